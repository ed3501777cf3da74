"""Configuration of Tree-GRPO (and chain GRPO, the same algorithm with L = 0 and ``inter`` advantages)."""

from __future__ import annotations

from typing import Any

from ray.rllib.algorithms.algorithm_config import AlgorithmConfig, NotProvided
from ray.rllib.core.rl_module.rl_module import RLModuleSpec
from ray.rllib.utils.annotations import override

from algos.advantages import ADVANTAGE_MODES
from algos.rollout import TreeShape
from policies.generation import SamplingSettings

# Our fields with their defaults and one line of documentation each (the paper's multi-hop setting scaled to
# a CPU; notes/tree-grpo.md has the paper's values).
TREE_GRPO_DEFAULTS: dict[str, tuple[Any, str]] = {
    "M": (2, "trees per prompt (chains per prompt for GRPO)"),
    "N": (2, "nodes expanded per tree in each expansion round"),
    "L": (1, "expansion rounds"),
    "prompts_per_iteration": (4, "prompts sampled from the training split per iteration"),
    "train_questions": (None, "draw prompts from the first k questions of the training split only (None: all); "
                              "k = prompts_per_iteration replays the same prompts, the check that RL fits them"),
    "advantage_mode": ("tree", "tree (intra + inter), intra or inter (chain GRPO)"),
    "temperature": (1.0, "sampling temperature of rollouts"),
    "top_p": (0.95, "nucleus sampling of rollouts"),
    "max_step_tokens": (500, "token cap of one agent step"),
    "max_context_tokens": (4096, "token cap of a whole trajectory"),
    "clip_eps": (0.2, "PPO ratio clip, both sides"),
    "dual_clip": (3.0, "dual-clip bound for negative advantages (None: off)"),
    "kl_coef": (0.001, "k3 KL to the frozen initial policy"),
    "entropy_coef": (0.001, "entropy bonus"),
    "warmup_steps": (0, "optimizer steps of linear learning-rate warm-up"),
    "weight_decay": (0.01, "AdamW weight decay"),
    "micro_batch_size": (4, "trajectories per forward/backward pass (gradient accumulation)"),
    "log_rollout_steps": (False, "print a progress line per batched rollout step (to stderr)"),
    "dev_eval_every": (0, "every k iterations a greedy evaluation on the env's evaluation split (0: never)"),
    "dev_eval_questions": (50, "questions of that evaluation (the first ones of the split)"),
    "trees_every": (0, "every k iterations write a few sampled trees as JSON + HTML (0: never)"),
    "trees_count": (4, "trees written each time"),
    "trees_dir": (None, "where the trees go (None: the algorithm's log directory / trees)"),
}


