"""The warm start's command line (``experiments/warmstart.py``): its options, each checked with an error that names
it, and ``--premature-template``'s values."""

from __future__ import annotations

import argparse
import hashlib
import json
from collections.abc import Sequence

import envs
from envs.synthetic import BRANCH_ROLES, SPECS, TEMPLATES
from policies.models import LORA_TARGETS

# The options that say where a build writes and how long it may run, not what it trains
NOT_TRAINING = ("output", "max_minutes", "dev_questions")
LOCATIONS = ("cache_dir", "data_dir")  # where the data is read from: its content is keyed by the world or the source
# The digest of the options' defaults (``defaults_digest``) when a warm start's key began to hold it: a key names its
# recipe's options, so a changed default would otherwise rebuild nothing and reuse a start trained another way
KEYED_DEFAULTS = "6a29d8e650c9"
# Options added since, at the default that trains as before they existed: left out of the digest while at it, so the
# keys of the starts cached before them (and the records that name those starts' paths) stay as they were
ADDED_SINCE_KEYED = {"replay_bottom": False}


def defaults_digest() -> str:
    """A digest of every training option's default (not ``NOT_TRAINING``'s nor ``LOCATIONS``', nor those of
    ``ADDED_SINCE_KEYED`` at their neutral default)."""
    defaults = {name: value for name, value in vars(parse_args([])).items()
                if name not in NOT_TRAINING + LOCATIONS and ADDED_SINCE_KEYED.get(name, object()) != value}
    return hashlib.sha256(json.dumps(defaults, sort_keys=True).encode()).hexdigest()[:12]


