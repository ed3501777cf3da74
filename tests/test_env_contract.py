"""SearchQAEnv's contract on small generated worlds (no data directory, no index): the reset options it takes,
snapshots restored only into an env serving the same questions, observations inside the declared space, and the
options docs/environments.md lists."""

from __future__ import annotations

import copy
import dataclasses
import inspect
import pickle
from collections.abc import Sequence
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest

import envs.search_qa  # also registers the ids
from envs.retrieval import Retriever, SearchHit
from envs.search_qa import INFORMATION_TAGS, MAX_OBSERVATION_CHARS, SearchQAEnv
from envs.synthetic import WorldSpec, write_world

SMALL = {"people": 40, "companies": 20, "cities": 10, "countries": 4, "train_questions": 60, "dev_questions": 30}


class FixedRetriever(Retriever):
    """One passage per query, titled by the query, whose text is ``text``: searches without building an index."""

    def __init__(self, text: str = "a short passage") -> None:
        self.text = text

    def _search_hits(self, queries: Sequence[str], k: int) -> list[list[SearchHit]]:
        return [[SearchHit(id=query, title=query, text=self.text, score=1.0)] for query in queries]


def world_env(root: Path, **kwargs) -> SearchQAEnv:
    return SearchQAEnv("synthhop", "dev", data_dir=root, retriever=kwargs.pop("retriever", FixedRetriever()), **kwargs)


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    return write_world(WorldSpec(**SMALL, seed=1), tmp_path_factory.mktemp("world"))


# -- reset options -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("index", [3, np.int64(3), np.uint8(3), np.int32(3)])
def test_reset_takes_any_integer_index(world, index):
    env = world_env(world)
    prompt, info = env.reset(options={"index": index})
    assert info["index"] == 3 and type(info["index"]) is int
    assert env.unwrapped.records[3].question.rstrip("?") in prompt


@pytest.mark.parametrize("index", [True, 3.0, "3", -1, SMALL["dev_questions"], np.float64(3)])
def test_reset_refuses_an_index_that_is_no_question_naming_the_option(world, index):
    env = world_env(world)
    with pytest.raises(ValueError, match=r"options\['index'\] must be an int in \[0, 30\)"):
        env.reset(options={"index": index})


def test_reset_refuses_unknown_options_naming_them_and_the_known_ones(world):
    env = world_env(world)
    with pytest.raises(ValueError, match=r"unknown reset option 'idx'; known: index"):
        env.reset(options={"idx": 3})
    with pytest.raises(ValueError, match=r"unknown reset option 'question', 'seed'; known: index"):
        env.reset(options={"index": 3, "seed": 0, "question": "q"})
    assert env.reset(options={})[1]["index"] in range(SMALL["dev_questions"])  # no option: a random question


# -- snapshots: which questions they index ---------------------------------------------------------------------


def test_a_snapshot_of_another_world_of_the_same_sizes_is_refused_naming_both():
    one, two = (gym.make("SynthHop-v0", split="dev", world={**SMALL, "seed": seed}, retriever=FixedRetriever())
                for seed in (1, 2))
    assert one.unwrapped.source[:2] == two.unwrapped.source[:2] == ("synthhop", "dev")  # alike but for the records
    assert len(one.unwrapped.records) == len(two.unwrapped.records)
    one.reset(options={"index": 3})
    one.step("<search>a query</search>")
    two.reset(options={"index": 0})
    with pytest.raises(ValueError, match=r"the state is from .*, this env serves") as error:
        two.unwrapped.set_state(one.unwrapped.get_state())
    assert one.unwrapped.source[2] in str(error.value) and two.unwrapped.source[2] in str(error.value)
    assert two.unwrapped.get_state().index == 0  # left as it was


def test_a_snapshot_restores_into_an_env_serving_the_same_world_from_elsewhere(tmp_path):
    spec = WorldSpec(**SMALL, seed=1)
    first, second = (world_env(write_world(spec, tmp_path / name)) for name in ("a", "b"))
    first.reset(options={"index": 5})
    first.step("<search>a query</search>")
    second.reset(options={"index": 0})
    second.set_state(pickle.loads(pickle.dumps(first.get_state())))
    assert second.step("<answer>x</answer>")[1:] == first.step("<answer>x</answer>")[1:]
    assert second.get_state() == first.get_state() and second.record == first.record


def test_a_snapshot_whose_index_is_no_question_is_refused(world):
    env = world_env(world)
    env.reset(options={"index": 0})
    for index in (SMALL["dev_questions"], -1):
        with pytest.raises(ValueError, match=r"the state's index must be an int in \[0, 30\)"):
            env.set_state(dataclasses.replace(env.get_state(), index=index))


