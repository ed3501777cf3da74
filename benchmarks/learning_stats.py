"""The statistics of a learning benchmark's runs: per setting, the final dev EM over seeds x questions with its
bootstrap interval, the failure mix, routing, tokens, tool calls and the speed outcomes; per comparison, the paired
differences of final dev EM (with what a power analysis needs) and of the time to each speed outcome in tokens,
iterations and optimizer steps; the curves averaged over seeds for the plot.

Seeds are few (6-10), so every comparison carries, beside the bootstrap, tests that hold at any number of seeds
(``experiments/confidence.py``): the per-seed paired differences' Student-t interval and p-value and the exact
sign-flip p-value; a time to an outcome that some runs never reach by their end is right-censored there, and the
paired comparison is a sign test over the pairs whose order is known (``censored_order``: both reached it; or one
reached it no later than the other's end), with the t-interval, sign-flip and bootstrap on the pairs where both
reached it. The comparisons of one table are read together: their p-values (sign-flip for EM, the censored sign test
for times) are Holm-adjusted over the table's comparisons (``holm_adjusted``), and a reading says "beyond the noise"
only where the adjusted p is below ``ALPHA``."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from algos.evaluation import failure_mix, routing
from benchmarks.learning_testbed import Testbed
from benchmarks.plateau_exit import TOKENS, first_passage_at, plateau_exit_at, progress, silent_update_share
from experiments.confidence import (
    Interval,
    bootstrap_interval,
    censored_order,
    censored_sign_test,
    detectable_difference,
    holm_adjusted,
    mean_interval,
    paired_bootstrap_interval,
    seeds_for_power,
    sign_flip_p_value,
    t_test_p_value,
)

# the EM difference the branching protocol (docs/protocol_branching.md) must be able to see, the default of --delta
DELTA = 0.03
# the two speed outcomes, keys of a setting's summary: tokens to leave the plateau for good, tokens to first reach
# the threshold
PLATEAU_EXIT, FIRST_PASSAGE = "plateau_exit_per_seed", "first_passage_per_seed"
SPEED_OUTCOMES = {PLATEAU_EXIT: plateau_exit_at, FIRST_PASSAGE: first_passage_at}
ALPHA = 0.05  # the level a Holm-adjusted p-value is read at


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


def signal_share(seeds: list[list[dict]]) -> float | None:
    """The mean over a setting's iterations (all seeds) of the share of prompts with a non-zero advantage (the
    prompts its updates learned from); None where its metrics predate ``nonzero_advantage_share``."""
    shares = [row["nonzero_advantage_share"] for rows in seeds for row in rows
              if row.get("nonzero_advantage_share") is not None]
    return float(np.mean(shares)) if shares else None


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
            "nonzero_advantage_share": signal_share(seeds),
        }
        if testbed.plateau_threshold is not None:
            for outcome, time_to in SPEED_OUTCOMES.items():
                summary[setting][outcome] = [time_to(rows, testbed.plateau_threshold) for rows in seeds]
            summary[setting]["silent_update_share_per_seed"] = [silent_update_share(rows) for rows in seeds]
    return summary


def compare(testbed: Testbed, finals: dict[str, list[list[dict]]], delta: float = DELTA) -> dict[str, dict]:
    """Every comparison whose two settings ran on the same seeds: the paired bootstrap interval of a - b, the tests
    over the per-seed mean differences (``seed_tests``) with the sign-flip p Holm-adjusted over the comparisons
    (``p_holm``), and what a power analysis needs: the standard deviation of the per-question paired differences
    (``sd_paired``, over seeds x questions), that of the per-seed mean differences (``sd_seed_means``, None with one
    seed), the smallest difference these cells detect at 80% power, and the seeds at this many questions that
    ``delta`` needs."""
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
                **seed_tests(differences.mean(axis=1)),
                "sd_paired": sd,
                "sd_seed_means": sd_seeds,
                "cells": int(differences.size),
                "detectable": detectable_difference(sd, differences.size),
                # the same from the per-seed means: what the seeds can see when they, not the questions, set the
                # spread (the cells are then not independent, and ``detectable`` is too optimistic)
                "detectable_over_seeds": detectable_difference(sd_seeds, seeds) if sd_seeds is not None else None,
                "seeds_for_delta": seeds_for_power(sd, delta, questions=questions) if sd > 0 else None,
            }
    return with_holm(out, "sign_flip_p")


def seed_tests(differences: np.ndarray) -> dict[str, float]:
    """The tests of per-seed paired differences that hold at few seeds: the Student-t 95% interval of their mean
    (``t_low``, ``t_high``), its p-value (``t_p``) and the exact sign-flip p-value (``sign_flip_p``)."""
    interval = mean_interval(differences)
    return {"t_low": interval.low, "t_high": interval.high, "t_p": t_test_p_value(differences),
            "sign_flip_p": sign_flip_p_value(differences)}


def with_holm(comparisons: dict[str, dict], key: str) -> dict[str, dict]:
    """``comparisons`` with ``p_holm``: each one's ``key`` p-value Holm-adjusted over all of them (read together)."""
    for d, adjusted in zip(comparisons.values(), holm_adjusted([d[key] for d in comparisons.values()]), strict=True):
        d["p_holm"] = adjusted
    return comparisons


