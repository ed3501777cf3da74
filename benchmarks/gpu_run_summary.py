"""What a run on a lent GPU did, from its own records: where the learner ran, the seconds of each phase, the GPU's
busy share and its peak memory against the plan (``device_check.sh 2`` runs it after the mission's command).

    python benchmarks/gpu_run_summary.py RUN_DIR RUN_LOG GPU_SAMPLES [--output summary.md]

RUN_DIR: the run's output directory (its ``metrics.jsonl``); RUN_LOG: the run's printed output (the ``placement:``,
``learner:`` and ``memory plan:`` lines); GPU_SAMPLES: ``nvidia-smi --query-gpu=utilization.gpu,memory.used
--format=csv,noheader,nounits -lms 500`` lines taken while the run ran (per GPU per sample).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path

# the phases of an iteration, as metrics.jsonl names them: the rollout, the learner's no-gradient passes (old and
# reference log-probs, inside the update), the whole update, the weight sync
PHASES = (("rollout", "sample_time_s"), ("old + reference log-probs", "scoring_time_s"),
          ("update (all of it)", "update_time_s"), ("weight sync", "sync_time_s"), ("iteration", "time_s"))
LOG_LINES = ("placement:", "learner:", "memory plan:")


def gpu_samples(text: str) -> list[tuple[float, float]]:
    """(utilization %, memory used MiB) per line of nvidia-smi's csv; lines that are not two numbers are skipped."""
    samples = []
    for line in text.splitlines():
        fields = [field.strip() for field in line.split(",")]
        if len(fields) == 2 and all(re.fullmatch(r"\d+(\.\d+)?", field) for field in fields):
            samples.append((float(fields[0]), float(fields[1])))
    return samples


def phase_seconds(rows: list[dict]) -> dict[str, list[float]]:
    """Each phase's seconds per iteration (a phase a row lacks is left out of that row)."""
    return {name: [row[key] for row in rows if row.get(key) is not None] for name, key in PHASES}


def summary(rows: list[dict], log: str, samples: list[tuple[float, float]]) -> str:
    """The run in words: the log's placement and plan lines, a table of the phases, the busy share and the peak."""
    lines = [line.strip() for line in log.splitlines() if line.strip().startswith(LOG_LINES)]
    out = ["## The run", "", *(f"- `{line}`" for line in lines), "",
           "| phase | seconds per iteration |", "|---|---|"]
    for name, seconds in phase_seconds(rows).items():
        out.append(f"| {name} | {', '.join(f'{s:.1f}' for s in seconds) or 'n/a'} |")
    peaks = [row.get("learner_peak_memory_gib") for row in rows if row.get("learner_peak_memory_gib") is not None]
    out.append("")
    if samples:
        busy = statistics.fmean(u for u, _ in samples)
        out.append(f"- GPU busy share (nvidia-smi utilization, mean of {len(samples)} samples): {busy:.0f}%")
        out.append(f"- GPU memory used at most (nvidia-smi, the caching allocator's reserve included): "
                   f"{max(m for _, m in samples) / 1024:.1f} GiB")
    if peaks:
        out.append(f"- learner peak allocated per update (GiB): {', '.join(f'{p:.1f}' for p in peaks)}")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir")
    p.add_argument("run_log")
    p.add_argument("gpu_samples")
    p.add_argument("--output", default=None, help="also write the summary here")
    args = p.parse_args(argv)
    metrics = Path(args.run_dir) / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    samples_file = Path(args.gpu_samples)
    text = summary(rows, Path(args.run_log).read_text(errors="replace"),
                   gpu_samples(samples_file.read_text()) if samples_file.exists() else [])
    print(text)
    if args.output:
        Path(args.output).write_text(text)
    return text


if __name__ == "__main__":
    main()
