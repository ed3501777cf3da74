"""What the learning benchmarks share (``bench_learning``, ``bench_branching``): a testbed (a generated world, its
settings and the comparisons between them), one training run per setting and seed from one start policy, each
resumable and evaluated greedily on held-out questions, and the report: the summary table with bootstrap
intervals, paired differences with what a power analysis needs, the failure mix and the curves.

A run is ``experiments/run.py`` into OUTPUT/SETTING/seedS; its final checkpoint is evaluated on the first
--eval-questions held-out questions and the scores saved beside it (``held_out.json``, with the run's options), so
that with --resume benchmarks split over processes (--seeds) or interrupted reuse every finished run.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import json
import math
import os
import shlex
import shutil
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from algos.evaluation import failure_mix, occurring_failures, routing
from algos.tree_grpo.settings import TreeGRPOSettings
from benchmarks.plateau_exit import (
    SILENT_GRAD_NORM,
    first_passage_tokens,
    plateau_exit_tokens,
    silent_update_share,
)
from envs.synthetic import BranchSpec, WorldSpec, world_data_dir
from experiments.confidence import (
    Interval,
    bootstrap_interval,
    detectable_difference,
    mean_interval,
    paired_bootstrap_interval,
    seeds_for_power,
)
from experiments.plot import load_metrics, plot_runs
from policies.generation import SamplingSettings

# the difference the issue-27 protocol must be able to see (EM), the default of --delta
DELTA = 0.03
# benchmark option -> (run.py's option, what it is): design choices a benchmark can set for every setting
DESIGN_OPTIONS = {"top_p": ("--top-p", "rollouts' top-p"), "entropy_coef": ("--entropy-coef", "entropy bonus")}
# the same for the options every run is given (run_options): a design choice where set away from the benchmark's
# default, which the parser records in ``schedule_defaults``
SCHEDULE_OPTIONS = {"lr": ("--lr", "lr"), "warmup_steps": ("--warmup-steps", "warm-up steps")}
# the two speed outcomes, keys of a setting's summary: tokens to leave the plateau for good (the fourth design's),
# tokens to first reach the threshold (the fifth's)
PLATEAU_EXIT, FIRST_PASSAGE = "plateau_exit_per_seed", "first_passage_per_seed"


@dataclass(frozen=True)
class Testbed:
    """One benchmark's task and settings. ``settings``: name -> (nominal budget in full chains, run.py options);
    ``comparisons``: (a, b) pairs whose paired difference a - b is reported (a >= b: the direction expected)."""

    name: str  # OUTPUT/NAME.md, NAME.json, NAME.png and the docs section's key
    title: str  # the docs section's title
    env: str
    world: WorldSpec | BranchSpec
    topk: int
    settings: Mapping[str, tuple[int, list[str]]]
    comparisons: tuple[tuple[str, str], ...]
    # dev EM above which a run's curve has left the plateau for good (benchmarks/plateau_exit.py); None: not reported
    plateau_threshold: float | None = None

    @property
    def data_dir(self) -> Path:
        return world_data_dir(self.world)


def add_run_options(p: argparse.ArgumentParser, settings: list[str], *, seeds: list[int] | None, iterations: int,
                    eval_every: int, section: str, warmup_steps: int | None = None) -> None:
    """The options every learning benchmark has: which settings and seeds, the runs' shared hyperparameters, the
    evaluations, --output, --report and --resume."""
    p.add_argument("--warm", default=None, help="start policy's model directory (default: the benchmark's warm start)")
    p.add_argument("--settings", nargs="+", default=settings, choices=settings)
    p.add_argument("--seeds", type=int, nargs="+", default=seeds)
    p.add_argument("--iterations", type=int, default=iterations)
    p.add_argument("--prompts-per-iter", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--warmup-steps", type=non_negative_int, default=warmup_steps,
                   help="optimizer steps of learning-rate warm-up, the same for every setting (default: %(default)s; "
                        "None: run.py's, the paper's share of the --iterations cap's steps, 0.285 for trees and 0.5 "
                        "for chains)")
    p.set_defaults(schedule_defaults={"lr": p.get_default("lr"), "warmup_steps": warmup_steps})
    p.add_argument("--eval-every", type=int, default=eval_every, help="learning-curve evaluations every k iterations")
    p.add_argument("--curve-questions", type=int, default=100, help="held-out questions of each curve point")
    p.add_argument("--eval-questions", type=int, default=300, help="held-out questions of the final evaluation")
    # Not the project's default cap (128 on CPU): generated-world steps are short (about 50 tokens for a whole
    # SynthHop leaf in the rollout benchmark), so 64 holds any step a warm start writes and cuts runaway ones early
    # on a CPU; it is also warmstart.py's dev-evaluation cap, so a warm start's dev EM and the runs' are alike.
    p.add_argument("--max-step-tokens", type=int, default=64)
    p.add_argument("--top-p", type=top_p_option, default=None,
                   help=f"nucleus of the rollouts' sampling, the same for every setting (default: run.py's, "
                        f"{SamplingSettings().top_p})")
    p.add_argument("--entropy-coef", type=non_negative_float, default=None,
                   help=f"entropy bonus of the update, the same for every setting (default: run.py's, "
                        f"{TreeGRPOSettings.model_fields['entropy_coef'].default})")
    p.add_argument("--delta", type=float, default=DELTA,
                   help="the EM difference the power analysis sizes the benchmark for (seeds needed at 80%% power)")
    p.add_argument("--output", default=None,
                   help="where the runs and results go (default: the benchmark's outputs/bench_NAME, with the design "
                        "choices set, e.g. --top-p, in its name: design_output)")
    p.add_argument("--report", action="store_true", help=f"write the {section} section of docs/benchmarks.md")
    p.add_argument("--resume", action="store_true",
                   help="reuse what --output holds: the start point's evaluation and the finished runs whose options "
                        "match, e.g. after an interruption, or to report on seeds run by several processes")


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0 (the option's name is added by argparse to the error)."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def non_negative_float(text: str) -> float:
    """argparse type: a number >= 0."""
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def top_p_option(text: str) -> float:
    """argparse type: a nucleus mass in (0, 1]."""
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    return value


def check_eval_questions(p: argparse.ArgumentParser, args: argparse.Namespace, testbed: Testbed) -> None:
    if not 1 <= args.eval_questions <= testbed.world.dev_questions:
        p.error(f"--eval-questions must be in [1, {testbed.world.dev_questions}] (the world's held-out questions), "
                f"got {args.eval_questions}")


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
                          env_id=testbed.env)


def run_directory(setting: str, seed: int, output: Path) -> Path:
    return output / setting.replace(" ", "_").replace(",", "").replace("(", "").replace(")", "") / f"seed{seed}"


def run_options(testbed: Testbed, setting: str, seed: int, model_dir: str, args: argparse.Namespace,
                directory: Path) -> list[str]:
    """run.py's options for one training run of ``setting`` from ``model_dir`` into ``directory``."""
    return [*testbed.settings[setting][1], "--env", testbed.env, "--data-dir", str(testbed.data_dir),
            "--topk", str(testbed.topk), "--model", model_dir, "--seed", str(seed), "--iterations",
            str(args.iterations), "--prompts-per-iter", str(args.prompts_per_iter), "--lr", str(args.lr),
            *([] if args.warmup_steps is None else ["--warmup-steps", str(args.warmup_steps)]),
            *design_options(args),
            "--max-step-tokens", str(args.max_step_tokens), "--eval-every", str(args.eval_every),
            "--eval-questions", str(args.curve_questions), "--micro-batch-size", "16", "--checkpoint-every", "0",
            "--trees-every", "0", "--no-mlflow", "--quiet", "--output", str(directory)]


