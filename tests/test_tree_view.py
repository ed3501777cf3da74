"""Tree dicts (ids, snippets, leaf indices matching the batch), advantages on them, and the HTML page."""

from __future__ import annotations

import copy
import re

import pytest

from algos.batch import leaf_records
from algos.tree import Node, Tree
from algos.tree_view import trees_html, trees_to_dicts, with_advantages
from policies.trajectory import TokenTrajectory

QUESTIONS = {5: "Who <script>alert(1)</script> wrote it?"}
ADVANTAGES = [1.0, -0.5, 2.0, 0.3]  # one per leaf, in leaf_records order


def node(**kwargs) -> Node:
    return Node(TokenTrajectory.from_prompt((1, 2, 3)), None, **kwargs)


def make_trees() -> list[Tree]:
    """Prompt 5, tree 0: a leaf and a search step with two leaves below; prompt 7, tree 1: one leaf."""
    root = node()
    root.add_child(node(action="answer", text="<answer>Paris</answer>", observation="12345678901234567890",
                        reward=1.0, is_leaf=True, info={"em": 1.0, "answer": "Paris"}))
    mid = root.add_child(node(action="search", text="<search>a & b</search>",
                              observation="  <information>x < y & z</information>"))
    mid.add_child(node(action="answer", text="<answer>Rome</answer>", reward=0.0, is_leaf=True,
                       info={"answer": "Rome"}))
    mid.add_child(node(action="invalid", text="oops", reward=0.5, is_leaf=True))
    other = node()
    other.add_child(node(action="answer", observation="done", reward=0.25, is_leaf=True, info={"em": 0.0}))
    return [Tree(root, prompt_index=5, tree_id=0), Tree(other, prompt_index=7, tree_id=1)]


def walk(d: dict) -> list[dict]:
    out = [d]
    for child in d["children"]:
        out.extend(walk(child))
    return out


def by_id(tree: dict) -> dict[str, dict]:
    return {n["id"]: n for n in walk(tree["root"])}


def summary(page: str, node_id: str) -> str:
    match = re.search(rf"<li id='n{re.escape(node_id)}'><details open><summary>(.*?)</summary>", page)
    assert match is not None, node_id
    return match.group(1)


def test_ids_and_copied_fields():
    dicts = trees_to_dicts(make_trees(), QUESTIONS, snippet_chars=20)
    assert [(d["prompt_index"], d["tree_id"]) for d in dicts] == [(5, 0), (7, 1)]
    assert [n["id"] for n in walk(dicts[0]["root"])] == ["5.0", "5.0.0", "5.0.1", "5.0.1.0", "5.0.1.1"]
    assert [n["id"] for n in walk(dicts[1]["root"])] == ["7.1", "7.1.0"]
    nodes = by_id(dicts[0])
    assert [(n["depth"], n["action"], n["is_leaf"]) for n in nodes.values()] == [
        (0, "root", False), (1, "answer", True), (1, "search", False), (2, "answer", True), (2, "invalid", True)]
    assert nodes["5.0.1"]["text"] == "<search>a & b</search>"
    assert nodes["5.0.0"]["reward"] == 1.0 and nodes["5.0.0"]["em"] == 1.0 and nodes["5.0.0"]["answer"] == "Paris"
    assert nodes["5.0.1.1"]["em"] == 0.0 and nodes["5.0.1.1"]["answer"] is None
    assert "leaf_index" not in nodes["5.0.1"] and "reward" not in nodes["5.0"]


def test_questions_by_prompt_index():
    dicts = trees_to_dicts(make_trees(), QUESTIONS)
    assert [d["question"] for d in dicts] == [QUESTIONS[5], ""]
    assert [d["question"] for d in trees_to_dicts(make_trees())] == ["", ""]


def test_observation_snippets():
    nodes = by_id(trees_to_dicts(make_trees(), snippet_chars=20)[0])
    assert nodes["5.0.1"]["observation"] == "<information>x < y & ..."  # stripped, cut to 20, marked
    assert nodes["5.0.0"]["observation"] == "12345678901234567890"  # exactly the limit: whole
    assert nodes["5.0"]["observation"] == ""
    assert by_id(trees_to_dicts(make_trees())[0])["5.0.1"]["observation"] == "<information>x < y & z</information>"


def test_leaf_index_matches_leaf_records():
    trees = make_trees()
    records = leaf_records(trees)
    leaves = [(d, n) for d in trees_to_dicts(trees) for n in walk(d["root"]) if n["is_leaf"]]
    assert [n["leaf_index"] for _, n in leaves] == [0, 1, 2, 3]
    for d, n in leaves:
        record = records[n["leaf_index"]]
        assert (record.prompt_index, record.tree_id, record.depth, record.reward) == (
            d["prompt_index"], d["tree_id"], n["depth"], n["reward"])
    assert [r.reward for r in records] == [1.0, 0.0, 0.5, 0.25]


