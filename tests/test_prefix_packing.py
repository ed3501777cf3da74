"""Shared-prefix packing: the trie of a batch's rows (hand-computed and against a brute-force trie), and the
packed forward of the LLM RLModule, whose log-probs, entropies and gradients equal the per-row forward's."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import policies.logprobs as logprobs
from policies.logprobs import (
    ENTROPY,
    GENERATED_MASK,
    LOGPROBS,
    PACKED_TOKENS,
    PACKING,
    REAL_TOKENS,
    UNIQUE_TOKENS,
    pack_rows,
)
from policies.prefix_packing import (
    NO_NODE,
    build_prefix_trie,
    choose_cuts,
    layout_segments,
    scored_predictions,
    segment_cost,
    segment_subtree_ends,
    tree_attention_mask,
    tree_block_mask,
)
from policies.rl_module import LLMRLModule
from tests.test_rl_module import build

# -- the trie ------------------------------------------------------------------------------------------------


def padded(rows: list[list[int]], *, pad: int = 0, left: bool = False) -> tuple[np.ndarray, np.ndarray]:
    width = max(map(len, rows))
    ids, mask = np.full((len(rows), width), pad), np.zeros((len(rows), width), dtype=np.int64)
    for b, row in enumerate(rows):
        span = slice(width - len(row), width) if left else slice(0, len(row))
        ids[b, span], mask[b, span] = row, 1
    return ids, mask


def test_hand_computed_trie():
    # Rows sorted: [5 6 7 8] < [5 6 7 8 4] < [5 6 9]; preorder nodes: 5 6 7 8 4 | 9
    trie = build_prefix_trie(*padded([[5, 6, 7, 8], [5, 6, 9], [5, 6, 7, 8, 4]]))
    np.testing.assert_array_equal(trie.token_ids, [5, 6, 7, 8, 4, 9])
    np.testing.assert_array_equal(trie.positions, [0, 1, 2, 3, 4, 2])
    np.testing.assert_array_equal(trie.parents, [-1, 0, 1, 2, 3, 1])
    np.testing.assert_array_equal(trie.subtree_ends, [6, 6, 5, 5, 5, 6])
    np.testing.assert_array_equal(trie.node_index, [[0, 1, 2, 3, -1], [0, 1, 5, -1, -1], [0, 1, 2, 3, 4]])
    assert (trie.num_nodes, trie.num_tokens) == (6, 12)
    expected_mask = torch.tensor([
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 0, 0],
        [1, 1, 1, 1, 1, 0],
        [1, 1, 0, 0, 0, 1],
    ], dtype=torch.bool)
    assert torch.equal(tree_attention_mask(torch.from_numpy(trie.subtree_ends)), expected_mask)  # one segment


def test_left_padding_gives_the_same_trie():
    rows = [[5, 6, 7, 8], [5, 6, 9], [5, 6, 7, 8, 4]]
    right, left = build_prefix_trie(*padded(rows)), build_prefix_trie(*padded(rows, left=True))
    for field in ("token_ids", "positions", "parents", "subtree_ends"):
        np.testing.assert_array_equal(getattr(left, field), getattr(right, field))
    np.testing.assert_array_equal(left.node_index[1], [-1, -1, 0, 1, 5])


def test_rows_that_share_nothing_and_an_empty_row():
    trie = build_prefix_trie(*padded([[1, 2], [3], [1, 2]]))
    assert (trie.num_nodes, trie.num_tokens) == (3, 5)
    empty = build_prefix_trie(np.zeros((2, 3), dtype=np.int64), np.zeros((2, 3), dtype=np.int64))
    assert empty.num_nodes == empty.num_tokens == 0 and (empty.node_index == -1).all()


def ancestors_or_self(parents: np.ndarray) -> np.ndarray:
    """Boolean [U, U] by walking the parent links (the definition the mask must meet)."""
    allowed = np.zeros((len(parents), len(parents)), dtype=bool)
    for node in range(len(parents)):
        up = node
        while up != -1:
            allowed[node, up] = True
            up = parents[up]
    return allowed


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), min_size=0, max_size=7), min_size=1, max_size=8), st.booleans())
def test_trie_matches_a_brute_force_trie(rows, left):
    """Small alphabet: rows share prefixes, repeat, and extend one another often."""
    ids, mask = padded([*rows, [0]], pad=9, left=left)  # one row keeps the batch non-empty
    trie = build_prefix_trie(ids, mask)
    prefixes = {}  # prefix tuple -> node, from every real (row, column)
    for b in range(len(ids)):
        real = np.nonzero(mask[b])[0]
        for depth, column in enumerate(real):
            node = trie.node_index[b, column]
            prefix = tuple(ids[b, real[:depth + 1]])
            assert prefixes.setdefault(prefix, node) == node  # same prefix, same node
            assert trie.token_ids[node] == ids[b, column] and trie.positions[node] == depth
            assert trie.parents[node] == (trie.node_index[b, real[depth - 1]] if depth else -1)
    assert trie.num_nodes == len(prefixes) == len(set(prefixes.values()))  # distinct prefixes, distinct nodes
    assert (trie.node_index[mask == 0] == -1).all()
    assert all(trie.parents[u] < u for u in range(trie.num_nodes))  # preorder: parents first
    mask_from_ends = tree_attention_mask(torch.from_numpy(trie.subtree_ends))
    np.testing.assert_array_equal(mask_from_ends.numpy(), ancestors_or_self(trie.parents))


def test_a_large_trie_maps_every_token_to_its_node():
    # 32 rows of up to 1000 tokens (its build time is benchmark matter, not a test's)
    rng = np.random.default_rng(0)
    ids = np.tile(rng.integers(0, 50_000, 1000), (32, 1))
    cuts = rng.integers(100, 1000, 32)
    for b, cut in enumerate(cuts):  # rows branch off a shared prefix of 100+ tokens at random points
        ids[b, cut:] = rng.integers(0, 50_000, 1000 - cut)
    mask = np.arange(1000)[None, :] < rng.integers(500, 1001, (32, 1))
    trie = build_prefix_trie(ids, mask)
    real = trie.node_index != -1
    np.testing.assert_array_equal(real, mask)
    np.testing.assert_array_equal(trie.token_ids[trie.node_index[real]], ids[real])
    np.testing.assert_array_equal(trie.positions[trie.node_index[real]], np.nonzero(real)[1])  # depth = column
    assert trie.num_nodes < trie.num_tokens


# -- segments --------------------------------------------------------------------------------------------------


def test_hand_computed_segments():
    trie = build_prefix_trie(*padded([[5, 6, 7, 8], [5, 6, 9], [5, 6, 7, 8, 4]]))
    # Whole: 6 nodes; split at the branch node 1: [5 6 7 8 4] and [5 6 9], 5 + 3 nodes.
    assert choose_cuts(trie, pair_cost=0.0).tolist() == [NO_NODE]
    assert choose_cuts(trie, pair_cost=0.5).tolist() == [NO_NODE]  # 6 + 18 <= (5 + 12.5) + (3 + 4.5)
    cuts = choose_cuts(trie, pair_cost=2.0)  # 6 + 72 > (5 + 50) + (3 + 18)
    assert cuts.tolist() == [4, 5]
    layout = layout_segments(trie, cuts)
    np.testing.assert_array_equal(layout.node_ids, [[0, 1, 2, 3, 4], [0, 1, 5, -1, -1]])
    np.testing.assert_array_equal(layout.row_segments, [0, 1, 0])  # row 0 ends at node 3, inside segment 0
    np.testing.assert_array_equal(layout.slots, [[0, 1, 2, 3, 4, -1], [0, 1, -1, -1, -1, 2]])
    assert layout.num_tokens == 8
    expected_mask = torch.tensor([
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],
        [0, 0, 0, 1, 0],  # padding slots attend to themselves alone
        [0, 0, 0, 0, 1],
    ], dtype=torch.bool)
    slot_ends = segment_subtree_ends(trie, layout)
    np.testing.assert_array_equal(slot_ends, [[5, 5, 5, 5, 5], [3, 3, 3, 4, 5]])
    assert torch.equal(tree_attention_mask(torch.from_numpy(slot_ends))[1], expected_mask)
    # Scored: node 3 by rows 0 and 2, node 4 by row 2, node 9's node 5 by row 1.
    predictions = scored_predictions(trie, layout, np.array([0, 2, 2, 1]), np.array([3, 3, 4, 2]))
    np.testing.assert_array_equal(predictions.slots, [2, 3, 5 + 1])  # parents 2, 3 (segment 0), 1 (segment 1)
    np.testing.assert_array_equal(predictions.targets, [8, 4, 9])
    np.testing.assert_array_equal(predictions.inverse, [0, 0, 1, 2])


def test_a_row_that_stops_at_a_branch_point_reads_from_a_segment_below_it():
    trie = build_prefix_trie(*padded([[1, 2, 3, 3, 3, 3], [1, 2], [1, 2, 4, 4, 4, 4]]))
    cuts = choose_cuts(trie, pair_cost=1.0)  # 10 + 100 > 2 * (6 + 36)
    assert cuts.tolist() == [5, 9]  # the leaves; row 1 ends at node 1, an ancestor of both
    np.testing.assert_array_equal(layout_segments(trie, cuts).row_segments, [0, 0, 1])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 2), min_size=0, max_size=7), min_size=1, max_size=8),
       st.sampled_from([0.0, 0.01, 0.1, 1.0, 100.0]))
def test_segments_hold_their_rows_and_cost_no_more_than_the_extremes(rows, pair_cost):
    trie = build_prefix_trie(*padded([*rows, [0]], pad=9))
    layout = layout_segments(trie, choose_cuts(trie, pair_cost))
    for b in range(trie.node_index.shape[0]):
        nodes = trie.node_index[b][trie.node_index[b] != NO_NODE]
        assert (layout.slots[layout.row_segments[b], nodes] != NO_NODE).all()
    for nodes in layout.node_ids:
        nodes = nodes[nodes != NO_NODE]
        assert (np.diff(nodes) > 0).all()  # preorder
        parents = trie.parents[nodes]
        assert np.isin(parents[parents != NO_NODE], nodes).all()  # closed under ancestors
    sizes = (layout.node_ids != NO_NODE).sum(axis=1)
    chosen = segment_cost(sizes, pair_cost).sum()
    leaves = np.nonzero(np.bincount(trie.parents[trie.parents != NO_NODE], minlength=trie.num_nodes) == 0)[0]
    one_per_leaf = segment_cost(trie.positions[leaves] + 1, pair_cost).sum()
    assert chosen <= min(segment_cost(trie.num_nodes, pair_cost), one_per_leaf) + 1e-9


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 2), min_size=0, max_size=7), min_size=1, max_size=8),
       st.sampled_from([0.0, 0.1, 100.0]))
def test_the_slot_mask_of_each_segment_is_its_ancestry(rows, pair_cost):
    trie = build_prefix_trie(*padded([*rows, [0]], pad=9))
    layout = layout_segments(trie, choose_cuts(trie, pair_cost))
    masks = tree_attention_mask(torch.from_numpy(segment_subtree_ends(trie, layout))).numpy()
    ancestry = ancestors_or_self(trie.parents)
    for nodes, mask in zip(layout.node_ids, masks, strict=True):
        real = nodes != NO_NODE
        expected = ancestry[np.ix_(nodes.clip(min=0), nodes.clip(min=0))] & real[:, None] & real[None, :]
        expected |= np.eye(len(nodes), dtype=bool) & ~real[:, None]  # padding slots: themselves alone
        np.testing.assert_array_equal(mask, expected)


def test_the_block_mask_skips_exactly_the_blocks_without_a_visible_pair():
    """Segments of several 128-slot blocks: the block mask's blocks are those holding a visible pair, its full
    blocks those where every pair is visible, and its mask function is the tree mask."""
    rng = np.random.default_rng(1)
    ids = np.tile(rng.integers(0, 1000, 700), (12, 1))
    for b, cut in enumerate(rng.integers(50, 700, 12)):  # rows branch off a shared prefix at random points
        ids[b, cut:] = rng.integers(0, 1000, 700 - cut)
    trie = build_prefix_trie(ids, np.arange(700)[None, :] < rng.integers(400, 701, (12, 1)))
    layout = layout_segments(trie, choose_cuts(trie, pair_cost=1e-3))
    slot_ends = torch.from_numpy(segment_subtree_ends(trie, layout))
    dense = tree_attention_mask(slot_ends)
    n_segments, width = slot_ends.shape
    assert n_segments > 1 and width > 2 * 128
    block_mask = tree_block_mask(slot_ends)
    blocks = -(-width // 128)
    padded_dense = torch.zeros((n_segments, blocks * 128, blocks * 128), dtype=torch.bool)
    padded_dense[:, :width, :width] = dense
    per_block = padded_dense.view(n_segments, blocks, 128, blocks, 128)
    any_visible, all_visible = per_block.any(dim=(2, 4)), per_block.all(dim=(2, 4))
    assert 0 < int(any_visible.sum()) < any_visible.numel()  # some blocks are skipped
    assert torch.equal(block_mask.to_dense()[:, 0].bool(), any_visible)
    full = torch.zeros_like(any_visible)
    for segment in range(n_segments):
        for row in range(blocks):
            count = int(block_mask.full_kv_num_blocks[segment, 0, row])
            full[segment, row, block_mask.full_kv_indices[segment, 0, row, :count]] = True
    assert full.any() and torch.equal(full[:, :-1, :-1], all_visible[:, :-1, :-1])  # the last: cut by the width
    queries, keys = torch.meshgrid(torch.arange(width), torch.arange(width), indexing="ij")
    for segment in range(n_segments):
        assert torch.equal(block_mask.mask_mod(segment, 0, queries, keys), dense[segment])


# -- the packed forward equals the per-row forward -----------------------------------------------------------


@pytest.fixture(scope="module")
def module() -> LLMRLModule:
    return build(logprob_chunk=24)  # small chunks (of positions, whatever the rows): several head chunks on both paths


@pytest.fixture(params=["model's", "one segment", "a segment per leaf"])
def segments(request, monkeypatch) -> str:
    """The packed forward under the model's cost model and under both extremes of it."""
    pair_cost = {"one segment": 0.0, "a segment per leaf": 1e6}.get(request.param)
    if pair_cost is not None:
        monkeypatch.setattr(logprobs, "attention_pair_cost", lambda config: pair_cost)
    return request.param


