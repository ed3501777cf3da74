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
The training state is saved to OUTPUT/checkpoint.pt after every epoch: the same command after a kill resumes
there and ends as an uninterrupted run would (the file is removed once the model is saved).
``cached_warm_start`` trains a recipe once per generated world and caches it: the CPU demo's start policy and the
benchmarks' testbeds.
"""

from __future__ import annotations

import argparse
import dataclasses
import fcntl
import functools
import json
import os
import time
from collections.abc import Sequence
from pathlib import Path

import gymnasium as gym
import numpy as np
import torch

import envs
from envs.cache import WARM_START_LOCK, WARM_START_STAGING, WARM_STARTS_DIR, default_cache_dir
from envs.datasets import resolve_data_dir
from envs.retrieval.corpus import replace_atomically
from envs.synthetic import (
    BRANCH_ROLES,
    SPECS,
    BranchSpec,
    SynthQuestion,
    WorldSpec,
    branch_questions,
    read_spec,
    world_data_dir,
    world_dir,
)
from experiments.baselines import OracleAgent, in_format
from experiments.evaluate import evaluate_env
from policies.generation import SamplingSettings, end_of_turn_ids, observation_ids, prompt_ids
from policies.generators import step_generator


def oracle_trajectory(env: gym.Env, tokenizer, index: int, max_searches: int, end_of_turn: int,
                      answer: bool = True, premature: bool = False, route: SynthQuestion | None = None,
                      restate: bool = False) -> tuple[list[int], list[int]]:
    """Question ``index``'s oracle trajectory: token ids and a 0/1 mask of the generated ones. With
    ``answer=False`` the oracle never answers: where it would, it repeats its last search until the episode
    ends unanswered. With ``premature=True`` a multi-hop question is answered after its first search, with the
    entity that search found (the second hop's bridge: a wrong answer in the right format). With ``route`` the
    oracle searches that route's chain and answers its answer instead of the gold ones (SynthBranch's wrong
    route, ``SynthQuestion.decoy``). With ``restate`` the thought before each search restates the sentence of the
    last passage that ends with the query (``OracleAgent``)."""
    prompt, _ = env.reset(options={"index": index})
    agent = OracleAgent(max_searches, restate=restate)
    record = env.unwrapped.record
    if route is not None:
        record = dataclasses.replace(record, supporting_titles=route.chain, answers=(route.answer,))
    if premature and len(record.supporting_titles) > 1:
        record = dataclasses.replace(record, supporting_titles=record.supporting_titles[:1],
                                     answers=(record.supporting_titles[1],))
    agent.start(prompt, record)
    ids = list(prompt_ids(tokenizer, prompt))
    generated = [0] * len(ids)
    observation, done, last_query = prompt, False, env.unwrapped.record.question
    while not done:
        text = agent.act(observation)
        if "<search>" in text:
            last_query = agent.pending
        elif not answer:
            text = in_format("I should check again", "search", last_query)
        step = tokenizer(text, add_special_tokens=False)["input_ids"]
        observation, _, terminated, truncated, _ = env.step(text)
        done = terminated or truncated
        if terminated:  # answered: as in the rollouts, the end-of-turn token follows </answer>
            step = [*step, end_of_turn]
        ids += step
        generated += [1] * len(step)
        if observation:
            obs = observation_ids(tokenizer, observation)
            ids += obs
            generated += [0] * len(obs)
    return ids, generated


def loss_weights(generated: Sequence[int], observation_weight: float) -> list[float]:
    """Per-token weights of the SFT loss: 1 on the generated tokens, ``observation_weight`` on the observations
    (every token after the first generated one that the policy did not generate), 0 on the prompt."""
    first = next((t for t, g in enumerate(generated) if g), len(generated))
    return [1.0 if g else observation_weight if t > first else 0.0 for t, g in enumerate(generated)]


def sft_loss(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the tokens with a positive weight, their weighted mean; the LM head runs on their
    positions only (the head of a small model with a 49k vocabulary costs more than the rest of it). With 0/1
    weights (the generated-token mask), the mean cross-entropy of the generated tokens."""
    hidden = model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    target_weights = weights[:, 1:].float()  # position t predicts token t + 1
    select = target_weights > 0
    logits = model.get_output_embeddings()(hidden[:, :-1][select]).float()
    losses = torch.nn.functional.cross_entropy(logits, input_ids[:, 1:][select], reduction="none")
    return (losses * target_weights[select]).sum() / target_weights[select].sum()


