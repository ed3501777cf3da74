"""Confidence intervals, checked against hand-computed values."""

from __future__ import annotations

import numpy as np
import pytest

from experiments.confidence import (
    Interval,
    SignTest,
    bootstrap_interval,
    censored_order,
    censored_sign_test,
    detectable_difference,
    holm_adjusted,
    mean_interval,
    paired_bootstrap_interval,
    paired_cells_for_power,
    paired_difference_interval,
    seeds_for_power,
    sign_flip_p_value,
    t_test_p_value,
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


def test_t_test_p_value_by_hand():
    # [1, 2, 3]: mean 2, sd 1, t = 2 / (1 / sqrt 3) = 2 sqrt 3 on 2 degrees of freedom, whose CDF is
    # 1/2 + t / (2 sqrt(2 + t^2)); p = 2 (1 - F(t)) = 1 - t / sqrt(2 + t^2) = 1 - sqrt(12 / 14)
    assert t_test_p_value([1, 2, 3]) == pytest.approx(1 - np.sqrt(12 / 14))
    assert t_test_p_value([-1, -2, -3]) == pytest.approx(1 - np.sqrt(12 / 14))
    assert t_test_p_value([0.5, 0.5]) == 0.0  # no spread, not zero: the sign is certain
    assert t_test_p_value([0, 0, 0]) == 1.0
    assert t_test_p_value([4.0]) == 1.0


def test_sign_flip_p_value_counts_every_sign_assignment():
    # [1, 2, 3]: the 8 signed sums are +-6, +-4, +-2, 0, 0; |sum| >= 6 in 2 of them
    assert sign_flip_p_value([1, 2, 3]) == 0.25
    # [3, 1, 1]: sums 5, 3, 3, 1, -1, -3, -3, -5; |sum| >= 5 in 2 of 8
    assert sign_flip_p_value([3, 1, 1]) == 0.25
    # [3, 1, -1] has the same |values|, so the same null sums, and |observed sum| 3: 6 of the 8 are that far out
    assert sign_flip_p_value([3, 1, -1]) == 0.75
    assert sign_flip_p_value([1, -1]) == 1.0  # observed sum 0: every assignment is as extreme
    assert sign_flip_p_value([0.1] * 6) == 2 / 64  # the smallest p 6 seeds can give
    assert sign_flip_p_value([0.1] * 20) == 2 / 2**20  # 20 seeds, the exact limit: every one of 2^20 counted
    # 19 ones and a -1, |sum| 18: the assignments with at most one or at least 19 minus signs, 2 x (1 + 20)
    assert sign_flip_p_value([1.0] * 19 + [-1.0]) == 42 / 2**20
    with pytest.raises(ValueError):
        sign_flip_p_value([])


def test_holm_adjusted_by_hand():
    # sorted 0.01, 0.03, 0.04 times 3, 2, 1: 0.03, 0.06, 0.04 -> running max 0.03, 0.06, 0.06; back in input order
    assert holm_adjusted([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
    assert holm_adjusted([0.5, 0.4]) == pytest.approx([0.8, 0.8])  # 0.4 x 2, then max(0.5 x 1, 0.8)
    assert holm_adjusted([0.6, 0.7]) == pytest.approx([1.0, 1.0])  # 0.6 x 2 capped at 1
    assert holm_adjusted([0.02]) == pytest.approx([0.02])  # one comparison: nothing to correct


def test_censored_order_orders_only_what_is_known():
    assert censored_order(3, 10, 5, 10) == -1  # both reached: a sooner
    assert censored_order(5, 10, 3, 10) == 1
    assert censored_order(4, 10, 4, 10) == 0  # a tie
    assert censored_order(8, 10, None, 9) == -1  # b never reached it by 9: later than a's 8
    assert censored_order(9, 10, None, 9) == -1  # a at b's end: still no later
    assert censored_order(12, 13, None, 9) == 0  # b stopped at 9, before a's 12: b might have reached it at 10
    assert censored_order(None, 9, 8, 10) == 1
    assert censored_order(None, 9, 12, 13) == 0
    assert censored_order(None, 9, None, 13) == 0  # both never reached it


def test_censored_sign_test_by_hand():
    # 5 ordered pairs, all a sooner: p = 2 / 2^5; the unordered pair is left out
    assert censored_sign_test([-1, -1, -1, -1, -1, 0]) == SignTest(5, 0, 1, 2 / 32)
    # 4 sooner, 1 later of 5: P(X <= 1) = 6 / 32, two-sided 12 / 32
    assert censored_sign_test([-1, -1, 1, -1, -1]).p == pytest.approx(12 / 32)
    assert censored_sign_test([0, 0]) == SignTest(0, 0, 2, 1.0)
