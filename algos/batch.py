"""From grown trees to a training batch: one record per leaf, advantages per prompt, padded arrays.

Advantages are computed per prompt here, before any sharding (a learner group splits a batch by rows, which
would split prompt groups). Array names avoid RLlib's reserved ``loss_mask`` (the learner indexes with it as
a boolean when a ``weights_seq_no`` column is present).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from algos.advantages import tree_grpo_advantages
from algos.tree import Tree
from policies.trajectory import TokenTrajectory

INPUT_IDS, ATTENTION_MASK, GENERATED_MASK = "input_ids", "attention_mask", "generated_mask"
SAMPLING_LOGPROBS, ADVANTAGES, REWARDS = "sampling_logprobs", "advantages", "rewards"


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
    rewards [B]."""
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
    batch[REWARDS] = np.asarray([r.reward for r in records], dtype=np.float32)
    return batch