class TreeGRPOConfig(AlgorithmConfig):
    """Tree-GRPO on RLlib's new API stack. ``TreeGRPOConfig().training(M=2, N=2, L=1, lr=1e-6, ...)``.

    The environment is any registered search-QA id (``.environment("HotpotQA-v0", env_config={...})``), the
    model is chosen through ``.rl_module(model_config={"model": ..., "dtype": ...})``.
    """

    def __init__(self, algo_class: type | None = None):
        from algos.tree_grpo.algorithm import TreeGRPO
        from algos.tree_grpo.env_runner import TreeSearchEnvRunner

        super().__init__(algo_class=algo_class or TreeGRPO)
        for name, (value, _) in TREE_GRPO_DEFAULTS.items():
            setattr(self, name, value)
        self.env_runner_cls = TreeSearchEnvRunner
        self.lr = 1e-6
        self.grad_clip = 1.0
        self.grad_clip_by = "global_norm"
        self.episodes_to_numpy = False  # ragged token lists; our runner returns leaf records
        self.num_env_runners = 0

    @override(AlgorithmConfig)
    def training(self, **kwargs) -> TreeGRPOConfig:
        ours = {k: kwargs.pop(k) for k in list(kwargs) if k in TREE_GRPO_DEFAULTS}
        super().training(**kwargs)
        for name, value in ours.items():
            if value is not NotProvided:
                setattr(self, name, value)
        return self

    @property
    def tree_shape(self) -> TreeShape:
        return TreeShape(self.M, self.N, self.L)

    @property
    def sampling(self) -> SamplingSettings:
        return SamplingSettings(temperature=self.temperature, top_p=self.top_p, max_step_tokens=self.max_step_tokens,
                                max_context_tokens=self.max_context_tokens)

    def tracked_params(self) -> dict[str, Any]:
        """The settings that define a run, for trackers: our fields, the RLlib ones we use, the env and model
        configs (the full ``to_dict()`` has some 260 mostly unused RLlib keys)."""
        rllib = ("env", "lr", "grad_clip", "seed", "num_env_runners", "num_learners", "num_gpus_per_learner",
                 "num_cpus_per_learner", "num_cpus_per_env_runner")
        return {**{name: getattr(self, name) for name in (*TREE_GRPO_DEFAULTS, *rllib)},
                "env_config": dict(self.env_config), "model_config": dict(self.model_config or {})}

    @override(AlgorithmConfig)
    def validate(self) -> None:
        super().validate()
        self.tree_shape  # noqa: B018  (raises on an invalid shape)
        self.sampling  # noqa: B018
        if self.advantage_mode not in ADVANTAGE_MODES:
            raise ValueError(f"advantage_mode must be one of {ADVANTAGE_MODES}, got {self.advantage_mode!r}")
        for name in ("prompts_per_iteration", "micro_batch_size", "trees_count", "dev_eval_questions"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive int, got {getattr(self, name)!r}")
        if self.train_questions is not None and (not isinstance(self.train_questions, int)
                                                 or self.train_questions < 1):
            raise ValueError(f"train_questions must be None or a positive int, got {self.train_questions!r}")
        for name in ("trees_every", "dev_eval_every"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                raise ValueError(f"{name} must be an int >= 0, got {getattr(self, name)!r}")
        if self.num_env_runners > self.prompts_per_iteration:
            raise ValueError(f"num_env_runners ({self.num_env_runners}) must not exceed prompts_per_iteration "
                             f"({self.prompts_per_iteration}): every runner grows the trees of its own prompts")

    @override(AlgorithmConfig)
    def get_default_rl_module_spec(self) -> RLModuleSpec:
        from policies.rl_module import LLMRLModule

        # No model_config here: RLlib merges the default spec's model_config OVER the user's
        # ``.rl_module(model_config=...)``; the module's own defaults (tiny-random) apply to missing keys.
        return RLModuleSpec(module_class=LLMRLModule)

    @override(AlgorithmConfig)
    def get_default_learner_class(self) -> type:
        from algos.tree_grpo.learner import TreeGRPOTorchLearner

        return TreeGRPOTorchLearner


class GRPOConfig(TreeGRPOConfig):
    """Chain GRPO: ``group_size`` independent chains per prompt (M = G, L = 0), advantages over the group."""

    def __init__(self, algo_class: type | None = None):
        from algos.tree_grpo.algorithm import GRPO

        super().__init__(algo_class=algo_class or GRPO)
        self.M, self.N, self.L, self.advantage_mode = 4, 0, 0, "inter"

    @property
    def group_size(self) -> int:
        return self.M

    @override(TreeGRPOConfig)
    def training(self, *, group_size: int | None = NotProvided, **kwargs) -> GRPOConfig:
        super().training(**kwargs)
        if group_size is not NotProvided:
            self.M = group_size
        return self

    @override(TreeGRPOConfig)
    def validate(self) -> None:
        super().validate()
        if self.L != 0 or self.advantage_mode != "inter":
            raise ValueError("GRPO is chain GRPO: L must be 0 and advantage_mode 'inter' (use TreeGRPO for trees)")
