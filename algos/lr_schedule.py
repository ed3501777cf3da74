"""The learning-rate schedule: linear warm-up, then constant or cosine decay (to zero at the last step).

RLlib's own lr schedules are piecewise in sampled env steps and reset the optimizer's rate after every update;
Tree-GRPO counts optimizer steps (K mini-batches x E epochs per iteration), so the learner sets the rate of each
step from this function and keeps the step counter in its checkpointed state.
"""

from __future__ import annotations

import math
from typing import Literal

LrSchedule = Literal["constant", "cosine"]
LR_SCHEDULES: tuple[str, ...] = ("constant", "cosine")


def warmup_steps_of(warmup_ratio: float, total_steps: int | None) -> int:
    """Warm-up length in optimizer steps: ``ceil(warmup_ratio * total_steps)`` (0 when the total is unknown)."""
    return math.ceil(warmup_ratio * total_steps) if total_steps else 0


def scheduled_lr(lr: float, step: int, *, warmup_steps: int = 0, total_steps: int | None = None,
                 schedule: LrSchedule = "constant") -> float:
    """Learning rate of optimizer step ``step`` (1-based).

    Warm-up: ``lr * step / warmup_steps`` for the first ``warmup_steps`` steps. After it, ``constant`` keeps
    ``lr``; ``cosine`` decays from ``lr`` to 0 at ``total_steps`` (and stays at 0 beyond it).
    """
    if step < 1:
        raise ValueError(f"optimizer steps count from 1, got {step}")
    if warmup_steps and step <= warmup_steps:
        return lr * step / warmup_steps
    if schedule == "constant":
        return lr
    if schedule != "cosine":
        raise ValueError(f"unknown lr schedule {schedule!r}; choose one of {LR_SCHEDULES}")
    if not total_steps:
        raise ValueError("the cosine schedule needs the total number of optimizer steps")
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return lr * 0.5 * (1.0 + math.cos(math.pi * progress))
