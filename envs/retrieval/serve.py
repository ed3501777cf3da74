"""A retrieval server over the project's own indexes, in the protocol of Search-R1's retrieval server, so that one
index serves every env runner of every node (``--retriever http://HOST:PORT/retrieve``)::

    python -m envs.retrieval.serve --data-dir DIR --index bm25 --port 8000
    python -m envs.retrieval.serve --corpus wiki-18.jsonl --index dense --model DIR/e5-base-v2 \\
        --query-prefix "query: " --passage-prefix "passage: "

``POST /retrieve`` takes ``{"queries": [...], "topk": k, "return_scores": true}`` and answers ``{"result": [...]}``:
per query a list of ``{"document": {"id", "contents"}, "score"}`` (plain documents when ``return_scores`` is
false). ``GET /health`` answers the corpus, the index and its size. The index is loaded (or built, once) before
the server listens. It listens on 127.0.0.1 unless ``--host`` says otherwise; it has no authentication, so
serve other machines (``--host 0.0.0.0``) on a trusted network only. Needs the ``serve`` extra (fastapi, uvicorn).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from envs.datasets import DataError, MissingDataError, corpus_path, join_contents
from envs.retrieval import BACKENDS, DEFAULT_BACKEND, LocalRetriever, SearchHit, get_retriever
from envs.retrieval.progress import report

DEFAULT_TOPK = 3  # when a request names none (as Search-R1's server)
DENSE_OPTIONS = ("model", "query_prefix", "passage_prefix")


class RetrieveRequest(BaseModel):
    """The body of ``POST /retrieve``."""

    queries: list[str]
    topk: int | None = Field(None, ge=1)
    return_scores: bool = False


def document(hit: SearchHit) -> dict[str, str]:
    """A hit as the protocol's document: the corpus id and ``contents`` in the corpus format."""
    return {"id": hit.id, "contents": join_contents(hit.title, hit.text)}


def answer(results: list[list[SearchHit]], return_scores: bool) -> dict[str, Any]:
    """The protocol's answer to a batch of searches."""
    if return_scores:
        return {"result": [[{"document": document(hit), "score": hit.score} for hit in hits] for hits in results]}
    return {"result": [[document(hit) for hit in hits] for hits in results]}


def build_app(retriever: LocalRetriever, default_topk: int = DEFAULT_TOPK, search_threads: int = 1):
    """The FastAPI app serving ``retriever``; at most ``search_threads`` searches run at once (each BM25 search
    thread holds a score array of the corpus's size)."""
    from fastapi import FastAPI, Response

    app = FastAPI(title="tree-grpo retrieval server")
    searching = threading.Semaphore(search_threads)

    @app.post("/retrieve", response_model=None)
    def retrieve(request: RetrieveRequest) -> Response:  # a plain def: FastAPI runs it in its thread pool
        with searching:
            results = retriever.search(request.queries, k=request.topk or default_topk)
        # json.dumps directly: FastAPI's own encoding of nested results is several times slower
        return Response(json.dumps(answer(results, request.return_scores)), media_type="application/json")

    @app.get("/health", response_model=None)
    def health() -> dict[str, Any]:
        return {"corpus": str(retriever.corpus.path), "index": retriever.name, "passages": len(retriever.corpus)}

    return app


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m envs.retrieval.serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--data-dir", help="data directory whose corpus is served (wiki/wiki-18.jsonl, else "
                                           "wiki/paragraphs.jsonl; default: $TREEGRPO_DATA_DIR, else ./data)")
    source.add_argument("--corpus", type=Path, help="a corpus file in the {\"id\", \"contents\"} jsonl format")
    parser.add_argument("--index", choices=list(BACKENDS), default=DEFAULT_BACKEND,
                        help="retrieval backend (default: %(default)s)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (0.0.0.0: every interface) (default: %(default)s)")
    parser.add_argument("--port", type=int, default=8000, help="TCP port, 1-65535 (default: %(default)s)")
    parser.add_argument("--topk", type=int, default=DEFAULT_TOPK,
                        help="passages per query when a request names none (default: %(default)s)")
    parser.add_argument("--search-threads", type=int, default=1, help="searches run at once (default: %(default)s)")
    parser.add_argument("--cache-dir", help="index cache (default: $TREEGRPO_CACHE_DIR, else ~/.cache/tree-grpo)")
    parser.add_argument("--model", help="dense: a local sentence-encoder directory (default: all-MiniLM-L6-v2)")
    parser.add_argument("--query-prefix", help="dense: prepended to every query (e5: 'query: ')")
    parser.add_argument("--passage-prefix", help="dense: prepended to every passage (e5: 'passage: ')")
    args = parser.parse_args(argv)
    given = [name for name in DENSE_OPTIONS if getattr(args, name) is not None]
    if given and args.index != "dense":
        parser.error(f"--{given[0].replace('_', '-')} applies to --index dense only")
    for name in ("topk", "search_threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if not 1 <= args.port <= 65535:
        parser.error(f"--port must be a TCP port, 1-65535, got {args.port}")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    import uvicorn

    options = {name: getattr(args, name) for name in DENSE_OPTIONS if getattr(args, name) is not None}
    try:
        corpus = args.corpus if args.corpus is not None else corpus_path(args.data_dir)
        retriever = get_retriever(args.index, corpus, cache_dir=args.cache_dir, **options)
    except (MissingDataError, DataError) as error:  # one line, as the other tools say it
        print(f"serve: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    app = build_app(retriever, args.topk, args.search_threads)
    report(f"serving {len(retriever.corpus)} passages of {retriever.corpus.path} ({args.index}) on "
           f"http://{args.host}:{args.port}/retrieve")
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
