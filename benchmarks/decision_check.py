"""The decision test's start-policy check (docs/protocol_decision.md), before any of its runs: each arm's trees grown
from the start policy as its first iteration would grow them (its run.py options: shape, branching, sampling; no
update), on every train question, a few times over.

    python benchmarks/decision_check.py                             # 300 train questions, 4 repeats, every arm
    python benchmarks/decision_check.py --prompts 24 --repeats 1    # a quick look

Per arm: the independent draws of the decision a prompt (the nodes at its depth, ``decision_draws``), leaves and the
measured cost in chains (generated tokens over one initial chain's), and the share of prompts whose leaves' rewards
differ (mixed: the prompts an update learns from), overall and per asked role, and its ratio to chain G=2's with a
95% bootstrap interval over the questions (paired: one resample for every arm), beside the ratios the protocol
predicts (``bench_decision.PREDICTED_MIXED_RATIO``), and the protocol's rule (``rule_verdict``: whether the runs go
ahead). Prints the table and writes OUTPUT/start-check.md and .json (OUTPUT: bench_decision's --output; not a
record of the test). The start is trained first if it is not cached. ``--rule OUTPUT/start-check.json`` reads the
rule again and exits 1 when it says stop (``benchmarks/decision_queue.sh``).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from pathlib import Path

import gymnasium as gym
import numpy as np

import envs  # noqa: F401  (registers the env ids)
from algos.tree import Tree
from benchmarks import bench_decision
from benchmarks.check_start import asked_role
from benchmarks.decision_draws import arm_settings, draws_at_depth, grow_arm
from benchmarks.learning_runs import run_options, without_output
from envs.synthetic import BRANCH_ROLES

RESAMPLES = 2000
START_CHECK = "start-check.json"  # OUTPUT's record of the check, which the rule reads
# The protocol's rule before any run: the tree at the decision must find the decision (draws a prompt at least this)
# and give more prompts a signal than chain G=2 (its ratio's 95% interval wholly above this).
MIN_DECISION_DRAWS = 2.9
RATIO_FLOOR = 1.0


def mixed_rewards(trees: Sequence[Tree], prompts: Sequence[int]) -> np.ndarray:
    """Per prompt of ``prompts`` (in order): whether the leaves of its trees were rewarded differently (so some leaf
    gets a non-zero advantage)."""
    rewards: dict[int, set[float]] = {prompt: set() for prompt in prompts}
    for tree in trees:
        rewards[tree.prompt_index].update(leaf.reward for leaf in tree.leaves())
    return np.array([len(rewards[prompt]) > 1 for prompt in prompts])


def ratio_interval(arm: np.ndarray, base: np.ndarray, resamples: int = RESAMPLES,
                   seed: int = 0) -> tuple[float, float, float]:
    """mean(arm) / mean(base) of two per-question shares, with its 95% bootstrap interval over the questions (the
    same resampled questions for both: the arms grew the same prompts)."""
    if base.mean() == 0:
        raise ValueError("the baseline arm had no prompt with mixed rewards: no ratio to it (grow more prompts: "
                         "--prompts, --repeats)")
    picks = np.random.default_rng(seed).integers(len(arm), size=(resamples, len(arm)))
    with np.errstate(divide="ignore", invalid="ignore"):  # a resample with no mixed baseline prompt: inf (or 0 / 0)
        ratios = arm[picks].mean(axis=1) / base[picks].mean(axis=1)
    low, high = np.quantile(ratios[~np.isnan(ratios)], [0.025, 0.975], method="inverted_cdf")  # inf stays inf
    return float(arm.mean() / base.mean()), float(low), float(high)


def grow_arms(args: argparse.Namespace, prompt_count: int, repeats: int) -> tuple[dict[str, dict], list[str]]:
    """Per arm of --settings: per-question mixed shares over ``repeats`` growths of the first ``prompt_count`` train
    questions (``mixed``), decision draws and leaves a prompt, the measured cost in chains; and each question's
    asked role."""
    from experiments.evaluate import load_policy

    bed = bench_decision.testbed(args)
    warm = bench_decision.start_policy(bed, args)
    model, tokenizer = load_policy(warm)
    env = gym.make(bed.env, split="train", data_dir=str(bed.data_dir), max_turns=bed.max_turns, topk=bed.topk)
    prompts = list(range(min(prompt_count, len(env.unwrapped.records))))
    arms = {}
    for name in args.settings:
        run = arm_settings(without_output(run_options(bed, name, 0, warm, args, Path(args.output))))
        mixed, draws, leaves, chains = [], 0, 0, []
        for repeat in range(repeats):
            trees, counters = grow_arm(env, model, tokenizer, run, prompts, seed=repeat)
            mixed.append(mixed_rewards(trees, prompts))
            draws += draws_at_depth(trees, bed.world.decision_hop + 1)
            leaves += counters.leaves
            chains.append(counters.budget_measured)
        grown = repeats * len(prompts)
        arms[name] = {"mixed": np.mean(mixed, axis=0), "draws": draws / grown, "leaves": leaves / grown,
                      "chains": float(np.mean(chains))}
        print(f"{name}: grown ({time.strftime('%H:%M:%S')})", flush=True)
    return arms, [asked_role(env.unwrapped.records[i].question) for i in prompts]


def check_table(arms: dict[str, dict], roles: list[str]) -> tuple[str, dict[str, dict]]:
    """The check's markdown table and its figures per arm, ratios against chain G=2's (none where no chain G=2
    prompt was mixed)."""
    if bench_decision.CHAIN_2 not in arms:
        raise ValueError(f"the check's ratios are against {bench_decision.CHAIN_2!r}: include it in --settings")
    base, asked = arms[bench_decision.CHAIN_2]["mixed"], np.array(roles)
    lines = ["| arm | decision draws a prompt | leaves | cost in chains | mixed-reward share | "
             + " | ".join(f"on {role} questions" for role in BRANCH_ROLES)
             + " | ratio to chain G=2 [95%] | predicted |", "|---|---|---|---|---|---|---|---|---|"]
    figures = {}
    for name, arm in arms.items():
        ratio = ratio_interval(arm["mixed"], base) if base.any() else None  # no mixed baseline prompt: no ratio
        by_role = {role: float(arm["mixed"][asked == role].mean()) for role in BRANCH_ROLES if (asked == role).any()}
        figures[name] = {"draws": arm["draws"], "leaves": arm["leaves"], "chains": arm["chains"],
                         "mixed": float(arm["mixed"].mean()), "mixed_by_role": by_role, "ratio": ratio,
                         "predicted_ratio": bench_decision.PREDICTED_MIXED_RATIO.get(name)}
        predicted = figures[name]["predicted_ratio"]
        lines.append(f"| {name} | {arm['draws']:.2f} | {arm['leaves']:.2f} | {arm['chains']:.2f} | "
                     f"{arm['mixed'].mean():.3f} | " + " | ".join(f"{by_role.get(role, float('nan')):.3f}"
                                                                  for role in BRANCH_ROLES)
                     + (" | - | " if ratio is None else f" | {ratio[0]:.3f} [{ratio[1]:.3f}, {ratio[2]:.3f}] | ")
                     + ("-" if predicted is None else f"{predicted:g}") + " |")
    return "\n".join(lines) + "\n", figures


def rule_verdict(figures: dict[str, dict]) -> tuple[bool, str]:
    """The protocol's rule on the check's figures: whether the runs go ahead, and why (every unmet condition named)."""
    arm = figures.get(bench_decision.AT_DECISION)
    if arm is None:
        return False, f"the check did not grow {bench_decision.AT_DECISION!r}"
    unmet = []
    if arm["draws"] < MIN_DECISION_DRAWS:
        unmet.append(f"it drew the decision {arm['draws']:.2f} times a prompt (the rule: at least "
                     f"{MIN_DECISION_DRAWS})")
    if arm["ratio"] is None or arm["ratio"][1] <= RATIO_FLOOR:
        low = "no ratio" if arm["ratio"] is None else f"its ratio's interval starts at {arm['ratio'][1]:.3f}"
        unmet.append(f"{low} (the rule: above {RATIO_FLOOR})")
    if unmet:
        return False, f"stop: {bench_decision.AT_DECISION}: " + "; ".join(unmet)
    return True, (f"go: {bench_decision.AT_DECISION} drew the decision {arm['draws']:.2f} times a prompt, its ratio "
                  f"to chain G=2 {arm['ratio'][0]:.3f} [{arm['ratio'][1]:.3f}, {arm['ratio'][2]:.3f}]")


def main(argv: list[str] | None = None) -> dict[str, dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="Other options go to bench_decision.py (--settings, --warm, --output, ...).")
    p.add_argument("--prompts", type=int, default=300, help="the first train questions to grow (default: all 300)")
    p.add_argument("--repeats", type=int, default=4, help="growths of each prompt per arm, each with its own seed")
    p.add_argument("--rule", type=Path, metavar="START_CHECK_JSON",
                   help="grow nothing: read the protocol's rule from a check's start-check.json, print the verdict "
                        "and exit 0 when the runs go ahead, 1 when they stop")
    options, rest = p.parse_known_args(argv)
    if options.rule:
        go, why = rule_verdict(json.loads(options.rule.read_text(encoding="utf-8"))["arms"])
        print(why)
        raise SystemExit(0 if go else 1)
    if options.prompts < 1 or options.repeats < 1:
        p.error(f"--prompts and --repeats must be >= 1, got {options.prompts} and {options.repeats}")
    args = bench_decision.parse_args(rest)
    start = time.perf_counter()
    arms, roles = grow_arms(args, options.prompts, options.repeats)
    table, figures = check_table(arms, roles)
    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    header = (f"Start-policy check: {len(roles)} train questions x {options.repeats} repeats per arm, no training; "
              f"{time.perf_counter() - start:.0f} s.\n\n")
    go, why = rule_verdict(figures)
    (output / "start-check.md").write_text(header + table + f"\nRule: {why}\n", encoding="utf-8")
    (output / START_CHECK).write_text(json.dumps({"prompts": len(roles), "repeats": options.repeats,
                                                         "arms": figures, "go": go, "rule": why}, indent=1),
                                             encoding="utf-8")
    print(header + table + f"\nRule: {why}")
    return figures


if __name__ == "__main__":
    main()
