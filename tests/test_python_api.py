"""TreeGRPOConfig as an RLlib user builds it in Python (no run.py): values checked where they are set, RLlib's options
that would do nothing refused naming ours, the env and model checked before Ray starts, the driver's runner only
without remote ones, and the seed reaching the module."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest

from algos.tree_grpo import TreeGRPOConfig


def config() -> TreeGRPOConfig:
    return TreeGRPOConfig().environment("SynthHop-v0").rl_module(model_config={"model": "tiny-random"})


@pytest.mark.parametrize(("runners", "local"), [(0, True), (2, False)])
def test_the_driver_samples_only_without_remote_runners(runners, local):
    """A local runner beside remote ones would hold a model copy no weight sync reaches: get_module() would give
    the start's weights. Asked for or not, it exists exactly when no remote runner does."""
    built = config().training(prompts_per_iteration=2).env_runners(num_env_runners=runners,
                                                                   create_local_env_runner=True)
    built.validate()
    assert built.create_local_env_runner is local


def test_chain_grpo_refuses_a_shape_it_would_replace_and_a_tree_gets_its_defaults_back():
    chain = config().training(algo="grpo", group_size=4)
    assert (chain.M, chain.N, chain.L, chain.advantage_mode) == (4, 0, 0, "inter")
    with pytest.raises(ValueError, match=r"chain GRPO, whose M, N, L, advantage_mode follow from group_size .*: "
                                         r"M=3 would be replaced"):
        chain.training(M=3)
    with pytest.raises(ValueError, match="advantage_mode='tree' would be replaced"):
        chain.training(advantage_mode="tree")
    assert chain.training(M=4, group_size=4).M == 4  # what it derives anyway
    tree, default = chain.copy().training(algo="tree_grpo"), TreeGRPOConfig()
    assert (tree.M, tree.N, tree.L, tree.advantage_mode) == (default.M, default.N, default.L, default.advantage_mode)
    assert (chain.copy().training(algo="tree_grpo", M=3).M, tree.N) == (3, default.N)


def test_numpy_scalars_are_taken_as_the_numbers_they_hold():
    built = config().training(M=np.int64(3), lr=np.float32(0.5) * 2e-6)
    assert (built.M, type(built.M)) == (3, int) and built.lr == pytest.approx(1e-6)


def test_rllib_options_that_would_do_nothing_are_refused_naming_ours():
    built = config().training(num_epochs=4, minibatch_size=8, gamma=0.9).env_runners(num_envs_per_env_runner=3)
    with pytest.raises(ValueError) as caught:
        built.validate()
    message = str(caught.value)
    for expected in ("num_epochs (4): ppo_epochs", "minibatch_size (8): ppo_mini_batches", "gamma (0.9)",
                     "num_envs_per_env_runner (3)"):
        assert expected in message
    assert "train_batch_size" not in message  # left at RLlib's default: not named
    config().validate()
    config().learners(num_learners=2).validate()  # RLlib's per-learner batch, derived from the learners, is no choice
    with pytest.raises(ValueError, match=r"train_batch_size_per_learner \(5\): prompts_per_iteration"):
        config().learners(num_learners=2).training(train_batch_size_per_learner=5).validate()
    # RLlib would repeat training_step within an iteration, on the same prompts, until these are met
    looping = config().reporting(min_time_s_per_iteration=10, min_sample_timesteps_per_iteration=100,
                                 min_train_timesteps_per_iteration=100)
    with pytest.raises(ValueError) as caught:
        looping.validate()
    for name in ("min_time_s_per_iteration (10)", "min_sample_timesteps_per_iteration (100)",
                 "min_train_timesteps_per_iteration (100)"):
        assert f"{name}: nothing: an iteration is one sample" in str(caught.value)


def test_the_env_and_the_model_config_are_checked_before_ray_starts(tmp_path):
    with pytest.raises(ValueError, match=r"env 'SynthHop-v1' is not a registered Gymnasium id \(did you mean "
                                         r"SynthHop-v0\?\)"):
        config().environment("SynthHop-v1").validate()
    for model_config, message in [({"modle": "x"}, "unknown model_config keys \\['modle'\\]"),
                                  ({"dtype": "bf16"}, "dtype must be one of"),
                                  ({"lora": {"rank": 4, "alfa": 8}}, "model_config lora: .*alfa")]:
        with pytest.raises(ValueError, match=message):
            config().rl_module(model_config=model_config).validate()


def test_flex_attention_on_learners_without_a_gpu_is_refused_before_ray_starts():
    """torch's flex_attention has no CPU backward: refused by validate(), not at the first update after a rollout."""
    flex = config().training(learner_attention="flex_attention")
    with pytest.raises(ValueError, match=r"^learner_attention: flex_attention cannot backpropagate on the CPU"):
        flex.validate()
    flex.learners(num_gpus_per_learner=1).validate()  # on a GPU it is the block-sparse kernel


