"""The markdown section ``bench_retrieval.py`` writes: the backends' table (with q/s ratios against the
``rank_bm25`` reference of the same run), the notes that say how each figure was taken and whether the targets
were met, and the retrieval server's load-test table."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from benchmarks.report import machine_description
from benchmarks.retrieval_measures import BATCH_SIZE, RECALL_K, SEARCH_K, WARMUP_QUERIES

REFERENCE = "rank_bm25"
PACKAGES = ("numpy", "rank-bm25", "faiss-cpu", "torch", "transformers", "fastapi", "uvicorn")


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
