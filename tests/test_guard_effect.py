"""benchmarks/guard_effect.py: the saturation guard's comparison read from run directories, by its declared rule."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import guard_effect
from benchmarks.guard_effect import guard_reading, run_record
from benchmarks.learning_runs import run_directory

SETTING = "tree (2,2,1) uniform"


def write_run(output: Path, seed: int, *, correct: int, questions: int = 20, rewards=(0.5, 1.0, 1.0),
              kls=(0.01, 0.02, 0.6)) -> Path:
    """A finished benchmark run: one metrics row per iteration (100 tokens each, a curve row between) and a final
    evaluation with ``correct`` of ``questions`` right."""
    directory = run_directory(SETTING, seed, output)
    directory.mkdir(parents=True)
    rows = [{"iteration": i + 1, "tokens_generated": 100, "reward_mean": r, "kl": k}
            for i, (r, k) in enumerate(zip(rewards, kls, strict=True))]
    rows.insert(1, {"iteration": 1, "dev_em": 0.5})
    (directory / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    scores = [{"em": float(i < correct)} for i in range(questions)]
    (directory / "held_out.json").write_text(json.dumps({"run": [], "scores": scores}), encoding="utf-8")
    return directory


def test_a_run_record_reads_training_rows_and_the_final_evaluation(tmp_path):
    record = run_record(write_run(tmp_path, 0, correct=15, rewards=(0.25, 0.75, 1.0), kls=(0.01, 0.3, 0.2)))
    assert (record.iterations, record.tokens) == (3, 300)  # the curve row is not an iteration
    assert record.largest_kl == pytest.approx(0.3) and record.last_reward == 1.0
    assert record.em == pytest.approx(0.75)


def test_an_unfinished_run_is_named_with_what_is_missing(tmp_path):
    directory = run_directory(SETTING, 3, tmp_path)
    directory.mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match=r"seed3/held_out.json: not found.*--resume"):
        run_record(directory)


def records(tmp_path: Path, correct: dict[int, int], name: str) -> dict:
    return {seed: run_record(write_run(tmp_path / name, seed, correct=c)) for seed, c in correct.items()}


def test_a_collapse_the_guard_prevents_at_no_cost(tmp_path):
    # seed 2 collapses unguarded (2/20 = 0.1 < 0.5) and ends 19/20 = 0.95 >= 0.9 guarded; seeds 0 and 1 end alike
    unguarded = records(tmp_path, {0: 18, 1: 19, 2: 2}, "unguarded")
    guarded = records(tmp_path, {0: 18, 1: 19, 2: 19}, "guarded")
    reading = guard_reading(unguarded, guarded)
    assert reading["collapsing_seeds"] == [2] and reading["prevented"]
    assert reading["on_collapsing"].mean == pytest.approx(0.85)  # 0.95 - 0.10
    assert reading["cost_on_others"].mean == pytest.approx(0.0) and reading["costs_nothing"]


def test_a_guard_that_stops_too_early_is_read_as_a_cost(tmp_path):
    # no seed collapses; guarded runs lose 10 of 20 questions at both seeds: -0.5, far below -0.05
    unguarded = records(tmp_path, {0: 18, 1: 18}, "unguarded")
    guarded = records(tmp_path, {0: 8, 1: 8}, "guarded")
    reading = guard_reading(unguarded, guarded)
    assert reading["collapsing_seeds"] == [] and not reading["prevented"] and reading["on_collapsing"] is None
    assert reading["cost_on_others"].mean == pytest.approx(-0.5) and not reading["costs_nothing"]
    assert "nothing to prevent" in guard_effect.markdown(unguarded, guarded, reading)


def test_a_collapse_the_guard_does_not_prevent(tmp_path):
    unguarded = records(tmp_path, {0: 18, 1: 1}, "unguarded")
    guarded = records(tmp_path, {0: 18, 1: 12}, "guarded")  # 0.6 < 0.9
    reading = guard_reading(unguarded, guarded)
    assert reading["collapsing_seeds"] == [1] and not reading["prevented"]
    assert "| 1 | 3 / 3 | 300 / 300 | 0.600 / 0.600 | 1.00 / 1.00 | 0.050 / 0.600 | yes |" in guard_effect.markdown(
        unguarded, guarded, reading)


def test_the_runs_compared_need_the_same_seeds(tmp_path):
    with pytest.raises(ValueError, match="same seeds"):
        guard_reading(records(tmp_path, {0: 18}, "unguarded"), records(tmp_path, {1: 18}, "guarded"))


def test_main_reads_both_outputs_and_writes_its_section(tmp_path, monkeypatch):
    for seed, (a, b) in enumerate([(18, 18), (1, 19)]):
        write_run(tmp_path / "u", seed, correct=a)
        write_run(tmp_path / "g", seed, correct=b)
    monkeypatch.chdir(tmp_path)
    reading = guard_effect.main(["--unguarded", "u", "--guarded", "g", "--seeds", "0", "1", "--report"])
    assert reading["collapsing_seeds"] == [1] and reading["prevented"] and reading["costs_nothing"]
    docs = (tmp_path / "results" / "saturation_guard" / "README.md").read_text(encoding="utf-8")  # its study's
    assert "<!-- saturation-guard:begin -->" in docs and "python benchmarks/guard_effect.py --unguarded u" in docs
