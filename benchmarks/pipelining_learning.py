"""Does one-step off-policy pipelining learn as well as the synchronous loop? The runs and the reading of
docs/protocol_pipelining.md (issue 65): the CPU demo trained with ``--max-staleness 0`` and ``1`` (one remote env
runner each) on the same training seeds, compared by held-out exact match after the last iteration.

    python benchmarks/pipelining_learning.py                 # the 10 runs (finished ones are kept), then the reading
    python benchmarks/pipelining_learning.py --report        # also section ``pipelining-learning`` of its README

The statistic is the protocol's: K = 1 - K = 0 over seeds and questions, paired (same seed, same question), with the
bootstrap interval of ``experiments.confidence.paired_bootstrap_interval``; beside it, as the project reads few
seeds, the per-seed mean differences' t-interval and the exact sign-flip p. The decision (``decision``) follows the
interval: not worse (lower bound >= -0.05), worse (upper bound < 0), else undecided.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.report import machine_description, replace_section
from benchmarks.run_records import run_folder_problems
from benchmarks.studies import section_file
from experiments.confidence import Interval, mean_interval, paired_bootstrap_interval, sign_flip_p_value
from experiments.plot import METRICS_FILE, load_metrics

SECTION_KEY, SECTION_TITLE = "pipelining-learning", "Pipelining: held-out exact match, K = 1 against K = 0 (CPU demo)"
NOT_WORSE_MARGIN = 0.05  # the protocol's: K = 1 may trail K = 0 by at most this at the interval's lower bound
ARM_STALENESS = (0, 1)
K1_MEANS = ("staleness", "sampler_ratio_mean", "tis_weight_mean")  # the K = 1 runs' means the protocol reports


def run_directory(output: Path, k: int, seed: int) -> Path:
    return output / f"k{k}-seed{seed}"


def decision(interval: Interval, margin: float = NOT_WORSE_MARGIN) -> str:
    """The protocol's rule on the K = 1 - K = 0 interval: "not worse" when its lower bound is at or above -margin,
    "worse" when its upper bound is below 0, else "undecided"."""
    if interval.low >= -margin:
        return "not worse"
    if interval.high < 0:
        return "worse"
    return "undecided"


def held_out_em(run: Path, when: str) -> np.ndarray:
    """One run's per-question held-out exact match, ``when`` "before" or "after" training (its demo.json)."""
    payload = json.loads((run / "demo.json").read_text(encoding="utf-8"))
    return np.array([row["em"] for row in payload["questions"][when]], dtype=float)


def compare(after: dict[int, np.ndarray], before: np.ndarray) -> dict[str, Any]:
    """The reading of ``after`` (K -> seeds x questions, held-out EM after training) against the start's ``before``
    (questions): each arm's mean and change from the start, and K = 1 - K = 0 with its intervals, tests and decision."""
    k0, k1 = after[0], after[1]
    per_seed = k1.mean(axis=1) - k0.mean(axis=1)
    difference = paired_bootstrap_interval(k1, k0)
    return {"arms": {k: {"em": float(ems.mean()), "change": float(ems.mean() - before.mean()),
                         "per_seed": ems.mean(axis=1).tolist()} for k, ems in after.items()},
            "start_em": float(before.mean()), "seeds": int(k0.shape[0]), "questions": int(k0.shape[1]),
            "difference": asdict(difference), "per_seed_difference": per_seed.tolist(),
            "t_interval": asdict(mean_interval(per_seed)),
            "sign_flip_p": sign_flip_p_value(per_seed), "decision": decision(difference)}


def read_runs(output: Path, seeds: list[int]) -> dict[str, Any]:
    """The comparison of the runs under ``output``, with the minutes of each arm's training and the K = 1 runs'
    staleness and sampler mismatch (means over their iterations and seeds)."""
    after = {k: np.stack([held_out_em(run_directory(output, k, seed), "after") for seed in seeds])
             for k in ARM_STALENESS}
    reading = compare(after, held_out_em(run_directory(output, 0, seeds[0]), "before"))
    rows = {k: [load_metrics(run_directory(output, k, seed)) for seed in seeds] for k in ARM_STALENESS}
    reading["training_minutes"] = {k: [sum(row["time_s"] for row in run) / 60 for run in runs]
                                   for k, runs in rows.items()}
    reading["k1_means"] = {key: float(np.mean([row[key] for run in rows[1] for row in run])) for key in K1_MEANS}
    return reading


