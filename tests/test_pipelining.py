"""One-step off-policy pipelining (``max_staleness``): with 1, an iteration's trees are grown on the remote runner with
the weights from before the previous update, while the learner updates on the previous iteration's trees, the rows
say so (``staleness``) and the learner recomputes the old log-probs; with 0, the iteration is the synchronous loop
(sample, update, sync) bit for bit; a run with 1 resumed from a checkpoint continues exactly as the uninterrupted
run. (The settings' errors: tests/test_settings.py; a runner killed mid-flight and a signal: the slow tier of
tests/test_env_runners.py and tests/test_resume.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from ray.rllib.core import DEFAULT_MODULE_ID
from ray.rllib.policy.sample_batch import MultiAgentBatch, SampleBatch
from ray.rllib.utils.metrics import LEARNER_RESULTS

import algos.tree_grpo.tree_grpo as tree_grpo_module
from algos.batch import learner_shards, pad_batch, prompt_advantages
from algos.tree_grpo import TreeGRPOConfig
from algos.tree_grpo import metrics as metric_keys
from algos.tree_grpo.settings import available_cores, env_runner_threads, split_threads
from algos.tree_grpo.weight_transport import sync_env_runners
from experiments.evaluate import load_policy
from experiments.run import main
from experiments.tracking import read_rows

FAST = ["--model", "tiny-random", "--max-step-tokens", "8", "--prompts-per-iter", "2", "--micro-batch-size", "6",
        "--lr", "1e-3", "--warmup-steps", "4", "--checkpoint-every", "0", "--quiet", "--trees-every", "1",
        "--trees-count", "1", "--num-env-runners", "1", "--max-staleness", "1"]


def tiny_config(data_dir: Path, **training) -> TreeGRPOConfig:
    """Two prompts of the default shape on one remote runner, a learner in this process."""
    return (TreeGRPOConfig().environment("HotpotQA-v0", env_config={"data_dir": str(data_dir)})
            .training(max_step_tokens=8, prompts_per_iteration=2, micro_batch_size=6, lr=1e-3, **training)
            .rl_module(model_config={"model": "tiny-random", "seed": 0})
            .env_runners(num_env_runners=1, num_cpus_per_env_runner=0.5))


@pytest.fixture
def batches(monkeypatch) -> list[list]:
    """The records of every batch the algorithm pads for its learner, in order."""
    seen, real_pad_batch = [], tree_grpo_module.pad_batch
    monkeypatch.setattr(tree_grpo_module, "pad_batch", lambda records, *a, **k: (
        seen.append(records), real_pad_batch(records, *a, **k))[1])
    return seen


def paths(records: list) -> list[tuple]:
    """What a batch's leaves are: their prompt, tree and tokens with the sampler's log-probs."""
    return [(record.prompt_index, record.tree_id, record.trajectory) for record in records]


def learner_weights(algo) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in
            algo.learner_group._learner.module[DEFAULT_MODULE_ID].model.state_dict().items()}


def same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)


def sampled(algo, iteration: int) -> list:
    """``iteration``'s records sampled now by ``algo``'s runners, with the weights they hold now."""
    return [record for result in algo.sample_call(iteration)() for record in result.records]


def test_a_staleness_of_one_grows_the_next_trees_with_the_weights_before_the_update(ray_session, data_dir,
                                                                                     batches):
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # torch's own on 2 cores
    try:
        algo = tiny_config(data_dir, max_staleness=1).build_algo()
        learner_threads = torch.get_num_threads()
        try:
            results, weights = [], []
            for _ in range(3):
                results.append(algo.train())
                weights.append(learner_weights(algo))
            runner = dict(algo.env_runner_group.foreach_env_runner(
                lambda r: (r.worker_index, {k: v.clone() for k, v in r.module.model.state_dict().items()}),
                local_env_runner=False))
        finally:
            algo.stop()
        stopped_threads = torch.get_num_threads()
    finally:
        torch.set_num_threads(threads)
    # the learner in this process leaves the runner its thread (0.5 CPU: one) while it samples ahead, until stop()
    assert learner_threads == split_threads(available_cores(), [env_runner_threads(0.5)], 2)
    assert stopped_threads == 2
    assert [result[metric_keys.STALENESS] for result in results] == [0, 1, 1]
    learner = [result[LEARNER_RESULTS][DEFAULT_MODULE_ID] for result in results]
    # the sampler's log-probs are an update old: the learner's own are the old ones, the gap corrected by TIS
    assert [metrics[metric_keys.OLD_LOGPROBS_RECOMPUTED] for metrics in learner] == [1.0, 1.0, 1.0]
    assert learner[1][metric_keys.SAMPLER_RATIO_MEAN] != 1.0 and learner[1][metric_keys.TIS_WEIGHT_MEAN] != 1.0
    assert same_weights(runner[1], weights[-1])  # the runner loaded the last update once its sample returned

    # the same trees, grown one at a time with the weights the pipeline had at hand
    reference = tiny_config(data_dir, old_logprobs="recompute").build_algo()
    try:
        assert paths(sampled(reference, 0)) == paths(batches[0])
        assert paths(sampled(reference, 1)) == paths(batches[1])  # iteration 1 grew with the initial weights
        reference.update_learners(batches[0], prompt_advantages(batches[0], mode=reference.config.advantage_mode))
        assert same_weights(learner_weights(reference), weights[0])
        assert paths(sampled(reference, 2)) == paths(batches[2])  # iteration 2 with the weights of update 1
    finally:
        reference.stop()


def test_a_staleness_of_zero_is_the_synchronous_loop_bit_for_bit(ray_session, data_dir, batches):
    algo = tiny_config(data_dir).build_algo()
    try:
        results, weights = [], []
        for _ in range(2):
            results.append(algo.train())
            weights.append(learner_weights(algo))
    finally:
        algo.stop()
    assert [result[metric_keys.STALENESS] for result in results] == [0, 0]
    assert [result[metric_keys.SAMPLE_WAIT_TIME_S] for result in results] == [0.0, 0.0]

    # the loop as it was: sample, advantages, one learner update, the weight sync, in turn
    reference = tiny_config(data_dir).build_algo()
    try:
        for iteration in range(2):
            records = sampled(reference, iteration)
            assert paths(records) == paths(batches[iteration])
            advantages = prompt_advantages(records, mode=reference.config.advantage_mode)
            arrays = learner_shards(pad_batch(records, advantages, pad_id=0), reference.config.settings.mini_batches,
                                    1)
            (update,) = reference.learner_group.update(
                batch=MultiAgentBatch({DEFAULT_MODULE_ID: SampleBatch(arrays)}, env_steps=len(records)),
                num_epochs=1, minibatch_size=None)
            sync_env_runners(reference.learner_group, reference.env_runner_group)
            assert same_weights(learner_weights(reference), weights[iteration])
            learned = results[iteration][LEARNER_RESULTS][DEFAULT_MODULE_ID]
            for key in (metric_keys.POLICY_LOSS, metric_keys.KL, metric_keys.GRAD_NORM, metric_keys.ENTROPY):
                assert learned[key] == update[DEFAULT_MODULE_ID][key].peek()
    finally:
        reference.stop()


def test_a_run_with_staleness_one_resumes_exactly(ray_session, data_dir, tmp_path):
    """The sample taken ahead (with weights the checkpoint no longer holds) is saved with the checkpoint."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    main([*FAST, "--iterations", "3", "--output", str(straight), "--no-mlflow"])
    main([*FAST, "--iterations", "1", "--output", str(resumed), "--no-mlflow"])
    main(["--resume", str(resumed), "--iterations", "2"])

    rows, rows_resumed = read_rows(straight / "metrics.jsonl"), read_rows(resumed / "metrics.jsonl")
    assert [row[metric_keys.STALENESS] for row in rows] == [0, 1, 1]
    # the weights that sampled each batch: the initial ones twice (the second batch was sampled during update 1),
    # then those of update 1
    assert [row[metric_keys.WEIGHTS_VERSION] for row in rows] == [0, 0, 1]

    def without_times(rows: list[dict]) -> list[dict]:
        return [{k: v for k, v in row.items() if not k.endswith("time_s") and k != "learner_peak_memory_gib"}
                for row in rows]

    assert without_times(rows_resumed) == without_times(rows)
    a, b = (load_policy(str(run / "checkpoints" / "latest"))[0].state_dict() for run in (straight, resumed))
    assert same_weights(a, b)
