"""The task of a learning benchmark (``bench_learning``, ``bench_branching``): a generated world, the settings
trained on it (each a run.py command line) and the comparisons between them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from envs.synthetic import BranchSpec, WorldSpec, world_data_dir


@dataclass(frozen=True)
class Testbed:
    """One benchmark's task and settings. ``settings``: name -> (nominal budget in full chains, run.py options);
    ``comparisons``: (a, b) pairs whose paired difference a - b is reported (a >= b: the direction expected)."""

    name: str  # OUTPUT/NAME.md, NAME.json, NAME.png and the docs section's key
    title: str  # the docs section's title
    env: str
    world: WorldSpec | BranchSpec
    topk: int
    settings: Mapping[str, tuple[int, list[str]]]
    comparisons: tuple[tuple[str, str], ...]
    # dev EM above which a run's curve has left the plateau for good (benchmarks/plateau_exit.py); None: not reported
    plateau_threshold: float | None = None

    @property
    def data_dir(self) -> Path:
        return world_data_dir(self.world)
