"""The report of a learning benchmark: the markdown (the settings' table, the failure mix, the plateau exits, the
paired differences in EM and in the time to each speed outcome in tokens, iterations and optimizer steps),
OUTPUT/NAME.md, NAME.json and NAME.png, and its section of its study's README (``results/STUDY/README.md``)."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Any

import numpy as np

from algos.evaluation import occurring_failures
from algos.tree_grpo.settings import TreeGRPOSettings
from benchmarks.learning_stats import (
    ALPHA,
    FIRST_PASSAGE,
    PLATEAU_EXIT,
    compare,
    compare_times,
    mean_rows,
    summarize,
)
from benchmarks.learning_testbed import Testbed
from benchmarks.plateau_exit import ITERATIONS, OPTIMIZER_STEPS, SILENT_GRAD_NORM, TOKENS, UNITS
from experiments.plot import plot_runs
from policies.generation import SamplingSettings

# the speed outcomes' tables, in this order: (outcome, unit)
TIME_TABLES = ((FIRST_PASSAGE, TOKENS), (FIRST_PASSAGE, ITERATIONS), (FIRST_PASSAGE, OPTIMIZER_STEPS),
               (PLATEAU_EXIT, TOKENS))


def verdict(difference: dict[str, float]) -> str:
    """Whether a - b >= 0 (the direction expected) holds beyond the noise, is reversed beyond it, or neither: beyond
    it only where the Holm-adjusted p-value is below ``ALPHA`` (the bootstrap interval alone is too narrow at few
    seeds)."""
    if difference["p_holm"] >= ALPHA:
        return "inside the noise: no difference shown"
    if difference["mean"] > 0:
        return "a > b beyond the noise: the expected direction holds"
    return "a < b beyond the noise: the expected direction does not hold here"


def _p(value: float) -> str:
    return f"{value:.3f}"


def _interval(d: dict[str, float]) -> str:
    return f"{d['mean']:.3f} [{d['low']:.3f}, {d['high']:.3f}]"


def _share(value: float | None) -> str:
    return "-" if value is None or np.isnan(value) else f"{value:.3f}"


def markdown(summary: dict[str, dict], differences: dict[str, dict], args: argparse.Namespace, warm: str,
             wall_s: float, plateau_threshold: float | None = None,
             time_differences: dict[tuple[str, str], dict[str, dict]] | None = None) -> str:
    """The report: the settings' table, the failure mix, the speed outcomes per seed, the paired differences of
    final dev EM and, per speed outcome and unit (``time_differences``: (outcome, unit) -> ``compare_times``), in
    time to it."""
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
    signal = {setting: s["nonzero_advantage_share"] for setting, s in summary.items()
              if s.get("nonzero_advantage_share") is not None}
    if signal:
        lines += ["", "Share of an iteration's prompts with a non-zero advantage (the prompts an update learns from; "
                      "mean over iterations and seeds): " + "; ".join(f"{setting} {share:.3f}"
                                                                       for setting, share in signal.items()) + "."]
    mixes = ([("start point", first["failures_before"])] if first else []) + [
        (setting, s["failures"]) for setting, s in summary.items()]
    kinds = occurring_failures(*(mix for _, mix in mixes))
    lines += ["", "Failure mix of the held-out questions (shares; after: pooled over seeds):", "",
              "| setting | " + " | ".join(kinds) + " |", "|---" * (len(kinds) + 1) + "|"]
    lines += [f"| {name} | " + " | ".join(f"{mix.get(kind, 0.0):.2f}" for kind in kinds) + " |" for name, mix in mixes]
    lines += plateau_table(summary, args, plateau_threshold)
    if differences:
        lines += ["", "Paired differences of final dev EM (a - b; same seeds, same questions). The tests that hold at "
                      f"few seeds are over the {len(args.seeds)} per-seed mean differences: their Student-t 95% "
                      "interval and p-value and the exact sign-flip p-value (all 2^n sign assignments); the reading "
                      f"uses the sign-flip p Holm-adjusted over the table's {len(differences)} comparisons (beyond the "
                      f"noise where below {ALPHA}). Beside them the 95% paired bootstrap over seeds x questions (too "
                      "narrow at few seeds), and what a power analysis needs: the std of the per-question paired "
                      "differences over seeds x questions, that of the per-seed mean differences, the smallest "
                      "difference these cells detect at 80% power (two-sided, 5%) if they were independent and from "
                      "the per-seed means (the one to read when seeds differ more than their questions explain), and "
                      f"the seeds at {args.eval_questions} questions that {args.delta} EM needs "
                      "(experiments/confidence.py, `seeds_for_power`):", "",
                  "| a - b | mean difference | t 95% interval (seeds) | t p | sign-flip p | Holm p | reading | "
                  "bootstrap 95% interval | sd paired | sd of seed means | detectable (cells) | "
                  f"detectable (seed means) | seeds for {args.delta} |", "|---" * 13 + "|"]
        lines += [f"| {name} | {d['mean']:+.3f} | [{d['t_low']:+.3f}, {d['t_high']:+.3f}] | {_p(d['t_p'])} | "
                  f"{_p(d['sign_flip_p'])} | {_p(d['p_holm'])} | {verdict(d)} | [{d['low']:+.3f}, {d['high']:+.3f}] "
                  f"| {d['sd_paired']:.3f} | {_share(d['sd_seed_means'])} | {d['detectable']:.3f} | "
                  f"{_share(d['detectable_over_seeds'])} | {d['seeds_for_delta'] or '-'} |"
                  for name, d in differences.items()]
    for (outcome, unit), outcome_differences in (time_differences or {}).items():
        lines += time_table(outcome_differences, outcome, unit)
    return "\n".join(lines) + "\n"


# per speed outcome: what it is, and the verb of a run that got there
OUTCOME_WORDS = {PLATEAU_EXIT: ("to leave the plateau", "left"),
                 FIRST_PASSAGE: ("to first reach the threshold (the first curve point at or above it, whatever "
                                 "follows)", "reached it")}


def time_table(differences: dict[str, dict], outcome: str = FIRST_PASSAGE, unit: str = TOKENS) -> list[str]:
    """The paired comparisons in time to the speed ``outcome`` in ``unit`` (``compare_times``); no lines without
    any."""
    if not differences:
        return []
    what, verb = OUTCOME_WORDS[outcome]
    units = UNITS[unit]
    lines = ["", f"Paired comparisons in {units} {what} (a - b over the same seeds; negative: a {verb} sooner). A run "
                 "that never got there is censored at its end, not scored as if it got there then: a pair is "
                 f"ordered when both {verb}, or when one {verb} no later than the other's end; the exact sign test "
                 f"counts the ordered pairs, Holm-adjusted over the table's {len(differences)} comparisons (the "
                 f"reading: beyond the noise where below {ALPHA}). Over the pairs where both {verb}: the mean "
                 "difference, its Student-t 95% interval and p-value, the exact sign-flip p-value and the 95% "
                 "bootstrap over those seeds.", "",
             f"| a - b | a sooner / later / unordered | sign test p | Holm p | reading | both {verb} | mean difference "
             "| t 95% interval | t p | sign-flip p | bootstrap 95% interval |", "|---" * 11 + "|"]
    for name, d in differences.items():
        reading = ("inside the noise" if d["p_holm"] >= ALPHA else
                   f"a {verb} sooner beyond the noise" if d["sooner"] > d["later"] else
                   f"a {verb} later beyond the noise")
        count = ",.0f" if unit == TOKENS else ",.1f"  # iterations and steps: a mean over seeds needs its tenths
        cells = (["-"] * 5 if "mean" not in d else
                 [f"{d['mean']:+{count}}", f"[{d['t_low']:+{count}}, {d['t_high']:+{count}}]", _p(d["t_p"]),
                  _p(d["sign_flip_p"]), f"[{d['low']:+{count}}, {d['high']:+{count}}]"])
        lines.append(f"| {name} | {d['sooner']} / {d['later']} / {d['unordered']} | {_p(d['p'])} | "
                     f"{_p(d['p_holm'])} | {reading} | {d['both']} | " + " | ".join(cells) + " |")
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
    time_differences = {(outcome, unit): compare_times(testbed, runs, outcome, unit) for outcome, unit in TIME_TABLES}
    table = markdown(summary, differences, args, warm, wall_s, testbed.plateau_threshold, time_differences)
    (output / f"{testbed.name}.md").write_text(table, encoding="utf-8")
    payload = {"settings": vars(args), "world": testbed.world.key, "summary": summary, "differences": differences,
               "time_differences": {f"{outcome} {unit}": d for (outcome, unit), d in time_differences.items()}}
    (output / f"{testbed.name}.json").write_text(json.dumps(payload, indent=1), encoding="utf-8")
    # the curves' questions: the first --curve-questions held-out ones, the start point's included
    start = float(np.mean([row["em"] for row in before[: args.curve_questions]]))
    plot = plot_runs({name: mean_rows(seeds, start) for name, seeds in runs.items()}, output / f"{testbed.name}.png",
                     metrics=("dev_em", "reward_mean"))
    return table, plot


def write_docs_section(testbed: Testbed, args: argparse.Namespace, table: str, plot: Path, header: str) -> Path:
    """The testbed's section of its study's README (``studies.section_file``: under ``header``, the command and the
    machine, the table) and its plot's compact copy beside it, NAME.png; the README's path."""
    from benchmarks.report import compact_plot_copy, replace_section
    from benchmarks.studies import section_file

    readme = section_file(testbed.name, args.output)
    if not readme.is_file():  # a study's first section: its README starts with its title
        readme.parent.mkdir(parents=True, exist_ok=True)
        readme.write_text(f"# {testbed.title}\n", encoding="utf-8")
    docs_plot = compact_plot_copy(plot, readme.parent / f"{testbed.name}.png")
    replace_section(readme, testbed.name, testbed.title,
                    f"{header}\n\n{table}\n"
                    f"![dev EM and training reward, mean over seeds]({docs_plot.name})\n\n"
                    f"Plot: `{docs_plot.name}`: dev EM on the first {args.curve_questions} held-out questions and the "
                    f"training reward, mean over seeds against iterations, tokens generated and tool calls (dev EM "
                    f"with a band of one std over seeds).\n")
    return readme


def command_header(script: str, argv: list[str] | None) -> str:
    """The section's first line: the command of ``script`` with ``argv`` (else this process's arguments) and the
    machine."""
    from benchmarks.report import machine_description

    command = shlex.join(["python", script, *(sys.argv[1:] if argv is None else argv)])
    return f"Command: `{command}`. Machine: {machine_description()}."
