"""Test setup: find the data directory the way the Makefile does, so a bare `pytest` works too."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import ray

ROOT = Path(__file__).resolve().parents[1]

if not os.environ.get("TREEGRPO_DATA_DIR"):
    for candidate in (ROOT / "data", ROOT.parent / "shared" / "data"):
        if candidate.is_dir():
            os.environ["TREEGRPO_DATA_DIR"] = str(candidate)
            break
os.environ.setdefault("RAY_AUTH_MODE", "disabled")


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
