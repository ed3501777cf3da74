"""Pipelining benchmark: one-step off-policy sampling (``--max-staleness 1``) against the synchronous loop, in
iterations per hour and generated tokens per second, on the CPU demo's task, in one run.

    python benchmarks/bench_pipelining.py                    # 4 arms, 6 iterations each (~10 min on 2 idle cores)
    python benchmarks/bench_pipelining.py --arms sync-default ahead-default --repeats 3   # run.py's defaults
    python benchmarks/bench_pipelining.py --iterations 8 --report

Every arm is the demo's training run (``experiments/demo.py``: the small SynthHop world, the cached start policy,
Tree-GRPO (2,2,1), 8 prompts per iteration, its learning rate and micro-batches), seed 0, with one remote env runner
and the learner in the driver (``--num-learners 0``), each arm in a fresh process (its own Ray instance). The arms
differ in ``--max-staleness`` and in the torch threads of the runner (``--num-cpus-per-env-runner``: Ray sets the
actor's ``OMP_NUM_THREADS`` to its CPUs) and of the learner (``--learner-threads``), both at the same priority
(run.py starts Ray's workers at nice 0, as the driver); a ``default`` arm sets neither, as run.py's defaults:

- ``sync-default``: K = 0 at run.py's defaults (the runner on its 1 CPU's thread, the learner on torch's, every core);
- ``ahead-default``: K = 1 at run.py's defaults (the runner on 1 thread, the learner on the cores it leaves);
- ``sync-1-2``: K = 0, the runner on 1 thread, the learner on 2 (run.py's defaults on a 2-core machine);
- ``sync-2-2``: K = 0, both on 2 threads (each phase has the machine to itself: the fair synchronous baseline);
- ``ahead-1-1``: K = 1, one thread each (one core each while they overlap: run.py's defaults on 2 cores);
- ``ahead-1-2``: K = 1, the runner on 1 thread, the learner on 2 (3 threads on 2 cores: run.py's defaults before
  the learner left the runner its cores).

``--repeats R`` runs the arms R times, interleaved (every arm once per round, in turn), so that a change in the
machine's load touches every arm alike; the 1-minute load average is logged before and after each run. Per arm and
run, over the iterations after the first ``--warmup`` (the first iteration of K = 1 samples before it can overlap,
and every arm's first one loads and packs its weights): the wall-clock seconds of ``Algorithm.train()`` per
iteration, iterations per hour, generated tokens per second (the trained batches' tokens over those seconds), and
the means of the runner's sampling seconds, the update's, the sync's and, with K = 1, the wait for the sample taken
ahead; the report gives their means over the rounds. The ratio is each arm's iterations per hour over the faster
synchronous arm's of the same round, its mean and range over the rounds. Writes ``--output`` (pipelining.json,
pipelining.md) and with ``--report`` section ``pipelining`` of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.report import machine_description, replace_section

SECTION_KEY, SECTION_TITLE = "pipelining", "Pipelining: one-step off-policy sampling against the synchronous loop (CPU)"


@dataclass(frozen=True)
class Arm:
    """One setting: the staleness and the threads of the runner and of the learner (None: run.py's default)."""

    label: str
    max_staleness: int
    runner_threads: int | None
    learner_threads: int | None


ARMS = {
    "sync-default": Arm("K = 0, run.py's default threads", 0, None, None),
    "ahead-default": Arm("K = 1, run.py's default threads (split)", 1, None, None),
    "sync-1-2": Arm("K = 0, runner 1 thread, learner 2 (run.py's defaults on 2 cores)", 0, 1, 2),
    "sync-2-2": Arm("K = 0, runner 2 threads, learner 2", 0, 2, 2),
    "ahead-1-1": Arm("K = 1, runner 1 thread, learner 1 (run.py's defaults on 2 cores)", 1, 1, 1),
    "ahead-1-2": Arm("K = 1, runner 1 thread, learner 2 (run.py's defaults before the split)", 1, 1, 2),
}
DEFAULT_ARMS = ("sync-default", "sync-2-2", "ahead-default", "ahead-1-2")
START_TEXT = {"demo": "the demo's start policy",
              "scratch": "the demo's start architecture with random weights (every step runs to the 48-token cap)"}
TIMES = ("sample_time_s", "update_time_s", "sync_time_s", "sample_wait_time_s")  # per-iteration means reported


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arms", nargs="+", default=list(DEFAULT_ARMS), choices=list(ARMS))
    p.add_argument("--iterations", type=int, default=6)
    p.add_argument("--repeats", type=int, default=1, help="rounds of the arms, interleaved (every arm once per round)")
    p.add_argument("--warmup", type=int, default=1, help="first iterations left out of the figures")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start", choices=("demo", "scratch"), default="demo",
                   help="the start policy: demo (the demo's, trained once and cached: about 13 minutes on 2 idle "
                        "cores the first time) or scratch (its architecture with random weights: every step runs to "
                        "the token cap, so the iterations are longer than the demo's)")
    p.add_argument("--output", default="outputs/bench_pipelining")
    p.add_argument("--report", action="store_true", help="write the pipelining section of docs/benchmarks.md")
    p.add_argument("--arm", choices=list(ARMS), help=argparse.SUPPRESS)  # internal: run one arm in this process
    args = p.parse_args(argv)
    if not 0 <= args.warmup < args.iterations:
        p.error(f"--warmup must be in [0, --iterations), got {args.warmup}")
    if args.repeats < 1:
        p.error(f"--repeats must be at least 1, got {args.repeats}")
    return args


