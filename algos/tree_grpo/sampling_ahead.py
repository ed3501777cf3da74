"""The sample taken ahead with ``max_staleness`` 1: the next iteration's sample, sent to the remote env runners
before the update (``start_ahead``), waited for after it and kept until the next iteration trains on it
(``SampleAhead``, the algorithm's state ``SAMPLED_AHEAD`` meanwhile).

RLlib keeps at most ``max_requests_in_flight_per_env_runner`` (1) requests of one tag in flight per runner and drops
the others, saying so only in the count ``foreach_env_runner_async`` returns. A training step that fails after
starting its sample (in Tune, or a library user's loop) leaves that request in flight: the next step's request
would be dropped and the old answer collected in its place. So a start first collects and discards what is still in
flight under the tag; a runner whose request was not sent all the same has its prompts sampled after the update
(as a runner that died does); and each answer is checked on receipt against the iteration and the prompts asked
for, anything else discarded, never trained on. ``start_ahead`` and ``SampleAhead`` run without Ray (the runner
group is RLlib's ``EnvRunnerGroup`` or any object with the calls used here, ``AsyncRunners``), so that they are
tested with fakes. ``SamplingAhead`` is the algorithm's side: its sample call, the sample in its state, started and
taken around the update, and the threads of the learner beside the runners that sample meanwhile.
"""

from __future__ import annotations

import functools
import math
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import ray
import torch

from algos.tree_grpo import metrics as metric_keys
from algos.tree_grpo.env_runner import RunnerResult, TreeSearchEnvRunner
from algos.tree_grpo.settings import available_cores, split_threads
from algos.tree_grpo.sharding import Started, answering_errors, raise_worker_errors, shard

AHEAD_TAG = "sample_ahead"  # RLlib's tag of the remote calls that sample ahead
SAMPLED_AHEAD = "sampled_ahead"  # the algorithm's state: the next iteration's sample


class AsyncRunners(Protocol):
    """The calls of RLlib's ``EnvRunnerGroup`` that sampling ahead uses."""

    def num_remote_env_runners(self) -> int: ...

    def healthy_env_runner_ids(self) -> list[int]: ...

    def foreach_env_runner_async(self, func: Callable[[Any], Any], tag: str | None = None, *,
                                 remote_worker_ids: list[int] | None = None) -> int: ...

    def fetch_ready_async_reqs(self, *, tags: str | None = None,
                               timeout_seconds: float | None = 0.0) -> list[tuple[int, Any]]: ...


def note(message: str) -> None:
    print(f"sampling ahead: {message}", file=sys.stderr, flush=True)


def asked(iteration: int, prompts: Sequence[int]) -> Callable[[RunnerResult], bool]:
    """Whether an answer is the one asked for: sampled for ``iteration`` (0-based), on exactly ``prompts``."""
    return lambda result: result.iteration == iteration and list(result.prompt_indices) == list(prompts)


def discard_in_flight(group: AsyncRunners) -> None:
    """Wait for the requests still in flight under ``AHEAD_TAG`` (started by a training step that did not finish)
    and discard their answers, so that RLlib sends the next one."""
    stale = group.fetch_ready_async_reqs(tags=AHEAD_TAG, timeout_seconds=None)
    if stale:
        iterations = sorted({result.iteration + 1 for _, result in stale if isinstance(result, RunnerResult)})
        note(f"discarded {len(stale)} sample(s) of iteration(s) {iterations} left in flight by a training step that "
             f"did not finish")


def start_ahead(group: AsyncRunners, iteration: int, prompts: Sequence[int],
                call: Callable[[Any, list[int]], RunnerResult]) -> Started[RunnerResult] | None:
    """``call(runner, shard)`` (the sample of ``iteration``) sent to every healthy remote runner, ``prompts`` split
    over them, without waiting: the first round of ``run_sharded``, None when no remote runner is healthy. The
    round's answers are those sent and answered as asked; the shards of the others are missing, so ``run_sharded``
    samples them again on the runners healthy then. ``call`` is shipped to the runners: it must not hold the
    algorithm."""
    discard_in_flight(group)
    workers = group.healthy_env_runner_ids() if group.num_remote_env_runners() > 0 else []
    if not workers:
        return None
    shards, guarded = shard(prompts, workers), answering_errors(call)
    sent = {worker for worker, part in shards.items()  # one request per runner: RLlib's count says which
            if group.foreach_env_runner_async(lambda runner, part=part: guarded(runner, part), tag=AHEAD_TAG,
                                              remote_worker_ids=[worker])}
    if unsent := sorted(set(shards) - sent):
        note(f"RLlib did not send iteration {iteration + 1}'s sample to env runner(s) {unsent} (a request of "
             f"theirs in flight: max_requests_in_flight_per_env_runner); their prompts are sampled after the update")

    def answers() -> dict[int, RunnerResult]:  # a runner that died is missing (RLlib marks it unhealthy)
        received = group.fetch_ready_async_reqs(tags=AHEAD_TAG, timeout_seconds=None)
        raise_worker_errors({worker: result for worker, result in received if worker in sent})
        kept = {worker: result for worker, result in received
                if worker in sent and asked(iteration, shards[worker])(result)}
        if stale := sorted(worker for worker, _ in received if worker not in kept):
            note(f"discarded the answer(s) of env runner(s) {stale}: not iteration {iteration + 1}'s sample of the "
                 f"prompts asked for; their prompts are sampled again")
        return kept

    return Started(shards, answers)


