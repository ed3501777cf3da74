"""Confidence intervals, checked against hand-computed values."""

from __future__ import annotations

import numpy as np
import pytest

from experiments.confidence import (
    Interval,
    bootstrap_interval,
    detectable_difference,
    mean_interval,
    paired_bootstrap_interval,
    paired_cells_for_power,
    paired_difference_interval,
    seeds_for_power,
)


def test_mean_interval_is_the_student_t_interval():
    # mean 0.75, sample std 0.5, standard error 0.25, t(0.975, 3 dof) = 3.1824
    interval = mean_interval([0, 1, 1, 1])
    assert interval.mean == pytest.approx(0.75)
    assert interval.low == pytest.approx(0.75 - 3.182446 * 0.25, abs=1e-5)
    assert interval.high == pytest.approx(0.75 + 3.182446 * 0.25, abs=1e-5)
    assert not interval.excludes(0.0)


def test_a_wider_confidence_gives_a_wider_interval():
    narrow, wide = mean_interval([1, 2, 3, 4], 0.8), mean_interval([1, 2, 3, 4], 0.99)
    assert wide.low < narrow.low < narrow.high < wide.high


def test_constant_and_single_values_give_zero_width():
    assert mean_interval([0.0, 0.0, 0.0]) == Interval(0.0, 0.0, 0.0)
    assert mean_interval([0.3]) == Interval(0.3, 0.3, 0.3)
    with pytest.raises(ValueError, match="at least one"):
        mean_interval([])


def test_paired_difference_uses_the_per_question_differences():
    # differences 1, 1, 0, 1: mean 0.75, std 0.5 -> the same interval as above, which excludes 0 only at 80%
    before, after = [0, 0, 1, 0], [1, 1, 1, 1]
    interval = paired_difference_interval(before, after)
    assert interval.mean == pytest.approx(0.75)
    assert interval.low == pytest.approx(0.75 - 3.182446 * 0.25, abs=1e-5)
    assert paired_difference_interval(before, after, 0.8).excludes(0.0)  # t(0.9, 3) = 1.638: [0.34, 1.16]
    with pytest.raises(ValueError, match="equal lengths"):
        paired_difference_interval([0, 1], [1])


def test_excludes_and_str():
    interval = Interval(0.2, 0.1, 0.3)
    assert interval.excludes(0.0) and interval.excludes(0.31) and not interval.excludes(0.1)
    assert str(interval) == "0.200 [0.100, 0.300]"


def test_bootstrap_of_identical_seeds_and_questions_has_no_width():
    interval = bootstrap_interval(np.full((3, 5), 0.4))
    assert (interval.mean, interval.low, interval.high) == pytest.approx((0.4, 0.4, 0.4))


def test_bootstrap_covers_the_mean_and_is_seeded():
    scores = np.random.default_rng(1).integers(0, 2, size=(5, 300)).astype(float)
    interval = bootstrap_interval(scores, seed=3)
    assert interval.mean == pytest.approx(scores.mean())
    assert interval.low < scores.mean() < interval.high
    # independent coin flips: resampling questions sees a standard error of ~0.013 (300 questions' 5-seed means),
    # resampling seeds another ~0.013; together about 0.018, an interval about 0.07 wide (two-stage resampling
    # counts the within-seed noise twice: it errs wide, never narrow)
    assert 0.05 < interval.high - interval.low < 0.1
    assert bootstrap_interval(scores, seed=3) == interval


def test_paired_bootstrap_sees_a_shift_that_the_noise_hides_unpaired():
    rng = np.random.default_rng(0)
    difficulty = rng.random(400)  # questions differ a lot; the settings differ by a small, consistent amount
    a = np.stack([difficulty + 0.02 + rng.normal(0, 0.01, 400) for _ in range(3)])
    b = np.stack([difficulty + rng.normal(0, 0.01, 400) for _ in range(3)])
    paired = paired_bootstrap_interval(a, b)
    assert paired.mean == pytest.approx(a.mean() - b.mean())
    assert paired.excludes(0.0)
    unpaired_a, unpaired_b = bootstrap_interval(a, seed=1), bootstrap_interval(b, seed=2)
    assert unpaired_a.low < unpaired_b.high  # the two intervals overlap: only pairing separates them
    with pytest.raises(ValueError, match="equal shapes"):
        paired_bootstrap_interval(a, b[:2])


def test_the_cells_and_seeds_a_paired_test_needs():
    # (z_0.975 + z_0.8)^2 = (1.959964 + 0.841621)^2 = 7.848879; sd 0.5, delta 0.05: 7.848879 * 100 = 784.9 -> 785
    assert paired_cells_for_power(0.5, 0.05) == 785
    assert seeds_for_power(0.5, 0.05, questions=300) == 3  # 785 / 300 = 2.6
    assert seeds_for_power(0.5, 0.05, questions=1000) == 2  # one seed would do: two, so the seeds' spread shows
    # sd 0.4, delta 0.03: 7.848879 * 0.16 / 0.0009 = 1395.4 -> 1396 cells, 5 seeds of 300 questions
    assert seeds_for_power(0.4, 0.03, questions=300) == 5
    assert paired_cells_for_power(0.5, 0.05, power=0.9) > 785 and paired_cells_for_power(0.5, 0.05, alpha=0.01) > 785
    assert detectable_difference(0.5, 785) == pytest.approx(0.05, abs=1e-4)  # the inverse
    assert detectable_difference(0.4, 1500) == pytest.approx(2.801585 * 0.4 / np.sqrt(1500), abs=1e-6)
    for bad in ({"sd_paired": -0.1, "delta": 0.03}, {"sd_paired": 0.4, "delta": 0.0}):
        with pytest.raises(ValueError, match="sd_paired"):
            paired_cells_for_power(**bad)
    with pytest.raises(ValueError, match="questions"):
        seeds_for_power(0.4, 0.03, questions=0)