def design_options(args: argparse.Namespace) -> list[str]:
    """run.py's options for the design choices set on the benchmark (``DESIGN_OPTIONS``); none for run.py's
    defaults, so the runs of a design that keeps them are the runs made before these options existed."""
    return [item for name, (flag, _) in DESIGN_OPTIONS.items() if getattr(args, name) is not None
            for item in (flag, str(getattr(args, name)))]


def design_choices(args: argparse.Namespace) -> list[tuple[str, str, float]]:
    """(run.py's option, what it is, value) of each design choice set on the benchmark: the ``DESIGN_OPTIONS``
    given at all, the ``SCHEDULE_OPTIONS`` given away from the benchmark's defaults."""
    defaults = {**dict.fromkeys(DESIGN_OPTIONS), **getattr(args, "schedule_defaults", {})}
    return [(flag, what, getattr(args, name)) for name, (flag, what) in {**DESIGN_OPTIONS, **SCHEDULE_OPTIONS}.items()
            if name in defaults and getattr(args, name) != defaults[name]]


def design_suffix(args: argparse.Namespace) -> str:
    """``-top-p-1-entropy-coef-0.01``-like: the design choices set on the benchmark, for its outputs' names."""
    return "".join(f"-{flag.strip('-')}-{value:g}" for flag, _, value in design_choices(args))


