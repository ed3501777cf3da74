"""Tree-GRPO and chain GRPO as RLlib algorithms (config, algorithm, env runner, learner)."""

from algos.tree_grpo.algorithm import GRPO, TreeGRPO
from algos.tree_grpo.config import GRPOConfig, TreeGRPOConfig

ALGORITHMS = {"tree_grpo": (TreeGRPO, TreeGRPOConfig), "grpo": (GRPO, GRPOConfig)}

__all__ = ["ALGORITHMS", "GRPO", "GRPOConfig", "TreeGRPO", "TreeGRPOConfig"]