def grow(rng: np.random.Generator, tokens: list[int], generated: list[int], depth: int
         ) -> list[tuple[list[int], list[int]]]:
    """The leaves below a node: 1-3 children per level, each a generated step and an observation (not
    generated); subtrees end at different depths. Tokens from a small range so that sibling steps sometimes
    start alike (and share nodes)."""
    if depth == 0:
        return [(tokens, generated)]
    leaves = []
    for _ in range(rng.integers(1, 4)):
        step, observation = rng.integers(10, 40, rng.integers(1, 6)), rng.integers(10, 40, rng.integers(0, 4))
        leaves += grow(rng, [*tokens, *step, *observation], generated + [1] * len(step) + [0] * len(observation),
                       int(rng.integers(0, depth)))
    return leaves


def tree_batch(seed: int, pad: int) -> dict[str, torch.Tensor]:
    """Rows of 2-3 prompts' trees under a shared system prefix, plus a duplicate row and a strict prefix of a
    row, shuffled and right-padded."""
    rng = np.random.default_rng(seed)
    system = [*rng.integers(100, 200, 6)]
    rows = []
    for _ in range(rng.integers(2, 4)):
        prompt = [*system, *rng.integers(200, 300, rng.integers(2, 8))]
        rows += grow(rng, prompt, [0] * len(prompt), depth=3)
    tokens, generated = rows[0]
    cut = len(tokens) - 2
    rows += [rows[-1], (tokens[:cut], generated[:cut])]
    rows = [rows[i] for i in rng.permutation(len(rows))]
    ids, mask = padded([row for row, _ in rows], pad=pad)
    generated_mask = np.zeros(ids.shape, dtype=np.float32)
    for b, (_, flags) in enumerate(rows):
        generated_mask[b, :len(flags)] = flags
    return {"input_ids": torch.from_numpy(ids), "attention_mask": torch.from_numpy(mask),
            GENERATED_MASK: torch.from_numpy(generated_mask)}


