"""MLflow tracking of run.py: params, metric series and artifacts in a sqlite store; a real MLflow server serves
the run over REST; an unreachable store only warns."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
import urllib.request
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import ray
import torch
from mlflow.tracking import MlflowClient
from pyarrow.fs import LocalFileSystem

from experiments.evaluate import load_policy
from experiments.run import main
from experiments.tracking import (
    TRIAL_TAG,
    EndTrialRuns,
    MLflowRun,
    RunRecord,
    RunTracker,
    flatten,
    metrics_row,
    numeric_metrics,
    read_rows,
    read_run_records,
    truncate_rows,
)
from policies.models import load_model
from tests.ports import free_port, refused_port

FAST = ["--model", "tiny-random", "--max-step-tokens", "8", "--prompts-per-iter", "2", "--micro-batch-size", "6",
        "--checkpoint-every", "0", "--quiet"]


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory, data_dir):
    """Two tracked iterations with trees every iteration and a final evaluation on two envs."""
    output = tmp_path_factory.mktemp("tracked")
    if not ray.is_initialized():
        ray.init(num_cpus=2, object_store_memory=400_000_000, include_dashboard=False, log_to_driver=False)
    try:
        main([*FAST, "--iterations", "2", "--trees-every", "1", "--trees-count", "2", "--final-eval",
              "--eval-envs", "HotpotQA-v0", "NQ-v0", "--eval-questions", "2", "--output", str(output)])
    finally:
        ray.shutdown()
    uri = f"sqlite:///{output / 'mlflow.db'}"
    return output, uri, read_run_records(output)[-1].run_id


def artifact_paths(client: MlflowClient, run_id: str, path: str | None = None) -> set[str]:
    found = set()
    for item in client.list_artifacts(run_id, path):
        found |= artifact_paths(client, run_id, item.path) if item.is_dir else {item.path}
    return found


def test_run_logs_params_metrics_and_artifacts(tracked_run):
    output, uri, run_id = tracked_run
    client = MlflowClient(uri)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == output.name
    params = run.data.params
    assert params["algo"] == "tree_grpo" and params["M"] == "2" and params["model"] == "tiny-random"
    assert params["advantage_mode"] == "tree" and params["topk"] == "3" and params["kl_coef"] == "0.001"
    rows = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    for key in ("reward_mean", "tokens_generated", "leaves", "kl", "budget_chains_measured", "unique_token_share",
                "optimizer_steps", "sampler_ratio_mean"):
        history = client.get_metric_history(run_id, key)
        assert [m.step for m in history] == [1, 2], key
        assert [m.value for m in history] == pytest.approx([row[key] for row in rows]), key
    assert 0 < rows[-1]["unique_token_share"] < 1  # the trees' shared prompts and steps
    assert [row["optimizer_steps"] for row in rows] == [1, 2]  # 2 prompts: one mini-batch per iteration
    artifacts = artifact_paths(client, run_id)
    assert (output / "mlartifacts").is_dir()  # beside the store, not ./mlruns in the working directory
    assert {"config.yaml", "metrics.jsonl", "learning_curve.png", "eval/eval.md", "eval/eval.json",
            "trees/iter_00001.json", "trees/iter_00001.html", "trees/iter_00002.html"} <= artifacts


def test_tree_rendering_names_the_actions_and_the_learners_advantages(tracked_run):
    output, _, _ = tracked_run
    trees = json.loads((output / "trees" / "iter_00002.json").read_text())
    page = (output / "trees" / "iter_00002.html").read_text()
    assert len(trees) == 2

    def nodes(node):
        yield node
        for child in node["children"]:
            yield from nodes(child)

    for tree in trees:
        all_nodes = list(nodes(tree["root"]))
        assert len([n for n in all_nodes if n["is_leaf"]]) == tree["root"]["leaves"] == 3  # 1 chain + N=2
        for node in all_nodes:
            assert f"class='action {node['action']}'>{node['action']}<" in page
            assert math.isfinite(node["advantage"])


def test_final_evaluation_table_covers_both_envs(tracked_run):
    output, _, _ = tracked_run
    table = (output / "eval" / "eval.md").read_text()
    assert "| | NQ | single-hop avg | HotpotQA | multi-hop avg |" in table.splitlines()
    data = json.loads((output / "eval" / "eval.json").read_text())
    assert set(data["datasets"]) == {"HotpotQA-v0", "NQ-v0"}
    assert all(d["questions"] == 2 for d in data["datasets"].values())


def test_evaluate_loads_the_trained_policy_from_a_checkpoint(tracked_run):
    output, _, _ = tracked_run
    model, tokenizer = load_policy(str(output / "checkpoints" / "latest"))
    initial = load_model("tiny-random")[0].state_dict()  # the untrained start point
    trained = model.state_dict()
    assert set(trained) == set(initial) and tokenizer.chat_template
    assert any(not torch.equal(trained[k], initial[k]) for k in trained)  # two updates moved the weights


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


def test_mlflow_server_serves_the_run_over_rest(tracked_run, tmp_path):
    _, uri, run_id = tracked_run
    port = free_port()
    log = tmp_path / "server.log"  # a file, not a pipe: a server whose pipe nobody reads blocks, and never stops
    server = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", uri, "--host", "127.0.0.1",
         "--port", str(port), "--workers", "1"],
        stdout=subprocess.DEVNULL, stderr=log.open("wb"), env={**os.environ, "MLFLOW_ALLOW_FILE_STORE": "false"},
        start_new_session=True)  # its own process group: the server's workers are stopped with it
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"{base}/health", timeout=2).close()
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"mlflow server did not start: {log.read_text()[-2000:]}")
                time.sleep(0.5)
        run = get_json(f"{base}/api/2.0/mlflow/runs/get?run_id={run_id}")["run"]
        assert run["info"]["run_id"] == run_id
        params = {p["key"]: p["value"] for p in run["data"]["params"]}
        assert params["algo"] == "tree_grpo" and params["env"] == "HotpotQA-v0"
        history = get_json(f"{base}/api/2.0/mlflow/metrics/get-history?run_id={run_id}&metric_key=leaves")
        assert [m["step"] for m in history["metrics"]] == [1, 2]
        assert all(m["value"] == 12 for m in history["metrics"])  # 2 prompts x 6 leaves
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:  # slow to stop on busy cores: what it served was checked above
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def test_unreachable_tracking_uri_only_warns(data_dir, tmp_path):
    # the port stays refused while Ray starts its servers on ports of its choosing
    with refused_port() as port, pytest.warns(RuntimeWarning, match="MLflow tracking at http://127.0.0.1:.* failed"):
        main([*FAST, "--iterations", "1", "--output", str(tmp_path), "--mlflow-uri", f"http://127.0.0.1:{port}"])
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 1
    assert not read_run_records(tmp_path)
    ray.shutdown()


def test_no_mlflow_writes_no_store_and_needs_no_mlflow(tmp_path, monkeypatch):
    for name in [name for name in sys.modules if name == "mlflow" or name.startswith("mlflow.")]:
        monkeypatch.setitem(sys.modules, name, None)  # as on a machine without mlflow: importing it fails
    tracker = MLflowRun(None, experiment="x")
    tracker.log_params({"a": 1})
    tracker.log_metrics({"b": 1.0}, step=1)
    tracker.end()
    assert not tracker.enabled and not any(Path(tmp_path).iterdir())


def test_flatten_and_numeric_metrics():
    assert flatten({"a": 1, "b": {"c": "x", "d": {"e": None}}, "f": {}}) == {
        "a": "1", "b/c": "x", "b/d/e": "None", "f": "{}"}
    assert flatten({"long": "y" * 7000})["long"] == "y" * 6000
    assert numeric_metrics({"a": 1, "b": 2.5, "c": None, "d": float("nan"), "e": "s", "f": True}) == {
        "a": 1.0, "b": 2.5}


def test_resumed_run_continues_its_mlflow_run_and_records_changed_params(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    first = MLflowRun(uri, experiment="tree-grpo", run_name="r")
    first.log_params({"iterations": 2, "M": 2})
    first.log_metrics({"reward_mean": 0.25}, step=1)
    first.end("KILLED")
    resumed = MLflowRun(uri, experiment="tree-grpo", previous=[RunRecord(uri, "tree-grpo", first.run_id)])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "Changing param values is not allowed" used to end tracking here
        resumed.log_params({"iterations": 5, "M": 2, "eval_every": 1}, first_iteration=3)
        resumed.log_metrics({"reward_mean": 0.5}, step=2)
    resumed.end()
    run = MlflowClient(uri).get_run(first.run_id)
    history = MlflowClient(uri).get_metric_history(first.run_id, "reward_mean")
    assert [(m.step, m.value) for m in history] == [(1, 0.25), (2, 0.5)]
    assert run.info.status == "FINISHED" and run.data.params["iterations"] == "2"
    assert run.data.params["eval_every"] == "1"
    assert run.data.tags["changed_on_resume/iterations"] == "2 -> 5 (from iteration 3)"


def test_metrics_row_counts_are_ints_whatever_the_runners():
    """Counts summed over several runners come back from RLlib as floats (the progress line used to crash)."""
    result = {"training_iteration": 3, "prompts": 4.0, "iteration_time_s": 1.5,
              "env_runners": {"leaves": 24.0, "tokens_generated": 811.0, "reward_mean": 0.25},
              "learners": {"default_policy": {"kl": 0.01}}, "evaluation": {"em": 0.5, "questions": 10.0}}
    row = metrics_row(result)
    assert row["leaves"] == 24 and isinstance(row["leaves"], int) and isinstance(row["prompts"], int)
    assert row["reward_mean"] == 0.25 and row["time_s"] == 1.5 and row["dev_em"] == 0.5
    from experiments.run import progress_line

    assert "leaves 24  tokens 811" in progress_line(row, 5)


def test_truncate_rows_drops_only_the_rows_after_the_checkpoint(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"iteration": i, "reward_mean": i / 10}) + "\n" for i in (1, 2, 3, 4)))
    assert truncate_rows(path, 2) == 2
    assert read_rows(path) == [{"iteration": 1, "reward_mean": 0.1}, {"iteration": 2, "reward_mean": 0.2}]
    assert truncate_rows(path, 2) == 0


class FlakyClient:
    """A stand-in for ``MlflowClient``: records every write in ``written``; ``log_batch`` raises for its first
    ``failures`` calls, ``create_run`` when ``broken`` (each test sets them with monkeypatch)."""

    failures, broken, written = 0, False, []

    def __init__(self, tracking_uri: str):
        pass

    def get_experiment_by_name(self, name):
        return None

    def create_experiment(self, name, artifact_location=None):
        return "0"

    def create_run(self, experiment_id, run_name=None, tags=None):
        if self.broken:
            raise ConnectionError("store away")
        return type("Run", (), {"info": type("Info", (), {"run_id": "run-1"})})()

    def log_batch(self, run_id, metrics=(), params=()):
        if FlakyClient.failures:
            FlakyClient.failures -= 1
            raise ConnectionError("database is locked")
        self.written.append(("batch", [(m.key, m.step) for m in metrics], [p.key for p in params]))

    def set_tag(self, run_id, key, value):
        self.written.append(("tag", key))

    def set_terminated(self, run_id, status):
        self.written.append(("end", status))


def test_a_failed_write_loses_that_write_alone_and_warns_once(monkeypatch):
    import mlflow.tracking

    monkeypatch.setattr(mlflow.tracking, "MlflowClient", FlakyClient)
    monkeypatch.setattr(FlakyClient, "failures", 2)
    monkeypatch.setattr(FlakyClient, "written", [])
    run = MLflowRun("sqlite:////nowhere/mlflow.db", experiment="tree-grpo")
    with pytest.warns(RuntimeWarning, match=r"failed to log metrics \(ConnectionError: database is locked\)") as caught:
        for step in (1, 2, 3):
            run.log_metrics({"reward_mean": 0.5}, step=step)
    assert len(caught) == 1  # once per kind, not per step
    run.set_tag("k", "v")
    run.end("FINISHED")
    assert run.enabled and FlakyClient.written == [("batch", [("reward_mean", 3)], []), ("tag", "k"),
                                                  ("end", "FINISHED")]


def test_a_run_that_cannot_start_switches_tracking_off(monkeypatch):
    import mlflow.tracking

    monkeypatch.setattr(mlflow.tracking, "MlflowClient", FlakyClient)
    monkeypatch.setattr(FlakyClient, "broken", True)
    with pytest.warns(RuntimeWarning, match="training goes on without it"):
        run = MLflowRun("sqlite:////nowhere/mlflow.db", experiment="tree-grpo")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # off: the writes are no-ops, without a warning each
        run.log_metrics({"reward_mean": 0.5}, step=1)
        run.end()
    assert not run.enabled and run.run_id is None


def trial_algorithm(working: Path, kept: Path | None) -> SimpleNamespace:
    """A Tune trial's algorithm as RunTracker sees it: its working directory, and Tune's storage of its files
    (``kept``, named as the trial; None: run.py's algorithm, without Tune). RLlib drops the trial id Tune passes."""
    storage = None if kept is None else SimpleNamespace(storage_filesystem=LocalFileSystem(), trial_fs_path=str(kept),
                                                        trial_dir_name=kept.name)
    return SimpleNamespace(logdir=str(working), trial_id="default", iteration=0, _storage=storage,
                           config=SimpleNamespace(algo="tree_grpo", env="HotpotQA-v0"))


def test_the_sweep_ends_the_runs_of_trials_that_stop_early_or_fail(tmp_path):
    """A trial stopped by a time or token budget, or failed, never reaches the iteration at which its RunTracker ends
    its run: the sweep's driver ends it (EndTrialRuns, Tune's callback), found by the trial directory's name the
    tracker tags it with; a run already ended, another trial's and run.py's (no trial tag) are left alone."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"

    def started(name: str) -> RunTracker:  # as RunTracker starts a trial's run (no Tune storage: run.py's)
        tracker = RunTracker(mlflow_uri=uri)
        tracker.on_algorithm_init(algorithm=trial_algorithm(tmp_path / name,
                                                            None if name == "run" else tmp_path / "kept" / name))
        return tracker

    stopped, failed, done, other, run_py = (started(t) for t in ("a_00000", "a_00001", "a_00002", "a_00003", "run"))
    done.mlflow.end("FINISHED")
    ender = EndTrialRuns(uri, "tree-grpo")
    ender.on_trial_complete(iteration=3, trials=[], trial=SimpleNamespace(path=str(tmp_path / "kept" / "a_00000")))
    for name in ("a_00001", "a_00002", "run"):
        ender.on_trial_error(iteration=3, trials=[], trial=SimpleNamespace(path=str(tmp_path / "kept" / name)))
    client = MlflowClient(uri)
    status = {t: client.get_run(t.mlflow.run_id).info.status for t in (stopped, failed, done, other, run_py)}
    assert list(status.values()) == ["FINISHED", "FAILED", "FINISHED", "RUNNING", "RUNNING"]
    assert client.get_run(failed.mlflow.run_id).data.tags[TRIAL_TAG] == "a_00001"
    assert TRIAL_TAG not in client.get_run(run_py.mlflow.run_id).data.tags
