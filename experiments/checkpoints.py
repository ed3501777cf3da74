"""Checkpoints a crash cannot half-write: ``checkpoints/iter_NNNNNN`` directories, each complete or absent.

A save writes RLlib's checkpoint into a temporary directory beside the others, adds ``manifest.json`` (every
file's size and SHA-256) last, renames the directory to ``iter_NNNNNN`` in one step, then points the
``latest`` symlink at it (also in one step) and prunes all but the newest ``keep``. A process killed at any
moment leaves the previous checkpoints and ``latest`` intact; its temporary directory is removed by the next
save. Layout::

    RUN/checkpoints/iter_000004/{manifest.json, algorithm_state.pkl, learner_group/, env_runner/, ...}
    RUN/checkpoints/iter_000006/...
    RUN/checkpoints/latest -> iter_000006

With sharded learners (``--learner-sharding fsdp``) the learner's part holds no weights: every learner writes its
shards of the weights and of AdamW's state into ``learner_group/learner/fsdp_shards/`` (torch distributed
checkpoint, one file per learner, ``sharding.json`` with their number), inside the same temporary directory, so the
manifest and the rename cover them too; ``sharded_policy`` reads them back whole in one process (export, evaluation).

RLlib checkpoints are pickles: restore only checkpoints you wrote (``experiments/export.py`` writes the
policy as safetensors for sharing).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pickle
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"
LATEST = "latest"
PREFIX = "iter_"
CONFIG_FILE = "config.yaml"  # a run directory's settings, as it started (experiments/run.py)
RESUMES_DIR = "resumes"  # resumes/iter_NNNNNN.yaml: a resumed invocation's settings, from iteration NNNNNN on
TMP_PREFIX = ".tmp-"
RLLIB_MARKER = "rllib_checkpoint.json"  # written by RLlib's save_to_path
LAYOUT = ("expected a checkpoint directory (iter_NNNNNN holding manifest.json), a run's checkpoints/ "
          "directory, or a run directory holding checkpoints/")


LEARNER_GROUP = "learner_group"  # RLlib's learner group in a checkpoint
LEARNER_GROUP_CTOR = "class_and_ctor_args.pkl"  # RLlib's, in LEARNER_GROUP: its constructor's arguments (module spec)


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete or damaged; the message names the path."""


def checkpoint_name(iteration: int) -> str:
    return f"{PREFIX}{iteration:06d}"


def checkpoint_iteration(path: str | Path) -> int | None:
    """The iteration of a checkpoint directory named ``iter_NNNNNN`` (None for another name)."""
    number = Path(path).name.removeprefix(PREFIX)
    return int(number) if Path(path).name.startswith(PREFIX) and number.isdigit() else None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST)


def write_manifest(directory: Path) -> None:
    """Record every file's size and hash, written last (to a temporary name, then renamed) as the seal."""
    entries = {str(p.relative_to(directory)): {"bytes": p.stat().st_size, "sha256": _sha256(p)}
               for p in _files(directory)}
    partial = directory / (MANIFEST + ".partial")
    partial.write_text(json.dumps({"files": entries}, indent=1, sort_keys=True))
    os.replace(partial, directory / MANIFEST)


def verify_checkpoint(path: str | Path, hashes: bool = True) -> None:
    """Raise ``CheckpointError`` unless ``path`` holds every file its manifest lists, of the recorded size
    (and hash). A checkpoint written by RLlib directly (no manifest) is accepted as it is."""
    path = Path(path)
    manifest = path / MANIFEST
    if not manifest.is_file():
        if (path / RLLIB_MARKER).is_file():
            return
        raise CheckpointError(f"{path} is not a complete checkpoint (no {MANIFEST}); {LAYOUT}")
    try:
        entries: dict[str, dict[str, Any]] = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError) as error:
        raise CheckpointError(f"{manifest} is damaged ({error}); resume from an earlier checkpoint") from error
    for name, entry in entries.items():
        file = path / name
        if not file.is_file() or file.stat().st_size != entry["bytes"]:
            raise CheckpointError(f"checkpoint {path} is damaged: {name} is missing or truncated; resume from "
                                  f"an earlier checkpoint in {path.parent}")
        if hashes and _sha256(file) != entry["sha256"]:
            raise CheckpointError(f"checkpoint {path} is damaged: {name} does not match its recorded hash")


def _iterations(directory: Path) -> list[Path]:
    """The checkpoint directories in ``directory``, oldest first."""
    found = [p for p in directory.glob(f"{PREFIX}*") if p.is_dir() and p.name[len(PREFIX):].isdigit()]
    return sorted(found, key=lambda p: int(p.name[len(PREFIX):]))


def _point_latest(directory: Path, target: str) -> None:
    link = directory / f"{TMP_PREFIX}{LATEST}-{os.getpid()}"
    with contextlib.suppress(FileNotFoundError):
        link.unlink()
    link.symlink_to(target)
    os.replace(link, directory / LATEST)


