"""Confidence intervals for held-out scores: a mean, a paired before/after difference, and the bootstrap over
seeds and questions that a comparison of settings needs.

Per-question scores (EM, answered, tool calls) are the unit: a mean over n questions has the Student-t interval
of its n values; a before/after change on the same questions has the interval of the per-question differences
(pairing removes the questions' difficulty from the noise). Several seeds add the run's own noise: the
bootstrap resamples seeds, then questions, so both sources are in the interval.

Before a comparison is run, ``seeds_for_power`` sizes it from a pilot's paired differences (the seeds x questions
a paired test needs to see a difference at a given power), and ``detectable_difference`` says what a given size
can see.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats


@dataclass(frozen=True)
class Interval:
    """A mean and its confidence interval [low, high]."""

    mean: float
    low: float
    high: float

    def excludes(self, value: float = 0.0) -> bool:
        """Whether ``value`` lies outside the interval (for a difference: the change is beyond the noise)."""
        return not self.low <= value <= self.high

    def __str__(self) -> str:
        return f"{self.mean:.3f} [{self.low:.3f}, {self.high:.3f}]"


def mean_interval(values: Sequence[float], confidence: float = 0.95) -> Interval:
    """The Student-t interval of the mean of ``values`` (one value: a zero-width interval at it)."""
    x = np.asarray(values, dtype=float)
    if x.size == 0:
        raise ValueError("mean_interval needs at least one value")
    mean = float(x.mean())
    if x.size == 1:
        return Interval(mean, mean, mean)
    half = float(stats.t.ppf(0.5 + confidence / 2, x.size - 1) * x.std(ddof=1) / np.sqrt(x.size))
    return Interval(mean, mean - half, mean + half)


def paired_difference_interval(before: Sequence[float], after: Sequence[float],
                               confidence: float = 0.95) -> Interval:
    """The interval of mean(after - before) over paired values (the same questions before and after)."""
    if len(before) != len(after):
        raise ValueError(f"paired values need equal lengths, got {len(before)} and {len(after)}")
    return mean_interval(np.asarray(after, dtype=float) - np.asarray(before, dtype=float), confidence)


def bootstrap_interval(scores: np.ndarray, *, confidence: float = 0.95, resamples: int = 2000,
                       seed: int = 0) -> Interval:
    """The percentile-bootstrap interval of the mean of ``scores`` (seeds x questions), resampling seeds and then
    questions (the same resampled questions for every seed: they are the same held-out questions). Resampling at
    both levels counts the within-seed noise twice, so the interval errs wide, never narrow."""
    return _bootstrap(np.asarray(scores, dtype=float)[None], confidence, resamples, seed)


def paired_bootstrap_interval(a: np.ndarray, b: np.ndarray, *, confidence: float = 0.95, resamples: int = 2000,
                              seed: int = 0) -> Interval:
    """The bootstrap interval of mean(a) - mean(b) for two settings run with the same seeds on the same questions
    (seeds x questions each), seeds and questions resampled together for both."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if a.shape != b.shape:
        raise ValueError(f"paired scores need equal shapes (seeds x questions), got {a.shape} and {b.shape}")
    return _bootstrap(np.stack([a, -b]), confidence, resamples, seed)


def _bootstrap(scores: np.ndarray, confidence: float, resamples: int, seed: int) -> Interval:
    """``scores``: (terms, seeds, questions); the statistic is the sum over terms of each term's mean."""
    if scores.ndim != 3 or 0 in scores.shape:
        raise ValueError(f"scores must be seeds x questions with at least one of each, got shape {scores.shape[1:]}")
    _, seeds, questions = scores.shape
    rng = np.random.default_rng(seed)
    seed_draws = rng.integers(0, seeds, size=(resamples, seeds))
    question_draws = rng.integers(0, questions, size=(resamples, questions))
    # (terms, resamples, seeds, questions) gathered in one go; means over seeds and questions, summed over terms
    picked = scores[:, seed_draws[:, :, None], question_draws[:, None, :]]
    statistic = picked.mean(axis=(2, 3)).sum(axis=0)
    tail = (1 - confidence) / 2 * 100
    low, high = np.percentile(statistic, [tail, 100 - tail])
    return Interval(float(scores.mean(axis=(1, 2)).sum()), float(low), float(high))


def paired_cells_for_power(sd_paired: float, delta: float, *, alpha: float = 0.05, power: float = 0.8) -> int:
    """The number of paired cells (seed x question pairs of two settings) a two-sided paired test at level
    ``alpha`` needs to detect a mean difference ``delta`` with probability ``power``, when the cells' paired
    differences have standard deviation ``sd_paired``: n = ((z_{1-alpha/2} + z_power) sd / delta)^2, rounded up
    (the normal approximation; at the hundreds of cells a benchmark needs, the t correction is below one cell).
    Cells are counted as independent: the seed's own noise, shared by its questions, makes the true need larger,
    which ``seeds_for_power``'s caller checks with the spread of the per-seed differences."""
    if sd_paired < 0 or delta <= 0 or not 0 < alpha < 1 or not 0 < power < 1:
        raise ValueError(f"need sd_paired >= 0, delta > 0 and alpha, power in (0, 1); got sd_paired {sd_paired}, "
                         f"delta {delta}, alpha {alpha}, power {power}")
    z = stats.norm.ppf(1 - alpha / 2) + stats.norm.ppf(power)
    return max(1, int(np.ceil((z * sd_paired / delta) ** 2 - 1e-9)))


def seeds_for_power(sd_paired: float, delta: float, *, questions: int, alpha: float = 0.05,
                    power: float = 0.8) -> int:
    """The seeds, each evaluated on the same ``questions`` held-out questions, that ``paired_cells_for_power``
    cells take (at least 2, so the seeds' spread is measured)."""
    if questions < 1:
        raise ValueError(f"questions must be >= 1, got {questions}")
    cells = paired_cells_for_power(sd_paired, delta, alpha=alpha, power=power)
    return max(2, -(-cells // questions))


def detectable_difference(sd_paired: float, cells: int, *, alpha: float = 0.05, power: float = 0.8) -> float:
    """The smallest mean difference that ``cells`` paired cells detect at level ``alpha`` with probability
    ``power`` (``paired_cells_for_power`` solved for delta): what a run of that size can rule out."""
    if cells < 1:
        raise ValueError(f"cells must be >= 1, got {cells}")
    z = stats.norm.ppf(1 - alpha / 2) + stats.norm.ppf(power)
    return float(z * sd_paired / np.sqrt(cells))
