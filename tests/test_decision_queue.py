"""benchmarks/decision_queue.sh: the decision test's order (check, rule, start, two workers, records, report), run with
a stand-in for python that logs each call, so that the order is seen without training anything."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest

from benchmarks.studies import ARCHIVE, LEGACY_ARCHIVE

QUEUE = Path(__file__).resolve().parents[1] / "benchmarks" / "decision_queue.sh"

STAND_IN = """#!/usr/bin/env bash
echo "$*" >> "$CALLS"
case "$*" in
  *"--rule"*) exit "$RULE_EXIT" ;;
  "-c "*) echo 0123abcd ;;
  *"--seeds 1 3"*) exit "$ODD_EXIT" ;;
esac
"""


def run_queue(tmp_path: Path, rule_exit: int = 0, odd_exit: int = 0,
              records: str | None = None) -> tuple[int, list[str], str]:
    """``records``: the name of the decision test's records archive to leave in results/decision_test/."""
    python = tmp_path / "python"
    python.write_text(STAND_IN)
    python.chmod(python.stat().st_mode | stat.S_IEXEC)
    if records:
        (tmp_path / "results" / "decision_test").mkdir(parents=True)
        (tmp_path / "results" / "decision_test" / records).write_bytes(b"")
    calls = tmp_path / "calls.log"
    env = {**os.environ, "PYTHON": str(python), "CALLS": str(calls), "RULE_EXIT": str(rule_exit),
           "ODD_EXIT": str(odd_exit), "SAVE_EVERY": "0.1"}
    done = subprocess.run(["bash", str(QUEUE), "out"], cwd=tmp_path, env=env, capture_output=True, text=True)
    return done.returncode, calls.read_text().splitlines(), done.stdout


def script(call: str) -> str:
    return call.split()[0]


def test_a_go_runs_the_check_the_rule_the_start_both_workers_the_records_and_the_report(tmp_path):
    code, calls, _ = run_queue(tmp_path)
    assert code == 0
    assert calls[:3] == ["benchmarks/decision_check.py --output out",
                         "benchmarks/decision_check.py --rule out/start-check.json",
                         "benchmarks/bench_decision.py --resume --start-only --output out"]
    workers = [c for c in calls if "--seeds" in c]
    assert sorted(c.split("--seeds ")[1] for c in workers) == ["0 2 4 6 8 10 12 14 16 18",
                                                               "1 3 5 7 9 11 13 15 17 19"]
    assert calls[-2:] == ["benchmarks/run_records.py save out", "benchmarks/bench_decision.py --resume --report "
                                                                 "--output out"]
    assert not any("restore" in c for c in calls)  # nothing kept yet: nothing to restore


def test_a_stop_starts_no_run(tmp_path):
    code, calls, said = run_queue(tmp_path, rule_exit=1)
    assert code == 1 and [script(c) for c in calls] == ["benchmarks/decision_check.py"] * 2
    assert "the rule says stop: no run starts" in said


@pytest.mark.parametrize("archive", [ARCHIVE, LEGACY_ARCHIVE])  # the legacy one: saved by an older checkout
def test_a_restart_restores_the_records_and_does_not_check_again(tmp_path, archive):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "start-check.json").write_text("{}")
    code, calls, _ = run_queue(tmp_path, records=archive)
    assert code == 0
    assert calls[:2] == ["benchmarks/run_records.py restore out", "benchmarks/decision_check.py --rule "
                                                                  "out/start-check.json"]


def test_a_failed_worker_keeps_the_records_and_reports_nothing(tmp_path):
    code, calls, said = run_queue(tmp_path, odd_exit=3)
    assert code == 3 and "a worker failed (exit 3): rerun this script, which resumes" in said
    assert calls[-1] == "benchmarks/run_records.py save out" and not any("--report" in c for c in calls)
