"""Where a tree branches: the strategies that pick the N nodes of an expansion round (``--branching``).

- ``uniform`` (the paper's, the default): N draws, uniformly at random with replacement, from the root and every
  non-leaf node (picking the root starts a fresh chain inside the tree).
- ``entropy`` (ARPO's idea, arXiv 2507.19849: fork after a tool call where the policy is uncertain): the nodes
  after a tool call (a non-leaf search step: its observation is a tool result) ranked by the mean entropy of the
  first ``ENTROPY_TOKENS`` tokens of the steps generated after them (:func:`following_entropy`), highest first;
  the N best distinct nodes, without replacement. The ranking is deterministic, so drawing with replacement would
  spend all N expansions on the one top node, and a node that ranks first by noise (a garbled step) would take
  the whole round; N distinct nodes spread the round over the N most uncertain decision points. When a tree has
  fewer such nodes than N, the ranking is repeated from the top (the most uncertain nodes get a second
  expansion), so every strategy grows the same number of leaves, M (1 + L N). Ties (equal entropies: a
  confident policy's 0.0) are broken at random with the tree's own generator, not by depth.
- ``after_tool``: N draws, uniformly with replacement, from the same nodes ``entropy`` ranks. It differs from
  ``uniform`` only in where it may branch (never the root, whose expansion costs a whole chain, nor an invalid
  step) and from ``entropy`` only in how it chooses there: the control that tells which of the two a difference
  between ``uniform`` and ``entropy`` comes from.

- ``at_depth_D`` (D = 1 .. ``MAX_BRANCH_DEPTH``): N draws, uniformly with replacement, from the non-leaf nodes at
  depth D (after the trajectory's D-th step), so every expansion re-draws step D + 1 onwards and shares steps 1..D.
  Where a task's one decision is step D + 1 (SynthBranch-v0's routing decision: ``BranchSpec.decision_hop``), each
  expansion is an independent draw of it for the cost of the steps from it on; ``uniform`` re-draws it only when it
  picks a node at depth D or above. A tree with no non-leaf node at depth D (its chains ended sooner) is drawn at the
  deepest depth above D that has one (the root at worst): the expansions still re-draw step D + 1, if at more cost.

A tree with no node after a tool call (its chains answered at once or wrote only invalid steps) has no point
after one: ``entropy`` and ``after_tool`` draw from it as ``uniform`` does.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from algos.tree import Node, Tree

Strategy = Callable[[Tree, int, np.random.Generator], list[Node]]

# Tokens after a tool call whose entropy ranks the node: ARPO measures the first 20. Past the opening "<think>"
# of a short step (SynthBranch's oracle steps name the entity to search from their 15th token on).
ENTROPY_TOKENS = 20
# The deepest ``at_depth_D``: past a default episode's non-leaf depths (max_turns 3 searches, then the answer) and the
# generated worlds' (SynthBranch's lead world: 4 searches)
MAX_BRANCH_DEPTH = 6


def after_tool_calls(tree: Tree) -> list[Node]:
    """The non-leaf nodes whose step searched (their observation is a tool result), depth first."""
    return [node for node in tree.expansion_candidates() if node.action == "search"]


def following_entropy(node: Node) -> float | None:
    """The mean, over the steps generated from ``node`` (its children), of each step's mean entropy over its first
    tokens (``Node.entropy``); None when none was measured."""
    measured = [child.entropy for child in node.children if child.entropy is not None]
    return float(np.mean(measured)) if measured else None


def uniform(tree: Tree, n: int, rng: np.random.Generator) -> list[Node]:
    """``n`` nodes drawn uniformly at random, with replacement, from the tree's expansion candidates."""
    return _draw(tree.expansion_candidates(), n, rng)


def after_tool(tree: Tree, n: int, rng: np.random.Generator) -> list[Node]:
    """``n`` nodes drawn uniformly, with replacement, from the nodes after a tool call (``uniform`` without any)."""
    candidates = after_tool_calls(tree)
    return _draw(candidates, n, rng) if candidates else uniform(tree, n, rng)


def entropy(tree: Tree, n: int, rng: np.random.Generator) -> list[Node]:
    """The ``n`` nodes after a tool call whose following steps had the highest mean entropy over their first
    tokens, distinct while they last (the ranking then repeats); ties in random order (``uniform`` without any
    node after a tool call)."""
    candidates = after_tool_calls(tree)
    if not candidates:
        return uniform(tree, n, rng)
    scores = [following_entropy(node) for node in candidates]
    if all(score is None for score in scores):
        raise ValueError("branching 'entropy' ranks the nodes after tool calls by the entropy of the steps that "
                         "follow them, and the step generator measured none (SamplingSettings.entropy_tokens is 0, "
                         "or a backend that does not measure it: the vllm generator does not)")
    shuffled = rng.permutation(len(candidates))  # ties keep this random order (the sort is stable)
    ranked = sorted(shuffled, key=lambda i: -np.inf if scores[i] is None else -scores[i])
    return [candidates[ranked[i % len(ranked)]] for i in range(n)]


def at_depth(depth: int) -> Strategy:
    """The strategy ``at_depth_{depth}``: ``n`` nodes drawn uniformly, with replacement, from the non-leaf nodes at
    ``depth``, or at the deepest depth above it that has any."""
    def pick(tree: Tree, n: int, rng: np.random.Generator) -> list[Node]:
        by_depth: dict[int, list[Node]] = {}
        for node in tree.expansion_candidates():  # the root is one: depth 0 always has a candidate
            if node.depth <= depth:
                by_depth.setdefault(node.depth, []).append(node)
        return _draw(by_depth[max(by_depth)], n, rng)

    return pick


def _draw(candidates: list[Node], n: int, rng: np.random.Generator) -> list[Node]:
    return [candidates[i] for i in rng.integers(len(candidates), size=n)]


STRATEGIES: dict[str, Strategy] = {"uniform": uniform, "entropy": entropy, "after_tool": after_tool,
                                   **{f"at_depth_{d}": at_depth(d) for d in range(1, MAX_BRANCH_DEPTH + 1)}}
BRANCHING = tuple(STRATEGIES)


def branching_strategy(name: str) -> Strategy:
    """The strategy called ``name``; a ``ValueError`` listing the known ones otherwise."""
    if name not in STRATEGIES:
        raise ValueError(f"unknown branching {name!r}; known: {', '.join(BRANCHING)}")
    return STRATEGIES[name]


def entropy_tokens(branching: str) -> int:
    """The first tokens of each step whose entropy the generator must measure for ``branching`` (0: none)."""
    return ENTROPY_TOKENS if branching == "entropy" else 0
