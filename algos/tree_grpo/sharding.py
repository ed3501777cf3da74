"""Spreading work (prompts to sample, questions to evaluate) over the env runners, surviving runners that die.

The items are split into contiguous shards, one per healthy runner. A runner that dies mid-call returns nothing:
its items go back into the pool, the algorithm tries to bring failed runners back (Ray restarts the actor, the
algorithm gives it the current weights), and the pool is split again over the runners that are healthy now (the
survivors, the restarted one if it is back). A runner that lives but whose call raises is not a death: the call
answers with the exception (``answering_errors``), which is raised in the driver (RLlib, restarting failed runners,
would log it, take the runner for dead and retry the same items to the same error). Ray-free, so that the retry
logic is tested with plain functions.
"""

from __future__ import annotations

import pickle
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import numpy as np

T = TypeVar("T")

SHARD_ATTEMPTS = 3  # rounds of dispatch before an iteration gives up on the items still without a result


def shard(items: Sequence[int], workers: Sequence[int]) -> dict[int, list[int]]:
    """``items`` in contiguous, near-equal shards (``np.array_split``), one per worker in order; workers whose
    shard would be empty are left out."""
    if not workers:
        raise ValueError("shard() needs at least one worker")
    parts = np.array_split(np.asarray(items, dtype=np.int64), len(workers))
    return {worker: part.tolist() for worker, part in zip(workers, parts, strict=True) if len(part)}


@dataclass(frozen=True)
class RaisedInWorker:
    """The exception a worker's call raised, brought back as its answer, with the worker's traceback."""

    error: Exception
    trace: str


def answering_errors(call: Callable[..., T]) -> Callable[..., T | RaisedInWorker]:
    """``call``, answering an exception it raises as a ``RaisedInWorker`` (one that does not pickle, as Ray would
    need, as a RuntimeError naming its type and message)."""
    def guarded(*args: Any) -> T | RaisedInWorker:
        try:
            return call(*args)
        except Exception as error:  # every error a call raises is the driver's to raise
            trace = traceback.format_exc()
            try:
                pickle.dumps(error)
            except Exception:  # pickling can raise anything
                error = RuntimeError(f"{type(error).__name__}: {error}")
            return RaisedInWorker(error, trace)

    return guarded


def raise_worker_errors(answers: Mapping[int, Any]) -> None:
    """Raise the first (by worker id) exception that ``answers`` hold as a ``RaisedInWorker``, noting the worker and
    its traceback."""
    for worker in sorted(answers):
        if isinstance(raised := answers[worker], RaisedInWorker):
            raised.error.add_note(f"raised in env runner {worker}:\n{raised.trace.rstrip()}")
            raise raised.error


@dataclass(frozen=True)
class Started(Generic[T]):
    """A first round already sent (the items' shards, one per worker) whose answers are still to come:
    ``answers()`` waits for them and returns those of the workers that answered (a dead worker is missing)."""

    shards: dict[int, list[int]]
    answers: Callable[[], dict[int, T]]


def run_sharded(items: Sequence[int], *, healthy: Callable[[], list[int]],
                dispatch: Callable[[dict[int, list[int]]], dict[int, T]], recover: Callable[[], object],
                what: str, attempts: int = SHARD_ATTEMPTS, started: Started[T] | None = None) -> list[T]:
    """Every item processed once: results in the order of the attempts, within an attempt by worker id.

    ``healthy()`` lists the workers to use now; ``dispatch(shards)`` runs each worker on its shard and returns
    the results of the workers that answered (a dead worker is missing); ``recover()`` tries to bring failed
    workers back before the next attempt. ``started``: the first round, sent before (its shards cover ``items``),
    whose answers are collected instead of dispatching one. After ``attempts`` rounds with items still
    unanswered, a ``RuntimeError`` names ``what``, the workers that failed and the items left.
    """
    pending, results, failed = list(items), [], set()
    if not pending:
        return results
    for _ in range(attempts):
        if started is not None:
            shards, answers, started = started.shards, started.answers(), None
        elif workers := healthy():
            shards = shard(pending, workers)
            answers = dispatch(shards)
        else:
            recover()
            continue
        raise_worker_errors(answers)
        results.extend(answers[worker] for worker in sorted(answers))
        lost = sorted(set(shards) - set(answers))
        failed.update(lost)
        pending = [item for worker in lost for item in shards[worker]]
        if not pending:
            return results
        recover()
    runners = f"env runner(s) {sorted(failed)} failed" if failed else "no env runner was healthy"
    raise RuntimeError(f"{what}: {runners}, and after {attempts} attempts {len(pending)} item(s) have no result: "
                       f"{pending}")
