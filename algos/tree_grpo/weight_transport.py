"""The weight sync from the learners to the env runners' engines, without a whole state dict on the way.

Each learner process packs its module's weights into buckets (:mod:`policies.weight_sync`: the compute dtype,
each tensor once, gathered one sharded parameter at a time) and the first learner puts every bucket in Ray's object
store itself as it is made (:func:`publish_weights`); the driver passes only the specs and the buckets' refs to the
runners (no copy of the weights in the driver, a remote learner's included), and each runner gets the buckets
(zero-copy numpy views of the store) and copies them into its module in place. A learner and an env runner in one
process (the driver's own runner with the local learner) copy tensor to tensor, without the object store
(:func:`sync_env_runners`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ray
import torch.distributed as dist
from ray.rllib.core import COMPONENT_METRICS_LOGGER, COMPONENT_OPTIMIZER, COMPONENT_RL_MODULE, DEFAULT_MODULE_ID
from ray.rllib.core.learner.learner import Learner
from ray.rllib.core.learner.learner_group import LearnerGroup
from ray.rllib.env.env_runner_group import EnvRunnerGroup
from ray.rllib.utils.actor_manager import RemoteCallResults
from ray.rllib.utils.metrics import WEIGHTS_SEQ_NO
from torch.distributed.tensor import DTensor

from policies.rl_module import LLMRLModule
from policies.weight_sync import Bucket, TensorSpec, engine_tensors


@dataclass(frozen=True)
class SyncedWeights:
    """One weight sync as it travels: the tensors' specs, the buckets (``data``: Ray refs of uint8 arrays) and
    the learner's weights sequence number."""

    specs: tuple[TensorSpec, ...]
    buckets: tuple[Bucket, ...]
    seq_no: int


def learner_module(learner: Learner) -> LLMRLModule:
    """The learner's policy module, unwrapped from a DDP (or other) wrapper."""
    module = learner.module[DEFAULT_MODULE_ID]
    return module.unwrapped() if hasattr(module, "unwrapped") else module


def weights_seq_no(learner: Learner) -> int:
    """The sequence number of the learner's current weights (RLlib counts its updates)."""
    return learner.get_state(not_components=[COMPONENT_RL_MODULE, COMPONENT_OPTIMIZER,
                                             COMPONENT_METRICS_LOGGER])[WEIGHTS_SEQ_NO]


def publish_weights(learner: Learner) -> SyncedWeights | None:
    """Runs in every learner process (all of them: gathering a sharded parameter is a collective). The first
    learner puts each bucket in the object store as it is made and returns the :class:`SyncedWeights`; the
    others return None (replicas skip the packing, shards join every gather)."""
    module = learner_module(learner)
    if not dist.is_initialized() or dist.get_rank() == 0:
        return put_weights(module, weights_seq_no(learner))
    if any(isinstance(p, DTensor) for p in module.parameters()):
        for _ in engine_tensors(module.model, module.precision.compute):  # the gathers, in step with the first's
            pass
    return None


def put_weights(module: LLMRLModule, seq_no: int) -> SyncedWeights:
    """``module``'s weight-sync buckets put in the object store one by one as they are made (each bucket's
    array freed once stored), as :class:`SyncedWeights` with sequence number ``seq_no``."""
    buckets = tuple(Bucket(bucket.pieces, ray.put(bucket.data)) for bucket in module.sync_buckets())
    return SyncedWeights(module.sync_specs(), buckets, seq_no)


def receive_weights(module: LLMRLModule, weights: SyncedWeights) -> None:
    """Get the buckets of ``weights`` from the object store and copy them into ``module`` in place."""
    arrays = ray.get([bucket.data for bucket in weights.buckets])
    module.load_synced(weights.specs, (Bucket(bucket.pieces, array)
                                       for bucket, array in zip(weights.buckets, arrays, strict=True)))


def learner_results(results: RemoteCallResults) -> list[Any]:
    """The values of a ``foreach_learner`` call; the first learner's error raised."""
    for result in results.result_or_errors:
        if not result.ok:
            raise result.get()
    return [result.get() for result in results.result_or_errors]


def colocated(learner_group: LearnerGroup, env_runner_group: EnvRunnerGroup) -> bool:
    """Whether the learner and the only env runner live in this process (the local learner, no remote runners)."""
    return learner_group.is_local and env_runner_group.num_remote_env_runners() == 0


def learner_seq_no(learner_group: LearnerGroup) -> int:
    """The sequence number of the learners' current weights (the first learner's; they step together)."""
    return learner_results(learner_group.foreach_learner(weights_seq_no))[0]


def published_weights(learner_group: LearnerGroup) -> SyncedWeights:
    """The learners' current weights packed into the object store (:func:`publish_weights` in every learner
    process), as the first learner's :class:`SyncedWeights`: what :func:`deliver_weights` hands the runners."""
    (weights,) = [weights for weights in learner_results(learner_group.foreach_learner(publish_weights))
                  if weights is not None]
    return weights


def deliver_weights(weights: SyncedWeights, env_runner_group: EnvRunnerGroup,
                    to_worker_indices: list[int] | None = None) -> None:
    """``weights`` into the env runners (``to_worker_indices``: those remote runners only; default every runner, the
    driver's own included); waits until every runner has them. A runner busy with a call loads them when that call
    returns (a runner's calls run in turn), never in the middle of it. A runner that fails is left to RLlib's fault
    tolerance (restored with the current weights later)."""
    state = {COMPONENT_RL_MODULE: weights, WEIGHTS_SEQ_NO: weights.seq_no}
    remote = env_runner_group.num_remote_env_runners() > 0
    env_runner_group.foreach_env_runner(lambda runner: runner.set_state(state), local_env_runner=not remote,
                                        remote_worker_ids=to_worker_indices if remote else None)


def sync_env_runners(learner_group: LearnerGroup, env_runner_group: EnvRunnerGroup,
                     to_worker_indices: list[int] | None = None) -> None:
    """The learner's current weights into the env runners (``to_worker_indices`` as in :func:`deliver_weights`):
    tensor to tensor when the learner and the only runner share this process, else through the object store."""
    if colocated(learner_group, env_runner_group):
        runner = env_runner_group.local_env_runner
        learner_group.foreach_learner(lambda learner: runner.copy_weights_from(learner_module(learner),
                                                                               weights_seq_no(learner)))
        return
    deliver_weights(published_weights(learner_group), env_runner_group, to_worker_indices)
