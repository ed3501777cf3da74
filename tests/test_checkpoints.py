"""Atomic checkpoints: a save is complete or absent, ``latest`` always names a complete one, damage is named."""

from __future__ import annotations

import os
import pickle
import re
from pathlib import Path

import pytest

from experiments.checkpoints import (
    CheckpointError,
    CheckpointManager,
    resolve_checkpoint,
    restore_errors,
    verify_checkpoint,
    write_manifest,
)


class FakeAlgo:
    """Writes a checkpoint the way RLlib lays one out (several files, one nested)."""

    def __init__(self, fail_after_files: int | None = None) -> None:
        self.fail_after_files = fail_after_files
        self.weights = b"w" * 1000

    def save_to_path(self, path: str) -> str:
        root = Path(path)
        (root / "learner_group").mkdir(parents=True)
        files = [(root / "algorithm_state.pkl", pickle.dumps({"iteration": 1})),
                 (root / "learner_group" / "module_state.pkl", self.weights),
                 (root / "rllib_checkpoint.json", b"{}")]
        for count, (file, data) in enumerate(files):
            if self.fail_after_files is not None and count == self.fail_after_files:
                raise KeyboardInterrupt  # killed in the middle of writing
            file.write_bytes(data)
        return path


def test_save_seals_renames_points_latest_and_prunes(tmp_path):
    manager = CheckpointManager(tmp_path / "checkpoints", keep=2)
    for iteration in (1, 2, 3):
        saved = manager.save(FakeAlgo(), iteration)
        assert saved.name == f"iter_{iteration:06d}"
        verify_checkpoint(saved)
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["iter_000002", "iter_000003", "latest"]
    assert os.readlink(tmp_path / "checkpoints" / "latest") == "iter_000003"  # relative: the run can move


def test_a_save_killed_midway_leaves_the_previous_checkpoint_and_latest_intact(tmp_path):
    manager = CheckpointManager(tmp_path / "checkpoints", keep=1)
    first = manager.save(FakeAlgo(), 1)
    with pytest.raises(KeyboardInterrupt):
        manager.save(FakeAlgo(fail_after_files=2), 2)
    assert resolve_checkpoint(tmp_path) == first  # the half-written one is never named iter_* nor latest
    assert not (tmp_path / "checkpoints" / "iter_000002").exists()
    manager.save(FakeAlgo(), 2)  # the next save clears the leftover
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["iter_000002", "latest"]


def test_resaving_an_iteration_replaces_it(tmp_path):
    manager = CheckpointManager(tmp_path, keep=3)
    manager.save(FakeAlgo(), 4)
    algo = FakeAlgo()
    algo.weights = b"v" * 10
    saved = manager.save(algo, 4)
    assert (saved / "learner_group" / "module_state.pkl").read_bytes() == b"v" * 10
    verify_checkpoint(saved)


@pytest.mark.parametrize("damage", ["truncate", "delete", "flip"])
def test_verify_names_the_damaged_file(tmp_path, damage):
    saved = CheckpointManager(tmp_path).save(FakeAlgo(), 1)
    target = saved / "learner_group" / "module_state.pkl"
    if damage == "truncate":
        target.write_bytes(target.read_bytes()[:10])
    elif damage == "delete":
        target.unlink()
    else:
        target.write_bytes(b"x" * 1000)  # same size, other bytes
    with pytest.raises(CheckpointError, match=r"module_state\.pkl"):
        verify_checkpoint(saved)
    with pytest.raises(CheckpointError, match=re.escape(str(saved))):
        resolve_checkpoint(tmp_path / "latest")


def test_resolve_accepts_every_spelling_of_a_run(tmp_path):
    run = tmp_path / "run"
    manager = CheckpointManager(run / "checkpoints")
    manager.save(FakeAlgo(), 1)
    newest = manager.save(FakeAlgo(), 2)
    for spelling in (run, run / "checkpoints", run / "checkpoints" / "latest", newest):
        assert resolve_checkpoint(spelling) == newest
    (run / "checkpoints" / "latest").unlink()  # no link: the highest iteration
    assert resolve_checkpoint(run) == newest


def test_resolve_explains_what_is_missing(tmp_path):
    with pytest.raises(CheckpointError, match=r"does not exist.*iter_NNNNNN"):
        resolve_checkpoint(tmp_path / "nope")
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    with pytest.raises(CheckpointError, match="no checkpoint yet"):
        resolve_checkpoint(tmp_path / "run")
    (tmp_path / "other").mkdir()
    with pytest.raises(CheckpointError, match="holds no checkpoint"):
        resolve_checkpoint(tmp_path / "other")


def test_a_checkpoint_without_manifest_is_incomplete_unless_rllib_wrote_it(tmp_path):
    (tmp_path / "iter_000001").mkdir()
    (tmp_path / "iter_000001" / "algorithm_state.pkl").write_bytes(b"x")
    with pytest.raises(CheckpointError, match=r"no manifest\.json"):
        verify_checkpoint(tmp_path / "iter_000001")
    FakeAlgo().save_to_path(str(tmp_path / "plain"))  # algo.save_to_path by hand: accepted as RLlib wrote it
    verify_checkpoint(tmp_path / "plain")
    write_manifest(tmp_path / "iter_000001")
    verify_checkpoint(tmp_path / "iter_000001")


def test_keep_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match="keep"):
        CheckpointManager(tmp_path, keep=0)


@pytest.mark.parametrize("error", [EOFError("Ran out of input"), pickle.UnpicklingError("truncated")])
def test_restore_errors_name_the_checkpoint(tmp_path, error):
    expected = re.escape(f"cannot restore checkpoint {tmp_path}")
    with pytest.raises(CheckpointError, match=expected), restore_errors(tmp_path):
        raise error
