"""The sample taken ahead (``algos/tree_grpo/sampling_ahead.py``), Ray-free: a request left in flight by a training
step that failed is discarded, not collected in place of the new one; a request RLlib did not send, and an answer
that is not the one asked for, have their prompts sampled again; the algorithm's state round-trips exactly, partial
states included (RLlib's component semantics); and the options around it: ``--tis-cap None`` with
``--max-staleness 1`` is refused, the learner's threads are split with the runners'. (The loop through Ray:
tests/test_pipelining.py.)"""

from __future__ import annotations

import pytest
from ray.rllib.algorithms.algorithm import Algorithm

from algos.tree_grpo import TreeGRPOConfig
from algos.tree_grpo import settings as algo_settings
from algos.tree_grpo.env_runner import RunnerResult
from algos.tree_grpo.sampling_ahead import AHEAD_TAG, SAMPLED_AHEAD, SampleAhead, start_ahead
from algos.tree_grpo.settings import TreeGRPOSettings, env_runner_threads, split_threads, validated
from algos.tree_grpo.sharding import run_sharded
from algos.tree_grpo.tree_grpo import TreeGRPO


class FakeRunner:
    """An env runner whose sample names the iteration and prompts it was asked for."""

    def __init__(self, worker_index: int):
        self.worker_index = worker_index

    def sample_prompts(self, prompt_indices: list[int], *, iteration: int, export_trees: int = 0) -> RunnerResult:
        return RunnerResult(self.worker_index, list(prompt_indices), [], {}, iteration=iteration)


class FakeRunnerGroup:
    """RLlib's ``EnvRunnerGroup`` as documented: an async request is dropped while ``max_in_flight`` requests of its
    tag are in flight on that runner (``max_requests_in_flight_per_env_runner``, 1 by default), and the count of
    requests made says so; ``fetch_ready_async_reqs`` with no timeout waits for every request of the tag in flight
    and returns ``(runner, answer)`` pairs. ``refused`` runners are sent nothing."""

    def __init__(self, workers: tuple[int, ...] = (1, 2), refused: frozenset[int] = frozenset()):
        self.runners = {worker: FakeRunner(worker) for worker in workers}
        self.refused = refused
        self.in_flight: list[tuple[str | None, int, object]] = []

    def num_remote_env_runners(self) -> int:
        return len(self.runners)

    def healthy_env_runner_ids(self) -> list[int]:
        return sorted(self.runners)

    def foreach_env_runner_async(self, func, tag=None, *, remote_worker_ids=None) -> int:
        sent = 0
        for worker in remote_worker_ids or sorted(self.runners):
            if worker not in self.refused and not any(t == tag and w == worker for t, w, _ in self.in_flight):
                self.in_flight.append((tag, worker, func))
                sent += 1
        return sent

    def fetch_ready_async_reqs(self, *, tags=None, timeout_seconds=0.0) -> list[tuple[int, object]]:
        assert timeout_seconds is None  # waits for them all
        ready = [(worker, func) for tag, worker, func in self.in_flight if tags is None or tag == tags]
        self.in_flight = [request for request in self.in_flight if not (tags is None or request[0] == tags)]
        return [(worker, func(self.runners[worker])) for worker, func in ready]

    def dispatch(self, call):
        """A synchronous round (``run_sharded``'s ``dispatch``), every runner answering."""
        return lambda shards: {worker: call(self.runners[worker], part) for worker, part in shards.items()}


def sample_of(iteration: int):
    return lambda runner, shard: runner.sample_prompts(shard, iteration=iteration)


def collected(group: FakeRunnerGroup, started, prompts: list[int], iteration: int) -> list[tuple[int, int]]:
    """What ``run_sharded`` makes of a round started ahead (lost prompts sampled again over the runners):
    (iteration, prompt) of every prompt sampled, sorted."""
    results = run_sharded(prompts, healthy=group.healthy_env_runner_ids, dispatch=group.dispatch(sample_of(iteration)),
                          recover=lambda: None, what="sampling", started=started)
    return sorted((result.iteration, prompt) for result in results for prompt in result.prompt_indices)


