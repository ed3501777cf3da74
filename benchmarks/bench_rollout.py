"""Rollout benchmark: what a tree costs per leaf against chains, and where an iteration's time goes.

    python benchmarks/bench_rollout.py                       # smollm2-135m, HotpotQA dev questions 0..7
    python benchmarks/bench_rollout.py --model tiny-random --max-step-tokens 16 --output /tmp/b.md  # smoke
    python benchmarks/bench_rollout.py --env SynthHop-v0 --model outputs/warm/synthhop/model --max-step-tokens 64

Part 1: the same questions, the same model and seed: tree (2,2,1) against chains G=4 and G=6; per leaf:
tokens generated, tokens prefilled, LLM calls, tool calls, wall seconds (prefix reuse on for all).
Part 2: one Tree-GRPO training iteration (RLlib, env runner in-process): the share of its time spent in
generation, env steps (retrieval), the learner update, weight sync, and the rest (Ray + bookkeeping).
Results replace the ``rollout`` section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import time

import gymnasium as gym
from ray.rllib.utils.metrics import LEARNER_UPDATE_TIMER, SYNCH_WORKER_WEIGHTS_TIMER, TIMERS

import envs
from algos.rollout import TreeRollout, TreeShape
from algos.tree_grpo import TreeGRPOConfig
from algos.tree_grpo import metrics as M
from benchmarks.report import machine_description, replace_section
from policies.generation import HFStepGenerator, SamplingSettings, default_max_step_tokens
from policies.models import load_model

NO_TOOL_CALLS_NOTE = (
    "The model made almost no tool calls (an untrained policy rarely closes a <search> tag), so tool calls per "
    "leaf cannot be compared with it; tests/test_rollout.py::test_tree_costs_less_per_leaf_than_chains checks "
    "the tool-call accounting with a scripted searching policy."
)
SHAPES = {"tree (2,2,1)": TreeShape(2, 2, 1), "chain G=4": TreeShape(4, 0, 0), "chain G=6": TreeShape(6, 0, 0)}


def per_leaf_costs(model_name: str, env_id: str, questions: list[int], settings: SamplingSettings,
                   seed: int) -> dict[str, dict]:
    model, tokenizer = load_model(model_name)
    model.eval()
    env = gym.make(env_id, split=envs.eval_split(env_id))
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


def iteration_shares(model_name: str, env_id: str, prompts: int, settings: SamplingSettings,
                     seed: int) -> dict[str, float]:
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=os.cpu_count(), object_store_memory=1_000_000_000, include_dashboard=False,
             log_to_driver=False, ignore_reinit_error=True)
    config = (TreeGRPOConfig().environment(env_id)
              .training(M=2, N=2, L=1, prompts_per_iteration=prompts, max_step_tokens=settings.max_step_tokens)
              .rl_module(model_config={"model": model_name}).debugging(seed=seed))
    algo = config.build_algo()
    try:
        result = algo.train()
    finally:
        algo.stop()
    total = result[M.ITERATION_TIME_S]
    timers = result[TIMERS]
    runners = result["env_runners"]
    parts = {
        "generation": runners[M.GENERATION_TIME_S],
        "env steps (retrieval)": runners[M.ENV_TIME_S],
        "learner update": timers[LEARNER_UPDATE_TIMER],
        "weight sync": timers[SYNCH_WORKER_WEIGHTS_TIMER],
    }
    parts["Ray + bookkeeping"] = total - sum(parts.values())
    return {"total_s": total, **{name: seconds / total for name, seconds in parts.items()}}


def report(args: argparse.Namespace, costs: dict[str, dict], shares: dict[str, float] | None) -> str:
    lines = [
        f"Command: `python benchmarks/bench_rollout.py --env {args.env} --model {args.model} "
        f"--questions {args.questions} "
        f"--max-step-tokens {args.max_step_tokens} --iteration-prompts {args.iteration_prompts} --seed {args.seed}`  ",
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
        lines += ["", f"One Tree-GRPO iteration ({args.iteration_prompts} prompts, 6 leaves each, in-process "
                      f"env runner and learner): {shares['total_s']:.1f} s", "",
                  "| part | share of iteration time |", "|---|---|"]
        lines += [f"| {name} | {share:.1%} |" for name, share in shares.items() if name != "total_s"]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--env", default="HotpotQA-v0", choices=list(envs.ENV_IDS))
    parser.add_argument("--questions", type=int, default=8)
    parser.add_argument("--max-step-tokens", type=int, default=default_max_step_tokens(),
                        help="token cap of one agent step (default: the project's, %(default)s on this machine)")
    parser.add_argument("--iteration-prompts", type=int, default=2, help="0 skips part 2")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default="docs/benchmarks.md")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    settings = SamplingSettings(max_step_tokens=args.max_step_tokens)
    costs = per_leaf_costs(args.model, args.env, list(range(args.questions)), settings, args.seed)
    shares = None
    if args.iteration_prompts:
        shares = iteration_shares(args.model, args.env, args.iteration_prompts, settings, args.seed)
    section = report(args, costs, shares)
    print(section)
    key = "rollout" if args.env == "HotpotQA-v0" else f"rollout-{args.env}"
    replace_section(args.output, key, f"Rollouts on {args.env}: tree vs chain per leaf, iteration time (issue 4)",
                    section)


if __name__ == "__main__":
    main()