@dataclass(frozen=True)
class Tolerance:
    """How close the packed forward must come to the per-row one. logprobs: absolute, on log-probs and
    entropies. grads: relative to each entry and, absolutely, to each gradient tensor's largest entry: an entry
    that is a sum of cancelling terms carries rounding noise of the tensor's scale (in fp32 the per-row forward
    of the same rows in another order differs from itself by ~5e-7 of the scale there; the packed one by
    ~2e-6). mean_grads: the mean deviation over the mean magnitude, per tensor (None: not checked)."""

    logprobs: float
    grads: float
    mean_grads: float | None = None


FP32 = Tolerance(logprobs=1e-5, grads=1e-5)
# bf16 (8 significant bits, 4e-3 relative rounding per operation) rounds in another order when a shared prefix is
# forwarded once: measured on these batches up to 3e-3 on log-probs and 1.5% of a tensor's largest gradient
# entry, 0.75% mean deviation; a wrong mask moves them by far more (the fp32 tests hold the exact semantics).
BF16 = Tolerance(logprobs=2e-2, grads=5e-2, mean_grads=2e-2)


def outputs_and_gradients(module: LLMRLModule, batch: dict[str, torch.Tensor], share: bool, seed: int,
                          temperature: float = 1.0) -> tuple[dict, dict[str, torch.Tensor]]:
    """Outputs, and the gradients of a randomly weighted sum of log-probs and entropies."""
    module.model.zero_grad()
    out = module.forward_train(batch, return_entropy=True, share_prefixes=share, temperature=temperature)
    weights = torch.rand((2, *batch["input_ids"].shape), generator=torch.Generator().manual_seed(seed))
    weights = weights.to(out[LOGPROBS].device)
    ((weights[0] * out[LOGPROBS]).sum() + (weights[1] * out[ENTROPY]).sum()).backward()
    grads = {name: p.grad.clone() for name, p in module.model.named_parameters() if p.requires_grad}
    module.model.zero_grad()
    return out, grads


