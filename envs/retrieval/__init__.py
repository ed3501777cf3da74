"""Passage retrieval over a jsonl corpus: one shared retriever per process and (backend, corpus, options).

    >>> from envs.retrieval import get_retriever
    >>> retriever = get_retriever("bm25", "data/wiki/paragraphs.jsonl")
    >>> [hit.title for hit in retriever.search_one("Who directed $1,000 a Touchdown?", k=3)]

Backends: ``bm25`` (default; sparse-matrix BM25), ``rank_bm25`` (the rank-bm25 library, the slow reference),
``dense`` (MiniLM + faiss; the ``dense`` extra). Indexes are built once and cached on disk (see
``envs.retrieval.corpus.default_cache_dir``), keyed by the corpus file's path, size and mtime.
"""

from __future__ import annotations

import inspect
import os
import threading
from pathlib import Path
from typing import Any

from envs.datasets import CORPUS_LAYOUT, MissingDataError
from envs.retrieval.base import Retriever, SearchHit
from envs.retrieval.bm25 import BM25Retriever
from envs.retrieval.corpus import Corpus, default_cache_dir
from envs.retrieval.dense import DenseRetriever
from envs.retrieval.rank_bm25_backend import RankBM25Retriever

BACKENDS: dict[str, type[Retriever]] = {
    cls.name: cls for cls in (BM25Retriever, RankBM25Retriever, DenseRetriever)
}
DEFAULT_BACKEND = "bm25"

_SHARED: dict[tuple, Retriever] = {}
_LOCK = threading.Lock()


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
    if corpus_path is None:
        from envs.datasets import corpus_path as default_corpus_path

        corpus_path = default_corpus_path()
    path = Path(corpus_path).resolve()
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    options = _with_defaults(BACKENDS[backend], options)  # "bm25" and "bm25", k1=0.9 are one retriever
    if not path.is_file():
        raise MissingDataError(f"{path}: corpus not found; expected {CORPUS_LAYOUT}")
    stat = path.stat()  # a corpus file changed on disk is a different retriever
    key = (backend, str(path), stat.st_size, stat.st_mtime_ns, str(cache), tuple(sorted(options.items())))
    with _LOCK:
        if key not in _SHARED:
            retriever = BACKENDS[backend].load_or_build(Corpus.open(path, cache), cache, **options)
            retriever.cache_dir = cache
            _SHARED[key] = retriever
        return _SHARED[key]


def _with_defaults(backend: type[Retriever], options: dict[str, Any]) -> dict[str, Any]:
    """The backend's options with its defaults filled in; an unknown option is a TypeError naming it."""
    bound = inspect.signature(backend.load_or_build).bind(None, None, **options)
    bound.apply_defaults()
    return {name: value for name, value in bound.arguments.items() if name not in ("corpus", "cache_dir")}


__all__ = ["BACKENDS", "DEFAULT_BACKEND", "Corpus", "Retriever", "SearchHit", "get_retriever"]