class SampleAhead:
    """The next iteration's sample, taken ahead: kept from its arrival until the next iteration's update replaces
    it (a stop before then saves it for the iteration it belongs to), ``results`` being the algorithm's state
    ``SAMPLED_AHEAD`` (None: none kept)."""

    def __init__(self) -> None:
        self.results: list[RunnerResult] | None = None

    def for_iteration(self, iteration: int) -> list[RunnerResult] | None:
        """The kept sample when every part of it was sampled for ``iteration``; else None, and a sample kept for
        another iteration (a state restored without its own sample ahead, or saved before results named their
        iteration) is dropped: the iteration samples anew."""
        if self.results is not None and any(result.iteration != iteration for result in self.results):
            note(f"discarded a kept sample that was not taken for iteration {iteration + 1}; sampling it now")
            self.results = None
        return self.results

    def take(self, ahead: Callable[[], list[RunnerResult]] | None) -> float:
        """Wait for the next iteration's sample started ahead (None: none started) and keep it; the seconds
        waited."""
        start = time.perf_counter()
        taken = ahead() if ahead is not None else None
        self.results = taken  # only now: a stop while waiting keeps the current iteration's own for the checkpoint
        return time.perf_counter() - start if ahead is not None else 0.0


class SamplingAhead:
    """Mixed into ``TreeGRPO`` before RLlib's ``Algorithm``: an iteration's sample (``sample_call``), and with
    ``max_staleness`` 1 the next one's taken ahead. An iteration then starts the next one's sample on the remote
    runners before its own update and collects it after: the runners sample with the weights from before the update
    while the learner updates, and load the new weights when that sample returns. The sample kept meanwhile
    (``SampleAhead``) is part of the algorithm's state (``SAMPLED_AHEAD``), with RLlib's component semantics
    (``get_state`` honours ``components`` and ``not_components``; a ``set_state`` without it leaves the kept sample
    alone), saved in checkpoints: a resumed run trains on the very batch the uninterrupted run would have (sampled
    with weights the checkpoint no longer holds). The learner in the driver leaves the runners' cores to them
    (``learner_threads``); ``stop()`` gives the driver its threads back."""

    def setup(self, config: Any) -> None:
        self._ahead = SampleAhead()
        self._torch_threads = torch.get_num_threads()
        super().setup(config)
        self._set_learner_threads()

    def get_state(self, components=None, *, not_components=None, **kwargs) -> dict[str, Any]:
        state = super().get_state(components, not_components=not_components, **kwargs)
        if self._check_component(SAMPLED_AHEAD, components, not_components):  # None too: "no sample kept"
            state[SAMPLED_AHEAD] = self._ahead.results  # sampled with weights the checkpoint does not hold
        return state

    def set_state(self, state: dict[str, Any]) -> None:
        super().set_state(state)
        if SAMPLED_AHEAD in state:
            self._ahead.results = state[SAMPLED_AHEAD]

    def cleanup(self) -> None:  # Tune's hook of ``stop()``
        super().cleanup()
        torch.set_num_threads(self._torch_threads)

    def _set_learner_threads(self) -> None:
        """The torch threads of the learner in the driver: ``learner_threads``; else with max_staleness 1 the cores
        the remote runners on this machine leave (they sample while it updates); else torch's own."""
        threads = self.config.learner_threads
        if threads is None and self.config.max_staleness and not self.config.num_learners:
            here = ray.get_runtime_context().get_node_id()
            beside = [count for node, count in self.env_runner_group.foreach_env_runner(
                lambda runner: (ray.get_runtime_context().get_node_id(), torch.get_num_threads()),
                local_env_runner=False) if node == here]
            threads = split_threads(available_cores(), beside, self._torch_threads)
        if threads is not None:
            torch.set_num_threads(threads)

    def sample_call(self, iteration: int, *, ahead: bool = False) -> Callable[[], list[RunnerResult]]:
        """``iteration``'s sample as a call that returns the runners' results (``on_env_runners``). ``ahead``: sent
        to the remote runners now, sampling with the weights they hold now, so that the call only waits for it
        (and samples again the prompts of a runner that died or answered otherwise meanwhile, on the runners healthy
        then); else the call does it all."""
        prompts = self._prompts_of(iteration)
        runners = max(1, self.env_runner_group.num_healthy_remote_env_runners())
        per_runner = math.ceil(self.config.trees_count / runners) if self._exports_trees(iteration) else 0

        def sample(runner: TreeSearchEnvRunner, shard: list[int]) -> RunnerResult:  # shipped: holds no algorithm
            return runner.sample_prompts(shard, iteration=iteration, export_trees=per_runner)

        started = start_ahead(self.env_runner_group, iteration, prompts, sample) if ahead else None
        return functools.partial(self.on_env_runners, prompts, sample, f"sampling of iteration {iteration + 1}",
                                 started=started)

    def _batch_of(self, iteration: int) -> list[RunnerResult]:
        """``iteration``'s sample: the one kept (until the update, or the skip, replaces it: a stop before then saves
        it for this iteration), else sampled now."""
        results = self._ahead.for_iteration(iteration)
        return self.sample_call(iteration)() if results is None else results

    def _start_ahead(self, iteration: int) -> Callable[[], list[RunnerResult]] | None:
        """With max_staleness 1, ``iteration``'s sample started on the remote runners now (``_take_ahead`` waits for
        it); else None."""
        return self.sample_call(iteration, ahead=True) if self.config.max_staleness else None

    def _take_ahead(self, ahead: Callable[[], list[RunnerResult]] | None) -> float:
        """Wait for the next iteration's sample started ahead (None: none started) and keep it for that iteration;
        the seconds waited (``SAMPLE_WAIT_TIME_S``)."""
        waited = self._ahead.take(ahead)
        self.metrics.log_value(metric_keys.SAMPLE_WAIT_TIME_S, waited, window=1)
        return waited