def start_model(start: str, output: Path) -> Path:
    """The start policy's directory: the demo's (cached), or its architecture with random weights (written once
    into ``output``)."""
    from envs.cache import default_cache_dir
    from experiments.demo import start_policy
    from experiments.warmstart import build_model
    from experiments.warmstart import parse_args as warm_start_args

    if start == "demo":
        return start_policy(0, default_cache_dir())
    directory = output / "scratch_model"
    if not (directory / "config.json").exists():
        model, tokenizer = build_model(warm_start_args([]))
        model.save_pretrained(directory)
        tokenizer.save_pretrained(directory)
    return directory


def run_arm(arm: Arm, iterations: int, seed: int, model: Path, output: Path) -> list[dict[str, Any]]:
    """The demo's training run from ``model`` under ``arm`` in this process: per iteration the wall-clock seconds
    of ``train()`` and the row's tokens, times and staleness (``output``: the run's directory, where nothing is
    written)."""
    from ray.rllib.utils.metrics import ENV_RUNNER_RESULTS

    from algos.tree_grpo import metrics as metric_keys
    from envs.cache import default_cache_dir
    from envs.synthetic import world_data_dir
    from experiments.demo import WORLD, task_options
    from experiments.preflight import check_before_ray, start_ray
    from experiments.run import plan
    from experiments.settings import build_config

    threads = [*(["--num-cpus-per-env-runner", str(arm.runner_threads)] if arm.runner_threads else []),
               *(["--learner-threads", str(arm.learner_threads)] if arm.learner_threads else [])]
    options = [*task_options(world_data_dir(WORLD, default_cache_dir()), model, seed), "--num-env-runners", "1",
               *threads, "--max-staleness", str(arm.max_staleness), "--iterations", str(iterations), "--quiet",
               "--no-mlflow", "--trees-every", "0", "--output", str(output)]
    settings = plan(options).settings
    check_before_ray(settings)
    start_ray(settings)
    algo = build_config(settings).build_algo()
    rows = []
    try:
        for _ in range(iterations):
            start = time.perf_counter()
            result = algo.train()
            runners = result[ENV_RUNNER_RESULTS]
            rows.append({"wall_s": time.perf_counter() - start,
                         "tokens_generated": runners[metric_keys.TOKENS_GENERATED],
                         "sample_time_s": runners[metric_keys.SAMPLE_TIME_S],
                         **{key: result[key] for key in (metric_keys.UPDATE_TIME_S, metric_keys.SYNC_TIME_S,
                                                         metric_keys.SAMPLE_WAIT_TIME_S, metric_keys.STALENESS)}})
    finally:
        algo.stop()
    return rows


def summary(rows: list[dict[str, Any]], warmup: int) -> dict[str, float]:
    """An arm's figures over its iterations after the first ``warmup``."""
    measured = rows[warmup:]
    seconds = sum(row["wall_s"] for row in measured)
    return {"s_per_iteration": seconds / len(measured), "iterations_per_hour": 3600 * len(measured) / seconds,
            "tokens_per_s": sum(row["tokens_generated"] for row in measured) / seconds,
            **{key: statistics.mean(row[key] for row in measured) for key in TIMES},
            "staleness": max(row["staleness"] for row in measured)}


def ratios(rounds: dict[str, list[dict[str, float]]]) -> dict[str, list[float]]:
    """Each arm's iterations per hour over the faster synchronous arm's of the same round ({} without one)."""
    synchronous = [name for name in rounds if ARMS[name].max_staleness == 0]
    if not synchronous:
        return {}
    baselines = [max(rounds[name][index]["iterations_per_hour"] for name in synchronous)
                 for index in range(len(rounds[synchronous[0]]))]
    return {name: [run["iterations_per_hour"] / baseline for run, baseline in zip(runs, baselines, strict=True)]
            for name, runs in rounds.items()}


