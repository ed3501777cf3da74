"""The pipelining protocol's reading (benchmarks/pipelining_learning.py), on hand-computed runs."""

from __future__ import annotations

import json

import numpy as np
import pytest

from benchmarks import pipelining_learning as learning
from experiments.confidence import Interval


@pytest.mark.parametrize(("interval", "expected"), [
    (Interval(0.0, -0.05, 0.1), "not worse"),  # the lower bound at the margin
    (Interval(-0.1, -0.2, -0.01), "worse"),
    (Interval(0.0, -0.06, 0.05), "undecided"),
    (Interval(-0.03, -0.04, -0.01), "not worse"),  # below 0 yet within the margin: not worse wins
])
def test_the_decision_reads_the_interval_as_the_protocol_says(interval, expected):
    assert learning.decision(interval) == expected


def write_run(directory, before, after, rows):
    directory.mkdir(parents=True)
    questions = {"before": [{"em": em} for em in before], "after": [{"em": em} for em in after]}
    (directory / "demo.json").write_text(json.dumps({"questions": questions}))
    (directory / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))


def test_runs_are_paired_by_seed_and_question(tmp_path):
    before = [0, 0, 1, 0]  # the start: 0.25
    after = {(0, 0): [1, 0, 1, 0], (0, 1): [1, 1, 0, 0], (1, 0): [1, 1, 1, 0], (1, 1): [1, 1, 0, 0]}
    for (k, seed), ems in after.items():
        rows = [{"time_s": 30.0 * (k + 1), "staleness": k, "sampler_ratio_mean": 1.0 - 0.1 * k * seed,
                 "tis_weight_mean": 1.0}] * 2
        write_run(learning.run_directory(tmp_path, k, seed), before, ems, rows)
    reading = learning.read_runs(tmp_path, [0, 1])
    assert reading["start_em"] == 0.25 and (reading["seeds"], reading["questions"]) == (2, 4)
    assert reading["arms"][0] == {"em": 0.5, "change": 0.25, "per_seed": [0.5, 0.5]}
    assert reading["arms"][1] == {"em": 0.625, "change": 0.375, "per_seed": [0.75, 0.5]}
    assert reading["per_seed_difference"] == [0.25, 0.0]
    assert reading["difference"]["mean"] == pytest.approx(0.125)
    assert reading["sign_flip_p"] == 1.0  # every sign assignment of (0.25, 0) sums to 0.25 in size
    assert reading["training_minutes"] == {0: [1.0, 1.0], 1: [2.0, 2.0]}
    assert reading["k1_means"] == pytest.approx({"staleness": 1.0, "sampler_ratio_mean": 0.95, "tis_weight_mean": 1.0})
    text = learning.report(reading, [0, 1])
    assert "K = 1 - K = 0: +0.125" in text and f"**{reading['decision']}**" in text
    assert np.isclose(reading["t_interval"]["mean"], 0.125)
