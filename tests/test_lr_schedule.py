"""The learning-rate schedule, by hand."""

from __future__ import annotations

import pytest

from algos.lr_schedule import scheduled_lr, warmup_steps_of


def test_linear_warmup_then_constant():
    assert [scheduled_lr(1.0, s, warmup_steps=4) for s in (1, 2, 3, 4, 5, 100)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert scheduled_lr(0.3, 1) == 0.3  # no warm-up


def test_cosine_after_warmup_reaches_zero_at_the_last_step():
    # warm-up 2 of 6 steps; then 4 decay steps: progress 1/4, 2/4, 3/4, 1 -> 0.5 (1 + cos(pi p))
    values = [scheduled_lr(2.0, s, warmup_steps=2, total_steps=6, schedule="cosine") for s in range(1, 8)]
    assert values == pytest.approx([1.0, 2.0, 1.7071068, 1.0, 0.2928932, 0.0, 0.0])


def test_cosine_needs_the_total_and_steps_count_from_one():
    with pytest.raises(ValueError, match="total number of optimizer steps"):
        scheduled_lr(1.0, 3, schedule="cosine")
    with pytest.raises(ValueError, match="count from 1"):
        scheduled_lr(1.0, 0)
    with pytest.raises(ValueError, match="unknown lr schedule 'linear'"):
        scheduled_lr(1.0, 1, schedule="linear")


def test_warmup_steps_of_a_ratio():
    assert warmup_steps_of(0.285, 180) == 52  # the paper's tree runs: 28.5% of 180 steps, rounded up
    assert warmup_steps_of(0.5, 7) == 4
    assert warmup_steps_of(0.285, None) == 0 and warmup_steps_of(0.0, 100) == 0
