"""A resumed run's MLflow run (no Ray: RunTracker driven as RLlib drives it): continued where the store and
experiment it is resumed with hold it, a new run tagged ``resumed_from`` where they do not (another --mlflow-uri or
--experiment), and the record of a run directory written before the store was recorded still read."""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

from mlflow.tracking import MlflowClient

from experiments.tracking import (
    LEGACY_RUN_ID_FILE,
    RESUMED_TAG,
    RUNS_FILE,
    MLflowRun,
    RunRecord,
    RunTracker,
    ensure_experiment,
    read_run_records,
)


def store(path: Path) -> str:
    return f"sqlite:///{path / 'mlflow.db'}"


def train(output: Path, uri: str, iterations: list[int], *, resume: bool, experiment: str = "tree-grpo") -> RunTracker:
    """As run.py tracks ``iterations`` (a resume first restores the algorithm, then logs the params), ended KILLED."""
    algorithm = SimpleNamespace(logdir=str(output), trial_id="default", iteration=iterations[0] - 1,
                                config=SimpleNamespace(algo="tree_grpo", env="HotpotQA-v0"))
    tracker = RunTracker(output=output, mlflow_uri=uri, experiment=experiment, resume=resume,
                         params={"M": 2, "mlflow_uri": uri, "experiment": experiment})
    tracker.on_algorithm_init(algorithm=algorithm)
    if resume:
        tracker.log_params(algorithm)
    for iteration in iterations:
        tracker.on_train_result(algorithm=algorithm, result={"training_iteration": iteration,
                                                            "env_runners": {"reward_mean": iteration / 10}})
        algorithm.iteration = iteration
    tracker.mlflow.end("KILLED")
    return tracker


def runs(uri: str, experiment: str = "tree-grpo") -> list:
    client = MlflowClient(uri)
    return client.search_runs([client.get_experiment_by_name(experiment).experiment_id])


def steps(uri: str, run_id: str) -> list[int]:
    return [m.step for m in MlflowClient(uri).get_metric_history(run_id, "reward_mean")]


def resume_lines(capsys) -> list[str]:
    """What was said on stderr about the resume (MLflow logs there too)."""
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("resume:")]


def test_a_run_resumed_into_another_store_starts_a_tagged_run_there_and_back_continues_its_first(tmp_path, capsys):
    output, a, b = tmp_path / "run", store(tmp_path / "a"), store(tmp_path / "b")
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first = train(output, a, [1, 2], resume=False).mlflow.run_id
    assert not resume_lines(capsys)

    moved = train(output, b, [3, 4], resume=True).mlflow.run_id
    (run,) = runs(b)
    assert run.info.run_id == moved != first
    assert run.data.tags[RESUMED_TAG] == f"run {first} in {a} (experiment tree-grpo)"
    assert steps(b, moved) == [3, 4]
    assert run.data.params == {"M": "2", "mlflow_uri": b, "experiment": "tree-grpo"}  # as a new run's
    assert not [tag for tag in run.data.tags if tag.startswith("changed_on_resume/")]
    (line,) = resume_lines(capsys)
    assert line == (f"resume: MLflow run {first} in {a} (experiment tree-grpo) is not in {b} (experiment tree-grpo): "
                    f"the run goes on in a new MLflow run there, {moved}, tagged {RESUMED_TAG}")

    back = train(output, a, [5], resume=True).mlflow.run_id
    (run,) = runs(a)  # the first run continued: no second run in A
    assert back == run.info.run_id == first and RESUMED_TAG not in run.data.tags
    assert steps(a, first) == [1, 2, 5] and steps(b, moved) == [3, 4]
    assert run.info.status == "KILLED" and not resume_lines(capsys)
    assert read_run_records(output) == [RunRecord(b, "tree-grpo", moved), RunRecord(a, "tree-grpo", first)]


def test_another_experiment_in_the_same_store_starts_a_tagged_run_in_it(tmp_path):
    uri = store(tmp_path)
    first = train(tmp_path, uri, [1], resume=False).mlflow.run_id
    ensure_experiment(MlflowClient(uri), "other", uri)  # already there: the store holds the run, in another one
    other = train(tmp_path, uri, [2], resume=True, experiment="other").mlflow.run_id
    (run,) = runs(uri, "other")
    assert run.info.run_id == other != first and steps(uri, other) == [2]
    assert run.data.tags[RESUMED_TAG] == f"run {first} in {uri} (experiment tree-grpo)"
    assert [r.info.run_id for r in runs(uri)] == [first] and steps(uri, first) == [1]


def test_a_moved_run_directory_continues_its_run_in_the_moved_store(tmp_path):
    """The default store moves with the run directory: another URI, the same store, the same run."""
    before, after = tmp_path / "before", tmp_path / "after"
    first = train(before, store(before), [1], resume=False).mlflow.run_id
    shutil.move(before, after)
    assert train(after, store(after), [2], resume=True).mlflow.run_id == first
    (run,) = runs(store(after))
    assert steps(store(after), first) == [1, 2] and RESUMED_TAG not in run.data.tags


def test_a_legacy_bare_run_id_is_continued_and_rewritten_with_its_store(tmp_path):
    uri = store(tmp_path)
    first = MLflowRun(uri, experiment="tree-grpo", run_name="r")
    first.log_metrics({"reward_mean": 0.1}, step=1)
    first.end("KILLED")
    (tmp_path / LEGACY_RUN_ID_FILE).write_text(first.run_id + "\n")
    assert read_run_records(tmp_path) == [RunRecord(None, None, first.run_id)]

    assert train(tmp_path, uri, [2], resume=True).mlflow.run_id == first.run_id
    assert steps(uri, first.run_id) == [1, 2] and len(runs(uri)) == 1
    assert not (tmp_path / LEGACY_RUN_ID_FILE).exists() and (tmp_path / RUNS_FILE).exists()
    assert read_run_records(tmp_path) == [RunRecord(uri, "tree-grpo", first.run_id)]

    elsewhere = tmp_path / "elsewhere"  # a legacy run resumed into another store: followed, its store unnamed
    elsewhere.mkdir()
    (elsewhere / LEGACY_RUN_ID_FILE).write_text(first.run_id)
    train(elsewhere, store(elsewhere), [2], resume=True)
    (run,) = runs(store(elsewhere))
    assert run.data.tags[RESUMED_TAG] == f"run {first.run_id} in an unrecorded store"


def test_a_run_deleted_from_its_own_store_is_not_continued_but_followed(tmp_path):
    uri = store(tmp_path)
    first = train(tmp_path, uri, [1], resume=False).mlflow.run_id
    MlflowClient(uri).delete_run(first)
    resumed = train(tmp_path, uri, [2], resume=True).mlflow
    assert resumed.run_id != first and resumed.resumed_from == RunRecord(uri, "tree-grpo", first)
    (run,) = runs(uri)  # the deleted one is not listed
    assert run.info.run_id == resumed.run_id and steps(uri, resumed.run_id) == [2]
