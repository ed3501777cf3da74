"""BM25 on a sparse term-by-passage matrix of precomputed weights (the default backend).

Each passage term gets its BM25 weight once at build time (Robertson/Lucene form with a non-negative idf)::

    w(t, d) = idf(t) * tf(t, d) * (k1 + 1) / (tf(t, d) + k1 * (1 - b + b * |d| / avgdl))
    idf(t)  = ln(1 + (N - df(t) + 0.5) / (df(t) + 0.5))

A query's score for passage d is the sum of w(t, d) over its distinct terms, so a search adds up a few posting
lists.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import scipy.sparse as sp

from envs.retrieval.base import Retriever, top_k
from envs.retrieval.corpus import Corpus, cache_entry, load_arrays, save_arrays
from envs.retrieval.progress import Percent, timed
from envs.retrieval.text import TOKENIZER_VERSION, tokenize

INDEX_VERSION = 2  # 2: the vocabulary stored as newline-joined UTF-8 bytes


def passage_text(title: str, text: str) -> str:
    """What the sparse retrievers index for a passage: its title and its text."""
    return f"{title}\n{text}"


def bm25_weights(tf: sp.csr_matrix, k1: float, b: float) -> sp.csr_matrix:
    """Passage-by-term term frequencies -> passage-by-term BM25 weights (same sparsity)."""
    n_docs = tf.shape[0]
    lengths = np.asarray(tf.sum(axis=1)).ravel()
    avgdl = max(lengths.mean(), 1e-9)
    df = np.bincount(tf.indices, minlength=tf.shape[1])
    idf = np.log1p((n_docs - df + 0.5) / (df + 0.5))
    rows = np.repeat(np.arange(n_docs), np.diff(tf.indptr))
    freq = tf.data.astype(np.float64)
    norm = k1 * (1.0 - b + b * lengths[rows] / avgdl)
    data = idf[tf.indices] * freq * (k1 + 1.0) / (freq + norm)
    return sp.csr_matrix((data.astype(np.float32), tf.indices, tf.indptr), shape=tf.shape)


class BM25Retriever(Retriever):
    """Sparse-matrix BM25; ``k1`` and ``b`` as in Lucene's defaults (0.9, 0.4 as in Pyserini)."""

    name = "bm25"

    def __init__(self, corpus: Corpus, vocab: dict[str, int], term_doc: sp.csr_matrix, options: dict[str, Any]):
        super().__init__(corpus, options)
        self.vocab = vocab
        self.term_doc = term_doc  # terms x passages, CSR: row t is t's posting list with weights

    @classmethod
    def load_or_build(cls, corpus: Corpus, cache_dir: Path, k1: float = 0.9, b: float = 0.4) -> BM25Retriever:
        options = {"k1": k1, "b": b}
        key = {**options, "version": INDEX_VERSION, "tokenizer": TOKENIZER_VERSION}
        entry = cache_entry(cache_dir, cls.name, corpus.path, key)
        arrays = load_arrays(entry)
        if arrays is None:
            with timed(f"building the BM25 index over {len(corpus)} passages of {corpus.path} (once; cached in "
                       f"{entry.parent})"):
                arrays = cls.build_arrays(corpus, k1, b)
                save_arrays(entry, arrays)
        terms = arrays["terms"].tobytes().decode("utf-8").split("\n")  # \w+ tokens hold no newline
        vocab = {term: i for i, term in enumerate(terms)}
        shape = (len(vocab), len(corpus))
        term_doc = sp.csr_matrix((arrays["data"], arrays["indices"], arrays["indptr"]), shape=shape)
        return cls(corpus, vocab, term_doc, options)

    @staticmethod
    def build_arrays(corpus: Corpus, k1: float, b: float) -> dict[str, np.ndarray]:
        vocab: dict[str, int] = {}
        term_ids: list[int] = []
        lengths: list[int] = []
        progress = Percent("BM25: passages tokenized", len(corpus))
        for passage in corpus:
            tokens = tokenize(passage_text(passage.title, passage.text))
            term_ids.extend([vocab.setdefault(t, len(vocab)) for t in tokens])
            lengths.append(len(tokens))
            progress(len(lengths))
        rows = np.repeat(np.arange(len(lengths), dtype=np.int64), lengths)
        cols = np.asarray(term_ids, dtype=np.int64)
        tf = sp.csr_matrix((np.ones(len(cols), dtype=np.float32), (rows, cols)), shape=(len(lengths), len(vocab)))
        tf.sum_duplicates()
        term_doc = bm25_weights(tf, k1, b).T.tocsr()
        term_doc.sort_indices()
        return {
            "terms": np.frombuffer("\n".join(vocab).encode("utf-8"), dtype=np.uint8),
            "data": term_doc.data,
            "indices": term_doc.indices.astype(np.int32),
            "indptr": term_doc.indptr.astype(np.int64),
        }

    def _term_ids(self, query: str) -> list[int]:
        ids = {self.vocab[t] for t in tokenize(query) if t in self.vocab}
        return sorted(ids)

    def _search(self, queries: list[str], k: int) -> list[tuple[np.ndarray, np.ndarray]]:
        # Per query: add up its posting lists. Faster than one sparse product for a batch (measured: the product
        # materialises every matching passage of every query), and a batch equals its queries run one by one.
        indptr, indices, data = self.term_doc.indptr, self.term_doc.indices, self.term_doc.data
        n_docs = self.term_doc.shape[1]
        results = []
        for query in queries:
            spans = [slice(indptr[t], indptr[t + 1]) for t in self._term_ids(query)]
            if not spans:
                results.append((np.empty(0, np.int64), np.empty(0, np.float64)))
                continue
            docs = np.concatenate([indices[s] for s in spans])
            weights = np.concatenate([data[s] for s in spans])
            results.append(top_k(np.bincount(docs, weights=weights, minlength=n_docs), k, positive_only=True))
        return results
