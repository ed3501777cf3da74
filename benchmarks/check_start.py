"""The copying check of a SynthBranch start policy (docs/protocol_branching.md), run before any pilot from it.

    python benchmarks/check_start.py MODEL                  # the branching testbed's world, 100 held-out questions
    python benchmarks/check_start.py MODEL --questions 300 --split train
    python benchmarks/check_start.py MODEL --sampled        # chains sampled as rollouts sample: routes greedy skips
    python benchmarks/check_start.py MODEL --lead           # bench_branching.py --lead's world (4 searches)
    python benchmarks/check_start.py RUN/checkpoints/latest --no-chains --questions 300 --split train  # seconds

Greedy (sampled with --sampled), on the first --questions questions: dev EM, the route each chain took at the
decision (right, wrong, neither person; ``algos.evaluation.route_taken``) and the EM of each route. Teacher-forced
on the right route's oracle trajectory (``experiments.oracle_trajectories.oracle_trajectory``): the probability of the
person's first name token at the decision (a choice) and of the surname's first token after it (copying: the passage
names several people with that first name across the world, so only the token after the chosen name in the passage
predicts it). In a world of one-word names (``names="given"``) the first token is the whole name: no surname is
reported. A start trained on restating thoughts (``warmstart.py --restate``, and ``--restate-goal``, as its
``warmstart.json`` says) is read in that format, and the asked role's word in the thought at the decision is
reported too (``role_p``: the decision itself). The person's first-token probability and ``role_p`` are also given
per asked role (``first_name_p_founder``, ``role_p_chair``, ...); ``role_p_chair_elsewhere`` is p(" chair") at the
decision on the other role's questions, and ``role_dependence_chair`` the difference: how much the decision depends
on the question (0: the start writes " chair" as often whichever role is asked, so a reward that raises it on the
chair questions raises it on the founder ones, where it is wrong); ``role_in_nucleus_chair`` (...) is the share of
the chair questions whose role word lies in the rollouts' top-p nucleus at the decision (--top-p): at 0, no rollout
can take the right route there, whatever the budget.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

import gymnasium as gym
import numpy as np
import torch

import envs  # noqa: F401  (registers the env ids)
from benchmarks.bench_branching import LEAD_WORLD, TOPK, WORLD
from benchmarks.learning_testbed import max_turns_for
from envs.synthetic import BRANCH_ROLES, world_data_dir
from experiments.arg_types import fraction
from experiments.checkpoints import CONFIG_FILE, RLLIB_MARKER, CheckpointError
from experiments.cli import read_yaml
from experiments.evaluate import load_policy, world_held_out
from experiments.oracle_trajectories import oracle_trajectory
from experiments.run import run_directory
from experiments.settings import RunSettings
from policies.generation import SamplingSettings, end_of_turn_ids
from policies.sampling import nucleus_mask


def name_token_probabilities(model, tokenizer, env: gym.Env, indices: list[int], restate: bool = False,
                             top_p: float = SamplingSettings().top_p, decision_hop: int = 1,
                             goal: bool = False) -> list[tuple[float, float, float, float, float]]:
    """Per question (``env``'s records at ``indices``): the model's probability of the decision's person's first
    token, of its surname's first token (NaN for a one-word name) and, with ``restate`` (a start trained on
    restating thoughts, ``warmstart.py --restate``), of the asked role's word in the thought at the decision,
    whether that word lies in the ``top_p`` nucleus there (1.0 or 0.0: whether a rollout sampling at top-p can take
    the right route at all) and the probability of the other role's word there (the wrong route; all three NaN
    without), teacher-forced on the right route's oracle trajectory in the start's own format (``goal``: its
    thoughts carry the asked role to the decision, ``warmstart.py --restate-goal``). ``decision_hop``:
    the search whose entity is the decision's person (``BranchSpec.decision_hop``: 1, the one after the company's;
    2 in a world with a lead hop)."""
    end_of_turn = min(end_of_turn_ids(tokenizer, model))
    rows = []
    for index in indices:
        asked = asked_role(env.unwrapped.records[index].question)
        ids, generated = oracle_trajectory(env, tokenizer, index, env.unwrapped.max_turns, end_of_turn,
                                           restate=restate, goal_role=asked if goal else None)
        record = env.unwrapped.record
        person = record.supporting_titles[decision_hop]
        start = _generated_at(ids, generated, tokenizer(f" {person}", add_special_tokens=False)["input_ids"])[0]
        surname = start + len(tokenizer(f" {person.split()[0]}", add_special_tokens=False)["input_ids"])
        with torch.no_grad():
            probabilities = torch.softmax(model(torch.tensor([ids])).logits[0].float(), -1)
        # the role word restated at the decision: the last generated " chair" / " founder" before the person's
        # name (a stated goal names it earlier too)
        role_word = tokenizer(f" {asked}", add_special_tokens=False)["input_ids"][:1]
        role_at = max(t for t in _generated_at(ids, generated, role_word) if t < start) if restate else None
        first, after, chosen = (_probability_at(probabilities, ids, t) for t in (start, surname, role_at))
        reachable, other = float("nan"), float("nan")
        if restate:
            reachable = float(in_nucleus(probabilities[role_at - 1], ids[role_at], top_p))
            (other_role,) = (role for role in BRANCH_ROLES if role != asked)
            other_word = tokenizer(f" {other_role}", add_special_tokens=False)["input_ids"][0]
            other = probabilities[role_at - 1, other_word].item()
        rows.append((first, after if " " in person else float("nan"), chosen, reachable, other))
    return rows


def in_nucleus(probabilities: torch.Tensor, token: int, top_p: float) -> bool:
    """Whether ``token`` is among what sampling the distribution ``probabilities`` [V] at ``top_p`` can draw: the
    nucleus (``policies.sampling.nucleus_mask``), every token of non-zero probability at top-p 1."""
    if top_p >= 1.0:
        return bool(probabilities[token] > 0)
    ordered, order = torch.sort(probabilities, descending=True)
    return bool(nucleus_mask(ordered[None], top_p)[0][order == token].item())


def asked_role(question: str) -> str:
    """The role a question asks about (``BRANCH_ROLES``: founder or chair)."""
    return next(role for role in BRANCH_ROLES if f" {role} of " in question)


def _probability_at(probabilities: torch.Tensor, ids: list[int], t: int | None) -> float:
    """The probability of token ``t`` of ``ids`` (position t - 1 predicts it); NaN for no position."""
    return probabilities[t - 1, ids[t]].item() if t is not None else float("nan")


def _generated_at(ids: list[int], generated: list[int], tokens: list[int]) -> list[int]:
    """Where ``tokens`` occur among the generated ids, in order."""
    return [t for t in range(len(ids)) if generated[t] and ids[t:t + len(tokens)] == tokens]


def thought_format(model: str) -> tuple[bool, bool]:
    """Whether the start at ``model`` was trained on restating thoughts and on thoughts stating the goal
    (``warmstart.py --restate``, ``--restate-goal``), as its ``warmstart.json`` says (a warm start's model
    directory; a training checkpoint, OUTPUT/checkpoints/NAME, is read as the start its run's ``config.yaml``
    names); (False, False) for any other model."""
    path = Path(model).resolve()
    if (path / RLLIB_MARKER).exists():
        try:
            run_dir = run_directory(path)
        except CheckpointError:  # an RLlib checkpoint not written by run.py: no start to follow
            return False, False
        return thought_format(read_yaml(run_dir / CONFIG_FILE, RunSettings)[0]["model"])
    summary = path.parent / "warmstart.json"
    if not summary.is_file():
        return False, False
    settings = json.loads(summary.read_text(encoding="utf-8"))["settings"]
    return bool(settings.get("restate", False)), bool(settings.get("restate_goal", False))


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="the start policy: a model directory, a --model name or a training checkpoint")
    p.add_argument("--questions", type=int, default=100)
    p.add_argument("--split", choices=["dev", "train"], default="dev", help="teacher-forced part: which split")
    p.add_argument("--top-p", type=fraction, default=SamplingSettings().top_p,
                   help="the rollouts' nucleus, for the share of questions whose right role it holds (default: "
                        "%(default)s, run.py's)")
    p.add_argument("--sampled", action="store_true",
                   help="sample the chains as rollouts do (temperature 1, top-p 0.95, seeded) instead of greedy: the "
                        "EM of a route that greedy decoding never takes")
    p.add_argument("--lead", action="store_true", help="LEAD_WORLD (bench_branching.py --lead) instead of WORLD")
    p.add_argument("--no-chains", action="store_true",
                   help="the teacher-forced probabilities only (seconds): no chains, no EM or routes")
    args = p.parse_args(argv)
    args.world = LEAD_WORLD if args.lead else WORLD
    args.data_dir = world_data_dir(args.world)
    args.max_turns = max_turns_for("SynthBranch-v0", args.data_dir)
    summary = {} if args.no_chains else chain_routes(args)
    summary.update(decision_probabilities(args))
    for key, value in summary.items():
        print(f"{key}: {value:.3f}")
    return summary


def chain_routes(args: argparse.Namespace) -> dict[str, float]:
    """Dev EM of the chains (greedy, or sampled), the share of each route taken at the decision and its EM."""
    rows = world_held_out(args.model, args.data_dir, args.questions, 64, TOPK, env_id="SynthBranch-v0",
                          greedy=not args.sampled, max_turns=args.max_turns)
    routes = Counter(row["route"] for row in rows)
    summary = {"em": float(np.mean([row["em"] for row in rows]))}
    for route, count in sorted(routes.items()):  # em_right is the check's "EM on routed right"
        summary[f"share_{route}"] = count / len(rows)
        summary[f"em_{route}"] = float(np.mean([row["em"] for row in rows if row["route"] == route]))
    return summary


def decision_probabilities(args: argparse.Namespace) -> dict[str, float]:
    """The teacher-forced probabilities at the decision of the command line's policy (``policy_decision``)."""
    return policy_decision(args.model, args.data_dir, args.split, args.questions, args.max_turns, args.top_p,
                           args.world.decision_hop)


