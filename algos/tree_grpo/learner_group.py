"""The Tree-GRPO learner group: RLlib's ``LearnerGroup``, with sharded learners (``learner_sharding="fsdp"``) taking
part together in whatever needs their whole state.

RLlib asks learner 0 alone for the weights (``get_state``: the weight sync, a restore's sync) and has learner 0 alone
write the learner's part of a checkpoint. Sharded, learner 0 holds a part of each weight only, and gathering the
rest is a collective every learner must join. So here:

- a state that holds the weights (``components`` naming the module) is gathered by every learner at once
  (``TreeGRPOTorchLearner.gathered_state``), learner 0's copy returned;
- a checkpoint (``save_to_path``) is RLlib's, whose learner state then holds no weights nor optimizer state, plus
  ``learner/SHARDS_DIR``: every learner's shards of both (torch distributed checkpoint, ``SHARDS_INFO`` beside them
  with the world size), written by every learner at once; the learners' nodes must share the checkpoint's file
  system;
- a restore (``restore_from_path``) checks that the checkpoint was written by this many learners and this sharding
  (a clear error otherwise, before anything is loaded), restores RLlib's part, then every learner reads its
  shards.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ray.rllib.core import COMPONENT_LEARNER, COMPONENT_RL_MODULE
from ray.rllib.core.learner.learner_group import LearnerGroup
from ray.rllib.utils.annotations import override
from ray.rllib.utils.typing import StateDict

SHARDS_DIR = "fsdp_shards"  # in a checkpoint's learner_group/learner/: the sharded learners' weights and optimizer
SHARDS_INFO = "sharding.json"  # in SHARDS_DIR: the world size that wrote the shards


def shards_directory(learner_group_path: str | Path) -> Path:
    return Path(learner_group_path) / COMPONENT_LEARNER / SHARDS_DIR


def write_shards_info(directory: str | Path, world_size: int) -> None:
    (Path(directory) / SHARDS_INFO).write_text(json.dumps({"world_size": world_size}))


def check_checkpoint_sharding(learner_group_path: str | Path, sharded: bool, world_size: int) -> None:
    """A ``ValueError`` naming the checkpoint unless it was written as this run would write it: with shards by
    ``world_size`` learners when ``sharded``, without shards otherwise."""
    directory = shards_directory(learner_group_path)
    checkpoint = Path(learner_group_path).parent
    if not directory.is_dir():
        if sharded:
            raise ValueError(f"{checkpoint}: a checkpoint of unsharded (ddp) learners cannot be resumed with "
                             f"--learner-sharding fsdp; resume with --learner-sharding ddp")
        return
    if not sharded:
        raise ValueError(f"{checkpoint}: a checkpoint of sharded (fsdp) learners cannot be resumed with "
                         f"--learner-sharding ddp; resume with --learner-sharding fsdp")
    written = int(json.loads((directory / SHARDS_INFO).read_text())["world_size"])
    if written != world_size:
        raise ValueError(f"{checkpoint}: a sharded (fsdp) checkpoint of {written} learner(s) cannot be resumed by "
                         f"{world_size}: resume with --num-learners {written}, or export it (experiments/export.py) "
                         f"and start a new run from the exported model")


class TreeGRPOLearnerGroup(LearnerGroup):
    """RLlib's learner group; see the module docstring for what changes with sharded learners."""

    @property
    def sharded(self) -> bool:
        return self.config.learner_sharding == "fsdp" and self.is_remote

    def on_every_learner(self, call: Callable[[Any], Any]) -> list[Any]:
        """``call(learner)`` on every learner at once (the collectives of sharded learners need them all); their
        results in learner order, the first learner's error raised."""
        return self._get_results(self.foreach_learner(call))

    @override(LearnerGroup)
    def get_state(self, components=None, *, not_components=None, **kwargs) -> StateDict:
        wants_weights = components is not None and self._check_component(
            f"{COMPONENT_LEARNER}/{COMPONENT_RL_MODULE}", components, not_components)
        if not (self.sharded and wants_weights):
            return super().get_state(components, not_components=not_components, **kwargs)
        inner = self._get_subcomponents(COMPONENT_LEARNER, components)
        inner_not = self._get_subcomponents(COMPONENT_LEARNER, not_components)
        states = self.on_every_learner(
            lambda learner: learner.gathered_state(inner, not_components=inner_not, **kwargs))
        return {COMPONENT_LEARNER: next(state for state in states if state is not None)}

    @override(LearnerGroup)
    def save_to_path(self, path=None, *, state=None, filesystem=None, use_msgpack=False) -> str:
        path = super().save_to_path(path, state=state, filesystem=filesystem, use_msgpack=use_msgpack)
        if self.sharded:
            directory = str(shards_directory(path))
            self.on_every_learner(lambda learner: learner.save_shards(directory))
        return path

    @override(LearnerGroup)
    def restore_from_path(self, path, *, component=None, filesystem=None, **kwargs) -> None:
        if component is None:
            check_checkpoint_sharding(path, self.sharded, len(self))
        super().restore_from_path(path, component=component, filesystem=filesystem, **kwargs)
        if component is None and self.sharded:
            directory = str(shards_directory(path))
            self.on_every_learner(lambda learner: learner.load_shards(directory))
