"""Greedy evaluation as the paper evaluates: one greedy chain per question, all questions of a batch advancing
together through the step generator; per-question results and their means, what became of each question (its
failure kind), and, on a world whose questions turn on one routing decision (SynthBranch), which route it took.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import gymnasium as gym
import numpy as np
from transformers import PreTrainedTokenizerBase

from algos.rollout import TreeRollout, TreeShape
from algos.tree import Node
from envs.rewards import normalize_answer
from envs.search_qa import parse_action
from policies.generation import StepGenerator

# per-question result columns, in table order
EVAL_COLUMNS = ("em", "f1", "reward", "tool_calls", "turns", "answered")
QUESTIONS = "questions"  # beside the means: how many questions they are over
QUERIES = "queries"  # beside the columns: the chain's search queries, in order (what ``route_taken`` reads)
ANSWER = "answer"  # beside the columns: the chain's answer as it wrote it (None when it gave none)
ANSWERED_EARLY = "answered before its last hop"
FAILURES = ("correct", "wrong answer", "wrong route", ANSWERED_EARLY, "no answer")
# a question's ``route`` (``route_taken``): the right one, the wrong one, or neither (no search at the decision,
# or a query naming neither route's entity)
ROUTES = ("right", "wrong", "neither")


def greedy_chains(env: gym.Env, generator: StepGenerator, tokenizer: PreTrainedTokenizerBase,
                  prompt_indices: Sequence[int]) -> list[dict[str, Any]]:
    """One chain per question of ``env`` (positions ``prompt_indices``), with ``generator``'s settings (greedy
    for evaluation): a dict of ``EVAL_COLUMNS`` per question, in order, and its search queries (``QUERIES``).
    ``answered`` is 1 when the chain gave a non-empty answer (``ANSWER``: the answer, None when it gave none)."""
    rollout = TreeRollout(env, generator, tokenizer)
    leaves = [leaf for tree in rollout.grow(list(prompt_indices), TreeShape(1, 0, 0)) for leaf in tree.leaves()]
    return [{"em": float(leaf.info.get("em", 0.0)), "f1": float(leaf.info.get("f1", 0.0)),
             "reward": float(leaf.reward), "tool_calls": float(leaf.info["tool_calls"]),
             "turns": float(leaf.info["turn"]), "answered": answered(leaf),
             ANSWER: leaf.info.get("answer"),
             QUERIES: [parse_action(node.text).argument for node in leaf.path() if node.action == "search"]}
            for leaf in leaves]


def answered(leaf: Node) -> float:
    """1.0 where the leaf's chain gave a non-empty answer (the env strips it), else 0.0."""
    return float(bool(leaf.info.get("answer")))


def mean_results(rows: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """The mean of every column over the questions (NaN for no questions)."""
    return {key: float(np.mean([row[key] for row in rows])) if rows else float("nan") for key in EVAL_COLUMNS}


def route_taken(queries: Sequence[str], right: Sequence[str], wrong: Sequence[str]) -> str:
    """Which route a chain's search ``queries`` took at the decision: the first hop where the right route's chain
    of searched entities (``right``, e.g. a SynthBranch question's supporting titles) and the wrong one's
    (``wrong``, its decoy's) differ. ``"right"`` or ``"wrong"`` when the query of that hop names that route's
    entity (after answer normalisation), ``"neither"`` when it names neither or the chain never searched that
    far (one of ``ROUTES``)."""
    hop = next((i for i, (a, b) in enumerate(zip(right, wrong, strict=False)) if a != b), None)
    if hop is None:
        raise ValueError(f"the two routes {list(right)} and {list(wrong)} do not differ at any hop")
    if hop >= len(queries):
        return "neither"
    query = normalize_answer(queries[hop])
    if query == normalize_answer(right[hop]):
        return "right"
    return "wrong" if query == normalize_answer(wrong[hop]) else "neither"


def failure_kind(row: Mapping[str, Any]) -> str:
    """What became of one question (a result row with its ``hops``, and its ``route`` where the world has one):
    correct, no answer at all, a wrong answer after following the wrong route, an answer given before the last hop
    was searched, or another wrong answer (one of ``FAILURES``)."""
    if row["em"] >= 1.0:
        return "correct"
    if not row["answered"]:
        return "no answer"
    if row.get("route") == "wrong":
        return "wrong route"
    return ANSWERED_EARLY if row["tool_calls"] < row["hops"] else "wrong answer"


def failure_mix(rows: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """The share of each failure kind (those that occur) among ``rows``."""
    return {kind: count / len(rows) for kind, count in Counter(map(failure_kind, rows)).items()}


def occurring_failures(*mixes: Mapping[str, float]) -> list[str]:
    """The failure kinds that occur in any of ``mixes`` (``failure_mix`` results), in ``FAILURES`` order: a
    table's rows or columns."""
    return [kind for kind in FAILURES if any(mix.get(kind) for mix in mixes)]


def routing(rows: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Over rows that carry a ``route``: the share routed right (``routed_right``), the number of them
    (``routed_right_questions``) and the exact match on them (``em_routed_right``, NaN when none): how well a
    policy copies names where it decided right, apart from how often it decides right. Empty without routes."""
    routed = [row for row in rows if "route" in row]
    if not routed:
        return {}
    right = [row["em"] for row in routed if row["route"] == "right"]
    return {"routed_right": len(right) / len(routed), "routed_right_questions": float(len(right)),
            "em_routed_right": float(np.mean(right)) if right else float("nan")}