def pad(rows: Sequence[tuple[list[int], Sequence[float]]], pad_id: int) -> tuple[torch.Tensor, ...]:
    """(ids, attention mask, loss weights) of ``rows`` of (ids, per-token weights), right-padded."""
    width = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    weights = torch.zeros((len(rows), width), dtype=torch.float)
    for i, (row_ids, row_weights) in enumerate(rows):
        ids[i, :len(row_ids)] = torch.tensor(row_ids)
        attention[i, :len(row_ids)] = 1
        weights[i, :len(row_ids)] = torch.tensor(row_weights, dtype=torch.float)
    return ids, attention, weights


def train(model, data: list[tuple[list[int], Sequence[float]]], *, epochs: int, lr: float, batch_size: int, seed: int,
          pad_id: int, max_minutes: float | None = None, checkpoint: Path | None = None, log=print) -> list[float]:
    """AdamW over shuffled batches, linear warm-up then cosine decay; the mean loss of each epoch.

    With ``checkpoint``, the whole training state (weights, optimizer, schedule, shuffling and torch generators, loss
    curve) is written there after every epoch and, when the file exists, training resumes after its last epoch: a
    killed run continues where it stopped and ends as an uninterrupted one would. ``max_minutes`` counts this
    process's time only."""
    rng = np.random.default_rng(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    steps = epochs * -(-len(data) // batch_size)
    warmup = max(1, steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + np.cos(np.pi * min(s, steps) / steps)))
    curve: list[float] = []
    if checkpoint is not None and checkpoint.exists():
        state = torch.load(checkpoint, weights_only=False)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        schedule.load_state_dict(state["schedule"])
        rng.bit_generator.state = state["shuffle_rng"]
        torch.set_rng_state(state["torch_rng"])
        curve = state["curve"]
        log(f"resuming after epoch {len(curve)}/{epochs} from {checkpoint}")
    model.train()
    start = time.perf_counter()
    for epoch in range(len(curve), epochs):
        order = rng.permutation(len(data))
        batches = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
        losses = []
        for batch in batches:
            ids, attention, weights = pad([data[i] for i in batch], pad_id)
            loss = sft_loss(model, ids, attention, weights)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            losses.append(loss.item())
        curve.append(float(np.mean(losses)))
        log(f"epoch {epoch + 1}/{epochs}: loss {curve[-1]:.4f}  ({time.perf_counter() - start:.0f} s)")
        if checkpoint is not None:
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                     "schedule": schedule.state_dict(), "shuffle_rng": rng.bit_generator.state,
                     "torch_rng": torch.get_rng_state(), "curve": curve}
            replace_atomically(checkpoint, functools.partial(torch.save, state))  # a kill mid-write keeps the last
        if max_minutes is not None and time.perf_counter() - start > 60 * max_minutes:
            log(f"stopping: --max-minutes {max_minutes} reached")
            break
    model.eval()
    return curve


def build_model(args: argparse.Namespace):
    """(model, tokenizer): a fresh small Llama for ``scratch``, else ``load_model(--model)``."""
    from policies.models import build_tiny_random, load_model

    if args.model != "scratch":
        return load_model(args.model, seed=args.seed)
    _, tokenizer = load_model("tiny-random")
    model = build_tiny_random(tokenizer, seed=args.seed, hidden_size=args.hidden_size, layers=args.layers,
                              heads=args.heads)
    return model, tokenizer


def dev_em(model, tokenizer, args: argparse.Namespace, env_kwargs: dict) -> dict[str, float]:
    """Greedy dev results (means) on the first --dev-questions of the env's evaluation split."""
    from algos.evaluation import mean_results

    generator = step_generator("hf", model, tokenizer,
                               SamplingSettings(greedy=True, max_step_tokens=args.max_step_tokens))
    rows = evaluate_env(args.env, generator, tokenizer, split=envs.eval_split(args.env), limit=args.dev_questions,
                        batch_size=32, env_kwargs=env_kwargs)
    return mean_results(rows)