def assert_same_outputs(packed: dict, per_row: dict, tolerance: Tolerance = FP32) -> None:
    for key in (LOGPROBS, ENTROPY):
        torch.testing.assert_close(packed[key], per_row[key], rtol=tolerance.logprobs, atol=tolerance.logprobs)
        assert (packed[key] == 0).equal(per_row[key] == 0)  # the same positions scored


def assert_packed_equals_per_row(module: LLMRLModule, batch: dict[str, torch.Tensor], seed: int, *,
                                 temperature: float = 1.0, tolerance: Tolerance = FP32) -> dict:
    per_row, per_row_grads = outputs_and_gradients(module, batch, share=False, seed=seed, temperature=temperature)
    packed, packed_grads = outputs_and_gradients(module, batch, share=True, seed=seed, temperature=temperature)
    assert_same_outputs(packed, per_row, tolerance)
    assert packed_grads.keys() == per_row_grads.keys()
    for name, grad in per_row_grads.items():
        scale = grad.abs().max().item()
        assert scale > 0, name
        torch.testing.assert_close(packed_grads[name], grad, rtol=tolerance.grads, atol=tolerance.grads * scale,
                                   msg=lambda detail, name=name: f"{name}: {detail}")
        if tolerance.mean_grads is not None:
            deviation = (packed_grads[name] - grad).abs().float().mean() / grad.abs().float().mean()
            assert deviation <= tolerance.mean_grads, (name, deviation.item())
    return packed


