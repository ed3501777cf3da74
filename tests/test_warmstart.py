"""Warm start (experiments/warmstart.py, oracle_trajectories.py, sft.py): oracle trajectories laid out like RL
rollouts, SFT that trains the generated tokens only, resuming, and the cached warm starts."""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
import threading
import time
from dataclasses import replace
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch

import envs  # noqa: F401  (registers the env ids)
import experiments.warmstart as warmstart_module
from envs.cache import WARM_START_LOCK
from envs.datasets import QARecord
from envs.synthetic import BranchSpec, WorldSpec, write_world
from experiments.cache import scan
from experiments.oracle_trajectories import (
    ORACLE_FORMAT,
    goal_thoughts,
    misrouted_questions,
    oracle_data_dirs,
    oracle_trajectory,
    premature_questions,
    train_branch_questions,
)
from experiments.sft import (
    SoftmaxVocabulary,
    TokenWeights,
    learning_rate_factor,
    loss_weights,
    pad,
    sft_loss,
    train,
)
from experiments.warmstart import cached_warm_start, parse_args, template_shares, warm_start_key
from experiments.warmstart import main as warmstart_main
from policies.generation import observation_ids, prompt_ids
from policies.models import build_tiny_random, load_model

WORLD = WorldSpec(people=20, companies=10, cities=6, countries=3, train_questions=20, dev_questions=10)
BRANCH = BranchSpec(people=20, companies=10, cities=6, countries=3, train_questions=8, dev_questions=4)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = write_world(WORLD, tmp_path_factory.mktemp("world"))
    env = gym.make("SynthHop-v0", split="train", data_dir=root)
    _, tokenizer = load_model("tiny-random")
    return env, tokenizer, root


def test_oracle_trajectory_is_prompt_steps_and_masked_observations(setup):
    env, tokenizer, _ = setup
    ids, generated = oracle_trajectory(env, tokenizer, 0, max_searches=3, end_of_turn=tokenizer.eos_token_id)
    record = env.unwrapped.records[0]
    prompt = prompt_ids(tokenizer, env.unwrapped.prompt)
    assert tuple(ids[:len(prompt)]) == prompt and not any(generated[:len(prompt)])
    text = tokenizer.decode([i for i, g in zip(ids, generated, strict=True) if g])
    assert text.count("<search>") == len(record.supporting_titles) and text.count("<answer>") == 1
    assert f"<answer> {record.answers[0]} </answer>" in text and ids[-1] == tokenizer.eos_token_id and generated[-1]
    # every observation (retrieved passages) is in the sequence and masked out
    masked = [i for i, g in zip(ids[len(prompt):], generated[len(prompt):], strict=True) if not g]
    first_hop = env.unwrapped.retriever.search([record.supporting_titles[0]], k=3)[0]
    assert first_hop[0].title in tokenizer.decode(masked)
    assert len(masked) >= len(observation_ids(tokenizer, "\n\n<information>"))


def test_an_unanswering_oracle_searches_until_the_episode_ends(setup):
    env, tokenizer, _ = setup
    ids, generated = oracle_trajectory(env, tokenizer, 0, 3, tokenizer.eos_token_id, answer=False)
    text = tokenizer.decode([i for i, g in zip(ids, generated, strict=True) if g])
    assert "<answer>" not in text and text.count("<search>") == 4  # 3 turns + the final one, all searches
    assert ids[-1] != tokenizer.eos_token_id


def test_a_premature_oracle_answers_a_multi_hop_question_with_its_first_bridge(setup):
    env, tokenizer, _ = setup
    index = next(i for i, r in enumerate(env.unwrapped.records) if len(r.supporting_titles) >= 2)
    record = env.unwrapped.records[index]
    ids, generated = oracle_trajectory(env, tokenizer, index, 3, tokenizer.eos_token_id, premature=True)
    text = tokenizer.decode([i for i, g in zip(ids, generated, strict=True) if g])
    assert text.count("<search>") == 1 and f"<search> {record.supporting_titles[0]} </search>" in text
    assert f"<answer> {record.supporting_titles[1]} </answer>" in text  # the bridge: right format, wrong answer
    one_hop = next(i for i, r in enumerate(env.unwrapped.records) if len(r.supporting_titles) == 1)
    # a one-hop question has no hop to skip: the same trajectory as the full oracle's
    assert oracle_trajectory(env, tokenizer, one_hop, 3, tokenizer.eos_token_id, premature=True) == \
        oracle_trajectory(env, tokenizer, one_hop, 3, tokenizer.eos_token_id)


def test_premature_questions_are_drawn_from_the_permutations_end_by_template():
    order = [3, 0, 5, 1, 4, 2, 6, 7]
    a, b = ("founder", "born_in"), ("spouse", "born_in")
    paths = [a, b, a, b, ("spouse",), a, None, b]
    # no template share: the last round(0.5 * 8) = 4 of the permutation, reversed: 7, 6, 2, 4
    assert premature_questions(order, 0.5, paths, {}) == {7, 6, 2, 4}
    # template a (questions 0, 2, 5; reversed order 2, 5, 0) at 2/3 -> 2, 5; the other five (reversed 7, 6, 4, 1, 3)
    # at 0.4 -> 7, 6
    assert premature_questions(order, 0.4, paths, {a: 2 / 3}) == {2, 5, 7, 6}
    # template b at 1 and a at 0: all of b (1, 3, 7), none of a, the rest (reversed 6, 4) at 0.5 -> 6
    assert premature_questions(order, 0.5, paths, {a: 0.0, b: 1.0}) == {1, 3, 7, 6}
    # among the multi-hop questions only (all but 4 here): reversed 7, 6, 2, 1, 5, 0, 3 at 0.5 -> round(3.5) = 4 of
    # them, 7, 6, 2, 1; the 1-hop question 4, drawn above, is no longer one of them
    multi_hop = [path is None or len(path) > 1 for path in paths]
    assert premature_questions(order, 0.5, paths, {}, multi_hop) == {7, 6, 2, 1}
    # a template's share is of its own questions either way
    assert premature_questions(order, 0.4, paths, {a: 2 / 3}, multi_hop) == {2, 5, 7, 6}


def test_template_shares_parse_the_option_and_name_what_is_wrong(capsys):
    assert template_shares(["founder.born_in=0.8", "spouse.born_in=0"]) == {("founder", "born_in"): 0.8,
                                                                           ("spouse", "born_in"): 0.0}
    for bad, message in ((["born_in=0.5"], "multi-hop templates' relation paths"),
                         (["founder.born_in"], "is not PATH=SHARE"), (["founder.born_in=x"], "is not a number"),
                         (["founder.born_in=1.5"], "must be in [0, 1]"),
                         (["founder.born_in=0.2", "founder.born_in=0.3"], "given twice")):
        with pytest.raises(ValueError, match=re.escape(message)):
            template_shares(bad)
    with pytest.raises(SystemExit):
        parse_args(["--premature-template", "founder.born_in=2"])
    with pytest.raises(SystemExit):
        parse_args(["--env", "SynthBranch-v0", "--premature-template", "founder.born_in=0.5"])
    err = capsys.readouterr().err
    assert "--premature-template: 'founder.born_in=2': the share must be in [0, 1]" in err
    assert "--premature-template needs --env SynthHop-v0" in err


