"""A retrieval server reached over HTTP, in the protocol of Search-R1's and Tree-GRPO's retrieval servers::

    POST http://HOST:PORT/retrieve   {"queries": ["q1", "q2"], "topk": 3, "return_scores": true}
    -> {"result": [[{"document": {"id": "..", "contents": "\\"Title\\"\\ntext"}, "score": 12.3}, ...],  # q1
                   [...]]}                                                                            # q2

(with ``return_scores`` false a server answers plain documents). ``python -m envs.retrieval.serve`` serves the
project's own indexes this way; so one index serves every env runner of every node.

A batch of queries is one request. A request that fails to connect, times out, or gets a 5xx/429 answer is
retried ``retries`` times with exponential backoff (each retry counted in ``retries`` of the retriever, which the
rollouts report as ``retrieval_retries``); then, or at once for an answer that is not the protocol (malformed
JSON, fewer result lists than queries, a 4xx), the search raises :class:`RetrievalError` naming the URL.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from typing import Any
from urllib.parse import urlsplit

from envs.datasets import split_contents
from envs.retrieval.base import RetrievalError, Retriever, SearchHit

DEFAULT_PATH = "/retrieve"
RETRYABLE_STATUS = frozenset({429, 500, 502, 503, 504})
STALE_CONNECTION = (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError)
SERVE_HINT = "start one with `python -m envs.retrieval.serve --data-dir DIR --port PORT`, or check the URL"


def is_url(spec: str) -> bool:
    """Whether a retriever spec names a server (``http://`` or ``https://``) rather than a backend."""
    return spec.startswith(("http://", "https://"))


def endpoint(url: str) -> str:
    """The full endpoint of a server URL: ``/retrieve`` when the URL names no path; a clear error otherwise."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"retriever URL {url!r} must look like http://HOST:PORT or http://HOST:PORT/retrieve")
    try:
        parts.port  # noqa: B018  (raises on a port that is not a number)
    except ValueError:
        raise ValueError(f"retriever URL {url!r} has an invalid port") from None
    return url.rstrip("/") + DEFAULT_PATH if parts.path in ("", "/") else url


class _Retryable(Exception):
    """A failed attempt worth repeating (the server may come back)."""


class RemoteRetriever(Retriever):
    """Searches a retrieval server (see the module docstring). Thread-safe: one connection per thread, kept
    alive between requests. Pickles as its URL and settings (each process opens its own connections)."""

    def __init__(self, url: str, *, timeout_s: float = 30.0, retries: int = 3, backoff_s: float = 0.5):
        if timeout_s <= 0 or retries < 0 or backoff_s < 0:
            raise ValueError(f"retriever {url}: timeout_s must be > 0, retries and backoff_s >= 0; got "
                             f"{timeout_s}, {retries}, {backoff_s}")
        self.url = endpoint(url)
        self.timeout_s, self.max_retries, self.backoff_s = timeout_s, retries, backoff_s
        parts = urlsplit(self.url)
        self._https = parts.scheme == "https"
        self._host, self._port = parts.hostname, parts.port
        self._path = parts.path + (f"?{parts.query}" if parts.query else "")
        self._local = threading.local()
        self._lock = threading.Lock()
        self.retries = 0

    def _search_hits(self, queries: list[str], k: int) -> list[list[SearchHit]]:
        if not queries:
            return []
        body = json.dumps({"queries": queries, "topk": k, "return_scores": True}).encode("utf-8")
        answer = self._post(body)
        return parse_answer(answer, len(queries), k, self.url)

    def _post(self, body: bytes) -> bytes:
        """The body of the server's 200 answer, after at most ``max_retries`` retries."""
        for attempt in range(self.max_retries + 1):
            try:
                return self._attempt(body)
            except _Retryable as failure:
                if attempt == self.max_retries:
                    raise RetrievalError(f"retrieval server {self.url}: {failure} (after {attempt + 1} attempts, "
                                         f"timeout {self.timeout_s:g} s each); {SERVE_HINT}") from None
                with self._lock:
                    self.retries += 1
                time.sleep(self.backoff_s * 2**attempt)
        raise AssertionError("unreachable")

    def _attempt(self, body: bytes) -> bytes:
        reused = getattr(self._local, "connection", None) is not None
        try:
            response, payload = self._exchange(body)
        except (OSError, http.client.HTTPException) as err:  # refused, reset, timed out, cut short
            if not (reused and isinstance(err, STALE_CONNECTION)):
                raise self._failed(err) from None
            # The server closed an idle kept-alive connection (uvicorn does after 5 s): reconnect, not a failure.
            self._drop_connection()
            try:
                response, payload = self._exchange(body)
            except (OSError, http.client.HTTPException) as again:
                raise self._failed(again) from None
        if response.status in RETRYABLE_STATUS:
            self._drop_connection()
            raise _Retryable(f"HTTP {response.status} {payload[:200]!r}")
        if response.status != 200:
            raise RetrievalError(f"retrieval server {self.url} answered HTTP {response.status}: {payload[:300]!r}")
        return payload

    def _exchange(self, body: bytes) -> tuple[http.client.HTTPResponse, bytes]:
        connection = self._connection()
        connection.request("POST", self._path, body=body, headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        return response, response.read()

    def _failed(self, err: Exception) -> _Retryable:
        self._drop_connection()
        return _Retryable("timed out" if isinstance(err, TimeoutError) else f"{type(err).__name__}: {err}")

    def _connection(self) -> http.client.HTTPConnection:
        connection = getattr(self._local, "connection", None)
        if connection is None:
            kind = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
            connection = self._local.connection = kind(self._host, self._port, timeout=self.timeout_s)
        return connection

    def _drop_connection(self) -> None:
        connection = getattr(self._local, "connection", None)
        if connection is not None:
            connection.close()
            self._local.connection = None

    def __reduce__(self):
        return shared_remote, (self.url, self.timeout_s, self.max_retries, self.backoff_s)

    def __repr__(self) -> str:
        return f"RemoteRetriever({self.url!r})"


def parse_answer(payload: bytes, n_queries: int, k: int, url: str) -> list[list[SearchHit]]:
    """A server's answer -> per query at most ``k`` hits; :class:`RetrievalError` naming ``url`` and the problem
    when the answer is not the protocol."""
    try:
        answer = json.loads(payload)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise RetrievalError(f"retrieval server {url} answered malformed JSON ({err}): {payload[:200]!r}") from None
    results = answer.get("result") if isinstance(answer, dict) else None
    if not isinstance(results, list):
        raise RetrievalError(f"retrieval server {url} answered no 'result' list: {payload[:200]!r}")
    if len(results) != n_queries:
        raise RetrievalError(f"retrieval server {url} answered {len(results)} result lists for {n_queries} queries")
    return [[_hit(entry, url) for entry in _entries(hits, url)[:k]] for hits in results]


def _entries(hits: Any, url: str) -> list:
    if not isinstance(hits, list):
        raise RetrievalError(f"retrieval server {url} answered a {type(hits).__name__} where a list of documents "
                             "belongs")
    return hits


def _hit(entry: Any, url: str) -> SearchHit:
    """One result entry: ``{"document": {...}, "score": s}``, or a plain document (no score: NaN)."""
    scored = isinstance(entry, dict) and "document" in entry
    document = entry["document"] if scored else entry
    if not isinstance(document, dict) or not isinstance(document.get("contents"), str):
        raise RetrievalError(f"retrieval server {url} answered a document without 'contents': {entry!r:.200}")
    score = entry.get("score", float("nan")) if scored else float("nan")
    if not isinstance(score, int | float):
        raise RetrievalError(f"retrieval server {url} answered a non-numeric score: {entry!r:.200}")
    title, text = split_contents(document["contents"])
    return SearchHit(id=str(document.get("id", "")), title=title, text=text, score=float(score))


_SHARED: dict[tuple, RemoteRetriever] = {}
_SHARED_LOCK = threading.Lock()


def shared_remote(url: str, timeout_s: float = 30.0, retries: int = 3, backoff_s: float = 0.5) -> RemoteRetriever:
    """The process-wide retriever of the server at ``url`` with these settings (so its retry count is one)."""
    key = (endpoint(url), timeout_s, retries, backoff_s)
    with _SHARED_LOCK:
        if key not in _SHARED:
            _SHARED[key] = RemoteRetriever(url, timeout_s=timeout_s, retries=retries, backoff_s=backoff_s)
        return _SHARED[key]
