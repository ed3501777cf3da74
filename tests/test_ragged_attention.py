"""The ragged pass's prefill attention: the rows packed into one variable-length call give what one masked call
per row gives, on the CPU (the packing, with the per-row kernel) and on a GPU (flash-attention's kernel)."""

from __future__ import annotations

import pytest
import torch

from policies.generation import SamplingSettings
from policies.hf_generation import HFStepGenerator
from policies.kv_cache import KVPool
from policies.models import load_model
from policies.ragged_attention import (
    PrefillRow,
    RaggedPlan,
    flash_varlen,
    flash_varlen_applies,
    packed_prefill,
    prefill_cumulative,
    ragged_attention,
    varlen_by_rows,
)
from tests.test_static_decode import two_rounds

HEADS, KV_HEADS, DIM = 6, 2, 16
# (new tokens, cached prefix) per prefilling row: a prompt from position 0, one token after a long prefix, an
# observation after a step, a row of one token from position 0
PREFILL = ((5, 0), (1, 37), (9, 12), (1, 0))
DECODE_LENGTHS = (3, 20)  # after the pass


class Layer(torch.nn.Module):
    layer_idx = 0


def one_pass(device: str, dtype: torch.dtype, kernel=None, seed: int = 0) -> torch.Tensor:
    """One layer's attention over two decoding rows (pool rows 0-1) and :data:`PREFILL` (rows 2-5), the pool's
    cached positions random; with ``kernel``, the prefilling rows packed into one call of it."""
    generator = torch.Generator().manual_seed(seed)
    pool = KVPool(1, KV_HEADS, DIM, dtype, torch.device(device))
    pool.ensure(rows=6, capacity=64, used_rows=0)
    pool.keys[0].copy_(torch.randn(pool.keys[0].shape, generator=generator))
    pool.values[0].copy_(torch.randn(pool.values[0].shape, generator=generator))
    rows, positions, prefill, offset = [0, 1], [n - 1 for n in DECODE_LENGTHS], [], len(DECODE_LENGTHS)
    for row, (count, start) in enumerate(PREFILL, start=len(DECODE_LENGTHS)):
        prefill.append(PrefillRow(row, offset, count, start))
        rows += [row] * count
        positions += range(start, start + count)
        offset += count
    total, prefill = offset, tuple(prefill)
    query, key, value = (torch.randn(1, heads, total, DIM, generator=generator).to(device, dtype)
                         for heads in (HEADS, KV_HEADS, KV_HEADS))
    view = 32
    decode_mask = (torch.arange(view)[None] < torch.tensor(DECODE_LENGTHS)[:, None])[:, None, None, :].to(device)
    packed = None
    if kernel is not None:
        packed = packed_prefill(prefill, torch.tensor(prefill_cumulative(prefill), device=device), kernel)
    plan = RaggedPlan(pool, len(DECODE_LENGTHS), torch.tensor(rows, device=device),
                      torch.tensor(positions, device=device), decode_mask, prefill, packed)
    out, _ = ragged_attention(Layer(), query, key, value, None, DIM**-0.5, ragged_plan=plan)
    return out


def test_the_cumulative_counts_start_at_zero_and_add_each_rows_queries_then_keys():
    prefill = (PrefillRow(2, 2, 5, 0), PrefillRow(3, 7, 1, 37), PrefillRow(4, 8, 9, 12))
    assert prefill_cumulative(prefill) == [0, 5, 6, 15, 0, 5, 43, 64]  # queries, then keys
    packed = packed_prefill(prefill, torch.tensor(prefill_cumulative(prefill)), varlen_by_rows)
    assert packed.query_counts == (5, 1, 9) and packed.key_counts == (5, 38, 21)
    assert packed.cu_queries.dtype == torch.int32 and packed.cu_keys.tolist() == [0, 5, 43, 64]


def test_packed_prefill_gives_the_attention_of_one_call_per_row():
    expected, got = one_pass("cpu", torch.float32), one_pass("cpu", torch.float32, varlen_by_rows)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)
    assert not torch.equal(one_pass("cpu", torch.float32, seed=1), expected)  # the inputs matter


def test_the_engine_samples_the_same_with_packed_prefill():
    model, tokenizer = load_model("tiny-random", seed=0)
    settings = SamplingSettings(max_step_tokens=12, stop_strings=())
    per_row = HFStepGenerator(model.eval(), tokenizer, settings, static_decode=False)
    packed = HFStepGenerator(model, tokenizer, settings, static_decode=False)
    assert packed.runner.prefill_kernel is None  # the CPU default: one call per row
    packed.runner.prefill_kernel = varlen_by_rows
    expected, got = two_rounds(per_row, tokenizer, settings), two_rounds(packed, tokenizer, settings)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)


def test_flash_applies_only_to_half_precision_on_a_gpu():
    model, _ = load_model("tiny-random", seed=0)
    assert not flash_varlen_applies(model, 32)
    assert not flash_varlen_applies(model.to(torch.bfloat16), 32)  # the CPU


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flash-attention needs a GPU")
def test_flash_varlen_gives_the_masked_attention_per_row():
    expected = one_pass("cuda", torch.bfloat16, varlen_by_rows).float()
    got = one_pass("cuda", torch.bfloat16, flash_varlen).float()
    torch.testing.assert_close(got, expected, atol=2e-2, rtol=2e-2)
    assert (got - expected).abs().mean() < 2e-3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flash-attention needs a GPU")
def test_the_engine_on_a_gpu_prefills_through_flash():
    model, tokenizer = load_model("tiny-random", dtype="bfloat16", seed=0)
    model = model.to("cuda").eval()
    settings = SamplingSettings(greedy=True, max_step_tokens=12, stop_strings=())
    flash = HFStepGenerator(model, tokenizer, settings, static_decode=False)
    per_row = HFStepGenerator(model, tokenizer, settings, static_decode=False)
    per_row.runner.prefill_kernel = None
    assert flash.runner.prefill_kernel is flash_varlen
    expected, got = two_rounds(per_row, tokenizer, settings), two_rounds(flash, tokenizer, settings)
    for a, b in zip(got, expected, strict=True):
        shared = min(len(a.logprobs), len(b.logprobs), 4)  # greedy ties in bf16 may part the rows later
        torch.testing.assert_close(torch.tensor(a.logprobs[:shared]), torch.tensor(b.logprobs[:shared]),
                                   atol=5e-2, rtol=0)
