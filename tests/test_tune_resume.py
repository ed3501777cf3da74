"""Resuming an interrupted Ray Tune sweep (``tune.py --resume OUTPUT``): the sweep's own options are read back; a
restored trial continues its rows and its MLflow run; the driver marks the runs of unfinished trials KILLED; and, in
the slow tier, a sweep stopped by Ctrl-C ends with every trial's iterations once, each in one MLflow run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import ray
from mlflow.tracking import MlflowClient

from experiments.cli import SettingsError
from experiments.tracking import (
    METRICS_FILE,
    RUNS_FILE,
    TRIAL_TAG,
    EndTrialRuns,
    RunTracker,
    read_rows,
    read_run_records,
)
from experiments.tune import SWEEP_COMMAND, main, plan
from tests.test_tracking import trial_algorithm

ROOT = Path(__file__).resolve().parent.parent
TINY = ["--model", "tiny-random", "--max-step-tokens", "8", "--prompts-per-iter", "2", "--micro-batch-size", "6"]


def saved_sweep(output: Path, argv: list[str], cwd: Path) -> None:
    """What a sweep leaves in its --output when it starts: its command and Tune's state (here, its marker file)."""
    output.mkdir(parents=True, exist_ok=True)
    (output / SWEEP_COMMAND).write_text(json.dumps({"argv": argv, "cwd": str(cwd)}))
    (output / "sweep").mkdir()
    (output / "sweep" / "tuner.pkl").write_bytes(b"")  # what Tune.can_restore looks for


def test_resume_plans_the_sweep_with_its_own_options_from_its_directory(tmp_path, monkeypatch):
    start = tmp_path / "project"
    start.mkdir()
    (start / "sweep.yaml").write_text("lr: 3.0e-6\n")
    output = tmp_path / "out"
    saved_sweep(output, ["--config", "sweep.yaml", "--grid", "M=1,2", "--iterations", "7", "--output", "rel"], start)
    monkeypatch.chdir(tmp_path)
    base, trials, options = plan(["--resume", str(output)])
    assert Path.cwd() == start  # the sweep's relative paths (its --config) read from where it ran
    assert base.output == str(output) and base.iterations == 7 and base.lr == 3e-6
    assert [t.M for t in trials] == [1, 2]
    assert options.resume == output / "sweep"


def test_resume_takes_no_other_option_and_needs_a_sweep(tmp_path):
    output = tmp_path / "out"
    with pytest.raises(SettingsError, match=f"--resume {output}: no sweep to continue there; a sweep's --output "
                                            f"holds {SWEEP_COMMAND} \\(its options\\) and sweep/"):
        plan(["--resume", str(output)])
    saved_sweep(output, ["--iterations", "2"], tmp_path)
    with pytest.raises(SettingsError, match="the options it started with; drop --iterations 3"):
        plan(["--resume", str(output), "--iterations", "3"])
    # a new sweep into it is refused, naming --resume
    with pytest.raises(SettingsError, match=f"continue it with --resume {output}"):
        plan(["--output", str(output)])
    (output / SWEEP_COMMAND).write_text(json.dumps({"argv": [], "cwd": str(tmp_path / "gone")}))
    with pytest.raises(SettingsError, match=r"the sweep ran from .*gone, which is gone"):
        plan([f"--resume={output}"])


def test_a_sweep_stopped_before_tune_saved_its_state_starts_again(tmp_path):
    """Killed between writing its command and Tune's first save: nothing to continue, nothing to keep."""
    output = tmp_path / "out"
    output.mkdir()
    (output / SWEEP_COMMAND).write_text(json.dumps({"argv": ["--output", str(output), "--grid", "M=1,2"],
                                                    "cwd": str(tmp_path)}))
    with pytest.raises(SettingsError, match=f"stopped before Ray Tune saved its state .* start it again: python "
                                            f"experiments/tune.py --output {output} --grid M=1,2"):
        plan(["--resume", str(output)])
    assert [t.M for t in plan(["--output", str(output), "--grid", "M=1,2"])[1]] == [1, 2]


def result(iteration: int) -> dict:
    return {"training_iteration": iteration, "iteration_time_s": 1.0}


