"""BM25 over a term-by-passage posting matrix saved on disk and memory-mapped (the default backend).

Each passage term gets its weight once, at build time::

    w(t, d) = idf(t) * tf(t, d) * (k1 + 1) / (tf(t, d) + k1 * (1 - b + b * |d| / avgdl))
    idf(t)  = ln(1 + (N - df(t) + 0.5) / (df(t) + 0.5))                  idf="lucene" (Lucene, Pyserini; >= 0)
    idf(t)  = ln((N - df(t) + 0.5) / (df(t) + 0.5)), negative values      idf="okapi" (rank-bm25's BM25Okapi,
              replaced by epsilon * the mean idf of the vocabulary                         Robertson et al. 1994)

A query's score for passage d is the sum of w(t, d) over its tokens (a repeated token counts again, as in
rank-bm25 and Lucene). The index is CSR: row t is term t's posting list (passage positions ascending, weights),
rows ordered by a 64-bit hash of the term so that a query looks its terms up in a memory-mapped array, not a
Python dict (a retriever remembers the rows of the terms it has searched). Every array is an ``.npy`` file in
the cache, memory-mapped: processes on one machine share its pages, and loading takes milliseconds whatever the
corpus size.

Search is exact top-k, in one of two ways, whichever costs less (``exhaustive``: by corpus size and postings).
Scoring in full adds every posting list of the query up and ranks only the passages that reach a floor, the k-th
best score among one list's passages (``BM25Retriever._score_all``): every search on small corpora (the real
one, 32k passages), and the searches of rare words on large ones. MaxScore pruning (Turtle & Flood 1995) for the
other searches: the shortest posting lists give a few good passages whose full scores bound the k-th best score
from below; the longest lists (frequent words) whose largest weights sum below that bound are never traversed,
only looked up (binary search) for the passages that can still make the top k (``BM25Retriever._candidates``).
Both give the top k of full scoring, ties broken by position.
The build streams the corpus in chunks and spills each chunk's (term, passage, tf) triples to disk, so its
memory is bounded by a chunk plus the output arrays, not by the corpus.
"""

from __future__ import annotations

import hashlib
import itertools
import threading
from collections import Counter
from pathlib import Path
from typing import Literal

import numpy as np

from envs.retrieval.base import top_k
from envs.retrieval.corpus import Corpus, building, cache_entry, load_arrays
from envs.retrieval.local import LocalRetriever
from envs.retrieval.progress import Percent, timed
from envs.retrieval.text import TOKENIZER_VERSION, tokenize

INDEX_VERSION = 3  # 3: memory-mapped .npy postings, hashed vocabulary, optional okapi idf
INDEX_ARRAYS = ("term_hashes", "indptr", "docs", "weights", "max_weight", "idf")
BUILD_CHUNK = 1 << 16  # passages per build chunk
EXHAUSTIVE_PASSAGES = 1 << 18  # up to this many passages, every search scores in full (see exhaustive)
EXHAUSTIVE_POSTINGS = 1 << 15  # and on larger corpora, every search of at most this many postings
REFRESH_POSTINGS = 4096  # a search refreshes its pruning threshold before adding a list longer than this
POOL_PER_LIST = 32  # best partial scores of each list added that join the pool scored in full
LOOKUP_COST = 16  # a binary search costs about this many postings added (when a list is applied to candidates)
GATHER_COST = 10  # reading a posting's score at random costs about this many scores compared in order
ROW_MEMO = 1 << 16  # terms whose row a retriever remembers (when full, it forgets them all)
SORT_CANDIDATES = 256  # at most this many candidates are ranked by one stable sort (else top_k)
IdfKind = Literal["lucene", "okapi"]


def passage_text(title: str, text: str) -> str:
    """What the sparse retrievers index for a passage: its title and its text."""
    return f"{title}\n{text}"


def term_hashes(terms: list[str]) -> np.ndarray:
    """A 64-bit hash of each term (blake2b: stable across processes and Python versions)."""
    return np.fromiter((int.from_bytes(hashlib.blake2b(t.encode("utf-8"), digest_size=8).digest(), "little")
                        for t in terms), dtype=np.uint64, count=len(terms))


