"""The frozen bottom run once per micro-batch against every pass, in the mission's command on a CPU.

    python benchmarks/bench_frozen_bottom.py --report docs/benchmarks.md     # 2 rounds x 2 arms x 3 iterations

``python experiments/run.py --env HotpotQA-v0`` at its CPU defaults (the oracle warm start, LoRA on the top 10 of
SmolLM2-135M's 30 layers) with ``--frozen-bottom-replay`` and with ``--no-frozen-bottom-replay``, the same seed, the
arms interleaved round by round. Replaying the bottom gives the same floats, so both arms sample the same trees and
make the same updates: the table checks that (rewards, losses and gradient norms equal iteration by iteration) and
compares the learner's update time (``update_time_s``; its no-gradient passes, ``scoring_time_s``, beside it) and the
whole iteration's, summed over each run's iterations after the first (Ray's and the model's start). The ratio is
every pass / replay per round, their mean and each round's given.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

from algos.tree_grpo import metrics as metric_keys
from benchmarks.report import machine_description, replace_section
from experiments.plot import METRICS_FILE, load_metrics

ROOT = Path(__file__).resolve().parents[1]
ARMS = {"replay": "--frozen-bottom-replay", "every pass": "--no-frozen-bottom-replay"}
ITERATION_S = "time_s"  # metrics.jsonl names the iteration's seconds time_s
SAME = (metric_keys.REWARD, metric_keys.POLICY_LOSS, metric_keys.GRAD_NORM)  # equal when the replay is exact


def run(output: Path, option: str, iterations: int, seed: int) -> list[dict]:
    """One run.py run's metrics rows (the directory is made afresh)."""
    shutil.rmtree(output, ignore_errors=True)
    subprocess.run([sys.executable, str(ROOT / "experiments" / "run.py"), "--env", "HotpotQA-v0", option,
                    "--iterations", str(iterations), "--seed", str(seed), "--no-mlflow", "--quiet",
                    "--output", str(output)], check=True)
    return load_metrics(output / METRICS_FILE)


def summed(rows: list[dict], key: str) -> float:
    return sum(row[key] for row in rows[1:])  # the first iteration carries the start's one-off costs


def report(rounds: list[dict[str, list[dict]]], args: argparse.Namespace) -> str:
    load = os.getloadavg()
    lines = [f"`python benchmarks/bench_frozen_bottom.py --rounds {args.rounds} --iterations {args.iterations}` on "
             f"{machine_description()}; 1-minute load average {load[0]:.2f} at the end (the runs' own).", "",
             "`run.py --env HotpotQA-v0` at its CPU defaults (SmolLM2-135M warm start, LoRA on the top 10 of 30 "
             "layers, float32), seconds summed over iterations 2 onward of each run; ratio: every pass / replay.", "",
             "| round | arm | update s | of it no-gradient passes s | iteration s | rewards, losses, gradient norms "
             "equal |",
             "|---|---|---|---|---|---|"]
    ratios = []
    for number, runs in enumerate(rounds, 1):
        same = all(a.get(key) == b.get(key) for a, b in zip(runs["replay"], runs["every pass"], strict=True)
                   for key in SAME)
        for arm, rows in runs.items():
            lines.append(f"| {number} | {arm} | {summed(rows, metric_keys.UPDATE_TIME_S):.1f} | "
                         f"{summed(rows, metric_keys.SCORING_TIME_S):.1f} | "
                         f"{summed(rows, ITERATION_S):.1f} | {'yes' if same else '**no**'} |")
        ratios.append([summed(runs["every pass"], key) / summed(runs["replay"], key)
                       for key in (metric_keys.UPDATE_TIME_S, ITERATION_S)])
    update, iteration = zip(*ratios, strict=True)
    lines += ["", f"**Update time: {sum(update) / len(update):.2f}x faster with the replay** (rounds "
                  f"{', '.join(f'{r:.2f}' for r in update)}); the whole iteration "
                  f"{sum(iteration) / len(iteration):.2f}x ({', '.join(f'{r:.2f}' for r in iteration)})."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--iterations", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", type=Path, default=Path("outputs/bench_frozen_bottom"))
    p.add_argument("--report", default=None, help="write the table as section frozen-bottom of this file")
    args = p.parse_args(argv)
    rounds = []
    for number in range(args.rounds):
        order = list(ARMS) if number % 2 == 0 else list(reversed(ARMS))  # neither arm always runs first
        runs = {arm: run(args.output / f"{arm.replace(' ', '_')}_{number}", ARMS[arm], args.iterations, args.seed)
                for arm in order}
        rounds.append({arm: runs[arm] for arm in ARMS})
    text = report(rounds, args)
    print(text)
    if args.report:
        replace_section(args.report, "frozen-bottom", "The frozen bottom once per micro-batch (CPU)", text)
    return text


if __name__ == "__main__":
    main()
