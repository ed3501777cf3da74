"""Tree-relative advantages (Tree-GRPO, arXiv 2509.21240, Sec. 3.2): one scalar per leaf trajectory of a prompt.

    A_intra(i) = (R_i - mean(R over the leaves of i's tree)) / (std(same) + eps)
    A_inter(i) = (R_i - mean(R over all leaves of the prompt)) / (std(same) + eps)
    A_tree(i)  = A_intra(i) + A_inter(i)

std is the unbiased (n - 1) standard deviation. A group of one leaf has nothing to compare with and contributes
0 (the official code normalises it with mean 0, std 1, i.e. passes the raw reward through). Chain GRPO is
``inter`` over the G chains of a prompt. With one tree per prompt (M = 1, the CPU defaults' (1,2,1)) both groups are
the same leaves, so ``A_tree = 2 A_inter``: the paper's sum is kept, and its step is twice ``inter``'s at one lr (the
CPU defaults' lr was chosen with it).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

import numpy as np

ADVANTAGE_MODES = ("tree", "intra", "inter")


def group_normalize(rewards: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """(r - mean) / (unbiased std + eps) over one group; exact zeros for a group of fewer than two or of equal
    rewards (where float rounding of the mean would otherwise leave residues of ~1e-11)."""
    rewards = np.asarray(rewards, dtype=np.float64)
    if rewards.size < 2 or np.ptp(rewards) == 0:
        return np.zeros_like(rewards)
    return (rewards - rewards.mean()) / (rewards.std(ddof=1) + eps)


def _inter(rewards: np.ndarray, tree_ids: np.ndarray, eps: float) -> np.ndarray:
    return group_normalize(rewards, eps)


def _intra(rewards: np.ndarray, tree_ids: np.ndarray, eps: float) -> np.ndarray:
    out = np.zeros_like(rewards)
    for tree in np.unique(tree_ids):
        members = tree_ids == tree
        out[members] = group_normalize(rewards[members], eps)
    return out


def _tree(rewards: np.ndarray, tree_ids: np.ndarray, eps: float) -> np.ndarray:
    return _intra(rewards, tree_ids, eps) + _inter(rewards, tree_ids, eps)


_ESTIMATORS: dict[str, Callable[[np.ndarray, np.ndarray, float], np.ndarray]] = {
    "tree": _tree, "intra": _intra, "inter": _inter,
}


def tree_grpo_advantages(
    rewards: Sequence[float], tree_ids: Sequence[Hashable], mode: str = "tree", eps: float = 1e-6
) -> np.ndarray:
    """Advantages of the leaves of ONE prompt: rewards [n], tree_ids [n] (which tree each leaf grew in) -> [n]."""
    if mode not in _ESTIMATORS:
        raise ValueError(f"unknown advantage mode {mode!r}; choose one of: {', '.join(ADVANTAGE_MODES)}")
    rewards_arr = np.asarray(rewards, dtype=np.float64)
    ids = np.asarray([str(t) for t in tree_ids])
    if rewards_arr.shape != ids.shape or rewards_arr.ndim != 1:
        raise ValueError(f"rewards and tree_ids must be 1-D and of one length, got {rewards_arr.shape} and {ids.shape}")
    return _ESTIMATORS[mode](rewards_arr, ids, eps)
