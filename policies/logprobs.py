"""Per-token log-probs (and entropies) of a causal LM over padded token rows: the train side of the policy.

``sequence_logprobs(model, batch)`` takes right- or left-padded ``input_ids`` / ``attention_mask`` [B, T] (and an
optional ``generated_mask``: only those positions are scored) and returns ``logprobs[b, t] = log p(input_ids[b, t]
| input_ids[b, :t])`` ([B, T], 0 where not scored), computing the LM head chunk by chunk so that no [B, T, V]
logits tensor is ever alive (each chunk's logits are recomputed in the backward pass). With
``share_prefixes=True`` the rows are forwarded as their trie of unique prefixes (:mod:`policies.prefix_packing`):
a token shared by several rows (the prompt, a tree's steps above a branch point) is computed and backpropagated
once, with the per-row results. Pure torch + transformers (no Ray): :class:`policies.rl_module.LLMRLModule` and the
benchmarks call it.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.checkpoint import checkpoint
from transformers import PreTrainedConfig

from policies.memory_plan import HEAD_CHUNK_POSITIONS
from policies.prefix_packing import (
    build_prefix_trie,
    choose_cuts,
    layout_segments,
    scored_predictions,
    segment_subtree_ends,
    tree_attention_mask,
    tree_block_mask,
)

LOGPROBS, ENTROPY = "logprobs", "entropy"
# prefix-sharing forward only: the trie's nodes, the nodes forwarded (ancestors repeat across segments), the
# real tokens of the rows
UNIQUE_TOKENS, PACKED_TOKENS, REAL_TOKENS = "unique_tokens", "packed_tokens", "real_tokens"
FLEX_ATTENTION = "flex_attention"
# attention implementations that take a tree mask as-is: a 4D tensor (sdpa, eager) or a block mask (flex_attention)
TREE_MASK_ATTENTION = ("sdpa", "eager", FLEX_ATTENTION)
PACKING = "prefix_packing"  # optional batch entry: the rows' PackedRows (pack_rows), reused instead of rebuilt
GENERATED_MASK = "generated_mask"  # batch column of the generated (trained) tokens; when given, only they are scored


def _scatter(values: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Values of the scored positions (rows, cols) in a float32 [B, T] tensor, 0 elsewhere."""
    out = torch.zeros(shape, dtype=torch.float32, device=rows.device)
    return out.index_put((rows, cols), values.to(torch.float32))