def with_design(testbed: Testbed, args: argparse.Namespace) -> Testbed:
    """The testbed under the design choices set on the benchmark: its section and files named after them, so a
    design's report sits beside the first design's instead of over it."""
    chosen = [f"{what} {value:g}" for _, what, value in design_choices(args)]
    if not chosen:
        return testbed
    return dataclasses.replace(testbed, name=testbed.name + design_suffix(args),
                               title=f"{testbed.title}, {', '.join(chosen)}")


def design_output(base: str, args: argparse.Namespace) -> str:
    """The default --output of a benchmark (``base``) under its design choices: a design's runs never share a
    directory with another's (a run of other options in a setting's directory would be trained over)."""
    return base + design_suffix(args).replace("-", "_")


def train_run(testbed: Testbed, setting: str, seed: int, model_dir: str, args: argparse.Namespace,
              output: Path) -> Path:
    """One training run from ``model_dir``; its metrics.jsonl. The final checkpoint is what gets evaluated."""
    from experiments.run import main as run

    directory = run_directory(setting, seed, output)
    if directory.exists():
        shutil.rmtree(directory)  # a fresh run: run.py refuses a directory that already holds one
    run(run_options(testbed, setting, seed, model_dir, args, directory))
    return directory / "metrics.jsonl"


def finished_run(testbed: Testbed, setting: str, seed: int, model_dir: str, args: argparse.Namespace,
                 output: Path) -> tuple[list[dict], list[dict[str, Any]]]:
    """(metrics rows, held-out scores) of one run. With --resume, a finished run in its directory is reused: its
    scores when its options and evaluation match this one's; its final checkpoint, evaluated again, when only the
    evaluation or the --output it was trained under differ (another --eval-questions; a run copied from a pilot).
    Otherwise (or if none) trained and evaluated now."""
    directory = run_directory(setting, seed, output)
    options = run_options(testbed, setting, seed, model_dir, args, directory)
    record, checkpoint = directory / "held_out.json", directory / "checkpoints" / "latest"

    def train_and_evaluate() -> list[dict[str, Any]]:
        if args.resume and checkpoint.exists() and trained_with(record, options):
            print(f"reusing the trained run in {directory}: evaluating its final checkpoint again")
        else:
            train_run(testbed, setting, seed, model_dir, args, output)
        return held_out_scores(testbed, str(checkpoint), args)

    key = {"run": options, "eval_questions": args.eval_questions}
    scores = scores_once(record, key, args.resume, train_and_evaluate)
    return load_metrics(directory / "metrics.jsonl"), scores


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


def start_point_scores(testbed: Testbed, model_dir: str, args: argparse.Namespace,
                       output: Path) -> list[dict[str, Any]]:
    """The start point's held-out scores (reused with --resume, as ``finished_run`` does)."""
    key = {"model": model_dir, "eval_questions": args.eval_questions, "max_step_tokens": args.max_step_tokens}
    return scores_once(output / "start_point.json", key, args.resume,
                       lambda: held_out_scores(testbed, model_dir, args))