def time_and_end(rows: list[dict], threshold: float, outcome: str, unit: str) -> tuple[int | None, int]:
    """A run's time to the speed ``outcome`` in ``unit`` (None: never got there) and where its last row stood (its
    censoring point when it never got there)."""
    return SPEED_OUTCOMES[outcome](rows, threshold, unit), progress(rows, len(rows) - 1, unit)


def compare_times(testbed: Testbed, runs: dict[str, list[list[dict]]], outcome: str = FIRST_PASSAGE,
                  unit: str = TOKENS) -> dict[str, dict]:
    """Every comparison whose two settings ran on the same seeds, in time to the speed ``outcome`` counted in
    ``unit`` (``plateau_exit.UNITS``), a run that never got there censored at its end (never scored as if it got
    there then): the seeds where a got there sooner / later / in an unknown order (``censored_order``), the exact sign
    test over the ordered ones (``p``) and its Holm adjustment over the comparisons (``p_holm``); over the seeds where
    both got there (``both``), the mean difference a - b (negative: a sooner) with ``seed_tests`` and the bootstrap
    interval over those seeds (``low``, ``high``; absent with fewer than 2 such seeds). Empty where the testbed
    reports no plateau."""
    out: dict[str, dict] = {}
    if testbed.plateau_threshold is None:
        return out
    for a, b in testbed.comparisons:
        if runs.get(a) and runs.get(b) and len(runs[a]) == len(runs[b]):
            pairs = [(time_and_end(rows_a, testbed.plateau_threshold, outcome, unit),
                      time_and_end(rows_b, testbed.plateau_threshold, outcome, unit))
                     for rows_a, rows_b in zip(runs[a], runs[b], strict=True)]
            test = censored_sign_test([censored_order(*time_a, *time_b) for time_a, time_b in pairs])
            both = np.array([(ta, tb) for (ta, _), (tb, _) in pairs if ta is not None and tb is not None], dtype=float)
            d: dict[str, Any] = {"sooner": test.sooner, "later": test.later, "unordered": test.unordered, "p": test.p,
                                 "both": len(both)}
            if len(both) >= 2:
                d.update(interval_dict(paired_bootstrap_interval(both[:, :1], both[:, 1:])))
                d.update(seed_tests(both[:, 0] - both[:, 1]))
            out[f"{a} - {b}"] = d
    return with_holm(out, "p")


def interval_dict(interval: Interval) -> dict[str, float]:
    return {"mean": interval.mean, "low": interval.low, "high": interval.high}


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
