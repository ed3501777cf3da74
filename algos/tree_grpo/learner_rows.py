"""How the learner cuts an update's batch (this learner's shard of it) into the pieces its passes run: the rows of
each PPO mini-batch, one micro-batch's columns with its packing, and the stand-in micro-batch of a learner that has
no rows where the others have some (its passes are the collectives they wait for)."""

from __future__ import annotations

import itertools

import numpy as np
import torch

from algos.batch import ATTENTION_MASK, MINI_BATCH, PROMPT_INDEX, minibatch_slices
from policies.logprobs import GENERATED_MASK, PACKING, PackedRows

OLD, REF, TIS = "old_logprobs", "ref_logprobs", "tis_weights"  # columns the update adds to its batch
ROWS = "rows"  # a micro-batch's (start, stop) in its update's batch: the same rows in every pass


def mini_batch_rows(data: dict[str, torch.Tensor], mini_batches: int, world: int) -> list[slice]:
    """The rows of each of the ``mini_batches`` PPO mini-batches in ``data``: from its ``MINI_BATCH`` column
    (``learner_shards``; a mini-batch can have no rows here), else cut from ``data`` itself (one learner only: the
    learners' cuts of their shards would not make the whole batch's mini-batches)."""
    if MINI_BATCH not in data:
        if world > 1:
            raise ValueError(f"{world} learners need the batch laid out by learner_shards (its {MINI_BATCH!r} "
                             f"column), so that their mini-batches make the whole batch's")
        return minibatch_slices(data[PROMPT_INDEX].cpu().numpy(), mini_batches)
    tags = data[MINI_BATCH].cpu().numpy()
    if len(tags) and not (np.all(np.diff(tags) >= 0) and tags[0] >= 0 and tags[-1] < mini_batches):
        raise ValueError(f"the {MINI_BATCH!r} column must not decrease and lie in 0..ppo_mini_batches - 1 "
                         f"({mini_batches - 1}), as learner_shards lays out a batch for this learner count; got "
                         f"{tags.tolist()}")
    bounds = np.searchsorted(tags, np.arange(mini_batches + 1))
    return [slice(int(a), int(b)) for a, b in itertools.pairwise(bounds)]


def micro_batch(data: dict[str, torch.Tensor], piece: slice, packings: dict[tuple[int, int], PackedRows]) -> dict:
    """The micro-batch ``piece`` of ``data`` (its rows under ``ROWS``), with its packing when there is one."""
    part = {k: v[piece] for k, v in data.items()}
    part[ROWS] = (piece.start, piece.stop)
    if (piece.start, piece.stop) in packings:
        part[PACKING] = packings[piece.start, piece.stop]
    return part


def stand_in(data: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A stand-in micro-batch for a learner without rows in a mini-batch (or, sharded, with fewer micro-batches than
    another learner), with ``data``'s columns: one row of two tokens, the second counted as generated so that the
    loss has a graph through every weight (the step multiplies it by 0). Its forward and backward passes are the
    collectives (DDP's buffer broadcast and gradient all-reduce; FSDP's gathers and gradient reductions) the other
    learners wait for."""
    part = {key: torch.zeros((1, 2) if value.dim() == 2 else (1, *value.shape[1:]), dtype=value.dtype,
                             device=value.device) for key, value in data.items()}
    part[ATTENTION_MASK] = torch.ones_like(part[ATTENTION_MASK])
    part[GENERATED_MASK][0, 1] = 1
    if TIS in part:
        part[TIS] = torch.ones_like(part[TIS])
    return part
