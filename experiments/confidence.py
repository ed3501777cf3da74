"""Confidence intervals for held-out scores: a mean, a paired before/after difference, and the bootstrap over
seeds and questions that a comparison of settings needs.

Per-question scores (EM, answered, tool calls) are the unit: a mean over n questions has the Student-t interval
of its n values; a before/after change on the same questions has the interval of the per-question differences
(pairing removes the questions' difficulty from the noise). Several seeds add the run's own noise: the
bootstrap resamples seeds, then questions, so both sources are in the interval.

At the few seeds a learning benchmark affords, the seed is the unit and a bootstrap over seeds is too narrow (a
percentile interval from 6 values undercovers), so a comparison also gets tests that hold at any n: the Student-t
interval and p-value of the per-seed paired differences (``t_test_p_value``), the exact sign-flip (permutation)
p-value over all 2^n sign assignments of those differences (``sign_flip_p_value``: no normality assumed), and for a
time to an event some runs never reach by their end (right-censored), a paired sign test that counts only the
pairs whose order is known (``censored_order``, ``censored_sign_test``). Several comparisons read together are
corrected by Holm's step-down method (``holm_adjusted``).

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


def t_test_p_value(differences: Sequence[float]) -> float:
    """The two-sided p-value of a one-sample Student-t test that the mean of ``differences`` (paired, one per seed)
    is 0. Differences all equal: 1 if they are 0, else 0 (no spread: the sign is certain); one difference: 1."""
    x = np.asarray(differences, dtype=float)
    if x.size == 0:
        raise ValueError("t_test_p_value needs at least one difference")
    if x.size == 1:
        return 1.0
    if np.ptp(x) == 0:
        return 1.0 if x[0] == 0 else 0.0
    return float(stats.ttest_1samp(x, 0.0).pvalue)


MAX_SIGN_FLIP_N = 20  # 2^20 sign assignments, about a million: the exact test's limit


def sign_flip_p_value(differences: Sequence[float]) -> float:
    """The exact two-sided p-value of the paired sign-flip (permutation) test: under "no difference" each paired
    difference is as likely to have either sign, so the share of all 2^n sign assignments whose |sum| is at least the
    observed |sum|. No normality assumed; its smallest value is 2 / 2^n (6 seeds: 0.031)."""
    x = np.asarray(differences, dtype=float)
    if not 1 <= x.size <= MAX_SIGN_FLIP_N:
        raise ValueError(f"sign_flip_p_value takes 1 to {MAX_SIGN_FLIP_N} differences, got {x.size}")
    sums = np.zeros(1)
    for value in x:  # every signed sum, doubling: 2^n floats (8 MB at 20), not an n x 2^n table of signs
        sums = np.concatenate((sums + value, sums - value))
    sums = np.abs(sums)
    observed = abs(float(x.sum()))
    return float(np.mean(sums >= observed - 1e-9 * max(1.0, observed)))


def holm_adjusted(p_values: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values of m comparisons read together (each compared with the level, e.g. 0.05,
    controls the chance of any false finding among the m): the i-th smallest p times (m - i + 1), made monotone by a
    running maximum, capped at 1; returned in the input's order."""
    p = np.asarray(p_values, dtype=float)
    order = np.argsort(p, kind="stable")
    scaled = np.minimum(1.0, np.maximum.accumulate(p[order] * (p.size - np.arange(p.size))))
    adjusted = np.empty_like(p)
    adjusted[order] = scaled
    return [float(v) for v in adjusted]


def censored_order(a: float | None, a_end: float, b: float | None, b_end: float) -> int:
    """Which of two paired runs reached an event first, when a run that never reached it (None) is right-censored at
    its end (``a_end``, ``b_end``: it would have reached it later than that, if ever): -1 if a is known to have been
    sooner, +1 if later, 0 if the order is unknown (both censored; one censored before the other's event) or a tie.
    The pairing rule of Woolson and Lachenbruch's rank tests for censored matched pairs (1980), reduced to signs."""
    if a is not None and b is not None:
        return int(np.sign(a - b))
    if a is not None:  # b censored: a sooner if a came no later than b's end
        return -1 if a <= b_end else 0
    if b is not None:
        return 1 if b <= a_end else 0
    return 0


@dataclass(frozen=True)
class SignTest:
    """A paired sign test: how many pairs had a sooner (``sooner``), later (``later``), or no known order
    (``unordered``: censoring or ties, left out of the test), and the exact two-sided binomial p-value."""

    sooner: int
    later: int
    unordered: int
    p: float


def censored_sign_test(orders: Sequence[int]) -> SignTest:
    """The exact two-sided sign test on paired orders (``censored_order``'s -1 / +1 / 0): under "no difference" each
    ordered pair is a fair coin, so p = P(a binomial(n ordered, 1/2) is at least as far from n/2 as observed)."""
    sooner, later = sum(o < 0 for o in orders), sum(o > 0 for o in orders)
    ordered = sooner + later
    p = float(stats.binomtest(sooner, ordered).pvalue) if ordered else 1.0
    return SignTest(sooner, later, len(orders) - ordered, p)
