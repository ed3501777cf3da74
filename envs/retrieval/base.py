"""The retriever interface: a batch of queries in, the top-k passages (id, title, text, score) of each out.

Two kinds implement it: indexes held in this process over a corpus file (``envs.retrieval.local``) and a
retrieval server reached over HTTP (``envs.retrieval.remote``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


class RetrievalError(RuntimeError):
    """A search could not be answered (e.g. the retrieval server is down or answered garbage); the message names
    the retriever (its URL) and what went wrong. Never turned into an empty observation."""


@dataclass(frozen=True)
class SearchHit:
    """One retrieved passage: its corpus id, Wikipedia title, text, the backend's score and, for an index held in
    this process, its position in the corpus file (None for a remote retriever's hits)."""

    id: str
    title: str
    text: str
    score: float
    index: int | None = None


class Retriever(ABC):
    """A search backend. A retriever is a shared, read-only resource: copying an env never copies it (``deepcopy``
    returns the same object); each kind says how it pickles (never its index)."""

    retries: int = 0  # failed requests retried so far (only a remote retriever retries)

    @abstractmethod
    def _search_hits(self, queries: list[str], k: int) -> list[list[SearchHit]]:
        """Per query: at most ``k`` hits, best first."""

    def search(self, queries: Sequence[str], k: int = 3) -> list[list[SearchHit]]:
        """The top-``k`` passages for each query, best first (ties broken by corpus position), in one batch."""
        if isinstance(queries, str):
            raise TypeError("search takes a sequence of queries; use search_one for a single query")
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        return self._search_hits(list(queries), k)

    def search_one(self, query: str, k: int = 3) -> list[SearchHit]:
        """The top-``k`` passages for one query."""
        return self.search([query], k)[0]

    def __deepcopy__(self, memo: dict) -> Retriever:
        return self


def top_k(scores: np.ndarray, k: int, *, positive_only: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Positions and values of the ``k`` largest scores, best first, ties broken by lowest position.

    ``positive_only`` drops scores <= 0 (for BM25, where 0 means no query term matched).
    """
    if positive_only:  # rank only the matching positions (few for BM25), then map back
        pool = np.flatnonzero(scores > 0)
        if pool.size == 0:
            return pool, scores[pool]
        best, best_scores = top_k(scores[pool], k)
        return pool[best], best_scores
    if k < 1 or scores.shape[0] == 0:
        return np.empty(0, dtype=np.int64), scores[:0]
    k = min(k, scores.shape[0])
    part = np.argpartition(-scores, k - 1)[:k] if k < scores.shape[0] else np.arange(scores.shape[0])
    # Include every position tied with the k-th value so the tie-break by position is exact.
    threshold = scores[part].min()
    candidates = np.flatnonzero(scores >= threshold) if np.count_nonzero(scores == threshold) > 1 else part
    best = candidates[np.lexsort((candidates, -scores[candidates]))[:k]]
    return best, scores[best]
