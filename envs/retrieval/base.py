"""The retriever interface: a batch of queries in, the top-k passages (title, text, score) of each out."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from envs.retrieval.corpus import Corpus
from envs.retrieval.shared import shared_retriever


@dataclass(frozen=True)
class SearchHit:
    """One retrieved passage: its position in the corpus, title, text and the backend's score."""

    index: int
    title: str
    text: str
    score: float


class Retriever(ABC):
    """A search backend over a :class:`Corpus`.

    Subclasses implement ``_search`` (corpus positions and scores, best first). A retriever is a shared,
    read-only resource: copying an env never copies it (``deepcopy`` returns the same object) and pickling it
    (e.g. to a Ray actor) ships only the corpus path and options; the receiving process loads the cached index.
    """

    name: ClassVar[str]

    def __init__(self, corpus: Corpus, options: dict[str, Any]):
        self.corpus = corpus
        self.options = options
        self.cache_dir: Path | None = None  # set by shared_retriever; unpickling loads the index from there

    @abstractmethod
    def _search(self, queries: list[str], k: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per query: (corpus positions, scores), both best first, at most ``k`` long."""

    def search(self, queries: Sequence[str], k: int = 3) -> list[list[SearchHit]]:
        """The top-``k`` passages for each query, best first (ties broken by corpus position)."""
        if isinstance(queries, str):
            raise TypeError("search takes a sequence of queries; use search_one for a single query")
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        results = self._search(list(queries), k)
        return [[self._hit(int(i), float(s)) for i, s in zip(idx, scores, strict=True)] for idx, scores in results]

    def search_one(self, query: str, k: int = 3) -> list[SearchHit]:
        """The top-``k`` passages for one query."""
        return self.search([query], k)[0]

    def _hit(self, index: int, score: float) -> SearchHit:
        passage = self.corpus[index]
        return SearchHit(index=index, title=passage.title, text=passage.text, score=score)

    def __deepcopy__(self, memo: dict) -> Retriever:
        return self

    def __reduce__(self):
        return shared_retriever, (type(self), str(self.corpus.path), self.cache_dir, self.options)


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
