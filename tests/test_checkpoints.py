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


def test_a_sharded_checkpoints_policy_is_read_whole(tmp_path):
    """A checkpoint of sharded learners holds no module state, only RLlib's module spec (with the learner group)
    and the learners' shards: ``sharded_policy`` builds the module and reads its weights from the shards (written
    here by one process; the slow tier's run.py tests export two learners' shards)."""
    import torch
    from ray.rllib.core import DEFAULT_MODULE_ID
    from ray.rllib.core.rl_module.multi_rl_module import MultiRLModuleSpec
    from ray.rllib.core.rl_module.rl_module import RLModuleSpec

    from algos.tree_grpo.learner_group import shards_directory
    from envs.search_qa import UnicodeText
    from experiments.checkpoints import LEARNER_GROUP, LEARNER_GROUP_CTOR, is_sharded, sharded_policy
    from policies.fsdp import save_sharded
    from policies.rl_module import LLMRLModule

    text = UnicodeText(100)
    spec = MultiRLModuleSpec(rl_module_specs={DEFAULT_MODULE_ID: RLModuleSpec(
        module_class=LLMRLModule, observation_space=text, action_space=text, model_config={"model": "tiny-random"})})
    trained = spec.rl_module_specs[DEFAULT_MODULE_ID].build()
    with torch.no_grad():
        for param in trained.model.parameters():
            param.add_(torch.randn_like(param), alpha=0.01)  # weights a freshly built module does not have
    (tmp_path / LEARNER_GROUP).mkdir()
    (tmp_path / LEARNER_GROUP / LEARNER_GROUP_CTOR).write_bytes(
        pickle.dumps({"class": None, "ctor_args_and_kwargs": ((), {"config": None, "module_spec": spec})}))
    assert not is_sharded(tmp_path)
    shards = shards_directory(tmp_path / LEARNER_GROUP)
    save_sharded(trained.model, torch.optim.AdamW(trained.model.parameters()), shards)
    assert is_sharded(tmp_path)
    read = sharded_policy(tmp_path).model.state_dict()
    assert read.keys() == trained.model.state_dict().keys()
    assert all(torch.equal(read[name], value) for name, value in trained.model.state_dict().items())


def test_a_sharded_checkpoint_without_its_module_spec_is_named(tmp_path):
    from experiments.checkpoints import sharded_policy

    (tmp_path / "learner_group").mkdir()
    with pytest.raises(CheckpointError, match=f"cannot restore checkpoint {re.escape(str(tmp_path))}"):
        sharded_policy(tmp_path)
