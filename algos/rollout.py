"""Growing Tree-GRPO trees (and chains, L = 0) over environment snapshots, independent of Ray.

For every prompt: M chains from the root to a leaf; then L rounds in which N nodes per tree (root or non-leaf,
uniformly with replacement) each grow one more full continuation to a leaf. Every round advances ALL active
branches of ALL trees together: one ``generate_step`` call per agent step, prefixes reused through the nodes'
cache handles. An "env copy" is a snapshot: before a branch steps, the env is restored to its node's state, so
one env object serves every branch exactly (the retriever is shared, never copied).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import gymnasium as gym
import numpy as np
from transformers import PreTrainedTokenizerBase

from algos.tree import Node, Tree, pick_expansion_nodes
from policies.generation import StepGenerator, observation_ids, prompt_ids
from policies.trajectory import TokenTrajectory


@dataclass(frozen=True)
class TreeShape:
    """M trees per prompt, N nodes expanded per tree per round, L rounds. Chain GRPO with group G = (G, 0, 0)."""

    M: int = 2
    N: int = 2
    L: int = 1

    def __post_init__(self) -> None:
        if self.M < 1 or self.N < 0 or self.L < 0 or (self.L > 0 and self.N < 1):
            raise ValueError(f"tree shape needs M >= 1, N >= 1 when L >= 1, L >= 0; got {self}")

    @property
    def leaves_per_prompt(self) -> int:
        return self.M * (1 + self.L * self.N)


@dataclass
class RolloutCounters:
    """What a rollout cost and produced (generation counters are added by the caller from the generator)."""

    tool_calls: int = 0
    env_steps: int = 0
    leaves: int = 0
    trees: int = 0
    extra: dict[str, int] = field(default_factory=dict)


class TreeRollout:
    """Grows trees for prompts of one environment with one step generator."""

    def __init__(self, env: gym.Env, generator: StepGenerator, tokenizer: PreTrainedTokenizerBase, *, seed: int = 0):
        self.env, self.generator, self.tokenizer = env.unwrapped, generator, tokenizer
        self.rng = np.random.default_rng(seed)
        self.counters = RolloutCounters()

    def grow(self, prompt_indices: list[int], shape: TreeShape) -> list[Tree]:
        """The trees of every prompt (M per prompt, in prompt order), grown to their leaves."""
        trees = [tree for index in prompt_indices for tree in self._plant(index, shape.M)]
        self._run_to_leaves([tree.root for tree in trees])
        for _ in range(shape.L):
            self._run_to_leaves([node for tree in trees for node in pick_expansion_nodes(tree, shape.N, self.rng)])
        for tree in trees:
            tree.drop_caches()
        self.counters.trees += len(trees)
        self.counters.leaves += sum(len(tree.leaves()) for tree in trees)
        return trees

    def _plant(self, prompt_index: int, m: int) -> list[Tree]:
        """The M trees of a prompt: identical roots sharing one prompt cache (the prompt is prefilled once)."""
        prompt, _ = self.env.reset(options={"index": prompt_index})
        ids = prompt_ids(self.tokenizer, prompt)
        cache, state = self.generator.prefix_cache(ids), self.env.get_state()
        return [Tree(Node(TokenTrajectory.from_prompt(ids), state, cache=cache), prompt_index, tree_id)
                for tree_id in range(m)]

    def _run_to_leaves(self, starts: list[Node]) -> None:
        """Advance a branch from each start node (the same node may appear several times) until all are leaves."""
        active = starts
        while active:
            seed = int(self.rng.integers(2**31))
            outputs = self.generator.generate_step([node.trajectory.branch(node.cache) for node in active], seed=seed)
            active = [child for node, out in zip(active, outputs, strict=True)
                      if not (child := self._step(node, out)).is_leaf]

    def _step(self, node: Node, out) -> Node:
        self.env.set_state(node.env_state)
        text = self.tokenizer.decode(out.token_ids, skip_special_tokens=True)
        observation, reward, terminated, truncated, info = self.env.step(text)
        done = terminated or truncated
        self.counters.env_steps += 1
        self.counters.tool_calls += info["tool_calls"] - node_tool_calls(node)
        trajectory = node.trajectory.with_step(out)
        if observation:
            trajectory = trajectory.with_observation(observation_ids(self.tokenizer, observation))
        child = Node(trajectory, self.env.get_state(), cache=None if done else out.cache, action=info["action"],
                     text=text, observation=observation, reward=float(reward), is_leaf=done, info=info)
        return node.add_child(child)


def node_tool_calls(node: Node) -> int:
    """Tool calls on the path from the root to ``node`` (the root has made none)."""
    return node.info.get("tool_calls", 0)