def test_advantages_on_leaves_and_means_above():
    first, second = (with_advantages(d, ADVANTAGES) for d in trees_to_dicts(make_trees()))
    nodes = by_id(first)
    assert [nodes[i]["advantage"] for i in ("5.0.0", "5.0.1.0", "5.0.1.1")] == [1.0, -0.5, 2.0]
    assert nodes["5.0"]["advantage"] == pytest.approx(2.5 / 3) and nodes["5.0"]["leaves"] == 3
    assert nodes["5.0.1"]["advantage"] == pytest.approx(0.75) and nodes["5.0.1"]["leaves"] == 2
    assert nodes["5.0.0"]["leaves"] == 1
    assert second["root"]["advantage"] == pytest.approx(0.3) and second["root"]["children"][0]["advantage"] == 0.3


def test_advantage_offset():
    tree = trees_to_dicts(make_trees())[0]
    nodes = by_id(with_advantages(tree, [9.0, 9.0, *ADVANTAGES], offset=2))
    assert [nodes[i]["advantage"] for i in ("5.0.0", "5.0.1.0", "5.0.1.1")] == [1.0, -0.5, 2.0]
    assert nodes["5.0.1"]["advantage"] == pytest.approx(0.75)


def test_with_advantages_leaves_input_alone():
    tree = trees_to_dicts(make_trees())[0]
    before = copy.deepcopy(tree)
    annotated = with_advantages(tree, ADVANTAGES)
    assert tree == before
    assert all("advantage" not in n and "leaves" not in n for n in walk(tree["root"]))
    assert all("advantage" in n for n in walk(annotated["root"]))


def annotated_page() -> str:
    dicts = trees_to_dicts(make_trees(), QUESTIONS, snippet_chars=20)
    return trees_html([with_advantages(d, ADVANTAGES) for d in dicts], title="a <b> title")


def test_html_is_one_document_with_every_action():
    page = annotated_page()
    assert page.count("<html>") == 1 and page.count("</html>") == 1 and page.count("<section>") == 2
    assert "<title>a &lt;b&gt; title</title>" in page
    actions = {"5.0": "root", "5.0.0": "answer", "5.0.1": "search", "5.0.1.0": "answer", "5.0.1.1": "invalid",
               "7.1": "root", "7.1.0": "answer"}
    for node_id, action in actions.items():
        assert f"<span class='action {action}'>{action}</span>" in summary(page, node_id)


def test_html_rewards_and_advantages():
    page = annotated_page()
    expected = {"5.0.0": ("reward 1.00", "advantage +1.000"), "5.0.1.0": ("reward 0.00", "advantage -0.500"),
                "5.0.1.1": ("reward 0.50", "advantage +2.000"), "7.1.0": ("reward 0.25", "advantage +0.300")}
    for node_id, (reward, advantage) in expected.items():
        assert reward in summary(page, node_id) and advantage in summary(page, node_id)
    assert "advantage +0.833" in summary(page, "5.0") and "3 leaves below" in summary(page, "5.0")
    assert "advantage +0.750" in summary(page, "5.0.1") and "2 leaves below" in summary(page, "5.0.1")
    assert "answer: Paris" in summary(page, "5.0.0")
    assert "class='adv" not in trees_html(trees_to_dicts(make_trees()))  # no advantages given: none shown


def test_html_branch_points():
    page = annotated_page()
    marker = "branch point: 2 continuations"
    assert page.count("branch point:") == 2
    for node_id in ("5.0", "5.0.1"):
        assert marker in summary(page, node_id)
    for node_id in ("5.0.0", "5.0.1.0", "5.0.1.1", "7.1", "7.1.0"):
        assert "branch point" not in summary(page, node_id)


def test_html_escapes_text_and_observation():
    page = annotated_page()
    assert "&lt;search&gt;a &amp; b&lt;/search&gt;" in page and "<search>" not in page
    assert "&lt;information&gt;x &lt; y &amp; ..." in page and "<information>" not in page
    assert "&lt;answer&gt;Paris&lt;/answer&gt;" in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page and "<script" not in page.lower()


def test_measured_step_entropies_are_shown_and_unmeasured_ones_are_not():
    trees = make_trees()
    trees[0].root.children[1].entropy = 0.6125
    nodes = by_id(trees_to_dicts(trees)[0])
    assert nodes["5.0.1"]["entropy"] == 0.6125 and "entropy" not in nodes["5.0.0"]
    page = trees_html(trees_to_dicts(trees))
    assert "entropy 0.61" in summary(page, "5.0.1") and "entropy" not in summary(page, "5.0.0")