def test_a_request_left_in_flight_by_a_failed_step_is_discarded_and_the_new_one_sent(capsys):
    group = FakeRunnerGroup()
    start_ahead(group, 5, [0, 1, 2, 3], sample_of(5))  # the training step that sent it failed before collecting it
    started = start_ahead(group, 6, [4, 5, 6, 7], sample_of(6))  # the retried step's
    assert [(tag, worker) for tag, worker, _ in group.in_flight] == [(AHEAD_TAG, 1), (AHEAD_TAG, 2)]
    assert {worker: (r.iteration, r.prompt_indices) for worker, r in started.answers().items()} == {
        1: (6, [4, 5]), 2: (6, [6, 7])}
    assert "discarded 2 sample(s) of iteration(s) [6] left in flight by a training step that did not finish" in (
        capsys.readouterr().err)


def test_an_answer_that_is_not_the_one_asked_for_is_discarded_and_its_prompts_sampled_again(capsys):
    group = FakeRunnerGroup()
    started = start_ahead(group, 6, [4, 5, 6, 7], sample_of(6))
    tag, worker, _ = group.in_flight[0]
    group.in_flight[0] = (tag, worker, lambda runner: sample_of(5)(runner, [4, 5]))  # another iteration's
    assert collected(group, started, [4, 5, 6, 7], 6) == [(6, 4), (6, 5), (6, 6), (6, 7)]
    assert "discarded the answer(s) of env runner(s) [1]: not iteration 7's sample" in capsys.readouterr().err

    started = start_ahead(group, 6, [4, 5, 6, 7], sample_of(6))
    group.in_flight[1] = (tag, 2, lambda runner: sample_of(6)(runner, [4, 5]))  # other prompts
    assert collected(group, started, [4, 5, 6, 7], 6) == [(6, 4), (6, 5), (6, 6), (6, 7)]


def test_a_request_rllib_does_not_send_has_its_prompts_sampled_after_the_update(capsys):
    group = FakeRunnerGroup(refused=frozenset({2}))
    started = start_ahead(group, 6, [4, 5, 6, 7], sample_of(6))
    assert [worker for _, worker, _ in group.in_flight] == [1]
    assert "RLlib did not send iteration 7's sample to env runner(s) [2]" in capsys.readouterr().err
    assert collected(group, started, [4, 5, 6, 7], 6) == [(6, 4), (6, 5), (6, 6), (6, 7)]


def test_no_healthy_remote_runner_starts_nothing():
    assert start_ahead(FakeRunnerGroup(workers=()), 0, [0, 1], sample_of(0)) is None


def test_a_kept_sample_serves_only_its_own_iteration(capsys):
    ahead = SampleAhead()
    assert ahead.take(None) == 0.0 and ahead.results is None
    assert ahead.take(lambda: [RunnerResult(1, [0], [], {}, iteration=3)]) >= 0.0
    assert ahead.for_iteration(3) == [RunnerResult(1, [0], [], {}, iteration=3)]
    assert ahead.for_iteration(4) is None and ahead.results is None  # e.g. restored to another iteration
    assert "discarded a kept sample that was not taken for iteration 5" in capsys.readouterr().err
    ahead.results = [RunnerResult(1, [0], [], {})]  # saved before results named their iteration
    assert ahead.for_iteration(3) is None


@pytest.fixture
def algorithms(monkeypatch):
    """TreeGRPO's own state on top of a stand-in for RLlib's (a learner group's and the iteration)."""
    def rllib_state(self, components=None, *, not_components=None, **kwargs) -> dict:
        return {"learner_group": "weights", "training_iteration": 3}

    monkeypatch.setattr(Algorithm, "get_state", rllib_state)
    monkeypatch.setattr(Algorithm, "set_state", lambda self, state: None)

    def make() -> TreeGRPO:
        algo = TreeGRPO.__new__(TreeGRPO)
        algo._ahead = SampleAhead()
        return algo

    return make