def oracle_data_dirs(args: argparse.Namespace, env_kwargs: dict) -> list[Path]:
    """The data directories whose train questions are trained: ``--env``'s (for a generated world, the world it
    serves: the data directory's, else the default one), then ``--extra-worlds`` worlds shaped like it with the
    seeds that follow its seed (written to the cache)."""
    dataset = envs.ENV_IDS[args.env][0]
    if dataset not in SPECS:
        return [Path(env_kwargs["data_dir"])]
    served = world_dir(dataset, data_dir=env_kwargs["data_dir"])
    spec = read_spec(dataset, served)
    return [served, *(world_data_dir(dataclasses.replace(spec, seed=spec.seed + k))
                      for k in range(1, args.extra_worlds + 1))]


def train_branch_questions(env: gym.Env, data_dir: Path) -> list[SynthQuestion]:
    """The train questions of a SynthBranch env serving ``data_dir``, in its order, each with its wrong route
    (``decoy``: the other person's) and the role it asks about."""
    return branch_questions(data_dir, "train", [r.question for r in env.unwrapped.records])


def misrouted_questions(questions: Sequence[SynthQuestion], share: float, role: str | None,
                        seed: int) -> set[int]:
    """The positions of ``questions`` whose oracle follows the wrong person: ``share`` of them, drawn at random
    (``seed``) among those asking about ``role`` (every question without one)."""
    eligible = [i for i, q in enumerate(questions) if role is None or q.role == role]
    order = np.random.default_rng([seed, 1]).permutation(len(eligible))
    return {eligible[i] for i in order[: round(share * len(eligible))]}


