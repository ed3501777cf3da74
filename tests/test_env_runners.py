"""Work spread over env runners: sharding and its retries (pure), several remote runners in one iteration, the
exported trees' leaf indices, counting the questions without a retriever, the mid-update flag, the weight sync
(buckets through the object store, tensor to tensor in one process), and (slow) a runner that dies mid-sample."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import ray
import torch
from ray.rllib.core import DEFAULT_MODULE_ID
from ray.rllib.utils.metrics import ENV_RUNNER_RESULTS, LEARNER_RESULTS, NUM_ENV_STEPS_SAMPLED_LIFETIME

import algos.tree_grpo.tree_grpo as tree_grpo_module
import envs
import envs.search_qa
from algos.tree_grpo import TreeGRPOConfig, weight_transport
from algos.tree_grpo import metrics as metric_keys
from algos.tree_grpo.config_checks import check_prompts_drawn
from algos.tree_grpo.env_runner import TreeSearchEnvRunner, module_device
from algos.tree_grpo.sharding import RaisedInWorker, Started, answering_errors, run_sharded, shard
from algos.tree_grpo.weight_transport import sync_env_runners, weights_seq_no

LEAVES_PER_PROMPT = 6  # the default shape (2, 2, 1)


def tiny_config(data_dir: Path, prompts: int, **training) -> TreeGRPOConfig:
    return (TreeGRPOConfig().environment("HotpotQA-v0", env_config={"data_dir": str(data_dir)})
            .training(max_step_tokens=8, prompts_per_iteration=prompts, micro_batch_size=6, **training)
            .rl_module(model_config={"model": "tiny-random", "seed": 0}))


def two_remote_runners(config: TreeGRPOConfig) -> TreeGRPOConfig:
    return config.env_runners(num_env_runners=2, num_cpus_per_env_runner=0.5)


# -- sharding and its retries, without Ray ------------------------------------------------------------------


def test_shard_splits_contiguously_and_leaves_out_empty_shards():
    assert shard([5, 6, 7], [1, 2]) == {1: [5, 6], 2: [7]}
    assert shard([5], [1, 2, 3]) == {1: [5]}
    assert shard([], [1]) == {}


class FlakyWorkers:
    """Workers that double their items; ``dies`` lists (attempt, worker) pairs that die instead of answering.
    ``recover`` brings every dead worker back."""

    def __init__(self, workers: list[int], dies: set[tuple[int, int]], come_back: bool = True):
        self.alive, self.dies, self.come_back = list(workers), dies, come_back
        self.dead: list[int] = []
        self.attempt, self.dispatched = 0, []

    def healthy(self) -> list[int]:
        return list(self.alive)

    def dispatch(self, shards: dict[int, list[int]]) -> dict[int, list[int]]:
        self.attempt += 1
        self.dispatched.append(shards)
        answers = {}
        for worker, items in shards.items():
            if (self.attempt, worker) in self.dies:
                self.alive.remove(worker)
                self.dead.append(worker)
            else:
                answers[worker] = [2 * item for item in items]
        return answers

    def recover(self) -> None:
        if self.come_back:
            self.alive, self.dead = sorted(self.alive + self.dead), []


def test_a_dead_workers_items_are_processed_again_once():
    workers = FlakyWorkers([1, 2], dies={(1, 1)})
    results = run_sharded([10, 11, 12, 13], healthy=workers.healthy, dispatch=workers.dispatch,
                          recover=workers.recover, what="sampling")
    assert workers.dispatched == [{1: [10, 11], 2: [12, 13]}, {1: [10], 2: [11]}]  # the restarted one helps
    assert sorted(item for part in results for item in part) == [20, 22, 24, 26]  # each item once


def test_a_worker_that_stays_dead_leaves_its_items_to_the_survivors():
    workers = FlakyWorkers([1, 2], dies={(1, 2)}, come_back=False)
    results = run_sharded([10, 11, 12], healthy=workers.healthy, dispatch=workers.dispatch,
                          recover=workers.recover, what="sampling")
    assert workers.dispatched[1] == {1: [12]}
    assert results == [[20, 22], [24]]


def test_items_without_a_result_after_the_attempts_are_an_error_naming_runners_and_items():
    workers = FlakyWorkers([1, 2], dies={(1, 2), (2, 1), (3, 1)})
    with pytest.raises(RuntimeError, match=r"sampling of iteration 3: env runner\(s\) \[1, 2\] failed.*\[12\]"):
        run_sharded([10, 11, 12], healthy=workers.healthy, dispatch=workers.dispatch, recover=workers.recover,
                    what="sampling of iteration 3")
    nobody = FlakyWorkers([], dies=set())
    with pytest.raises(RuntimeError, match="no env runner was healthy"):
        run_sharded([1], healthy=nobody.healthy, dispatch=nobody.dispatch, recover=nobody.recover, what="x")


def test_a_started_rounds_answers_are_collected_and_its_dead_workers_items_dispatched_again():
    workers = FlakyWorkers([1, 2], dies=set())
    started = Started({1: [10, 11], 2: [12]}, answers=lambda: {2: [24]})  # worker 1 died meanwhile
    results = run_sharded([10, 11, 12], healthy=workers.healthy, dispatch=workers.dispatch,
                          recover=workers.recover, what="sampling", started=started)
    assert workers.dispatched == [{1: [10], 2: [11]}]  # the started round is not sent again: only the lost items
    assert results == [[24], [20], [22]]


def test_a_call_that_raises_in_a_living_worker_is_raised_in_the_driver_not_retried():
    workers = FlakyWorkers([1, 2], dies=set())

    def dispatch(shards):
        workers.dispatched.append(shards)
        return {worker: answering_errors(lambda items: [1 / (item - 11) for item in items])(items)
                for worker, items in shards.items()}

    with pytest.raises(ZeroDivisionError) as raised:
        run_sharded([10, 11, 12], healthy=workers.healthy, dispatch=dispatch, recover=workers.recover,
                    what="sampling")
    assert len(workers.dispatched) == 1  # not sent again: it is no runner's death
    assert "raised in env runner 1" in "".join(raised.value.__notes__)
    assert "ZeroDivisionError" in "".join(raised.value.__notes__)  # the worker's traceback


class Unpicklable(Exception):
    def __reduce__(self):
        raise TypeError("not picklable")


def test_an_error_that_would_not_reach_the_driver_is_answered_as_a_runtime_error_naming_it():
    def fails():
        raise Unpicklable("the cause")

    answer = answering_errors(fails)()
    assert isinstance(answer, RaisedInWorker) and type(answer.error) is RuntimeError
    assert str(answer.error) == "Unpicklable: the cause"
    assert "in fails" in answer.trace and "__reduce__" not in answer.trace  # the call's traceback, not pickle's
    assert answering_errors(lambda x: x + 1)(1) == 2


# -- the number of questions, without building the retriever ------------------------------------------------


@pytest.fixture
def no_retriever(monkeypatch):
    """Building a search env in this process (the driver) fails."""

    def refuse(*args, **kwargs):
        raise AssertionError("the driver built a retriever")

    monkeypatch.setattr(envs.search_qa, "get_retriever", refuse)


def test_question_count_reads_the_dataset_only(data_dir, monkeypatch):
    expected = len(gym.make("HotpotQA-v0", data_dir=str(data_dir)).unwrapped.records)
    monkeypatch.setattr(envs.search_qa, "get_retriever", lambda *a, **k: pytest.fail("built a retriever"))
    assert envs.question_count("HotpotQA-v0", data_dir=str(data_dir)) == expected
    dev = envs.question_count("HotpotQA-v0", data_dir=str(data_dir), split="dev")
    assert dev == len(envs.datasets.load_dataset("hotpotqa", "dev", data_dir)) != expected
    world = {"people": 20, "companies": 10, "cities": 6, "countries": 3, "train_questions": 17, "dev_questions": 5}
    assert envs.question_count("SynthHop-v0", world=world) == 17
    assert envs.question_count("SynthHop-v0", world=world, split="dev") == 5
    assert envs.question_count("SynthBranch-v0", world={**world, "train_questions": 6}) == 6


# -- one iteration on several runners ----------------------------------------------------------------------


def test_two_remote_runners_share_an_iteration_and_the_evaluation(ray_session, data_dir, monkeypatch, no_retriever):
    prompts = 3  # shards of 2 and 1 prompts: the second runner's records start at an offset
    batches, dispatched = [], []
    real_pad_batch, real_run_sharded = tree_grpo_module.pad_batch, tree_grpo_module.run_sharded
    monkeypatch.setattr(tree_grpo_module, "pad_batch", lambda records, *a, **k: (
        batches.append(records), real_pad_batch(records, *a, **k))[1])
    # distinct advantages (row numbers), so that a tree's leaves show which records they point at
    monkeypatch.setattr(tree_grpo_module, "prompt_advantages",
                        lambda records, mode: np.arange(len(records), dtype=float))

    def spy_run_sharded(items, *, dispatch, what, **kwargs):
        def spy_dispatch(shards):
            answers = dispatch(shards)
            dispatched.append((what, shards, answers))
            return answers

        return real_run_sharded(items, dispatch=spy_dispatch, what=what, **kwargs)

    monkeypatch.setattr(tree_grpo_module, "run_sharded", spy_run_sharded)
    config = two_remote_runners(tiny_config(data_dir, prompts, trees_every=1, trees_count=4))
    # a reward that differs between questions, so that a mean over the leaves differs from the runners' means' mean
    config.environment(env_config={**config.env_config, "reward": lambda answer, answers, valid: len(answers[0])})
    algo = config.evaluation(evaluation_interval=1, evaluation_duration=3).build_algo()
    try:
        # no runner in the driver (the config derives it): get_module() is a remote runner's, synced after the update
        assert algo.env_runner is None and algo.eval_env_runner_group is None
        start = {k: v.clone() for k, v in algo.get_module().model.state_dict().items()}
        result = algo.train()
        learned = algo.learner_group.get_weights()[DEFAULT_MODULE_ID]
        served = algo.get_module().model.state_dict()
    finally:
        algo.stop()
    assert any(not torch.equal(served[k], start[k]) for k in start)
    assert all(torch.equal(served[k], torch.as_tensor(learned[f"model.{k}"])) for k in served)

    (records,) = batches
    runners = result[ENV_RUNNER_RESULTS]
    assert len(records) == runners[metric_keys.LEAVES] == prompts * LEAVES_PER_PROMPT
    assert runners[metric_keys.TREES] == len({(r.prompt_index, r.tree_id) for r in records}) == prompts * 2
    (sampling,) = [answers for what, _, answers in dispatched if what.startswith("sampling")]
    assert sorted(sampling) == [1, 2] and [len(sampling[w].prompt_indices) for w in (1, 2)] == [2, 1]
    for key in (metric_keys.TOKENS_GENERATED, metric_keys.TOKENS_PREFILLED, metric_keys.LLM_CALLS,
                metric_keys.TOOL_CALLS, metric_keys.LEAVES, metric_keys.TREES):
        assert runners[key] == sum(sampling[w].metrics[key].peek() for w in (1, 2)), key
    assert result[metric_keys.ENV_RUNNER_RESTARTS] == 0
    rewards = [record.reward for record in records]
    assert len(set(rewards)) > 1 and runners[metric_keys.REWARD] == pytest.approx(np.mean(rewards))

    # exported trees: two per runner, each leaf pointing at its own record in the batch
    trees = algo.exported_trees
    assert len(trees) == 4 and {t["prompt_index"] for t in trees} == {p for w in (1, 2)
                                                                     for p in sampling[w].prompt_indices[:1]}
    rows = []
    for tree in trees:
        stack = [tree["root"]]
        while stack:
            node = stack.pop()
            stack.extend(node["children"])
            if node["is_leaf"]:
                record = records[int(node["advantage"])]
                assert (record.prompt_index, record.tree_id, record.depth) == (
                    tree["prompt_index"], tree["tree_id"], node["depth"])
                rows.append(int(node["advantage"]))
    assert len(rows) == len(set(rows)) == 4 * 3  # a (2, 2, 1) tree has 3 leaves

    # the evaluation: evaluation_duration questions, over both runners
    evaluation = result["evaluation"]
    assert evaluation["questions"] == 3 and 0.0 <= evaluation["em"] <= 1.0
    (eval_shards,) = [shards for what, shards, _ in dispatched if what.startswith("greedy evaluation")]
    assert sorted(eval_shards) == [1, 2] and sorted(q for part in eval_shards.values() for q in part) == [0, 1, 2]


def test_a_remote_runners_error_names_its_cause_and_restarts_nothing(ray_session, data_dir, no_retriever):
    # a prompt longer than the context cap: rollout's ValueError naming the option, not "env runner(s) failed"
    algo = two_remote_runners(tiny_config(data_dir, 2, max_context_tokens=4)).build_algo()
    try:
        with pytest.raises(ValueError, match="max_context_tokens"):
            algo.train()
        assert algo.env_runner_group.num_healthy_remote_env_runners() == 2
    finally:
        algo.stop()


def test_mid_update_is_true_from_the_update_until_train_returns(ray_session, data_dir, monkeypatch):
    algo = tiny_config(data_dir, 1).build_algo()
    try:
        seen = []
        update = algo.learner_group.update

        def spy(*args, **kwargs):
            seen.append(algo.mid_update)
            return update(*args, **kwargs)

        monkeypatch.setattr(algo.learner_group, "update", spy)
        assert algo.mid_update is False
        algo.train()
        assert seen == [True] and algo.mid_update is False
        assert algo.exported_trees == []  # trees_every=10: nothing kept on the first iteration
    finally:
        algo.stop()


def test_the_sampled_leaves_count_over_the_run_where_rllib_and_tune_read_them(ray_session, data_dir, monkeypatch):
    algo = tiny_config(data_dir, 1).build_algo()
    try:
        timesteps = []
        update = algo.learner_group.update
        monkeypatch.setattr(algo.learner_group, "update", lambda *args, **kwargs: (
            timesteps.append(kwargs["timesteps"][NUM_ENV_STEPS_SAMPLED_LIFETIME]), update(*args, **kwargs))[1])
        first, second = algo.train(), algo.train()
    finally:
        algo.stop()
    for result, leaves in ((first, LEAVES_PER_PROMPT), (second, 2 * LEAVES_PER_PROMPT)):
        assert result[ENV_RUNNER_RESULTS][NUM_ENV_STEPS_SAMPLED_LIFETIME] == leaves
        assert result[NUM_ENV_STEPS_SAMPLED_LIFETIME] == leaves  # RLlib copies it to the top (Tune's timesteps)
    assert timesteps == [LEAVES_PER_PROMPT, 2 * LEAVES_PER_PROMPT]


# -- a runner that dies mid-sample ---------------------------------------------------------------------------


def weights_checksum(model: torch.nn.Module) -> float:
    return float(sum(p.detach().double().abs().sum() for p in model.parameters()))


def runner_dying_once(marker: Path, die_in_iteration: int) -> type:
    """Runner 1 dies (the process exits) inside ``sample`` of ``die_in_iteration``, once (``marker`` remembers it);
    every record carries the checksum of the weights that sampled it."""
    # Ray's workers cannot import the tests folder (not on their path): ship this module's code by value.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

    class DiesOnce(TreeSearchEnvRunner):
        def sample(self, *, prompt_indices=None, iteration: int = 0, **kwargs):
            if self.worker_index == 1 and iteration == die_in_iteration and not marker.exists():
                marker.touch()
                os._exit(1)
            records = super().sample(prompt_indices=prompt_indices, iteration=iteration, **kwargs)
            checksum = weights_checksum(self.module.model)
            for record in records:
                record.info["weights_checksum"] = checksum
            return records

    return DiesOnce


def wait_until_alive(algo, worker_id: int, timeout_s: float = 600) -> None:
    """Until Ray has restarted runner ``worker_id`` (pinging it directly: the algorithm's bookkeeping of healthy
    runners is left to the algorithm)."""
    handle = algo.env_runner_group._worker_manager.actors()[worker_id]
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            ray.get(handle.ping.remote(), timeout=30)
            return
        except ray.exceptions.RayError:
            if time.monotonic() > deadline:
                raise
            time.sleep(1)


@pytest.mark.slow
@pytest.mark.parametrize("runners", [1, 2])
def test_a_runner_that_dies_mid_sample_is_restarted_with_current_weights(ray_session, data_dir, tmp_path,
                                                                         monkeypatch, runners):
    prompts, batches = 2, []
    real_pad_batch = tree_grpo_module.pad_batch
    monkeypatch.setattr(tree_grpo_module, "pad_batch", lambda records, *a, **k: (
        batches.append(records), real_pad_batch(records, *a, **k))[1])
    config = tiny_config(data_dir, prompts, lr=1e-3).env_runners(
        num_env_runners=runners, num_cpus_per_env_runner=0.5,
        env_runner_cls=runner_dying_once(tmp_path / "died", die_in_iteration=1))
    algo = config.build_algo()
    learner_model = algo.learner_group._learner.module["default_policy"].model
    try:
        algo.train()
        weights = [weights_checksum(learner_model)]
        results = [algo.train()]  # runner 1 dies in here
        weights.append(weights_checksum(learner_model))
        wait_until_alive(algo, 1)
        results.append(algo.train())
    finally:
        algo.stop()
    assert (tmp_path / "died").exists()
    for result, records, sampled_with in zip(results, batches[1:], weights, strict=True):
        assert len(records) == result[ENV_RUNNER_RESULTS][metric_keys.LEAVES] == prompts * LEAVES_PER_PROMPT
        # every record (the re-sampled ones included) was sampled with the weights of the last update
        assert [r.info["weights_checksum"] for r in records] == pytest.approx([sampled_with] * len(records), rel=1e-12)
        assert result[LEARNER_RESULTS]["default_policy"][metric_keys.SAMPLER_LOGPROB_GAP] < 1e-3
    restarts = [result[metric_keys.ENV_RUNNER_RESTARTS] for result in results]
    # a lone runner's iteration waits for its restart; with a survivor, it takes over and the restarted runner is
    # restored before the next iteration (unless Ray had it back before the retry)
    assert restarts == [1, 0] if runners == 1 else sum(restarts) == 1


@pytest.mark.slow
def test_a_runner_that_dies_sampling_ahead_is_restarted_and_samples_again_with_the_new_weights(ray_session, data_dir,
                                                                                          tmp_path, monkeypatch):
    """max_staleness 1: the lone runner dies in the sample of iteration 2, taken during the first update; the
    iteration waits for its restart, and the restored runner samples those prompts with the update's weights."""
    prompts, batches = 2, []
    real_pad_batch = tree_grpo_module.pad_batch
    monkeypatch.setattr(tree_grpo_module, "pad_batch", lambda records, *a, **k: (
        batches.append(records), real_pad_batch(records, *a, **k))[1])
    config = tiny_config(data_dir, prompts, lr=1e-3, max_staleness=1).env_runners(
        num_env_runners=1, num_cpus_per_env_runner=0.5,
        env_runner_cls=runner_dying_once(tmp_path / "died", die_in_iteration=1))
    algo = config.build_algo()
    learner_model = algo.learner_group._learner.module["default_policy"].model
    try:
        results = [algo.train()]  # the runner dies in the sample taken ahead
        updated = weights_checksum(learner_model)
        results += [algo.train(), algo.train()]
    finally:
        algo.stop()
    assert (tmp_path / "died").exists()
    assert [result[metric_keys.ENV_RUNNER_RESTARTS] for result in results] == [1, 0, 0]
    assert [len(records) for records in batches] == [prompts * LEAVES_PER_PROMPT] * 3
    # sampled again after the update, with its weights: on-policy once, then one update behind again
    assert [r.info["weights_checksum"] for r in batches[1]] == pytest.approx([updated] * len(batches[1]), rel=1e-12)
    assert [result[metric_keys.STALENESS] for result in results] == [0, 0, 1]


