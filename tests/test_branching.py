"""Branching strategies (algos/branching.py): which nodes each one picks on hand-built trees (in a rollout:
tests/test_rollout.py)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from algos.branching import BRANCHING, ENTROPY_TOKENS, branching_strategy, entropy_tokens, following_entropy
from algos.tree import Node, Tree
from policies.trajectory import TokenTrajectory

EMPTY = TokenTrajectory.from_prompt(())


def step(parent: Node, action: str, entropy: float | None = None, leaf: bool = False) -> Node:
    return parent.add_child(Node(EMPTY, None, action=action, entropy=entropy, is_leaf=leaf))


@pytest.fixture
def tree():
    """root -> s1 (search) -> s2 (search) -> answer; s1 -> x (invalid) -> answer; root -> answer. The steps after
    s1 had entropies 1.5 and 0.9 (mean 1.2), the step after s2 0.2."""
    root = Node(EMPTY, None)
    s1 = step(root, "search", 0.1)
    s2 = step(s1, "search", 1.5)
    step(s2, "answer", 0.2, leaf=True)
    x = step(s1, "invalid", 0.9)
    step(x, "answer", 0.3, leaf=True)
    step(root, "answer", 0.4, leaf=True)
    return Tree(root, prompt_index=0, tree_id=0), {"root": root, "s1": s1, "s2": s2, "x": x}


def names(picks, nodes) -> list[str]:
    by_id = {id(node): name for name, node in nodes.items()}
    return [by_id[id(node)] for node in picks]


def test_following_entropy_is_the_mean_over_the_next_steps(tree):
    _, nodes = tree
    assert following_entropy(nodes["s1"]) == pytest.approx(1.2)
    assert following_entropy(nodes["s2"]) == pytest.approx(0.2)
    assert following_entropy(Node(EMPTY, None)) is None


def test_uniform_is_the_papers_draw_with_replacement_over_root_and_non_leaves(tree):
    tree, nodes = tree
    assert tree.expansion_candidates() == [nodes[name] for name in ("root", "s1", "s2", "x")]
    # the same draws as before the strategies existed: one integers() call over the candidates
    expected = [tree.expansion_candidates()[i] for i in np.random.default_rng(7).integers(4, size=5)]
    assert branching_strategy("uniform")(tree, 5, np.random.default_rng(7)) == expected
    counts = Counter(names(branching_strategy("uniform")(tree, 20_000, np.random.default_rng(0)), nodes))
    assert set(counts) == {"root", "s1", "s2", "x"}
    assert all(abs(count / 20_000 - 0.25) < 0.013 for count in counts.values())  # 4.2 standard deviations


def test_entropy_takes_the_most_uncertain_nodes_after_tool_calls_distinct_then_again(tree):
    tree, nodes = tree
    rng = np.random.default_rng(0)
    assert names(branching_strategy("entropy")(tree, 1, rng), nodes) == ["s1"]
    assert names(branching_strategy("entropy")(tree, 2, rng), nodes) == ["s1", "s2"]  # without replacement
    assert names(branching_strategy("entropy")(tree, 5, rng), nodes) == ["s1", "s2", "s1", "s2", "s1"]


def test_entropy_breaks_ties_at_random_not_by_depth():
    root = Node(EMPTY, None)
    a = step(root, "search")
    b = step(a, "search", 0.7)
    step(b, "search", 0.7)  # a and b are followed by equally uncertain steps
    leafless = b.children[0]
    step(leafless, "answer", 0.7, leaf=True)
    tree = Tree(root, 0, 0)
    firsts = Counter(id(branching_strategy("entropy")(tree, 1, np.random.default_rng(seed))[0])
                     for seed in range(200))
    assert set(firsts) == {id(a), id(b), id(leafless)} and min(firsts.values()) > 40


def test_after_tool_draws_uniformly_from_the_nodes_after_tool_calls(tree):
    tree, nodes = tree
    counts = Counter(names(branching_strategy("after_tool")(tree, 20_000, np.random.default_rng(0)), nodes))
    assert set(counts) == {"s1", "s2"} and abs(counts["s1"] / 20_000 - 0.5) < 0.015


@pytest.mark.parametrize("branching", ["entropy", "after_tool"])
def test_a_tree_without_tool_calls_is_drawn_as_uniform(branching):
    root = Node(EMPTY, None)
    x = step(root, "invalid", 0.5)
    step(x, "answer", 0.1, leaf=True)
    tree = Tree(root, 0, 0)
    assert branching_strategy(branching)(tree, 6, np.random.default_rng(3)) == \
        branching_strategy("uniform")(tree, 6, np.random.default_rng(3))


def test_entropy_without_measured_entropies_and_an_unknown_name_are_errors(tree):
    root = Node(EMPTY, None)
    step(step(root, "search"), "answer", leaf=True)
    with pytest.raises(ValueError, match=r"measured none.*vllm generator does not"):
        branching_strategy("entropy")(Tree(root, 0, 0), 2, np.random.default_rng(0))
    with pytest.raises(ValueError, match=r"unknown branching 'widest'; known: uniform, entropy, after_tool, at_dep"):
        branching_strategy("widest")
    assert BRANCHING[:3] == ("uniform", "entropy", "after_tool")
    assert [entropy_tokens(name) for name in BRANCHING[:3]] == [0, ENTROPY_TOKENS, 0]


def test_at_depth_branches_at_the_non_leaf_nodes_of_its_depth(tree):
    tree, nodes = tree
    rng = np.random.default_rng(0)
    # depth 1 holds s1 and the root's answer (a leaf): every expansion grows from s1
    assert names(branching_strategy("at_depth_1")(tree, 3, rng), nodes) == ["s1", "s1", "s1"]
    # depth 2 holds s2 and x, drawn uniformly with replacement (the draws uniform makes over them)
    expected = [[nodes["s2"], nodes["x"]][i] for i in np.random.default_rng(7).integers(2, size=5)]
    assert branching_strategy("at_depth_2")(tree, 5, np.random.default_rng(7)) == expected
    counts = Counter(names(branching_strategy("at_depth_2")(tree, 20_000, np.random.default_rng(0)), nodes))
    assert set(counts) == {"s2", "x"} and abs(counts["s2"] / 20_000 - 0.5) < 0.015


def test_at_depth_falls_back_to_the_deepest_non_leaf_depth_above_it(tree):
    tree, nodes = tree
    # depth 3 holds answers only: the nodes at depth 2, the last before it
    assert set(names(branching_strategy("at_depth_3")(tree, 50, np.random.default_rng(0)), nodes)) == {"s2", "x"}
    root = Node(EMPTY, None)
    step(root, "answer", leaf=True)  # a chain that answered at once: only the root is left to branch at
    assert branching_strategy("at_depth_2")(Tree(root, 0, 0), 2, np.random.default_rng(0)) == [root, root]


def test_at_depth_names_cover_the_depths_of_an_episode():
    assert [name for name in BRANCHING if name.startswith("at_depth_")] == [f"at_depth_{d}" for d in range(1, 7)]
    assert all(entropy_tokens(name) == 0 for name in BRANCHING if name.startswith("at_depth_"))
