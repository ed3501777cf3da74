"""Token sampling on the device without a host sync or a full-vocabulary sort, with one random stream per branch.

Nucleus (top-p) sampling needs the smallest set of most likely tokens whose mass reaches ``top_p``. Sorting the
whole vocabulary for it (49k ids for SmolLM2) costs more than a small model's forward pass, so
:func:`sample_tokens` takes the ``CANDIDATES`` most likely tokens first (a partial selection), cuts the nucleus
inside them, and draws among the survivors. That is exact whenever the candidates hold at least ``top_p`` of the
mass (the nucleus then lies inside them); rows where they do not are flagged and :func:`sample_tokens_exact`
redraws them over the whole sorted vocabulary, with the same random numbers, so a token's fate never depends on
which path drew it.

The draw is the exponential race: ``argmax_i p_i / E_i`` with ``E_i ~ Exponential(1)`` picks ``i`` with
probability ``p_i / sum(p)`` (equivalently the Gumbel-max trick), with no ``torch.multinomial`` and so no host
sync. The exponentials come from a counter-based hash of (branch stream, token position, token id)
(:func:`stream_uniforms`), not from a stateful generator: a branch draws the same numbers whichever other branches
share its batch and in whatever order the batches run, which is what keeps a seeded rollout exact under
continuous batching and resume.
"""

from __future__ import annotations

import functools

import torch

# Candidate counts tried in turn before the exact path: 256 covers a trained model's nucleus almost always; an
# untrained model's flat distribution (SmolLM2-135M at T=1 on HotpotQA: 256 fall short in most steps) mostly fits
# in 4096, still a tenth of a sort's cost.
CANDIDATES = (256, 4096)
_MASK32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, constant: int) -> torch.Tensor:
    """``(x * constant) mod 2**32`` for int64 ``x`` in [0, 2**32), in 16-bit halves so that no int64 overflows."""
    low, high = x & 0xFFFF, x >> 16
    return (low * constant + ((high * (constant & 0xFFFF)) << 16)) & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash with full avalanche (the "lowbias32" constants), on int64 values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def stream_uniforms(streams: torch.Tensor, positions: torch.Tensor, token_ids: torch.Tensor,
                    vocab_size: int) -> torch.Tensor:
    """Uniforms in (0, 1), float64, one per token id: a pure function of (stream, position, token id).

    ``streams`` and ``positions`` are [B] int64 (a stream is any integer below 2**62), ``token_ids`` [B, K]
    int64 below ``vocab_size``; the result is [B, K]. Each input word is folded in through the hash in turn, so
    changing any of them changes the number; the row's words (position, stream) on [B], the token's first round
    looked up (:func:`token_hashes`), so each token costs one round of arithmetic (the exact path hashes a whole
    nucleus, tens of thousands of ids for an untrained model).
    """
    key = _mix32(positions & _MASK32)
    key = _mix32(key ^ (streams & _MASK32))
    key = _mix32(key ^ ((streams >> 32) & _MASK32))
    x = _mix32(token_hashes(vocab_size, token_ids.device)[token_ids] ^ key[:, None])
    return (x.double() + 0.5) / 2.0**32


@functools.lru_cache(maxsize=8)
def token_hashes(vocab_size: int, device: torch.device) -> torch.Tensor:
    """The first hash round of every token id below ``vocab_size`` (int64 [vocab_size]): the same in every row and
    pass, so it is computed once per vocabulary and device and then looked up."""
    return _mix32((torch.arange(vocab_size, device=device) + 0x9E3779B9) & _MASK32)


def race(logprobs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Index of the winner of the exponential race on each row: ``argmax log p - log E`` with ``E = -log u``
    (``-inf`` log-probs never win)."""
    return (logprobs.double() - torch.log(-torch.log(uniforms))).argmax(dim=-1)


def nucleus_mask(sorted_probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Which of the descending ``sorted_probs`` [B, K] are in the nucleus: the smallest prefix whose mass reaches
    ``top_p`` (the first token always is)."""
    return sorted_probs.cumsum(dim=-1) - sorted_probs < top_p


def sample_tokens(logprobs: torch.Tensor, top_p: float, streams: torch.Tensor, positions: torch.Tensor,
                  candidates: int = CANDIDATES[0]) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of the (tempered) ``logprobs`` [B, V] under top-p, drawn from the rows' streams at
    ``positions`` among the ``candidates`` most likely tokens; returns (token ids [B], rows whose candidates hold
    less than ``top_p`` [B] bool, to redraw with more candidates or :func:`sample_tokens_exact`). Neither output
    needs the host: the flagged rows' token ids are placeholders until redrawn."""
    if top_p >= 1.0:
        everything = torch.arange(logprobs.shape[-1], device=logprobs.device).expand_as(logprobs)
        winner = race(logprobs, stream_uniforms(streams, positions, everything, logprobs.shape[-1]))
        return winner, torch.zeros_like(streams, dtype=torch.bool)
    top, ids = logprobs.topk(min(candidates, logprobs.shape[-1]), dim=-1)  # sorted, descending
    probs = top.exp()
    kept = nucleus_mask(probs, top_p)
    incomplete = probs.sum(dim=-1) < top_p  # the nucleus may reach past the candidates
    winner = race(top.masked_fill(~kept, -torch.inf), stream_uniforms(streams, positions, ids, logprobs.shape[-1]))
    return ids.gather(-1, winner[:, None]).squeeze(-1), incomplete


def sample_tokens_exact(logprobs: torch.Tensor, top_p: float, streams: torch.Tensor,
                        positions: torch.Tensor) -> torch.Tensor:
    """:func:`sample_tokens` over the whole sorted vocabulary (for the rows it flags): token ids [B]. Reads the
    nucleus width on the host (this path is the rare one), so only the nucleus is hashed. (Drawing every row this
    way in one pass, hashing the whole sorted vocabulary to avoid that read, measured slower on an H100 than the
    staged candidates, even for flat distributions.)"""
    ordered, ids = logprobs.sort(dim=-1, descending=True)
    kept = nucleus_mask(ordered.exp(), top_p)
    width = int(kept.sum(dim=-1).max())
    ordered, ids, kept = ordered[:, :width], ids[:, :width], kept[:, :width]
    uniforms = stream_uniforms(streams, positions, ids, logprobs.shape[-1])
    winner = race(ordered.masked_fill(~kept, -torch.inf), uniforms)
    return ids.gather(-1, winner[:, None]).squeeze(-1)
