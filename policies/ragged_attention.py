"""Attention over a ragged batch: decode rows and prefill rows of any lengths in one forward pass.

The engine flattens every query token of a forward pass into one sequence ``[1, T]``: first one token per
decoding row (rows ``0 .. D-1`` of the :class:`~policies.kv_cache.KVPool`), then the new tokens of each row
being prefilled. Linear layers, norms and rotary embeddings work token by token, so only attention needs to know
the layout; it is registered with transformers' ``AttentionInterface`` as ``ATTENTION`` and receives the
:class:`RaggedPlan` through the model call's keyword arguments. Per layer it writes the new keys and values in
place into the pool, then attends: all decoding rows in one masked call (each row up to its own length), each
prefilling row causally over its cached prefix and its new tokens. Nothing is padded to another row's length,
and the pool is never copied.

On a GPU the prefilling rows attend in one variable-length flash-attention call (:class:`PackedPrefill`, the
kernel :func:`flash_varlen`): their keys and values are gathered from the pool into one packed run per layer,
and flash's causal mask, aligned to each row's last key, lets a row's new tokens see its cached prefix. One
kernel per layer replaces a masked attention per row: a tree's prefill passes carry a dozen rows or more, and
masked attention with grouped key heads runs as several unfused kernels each.

A model runs this attention only inside :func:`ragged_attention_for` (its attention implementation is switched
for the forward pass and restored after), so the same model object keeps serving the learner with its own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

from policies.kv_cache import KVPool

ATTENTION = "treegrpo_ragged"


@dataclass(frozen=True)
class PrefillRow:
    """A row being prefilled: its pool ``row``, where its tokens start in the flat sequence (``offset``), how many
    (``count``), and the position of the first (``start``, the length of its cached prefix)."""

    row: int
    offset: int
    count: int
    start: int


@dataclass(frozen=True)
class PackedPrefill:
    """The prefilling ``rows`` as one variable-length attention call: ``cu_queries`` / ``cu_keys`` [rows + 1], the
    running sums of their new tokens and of the keys each sees (cached prefix and new tokens), as int32 on the
    device, where the flash kernel reads them; ``kernel``, the call."""

    rows: tuple[PrefillRow, ...]
    cu_queries: torch.Tensor
    cu_keys: torch.Tensor
    kernel: VarlenKernel

    @property
    def query_counts(self) -> tuple[int, ...]:
        return tuple(p.count for p in self.rows)

    @property
    def key_counts(self) -> tuple[int, ...]:
        return tuple(p.start + p.count for p in self.rows)


@dataclass(frozen=True)
class RaggedPlan:
    """The layout of one forward pass (see the module docstring). ``write_rows`` / ``write_positions`` [T]: where
    each flat token's keys and values go; ``decode_mask`` [D, 1, 1, view]: which positions each decoding row sees;
    ``packed_prefill``: the prefilling rows' attention as one call (None: one masked call per row)."""

    pool: KVPool
    decode_rows: int
    write_rows: torch.Tensor
    write_positions: torch.Tensor
    decode_mask: torch.Tensor | None
    prefill: tuple[PrefillRow, ...]
    packed_prefill: PackedPrefill | None = None


def ragged_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                     ragged_plan: RaggedPlan | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: ``query`` [1, heads, T, dim], ``key``/``value`` [1, kv_heads, T, dim]
    (rotary applied); returns [1, T, heads, dim]."""
    if ragged_plan is None:
        raise RuntimeError(f"the {ATTENTION!r} attention runs only inside the HF step generator's forward passes")
    plan, layer = ragged_plan, module.layer_idx
    keys, values = plan.pool.keys[layer], plan.pool.values[layer]
    keys[plan.write_rows, :, plan.write_positions] = key[0].transpose(0, 1)
    values[plan.write_rows, :, plan.write_positions] = value[0].transpose(0, 1)
    out = query.new_empty(query.shape[2], query.shape[1], query.shape[3])  # [T, heads, dim]
    if plan.decode_rows:
        rows, view = plan.decode_rows, plan.decode_mask.shape[-1]
        q = query[0, :, :rows].transpose(0, 1)[:, :, None]  # [D, heads, 1, dim]
        o = F.scaled_dot_product_attention(q, keys[:rows, :, :view], values[:rows, :, :view],
                                           attn_mask=plan.decode_mask, scale=scaling, enable_gqa=True)
        out[:rows] = o[:, :, 0]
    if plan.packed_prefill is not None and plan.prefill:
        first = plan.prefill[0].offset  # the prefilling rows' tokens follow the decoding rows', in row order
        q = query[0, :, first:].transpose(0, 1)  # [prefill tokens, heads, dim]
        k = torch.cat([keys[p.row, :, : p.start + p.count].transpose(0, 1) for p in plan.prefill])
        v = torch.cat([values[p.row, :, : p.start + p.count].transpose(0, 1) for p in plan.prefill])
        out[first:] = plan.packed_prefill.kernel(q, k, v, plan.packed_prefill, scaling)
        return out[None], None
    for p in plan.prefill:
        end = p.start + p.count
        o = causal_attention(query[:, :, p.offset : p.offset + p.count], keys[p.row : p.row + 1, :, :end],
                             values[p.row : p.row + 1, :, :end], scaling)
        out[p.offset : p.offset + p.count] = o[0].transpose(0, 1)
    return out[None], None


VarlenKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, PackedPrefill, "float | None"], torch.Tensor]
"""``(q [queries, heads, dim], k / v [keys, kv_heads, dim], packed, scale) -> [queries, heads, dim]``: each row's
queries attend causally to its keys, the mask aligned to the row's last key (query i of a row of n queries and m
keys sees keys 0 .. m - n + i)."""


def flash_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packed: PackedPrefill,
                 scale: float | None) -> torch.Tensor:
    """:data:`VarlenKernel` as flash-attention's variable-length forward (CUDA, fp16/bf16; grouped key heads and
    the last-key-aligned causal mask are flash's own)."""
    return torch.ops.aten._flash_attention_forward(
        q.contiguous(), k, v, packed.cu_queries, packed.cu_keys, max(packed.query_counts), max(packed.key_counts),
        0.0, True, False, scale=scale)[0]