def policy_decision(policy: str, data_dir: Path, split: str, questions: int, max_turns: int, top_p: float,
                    decision_hop: int) -> dict[str, float]:
    """The teacher-forced probabilities at the decision (``name_token_probabilities``) of ``policy`` (a model
    directory or a training checkpoint, read in its start's thought format) on the first ``questions`` of ``split``
    of the SynthBranch world in ``data_dir``, averaged, per asked role (``decision_summary``)."""
    model, tokenizer = load_policy(policy)
    env = gym.make("SynthBranch-v0", data_dir=str(data_dir), split=split, topk=TOPK, max_turns=max_turns)
    indices = list(range(min(questions, len(env.unwrapped.records))))
    restate, goal = thought_format(policy)
    probabilities = np.array(name_token_probabilities(model, tokenizer, env, indices, restate=restate, top_p=top_p,
                                                      decision_hop=decision_hop, goal=goal))
    return decision_summary(probabilities, [asked_role(env.unwrapped.records[i].question) for i in indices])


def decision_summary(probabilities: np.ndarray, asked: list[str]) -> dict[str, float]:
    """Means of ``name_token_probabilities``'s rows [questions, 5] over the questions, and per asked role (``asked``:
    each question's role): the check's keys (the module's docstring)."""
    roles = np.array(asked)
    summary = {"first_name_p": float(probabilities[:, 0].mean())}
    restated = not np.isnan(probabilities[:, 2]).all()
    if restated:  # the decision as the start writes it: the asked role's word
        summary["role_p"] = float(probabilities[:, 2].mean())
    for role in BRANCH_ROLES:  # per asked role: a copy keyed on the token before a name favours one sentence's
        mine = roles == role  # person, and a decision that reads the question moves the role_p apart
        if mine.any():
            summary[f"first_name_p_{role}"] = float(probabilities[mine, 0].mean())
            if restated:
                summary[f"role_p_{role}"] = float(probabilities[mine, 2].mean())
                summary[f"role_in_nucleus_{role}"] = float(probabilities[mine, 3].mean())
            if restated and (~mine).any():  # the role's word where the other is asked: column 4 of those questions
                summary[f"role_p_{role}_elsewhere"] = float(probabilities[~mine, 4].mean())
                summary[f"role_dependence_{role}"] = summary[f"role_p_{role}"] - summary[f"role_p_{role}_elsewhere"]
    if not np.isnan(probabilities[:, 1]).all():
        summary.update(surname_p=float(probabilities[:, 1].mean()),
                       surname_p_above_half=float((probabilities[:, 1] > 0.5).mean()))
    return summary


if __name__ == "__main__":
    main()
