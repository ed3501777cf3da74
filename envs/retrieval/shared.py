"""One retriever per process and (backend, corpus file, cache, options): loaded from the cache or built once.

``get_retriever`` (a backend by name) and unpickling a retriever (its class, e.g. in a Ray actor) both come here,
so a process holds one copy of each index however the retriever reached it.
"""

from __future__ import annotations

import inspect
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from envs.datasets import CORPUS_LAYOUT, MissingDataError
from envs.retrieval.corpus import Corpus, default_cache_dir

if TYPE_CHECKING:  # base.py imports this module to unpickle retrievers
    from envs.retrieval.base import Retriever

_SHARED: dict[tuple, Retriever] = {}
_LOCK = threading.Lock()


def shared_retriever(
    backend: type[Retriever],
    corpus_path: str | os.PathLike,
    cache_dir: str | os.PathLike | None = None,
    options: dict[str, Any] | None = None,
) -> Retriever:
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


def _with_defaults(backend: type[Retriever], options: dict[str, Any]) -> dict[str, Any]:
    """The backend's options with its defaults filled in; an unknown option is a TypeError naming it."""
    bound = inspect.signature(backend.load_or_build).bind(None, None, **options)
    bound.apply_defaults()
    return {name: value for name, value in bound.arguments.items() if name not in ("corpus", "cache_dir")}