@pytest.mark.parametrize("seed, temperature", [(0, 1.0), (1, 0.7), (2, 1.0), (3, 1.3)])
def test_packed_forward_equals_per_row(module, segments, seed, temperature):
    batch = tree_batch(seed, module.tokenizer.pad_token_id)
    packed = assert_packed_equals_per_row(module, batch, seed, temperature=temperature)
    trie = build_prefix_trie(batch["input_ids"].numpy(), batch["attention_mask"].numpy())
    assert (packed[UNIQUE_TOKENS], packed[REAL_TOKENS]) == (trie.num_nodes, trie.num_tokens)
    assert packed[UNIQUE_TOKENS] <= packed[PACKED_TOKENS] < packed[REAL_TOKENS]
    if segments != "model's":  # which the model's cost model picks depends on the batch's size
        assert (packed[UNIQUE_TOKENS] == packed[PACKED_TOKENS]) == (segments == "one segment")


def test_packed_forward_in_bfloat16(segments):
    module = build(logprob_chunk=4, dtype="bfloat16")
    for seed in range(3):
        batch = tree_batch(seed, module.tokenizer.pad_token_id)
        assert_packed_equals_per_row(module, batch, seed, temperature=0.7, tolerance=BF16)


def test_packed_forward_without_a_generated_mask(module, segments):
    batch = tree_batch(7, module.tokenizer.pad_token_id)
    del batch[GENERATED_MASK]
    assert_packed_equals_per_row(module, batch, seed=7)


