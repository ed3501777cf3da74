"""The retrieval benchmark's pure parts (benchmarks/retrieval_corpus.py, retrieval_report.py), by hand: the generated
corpus's copies and perturbations, the gold titles recall counts, and the report's ratios and tables."""

from __future__ import annotations

import json

import numpy as np

from benchmarks.retrieval_corpus import generated_lines, gold_title, large_corpus, perturb
from benchmarks.retrieval_report import ratio, server_table, table
from envs.datasets import parse_passage


def test_gold_title_strips_only_a_trailing_copy_suffix():
    assert gold_title("Paris ~dup03") == "Paris"
    assert gold_title("Paris ~dup03 (city)") == "Paris ~dup03 (city)"
    assert gold_title("Paris") == "Paris"


def test_perturb_by_hand():
    rng = np.random.default_rng(0)
    assert perturb(["alone"], rng) == ["alone"]  # too short to perturb
    assert perturb(["a", "b", "c"], rng, drop=1.0, swap=0.0) == ["a"]  # every word dropped: the first is kept
    # no word dropped, every neighbour pair swapped in order: (a b) -> b a c, then (a c) -> b c a
    assert perturb(["a", "b", "c"], rng, drop=0.0, swap=1.0) == ["b", "c", "a"]
    assert perturb(["a", "b", "c"], rng, drop=0.0, swap=0.0) == ["a", "b", "c"]


def test_generated_lines_are_the_source_then_numbered_perturbed_copies(tmp_path):
    source = tmp_path / "corpus.jsonl"
    words = " ".join(f"w{i}" for i in range(40))
    passages = [{"id": "p0", "contents": f'"Alpha"\n{words}'}, {"id": "p1", "contents": '"Beta"\nfive six'}]
    source.write_text("\n".join(json.dumps(p) for p in passages) + "\n\n")  # a blank line is skipped
    lines = list(generated_lines(source, 5, seed=0))
    assert len(lines) == 5 and [json.loads(line) for line in lines[:2]] == passages
    copies = [parse_passage(line, "generated") for line in lines[2:]]
    assert [(p.id, p.title) for p in copies] == [("p0~1", "Alpha ~dup01"), ("p1~1", "Beta ~dup01"),
                                                 ("p0~2", "Alpha ~dup02")]
    assert set(copies[0].text.split()) < set(words.split())  # some of the 40 words dropped, none added
    assert lines == list(generated_lines(source, 5, seed=0)) and lines[2:] != list(generated_lines(source, 5, 1))[2:]


def test_large_corpus_is_reused_while_its_inputs_are_the_same(tmp_path):
    source = tmp_path / "corpus.jsonl"
    source.write_text(json.dumps({"id": "p0", "contents": '"Alpha"\none two'}) + "\n")
    said: list[str] = []
    path = large_corpus(source, 3, 0, tmp_path, said.append)
    assert len(path.read_text().splitlines()) == 3 and said[0].startswith("generating 3 passages")
    assert large_corpus(source, 3, 0, tmp_path, said.append) == path and said[-1] == f"reusing {path}"
    large_corpus(source, 3, 1, tmp_path, said.append)  # another seed: another file
    assert said[-2].startswith("generating 3 passages")


def test_ratio_formats_by_size():
    assert ratio(50.0, 2.0) == "25×"
    assert ratio(99.6, 1.0) == "100×"  # whole times from 10 on: two significant digits would say 1e+02
    assert ratio(12_345.0, 1.0) == "12,345×"
    assert ratio(3.0, 2.0) == "1.5×"
    assert ratio(1.0, None) == ratio(1.0, 0.0) == "n/a"


def row(backend: str, single: float, batched: float, *, large: bool = False, queries: int = 10) -> dict:
    return {"backend": backend, "large": large, "passages": 1000, "build_s": 1.0, "build_peak_mb": 10.0,
            "load_s": 0.5, "rss_mb": 20.0, "single_qps": single, "p50_ms": 0.1, "p99_ms": 0.2,
            "batched_qps": batched, "recall_any": 0.5, "recall_all": 0.25, "queries": queries}


def test_table_divides_by_the_reference_row_of_the_real_corpus():
    rows = [row("bm25", 1000.0, 4000.0), row("rank_bm25", 10.0, 20.0, queries=5), row("bm25", 500.0, 40.0, large=True)]
    lines = table(rows, full_queries=10).splitlines()
    assert len(lines) == 2 + 3 and lines[1].count("---") == lines[0].count("|") - 1
    assert "| 100× / 200× |" in lines[2] and "| 1× / 1× |" in lines[3] and "| 50× / 2× |" in lines[4]
    assert lines[3].endswith("| 5 (subset) |") and lines[2].endswith("| 10 |")


def test_server_table_holds_the_load_tested_rows_only():
    assert server_table([row("bm25", 1.0, 1.0)]) == ""
    served = {**row("bm25", 1.0, 1.0), "server_clients": 8, "server_requests": 4000, "server_qps": 1234.4,
              "server_p50_ms": 1.0, "server_p99_ms": 9.5}
    assert server_table([served, row("dense", 1.0, 1.0)]).splitlines()[2:] == [
        "| `bm25` | 1,000 | 8 | 4,000 | 1,234 | 1.00 / 9.50 |"]