def token_logprobs_and_entropy(
    hidden: torch.Tensor, head: torch.nn.Module, targets: torch.Tensor, *, with_entropy: bool,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of each target under ``softmax(head(hidden) / temperature)`` (and that distribution's entropy),
    in float32: the distribution the rollouts sample from (before top-p).

    hidden: [B, C, H]; targets: [B, C]. Returns ([B, C], [B, C] or None).
    """
    logits = head(hidden).float() / temperature
    logp = torch.log_softmax(logits, dim=-1)
    chosen = logp.gather(-1, targets[..., None]).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1) if with_entropy else None
    return chosen, entropy


def chunked_logprobs_and_entropy(
    hidden: torch.Tensor, head: torch.nn.Module, targets: torch.Tensor, *, chunk: int, with_entropy: bool,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`token_logprobs_and_entropy` of hidden [N, H] and targets [N], ``chunk`` positions at a time; with
    gradients on, each chunk's logits are recomputed in the backward pass instead of kept."""
    chunks_lp, chunks_ent = [], []
    for start in range(0, len(targets), chunk):
        args = (hidden[start:start + chunk], head, targets[start:start + chunk])
        if torch.is_grad_enabled():
            lp, ent = checkpoint(token_logprobs_and_entropy, *args, with_entropy=with_entropy,
                                 temperature=temperature, use_reentrant=False)
        else:
            lp, ent = token_logprobs_and_entropy(*args, with_entropy=with_entropy, temperature=temperature)
        chunks_lp.append(lp)
        chunks_ent.append(ent)
    empty = hidden.new_zeros(0, dtype=torch.float32)
    logprobs = torch.cat(chunks_lp) if chunks_lp else empty
    entropy = (torch.cat(chunks_ent) if chunks_ent else empty) if with_entropy else None
    return logprobs, entropy


def scored_positions(batch: dict[str, Any]) -> torch.Tensor:
    """Boolean [B, T]: the positions t whose token is scored: real, after a real token, and generated when the
    batch has a ``generated_mask``."""
    mask = batch["attention_mask"].bool()
    scored = torch.zeros_like(mask)
    scored[:, 1:] = mask[:, 1:] & mask[:, :-1]
    if GENERATED_MASK in batch:
        scored &= batch[GENERATED_MASK].bool()
    return scored


def packed_attention_mask(packing: PackedRows, implementation: str, dtype: torch.dtype) -> Any:
    """The tree attention mask of ``packing`` as ``implementation`` takes it as-is (transformers passes a 4D
    ``attention_mask`` or a ``BlockMask`` through unchanged): flex_attention the block mask built with the
    packing, sdpa a boolean [G, 1, S, S] (True: may attend), eager an additive one (0 or the dtype's minimum),
    which it adds to the attention scores."""
    if implementation == FLEX_ATTENTION:
        if packing.block_mask is None:
            raise ValueError("this packing was built for a dense mask; build it with the flex_attention model")
        return packing.block_mask
    allowed = tree_attention_mask(packing.slot_ends)[:, None]
    if implementation == "sdpa":
        return allowed
    blocked = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return blocked.masked_fill_(~allowed, torch.finfo(dtype).min)


def attention_pair_cost(config: PreTrainedConfig) -> float:
    """Work of one (query, key) attention pair relative to one token's projections and MLP, per layer (multiply
    -adds: scores and weighted values vs. the q, k, v, o and MLP matrices); the LM head is left out, as
    prefix sharing computes it once per unique token anyway. Drives how the trie is cut into segments."""
    hidden = config.hidden_size
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    intermediate = getattr(config, "intermediate_size", None) or 4 * hidden
    per_token = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + 3 * hidden * intermediate
    return 2 * heads * head_dim / per_token


def per_row_predictions(base: torch.nn.Module, batch: dict[str, Any], rows: torch.Tensor, cols: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    """The hidden states predicting the scored tokens (rows, cols) and those tokens, from one forward of the
    padded rows, cut to the columns that hold a real token (a micro-batch of short rows in a wide batch); the
    head's outputs are already per scored position."""
    input_ids, mask = batch["input_ids"], batch["attention_mask"]
    real_columns = mask.bool().any(0).nonzero().squeeze(-1).tolist()
    first, stop = (real_columns[0], real_columns[-1] + 1) if real_columns else (0, mask.shape[1])
    input_ids, mask = input_ids[:, first:stop], mask[:, first:stop]
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0)  # right or left padding alike
    # no KV cache: a scoring pass reads no past, and a cache would hold every layer's keys and values to the end
    hidden = base.get_decoder()(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                                use_cache=False).last_hidden_state
    return hidden[rows, cols - first - 1], input_ids[rows, cols - first], lambda values: values


@dataclass(frozen=True)
class PackedRows:
    """A batch's rows as the segments of their trie (:mod:`policies.prefix_packing`), on the batch's device: built
    once per batch, reused by every forward pass over it (old and reference log-probs, each PPO epoch).

    token_ids, positions, slot_ends [G, S]: each slot's token, position id (depth) and the end of its subtree in
    its segment (the tree mask, :func:`~policies.prefix_packing.tree_attention_mask`). slots, targets [P]: the
    flat slot predicting each unique scored node, and that node's token. inverse [N]: the unique prediction of
    each scored position. block_mask: flex_attention's mask (None for the dense-mask implementations). counts:
    ``UNIQUE_TOKENS``, ``PACKED_TOKENS``, ``REAL_TOKENS``. shape: the batch's [B, T].
    """

    token_ids: torch.Tensor
    positions: torch.Tensor
    slot_ends: torch.Tensor
    slots: torch.Tensor
    targets: torch.Tensor
    inverse: torch.Tensor
    block_mask: Any
    counts: dict[str, int]
    shape: tuple[int, int]


def pack_rows(model: torch.nn.Module, batch: dict[str, Any]) -> PackedRows:
    """The packing of ``batch``'s rows for ``model`` (its attention implementation picks the mask's form; its
    shape, the cut into segments): the trie, cut into segments, the unique scored predictions, and for
    flex_attention the block mask."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    rows, cols = scored_positions(batch).nonzero(as_tuple=True)
    input_ids = batch["input_ids"]
    trie = build_prefix_trie(input_ids.cpu().numpy(), batch["attention_mask"].cpu().numpy())
    layout = layout_segments(trie, choose_cuts(trie, attention_pair_cost(base.config)))
    predictions = scored_predictions(trie, layout, rows.cpu().numpy(), cols.cpu().numpy())

    def on_device(array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(input_ids.device)

    slot_nodes = on_device(layout.node_ids).clamp(min=0)  # padding slots repeat node 0; they attend to themselves
    slot_ends = on_device(segment_subtree_ends(trie, layout))
    flex = base.config._attn_implementation == FLEX_ATTENTION
    return PackedRows(
        token_ids=on_device(trie.token_ids)[slot_nodes], positions=on_device(trie.positions)[slot_nodes],
        slot_ends=slot_ends, slots=on_device(predictions.slots), targets=on_device(predictions.targets),
        inverse=on_device(predictions.inverse), block_mask=tree_block_mask(slot_ends) if flex else None,
        counts={UNIQUE_TOKENS: trie.num_nodes, PACKED_TOKENS: layout.num_tokens, REAL_TOKENS: trie.num_tokens},
        shape=tuple(input_ids.shape))


def packed_predictions(base: torch.nn.Module, packing: PackedRows
                       ) -> tuple[torch.Tensor, torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    """Like :func:`per_row_predictions` from one forward of the packed segments (the rows of the packed batch;
    position ids = depths; the tree attention mask), once per unique scored node; the returned function spreads
    the head's per-node outputs back over the scored positions (its backward sums a shared node's gradients)."""
    dtype = base.get_input_embeddings().weight.dtype
    hidden = base.get_decoder()(
        input_ids=packing.token_ids, position_ids=packing.positions, use_cache=False,
        attention_mask=packed_attention_mask(packing, base.config._attn_implementation, dtype),
    ).last_hidden_state
    return hidden.flatten(0, 1)[packing.slots], packing.targets, lambda values: values[packing.inverse]


_warned_implementations: set[str] = set()  # the fallback is announced once per implementation and process


def takes_tree_mask(base: torch.nn.Module) -> bool:
    """Whether the model's attention implementation takes a tree mask (a custom 4D mask or a block mask); warns
    (once) when not."""
    implementation = base.config._attn_implementation
    if implementation in TREE_MASK_ATTENTION:
        return True
    if implementation in _warned_implementations:
        return False
    _warned_implementations.add(implementation)
    warnings.warn(
        f"prefix sharing needs a tree attention mask, which the model's attention implementation "
        f"{implementation!r} does not take (only {', '.join(TREE_MASK_ATTENTION)} do): forwarding the padded "
        f"rows unshared. Load the model with attn_implementation='sdpa' to share prefixes.", stacklevel=3)
    return False


def check_backward_possible(base: torch.nn.Module, device: torch.device) -> None:
    """Raise a ``ValueError`` naming the setting where the forward would not backpropagate: torch's
    flex_attention has no backward pass on the CPU (its forward runs there)."""
    if base.config._attn_implementation == FLEX_ATTENTION and device.type == "cpu" and torch.is_grad_enabled():
        raise ValueError("attention implementation flex_attention (the learner_attention setting) cannot "
                         "backpropagate on the CPU: torch's flex_attention has no CPU backward pass; use sdpa there")


def sequence_logprobs(model: torch.nn.Module, batch: dict[str, Any], *, return_entropy: bool = False,
                      share_prefixes: bool = False, chunk_positions: int = HEAD_CHUNK_POSITIONS,
                      temperature: float = 1.0) -> dict[str, Any]:
    """``LOGPROBS`` [B, T] (and ``ENTROPY`` [B, T] when asked) of ``model`` (a causal LM, or a peft model over
    one) on ``batch``, as the module docstring says. ``share_prefixes``: forward the batch as its trie of unique
    prefixes in one decoder call: each unique token once per segment that holds it (the trie is cut into segments
    where the attention a whole pack would need costs more than repeating a shared prefix does), the LM head once
    per unique scored token; same outputs and gradients as the per-row forward, plus the ints
    ``UNIQUE_TOKENS``, ``PACKED_TOKENS`` (decoder tokens) and ``REAL_TOKENS`` (the rows' tokens). The packing is
    the batch's ``PACKING`` entry when it has one (:func:`pack_rows`, built once for several passes), else built
    here. Models whose attention implementation cannot take a tree mask (sdpa, eager and flex_attention can) run
    per row, with a warning. ``chunk_positions``: scored positions in one LM-head chunk, whatever the rows.
    ``temperature``: of the softmax (the rollouts' sampling temperature, so that the learner's log-probs are of the
    distribution sampled from)."""
    input_ids = batch["input_ids"]
    rows, cols = scored_positions(batch).nonzero(as_tuple=True)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    check_backward_possible(base, input_ids.device)
    out: dict[str, Any] = {}
    if share_prefixes and takes_tree_mask(base):
        packing = batch.get(PACKING) or pack_rows(base, batch)
        if packing.shape != tuple(input_ids.shape):
            raise ValueError(f"batch[{PACKING!r}] packs rows of shape {packing.shape}, not this batch's "
                             f"{tuple(input_ids.shape)}: build it with pack_rows of this batch")
        hidden, targets, expand = packed_predictions(base, packing)
        out.update(packing.counts)
    else:
        hidden, targets, expand = per_row_predictions(base, batch, rows, cols)
    logprobs, entropy = chunked_logprobs_and_entropy(hidden, base.get_output_embeddings(), targets,
                                                     chunk=chunk_positions,
                                                     with_entropy=return_entropy, temperature=temperature)
    out[LOGPROBS] = _scatter(expand(logprobs), rows, cols, input_ids.shape)
    if return_entropy:
        out[ENTROPY] = _scatter(expand(entropy), rows, cols, input_ids.shape)
    return out
