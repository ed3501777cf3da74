"""From grown trees to a training batch: one record per leaf, advantages per prompt, padded arrays.

Advantages are computed per prompt here, before any sharding (a learner group splits a batch by rows, which
would split prompt groups). Array names avoid RLlib's reserved ``loss_mask`` (the learner indexes with it as
a boolean when a ``weights_seq_no`` column is present).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from algos.advantages import tree_grpo_advantages
from algos.tree import Tree
from policies.logprobs import GENERATED_MASK
from policies.prefix_packing import build_prefix_trie
from policies.trajectory import TokenTrajectory

INPUT_IDS, ATTENTION_MASK = "input_ids", "attention_mask"
SAMPLING_LOGPROBS, ADVANTAGES = "sampling_logprobs", "advantages"
PROMPT_INDEX = "prompt_index"  # [B]: the prompt a row grew from (PPO mini-batches keep prompt groups whole)
MINI_BATCH = "mini_batch"  # [B]: the mini-batch (optimizer step of an epoch) of each row (learner_shards)


@dataclass(frozen=True)
class LeafRecord:
    """One root-to-leaf trajectory: which prompt and tree it grew in, its tokens, reward and final info."""

    prompt_index: int
    tree_id: int
    depth: int
    trajectory: TokenTrajectory
    reward: float
    info: dict[str, Any] = field(default_factory=dict)


def leaf_records(trees: Sequence[Tree]) -> list[LeafRecord]:
    """Every leaf of every tree, in tree order."""
    return [LeafRecord(tree.prompt_index, tree.tree_id, leaf.depth, leaf.trajectory, leaf.reward, leaf.info)
            for tree in trees for leaf in tree.leaves()]


def prompt_advantages(records: Sequence[LeafRecord], mode: str = "tree", eps: float = 1e-6) -> np.ndarray:
    """One advantage per record, normalised within each prompt's leaves (``tree_grpo_advantages``)."""
    groups: dict[int, list[int]] = defaultdict(list)
    for i, record in enumerate(records):
        groups[record.prompt_index].append(i)
    advantages = np.zeros(len(records), dtype=np.float64)
    for members in groups.values():
        rewards = [records[i].reward for i in members]
        trees = [records[i].tree_id for i in members]
        advantages[members] = tree_grpo_advantages(rewards, trees, mode=mode, eps=eps)
    return advantages


def pad_batch(records: Sequence[LeafRecord], advantages: np.ndarray, pad_id: int) -> dict[str, np.ndarray]:
    """Right-padded arrays: ids, attention and generated-token masks, sampling log-probs [B, T]; advantages and
    prompt indices [B]."""
    width = max(len(r.trajectory) for r in records)
    batch = {
        INPUT_IDS: np.full((len(records), width), pad_id, dtype=np.int64),
        ATTENTION_MASK: np.zeros((len(records), width), dtype=np.int64),
        GENERATED_MASK: np.zeros((len(records), width), dtype=np.float32),
        SAMPLING_LOGPROBS: np.zeros((len(records), width), dtype=np.float32),
    }
    for row, record in enumerate(records):
        n = len(record.trajectory)
        batch[INPUT_IDS][row, :n] = record.trajectory.token_ids
        batch[ATTENTION_MASK][row, :n] = 1
        batch[GENERATED_MASK][row, :n] = record.trajectory.generated_mask
        batch[SAMPLING_LOGPROBS][row, :n] = record.trajectory.sampling_logprobs
    batch[ADVANTAGES] = np.asarray(advantages, dtype=np.float32)
    batch[PROMPT_INDEX] = np.asarray([r.prompt_index for r in records], dtype=np.int64)
    return batch


def prompt_group_starts(prompt_index: np.ndarray) -> np.ndarray:
    """The first row of each prompt group of a batch whose prompt groups are contiguous."""
    return np.flatnonzero(np.r_[True, prompt_index[1:] != prompt_index[:-1]])


def minibatch_slices(prompt_index: np.ndarray, count: int) -> list[slice]:
    """``count`` contiguous, non-empty row ranges covering a batch whose prompt groups are contiguous.

    The prompt groups are split as evenly as possible, never cutting one; when there are fewer groups than
    ``count`` (a learner's shard of a batch can hold a cut group), the rows are split evenly instead, so that
    every learner makes the same number of optimizer steps.
    """
    rows = len(prompt_index)
    if not 1 <= count <= rows:
        raise ValueError(f"cannot split {rows} rows into {count} non-empty mini-batches")
    group_starts = prompt_group_starts(prompt_index)
    units = group_starts if len(group_starts) >= count else np.arange(rows)
    starts = [int(units[part[0]]) for part in np.array_split(np.arange(len(units)), count)]
    return [slice(a, b) for a, b in zip(starts, [*starts[1:], rows], strict=True)]