def test_a_template_share_makes_the_oracle_answer_one_hop_short_on_that_template_only(setup, tmp_path, monkeypatch):
    trained = []
    monkeypatch.setattr(warmstart_module, "train", lambda model, data, **_: trained.extend(data) or
                        {"loss": [], "check": []})
    env, tokenizer, root = setup
    warmstart_main(["--data-dir", str(root), "--hidden-size", "32", "--layers", "1", "--heads", "2", "--epochs", "1",
                    "--dev-questions", "0", "--premature", "0", "--premature-template", "founder.born_in=1",
                    "--output", str(tmp_path / "warm")])
    records = env.unwrapped.records
    assert len(trained) == len(records)
    for record, (ids, generated) in zip(records, trained, strict=True):
        text = tokenizer.decode([i for i, g in zip(ids, generated, strict=True) if g])
        short = text.count("<search>") < len(record.supporting_titles)
        assert short == record.question.startswith("In which city was the founder of"), record.question
    assert any(r.question.startswith("In which city was the founder of") for r in records)


@pytest.fixture(scope="module")
def branch(tmp_path_factory):
    root = write_world(BRANCH, tmp_path_factory.mktemp("branch"))
    return gym.make("SynthBranch-v0", split="train", data_dir=root), root


def test_a_misrouted_oracle_follows_the_other_person_to_a_wrong_answer(branch, setup, tmp_path):
    env, root = branch
    tokenizer = setup[1]
    questions = train_branch_questions(env, root)
    for index, record in enumerate(env.unwrapped.records):
        route = questions[index].decoy
        assert questions[index].role in record.question and route.role is None  # the role asked; a decoy asks none
        assert route.chain[0] == record.supporting_titles[0] and route.chain[1] != record.supporting_titles[1]
        ids, generated = oracle_trajectory(env, tokenizer, index, 3, tokenizer.eos_token_id, route=route)
        text = tokenizer.decode([i for i, g in zip(ids, generated, strict=True) if g])
        assert [f"<search> {title} </search>" in text for title in route.chain] == [True] * 3
        assert f"<answer> {route.answer} </answer>" in text and record.answers[0] not in text
    with pytest.raises(ValueError, match=r"not those of its world\.json"):
        train_branch_questions(env, write_world(replace(BRANCH, seed=1), tmp_path))  # another world's questions


def test_a_restating_oracle_names_the_role_it_follows_before_each_search(setup, tmp_path):
    tokenizer = setup[1]
    spec = replace(BRANCH, names="given", passages="roles")
    root = write_world(spec, tmp_path / "roles")
    env = gym.make("SynthBranch-v0", split="train", data_dir=root)
    questions = train_branch_questions(env, root)
    for index, question in enumerate(questions):
        company = question.chain[0]
        for route, role in ((None, question.role), (question.decoy, None)):
            ids, generated = oracle_trajectory(env, tokenizer, index, 3, tokenizer.eos_token_id, route=route,
                                               restate=True)
            text = tokenizer.decode([i for i, g in zip(ids, generated, strict=True) if g])
            chain = (route or question).chain
            followed = role or next(r for r in ("founder", "chair") if r != question.role)
            # the first search has no passage to restate; the decision's names the role, the next a birth place
            assert f"<think>I need this passage</think>\n<search> {company} </search>" in text
            assert f"<think>The {followed} of {company} is {chain[1]}</think>\n<search> {chain[1]} </search>" in text
            assert f" who was born in {chain[2]}</think>\n<search> {chain[2]} </search>" in text
    ids, generated = oracle_trajectory(env, tokenizer, 0, 3, tokenizer.eos_token_id)
    assert "The founder of" not in tokenizer.decode([i for i, g in zip(ids, generated, strict=True) if g])


def test_goal_stating_thoughts_carry_the_asked_role_from_the_question_to_the_decision(setup, tmp_path):
    tokenizer = setup[1]
    spec = replace(BRANCH, names="given", passages="roles", hops=4, lead=True, people=20)
    root = write_world(spec, tmp_path / "lead")
    env = gym.make("SynthBranch-v0", split="train", data_dir=root, max_turns=4)
    questions = train_branch_questions(env, root)
    for index, question in enumerate(questions):
        lead, company = question.chain[:2]
        for route in (None, question.decoy):
            ids, generated = oracle_trajectory(env, tokenizer, index, 4, tokenizer.eos_token_id, route=route,
                                               restate=True, goal_role=question.role)
            text = tokenizer.decode([i for i, g in zip(ids, generated, strict=True) if g])
            chain = (route or question).chain
            followed = question.role if route is None else next(r for r in ("founder", "chair") if r != question.role)
            # the question's words, then the company found; the decision follows the plan or, misrouted, does not
            assert f"<think>I need the {question.role} of the company {lead} works for</think>" in text
            assert f"<think>{lead} works for {company}. I need the {question.role} of {company}</think>" in text
            assert f"<think>The {followed} of {company} is {chain[2]}</think>\n<search> {chain[2]} </search>" in text
            assert text.count("I need the") == 2
    ids, generated = oracle_trajectory(env, tokenizer, 0, 4, tokenizer.eos_token_id, restate=True)
    assert "I need the" not in tokenizer.decode(ids)
    # where the company is the first search (no lead hop) one thought states the goal, in the question's words
    root = write_world(replace(BRANCH, names="given", passages="roles"), tmp_path / "three")
    env = gym.make("SynthBranch-v0", split="train", data_dir=root)
    question = train_branch_questions(env, root)[0]
    ids, generated = oracle_trajectory(env, tokenizer, 0, 3, tokenizer.eos_token_id, restate=True,
                                       goal_role=question.role)
    text = tokenizer.decode([i for i, g in zip(ids, generated, strict=True) if g])
    assert text.startswith(f"<think>I need the {question.role} of {question.chain[0]}</think>")
    assert text.count("I need the") == 1
    with pytest.raises(ValueError, match="not a SynthBranch question about the chair"):
        goal_thoughts(QARecord("q", "Where was the mayor of Zeta born?", ("x",), supporting_titles=("a", "b", "c")),
                      "chair")


# what ORACLE_FORMAT's oracle renders in test_the_oracles_text_is_the_version_cached_warm_starts_are_keyed_by
ORACLE_TEXT = (3, "e6d4271f24c3fe6a")


def test_the_oracles_text_is_the_version_cached_warm_starts_are_keyed_by(setup, tmp_path, monkeypatch):
    env, tokenizer, _ = setup
    eos = tokenizer.eos_token_id
    multi_hop = next(i for i, r in enumerate(env.unwrapped.records) if len(r.supporting_titles) > 1)
    rendered = [oracle_trajectory(env, tokenizer, 0, 3, eos),
                oracle_trajectory(env, tokenizer, 0, 3, eos, answer=False),
                oracle_trajectory(env, tokenizer, multi_hop, 3, eos, premature=True),
                oracle_trajectory(env, tokenizer, multi_hop, 3, eos, cite=True, read=True)]
    root = write_world(replace(BRANCH, names="given", passages="roles", hops=4, lead=True), tmp_path / "lead")
    lead = gym.make("SynthBranch-v0", split="train", data_dir=root, max_turns=4)
    question = train_branch_questions(lead, root)[0]
    rendered += [oracle_trajectory(lead, tokenizer, 0, 4, eos, route=route, restate=True, goal_role=role)
                 for route in (None, question.decoy) for role in (None, question.role)]
    digest = hashlib.sha256(json.dumps(rendered).encode()).hexdigest()[:16]
    assert (ORACLE_FORMAT, digest) == ORACLE_TEXT, (
        "the oracle's trajectories changed: bump ORACLE_FORMAT (else cached warm starts trained on the old text are "
        "reused) and pin the new (format, digest) in ORACLE_TEXT")
    monkeypatch.setattr(warmstart_module, "main", write_empty_model)
    first = cached_warm_start(BRANCH, ("--seed", "0"), topk=1, cache_dir=tmp_path)
    monkeypatch.setattr(warmstart_module, "ORACLE_FORMAT", ORACLE_FORMAT + 1)
    bumped = cached_warm_start(BRANCH, ("--seed", "0"), topk=1, cache_dir=tmp_path)
    assert bumped != first and f"oracle-format-{ORACLE_FORMAT + 1}-seed-0" in bumped.parent.name