def parse_args(argv: list[str] | None = None, description: str | None = None) -> argparse.Namespace:
    """``experiments/warmstart.py``'s options (``description``: its ``--help`` text), checked."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--env", choices=list(envs.ENV_IDS), default="SynthHop-v0")
    p.add_argument("--model", default="scratch", help="scratch (a small Llama from random weights) or a "
                                                      "run.py --model to fine-tune")
    p.add_argument("--hidden-size", type=int, default=192, help="--model scratch: width")
    p.add_argument("--layers", type=int, default=3, help="--model scratch: depth")
    p.add_argument("--heads", type=int, default=6, help="--model scratch: attention heads")
    p.add_argument("--questions", type=int, default=None, help="oracle trajectories (default: the whole split)")
    p.add_argument("--extra-worlds", type=int, default=0,
                   help="SynthHop-v0, SynthBranch-v0: also train on the train questions of this many other worlds "
                        "(the same sizes, other seeds), whose names differ, so the model must learn to copy names "
                        "from the question and the passages instead of memorising them")
    p.add_argument("--unanswered", type=float, default=0.0,
                   help="share of oracle trajectories that never answer (a deliberately weaker start)")
    p.add_argument("--premature", type=float, default=0.0,
                   help="share of oracle trajectories that answer after the first search with the entity it found, "
                        "where a question needs more than one (a start policy that sometimes stops one hop short); "
                        "of the multi-hop ones in expectation, or exactly with --premature-among multi-hop")
    p.add_argument("--premature-among", choices=("all", "multi-hop"), default="all",
                   help="the questions --premature is drawn among: all (1-hop ones have no hop to skip, so the share "
                        "of multi-hop trajectories answered short is --premature only in expectation, drawn by the "
                        "seed) or multi-hop (exactly that share of them)")
    p.add_argument("--premature-template", action="append", default=[], metavar="PATH=SHARE",
                   help="SynthHop-v0: the --premature share of one multi-hop question template's trajectories, the "
                        "template named by its relation path, e.g. born_in.country=0.8 (repeatable; the other "
                        "templates keep --premature): a start whose choice after the first search follows the "
                        "template, so that greedy decoding answers one hop short on some templates and searches again "
                        "on the others, whatever the seed, while sampling does both")
    p.add_argument("--misroute", type=float, default=0.0,
                   help="SynthBranch-v0: share of oracle trajectories that follow the wrong person after the first "
                        "search (the chair for a founder question, and the other way round) to a wrong answer in "
                        "the right format: a start policy that copies names well and routes wrong that often")
    p.add_argument("--misroute-role", choices=BRANCH_ROLES, default=None,
                   help="SynthBranch-v0: draw the --misroute share among the questions about this person only (with "
                        "--misroute 1: a start policy that always follows the other person on those questions, a "
                        "rule rather than a coin, and routes right on the rest)")
    p.add_argument("--observation-weight", type=float, default=0.0,
                   help="loss weight of the observations' tokens (language modelling on the retrieved passages: their "
                        "titles repeat the query and their text repeats the title, so predicting them trains copying; "
                        "0: the generated tokens only)")
    p.add_argument("--observation-share", type=float, default=1.0,
                   help="with --observation-weight: train a fresh random draw of this share of the observations' "
                        "tokens each epoch, at the weight divided by the share (the same expected loss; the LM "
                        "head's cost over the passages falls with the share)")
    p.add_argument("--softmax-vocabulary", choices=("full", "data"), default="full",
                   help="the tokens the loss's softmax runs over: the model's whole vocabulary, or the tokens the "
                        "training data holds (a few thousand of SmolLM2's 49k: the LM head's cost, most of a small "
                        "model's step, falls with it), with --softmax-negatives of the others")
    p.add_argument("--softmax-negatives", type=int, default=0,
                   help="with --softmax-vocabulary data: tokens drawn from the others each step into the softmax, each "
                        "standing for its share of them (a sampled softmax: it keeps their logits down, so that the "
                        "model does not sample them; 0: they get no gradient)")
    p.add_argument("--restate", action="store_true",
                   help="the oracle's thought before a search restates the passage's sentence that ends with the query "
                        "(\"The chair of X is Y\" before searching Y; SynthBranch's role passages), so the name "
                        "is copied as the continuation of words the passage holds")
    p.add_argument("--restate-goal", action="store_true",
                   help="SynthBranch: the oracle's thoughts carry the asked role from the question to the decision, "
                        "each copying the one before (\"I need the chair of the company Anna works for\", then \"... "
                        "I need the chair of Tosafen Works\"); a misrouted trajectory states it and follows the other")
    p.add_argument("--cite", action="store_true",
                   help="real questions: the oracle's thoughts before its later searches and its answer quote the "
                        "passage sentence that names the next query or the answer")
    p.add_argument("--require-gold", action="store_true",
                   help="skip (and count) the questions whose supporting passages do not all come back from the "
                        "corpus for their own titles")
    p.add_argument("--read", action="store_true",
                   help="real questions: the oracle searches the supporting titles the question names first and "
                        "writes each query as the question or a passage read before names it; questions where a "
                        "query or the answer is named nowhere before it are skipped (and counted)")
    p.add_argument("--passage-words", type=int, default=None, help="each passage cut to its first k words")
    p.add_argument("--lora-rank", type=int, default=None,
                   help="train LoRA adapters of this rank (alpha twice it), merged into the saved model (default: "
                        "full fine-tuning)")
    p.add_argument("--lora-layers", type=int, default=None, help="with --lora-rank: the top k layers only")
    p.add_argument("--lora-targets", choices=tuple(LORA_TARGETS), default="attention",
                   help="with --lora-rank: the projections adapted")
    p.add_argument("--epochs", type=int, default=6, help="epochs of the schedule (warm-up, cosine to --lr-floor)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (use ~1e-5 to fine-tune smollm2)")
    p.add_argument("--lr-floor", type=float, default=0.0,
                   help="the learning rate at the schedule's end and in any extra epoch, a fraction of --lr")
    p.add_argument("--check-questions", type=int, default=0,
                   help="generated worlds with --extra-worlds: after the schedule, greedy exact match on the first "
                        "this many held-out questions that need one search of the first extra world (questions no "
                        "trajectory trains, about entities the trajectories do: what the served world's held-out "
                        "questions ask, without reading them; the world's names, apart from the strategy the data "
                        "teaches), and up to --extra-epochs more epochs while it is below --check-em (0: no check)")
    p.add_argument("--check-em", type=float, default=0.0, help="the check's minimum exact match")
    p.add_argument("--check-one-hop-short", type=float, default=None, metavar="SHARE",
                   help="with --check-questions: the check asks that many held-out multi-hop questions instead, and "
                        "the extra epochs run while the share answered before their last hop is below SHARE (in "
                        "place of --check-em)")
    p.add_argument("--extra-epochs", type=int, default=0, help="at most this many epochs after --epochs")
    p.add_argument("--extra-lr", type=float, default=None,
                   help="the learning rate of the extra epochs, a fraction of --lr (default: --lr-floor); above the "
                        "floor, they go on learning what the schedule had not taught by its end")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--replay-bottom", action="store_true",
                   help="with LoRA on the top layers: each row's frozen bottom computed in its first epoch only and "
                        "replayed after (the same training to float rounding, not to the bit; a resumed build "
                        "records it again)")
    p.add_argument("--max-minutes", type=float, default=None, help="stop after the epoch that passes this")
    p.add_argument("--max-turns", type=int, default=3)
    p.add_argument("--topk", type=int, default=3)
    p.add_argument("--max-step-tokens", type=int, default=64, help="step cap of the dev evaluation")
    p.add_argument("--dev-questions", type=int, default=100,
                   help="greedy dev questions evaluated before and after (0: no dev evaluation)")
    p.add_argument("--data-dir", default=None, help="default: $TREEGRPO_DATA_DIR, else ./data")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cache-dir", default=None, help="where generated worlds are written (default: the cache, "
                                                     "$TREEGRPO_CACHE_DIR, else ~/.cache/tree-grpo)")
    p.add_argument("--output", default="outputs/warmstart")
    args = p.parse_args(argv)
    if args.extra_worlds < 0:
        p.error(f"--extra-worlds must be >= 0, got {args.extra_worlds}")
    for name in ("unanswered", "premature", "misroute"):
        if not 0.0 <= getattr(args, name) <= 1.0:
            p.error(f"--{name} must be a share in [0, 1], got {getattr(args, name)}")
    if not 0.0 <= args.lr_floor <= 1.0:
        p.error(f"--lr-floor must be a fraction of --lr in [0, 1], got {args.lr_floor}")
    if args.extra_lr is not None and not 0.0 < args.extra_lr <= 1.0:
        p.error(f"--extra-lr must be a fraction of --lr in (0, 1], got {args.extra_lr}")
    if not 0.0 <= args.check_em <= 1.0:
        p.error(f"--check-em must be an exact match in [0, 1], got {args.check_em}")
    if args.check_one_hop_short is not None:
        if not 0.0 <= args.check_one_hop_short <= 1.0:
            p.error(f"--check-one-hop-short must be a share in [0, 1], got {args.check_one_hop_short}")
        if args.check_em:
            p.error("--check-one-hop-short replaces --check-em (the check scores one of them): give one")
        if not args.check_questions:
            p.error("--check-one-hop-short needs --check-questions (how many multi-hop questions it asks)")
    for name in ("check_questions", "extra_epochs", "softmax_negatives"):
        if getattr(args, name) < 0:
            p.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if not 0.0 < args.observation_share <= 1.0:
        p.error(f"--observation-share must be a share in (0, 1], got {args.observation_share}")
    if args.observation_weight < 0:
        p.error(f"--observation-weight must be >= 0, got {args.observation_weight}")
    for name in ("questions", "passage_words", "lora_rank", "lora_layers", "epochs", "batch_size", "max_turns", "topk",
                 "max_step_tokens", "hidden_size", "layers", "heads"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.dev_questions < 0:
        p.error(f"--dev-questions must be >= 0 (0: no dev evaluation), got {args.dev_questions}")
    if not args.lr > 0:
        p.error(f"--lr must be > 0, got {args.lr}")
    if args.max_minutes is not None and not args.max_minutes > 0:
        p.error(f"--max-minutes must be > 0 (leave it out for no limit), got {args.max_minutes}")
    if args.lora_layers is not None and args.lora_rank is None:
        p.error("--lora-layers needs --lora-rank (the adapters it places)")
    if args.replay_bottom and args.lora_layers is None:
        p.error("--replay-bottom needs --lora-layers (a frozen bottom below the adapted top layers to replay)")
    if args.lora_rank is not None and args.model == "scratch":
        p.error("--lora-rank adapts a pretrained --model; --model scratch trains every weight")
    if args.softmax_negatives and args.softmax_vocabulary != "data":
        p.error("--softmax-negatives needs --softmax-vocabulary data (the full softmax has no tokens left to draw)")
    synthetic = [env_id for env_id, (dataset, *_) in envs.ENV_IDS.items() if dataset in SPECS]
    if args.extra_worlds and args.env not in synthetic:
        p.error(f"--extra-worlds needs a generated world (--env {' or '.join(synthetic)}), got --env {args.env}")
    if args.check_questions and not args.extra_worlds:
        p.error("--check-questions needs --extra-worlds >= 1 (it asks the first extra world's held-out questions)")
    if args.extra_epochs and not args.check_questions:
        p.error("--extra-epochs needs --check-questions (the extra epochs run while the check fails)")
    if args.extra_lr is not None and not args.extra_epochs:
        p.error("--extra-lr needs --extra-epochs (it is their learning rate)")
    try:
        template_shares(args.premature_template)
    except ValueError as error:
        p.error(f"--premature-template: {error}")
    if args.premature_template and args.env != "SynthHop-v0":
        p.error(f"--premature-template needs --env SynthHop-v0 (the env whose questions TEMPLATES asks), got --env "
                f"{args.env}")
    if args.misroute_role and not args.misroute:
        p.error("--misroute-role needs --misroute (the share of those questions to misroute)")
    if args.misroute and args.env != "SynthBranch-v0":
        p.error(f"--misroute needs --env SynthBranch-v0 (the env with a wrong route to follow), got --env {args.env}")
    if args.restate_goal and args.env != "SynthBranch-v0":
        p.error(f"--restate-goal needs --env SynthBranch-v0 (the env whose questions ask a role), got --env {args.env}")
    return args


def template_shares(options: Sequence[str]) -> dict[tuple[str, ...], float]:
    """``--premature-template`` values (``PATH=SHARE``, PATH a multi-hop template's relations joined by dots) as
    relation path -> share; a malformed value, an unknown path, a share outside [0, 1] or a path given twice is a
    ValueError naming it."""
    known = {path for _, path, _ in TEMPLATES if len(path) > 1}
    shares: dict[tuple[str, ...], float] = {}
    for option in options:
        name, equals, value = option.partition("=")
        path = tuple(name.split("."))
        if not equals or path not in known:
            raise ValueError(f"{option!r} is not PATH=SHARE with PATH one of the multi-hop templates' relation paths "
                             f"{sorted('.'.join(known_path) for known_path in known)}")
        try:
            share = float(value)
        except ValueError:
            raise ValueError(f"{option!r}: the share {value!r} is not a number") from None
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"{option!r}: the share must be in [0, 1]")
        if path in shares:
            raise ValueError(f"{option!r}: the template {name} is given twice")
        shares[path] = share
    return shares
