"""Warm start (the "cold start" of agentic RL recipes): supervised fine-tuning on the retrieval oracle's
trajectories, so that RL starts from a policy that follows the search/answer format.

    python experiments/warmstart.py --env SynthHop-v0 --model scratch --extra-worlds 4 --output outputs/warm/synthhop
    python experiments/warmstart.py --env HotpotQA-v0 --model smollm2-135m --questions 300 --output outputs/warm/hq
    python experiments/warmstart.py --env SynthBranch-v0 --extra-worlds 4 --misroute 0.8 --output outputs/warm/branch
    python experiments/run.py --env SynthHop-v0 --model outputs/warm/synthhop/model ...      # then RL from it

The oracle searches each hop's gold query (a question's supporting titles, in order) and answers with the gold
answer. Its steps are run through the env, so the observations are the real retrieved passages, and the
trajectory is laid out token for token as the RL rollouts are (chat-templated prompt, step ids, observation
ids, the end-of-turn token after the answer). The generated tokens are trained; the observations are masked, or
trained as language modelling at ``--observation-weight`` (a copying curriculum: a passage's title repeats the query
and its text the title, the skill a policy needs to name what it read).
``--model scratch`` is a small Llama (SmolLM2's tokenizer) trained from random weights; any ``run.py --model``
is fine-tuned. Deliberately weaker starts: ``--unanswered`` (never answers), ``--premature`` (answers a hop
short), ``--misroute`` (SynthBranch-v0: follows the other person named by the first search, so the start policy
copies names well and routes wrong that often). Writes OUTPUT/model (a directory ``--model`` accepts) and
OUTPUT/warmstart.json (settings, loss curve, greedy dev EM before and after).
The schedule is a warm-up, then a cosine from ``--lr`` down to ``--lr-floor`` (a fraction of it) over ``--epochs``;
with ``--check-questions N`` the start then answers N held-out one-search questions of the first extra world (unseen
questions about trained entities) greedily, and trains on at ``--extra-lr``, at most ``--extra-epochs`` more epochs,
while fewer than ``--check-em`` of them come out right: when a start has learnt its names by a fixed epoch depends on
the seed and the last bits of the sums. With ``--check-one-hop-short S`` the check asks the held-out multi-hop
questions instead, and training goes on while fewer than S of them are answered one hop short (a stage that is to
tip the start to answering after the first search, which some seeds resist). The checks are in
OUTPUT/warmstart.json beside the loss per epoch.
The training state is saved to OUTPUT/checkpoint.pt after every epoch: the same command after a kill resumes
there and ends as an uninterrupted run would (the file is removed once the model is saved).
``cached_warm_start`` trains a recipe once per generated world and caches it: the CPU demo's start policy and the
benchmarks' testbeds.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path

import gymnasium as gym
import numpy as np
import torch

import envs
from algos.evaluation import ANSWERED_EARLY, failure_kind
from envs.cache import WARM_START_LOCK, WARM_START_RECIPE, WARM_START_STAGING, WARM_STARTS_DIR, default_cache_dir
from envs.datasets import resolve_data_dir
from envs.synthetic import BRANCH_ROLES, SPECS, TEMPLATES, BranchSpec, WorldSpec, question_path, world_data_dir
from experiments.evaluate import chains_in_batches, evaluate_env
from experiments.oracle_trajectories import (
    ORACLE_FORMAT,
    misrouted_questions,
    oracle_data_dirs,
    oracle_trajectory,
    premature_questions,
    train_branch_questions,
)
from experiments.sft import SoftmaxVocabulary, TokenWeights, train
from policies.generation import SamplingSettings, end_of_turn_ids
from policies.generators import step_generator

MAX_KEY_LENGTH = 200  # a warm start's cache key, in characters (``warm_start_key``)


def build_model(args: argparse.Namespace):
    """(model, tokenizer): a fresh small Llama for ``scratch``, else ``load_model(--model)``."""
    from policies.models import build_tiny_random, load_model

    if args.model != "scratch":
        return load_model(args.model, seed=args.seed)
    _, tokenizer = load_model("tiny-random")
    model = build_tiny_random(tokenizer, seed=args.seed, hidden_size=args.hidden_size, layers=args.layers,
                              heads=args.heads)
    return model, tokenizer


def dev_em(model, tokenizer, args: argparse.Namespace, env_kwargs: dict, questions: int) -> dict[str, float]:
    """Greedy results (means) on the first ``questions`` of the evaluation split of the env ``env_kwargs`` serve."""
    from algos.evaluation import mean_results

    generator = step_generator("hf", model, tokenizer,
                               SamplingSettings(greedy=True, max_step_tokens=args.max_step_tokens))
    rows = evaluate_env(args.env, generator, tokenizer, split=envs.eval_split(args.env), limit=questions,
                        batch_size=32, env_kwargs=env_kwargs)
    return mean_results(rows)


def greedy_results(model, tokenizer, args: argparse.Namespace, env: gym.Env, questions: Sequence[int]) -> list[dict]:
    """Greedy results on the questions at positions ``questions`` of ``env``'s split, 32 at a time."""
    generator = step_generator("hf", model, tokenizer,
                               SamplingSettings(greedy=True, max_step_tokens=args.max_step_tokens))
    return chains_in_batches(env, generator, tokenizer, questions, batch_size=32)


