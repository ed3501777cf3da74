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
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.report import machine_description, replace_section
from envs.datasets import QARecord, corpus_path, load_dataset, parse_passage

BACKENDS = ("bm25", "rank_bm25", "dense")
REFERENCE = "rank_bm25"
LARGE_BACKEND = "bm25"
SEARCH_K = 3
RECALL_K = 5
BATCH_SIZE = 64
WARMUP_QUERIES = 3
DUP_SUFFIX = re.compile(r" ~dup\d+$")
GENERATOR_VERSION = 1
REPO_ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("numpy", "rank-bm25", "faiss-cpu", "torch", "transformers", "fastapi", "uvicorn")


@dataclass(frozen=True)
class ServerLoad:
    """A retrieval server load test: concurrent clients, and at most this many requests and seconds."""

    clients: int
    requests: int
    seconds: float


# ---------------------------------------------------------------------------------------------------------
# Worker side: one measurement in a fresh process


def rss_mb(field: str = "VmRSS") -> float:
    """This process's resident set (or its peak, ``VmHWM``) in MiB, from /proc/self/status."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def gold_title(title: str) -> str:
    """A passage title with the generated corpus's copy suffix removed."""
    return DUP_SUFFIX.sub("", title)


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


# ---------------------------------------------------------------------------------------------------------
# Parent side: orchestration


def call_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """Run one measurement in a fresh subprocess of this script and return its JSON result."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec)]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


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


# ---------------------------------------------------------------------------------------------------------
# The generated large corpus


def perturb(words: list[str], rng: np.random.Generator, drop: float = 0.1, swap: float = 0.1) -> list[str]:
    """Drop a fraction of the words and swap a fraction of neighbouring pairs (keeps at least one word)."""
    if len(words) < 2:
        return words
    kept = [w for w, keep in zip(words, rng.random(len(words)) >= drop, strict=True) if keep] or words[:1]
    for i in np.flatnonzero(rng.random(len(kept) - 1) < swap):
        kept[i], kept[i + 1] = kept[i + 1], kept[i]
    return kept


def generated_lines(source: Path, n_passages: int, seed: int) -> Iterator[str]:
    """``n_passages`` jsonl lines: the source corpus (copy 0), then perturbed copies 1, 2, ... of it."""
    originals = source.read_bytes().splitlines()
    originals = [line for line in originals if line.strip()]
    copy = written = 0
    while written < n_passages:
        rng = np.random.default_rng([seed, copy])
        for i, line in enumerate(originals):
            if written == n_passages:
                return
            if copy == 0:
                yield line.decode("utf-8")
            else:
                passage = parse_passage(line, f"{source}: passage {i}")
                text = " ".join(perturb(passage.text.split(), rng))
                contents = f'"{passage.title} ~dup{copy:02d}"\n{text}'
                yield json.dumps({"id": f"{passage.id}~{copy}", "contents": contents}, ensure_ascii=False)
            written += 1
        copy += 1


def large_corpus(source: Path, n_passages: int, seed: int, workdir: Path) -> Path:
    """The generated corpus file under ``workdir``, reused when a previous run made it with the same inputs."""
    path = workdir / f"{source.stem}-{n_passages}-seed{seed}.jsonl"
    stat = source.stat()
    meta = {
        "source": str(source.resolve()),
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
        "passages": n_passages,
        "seed": seed,
        "version": GENERATOR_VERSION,
    }
    meta_path = path.with_suffix(".meta.json")
    if path.is_file() and meta_path.is_file() and json.loads(meta_path.read_text()) == meta:
        log(f"reusing {path}")
        return path
    log(f"generating {n_passages:,} passages into {path}")
    start = time.perf_counter()
    tmp = path.with_suffix(".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for line in generated_lines(source, n_passages, seed):
            f.write(line + "\n")
    tmp.replace(path)
    meta_path.write_text(json.dumps(meta))
    log(f"generated {path.stat().st_size / 2**20:,.0f} MiB in {time.perf_counter() - start:.0f}s")
    return path


# ---------------------------------------------------------------------------------------------------------
# Report


def ratio(value: float, reference: float | None) -> str:
    if not reference:
        return "n/a"
    times = value / reference
    return f"{times:,.0f}×" if times >= 10 else f"{times:.2g}×"


def table(rows: list[dict[str, Any]], full_queries: int) -> str:
    """The markdown results table, with q/s ratios against the rank_bm25 row of the same run."""
    ref = next((r for r in rows if r["backend"] == REFERENCE and not r["large"]), None)
    header = (
        "| backend | passages | build s | build peak MiB | load s | RSS MiB | single q/s | p50 / p99 ms "
        "| batched q/s | × rank_bm25 (single / batched) | top-5 any gold | top-5 both gold | questions |"
    )
    lines = [header, "|" + "---|" * header.count(" | ") + "---|"]
    for r in rows:
        subset = " (subset)" if r["queries"] < full_queries else ""
        single = ratio(r["single_qps"], ref and ref["single_qps"])
        batched = ratio(r["batched_qps"], ref and ref["batched_qps"])
        lines.append(
            f"| `{r['backend']}` | {r['passages']:,} | {r['build_s']:,.1f} | {r['build_peak_mb']:,.0f} "
            f"| {r['load_s']:.2f} "
            f"| {r['rss_mb']:,.0f} | {r['single_qps']:,.0f} | {r['p50_ms']:.2f} / {r['p99_ms']:.2f} "
            f"| {r['batched_qps']:,.0f} | {single} / {batched} | {r['recall_any']:.3f} | {r['recall_all']:.3f} "
            f"| {r['queries']}{subset} |"
        )
    return "\n".join(lines)


def server_table(rows: list[dict[str, Any]]) -> str:
    """The load tests' table (rows that have one)."""
    lines = ["| served index | passages | clients | requests | requests/s | p50 / p99 ms per request |",
             "|---|---|---|---|---|---|"]
    lines += [f"| `{r['backend']}` | {r['passages']:,} | {r['server_clients']} | {r['server_requests']:,} "
              f"| {r['server_qps']:,.0f} | {r['server_p50_ms']:.2f} / {r['server_p99_ms']:.2f} |"
              for r in rows if "server_qps" in r]
    return "\n".join(lines) if len(lines) > 2 else ""