def budget_chunks(unit_starts: Sequence[int], unit_costs: Sequence[float], rows: int, budget: float) -> list[slice]:
    """Contiguous row ranges of whole units (unit i: rows ``unit_starts[i]`` up to the next unit's start, the
    last up to ``rows``; the first starts at row 0), each taking units in turn while their summed cost stays
    within ``budget``; a unit that alone costs more forms a range alone."""
    chunks, start, total = [], 0, 0.0
    for unit_start, cost in zip(unit_starts, unit_costs, strict=True):
        if total + cost > budget and unit_start > start:  # this unit would overflow: close the chunk
            chunks.append(slice(start, int(unit_start)))
            start, total = int(unit_start), 0.0
        total += cost
    chunks.append(slice(start, rows))
    return chunks


def prompt_group_chunks(prompt_index: np.ndarray, max_rows: int) -> list[slice]:
    """Contiguous row ranges of whole prompt groups, each at most ``max_rows`` rows unless a single group is
    larger (it then forms a range alone): the micro-batches of shared-prefix training, in which the rows of a
    prompt must meet to share their prompt and steps."""
    starts = prompt_group_starts(prompt_index)
    return budget_chunks(starts, np.diff([*starts, len(prompt_index)]), len(prompt_index), max_rows)


def micro_batch_slices(batch: dict[str, np.ndarray], *, share_prefixes: bool, max_rows: int,
                       max_tokens: int | None = None) -> list[slice]:
    """The micro-batches of ``batch`` (``INPUT_IDS``, ``ATTENTION_MASK``, ``PROMPT_INDEX`` as numpy arrays):
    contiguous row ranges of whole prompt groups with ``share_prefixes`` (the rows of a prompt must meet to share
    it), of any rows otherwise; ``max_rows`` rows each, or with ``max_tokens`` as many as fit that many decoder
    tokens: a prompt group counts the unique tokens of its trie (what the shared-prefix forward computes of it), a
    row its real tokens. A group or row that alone exceeds the budget forms a micro-batch alone."""
    rows, mask = len(batch[INPUT_IDS]), batch[ATTENTION_MASK]
    starts = prompt_group_starts(batch[PROMPT_INDEX]) if share_prefixes else np.arange(rows)
    if max_tokens is None:
        return budget_chunks(starts, np.diff([*starts, rows]), rows, max_rows)
    if share_prefixes:
        spans = zip(starts, [*starts[1:], rows], strict=True)
        costs = [build_prefix_trie(batch[INPUT_IDS][a:b], mask[a:b]).num_nodes for a, b in spans]
    else:
        costs = mask.sum(axis=1)
    return budget_chunks(starts, costs, rows, max_tokens)


def learner_shards(batch: dict[str, np.ndarray], mini_batches: int, learners: int) -> dict[str, np.ndarray]:
    """The iteration's ``batch`` (contiguous prompt groups) laid out for ``learners`` learners and ``mini_batches``
    optimizer steps per epoch: the mini-batches are cut from the whole batch (``minibatch_slices``: whole prompt
    groups), then the rows are reordered so that each learner's block of rows, as RLlib's learner group cuts the
    batch (``ShardBatchIterator``: learner i gets rows ``[i c, (i + 1) c)`` with ``c = ceil(B / learners)``), holds
    a contiguous part of every mini-batch, in proportion to the rows left for it; the ``MINI_BATCH`` column tags
    each row's mini-batch. A part can be empty (a mini-batch with fewer rows than learners, fewer rows than
    learners): that learner's step runs on a stand-in row. With one learner the rows keep their order.

    A prompt group is cut at most where a mini-batch's part ends: the learner's token-mean is over the whole
    mini-batch whatever the cut, which only costs prefix sharing across the cut."""
    rows = len(batch[PROMPT_INDEX])
    minis = minibatch_slices(np.asarray(batch[PROMPT_INDEX]), mini_batches)
    block = -(-rows // learners)
    left = [max(0, min(block, rows - block * i)) for i in range(learners)]  # rows each learner's block still takes
    parts: list[list[np.ndarray]] = [[] for _ in range(learners)]  # per learner, per mini-batch: its rows
    for mini in minis:
        size, total = mini.stop - mini.start, sum(left)
        exact = [size * n / total for n in left]  # proportional shares; size <= total, so floor(share) <= left
        counts = [math.floor(x) for x in exact]
        for i in sorted(range(learners), key=lambda i: counts[i] - exact[i])[:size - sum(counts)]:
            counts[i] += 1  # the largest remainders (a positive remainder means floor(share) < left)
        start = mini.start
        for i, count in enumerate(counts):
            parts[i].append(np.arange(start, start + count))
            start += count
            left[i] -= count
    order = np.concatenate([rows_ for learner in parts for rows_ in learner]).astype(np.int64)
    tags = np.concatenate([np.full(len(rows_), k, dtype=np.int64) for learner in parts
                           for k, rows_ in enumerate(learner)])
    return {**{key: np.asarray(value)[order] for key, value in batch.items()}, MINI_BATCH: tags}
