"""SearchQAEnv's contract on small generated worlds (no data directory, no index): the reset options it takes."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from envs.retrieval import Retriever, SearchHit
from envs.search_qa import SearchQAEnv
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
