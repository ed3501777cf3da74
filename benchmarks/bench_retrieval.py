"""Benchmark the retrieval backends of ``envs.retrieval`` on the real corpus and on a generated large one.

For each backend (``bm25``, ``rank_bm25``, ``dense``) over ``$TREEGRPO_DATA_DIR/wiki/paragraphs.jsonl`` it measures:

* build time: ``get_retriever`` with a fresh, empty cache directory (includes scanning the corpus offsets), and the
  peak RSS increase of the building process;
* load time: ``get_retriever`` again from the now warm cache, in a fresh process (``get_retriever`` memoizes per
  process), and the RSS increase of that process once the index is loaded;
* queries/s: ``search_one(q, k=3)`` over the HotpotQA dev questions one at a time (with p50/p99 latency), and
  ``search(batch, k=3)`` over batches of 64; the median of ``--repeats`` passes (``rank_bm25``, the slow reference,
  on the first ``--reference-queries`` questions only);
* recall: the fraction of questions with at least one gold supporting title among the top-5 titles, and with both.

Then it builds the default backend (``bm25``) over a generated corpus of ``--large-passages`` passages (copy 0 is
the real corpus; copy c >= 1 perturbs every passage with a seeded RNG: a `` ~dupNN`` title suffix, ~10% of words
dropped and ~10% of neighbours swapped, unique ids), written under ``--workdir`` (never into the repository), and
measures the same figures; recall strips the suffix so the original gold titles count.

With ``--server-clients N`` (default 8; 0 skips it), each ``bm25`` corpus is also served by ``python -m
envs.retrieval.serve`` (a separate process, from the measured index) and loaded by N client threads, each sending
one question per request (top-3) until ``--server-requests`` requests or ``--server-seconds`` seconds: requests/s
and the p50/p99 latency of a request as a client sees it.

Every measurement runs in its own subprocess of this script (``--worker SPEC``, one JSON line out). The results
replace the section between ``<!-- retrieval:begin -->`` and ``<!-- retrieval:end -->`` of ``--output``.

    TREEGRPO_DATA_DIR=/path/to/data python benchmarks/bench_retrieval.py

This file runs the measurements and writes the section; ``retrieval_measures.py`` holds what is measured (the
worker, the load test), ``retrieval_corpus.py`` the generated corpus, ``retrieval_report.py`` the section's text.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.report import replace_section
from benchmarks.retrieval_corpus import large_corpus
from benchmarks.retrieval_measures import REPO_ROOT, ServerLoad, load_test, questions, run_worker
from benchmarks.retrieval_report import REFERENCE, section
from envs.datasets import corpus_path

BACKENDS = ("bm25", "rank_bm25", "dense")
LARGE_BACKEND = "bm25"


def call_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """Run one measurement in a fresh subprocess of this script and return its JSON result."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec)]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measure(backend: str, corpus: Path, queries: int, workdir: Path, repeats: int, *, large: bool = False,
            load: ServerLoad | None = None) -> dict:
    """Cold build, then warm load + queries + recall, each in a fresh process, with a throwaway cache dir; then,
    with ``load``, the load test of a server of that index."""
    cache_dir = Path(tempfile.mkdtemp(prefix=f"cache-{backend}-", dir=workdir))
    served: dict[str, Any] = {}
    try:
        spec = {"backend": backend, "corpus": str(corpus), "cache_dir": str(cache_dir)}
        spec |= {"queries": queries, "repeats": repeats}
        log(f"{backend} on {corpus.name}: building (cold cache)")
        build = call_worker({**spec, "mode": "build"})
        log(f"{backend}: built in {build['seconds']:.1f}s; loading and querying in a fresh process")
        run = call_worker({**spec, "mode": "query"})
        if load is not None:
            log(f"{backend}: serving {corpus.name} to {load.clients} clients")
            served = load_test(corpus, cache_dir, [r.question for r in questions(queries)], load)
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)
    row = {
        "backend": backend,
        "corpus": corpus.name,
        "large": large,
        "passages": run["passages"],
        "build_s": build["seconds"],
        "build_peak_mb": build["peak_mb"],
        "load_s": run["seconds"],
        **{key: run[key] for key in ("rss_mb", "single_qps", "p50_ms", "p99_ms", "batched_qps", "queries")},
        **{key: run[key] for key in ("recall_any", "recall_all")},
        **served,
    }
    log(f"{backend}: {json.dumps(row)}")
    return row


