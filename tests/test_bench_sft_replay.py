"""bench_sft_replay's table: each epoch's seconds, the ratios every epoch / replay per round and their mean, the
loss curves' largest gap."""

from __future__ import annotations

import argparse

from benchmarks.bench_sft_replay import report


def test_the_ratios_are_every_epoch_over_replay_for_epoch_two_and_the_whole():
    args = argparse.Namespace(questions=4, rounds=2)
    data = [([1, 2, 3], [0, 1, 1]), ([4, 5], [0, 1])]
    rounds = [{"replay": {"epoch_s": [30.0, 20.0], "loss": [0.5, 0.25]},
               "every epoch": {"epoch_s": [30.0, 30.0], "loss": [0.5, 0.25001]}},
              {"replay": {"epoch_s": [40.0, 25.0], "loss": [0.5, 0.25]},
               "every epoch": {"epoch_s": [40.0, 40.0], "loss": [0.5, 0.25]}}]
    text = report(rounds, args, data)
    assert "on 2 oracle trajectories (5 tokens)" in text
    assert "| 1 | replay | 30.0 | 20.0 | 50.0 | 0.50000, 0.25000 |" in text
    # epoch 2: 30 / 20 = 1.50 and 40 / 25 = 1.60, mean 1.55; whole: 60 / 50 = 1.20 and 80 / 65 = 1.23, mean 1.22
    assert "Epoch 2: **1.55x** (rounds: 1.50, 1.60); the whole fine-tuning **1.22x** (1.20, 1.23)" in text
    assert "differ by at most 1.0e-05" in text