def test_a_restored_trial_continues_its_rows_and_its_mlflow_run(tmp_path):
    """Tune gives a restored trial a new, empty working directory and brings back only its checkpoint: the tracker
    brings back its rows and its MLflow record from the trial's kept directory, drops the rows after the checkpoint
    (the first row it writes names the iteration), and continues the run the driver marked KILLED."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    kept = tmp_path / "sweep" / "trial_0"
    first = RunTracker(mlflow_uri=uri)
    first.on_algorithm_init(algorithm=trial_algorithm(kept, kept))  # a fresh trial: nothing kept yet
    assert first.mlflow.enabled and read_run_records(kept)
    for iteration in (1, 2, 3):
        first.on_train_result(algorithm=None, result=result(iteration))
    EndTrialRuns(uri, "tree-grpo").on_experiment_end(trials=[SimpleNamespace(status="TERMINATED",
                                                                            last_result={}, path=str(kept))])
    client = MlflowClient(uri)
    assert client.get_run(first.mlflow.run_id).info.status == "KILLED"
    # restored from the checkpoint of iteration 2, in a new working directory
    working = tmp_path / "session_2" / "trial_0"
    restored = RunTracker(mlflow_uri=uri)
    restored.on_algorithm_init(algorithm=trial_algorithm(working, kept))
    assert restored.mlflow.run_id == first.mlflow.run_id
    assert client.get_run(first.mlflow.run_id).info.status == "RUNNING"
    restored.on_train_result(algorithm=None, result=result(3))
    assert [row["iteration"] for row in read_rows(working / METRICS_FILE)] == [1, 2, 3]
    assert {(working / name).exists() for name in (METRICS_FILE, RUNS_FILE)} == {True}
    # run.py's algorithms have no Tune storage: nothing is brought back, a new run is started
    plain = RunTracker(mlflow_uri=uri)
    plain.on_algorithm_init(algorithm=trial_algorithm(tmp_path / "run", None))
    assert plain.mlflow.run_id != first.mlflow.run_id


def test_a_trial_restarted_from_its_start_rewrites_its_rows(tmp_path):
    """A trial with no checkpoint restarts at iteration 1: its earlier rows are dropped, not duplicated."""
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / METRICS_FILE).write_text("".join(json.dumps({"iteration": i}) + "\n" for i in (1, 2)))
    working = tmp_path / "working"
    tracker = RunTracker()
    tracker.on_algorithm_init(algorithm=trial_algorithm(working, kept))
    tracker.on_train_result(algorithm=None, result=result(1))
    assert [row["iteration"] for row in read_rows(working / METRICS_FILE)] == [1]
    tracker.on_train_result(algorithm=None, result=result(2))  # later rows are appended
    assert [row["iteration"] for row in read_rows(working / METRICS_FILE)] == [1, 2]


def test_the_driver_ends_unfinished_trials_killed_with_their_rows(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    trackers, trials = [], []
    # an interrupted sweep's trials are stopped as TERMINATED too: only the last result's "done" tells them apart
    for trial_id, status, last in (("t_0", "TERMINATED", {"done": True}), ("t_1", "ERROR", {}),
                                   ("t_2", "TERMINATED", {"done": False}), ("t_3", "PENDING", {})):
        directory = tmp_path / trial_id
        tracker = RunTracker(mlflow_uri=uri)
        tracker.on_algorithm_init(algorithm=trial_algorithm(directory, directory))
        tracker.on_train_result(algorithm=None, result=result(1))
        trackers.append(tracker)
        trials.append(SimpleNamespace(status=status, last_result=last, path=str(directory)))
    EndTrialRuns(uri, "tree-grpo").on_experiment_end(trials=trials)
    client = MlflowClient(uri)
    runs = [client.get_run(tracker.mlflow.run_id) for tracker in trackers]
    # ended trials are on_trial_complete's and on_trial_error's to end
    assert [run.info.status for run in runs] == ["RUNNING", "RUNNING", "KILLED", "KILLED"]
    assert [run.data.tags[TRIAL_TAG] for run in runs] == ["t_0", "t_1", "t_2", "t_3"]  # the trials' directories
    assert [item.path for item in client.list_artifacts(runs[2].info.run_id)] == [METRICS_FILE]
    EndTrialRuns(uri, "tree-grpo").on_trial_complete(iteration=1, trials=trials, trial=trials[0])
    assert [item.path for item in client.list_artifacts(runs[0].info.run_id)] == [METRICS_FILE]


@pytest.mark.slow
def test_a_sweep_stopped_by_ctrl_c_resumes_to_every_iteration_once(data_dir, tmp_path):
    output = tmp_path / "sweep_out"
    command = [sys.executable, "experiments/tune.py", *TINY, "--grid", "M=1,2", "--iterations", "4",
               "--checkpoint-every", "1", "--max-concurrent", "1", "--output", str(output)]
    log = tmp_path / "stderr.log"
    with log.open("wb") as stderr:  # a file, not a pipe: Tune's progress would fill a pipe nobody reads
        process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=stderr,
                                   env={**os.environ, "PYTHONPATH": str(ROOT)})
        deadline = time.monotonic() + 300
        while not any(read_rows(path) for path in (output / "sweep").glob(f"*/{METRICS_FILE}")):
            assert process.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "no trial reported"
            time.sleep(0.5)
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=300) == 130, log.read_text()[-3000:]
    assert (f"interrupted with 2 of 2 trials unfinished; continue it with: python experiments/tune.py --resume "
            f"{output}") in log.read_text()  # the second not yet started: --max-concurrent 1
    client = MlflowClient(f"sqlite:///{output / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("tree-grpo").experiment_id
    assert "KILLED" in {run.info.status for run in client.search_runs([experiment])}

    main(["--resume", str(output)])
    ray.shutdown()
    trials = json.loads((output / "tune_results.json").read_text())["trials"]
    assert sorted(t["M"] for t in trials) == [1, 2] and all(t["iterations"] == 4 for t in trials)
    for trial in (output / "sweep").glob("*/"):
        if trial.is_dir() and (trial / "params.json").exists():
            assert [row["iteration"] for row in read_rows(trial / METRICS_FILE)] == [1, 2, 3, 4], trial
    runs = client.search_runs([experiment])
    assert len(runs) == 2 and {run.info.status for run in runs} == {"FINISHED"}  # one MLflow run a trial
