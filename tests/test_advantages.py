"""Tree-relative advantages against values computed by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest

from algos.advantages import group_normalize, tree_grpo_advantages

EPS = 1e-6


def test_group_normalize_by_hand():
    # rewards 1, 0, 0: mean 1/3, unbiased std sqrt(((2/3)^2 + 2 (1/3)^2) / 2) = sqrt(1/3)
    std = math.sqrt(1 / 3)
    expected = [(2 / 3) / (std + EPS), (-1 / 3) / (std + EPS), (-1 / 3) / (std + EPS)]
    np.testing.assert_allclose(group_normalize(np.array([1.0, 0.0, 0.0])), expected, rtol=1e-12)


@pytest.mark.parametrize("rewards", [[0.7], [], [0.2, 0.2, 0.2]])
def test_degenerate_groups_give_zero(rewards):
    assert np.all(group_normalize(np.array(rewards)) == 0)


def test_tree_mode_by_hand():
    # two trees of three leaves: tree a = (1, 0, 0), tree b = (1, 1, 0)
    rewards, trees = [1, 0, 0, 1, 1, 0], ["a", "a", "a", "b", "b", "b"]
    s3 = math.sqrt(1 / 3)  # unbiased std within each tree
    intra = [(2 / 3) / (s3 + EPS), (-1 / 3) / (s3 + EPS), (-1 / 3) / (s3 + EPS),
             (1 / 3) / (s3 + EPS), (1 / 3) / (s3 + EPS), (-2 / 3) / (s3 + EPS)]
    # all six: mean 1/2, unbiased std sqrt(6 * 1/4 / 5) = sqrt(0.3)
    s6 = math.sqrt(0.3)
    inter = [(r - 0.5) / (s6 + EPS) for r in rewards]
    np.testing.assert_allclose(tree_grpo_advantages(rewards, trees, "intra"), intra, rtol=1e-12)
    np.testing.assert_allclose(tree_grpo_advantages(rewards, trees, "inter"), inter, rtol=1e-12)
    np.testing.assert_allclose(tree_grpo_advantages(rewards, trees), np.add(intra, inter), rtol=1e-12)


def test_one_leaf_tree_contributes_only_inter():
    # tree x has one leaf: its intra term is 0 (the official code would pass the raw reward 0.8 through)
    rewards, trees = [0.8, 0.2, 1.0], ["x", "y", "y"]
    inter = tree_grpo_advantages(rewards, trees, "inter")
    got = tree_grpo_advantages(rewards, trees, "tree")
    assert tree_grpo_advantages(rewards, trees, "intra")[0] == 0.0
    assert got[0] == pytest.approx(inter[0])
    # tree y: (0.2, 1.0) -> mean 0.6, std sqrt(0.32) -> -/+ 0.4 / (0.5657 + eps)
    assert got[1] - inter[1] == pytest.approx(-0.4 / (math.sqrt(0.32) + EPS))


def test_chain_grpo_is_inter_and_ignores_tree_ids():
    rewards = [1.0, 0.0, 0.2, 0.0]
    np.testing.assert_array_equal(tree_grpo_advantages(rewards, [0, 1, 2, 3], "inter"),
                                  tree_grpo_advantages(rewards, [0, 0, 0, 0], "inter"))
    assert tree_grpo_advantages(rewards, [0, 1, 2, 3], "inter").sum() == pytest.approx(0.0, abs=1e-12)


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="tree, intra, inter"):
        tree_grpo_advantages([1.0], [0], mode="global")
    with pytest.raises(ValueError, match="one length"):
        tree_grpo_advantages([1.0, 0.0], [0])


def test_one_tree_per_prompt_doubles_the_inter_advantage():
    rewards, trees = [1.0, 0.0, 0.0], [0, 0, 0]  # mean 1/3, unbiased std sqrt(1/3)
    inter = tree_grpo_advantages(rewards, trees, mode="inter", eps=0.0)
    np.testing.assert_allclose(inter, [(2 / 3) / np.sqrt(1 / 3), -(1 / 3) / np.sqrt(1 / 3), -(1 / 3) / np.sqrt(1 / 3)])
    np.testing.assert_allclose(tree_grpo_advantages(rewards, trees, mode="tree", eps=0.0), 2 * inter)
