"""Rollout benchmark: what a tree costs per leaf against chains, and where an iteration's time goes.

    python benchmarks/bench_rollout.py                       # smollm2-135m, HotpotQA dev questions 0..7
    python benchmarks/bench_rollout.py --model tiny-random --max-step-tokens 16 --output /tmp/b.md  # smoke
    python benchmarks/bench_rollout.py --env SynthHop-v0 --model outputs/warm/synthhop/model --max-step-tokens 64

Part 1: the same questions, the same model and seed: tree (2,2,1) against chains G=4 and G=6; per leaf:
tokens generated, tokens prefilled, LLM calls, tool calls, wall seconds (prefix reuse on for all).
Part 2: Tree-GRPO training iterations (RLlib, env runner in-process): the share of their time spent in
generation, env steps (retrieval), the learner update, weight sync, and the rest (Ray + bookkeeping), with a
single-step update (one optimizer step on recomputed old log-probs, every row forwarded whole) and with the
defaults (PPO mini-batches, the sampler's old log-probs, shared prefixes trained once), the same seed and
prompts, one after the other: what the defaults' update costs and saves.
Results replace the ``rollout`` section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import time

import gymnasium as gym

import envs
from algos.rollout import TreeRollout, TreeShape
from algos.tree_grpo import TreeGRPOConfig
from algos.tree_grpo import metrics as metric_keys
from benchmarks.report import machine_description, replace_section
from envs.datasets import resolve_data_dir
from policies.generation import SamplingSettings, default_max_step_tokens
from policies.hf_generation import HFStepGenerator
from policies.models import load_model

NO_TOOL_CALLS_NOTE = (
    "The model made almost no tool calls (an untrained policy rarely closes a <search> tag), so tool calls per "
    "leaf cannot be compared with it; tests/test_rollout.py::test_tree_costs_less_per_leaf_than_chains checks "
    "the tool-call accounting with a scripted searching policy."
)
# a single-step update (no PPO mini-batches, recomputed old log-probs, no shared prefixes) against the defaults
UPDATES = {"before (1 step, recomputed old log-probs, per row)":
           {"ppo_mini_batches": 1, "old_logprobs": "recompute", "prefix_sharing": False, "warmup_steps": 0},
           "after (defaults)": {}}
SHAPES = {"tree (2,2,1)": TreeShape(2, 2, 1), "chain G=4": TreeShape(4, 0, 0), "chain G=6": TreeShape(6, 0, 0)}


def per_leaf_costs(model_name: str, env_id: str, questions: list[int], settings: SamplingSettings,
                   seed: int, env_kwargs: dict) -> dict[str, dict]:
    model, tokenizer = load_model(model_name)
    model.eval()
    env = gym.make(env_id, split=envs.eval_split(env_id), **env_kwargs)
    rows = {}
    for name, shape in SHAPES.items():
        generator = HFStepGenerator(model, tokenizer, settings)
        rollout = TreeRollout(env, generator, tokenizer, seed=seed)
        start = time.perf_counter()
        rollout.grow(questions, shape)
        seconds = time.perf_counter() - start
        leaves = rollout.counters.leaves
        counters = generator.counters.as_dict()
        rows[name] = {key: value / leaves for key, value in counters.items()}
        rows[name].update(tool_calls=rollout.counters.tool_calls / leaves, seconds=seconds / leaves, leaves=leaves,
                          budget=rollout.counters.budget_measured, estimate=shape.budget_estimate)
    return rows


def iteration_shares(model_name: str, env_id: str, prompts: int, settings: SamplingSettings, seed: int,
                     iterations: int, update: dict, env_kwargs: dict) -> dict[str, float]:
    """The shares of ``iterations`` training iterations' time (summed) per part, and the total seconds."""
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=os.cpu_count(), object_store_memory=1_000_000_000, include_dashboard=False,
             log_to_driver=False, ignore_reinit_error=True)
    config = (TreeGRPOConfig().environment(env_id, env_config=env_kwargs)
              .training(M=2, N=2, L=1, prompts_per_iteration=prompts, max_step_tokens=settings.max_step_tokens,
                        total_iterations=iterations, **update)
              .rl_module(model_config={"model": model_name}).debugging(seed=seed))
    algo = config.build_algo()
    parts: dict[str, float] = {}
    total = 0.0
    try:
        for _ in range(iterations):
            result = algo.train()
            total += result[metric_keys.ITERATION_TIME_S]
            runners = result["env_runners"]
            for name, seconds in (("generation", runners[metric_keys.GENERATION_TIME_S]),
                                  ("env steps (retrieval)", runners[metric_keys.ENV_TIME_S]),
                                  ("learner update", result[metric_keys.UPDATE_TIME_S]),
                                  ("weight sync", result[metric_keys.SYNC_TIME_S])):
                parts[name] = parts.get(name, 0.0) + seconds
    finally:
        algo.stop()
    parts["Ray + bookkeeping"] = total - sum(parts.values())
    return {"total_s": total, **{name: seconds / total for name, seconds in parts.items()}}


