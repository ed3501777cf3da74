"""MLflow tracking for training runs that never stops training: a store that cannot be reached gives one
warning, and the run goes on untracked.

Uses ``MlflowClient`` with an explicit run id (no global active run), so several trackers can live in one
process (tests, Tune). Default store: ``sqlite:///<output>/mlflow.db`` (MLflow 3 refuses plain file stores).
"""

from __future__ import annotations

import math
import os
import time
import urllib.request
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

PARAM_VALUE_LIMIT = 6000  # MLflow's limit on a param value
BATCH_LIMIT = 100  # params per log_batch call


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


class MLflowTracker:
    """One MLflow run. Every method is a no-op once tracking is off (``--no-mlflow``) or has failed."""

    def __init__(self, tracking_uri: str | None, *, experiment: str, run_name: str | None = None,
                 run_id: str | None = None, tags: Mapping[str, str] | None = None):
        self.tracking_uri, self.run_id, self._client = tracking_uri, None, None
        if tracking_uri is None:
            return
        self._guard(self._start, experiment, run_name, run_id, dict(tags or {}))

    @property
    def enabled(self) -> bool:
        return self._client is not None and self.run_id is not None

    def _start(self, experiment: str, run_name: str | None, run_id: str | None, tags: dict[str, str]) -> None:
        from mlflow.tracking import MlflowClient

        if self.tracking_uri.startswith(("http://", "https://")):
            # fail in seconds, not after MLflow's minutes of retries
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
            urllib.request.urlopen(f"{self.tracking_uri.rstrip('/')}/health", timeout=5).close()
        client = MlflowClient(self.tracking_uri)
        if run_id is not None:  # a resumed training run continues its MLflow run
            client.update_run(run_id, status="RUNNING")
        else:
            experiment_id = ensure_experiment(client, experiment, self.tracking_uri)
            run_id = client.create_run(experiment_id, run_name=run_name, tags=tags).info.run_id
        self._client, self.run_id = client, run_id

    def _guard(self, fn, *args) -> None:
        try:
            fn(*args)
        except Exception as error:  # tracking must never stop training
            warnings.warn(f"MLflow tracking at {self.tracking_uri} failed ({type(error).__name__}: {error}); "
                          f"training goes on without it", RuntimeWarning, stacklevel=3)
            self._client = None

    def log_params(self, params: Mapping[str, Any]) -> None:
        """Nested params, flattened (``env_config/topk``)."""
        from mlflow.entities import Param

        if not self.enabled:
            return
        flat = [Param(k, v) for k, v in flatten(params).items()]
        for start in range(0, len(flat), BATCH_LIMIT):
            self._guard(self._client.log_batch, self.run_id, [], flat[start:start + BATCH_LIMIT])

    def log_metrics(self, metrics: Mapping[str, Any], step: int) -> None:
        """The finite numbers of ``metrics`` at ``step`` (None and NaN are skipped)."""
        from mlflow.entities import Metric

        if not self.enabled:
            return
        now = int(time.time() * 1000)
        batch = [Metric(k, v, now, step) for k, v in numeric_metrics(metrics).items()]
        if batch:
            self._guard(self._client.log_batch, self.run_id, batch)

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        if self.enabled and Path(path).exists():
            self._guard(self._client.log_artifact, self.run_id, str(path), artifact_path)

    def end(self, status: str = "FINISHED") -> None:
        if self.enabled:
            self._guard(self._client.set_terminated, self.run_id, status)
