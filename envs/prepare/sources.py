"""What ``python -m envs.prepare`` can fetch: the public files, where they are published, their sizes and checksums
where the publisher gives them, and which file of the data directory each becomes.

Sources (all public, no account needed):

- HotpotQA: the official files from the HotpotQA site (http://curtis.ml.cmu.edu/datasets/hotpot/, linked from
  https://hotpotqa.github.io). Official, rather than FlashRAG's question-only copy, because the first-run corpus is
  pooled from their context paragraphs. Sizes and sha256 as Hugging Face's ``hotpot_qa`` loader pins them
  (huggingface/datasets, ``datasets/hotpot_qa/dataset_infos.json``, ``download_checksums``). The site is plain
  HTTP and has had outages: when it cannot be fetched, the Internet Archive's copy of the same URLs is (its raw
  ``id_`` form), checked against the same sha256.
- The other QA sets: FlashRAG's copies on the Hugging Face hub (``RUC-NLPIR/FlashRAG_datasets``,
  ``NAME/{train,dev,test}.jsonl``, ``{"id", "question", "golden_answers", "metadata"}`` lines), the files
  Search-R1's ``scripts/data_process/*.py`` read through ``datasets.load_dataset('RUC-NLPIR/FlashRAG_datasets',
  NAME)``. No size is published beside them: the download is checked against its Content-Length.
- The hub's files are read at a revision of their repository (``resolve/REVISION``), not at a branch that moves
  (FlashRAG's popqa test file changed between commits).
- wiki-18: Search-R1's corpus on the hub (``PeterJinGo/wiki-18-corpus``, ``wiki-18.jsonl.gz``; its size and the
  sha256 of its LFS object). Despite the name the gzip holds a tar of one file, FlashRAG's ``wiki_dump.jsonl``
  (14,393,573,105 bytes, 21M passages); ``convert.unpack_corpus`` reads either shape.

No published retrieval index is fetched: Search-R1's (``PeterJinGo/wiki-18-e5-index``: a 64 GB faiss flat index
of e5-base-v2 embeddings; ``wiki-18-bm25-index``: Pyserini's Lucene format) are not what ``envs.retrieval`` reads;
its indexes are built from the corpus and cached (docs/retrieval.md).

With ``--source DIR`` (or a URL) every file is read from ``DIR/MIRROR/PATH`` instead of ``URL/PATH``: ``MIRROR`` is
the host's ``mirror`` folder below (``hotpotqa``, ``RUC-NLPIR/FlashRAG_datasets``, ``PeterJinGo/wiki-18-corpus``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from envs.datasets import CORPUS_CANDIDATES
from envs.prepare import convert

HUB = "https://huggingface.co/datasets"
# The revision of each hub repository its files are read at. A branch name until each repository's commit hash is
# looked up (https://huggingface.co/api/datasets/REPO gives it as "sha"; not reachable where this was written): set
# them to those hashes to pin the files.
FLASHRAG_REVISION = "main"
WIKI18_REVISION = "main"
HOTPOTQA_URL = "http://curtis.ml.cmu.edu/datasets/hotpot"
WAYBACK_RAW = "https://web.archive.org/web/2019id_"  # the Internet Archive's copy of a URL, as captured, byte for byte


@dataclass(frozen=True)
class Host:
    """Where a set of files is published (``url``), the folder that holds the same files under ``--source``, other
    public copies of the same files (base URLs tried in turn when ``url`` fails), and for a hub repository the
    revision it is read at."""

    url: str
    mirror: str
    fallbacks: tuple[str, ...] = ()
    revision: str | None = None


def hub(repository: str, revision: str) -> Host:
    """A Hugging Face dataset repository's files at ``revision``."""
    return Host(f"{HUB}/{repository}/resolve/{revision}", repository, revision=revision)


HOTPOTQA_SITE = Host(HOTPOTQA_URL, "hotpotqa", fallbacks=(f"{WAYBACK_RAW}/{HOTPOTQA_URL}",))
FLASHRAG_HUB = hub("RUC-NLPIR/FlashRAG_datasets", FLASHRAG_REVISION)
WIKI18_HUB = hub("PeterJinGo/wiki-18-corpus", WIKI18_REVISION)


@dataclass(frozen=True)
class RemoteFile:
    """One published file; ``size`` (bytes) and ``sha256`` where its publisher gives them, else None."""

    host: Host
    path: str
    size: int | None = None
    sha256: str | None = None

    def url(self, source: str | None = None) -> str:
        """Its address: at its publisher, or under ``source`` (a directory or a base URL laid out as the mirror)."""
        if source is None:
            return f"{self.host.url}/{self.path}"
        base = source if "://" in source else Path(source).resolve().as_uri()
        return f"{base.rstrip('/')}/{self.mirror_path}"

    def fallback_urls(self) -> tuple[str, ...]:
        """Its addresses at the other public copies of its publisher's files."""
        return tuple(f"{base}/{self.path}" for base in self.host.fallbacks)

    @property
    def mirror_path(self) -> str:
        """Where it lies under a ``--source`` directory."""
        return f"{self.host.mirror}/{self.path}"


