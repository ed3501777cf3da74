"""The retrieval oracle's trajectories, the warm start's training data (``experiments/warmstart.py``): each laid out
token for token as the RL rollouts are, with a 0/1 mask of the generated tokens; the data directories they come
from (the served world and ``--extra-worlds`` more); and, on SynthBranch, which questions the oracle misroutes."""

from __future__ import annotations

import argparse
import dataclasses
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

import gymnasium as gym
import numpy as np

import envs
from envs.datasets import QARecord
from envs.synthetic import SPECS, SynthQuestion, branch_questions, read_spec, world_data_dir, world_dir
from experiments.baselines import OracleAgent, in_format
from policies.generation import observation_ids, prompt_ids

ORACLE_FORMAT = 3
"""The version of the text the oracle writes (its thoughts, searches and answers): cached warm starts are keyed by it
(``warmstart.cached_warm_start``), so a change to that text bumps it; tests/test_warmstart.py pins what it renders."""


def oracle_trajectory(env: gym.Env, tokenizer, index: int, max_searches: int, end_of_turn: int,
                      answer: bool = True, premature: bool = False, route: SynthQuestion | None = None,
                      restate: bool = False, goal_role: str | None = None,
                      cite: bool = False, require_gold: bool = False,
                      read: bool = False) -> tuple[list[int], list[int]] | None:
    """Question ``index``'s oracle trajectory: token ids and a 0/1 mask of the generated ones. With
    ``answer=False`` the oracle never answers: where it would, it repeats its last search until the episode
    ends unanswered. With ``premature=True`` a multi-hop question is answered after its first search, with the
    entity that search found (the second hop's bridge: a wrong answer in the right format). With ``route`` the
    oracle searches that route's chain and answers its answer instead of the gold ones (SynthBranch's wrong
    route, ``SynthQuestion.decoy``). With ``restate`` the thought before each search restates the sentence of the
    last passage that ends with the query (``OracleAgent``). With ``goal_role`` (SynthBranch: the role the question
    asks) the thoughts carry the question's goal to the decision, each copying the one before: the first states it
    in the question's words ("I need the chair of the company Anna works for"), the one before the search of the
    decision's passage (the company's, the third search from the end) names the company found ("Anna works for
    Tosafen Works. I need the chair of Tosafen Works"); the decision ("The chair of Tosafen Works is Jose")
    follows it, or on a misrouted ``route`` does not. With ``cite`` (real questions) the thoughts before the later
    searches and the answer quote the passage sentence naming what comes next (``OracleAgent``). With
    ``require_gold``, None where a supporting title's passage did not come back for its search (the corpus lacks it,
    or ranks it below the top k): a trajectory that would teach answering from nothing. With ``read``, the titles the
    question names are searched first and each query is written as it was read; None where a query or the answer is
    named neither in the question nor in a passage before it: a trajectory that would teach searching without
    reading."""
    prompt, _ = env.reset(options={"index": index})
    record = env.unwrapped.record
    agent = OracleAgent(max_searches, restate=restate, goals=goal_thoughts(record, goal_role) if goal_role else None,
                        cite=cite, read=read)
    if route is not None:
        record = dataclasses.replace(record, supporting_titles=route.chain, answers=(route.answer,))
    if premature and len(record.supporting_titles) > 1:
        record = dataclasses.replace(record, supporting_titles=record.supporting_titles[:1],
                                     answers=(record.supporting_titles[1],))
    agent.start(prompt, record)
    ids = list(prompt_ids(tokenizer, prompt))
    generated = [0] * len(ids)
    observation, done, last_query = prompt, False, env.unwrapped.record.question
    while not done:
        text = agent.act(observation)
        if "<search>" in text:
            last_query = agent.pending
        elif not answer:
            text = in_format("I should check again", "search", last_query)
        step = tokenizer(text, add_special_tokens=False)["input_ids"]
        observation, _, terminated, truncated, _ = env.step(text)
        done = terminated or truncated
        if terminated:  # answered: as in the rollouts, the end-of-turn token follows </answer>
            step = [*step, end_of_turn]
        ids += step
        generated += [1] * len(step)
        if observation:
            obs = observation_ids(tokenizer, observation)
            ids += obs
            generated += [0] * len(obs)
    if (require_gold and agent.found < agent.searched) or agent.unread:
        return None
    return ids, generated


def goal_thoughts(record: QARecord, role: str) -> dict[int, str]:
    """The goal each thought states (``oracle_trajectory``'s ``goal_role``), by search: the first the question's
    own words, the company's search (the third from the end) its name; one thought where the company is searched
    first."""
    asked = re.search(rf"the {role} of (.+) born\?", record.question)
    if asked is None:
        raise ValueError(f"not a SynthBranch question about the {role}: {record.question!r}")
    company = record.supporting_titles[-3]
    return {0: f"I need the {role} of {asked.group(1)}",
            len(record.supporting_titles) - 3: f"I need the {role} of {company}"}


def oracle_data_dirs(args: argparse.Namespace, env_kwargs: dict) -> list[Path]:
    """The data directories whose train questions are trained: ``--env``'s (for a generated world, the world it
    serves: the data directory's, else the default one), then ``--extra-worlds`` worlds shaped like it with the
    seeds that follow its seed (written to ``--cache-dir``)."""
    dataset = envs.ENV_IDS[args.env][0]
    if dataset not in SPECS:
        return [Path(env_kwargs["data_dir"])]
    served = world_dir(dataset, data_dir=env_kwargs["data_dir"])
    spec = read_spec(dataset, served)
    return [served, *(world_data_dir(dataclasses.replace(spec, seed=spec.seed + k), args.cache_dir)
                      for k in range(1, args.extra_worlds + 1))]


def train_branch_questions(env: gym.Env, data_dir: Path) -> list[SynthQuestion]:
    """The train questions of a SynthBranch env serving ``data_dir``, in its order, each with its wrong route
    (``decoy``: the other person's) and the role it asks about."""
    return branch_questions(data_dir, "train", [r.question for r in env.unwrapped.records])


def premature_questions(order: Sequence[int], share: float, paths: Sequence[tuple[str, ...] | None],
                        template_shares: Mapping[tuple[str, ...], float],
                        multi_hop: Sequence[bool] | None = None) -> set[int]:
    """The questions whose oracle answers one hop short, drawn from the end of ``order`` (a seeded permutation of
    the question indices, whose start draws the unanswered ones): those of each template in ``template_shares``
    (``paths[i]``, question i's relation path) that template's share of them, the others ``share`` of the others;
    with ``multi_hop`` (whether question i needs more than one search), of the other multi-hop questions only, so
    that exactly that share of them is answered short (1-hop questions have no hop to skip)."""
    groups: dict[tuple[str, ...] | None, list[int]] = {}
    for i in reversed(order):
        group = paths[i] if paths[i] in template_shares else None
        if group is None and multi_hop is not None and not multi_hop[i]:
            continue
        groups.setdefault(group, []).append(i)
    return {i for path, members in groups.items()
            for i in members[: round((share if path is None else template_shares[path]) * len(members))]}


def misrouted_questions(questions: Sequence[SynthQuestion], share: float, role: str | None,
                        seed: int) -> set[int]:
    """The positions of ``questions`` whose oracle follows the wrong person: ``share`` of them, drawn at random
    (``seed``) among those asking about ``role`` (every question without one)."""
    eligible = [i for i, q in enumerate(questions) if role is None or q.role == role]
    order = np.random.default_rng([seed, 1]).permutation(len(eligible))
    return {eligible[i] for i in order[: round(share * len(eligible))]}