def warm_start_key(readable: str, limit: int = MAX_KEY_LENGTH) -> str:
    """A warm start's cache key: ``readable`` (the world, top-k and recipe), or where that is longer than ``limit``
    (file names end at 255 bytes, with the lock's and staging's suffixes), its start and a hash of the whole."""
    if len(readable) <= limit:
        return readable
    digest = hashlib.sha256(readable.encode()).hexdigest()[:16]
    return f"{readable[:limit - len(digest) - 1]}-{digest}"


def readable_warm_start_key(world: WorldSpec | BranchSpec, recipe: Sequence[str], *, topk: int,
                      continues: Sequence[str] | None = None) -> str:
    """The whole key of ``cached_warm_start``'s warm start (the world, top-k, the oracle's format and each stage's
    options), before ``warm_start_key`` shortens a long one."""
    stages = [recipe]
    if continues is not None:
        if "--model" in recipe:
            raise ValueError(f"a recipe that continues another takes that one's model, not its own --model: {recipe}")
        stages = [continues, recipe]
    # the first format is left out of the key, so starts cached before it was versioned keep theirs
    oracle = "" if ORACLE_FORMAT == 1 else f"oracle-format-{ORACLE_FORMAT}-"
    return f"{world.key}-topk{topk}-{oracle}" + "-then-".join("-".join(stage).replace("--", "") for stage in stages)


def warm_start_dir(world: WorldSpec | BranchSpec, recipe: Sequence[str], *, topk: int,
                   cache_dir: str | os.PathLike | None = None, continues: Sequence[str] | None = None) -> Path:
    """Where ``cached_warm_start`` keeps that warm start's model directory (nothing trained: it may not exist)."""
    key = warm_start_key(readable_warm_start_key(world, recipe, topk=topk, continues=continues))
    return Path(cache_dir or default_cache_dir()) / WARM_STARTS_DIR / key / "model"


