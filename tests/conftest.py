"""Test setup: find the data directory the way the Makefile does, so a bare `pytest` works too, and give the run a
temporary cache and home folders of its own, so that the tests never write into the user's."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from envs.cache import CACHE_DIR_ENV, MODELS_DIR, default_cache_dir

try:
    import ray
    from ray.tune.trainable import trainable
except ImportError:  # the lent GPU machine's vLLM call (benchmarks/device_check.sh vllm): Ray's tests skip
    ray = trainable = None

ROOT = Path(__file__).resolve().parents[1]


def keep_out_of_home() -> Path:
    """Give this run a temporary folder, removed when it ends, for all it would otherwise write into the user's
    cache or home, and return it. Set here, at import, before any test resolves a path; the Ray workers and
    subprocesses the tests start inherit the environment.

    - ``cache/``: ``$TREEGRPO_CACHE_DIR``, for the indexes, worlds and warm starts the tests build. The user's
      converted models (SmolLM2's weights and tokenizer, the slowest entries to rebuild) are linked in: a model
      directory is published whole and never written again, so the run only reads them; the ones the user lacks
      are converted into the temporary cache, once per run.
    - ``matplotlib/``: ``MPLCONFIGDIR``, matplotlib's font cache (else ``~/.cache/matplotlib``).
    - ``ray_results/``: an RLlib Algorithm built outside Tune makes a log folder in ``~/ray_results``, Ray's
      ``DEFAULT_STORAGE_PATH``, fixed from ``$HOME`` when Ray is imported; the module global Trainable reads it from
      is pointed here (test_cache.py fails if that stops working).
    - MLflow's telemetry is off: it writes ``~/.config/mlflow/telemetry.json`` (and would report the tests' usage)."""
    root = Path(tempfile.mkdtemp(prefix="tree-grpo-test-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    user_models = default_cache_dir() / MODELS_DIR
    cache = root / "cache"
    (cache / MODELS_DIR).mkdir(parents=True)
    if user_models.is_dir():
        for model in user_models.iterdir():
            if model.is_dir() and ".tmp" not in model.name:  # published, not a conversion under way
                (cache / MODELS_DIR / model.name).symlink_to(model.resolve(), target_is_directory=True)
    os.environ[CACHE_DIR_ENV] = str(cache)
    os.environ["MPLCONFIGDIR"] = str(root / "matplotlib")
    os.environ["MLFLOW_DISABLE_TELEMETRY"] = "true"
    if trainable is not None:
        trainable.DEFAULT_STORAGE_PATH = str(root / "ray_results")
    return root


TEST_ROOT = keep_out_of_home()

if not os.environ.get("TREEGRPO_DATA_DIR"):
    for candidate in (ROOT / "data", ROOT.parent / "shared" / "data"):
        if candidate.is_dir():
            os.environ["TREEGRPO_DATA_DIR"] = str(candidate)
            break
os.environ.setdefault("RAY_AUTH_MODE", "disabled")


@pytest.fixture(scope="session")
def test_root() -> Path:
    """The run's temporary folder that stands in for the user's cache and home (``keep_out_of_home``)."""
    return TEST_ROOT


@pytest.fixture(scope="session")
def data_dir() -> Path:
    """The data directory; tests that need the real data skip without it."""
    path = os.environ.get("TREEGRPO_DATA_DIR")
    if not path or not Path(path).is_dir():
        pytest.skip("no data directory: set TREEGRPO_DATA_DIR (see envs/datasets.py for the layout)")
    return Path(path)


@pytest.fixture(scope="module")
def ray_session():
    """A local Ray instance for a test module (2 CPUs), shut down after it."""
    if ray is None:
        pytest.skip("Ray is not installed")
    if not ray.is_initialized():
        ray.init(num_cpus=2, object_store_memory=400_000_000, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


# pyproject's `timeout` (pytest-timeout) turns a hung test (a stuck collective, a lost Ray actor) into a failure
# with every thread's stack instead of a CI run that never ends; the slow end-to-end tier gets longer.
SLOW_TEST_TIMEOUT_S = 3600


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("slow") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(SLOW_TEST_TIMEOUT_S))
