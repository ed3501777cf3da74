"""The statistics of a learning benchmark's runs: per setting, the final dev EM over seeds x questions with its
bootstrap interval, the failure mix, routing, tokens, tool calls and the speed outcomes; per comparison, the paired
differences of final dev EM (with what a power analysis needs) and of tokens to each speed outcome; the curves
averaged over seeds for the plot."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from algos.evaluation import failure_mix, routing
from benchmarks.learning_testbed import Testbed
from benchmarks.plateau_exit import first_passage_tokens, plateau_exit_tokens, silent_update_share
from experiments.confidence import (
    Interval,
    bootstrap_interval,
    detectable_difference,
    mean_interval,
    paired_bootstrap_interval,
    seeds_for_power,
)

# the EM difference the branching protocol (docs/protocol_branching.md) must be able to see, the default of --delta
DELTA = 0.03
# the two speed outcomes, keys of a setting's summary: tokens to leave the plateau for good, tokens to first reach
# the threshold
PLATEAU_EXIT, FIRST_PASSAGE = "plateau_exit_per_seed", "first_passage_per_seed"


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
