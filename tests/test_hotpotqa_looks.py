"""benchmarks/hotpotqa_looks.py: two looks at the same runs, read from the studies' compressed records."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import benchmarks.bench_hotpotqa as bench
import benchmarks.hotpotqa_looks as looks


def write_look(output: Path, runs: dict[int, tuple[str, list[float], list[tuple[float, float]]]]) -> None:
    """A benchmark output: the start's evaluation, and per seed its start, per-question EM and metrics rows
    (mixed-reward share, seconds)."""
    for digest in {start for start, _, _ in runs.values()}:
        directory = bench.start_eval_dir(output, digest)
        directory.mkdir(parents=True)
        (directory / "eval.json").write_text(json.dumps({"questions": {bench.ENV: [{"em": 0.0}] * 4}}))
    for seed, (start, ems, rows) in runs.items():
        run = bench.run_dir(output, "tree", seed)
        bench.bind_start(run, start)
        (run / "eval").mkdir()
        (run / "eval" / "eval.json").write_text(json.dumps({"questions": {bench.ENV: [{"em": em} for em in ems]}}))
        (run / "metrics.jsonl").write_text("".join(json.dumps({"nonzero_advantage_share": mixed, "time_s": seconds})
                                                   + "\n" for mixed, seconds in rows))


def saved(tmp_path: Path, name: str, runs: dict) -> Path:
    output, records = tmp_path / "outputs" / name, tmp_path / "results" / name
    write_look(output, runs)
    records.mkdir(parents=True)
    bench.save_records(output, records)
    return records


FIRST = {0: ("aaaa", [1, 0, 0, 0], [(0.5, 60.0)] * 2), 1: ("aaaa", [0, 0, 0, 0], [(0.5, 60.0)] * 2)}


def test_the_second_look_is_read_against_the_start_and_the_first_look(tmp_path):
    first = saved(tmp_path, "study", FIRST)
    later = [(0.5, 60.0), (0.5, 60.0), (0.25, 70.0), (0.25, 80.0)]
    second = saved(tmp_path, "study_40", {0: ("aaaa", [1, 1, 0, 0], later), 1: ("aaaa", [1, 1, 1, 0], later)})
    summary = looks.main([str(first), str(second)])
    assert summary["seeds"] == [0, 1]
    s0, s1 = summary["per_seed"][0], summary["per_seed"][1]
    assert s0["em"] == {"start": 0.0, "first": 0.25, "second": 0.5} and s0["iterations"] == [2, 4]
    assert s0["change_between_looks"]["mean"] == pytest.approx(0.25)
    assert s1["change_between_looks"]["mean"] == pytest.approx(0.75)
    assert s0["mixed_reward_share_between_looks"] == pytest.approx(0.25)  # the iterations after the first look only
    assert s0["training_s"] == pytest.approx(270.0)  # all 4 iterations
    narrow, wide = summary["pooled_change"].values()
    assert narrow["mean"] == pytest.approx(0.625) and wide["low"] <= narrow["low"] and wide["high"] >= narrow["high"]
    t = summary["change_t_over_seeds"]  # changes 0.5 and 0.75: sd 0.177, se 0.125, t(0.975, 1 df) 12.706
    assert (t["low"], t["high"]) == pytest.approx((0.625 - 1.588, 0.625 + 1.588), abs=1e-3)
    assert summary["sign_flip_p"] == pytest.approx(0.5)
    assert "| 0 | 2 -> 4 | 0.000 | 0.250 | 0.500 | +0.250 [" in looks.markdown(summary)


def test_looks_at_other_seeds_or_another_start_are_refused_by_name(tmp_path):
    first = saved(tmp_path, "study", FIRST)
    one_seed = saved(tmp_path, "one_seed", {0: ("aaaa", [1, 1, 0, 0], [(0.5, 60.0)] * 4)})
    with pytest.raises(SystemExit, match=r"other seeds: \[0, 1\] at the first, \[0\] at the second"):
        looks.main([str(first), str(one_seed)])
    other = saved(tmp_path, "other_start", {0: ("aaaa", [1, 1, 0, 0], [(0.5, 60.0)] * 4),
                                            1: ("bbbb", [1, 1, 0, 0], [(0.5, 60.0)] * 4)})
    with pytest.raises(SystemExit, match="seed 1 trained from the start aaaa at the first look and bbbb"):
        looks.main([str(first), str(other)])
    with pytest.raises(SystemExit, match="holds none"):
        looks.main([str(first), str(tmp_path / "nowhere")])