# (downloaded file, file to write) -> None; writes the second from the first
Conversion = Callable[[Path, Path], None]


@dataclass(frozen=True)
class Product:
    """A file of the data directory (``output``, relative to it) made from one download: the download itself when
    ``conversion`` is None, else ``conversion(download, output)``. ``split`` is the dataset split it holds (None for
    a corpus); ``output_size`` the bytes the conversion writes, where known (the disk check)."""

    output: str
    remote: RemoteFile
    split: str | None = None
    conversion: Conversion | None = None
    output_size: int | None = None

    def output_bytes(self, download_size: int | None) -> int:
        """The disk its conversion's output takes, from a download of ``download_size`` bytes: ``output_size`` for
        the publisher's file, in the same proportion for another (a ``--source`` mirror's, often a small stand-in);
        the download's size where no output size is known."""
        if self.output_size is None:
            return download_size or 0
        if download_size is None or self.remote.size is None:
            return self.output_size
        return self.output_size * download_size // self.remote.size


def _flashrag(name: str, splits: tuple[str, ...], to_parquet: bool) -> tuple[Product, ...]:
    """FlashRAG's split files of ``name``: kept as published (``NAME/SPLIT.jsonl``, which envs/datasets.py reads),
    or as ``NAME/SPLIT.parquet`` for the sets whose official format is another (2WikiMultihopQA, MuSiQue)."""
    if to_parquet:
        return tuple(Product(f"{name}/{split}.parquet", RemoteFile(FLASHRAG_HUB, f"{name}/{split}.jsonl"), split,
                             convert.flashrag_to_parquet) for split in splits)
    return tuple(Product(f"{name}/{split}.jsonl", RemoteFile(FLASHRAG_HUB, f"{name}/{split}.jsonl"), split)
                 for split in splits)


# dataset name (as envs/datasets.py's DATASETS) -> its products
DATASET_PRODUCTS: dict[str, tuple[Product, ...]] = {
    "hotpotqa": (
        Product("hotpotqa/hotpot_train_v1.1.json",
                RemoteFile(HOTPOTQA_SITE, "hotpot_train_v1.1.json", 566_426_227,
                           "26650cf50234ef5fb2e664ed70bbecdfd87815e6bffc257e068efea5cf7cd316"), "train"),
        Product("hotpotqa/hotpot_dev_distractor_v1.json",
                RemoteFile(HOTPOTQA_SITE, "hotpot_dev_distractor_v1.json", 46_320_117,
                           "4e9ecb5c8d3b719f624d66b60f8d56bf227f03914f5f0753d6fa1b359d7104ea"), "dev"),
    ),
    "2wikimultihopqa": _flashrag("2wikimultihopqa", ("train", "dev"), to_parquet=True),
    "musique": _flashrag("musique", ("train", "dev"), to_parquet=True),
    "nq": _flashrag("nq", ("train", "dev", "test"), to_parquet=False),
    "triviaqa": _flashrag("triviaqa", ("train", "dev", "test"), to_parquet=False),
    "popqa": _flashrag("popqa", ("test",), to_parquet=False),
    "bamboogle": _flashrag("bamboogle", ("test",), to_parquet=False),
}

PARAGRAPHS_CORPUS, WIKI18_CORPUS, NO_CORPUS = "hotpotqa-paragraphs", "wiki-18", "none"
PARAGRAPHS_OUTPUT, WIKI18_OUTPUT = CORPUS_CANDIDATES[1], CORPUS_CANDIDATES[0]
WIKI18 = Product(WIKI18_OUTPUT, RemoteFile(WIKI18_HUB, "wiki-18.jsonl.gz", 5_123_307_260,
                                           "7abd929223399cd63c52b499f289bf4f9039be1e9f8c43e1cb3938305b2317db"),
                 conversion=convert.unpack_corpus, output_size=14_393_573_105)

# corpus name -> what it is (the --help text)
CORPORA: dict[str, str] = {
    PARAGRAPHS_CORPUS: f"{PARAGRAPHS_OUTPUT}: the HotpotQA files' context paragraphs, pooled (the first-run corpus, "
                       "built from the hotpotqa download)",
    WIKI18_CORPUS: f"{WIKI18_OUTPUT}: the paper's Wikipedia 2018 (21M passages; 5.1 GB download, 14.4 GB on disk)",
    NO_CORPUS: "no corpus",
}
