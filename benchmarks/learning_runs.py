"""The runs of a learning benchmark (``bench_learning``, ``bench_branching``): one training run per setting and seed
from one start policy, each resumable and evaluated greedily on held-out questions, and the loop over them that
rewrites the report after each run.

A run is ``experiments/run.py`` into OUTPUT/SETTING/seedS; its final checkpoint is evaluated on the first
--eval-questions held-out questions and the scores saved beside it (``held_out.json``, with the run's options), so
that with --resume benchmarks split over processes (--seeds) or interrupted reuse every finished run.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.learning_options import design_options
from benchmarks.learning_report import command_header, write_docs_section, write_results
from benchmarks.learning_testbed import DEFAULT_MAX_TURNS, Testbed
from envs.retrieval.corpus import replace_atomically
from experiments.plot import METRICS_FILE, load_metrics

FINAL_EVALUATION = "held_out.json"  # a run's final held-out scores, keyed by its options: the run has finished
START_POINT = "start_point.json"  # the start policy's held-out scores, keyed by its path


@contextlib.contextmanager
def exclusive(lock: Path):
    """Hold an exclusive lock on the file ``lock`` while the block runs: of several processes sharing --output
    with --resume, the first trains the warm start and evaluates the start point, and the others, waiting here,
    reuse them."""
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def held_out_scores(testbed: Testbed, policy: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Greedy results of ``policy`` (a model directory or a run's checkpoint) on the first --eval-questions
    held-out questions, one dict of ``algos.evaluation.EVAL_COLUMNS``, ``hops`` (and ``route``) per question."""
    from experiments.evaluate import world_held_out

    return world_held_out(policy, testbed.data_dir, args.eval_questions, args.max_step_tokens, testbed.topk,
                          env_id=testbed.env, max_turns=testbed.max_turns)


def max_turns_options(testbed: Testbed) -> list[str]:
    """run.py's ``--max-turns`` where the testbed's questions need more searches than its default (else none, so
    the runs of other testbeds keep their command lines, and a resume its runs)."""
    return [] if testbed.max_turns == DEFAULT_MAX_TURNS else ["--max-turns", str(testbed.max_turns)]


def run_directory(setting: str, seed: int, output: Path) -> Path:
    return output / setting.replace(" ", "_").replace(",", "").replace("(", "").replace(")", "") / f"seed{seed}"


def run_options(testbed: Testbed, setting: str, seed: int, model_dir: str, args: argparse.Namespace,
                directory: Path) -> list[str]:
    """run.py's options for one training run of ``setting`` from ``model_dir`` into ``directory``."""
    return [*testbed.settings[setting][1], "--env", testbed.env, "--data-dir", str(testbed.data_dir),
            "--topk", str(testbed.topk), *max_turns_options(testbed), "--model", model_dir, "--seed", str(seed),
            "--iterations", str(args.iterations), "--prompts-per-iter", str(args.prompts_per_iter),
            "--lr", str(args.lr),
            *([] if args.warmup_steps is None else ["--warmup-steps", str(args.warmup_steps)]),
            *design_options(args),
            "--max-step-tokens", str(args.max_step_tokens), "--eval-every", str(args.eval_every),
            "--eval-questions", str(args.curve_questions), "--micro-batch-size", "16", "--checkpoint-every", "0",
            "--trees-every", "0", "--no-mlflow", "--quiet", "--output", str(directory),
            *(testbed.probe.options if testbed.probe else ())]


def train_run(testbed: Testbed, setting: str, seed: int, model_dir: str, args: argparse.Namespace,
              output: Path) -> Path:
    """One training run from ``model_dir`` (then the testbed's probe, if any); its metrics.jsonl. The final checkpoint
    is what gets evaluated."""
    from experiments.run import main as run

    directory = run_directory(setting, seed, output)
    if directory.exists():
        shutil.rmtree(directory)  # a fresh run: run.py refuses a directory that already holds one
    run(run_options(testbed, setting, seed, model_dir, args, directory))
    if testbed.probe is not None:
        testbed.probe.measure(directory)
    return directory / METRICS_FILE


