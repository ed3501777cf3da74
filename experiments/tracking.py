"""Tracking, one path for run.py and tune.py: the :class:`RunTracker` RLlib callback writes each iteration's row
to ``OUTPUT/metrics.jsonl``, logs it to MLflow, and writes the sampled trees (JSON + HTML) as files and MLflow
artifacts. The metric names are those of ``algos.tree_grpo.metrics``; ``metrics_row`` is the only reader of
RLlib's result dict.

MLflow goes through ``MlflowClient`` with an explicit run id (no global active run), so several trackers can
live in one process (tests, Tune). A store that cannot be reached gives one warning and the run goes on
untracked; a write that fails once the run is started loses that write alone (one warning per kind of write),
and the run is still ended with its status. Default store: ``sqlite:///<output>/mlflow.db`` (MLflow 3 refuses
plain file stores), artifacts beside it. ``OUTPUT/mlflow_runs.json`` records the MLflow runs a training run was
tracked in (store, experiment, run id; :class:`RunRecord`). A resumed run continues the recorded MLflow run that the
store and experiment it is resumed with hold: params already logged are kept, an option that changed on resume is
recorded as a ``changed_on_resume/<name>`` tag. Resumed into a store or experiment that holds none of them (another
``--mlflow-uri`` or ``--experiment``), it starts a new MLflow run there, tagged ``resumed_from`` with the latest
recorded run, whose params are logged as a new run's. A sweep's driver ends the runs of the trials that stop early,
fail or are interrupted (:class:`EndTrialRuns`); a trial restored by a resumed sweep continues its rows and its MLflow
run (``bring_back_trial_files``). A run's first row in a process drops the rows from that iteration on (written after
the checkpoint it resumed from, or by a trial restarted from its start).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import urllib.request
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ray.rllib.callbacks.callbacks import RLlibCallback
from ray.rllib.utils.metrics import ENV_RUNNER_RESULTS, EVALUATION_RESULTS, LEARNER_RESULTS
from ray.tune import Callback

from algos.evaluation import EVAL_COLUMNS, QUESTIONS
from algos.tree_grpo import metrics as metric_keys
from algos.tree_view import trees_html
from experiments.plot import METRICS_FILE  # declared beside its reader, which must not import Ray

PARAM_VALUE_LIMIT = 6000  # MLflow's limit on a param value
BATCH_LIMIT = 100  # params per log_batch call
RUNS_FILE = "mlflow_runs.json"  # a run directory's MLflow runs (RunRecord), the latest last
LEGACY_RUN_ID_FILE = "mlflow_run_id"  # its format before RUNS_FILE: the bare id of the one run, store not recorded
RESUMED_TAG = "resumed_from"  # a run started on resume in another store or experiment: the run it continues
TRIAL_TAG = "tune_trial"  # a Tune trial's MLflow run: the trial's directory name, by which the sweep's driver ends it

# metrics.jsonl columns by where they are in RLlib's result dict
ENV_RUNNER_KEYS = (metric_keys.REWARD, metric_keys.EM, metric_keys.TREES, metric_keys.LEAVES,
                   metric_keys.TOKENS_GENERATED, metric_keys.TOKENS_PREFILLED, metric_keys.LLM_CALLS,
                   metric_keys.FORWARD_PASSES, metric_keys.KV_PEAK_MIB, metric_keys.TOOL_CALLS,
                   metric_keys.RETRIEVAL_RETRIES, metric_keys.SAMPLE_TIME_S, metric_keys.GENERATION_TIME_S,
                   metric_keys.ENV_TIME_S, metric_keys.BUDGET_ESTIMATE, metric_keys.BUDGET_MEASURED,
                   metric_keys.EXPANSIONS, metric_keys.EXPANSIONS_BEFORE_ANSWER_READ)
LEARNER_KEYS = (metric_keys.POLICY_LOSS, metric_keys.KL, metric_keys.ENTROPY, metric_keys.CLIP_FRACTION,
                metric_keys.DUAL_CLIP_FRACTION, metric_keys.RATIO_MEAN, metric_keys.RATIO_MAX, metric_keys.RATIO_MIN,
                metric_keys.GRAD_NORM, metric_keys.NONFINITE_GRAD_SHARE, metric_keys.LEARNING_RATE,
                metric_keys.SAMPLER_LOGPROB_GAP, metric_keys.TRAINED_TOKENS, metric_keys.OPTIMIZER_STEPS,
                metric_keys.OLD_LOGPROBS_RECOMPUTED, metric_keys.SAMPLER_RATIO_MEAN, metric_keys.SAMPLER_RATIO_P99,
                metric_keys.SAMPLER_RATIO_OUTSIDE, metric_keys.TIS_WEIGHT_MEAN, metric_keys.UNIQUE_TOKEN_SHARE,
                metric_keys.FORWARDED_TOKEN_SHARE, metric_keys.LEARNER_PEAK_MEMORY_GIB, metric_keys.SCORING_TIME_S)
TOP_LEVEL_KEYS = (metric_keys.PROMPTS, metric_keys.TOKENS_GENERATED_TOTAL, metric_keys.ITERATION_TIME_S,
                  metric_keys.UPDATE_TIME_S, metric_keys.SYNC_TIME_S, metric_keys.UPDATE_SKIPPED,
                  metric_keys.UPDATES_SKIPPED_TOTAL, metric_keys.UNIFORM_STREAK, metric_keys.ENV_RUNNER_RESTARTS,
                  metric_keys.SAMPLED_BY, metric_keys.NONZERO_ADVANTAGE_SHARE, metric_keys.STALENESS,
                  metric_keys.WEIGHTS_VERSION, metric_keys.SAMPLE_WAIT_TIME_S)
# Counts summed over runners come back as floats from RLlib's metrics: written as ints.
COUNT_KEYS = frozenset({metric_keys.TREES, metric_keys.LEAVES, metric_keys.TOKENS_GENERATED,
                        metric_keys.TOKENS_PREFILLED, metric_keys.LLM_CALLS, metric_keys.FORWARD_PASSES,
                        metric_keys.TOOL_CALLS, metric_keys.RETRIEVAL_RETRIES, metric_keys.PROMPTS,
                        metric_keys.ENV_RUNNER_RESTARTS, metric_keys.OPTIMIZER_STEPS,
                        metric_keys.TOKENS_GENERATED_TOTAL, metric_keys.UPDATE_SKIPPED,
                        metric_keys.UPDATES_SKIPPED_TOTAL, metric_keys.UNIFORM_STREAK, metric_keys.STALENESS,
                        metric_keys.WEIGHTS_VERSION, metric_keys.EXPANSIONS,
                        metric_keys.EXPANSIONS_BEFORE_ANSWER_READ})


def default_tracking_uri(output: str | Path) -> str:
    """``sqlite:///ABS/OUTPUT/mlflow.db``."""
    return f"sqlite:///{Path(output).resolve() / 'mlflow.db'}"


