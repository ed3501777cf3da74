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
from typing import Any

import numpy as np
import torch
from torch.utils.checkpoint import checkpoint
from transformers import PreTrainedConfig

from policies.prefix_packing import (
    build_prefix_trie,
    choose_cuts,
    layout_segments,
    scored_predictions,
    tree_attention_mask,
)

LOGPROBS, ENTROPY = "logprobs", "entropy"
# prefix-sharing forward only: the trie's nodes, the nodes forwarded (ancestors repeat across segments), the
# real tokens of the rows
UNIQUE_TOKENS, PACKED_TOKENS, REAL_TOKENS = "unique_tokens", "packed_tokens", "real_tokens"
TREE_MASK_ATTENTION = ("sdpa", "eager")  # attention implementations that take a custom 4D mask as-is
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


def packed_attention_mask(allowed: torch.Tensor, implementation: str, dtype: torch.dtype) -> torch.Tensor:
    """The tree attention mask [G, S, S] (True: may attend) as the 4D mask [G, 1, S, S] that ``implementation``
    takes as-is (transformers passes a 4D ``attention_mask`` through unchanged): boolean for sdpa, additive (0 or
    the dtype's minimum) for eager, which adds the mask to the attention scores."""
    if implementation == "sdpa":
        return allowed[:, None]
    blocked = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return blocked.masked_fill_(~allowed, torch.finfo(dtype).min)[:, None]


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
    padded rows; the head's outputs are already per scored position."""
    input_ids, mask = batch["input_ids"], batch["attention_mask"]
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0)  # right or left padding alike
    hidden = base.get_decoder()(input_ids=input_ids, attention_mask=mask, position_ids=positions).last_hidden_state
    return hidden[rows, cols - 1], input_ids[rows, cols], lambda values: values

def packed_predictions(base: torch.nn.Module, batch: dict[str, Any], rows: torch.Tensor, cols: torch.Tensor,
                        stats: dict[str, Any]
                        ) -> tuple[torch.Tensor, torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    """Like :func:`per_row_predictions` from one forward of the batch's trie, cut into segments (the rows of
    the packed batch; position ids = depths; the tree attention mask), once per unique scored node; the
    returned function spreads the head's per-node outputs back over the scored positions (its backward sums
    a shared node's gradients)."""
    trie = build_prefix_trie(batch["input_ids"].cpu().numpy(), batch["attention_mask"].cpu().numpy())
    layout = layout_segments(trie, choose_cuts(trie, attention_pair_cost(base.config)))
    predictions = scored_predictions(trie, layout, rows.cpu().numpy(), cols.cpu().numpy())
    device = batch["input_ids"].device

    def on_device(array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(device)

    node_ids = on_device(layout.node_ids)
    slot_nodes = node_ids.clamp(min=0)  # padding slots repeat node 0; they attend to themselves alone
    token_ids, positions = on_device(trie.token_ids)[slot_nodes], on_device(trie.positions)[slot_nodes]
    allowed = tree_attention_mask(node_ids, on_device(trie.subtree_ends))
    dtype = base.get_input_embeddings().weight.dtype
    hidden = base.get_decoder()(
        input_ids=token_ids, position_ids=positions,
        attention_mask=packed_attention_mask(allowed, base.config._attn_implementation, dtype),
    ).last_hidden_state
    stats[UNIQUE_TOKENS], stats[PACKED_TOKENS], stats[REAL_TOKENS] = (
        trie.num_nodes, layout.num_tokens, trie.num_tokens)
    slots, targets, inverse = map(on_device, (predictions.slots, predictions.targets, predictions.inverse))
    return hidden.flatten(0, 1)[slots], targets, lambda values: values[inverse]

_warned_implementations: set[str] = set()  # the fallback is announced once per implementation and process


def takes_tree_mask(base: torch.nn.Module) -> bool:
    """Whether the model's attention implementation honours a custom 4D mask; warns (once) when not."""
    implementation = base.config._attn_implementation
    if implementation in TREE_MASK_ATTENTION:
        return True
    if implementation in _warned_implementations:
        return False
    _warned_implementations.add(implementation)
    warnings.warn(
        f"prefix sharing needs a custom 4D attention mask, which the model's attention implementation "
        f"{implementation!r} does not take (only {', '.join(TREE_MASK_ATTENTION)} do): forwarding the padded "
        f"rows unshared. Load the model with attn_implementation='sdpa' to share prefixes.", stacklevel=3)
    return False


def sequence_logprobs(model: torch.nn.Module, batch: dict[str, Any], *, return_entropy: bool = False,
                      share_prefixes: bool = False, chunk_positions: int = 256,
                      temperature: float = 1.0) -> dict[str, Any]:
    """``LOGPROBS`` [B, T] (and ``ENTROPY`` [B, T] when asked) of ``model`` (a causal LM, or a peft model over
    one) on ``batch``, as the module docstring says. ``share_prefixes``: forward the batch as its trie of unique
    prefixes in one decoder call: each unique token once per segment that holds it (the trie is cut into segments
    where the attention a whole pack would need costs more than repeating a shared prefix does), the LM head once
    per unique scored token; same outputs and gradients as the per-row forward, plus the ints
    ``UNIQUE_TOKENS``, ``PACKED_TOKENS`` (decoder tokens) and ``REAL_TOKENS`` (the rows' tokens). Models whose
    attention implementation cannot take a custom 4D mask (only sdpa and eager can) run per row, with a warning.
    ``chunk_positions``: scored positions per row in one LM-head chunk. ``temperature``: of the softmax (the
    rollouts' sampling temperature, so that the learner's log-probs are of the distribution sampled from)."""
    input_ids = batch["input_ids"]
    rows, cols = scored_positions(batch).nonzero(as_tuple=True)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    out: dict[str, Any] = {}
    if share_prefixes and takes_tree_mask(base):
        hidden, targets, expand = packed_predictions(base, batch, rows, cols, out)
    else:
        hidden, targets, expand = per_row_predictions(base, batch, rows, cols)
    logprobs, entropy = chunked_logprobs_and_entropy(hidden, base.get_output_embeddings(), targets,
                                                     chunk=chunk_positions * input_ids.shape[0],
                                                     with_entropy=return_entropy, temperature=temperature)
    out[LOGPROBS] = _scatter(expand(logprobs), rows, cols, input_ids.shape)
    if return_entropy:
        out[ENTROPY] = _scatter(expand(entropy), rows, cols, input_ids.shape)
    return out
