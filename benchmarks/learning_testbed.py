"""The task of a learning benchmark (``bench_learning``, ``bench_branching``): a generated world, the settings
trained on it (each a run.py command line) and the comparisons between them."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import envs
from envs.synthetic import BranchSpec, WorldSpec, world_data_dir
from experiments.settings import RunSettings

DEFAULT_MAX_TURNS = RunSettings.model_fields["max_turns"].default  # run.py's (the env's) search steps


def max_turns_for(env_id: str, data_dir: Path) -> int:
    """The search steps to allow on the generated world in ``data_dir``: run.py's default, or the searches its
    questions need where they need more (a SynthBranch world with a lead hop and 4 hops)."""
    return max(DEFAULT_MAX_TURNS, envs.world_hops(env_id, data_dir=str(data_dir)) or 0)


@dataclass(frozen=True)
class RunProbe:
    """A measurement of every run's policy beside its metrics (``bench_decision``'s probe of the decision):
    ``options``, run.py options given after the benchmark's shared ones (so they win: e.g. the checkpoints it reads),
    and ``measure``, called with the run's directory once its training has ended, before its final evaluation."""

    options: tuple[str, ...]
    measure: Callable[[Path], None]


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
    probe: RunProbe | None = None  # measured on every run (None: none)

    @property
    def data_dir(self) -> Path:
        return world_data_dir(self.world)

    @property
    def max_turns(self) -> int:
        """The search steps its runs and evaluations allow (``max_turns_for`` its world)."""
        return max_turns_for(self.env, self.data_dir)
