"""Attention over a ragged batch: decode rows and prefill rows of any lengths in one forward pass.

The engine flattens every query token of a forward pass into one sequence ``[1, T]``: first one token per
decoding row (rows ``0 .. D-1`` of the :class:`~policies.kv_cache.KVPool`), then the new tokens of each row
being prefilled. Linear layers, norms and rotary embeddings work token by token, so only attention needs to know
the layout; it is registered with transformers' ``AttentionInterface`` as ``ATTENTION`` and receives the
:class:`RaggedPlan` through the model call's keyword arguments. Per layer it writes the new keys and values in
place into the pool, then attends: all decoding rows in one masked call (each row up to its own length), each
prefilling row causally over its cached prefix and its new tokens. Nothing is padded to another row's length,
and the pool is never copied.

A model runs this attention only inside :func:`ragged_attention_for` (its attention implementation is switched
for the forward pass and restored after), so the same model object keeps serving the learner with its own.
"""

from __future__ import annotations

from collections.abc import Iterator
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
class RaggedPlan:
    """The layout of one forward pass (see the module docstring). ``write_rows`` / ``write_positions`` [T]: where
    each flat token's keys and values go; ``decode_mask`` [D, 1, 1, view]: which positions each decoding row sees;
    ``prefill_masks``: per prefilling row, [count, start + count] (None when causal from position 0)."""

    pool: KVPool
    decode_rows: int
    write_rows: torch.Tensor
    write_positions: torch.Tensor
    decode_mask: torch.Tensor | None
    prefill: tuple[PrefillRow, ...]
    prefill_masks: tuple[torch.Tensor | None, ...]


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
    for p, mask in zip(plan.prefill, plan.prefill_masks, strict=True):
        end = p.start + p.count
        o = F.scaled_dot_product_attention(query[:, :, p.offset : p.offset + p.count], keys[p.row : p.row + 1, :, :end],
                                           values[p.row : p.row + 1, :, :end], attn_mask=mask, is_causal=mask is None,
                                           scale=scaling, enable_gqa=True)
        out[p.offset : p.offset + p.count] = o[0].transpose(0, 1)
    return out[None], None


def _no_mask(*args, **kwargs) -> None:
    return None  # the plan carries the masks


AttentionInterface.register(ATTENTION, ragged_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION, _no_mask)


def prefill_mask(start: int, count: int, device: torch.device) -> torch.Tensor | None:
    """[count, start + count]: query i (at position start + i) sees keys up to its own position; None when
    ``start`` is 0 (plain causal attention)."""
    if start == 0:
        return None
    return torch.arange(start + count, device=device)[None] <= torch.arange(count, device=device)[:, None] + start


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
