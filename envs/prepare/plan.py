"""What a ``python -m envs.prepare`` run will do in a data directory, decided before anything is fetched: the files
still to fetch or build, their sizes, and whether the disk holds them.

A file is made unless the data directory already has it, or a file that envs/datasets.py reads in its place (the
full official files before the subsets, ``wiki/wiki-18.jsonl`` before ``wiki/paragraphs.jsonl``): what is there is
kept, so a run after an interrupted one only finishes the rest, and one after a finished one does nothing.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path

from envs.datasets import CORPUS_CANDIDATES, DATASETS
from envs.prepare.download import DownloadError, file_problem, part_path, remote_size, resume_offset
from envs.prepare.sources import (
    CORPORA,
    DATASET_PRODUCTS,
    PARAGRAPHS_CORPUS,
    PARAGRAPHS_OUTPUT,
    WIKI18,
    WIKI18_CORPUS,
    Product,
)

DOWNLOADS_DIR = "downloads"  # under the data directory: files fetched to be converted, removed once they are
PARAGRAPH_SOURCE = "hotpotqa"  # the dataset the first-run corpus is pooled from


class NotEnoughDiskError(RuntimeError):
    """The data directory's disk cannot hold what the run would write; the message gives the sizes."""


class DamagedFileError(RuntimeError):
    """A file already in the data directory is not the file it stands for (truncated, too long, corrupted); the
    message names it and the way out. The file is left as it is: it may be the user's own."""


def human_bytes(n: int) -> str:
    """``n`` bytes in binary units: "512 B", "540.2 MiB"."""
    size, unit = float(n), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            break
        size /= 1024
    return f"{n} B" if unit == "B" else f"{size:.1f} {unit}"


def manual_route(product: Product, data_dir: Path) -> str:
    """What to do when a file cannot be fetched from here."""
    return (f"Without network access here: fetch it where there is, into DIR/{product.remote.mirror_path}, and run "
            f"again with --source DIR; or lay {data_dir} out by hand as docs/environments.md describes (\"Getting "
            f"the data\"; this file becomes {product.output})")


@dataclass(frozen=True)
class Task:
    """A product to make: its download's ``url`` and ``size`` (None if unknown), and where the download goes."""

    product: Product
    url: str
    size: int | None
    sha256: str | None
    download: Path  # the output itself, or a file under DOWNLOADS_DIR when a conversion reads it
    fallbacks: tuple[str, ...] = ()  # other public copies of the file at ``url``

    def bytes_to_fetch(self) -> int:
        """What is left to download (0 when unknown)."""
        return (self.size or 0) - resume_offset(part_path(self.download), self.url, self.size, self.sha256)

    def bytes_to_write(self) -> int:
        """The disk it takes besides its download: the conversion's output."""
        return 0 if self.product.conversion is None else self.product.output_bytes(self.size)


@dataclass
class Plan:
    """The run's work in ``data_dir``: ``tasks`` in order, then the first-run corpus when ``build_paragraphs``."""

    data_dir: Path
    tasks: list[Task] = field(default_factory=list)
    kept: list[Path] = field(default_factory=list)  # files already there that stand for a product
    build_paragraphs: bool = False
    paragraphs_estimate: int = 0  # bytes: at most the HotpotQA files it is pooled from

    def bytes_to_fetch(self) -> int:
        return sum(task.bytes_to_fetch() for task in self.tasks)

    def files(self) -> list[Path]:
        """Every file the run may write: downloads, outputs, the first-run corpus."""
        outputs = [self.data_dir / PARAGRAPHS_OUTPUT] if self.build_paragraphs else []
        return [*(task.download for task in self.tasks), *(self.data_dir / t.product.output for t in self.tasks),
                *outputs]

    def bytes_needed(self) -> int:
        """Disk the run needs at its peak: every download (kept until its conversion is written) and output."""
        return self.bytes_to_fetch() + sum(task.bytes_to_write() for task in self.tasks) + self.paragraphs_estimate


def kept_instead(candidates: tuple[str, ...], output: str, data_dir: Path) -> Path | None:
    """The file of ``data_dir`` that stands for ``output``: itself, or a candidate envs/datasets.py reads before it."""
    preferred = candidates[:candidates.index(output) + 1] if output in candidates else (output,)
    return next((data_dir / rel for rel in preferred if (data_dir / rel).is_file()), None)


