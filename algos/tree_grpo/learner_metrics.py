"""The learner's metrics of one update: each optimizer step's partial sums on this learner, added up over the
learners, then combined over the update's steps.

A step's loss terms and per-token statistics are token-weighted partial sums on each learner (``value * tokens /
the mini-batch's tokens on all learners``), so that their sum over the learners is the whole mini-batch's
token-mean; the ratio's bounds are extremes over the learners' tokens; the gradient norm, the share of non-finite
steps and the learning rate are the same on every learner. The sampler mismatch (``mismatch_sums``) travels as sums
over the generated tokens too, its 99th percentile as the largest learner's (a bound on the batch's).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist

from algos.losses import MismatchStats, sampler_mismatch
from algos.tree_grpo import metrics as metric_keys
from policies.logprobs import PACKED_TOKENS, REAL_TOKENS, UNIQUE_TOKENS

LOSS = "loss"  # a step's total loss (policy + KL - entropy terms), returned to RLlib as total_loss
TOKENS = "tokens"  # the generated tokens a step's (or the mismatch's) partial sums are over, on this learner
# per-step metrics that combine as extremes, not as token-weighted means
EXTREMES = (metric_keys.RATIO_MAX, metric_keys.RATIO_MIN)
# per-step metrics equal on every learner (after the gradients' all-reduce)
SAME_ON_EVERY_LEARNER = (metric_keys.GRAD_NORM, metric_keys.NONFINITE_GRAD_SHARE, metric_keys.LEARNING_RATE)
AllReduce = Callable[[list[float], dist.ReduceOp], list[float]]


def mismatch_metrics(stats: MismatchStats) -> dict[str, float]:
    return {metric_keys.SAMPLER_RATIO_MEAN: stats.ratio_mean, metric_keys.SAMPLER_RATIO_P99: stats.ratio_p99,
            metric_keys.SAMPLER_RATIO_OUTSIDE: stats.outside}


def mismatch_sums(learner_logprobs: torch.Tensor, sampling_logprobs: torch.Tensor, tis_weights: torch.Tensor,
                  mask: torch.Tensor) -> dict[str, float]:
    """The sampler mismatch of a learner's rows as sums over their generated tokens (``TOKENS`` of them; the 99th
    percentile as it is, -inf without tokens), to be added up over the learners (:func:`across_learners`)."""
    tokens = float(mask.sum())
    stats = sampler_mismatch(learner_logprobs, sampling_logprobs, mask)
    return {metric_keys.SAMPLER_RATIO_MEAN: stats.ratio_mean * tokens,
            metric_keys.SAMPLER_RATIO_OUTSIDE: stats.outside * tokens,
            metric_keys.SAMPLER_RATIO_P99: stats.ratio_p99 if tokens else -math.inf,
            metric_keys.TIS_WEIGHT_MEAN: float((tis_weights * mask).sum()), TOKENS: tokens}


def across_learners(steps: list[dict], mismatch: dict, trained_tokens: float, peak_memory: float,
                    all_reduce: AllReduce) -> tuple[list[dict], dict[str, float], float, float]:
    """The steps' metrics and the mismatch of the whole batch (all learners, two all-reduces) from this
    learner's partial sums (see the module docstring), and the batch's trained tokens and largest peak memory."""
    summed = sorted(key for key in steps[0] if key not in EXTREMES + SAME_ON_EVERY_LEARNER)
    mismatch_keys = sorted(key for key in mismatch if key != metric_keys.SAMPLER_RATIO_P99)
    sums = all_reduce([step[key] for step in steps for key in summed]
                      + [mismatch[key] for key in mismatch_keys] + [trained_tokens], dist.ReduceOp.SUM)
    bounds = [value for step in steps for value in (step[metric_keys.RATIO_MAX], -step[metric_keys.RATIO_MIN])]
    highs = all_reduce([*bounds, mismatch[metric_keys.SAMPLER_RATIO_P99], peak_memory], dist.ReduceOp.MAX)
    out = []
    for i, step in enumerate(steps):
        high, low = highs[2 * i], -highs[2 * i + 1]
        out.append({**step, **dict(zip(summed, sums[i * len(summed):(i + 1) * len(summed)], strict=True)),
                    # no generated token in the step on any learner: ratio 1, as clipped_policy_loss says then
                    metric_keys.RATIO_MAX: high if math.isfinite(high) else 1.0,
                    metric_keys.RATIO_MIN: low if math.isfinite(low) else 1.0})
    totals = dict(zip(mismatch_keys, sums[len(steps) * len(summed):-1], strict=True))
    tokens, p99 = totals.pop(TOKENS), highs[-2]
    if tokens:
        reduced = {key: value / tokens for key, value in totals.items()}
        reduced[metric_keys.SAMPLER_RATIO_P99] = p99
    else:  # as sampler_mismatch says for no tokens; importance weights of 1
        reduced = {**mismatch_metrics(MismatchStats(1.0, 1.0, 0.0)), metric_keys.TIS_WEIGHT_MEAN: 1.0}
    return out, reduced, sums[-1], highs[-1]


def update_metrics(steps: list[dict]) -> dict[str, float]:
    """One update's metrics from its steps' (reduced over the learners, their losses popped): the token shares of
    the shared-prefix forward (popping the steps' counts), the ratio's extremes, the last learning rate, the mean
    of the rest."""
    metrics = {}
    counts = {key: sum(step.pop(key) for step in steps) for key in (UNIQUE_TOKENS, PACKED_TOKENS, REAL_TOKENS)}
    if counts[REAL_TOKENS]:
        metrics[metric_keys.UNIQUE_TOKEN_SHARE] = counts[UNIQUE_TOKENS] / counts[REAL_TOKENS]
        metrics[metric_keys.FORWARDED_TOKEN_SHARE] = counts[PACKED_TOKENS] / counts[REAL_TOKENS]
    for key in steps[0]:
        values = [step[key] for step in steps]
        metrics[key] = (max(values) if key == metric_keys.RATIO_MAX else min(values) if key == metric_keys.RATIO_MIN
                        else values[-1] if key == metric_keys.LEARNING_RATE else sum(values) / len(values))
    return metrics
