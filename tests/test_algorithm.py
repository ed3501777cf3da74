"""Tree-GRPO / GRPO on RLlib end to end with tiny-random."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections import defaultdict

import numpy as np
import pytest
import torch

import algos.tree_grpo.tree_grpo as algorithm_module
import envs  # noqa: F401  (registers the env ids)
from algos.advantages import tree_grpo_advantages
from algos.tree_grpo import TreeGRPO, TreeGRPOConfig
from experiments.run import main
from experiments.tracking import ENV_RUNNER_KEYS
from policies.models import build_tiny_random, load_model

CONTRACT_KEYS = ("iteration", "reward_mean", "em_mean", "prompts", "trees", "leaves", "tokens_generated",
                 "tokens_prefilled", "llm_calls", "tool_calls", "time_s", "update_time_s", "sync_time_s")
FAST = ["--model", "tiny-random", "--max-step-tokens", "8", "--prompts-per-iter", "2", "--micro-batch-size", "6",
        "--lr", "1e-3", "--checkpoint-every", "0"]


def read_rows(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_two_tree_grpo_iterations(ray_session, data_dir, tmp_path, monkeypatch):
    seen = []
    real_pad_batch = algorithm_module.pad_batch

    def spy(records, advantages, pad_id):
        seen.append((records, advantages))
        return real_pad_batch(records, advantages, pad_id)

    monkeypatch.setattr(algorithm_module, "pad_batch", spy)
    weights_before = load_model("tiny-random", seed=0)[0].state_dict()
    main([*FAST, "--algo", "tree_grpo", "--M", "2", "--N", "2", "--L", "1", "--iterations", "2",
          "--output", str(tmp_path)])
    rows = read_rows(tmp_path / "metrics.jsonl")
    assert [r["iteration"] for r in rows] == [1, 2]
    assert [r["tokens_generated_total"] for r in rows] == [rows[0]["tokens_generated"],
                                                           rows[0]["tokens_generated"] + rows[1]["tokens_generated"]]
    for row in rows:
        assert all(row[k] is not None and math.isfinite(row[k]) for k in CONTRACT_KEYS), row
        # the iteration's own parts (not smoothed timers): they fit inside it, beside the sampling
        assert 0 < row["update_time_s"] + row["sync_time_s"] + row["sample_time_s"] <= row["time_s"] * 1.01, row
        assert row["leaves"] == row["prompts"] * 6 and row["trees"] == row["prompts"] * 2
        assert row["llm_calls"] >= row["leaves"] and row["tokens_prefilled"] > 0
        # continuous batching: a pass carries several rows' tokens; the KV peak is reported
        assert row["tokens_per_forward_pass"] == row["tokens_generated"] / row["forward_passes"] > 1
        assert row["kv_peak_mib"] > 0
        assert row["sampler_logprob_gap"] < 1e-3  # the trained tokens are the sampled ones
        assert row["sampled_by"] == [0]  # the local runner (no remote ones)
    # advantages per prompt are exactly the pure function's
    for records, advantages in seen:
        groups = defaultdict(list)
        for i, record in enumerate(records):
            groups[record.prompt_index].append(i)
        for members in groups.values():
            expected = tree_grpo_advantages([records[i].reward for i in members],
                                            [records[i].tree_id for i in members])
            np.testing.assert_allclose(advantages[members], expected)
    # the trained weights (read back from the final checkpoint) differ from the initial ones
    algo = TreeGRPO.from_checkpoint(str(tmp_path / "checkpoints" / "latest"))
    try:
        after = algo.learner_group._learner.module["default_policy"].model.state_dict()
        assert any(not torch.equal(weights_before[k], after[k]) for k in weights_before)
    finally:
        algo.stop()


def test_a_token_budget_ends_the_run_after_the_iteration_that_reaches_it(ray_session, data_dir, tmp_path, capsys):
    main([*FAST, "--algo", "grpo", "--group-size", "2", "--iterations", "3", "--token-budget", "1", "--final-eval",
          "--eval-questions", "2", "--no-mlflow", "--output", str(tmp_path)])
    rows = read_rows(tmp_path / "metrics.jsonl")
    assert [r["iteration"] for r in rows] == [1]  # the budget was reached during iteration 1: no iteration 2
    assert rows[0]["leaves"] == rows[0]["prompts"] * 2  # and iteration 1 was finished, not cut short
    assert rows[0]["tokens_generated_total"] == rows[0]["tokens_generated"] >= 1
    assert "token budget reached" in capsys.readouterr().err
    # the end of a run: a checkpoint of the last iteration and the final evaluation
    assert (tmp_path / "checkpoints" / "latest").resolve().name == "iter_000001"
    assert json.loads((tmp_path / "eval" / "eval.json").read_text())


def test_chain_grpo_iteration_with_greedy_eval(ray_session, data_dir, tmp_path):
    main([*FAST, "--algo", "grpo", "--group-size", "3", "--iterations", "1", "--output", str(tmp_path),
          "--eval-every", "1", "--eval-questions", "3"])
    (row,) = read_rows(tmp_path / "metrics.jsonl")
    assert row["leaves"] == row["prompts"] * 3 == row["trees"]
    assert set(ENV_RUNNER_KEYS) <= set(row)
    assert 0.0 <= row["dev_em"] <= 1.0 and 1.0 <= row["dev_turns"] <= 4.0 and row["dev_tool_calls"] <= 3.0


def test_actors_that_cannot_be_placed_are_an_error_not_a_hang(data_dir, tmp_path):
    from experiments.cli import SettingsError
    from experiments.preflight import check_resources
    from experiments.run import plan

    settings = plan(["--num-env-runners", "1", "--num-learners", "2", "--output", str(tmp_path)]).settings
    with pytest.raises(SettingsError, match="num-cpus-per-learner"):
        check_resources(settings, {"CPU": 2.0})
    check_resources(plan(["--num-env-runners", "1", "--num-learners", "2", "--num-cpus-per-learner", "0.5",
                          "--output", str(tmp_path)]).settings, {"CPU": 2.0})
    engines = plan(["--num-env-runners", "2", "--num-gpus-per-env-runner", "1", "--num-cpus-per-env-runner", "0.5",
                    "--output", str(tmp_path)]).settings  # a vLLM engine on each runner's GPU
    with pytest.raises(SettingsError, match="need 1 CPUs and 2 GPUs but Ray has 2 CPUs and 1 GPUs"):
        check_resources(engines, {"CPU": 2.0, "GPU": 1.0})
    check_resources(engines, {"CPU": 2.0, "GPU": 2.0})
    placed = plan(["--num-env-runners", "2", "--num-cpus-per-env-runner", "0.5", "--env-runner-resources",
                   "rollout_node=1", "--output", str(tmp_path)]).settings  # runners only on the nodes offering it
    with pytest.raises(SettingsError, match=r"--env-runner-resources rollout_node=1: 2 env runner\(s\) need 2 "
                                            r"rollout_node but Ray has 1 \(a node offers it with ray start"):
        check_resources(placed, {"CPU": 2.0, "rollout_node": 1.0})
    with pytest.raises(SettingsError, match="need 2 rollout_node but Ray has 0"):
        check_resources(placed, {"CPU": 2.0})  # a local Ray has no custom resources
    check_resources(placed, {"CPU": 2.0, "rollout_node": 2.0})
    # the totals suffice, but each actor must fit on one node: half a GPU on each of two nodes hosts no
    # one-GPU engine; a node with one GPU and the other's CPUs hosts both runners
    one_engine = plan(["--num-env-runners", "1", "--num-gpus-per-env-runner", "1", "--num-cpus-per-env-runner", "1",
                       "--output", str(tmp_path)]).settings
    halves = [{"CPU": 2.0, "GPU": 0.5}, {"CPU": 2.0, "GPU": 0.5}]
    with pytest.raises(SettingsError, match=r"one env runner needs 1 CPU, 1 GPU on a single node, but no node .* "
                                            r"\(the most any node has: CPU 2, GPU 0.5\): lower --num-cpus-per-env"):
        check_resources(one_engine, {"CPU": 4.0, "GPU": 1.0}, halves)
    check_resources(one_engine, {"CPU": 4.0, "GPU": 1.0}, [{"CPU": 2.0}, {"CPU": 2.0, "GPU": 1.0}])
    learners = plan(["--num-env-runners", "1", "--num-learners", "1", "--num-gpus-per-learner", "2",
                     "--output", str(tmp_path)]).settings
    with pytest.raises(SettingsError, match="one learner needs 1 CPU, 2 GPU on a single node"):  # as RLlib asks
        check_resources(learners, {"CPU": 4.0, "GPU": 2.0}, [{"CPU": 2.0, "GPU": 1.0}] * 2)


def test_invalid_config_names_the_field():
    with pytest.raises(ValueError, match="advantage_mode"):
        TreeGRPOConfig().environment("HotpotQA-v0").training(advantage_mode="global").validate()
    with pytest.raises(ValueError, match="M: Input should be greater than or equal to 1"):
        TreeGRPOConfig().environment("HotpotQA-v0").training(M=0).validate()
    with pytest.raises(ValueError, match="train_questions"):
        TreeGRPOConfig().environment("HotpotQA-v0").training(train_questions=0).validate()
    config = TreeGRPOConfig().environment("HotpotQA-v0")
    config.grad_clip_by = "l2"  # assigned directly, past .training()'s own check
    with pytest.raises(ValueError, match="grad_clip_by must be one of"):
        config.validate()


def test_train_questions_limits_the_prompts_to_the_first_questions(ray_session, data_dir):
    config = (TreeGRPOConfig().environment("HotpotQA-v0", env_config={"data_dir": str(data_dir)})
              .training(prompts_per_iteration=2, train_questions=3))
    algo = config.build_algo()
    try:
        drawn = [algo._prompts_of(iteration) for iteration in range(12)]
    finally:
        algo.stop()
    assert all(len(prompts) == 2 for prompts in drawn)
    assert set().union(*drawn) == {0, 1, 2}  # every one of the first three, and nothing after them


def test_the_configured_model_reaches_the_runner_and_the_learner(ray_session, data_dir, tmp_path):
    # a saved model directory that differs from the default tiny-random in shape
    _, tokenizer = load_model("tiny-random")
    narrower = build_tiny_random(tokenizer, hidden_size=32, layers=1, heads=2)
    narrower.save_pretrained(tmp_path / "m")
    tokenizer.save_pretrained(tmp_path / "m")
    config = (TreeGRPOConfig().environment("HotpotQA-v0", env_config={"data_dir": str(data_dir)})
              .rl_module(model_config={"model": str(tmp_path / "m")}).training(prompts_per_iteration=1))
    algo = config.build_algo()
    try:
        learner_module = algo.learner_group._learner.module["default_policy"]
        for module in (algo.env_runner.module, learner_module):
            assert module.model.config.hidden_size == 32 and module.model.config.num_hidden_layers == 1
    finally:
        algo.stop()


@pytest.mark.slow
def test_remote_env_runner_and_two_ddp_learners(ray_session, data_dir, tmp_path):
    main([*FAST, "--iterations", "1", "--num-env-runners", "1", "--num-learners", "2", "--num-cpus-per-learner",
          "0.5", "--num-cpus-per-env-runner", "0.5", "--output", str(tmp_path)])
    (row,) = read_rows(tmp_path / "metrics.jsonl")
    assert row["leaves"] == row["prompts"] * 6 and math.isfinite(row["kl"])


@pytest.mark.slow
def test_resume_in_a_new_process(ray_session, data_dir, tmp_path):
    main([*FAST, "--iterations", "1", "--output", str(tmp_path)])
    command = [sys.executable, "experiments/run.py", *FAST, "--iterations", "1", "--output", str(tmp_path),
               "--resume", str(tmp_path / "checkpoints" / "latest")]
    subprocess.run(command, check=True, capture_output=True, timeout=900)
    rows = read_rows(tmp_path / "metrics.jsonl")
    assert [r["iteration"] for r in rows] == [1, 2]


def test_a_run_stops_after_uniform_iterations_in_a_row_and_a_resume_counts_on(ray_session, data_dir, tmp_path,
                                                                             monkeypatch, capsys):
    alike = iter([True, False, True, True, True])
    monkeypatch.setattr(algorithm_module, "rewarded_alike", lambda records: next(alike))
    main([*FAST, "--iterations", "6", "--stop-after-uniform", "2", "--no-mlflow", "--output", str(tmp_path)])
    # an iteration with a signal resets the streak; the second uniform iteration in a row ends the run
    assert [row["uniform_streak"] for row in read_rows(tmp_path / "metrics.jsonl")] == [1, 0, 1, 2]
    assert "rewarded alike in the last 2 iterations (--stop-after-uniform 2)" in capsys.readouterr().err
    main([*FAST, "--iterations", "6", "--stop-after-uniform", "3", "--no-mlflow", "--output", str(tmp_path),
          "--resume", str(tmp_path / "checkpoints" / "latest")])
    # the streak came back with the checkpoint: one more uniform iteration makes 3
    assert [row["uniform_streak"] for row in read_rows(tmp_path / "metrics.jsonl")] == [1, 0, 1, 2, 3]


def test_an_iteration_whose_leaves_are_rewarded_alike_skips_the_update(ray_session, data_dir, tmp_path):
    """tiny-random earns nothing: every advantage is 0, so the update is skipped, counted, and the weights stay."""
    main([*FAST, "--iterations", "2", "--skip-uniform-rewards", "--no-mlflow", "--output", str(tmp_path)])
    rows = read_rows(tmp_path / "metrics.jsonl")
    assert all(row["reward_mean"] == 0 for row in rows)
    assert all(row["nonzero_advantage_share"] == 0 for row in rows)  # the driver's advantages, in metrics.jsonl
    assert [(row["update_skipped"], row["updates_skipped_total"]) for row in rows] == [(1, 1), (1, 2)]
    assert all(row["update_time_s"] == 0 and row["grad_norm"] is None and row["kl"] is None for row in rows)
    algo = TreeGRPO.from_checkpoint(str(tmp_path / "checkpoints" / "latest"))
    try:
        trained = algo.learner_group._learner.module["default_policy"].model.state_dict()
    finally:
        algo.stop()
    initial = load_model("tiny-random", seed=0)[0].state_dict()
    assert all(torch.equal(trained[name], initial[name]) for name in initial)
