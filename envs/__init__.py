"""Gymnasium search-QA environments. Importing this package registers them::

    import gymnasium as gym
    import envs  # noqa: F401  (registers the ids below)

    env = gym.make("HotpotQA-v0", split="dev", topk=3, max_turns=3)

Every id serves :class:`envs.search_qa.SearchQAEnv` on the shared corpus (``DATA_DIR/wiki/wiki-18.jsonl``, else
``DATA_DIR/wiki/paragraphs.jsonl``); every constructor argument can be overridden through ``gym.make`` keyword
arguments (but a generated world's dataset). ``SynthHop-v0`` serves
the same env over a generated fictional world (``envs.synthetic``; ``gym.make("SynthHop-v0", world={...})``), and
``SynthBranch-v0`` over its variant whose questions turn on one routing decision
(``envs.synthetic.make_synthbranch_env``).
"""

from __future__ import annotations

import os
from typing import Any

import gymnasium as gym

from envs.datasets import DATASETS, load_dataset, load_records
from envs.retrieval import DEFAULT_BACKEND
from envs.search_qa import SearchQAEnv, SearchQAState, UnicodeText, parse_action, searched_corpus

ENTRY_POINT = "envs.search_qa:SearchQAEnv"
# generated worlds: dataset -> the factory serving it
SYNTHETIC_ENTRY_POINTS = {"synthhop": "envs.synthetic:make_synthhop_env",
                          "synthbranch": "envs.synthetic:make_synthbranch_env"}

# env id -> (dataset name, default split, evaluation split)
ENV_IDS: dict[str, tuple[str, str, str]] = {
    "HotpotQA-v0": ("hotpotqa", "train", "dev"),
    "2WikiMultihopQA-v0": ("2wikimultihopqa", "dev", "dev"),
    "Musique-v0": ("musique", "dev", "dev"),
    "NQ-v0": ("nq", "test", "test"),
    "TriviaQA-v0": ("triviaqa", "test", "test"),
    "PopQA-v0": ("popqa", "test", "test"),
    "Bamboogle-v0": ("bamboogle", "test", "test"),
    "SynthHop-v0": ("synthhop", "train", "dev"),  # a generated world (envs.synthetic), not the data directory
    "SynthBranch-v0": ("synthbranch", "train", "dev"),  # its variant with a routing decision per question
}
PAPER_ENV_IDS = tuple(env_id for env_id, (dataset, _, _) in ENV_IDS.items() if dataset not in SYNTHETIC_ENTRY_POINTS)


def eval_split(env_id: str) -> str:
    """The split an env id is evaluated on (dev for the multi-hop sets, test for the open-domain ones)."""
    if env_id not in ENV_IDS:
        raise ValueError(f"unknown env id {env_id!r}; registered: {', '.join(ENV_IDS)}")
    return ENV_IDS[env_id][2]


def question_count(env_id: str, **env_config: Any) -> int:
    """How many questions ``gym.make(env_id, **env_config)`` poses (its ``unwrapped.records``), read from the
    dataset file alone: the retriever and its index are not built. A generated world is written to the cache
    if it is not there yet (as the env would). An env id of another entry point is built and counted."""
    spec = gym.spec(env_id)
    kwargs = {**spec.kwargs, **env_config}
    if spec.entry_point in SYNTHETIC_ENTRY_POINTS.values():
        return len(_world_questions(spec.entry_point, kwargs))
    if spec.entry_point == ENTRY_POINT:
        dataset = kwargs.get("dataset", "hotpotqa")
        if kwargs.get("data_file") is not None:
            if dataset not in DATASETS:
                raise ValueError(f"unknown dataset {dataset!r}; known datasets: {', '.join(sorted(DATASETS))}")
            return len(load_records(kwargs["data_file"], DATASETS[dataset][0]))
        return len(load_dataset(dataset, kwargs.get("split", "train"), kwargs.get("data_dir")))
    env = gym.make(env_id, **env_config)
    try:
        return len(env.unwrapped.records)
    finally:
        env.close()


def corpus_file(env_id: str, **env_config: Any) -> str | os.PathLike | None:
    """The corpus file ``gym.make(env_id, **env_config)`` searches, found from its options alone (no index is
    built): a ``MissingDataError`` naming the expected layout where the data directory has none; None where a
    retrieval server serves the passages or the world is generated (its corpus is written with it)."""
    spec = gym.spec(env_id)
    if spec.entry_point != ENTRY_POINT:
        return None
    kwargs = {**spec.kwargs, **env_config}
    return searched_corpus(kwargs.get("retriever", DEFAULT_BACKEND), kwargs.get("corpus_path"),
                           kwargs.get("data_dir"))


def world_hops(env_id: str, **env_config: Any) -> int | None:
    """The most searches a question of ``gym.make(env_id, **env_config)`` needs when its world is generated
    (SynthHop-v0, SynthBranch-v0: one per hop); None for the datasets, whose hops are not known."""
    spec = gym.spec(env_id)
    if spec.entry_point not in SYNTHETIC_ENTRY_POINTS.values():
        return None
    return max(len(record.supporting_titles) for record in _world_questions(spec.entry_point, {**spec.kwargs,
                                                                                                **env_config}))


def _world_questions(entry_point: str, kwargs: dict[str, Any]):
    """The questions of a generated world's env (its split), read from the world's files."""
    from envs.synthetic import world_dir

    dataset = next(name for name, point in SYNTHETIC_ENTRY_POINTS.items() if point == entry_point)
    return load_dataset(dataset, kwargs.get("split", "train"), world_dir(dataset, kwargs.get("world"),
                                                                         kwargs.get("data_dir")))


for _env_id, (_dataset, _split, _) in ENV_IDS.items():
    if _env_id not in gym.registry:
        if _dataset in SYNTHETIC_ENTRY_POINTS:
            gym.register(id=_env_id, entry_point=SYNTHETIC_ENTRY_POINTS[_dataset], kwargs={"split": _split})
        else:
            gym.register(id=_env_id, entry_point=ENTRY_POINT, kwargs={"dataset": _dataset, "split": _split})

__all__ = ["ENV_IDS", "PAPER_ENV_IDS", "SearchQAEnv", "SearchQAState", "UnicodeText", "corpus_file", "eval_split",
           "parse_action", "question_count", "world_hops"]
