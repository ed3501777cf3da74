"""Leaf records, per-prompt advantages and the padded batch."""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest

from algos.advantages import tree_grpo_advantages
from algos.batch import (
    ADVANTAGES,
    ATTENTION_MASK,
    INPUT_IDS,
    PROMPT_INDEX,
    SAMPLING_LOGPROBS,
    LeafRecord,
    budget_chunks,
    leaf_records,
    micro_batch_slices,
    minibatch_slices,
    pad_batch,
    prompt_advantages,
    prompt_group_chunks,
)
from algos.tree import Node, Tree
from policies.generation import StepOutput
from policies.logprobs import GENERATED_MASK
from policies.trajectory import TokenTrajectory


def record(prompt: int, tree: int, reward: float, ids=(1, 2), step=(3,)) -> LeafRecord:
    out = StepOutput(tuple(step), tuple(-0.5 for _ in step), "stop", None)
    trajectory = TokenTrajectory.from_prompt(tuple(ids)).with_step(out).with_observation((9,))
    return LeafRecord(prompt, tree, 1, trajectory, reward)


def test_advantages_are_per_prompt():
    records = [record(7, 0, 1.0), record(7, 0, 0.0), record(7, 1, 0.2), record(3, 0, 1.0), record(3, 1, 0.0)]
    got = prompt_advantages(records, mode="tree")
    np.testing.assert_allclose(got[:3], tree_grpo_advantages([1.0, 0.0, 0.2], [0, 0, 1]))
    np.testing.assert_allclose(got[3:], tree_grpo_advantages([1.0, 0.0], [0, 1]))
    # a prompt alone is unaffected by the others in the batch
    np.testing.assert_allclose(prompt_advantages(records[3:]), got[3:])


def test_pad_batch_layout():
    records = [record(0, 0, 1.0, ids=(1, 2, 3, 4), step=(5, 6)), record(0, 1, 0.0, ids=(1,), step=(8,))]
    batch = pad_batch(records, np.array([0.5, -0.5]), pad_id=0)
    assert batch[INPUT_IDS].tolist() == [[1, 2, 3, 4, 5, 6, 9], [1, 8, 9, 0, 0, 0, 0]]
    assert batch[ATTENTION_MASK].tolist() == [[1] * 7, [1, 1, 1, 0, 0, 0, 0]]
    assert batch[GENERATED_MASK].tolist() == [[0, 0, 0, 0, 1, 1, 0], [0, 1, 0, 0, 0, 0, 0]]
    assert batch[SAMPLING_LOGPROBS][0].tolist() == [0, 0, 0, 0, -0.5, -0.5, 0]
    assert batch[ADVANTAGES].tolist() == [0.5, -0.5] and batch[INPUT_IDS].dtype == np.int64


def test_leaf_records_from_a_tree():
    empty = TokenTrajectory.from_prompt((1,))
    root = Node(empty, None)
    mid = root.add_child(Node(empty, None))
    mid.add_child(Node(empty, None, reward=1.0, is_leaf=True, info={"em": 1.0}))
    root.add_child(Node(empty, None, reward=0.2, is_leaf=True))
    records = leaf_records([Tree(root, prompt_index=4, tree_id=1)])
    assert [(r.prompt_index, r.tree_id, r.depth, r.reward) for r in records] == [(4, 1, 2, 1.0), (4, 1, 1, 0.2)]
    assert records[0].info == {"em": 1.0}


def test_unknown_mode_is_named():
    with pytest.raises(ValueError, match="mode"):
        prompt_advantages([record(0, 0, 1.0)], mode="nope")


def test_minibatch_slices_keep_prompt_groups_whole():
    prompts = np.array([7, 7, 7, 3, 3, 3, 9, 9, 9, 5, 5, 5])
    assert minibatch_slices(prompts, 2) == [slice(0, 6), slice(6, 12)]
    assert minibatch_slices(prompts, 3) == [slice(0, 6), slice(6, 9), slice(9, 12)]  # 4 groups: 2 + 1 + 1
    assert minibatch_slices(prompts, 1) == [slice(0, 12)]


def test_minibatch_slices_split_rows_when_groups_are_too_few():
    assert minibatch_slices(np.array([1, 1, 1, 1, 2]), 3) == [slice(0, 2), slice(2, 4), slice(4, 5)]
    with pytest.raises(ValueError, match="cannot split 2 rows into 3"):
        minibatch_slices(np.array([1, 2]), 3)


def test_budget_chunks_close_before_the_unit_that_overflows():
    # units at rows 0, 2, 3, 6 of 8 rows, costing 5, 4, 9, 1
    assert budget_chunks([0, 2, 3, 6], [5, 4, 9, 1], 8, 10) == [slice(0, 3), slice(3, 8)]
    assert budget_chunks([0, 2, 3, 6], [5, 4, 9, 1], 8, 8) == [slice(0, 2), slice(2, 3), slice(3, 6), slice(6, 8)]
    assert budget_chunks([0, 2, 3, 6], [5, 4, 9, 1], 8, 3) == [slice(0, 2), slice(2, 3), slice(3, 6), slice(6, 8)]
    assert budget_chunks([0, 2, 3, 6], [5, 4, 9, 1], 8, 19) == [slice(0, 8)]


def test_micro_batches_by_tokens_count_a_groups_unique_tokens_or_a_rows_real_tokens():
    # prompt 1: rows [1 2 3 4] and [1 2 5] share 2 tokens (5 unique of 7); prompt 2: [6 7] and [8] (3 of 3)
    ids = np.array([[1, 2, 3, 4], [1, 2, 5, 0], [6, 7, 0, 0], [8, 0, 0, 0]])
    batch = {INPUT_IDS: ids, ATTENTION_MASK: (ids > 0).astype(np.int64), PROMPT_INDEX: np.array([1, 1, 2, 2])}
    by_tokens = partial(micro_batch_slices, batch, max_rows=1)
    assert by_tokens(share_prefixes=True, max_tokens=8) == [slice(0, 4)]  # 5 + 3
    assert by_tokens(share_prefixes=True, max_tokens=7) == [slice(0, 2), slice(2, 4)]
    assert by_tokens(share_prefixes=True, max_tokens=2) == [slice(0, 2), slice(2, 4)]  # each group whole
    assert by_tokens(share_prefixes=False, max_tokens=5) == [slice(0, 1), slice(1, 3), slice(3, 4)]  # 4 | 3 + 2 | 1
    assert by_tokens(share_prefixes=False, max_tokens=10) == [slice(0, 4)]
    assert by_tokens(share_prefixes=False, max_tokens=None) == [slice(b, b + 1) for b in range(4)]  # max_rows
    assert micro_batch_slices(batch, share_prefixes=True, max_rows=1) == [slice(0, 2), slice(2, 4)]


def test_prompt_group_chunks_keep_groups_whole_within_the_row_budget():
    prompts = np.array([1, 1, 1, 2, 2, 2, 3, 3, 4])
    assert prompt_group_chunks(prompts, 4) == [slice(0, 3), slice(3, 6), slice(6, 9)]
    assert prompt_group_chunks(prompts, 6) == [slice(0, 6), slice(6, 9)]
    assert prompt_group_chunks(prompts, 100) == [slice(0, 9)]
    assert prompt_group_chunks(np.array([5] * 7 + [6]), 2) == [slice(0, 7), slice(7, 8)]  # a big group alone
