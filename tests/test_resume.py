"""Resuming a run: 3 iterations straight and 1 + resume 2 give identical metrics and bit-identical weights on CPU
(warm-up on), in the run's own directory, continuing its MLflow run; a signal saves a checkpoint and exits
non-zero (slow tier)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray
import torch
from mlflow.tracking import MlflowClient

from experiments.checkpoints import verify_checkpoint
from experiments.cli import read_yaml
from experiments.evaluate import load_policy
from experiments.run import main, plan
from experiments.settings import RunSettings
from experiments.tracking import read_rows

FAST = ["--model", "tiny-random", "--max-step-tokens", "8", "--prompts-per-iter", "2", "--micro-batch-size", "6",
        "--lr", "1e-3", "--warmup-steps", "4", "--checkpoint-every", "0", "--quiet", "--trees-every", "1",
        "--trees-count", "1"]
def without_times(rows: list[dict]) -> list[dict]:
    """The rows without the columns that measure the machine, the only ones that may differ: wall-clock times
    (every one ends in ``time_s``) and the learner's peak memory (on a CPU the process's resident set)."""
    return [{k: v for k, v in row.items() if not k.endswith("time_s") and k != "learner_peak_memory_gib"}
            for row in rows]


def weights(run: Path) -> dict[str, torch.Tensor]:
    return load_policy(str(run / "checkpoints" / "latest"))[0].state_dict()


def test_three_iterations_equal_one_plus_resume_two(ray_session, data_dir, tmp_path, test_root):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    results = test_root / "ray_results"  # where RLlib's default result logger would write (~/ray_results for a user)
    before = set(results.iterdir()) if results.is_dir() else set()
    main([*FAST, "--iterations", "3", "--output", str(straight)])
    assert (set(results.iterdir()) if results.is_dir() else set()) == before
    main([*FAST, "--iterations", "1", "--output", str(resumed)])
    main(["--resume", str(resumed), "--iterations", "2"])  # continues in its own directory, same settings

    rows, rows_resumed = read_rows(straight / "metrics.jsonl"), read_rows(resumed / "metrics.jsonl")
    assert [r["iteration"] for r in rows_resumed] == [1, 2, 3]
    assert [r["learning_rate"] for r in rows] == pytest.approx([2.5e-4, 5e-4, 7.5e-4])  # warm-up not restarted
    assert without_times(rows_resumed) == without_times(rows)
    a, b = weights(straight), weights(resumed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    client = MlflowClient(f"sqlite:///{resumed / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("tree-grpo").experiment_id])
    assert run.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "reward_mean")] == [1, 2, 3]
    assert run.data.tags["changed_on_resume/iterations"] == "1 -> 2 (from iteration 2)"
    # config.yaml keeps the run's settings (--config repeats the run); the resumed invocation is recorded beside it
    first = plan([*FAST, "--iterations", "1", "--output", str(tmp_path / "new")]).settings.model_copy(
        update={"output": str(resumed)})
    assert RunSettings.model_validate(read_yaml(resumed / "config.yaml", RunSettings)[0]) == first
    record = resumed / "resumes" / "iter_000002.yaml"
    assert read_yaml(record, RunSettings)[0]["iterations"] == 2
    header = record.read_text()
    assert f"--resume {resumed} --iterations 2" in header and "# changed: iterations: 1 -> 2" in header
    trees = {item.path for item in client.list_artifacts(run.info.run_id, "trees")}
    assert "trees/iter_00003.html" in trees  # tracking did not go quiet after the resume
    checkpoints = sorted(p.name for p in (resumed / "checkpoints").iterdir())
    assert checkpoints == ["iter_000001", "iter_000003", "latest"]  # the last two kept


def wait_for_rows(path: Path, count: int, process: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while len(read_rows(path)) < count:
        assert process.poll() is None, (process.stderr.read().decode()[-3000:] if process.stderr else
                                        f"the run exited with {process.returncode}")
        assert time.monotonic() < deadline, "no progress"
        time.sleep(0.5)


@pytest.mark.slow
@pytest.mark.parametrize(("first", "second", "status", "options"), [
    (signal.SIGTERM, signal.SIGINT, 143, []), (signal.SIGINT, None, 130, []),
    (signal.SIGINT, None, 130, ["--num-env-runners", "1", "--max-staleness", "1"])], ids=["term-int", "int", "ahead"])
def test_a_signal_saves_once_and_exits_non_zero(data_dir, tmp_path, first, second, status, options):
    command = [sys.executable, "experiments/run.py", *FAST, *options, "--iterations", "50", "--output", str(tmp_path),
               "--no-mlflow"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    wait_for_rows(tmp_path / "metrics.jsonl", 1, process)
    process.send_signal(first)
    if second is not None:  # the second signal lands while the checkpoint is written
        time.sleep(0.3)
        process.send_signal(second)
    assert process.wait(timeout=300) == status, process.stderr.read().decode()[-3000:]
    latest = (tmp_path / "checkpoints" / "latest").resolve()
    verify_checkpoint(latest)
    done = len(read_rows(tmp_path / "metrics.jsonl"))
    assert latest.name == f"iter_{done:06d}"
    main(["--resume", str(tmp_path), "--iterations", "1"])  # and the run continues from it
    assert [r["iteration"] for r in read_rows(tmp_path / "metrics.jsonl")] == list(range(1, done + 2))
    ray.shutdown()
