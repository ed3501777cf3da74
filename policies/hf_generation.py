"""The transformers backend of :class:`~policies.generation.StepGenerator`: batched branching generation on a
causal LM with KV-cache reuse across branches (CPU or GPU).

Branches that carry a :class:`KVCache` (the keys and values of a prefix of their context) prefill only the rest;
every step returns a cache handle for the new context, so a child branch forked from it prefills only its
observation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from policies.generation import (
    Branch,
    GenerationCounters,
    SamplingSettings,
    StepOutput,
    end_of_turn_ids,
)


@dataclass(frozen=True)
class KVCache:
    """Keys and values of one sequence's first ``length`` tokens: per layer (K, V), each [kv_heads, length, dim]."""

    layers: tuple[tuple[torch.Tensor, torch.Tensor], ...]
    length: int

    def crop(self, length: int) -> KVCache:
        """The cache of the first ``length`` tokens (a view, no copy)."""
        return KVCache(tuple((k[:, :length], v[:, :length]) for k, v in self.layers), length)



# -- sampling ----------------------------------------------------------------------------------------------


def sample_tokens(logits: torch.Tensor, settings: SamplingSettings, generator: torch.Generator) -> torch.Tensor:
    """One token id per row of ``logits`` [B, V]: greedy, or temperature + nucleus (top-p) sampling."""
    if settings.greedy:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.float() / settings.temperature, dim=-1)
    if settings.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        outside = sorted_probs.cumsum(dim=-1) - sorted_probs >= settings.top_p
        sorted_probs = sorted_probs.masked_fill(outside, 0.0)
        choice = torch.multinomial(sorted_probs, 1, generator=generator).squeeze(-1)
        return order.gather(-1, choice[:, None]).squeeze(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


# -- the transformers backend ------------------------------------------------------------------------------


@dataclass
class _Batch:
    """Padded batch state during one ``generate_step`` call."""

    attention_mask: torch.Tensor  # [B, past + current], 1 = real token
    next_position: torch.Tensor  # [B], position id of each branch's next real token
    generated: list[list[int]]  # sampled ids per branch
    logprobs: list[list[float]]
    finish: list[str | None]  # None while a branch is active
    closing: list[bool]  # a stop string closed; one end-of-turn token to go


class HFStepGenerator:
    """A :class:`StepGenerator` on a transformers causal LM, with KV-cache reuse across branches.

    Branches are laid out left-padded: ``[pad | cached prefix | pad | uncached suffix]``; the attention mask
    hides the pads and explicit position ids keep every branch's positions contiguous, so each branch sees
    exactly what it would see alone.
    """

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                 settings: SamplingSettings | None = None, *, keep_cache: bool = True):
        self.model, self.tokenizer = model, tokenizer
        self.settings = settings or SamplingSettings()
        self.keep_cache = keep_cache
        # the distribution the recorded log-probs are of: the tempered softmax (greedy decoding: the model's own)
        self._logprob_temperature = 1.0 if self.settings.greedy else self.settings.temperature
        self.eot_ids = end_of_turn_ids(tokenizer, model)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(self.eot_ids)
        self.counters = GenerationCounters()
        self._stop_window = max(len(s) for s in self.settings.stop_strings) + 2  # tokens to decode per check

    @torch.inference_mode()
    def generate_step(self, branches: Sequence[Branch], *, seed: int | None = None) -> list[StepOutput]:
        if not branches:
            return []
        # on the logits' device: torch.multinomial refuses a generator of another device (a CPU one on CUDA logits)
        generator = torch.Generator(device=self.model.device)
        generator.manual_seed(seed if seed is not None else torch.seed() % (2**63))
        caps = [self.settings.step_cap(len(b.token_ids)) for b in branches]
        state, cache, logits = self._prefill(branches, caps)
        while True:
            tokens = sample_tokens(logits, self.settings, generator).cpu()
            chosen = torch.log_softmax(logits.float() / self._logprob_temperature, dim=-1).gather(
                -1, tokens.to(logits.device)[:, None])
            self._record(state, tokens.tolist(), chosen.squeeze(-1).tolist(), caps)
            active = torch.tensor([f is None for f in state.finish])
            if not active.any():
                break
            logits = self._decode(state, cache, tokens, active)
        self.counters.llm_calls += len(branches)
        self.counters.tokens_generated += sum(len(g) for g in state.generated)
        return [
            StepOutput(tuple(gen), tuple(lp), finish, self._extract(cache, state, b) if self.keep_cache else None)
            for b, (gen, lp, finish) in enumerate(zip(state.generated, state.logprobs, state.finish, strict=True))
        ]

    @torch.inference_mode()
    def prefix_cache(self, token_ids: tuple[int, ...]) -> KVCache | None:
        """The cache of ``token_ids[:-1]``: branches sharing this context (the M trees of a prompt) then prefill
        one token each instead of the whole prompt."""
        if not self.keep_cache or len(token_ids) < 2:
            return None
        ids = torch.tensor([token_ids[:-1]], device=self.model.device)
        out = self.model(input_ids=ids, use_cache=True, logits_to_keep=1)
        self.counters.tokens_prefilled += ids.shape[1]
        layers = tuple((layer.keys[0].clone(), layer.values[0].clone()) for layer in out.past_key_values.layers)
        return KVCache(layers, ids.shape[1])

    def _prefill(self, branches: Sequence[Branch], caps: list[int]) -> tuple[_Batch, DynamicCache, torch.Tensor]:
        device = self.model.device
        caches = [_usable_cache(b) for b in branches]
        cached = [c.length if c else 0 for c in caches]
        suffixes = [b.token_ids[n:] for b, n in zip(branches, cached, strict=True)]
        past_len, suffix_len = max(cached), max(len(s) for s in suffixes)
        batch = len(branches)
        input_ids = torch.full((batch, suffix_len), self.pad_id, dtype=torch.long)
        mask = torch.zeros((batch, past_len + suffix_len), dtype=torch.long)
        positions = torch.zeros((batch, suffix_len), dtype=torch.long)
        for b, (n, suffix) in enumerate(zip(cached, suffixes, strict=True)):
            start = suffix_len - len(suffix)
            input_ids[b, start:] = torch.tensor(suffix, dtype=torch.long)
            mask[b, past_len - n : past_len] = 1
            mask[b, past_len + start :] = 1
            positions[b, start:] = torch.arange(n, n + len(suffix))
        past = DynamicCache(ddp_cache_data=_stack_caches(caches, past_len, self.model)) if past_len else DynamicCache()
        out = self.model(input_ids=input_ids.to(device), attention_mask=mask.to(device),
                         position_ids=positions.to(device), past_key_values=past, use_cache=True,
                         logits_to_keep=1)  # only the last position's logits: never B x T x V
        self.counters.tokens_prefilled += sum(len(s) for s in suffixes)
        next_position = torch.tensor([n + len(s) for n, s in zip(cached, suffixes, strict=True)])
        state = _Batch(mask, next_position, generated=[[] for _ in branches], logprobs=[[] for _ in branches],
                       finish=[None if cap > 0 else "length" for cap in caps], closing=[False for _ in branches])
        return state, out.past_key_values, out.logits[:, -1]

    def _decode(self, state: _Batch, cache: DynamicCache, tokens: torch.Tensor,
                active: torch.Tensor) -> torch.Tensor:
        device = self.model.device
        inputs = torch.where(active, tokens, torch.full_like(tokens, self.pad_id))
        state.attention_mask = torch.cat([state.attention_mask, active.long()[:, None]], dim=1)
        out = self.model(input_ids=inputs[:, None].to(device), attention_mask=state.attention_mask.to(device),
                         position_ids=state.next_position[:, None].to(device), past_key_values=cache, use_cache=True,
                         logits_to_keep=1)
        state.next_position = state.next_position + active.long()
        return out.logits[:, -1]

    def _record(self, state: _Batch, tokens: list[int], logprobs: list[float], caps: list[int]) -> None:
        for b, (token, logprob) in enumerate(zip(tokens, logprobs, strict=True)):
            if state.finish[b] is not None:
                continue
            state.generated[b].append(token)
            state.logprobs[b].append(logprob)
            if state.closing[b]:
                state.finish[b] = "stop"
            elif token in self.eot_ids:
                state.finish[b] = "eos"
            elif stop := self._closing_string(state.generated[b]):
                end_turn = stop in self.settings.end_turn_after and len(state.generated[b]) < caps[b]
                state.closing[b] = end_turn
                state.finish[b] = None if end_turn else "stop"
            elif len(state.generated[b]) >= caps[b]:
                state.finish[b] = "length"

    def _closing_string(self, generated: list[int]) -> str | None:
        # Checked after every token, so a stop string in the recent tail is the first one of the step.
        tail = self.tokenizer.decode(generated[-self._stop_window :])
        return next((stop for stop in self.settings.stop_strings if stop in tail), None)

    def _extract(self, cache: DynamicCache, state: _Batch, b: int) -> KVCache:
        # The mask covers every fed position; the last sampled token was never fed.
        keep = state.attention_mask[b].bool().to(cache.layers[0].keys.device)
        layers = tuple((layer.keys[b][:, keep].clone(), layer.values[b][:, keep].clone()) for layer in cache.layers)
        return KVCache(layers, int(keep.sum()))


def _usable_cache(branch: Branch) -> KVCache | None:
    """The branch's cache, cropped to leave at least one token to prefill (the next-token logits need it)."""
    cache = branch.cache
    if cache is None or cache.length == 0:
        return None
    return cache if cache.length < len(branch.token_ids) else cache.crop(len(branch.token_ids) - 1)


def _stack_caches(caches: list[KVCache | None], length: int, model: PreTrainedModel) -> list[tuple]:
    """Per layer (K, V) of the whole batch, each cache right-aligned in ``length`` slots (zeros = padding)."""
    template = next(c for c in caches if c is not None)
    stacked = []
    for layer, (k_ref, v_ref) in enumerate(template.layers):
        keys = k_ref.new_zeros((len(caches), k_ref.shape[0], length, k_ref.shape[2]))
        values = v_ref.new_zeros((len(caches), v_ref.shape[0], length, v_ref.shape[2]))
        for b, cache in enumerate(caches):
            if cache is not None:
                keys[b, :, length - cache.length :] = cache.layers[layer][0]
                values[b, :, length - cache.length :] = cache.layers[layer][1]
        stacked.append((keys.to(model.device), values.to(model.device)))
    return stacked
