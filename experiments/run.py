"""Train a search agent with Tree-GRPO (or chain GRPO) on RLlib.

    python experiments/run.py --algo tree_grpo --env HotpotQA-v0                 # CPU defaults, smollm2-135m
    python experiments/run.py --algo grpo --group-size 4 --env HotpotQA-v0
    python experiments/run.py --model tiny-random --iterations 2 --output outputs/smoke
    python experiments/run.py --resume outputs/run/checkpoints/latest --iterations 10

Writes OUTPUT/metrics.jsonl (one JSON object per iteration) and checkpoints under OUTPUT/checkpoints/
(every --checkpoint-every iterations, at the end, and on Ctrl-C).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import envs
from algos.tree_grpo import ALGORITHMS
from algos.tree_grpo import metrics as M
from algos.tree_grpo.algorithm import ITERATION_TIME_S, PROMPTS
from envs.datasets import resolve_data_dir

# metrics.jsonl columns: (name, where in RLlib's result: env runner results, learner results or top level)
ENV_RUNNER_KEYS = (M.REWARD, M.EM, M.TREES, M.LEAVES, M.TOKENS_GENERATED, M.TOKENS_PREFILLED, M.LLM_CALLS,
                   M.TOOL_CALLS, M.SAMPLE_TIME_S, M.GENERATION_TIME_S, M.ENV_TIME_S, M.BUDGET_ESTIMATE,
                   M.BUDGET_MEASURED)
LEARNER_KEYS = (M.POLICY_LOSS, M.KL, M.ENTROPY, M.CLIP_FRACTION, M.DUAL_CLIP_FRACTION, M.RATIO_MEAN, M.RATIO_MAX,
                M.RATIO_MIN, M.GRAD_NORM, M.LEARNING_RATE, M.SAMPLER_LOGPROB_GAP, M.TRAINED_TOKENS)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--algo", choices=list(ALGORITHMS), default="tree_grpo")
    p.add_argument("--env", choices=list(envs.ENV_IDS), default="HotpotQA-v0")
    p.add_argument("--split", default=None, help="training split (default: the env id's default)")
    p.add_argument("--model", default="smollm2-135m", help="tiny-random, smollm2-135m, a hub id or a directory")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--M", type=int, default=2, help="trees per prompt")
    p.add_argument("--N", type=int, default=2, help="nodes expanded per tree per round")
    p.add_argument("--L", type=int, default=1, help="expansion rounds")
    p.add_argument("--group-size", type=int, default=4, help="chains per prompt for --algo grpo")
    p.add_argument("--prompts-per-iter", type=int, default=None, help="default: 4 on CPU, 32 with a GPU")
    p.add_argument("--iterations", type=int, default=20)
    p.add_argument("--max-turns", type=int, default=3)
    p.add_argument("--topk", type=int, default=3)
    p.add_argument("--max-step-tokens", type=int, default=500)
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--warmup-steps", type=int, default=0)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--output", default="outputs/run")
    p.add_argument("--data-dir", default=None, help="default: $TREEGRPO_DATA_DIR, else ./data")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-env-runners", type=int, default=0, help="remote Ray env runners (0: in this process)")
    p.add_argument("--num-learners", type=int, default=0, help="remote learners, DDP (0: in this process)")
    p.add_argument("--num-gpus-per-learner", type=float, default=0)
    p.add_argument("--num-cpus-per-learner", type=float, default=1)
    p.add_argument("--num-cpus-per-env-runner", type=float, default=1)
    p.add_argument("--checkpoint-every", type=int, default=10)
    p.add_argument("--eval-every", type=int, default=0, help="greedy evaluation every k iterations (0: never)")
    p.add_argument("--eval-questions", type=int, default=50, help="questions of the evaluation split")
    p.add_argument("--resume", default=None, help="a checkpoint directory to continue from")
    p.add_argument("--quiet", action="store_true", help="no progress line per rollout step")
    return p.parse_args(argv)


def default_prompts_per_iter() -> int:
    import torch

    return 32 if torch.cuda.is_available() else 4


def build_config(args: argparse.Namespace):
    """The algorithm config for the command-line settings."""
    config_cls = ALGORITHMS[args.algo][1]
    prompts = args.prompts_per_iter or default_prompts_per_iter()
    env_config: dict[str, Any] = {"data_dir": str(resolve_data_dir(args.data_dir).resolve()),
                                  "max_turns": args.max_turns, "topk": args.topk}
    if args.split:
        env_config["split"] = args.split
    shape = {"group_size": args.group_size} if args.algo == "grpo" else {"M": args.M, "N": args.N, "L": args.L}
    return (
        config_cls()
        .environment(args.env, env_config=env_config)
        .training(**shape, prompts_per_iteration=prompts, max_step_tokens=args.max_step_tokens,
                  lr=args.lr, warmup_steps=args.warmup_steps, micro_batch_size=args.micro_batch_size,
                  log_rollout_steps=not args.quiet)
        .rl_module(model_config={"model": args.model, "dtype": args.dtype, "seed": args.seed})
        .env_runners(num_env_runners=args.num_env_runners, create_local_env_runner=args.num_env_runners == 0,
                     num_cpus_per_env_runner=args.num_cpus_per_env_runner)
        .learners(num_learners=args.num_learners, num_gpus_per_learner=args.num_gpus_per_learner,
                  num_cpus_per_learner=args.num_cpus_per_learner)
        .debugging(seed=args.seed)
    )


def check_resources(args: argparse.Namespace, available: dict[str, float]) -> None:
    """Fail fast, naming the options, when the actors cannot all be placed (Ray would wait forever)."""
    gpus = args.num_learners * args.num_gpus_per_learner
    cpus = args.num_env_runners * args.num_cpus_per_env_runner
    cpus += args.num_learners * (args.num_cpus_per_learner if not args.num_gpus_per_learner else 0)
    if cpus > available.get("CPU", 0) or gpus > available.get("GPU", 0):
        raise SystemExit(
            f"the requested actors need {cpus:g} CPUs and {gpus:g} GPUs but Ray has {available.get('CPU', 0):g} "
            f"CPUs and {available.get('GPU', 0):g} GPUs: lower --num-env-runners / --num-learners, or "
            f"--num-cpus-per-env-runner / --num-cpus-per-learner (fractions are fine, e.g. 0.5)"
        )


def metrics_row(iteration: int, result: dict) -> dict[str, Any]:
    """One metrics.jsonl line from RLlib's result dict."""
    runners = result.get("env_runners", {})
    learner = result.get("learners", {}).get("default_policy", {})
    row: dict[str, Any] = {"iteration": iteration, "prompts": result.get(PROMPTS),
                           "time_s": result.get(ITERATION_TIME_S)}
    row.update({key: runners.get(key) for key in ENV_RUNNER_KEYS})
    row.update({key: learner.get(key) for key in LEARNER_KEYS})
    return {k: (float(v) if hasattr(v, "__float__") and not isinstance(v, int) else v) for k, v in row.items()}


