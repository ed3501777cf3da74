"""Passage retrieval over a jsonl corpus: one shared retriever per process and (backend, corpus, options).

    >>> from envs.retrieval import get_retriever
    >>> retriever = get_retriever("bm25", "data/wiki/paragraphs.jsonl")
    >>> [hit.title for hit in retriever.search_one("Who directed $1,000 a Touchdown?", k=3)]

Backends: ``bm25`` (default; sparse-matrix BM25), ``rank_bm25`` (the rank-bm25 library, the slow reference),
``dense`` (MiniLM + faiss; the ``dense`` extra). Indexes are built once and cached on disk (see
``envs.retrieval.corpus.default_cache_dir``), keyed by the corpus file's path, size and mtime.
"""

from __future__ import annotations

import os
from typing import Any

from envs.datasets import corpus_path as default_corpus_path
from envs.retrieval.base import Retriever, SearchHit
from envs.retrieval.bm25 import BM25Retriever
from envs.retrieval.corpus import Corpus
from envs.retrieval.dense import DenseRetriever
from envs.retrieval.rank_bm25_backend import RankBM25Retriever
from envs.retrieval.shared import shared_retriever

BACKENDS: dict[str, type[Retriever]] = {
    cls.name: cls for cls in (BM25Retriever, RankBM25Retriever, DenseRetriever)
}
DEFAULT_BACKEND = "bm25"


def get_retriever(
    backend: str = DEFAULT_BACKEND,
    corpus_path: str | os.PathLike | None = None,
    *,
    cache_dir: str | os.PathLike | None = None,
    **options: Any,
) -> Retriever:
    """The process-wide retriever for ``backend`` over ``corpus_path``, loaded from cache or built once.

    ``corpus_path`` defaults to the data directory's ``wiki/paragraphs.jsonl``. ``options`` go to the
    backend (``k1``/``b`` for the BM25s, ``model`` for dense).
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown retriever backend {backend!r}; choose one of: {', '.join(BACKENDS)}")
    path = default_corpus_path() if corpus_path is None else corpus_path
    return shared_retriever(BACKENDS[backend], path, cache_dir, options)


__all__ = ["BACKENDS", "DEFAULT_BACKEND", "Corpus", "Retriever", "SearchHit", "get_retriever"]
