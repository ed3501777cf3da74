"""Greedy evaluation as the paper evaluates: one greedy chain per question, all questions of a batch advancing
together through the step generator; per-question results and their means.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

import gymnasium as gym
import numpy as np
from transformers import PreTrainedTokenizerBase

from algos.batch import leaf_records
from algos.rollout import TreeRollout, TreeShape
from policies.generation import StepGenerator

# per-question result columns, in table order
EVAL_COLUMNS = ("em", "f1", "reward", "tool_calls", "turns", "answered")
QUESTIONS = "questions"  # beside the means: how many questions they are over
FAILURES = ("correct", "wrong answer", "answered before its last hop", "no answer")


def greedy_chains(env: gym.Env, generator: StepGenerator, tokenizer: PreTrainedTokenizerBase,
                  prompt_indices: Sequence[int]) -> list[dict[str, float]]:
    """One chain per question of ``env`` (positions ``prompt_indices``), with ``generator``'s settings (greedy
    for evaluation): a dict of ``EVAL_COLUMNS`` per question, in order. ``answered`` is 1 when the chain gave
    an answer."""
    rollout = TreeRollout(env, generator, tokenizer)
    records = leaf_records(rollout.grow(list(prompt_indices), TreeShape(1, 0, 0)))
    return [{"em": float(r.info.get("em", 0.0)), "f1": float(r.info.get("f1", 0.0)), "reward": float(r.reward),
             "tool_calls": float(r.info["tool_calls"]), "turns": float(r.info["turn"]),
             "answered": float(r.info.get("answer") is not None)} for r in records]


def mean_results(rows: Sequence[dict[str, float]]) -> dict[str, float]:
    """The mean of every column over the questions (NaN for no questions)."""
    return {key: float(np.mean([row[key] for row in rows])) if rows else float("nan") for key in EVAL_COLUMNS}


def failure_kind(row: Mapping[str, float]) -> str:
    """What became of one question (a result row with its ``hops``): correct, a wrong answer after enough
    searches, an answer given before the last hop was searched, or no answer at all (one of ``FAILURES``)."""
    if row["em"] >= 1.0:
        return "correct"
    if not row["answered"]:
        return "no answer"
    return "answered before its last hop" if row["tool_calls"] < row["hops"] else "wrong answer"


def failure_mix(rows: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """The share of each failure kind (those that occur) among ``rows``."""
    return {kind: count / len(rows) for kind, count in Counter(map(failure_kind, rows)).items()}
