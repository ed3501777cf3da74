"""Indexes held in this process over a corpus file, one per process and (backend, corpus file, cache, options):
loaded from the on-disk cache or built once.

``get_retriever`` (a backend by name) and unpickling a local retriever (e.g. in a Ray actor) both come to
``shared_retriever``, so a process holds one copy of each index however the retriever reached it.
"""

from __future__ import annotations

import inspect
import os
import threading
from abc import abstractmethod
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from envs.cache import default_cache_dir
from envs.datasets import CORPUS_LAYOUT, MissingDataError
from envs.retrieval.base import Retriever, SearchHit
from envs.retrieval.corpus import Corpus


class LocalRetriever(Retriever):
    """A search backend over a :class:`Corpus` whose index lives in this process (memory-mapped where it can).

    Subclasses implement ``load_or_build`` and ``_search`` (corpus positions and scores, best first). Pickling
    ships only the backend, the corpus path, the cache folder and the options; the receiving process loads the
    cached index (once: see ``shared_retriever``).
    """

    name: ClassVar[str]

    def __init__(self, corpus: Corpus, options: dict[str, Any]):
        self.corpus = corpus
        self.options = options
        self.cache_dir: Path | None = None  # set by shared_retriever; unpickling loads the index from there

    @classmethod
    @abstractmethod
    def load_or_build(cls, corpus: Corpus, cache_dir: Path, **options: Any) -> LocalRetriever:
        """The index over ``corpus`` from ``cache_dir``, built and saved there first if it is not."""

    @abstractmethod
    def _search(self, queries: list[str], k: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per query: (corpus positions, scores), both best first, at most ``k`` long."""

    def _search_hits(self, queries: list[str], k: int) -> list[list[SearchHit]]:
        results = self._search(queries, k)
        return [[self._hit(int(i), float(s)) for i, s in zip(idx, scores, strict=True)] for idx, scores in results]

    def _hit(self, index: int, score: float) -> SearchHit:
        passage = self.corpus[index]
        return SearchHit(id=passage.id, title=passage.title, text=passage.text, score=score, index=index)

    def __reduce__(self):
        return shared_retriever, (type(self), str(self.corpus.path), self.cache_dir, self.options)


_SHARED: dict[tuple, LocalRetriever] = {}
_LOCK = threading.Lock()


def shared_retriever(
    backend: type[LocalRetriever],
    corpus_path: str | os.PathLike,
    cache_dir: str | os.PathLike | None = None,
    options: dict[str, Any] | None = None,
) -> LocalRetriever:
    """The process-wide ``backend`` retriever over ``corpus_path``, with its index in ``cache_dir`` (default
    ``default_cache_dir()``); ``options`` go to the backend's ``load_or_build``."""
    path = Path(corpus_path).resolve()
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    options = _with_defaults(backend, options or {})  # "bm25" and "bm25", k1=0.9 are one retriever
    if not path.is_file():
        raise MissingDataError(f"{path}: corpus not found; expected {CORPUS_LAYOUT}")
    stat = path.stat()  # a corpus file changed on disk is a different retriever
    key = (backend.name, str(path), stat.st_size, stat.st_mtime_ns, str(cache), tuple(sorted(options.items())))
    with _LOCK:
        if key not in _SHARED:
            retriever = backend.load_or_build(Corpus.open(path, cache), cache, **options)
            retriever.cache_dir = cache
            _SHARED[key] = retriever
        return _SHARED[key]


def _with_defaults(backend: type[LocalRetriever], options: dict[str, Any]) -> dict[str, Any]:
    """The backend's options with its defaults filled in; an unknown option is a TypeError naming it."""
    bound = inspect.signature(backend.load_or_build).bind(None, None, **options)
    bound.apply_defaults()
    return {name: value for name, value in bound.arguments.items() if name not in ("corpus", "cache_dir")}