def report(args: argparse.Namespace, rounds: dict[str, list[dict[str, float]]], loads: list[float]) -> str:
    """The markdown section: one row per arm, its figures' means over the rounds (``rounds``: each arm's summaries,
    one per round) and the ratio against the faster synchronous arm of each round; ``loads``: the 1-minute load
    averages logged around the runs."""
    by_arm = ratios(rounds)
    lines = [f"Command: `python benchmarks/bench_pipelining.py --arms {' '.join(args.arms)} --iterations "
             f"{args.iterations} --warmup {args.warmup} --repeats {args.repeats} --seed {args.seed} --start "
             f"{args.start}`  ",
             f"Machine: {machine_description()}; 1-minute load average around the runs "
             f"{min(loads):.2f}-{max(loads):.2f}" if loads else f"Machine: {machine_description()}", "",
             "The CPU demo's training run (`experiments/demo.py`: SynthHop, Tree-GRPO (2,2,1), 8 prompts per "
             f"iteration) from {START_TEXT[args.start]}, seed {args.seed}, one remote env runner, the learner in the "
             f"driver; {args.iterations} iterations per arm, the first {args.warmup} left out, {args.repeats} "
             f"round(s) of the arms, interleaved. Seconds are the wall clock of `Algorithm.train()`; tokens per second "
             f"are the trained batches' generated tokens over them; each figure is the mean over the rounds.", "",
             "| arm | setting | s / iteration | iterations / hour | tokens / s | x the faster K = 0 | sampling s | "
             "update s | sync s | wait s |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, runs in rounds.items():
        mean = {key: statistics.mean(run[key] for run in runs) for key in runs[0]}
        spread = by_arm.get(name, [])
        ratio = (f"{statistics.mean(spread):.2f}" + (f" ({min(spread):.2f}-{max(spread):.2f})" if len(spread) > 1
                                                     else "")) if spread else "-"
        lines.append(f"| {name} | {ARMS[name].label} | {mean['s_per_iteration']:.1f} | "
                     f"{mean['iterations_per_hour']:.0f} | {mean['tokens_per_s']:.0f} | {ratio} | "
                     f"{mean['sample_time_s']:.1f} | {mean['update_time_s']:.1f} | {mean['sync_time_s']:.2f} | "
                     f"{mean['sample_wait_time_s']:.1f} |")
    lines += ["", "Sampling s: the runner's own seconds per iteration; wait s: how long the driver waited, after the "
                  "update, for the sample taken ahead (K = 1; the rest of the sampling hid behind the update); the "
                  "ratio's range: over the rounds."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, list[dict[str, float]]]:
    args = parse_args(argv)
    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    if args.arm:  # a child: one arm, its rows to stdout's last line
        model = start_model(args.start, output)
        print(json.dumps(run_arm(ARMS[args.arm], args.iterations, args.seed, model, output / args.arm)))
        return {}
    start_model(args.start, output)  # trained or written once, before the arms
    rounds: dict[str, list[dict[str, float]]] = {name: [] for name in args.arms}
    rows: dict[str, list[list[dict[str, Any]]]] = {name: [] for name in args.arms}
    loads: list[dict[str, Any]] = []
    for index in range(args.repeats):
        for name in args.arms:
            before = os.getloadavg()[0]
            print(f"round {index + 1}/{args.repeats}, {name}: {ARMS[name].label} (load average {before:.2f}) ...",
                  flush=True)
            child = subprocess.run([sys.executable, __file__, "--arm", name, "--iterations", str(args.iterations),
                                    "--seed", str(args.seed), "--start", args.start, "--output", str(output)],
                                   check=True, stdout=subprocess.PIPE, text=True)
            rows[name].append(json.loads(child.stdout.strip().splitlines()[-1]))
            rounds[name].append(summary(rows[name][-1], args.warmup))
            loads.append({"round": index, "arm": name, "before": before, "after": os.getloadavg()[0]})
            print(f"  {rounds[name][-1]['s_per_iteration']:.1f} s per iteration, "
                  f"{rounds[name][-1]['tokens_per_s']:.0f} tokens/s (load average {loads[-1]['after']:.2f})",
                  flush=True)
    text = report(args, rounds, [load[key] for load in loads for key in ("before", "after")])
    (output / "pipelining.json").write_text(json.dumps(
        {"settings": vars(args), "arms": {name: asdict(ARMS[name]) for name in rounds}, "rows": rows,
         "rounds": rounds, "ratios": ratios(rounds), "load_averages": loads}, indent=1), encoding="utf-8")
    (output / "pipelining.md").write_text(text, encoding="utf-8")
    if args.report:
        replace_section(Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md", SECTION_KEY, SECTION_TITLE,
                        text)
    print(text)
    return rounds


if __name__ == "__main__":
    main()