def cached_warm_start(world: WorldSpec | BranchSpec, recipe: Sequence[str], *, topk: int,
                      cache_dir: str | os.PathLike | None = None, continues: Sequence[str] | None = None) -> Path:
    """The model directory of the warm start of ``recipe`` (this script's options: model, extra worlds, epochs,
    strategy shares, seed...) on ``world``'s generated world with ``topk`` passages per search, trained once per
    (world, topk, recipe) into the cache (``$TREEGRPO_CACHE_DIR``, default ``~/.cache/tree-grpo``) and reused
    after: the demo's start policy and the benchmarks' testbeds. One process trains a recipe at a time (a lock
    file; the others wait, then find it cached) in a staging directory published whole when done; a killed training
    leaves its staging directory and checkpoint, and the next call resumes it.

    With ``continues`` (another recipe), ``recipe`` trains on from that recipe's cached warm start (trained first if
    missing) instead of its own ``--model``: a start in stages, cached under both recipes."""
    cache_dir = Path(cache_dir or default_cache_dir())
    start: list[str] = []
    stages = [recipe]
    if continues is not None:
        if "--model" in recipe:
            raise ValueError(f"a recipe that continues another takes that one's model, not its own --model: {recipe}")
        start = ["--model", str(cached_warm_start(world, continues, topk=topk, cache_dir=cache_dir))]
        stages = [continues, recipe]
    key = f"{world.key}-topk{topk}-" + "-then-".join("-".join(stage).replace("--", "") for stage in stages)
    model = cache_dir / WARM_STARTS_DIR / key / "model"
    model.parent.parent.mkdir(parents=True, exist_ok=True)
    with open(model.parent.parent / f"{key}{WARM_START_LOCK}", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also when the process dies
        if (model / "config.json").exists():
            print(f"warm start: cached at {model}")
            return model
        staging = model.parent.parent / f"{key}{WARM_START_STAGING}"
        print(f"warm start: training the start policy (once; cached at {model}; staged in {staging}) ...",
              flush=True)
        env_id = next(env_id for env_id, (dataset, *_) in envs.ENV_IDS.items() if dataset == world.DATASET)
        main(["--env", env_id, "--data-dir", str(world_data_dir(world, cache_dir)), "--topk", str(topk),
              "--dev-questions", "0", *recipe, *start, "--output", str(staging)])
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
                   help="share of multi-hop oracle trajectories that answer after the first search with the entity "
                        "it found (a start policy that sometimes stops one hop short)")
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
    p.add_argument("--restate", action="store_true",
                   help="the oracle's thought before a search restates the passage's sentence that ends with the query "
                        "(\"The chair of X is Y\" before searching Y; SynthBranch's role passages), so the name "
                        "is copied as the continuation of words the passage holds")
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (use ~1e-5 to fine-tune smollm2)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--max-minutes", type=float, default=None, help="stop after the epoch that passes this")
    p.add_argument("--max-turns", type=int, default=3)
    p.add_argument("--topk", type=int, default=3)
    p.add_argument("--max-step-tokens", type=int, default=64, help="step cap of the dev evaluation")
    p.add_argument("--dev-questions", type=int, default=100,
                   help="greedy dev questions evaluated before and after (0: no dev evaluation)")
    p.add_argument("--data-dir", default=None, help="default: $TREEGRPO_DATA_DIR, else ./data")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default="outputs/warmstart")
    args = p.parse_args(argv)
    if args.extra_worlds < 0:
        p.error(f"--extra-worlds must be >= 0, got {args.extra_worlds}")
    for name in ("unanswered", "premature", "misroute"):
        if not 0.0 <= getattr(args, name) <= 1.0:
            p.error(f"--{name} must be a share in [0, 1], got {getattr(args, name)}")
    if args.observation_weight < 0:
        p.error(f"--observation-weight must be >= 0, got {args.observation_weight}")
    if args.questions is not None and args.questions < 1:
        p.error(f"--questions must be >= 1, got {args.questions}")
    synthetic = [env_id for env_id, (dataset, *_) in envs.ENV_IDS.items() if dataset in SPECS]
    if args.extra_worlds and args.env not in synthetic:
        p.error(f"--extra-worlds needs a generated world (--env {' or '.join(synthetic)}), got --env {args.env}")
    if args.misroute_role and not args.misroute:
        p.error("--misroute-role needs --misroute (the share of those questions to misroute)")
    if args.misroute and args.env != "SynthBranch-v0":
        p.error(f"--misroute needs --env SynthBranch-v0 (the env with a wrong route to follow), got --env {args.env}")
    return args


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
        premature = set(order[::-1][: round(args.premature * count)])
        # a draw of its own: a misrouted trajectory may also be unanswered or premature, as the shares say
        questions = train_branch_questions(env, data_dir)[:count] if args.misroute else []
        misrouted = misrouted_questions(questions, args.misroute, args.misroute_role, args.seed)
        data += [oracle_trajectory(env, tokenizer, i, args.max_turns, end_of_turn, answer=i not in unanswered,
                                   premature=i in premature, route=questions[i].decoy if i in misrouted else None,
                                   restate=args.restate)
                 for i in range(count)]
        env.close()
    tokens = sum(len(ids) for ids, _ in data)
    print(f"{len(data)} oracle trajectories, {tokens} tokens ({sum(sum(m) for _, m in data)} generated); "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters")
    data = [(ids, loss_weights(generated, args.observation_weight)) for ids, generated in data]
    before = dev_em(model, tokenizer, args, env_kwargs) if args.dev_questions else None  # 0: no dev evaluation
    if before is not None:
        print(f"dev before: EM {before['em']:.3f}, reward {before['reward']:.3f}, answer rate "
              f"{before['answered']:.2f}")
    curve = train(model, data, epochs=args.epochs, lr=args.lr, batch_size=args.batch_size, seed=args.seed,
                  pad_id=tokenizer.pad_token_id, max_minutes=args.max_minutes, checkpoint=checkpoint)
    after = dev_em(model, tokenizer, args, env_kwargs) if args.dev_questions else None
    if after is not None:
        print(f"dev after: EM {after['em']:.3f}, reward {after['reward']:.3f}, answer rate {after['answered']:.2f}, "
              f"tool calls {after['tool_calls']:.2f}")
    model.save_pretrained(output / "model")
    tokenizer.save_pretrained(output / "model")
    summary = {"settings": vars(args), "trajectories": len(data), "tokens": tokens, "loss_per_epoch": curve,
               "dev_before": before, "dev_after": after}
    (output / "warmstart.json").write_text(json.dumps(summary, indent=1), encoding="utf-8")
    checkpoint.unlink(missing_ok=True)  # the model is saved: the optimizer's state is not worth its disk
    settings.unlink(missing_ok=True)
    return output / "model"


if __name__ == "__main__":
    # printed here, not in main: cached_warm_start trains in a staging directory and names the final one itself
    trained = main()
    print(f"model: {trained} (use --model {trained})")
