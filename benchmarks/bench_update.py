"""Update benchmark: do K PPO mini-batches learn faster per rollout than one step, with the same prompts?

    python benchmarks/bench_update.py                            # K=1 vs K=4, seeds 0 1 2, 4 iterations (~30 min)
    python benchmarks/bench_update.py --iterations 8 --seeds 0 1 2 3 4 --report

Each run is the CPU demo (``experiments/demo.py``: the small SynthHop world, the cached warm start that
sometimes answers one hop short, Tree-GRPO (2,2,1), 8 prompts per iteration) for ``--iterations`` iterations,
with ``--ppo-mini-batches K`` optimizer steps per rollout batch and everything else equal (the same seeds draw the
same first prompts).
Per setting: held-out answer rate, reward and EM after training, mean over seeds with a 95% bootstrap interval
over seeds and questions; and the paired difference K=4 - K=1 (same seeds, same questions) with its interval.
Writes OUTPUT/update.md and update.json, and with ``--report`` the ``update`` section of its
study's README (results/ppo_minibatches/README.md).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from benchmarks.report import machine_description, replace_section
from benchmarks.studies import section_file
from experiments.confidence import bootstrap_interval, paired_bootstrap_interval
from experiments.demo import SUMMARY_METRICS
from experiments.demo import main as demo

# name -> run.py options (after the demo's own); everything else is the default update
SETTINGS = {
    "K=1": ["--ppo-mini-batches", "1"],
    "K=4": ["--ppo-mini-batches", "4"],
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--iterations", type=int, default=4)
    p.add_argument("--output", default="outputs/bench_update")
    p.add_argument("--report", action="store_true", help="write the update section of its study's README")
    return p.parse_args(argv)


def scores(runs: dict[str, dict[int, dict]], setting: str, metric: str, part: str = "after") -> np.ndarray:
    """seeds x questions of one metric, from the demo payloads of ``setting``."""
    return np.array([[row[metric] for row in runs[setting][seed]["questions"][part]]
                     for seed in sorted(runs[setting])])


def report(args: argparse.Namespace, runs: dict[str, dict[int, dict]], minutes: dict[str, float]) -> str:
    settings = [s for s in args.settings if runs.get(s)]
    first = runs[settings[0]][min(runs[settings[0]])]
    lines = [f"Command: `python benchmarks/bench_update.py --settings {' '.join(args.settings)} --seeds "
             f"{' '.join(map(str, args.seeds))} --iterations {args.iterations}`  ",
             f"Machine: {machine_description()}", "",
             f"The CPU demo's task (`experiments/demo.py`), {args.iterations} iterations of Tree-GRPO (2,2,1), "
             f"8 prompts each, seeds {args.seeds}; {len(first['questions']['after'])} held-out questions, greedy. "
             "Mean over seeds and questions, 95% bootstrap interval (seeds and questions resampled).", "",
             "| setting | " + " | ".join(f"{label} after" for label in SUMMARY_METRICS.values())
             + " | minutes per run |", "|---|" + "---|" * (len(SUMMARY_METRICS) + 1),
             "| start policy | " + " | ".join(f"{np.mean(scores(runs, settings[0], m, 'before')):.3f}"
                                             for m in SUMMARY_METRICS) + " | - |"]
    for setting in settings:
        cells = [str(bootstrap_interval(scores(runs, setting, metric))) for metric in SUMMARY_METRICS]
        lines.append(f"| {setting} | " + " | ".join(cells) + f" | {minutes[setting]:.1f} |")
    if {"K=1", "K=4"} <= set(settings) and sorted(runs["K=1"]) == sorted(runs["K=4"]):
        lines += ["", "Paired difference K=4 - K=1 (same seeds, same questions):", "",
                  "| metric | difference [95% interval] | beyond noise |", "|---|---|---|"]
        for metric, label in SUMMARY_METRICS.items():
            diff = paired_bootstrap_interval(scores(runs, "K=4", metric), scores(runs, "K=1", metric))
            lines.append(f"| {label} | {diff} | {'yes' if diff.excludes(0.0) else 'no'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    args = parse_args(argv)
    output = Path(args.output)
    runs: dict[str, dict[int, dict]] = {}
    minutes: dict[str, float] = {}
    for setting in args.settings:
        runs[setting] = {}
        start = time.perf_counter()
        for seed in args.seeds:
            runs[setting][seed] = demo(["--output", str(output / setting / f"seed{seed}"), "--seed", str(seed),
                                        "--iterations", str(args.iterations), "--no-mlflow", *SETTINGS[setting]])
        minutes[setting] = (time.perf_counter() - start) / 60 / len(args.seeds)
    text = report(args, runs, minutes)
    (output / "update.md").write_text(text + "\n", encoding="utf-8")
    (output / "update.json").write_text(json.dumps({s: {seed: {k: v for k, v in r.items() if k != "questions"}
                                                        for seed, r in by_seed.items()}
                                                    for s, by_seed in runs.items()}, indent=1), encoding="utf-8")
    print(text)
    if args.report:
        replace_section(section_file("update", output), "update", "PPO mini-batches: learning per rollout (issue 14)",
                        text)
    return text


if __name__ == "__main__":
    main()
