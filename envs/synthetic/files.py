"""A generated world's files: written in the formats the real loaders read, read back (its spec, SynthBranch's
questions with their decoys), and cached once per spec under the cache root."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from envs.cache import default_cache_dir
from envs.synthetic.world import BranchSpec, SynthQuestion, WorldSpec, spec_from_fields


def write_world(spec: WorldSpec | BranchSpec, directory: str | os.PathLike) -> Path:
    """Write the world under ``directory``: ``wiki/paragraphs.jsonl`` and ``DATASET/{train,dev}.json`` (DATASET:
    synthhop or synthbranch), with the spec as ``DATASET/world.json``."""
    world, directory, dataset = spec.world(), Path(directory), spec.DATASET
    (directory / "wiki").mkdir(parents=True, exist_ok=True)
    (directory / dataset).mkdir(parents=True, exist_ok=True)
    with (directory / "wiki" / "paragraphs.jsonl").open("w", encoding="utf-8") as f:
        for i, name in enumerate(world.entities):
            f.write(json.dumps({"id": str(i), "contents": f'"{name}"\n{world.passage(name)}'}) + "\n")
    for split, questions in world.split_questions().items():
        rows = [{"_id": f"{dataset}-{split}-{i}", "question": q.question, "answer": q.answer, "type": "bridge",
                 "hops": q.hops, "supporting_facts": [[title, 0] for title in q.chain]}
                for i, q in enumerate(questions)]
        (directory / dataset / f"{split}.json").write_text(json.dumps(rows, indent=0), encoding="utf-8")
    (directory / dataset / "world.json").write_text(json.dumps(asdict(spec)), encoding="utf-8")
    return directory


def read_spec(dataset: str, data_dir: str | os.PathLike) -> WorldSpec | BranchSpec:
    """The spec of the ``dataset`` world written in ``data_dir`` (its ``DATASET/world.json``)."""
    return spec_from_fields(dataset, json.loads((Path(data_dir) / dataset / "world.json").read_text()))


def branch_questions(data_dir: str | os.PathLike, split: str, served: Sequence[str]) -> list[SynthQuestion]:
    """The questions of ``split`` of the SynthBranch world written in ``data_dir``, each with its decoy (the wrong
    route), for an env that serves the question texts ``served`` (in order); a ``ValueError`` when they are not
    the questions of ``data_dir``'s ``world.json``."""
    questions = read_spec("synthbranch", data_dir).world().split_questions()[split]
    if [q.question for q in questions] != list(served):
        raise ValueError(f"{data_dir}: the synthbranch {split} questions are not those of its world.json")
    return questions


def world_data_dir(spec: WorldSpec | BranchSpec, cache_dir: str | os.PathLike | None = None) -> Path:
    """The data directory of ``spec``'s world, written once into the cache (atomically, so concurrent
    processes agree)."""
    directory = Path(cache_dir or default_cache_dir()) / spec.DATASET / spec.key
    if not (directory / spec.DATASET / "world.json").exists():
        staging = Path(tempfile.mkdtemp(prefix=f"{spec.key}.tmp", dir=directory.parent.mkdir(
            parents=True, exist_ok=True) or directory.parent))
        write_world(spec, staging)
        try:
            staging.rename(directory)
        except OSError:  # another process published it first
            shutil.rmtree(staging, ignore_errors=True)
    return directory