def test_warmstart_misroutes_the_share_asked_on_synthbranch(branch, tmp_path, monkeypatch):
    routed = []
    real = warmstart_module.oracle_trajectory

    def spy(*args, route=None, **kwargs):
        routed.append(route is not None)
        return real(*args, route=route, **kwargs)

    monkeypatch.setattr(warmstart_module, "oracle_trajectory", spy)
    warmstart_main(["--env", "SynthBranch-v0", "--data-dir", str(branch[1]), "--misroute", "0.75",
                    "--hidden-size", "32", "--layers", "1", "--heads", "2", "--epochs", "1", "--dev-questions", "0",
                    "--output", str(tmp_path / "warm")])
    assert len(routed) == BRANCH.train_questions and sum(routed) == 6


def test_a_misroute_role_draws_its_share_among_that_roles_questions_alone(branch):
    questions = train_branch_questions(*branch)
    chairs = {i for i, q in enumerate(questions) if q.role == "chair"}
    assert 0 < len(chairs) < len(questions)  # the fixture has both kinds
    assert misrouted_questions(questions, 1.0, "chair", seed=0) == chairs  # a rule: every chair question
    half = misrouted_questions(questions, 0.5, "chair", seed=0)
    assert half < chairs and len(half) == round(0.5 * len(chairs))
    assert misrouted_questions(questions, 0.5, "chair", seed=1) != half or len(chairs) < 3  # seeded
    assert len(misrouted_questions(questions, 0.5, None, seed=0)) == round(0.5 * len(questions))
    assert misrouted_questions(questions, 0.0, "founder", seed=0) == set()


