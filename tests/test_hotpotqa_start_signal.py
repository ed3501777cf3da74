"""The start-signal check's scoring (benchmarks/hotpotqa_start_signal.py), on hand-built trees."""

from __future__ import annotations

import pytest

from algos.evaluation import answered
from algos.tree import Node, Tree
from benchmarks.hotpotqa_start_signal import answer_read, em_by_reading, leaf_rewards, main, mixed, table
from policies.trajectory import TokenTrajectory


def leaf(parent: Node, answer: str | None, format_valid: bool = True, observation: str = "") -> Node:
    return parent.add_child(Node(TokenTrajectory.from_prompt(()), None, is_leaf=True, observation=observation,
                                 info={"answer": answer, "format_valid": format_valid}))


def trees() -> list[Tree]:
    """Prompt 0 (gold "Paris"): one tree, leaves "Paris", "paris city", no answer; the first two read "Paris" (the
    first in its own observation, the second in its parent step's). Prompt 2 (gold "1990"): two trees, leaves
    "London" (format invalid) and "Rome", neither read "1990"."""
    first, second, third = (Node(TokenTrajectory.from_prompt(()), None) for _ in range(3))
    leaf(first, "Paris", observation="<information>It moved to PARIS in 1889.</information>")
    searched = first.add_child(Node(TokenTrajectory.from_prompt(()), None, observation="Paris, the capital"))
    leaf(searched, "paris city")
    leaf(first, None, observation="Lyon")
    leaf(second, "London", format_valid=False)
    leaf(third, "Rome")
    return [Tree(first, 0, 0), Tree(second, 2, 0), Tree(third, 2, 1)]


ANSWERS = [["Paris"], ["x"], ["1990"]]


def test_each_leaf_is_scored_under_each_reward_from_what_it_answered():
    grown = trees()
    # format: right 1.0, wrong 0.2 (0.1 with the format broken), none 0; F1 of "paris city": 2 * (1/2 * 1) / 1.5
    assert leaf_rewards(grown, ANSWERS, [0, 2], "format") == [[1.0, 0.2, 0.0], [0.1, 0.2]]
    assert leaf_rewards(grown, ANSWERS, [0, 2], "em") == [[1.0, 0.0, 0.0], [0.0, 0.0]]
    f1 = leaf_rewards(grown, ANSWERS, [0, 2], "f1")
    assert f1[1] == [0.0, 0.0] and f1[0][0] == 1.0 and abs(f1[0][1] - 2 / 3) < 1e-12 and f1[0][2] == 0.0


def test_a_prompt_is_mixed_when_its_trees_leaves_differ_and_the_answer_rate_counts_leaves():
    grown = trees()
    # prompt 2's two leaves: format 0.1 and 0.2 (mixed), EM 0 and 0 (alike)
    assert mixed(leaf_rewards(grown, ANSWERS, [0, 2], "format")).tolist() == [1.0, 1.0]
    assert mixed(leaf_rewards(grown, ANSWERS, [0, 2], "em")).tolist() == [1.0, 0.0]
    assert mixed([[0.5], []]).tolist() == [0.0, 0.0]  # one leaf, or none: nothing to compare
    assert [answered(leaf) for tree in grown for leaf in tree.leaves()] == [1.0, 1.0, 0.0, 1.0, 1.0]


def test_a_leaf_has_read_the_answer_when_an_observation_on_its_path_named_it():
    grown = trees()
    named = [["Paris"], ["x"], ["1990"]]
    read = answer_read(grown, named, [0, 2])
    assert read == [[1.0, 1.0, 0.0], [0.0, 0.0]]
    assert answer_read(grown, [[], ["x"], ["1990"]], [0, 2])[0] == [0.0, 0.0, 0.0]  # a yes / no verdict: never read
    assert mixed(read).tolist() == [1.0, 0.0]
    # EM 1, 0 among the two leaves that read "Paris"; 0, 0, 0 among the three that did not
    em = leaf_rewards(grown, ANSWERS, [0, 2], "em")
    assert em_by_reading(em, read) == {"read": 0.4, "em_read": 0.5, "em_unread": 0.0}
    assert em_by_reading([[0.0]], [[0.0]]) == {"read": 0.0, "em_read": None, "em_unread": 0.0}


def test_the_table_gives_each_arms_shares_and_the_difference_from_the_first():
    base = {"options": "", "seconds": 20.0, "tokens": 400, "leaves": 6, "answered": 0.5, "em": 0.1, "f1": 0.2,
            "read": 0.25, "em_read": 0.4, "em_unread": None,
            "mixed": {"format": [1.0, 0.0], "em": [0.0, 0.0], "f1": [1.0, 1.0], "read": [0.0, 1.0]}}
    cooler = {**base, "options": "--temperature 0.7", "em_unread": 0.05,
              "mixed": {"format": [1.0, 1.0], "em": [0.0, 1.0], "f1": [1.0, 1.0], "read": [0.0, 1.0]}}
    text = table([base, cooler])
    first, second = text.splitlines()[2:]
    assert first.startswith("| `(defaults)` | 2 | 3.0 | 200 | 10.0 | 0.500 | 0.100 | 0.200 | 0.250 | 0.400 / - | "
                            "0.500 [")
    assert "vs first" not in first
    assert second.startswith("| `--temperature 0.7` | 2 |") and "| 0.400 / 0.050 |" in second
    assert second.count("vs first") == 4 and "vs first 0.500 [" in second and "vs first 0.000 [0.000, 0.000]" in second


def test_an_arm_that_names_another_env_is_refused_by_name(capsys):
    with pytest.raises(SystemExit):
        main(["--arms", "", "--env SynthHop-v0 --temperature 0.7"])
    assert "drop --env from ['--env SynthHop-v0 --temperature 0.7']" in capsys.readouterr().err