@pytest.mark.slow
def test_a_runner_killed_between_iterations_is_counted_and_samples_again_with_current_weights(ray_session, data_dir,
                                                                                              tmp_path, monkeypatch):
    """Ray restarts a runner killed while idle before the next call reaches it, so no call fails: RLlib alone
    never counts it, and the new process would sample with its initial weights."""
    prompts, batches = 2, []
    real_pad_batch = tree_grpo_module.pad_batch
    monkeypatch.setattr(tree_grpo_module, "pad_batch", lambda records, *a, **k: (
        batches.append(records), real_pad_batch(records, *a, **k))[1])
    config = two_remote_runners(tiny_config(data_dir, prompts, lr=1e-3)).env_runners(
        env_runner_cls=runner_dying_once(tmp_path / "unused", die_in_iteration=-1))  # never dies: stamps weights
    algo = config.build_algo()
    learner_model = algo.learner_group._learner.module["default_policy"].model
    try:
        first = algo.train()
        pids = dict(algo.env_runner_group.foreach_env_runner(lambda runner: (runner.worker_index, os.getpid()),
                                                             local_env_runner=False))
        os.kill(pids[1], signal.SIGKILL)
        wait_until_alive(algo, 1)  # Ray has the new process up before the next call
        current = weights_checksum(learner_model)
        second = algo.train()
    finally:
        algo.stop()
    assert first[metric_keys.SAMPLED_BY] == [1, 2] and first[metric_keys.ENV_RUNNER_RESTARTS] == 0
    # both runners, counted
    assert second[metric_keys.ENV_RUNNER_RESTARTS] == 1 and second[metric_keys.SAMPLED_BY] == [1, 2]
    assert [r.info["weights_checksum"] for r in batches[1]] == pytest.approx([current] * len(batches[1]), rel=1e-12)