def test_a_misroute_role_without_a_share_is_refused(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--env", "SynthBranch-v0", "--misroute-role", "chair"])
    assert "--misroute-role needs --misroute" in capsys.readouterr().err


@pytest.mark.parametrize(("option", "value", "message"), [
    ("--batch-size", "0", "--batch-size must be >= 1"), ("--epochs", "0", "--epochs must be >= 1"),
    ("--topk", "0", "--topk must be >= 1"), ("--layers", "0", "--layers must be >= 1"),
    ("--dev-questions", "-1", "--dev-questions must be >= 0"), ("--lr", "0", "--lr must be > 0"),
    ("--max-minutes", "0", "--max-minutes must be > 0")])
def test_counts_and_rates_that_mean_nothing_are_refused_before_anything_is_built(option, value, message, capsys):
    """--batch-size 0 or --epochs 0 used to end in a ZeroDivisionError after the model and the data were built."""
    with pytest.raises(SystemExit):
        parse_args([option, value])
    assert message in capsys.readouterr().err


def test_a_finished_start_in_output_is_kept(tmp_path):
    """Training again into an --output that holds a finished start would replace its model silently: refused."""
    (tmp_path / "warmstart.json").write_text("{}")
    with pytest.raises(SystemExit, match=f"{tmp_path} holds a finished warm start \\(warmstart.json, model/\\)"):
        warmstart_main(["--output", str(tmp_path)])
    assert (tmp_path / "warmstart.json").read_text() == "{}" and sorted(tmp_path.iterdir()) == [
        tmp_path / "warmstart.json"]


@pytest.mark.parametrize("option", ["--unanswered", "--premature", "--misroute"])
def test_shares_outside_zero_one_are_refused(option, capsys):
    with pytest.raises(SystemExit):
        parse_args([option, "1.5"])
    assert f"{option} must be a share in [0, 1]" in capsys.readouterr().err


def test_extra_worlds_have_the_served_worlds_sizes_other_seeds_and_other_names(setup, branch, tmp_path, monkeypatch,
                                                                              capsys):
    monkeypatch.setenv("TREEGRPO_CACHE_DIR", str(tmp_path))  # the extra worlds are generated into the cache
    for env_id, served, spec in (("SynthHop-v0", setup[2], WORLD), ("SynthBranch-v0", branch[1], BRANCH)):
        args = parse_args(["--env", env_id, "--extra-worlds", "2", "--data-dir", str(served)])
        dirs = oracle_data_dirs(args, {"data_dir": str(served)})
        questions = [[r.question for r in gym.make(env_id, data_dir=d).unwrapped.records] for d in dirs]
        expected = [[q.question for q in replace(spec, seed=seed).world().split_questions()["train"]]
                    for seed in (0, 1, 2)]
        assert dirs[0] == served and questions == expected and len({tuple(q) for q in questions}) == 3
    for bad in (["--env", "HotpotQA-v0", "--extra-worlds", "1"], ["--extra-worlds", "-1"],
                ["--env", "SynthHop-v0", "--misroute", "0.5"], ["--observation-weight", "-0.1"]):
        with pytest.raises(SystemExit):
            parse_args(bad)
    err = capsys.readouterr().err
    assert "--extra-worlds needs a generated world (--env SynthHop-v0 or SynthBranch-v0), got --env HotpotQA-v0" in err
    assert "must be >= 0, got -1" in err and "--misroute needs --env SynthBranch-v0" in err
    assert "--observation-weight must be >= 0, got -0.1" in err


def test_sft_loss_ignores_masked_tokens(setup):
    _, tokenizer, _ = setup
    model = build_tiny_random(tokenizer, hidden_size=32, layers=1, heads=2)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    attention = torch.ones_like(ids)
    generated = torch.tensor([[0, 0, 0, 1, 1, 0]])
    with torch.no_grad():
        loss = sft_loss(model, ids, attention, generated)
        logp = torch.log_softmax(model(ids).logits[0].float(), -1)
    expected = -(logp[2, 8] + logp[3, 9]) / 2  # tokens 3 and 4 are predicted at positions 2 and 3
    torch.testing.assert_close(loss, expected, atol=1e-5, rtol=0)


def test_loss_weights_train_observations_after_the_first_step_only():
    # prompt (3 tokens), a step (2), an observation (2), a step (1), an observation (1)
    generated = [0, 0, 0, 1, 1, 0, 0, 1, 0]
    assert loss_weights(generated, 0.0) == [0, 0, 0, 1, 1, 0, 0, 1, 0]
    assert loss_weights(generated, 0.25) == [0, 0, 0, 1, 1, 0.25, 0.25, 1, 0.25]
    assert loss_weights([0, 0], 0.5) == [0.0, 0.0]  # nothing generated: nothing trained


class FixedDraws:
    """A stand-in for a numpy generator whose ``random`` returns the given numbers."""

    def __init__(self, values: list[float]):
        self.values = values

    def random(self, size: int) -> np.ndarray:
        return np.array(self.values[:size])


def test_token_weights_train_a_drawn_share_of_the_observations_at_the_weight_over_the_share():
    # prompt (3 tokens), a step (2), an observation (2), a step (1), an observation (1); share 0.5 keeps a token
    # whose draw is below 0.5, at 0.25 / 0.5
    generated = [0, 0, 0, 1, 1, 0, 0, 1, 0]
    draws = FixedDraws([0.1, 0.9, 0.1, 0.9, 0.1, 0.3, 0.7, 0.9, 0.2])
    assert TokenWeights(0.25, 0.5).draw(generated, draws) == [0, 0, 0, 1, 1, 0.5, 0, 1, 0.5]
    assert TokenWeights(0.25, 1.0).draw(generated, draws) == loss_weights(generated, 0.25)  # no draw
    assert TokenWeights(0.0, 0.5).draw(generated, draws) == generated  # observations untrained: nothing to draw
    # the expected weight of an observation token is the weight asked
    rng = np.random.default_rng(0)
    mean = np.mean([TokenWeights(0.25, 0.5).draw(generated, rng)[5] for _ in range(4000)])
    assert mean == pytest.approx(0.25, abs=0.02)


def test_sft_loss_weighs_observation_tokens(setup):
    _, tokenizer, _ = setup
    model = build_tiny_random(tokenizer, hidden_size=32, layers=1, heads=2)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    weights = torch.tensor([[0, 0, 0, 1, 0.5, 0]])
    with torch.no_grad():
        loss = sft_loss(model, ids, torch.ones_like(ids), weights)
        logp = torch.log_softmax(model(ids).logits[0].float(), -1)
    expected = -(logp[2, 8] + 0.5 * logp[3, 9]) / 1.5  # the weighted mean over the trained tokens
    torch.testing.assert_close(loss, expected, atol=1e-5, rtol=0)


def test_the_data_vocabulary_holds_every_token_of_the_data_and_indexes_it():
    vocabulary = SoftmaxVocabulary.of([([7, 3, 7, 9], [0, 1, 1, 1]), ([3, 12], [0, 1])], vocab_size=16)
    assert vocabulary.ids.tolist() == [3, 7, 9, 12]
    assert vocabulary.index[[3, 7, 9, 12]].tolist() == [0, 1, 2, 3]
    assert (vocabulary.index >= 0).sum() == 4 and vocabulary.index[0] == -1


def test_sft_loss_over_the_data_vocabulary_normalises_over_its_tokens_only(setup):
    _, tokenizer, _ = setup
    model = build_tiny_random(tokenizer, hidden_size=32, layers=1, heads=2)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    weights = torch.tensor([[0, 0, 0, 1, 0.5, 0]])
    vocabulary = SoftmaxVocabulary.of([([5, 6, 7, 8, 9, 10, 40], [])], model.config.vocab_size)
    loss = sft_loss(model, ids, torch.ones_like(ids), weights, vocabulary)
    with torch.no_grad():
        logits = model(ids).logits[0].float()[:, [5, 6, 7, 8, 9, 10, 40]]  # the softmax over these 7 tokens
        logp = torch.log_softmax(logits, -1)
    expected = -(logp[2, 3] + 0.5 * logp[3, 4]) / 1.5  # tokens 8 and 9: indexes 3 and 4 among the 7
    torch.testing.assert_close(loss, expected, atol=1e-5, rtol=0)
    loss.backward()  # the head's rows of tokens outside get no gradient (tied: nor do their embeddings)
    rows = model.get_output_embeddings().weight.grad.abs().sum(dim=1)
    assert rows[[5, 6, 7, 8, 9, 10, 40]].sum() > 0 and rows[11:40].sum() == 0 and rows[41:].sum() == 0
    everything = SoftmaxVocabulary.of([(list(range(model.config.vocab_size)), [])], model.config.vocab_size)
    with torch.no_grad():  # over every token: the full softmax's loss
        torch.testing.assert_close(sft_loss(model, ids, torch.ones_like(ids), weights, everything),
                                   sft_loss(model, ids, torch.ones_like(ids), weights), atol=1e-5, rtol=0)


def test_sampled_negatives_join_the_softmax_each_standing_for_its_share_of_the_others(setup, monkeypatch):
    _, tokenizer, _ = setup
    model = build_tiny_random(tokenizer, hidden_size=32, layers=1, heads=2)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    weights = torch.tensor([[0, 0, 0, 1, 0.5, 0]])
    vocabulary = SoftmaxVocabulary.of([([5, 6, 7, 8, 9, 10], [])], model.config.vocab_size, negatives=2)
    assert len(vocabulary.outside) == model.config.vocab_size - 6 and 5 not in vocabulary.outside.tolist()
    positions = torch.tensor([0, 100])  # the outside tokens 0 and 106 (5-10 are not outside)
    monkeypatch.setattr(torch, "randint", lambda high, size, generator=None: positions)
    columns, log_counts = vocabulary.columns(None)
    assert columns.tolist() == [5, 6, 7, 8, 9, 10, 0, 106]
    share = np.log((model.config.vocab_size - 6) / 2)  # each drawn token stands for half of the others
    torch.testing.assert_close(log_counts, torch.tensor([0.0] * 6 + [share] * 2, dtype=torch.float32))
    with torch.no_grad():
        loss = sft_loss(model, ids, torch.ones_like(ids), weights, vocabulary)
        logits = model(ids).logits[0].float()[:, [5, 6, 7, 8, 9, 10, 0, 106]] + log_counts
        logp = torch.log_softmax(logits, -1)
    expected = -(logp[2, 3] + 0.5 * logp[3, 4]) / 1.5
    torch.testing.assert_close(loss, expected, atol=1e-5, rtol=0)


def test_the_negatives_are_drawn_from_the_generator_and_a_resume_continues_its_draws(setup):
    vocabulary = SoftmaxVocabulary.of([([1, 2, 3], [])], 1000, negatives=16)
    generator = torch.Generator().manual_seed(0)
    first = vocabulary.columns(generator)[0]
    state = generator.get_state()
    second = vocabulary.columns(generator)[0]
    assert not torch.equal(first, second) and set(second[3:].tolist()).isdisjoint({1, 2, 3})
    generator.set_state(state)
    assert torch.equal(vocabulary.columns(generator)[0], second)


def test_sft_fits_a_few_oracle_trajectories(setup):
    env, tokenizer, _ = setup
    model = build_tiny_random(tokenizer, hidden_size=64, layers=2, heads=4)
    data = [oracle_trajectory(env, tokenizer, i, 3, tokenizer.eos_token_id) for i in range(4)]
    ids, attention, generated = pad(data, tokenizer.pad_token_id)
    with torch.no_grad():
        before = sft_loss(model, ids, attention, generated).item()
    train(model, data, epochs=30, lr=3e-3, batch_size=4, seed=0, pad_id=tokenizer.pad_token_id, log=lambda _: None)
    with torch.no_grad():
        after = sft_loss(model, ids, attention, generated).item()
    assert after < 0.5 * before


def resumable_training(setup, *, questions: int, epochs: int, batch_size: int):
    """Oracle data, train()'s settings (a drawn share of the observations: a resumed run must draw on where the
    killed one stopped) and a maker of the same fresh tiny model, for the resume tests."""
    env, tokenizer, _ = setup
    data = [oracle_trajectory(env, tokenizer, i, 3, tokenizer.eos_token_id) for i in range(questions)]
    settings = {"epochs": epochs, "lr": 3e-3, "batch_size": batch_size, "seed": 0, "pad_id": tokenizer.pad_token_id,
                "token_weights": TokenWeights(0.5, 0.5), "log": lambda _: None}

    def fresh_model():
        torch.manual_seed(0)
        return build_tiny_random(tokenizer, hidden_size=32, layers=1, heads=2)

    return data, settings, fresh_model


def test_a_training_killed_after_an_epoch_resumes_and_ends_as_an_uninterrupted_one(setup, tmp_path):
    data, settings, fresh_model = resumable_training(setup, questions=6, epochs=3, batch_size=4)
    whole = fresh_model()
    whole_curve = train(whole, data, **settings)
    checkpoint = tmp_path / "checkpoint.pt"
    first = fresh_model()
    assert len(train(first, data, **settings, max_minutes=0, checkpoint=checkpoint)["loss"]) == 1  # "killed"
    resumed = fresh_model()  # a new process: fresh weights and generators, restored from the checkpoint
    torch.manual_seed(123)
    lines = []
    resumed_curve = train(resumed, data, **{**settings, "log": lines.append}, checkpoint=checkpoint)
    assert lines[0].startswith("resuming after epoch 1/3") and len(lines) == 3
    assert resumed_curve == whole_curve
    for a, b in zip(whole.parameters(), resumed.parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_the_schedule_warms_up_then_decays_to_its_floor_and_stays_there():
    # 10 steps, 2 of warm-up, floor 0.1: step s multiplies the peak by min(1, (s + 1) / 2) * (0.1 + 0.9 * cosine)
    factor = [learning_rate_factor(s, steps=10, warmup=2, floor=0.1) for s in (0, 1, 5, 10, 15)]
    np.testing.assert_allclose(factor, [0.5, 0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi / 10)), 0.55, 0.1, 0.1])
    assert learning_rate_factor(10, steps=10, warmup=2, floor=0.0) == pytest.approx(0.0)
    # the extra epochs' own rate after the schedule; the schedule itself unchanged
    extra = [learning_rate_factor(s, steps=10, warmup=2, floor=0.1, extra=0.3) for s in (5, 10, 15)]
    assert extra == [pytest.approx(0.55), 0.3, 0.3]


