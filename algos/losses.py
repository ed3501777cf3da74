"""The Tree-GRPO / GRPO policy loss as small tensor functions (token level, masked, token-mean).

As in the official Tree-GRPO code (arXiv 2509.21240): the PPO ratio is taken against the old policy, whose
log-probs the trainer recomputes with the weights of before the update (here the learner's ``old_logprobs``:
``recompute``, or the sampler's own where its numerics match the learner's), with clip epsilon 0.2 on both sides
and dual-clip c = 3 for negative advantages (Ye et al., 2020), log-ratio clamped to [-20, 20]; k3 KL estimator to
the frozen reference policy, clamped to [-10, 10]; entropy bonus.

Normalisation: every term is a mean over the generated (unmasked) tokens of the whole mini-batch, one optimizer
step's data ("token-mean"). The learner accumulates micro-batches by weighting each micro-batch's token-mean
(``masked_mean``) by its share of the mini-batch's generated tokens, so the loss and its gradient do not depend
on the micro-batch size. verl instead averages within each micro-batch and divides by the number of
accumulation steps: a micro-batch with few tokens then weighs as much as a full one, and the result changes
with the micro-batch size unless every micro-batch holds the same number of tokens.

Shapes: every tensor argument is [B, T] (per token); ``mask`` is 1 on generated tokens, 0 on prompt,
observation and padding tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` over the tokens where ``mask`` is 1 (the token-mean of the tokens given; see the module
    docstring for how the learner makes it the mini-batch's)."""
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1.0)


def k3_kl(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, bound: float = 10.0, log_ratio_bound: float = 20.0
) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi || pi_ref): exp(d) - d - 1 with d = ref - logp clamped to
    [-log_ratio_bound, log_ratio_bound], the estimate clamped to [-bound, bound].

    Clamping d before the exponential keeps exp(d) finite: an overflowing exp(d) = inf makes the backward pass
    compute 0 * inf = NaN even where the estimate clamp has cut the gradient.
    """
    delta = (ref_logprobs - logprobs).clamp(-log_ratio_bound, log_ratio_bound)
    return (torch.exp(delta) - delta - 1.0).clamp(-bound, bound)


@dataclass(frozen=True)
class PolicyLossStats:
    """Diagnostics of one policy-loss evaluation (plain floats, for logging)."""

    clip_fraction: float
    dual_clip_fraction: float
    ratio_mean: float
    ratio_max: float
    ratio_min: float


def clipped_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip: float = 0.2,
    dual_clip: float | None = 3.0,
    log_ratio_bound: float = 20.0,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, PolicyLossStats]:
    """Token-mean PPO loss with dual clipping.

    per token: l = max(-A r, -A clip(r, 1 - clip, 1 + clip)); for A < 0 additionally l = min(l, -A c),
    with r = exp(clamp(logp - old_logp, -bound, bound)), multiplied by ``weights`` (truncated importance
    weights, no gradient) when given. ``advantages`` is broadcast per token ([B, T] or [B, 1]).
    """
    ratio = torch.exp((logprobs - old_logprobs).clamp(-log_ratio_bound, log_ratio_bound))
    advantages = advantages.expand_as(ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip, 1.0 + clip)
    loss = torch.maximum(unclipped, clipped)
    dual = torch.zeros_like(loss, dtype=torch.bool)
    if dual_clip is not None:
        capped = torch.minimum(loss, -advantages * dual_clip)
        dual = (advantages < 0) & (capped < loss)
        loss = torch.where(advantages < 0, capped, loss)
    if weights is not None:
        loss = loss * weights.detach()
    with torch.no_grad():
        m = mask.bool()
        real = ratio[m] if m.any() else ratio.new_ones(1)
        stats = PolicyLossStats(
            clip_fraction=masked_mean((clipped > unclipped).float(), mask).item(),
            dual_clip_fraction=masked_mean(dual.float(), mask).item(),
            ratio_mean=real.mean().item(), ratio_max=real.max().item(), ratio_min=real.min().item(),
        )
    return masked_mean(loss, mask), stats


def truncated_importance_weights(
    old_logprobs: torch.Tensor, sampling_logprobs: torch.Tensor, mask: torch.Tensor, *, cap: float,
    level: str = "token",
) -> torch.Tensor:
    """Truncated importance sampling between the sampler and the learner's old policy: per token
    ``min(exp(old - sampler), cap)``, or per trajectory ``min(exp(sum of its tokens' old - sampler), cap)``
    broadcast over its tokens. The log-ratio is capped before the exponential, so nothing overflows."""
    log_ratio = (old_logprobs - sampling_logprobs) * mask
    if level == "sequence":
        log_ratio = log_ratio.sum(-1, keepdim=True).expand_as(old_logprobs)
    elif level != "token":
        raise ValueError(f"level must be token or sequence, got {level!r}")
    return torch.exp(log_ratio.clamp(max=math.log(cap)))


@dataclass(frozen=True)
class MismatchStats:
    """How far the sampler's log-probs are from the learner's, over generated tokens: the ratio
    r = exp(learner - sampler)'s mean, 99th percentile, and share of tokens outside [0.9, 1.1]."""

    ratio_mean: float
    ratio_p99: float
    outside: float


def sampler_mismatch(learner_logprobs: torch.Tensor, sampling_logprobs: torch.Tensor,
                     mask: torch.Tensor) -> MismatchStats:
    with torch.no_grad():
        ratio = torch.exp((learner_logprobs - sampling_logprobs)[mask.bool()].double().clamp(-20.0, 20.0))
        if ratio.numel() == 0:
            return MismatchStats(1.0, 1.0, 0.0)
        return MismatchStats(ratio.mean().item(), torch.quantile(ratio, 0.99).item(),
                             ((ratio < 0.9) | (ratio > 1.1)).double().mean().item())