def section(
    rows: list[dict[str, Any]],
    command: str,
    full_queries: int,
    reference_queries: int,
    total_s: float,
    repeats: int,
    failures: Sequence[str] = (),
) -> str:
    bm25 = next((r for r in rows if r["backend"] == "bm25" and not r["large"]), None)
    notes = [
        f"- Top-{SEARCH_K} searches; q/s single = `search_one` one question at a time, batched = `search` on batches "
        f"of {BATCH_SIZE}; q/s is the median of {repeats} passes over the questions (after {WARMUP_QUERIES} warm-up "
        "queries); latency percentiles are over all passes. Recall = share of questions with at least one / both "
        f"gold supporting titles among the top-{RECALL_K} titles.",
        f"- `{REFERENCE}` is timed on the first {reference_queries} questions only (it scores every passage in "
        "Python); the ratio column divides by its q/s from this run (on the real corpus, also for the large row).",
        "- Build = `get_retriever` into an empty cache dir; load = `get_retriever` from that warm cache in a fresh "
        "process; RSS = resident-set increase of that process after loading (for `dense` this includes importing "
        "torch/transformers and the MiniLM model); build peak = peak RSS increase while building.",
    ]
    notes += [f"- {failure}." for failure in failures]
    large = next((r for r in rows if r["large"]), None)
    real = next((r for r in rows if not r["large"]), None)
    if large:
        copies = f"~{large['passages'] / real['passages']:.0f} copies of " if real else "copies of "
        notes.append(
            f"- The {large['passages']:,}-passage row is a generated corpus: {copies}the real one, all but the first "
            "perturbed (title suffix, ~10% of words dropped, ~10% of neighbours swapped; seeded), so each gold "
            f"passage has near-duplicates competing for the top-{RECALL_K}; recall strips the suffix."
        )
    if bm25:
        met = "met" if bm25["single_qps"] >= 1000 else "NOT met"
        notes.append(
            f"- Target ≥ 1,000 single top-{SEARCH_K} searches/s for `bm25` on the real corpus: {met} "
            f"({bm25['single_qps']:,.0f}/s)."
        )
    if large and large["backend"] == "bm25":
        met = (large["single_qps"] >= 1000 or large["p99_ms"] < 5) and large["build_peak_mb"] < 2048
        notes.append(
            f"- Target for `bm25` on {large['passages']:,} passages: ≥ 1,000 single top-{SEARCH_K} searches/s or p99 "
            f"< 5 ms, and a build peak under 2 GB: {'met' if met else 'NOT met'} ({large['single_qps']:,.0f}/s, p99 "
            f"{large['p99_ms']:.2f} ms, {large['build_peak_mb']:,.0f} MiB)."
        )
    return "\n".join(
        [
            "```",
            command,
            "```",
            "",
            f"Machine: {machine_description(PACKAGES)}. "
            f"Total runtime: {total_s / 60:.1f} min.",
            "",
            table(rows, full_queries),
            "",
            *notes,
            *(["", "Retrieval server (`python -m envs.retrieval.serve`, one process, 1 search thread) under load:", "",
                server_table(rows)] if server_table(rows) else []),
        ]
    )


# ---------------------------------------------------------------------------------------------------------
# Entry point


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
        large = large_corpus(source, args.large_passages, args.seed, args.workdir)
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
