"""Tree-GRPO on RLlib: tree data structures, tree-relative advantages, config, algorithm, env runner, learner."""