def artifact_location(tracking_uri: str) -> str | None:
    """Where a new experiment's artifacts go: beside a sqlite store (``mlartifacts/``), not MLflow's default
    ``./mlruns`` in whatever directory the process runs in; None (the server decides) for other stores."""
    if tracking_uri.startswith("sqlite:///"):
        return (Path(tracking_uri.removeprefix("sqlite:///")).parent / "mlartifacts").resolve().as_uri()
    return None


def ensure_experiment(client, name: str, tracking_uri: str) -> str:
    """The id of experiment ``name``, created (with ``artifact_location``) if missing."""
    found = client.get_experiment_by_name(name)
    return found.experiment_id if found else client.create_experiment(
        name, artifact_location=artifact_location(tracking_uri))


def flatten(params: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested mappings as ``a/b`` keys; values as strings cut to MLflow's limit."""
    flat: dict[str, str] = {}
    for key, value in params.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(flatten(value, prefix=f"{name}/"))
        else:
            flat[name] = str(value)[:PARAM_VALUE_LIMIT]
    return flat


def numeric_metrics(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The finite numbers of a metrics row (MLflow takes nothing else)."""
    return {k: float(v) for k, v in metrics.items()
            if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)}


def metrics_row(result: Mapping[str, Any]) -> dict[str, Any]:
    """One ``metrics.jsonl`` line from RLlib's result dict: the iteration, the runners' and the learner's
    metrics, and on evaluating iterations the greedy evaluation as ``dev_<column>``."""
    runners = result.get(ENV_RUNNER_RESULTS, {})
    learner = result.get(LEARNER_RESULTS, {}).get("default_policy", {})
    row: dict[str, Any] = {"iteration": result.get("training_iteration")}
    row.update({key: result.get(key) for key in TOP_LEVEL_KEYS})
    row.update({key: runners.get(key) for key in ENV_RUNNER_KEYS})
    row.update({key: learner.get(key) for key in LEARNER_KEYS})
    evaluation = result.get(EVALUATION_RESULTS) or {}
    row.update({f"{metric_keys.DEV_PREFIX}{key}": value for key, value in evaluation.items()
                if isinstance(value, int | float) and value == value})
    row["time_s"] = row.pop(metric_keys.ITERATION_TIME_S)
    passes, tokens = row.get(metric_keys.FORWARD_PASSES), row.get(metric_keys.TOKENS_GENERATED)
    row[metric_keys.TOKENS_PER_FORWARD_PASS] = float(tokens) / float(passes) if passes and tokens is not None else None
    for key, value in row.items():
        if hasattr(value, "__float__") and not isinstance(value, int | bool):
            value = float(value)
            row[key] = round(value) if key in COUNT_KEYS and math.isfinite(value) else value
    return row


def metric_columns() -> tuple[str, ...]:
    """The numeric columns of metrics.jsonl: every column ``metrics_row`` writes but the list of the runners that
    sampled (``sampled_by``), then the greedy evaluation's (``dev_<column>``, on evaluating iterations)."""
    written = [key for key in metrics_row({}) if key != metric_keys.SAMPLED_BY]
    return (*written, *(f"{metric_keys.DEV_PREFIX}{key}" for key in (*EVAL_COLUMNS, QUESTIONS)))


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a metrics.jsonl file ([] if it does not exist)."""
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def truncate_rows(path: str | Path, last_iteration: int) -> int:
    """Drop the rows after ``last_iteration`` (written after the checkpoint a run resumes from); the count."""
    rows = read_rows(path)
    kept = [row for row in rows if row["iteration"] <= last_iteration]
    if len(kept) < len(rows):
        Path(path).write_text("".join(json.dumps(row) + "\n" for row in kept), encoding="utf-8")
    return len(rows) - len(kept)


@dataclass(frozen=True)
class RunRecord:
    """An MLflow run a training run was tracked in. ``tracking_uri`` and ``experiment`` are None in a record read
    from ``LEGACY_RUN_ID_FILE``, which did not name them."""

    tracking_uri: str | None
    experiment: str | None
    run_id: str

    def describe(self) -> str:
        """The run, its store and its experiment, in words (the ``RESUMED_TAG`` tag's value)."""
        return (f"run {self.run_id} in {self.tracking_uri or 'an unrecorded store'}"
                + (f" (experiment {self.experiment})" if self.experiment else ""))


def read_run_records(output: str | Path) -> list[RunRecord]:
    """The MLflow runs recorded in run directory ``output``, the latest last: ``RUNS_FILE``, else the bare run id of
    ``LEGACY_RUN_ID_FILE`` (store and experiment unknown); [] when neither exists."""
    output = Path(output)
    if (output / RUNS_FILE).exists():
        return [RunRecord(**record) for record in json.loads((output / RUNS_FILE).read_text(encoding="utf-8"))]
    legacy = output / LEGACY_RUN_ID_FILE
    run_id = legacy.read_text(encoding="utf-8").strip() if legacy.exists() else ""
    return [RunRecord(None, None, run_id)] if run_id else []


def record_run(output: str | Path, run: RunRecord, earlier: Sequence[RunRecord] = ()) -> None:
    """Write ``RUNS_FILE``: ``earlier`` but any record of ``run``'s id, then ``run``; a legacy file is replaced."""
    output = Path(output)
    records = [record for record in earlier if record.run_id != run.run_id] + [run]
    (output / RUNS_FILE).write_text(json.dumps([asdict(record) for record in records], indent=1) + "\n",
                                    encoding="utf-8")
    (output / LEGACY_RUN_ID_FILE).unlink(missing_ok=True)


def tune_storage(algorithm) -> Any:
    """Tune's ``StorageContext`` of the trial that runs ``algorithm`` (its directory's name and where its files are
    kept), or None outside Tune. RLlib drops the trial's id Tune passes in the config (``algorithm.trial_id`` is
    ``"default"`` in a trial too): the trial's directory name is what the trial and the sweep's driver both know."""
    return getattr(algorithm, "_storage", None)


def bring_back_trial_files(storage, output: Path) -> bool:
    """Whether a Tune trial is restored (a resumed sweep): its rows and MLflow records (``METRICS_FILE``,
    ``RUNS_FILE``) are copied from the trial's directory in the sweep's ``storage`` into ``output``, the new working
    directory Tune gives the trial (it brings back only the checkpoint), when ``output`` lacks them. False for a
    trial that never reported."""
    from pyarrow.fs import FileType, copy_files

    found = False
    for name in (METRICS_FILE, RUNS_FILE):
        kept = f"{storage.trial_fs_path}/{name}"
        if storage.storage_filesystem.get_file_info(kept).type == FileType.File:
            found = True
            if not (output / name).exists():
                copy_files(kept, str(output / name), source_filesystem=storage.storage_filesystem)
    return found


class MLflowRun:
    """One MLflow run. Every method is a no-op when tracking is off or the run could not be started or continued
    (one warning). A write that fails (a store busy or away for a moment) loses that write alone: it warns once per
    kind (params, tag, metrics, artifact, end), and later writes and ``end`` are still sent.

    ``previous``: the runs a resumed training run was tracked in, the latest last. The latest of them that this
    store holds in ``experiment`` (and not deleted) is continued, whatever URI reached the store when it was
    recorded; when it holds none (another store or experiment, or the run deleted), a new run is started, tagged
    ``RESUMED_TAG`` with the latest record (``resumed_from``)."""

    def __init__(self, tracking_uri: str | None, *, experiment: str, run_name: str | None = None,
                 previous: Sequence[RunRecord] = (), tags: Mapping[str, str] | None = None):
        self.tracking_uri, self.experiment, self.run_id, self._client = tracking_uri, experiment, None, None
        self.params: dict[str, str] = {}  # already logged (a continued run's)
        self.failed: set[str] = set()  # the kinds of write that have failed (each warned about once)
        self.resumed_from: RunRecord | None = None  # the run a new run continues (previous, none of them here)
        if tracking_uri is not None:
            try:
                self._start(run_name, list(previous), dict(tags or {}))
            except Exception as error:  # tracking must never stop training
                warnings.warn(f"MLflow tracking at {tracking_uri} failed ({type(error).__name__}: {error}); "
                              f"training goes on without it", RuntimeWarning, stacklevel=2)

    @property
    def enabled(self) -> bool:
        return self._client is not None and self.run_id is not None

    def _start(self, run_name: str | None, previous: list[RunRecord], tags: dict[str, str]) -> None:
        from mlflow.tracking import MlflowClient

        if self.tracking_uri.startswith(("http://", "https://")):
            # fail in seconds, not after MLflow's minutes of retries
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
            urllib.request.urlopen(f"{self.tracking_uri.rstrip('/')}/health", timeout=5).close()
        client = MlflowClient(self.tracking_uri)
        run_id = self._held(client, previous)
        if run_id is not None:  # a resumed training run continues its MLflow run
            client.update_run(run_id, status="RUNNING")
            self.params = dict(client.get_run(run_id).data.params)
        else:
            if previous:
                self.resumed_from = previous[-1]
                tags = {**tags, RESUMED_TAG: self.resumed_from.describe()}
            experiment_id = ensure_experiment(client, self.experiment, self.tracking_uri)
            run_id = client.create_run(experiment_id, run_name=run_name, tags=tags).info.run_id
        self._client, self.run_id = client, run_id

    def _held(self, client, previous: list[RunRecord]) -> str | None:
        """The id of the latest run of ``previous`` that this store holds, not deleted, in the experiment; None if
        none is (nor the experiment). Looked up by id, not by the recorded URI: the same store may be reached by
        another (a moved run directory's default store, another name of a server)."""
        from mlflow.exceptions import MlflowException

        found = client.get_experiment_by_name(self.experiment) if previous else None
        for record in reversed(previous if found is not None else []):
            try:
                run = client.get_run(record.run_id)
            except MlflowException as error:
                if error.error_code != "RESOURCE_DOES_NOT_EXIST":
                    raise
                continue
            if run.info.experiment_id == found.experiment_id and run.info.lifecycle_stage == "active":
                return record.run_id
        return None

    def _write(self, kind: str, fn: Callable[..., Any], *args: Any) -> None:
        """``fn(*args)``, a write of ``kind``; a failure warns (the first of its kind) and tracking stays on."""
        try:
            fn(*args)
        except Exception as error:  # tracking must never stop training
            if kind not in self.failed:
                self.failed.add(kind)
                warnings.warn(f"MLflow tracking at {self.tracking_uri} failed to log {kind} ({type(error).__name__}: "
                              f"{error}); training goes on, and later writes are still sent (this warning is not "
                              f"repeated for {kind})", RuntimeWarning, stacklevel=3)

    def log_params(self, params: Mapping[str, Any], *, first_iteration: int = 1) -> None:
        """Nested params, flattened (``env_config/topk``). MLflow params cannot change: a value that differs from
        the one already logged (a resumed run) becomes the tag ``changed_on_resume/<name>``, naming
        ``first_iteration``, the first iteration the value applies to."""
        if not self.enabled:
            return
        from mlflow.entities import Param  # here, after the check: --no-mlflow runs without mlflow installed

        flat = flatten(params)
        new = [Param(k, v) for k, v in flat.items() if k not in self.params]
        for start in range(0, len(new), BATCH_LIMIT):
            self._write("params", self._client.log_batch, self.run_id, [], new[start:start + BATCH_LIMIT])
        for key, value in flat.items():
            if key in self.params and self.params[key] != value:
                self.set_tag(f"changed_on_resume/{key}",
                             f"{self.params[key]} -> {value} (from iteration {first_iteration})")
        self.params.update(flat)

    def set_tag(self, key: str, value: str) -> None:
        if self.enabled:
            self._write("tag", self._client.set_tag, self.run_id, key, value)

    def log_metrics(self, metrics: Mapping[str, Any], step: int) -> None:
        """The finite numbers of ``metrics`` at ``step`` (None and NaN are skipped)."""
        if not self.enabled:
            return
        from mlflow.entities import Metric  # after the check, as in log_params

        now = int(time.time() * 1000)
        batch = [Metric(k, v, now, step) for k, v in numeric_metrics(metrics).items()]
        if batch:
            self._write("metrics", self._client.log_batch, self.run_id, batch)

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        if self.enabled and Path(path).exists():
            self._write("artifact", self._client.log_artifact, self.run_id, str(path), artifact_path)

    def end(self, status: str = "FINISHED") -> None:
        if self.enabled:
            self._write("end", self._client.set_terminated, self.run_id, status)


def write_trees(trees: list[dict[str, Any]], directory: Path, iteration: int, title: str) -> list[Path]:
    """``directory/iter_NNNNN.json`` and ``.html`` of the exported trees."""
    directory.mkdir(parents=True, exist_ok=True)
    stem = directory / f"iter_{iteration:05d}"
    stem.with_suffix(".json").write_text(json.dumps(trees, indent=1), encoding="utf-8")
    stem.with_suffix(".html").write_text(trees_html(trees, title), encoding="utf-8")
    return [stem.with_suffix(".json"), stem.with_suffix(".html")]


class RunTracker(RLlibCallback):
    """The RLlib callback that records every iteration (see the module docstring).

    ``output``: the run's directory (default: the algorithm's log directory, a Tune trial's own directory).
    ``mlflow_uri``: None for no MLflow. ``params``: what to log as MLflow params, or a function of the algorithm's
    config that returns them (a Tune trial's settings are known only in the trial). ``resume``: continue the
    MLflow run recorded in ``output`` (``RUNS_FILE``) that this store and experiment hold, or start one tagged
    ``resumed_from`` (:class:`MLflowRun`, ``previous``; one line on stderr says so); its params are logged by
    ``log_params`` once the algorithm is restored (the caller's call), so that a changed value names the iteration
    it applies from.
    ``final_iteration``: end the MLflow run (FINISHED, with metrics.jsonl) after that iteration, for callers that
    do not end it themselves (Tune trials); run.py ends it with the run's status.
    """

    def __init__(self, *, output: str | Path | None = None, mlflow_uri: str | None = None,
                 experiment: str = "tree-grpo", run_name: str | None = None, tags: Mapping[str, str] | None = None,
                 params: Mapping[str, Any] | Callable[[Any], Mapping[str, Any]] | None = None, resume: bool = False,
                 final_iteration: int | None = None):
        super().__init__()
        self._options = dict(output=output, mlflow_uri=mlflow_uri, experiment=experiment, run_name=run_name,
                             tags=dict(tags or {}), params=params, resume=resume, final_iteration=final_iteration)
        self.output: Path | None = None
        self.mlflow: MLflowRun | None = None
        self.last_row: dict[str, Any] | None = None

    def on_algorithm_init(self, *, algorithm, metrics_logger=None, **kwargs) -> None:
        options = self._options
        self.output = Path(options["output"] or algorithm.logdir).resolve()
        self.output.mkdir(parents=True, exist_ok=True)
        storage = tune_storage(algorithm)
        trial = {TRIAL_TAG: storage.trial_dir_name} if storage is not None else {}
        # a Tune trial restored by a resumed sweep continues its rows and its MLflow run
        restored = storage is not None and bring_back_trial_files(storage, self.output)
        previous = read_run_records(self.output) if options["resume"] or restored else []
        mlflow = self.mlflow = MLflowRun(options["mlflow_uri"], experiment=options["experiment"],
                                         run_name=options["run_name"] or self.output.name, previous=previous,
                                         tags={"algo": algorithm.config.algo, "env": str(algorithm.config.env),
                                               **trial, **options["tags"]})
        if mlflow.enabled:
            record_run(self.output, RunRecord(mlflow.tracking_uri, mlflow.experiment, mlflow.run_id), previous)
            if mlflow.resumed_from is not None:
                print(f"resume: MLflow {mlflow.resumed_from.describe()} is not in {mlflow.tracking_uri} (experiment "
                      f"{mlflow.experiment}): the run goes on in a new MLflow run there, {mlflow.run_id}, tagged "
                      f"{RESUMED_TAG}", file=sys.stderr)
        if not options["resume"]:
            self.log_params(algorithm)

    def log_params(self, algorithm) -> None:
        """The run's params, applying from the algorithm's next iteration."""
        params = self._options["params"] or {}
        self.mlflow.log_params(params(algorithm.config) if callable(params) else params,
                               first_iteration=algorithm.iteration + 1)

    def on_train_result(self, *, algorithm, metrics_logger=None, result: dict, **kwargs) -> None:
        row = metrics_row(result)
        if self.last_row is None:  # this process's first row: rows from that iteration on are a run's lost work
            truncate_rows(self.output / METRICS_FILE, row["iteration"] - 1)
        with (self.output / METRICS_FILE).open("a", encoding="utf-8") as log:
            log.write(json.dumps(row) + "\n")
        self.mlflow.log_metrics(row, step=row["iteration"])
        trees = getattr(algorithm, "exported_trees", None)
        if trees:
            title = f"{algorithm.config.algo}, iteration {row['iteration']}"
            for path in write_trees(trees, self.output / "trees", row["iteration"], title):
                self.mlflow.log_artifact(path, "trees")
        self.last_row = row
        final = self._options["final_iteration"]
        if final is not None and row["iteration"] >= final:
            self.mlflow.log_artifact(self.output / METRICS_FILE)
            self.mlflow.end("FINISHED")


def trial_unfinished(failed: bool, last_result: Mapping[str, Any]) -> bool:
    """Whether a Tune trial neither failed nor ended: Tune marks the last result of a trial that met its stop
    criteria ``done``, and stops an interrupted sweep's trials as TERMINATED all the same."""
    return not failed and not last_result.get("done")


class EndTrialRuns(Callback):
    """The Tune callback, in a sweep's driver, that ends the MLflow run of every trial that ends before its
    ``RunTracker`` could (which ends it after ``final_iteration``, and hears of no stop: RLlib's callbacks have no stop
    hook): a trial stopped by --time-budget-s, --token-budget or --stop-after-uniform is FINISHED, one that failed
    FAILED, and one still unfinished when the sweep ends (interrupted: Ctrl-C) KILLED, until a resumed sweep continues
    it. The run gets the trial's metrics.jsonl as its artifact, as a run ended by its tracker does (from the trial's
    directory, when the sweep's storage is this machine's disk). The run is found by the trial's directory name (its tag
    ``TRIAL_TAG``), wherever the trial ran; a run already ended is left as it is. A store that cannot be reached
    warns, and the sweep goes on."""

    def __init__(self, tracking_uri: str, experiment: str):
        self.tracking_uri, self.experiment = tracking_uri, experiment

    def on_trial_complete(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        self.end(trial.path, "FINISHED")

    def on_trial_error(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        self.end(trial.path, "FAILED")

    def on_experiment_end(self, trials: list, **info: Any) -> None:
        for trial in trials:
            if trial_unfinished(trial.status == "ERROR", trial.last_result):
                self.end(trial.path, "KILLED")

    def end(self, trial_dir: str, status: str) -> None:
        """End the runs of the trial in ``trial_dir`` (the storage's path of its directory) still RUNNING with
        ``status``, logging its metrics.jsonl first when that is on this machine's disk."""
        from mlflow.tracking import MlflowClient

        name = Path(trial_dir).name  # the trial's tag
        try:
            client = MlflowClient(self.tracking_uri)
            experiment = client.get_experiment_by_name(self.experiment)
            if experiment is None:  # no trial started its run
                return
            running = client.search_runs([experiment.experiment_id], filter_string=(
                f"tags.{TRIAL_TAG} = '{name}' and attributes.status = 'RUNNING'"))
            metrics_file = Path(trial_dir) / METRICS_FILE
            for run in running:
                if metrics_file.is_absolute() and metrics_file.is_file():
                    client.log_artifact(run.info.run_id, str(metrics_file))
                client.set_terminated(run.info.run_id, status)
        except Exception as error:  # tracking must never stop the sweep
            warnings.warn(f"MLflow tracking at {self.tracking_uri} failed to end trial {name}'s run "
                          f"({type(error).__name__}: {error})", RuntimeWarning, stacklevel=2)


def tracker_of(algorithm) -> RunTracker:
    """The algorithm's :class:`RunTracker` instance."""
    callbacks = algorithm.callbacks if isinstance(algorithm.callbacks, list) else [algorithm.callbacks]
    found = [c for c in callbacks if isinstance(c, RunTracker)]
    if not found:
        raise ValueError("the algorithm has no RunTracker callback (config.callbacks(...))")
    return found[0]