class CheckpointManager:
    """Saves an RLlib algorithm atomically into ``directory`` and keeps the newest ``keep`` checkpoints."""

    def __init__(self, directory: str | Path, keep: int = 2) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.directory = Path(directory).resolve()
        self.keep = keep

    def save(self, algo: Any, iteration: int) -> Path:
        """Save ``algo`` as ``iter_<iteration>``; return its path (replacing one of the same iteration)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        self._remove_leftovers()
        final = self.directory / checkpoint_name(iteration)
        tmp = self.directory / f"{TMP_PREFIX}{final.name}-{os.getpid()}"
        algo.save_to_path(str(tmp))
        write_manifest(tmp)
        if final.exists():  # a resumed run re-reaching a saved iteration: swap, never leave neither
            old = self.directory / f"{TMP_PREFIX}old-{final.name}-{os.getpid()}"
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old)
        else:
            os.replace(tmp, final)
        _point_latest(self.directory, final.name)
        self._prune(keep_also=final)
        return final

    def _prune(self, keep_also: Path) -> None:
        for old in _iterations(self.directory)[:-self.keep]:
            if old != keep_also:
                shutil.rmtree(old, ignore_errors=True)

    def _remove_leftovers(self) -> None:
        """Temporary directories of a save that was killed (never named iter_*, so never resumed from)."""
        for leftover in self.directory.glob(f"{TMP_PREFIX}*"):
            if leftover.is_dir() and not leftover.is_symlink():
                shutil.rmtree(leftover, ignore_errors=True)
            else:
                leftover.unlink(missing_ok=True)


def resolve_checkpoint(path: str | Path, hashes: bool = True) -> Path:
    """The checkpoint that ``path`` names: a checkpoint directory, ``checkpoints/latest``, a run's
    ``checkpoints/`` directory or the run directory (its newest checkpoint); verified before it is returned (its
    files' hashes too unless ``hashes`` is False)."""
    given = Path(path)
    if not given.exists():
        raise CheckpointError(f"{given} does not exist; {LAYOUT}")
    candidate = given.resolve()
    if not (candidate / MANIFEST).exists() and not (candidate / RLLIB_MARKER).exists():
        checkpoints = candidate / "checkpoints" if (candidate / "checkpoints").is_dir() else candidate
        if (checkpoints / LATEST).exists():
            candidate = (checkpoints / LATEST).resolve()
        elif found := _iterations(checkpoints):
            candidate = found[-1]
        elif checkpoints is not candidate:
            raise CheckpointError(f"the run {given} has no checkpoint yet ({checkpoints} is empty): it stopped "
                                  f"before its first save (run.py: start it again without --resume)")
        else:
            raise CheckpointError(f"{given} holds no checkpoint; {LAYOUT}")
    verify_checkpoint(candidate, hashes)
    return candidate


def names_a_run(path: str | Path) -> bool:
    """Whether ``path`` is a run directory or its ``checkpoints/`` directory (which ``resolve_checkpoint`` turns into
    the newest checkpoint), not a model directory or a checkpoint itself."""
    path = Path(path)
    return (path / "checkpoints").is_dir() or (path.name == "checkpoints" and path.is_dir())


@contextlib.contextmanager
def restore_errors(path: str | Path) -> Iterator[None]:
    """Turn the bare errors of reading a damaged pickle into a ``CheckpointError`` naming the checkpoint."""
    try:
        yield
    except (EOFError, pickle.UnpicklingError, FileNotFoundError) as error:
        raise CheckpointError(f"cannot restore checkpoint {path}: {type(error).__name__}: {error} (the checkpoint "
                              f"is damaged or incomplete; resume from an earlier one in {Path(path).parent})"
                              ) from error


def is_sharded(checkpoint: str | Path) -> bool:
    """Whether ``checkpoint`` holds sharded learners' weights (``learner_sharding="fsdp"``) instead of a module."""
    from algos.tree_grpo.learner_group import shards_directory

    return shards_directory(Path(checkpoint) / LEARNER_GROUP).is_dir()


def sharded_policy(checkpoint: str | Path) -> Any:
    """The policy module of a checkpoint of sharded learners, in this process: built from the module spec RLlib
    wrote with the learner group, its weights (the float32 masters) read from every learner's shards, whatever the
    number of learners that wrote them (no process group needed)."""
    from ray.rllib.core import DEFAULT_MODULE_ID

    from algos.tree_grpo.learner_group import shards_directory
    from policies.fsdp import load_full_weights

    checkpoint = Path(checkpoint)
    with restore_errors(checkpoint), (checkpoint / LEARNER_GROUP / LEARNER_GROUP_CTOR).open("rb") as stream:
        _, kwargs = pickle.load(stream)["ctor_args_and_kwargs"]
    module = kwargs["module_spec"].rl_module_specs[DEFAULT_MODULE_ID].build()
    with restore_errors(checkpoint):
        load_full_weights(module.model, shards_directory(checkpoint / LEARNER_GROUP))
    return module


def settings_file_at(run_dir: Path, iteration: int | None) -> Path:
    """The file holding a run's settings after ``iteration`` (None: its newest): the newest resume record that
    applies by then (``resumes/iter_NNNNNN.yaml``, NNNNNN the first iteration it applies to), else config.yaml."""
    def first(path: Path) -> int | None:
        return checkpoint_iteration(path.with_suffix(""))

    records = sorted((path for path in (run_dir / RESUMES_DIR).glob("*.yaml") if first(path) is not None), key=first)
    applying = [path for path in records if iteration is None or first(path) <= iteration + 1]
    return applying[-1] if applying else run_dir / CONFIG_FILE