def progress_line(row: dict[str, Any], total: int) -> str:
    def f(key: str, fmt: str) -> str:
        value = row.get(key)
        return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, fmt)

    return (f"iter {row['iteration']:>4}/{total}  reward {f(M.REWARD, '.3f')}  EM {f(M.EM, '.3f')}  "
            f"leaves {f(M.LEAVES, 'd')}  tokens {f(M.TOKENS_GENERATED, 'd')}  tool calls {f(M.TOOL_CALLS, 'd')}  "
            f"KL {f(M.KL, '.4f')}  {f('time_s', '.1f')} s"
            + (f"  dev EM {row['dev_em']:.3f}" if "dev_em" in row else ""))


def main(argv: list[str] | None = None) -> Path:
    args = parse_args(argv)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray

    output = Path(args.output)
    (output / "checkpoints").mkdir(parents=True, exist_ok=True)
    if not ray.is_initialized():
        ray.init(num_cpus=os.cpu_count(), object_store_memory=1_000_000_000, include_dashboard=False,
                 log_to_driver=not args.quiet)  # remote runners' progress lines reach this console
    check_resources(args, ray.cluster_resources())
    algo = ALGORITHMS[args.algo][0].from_checkpoint(args.resume) if args.resume else build_config(args).build_algo()
    start_iteration = algo.iteration
    latest = output / "checkpoints" / "latest"
    try:
        with (output / "metrics.jsonl").open("a", encoding="utf-8") as log:
            for _ in range(args.iterations):
                start = time.perf_counter()
                result = algo.train()
                row = metrics_row(algo.iteration, result)
                row["time_s"] = row["time_s"] or time.perf_counter() - start
                if args.eval_every and algo.iteration % args.eval_every == 0:
                    row.update(algo.greedy_eval(envs.eval_split(args.env), args.eval_questions))
                log.write(json.dumps(row) + "\n")
                log.flush()
                print(progress_line(row, start_iteration + args.iterations), flush=True)
                if args.checkpoint_every and algo.iteration % args.checkpoint_every == 0:
                    algo.save_to_path(str(latest.resolve()))
    except KeyboardInterrupt:
        print("interrupted: saving a checkpoint before stopping", file=sys.stderr)
    finally:
        algo.save_to_path(str(latest.resolve()))
        algo.stop()
    print(f"metrics: {output / 'metrics.jsonl'}; checkpoint: {latest}")
    return latest


if __name__ == "__main__":
    main()
