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
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

import gymnasium as gym
import numpy as np
import torch

import envs
from algos.evaluation import ANSWERED_EARLY, failure_kind
from envs.cache import WARM_START_LOCK, WARM_START_RECIPE, WARM_START_STAGING, WARM_STARTS_DIR, default_cache_dir
from envs.datasets import MissingDataError, resolve_data_dir, train_and_corpus_digest
from envs.synthetic import SPECS, BranchSpec, WorldSpec, question_path, world_data_dir
from experiments.evaluate import chains_in_batches, evaluate_env
from experiments.model_manifest import damage, write_manifest
from experiments.oracle_trajectories import (
    ORACLE_FORMAT,
    misrouted_questions,
    oracle_data_dirs,
    oracle_trajectory,
    premature_questions,
    train_branch_questions,
)
from experiments.sft import SoftmaxVocabulary, TokenWeights, train
from experiments.warmstart_options import (
    ADDED_SINCE_KEYED,
    KEYED_DEFAULTS,
    NOT_TRAINING,
    defaults_digest,
    parse_args,
    template_shares,
)
from policies.generation import SamplingSettings, end_of_turn_ids
from policies.generators import step_generator
from policies.models import LORA_TARGETS, LoraSettings

CHECKPOINT_MINUTES = 5.0  # within an epoch, the training state is saved this often (a pretrained model's epoch is long)
MAX_KEY_LENGTH = 200  # a warm start's cache key, in characters (``warm_start_key``)
SUMMARY_FILE = "warmstart.json"  # a finished start's settings, loss curve and dev EM, written last
CHECKPOINT_FILE = "checkpoint.pt"  # the training state while a start trains (removed once it is saved)


@runtime_checkable
class DataSource(Protocol):
    """A dataset on disk that a warm start trains on, as a generated world is (``experiments/qa_start.QASource``):
    its ``DATASET`` name, the cache ``key`` of its content and its ``data_dir``."""

    DATASET: str
    data_dir: Path

    @property
    def key(self) -> str: ...


def build_model(args: argparse.Namespace):
    """(model, tokenizer): a fresh small Llama for ``scratch``, else ``load_model(--model)``."""
    from policies.models import build_tiny_random, load_model

    if args.model != "scratch":
        lora = None if args.lora_rank is None else LoraSettings(
            rank=args.lora_rank, alpha=2 * args.lora_rank, target_modules=LORA_TARGETS[args.lora_targets],
            layers=args.lora_layers)
        model, tokenizer = load_model(args.model, seed=args.seed, lora=lora)
        if not tokenizer.chat_template:
            raise SystemExit(f"--model {args.model} has no chat template: the warm start lays its trajectories out "
                             f"as the rollouts prompt an instruct model (the question in a chat turn); use an "
                             f"instruct model, or give the tokenizer a chat_template")
        return model, tokenizer
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


def minutes_on_this_cpu(minutes: dict[str, int], capability: str | None = None) -> int:
    """About how long a build takes on 2 cores of this CPU, from ``minutes`` measured by the CPU's widest vector unit
    as torch dispatches to it (``capability``: torch's, this machine's by default); the slowest figure where this
    unit has not been measured."""
    return minutes.get(capability or torch.backends.cpu.get_cpu_capability(), max(minutes.values()))


def warm_start_key(readable: str, limit: int = MAX_KEY_LENGTH) -> str:
    """A warm start's cache key: ``readable`` (the world, top-k and recipe), or where that is longer than ``limit``
    (file names end at 255 bytes, with the lock's and staging's suffixes), its start and a hash of the whole."""
    if len(readable) <= limit:
        return readable
    digest = hashlib.sha256(readable.encode()).hexdigest()[:16]
    return f"{readable[:limit - len(digest) - 1]}-{digest}"


def readable_warm_start_key(world: WorldSpec | BranchSpec | DataSource, recipe: Sequence[str], *, topk: int,
                      continues: Sequence[str] | None = None) -> str:
    """The whole key of ``cached_warm_start``'s warm start (the world, top-k, the oracle's format, the digest of the
    options' defaults where they changed, and each stage's options), before ``warm_start_key`` shortens a long one."""
    stages = [recipe]
    if continues is not None:
        if "--model" in recipe:
            raise ValueError(f"a recipe that continues another takes that one's model, not its own --model: {recipe}")
        stages = [continues, recipe]
    # the first format is left out of the key, so starts cached before it was versioned keep theirs; so are the
    # options' defaults while they are those of KEYED_DEFAULTS
    oracle = "" if ORACLE_FORMAT == 1 else f"oracle-format-{ORACLE_FORMAT}-"
    digest = defaults_digest()
    defaults = "" if digest == KEYED_DEFAULTS else f"defaults-{digest}-"
    return (f"{world.key}-topk{topk}-{oracle}{defaults}"
            + "-then-".join("-".join(stage).replace("--", "") for stage in stages))