def test_a_partial_state_leaves_the_sample_taken_ahead_alone(algorithms):
    algo, sample = algorithms(), [RunnerResult(1, [0, 1], [], {}, iteration=3)]
    algo.set_state({SAMPLED_AHEAD: sample})
    algo.set_state({"learner_group": "weights"})
    assert algo.get_state()[SAMPLED_AHEAD] is sample


def test_get_state_honours_components(algorithms):
    algo, sample = algorithms(), [RunnerResult(1, [0, 1], [], {}, iteration=3)]
    algo.set_state({SAMPLED_AHEAD: sample})
    assert SAMPLED_AHEAD not in algo.get_state(components="learner_group")
    assert SAMPLED_AHEAD not in algo.get_state(not_components=[SAMPLED_AHEAD])
    assert algo.get_state(components=[SAMPLED_AHEAD])[SAMPLED_AHEAD] is sample


def test_the_state_round_trips_exactly_with_and_without_a_sample(algorithms):
    source, target = algorithms(), algorithms()
    source.set_state({SAMPLED_AHEAD: [RunnerResult(1, [0, 1], [], {}, iteration=3)]})
    target.set_state(source.get_state())
    assert target.get_state() == source.get_state()
    empty = algorithms()  # a full state without a sample says so: restoring it clears the one kept
    target.set_state(empty.get_state())
    assert target.get_state() == empty.get_state() and target.get_state()[SAMPLED_AHEAD] is None


def test_no_truncated_importance_weights_with_a_staleness_of_one_is_refused():
    with pytest.raises(ValueError, match="tis_cap: None turns off the truncated importance weights, the only "
                                         "correction of the sampler's lag with max_staleness 1"):
        validated(TreeGRPOSettings, {"max_staleness": 1, "tis_cap": None})
    validated(TreeGRPOSettings, {"max_staleness": 0, "tis_cap": None})  # on-policy: nothing to correct


def test_the_learner_gets_the_cores_the_runners_leave(monkeypatch):
    assert split_threads(2, [1], 2) == 1  # run.py's defaults on 2 cores: one thread each
    assert split_threads(8, [1, 1], 8) == 6 and split_threads(8, [1], 4) == 4  # never above the process's own
    assert split_threads(2, [1, 1, 1], 2) == 1  # at least one
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert [env_runner_threads(cpus) for cpus in (0.5, 1.0, 2.5)] == [1, 1, 2]  # as Ray sets OMP_NUM_THREADS
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # inherited: Ray leaves it
    assert env_runner_threads(1.0) == 3


def test_learner_threads_are_refused_for_remote_learners():
    with pytest.raises(ValueError, match="learner_threads: sets the torch threads of the learner in the driver, but "
                                         "num_learners is 2"):
        TreeGRPOConfig().training(learner_threads=2).learners(num_learners=2).validate()


def test_the_placement_line_says_how_the_threads_are_split(tmp_path, monkeypatch):
    import torch

    from experiments.preflight import placement_line
    from experiments.run import plan

    def line(*argv: str) -> str:
        return placement_line(plan([*argv, "--output", str(tmp_path / "run")]).settings)

    monkeypatch.setattr(algo_settings, "available_cores", lambda: 2)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    ahead = line("--max-staleness", "1", "--num-env-runners", "1")
    assert ("learner: in this process, on the CPU, 1 torch thread(s): this machine's 2 cores less the remote env "
            "runners' 1 each, which sample while it updates (max_staleness 1; --learner-threads sets it)") in ahead
    assert "2 torch thread(s) (--learner-threads)" in line("--max-staleness", "1", "--num-env-runners", "1",
                                                           "--learner-threads", "2")
    assert "thread" not in line("--num-env-runners", "1")  # K = 0: torch's own, as before
    assert "thread" not in line("--max-staleness", "1", "--num-env-runners", "1", "--num-learners", "1")