def test_extra_epochs_train_at_the_extra_learning_rate(setup, monkeypatch):
    env, tokenizer, _ = setup
    data = [oracle_trajectory(env, tokenizer, i, 3, tokenizer.eos_token_id) for i in range(2)]
    model = build_tiny_random(tokenizer, hidden_size=32, layers=1, heads=2)
    rates = []
    step = torch.optim.AdamW.step

    def recording_step(optimizer, *args, **kwargs):
        rates.append(optimizer.param_groups[0]["lr"])
        return step(optimizer, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", recording_step)
    train(model, data, epochs=1, lr=1e-3, batch_size=2, seed=0, pad_id=tokenizer.pad_token_id, lr_floor=0.1,
          check=lambda: 0.0, check_min=0.5, extra_epochs=2, extra_lr=0.4, log=lambda _: None)
    # one step in the schedule (warm-up of one step: the peak), then one in each extra epoch at 0.4 x the peak
    assert rates == [pytest.approx(1e-3), pytest.approx(4e-4), pytest.approx(4e-4)]


@pytest.mark.parametrize(("scores", "extra_epochs", "epochs_run"), [
    ([0.2, 0.4, 0.9, 0.9], 5, 3),  # below 0.5 twice: two extra epochs, then the check passes
    ([0.2, 0.4, 0.9], 1, 2),  # the cap: one extra epoch, whatever the check says
    ([0.9], 5, 1),  # in the band after the schedule: no extra epoch
])
def test_extra_epochs_run_while_the_check_fails_up_to_the_cap(setup, scores, extra_epochs, epochs_run):
    env, tokenizer, _ = setup
    data = [oracle_trajectory(env, tokenizer, i, 3, tokenizer.eos_token_id) for i in range(2)]
    model = build_tiny_random(tokenizer, hidden_size=32, layers=1, heads=2)
    checked = iter(scores)
    curve = train(model, data, epochs=1, lr=3e-3, batch_size=2, seed=0, pad_id=tokenizer.pad_token_id,
                  check=lambda: next(checked), check_min=0.5, extra_epochs=extra_epochs, log=lambda _: None)
    assert len(curve["loss"]) == epochs_run and curve["check"] == scores[:epochs_run]


def test_a_training_killed_in_its_extra_epochs_resumes_with_its_checks(setup, tmp_path):
    env, tokenizer, _ = setup
    data = [oracle_trajectory(env, tokenizer, i, 3, tokenizer.eos_token_id) for i in range(2)]
    settings = {"epochs": 1, "lr": 3e-3, "batch_size": 2, "seed": 0, "pad_id": tokenizer.pad_token_id,
                "check_min": 0.5, "extra_epochs": 4, "log": lambda _: None}
    checkpoint = tmp_path / "checkpoint.pt"
    scores = iter([0.1, 0.3, 0.7])
    model = build_tiny_random(tokenizer, hidden_size=32, layers=1, heads=2)
    assert train(model, data, **settings, check=lambda: next(scores), max_minutes=0,
                 checkpoint=checkpoint)["check"] == [0.1]
    curve = train(model, data, **settings, check=lambda: next(scores), checkpoint=checkpoint)
    assert curve["check"] == [0.1, 0.3, 0.7] and len(curve["loss"]) == 3


def test_a_checkpoint_left_by_other_settings_is_refused_naming_it(tmp_path):
    def options(epochs: str) -> argparse.Namespace:
        return parse_args(["--epochs", epochs, "--output", str(tmp_path)])

    checkpoint, _ = warmstart_module.claim_output(tmp_path, options("2"))
    checkpoint.write_bytes(b"the state after epoch 1")  # as a killed training leaves it
    assert warmstart_module.claim_output(tmp_path, options("2"))[0] == checkpoint  # the same settings resume
    assert warmstart_module.claim_output(tmp_path, parse_args(["--epochs", "2", "--output", str(tmp_path),
                                                               "--max-minutes", "5"]))[0] == checkpoint
    with pytest.raises(SystemExit, match=r"checkpoint.pt was written by other settings.*'epochs': 2"):
        warmstart_module.claim_output(tmp_path, options("3"))


def test_warmstart_main_trains_on_extra_worlds_and_saves_a_loadable_model(setup, tmp_path, monkeypatch):
    monkeypatch.setenv("TREEGRPO_CACHE_DIR", str(tmp_path / "cache"))
    model_dir = warmstart_main(["--data-dir", str(setup[2]), "--extra-worlds", "1", "--hidden-size", "32",
                                "--layers", "1", "--heads", "2", "--epochs", "1", "--dev-questions", "2",
                                "--observation-weight", "0.5", "--observation-share", "0.5",
                                "--max-step-tokens", "8", "--output", str(tmp_path / "warm")])
    summary = json.loads((tmp_path / "warm" / "warmstart.json").read_text())
    assert summary["trajectories"] == 2 * WORLD.train_questions and len(summary["loss_per_epoch"]) == 1
    assert summary["settings"]["observation_weight"] == 0.5 and np.isfinite(summary["loss_per_epoch"][0])
    assert set(summary["dev_after"]) >= {"em", "answered"}
    model, _ = load_model(str(model_dir))
    assert model.config.hidden_size == 32
    assert not list((tmp_path / "warm").glob("checkpoint*"))  # the model is saved: the training state is dropped


def test_warmstart_over_the_data_vocabulary_trains_its_tokens_only(setup, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TREEGRPO_CACHE_DIR", str(tmp_path / "cache"))
    untrained = build_tiny_random(load_model("tiny-random")[1], seed=0, hidden_size=32, layers=1, heads=2)
    model_dir = warmstart_main(["--data-dir", str(setup[2]), "--hidden-size", "32", "--layers", "1", "--heads", "2",
                                "--epochs", "1", "--dev-questions", "0", "--softmax-vocabulary", "data",
                                "--softmax-negatives", "0", "--output", str(tmp_path / "warm")])
    assert "the loss's softmax over the" in capsys.readouterr().out
    trained, _ = load_model(str(model_dir))
    before, after = untrained.get_output_embeddings().weight, trained.get_output_embeddings().weight
    moved = ((after - before).abs().sum(dim=1) / before.abs().sum(dim=1)).detach()
    # the data's tokens (a few hundred of 49k) move; AdamW's weight decay alone shrinks the rest, by lr x 0.01 a step
    assert 100 < int((moved > 1e-3).sum()) < 2000
    assert torch.quantile(moved, 0.5) < 1e-3


def test_replay_bottom_replays_a_lora_builds_frozen_bottom_and_trains_as_without_it(setup, tmp_path, monkeypatch):
    """--replay-bottom: the bottom below the adapted top layer recorded in epoch 1 and replayed in epoch 2; the loss
    curve that of the build without it, to float rounding."""
    import experiments.sft as sft_module

    monkeypatch.setenv("TREEGRPO_CACHE_DIR", str(tmp_path / "cache"))
    replayed = []
    over = sft_module.BottomReplay.over
    monkeypatch.setattr(sft_module.BottomReplay, "over", lambda self, batch, attention: (
        replayed.append(all(i in self.rows for i in batch)), over(self, batch, attention))[1])
    curves = {}
    for replay in (False, True):
        output = tmp_path / f"replay-{replay}"
        warmstart_main(["--data-dir", str(setup[2]), "--model", "tiny-random", "--lora-rank", "2", "--lora-layers",
                        "1", "--questions", "6", "--epochs", "2", "--batch-size", "2", "--dev-questions", "0",
                        *(["--replay-bottom"] if replay else []), "--output", str(output)])
        curves[replay] = json.loads((output / "warmstart.json").read_text())["loss_per_epoch"]
    half = len(replayed) // 2
    assert half and not any(replayed[:half]) and all(replayed[half:])  # epoch 1 records, epoch 2 replays
    np.testing.assert_allclose(curves[True], curves[False], rtol=1e-5)


def test_an_option_added_since_the_keys_leaves_them_as_they_were(monkeypatch, capsys):
    """--replay-bottom at its default is left out of the defaults' digest: the cached starts' keys stay, and so do
    the records naming their paths; as a recipe's option it is in the key, and it needs a frozen bottom."""
    from experiments import warmstart_options

    assert warmstart_options.defaults_digest() == warmstart_options.KEYED_DEFAULTS
    assert warmstart_module.readable_warm_start_key(WORLD, ("--replay-bottom",), topk=1).endswith("-replay-bottom")
    with pytest.raises(SystemExit):
        parse_args(["--replay-bottom"])
    assert "--replay-bottom needs --lora-layers" in capsys.readouterr().err


def test_a_build_killed_before_an_option_existed_resumes_at_its_neutral_default(tmp_path):
    """A checkpoint's settings written before --replay-bottom existed lack it: that build trained without the replay,
    so it resumes as one without it, and is refused as one with it."""
    args = parse_args(["--output", str(tmp_path)])
    _, settings = warmstart_module.claim_output(tmp_path, args)
    (tmp_path / "checkpoint.pt").write_bytes(b"epoch 1")
    older = json.loads(settings.read_text())
    del older["replay_bottom"]
    settings.write_text(json.dumps(older))
    warmstart_module.claim_output(tmp_path, args)
    settings.write_text(json.dumps(older))
    with pytest.raises(SystemExit, match="was written by other settings"):
        warmstart_module.claim_output(tmp_path, parse_args(["--output", str(tmp_path), "--model", "tiny-random",
                                                            "--lora-rank", "2", "--lora-layers", "1",
                                                            "--replay-bottom"]))


def test_warmstart_checks_an_extra_worlds_held_out_one_search_questions(setup, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    checked = []

    def greedy_results(model, tokenizer, args, env, questions):
        checked.append(list(questions))
        return [{"em": 0.0} for _ in questions]

    monkeypatch.setattr(warmstart_module, "greedy_results", greedy_results)
    warmstart_main(["--data-dir", str(setup[2]), "--extra-worlds", "1", "--questions", "12", "--hidden-size", "32",
                    "--layers", "1", "--heads", "2", "--epochs", "1", "--dev-questions", "0", "--premature", "1",
                    "--check-questions", "3", "--check-em", "0.5", "--extra-epochs", "1", "--max-step-tokens", "8",
                    "--cache-dir", str(cache), "--output", str(tmp_path / "warm")])
    summary = json.loads((tmp_path / "warm" / "warmstart.json").read_text())
    # the check fails after the schedule and after the one extra epoch allowed: two epochs, two checks
    assert summary["check_per_epoch"] == [0.0, 0.0] and len(summary["loss_per_epoch"]) == 2
    extra = cache / "synthhop" / replace(WORLD, seed=WORLD.seed + 1).key
    env = gym.make("SynthHop-v0", data_dir=extra, split="dev")
    one_hop = [i for i, record in enumerate(env.unwrapped.records) if len(record.supporting_titles) == 1]
    assert len(one_hop) >= 3 and checked == [one_hop[:3]] * 2  # questions no trajectory trains, one search each
    written = {json.loads((d / "synthhop" / "world.json").read_text())["seed"] for d in (cache / "synthhop").iterdir()}
    assert written == {WORLD.seed + 1}  # the extra world, in --cache-dir


def test_a_one_hop_short_check_asks_multi_hop_questions_and_trains_on_while_too_few_stop_short(setup, tmp_path,
                                                                                               monkeypatch):
    cache = tmp_path / "cache"
    checked = []

    def greedy_results(model, tokenizer, args, env, questions):
        checked.append(list(questions))
        # the first answered after one search (one hop short), the next after two, the rest never answered
        return [{"em": 0.0, "answered": float(k < 2), "tool_calls": float(k + 1)} for k in range(len(questions))]

    monkeypatch.setattr(warmstart_module, "greedy_results", greedy_results)
    warmstart_main(["--data-dir", str(setup[2]), "--extra-worlds", "1", "--questions", "12", "--hidden-size", "32",
                    "--layers", "1", "--heads", "2", "--epochs", "1", "--dev-questions", "0", "--premature", "1",
                    "--check-questions", "4", "--check-one-hop-short", "0.6", "--extra-epochs", "2",
                    "--max-step-tokens", "8", "--cache-dir", str(cache), "--output", str(tmp_path / "warm")])
    summary = json.loads((tmp_path / "warm" / "warmstart.json").read_text())
    extra = cache / "synthhop" / replace(WORLD, seed=WORLD.seed + 1).key
    records = gym.make("SynthHop-v0", data_dir=extra, split="dev").unwrapped.records
    multi_hop = [i for i, record in enumerate(records) if len(record.supporting_titles) > 1][:4]
    assert len(multi_hop) == 4 and checked == [multi_hop] * 3  # the schedule's epoch and both extra ones checked
    # of 4 multi-hop questions the first stopped short, the second too if it needs 3 searches (it made 2), the others
    # never answered: 0.25 or 0.5, below 0.6 after every epoch, so both extra epochs ran
    hops = [len(records[i].supporting_titles) for i in multi_hop]
    assert summary["check_per_epoch"] == [(1 + (hops[1] > 2)) / 4] * 3 and len(summary["loss_per_epoch"]) == 3


@pytest.mark.parametrize(("argv", "message"), [
    (["--check-questions", "5", "--extra-worlds", "1", "--check-one-hop-short", "0.5", "--check-em", "0.5"],
     "--check-one-hop-short replaces --check-em"),
    (["--check-one-hop-short", "0.5"], "--check-one-hop-short needs --check-questions"),
    (["--check-questions", "5", "--extra-worlds", "1", "--check-one-hop-short", "1.5"],
     "--check-one-hop-short must be a share in [0, 1], got 1.5"),
    (["--extra-epochs", "2"], "--extra-epochs needs --check-questions"),
    (["--check-questions", "5"], "--check-questions needs --extra-worlds"),
    (["--lr-floor", "1.5"], "--lr-floor must be a fraction"),
    (["--check-em", "-0.1"], "--check-em must be an exact match"),
    (["--extra-lr", "0.3"], "--extra-lr needs --extra-epochs"),
    (["--check-questions", "5", "--extra-worlds", "1", "--extra-epochs", "1", "--extra-lr", "0"],
     "--extra-lr must be a fraction of --lr in (0, 1], got 0.0"),
    (["--observation-share", "0"], "--observation-share must be a share in (0, 1], got 0.0"),
    (["--observation-share", "1.5"], "--observation-share must be a share in (0, 1], got 1.5"),
    (["--softmax-negatives", "64"], "--softmax-negatives needs --softmax-vocabulary data"),
    (["--softmax-vocabulary", "data", "--softmax-negatives", "-1"], "--softmax-negatives must be >= 0, got -1"),
])
def test_warmstart_check_options_at_their_edges_are_refused_naming_them(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert message in capsys.readouterr().err


def test_warmstart_without_dev_questions_prints_no_dev_line(setup, tmp_path, capsys):
    warmstart_main(["--data-dir", str(setup[2]), "--questions", "2", "--hidden-size", "32", "--layers", "1",
                    "--heads", "2", "--epochs", "1", "--dev-questions", "0", "--output", str(tmp_path / "warm")])
    out = capsys.readouterr().out
    assert "nan" not in out and "dev before" not in out and "dev after" not in out  # the demo's warm start
    summary = json.loads((tmp_path / "warm" / "warmstart.json").read_text())
    assert summary["dev_before"] is None and summary["dev_after"] is None


def write_empty_model(argv: list[str]) -> None:
    """A stand-in for the warm start's training: an empty model directory under its ``--output``."""
    model = Path(argv[argv.index("--output") + 1]) / "model"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")


@pytest.fixture
def trained(monkeypatch) -> list[list[str]]:
    """The argv of every warm start trained while the test runs (warmstart.main writes an empty model)."""
    calls: list[list[str]] = []

    def fake_warmstart(argv: list[str]) -> None:
        write_empty_model(argv)
        calls.append(argv)

    monkeypatch.setattr(warmstart_module, "main", fake_warmstart)
    return calls


def test_a_cached_warm_start_trains_once_per_world_topk_and_recipe(tmp_path, trained, capsys):
    recipe = ("--misroute", "0.7", "--seed", "0")
    model = cached_warm_start(BRANCH, recipe, topk=1, cache_dir=tmp_path)
    first = " ".join(trained[0])
    assert (model / "config.json").is_file() and model.parent.parent == tmp_path / "warm_starts"
    assert "--env SynthBranch-v0" in first and "--misroute 0.7 --seed 0" in first
    assert "--topk 1" in first and "--dev-questions 0" in first
    assert cached_warm_start(BRANCH, recipe, topk=1, cache_dir=tmp_path) == model and len(trained) == 1  # cached
    assert "cached at" in capsys.readouterr().out
    assert cached_warm_start(BRANCH, ("--misroute", "0.5"), topk=1, cache_dir=tmp_path) != model
    assert cached_warm_start(BRANCH, recipe, topk=2, cache_dir=tmp_path) != model
    cached_warm_start(WORLD, (), topk=1, cache_dir=tmp_path)
    assert len(trained) == 4 and "SynthHop-v0" in trained[-1]
    assert not list((tmp_path / "warm_starts").glob("*.partial"))  # staging directories are published


def test_a_cached_warm_start_is_read_without_writing_to_the_cache(tmp_path, trained):
    """A shared cache a user may only read (a lab's, a packed image's) serves its starts: finding one takes no lock."""
    model = cached_warm_start(BRANCH, ("--seed", "0"), topk=1, cache_dir=tmp_path)
    [lock] = (tmp_path / "warm_starts").glob(f"*{WARM_START_LOCK}")
    lock.unlink()
    assert cached_warm_start(BRANCH, ("--seed", "0"), topk=1, cache_dir=tmp_path) == model and len(trained) == 1
    assert not lock.exists()


def test_a_long_recipe_gets_a_key_that_fits_a_file_name_and_still_names_it_alone(tmp_path, monkeypatch):
    assert warm_start_key("abc-topk1-epochs-8", limit=20) == "abc-topk1-epochs-8"  # short keys as they were
    long_a, long_b = "w-topk1-" + "x" * 40 + "-seed-0", "w-topk1-" + "x" * 40 + "-seed-1"
    key_a, key_b = warm_start_key(long_a, limit=30), warm_start_key(long_b, limit=30)
    assert len(key_a) == len(key_b) == 30 and key_a.startswith("w-topk1-xxx") and key_a != key_b
    monkeypatch.setattr(warmstart_module, "main", write_empty_model)
    paths = ("founder.born_in", "spouse.born_in", "based_in.country", "born_in.country")
    recipe = (*(option for path in paths for option in ("--premature-template", f"{path}=0.8")), "--seed", "0")
    model = cached_warm_start(WORLD, recipe, topk=1, cache_dir=tmp_path)  # 300 characters of recipe
    assert (model / "config.json").is_file() and len(model.parent.name) <= 200
    assert cached_warm_start(WORLD, (*recipe[:-1], "1"), topk=1, cache_dir=tmp_path) != model
    # the whole recipe is kept beside the model, and the cache's listing names it, not the name's hash
    whole = (model.parent / "recipe.txt").read_text().strip()
    assert whole.startswith(f"{WORLD.key}-topk1-") and whole.endswith("-seed-0")
    assert "-premature-template-founder.born_in=0.8-premature-template-spouse.born_in=0.8-" in whole
    [entry] = [e for e in scan(tmp_path) if e.path == model.parent]
    assert entry.state == "ok" and whole.split("-", 2)[2] in entry.about


def test_a_warm_start_in_stages_trains_on_from_the_cached_start_it_continues(tmp_path, trained):
    first, then = ("--model", "scratch", "--epochs", "6"), ("--misroute", "0.7", "--epochs", "1")
    base = cached_warm_start(BRANCH, first, topk=1, cache_dir=tmp_path)
    staged = cached_warm_start(BRANCH, then, topk=1, cache_dir=tmp_path, continues=first)
    assert len(trained) == 2 and staged != base  # the base was cached; only the second stage trained
    assert trained[1][trained[1].index("--model") + 1] == str(base) and "--misroute" in trained[1]
    assert staged.parent.name.endswith("model-scratch-epochs-6-then-misroute-0.7-epochs-1")
    assert cached_warm_start(BRANCH, then, topk=1, cache_dir=tmp_path) != staged  # the same stage from scratch
    assert cached_warm_start(BRANCH, then, topk=1, cache_dir=tmp_path, continues=first) == staged
    assert len(trained) == 3


def test_a_cached_later_stage_needs_no_earlier_one(tmp_path, trained):
    """A cache holding only the last stage (the demo's start as device_kit.py --learn packs it) trains nothing."""
    first, then = ("--model", "scratch", "--epochs", "6"), ("--misroute", "0.7", "--epochs", "1")
    staged = cached_warm_start(BRANCH, then, topk=1, cache_dir=tmp_path, continues=first)
    assert len(trained) == 2
    base = Path(trained[1][trained[1].index("--model") + 1])
    shutil.rmtree(base.parent)  # the first stage gone: the second is still found, and nothing trains
    assert cached_warm_start(BRANCH, then, topk=1, cache_dir=tmp_path, continues=first) == staged
    assert len(trained) == 2 and not base.exists()
    with pytest.raises(ValueError, match="takes that one's model"):
        cached_warm_start(BRANCH, ("--model", "scratch"), topk=1, cache_dir=tmp_path, continues=first)


def test_a_killed_cached_warm_start_resumes_in_its_staging_directory(tmp_path, monkeypatch):
    outputs = []

    def killed_warmstart(argv: list[str]) -> None:
        outputs.append(argv[argv.index("--output") + 1])
        (Path(outputs[-1]) / "checkpoint.pt").parent.mkdir(parents=True, exist_ok=True)
        (Path(outputs[-1]) / "checkpoint.pt").write_bytes(b"epoch 1")
        raise KeyboardInterrupt

    monkeypatch.setattr(warmstart_module, "main", killed_warmstart)
    with pytest.raises(KeyboardInterrupt):
        cached_warm_start(BRANCH, ("--seed", "0"), topk=1, cache_dir=tmp_path)

    def finishing_warmstart(argv: list[str]) -> None:
        output = Path(argv[argv.index("--output") + 1])
        assert (output / "checkpoint.pt").read_bytes() == b"epoch 1"  # what the killed run left is there to resume
        outputs.append(str(output))
        (output / "model").mkdir()
        (output / "model" / "config.json").write_text("{}")

    monkeypatch.setattr(warmstart_module, "main", finishing_warmstart)
    model = cached_warm_start(BRANCH, ("--seed", "0"), topk=1, cache_dir=tmp_path)
    assert outputs[0] == outputs[1] and (model / "config.json").is_file()


def test_a_start_finished_but_not_published_is_published_without_training(tmp_path, monkeypatch):
    """Killed between its summary and the move into the cache, a build leaves a finished start in its staging
    directory: the next call publishes it (training there again would be refused as replacing a finished start)."""
    def finished_then_killed(argv: list[str]) -> None:
        output = Path(argv[argv.index("--output") + 1])
        (output / "model").mkdir(parents=True)
        (output / "model" / "config.json").write_text("{}")
        (output / "warmstart.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(warmstart_module, "main", finished_then_killed)
    with pytest.raises(KeyboardInterrupt):
        cached_warm_start(BRANCH, ("--seed", "0"), topk=1, cache_dir=tmp_path)
    monkeypatch.setattr(warmstart_module, "main", lambda argv: pytest.fail("trained again"))
    model = cached_warm_start(BRANCH, ("--seed", "0"), topk=1, cache_dir=tmp_path)
    assert (model / "config.json").is_file() and (model.parent / "warmstart.json").is_file()


def test_concurrent_cached_warm_starts_train_a_recipe_once(tmp_path, monkeypatch):
    trained = []

    def slow_warmstart(argv: list[str]) -> None:
        trained.append(argv)
        time.sleep(0.3)  # long enough for the other thread to reach the lock
        output = Path(argv[argv.index("--output") + 1])
        (output / "model").mkdir(parents=True)
        (output / "model" / "config.json").write_text("{}")

    monkeypatch.setattr(warmstart_module, "main", slow_warmstart)
    models = []
    threads = [threading.Thread(target=lambda: models.append(cached_warm_start(BRANCH, (), topk=1,
                                                                                cache_dir=tmp_path)))
               for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(trained) == 1 and len(models) == 2 and models[0] == models[1]


def test_a_training_killed_within_an_epoch_resumes_there_and_ends_as_an_uninterrupted_one(setup, tmp_path,
                                                                                          monkeypatch):
    import experiments.sft as sft_module

    data, settings, fresh_model = resumable_training(setup, questions=10, epochs=2, batch_size=2)
    whole = fresh_model()
    whole_curve = train(whole, data, **settings)
    calls, real_loss = [], sft_module.sft_loss

    def killed_at_the_eighth_batch(*args, **kwargs):  # batch 3 of the second epoch: saved after every batch before
        calls.append(1)
        if len(calls) == 8:
            raise KeyboardInterrupt
        return real_loss(*args, **kwargs)

    checkpoint = tmp_path / "checkpoint.pt"
    monkeypatch.setattr(sft_module, "sft_loss", killed_at_the_eighth_batch)
    with pytest.raises(KeyboardInterrupt):
        train(fresh_model(), data, **settings, checkpoint=checkpoint, checkpoint_minutes=0)
    monkeypatch.setattr(sft_module, "sft_loss", real_loss)
    resumed, lines = fresh_model(), []
    torch.manual_seed(123)
    resumed_curve = train(resumed, data, **{**settings, "log": lines.append}, checkpoint=checkpoint,
                          checkpoint_minutes=0)
    assert lines[0].startswith("resuming after batch 2 of epoch 2")
    assert resumed_curve == whole_curve
    for a, b in zip(whole.parameters(), resumed.parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_a_changed_default_of_the_recipes_options_changes_the_key(monkeypatch):
    """A key names the recipe's options; a default it does not name changes the key too (a start trained another way
    is never reused), and while the defaults are those keyed first, the key is as it was (cached starts stay found)."""
    from experiments import warmstart_options

    monkeypatch.setattr(warmstart_module, "KEYED_DEFAULTS", warmstart_options.defaults_digest())
    key = warmstart_module.readable_warm_start_key(WORLD, ("--seed", "0"), topk=1)
    assert key == f"{WORLD.key}-topk1-oracle-format-{warmstart_module.ORACLE_FORMAT}-seed-0"
    parse = warmstart_options.parse_args
    monkeypatch.setattr(warmstart_options, "parse_args",
                        lambda argv=None, **kw: argparse.Namespace(**{**vars(parse(argv, **kw)), "max_turns": 4}))
    changed = warmstart_module.readable_warm_start_key(WORLD, ("--seed", "0"), topk=1)
    assert changed != key and changed.startswith(f"{key.removesuffix('seed-0')}defaults-")
    monkeypatch.setattr(warmstart_options, "parse_args", parse)
    assert warmstart_module.readable_warm_start_key(WORLD, ("--seed", "0"), topk=1) == key
