"""SearchQAEnv on small generated worlds (no data directory, no index): async vector envs through shared memory,
and the arguments, snapshots and world fields it refuses, each naming what is wrong."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.vector.utils import create_shared_memory, read_from_shared_memory, write_to_shared_memory

import envs
from envs.retrieval import SearchHit
from envs.search_qa import SearchQAEnv, UnicodeText
from envs.synthetic import BranchSpec, WorldSpec, write_world
from tests.test_env_contract import SMALL, FixedRetriever, world_env

# characters a charset-based encoding would lose: NUL, a lone surrogate, astral and right-to-left ones
ODD_TEXT = "NUL\x00 lone\ud800 🙂 北京 \u202e end"


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    return write_world(WorldSpec(**SMALL, seed=1), tmp_path_factory.mktemp("world"))


# -- vector envs -------------------------------------------------------------------------------------------------


def test_text_shared_memory_round_trips_any_string_up_to_max_length():
    space = UnicodeText(8)
    memory = create_shared_memory(space, n=3)
    view = read_from_shared_memory(space, memory, n=3)  # read once, like AsyncVectorEnv: it follows the writes
    for index, text in enumerate(["\x00\ud800🙂", "", "12345678"]):
        write_to_shared_memory(space, index, text, memory)
    assert tuple(view) == ("\x00\ud800🙂", "", "12345678")
    write_to_shared_memory(space, 2, "short", memory)  # a shorter string leaves nothing of the longer one
    assert view[2] == "short" and view[-1] == "short" and view[:2] == ("\x00\ud800🙂", "")
    with pytest.raises(ValueError, match="the observation must be a str of at most 8 characters"):
        write_to_shared_memory(space, 0, "123456789", memory)


def test_async_vector_env_with_shared_memory_gives_the_sync_env_observations(world):
    def make(mode: str) -> gym.vector.VectorEnv:
        kwargs = {"vector_kwargs": {"shared_memory": True}} if mode == "async" else {}
        return gym.make_vec("SynthHop-v0", num_envs=2, vectorization_mode=mode, split="dev", data_dir=world,
                            retriever=FixedRetriever(ODD_TEXT), max_turns=3, **kwargs)

    steps = [("<search>first</search>", "no action"), ("<answer>x</answer>", "<search>second</search>"),
             ("<search>after the reset</search>", "<answer>y</answer>")]
    results = {}
    for mode in ("sync", "async"):
        vector_env = make(mode)
        try:
            observations = [vector_env.reset(seed=0)[0]]
            for actions in steps:
                observation, reward, terminated, truncated, _ = vector_env.step(actions)
                observations.append((observation, reward.tolist(), terminated.tolist(), truncated.tolist()))
        finally:
            vector_env.close()
        results[mode] = observations
    assert results["async"] == results["sync"]
    assert ODD_TEXT in results["async"][1][0][0] and type(results["async"][0]) is tuple  # a copy, not the view


def test_text_spaces_still_refuse_flattening(world):
    env = gym.make("SynthHop-v0", split="dev", data_dir=world, retriever=FixedRetriever())
    with pytest.raises(NotImplementedError, match="no fixed-size vector form"):
        gym.wrappers.FlattenObservation(env)


# -- the retriever and its corpus ----------------------------------------------------------------------------------


@pytest.mark.parametrize("retriever", [object(), 123, None])
def test_a_retriever_of_another_type_is_refused_when_the_env_is_built(world, retriever):
    with pytest.raises(TypeError, match=r"retriever must be a backend name \(bm25, .*\), a retrieval server URL .* "
                                        r"or an envs.retrieval.Retriever instance \(subclass "
                                        r"envs.retrieval.base.Retriever for your own\), got "):
        world_env(world, retriever=retriever)


@pytest.mark.parametrize("retriever", [FixedRetriever(), "http://127.0.0.1:1/retrieve"])
def test_a_corpus_path_with_a_retriever_that_searches_its_own_corpus_is_refused(world, retriever):
    with pytest.raises(ValueError, match=r"corpus_path must be None with .*, which searches its own corpus"):
        world_env(world, retriever=retriever, corpus_path=world / "wiki" / "paragraphs.jsonl")
    with pytest.raises(ValueError, match="corpus_path must be None"):  # the same rule before the env is built
        envs.corpus_file("HotpotQA-v0", retriever=retriever, corpus_path="corpus.jsonl")


# -- snapshots -----------------------------------------------------------------------------------------------------


@pytest.fixture
def searched(world) -> SearchQAEnv:
    """An env one search into its episode."""
    env = world_env(world)
    env.reset(options={"index": 2})
    env.step("<search>a query</search>")
    return env


@pytest.mark.parametrize(("changes", "message"), [
    ({"source": ("synthhop", "dev")}, r"the state's source must be a tuple of 3 str"),
    ({"source": ["synthhop", "dev", "x"]}, r"the state's source must be a tuple of 3 str"),
    ({"turn": -3, "tool_calls": -7}, r"the state's turn must be a non-negative int, got -3"),
    ({"turn": 1.0}, r"the state's turn must be a non-negative int, got 1.0"),
    ({"tool_calls": -1}, r"the state's tool_calls must be a non-negative int, got -1"),
    ({"tool_calls": True}, r"the state's tool_calls must be a non-negative int, got True"),
    ({"tool_calls": 2}, r"the state's tool_calls must be at most its turn \(1\), got 2"),
    ({"steps": "xyz"}, r"the state's steps must be a tuple of \(step text, observation\) str pairs"),
    ({"steps": [("a", "b")]}, r"the state's steps must be a tuple"),
    ({"steps": (("a", 1),)}, r"the state's steps must be a tuple"),
    ({"steps": (("a", "b", "c"),)}, r"the state's steps must be a tuple"),
    ({"steps": ()}, r"the state's steps must hold one .* pair per turn \(1\), got 0"),
    ({"done": 1}, r"the state's done must be a bool, got 1"),
    ({"index": "2"}, r"the state's index must be an int"),
])
def test_set_state_refuses_a_malformed_snapshot_naming_the_field(searched, changes, message):
    before = searched.get_state()
    with pytest.raises(ValueError, match=message):
        searched.set_state(dataclasses.replace(before, **changes))
    assert searched.get_state() == before  # left as it was


def test_set_state_takes_numpy_integers_and_keeps_python_ints(searched):
    state = searched.get_state()
    searched.set_state(dataclasses.replace(state, index=np.int64(2), turn=np.int32(1), tool_calls=np.uint8(1)))
    restored = searched.get_state()
    assert restored == state and {type(restored.index), type(restored.turn), type(restored.tool_calls)} == {int}
    assert searched.step("<answer>x</answer>")[4]["turn"] == 2


# -- the final step --------------------------------------------------------------------------------------------------


class CountingRetriever(FixedRetriever):
    """A ``FixedRetriever`` that counts the queries it is asked."""

    def __init__(self) -> None:
        super().__init__()
        self.queries = 0

    def _search_hits(self, queries: Sequence[str], k: int) -> list[list[SearchHit]]:
        self.queries += len(queries)
        return super()._search_hits(queries, k)


def test_a_search_on_the_final_step_is_reported_as_written_but_runs_no_search(world):
    retriever = CountingRetriever()
    env = world_env(world, retriever=retriever, max_turns=1)
    env.reset(options={"index": 0})
    env.step("<search>first</search>")
    observation, reward, terminated, truncated, info = env.step("<search>past the limit</search>")
    assert (observation, reward, terminated, truncated) == ("", 0.0, False, True)
    assert (info["action"], info["turn"], info["tool_calls"], retriever.queries) == ("search", 2, 1, 1)


# -- prompt templates and reset options ------------------------------------------------------------------------------


@pytest.mark.parametrize(("template", "error", "message"), [
    (None, TypeError, "prompt_template must be a str .*, got NoneType"),
    (b"Q: {question}", TypeError, "prompt_template must be a str .*, got bytes"),
    ("Q: {question.foo}", ValueError, "prompt_template must be a str.format template .*AttributeError"),
    ("Q: {question} {question.upper}", ValueError, r"prompt_template must contain '\{question\}' and no other field"),
    ("Q: {{question}}", ValueError, r"prompt_template must contain '\{question\}' and no other field, got fields \[\]"),
])
def test_a_prompt_template_that_is_not_a_template_of_question_is_refused_naming_it(world, template, error, message):
    with pytest.raises(error, match=message):
        world_env(world, prompt_template=template)


def test_a_prompt_template_may_convert_or_pad_the_question(world):
    env = world_env(world, prompt_template="Q: {question!r:>5}")
    assert env.reset(options={"index": 0})[0] == f"Q: {env.records[0].question!r:>5}"


@pytest.mark.parametrize("options", [[("index", 1)], "index", 1])
def test_reset_options_that_are_not_a_dict_are_refused(world, options):
    env = world_env(world)
    with pytest.raises(TypeError, match=f"options must be a dict .* or None, got {type(options).__name__}"):
        env.reset(options=options)


# -- world fields ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("spec", "values", "message"), [
    (WorldSpec, {"people": "40"}, "people must be an int, got str '40'"),
    (WorldSpec, {"seed": 1.5}, "seed must be an int, got float 1.5"),
    (WorldSpec, {"seed": True}, "seed must be an int, got bool True"),
    (WorldSpec, {"seed": -1}, "seed must be a non-negative int"),
    (WorldSpec, {"dev_questions": None}, "dev_questions must be an int, got NoneType None"),
    (BranchSpec, {"hops": 3.0}, "hops must be an int, got float 3.0"),
])
def test_a_world_field_of_the_wrong_type_is_refused_naming_it(spec, values, message):
    with pytest.raises(ValueError, match=message):
        spec(**values)


def test_a_world_field_of_the_wrong_type_is_refused_through_gym_make():
    with pytest.raises(ValueError, match="people must be an int, got str '40'"):
        gym.make("SynthHop-v0", world={**SMALL, "seed": 1, "people": "40"}, retriever=FixedRetriever())


def test_world_fields_take_numpy_integers_as_python_ints():
    spec = WorldSpec(**SMALL, seed=np.int64(1))
    assert spec == WorldSpec(**SMALL, seed=1) and type(spec.seed) is int
    assert spec.key == WorldSpec(**SMALL, seed=1).key  # the cache key is JSON of the fields
