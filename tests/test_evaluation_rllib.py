"""RLlib's evaluation settings run the greedy evaluation: every ``evaluation_interval`` iterations inside
``train()``, ``evaluation_duration`` questions of the evaluation split, on the training runners."""

from __future__ import annotations

from pathlib import Path

import pytest
from ray.rllib.utils.metrics import EVALUATION_RESULTS

from algos.evaluation import EVAL_COLUMNS, QUESTIONS
from algos.tree_grpo import TreeGRPOConfig
from algos.tree_grpo.config_checks import check_evaluation_settings


def tiny_config(data_dir: Path, **training) -> TreeGRPOConfig:
    return (TreeGRPOConfig().environment("HotpotQA-v0", env_config={"data_dir": str(data_dir)})
            .training(max_step_tokens=8, prompts_per_iteration=1, micro_batch_size=6, **training)
            .rl_module(model_config={"model": "tiny-random", "seed": 0}))


def test_evaluation_interval_and_duration_run_the_greedy_evaluation(ray_session, data_dir, capfd):
    seen = []  # RLlib's evaluation callbacks, in order, with what the end one is given
    config = (tiny_config(data_dir, algo="grpo", group_size=2, log_rollout_steps=True)
              .evaluation(evaluation_interval=2, evaluation_duration=3)
              .callbacks(on_evaluate_start=lambda algorithm, **_: seen.append("start"),
                         on_evaluate_end=lambda evaluation_metrics, **_: seen.append(evaluation_metrics)))
    algo = config.build_algo()
    try:
        assert algo.eval_env_runner_group is None  # no second set of runners (and model copies)
        first, second = algo.train(), algo.train()
        direct = algo.evaluate()
    finally:
        algo.stop()
    assert EVALUATION_RESULTS not in first
    for means in (second[EVALUATION_RESULTS], direct):
        assert set(means) == {*EVAL_COLUMNS, QUESTIONS} and means[QUESTIONS] == 3
        assert 0.0 <= means["em"] <= 1.0 and 1.0 <= means["turns"] <= 4.0
    assert seen == ["start", second[EVALUATION_RESULTS], "start", direct]
    # rounds of prompts_per_iteration * M = 2 questions, one progress line each
    stderr = capfd.readouterr().err
    assert "HotpotQA-v0 dev: 2/3 questions" in stderr and "HotpotQA-v0 dev: 3/3 questions" in stderr
    assert stderr.count("HotpotQA-v0 dev: evaluating on 3 questions") == 2  # announced before the first round


@pytest.mark.parametrize(("setting", "value"), [
    ("evaluation_interval", True),
    ("evaluation_duration_unit", "timesteps"),
    ("evaluation_duration", "auto"),
    ("evaluation_num_env_runners", 1),
    ("evaluation_parallel_to_training", True),
    ("evaluation_config", {"explore": False}),
    ("custom_evaluation_function", print),
])
def test_unusable_evaluation_settings_are_named(setting, value):
    config = TreeGRPOConfig().environment("HotpotQA-v0")
    setattr(config, setting, value)
    with pytest.raises(ValueError, match=setting):
        check_evaluation_settings(config)


def test_an_unusable_evaluation_setting_fails_the_build(ray_session, data_dir):
    config = tiny_config(data_dir).evaluation(evaluation_interval=1, evaluation_duration_unit="timesteps")
    with pytest.raises(ValueError, match="evaluation_duration_unit must be 'episodes'"):
        config.build_algo()
