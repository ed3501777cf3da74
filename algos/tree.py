"""Trees of agent steps: a node is one whole step (generated ids + the observation they drew).

The root holds the prompt only. Every node keeps what a branch needs to continue from it: the token trajectory
up to and including its observation, the environment snapshot after its step, and the generator's cache
handle for its context. Leaves are finished trajectories with an outcome reward. Which nodes an expansion round
grows from is ``algos.branching``'s choice.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from policies.generation import CacheHandle
from policies.trajectory import TokenTrajectory


@dataclass(eq=False)
class Node:
    """One agent step (or the root). ``depth`` counts steps from the root (the root is 0)."""

    trajectory: TokenTrajectory
    env_state: Any
    parent: Node | None = None
    cache: CacheHandle | None = None
    action: str = "root"  # search / answer / invalid, from the env's info
    text: str = ""  # the step's decoded text (for people: logs and renderings)
    observation: str = ""
    reward: float = 0.0
    is_leaf: bool = False
    info: dict[str, Any] = field(default_factory=dict)
    children: list[Node] = field(default_factory=list)
    lineage: tuple[int, int] = (0, 0)  # (expansion round, branch index in it) of the branch that made this step
    entropy: float | None = None  # mean entropy of the step's first tokens, where measured (StepOutput.entropy)

    @property
    def depth(self) -> int:
        return 0 if self.parent is None else self.parent.depth + 1

    def path(self) -> list[Node]:
        """The nodes from the root to this one, both included."""
        nodes, node = [], self
        while node is not None:
            nodes.append(node)
            node = node.parent
        return nodes[::-1]

    def add_child(self, child: Node) -> Node:
        """Attach ``child``; children stay in lineage order, whatever order their steps finished in."""
        child.parent = self
        self.children.append(child)
        self.children.sort(key=lambda node: node.lineage)
        return child


@dataclass(eq=False)
class Tree:
    """The tree grown for one prompt: ``prompt_index`` in the dataset, ``tree_id`` among the prompt's M trees."""

    root: Node
    prompt_index: int
    tree_id: int

    def nodes(self) -> list[Node]:
        """All nodes, depth first, the root first."""
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(reversed(node.children))
        return out

    def leaves(self) -> list[Node]:
        return [node for node in self.nodes() if node.is_leaf]

    def expansion_candidates(self) -> list[Node]:
        """The root and every non-leaf node (picking the root starts a fresh chain inside the tree)."""
        return [node for node in self.nodes() if not node.is_leaf]

    def drop_caches(self) -> None:
        """Free every node's cache once the tree is done growing."""
        for node in self.nodes():
            node.cache = None