def cached_warm_start(world: WorldSpec | BranchSpec, recipe: Sequence[str], *, topk: int,
                      cache_dir: str | os.PathLike | None = None, continues: Sequence[str] | None = None) -> Path:
    """The model directory of the warm start of ``recipe`` (this script's options: model, extra worlds, epochs,
    strategy shares, seed...) on ``world``'s generated world with ``topk`` passages per search, trained once per
    (world, topk, the oracle's ``ORACLE_FORMAT``, recipe) into the cache (``$TREEGRPO_CACHE_DIR``, default
    ``~/.cache/tree-grpo``) and reused after: the demo's start policy and the benchmarks' testbeds. One process
    trains a recipe at a time (a lock file; the others wait, then find it cached) in a staging directory published
    whole when done; a killed training leaves its staging directory and checkpoint, and the next call resumes it.

    With ``continues`` (another recipe), ``recipe`` trains on from that recipe's cached warm start (trained first if
    missing) instead of its own ``--model``: a start in stages, cached under both recipes. A cached later stage is
    returned without the earlier one (its key names the earlier recipe, not its path), so a cache that holds only the
    last stage, as ``benchmarks/device_kit.py --learn`` packs the demo's for a GPU machine, trains nothing."""
    cache_dir = Path(cache_dir or default_cache_dir())
    readable = readable_warm_start_key(world, recipe, topk=topk, continues=continues)
    key = warm_start_key(readable)
    model = cache_dir / WARM_STARTS_DIR / key / "model"
    model.parent.parent.mkdir(parents=True, exist_ok=True)
    with open(model.parent.parent / f"{key}{WARM_START_LOCK}", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also when the process dies
        if (model / "config.json").exists():
            print(f"warm start: cached at {model}")
            return model
        start = [] if continues is None else ["--model", str(cached_warm_start(world, continues, topk=topk,
                                                                             cache_dir=cache_dir))]
        staging = model.parent.parent / f"{key}{WARM_START_STAGING}"
        print(f"warm start: training the start policy (once; cached at {model}; staged in {staging}) ...",
              flush=True)
        env_id = next(env_id for env_id, (dataset, *_) in envs.ENV_IDS.items() if dataset == world.DATASET)
        main(["--env", env_id, "--data-dir", str(world_data_dir(world, cache_dir)), "--topk", str(topk),
              "--dev-questions", "0", *recipe, *start, "--cache-dir", str(cache_dir), "--output", str(staging)])
        (staging / WARM_START_RECIPE).write_text(readable + "\n", encoding="utf-8")
        os.replace(staging, model.parent)
    print(f"warm start: moved into the cache: {model} (use --model {model})")
    return model


def claim_output(output: Path, args: argparse.Namespace) -> tuple[Path, Path]:
    """The training checkpoint in ``output`` and the file recording the settings it was written with; a checkpoint
    left by other settings is refused (resuming it would train a mixture), naming both."""
    checkpoint, settings = output / "checkpoint.pt", output / "checkpoint_settings.json"
    wanted = {k: v for k, v in vars(args).items() if k not in ("output", "max_minutes", "dev_questions")}
    if checkpoint.exists():
        found = json.loads(settings.read_text(encoding="utf-8")) if settings.exists() else None
        if found != wanted:
            raise SystemExit(f"{checkpoint} was written by other settings ({found}, now {wanted}): remove it "
                             f"to train afresh, or pass --output elsewhere")
    output.mkdir(parents=True, exist_ok=True)
    settings.write_text(json.dumps(wanted, indent=1), encoding="utf-8")
    return checkpoint, settings


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    if args.questions is not None and args.questions < 1:
        p.error(f"--questions must be >= 1, got {args.questions}")
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


def main(argv: list[str] | None = None) -> Path:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    output = Path(args.output)
    checkpoint, settings = claim_output(output, args)
    env_kwargs = {"data_dir": str(resolve_data_dir(args.data_dir).resolve()), "max_turns": args.max_turns,
                  "topk": args.topk}
    model, tokenizer = build_model(args)
    end_of_turn = min(end_of_turn_ids(tokenizer, model))
    data = []
    for data_dir in oracle_data_dirs(args, env_kwargs):
        env = gym.make(args.env, **{**env_kwargs, "data_dir": str(data_dir)})
        count = min(args.questions or len(env.unwrapped.records), len(env.unwrapped.records))
        order = np.random.default_rng(args.seed).permutation(count).tolist()
        unanswered = set(order[: round(args.unanswered * count)])
        # drawn from the other end of the permutation, so the two kinds overlap only when their shares sum past 1
        paths = [question_path(record.question) for record in env.unwrapped.records[:count]]
        multi_hop = ([len(record.supporting_titles) > 1 for record in env.unwrapped.records[:count]]
                     if args.premature_among == "multi-hop" else None)
        premature = premature_questions(order, args.premature, paths, template_shares(args.premature_template),
                                        multi_hop)
        # a draw of its own: a misrouted trajectory may also be unanswered or premature, as the shares say
        questions = train_branch_questions(env, data_dir)[:count] if args.misroute or args.restate_goal else []
        misrouted = misrouted_questions(questions, args.misroute, args.misroute_role, args.seed)
        data += [oracle_trajectory(env, tokenizer, i, args.max_turns, end_of_turn, answer=i not in unanswered,
                                   premature=i in premature, route=questions[i].decoy if i in misrouted else None,
                                   restate=args.restate, goal_role=questions[i].role if args.restate_goal else None)
                 for i in range(count)]
        env.close()
    tokens = sum(len(ids) for ids, _ in data)
    print(f"{len(data)} oracle trajectories, {tokens} tokens ({sum(sum(m) for _, m in data)} generated); "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters")
    before = dev_em(model, tokenizer, args, env_kwargs, args.dev_questions) if args.dev_questions else None
    if before is not None:
        print(f"dev before: EM {before['em']:.3f}, reward {before['reward']:.3f}, answer rate "
              f"{before['answered']:.2f}")
    check = None
    if args.check_questions:
        check_dir = oracle_data_dirs(args, env_kwargs)[1]  # the first extra world (parse_args asks for one)
        check_env = gym.make(args.env, **{**env_kwargs, "data_dir": str(check_dir)}, split=envs.eval_split(args.env))
        short = args.check_one_hop_short is not None
        records = check_env.unwrapped.records
        check_questions = [i for i, record in enumerate(records)
                           if (len(record.supporting_titles) > 1) == short][:args.check_questions]
        if not check_questions:
            raise SystemExit(f"--check-questions: the held-out split of {check_dir} has no question that needs "
                             f"{'more than one search' if short else 'one search'}: nothing to check")

        def check() -> float:
            rows = greedy_results(model, tokenizer, args, check_env, check_questions)
            if short:
                return float(np.mean([failure_kind({**row, "hops": len(records[i].supporting_titles)}) == ANSWERED_EARLY
                                      for i, row in zip(check_questions, rows, strict=True)]))
            return float(np.mean([row["em"] for row in rows]))

    token_weights = TokenWeights(args.observation_weight, args.observation_share)
    vocabulary = None
    if args.softmax_vocabulary == "data":
        vocabulary = SoftmaxVocabulary.of(data, model.get_output_embeddings().weight.shape[0],
                                          args.softmax_negatives)
        print(f"the loss's softmax over the {len(vocabulary.ids)} tokens the data holds (of {len(vocabulary.index)})"
              f" and {args.softmax_negatives} drawn from the others per step")
    curve = train(model, data, epochs=args.epochs, lr=args.lr, batch_size=args.batch_size, seed=args.seed,
                  pad_id=tokenizer.pad_token_id, token_weights=token_weights, max_minutes=args.max_minutes,
                  checkpoint=checkpoint, lr_floor=args.lr_floor, check=check,
                  check_min=args.check_em if args.check_one_hop_short is None else args.check_one_hop_short,
                  extra_epochs=args.extra_epochs, extra_lr=args.extra_lr, vocabulary=vocabulary)
    if args.check_questions:
        check_env.close()
    after = dev_em(model, tokenizer, args, env_kwargs, args.dev_questions) if args.dev_questions else None
    if after is not None:
        print(f"dev after: EM {after['em']:.3f}, reward {after['reward']:.3f}, answer rate {after['answered']:.2f}, "
              f"tool calls {after['tool_calls']:.2f}")
    model.save_pretrained(output / "model")
    tokenizer.save_pretrained(output / "model")
    summary = {"settings": vars(args), "trajectories": len(data), "tokens": tokens, "loss_per_epoch": curve["loss"],
               "check_per_epoch": curve["check"],
               "dev_before": before, "dev_after": after}
    (output / "warmstart.json").write_text(json.dumps(summary, indent=1), encoding="utf-8")
    checkpoint.unlink(missing_ok=True)  # the model is saved: the optimizer's state is not worth its disk
    settings.unlink(missing_ok=True)
    return output / "model"


if __name__ == "__main__":
    # printed here, not in main: cached_warm_start trains in a staging directory and names the final one itself
    trained = main()
    print(f"model: {trained} (use --model {trained})")
