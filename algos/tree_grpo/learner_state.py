"""The Tree-GRPO learner's state (a mixin of ``TreeGRPOTorchLearner``): RLlib's, plus the schedule position next to
the optimizer's, and, with sharded learners (``learner_sharding="fsdp"``), the weights and the optimizer state as
shards: each learner writes its own into a checkpoint (:meth:`LearnerState.save_shards`), and a full copy of the
weights is gathered by every learner together (:meth:`LearnerState.gathered_state`), never by learner 0 alone as
RLlib's ``LearnerGroup.get_state`` asks (``algos/tree_grpo/learner_group.py`` has all of them take part).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from ray.rllib.core import COMPONENT_OPTIMIZER, COMPONENT_RL_MODULE, DEFAULT_MODULE_ID
from ray.rllib.core.learner.torch.torch_learner import TorchLearner
from ray.rllib.utils import force_list
from ray.rllib.utils.annotations import override
from ray.rllib.utils.typing import StateDict

from algos.tree_grpo import metrics as metric_keys
from algos.tree_grpo.learner_group import write_shards_info
from policies.fsdp import full_state, load_sharded, save_sharded

# a learner state key too: optimizer steps taken so far (the schedule position)
OPTIMIZER_STEPS = metric_keys.OPTIMIZER_STEPS


def _cpu_copy(optimizer_state: dict) -> dict:
    """A torch optimizer's ``state_dict()`` with every per-parameter tensor copied to the CPU."""
    return {**optimizer_state, "state": {
        index: {key: value.detach().to("cpu", copy=True) if torch.is_tensor(value) else value
                for key, value in per_param.items()}
        for index, per_param in optimizer_state["state"].items()}}


class LearnerState:
    """The state methods of ``TreeGRPOTorchLearner`` (listed before ``TorchLearner`` among its bases). Reads the
    learner's ``_optimizer_steps``, ``_world``, ``_policy_root`` (FSDP's root, None when not sharded) and
    ``_gathering`` (True while every learner gathers together)."""

    @override(TorchLearner)
    def get_state(self, components=None, *, not_components=None, **kwargs) -> StateDict:
        """RLlib's learner state plus ``OPTIMIZER_STEPS``, which travels with the optimizer component: restoring
        weights alone gives a fresh optimizer, whose warm-up starts again.

        Sharded (fsdp), the weights and the optimizer state are not in it: the whole state (``components`` None, a
        checkpoint's) leaves them to :meth:`save_shards`, and asking for them by name is an error outside
        :meth:`gathered_state` (learner 0 alone cannot gather the others' shards: it would wait for them)."""
        optimizer = self._check_component(COMPONENT_OPTIMIZER, components, not_components)
        if self._policy_root is None:
            state = super().get_state(components, not_components=not_components, **kwargs)
        else:
            weights = self._check_component(COMPONENT_RL_MODULE, components, not_components)
            if components is not None and (weights or optimizer) and not self._gathering:
                raise ValueError("learner_sharding fsdp: the weights and optimizer state are shards; every learner "
                                 "gathers them together (foreach_learner: TreeGRPOTorchLearner.gathered_state), not "
                                 "learner 0 alone (LearnerGroup.get_state)")
            shards = [COMPONENT_RL_MODULE, COMPONENT_OPTIMIZER]
            state = super().get_state(components, not_components=[*force_list(not_components), *shards], **kwargs)
            if weights and self._gathering:
                state[COMPONENT_RL_MODULE] = {DEFAULT_MODULE_ID: self._full_module_state(**kwargs)}
        if optimizer:
            state[OPTIMIZER_STEPS] = self._optimizer_steps
        return state

    def gathered_state(self, components=None, *, not_components=None, **kwargs) -> StateDict | None:
        """:meth:`get_state` with the weights gathered from the shards (one tensor at a time; ``inference_only``: in
        the compute dtype), on learner 0; None on the others. Every learner must call it at once (the algorithm:
        ``learner_group.foreach_learner``), as every one holds a part of each weight. As :meth:`get_state` when
        not sharded. The optimizer state is not gathered (checkpoints hold it as shards)."""
        if self._policy_root is not None and self._check_component(COMPONENT_OPTIMIZER, components, not_components):
            not_components = [*force_list(not_components), COMPONENT_OPTIMIZER]
        self._gathering = True
        try:
            state = self.get_state(components, not_components=not_components, **kwargs)
        finally:
            self._gathering = False
        return state if self._policy_root is None or dist.get_rank() == 0 else None

    def _full_module_state(self, inference_only: bool = False, **kwargs) -> dict[str, torch.Tensor]:
        """The sharded module's state dict, gathered tensor by tensor; kept on learner 0 only."""
        module = self.module[DEFAULT_MODULE_ID].unwrapped()
        keep = dist.get_rank() == 0
        dtype = module.precision.compute if inference_only else None
        return {name: tensor for name, tensor in full_state(module, dtype) if keep}

    def save_shards(self, directory: str) -> None:
        """Write this learner's shards of the weights and the optimizer state into ``directory`` (torch distributed
        checkpoint; every learner at once), and, from learner 0, the world size (``write_shards_info``)."""
        module = self.module[DEFAULT_MODULE_ID].unwrapped()
        save_sharded(module.model, self._the_optimizer(), directory)
        if dist.get_rank() == 0:
            write_shards_info(directory, self._world)

    def load_shards(self, directory: str) -> None:
        """Read this learner's shards from what :meth:`save_shards` wrote, at the same world size (every learner at
        once; ``TreeGRPOLearnerGroup.restore_from_path`` checks the world size first)."""
        module = self.module[DEFAULT_MODULE_ID].unwrapped()
        load_sharded(module.model, self._the_optimizer(), directory)

    def _the_optimizer(self) -> torch.optim.Optimizer:
        ((_, optimizer),) = self.get_optimizers_for_module(DEFAULT_MODULE_ID)
        return optimizer

    @override(TorchLearner)
    def set_state(self, state: StateDict) -> None:
        super().set_state(state)
        if OPTIMIZER_STEPS in state:
            self._optimizer_steps = int(state[OPTIMIZER_STEPS])

    @override(TorchLearner)
    def _get_optimizer_state(self) -> StateDict:
        """RLlib's optimizer state with CPU torch tensors instead of numpy arrays: numpy has no bfloat16, so
        RLlib's conversion fails for the AdamW moments of a bf16 model. Copies, so the state is a snapshot.
        (RLlib's ``_set_optimizer_state`` takes tensors as they are; AdamW casts them back to the parameters'
        dtype.)"""
        return {name: {"module_id": self._optimizer_name_to_module[name], "state": _cpu_copy(optimizer.state_dict())}
                for name, optimizer in self._named_optimizers.items()}