def scores_once(record: Path, key: dict, resume: bool,
                compute: Callable[[], list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The scores saved in ``record`` under ``key`` when ``resume`` and they exist; else ``compute()``'s, saved
    there with their key."""
    if resume and record.exists():
        saved = json.loads(record.read_text(encoding="utf-8"))
        if {k: saved.get(k) for k in key} == key:
            print(f"reusing {record}")
            return saved["scores"]
    scores = compute()
    record.write_text(json.dumps({**key, "scores": scores}), encoding="utf-8")
    return scores


def em_matrix(scores: list[list[dict[str, Any]]]) -> np.ndarray:
    """Seeds x questions of exact match."""
    return np.array([[row["em"] for row in seed] for seed in scores], dtype=float)


def reward_first_and_last(rows: list[dict], share: float = 0.1) -> tuple[float, float]:
    """The mean training reward (sampled, the policy's own) of a run's first and last ``share`` of iterations
    (at least one each): whether the policy improved on what it trains on, which a threshold metric like greedy
    EM can hide."""
    count = max(1, math.ceil(share * len(rows)))
    rewards = [row["reward_mean"] for row in rows]
    return float(np.mean(rewards[:count])), float(np.mean(rewards[-count:]))


def summarize(testbed: Testbed, runs: dict[str, list[list[dict]]], finals: dict[str, list[list[dict]]],
              before: list[dict[str, Any]]) -> dict[str, dict]:
    """Per setting: the final dev EM over seeds x questions with its bootstrap interval, per-seed means, the
    failure mix and routing (where the world has routes), tool calls, tokens (per run and per prompt) and seconds
    per seed, the training reward of the first and last tenth of iterations (means over seeds)."""
    summary = {}
    for setting, seeds in runs.items():
        em, pooled = em_matrix(finals[setting]), [row for seed in finals[setting] for row in seed]
        tokens = [int(sum(r["tokens_generated"] or 0 for r in rows)) for rows in seeds]
        prompts = [int(sum(r.get("prompts") or 0 for r in rows)) for rows in seeds]
        summary[setting] = {
            "budget": testbed.settings[setting][0],
            "dev_em_before": interval_dict(mean_interval([row["em"] for row in before])),
            "dev_em": interval_dict(bootstrap_interval(em)),
            "dev_em_per_seed": [float(v) for v in em.mean(axis=1)],
            "failures_before": failure_mix(before),
            "failures": failure_mix(pooled),
            "routing_before": routing(before),
            "routing": routing(pooled),
            "tool_calls": float(np.mean([[row["tool_calls"] for row in seed] for seed in finals[setting]])),
            "tokens_generated_per_seed": tokens,
            "tokens_per_prompt": float(sum(tokens) / sum(prompts)) if sum(prompts) else None,
            "iterations_per_seed": [len(rows) for rows in seeds],
            "tool_calls_per_seed": [int(sum(r["tool_calls"] or 0 for r in rows)) for rows in seeds],
            "seconds_per_seed": [float(sum(r["time_s"] or 0 for r in rows)) for rows in seeds],
            "reward_first_last": [float(v) for v in np.mean([reward_first_and_last(rows) for rows in seeds], axis=0)],
        }
        if testbed.plateau_threshold is not None:
            summary[setting][PLATEAU_EXIT] = [plateau_exit_tokens(rows, testbed.plateau_threshold) for rows in seeds]
            summary[setting][FIRST_PASSAGE] = [first_passage_tokens(rows, testbed.plateau_threshold) for rows in seeds]
            summary[setting]["silent_update_share_per_seed"] = [silent_update_share(rows) for rows in seeds]
    return summary


def compare(testbed: Testbed, finals: dict[str, list[list[dict]]], delta: float = DELTA) -> dict[str, dict]:
    """Every comparison whose two settings ran on the same seeds: the paired bootstrap interval of a - b, and what
    a power analysis needs: the standard deviation of the per-question paired differences (``sd_paired``, over
    seeds x questions), that of the per-seed mean differences (``sd_seed_means``, None with one seed), the smallest
    difference these cells detect at 80% power, and the seeds at this many questions that ``delta`` needs."""
    out = {}
    for a, b in testbed.comparisons:
        if finals.get(a) and finals.get(b) and len(finals[a]) == len(finals[b]):
            ems_a, ems_b = em_matrix(finals[a]), em_matrix(finals[b])
            differences = ems_a - ems_b
            sd = float(differences.std(ddof=1)) if differences.size > 1 else 0.0
            seeds, questions = differences.shape
            sd_seeds = float(differences.mean(axis=1).std(ddof=1)) if seeds > 1 else None
            out[f"{a} - {b}"] = {
                **interval_dict(paired_bootstrap_interval(ems_a, ems_b)),
                "sd_paired": sd,
                "sd_seed_means": sd_seeds,
                "cells": int(differences.size),
                "detectable": detectable_difference(sd, differences.size),
                # the same from the per-seed means: what the seeds can see when they, not the questions, set the
                # spread (the cells are then not independent, and ``detectable`` is too optimistic)
                "detectable_over_seeds": detectable_difference(sd_seeds, seeds) if sd_seeds is not None else None,
                "seeds_for_delta": seeds_for_power(sd, delta, questions=questions) if sd > 0 else None,
            }
    return out


def exit_tokens_per_seed(summary: dict[str, dict], runs: dict[str, list[list[dict]]], setting: str,
                         outcome: str = PLATEAU_EXIT) -> list[int]:
    """Each seed's tokens to the speed ``outcome`` (``PLATEAU_EXIT`` or ``FIRST_PASSAGE``); a run that never got
    there counts as the tokens it generated in all (its budget, as the protocol's speed outcome counts it)."""
    return [int(rows[-1]["tokens_generated_total"]) if tokens is None else tokens
            for tokens, rows in zip(summary[setting][outcome], runs[setting], strict=True)]


def compare_exit_tokens(testbed: Testbed, summary: dict[str, dict], runs: dict[str, list[list[dict]]],
                        outcome: str = PLATEAU_EXIT) -> dict[str, dict]:
    """Every comparison whose two settings ran on the same seeds, in tokens to the speed ``outcome``: the mean
    paired difference a - b over seeds (negative: a got there sooner) with its bootstrap interval over seeds, the sd
    of the per-seed differences (what sizes the seeds) and the smallest difference in tokens that this many seeds
    detect at 80% power with that sd (``detectable_difference``). Empty where the testbed reports no plateau."""
    out = {}
    if testbed.plateau_threshold is None:
        return out
    for a, b in testbed.comparisons:
        if a in summary and b in summary and len(runs[a]) == len(runs[b]):
            tokens_a, tokens_b = (np.array(exit_tokens_per_seed(summary, runs, s, outcome), dtype=float)
                                  for s in (a, b))
            differences = tokens_a - tokens_b
            sd = float(differences.std(ddof=1)) if differences.size > 1 else None
            out[f"{a} - {b}"] = {  # the bootstrap takes seeds x questions: one "question" per seed here
                **interval_dict(paired_bootstrap_interval(tokens_a[:, None], tokens_b[:, None])),
                "sd_seed_differences": sd,
                "detectable": None if sd is None else detectable_difference(sd, differences.size),
            }
    return out


def interval_dict(interval: Interval) -> dict[str, float]:
    return {"mean": interval.mean, "low": interval.low, "high": interval.high}


def verdict(difference: dict[str, float]) -> str:
    """Whether a - b >= 0 (the direction expected) holds beyond the noise, is reversed beyond it, or neither."""
    if difference["low"] > 0:
        return "a > b beyond the noise: the expected direction holds"
    if difference["high"] < 0:
        return "a < b beyond the noise: the expected direction does not hold here"
    return "inside the noise: no difference shown"


def mean_rows(seeds: list[list[dict]], before: float) -> list[dict]:
    """Rows averaged over seeds, iteration by iteration, after the start point (iteration 0) (for the plot);
    ``dev_em_std`` is the spread over seeds."""
    by_iteration: dict[int, list[dict]] = {0: [{"iteration": 0, "tokens_generated": 0, "tool_calls": 0,
                                                "reward_mean": float("nan"), "dev_em": before}]}
    for rows in seeds:
        for row in rows:
            by_iteration.setdefault(row["iteration"], []).append(row)
    out = []
    for it, rows in sorted(by_iteration.items()):
        devs = [r["dev_em"] for r in rows if r.get("dev_em") is not None]
        out.append({"iteration": it, "tokens_generated": float(np.mean([r["tokens_generated"] or 0 for r in rows])),
                    "tool_calls": float(np.mean([r.get("tool_calls") or 0 for r in rows])),
                    "reward_mean": float(np.mean([r["reward_mean"] for r in rows])),
                    "dev_em": float(np.mean(devs)) if devs else None,
                    "dev_em_std": float(np.std(devs)) if devs else None})
    return out


def _interval(d: dict[str, float]) -> str:
    return f"{d['mean']:.3f} [{d['low']:.3f}, {d['high']:.3f}]"


def _share(value: float | None) -> str:
    return "-" if value is None or np.isnan(value) else f"{value:.3f}"


def markdown(summary: dict[str, dict], differences: dict[str, dict], args: argparse.Namespace, warm: str,
             wall_s: float, plateau_threshold: float | None = None,
             exit_differences: dict[str, dict[str, dict]] | None = None) -> str:
    """The report: the settings' table, the failure mix, the speed outcomes per seed, the paired differences of
    final dev EM and, per speed outcome (``exit_differences``: outcome -> ``compare_exit_tokens``), in tokens."""
    run_minutes = sum(sum(s["seconds_per_seed"]) for s in summary.values()) / 60
    budget = getattr(args, "token_budget", None)
    length = (f"each run until it has generated its token budget (T = {budget:,}; the iteration that reaches it "
              f"ends the run), at most {args.iterations} iterations" if budget else f"{args.iterations} iterations")
    first = next(iter(summary.values()), None)
    routed = bool(first and first["routing_before"])
    warmup = ("the paper's share of the cap's steps" if args.warmup_steps is None
              else f"{args.warmup_steps} optimizer steps")
    nucleus = SamplingSettings().top_p if args.top_p is None else args.top_p
    bonus = TreeGRPOSettings.model_fields["entropy_coef"].default if args.entropy_coef is None else args.entropy_coef
    lines = [f"Warm start: `{warm}`; {args.prompts_per_iter} prompts per iteration, {length}, lr {args.lr} "
             f"(warm-up: {warmup}), entropy bonus {bonus}, rollouts sampled at temperature 1, top-p {nucleus}, seeds "
             f"{args.seeds}; final dev EM: greedy, on the first {args.eval_questions} held-out questions, mean over "
             f"seeds x questions with its 95% bootstrap interval (seeds and questions resampled). Training "
             f"iterations, summed over the runs: {run_minutes:.0f} min (from their metrics; warm start and final "
             f"evaluations not included); this invocation: {wall_s / 60:.0f} min (runs reused with --resume cost it "
             f"nothing).", ""]
    if routed:
        start = first["routing_before"]
        lines += [f"Start point: routed right on {start['routed_right']:.3f} of the held-out questions (the second "
                  f"search names the question's person); EM on those {_share(start['em_routed_right'])} (the "
                  f"testbed's copying check asks >= 0.9).", ""]
    header = ("| setting | budget (chains, nominal) | tokens generated per run (measured) | tokens per prompt | "
              "iterations per run | dev EM before | dev EM after [95% interval] | per seed | "
              + ("routed right (after) | EM on routed right (after) | " if routed else "")
              + "tool calls per question (after) | tool calls per run | training reward (first -> last tenth) | "
              "minutes per run |")
    lines += [header, "|---" * (header.count("|") - 1) + "|"]
    for setting, s in summary.items():
        seeds = ", ".join(f"{v:.3f}" for v in s["dev_em_per_seed"])
        per_prompt = "-" if s["tokens_per_prompt"] is None else f"{s['tokens_per_prompt']:,.0f}"
        reward_first, reward_last = s["reward_first_last"]
        routing_cells = (f"{_share(s['routing'].get('routed_right'))} | "
                         f"{_share(s['routing'].get('em_routed_right'))} | " if routed else "")
        lines.append(f"| {setting} | {s['budget']} | {np.mean(s['tokens_generated_per_seed']):,.0f} | {per_prompt} | "
                     f"{np.mean(s['iterations_per_seed']):.1f} | {_interval(s['dev_em_before'])} | "
                     f"{_interval(s['dev_em'])} | {seeds} | {routing_cells}{s['tool_calls']:.2f} | "
                     f"{np.mean(s['tool_calls_per_seed']):,.0f} | {reward_first:.3f} -> {reward_last:.3f} | "
                     f"{np.mean(s['seconds_per_seed']) / 60:.1f} |")
    mixes = ([("start point", first["failures_before"])] if first else []) + [
        (setting, s["failures"]) for setting, s in summary.items()]
    kinds = occurring_failures(*(mix for _, mix in mixes))
    lines += ["", "Failure mix of the held-out questions (shares; after: pooled over seeds):", "",
              "| setting | " + " | ".join(kinds) + " |", "|---" * (len(kinds) + 1) + "|"]
    lines += [f"| {name} | " + " | ".join(f"{mix.get(kind, 0.0):.2f}" for kind in kinds) + " |" for name, mix in mixes]
    lines += plateau_table(summary, args, plateau_threshold)
    if differences:
        lines += ["", "Paired differences of final dev EM (a - b; same seeds, same questions; 95% paired bootstrap), "
                      "with what a power analysis needs: the std of the per-question paired differences over seeds x "
                      "questions, that of the per-seed mean differences, the smallest difference these cells detect "
                      "at 80% power (two-sided, 5%) if they were independent and from the per-seed means (the one to "
                      "read when seeds differ more than their questions explain), and the seeds at "
                      f"{args.eval_questions} questions that {args.delta} EM needs (experiments/confidence.py, "
                      "`seeds_for_power`):", "",
                  "| a - b | difference [95% interval] | reading | sd paired | sd of seed means | detectable (cells) | "
                  f"detectable (seed means) | seeds for {args.delta} |", "|---|---|---|---|---|---|---|---|"]
        lines += [f"| {name} | {_interval(d)} | {verdict(d)} | {d['sd_paired']:.3f} | {_share(d['sd_seed_means'])} "
                  f"| {d['detectable']:.3f} | {_share(d['detectable_over_seeds'])} | {d['seeds_for_delta'] or '-'} |"
                  for name, d in differences.items()]
    for outcome, outcome_differences in (exit_differences or {}).items():
        lines += exit_tokens_table(outcome_differences, outcome)
    return "\n".join(lines) + "\n"


# per speed outcome: what it is, and the verb of a run that got there
OUTCOME_WORDS = {PLATEAU_EXIT: ("to leave the plateau", "left", "a run that stayed"),
                 FIRST_PASSAGE: ("to first reach the threshold (the first curve point at or above it, whatever "
                                 "follows)", "reached it", "a run that never reached it")}


def exit_tokens_table(differences: dict[str, dict], outcome: str = PLATEAU_EXIT) -> list[str]:
    """The paired differences in tokens to the speed ``outcome`` (``compare_exit_tokens``); no lines without any."""
    if not differences:
        return []
    what, verb, never = OUTCOME_WORDS[outcome]
    lines = ["", f"Paired differences in tokens {what} (a - b over the same seeds; negative: a {verb} sooner; {never} "
                 "counts as all the tokens it generated; 95% bootstrap over seeds), with the sd of the per-seed "
                 "differences and the smallest difference these seeds detect with it (80% power, two-sided, 5%):", "",
             "| a - b | difference in tokens [95% interval] | reading | sd of seed differences | detectable |",
             "|---|---|---|---|---|"]
    for name, d in differences.items():
        reading = (f"a {verb} sooner beyond the noise" if d["high"] < 0 else
                   f"a {verb} later beyond the noise" if d["low"] > 0 else "inside the noise")
        sd, detectable = ("-" if d.get(key) is None else f"{d[key]:,.0f}"
                          for key in ("sd_seed_differences", "detectable"))
        lines.append(f"| {name} | {d['mean']:+,.0f} [{d['low']:+,.0f}, {d['high']:+,.0f}] | {reading} | {sd} | "
                     f"{detectable} |")
    return lines


def plateau_table(summary: dict[str, dict], args: argparse.Namespace, threshold: float | None) -> list[str]:
    """Where each run's curve left the plateau (the tokens at the first curve point from which every later one is
    >= the threshold; "stayed" if its last point is below it), per setting and seed, and how many runs left it;
    no lines where the testbed does not report it."""
    if threshold is None:
        return []
    lines = ["", f"Plateau exit (benchmarks/plateau_exit.py, threshold {threshold}): tokens generated "
                 f"when the dev EM curve (first {args.curve_questions} held-out questions) reached the threshold and "
                 f"stayed at or above it to the run's end; \"stayed\": its last point is below. After \"first\": the "
                 f"tokens at its first curve point at or above the threshold, whatever follows (\"never\": none). In "
                 f"parentheses: the share of the run's second half of iterations whose gradient norm was below "
                 f"{SILENT_GRAD_NORM} (silent updates: every prompt's leaves rewarded alike).", "",
             "| setting | " + " | ".join(f"seed {seed}" for seed in args.seeds) + " | runs that left / reached it |",
             "|---" * (len(args.seeds) + 2) + "|"]
    for setting, s in summary.items():
        exits, firsts = s[PLATEAU_EXIT], s[FIRST_PASSAGE]
        cells = [f"{_tokens(tokens, 'stayed')}; first {_tokens(first, 'never')}"
                 + ("" if share is None else f" ({share:.2f})")
                 for tokens, first, share in zip(exits, firsts, s["silent_update_share_per_seed"], strict=True)]
        cells += [""] * (len(args.seeds) - len(cells))  # seeds not run yet
        left, reached = (sum(tokens is not None for tokens in per_seed) for per_seed in (exits, firsts))
        lines.append(f"| {setting} | " + " | ".join(cells) + f" | {left} / {reached} of {len(exits)} |")
    return lines


def _tokens(tokens: int | None, none: str) -> str:
    return none if tokens is None else f"{tokens:,}"


def write_results(testbed: Testbed, runs: dict[str, list[list[dict]]], finals: dict[str, list[list[dict]]],
                  before: list[dict[str, Any]], args: argparse.Namespace, warm: str, wall_s: float,
                  output: Path) -> tuple[str, Path]:
    """OUTPUT/NAME.md, NAME.json and NAME.png for the runs so far; (the table, the plot's path)."""
    summary, differences = summarize(testbed, runs, finals, before), compare(testbed, finals, args.delta)
    exit_differences = {outcome: compare_exit_tokens(testbed, summary, runs, outcome)
                        for outcome in (PLATEAU_EXIT, FIRST_PASSAGE)}
    table = markdown(summary, differences, args, warm, wall_s, testbed.plateau_threshold, exit_differences)
    (output / f"{testbed.name}.md").write_text(table, encoding="utf-8")
    payload = {"settings": vars(args), "world": testbed.world.key, "summary": summary, "differences": differences,
               "exit_token_differences": exit_differences}
    (output / f"{testbed.name}.json").write_text(json.dumps(payload, indent=1), encoding="utf-8")
    # the curves' questions: the first --curve-questions held-out ones, the start point's included
    start = float(np.mean([row["em"] for row in before[: args.curve_questions]]))
    plot = plot_runs({name: mean_rows(seeds, start) for name, seeds in runs.items()}, output / f"{testbed.name}.png",
                     metrics=("dev_em", "reward_mean"))
    return table, plot


def run_benchmark(testbed: Testbed, args: argparse.Namespace, warm_start: Callable[[], Path],
                  argv: list[str] | None, script: str) -> Path:
    """Every setting x seed of ``args`` from the start policy (``--warm``, else ``warm_start()``), seed-major (an
    interrupted benchmark still compares every setting), the results rewritten after each run; with --report, the
    testbed's section of docs/benchmarks.md and its plot docs/NAME.png. Returns OUTPUT/NAME.md."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with exclusive(output / "start.lock"):
        warm = str(Path(args.warm or warm_start()).resolve())
        before = start_point_scores(testbed, warm, args, output)
    print(f"start point {warm}: dev EM {np.mean([row['em'] for row in before]):.3f}")
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
        from benchmarks.report import compact_plot_copy, machine_description, replace_section

        command = shlex.join(["python", script, *(sys.argv[1:] if argv is None else argv)])
        docs_plot = compact_plot_copy(plot, Path("docs") / f"{testbed.name}.png")
        replace_section("docs/benchmarks.md", testbed.name, testbed.title,
                        f"Command: `{command}`. Machine: {machine_description()}.\n\n{table}\n"
                        f"![dev EM and training reward, mean over seeds]({docs_plot.name})\n\n"
                        f"Plot: `{docs_plot}` (a copy of `{plot}`): dev EM on the first {args.curve_questions} "
                        f"held-out questions and the training reward, mean over seeds against iterations, tokens "
                        f"generated and tool calls (dev EM with a band of one std over seeds).\n")
    return output / f"{testbed.name}.md"
