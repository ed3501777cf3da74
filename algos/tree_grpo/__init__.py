"""Tree-GRPO (and chain GRPO, its ``algo="grpo"`` setting) as an RLlib algorithm: config and algorithm
(``tree_grpo.py``), settings (``settings.py``), env runner, learner, metric keys."""

from algos.tree_grpo.settings import TreeGRPOSettings
from algos.tree_grpo.tree_grpo import TreeGRPO, TreeGRPOConfig

__all__ = ["TreeGRPO", "TreeGRPOConfig", "TreeGRPOSettings"]
