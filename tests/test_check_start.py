"""The start-policy check of the branching testbed: the teacher-forced probabilities read the decision's tokens."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from types import SimpleNamespace

import gymnasium as gym
import numpy as np
import pytest
import torch

from benchmarks.check_start import (
    asked_role,
    decision_summary,
    in_nucleus,
    name_token_probabilities,
    thought_format,
)
from envs.synthetic import BranchSpec, write_world
from experiments.oracle_trajectories import oracle_trajectory
from policies.models import load_model

BRANCH = BranchSpec(people=20, companies=10, cities=6, countries=3, train_questions=8, dev_questions=4)


class Peeking(torch.nn.Module):
    """A "model" whose logits at position t put all mass on the token at t + 1 (or, with ``shift``, t + 1 + shift),
    so a probability read at the right position is 1 and one read a position off is 0."""

    def __init__(self, vocab: int, eos: int, shift: int = 0):
        super().__init__()
        self.vocab, self.shift = vocab, shift
        self.generation_config = SimpleNamespace(eos_token_id=eos)

    def forward(self, input_ids: torch.Tensor) -> SimpleNamespace:
        following = torch.roll(input_ids, -1 - self.shift, dims=1)
        return SimpleNamespace(logits=100.0 * torch.nn.functional.one_hot(following, self.vocab).float())


class Misled(Peeking):
    """``Peeking``, except that the position before ``at`` puts all its mass on token ``instead``."""

    def __init__(self, vocab: int, eos: int, at: int, instead: int):
        super().__init__(vocab, eos)
        self.at, self.instead = at, instead

    def forward(self, input_ids: torch.Tensor) -> SimpleNamespace:
        logits = super().forward(input_ids).logits
        logits[:, self.at - 1] = 100.0 * torch.nn.functional.one_hot(torch.tensor(self.instead), self.vocab).float()
        return SimpleNamespace(logits=logits)


class RoleBlind(torch.nn.Module):
    """A "model" that ignores its input: at every position half its mass on " founder", half on " chair"."""

    def __init__(self, tokenizer):
        super().__init__()
        self.vocab = len(tokenizer)
        self.words = [tokenizer(f" {role}", add_special_tokens=False)["input_ids"][0] for role in ("founder", "chair")]
        self.generation_config = SimpleNamespace(eos_token_id=tokenizer.eos_token_id)

    def forward(self, input_ids: torch.Tensor) -> SimpleNamespace:
        logits = torch.full((*input_ids.shape, self.vocab), -1e4)
        logits[..., self.words] = 0.0
        return SimpleNamespace(logits=logits)


@pytest.fixture(scope="module")
def branch_env(tmp_path_factory):
    root = write_world(BRANCH, tmp_path_factory.mktemp("branch"))
    _, tokenizer = load_model("tiny-random")
    return gym.make("SynthBranch-v0", split="train", data_dir=root, topk=1), tokenizer


def test_name_token_probabilities_read_the_decisions_first_name_and_surname(branch_env):
    env, tokenizer = branch_env
    vocab = len(tokenizer)
    right = name_token_probabilities(Peeking(vocab, tokenizer.eos_token_id), tokenizer, env, [0, 1, 2])
    assert len(right) == 3 and all(p[:2] == pytest.approx((1.0, 1.0)) and math.isnan(p[2]) for p in right)
    off_by_one = name_token_probabilities(Peeking(vocab, tokenizer.eos_token_id, shift=1), tokenizer, env, [0, 1])
    assert all(max(p[:2]) < 1e-6 for p in off_by_one)


def test_a_one_word_name_is_read_whole_and_has_no_surname(tmp_path):
    root = write_world(replace(BRANCH, names="given"), tmp_path)
    _, tokenizer = load_model("tiny-random")
    env = gym.make("SynthBranch-v0", split="train", data_dir=root, topk=1)
    rows = name_token_probabilities(Peeking(len(tokenizer), tokenizer.eos_token_id), tokenizer, env, [0, 1])
    assert [p[0] for p in rows] == pytest.approx([1.0, 1.0]) and all(math.isnan(p[1]) for p in rows)


def test_with_a_lead_hop_the_decisions_person_is_the_third_search(tmp_path):
    lead = BranchSpec(people=20, companies=10, cities=6, countries=3, train_questions=8, dev_questions=4, hops=4,
                      lead=True, names="given", passages="roles")
    root = write_world(lead, tmp_path)
    _, tokenizer = load_model("tiny-random")
    env = gym.make("SynthBranch-v0", split="train", data_dir=root, topk=1, max_turns=4)
    peeking = Peeking(len(tokenizer), tokenizer.eos_token_id)
    rows = name_token_probabilities(peeking, tokenizer, env, [0, 1, 2], restate=True, decision_hop=2)
    assert all(p[0] == pytest.approx(1.0) and p[2] == pytest.approx(1.0) and p[3] == 1.0 for p in rows)
    # the searches before it: the employee, whose passage names the company, then the company, whose passage names
    # the person
    record = env.unwrapped.records[0]
    assert record.supporting_titles[2] in (world := lead.world()).passage(record.supporting_titles[1])
    assert world.entities[record.supporting_titles[0]].facts["employer"] == record.supporting_titles[1]
    # a start that states its goal names the role three times: the decision is the one before the person's name
    role = asked_role(record.question)
    other = next(r for r in ("founder", "chair") if r != role)
    ids, generated = oracle_trajectory(env, tokenizer, 0, 4, tokenizer.eos_token_id, restate=True, goal_role=role)
    word = tokenizer(f" {role}", add_special_tokens=False)["input_ids"][0]
    *goals_at, decision_at = (t for t in range(len(ids)) if generated[t] and ids[t] == word)
    assert len(goals_at) == 2  # the question's goal, then the company's
    goal_at = goals_at[-1]
    other_word = tokenizer(f" {other}", add_special_tokens=False)["input_ids"][0]
    for at, right in ((decision_at, 0.0), (goal_at, 1.0)):  # misled at the decision, then at the goal only
        misled = Misled(len(tokenizer), tokenizer.eos_token_id, at, other_word)
        (row,) = name_token_probabilities(misled, tokenizer, env, [0], restate=True, decision_hop=2, goal=True)
        assert row[2] == pytest.approx(right) and row[4] == pytest.approx(1.0 - right)


def test_a_restating_start_is_read_in_its_format_with_the_decisions_role_word(tmp_path):
    root = write_world(replace(BRANCH, names="given", passages="roles"), tmp_path / "world")
    _, tokenizer = load_model("tiny-random")
    env = gym.make("SynthBranch-v0", split="train", data_dir=root, topk=1)
    rows = name_token_probabilities(Peeking(len(tokenizer), tokenizer.eos_token_id), tokenizer, env, [0, 1, 2],
                                    restate=True)
    assert all(p[0] == pytest.approx(1.0) and math.isnan(p[1]) and p[2] == pytest.approx(1.0) and p[3] == 1.0
               for p in rows)
    shifted = name_token_probabilities(Peeking(len(tokenizer), tokenizer.eos_token_id, shift=1), tokenizer, env,
                                       [0, 1], restate=True)
    assert all(p[2] < 1e-6 and p[3] == 0.0 for p in shifted)  # the role word is outside the nucleus: unreachable
    assert all(p[4] < 1e-6 for p in rows)  # all the mass on the asked role's word: none on the other's
    blind = name_token_probabilities(RoleBlind(tokenizer), tokenizer, env, [0, 1, 2, 3], restate=True)
    assert all(p[2] == pytest.approx(0.5) and p[4] == pytest.approx(0.5) for p in blind)
    assert all(math.isnan(p[3]) for p in name_token_probabilities(Peeking(len(tokenizer), tokenizer.eos_token_id),
                                                                  tokenizer, env, [0]))  # not restating: not read
    # whether a start restates is read from the warmstart.json beside its model directory
    (tmp_path / "start" / "model").mkdir(parents=True)
    assert thought_format(str(tmp_path / "start" / "model")) == (False, False)
    for restate, goal in ((True, False), (False, False), (True, True)):
        settings = {"restate": restate, "restate_goal": goal}
        (tmp_path / "start" / "warmstart.json").write_text(json.dumps({"settings": settings}))
        assert thought_format(str(tmp_path / "start" / "model")) == (restate, goal)
    # a training checkpoint is read as the start its run's config.yaml names (OUTPUT/checkpoints/NAME)
    checkpoint = tmp_path / "run" / "checkpoints" / "iter_000002"
    checkpoint.mkdir(parents=True)
    (checkpoint / "rllib_checkpoint.json").write_text("{}")
    (tmp_path / "run" / "config.yaml").write_text(f"model: {tmp_path / 'start' / 'model'}\n")
    assert thought_format(str(checkpoint)) == (True, True)  # the start's warmstart.json, as last written
    (tmp_path / "start" / "warmstart.json").write_text(json.dumps({"settings": {"restate": True}}))
    assert thought_format(str(checkpoint)) == (True, False)  # a warmstart.json from before --restate-goal


def test_the_asked_role_is_read_from_each_question_of_a_world(branch_env):
    env, _ = branch_env
    roles = [asked_role(record.question) for record in env.unwrapped.records]
    assert set(roles) == {"founder", "chair"}
    assert all(f"the {role} of " in record.question for role, record in zip(roles, env.unwrapped.records, strict=True))
    with pytest.raises(StopIteration):
        asked_role("Where was the mayor of Zeta born?")


def test_the_nucleus_holds_the_most_likely_tokens_until_their_mass_reaches_top_p():
    probabilities = torch.tensor([0.08, 0.6, 0.02, 0.3])  # by rank: 0.6, 0.3, 0.08 (mass before it 0.9), 0.02 (0.98)
    assert [in_nucleus(probabilities, token, 0.95) for token in range(4)] == [True, True, False, True]
    assert [in_nucleus(probabilities, token, 0.9) for token in range(4)] == [False, True, False, True]
    assert [in_nucleus(probabilities, token, 0.5) for token in range(4)] == [False, True, False, False]
    assert all(in_nucleus(probabilities, token, 1.0) for token in range(4))  # top-p 1 samples every token
    assert not in_nucleus(torch.tensor([1.0, 0.0]), 1, 1.0)


def test_the_decisions_dependence_on_the_question_is_its_role_word_asked_minus_elsewhere():
    nan = float("nan")
    # rows: first name p, surname p, asked role's word p, in nucleus, the other role's word p
    rows = np.array([[0.9, nan, 0.02, 1.0, 0.97],   # chair asked: " chair" 0.02, " founder" 0.97
                     [0.8, nan, 0.04, 1.0, 0.95],   # chair asked
                     [0.7, nan, 0.99, 1.0, 0.01],   # founder asked: " founder" 0.99, " chair" 0.01
                     [0.6, nan, 0.97, 1.0, 0.03]])  # founder asked
    summary = decision_summary(rows, ["chair", "chair", "founder", "founder"])
    assert summary["role_p_chair"] == pytest.approx(0.03) and summary["role_p_founder"] == pytest.approx(0.98)
    assert summary["role_p_chair_elsewhere"] == pytest.approx(0.02)  # " chair" on the founder questions
    assert summary["role_p_founder_elsewhere"] == pytest.approx(0.96)
    assert summary["role_dependence_chair"] == pytest.approx(0.01)
    assert summary["role_dependence_founder"] == pytest.approx(0.02)
    assert summary["first_name_p_chair"] == pytest.approx(0.85) and "surname_p" not in summary
    # a start that does not restate has no role word: no role keys
    assert not any(key.startswith("role_") for key in decision_summary(np.where(np.arange(5) >= 2, nan, rows),
                                                                          ["chair", "chair", "founder", "founder"]))