def warm_start_dir(world: WorldSpec | BranchSpec | DataSource, recipe: Sequence[str], *, topk: int,
                   cache_dir: str | os.PathLike | None = None, continues: Sequence[str] | None = None) -> Path:
    """Where ``cached_warm_start`` keeps that warm start's model directory (nothing trained: it may not exist)."""
    key = warm_start_key(readable_warm_start_key(world, recipe, topk=topk, continues=continues))
    return Path(cache_dir or default_cache_dir()) / WARM_STARTS_DIR / key / "model"


def cached_warm_start(world: WorldSpec | BranchSpec | DataSource, recipe: Sequence[str], *, topk: int,
                      cache_dir: str | os.PathLike | None = None, continues: Sequence[str] | None = None) -> Path:
    """The model directory of the warm start of ``recipe`` (this script's options: model, extra worlds, epochs,
    strategy shares, seed...) on ``world``'s generated world with ``topk`` passages per search, trained once per
    (world, topk, the oracle's ``ORACLE_FORMAT``, recipe, the defaults of the options it does not
    name) into the cache (``$TREEGRPO_CACHE_DIR``, default
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
    # a start is published whole (os.replace), so finding one needs no lock: a cache the user may only read serves
    if (model / "config.json").exists() and damage(model) is None:
        print(f"warm start: cached at {model}")
        return model
    model.parent.parent.mkdir(parents=True, exist_ok=True)
    with open(model.parent.parent / f"{key}{WARM_START_LOCK}", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also when the process dies
        if (model / "config.json").exists():  # published by another process while this one waited, or damaged
            problem = damage(model)
            if problem is None:
                print(f"warm start: cached at {model}")
                return model
            print(f"warm start: the cached start at {model} is damaged ({problem}): training it again", flush=True)
            shutil.rmtree(model.parent)
        start = [] if continues is None else ["--model", str(cached_warm_start(world, continues, topk=topk,
                                                                             cache_dir=cache_dir))]
        staging = model.parent.parent / f"{key}{WARM_START_STAGING}"
        print(f"warm start: training the start policy (once; cached at {model}; staged in {staging}) ...",
              flush=True)
        env_id = next(env_id for env_id, (dataset, *_) in envs.ENV_IDS.items() if dataset == world.DATASET)
        # a real QA set's source (experiments/qa_start.py) names its data directory; a generated world is written
        data_dir = world.data_dir if isinstance(world, DataSource) else world_data_dir(world, cache_dir)
        if not finished(staging):  # else trained to its end by a process killed before publishing it
            main(["--env", env_id, "--data-dir", str(data_dir), "--topk", str(topk),
                  "--dev-questions", "0", *recipe, *start, "--cache-dir", str(cache_dir), "--output", str(staging)])
        (staging / WARM_START_RECIPE).write_text(readable + "\n", encoding="utf-8")
        write_manifest(staging / model.name)
        os.replace(staging, model.parent)
    print(f"warm start: moved into the cache: {model} (use --model {model})")
    return model


def trained_data(args: argparse.Namespace) -> str:
    """The data ``args`` trains on: a real QA set by content (``train_and_corpus_digest``: a killed build resumes
    from its data moved or copied elsewhere), a generated world by its directory (written from its spec); by path
    where a file is missing (``training_data`` then names it)."""
    dataset = envs.ENV_IDS[args.env][0]
    if dataset in SPECS:
        return str(args.data_dir)
    try:
        return train_and_corpus_digest(dataset, args.data_dir)
    except MissingDataError:
        return str(args.data_dir)


def finished(output: Path) -> bool:
    """Whether ``output`` holds a start trained to its end (its summary is written after the model, and the training
    checkpoint removed after both)."""
    return (output / SUMMARY_FILE).exists() and not (output / CHECKPOINT_FILE).exists()


def claim_output(output: Path, args: argparse.Namespace) -> tuple[Path, Path]:
    """The training checkpoint in ``output`` and the file recording the settings it was written with; a checkpoint
    left by other settings is refused (resuming it would train a mixture), naming both, and so is a finished start
    (its model would be replaced)."""
    checkpoint, settings = output / CHECKPOINT_FILE, output / "checkpoint_settings.json"
    wanted = {k: v for k, v in vars(args).items() if k not in NOT_TRAINING}
    wanted["data_dir"] = trained_data(args)
    if finished(output):
        raise SystemExit(f"{output} holds a finished warm start ({SUMMARY_FILE}, model/): pass --output elsewhere, "
                         f"or remove it to train afresh")
    if checkpoint.exists():
        found = json.loads(settings.read_text(encoding="utf-8")) if settings.exists() else None
        if found is not None:  # written before an option existed: trained at its neutral default
            found = {**{k: v for k, v in ADDED_SINCE_KEYED.items() if k in wanted}, **found}
        if found != wanted:
            raise SystemExit(f"{checkpoint} was written by other settings ({found}, now {wanted}): remove it "
                             f"to train afresh, or pass --output elsewhere")
    output.mkdir(parents=True, exist_ok=True)
    settings.write_text(json.dumps(wanted, indent=1), encoding="utf-8")
    return checkpoint, settings


def training_data(args: argparse.Namespace, env_kwargs: dict, tokenizer,
                  end_of_turn: int) -> list[tuple[list[int], list[int]]]:
    """The oracle's trajectories of the train split of every data directory trained on (``oracle_data_dirs``): never
    a question of the evaluation split (an env whose data has no train split is an error naming the file it needs).
    With ``--require-gold`` the questions whose supporting passages do not all come back are skipped, and counted;
    with ``--read``, those whose queries or answer no passage read before names."""
    data, skipped = [], 0
    for data_dir in oracle_data_dirs(args, env_kwargs):
        try:
            env = gym.make(args.env, **{**env_kwargs, "data_dir": str(data_dir)}, split="train")
        except MissingDataError as error:
            raise SystemExit(f"the warm start trains on {args.env}'s train split, which is missing: {error}") from None
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
        trajectories = [
            oracle_trajectory(env, tokenizer, i, args.max_turns, end_of_turn, answer=i not in unanswered,
                              premature=i in premature, route=questions[i].decoy if i in misrouted else None,
                              restate=args.restate, goal_role=questions[i].role if args.restate_goal else None,
                              cite=args.cite, require_gold=args.require_gold, read=args.read)
            for i in range(count)]
        skipped += sum(trajectory is None for trajectory in trajectories)
        data += [trajectory for trajectory in trajectories if trajectory is not None]
        env.close()
    reasons = [*(["a supporting title's passage did not come back for its own title (the corpus lacks it, or ranks "
                  f"it below the top {args.topk})"] if args.require_gold else []),
               *(["a query or the answer is named neither in the question nor in a passage read before it"]
                 if args.read else [])]
    if reasons:
        print(f"{skipped} of {skipped + len(data)} questions skipped: {'; or '.join(reasons)}")
    return data


def main(argv: list[str] | None = None) -> Path:
    args = parse_args(argv, description=__doc__)
    torch.manual_seed(args.seed)
    output = Path(args.output)
    checkpoint, settings = claim_output(output, args)
    env_kwargs = {"data_dir": str(resolve_data_dir(args.data_dir).resolve()), "max_turns": args.max_turns,
                  "topk": args.topk, "passage_words": args.passage_words}
    model, tokenizer = build_model(args)
    end_of_turn = min(end_of_turn_ids(tokenizer, model))
    data = training_data(args, env_kwargs, tokenizer, end_of_turn)
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
                  extra_epochs=args.extra_epochs, extra_lr=args.extra_lr, vocabulary=vocabulary,
                  checkpoint_minutes=CHECKPOINT_MINUTES, replay_bottom=args.replay_bottom)
    if args.check_questions:
        check_env.close()
    after = dev_em(model, tokenizer, args, env_kwargs, args.dev_questions) if args.dev_questions else None
    if after is not None:
        print(f"dev after: EM {after['em']:.3f}, reward {after['reward']:.3f}, answer rate {after['answered']:.2f}, "
              f"tool calls {after['tool_calls']:.2f}")
    if args.lora_rank is not None:
        model = model.merge_and_unload()  # a plain model: run.py's --model, and its own LoRA on top
    model.save_pretrained(output / "model")
    tokenizer.save_pretrained(output / "model")
    summary = {"settings": vars(args), "trajectories": len(data), "tokens": tokens, "loss_per_epoch": curve["loss"],
               "check_per_epoch": curve["check"],
               "dev_before": before, "dev_after": after}
    (output / SUMMARY_FILE).write_text(json.dumps(summary, indent=1), encoding="utf-8")
    checkpoint.unlink(missing_ok=True)  # the model is saved: the optimizer's state is not worth its disk
    settings.unlink(missing_ok=True)
    return output / "model"


if __name__ == "__main__":
    # printed here, not in main: cached_warm_start trains in a staging directory and names the final one itself
    trained = main()
    print(f"model: {trained} (use --model {trained})")
