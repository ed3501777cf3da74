"""bench_frozen_bottom's table: seconds summed past the first iteration, the ratio per round, the equality check."""

from __future__ import annotations

import argparse

from benchmarks.bench_frozen_bottom import report


def rows(update: list[float], iteration: list[float], rewards: list[float]) -> list[dict]:
    return [{"update_time_s": u, "scoring_time_s": u / 2, "time_s": t, "reward_mean": r, "policy_loss": 0.1,
             "grad_norm": 1.0} for u, t, r in zip(update, iteration, rewards, strict=True)]


def test_the_ratio_is_every_pass_over_replay_without_the_first_iteration_and_unequal_runs_are_flagged():
    args = argparse.Namespace(rounds=2, iterations=3)
    same = [0.1, 0.2, 0.3]
    rounds = [{"replay": rows([99, 10, 10], [99, 40, 40], same), "every pass": rows([1, 15, 15], [1, 50, 50], same)},
              {"replay": rows([99, 20, 20], [99, 50, 50], same),
               "every pass": rows([1, 25, 25], [1, 50, 50], [0.1, 0.2, 0.4])}]
    text = report(rounds, args)
    assert "| 1 | replay | 20.0 | 10.0 | 80.0 | yes |" in text
    assert "| 1 | every pass | 30.0 | 15.0 | 100.0 | yes |" in text
    assert "| 2 | every pass | 50.0 | 25.0 | 100.0 | **no** |" in text  # a reward differs: the replay was not exact
    # update: 30 / 20 = 1.50 and 50 / 40 = 1.25, mean 1.375; iteration: 100 / 80 = 1.25 and 100 / 100 = 1.00
    assert "**Update time: 1.38x faster with the replay** (rounds 1.50, 1.25)" in text
    assert "the whole iteration 1.12x (1.25, 1.00)" in text