def test_a_runner_keeps_its_module_on_the_gpu_only_for_the_hf_generator():
    assert module_device("hf", cuda_available=True) == "cuda"
    assert module_device("vllm", cuda_available=True) == "cpu"  # the engine holds the GPU copy: no second one
    assert module_device("hf", cuda_available=False) == module_device("vllm", cuda_available=False) == "cpu"


# -- the weight sync ----------------------------------------------------------------------------------------


def runner_weights(algo) -> dict[int, dict[str, torch.Tensor]]:
    """Each runner's module weights by worker index (the driver's own runner: 0)."""
    group = algo.env_runner_group
    remote = group.num_remote_env_runners() > 0
    return dict(group.foreach_env_runner(
        lambda runner: (runner.worker_index, {k: v.clone() for k, v in runner.module.model.state_dict().items()}),
        local_env_runner=not remote))


def assert_runners_hold(algo, learner_model: torch.nn.Module, dtype: torch.dtype, runners: list[int]) -> None:
    expected = learner_model.state_dict()
    held = runner_weights(algo)
    assert sorted(held) == runners
    for weights in held.values():
        for key, tensor in weights.items():
            assert tensor.dtype == dtype and torch.equal(tensor, expected[key].to(dtype)), key


def perturb(model: torch.nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.01)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_sync_gives_every_runner_the_learners_weights_in_the_engine_dtype(ray_session, data_dir, monkeypatch,
                                                                              dtype):
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # ``perturb`` runs in the runners too
    config = two_remote_runners(tiny_config(data_dir, 2, lr=1e-2, skip_uniform_rewards=False))
    algo = config.rl_module(model_config={"model": "tiny-random", "seed": 0, "dtype": dtype,
                                          "sync_bucket_mib": 0.5}).build_algo()
    learner = algo.learner_group._learner
    learner_model = learner.module["default_policy"].model
    puts = []
    real_put = ray.put
    monkeypatch.setattr(weight_transport.ray, "put", lambda value: (puts.append(value.nbytes), real_put(value))[1])
    try:
        perturb(learner_model, seed=1)  # the runners' copies differ until the sync
        sync_env_runners(algo.learner_group, algo.env_runner_group)
        assert_runners_hold(algo, learner_model, getattr(torch, dtype), [1, 2])
        # the buckets went into the object store once for both runners, each at most 0.5 MiB, each tensor once
        item = getattr(torch, dtype).itemsize
        assert max(puts) <= 2**19 and sum(puts) >= sum(p.numel() for p in learner_model.parameters()) * item
        assert sum(puts) < (sum(p.numel() for p in learner_model.parameters()) * item) + len(puts) * 64 * 300
        algo.train()  # an update, then the training step's own sync
        seq_no = weights_seq_no(learner)
        assert seq_no == 1
        assert_runners_hold(algo, learner_model, getattr(torch, dtype), [1, 2])
        assert algo.env_runner_group.foreach_env_runner(lambda runner: runner._weights_seq_no,
                                                        local_env_runner=False) == [seq_no, seq_no]
        # a restarted runner (its sequence number back to 0) gets the current weights through the restore path
        algo.env_runner_group.foreach_env_runner(lambda runner: (perturb(runner.module.model, seed=2),
                                                                 setattr(runner, "_weights_seq_no", 0)),
                                                 remote_worker_ids=[2], local_env_runner=False)
        sync_env_runners(algo.learner_group, algo.env_runner_group, to_worker_indices=[2])
        assert_runners_hold(algo, learner_model, getattr(torch, dtype), [1, 2])
    finally:
        algo.stop()


