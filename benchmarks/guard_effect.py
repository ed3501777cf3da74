"""What the saturation guard (``run.py --stop-after-uniform K``) changes: one setting's runs of a learning benchmark
without and with it, seed by seed, read by the rule of docs/protocol_branching.md ("The saturation guard ...").

    python benchmarks/guard_effect.py --unguarded outputs/bench_branching_start_misroute_0.85_chair \
        --guarded outputs/bench_branching_start_misroute_0.85_chair_stop_after_uniform_3 --report

Each run is a benchmark run directory (``metrics.jsonl`` and the final evaluation ``held_out.json``). Per seed: the
iterations, tokens generated, largest KL, last training reward and final dev EM of both runs. A seed *collapses*
where its unguarded run ends below ``COLLAPSE_BELOW``; the guard *prevents* the collapse if every collapsing seed's
guarded run ends at ``RECOVERED_AT`` or more, and *costs nothing* if, over the other seeds, the paired 95% interval
of guarded - unguarded final dev EM lies above ``-COST_MARGIN``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from benchmarks.learning_runs import FINAL_EVALUATION, run_directory
from benchmarks.learning_stats import em_matrix
from experiments.confidence import Interval, paired_bootstrap_interval
from experiments.plot import load_metrics

# the protocol's decision rule (declared 2026-11-28, before the runs)
COLLAPSE_BELOW = 0.5  # an unguarded final dev EM below this is a collapse (the learned runs end at 0.89-0.96)
RECOVERED_AT = 0.9  # a guarded run at a collapsing seed ends at the learned runs' level
COST_MARGIN = 0.05  # on the other seeds, the guard may not cost more than this much final dev EM
SECTION = "saturation-guard"


@dataclass(frozen=True)
class RunRecord:
    """What the comparison reads of one finished run."""

    iterations: int
    tokens: int
    largest_kl: float
    last_reward: float
    scores: list[dict]

    @property
    def em(self) -> float:
        return float(np.mean([row["em"] for row in self.scores]))


def run_record(directory: Path) -> RunRecord:
    """``directory``'s training iterations (rows with a training reward) and final evaluation; FileNotFoundError
    naming what is missing when the run has not finished."""
    evaluation = directory / FINAL_EVALUATION
    if not evaluation.is_file():
        raise FileNotFoundError(f"{evaluation}: not found; the run in {directory} has no final evaluation yet "
                                f"(run its benchmark command, with --resume, to finish it)")
    rows = [row for row in load_metrics(directory) if row.get("reward_mean") is not None]
    return RunRecord(iterations=len(rows), tokens=int(sum(row.get("tokens_generated") or 0 for row in rows)),
                     largest_kl=float(max((row.get("kl") or 0.0) for row in rows)),
                     last_reward=float(rows[-1]["reward_mean"]),
                     scores=json.loads(evaluation.read_text(encoding="utf-8"))["scores"])


def paired_em(unguarded: list[RunRecord], guarded: list[RunRecord]) -> Interval:
    """guarded - unguarded final dev EM over these seeds x their questions, with its 95% paired bootstrap."""
    return paired_bootstrap_interval(em_matrix([run.scores for run in guarded]),
                                     em_matrix([run.scores for run in unguarded]))


def guard_reading(unguarded: dict[int, RunRecord], guarded: dict[int, RunRecord]) -> dict:
    """The decision rule on runs keyed by seed (the same seeds in both): the collapsing seeds, whether the guard
    prevented each collapse, and its paired cost over the other seeds (None where every seed collapsed)."""
    if sorted(unguarded) != sorted(guarded):
        raise ValueError(f"the guarded and unguarded runs need the same seeds, got {sorted(guarded)} and "
                         f"{sorted(unguarded)}")
    collapsing = [seed for seed in sorted(unguarded) if unguarded[seed].em < COLLAPSE_BELOW]
    others = [seed for seed in sorted(unguarded) if seed not in collapsing]
    cost = paired_em([unguarded[s] for s in others], [guarded[s] for s in others]) if others else None
    return {
        "collapsing_seeds": collapsing,
        "prevented": bool(collapsing) and all(guarded[seed].em >= RECOVERED_AT for seed in collapsing),
        "on_collapsing": paired_em([unguarded[s] for s in collapsing], [guarded[s] for s in collapsing])
        if collapsing else None,
        "cost_on_others": cost,
        "costs_nothing": cost is not None and cost.low > -COST_MARGIN,
    }


def markdown(unguarded: dict[int, RunRecord], guarded: dict[int, RunRecord], reading: dict) -> str:
    """The per-seed table and the rule's reading."""
    def interval(value: Interval | None) -> str:
        return "none" if value is None else f"{value.mean:+.3f} [{value.low:+.3f}, {value.high:+.3f}]"

    if not reading["collapsing_seeds"]:
        prevention = "nothing to prevent"
    else:
        prevention = "prevented" if reading["prevented"] else "not prevented"
    lines = [f"Runs: the same setting and seeds without and with the guard; final dev EM "
             f"greedy on each run's evaluated held-out questions. Decision rule (docs/protocol_branching.md): a seed "
             f"collapses below {COLLAPSE_BELOW} unguarded; the guard prevents it at >= {RECOVERED_AT} guarded; it "
             f"costs nothing where the other seeds' paired interval lies above -{COST_MARGIN}.", "",
             "| seed | iterations (unguarded / guarded) | tokens generated | largest KL | last training reward "
             "| final dev EM | collapses |", "|---|---|---|---|---|---|---|"]
    for seed in sorted(unguarded):
        a, b = unguarded[seed], guarded[seed]
        lines.append(f"| {seed} | {a.iterations} / {b.iterations} | {a.tokens:,} / {b.tokens:,} | "
                     f"{a.largest_kl:.3f} / {b.largest_kl:.3f} | {a.last_reward:.2f} / {b.last_reward:.2f} | "
                     f"{a.em:.3f} / {b.em:.3f} | {'yes' if seed in reading['collapsing_seeds'] else 'no'} |")
    lines += ["", f"- Collapsing seeds: {reading['collapsing_seeds'] or 'none'}; guarded - unguarded there: "
                  f"{interval(reading['on_collapsing'])}; {prevention}.",
              f"- Guarded - unguarded on the other seeds: {interval(reading['cost_on_others'])}; "
              f"{'costs nothing (above the margin)' if reading['costs_nothing'] else 'a cost not ruled out'}."]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--unguarded", type=Path, required=True, help="the benchmark output of the runs without the guard")
    p.add_argument("--guarded", type=Path, required=True, help="the benchmark output of the runs with it")
    p.add_argument("--setting", default="tree (2,2,1) uniform", help="the benchmark setting compared")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    p.add_argument("--report", action="store_true", help=f"write the {SECTION} section of its study's README")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    from benchmarks.report import machine_description, replace_section
    from benchmarks.studies import section_file

    args = parse_args(argv)
    unguarded = {seed: run_record(run_directory(args.setting, seed, args.unguarded)) for seed in args.seeds}
    guarded = {seed: run_record(run_directory(args.setting, seed, args.guarded)) for seed in args.seeds}
    reading = guard_reading(unguarded, guarded)
    command = shlex.join(["python", "benchmarks/guard_effect.py", *(sys.argv[1:] if argv is None else argv)])
    table = markdown(unguarded, guarded, reading)
    print(table)
    if args.report:
        replace_section(section_file(SECTION, args.guarded), SECTION,
                        f"The saturation guard (issue 47): {args.setting} without and with it",
                        f"Command: `{command}`. Machine: {machine_description()}.\n\n{table}")
    return reading


if __name__ == "__main__":
    main()
