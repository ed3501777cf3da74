"""benchmarks/bench_hotpotqa.py: the start and the runs are evaluated on the same observations."""

from __future__ import annotations

from pathlib import Path

import benchmarks.bench_hotpotqa as bench
from experiments.qa_start import CPU_OBSERVATION_OPTIONS, CPU_QA_DEFAULTS


def test_the_start_is_evaluated_with_the_runs_observations_and_a_run_with_its_own(tmp_path, monkeypatch):
    commands = []
    monkeypatch.setattr(bench.subprocess, "run", lambda command, check: commands.append(command))
    bench.evaluate("START_DIR", tmp_path / "start", CPU_OBSERVATION_OPTIONS)
    bench.evaluate("RUN/checkpoints/latest", tmp_path / "run")
    start, run = (" ".join(command) for command in commands)
    assert (f"--topk {CPU_QA_DEFAULTS['topk']} --passage-words {CPU_QA_DEFAULTS['passage_words']} "
            f"--max-step-tokens {CPU_QA_DEFAULTS['max_step_tokens']}") in start
    assert "--topk" not in run and "--passage-words" not in run  # evaluate.py reads them from the run's config
    (tmp_path / "done").mkdir()
    (tmp_path / "done" / "eval.json").write_text("{}")
    bench.evaluate("START_DIR", Path(tmp_path / "done"), CPU_OBSERVATION_OPTIONS)
    assert len(commands) == 2  # evaluated once