def present_problem(product: Product, path: Path, data_dir: Path, source: str | None) -> str:
    """What is wrong with ``path``, already in ``data_dir`` for ``product``, against the file this run would fetch:
    the publisher's size and sha256 where it gives them; with ``source``, the mirror's size where the mirror answers.
    "" if nothing, or nothing to check against (a file read in its place, a converted one)."""
    if path != data_dir / product.output or product.conversion is not None:
        return ""
    if source is None:
        return file_problem(path, product.remote.size, product.remote.sha256)
    try:
        size = remote_size(product.remote.url(source), "")
    except DownloadError:  # the mirror no longer has it: what is there stays unchecked, as it would be by hand
        return ""
    return file_problem(path, size, None)


def check_names(datasets: list[str], corpus: str) -> None:
    """Refuse a dataset or corpus this module does not know, listing the known ones."""
    unknown = [name for name in datasets if name not in DATASET_PRODUCTS]
    if unknown:
        raise ValueError(f"unknown dataset{'s' * (len(unknown) > 1)} {', '.join(unknown)}; known datasets: "
                         f"{', '.join(DATASET_PRODUCTS)}")
    if corpus not in CORPORA:
        raise ValueError(f"unknown corpus {corpus}; known corpora: {', '.join(CORPORA)}")


def make_plan(datasets: list[str], corpus: str, data_dir: Path, source: str | None) -> Plan:
    """What ``datasets`` and ``corpus`` need in ``data_dir``, read from their publishers or from ``source``; the
    sizes no manifest gives are asked of the server (a failure to reach it is the first error, before any fetch)."""
    check_names(datasets, corpus)
    names = list(dict.fromkeys(datasets))
    if corpus == PARAGRAPHS_CORPUS and PARAGRAPH_SOURCE not in names:
        names.append(PARAGRAPH_SOURCE)
    plan = Plan(data_dir)
    wanted = [(p, DATASETS[name][1][p.split]) for name in names for p in DATASET_PRODUCTS[name]]
    if corpus == WIKI18_CORPUS:
        wanted.append((WIKI18, CORPUS_CANDIDATES))
    for product, candidates in wanted:
        kept = kept_instead(candidates, product.output, data_dir)
        if kept is not None:
            problem = present_problem(product, kept, data_dir, source)
            if problem:
                raise DamagedFileError(f"{kept}: {problem} (already there, not fetched by this run): delete it and "
                                       f"run again to fetch it")
            plan.kept.append(kept)
            continue
        url, route = product.remote.url(source), manual_route(product, data_dir)
        # The manifest describes the publisher's files; a --source mirror may hold others (subsets, a test's stand-ins)
        # and is checked against its own Content-Length.
        size, sha256 = (product.remote.size, product.remote.sha256) if source is None else (None, None)
        download = data_dir / (product.output if product.conversion is None
                               else f"{DOWNLOADS_DIR}/{product.remote.mirror_path}")
        fallbacks = product.remote.fallback_urls() if source is None else ()
        plan.tasks.append(Task(product, url, size or remote_size(url, route), sha256, download, fallbacks))
    if corpus == PARAGRAPHS_CORPUS:
        kept = kept_instead(CORPUS_CANDIDATES, PARAGRAPHS_OUTPUT, data_dir)
        if kept is not None:
            plan.kept.append(kept)
        else:
            plan.build_paragraphs = True
            sources = [(p.output, next((t.size for t in plan.tasks if t.product is p), None))
                       for p in DATASET_PRODUCTS[PARAGRAPH_SOURCE]]
            plan.paragraphs_estimate = sum(size if size is not None else _size_on_disk(data_dir, output)
                                           for output, size in sources)
    return plan


def _size_on_disk(data_dir: Path, output: str) -> int:
    path = data_dir / output
    return path.stat().st_size if path.is_file() else 0


def free_bytes(data_dir: Path) -> int:
    """Free space on the disk that holds (or will hold) ``data_dir``."""
    existing = next(p for p in (data_dir.resolve(), *data_dir.resolve().parents) if p.exists())
    return shutil.disk_usage(existing).free


def check_disk(plan: Plan) -> None:
    """Refuse, with the sizes, a plan the disk cannot hold."""
    needed, free = plan.bytes_needed(), free_bytes(plan.data_dir)
    if needed > free:
        raise NotEnoughDiskError(
            f"refused: {human_bytes(needed)} needed in {plan.data_dir} ({human_bytes(plan.bytes_to_fetch())} to "
            f"download, the rest to unpack and build), {human_bytes(free)} free. Free some space, or choose "
            f"another --data-dir.")