def test_packed_forward_with_eager_attention(segments):
    module = build(logprob_chunk=4)
    module.model.set_attn_implementation("eager")
    assert_packed_equals_per_row(module, tree_batch(3, module.tokenizer.pad_token_id), seed=3)


# -- flex_attention: the block mask ------------------------------------------------------------------------------
# torch 2.13 runs flex_attention's forward on the CPU (transformers compiles it: ~10 s the first time here, a few
# seconds per new shape) but has no CPU backward: the CPU checks outputs without gradients, CUDA gradients too.


def test_flex_attention_packed_forward_equals_per_row_without_gradients_on_the_cpu(monkeypatch):
    module = build(logprob_chunk=3)
    batch = tree_batch(3, module.tokenizer.pad_token_id)
    builds = []
    monkeypatch.setattr(logprobs, "tree_block_mask", lambda ends: builds.append(ends) or tree_block_mask(ends))
    for dtype, tolerance in ((torch.float32, FP32), (torch.bfloat16, BF16)):
        module.model.to(dtype).set_attn_implementation("sdpa")
        with torch.no_grad():
            per_row = module.forward_train(batch, return_entropy=True, temperature=0.7)
        module.model.set_attn_implementation("flex_attention")
        packed_batch = {**batch, PACKING: pack_rows(module.model, batch)}
        for _ in range(2):  # e.g. the old and the reference log-probs: one block mask for both
            with torch.no_grad():
                packed = module.forward_train(packed_batch, return_entropy=True, share_prefixes=True,
                                              temperature=0.7)
            assert_same_outputs(packed, per_row, tolerance)
    assert len(builds) == 2  # once per packing
    with pytest.raises(ValueError, match=r"flex_attention .* cannot backpropagate on the CPU"):
        module.forward_train(packed_batch, share_prefixes=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flex_attention backpropagates on CUDA (not on the CPU)")
@pytest.mark.parametrize("dtype, tolerance", [("float32", Tolerance(logprobs=1e-4, grads=1e-4)), ("bfloat16", BF16)])
def test_flex_attention_packed_forward_and_gradients_equal_per_row_on_cuda(segments, dtype, tolerance):
    module = build(logprob_chunk=4, dtype=dtype)
    module.model.to("cuda").set_attn_implementation("flex_attention")
    for seed in range(2):
        batch = {key: value.cuda() for key, value in tree_batch(seed, module.tokenizer.pad_token_id).items()}
        assert_packed_equals_per_row(module, batch, seed, temperature=0.7, tolerance=tolerance)


def test_packed_forward_with_lora():
    pytest.importorskip("peft")
    module = build(lora={"rank": 4, "alpha": 8})
    with torch.no_grad():  # LoRA's B starts at 0, which would leave the A matrices without gradient
        for name, param in module.model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.1, generator=torch.Generator().manual_seed(0))
    assert_packed_equals_per_row(module, tree_batch(5, module.tokenizer.pad_token_id), seed=5)


def test_an_attention_without_custom_masks_falls_back_to_rows(module, monkeypatch):
    monkeypatch.setattr(logprobs, "_warned_implementations", set())
    monkeypatch.setattr(logprobs, "TREE_MASK_ATTENTION", ("eager",))  # as if sdpa could not take the mask
    batch = tree_batch(1, module.tokenizer.pad_token_id)
    with torch.no_grad(), pytest.warns(UserWarning, match="'sdpa' does not take"):
        out = module.forward_train(batch, share_prefixes=True)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once per implementation
        again = module.forward_train(batch, share_prefixes=True)
    assert UNIQUE_TOKENS not in out and torch.equal(out[LOGPROBS], again[LOGPROBS])