def idf_weights(df: np.ndarray, n_docs: int, kind: IdfKind, epsilon: float) -> np.ndarray:
    """Per-term idf from document frequencies (see the module docstring), float64."""
    df = df.astype(np.float64)
    if kind == "lucene":
        return np.log1p((n_docs - df + 0.5) / (df + 0.5))
    if kind == "okapi":
        idf = np.log(n_docs - df + 0.5) - np.log(df + 0.5)
        return np.where(idf < 0, epsilon * idf.mean(), idf)
    raise ValueError(f"unknown idf {kind!r}; choose lucene or okapi")


def term_weights(tf: np.ndarray, lengths: np.ndarray, idf: np.ndarray, avgdl: float, k1: float, b: float
                 ) -> np.ndarray:
    """w(t, d) for aligned arrays of term frequencies, passage lengths and term idfs (float32)."""
    tf = tf.astype(np.float64)
    return (idf * tf * (k1 + 1.0) / (tf + k1 * (1.0 - b + b * lengths / avgdl))).astype(np.float32)


def exhaustive(passages: int, postings: int) -> bool:
    """Whether a search over ``postings`` postings of a corpus of ``passages`` scores every matching passage
    (``BM25Retriever._score_all``) rather than pruning (``_candidates``). Measured per search on the HotpotQA dev
    questions: on 32k passages scoring in full is 3 to 4x faster at every number of postings, frequent words
    included (pruning's bookkeeping costs more than the postings it skips); on 1M passages it is 1.8 to 3.7x
    faster below 40k postings; above them pruning is faster on most searches, and the retrieval server under
    load (8 clients, 2 cores) answered a fifth fewer requests/s when they all scored in full."""
    return passages <= EXHAUSTIVE_PASSAGES or postings <= EXHAUSTIVE_POSTINGS


def distinct(values: np.ndarray) -> np.ndarray:
    """The distinct values, ascending (``np.unique`` hashes in numpy 2.x and is ~15x slower on these arrays)."""
    values = np.sort(values)
    return values[np.concatenate(([True], values[1:] != values[:-1]))] if values.size else values


