"""Two looks at the same HotpotQA runs, the second after training them on (docs/protocol_hotpotqa_f3_40.md), read
from the two studies' compressed records: the pooled EM change from the start at the second look, at 95% and at
the Bonferroni level for two looks (97.5%); each seed's EM at both looks with the paired change between them; the
mixed-reward share over the iterations between the looks; each run's summed training seconds.

    python benchmarks/hotpotqa_looks.py results/hotpotqa_cpu_f3 results/hotpotqa_cpu_f3_40
"""

from __future__ import annotations

import argparse
import json
import tempfile
from dataclasses import asdict
from pathlib import Path

import numpy as np

from benchmarks.bench_hotpotqa import (
    finished_runs,
    interval,
    mixed_reward_share,
    restore_records,
    run_dir,
    run_rows,
    run_start,
)
from benchmarks.run_records import read_archive
from benchmarks.studies import ARCHIVE
from experiments.confidence import (
    paired_bootstrap_interval,
    paired_difference_interval,
    sign_flip_p_value,
)
from experiments.plot import METRICS_FILE, load_metrics

LEVELS = (0.95, 1 - 0.05 / 2)  # the declared level, and Bonferroni's over the two looks
ARM = "tree"


def unpack(records: Path, into: Path) -> Path:
    """A study's compressed records written out as its benchmark output folder (the archive's one top folder)."""
    names = {name.split("/", 1)[0] for name in read_archive(records / ARCHIVE)}
    if len(names) != 1:
        raise SystemExit(f"{records / ARCHIVE} should hold one benchmark output folder, it holds "
                         f"{sorted(names) or 'none'}")
    output = into / names.pop()
    restore_records(output, records)
    return output


def seeds_of(output: Path, arm: str) -> list[int]:
    candidates = sorted(int(path.name.rsplit("_s", 1)[1]) for path in output.glob(f"{arm}_s*"))
    return sorted(finished_runs(output, arm, candidates))


def looks(first: Path, second: Path, arm: str = ARM) -> dict:
    """The two looks (benchmark output folders of bench_hotpotqa.py) at ``arm``'s runs: the same seeds, each trained
    from the same start, the second look's runs trained on from the first's."""
    seeds = seeds_of(second, arm)
    if seeds != seeds_of(first, arm):
        raise SystemExit(f"the looks hold other seeds: {seeds_of(first, arm)} at the first, {seeds} at the second")
    per_seed, before, after = {}, [], []
    for seed in seeds:
        run_a, run_b = run_dir(first, arm, seed), run_dir(second, arm, seed)
        if run_start(run_a) != run_start(run_b):
            raise SystemExit(f"seed {seed} trained from the start {run_start(run_a)} at the first look and "
                             f"{run_start(run_b)} at the second: not the same run")
        start, rows_b = run_rows(second, run_b)
        _, rows_a = run_rows(first, run_a)
        trained_a, trained_b = (load_metrics(run / METRICS_FILE) for run in (run_a, run_b))
        between = trained_b[len(trained_a):]
        em = {name: [r["em"] for r in rows] for name, rows in (("start", start), ("first", rows_a), ("second", rows_b))}
        per_seed[seed] = {"iterations": [len(trained_a), len(trained_b)],
                          "em": {name: float(np.mean(values)) for name, values in em.items()},
                          "change_between_looks": asdict(paired_difference_interval(em["first"], em["second"])),
                          "mixed_reward_share_between_looks": mixed_reward_share(between) if between else None,
                          "training_s": float(sum(row.get("time_s") or 0.0 for row in trained_b))}
        before.append(em["start"])
        after.append(em["second"])
    changes = [s["em"]["second"] - s["em"]["start"] for s in per_seed.values()]
    return {"arm": arm, "seeds": seeds, "per_seed": per_seed,
            "pooled_change": {f"{level:.3f}": asdict(paired_bootstrap_interval(np.array(after), np.array(before),
                                                                                  confidence=level))
                              for level in LEVELS},
            "change_t_over_seeds": interval(changes),
            "sign_flip_p": sign_flip_p_value(changes)}


def markdown(summary: dict) -> str:
    pooled = ", ".join(f"{float(level):.1%} [{i['low']:+.3f}, {i['high']:+.3f}]"
                       for level, i in summary["pooled_change"].items())
    mean = next(iter(summary["pooled_change"].values()))["mean"]
    t = summary["change_t_over_seeds"]
    lines = [f"{summary['arm']}, {len(summary['seeds'])} seeds: EM change from the start at the second look "
             f"{mean:+.3f}, pooled (bootstrap) {pooled}; t over seeds [{t['low']:+.3f}, {t['high']:+.3f}], "
             f"sign-flip p {summary['sign_flip_p']:.3f}.", "",
             "| seed | iterations | EM start | EM first look | EM second look | second - first (t) | mixed rewards "
             "between | training minutes |", "|" + "---|" * 8]
    for seed, s in summary["per_seed"].items():
        c, mixed = s["change_between_looks"], s["mixed_reward_share_between_looks"]
        lines.append(f"| {seed} | {s['iterations'][0]} -> {s['iterations'][1]} | {s['em']['start']:.3f} | "
                     f"{s['em']['first']:.3f} | {s['em']['second']:.3f} | {c['mean']:+.3f} [{c['low']:+.3f}, "
                     f"{c['high']:+.3f}] | {'-' if mixed is None else format(mixed, '.3f')} | "
                     f"{s['training_s'] / 60:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("first", type=Path, help="the first look's study folder (its records.tar.xz)")
    parser.add_argument("second", type=Path, help="the second look's study folder (its records.tar.xz)")
    parser.add_argument("--output", type=Path, default=None, help="also write the summary here as JSON")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        first, second = (unpack(records, Path(scratch) / look) for look, records in (("1", args.first),
                                                                                    ("2", args.second)))
        summary = looks(first, second)
    if args.output:
        args.output.write_text(json.dumps(summary, indent=1), encoding="utf-8")
    print(markdown(summary))
    return summary


if __name__ == "__main__":
    main()