def test_snapshots_and_clones_never_digest_the_records_again(world, monkeypatch):
    env = world_env(world)
    env.reset(options={"index": 2})

    def refuse(records):
        raise AssertionError("the records were digested again")

    monkeypatch.setattr(envs.search_qa, "records_digest", refuse)
    clone = copy.deepcopy(env)
    clone.set_state(env.get_state())
    clone.step("<search>a query</search>")
    env.set_state(clone.get_state())
    assert env.get_state().turn == 1


def test_set_state_restores_the_episode_and_leaves_the_random_generator_as_it_was(world):
    source, target, control = world_env(world), world_env(world), world_env(world)
    source.reset(seed=99)
    source.step("<search>a query</search>")
    target.reset(seed=5)
    control.reset(seed=5)
    target.set_state(source.get_state())
    assert target.step("<answer>x</answer>") == source.step("<answer>x</answer>")
    drawn = [[env.reset()[1]["index"] for _ in range(8)] for env in (target, control)]
    assert drawn[0] == drawn[1]  # the draws the env's own seed gives, whatever snapshot it restored


# -- the observation space ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("max_obs_chars", [2000, MAX_OBSERVATION_CHARS, 3 * MAX_OBSERVATION_CHARS])
def test_a_search_observation_is_in_the_observation_space_whatever_max_obs_chars(world, max_obs_chars):
    passage = "word " * (max_obs_chars // 5 + 10)  # longer than the cap: the observation is as long as it can be
    env = world_env(world, max_obs_chars=max_obs_chars, retriever=FixedRetriever(passage))
    prompt, _ = env.reset(options={"index": 0})
    observation, *_ = env.step("<search>a query</search>")
    assert len(observation) == max_obs_chars + sum(map(len, INFORMATION_TAGS))
    assert env.observation_space.contains(observation) and env.observation_space.contains(prompt)
    invalid, *_ = env.step("no action")
    assert env.observation_space.contains(invalid)
    assert env.observation_space.max_length == max(MAX_OBSERVATION_CHARS, len(observation))


def test_the_environments_page_lists_every_option_the_env_takes():
    page = (Path(__file__).resolve().parents[1] / "docs" / "environments.md").read_text()
    options = page[page.index("Options (all `gym.make` keyword arguments"):]
    options = options[: options.index("\n\n")]
    taken = inspect.signature(SearchQAEnv).parameters
    assert [name for name in taken if f"`{name}" not in options] == []


def test_a_snapshot_restores_whether_its_questions_were_read_from_a_split_or_the_same_file(world):
    by_split = world_env(world)
    by_file = SearchQAEnv("synthhop", data_file=world / "synthhop" / "dev.json", retriever=FixedRetriever())
    by_split.reset(options={"index": 4})
    by_file.set_state(by_split.get_state())  # the same records: the same questions
    assert by_file.record == by_split.record


@pytest.mark.parametrize(("option", "value"), [("topk", np.int64(2)), ("max_turns", np.int32(4)),
                                               ("passage_words", np.uint16(30))])
def test_integer_options_take_any_integer_and_keep_a_python_int(world, option, value):
    env = world_env(world, **{option: value})
    assert getattr(env, option) == value and type(getattr(env, option)) is int


@pytest.mark.parametrize("value", [True, 2.0, "2", 0])
def test_an_integer_option_that_is_not_a_positive_integer_is_refused_naming_it(world, value):
    with pytest.raises(ValueError, match=f"topk must be a positive int, got {value!r}"):
        world_env(world, topk=value)


@pytest.mark.parametrize("template", ['Reply as JSON {"answer": ...}. Q: {question}', "Q: {question} {0}",
                                      "Q: {question} {", "no field at all"])
def test_a_prompt_template_that_cannot_format_is_refused_when_the_env_is_built(world, template):
    with pytest.raises(ValueError, match="prompt_template"):
        world_env(world, prompt_template=template)
    env = world_env(world, prompt_template='Reply as JSON {{"answer": ...}}. Q: {question}')  # braces doubled
    assert env.reset(options={"index": 0})[0].startswith('Reply as JSON {"answer": ...}. Q: ')


def test_text_spaces_refuse_flattening_up_front_naming_why(world):
    """Gymnasium flattens a Text space by its sampling charset, which real text leaves ("[", "Ω"): a KeyError in
    mid-episode. The env's spaces refuse it when a wrapper is built."""
    env = gym.make("SynthHop-v0", split="dev", data_dir=world, retriever=FixedRetriever())
    with pytest.raises(NotImplementedError, match="no fixed-size vector form: tokenize"):
        gym.wrappers.FlattenObservation(env)
    with pytest.raises(NotImplementedError, match="no fixed-size vector form"):
        gym.spaces.utils.flatten(env.observation_space, "Price [1] Ω")
    space = env.observation_space
    assert eval(repr(space), {"UnicodeText": type(space)}) == space  # its repr builds it again