class BM25Retriever(LocalRetriever):
    """BM25 over memory-mapped postings; ``k1`` and ``b`` default to Pyserini's (0.9, 0.4) with Lucene's idf;
    ``idf="okapi"`` with ``k1=1.5, b=0.75, epsilon=0.25`` scores as rank-bm25's ``BM25Okapi``."""

    name = "bm25"

    def __init__(self, corpus: Corpus, arrays: dict[str, np.ndarray], options: dict):
        super().__init__(corpus, options)
        # Plain ndarray views of the memory maps (np.memmap's Python-level slicing costs microseconds per call).
        arrays = {name: np.asarray(array) for name, array in arrays.items()}
        self.term_hashes, self.indptr = arrays["term_hashes"], arrays["indptr"]
        self.docs, self.weights, self.max_weight = arrays["docs"], arrays["weights"], arrays["max_weight"]
        # MaxScore needs weights >= 0 (always with lucene; okapi's floor can be negative on tiny corpora)
        self.prunable = bool(np.min(arrays["idf"], initial=0.0) >= 0)
        self._rows: dict[str, int] = {}  # row of each term searched so far (a few words recur in most queries)
        self._scratch = threading.local()  # one score accumulator per thread (the server searches in threads)

    @classmethod
    def load_or_build(cls, corpus: Corpus, cache_dir: Path, k1: float = 0.9, b: float = 0.4,
                      idf: IdfKind = "lucene", epsilon: float = 0.25) -> BM25Retriever:
        options = {"k1": k1, "b": b, "idf": idf, "epsilon": epsilon}
        idf_weights(np.ones(1), 2, idf, epsilon)  # an unknown idf kind fails before a build
        key = {**options, "version": INDEX_VERSION, "tokenizer": TOKENIZER_VERSION}
        entry = cache_entry(cache_dir, cls.name, corpus.path, key)
        arrays = load_arrays(entry, INDEX_ARRAYS)
        if arrays is None:
            with timed(f"building the BM25 index over {len(corpus)} passages of {corpus.path} (once; cached in "
                       f"{entry.parent})"), building(entry) as folder:
                cls.build_index(corpus, folder, k1, b, idf, epsilon)
            arrays = load_arrays(entry, INDEX_ARRAYS)
        return cls(corpus, arrays, options)

    @staticmethod
    def build_index(corpus: Corpus, folder: Path, k1: float, b: float, idf_kind: IdfKind, epsilon: float) -> None:
        """Write the index arrays of ``corpus`` into ``folder`` (``INDEX_ARRAYS``, one ``.npy`` each)."""
        vocab: dict[str, int] = {}
        lengths = np.zeros(len(corpus), dtype=np.int32)
        df = np.zeros(0, dtype=np.int64)
        spills: list[Path] = []
        progress = Percent("BM25: passages tokenized", len(corpus))
        passages = iter(corpus)
        start = 0
        while chunk := list(itertools.islice(passages, BUILD_CHUNK)):
            ids: list[int] = []
            for i, passage in enumerate(chunk):
                tokens = tokenize(passage_text(passage.title, passage.text))
                ids.extend([vocab.setdefault(t, len(vocab)) for t in tokens])
                lengths[start + i] = len(tokens)
                progress(start + i + 1)
            local_docs = np.repeat(np.arange(len(chunk), dtype=np.int64), lengths[start : start + len(chunk)])
            pairs, tf = np.unique(local_docs * len(vocab) + np.asarray(ids, dtype=np.int64), return_counts=True)
            terms = (pairs % len(vocab)).astype(np.int32)
            spill = folder / f"spill-{len(spills)}.npz"
            np.savez(spill, terms=terms, docs=(pairs // len(vocab) + start).astype(np.int32), tf=tf.astype(np.int32))
            spills.append(spill)
            df = np.pad(df, (0, len(vocab) - len(df))) + np.bincount(terms, minlength=len(vocab))
            start += len(chunk)
        n_docs = start
        avgdl = max(float(lengths.mean()), 1e-9)
        idf = idf_weights(df, n_docs, idf_kind, epsilon)
        hashes = term_hashes(list(vocab))
        del vocab
        order = np.argsort(hashes)  # row r holds term order[r]
        if np.any(hashes[order][1:] == hashes[order][:-1]):
            raise RuntimeError(f"{corpus.path}: two terms share a 64-bit hash; the BM25 index cannot be built")
        row_of = np.empty_like(order)
        row_of[order] = np.arange(len(order))
        indptr = np.concatenate([[0], np.cumsum(df[order])]).astype(np.int64)
        nnz = int(indptr[-1])
        docs = np.lib.format.open_memmap(folder / "docs.npy", mode="w+", dtype=np.int32, shape=(nnz,))
        weights = np.lib.format.open_memmap(folder / "weights.npy", mode="w+", dtype=np.float32, shape=(nnz,))
        fill = indptr[:-1].copy()  # next free slot of every row
        for spill in spills:  # chunks in passage order: every posting list comes out sorted by passage
            with np.load(spill) as part:
                terms, chunk_docs, tf = part["terms"], part["docs"], part["tf"]
            by_row = np.argsort(row_of[terms], kind="stable")
            terms, chunk_docs, tf = terms[by_row], chunk_docs[by_row], tf[by_row]
            rows = row_of[terms]
            present, first, counts = np.unique(rows, return_index=True, return_counts=True)
            slots = fill[rows] + np.arange(len(rows)) - np.repeat(first, counts)
            docs[slots] = chunk_docs
            weights[slots] = term_weights(tf, lengths[chunk_docs], idf[terms], avgdl, k1, b)
            fill[present] += counts
            spill.unlink()
        max_weight = np.maximum.reduceat(weights, indptr[:-1]) if nnz else np.zeros(len(order), np.float32)
        docs.flush(), weights.flush()
        del docs, weights
        arrays = {"term_hashes": hashes[order], "indptr": indptr, "max_weight": max_weight,
                  "idf": idf[order].astype(np.float32)}
        for name, array in arrays.items():
            np.save(folder / f"{name}.npy", array)

    def term_rows(self, terms: list[str]) -> np.ndarray:
        """The index row of each term, -1 for a term not in the corpus."""
        memo = self._rows
        rows = [memo.get(term) for term in terms]
        if None in rows:  # hash and look up the terms not searched before
            new = list(dict.fromkeys(term for term, row in zip(terms, rows, strict=True) if row is None))
            found = dict(zip(new, self._look_up(new).tolist(), strict=True))
            if len(memo) + len(found) > ROW_MEMO:
                memo = self._rows = {}
            memo.update(found)
            rows = [found[term] if row is None else row for term, row in zip(terms, rows, strict=True)]
        return np.array(rows, dtype=np.int64)

    def _look_up(self, terms: list[str]) -> np.ndarray:
        """``term_rows`` without the memo: a binary search of each term's hash."""
        hashes = term_hashes(terms)
        if not len(self.term_hashes):
            return np.full(len(terms), -1)
        rows = np.minimum(np.searchsorted(self.term_hashes, hashes), len(self.term_hashes) - 1)
        return np.where(self.term_hashes[rows] == hashes, rows, -1)

    def _accumulator(self) -> np.ndarray:
        """This thread's score per passage (zeros between searches)."""
        acc = getattr(self._scratch, "acc", None)
        if acc is None:
            acc = self._scratch.acc = np.zeros(len(self.corpus), dtype=np.float64)
        return acc

    def _search(self, queries: list[str], k: int) -> list[tuple[np.ndarray, np.ndarray]]:
        return [self._search_query(query, k) for query in queries]

    def _search_query(self, query: str, k: int) -> tuple[np.ndarray, np.ndarray]:
        counts = Counter(tokenize(query))
        rows = self.term_rows(list(counts))
        known = rows >= 0
        if not known.any():
            return np.empty(0, np.int64), np.empty(0, np.float64)
        rows, times = rows[known], np.asarray(list(counts.values()), dtype=np.float64)[known]
        starts, ends = self.indptr[rows], self.indptr[rows + 1]
        lengths = ends - starts
        if exhaustive(len(self.corpus), int(lengths.sum())):
            candidates, scores = self._score_all(rows, times, starts, lengths, k)
        else:
            order = np.argsort(lengths, kind="stable")  # shortest list first
            acc, added = self._accumulator(), []
            try:
                candidates, scores = self._candidates(rows[order], times[order], k, acc, added)
            finally:
                for docs in added:  # every passage touched is in an added list
                    acc[docs] = 0.0
            if self.prunable:  # weights >= 0: a passage that scores 0 matched no term that counts
                candidates, scores = candidates[scores > 0], scores[scores > 0]
        if candidates.size <= SORT_CANDIDATES:  # candidates ascend by position: a stable sort breaks ties by it
            best = np.argsort(-scores, kind="stable")[:k]
            return candidates[best].astype(np.int64), scores[best]
        best, best_scores = top_k(scores, k)  # ties break by position, as above
        return candidates[best].astype(np.int64), best_scores

    def _score_all(self, rows: np.ndarray, times: np.ndarray, starts: np.ndarray, lengths: np.ndarray, k: int
                   ) -> tuple[np.ndarray, np.ndarray]:
        """Without pruning: every list added up (row ``rows[i]``'s postings start at ``starts[i]``, ``lengths[i]``
        of them), on a small corpus into a fresh score array (``bincount``), on a large one into this thread's
        accumulator (``np.add.at``: its work is in the postings, not the corpus; cleared after); float64 sums in
        list order either way. Returns passages (ascending) that include the top k, with their scores: with
        weights >= 0, those scoring at least a floor > 0, the k-th best score among the passages of one list (the
        one with the largest bound), a lower bound on the k-th best of all (usually a handful of passages);
        otherwise every matching passage."""
        spans = [slice(start, start + n) for start, n in zip(starts.tolist(), lengths.tolist(), strict=True)]
        lists = [self.docs[span] for span in spans]
        weights = [self.weights[span] if factor == 1.0 else factor * self.weights[span]  # float64 factor
                   for span, factor in zip(spans, times, strict=True)]
        if len(self.corpus) <= EXHAUSTIVE_PASSAGES:
            docs = np.concatenate(lists)
            scores = np.bincount(docs, weights=np.concatenate(weights), minlength=len(self.corpus))
            return self._top_candidates(scores, docs, lists, rows, times, lengths, k)
        docs = np.concatenate(lists, dtype=np.intp)
        acc = self._accumulator()
        try:
            np.add.at(acc, docs, np.concatenate(weights, dtype=np.float64))
            return self._top_candidates(acc, docs, lists, rows, times, lengths, k)
        finally:
            acc[docs] = 0.0

    def _top_candidates(self, scores: np.ndarray, docs: np.ndarray, lists: list[np.ndarray], rows: np.ndarray,
                        times: np.ndarray, lengths: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """``_score_all``'s candidates and their scores, from every passage's ``scores`` (``docs``: the query's
        lists, concatenated)."""
        long_enough = np.flatnonzero(lengths >= k)
        if not self.prunable or not long_enough.size:
            candidates = distinct(docs)
            if self.prunable:
                candidates = candidates[scores[candidates] > 0]
            return candidates, scores[candidates]
        bounds = self.max_weight[rows[long_enough]] * times[long_enough]
        some = scores[lists[int(long_enough[np.argmax(bounds)])]]  # k or more distinct passages' full scores
        floor = max(float(np.partition(some, some.size - k)[some.size - k]), np.nextafter(0.0, 1.0))
        if docs.size * GATHER_COST < len(scores):  # few postings: compare their passages' scores, not all
            candidates = distinct(docs[scores[docs] >= floor])
        else:
            candidates = np.flatnonzero(scores >= floor)
        return candidates, scores[candidates]

    def _candidates(self, rows: np.ndarray, times: np.ndarray, k: int, acc: np.ndarray, added: list[np.ndarray]
                    ) -> tuple[np.ndarray, np.ndarray]:
        """The passages that can make the top k (ascending) and their full scores; ``rows`` shortest first.

        1. A threshold: the k-th best full score of a pool of good passages (the best partial scores of each list
           added), a lower bound on the k-th best score of all.
        2. The lists not added whose bounds (largest weight x multiplicity) sum below the threshold ("slack")
           are set aside: a passage in none of the other lists scores at most the slack, so cannot make the top
           k. Of the others, the shortest is added to ``acc``, the pool and threshold refreshed, and the lists
           split again, until every list not added is set aside.
        3. Candidates: passages of the added lists whose partial score plus the slack reaches the threshold. The
           lists set aside are then applied largest bound first, each to the candidates only (binary search) or
           whole (when that is cheaper), and the candidates that can no longer reach the threshold dropped.
        Every candidate gets every list's weight in the same order, so equal scores stay equal (exact ties).
        """
        bounds = self.max_weight[rows] * times
        lengths = self.indptr[rows + 1] - self.indptr[rows]
        pending = np.arange(len(rows))  # lists not added, shortest first
        threshold, pool, pool_scores = -np.inf, np.empty(0, dtype=np.int32), np.empty(0)
        while pending.size:
            by_bound = pending[np.argsort(bounds[pending], kind="stable")]
            aside = by_bound[: int(np.searchsorted(np.cumsum(bounds[by_bound]) * (1 + 1e-9), threshold))]
            essential = pending[~np.isin(pending, aside, kind="sort")] if aside.size else pending
            if not essential.size:
                break
            i, pending = essential[0], pending[pending != essential[0]]
            docs = self._add(rows[i], times[i], acc)
            added.append(docs)
            if not self.prunable or not pending.size or lengths[pending].min() < REFRESH_POSTINGS:
                continue  # cheaper to add the next list than to refresh the threshold first
            best = docs[np.argpartition(-acc[docs], min(POOL_PER_LIST, docs.size) - 1)[:POOL_PER_LIST]]
            fresh = distinct(best[~np.isin(best, pool)])
            pool = np.concatenate([pool, fresh])
            full = acc[fresh] + sum((self._lookup(fresh, rows[j], times[j]) for j in pending), np.zeros(fresh.size))
            pool_scores = np.concatenate([pool_scores, full])
            if pool.size >= k:
                threshold = max(threshold, float(np.partition(pool_scores, pool.size - k)[pool.size - k]))
        rest = pending[np.argsort(-bounds[pending], kind="stable")]  # largest bound first
        seen = np.concatenate(added)
        slack = float(bounds[rest].sum())
        candidates = seen[acc[seen] + slack * (1 + 1e-9) >= threshold]  # with repeats: harmless until the end
        for i in rest:
            slack = max(slack - bounds[i], 0.0)
            if candidates.size * LOOKUP_COST < lengths[i]:
                acc[candidates] += self._lookup(candidates, rows[i], times[i])
            else:
                added.append(self._add(rows[i], times[i], acc))
            candidates = candidates[acc[candidates] + slack * (1 + 1e-9) >= threshold]
        candidates = distinct(candidates)
        return candidates, acc[candidates]

    def _add(self, row: int, times: float, acc: np.ndarray) -> np.ndarray:
        """Add row's weights (x ``times``) to its passages' scores in ``acc``; its passages."""
        span = slice(self.indptr[row], self.indptr[row + 1])
        docs = self.docs[span]
        acc[docs] += times * self.weights[span]
        return docs

    def _lookup(self, docs: np.ndarray, row: int, times: float) -> np.ndarray:
        """Per passage of ``docs``, its weight in ``row`` x ``times`` (0 when absent), by binary search."""
        start, end = self.indptr[row], self.indptr[row + 1]
        postings = self.docs[start:end]
        slots = np.minimum(np.searchsorted(postings, docs), end - start - 1)
        return np.where(postings[slots] == docs, times * self.weights[start + slots], 0.0)