def test_an_evaluation_the_env_cannot_give_is_refused(tmp_path):
    gym.register("ThreeQuestions-v0", entry_point="envs.search_qa:SearchQAEnv")  # the user's own id: no split known
    try:
        with pytest.raises(ValueError, match="evaluation_interval: the greedy evaluation reads the env's evaluation "
                                             "split"):
            config().environment("ThreeQuestions-v0").evaluation(evaluation_interval=1).validate()
        config().environment("ThreeQuestions-v0").validate()  # training alone is fine
    finally:
        del gym.registry["ThreeQuestions-v0"]
    on_a_file = config().environment("HotpotQA-v0", env_config={"data_file": str(tmp_path / "q.jsonl")})
    with pytest.raises(ValueError, match="data_file replaces the env's splits"):
        on_a_file.evaluation(evaluation_interval=1).validate()


def test_the_seed_reaches_the_module_unless_its_model_config_names_one():
    assert "seed" not in config().model_config  # RLlib's seed None: the module's default
    assert config().debugging(seed=7).model_config["seed"] == 7
    assert config().debugging(seed=7).rl_module(model_config={"seed": 3}).model_config["seed"] == 3
    assert config().debugging(seed=7).get_rl_module_spec().model_config["seed"] == 7  # what the module gets


def test_a_visible_gpu_with_the_learner_on_the_cpu_is_said(monkeypatch):
    import algos.tree_grpo.tree_grpo as tree_grpo

    monkeypatch.setattr(tree_grpo, "gpu_visible", lambda: True)
    monkeypatch.setattr(tree_grpo, "log_once", lambda key: True)
    with pytest.warns(UserWarning, match=r"set .learners\(num_gpus_per_learner=1\)"):
        config().validate()


def test_training_on_the_evaluation_split_is_refused_unless_allowed_as_in_run_py():
    with pytest.raises(ValueError, match=r"NQ-v0 would train on split 'test', which is also its evaluation split"):
        config().environment("NQ-v0").validate()  # the open-domain sets ship their test split only
    config().environment("NQ-v0", env_config={"split": "train"}).validate()
    config().environment("NQ-v0").training(allow_eval_split_training=True).validate()
    config().environment("NQ-v0", env_config={"data_file": "my_questions.jsonl"}).validate()  # no split trained on


def test_a_tune_search_space_is_kept_for_tune_and_each_trials_config_is_checked():
    from ray import tune

    searched = config().training(lr=tune.grid_search([1e-5, 2e-5]), M=tune.choice([1, 2]), N=3)
    assert searched.lr == {"grid_search": [1e-5, 2e-5]} and searched.N == 3
    assert searched.training(kl_coef=0.0).kl_coef == 0.0 and isinstance(searched.M, tune.search.sample.Domain)
    with pytest.raises(ValueError, match=r"M, lr: a Ray Tune search space, resolved per trial"):
        searched.validate()
    trial = TreeGRPOConfig.from_dict({**searched.to_dict(), "lr": 2e-5, "M": 2})  # what a trial gets, resolved
    trial.validate()
    assert (trial.lr, trial.M, trial.N) == (2e-5, 2, 3)
    with pytest.raises(ValueError, match="lr: Input should be a valid number"):
        config().training(lr={"grid": [1e-5]})  # not a search space: checked as a value


def test_a_trial_of_a_search_over_group_size_or_algo_derives_the_chain_shape_again():
    from ray import tune

    chains = config().training(algo="grpo", group_size=tune.grid_search([4, 8]))
    trial = TreeGRPOConfig.from_dict({**chains.to_dict(), "group_size": 8})  # Tune sets it as an attribute
    trial.validate()
    assert (trial.M, trial.N, trial.L, trial.advantage_mode) == (8, 0, 0, "inter")
    algos_searched = config().training(algo=tune.grid_search(["tree_grpo", "grpo"]), group_size=3)
    chain = TreeGRPOConfig.from_dict({**algos_searched.to_dict(), "algo": "grpo"})
    chain.validate()
    assert (chain.M, chain.N, chain.L, chain.advantage_mode) == (3, 0, 0, "inter")
    tree = TreeGRPOConfig.from_dict({**algos_searched.to_dict(), "algo": "tree_grpo"})
    tree.validate()
    assert (tree.M, tree.N, tree.L) == (TreeGRPOConfig().M, TreeGRPOConfig().N, TreeGRPOConfig().L)
    handmade = TreeGRPOConfig.from_dict({**chain.to_dict(), "M": 2})  # a derived field changed by hand: refused
    with pytest.raises(ValueError, match="chain GRPO whose shape follows from group_size"):
        handmade.validate()
