"""What a run on a lent GPU did, from its own records: where the learner ran, the seconds of each phase, the GPU's
busy share and its peak memory against the plan (``device_check.sh 2`` runs it after the mission's command); with
``--compare``, a demo run on the GPU beside one on the CPU (``device_check.sh learn``, issue 63 item 3).

    python benchmarks/gpu_run_summary.py RUN_DIR RUN_LOG GPU_SAMPLES [--compare CPU_DEMO_DIR] [--output summary.md]

RUN_DIR: the run's output directory (its ``metrics.jsonl``; a demo's also holds ``demo.json``); RUN_LOG: the run's
printed output (the ``placement:``, ``learner:`` and ``memory plan:`` lines); GPU_SAMPLES: ``nvidia-smi
--query-gpu=utilization.gpu,memory.used --format=csv,noheader,nounits -lms 500`` lines taken while the run ran (per
GPU per sample). CPU_DEMO_DIR: a folder with the ``metrics.jsonl`` and ``demo.json`` of ``experiments/demo.py`` run
on the CPU (the same task and start): the comparison gives held-out exact match before and after with 95% intervals
and the paired change for both runs, and each phase's seconds per iteration on the GPU beside the CPU's.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path

from experiments.plot import METRICS_FILE, load_metrics

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


def steady_mean(values: list[float]) -> float | None:
    """The mean seconds of the iterations after the first (which captures CUDA graphs, builds indexes and fills
    caches); the first alone when it is the only one; None without any."""
    rest = values[1:] or values
    return statistics.fmean(rest) if rest else None


def phase_comparison(gpu_rows: list[dict], cpu_rows: list[dict]) -> list[tuple[str, float | None, float | None,
                                                                                float | None]]:
    """Per phase: (name, the GPU's first iteration, the GPU's mean of the rest, the CPU's mean of the rest)."""
    gpu, cpu = phase_seconds(gpu_rows), phase_seconds(cpu_rows)
    return [(name, gpu[name][0] if gpu[name] else None, steady_mean(gpu[name]), steady_mean(cpu[name]))
            for name in gpu]


def em_row(label: str, demo: dict) -> str:
    """A table row of a demo's held-out exact match (``demo.json``): before, after, the paired change, and whether
    the change's 95% interval leaves out 0."""
    em = demo["metrics"]["em"]

    def text(part: dict) -> str:
        return f"{part['mean']:.3f} [{part['low']:.3f}, {part['high']:.3f}]"

    beyond = not em["change"]["low"] <= 0.0 <= em["change"]["high"]
    return (f"| {label} | {text(em['before'])} | {text(em['after'])} | {text(em['change'])} | "
            f"{'yes' if beyond else 'no'} |")


def learning_comparison(gpu_demo: dict | None, gpu_rows: list[dict], cpu_demo: dict | None,
                        cpu_rows: list[dict]) -> str:
    """The demo on the GPU beside the demo on the CPU: held-out exact match before and after (95% intervals, the
    paired change; ``demo.json``'s), then each phase's seconds per iteration (``metrics.jsonl``'s)."""
    out = ["## The demo on the GPU beside the CPU demo", ""]
    demos = [(label, demo) for label, demo in (("GPU", gpu_demo), ("CPU", cpu_demo)) if demo is not None]
    if demos:
        questions = {len(demo["questions"]["before"]) for _, demo in demos if "questions" in demo}
        out += [f"Held-out exact match, greedy ({' / '.join(map(str, sorted(questions))) or '?'} questions; 95% "
                f"intervals):", "", "| run | before | after | change (paired) | beyond noise |",
                "|---|---|---|---|---|",
                *(em_row(label, demo) for label, demo in demos), ""]
        if gpu_demo is not None:
            change = gpu_demo["metrics"]["em"]["change"]
            verdict = ("a gain beyond the noise" if change["low"] > 0 else
                       "a loss beyond the noise" if change["high"] < 0 else
                       "no change beyond the noise: a finding of why not is owed")
            curve = ", ".join(f"{iteration}: {em['mean']:.3f}" for iteration, em in gpu_demo["held_out_em"].items())
            out += [f"- GPU: {verdict}; held-out exact match by iteration {curve}"]
        if gpu_demo is not None and cpu_demo is not None and len(questions) == 1:
            same = gpu_demo["metrics"]["em"]["before"]["mean"] == cpu_demo["metrics"]["em"]["before"]["mean"]
            out += [f"- the start's held-out exact match is {'the same' if same else 'NOT the same'} on both machines "
                    f"(one start, evaluated in float32 on each machine's CPU)"]
        out.append("")
    out += ["Seconds per iteration by phase (the first iteration apart: CUDA graphs captured, the index built):", "",
            "| phase | GPU: iteration 1 | GPU: mean of the rest | CPU: mean of the rest | CPU / GPU |",
            "|---|---|---|---|---|"]

    def cell(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.2f}"

    for name, first, gpu, cpu in phase_comparison(gpu_rows, cpu_rows):
        ratio = f"{cpu / gpu:.2f}x" if gpu and cpu is not None else "n/a"
        out.append(f"| {name} | {cell(first)} | {cell(gpu)} | {cell(cpu)} | {ratio} |")
    out.append(f"\nIterations: GPU {len(gpu_rows)}, CPU {len(cpu_rows)}.")
    return "\n".join(out) + "\n"


def run_rows(run_dir: Path) -> list[dict]:
    """A run's metrics rows (none when it wrote none: stopped before its first iteration)."""
    return load_metrics(run_dir) if (run_dir / METRICS_FILE).exists() else []


def read_demo(run_dir: Path) -> dict | None:
    """A demo run's ``demo.json`` (None when it did not finish)."""
    path = run_dir / "demo.json"
    return json.loads(path.read_text()) if path.exists() else None


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir")
    p.add_argument("run_log")
    p.add_argument("gpu_samples")
    p.add_argument("--compare", default=None, metavar="CPU_DEMO_DIR",
                   help="a CPU demo run's metrics.jsonl and demo.json: RUN_DIR is then a demo run on the GPU, and "
                        "the summary ends with the two side by side")
    p.add_argument("--output", default=None, help="also write the summary here")
    args = p.parse_args(argv)
    run_dir, log = Path(args.run_dir), Path(args.run_log)
    rows = run_rows(run_dir)
    samples_file = Path(args.gpu_samples)
    text = summary(rows, log.read_text(errors="replace") if log.exists() else "",
                   gpu_samples(samples_file.read_text()) if samples_file.exists() else [])
    if args.compare:
        text += "\n" + learning_comparison(read_demo(run_dir), rows, read_demo(Path(args.compare)),
                                           run_rows(Path(args.compare)))
    print(text)
    if args.output:
        Path(args.output).write_text(text)
    return text


if __name__ == "__main__":
    main()
