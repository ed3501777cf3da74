"""The registered envs over generated worlds: ``SynthHop-v0`` (``make_synthhop_env``) and ``SynthBranch-v0``
(``make_synthbranch_env``), each a ``SearchQAEnv`` over a world's files."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from envs.synthetic.files import read_spec, world_data_dir
from envs.synthetic.world import spec_from_fields


def make_synthhop_env(split: str = "train", *, world: Mapping[str, Any] | None = None,
                      data_dir: str | os.PathLike | None = None, **env_kwargs: Any):
    """``gym.make("SynthHop-v0", world={...}, ...)``: search QA over a generated world of people, companies, cities
    and countries, where a question takes 1 to 3 hops ("In which country is the company Anna works for based?").

    ## Action Space, Observation Space, Rewards, Episode End
    Those of ``SearchQAEnv`` (``UnicodeText`` actions and observations: the step's text, and the retrieved
    passages or the final ""; Search-R1's format-aware exact-match reward at the end; ``terminated`` on an
    answer, ``truncated`` when the final, answer-only step (turn ``max_turns + 1``) holds none). A question needs
    one search per hop: ``max_turns`` below the world's most hops is refused.

    ## Arguments
    ``world``: ``WorldSpec`` fields (sizes, seed, ``hop_mix``), generated into the cache. A ``data_dir`` that holds
    ``synthhop/`` files (``python -m envs.synthetic DIR``) is served as it is; any other (e.g. the real data
    directory) is ignored; one that does not exist is an error. Every other keyword goes to ``SearchQAEnv``.

    ## Version History
    * v0: initial version.
    """
    return _world_env("synthhop", split, world, data_dir, env_kwargs)


def make_synthbranch_env(split: str = "train", *, world: Mapping[str, Any] | None = None,
                         data_dir: str | os.PathLike | None = None, **env_kwargs: Any):
    """``gym.make("SynthBranch-v0", world={...}, ...)``: search QA over a SynthBranch world, where every question
    turns on one decision taken after the first search, and which way is right differs between questions.

    ## Description
    Each company has a founder and a chair, both named in its passage: "Brightwater Guild is a guild based in
    Quellmoor. It was founded in 1874 by Varno Keld and is chaired by Tal Mirren." Every question asks about one of
    them, e.g. (``hops`` 3) "In which country was the chair of Brightwater Guild born?": search the company, then
    the person the question's wording names (the routing decision), then that person's birth city; answer its
    country. The other person's route ends in another country (the world is drawn so), so following the wrong
    name gives a wrong answer in the right format. Half the questions of each split ask about founders, half about
    chairs, so no fixed rule ("the first name") is right more than half the time. ``hops`` 2 asks the birth city,
    4 the birth country of the person's spouse.

    ## Action Space, Observation Space, Rewards, Episode End
    Those of ``SearchQAEnv`` (``UnicodeText`` actions and observations: the step's text, and the retrieved
    passages or the final ""; Search-R1's format-aware exact-match reward at the end; ``terminated`` on an
    answer, ``truncated`` when the final, answer-only step (turn ``max_turns + 1``) holds none). A question needs
    ``hops`` searches: ``max_turns`` must be at least ``hops`` (less is refused). With
    ``hops`` 3 and the paper's ``max_turns`` 3, a trajectory is 3 searches and the answer: 4 LLM calls.

    ## Why step-level credit matters here
    The decision is one step in the middle of a 3-4 step trajectory: everything before it is the same on both
    routes and everything after it is copying names. A start policy that routes wrong most of the time
    (``experiments/warmstart.py --misroute``) rarely samples the right route, so chains of a group mostly share
    one outcome. A tree that branches after the first search (the node before the decision) makes siblings that
    share that search and differ in the decision alone; their reward difference credits that one step, and the
    expansion costs the rest of a chain only, not a whole one. Where a strategy branches (``--branching``) decides
    how often that node is expanded.

    ## Arguments
    ``world``: ``BranchSpec`` fields (``hops``, sizes, seed, ``names``, ``passages``, ``lead``), generated into the
    cache; with ``names="given"`` every person is one common given name ("founded in 1874 by Mary and is chaired by
    John"), one token for SmolLM2's tokenizer, so the decision is a single token and no blend of the two names can be
    written (the branching benchmark's world); with ``passages="roles"`` a company's passage names them in the
    questions' words ("The founder of Brightwater Guild is Mary. The chair of Brightwater Guild is John."); with
    ``lead=True`` a question names a person who works for the company instead ("In which country was the chair of
    the company Anna works for born?"), whose passage is searched first, so the decision is the middle step of
    ``hops`` (3-5) searches and an answer. A ``data_dir`` holding ``synthbranch/`` files (``python -m envs.synthetic
    DIR --dataset synthbranch``) is served as it is. Every
    other keyword goes to ``SearchQAEnv``.

    ## Version History
    * v0: initial version.
    """
    return _world_env("synthbranch", split, world, data_dir, env_kwargs)


def _world_env(dataset: str, split: str, world: Mapping[str, Any] | None, data_dir: str | os.PathLike | None,
               env_kwargs: dict[str, Any]):
    """The env over the world; a ``ValueError`` where its ``max_turns`` cannot make the searches a question needs
    (one per hop), or ``env_kwargs`` names another dataset."""
    from envs.search_qa import SearchQAEnv

    if "dataset" in env_kwargs:
        raise ValueError(f"this env serves the {dataset} dataset; dataset={env_kwargs['dataset']!r} cannot be set "
                         f"(gym.make another id, or build SearchQAEnv)")
    env = SearchQAEnv(dataset, split, data_dir=world_dir(dataset, world, data_dir), **env_kwargs)
    hops = max(len(record.supporting_titles) for record in env.records)
    if hops > env.max_turns:
        raise ValueError(f"max_turns {env.max_turns}: the {dataset} world asks {hops}-hop questions, one search per "
                         f"hop: set max_turns to at least {hops}")
    return env


def world_dir(dataset: str, world: Mapping[str, Any] | None = None,
              data_dir: str | os.PathLike | None = None) -> Path:
    """The data directory a ``dataset`` (synthhop, synthbranch) env serves: ``data_dir`` when it holds that
    dataset's files (``world``, if given, must be the world written there), else the cached world of ``world``
    (the spec's fields), written on first use. A ``data_dir`` that does not exist is a ``MissingDataError``."""
    from envs.datasets import MissingDataError

    if data_dir is not None and not Path(data_dir).is_dir():
        raise MissingDataError(f"data_dir {data_dir} does not exist: pass a directory holding {dataset}/world.json "
                               f"(python -m envs.synthetic DIR), or none, to generate the world of world= into the "
                               f"cache")
    if data_dir is not None and (Path(data_dir) / dataset / "world.json").exists():
        if world is not None and spec_from_fields(dataset, world) != read_spec(dataset, data_dir):
            raise ValueError(f"world={dict(world)} is not the world written in data_dir {data_dir} "
                             f"({dataset}/world.json): give one of them")
        return Path(data_dir)
    return world_data_dir(spec_from_fields(dataset, world))
