"""What ``TreeGRPOConfig.validate`` checks of RLlib's own options and of the config's env, model and evaluation:
the evaluation settings Tree-GRPO reads, RLlib's options it does not act on (named with the setting that does
their job), a Ray Tune search space left for Tune, and the env and ``model_config`` before Ray starts."""

from __future__ import annotations

import difflib
from typing import Any

import gymnasium as gym
from ray.rllib.algorithms.algorithm_config import AlgorithmConfig

import envs
from algos.tree_grpo.settings import check_training_split
from policies.rl_module import check_model_config


def check_evaluation_settings(config: AlgorithmConfig) -> None:
    """RLlib's evaluation settings as Tree-GRPO reads them, or a ``ValueError`` naming the setting: every
    ``evaluation_interval`` iterations, ``evaluation_duration`` questions (episodes) of the evaluation split, one
    greedy chain each, on the training runners."""
    interval, duration = config.evaluation_interval, config.evaluation_duration
    problems = {
        "evaluation_interval": (interval is not None and (not isinstance(interval, int) or isinstance(interval, bool)
                                                          or interval < 0),
                                f"must be None or an int >= 0 (iterations between evaluations), got {interval!r}"),
        "evaluation_duration": (not isinstance(duration, int) or isinstance(duration, bool) or duration < 1,
                                f"must be a positive int (questions of the evaluation split), got {duration!r}"),
        "evaluation_duration_unit": (config.evaluation_duration_unit != "episodes",
                                     f"must be 'episodes' (one greedy chain per question), got "
                                     f"{config.evaluation_duration_unit!r}"),
        "evaluation_num_env_runners": (config.evaluation_num_env_runners != 0,
                                       f"must be 0: the evaluation runs on the training env runners, got "
                                       f"{config.evaluation_num_env_runners!r}"),
        "evaluation_parallel_to_training": (bool(config.evaluation_parallel_to_training),
                                            "must be False: the evaluation uses the training env runners"),
        "evaluation_config": (bool(config.evaluation_config),
                              "is not used: the evaluation runs the training env's settings on its evaluation split, "
                              f"greedily; got {config.evaluation_config!r}"),
        "custom_evaluation_function": (config.custom_evaluation_function is not None,
                                       "is not supported: the evaluation is the greedy one (TreeGRPO.evaluate)"),
    }
    wrong = [f"{name} {message}" for name, (bad, message) in problems.items() if bad]
    if wrong:
        raise ValueError("; ".join(wrong))


def is_search_space(value: Any) -> bool:
    """Whether ``value`` is a Ray Tune search space (a sampling domain, or ``tune.grid_search``'s dict)."""
    from ray.tune.search.sample import Domain

    return isinstance(value, Domain) or (isinstance(value, dict) and set(value) == {"grid_search"})


# RLlib options this algorithm does not act on, and what does their job here
UNUSED_RLLIB_OPTIONS: dict[str, str] = {
    "num_epochs": "ppo_epochs (passes over each iteration's batch)",
    "minibatch_size": "ppo_mini_batches (optimizer steps per pass, whole prompt groups each)",
    "train_batch_size_per_learner": "prompts_per_iteration (a batch is the leaves of its prompts' trees)",
    "train_batch_size": "prompts_per_iteration (a batch is the leaves of its prompts' trees)",
    "gamma": "nothing: a leaf's one outcome reward is its return, undiscounted",
    "num_envs_per_env_runner": "nothing: a runner clones its env per branch (num_env_runners spreads the prompts)",
    "rollout_fragment_length": "nothing: a sample is whole trees",
    "explore": "temperature and top_p (sampling); the evaluation decodes greedily",
    # RLlib would run training_step again within the iteration, on the same iteration's prompts
    **dict.fromkeys(("min_time_s_per_iteration", "min_sample_timesteps_per_iteration",
                     "min_train_timesteps_per_iteration"),
                    "nothing: an iteration is one sample of prompts_per_iteration prompts and one update"),
}


def check_unused_rllib_options(config: AlgorithmConfig) -> None:
    """A ``ValueError`` naming each RLlib option in ``UNUSED_RLLIB_OPTIONS`` set away from RLlib's default (it would do
    nothing), with the setting that does its job."""
    defaults = AlgorithmConfig()

    def was_set(name: str) -> bool:
        if name == "train_batch_size_per_learner":  # RLlib derives it from train_batch_size and the learners
            return config.train_batch_size_per_learner != config.train_batch_size // (config.num_learners or 1)
        return getattr(config, name) != getattr(defaults, name)

    changed = [f"{name} ({getattr(config, name)!r}): {instead}" for name, instead in UNUSED_RLLIB_OPTIONS.items()
               if was_set(name)]
    if changed:
        raise ValueError(f"Tree-GRPO does not use these RLlib options: {'; '.join(changed)} (TreeGRPOConfig()"
                         f".training(...) sets the settings named)")


def check_env_and_model(config: AlgorithmConfig) -> None:
    """A ``ValueError`` for a ``model_config`` the module would refuse, an env that is not a registered Gymnasium id
    (the rollouts clone it with ``gym.make``), or an evaluation the env cannot give (an id without a known evaluation
    split, a ``data_file`` that replaces the splits): found before Ray starts, not as an actor's failure. An env not
    chosen yet (None: RLlib validates a config whenever asked) is left to the algorithm's setup."""
    check_model_config(config.model_config)
    env, env_config = config.env, dict(config.env_config or {})
    if env is None:
        return
    if not isinstance(env, str) or env not in gym.registry:
        close = difflib.get_close_matches(str(env), list(envs.ENV_IDS), n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise ValueError(f"env {env!r} is not a registered Gymnasium id{hint}: Tree-GRPO clones it with gym.make; "
                         f"this package registers {', '.join(envs.ENV_IDS)}")
    if env_config.get("data_file") is None:  # a data file replaces the splits: no evaluation split is trained on
        check_training_split(env, env_config.get("split"), config.allow_eval_split_training)
    if config.evaluation_interval:
        if env not in envs.ENV_IDS:
            raise ValueError(f"evaluation_interval: the greedy evaluation reads the env's evaluation split, known for "
                             f"{', '.join(envs.ENV_IDS)}; {env!r} is not one (evaluate with greedy_eval and a split)")
        if env_config.get("data_file") is not None:
            raise ValueError("evaluation_interval: env_config's data_file replaces the env's splits, so the "
                             "evaluation would read the training file; evaluate with greedy_eval on another env")


def check_prompts_drawn(mini_batches: int, prompts_per_iteration: int, questions: int,
                        train_questions: int | None) -> None:
    """A ``ValueError`` when an iteration draws fewer prompts than ``ppo_mini_batches``, which hold whole prompt
    groups. It draws ``prompts_per_iteration`` of the training split's ``questions`` (its first ``train_questions``
    where set), or all of them where there are fewer: found when the algorithm is built, not after the first
    rollout."""
    drawn = min(prompts_per_iteration, questions, train_questions or questions)
    if mini_batches > drawn:
        where = (f"train_questions is {train_questions}" if train_questions is not None and train_questions <= questions
                 else f"the training data holds {questions} question(s)")
        raise ValueError(f"ppo_mini_batches ({mini_batches}) exceeds the {drawn} prompt(s) an iteration draws "
                         f"({where}, prompts_per_iteration {prompts_per_iteration}): a mini-batch holds whole prompt "
                         f"groups; lower ppo_mini_batches or train on more questions")