def test_a_learner_and_runner_in_one_process_copy_tensor_to_tensor(ray_session, data_dir, monkeypatch):
    algo = tiny_config(data_dir, 1).rl_module(model_config={"model": "tiny-random", "dtype": "bfloat16"}).build_algo()
    learner_model = algo.learner_group._learner.module["default_policy"].model
    monkeypatch.setattr(weight_transport, "publish_weights", lambda learner: pytest.fail("used the object store"))
    try:
        assert weight_transport.colocated(algo.learner_group, algo.env_runner_group)
        perturb(learner_model, seed=3)
        sync_env_runners(algo.learner_group, algo.env_runner_group)
        assert_runners_hold(algo, learner_model, torch.bfloat16, [0])
    finally:
        algo.stop()


def test_a_float32_runner_in_the_learners_process_holds_the_learners_own_parameters(ray_session, data_dir):
    algo = tiny_config(data_dir, 1).rl_module(model_config={"model": "tiny-random", "dtype": "float32"}).build_algo()
    learner_model = algo.learner_group._learner.module["default_policy"].model
    engine_model = algo.env_runner_group.local_env_runner.module.model
    try:
        algo.train()  # an update in place, then the training step's own sync
        theirs = dict(learner_model.named_parameters(remove_duplicate=False))
        assert all(p is theirs[name] for name, p in engine_model.named_parameters(remove_duplicate=False))
        assert_runners_hold(algo, learner_model, torch.float32, [0])
    finally:
        algo.stop()


def test_fewer_prompts_drawn_than_mini_batches_are_refused_naming_why():
    check_prompts_drawn(4, 8, 100, None)  # 8 prompts drawn: 4 mini-batches fit
    check_prompts_drawn(4, 8, 4, None)  # 4 questions: exactly 4
    with pytest.raises(ValueError, match=r"ppo_mini_batches \(4\) exceeds the 3 prompt\(s\) an iteration draws "
                                         r"\(train_questions is 3, prompts_per_iteration 8\)"):
        check_prompts_drawn(4, 8, 100, 3)
    with pytest.raises(ValueError, match=r"the 2 prompt\(s\) .*\(the training data holds 2 question\(s\)"):
        check_prompts_drawn(4, 8, 2, 50)


def test_an_algorithm_that_would_draw_too_few_prompts_fails_when_built(ray_session, data_dir, no_retriever):
    config = tiny_config(data_dir, 2, train_questions=1, ppo_mini_batches=2)
    config.validate()  # the question count is read when the algorithm is built, not by validate()
    with pytest.raises(ValueError, match="train_questions is 1"):
        config.build_algo()