def finished_run(testbed: Testbed, setting: str, seed: int, model_dir: str, args: argparse.Namespace,
                 output: Path) -> tuple[list[dict], list[dict[str, Any]]]:
    """(metrics rows, held-out scores) of one run. With --resume, a finished run in its directory is reused: its
    scores when its options and evaluation match this one's; its final checkpoint, evaluated again, when only the
    evaluation or the --output it was trained under differ (another --eval-questions; a run copied from a pilot).
    Otherwise (or if none) trained and evaluated now."""
    directory = run_directory(setting, seed, output)
    options = run_options(testbed, setting, seed, model_dir, args, directory)
    record, checkpoint = directory / FINAL_EVALUATION, directory / "checkpoints" / "latest"

    def train_and_evaluate() -> list[dict[str, Any]]:
        if args.resume and checkpoint.exists() and trained_with(record, options):
            print(f"reusing the trained run in {directory}: evaluating its final checkpoint again")
        else:
            train_run(testbed, setting, seed, model_dir, args, output)
        return held_out_scores(testbed, str(checkpoint), args)

    key = {"run": options, "eval_questions": args.eval_questions}
    scores = scores_once(record, key, args.resume, train_and_evaluate)
    return load_metrics(directory / METRICS_FILE), scores


def trained_with(record: Path, options: list[str]) -> bool:
    """Whether the run whose evaluation ``record`` holds was trained with run.py ``options``, wherever it was trained
    (--output aside). A fresh training deletes its directory first, so a record there belongs to what it holds."""
    if not record.exists():
        return False
    saved = json.loads(record.read_text(encoding="utf-8")).get("run") or []
    return without_output(saved) == without_output(options)


def without_output(options: list[str]) -> list[str]:
    """run.py's options less ``--output DIR``."""
    if "--output" not in options:
        return list(options)
    at = options.index("--output")
    return options[:at] + options[at + 2:]


def comparable(key: dict[str, Any]) -> dict[str, Any]:
    """``key`` with its run.py options (``run``) less ``--output DIR``."""
    return {k: without_output(v) if k == "run" and v is not None else v for k, v in key.items()}


def start_point_scores(testbed: Testbed, model_dir: str, args: argparse.Namespace,
                       output: Path) -> list[dict[str, Any]]:
    """The start point's held-out scores (reused with --resume, as ``finished_run`` does)."""
    key = {"model": model_dir, "eval_questions": args.eval_questions, "max_step_tokens": args.max_step_tokens}
    return scores_once(output / START_POINT, key, args.resume,
                       lambda: held_out_scores(testbed, model_dir, args))


def scores_once(record: Path, key: dict, resume: bool,
                compute: Callable[[], list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The scores saved in ``record`` under ``key`` when ``resume`` and they exist; else ``compute()``'s, saved
    there with their key. A key's run.py options match less ``--output`` (the same run's folder, spelt relative or
    absolute, or copied from another benchmark's output)."""
    if resume and record.exists():
        saved = json.loads(record.read_text(encoding="utf-8"))
        if comparable({k: saved.get(k) for k in key}) == comparable(key):
            print(f"reusing {record}")
            return saved["scores"]
    scores = compute()
    # whole or absent: a records save running beside (run_records.py) never keeps half of it
    replace_atomically(record, lambda staged: staged.write_text(json.dumps({**key, "scores": scores}),
                                                                encoding="utf-8"))
    return scores


def run_benchmark(testbed: Testbed, args: argparse.Namespace, warm_start: Callable[[], Path],
                  argv: list[str] | None, script: str) -> Path:
    """Every setting x seed of ``args`` from the start policy (``--warm``, else ``warm_start()``), seed-major (an
    interrupted benchmark still compares every setting), the results rewritten after each run; with --report, the
    testbed's section of its study's README and its plot beside it (``write_docs_section``); with --start-only,
    only the start policy and its evaluation. Returns OUTPUT/NAME.md."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with exclusive(output / "start.lock"):
        warm = str(Path(args.warm or warm_start()).resolve())
        before = start_point_scores(testbed, warm, args, output)
    print(f"start point {warm}: dev EM {np.mean([row['em'] for row in before]):.3f}")
    if args.start_only:
        return output / f"{testbed.name}.md"
    runs: dict[str, list[list[dict]]] = {setting: [] for setting in args.settings}
    finals: dict[str, list[list[dict]]] = {setting: [] for setting in args.settings}
    for seed in args.seeds:
        for setting in args.settings:
            rows, scores = finished_run(testbed, setting, seed, warm, args, output)
            runs[setting].append(rows)
            finals[setting].append(scores)
            table, plot = write_results(testbed, {k: v for k, v in runs.items() if v}, finals, before, args, warm,
                                        time.perf_counter() - start, output)
    print(table)
    if args.report:
        write_docs_section(testbed, args, table, plot, command_header(script, argv))
    return output / f"{testbed.name}.md"