def log(message: str) -> None:
    print(f"[bench_retrieval {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated (default: all three)")
    parser.add_argument("--large-passages", type=int, default=1_000_000, help="generated corpus size; 0 skips it")
    parser.add_argument("--queries", type=int, default=None, help="use the first N dev questions (default: all)")
    parser.add_argument("--reference-queries", type=int, default=100, help=f"question limit for {REFERENCE}")
    parser.add_argument("--repeats", type=int, default=3, help="timed passes over the questions; q/s is the median")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--workdir",
        type=Path,
        default=Path(tempfile.gettempdir()) / "bench_retrieval",
        help="caches and the generated corpus go here (outside the repository)",
    )
    parser.add_argument("--corpus", type=Path, default=None, help="default: $TREEGRPO_DATA_DIR/wiki/paragraphs.jsonl")
    parser.add_argument("--server-clients", type=int, default=8, help="concurrent clients of the retrieval server "
                                                                     "load test of each bm25 index (0: no load test)")
    parser.add_argument("--server-requests", type=int, default=4000, help="requests of a load test, at most")
    parser.add_argument("--server-seconds", type=float, default=60.0, help="seconds of a load test, at most")
    parser.add_argument("--output", type=Path, default=REPO_ROOT / "docs" / "benchmarks.md")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def command_line(argv: Sequence[str]) -> str:
    env = f"TREEGRPO_DATA_DIR={os.environ['TREEGRPO_DATA_DIR']} " if os.environ.get("TREEGRPO_DATA_DIR") else ""
    return f"{env}python benchmarks/bench_retrieval.py {shlex.join(argv)}".rstrip()


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        print(json.dumps(run_worker(json.loads(args.worker))))
        return
    started = time.perf_counter()
    np.random.seed(args.seed)
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = sorted(set(backends) - set(BACKENDS))
    if unknown:
        raise SystemExit(f"unknown backends {unknown}; choose from {', '.join(BACKENDS)}")
    args.workdir.mkdir(parents=True, exist_ok=True)
    if args.workdir.resolve().is_relative_to(REPO_ROOT):
        raise SystemExit(f"--workdir {args.workdir} is inside the repository; use a temporary directory")
    source = (args.corpus or corpus_path()).resolve()
    full_queries = len(questions(args.queries))
    jobs = [
        (b, source, min(full_queries, args.reference_queries) if b == REFERENCE else full_queries, False)
        for b in backends
    ]
    if args.large_passages > 0:
        large = large_corpus(source, args.large_passages, args.seed, args.workdir, log)
        jobs.append((LARGE_BACKEND, large, full_queries, True))
    load = ServerLoad(args.server_clients, args.server_requests, args.server_seconds) if args.server_clients else None
    rows, failures = [], []
    for backend, corpus, limit, is_large in jobs:
        try:
            rows.append(measure(backend, corpus, limit, args.workdir, args.repeats, large=is_large,
                                load=load if backend == LARGE_BACKEND else None))
        except (subprocess.CalledProcessError, RuntimeError) as err:  # keep the other backends' figures
            failures.append(f"`{backend}` on {corpus.name} failed ({err})")
            log(failures[-1])
    total = time.perf_counter() - started
    command = command_line(sys.argv[1:] if argv is None else argv)
    text = section(rows, command, full_queries, args.reference_queries, total, args.repeats, failures)
    replace_section(args.output, "retrieval", "Retrieval backends", text)
    print(text)
    log(f"wrote {args.output} in {total / 60:.1f} min")


if __name__ == "__main__":
    main()