def report(args: argparse.Namespace, costs: dict[str, dict], shares: dict[str, dict] | None) -> str:
    lines = [
        f"Command: `python benchmarks/bench_rollout.py --env {args.env} --model {args.model} "
        + (f"--data-dir {args.data_dir} " if args.data_dir else "") +
        f"--questions {args.questions} "
        f"--max-step-tokens {args.max_step_tokens} --iteration-prompts {args.iteration_prompts} "
        f"--iterations {args.iterations} --seed {args.seed}`  ",
        f"Machine: {machine_description()}",
        "",
        f"Per leaf, {args.env} {envs.eval_split(args.env)} questions 0..{args.questions - 1}, same model and seed, "
        f"prefix reuse on:",
        "",
        "| rollout | leaves | tokens generated | tokens prefilled | LLM calls | tool calls | seconds | "
        "budget (chains/prompt) measured / paper's estimate | generated vs G=4 | vs G=6 | tool calls vs G=4 | vs G=6 |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in costs.items():
        ratios = [r[key] / costs[chain][key] if costs[chain][key] else float("nan")
                  for key in ("tokens_generated", "tool_calls") for chain in ("chain G=4", "chain G=6")]
        lines.append(
            f"| {name} | {r['leaves']} | {r['tokens_generated']:.1f} | {r['tokens_prefilled']:.1f} | "
            f"{r['llm_calls']:.2f} | {r['tool_calls']:.2f} | {r['seconds']:.2f} | {r['budget']:.2f} / "
            f"{r['estimate']:.1f} | " + " | ".join(f"{x:.2f}" for x in ratios) + " |")
    if max(r["tool_calls"] for r in costs.values()) < 0.1:
        lines += ["", NO_TOOL_CALLS_NOTE]
    if shares:
        names = list(shares)
        lines += ["", f"{args.iterations} Tree-GRPO iterations ({args.iteration_prompts} prompts, 6 leaves each, "
                      "in-process env runner and learner), the update before and after the update issue:", "",
                  "| part | " + " | ".join(names) + " |", "|---|" + "---|" * len(names),
                  "| seconds (all iterations) | " + " | ".join(f"{shares[n]['total_s']:.1f}" for n in names) + " |"]
        for part in shares[names[0]]:
            if part != "total_s":
                lines.append(f"| {part} | " + " | ".join(
                    f"{shares[n][part]:.1%} ({shares[n][part] * shares[n]['total_s']:.1f} s)" for n in names) + " |")
        ratio = shares[names[0]]["total_s"] / shares[names[-1]]["total_s"]
        lines += ["", f"Iteration time before / after: {ratio:.2f}x."]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--env", default="HotpotQA-v0", choices=list(envs.ENV_IDS))
    parser.add_argument("--data-dir", default=None, help="data directory (SynthHop-v0: a world written by "
                                                         "python -m envs.synthetic; default: the project's)")
    parser.add_argument("--questions", type=int, default=8)
    parser.add_argument("--max-step-tokens", type=int, default=default_max_step_tokens(),
                        help="token cap of one agent step (default: the project's, %(default)s on this machine)")
    parser.add_argument("--iteration-prompts", type=int, default=2, help="0 skips part 2")
    parser.add_argument("--iterations", type=int, default=2, help="training iterations per update setting")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default="docs/benchmarks.md")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    settings = SamplingSettings(max_step_tokens=args.max_step_tokens)
    env_kwargs = {"data_dir": str(resolve_data_dir(args.data_dir).resolve())} if args.data_dir else {}
    costs = per_leaf_costs(args.model, args.env, list(range(args.questions)), settings, args.seed, env_kwargs)
    shares = None
    if args.iteration_prompts:
        shares = {name: iteration_shares(args.model, args.env, args.iteration_prompts, settings, args.seed,
                                         args.iterations, update, env_kwargs) for name, update in UPDATES.items()}
    section = report(args, costs, shares)
    print(section)
    key = "rollout" if args.env == "HotpotQA-v0" else f"rollout-{args.env}"
    replace_section(args.output, key, f"Rollouts on {args.env}: tree vs chain per leaf, iteration time (issue 4)",
                    section)


if __name__ == "__main__":
    main()
