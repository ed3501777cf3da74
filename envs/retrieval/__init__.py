"""Passage retrieval: one shared retriever per process and (backend or server, corpus, options).

    >>> from envs.retrieval import get_retriever
    >>> retriever = get_retriever("bm25", "data/wiki/paragraphs.jsonl")
    >>> [hit.title for hit in retriever.search_one("Who directed $1,000 a Touchdown?", k=3)]
    >>> remote = get_retriever("http://127.0.0.1:8000/retrieve")  # a retrieval server (envs.retrieval.serve)

Backends held in this process: ``bm25`` (default; memory-mapped postings), ``rank_bm25`` (the rank-bm25 library,
the slow reference), ``dense`` (a sentence encoder + faiss; the ``dense`` extra). Their indexes are built once and
cached on disk (see ``envs.cache.default_cache_dir``), keyed by the corpus file's path, size and
mtime; stale ones (their file changed or gone) are pruned (``envs.retrieval.corpus.prune_stale_entries``). A URL
instead of a backend name searches a server in Search-R1's protocol (``envs.retrieval.remote``).
"""

from __future__ import annotations

import os
from typing import Any

from envs.datasets import corpus_path as default_corpus_path
from envs.retrieval.base import RetrievalError, Retriever, SearchHit
from envs.retrieval.bm25 import BM25Retriever
from envs.retrieval.corpus import Corpus
from envs.retrieval.dense import DenseRetriever
from envs.retrieval.local import LocalRetriever, shared_retriever
from envs.retrieval.rank_bm25_backend import RankBM25Retriever
from envs.retrieval.remote import RemoteRetriever, is_url, shared_remote

BACKENDS: dict[str, type[LocalRetriever]] = {
    cls.name: cls for cls in (BM25Retriever, RankBM25Retriever, DenseRetriever)
}
DEFAULT_BACKEND = "bm25"


def check_retriever_spec(spec: str) -> str:
    """``spec`` if it names a backend or a server URL; else a ValueError listing what it may be."""
    if is_url(spec):
        RemoteRetriever(spec)  # validates the URL; connects nothing
    elif spec not in BACKENDS:
        raise ValueError(f"unknown retriever backend {spec!r}; choose one of: {', '.join(BACKENDS)}, or the URL of "
                         "a retrieval server (http://HOST:PORT/retrieve)")
    return spec


def get_retriever(
    backend: str = DEFAULT_BACKEND,
    corpus_path: str | os.PathLike | None = None,
    *,
    cache_dir: str | os.PathLike | None = None,
    **options: Any,
) -> Retriever:
    """The process-wide retriever for ``backend`` over ``corpus_path``, loaded from cache or built once; or, when
    ``backend`` is a URL, the process-wide client of that server (``options``: ``timeout_s``, ``retries``,
    ``backoff_s``; the server has its own corpus).

    ``corpus_path`` defaults to the data directory's corpus. ``options`` go to the backend (``k1``/``b``/``idf``
    for bm25, ``model``/``query_prefix``/``passage_prefix`` for dense).
    """
    check_retriever_spec(backend)
    if is_url(backend):
        if corpus_path is not None or cache_dir is not None:
            raise ValueError(f"retriever {backend}: a retrieval server reads its own corpus; corpus_path and "
                             "cache_dir apply to the local backends only")
        return shared_remote(backend, **options)
    path = default_corpus_path() if corpus_path is None else corpus_path
    return shared_retriever(BACKENDS[backend], path, cache_dir, options)


__all__ = ["BACKENDS", "DEFAULT_BACKEND", "Corpus", "LocalRetriever", "RemoteRetriever", "RetrievalError",
           "Retriever", "SearchHit", "check_retriever_spec", "get_retriever", "is_url"]
