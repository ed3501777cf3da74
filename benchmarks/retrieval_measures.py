"""What ``bench_retrieval.py`` measures of one retriever. ``run_worker`` runs in a fresh process (the script's
``--worker``): it builds an index into an empty cache (time, peak RSS), or loads it from the warm cache (time, RSS)
and times ``search_one`` and batched ``search`` over the HotpotQA dev questions, with the recall of their gold
titles. ``load_test`` serves an index with ``python -m envs.retrieval.serve`` and loads the server from concurrent
client threads."""

from __future__ import annotations

import itertools
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.retrieval_corpus import gold_title
from envs.datasets import QARecord, load_dataset

SEARCH_K = 3
RECALL_K = 5
BATCH_SIZE = 64
WARMUP_QUERIES = 3
REPO_ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class ServerLoad:
    """A retrieval server load test: concurrent clients, and at most this many requests and seconds."""

    clients: int
    requests: int
    seconds: float


def rss_mb(field: str = "VmRSS") -> float:
    """This process's resident set (or its peak, ``VmHWM``) in MiB, from /proc/self/status."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def questions(limit: int | None) -> list[QARecord]:
    """The first ``limit`` HotpotQA dev questions that have supporting titles (all of them when None)."""
    records = [r for r in load_dataset("hotpotqa", "dev") if r.supporting_titles]
    return records[:limit] if limit is not None else records


def time_single(retriever: Any, texts: list[str], repeats: int) -> dict[str, float]:
    """Queries/s (median over ``repeats`` passes) and latency percentiles of ``search_one``, one query at a time."""
    for text in texts[:WARMUP_QUERIES]:
        retriever.search_one(text, k=SEARCH_K)
    passes = []
    for _ in range(repeats):
        latencies = []
        for text in texts:
            start = time.perf_counter()
            retriever.search_one(text, k=SEARCH_K)
            latencies.append(time.perf_counter() - start)
        passes.append(latencies)
    everything = np.concatenate(passes)
    return {
        "single_qps": float(np.median([len(texts) / sum(latencies) for latencies in passes])),
        "p50_ms": 1000 * float(np.percentile(everything, 50)),
        "p99_ms": 1000 * float(np.percentile(everything, 99)),
    }


def batches(items: Sequence[str], size: int) -> Iterator[list[str]]:
    for start in range(0, len(items), size):
        yield list(items[start : start + size])


def time_batched(retriever: Any, texts: list[str], repeats: int) -> float:
    """Queries/s of ``search`` over batches of ``BATCH_SIZE`` (median over ``repeats`` passes)."""
    retriever.search(texts[:WARMUP_QUERIES], k=SEARCH_K)
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        for batch in batches(texts, BATCH_SIZE):
            retriever.search(batch, k=SEARCH_K)
        rates.append(len(texts) / (time.perf_counter() - start))
    return float(np.median(rates))


def recall(retriever: Any, records: list[QARecord]) -> dict[str, float]:
    """Fractions of questions with any / all gold supporting titles among the top-``RECALL_K`` titles."""
    any_hits = all_hits = 0
    for batch_records in (records[i : i + BATCH_SIZE] for i in range(0, len(records), BATCH_SIZE)):
        results = retriever.search([r.question for r in batch_records], k=RECALL_K)
        for record, hits in zip(batch_records, results, strict=True):
            found = {gold_title(hit.title) for hit in hits}
            gold = set(record.supporting_titles)
            any_hits += bool(found & gold)
            all_hits += gold <= found
    return {"recall_any": any_hits / len(records), "recall_all": all_hits / len(records)}


def run_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """Load or build one retriever per ``spec`` and measure it; see the module docstring."""
    from envs.retrieval import get_retriever

    records = questions(spec["queries"]) if spec["mode"] == "query" else []
    base_rss = rss_mb()
    start = time.perf_counter()
    retriever = get_retriever(spec["backend"], spec["corpus"], cache_dir=spec["cache_dir"])
    seconds = time.perf_counter() - start
    result: dict[str, Any] = {"passages": len(retriever.corpus), "seconds": seconds, "rss_mb": rss_mb() - base_rss}
    if spec["mode"] == "build":
        result["peak_mb"] = rss_mb("VmHWM") - base_rss
        return result
    texts = [r.question for r in records]
    result.update(time_single(retriever, texts, spec["repeats"]))
    result["batched_qps"] = time_batched(retriever, texts, spec["repeats"])
    result.update(recall(retriever, records))
    result["queries"] = len(records)
    return result


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load_test(corpus: Path, cache_dir: Path, texts: list[str], load: ServerLoad) -> dict[str, Any]:
    """Serve ``corpus`` (its index already in ``cache_dir``) and send ``texts`` from ``load.clients`` threads."""
    from envs.retrieval import RemoteRetriever

    port = free_port()
    cmd = [sys.executable, "-m", "envs.retrieval.serve", "--corpus", str(corpus), "--cache-dir", str(cache_dir),
           "--port", str(port)]
    server = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while server.poll() is None and time.monotonic() < deadline:
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.2)
        else:
            raise RuntimeError(f"the retrieval server did not listen on port {port} (exit status {server.poll()})")
        client = RemoteRetriever(f"http://127.0.0.1:{port}/retrieve", retries=0)
        sent = itertools.count()
        latencies: list[float] = []
        stop = time.perf_counter() + load.seconds

        def send() -> None:
            while (n := next(sent)) < load.requests and time.perf_counter() < stop:
                start = time.perf_counter()
                client.search_one(texts[n % len(texts)], k=SEARCH_K)
                latencies.append(time.perf_counter() - start)  # list.append is atomic under the GIL

        for text in texts[:WARMUP_QUERIES]:
            client.search_one(text, k=SEARCH_K)
        start = time.perf_counter()
        threads = [threading.Thread(target=send) for _ in range(load.clients)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        seconds = time.perf_counter() - start
    finally:
        server.terminate()
        server.wait(timeout=60)
    return {"server_clients": load.clients, "server_requests": len(latencies), "server_qps": len(latencies) / seconds,
            "server_p50_ms": 1000 * float(np.percentile(latencies, 50)),
            "server_p99_ms": 1000 * float(np.percentile(latencies, 99))}