def varlen_by_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packed: PackedPrefill,
                   scale: float | None) -> torch.Tensor:
    """:data:`VarlenKernel` as one masked attention per row (any device: what :func:`flash_varlen` computes)."""
    out, query_at, key_at = q.new_empty(q.shape), 0, 0
    for queries, keys in zip(packed.query_counts, packed.key_counts, strict=True):
        rows, seen = slice(query_at, query_at + queries), slice(key_at, key_at + keys)
        o = causal_attention(q[rows].transpose(0, 1)[None], k[seen].transpose(0, 1)[None],
                             v[seen].transpose(0, 1)[None], scale)
        out[rows] = o[0].transpose(0, 1)
        query_at, key_at = query_at + queries, key_at + keys
    return out


def flash_varlen_applies(model: PreTrainedModel, head_dim: int) -> bool:
    """Whether :func:`flash_varlen` runs ``model``'s attention (heads of ``head_dim``): CUDA on sm80 or later, half
    precision, a head dimension flash supports."""
    if model.device.type != "cuda" or model.dtype not in (torch.float16, torch.bfloat16):
        return False
    return (torch.backends.cuda.flash_sdp_enabled() and torch.cuda.get_device_capability(model.device)[0] >= 8
            and head_dim % 8 == 0 and head_dim <= 256)


def packed_prefill(prefill: tuple[PrefillRow, ...], cumulative: torch.Tensor, kernel: VarlenKernel) -> PackedPrefill:
    """The :class:`PackedPrefill` of ``prefill``; ``cumulative`` [2 * (rows + 1)] holds :func:`prefill_cumulative`
    on the device."""
    cu = cumulative.to(torch.int32)
    return PackedPrefill(prefill, cu[: len(prefill) + 1], cu[len(prefill) + 1 :], kernel)


def prefill_cumulative(prefill: tuple[PrefillRow, ...]) -> list[int]:
    """The running sums of the rows' query counts, then of their key counts, each from 0 (for the device)."""
    queries, keys = [0], [0]
    for p in prefill:
        queries.append(queries[-1] + p.count)
        keys.append(keys[-1] + p.start + p.count)
    return queries + keys


def _no_mask(*args, **kwargs) -> None:
    return None  # the plan carries the masks


AttentionInterface.register(ATTENTION, ragged_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION, _no_mask)


def causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     scale: float | None) -> torch.Tensor:
    """One row's new tokens over its keys: ``query`` [1, heads, n, dim], ``key`` / ``value`` [1, kv_heads, m, dim]
    (its cached prefix of m - n positions, then the n new ones); query i sees keys 0 .. m - n + i."""
    count, start = query.shape[2], key.shape[2] - query.shape[2]
    mask = None
    if start:
        positions = torch.arange(start + count, device=query.device)
        mask = positions[None] <= torch.arange(count, device=query.device)[:, None] + start
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, is_causal=mask is None, scale=scale,
                                          enable_gqa=True)


@contextmanager
def ragged_attention_for(model: PreTrainedModel) -> Iterator[None]:
    """Run ``model``'s attention as :func:`ragged_attention` inside the block (the config's setter carries the
    choice to sub-configs)."""
    saved = model.config._attn_implementation
    model.config._attn_implementation = ATTENTION
    try:
        yield
    finally:
        model.config._attn_implementation = saved
