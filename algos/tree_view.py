"""Trees for people: grown trees as JSON-ready dicts (with the advantages the learner saw) and as one
self-contained HTML page where branch points, actions, observations, rewards and advantages can be read.
"""

from __future__ import annotations

import html
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from algos.tree import Node, Tree


def trees_to_dicts(trees: Sequence[Tree], questions: Mapping[int, str] | None = None, *,
                   snippet_chars: int = 300) -> list[dict[str, Any]]:
    """Nested dicts of ``trees``. Every leaf gets ``leaf_index``: its position among all leaves of ``trees`` in
    tree order, which is its record's position in ``algos.batch.leaf_records(trees)``."""
    counter = iter(range(sum(len(tree.leaves()) for tree in trees)))
    questions = questions or {}
    return [{"prompt_index": tree.prompt_index, "tree_id": tree.tree_id,
             "question": questions.get(tree.prompt_index, ""),
             "root": _node_dict(tree.root, f"{tree.prompt_index}.{tree.tree_id}", counter, snippet_chars)}
            for tree in trees]


def _node_dict(node: Node, node_id: str, leaf_counter, snippet_chars: int) -> dict[str, Any]:
    out: dict[str, Any] = {"id": node_id, "depth": node.depth, "action": node.action, "text": node.text,
                           "observation": _snippet(node.observation, snippet_chars), "is_leaf": node.is_leaf}
    if node.entropy is not None:  # measured for --branching entropy: where the policy was uncertain
        out["entropy"] = node.entropy
    if node.is_leaf:
        out.update(leaf_index=next(leaf_counter), reward=node.reward, em=float(node.info.get("em", 0.0)),
                   answer=node.info.get("answer"))
    out["children"] = [_node_dict(child, f"{node_id}.{i}", leaf_counter, snippet_chars)
                       for i, child in enumerate(node.children)]
    return out


def _snippet(text: str, limit: int) -> str:
    text = text.strip()
    return text if len(text) <= limit else text[:limit].rstrip() + " ..."


def with_advantages(tree: dict[str, Any], advantages: Sequence[float], offset: int = 0) -> dict[str, Any]:
    """A copy of a tree dict where every node carries ``advantage`` and ``leaves``: a leaf its own advantage
    (``advantages[offset + leaf_index]``), an inner node the mean over the leaves below it. The mean is the
    step-level signal a shared step receives: its tokens are trained once per leaf below it."""
    return {**tree, "root": _annotate(tree["root"], advantages, offset)[0]}


def _annotate(node: dict[str, Any], advantages: Sequence[float], offset: int) -> tuple[dict[str, Any], list[float]]:
    if node["is_leaf"]:
        below = [float(advantages[offset + node["leaf_index"]])]
        return {**node, "advantage": below[0], "leaves": 1}, below
    children, below = [], []
    for child in node["children"]:
        annotated, values = _annotate(child, advantages, offset)
        children.append(annotated)
        below.extend(values)
    advantage = float(np.mean(below)) if below else float("nan")
    return {**node, "children": children, "advantage": advantage, "leaves": len(below)}, below


def trees_html(trees: Sequence[dict[str, Any]], title: str = "Tree-GRPO trees") -> str:
    """One HTML page (inline CSS, no scripts) showing every tree as nested, collapsible steps."""
    body = "\n".join(_tree_html(tree) for tree in trees)
    return f"<!doctype html>\n<html><head><meta charset='utf-8'><title>{html.escape(title)}</title>\n" \
           f"<style>{_CSS}</style></head>\n<body><h1>{html.escape(title)}</h1>\n{_LEGEND}\n{body}\n</body></html>\n"


def _tree_html(tree: dict[str, Any]) -> str:
    heading = f"prompt {tree['prompt_index']}, tree {tree['tree_id']}"
    question = html.escape(tree.get("question", ""))
    return f"<section><h2>{heading}</h2><p class='q'>{question}</p><ul class='tree'>{_node_html(tree['root'])}" \
           f"</ul></section>"


def _node_html(node: dict[str, Any]) -> str:
    children = node["children"]
    stats = []
    if "advantage" in node:
        sign = "pos" if node["advantage"] > 0 else "neg" if node["advantage"] < 0 else "zero"
        stats.append(f"<span class='adv {sign}'>advantage {node['advantage']:+.3f}</span>")
    if node["is_leaf"]:
        stats.append(f"<span class='reward'>reward {node['reward']:.2f}</span>")
        stats.append(f"answer: {html.escape(str(node.get('answer')))}")
    if "leaves" in node and not node["is_leaf"]:
        stats.append(f"{node['leaves']} leaves below")
    if "entropy" in node:
        stats.append(f"entropy {node['entropy']:.2f}")
    if len(children) > 1:
        stats.append(f"<span class='branch'>branch point: {len(children)} continuations</span>")
    label = "prompt" if node["depth"] == 0 else f"step {node['depth']}"
    action = html.escape(node["action"], quote=True)
    summary = f"<b>{label}</b> <span class='action {action}'>{action}</span> {' · '.join(stats)}"
    detail = ""
    if node["text"]:
        detail += f"<pre class='text'>{html.escape(node['text'])}</pre>"
    if node["observation"]:
        detail += f"<pre class='obs'>{html.escape(node['observation'])}</pre>"
    inner = "".join(_node_html(child) for child in children)
    sub = f"<ul>{inner}</ul>" if inner else ""
    return f"<li id='n{node['id']}'><details open><summary>{summary}</summary>{detail}{sub}</details></li>"


_CSS = """
body{font-family:system-ui,sans-serif;margin:1.5em;color:#222}
ul.tree,ul.tree ul{list-style:none;padding-left:1.4em;border-left:2px solid #ccc;margin:0}
li{margin:.3em 0}
summary{cursor:pointer}
pre{white-space:pre-wrap;margin:.2em 0 .2em 1em;padding:.3em;font-size:.85em;max-width:110ch}
pre.text{background:#f4f4f8}
pre.obs{background:#fff8e6;color:#555}
.action{border-radius:3px;padding:0 .4em;font-size:.85em;background:#ddd}
.action.search{background:#cfe3ff}.action.answer{background:#d4f5d4}.action.invalid{background:#ffd6d6}
.adv.pos{color:#0a7a0a}.adv.neg{color:#b00000}.adv.zero{color:#777}
.branch{color:#7a3db8;font-weight:bold}
.q{font-style:italic}
"""

_LEGEND = ("<p>Each line is one agent step (its generated text, then in yellow the observation it drew). "
           "A leaf's advantage is the one its trajectory was trained with; an inner step shows the mean over the "
           "leaves below it, the step-level signal that sibling branches produce.</p>")
