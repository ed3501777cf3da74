"""Evaluation's routing on a world whose questions turn on one decision (SynthBranch): which route a chain took,
the failure kind it makes, and the share routed right with the exact match on those, by hand."""

from __future__ import annotations

import math

import pytest

import experiments.evaluate as evaluate
import policies.generators
from algos.evaluation import QUERIES, failure_kind, failure_mix, occurring_failures, route_taken, routing
from envs.synthetic import BranchSpec, WorldSpec, branch_questions, write_world

RIGHT = ("Brightwater Guild", "Varno Keld", "Quellmoor")
WRONG = ("Brightwater Guild", "Tal Mirren", "Dravia Bay")


@pytest.mark.parametrize(("queries", "route"), [
    (["Brightwater Guild", "Varno Keld", "Quellmoor"], "right"),
    (["Brightwater Guild", "varno keld."], "right"),  # normalised as answers are
    (["Brightwater Guild", "Tal Mirren", "Quellmoor"], "wrong"),  # the decision is the second search
    (["Brightwater Guild", "Varno"], "neither"),  # half a name names no one
    (["Brightwater Guild"], "neither"),  # answered (or gave up) before the decision
    ([], "neither"),
])
def test_the_route_is_read_from_the_query_at_the_decision(queries, route):
    assert route_taken(queries, RIGHT, WRONG) == route


def test_routes_that_never_differ_are_an_error():
    with pytest.raises(ValueError, match="do not differ"):
        route_taken(["a"], ("a", "b"), ("a", "b"))


def row(em: float, route: str | None = None, answered: float = 1.0, tool_calls: float = 3.0) -> dict:
    return {"em": em, "answered": answered, "tool_calls": tool_calls, "hops": 3.0,
            **({} if route is None else {"route": route})}


def test_a_wrong_answer_after_the_wrong_route_is_its_own_failure_kind():
    assert failure_kind(row(0.0, "wrong")) == "wrong route"
    assert failure_kind(row(0.0, "wrong", tool_calls=1.0)) == "wrong route"  # the route went wrong first
    assert failure_kind(row(0.0, "right")) == "wrong answer"  # routed right, copied wrong
    assert failure_kind(row(0.0, "neither", tool_calls=1.0)) == "answered before its last hop"
    assert failure_kind(row(0.0, "wrong", answered=0.0)) == "no answer"
    assert failure_kind(row(1.0, "wrong")) == "correct"  # both routes can end alike: the answer decides
    mix = failure_mix([row(1.0, "right"), row(0.0, "wrong"), row(0.0, "wrong"), row(0.0, "right")])
    assert mix == {"correct": 0.25, "wrong route": 0.5, "wrong answer": 0.25}
    assert occurring_failures(mix, {"no answer": 0.0, "correct": 1.0}) == ["correct", "wrong answer", "wrong route"]


def test_routing_is_the_share_routed_right_and_the_em_on_those():
    rows = [row(1.0, "right"), row(1.0, "right"), row(0.0, "right"), row(0.0, "wrong"), row(0.0, "neither")]
    assert routing(rows) == {"routed_right": 0.6, "routed_right_questions": 3.0, "em_routed_right": 2 / 3}
    nowhere = routing([row(0.0, "wrong")])
    assert nowhere["routed_right"] == 0.0 and math.isnan(nowhere["em_routed_right"])
    assert routing([row(1.0)]) == {}  # a world without routes (SynthHop)


def test_held_out_synthbranch_results_carry_the_hops_and_the_route(tmp_path, monkeypatch):
    spec = BranchSpec(people=20, companies=10, cities=6, countries=3, train_questions=8, dev_questions=4)
    root = write_world(spec, tmp_path)
    questions = spec.world().split_questions()["dev"]
    # the chains' queries: the right person, the wrong one, a stop after the first search, a garbled name
    chains = [[q.chain[0], q.chain[1]] for q in questions[:1]] + [[questions[1].chain[0], questions[1].decoy.chain[1]],
                                                                 [questions[2].chain[0]], [questions[3].chain[0], "x"]]
    monkeypatch.setattr(evaluate, "load_policy", lambda policy: (None, None))
    monkeypatch.setattr(policies.generators, "step_generator", lambda *args: None)
    monkeypatch.setattr(evaluate, "evaluate_env", lambda env_id, *args, limit, **kwargs: [
        {"em": 0.0, "answered": 1.0, "tool_calls": float(len(q)), QUERIES: q} for q in chains[:limit]])
    rows = evaluate.world_held_out("policy", root, 4, 16, 1, env_id="SynthBranch-v0")
    assert [r["route"] for r in rows] == ["right", "wrong", "neither", "neither"]
    assert [r["hops"] for r in rows] == [3.0] * 4
    hop = write_world(WorldSpec(people=20, companies=10, cities=6, countries=3, train_questions=8, dev_questions=4),
                      tmp_path / "synthhop")
    assert all("route" not in r for r in evaluate.world_held_out("policy", hop, 4, 16, 1))  # SynthHop: no routes
    with pytest.raises(ValueError, match=r"not those of its world\.json"):
        branch_questions(root, "dev", [q.question for q in questions[::-1]])


@pytest.mark.parametrize("greedy", [True, False])
def test_held_out_chains_are_greedy_unless_asked_to_sample_as_rollouts_do(tmp_path, monkeypatch, greedy):
    root = write_world(WorldSpec(people=20, companies=10, cities=6, countries=3, train_questions=8, dev_questions=4),
                       tmp_path)
    used = []
    monkeypatch.setattr(evaluate, "load_policy", lambda policy: (None, None))
    monkeypatch.setattr(policies.generators, "step_generator", lambda backend, model, tok, sampling: used.append(
        sampling))
    monkeypatch.setattr(evaluate, "evaluate_env", lambda env_id, *args, limit, **kwargs: [
        {"em": 0.0, "answered": 1.0, "tool_calls": 1.0, QUERIES: []}] * limit)
    evaluate.world_held_out("policy", root, 4, 16, 1, greedy=greedy)
    assert [(s.greedy, s.temperature, s.top_p, s.max_step_tokens) for s in used] == [(greedy, 1.0, 0.95, 16)]
