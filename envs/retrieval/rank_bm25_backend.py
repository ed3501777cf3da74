"""The rank-bm25 library's BM25Okapi as a backend: the reference implementation (slow: dense scoring)."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np

from envs.retrieval.base import top_k
from envs.retrieval.bm25 import passage_text
from envs.retrieval.corpus import Corpus, cache_entry, replace_atomically
from envs.retrieval.local import LocalRetriever
from envs.retrieval.progress import timed
from envs.retrieval.text import TOKENIZER_VERSION, tokenize

INDEX_VERSION = 1


class RankBM25Retriever(LocalRetriever):
    """``rank_bm25.BM25Okapi`` over the same tokens as ``bm25`` (k1=1.5, b=0.75: the library's defaults)."""

    name = "rank_bm25"

    def __init__(self, corpus: Corpus, model, options: dict):
        super().__init__(corpus, options)
        self.model = model

    @classmethod
    def load_or_build(cls, corpus: Corpus, cache_dir: Path, k1: float = 1.5, b: float = 0.75) -> RankBM25Retriever:
        from rank_bm25 import BM25Okapi

        options = {"k1": k1, "b": b}
        key = {**options, "version": INDEX_VERSION, "tokenizer": TOKENIZER_VERSION}
        entry = cache_entry(cache_dir, cls.name, corpus.path, key)
        file = entry / "bm25okapi.pkl"
        if file.is_file():
            with file.open("rb") as f:
                model = pickle.load(f)
        else:
            with timed(f"building the rank-bm25 index over {len(corpus)} passages of {corpus.path} (once)"):
                model = BM25Okapi([tokenize(passage_text(p.title, p.text)) for p in corpus], k1=k1, b=b)
                replace_atomically(file, lambda tmp: tmp.write_bytes(pickle.dumps(model, pickle.HIGHEST_PROTOCOL)))
        return cls(corpus, model, options)

    def _search(self, queries: list[str], k: int) -> list[tuple[np.ndarray, np.ndarray]]:
        return [top_k(np.asarray(self.model.get_scores(tokenize(q))), k) for q in queries]
