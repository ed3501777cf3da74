"""Gymnasium search-QA environments. Importing this package registers them::

    import gymnasium as gym
    import envs  # noqa: F401  (registers the ids below)

    env = gym.make("HotpotQA-v0", split="dev", topk=3, max_turns=3)

Every id serves :class:`envs.search_qa.SearchQAEnv` on the shared corpus (``DATA_DIR/wiki/paragraphs.jsonl``);
every constructor argument can be overridden through ``gym.make`` keyword arguments. ``SynthHop-v0`` serves
the same env over a generated fictional world (``envs.synthetic``; ``gym.make("SynthHop-v0", world={...})``).
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym

from envs.datasets import DATASETS, load_dataset, load_records
from envs.search_qa import SearchQAEnv, SearchQAState, UnicodeText, parse_action

ENTRY_POINT = "envs.search_qa:SearchQAEnv"
SYNTHHOP_ENTRY_POINT = "envs.synthetic:make_synthhop_env"

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
}
PAPER_ENV_IDS = tuple(env_id for env_id in ENV_IDS if env_id != "SynthHop-v0")


def eval_split(env_id: str) -> str:
    """The split an env id is evaluated on (dev for the multi-hop sets, test for the open-domain ones)."""
    if env_id not in ENV_IDS:
        raise ValueError(f"unknown env id {env_id!r}; registered: {', '.join(ENV_IDS)}")
    return ENV_IDS[env_id][2]


def question_count(env_id: str, **env_config: Any) -> int:
    """How many questions ``gym.make(env_id, **env_config)`` poses (its ``unwrapped.records``), read from the
    dataset file alone: the retriever and its index are not built. SynthHop's world is written to the cache
    if it is not there yet (as the env would). An env id of another entry point is built and counted."""
    spec = gym.spec(env_id)
    kwargs = {**spec.kwargs, **env_config}
    if spec.entry_point == SYNTHHOP_ENTRY_POINT:
        from envs.synthetic import synthhop_data_dir

        data_dir = synthhop_data_dir(kwargs.get("world"), kwargs.get("data_dir"))
        return len(load_dataset("synthhop", kwargs.get("split", "train"), data_dir))
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


for _env_id, (_dataset, _split, _) in ENV_IDS.items():
    if _env_id not in gym.registry:
        if _dataset == "synthhop":
            gym.register(id=_env_id, entry_point=SYNTHHOP_ENTRY_POINT, kwargs={"split": _split})
        else:
            gym.register(id=_env_id, entry_point=ENTRY_POINT, kwargs={"dataset": _dataset, "split": _split})

__all__ = ["ENV_IDS", "PAPER_ENV_IDS", "SearchQAEnv", "SearchQAState", "UnicodeText", "eval_split", "parse_action",
           "question_count"]