def report(reading: dict[str, Any], seeds: list[int]) -> str:
    d, t = reading["difference"], reading["t_interval"]
    lines = [f"Command: `python benchmarks/pipelining_learning.py --seeds {' '.join(map(str, seeds))} --report`  ",
             f"Machine: {machine_description()}", "",
             "Protocol: docs/protocol_pipelining.md (committed before the runs). The CPU demo (SynthHop, Tree-GRPO "
             "(2,2,1), 8 prompts per iteration, 8 iterations, the cached start of start seed 0), one remote env "
             f"runner, the learner in the driver; training seeds {', '.join(map(str, seeds))}; held-out exact match "
             f"after the 8th iteration on all {reading['questions']} held-out questions, greedy.", "",
             "| K | held-out EM after | change from the start | per seed | training minutes per run |",
             "|---|---|---|---|---|"]
    for k in ARM_STALENESS:
        arm = reading["arms"][k]
        minutes = reading["training_minutes"][k]
        lines.append(f"| {k} | {arm['em']:.3f} | {arm['change']:+.3f} | "
                     f"{', '.join(f'{v:.3f}' for v in arm['per_seed'])} | {np.mean(minutes):.1f} |")
    lines += ["", f"Start policy: {reading['start_em']:.3f}.",
              f"**K = 1 - K = 0: {d['mean']:+.3f}, 95% interval [{d['low']:+.3f}, {d['high']:+.3f}]** (paired "
              f"bootstrap over seeds and questions); per-seed differences "
              f"{', '.join(f'{v:+.3f}' for v in reading['per_seed_difference'])}, t-interval "
              f"[{t['low']:+.3f}, {t['high']:+.3f}], exact sign-flip p {reading['sign_flip_p']:.3f}. "
              f"Decision (lower bound >= -{NOT_WORSE_MARGIN} is not worse): **{reading['decision']}**.",
              "K = 1 runs' means over iterations: " + ", ".join(f"{key} {value:.4f}" for key, value
                                                                 in reading["k1_means"].items()) + "."]
    return "\n".join(lines) + "\n"


def train_missing(output: Path, seeds: list[int]) -> None:
    """The protocol's runs that ``output`` lacks, each in its own process (its own Ray instance)."""
    for seed in seeds:
        for k in ARM_STALENESS:
            run = run_directory(output, k, seed)
            if (run / "demo.json").exists():
                continue
            print(f"K = {k}, seed {seed} ...", flush=True)
            subprocess.run([sys.executable, "experiments/demo.py", "--seed", str(seed), "--no-mlflow", "--output",
                            str(run), "--num-env-runners", "1", "--max-staleness", str(k)], check=True,
                           cwd=Path(__file__).resolve().parent.parent)


def record_problems(files: dict[Path, bytes], args: argparse.Namespace, copied: tuple[str, ...] = ()) -> list[str]:
    """What is wrong with one output's records against the protocol's runs (each K x ``args.seeds``, each with its
    demo.json and metrics.jsonl), one line each."""
    declared = {run_directory(Path(), k, seed) for k in ARM_STALENESS for seed in args.seeds} | {
        Path(name) for name in copied}
    return run_folder_problems(files, declared, ("demo.json", METRICS_FILE))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    p.add_argument("--output", default="outputs/pipelining")
    p.add_argument("--report", action="store_true", help=f"write section {SECTION_KEY} of its study's README")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    output = Path(args.output).resolve()
    train_missing(output, args.seeds)
    reading = read_runs(output, args.seeds)
    text = report(reading, args.seeds)
    (output / "pipelining_learning.json").write_text(json.dumps(reading, indent=1), encoding="utf-8")
    if args.report:
        replace_section(Path(__file__).resolve().parent.parent / section_file(SECTION_KEY, output), SECTION_KEY,
                        SECTION_TITLE, text)
    print(text)
    return reading


if __name__ == "__main__":
    main()
