"""``python -m envs.prepare DATASET... [--corpus NAME] [--data-dir DIR] [--source DIR-or-URL]``: fetch the public QA
files and a corpus into a data directory laid out as envs/datasets.py reads it (``make data``)."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

from envs.datasets import DATA_DIR_ENV, DataError, dataset_path
from envs.prepare.convert import build_paragraph_corpus
from envs.prepare.datadir import WriteError, check_writable, removed_if_failed, writing
from envs.prepare.download import DownloadError, fetch, report
from envs.prepare.plan import (
    DOWNLOADS_DIR,
    PARAGRAPH_SOURCE,
    DamagedFileError,
    NotEnoughDiskError,
    Plan,
    check_disk,
    human_bytes,
    make_plan,
    manual_route,
)
from envs.prepare.sources import CORPORA, DATASET_PRODUCTS, PARAGRAPHS_CORPUS, PARAGRAPHS_OUTPUT


def target_dir(data_dir: str | None) -> Path:
    """``--data-dir``, else ``$TREEGRPO_DATA_DIR``, else ``./data`` (as envs/datasets.py resolves it, but it may not
    exist yet)."""
    return Path(data_dir or os.environ.get(DATA_DIR_ENV) or "data")


def describe(plan: Plan) -> list[str]:
    """The plan in lines, said before anything starts: each file, where it comes from and how large it is."""
    lines = [f"data directory: {plan.data_dir.resolve()}"]
    lines += [f"  have      {path.relative_to(plan.data_dir)}" for path in plan.kept]
    for task in plan.tasks:
        size = human_bytes(task.size) if task.size is not None else "size unknown"
        lines.append(f"  download  {task.product.output:<42} {size:>12}  {task.url}")
    if plan.build_paragraphs:
        lines.append(f"  build     {PARAGRAPHS_OUTPUT:<42} {'<= ' + human_bytes(plan.paragraphs_estimate):>12}  "
                     f"the {PARAGRAPH_SOURCE} files' paragraphs, pooled")
    if plan.tasks or plan.build_paragraphs:
        lines.append(f"to download: {human_bytes(plan.bytes_to_fetch())}; disk needed: "
                     f"{human_bytes(plan.bytes_needed())}")
    else:
        lines.append("nothing to do: every file is there")
    return lines


def execute(plan: Plan) -> None:
    """Fetch, convert and build what the plan says, in order."""
    for task in plan.tasks:
        product = task.product
        fetch(task.url, task.download, task.size, task.sha256, manual_route(product, plan.data_dir),
              fallbacks=task.fallbacks)
        if product.conversion is not None:
            report(f"writing {product.output} from {task.download.name}")
            try:
                product.conversion(task.download, plan.data_dir / product.output)
            except DataError as err:  # kept: it passed its checks, and may be the publisher's (5 GB for wiki-18)
                raise DataError(f"{err}. To fetch it again, delete {task.download} and run again") from None
            with writing(task.download):
                task.download.unlink()
    if plan.build_paragraphs:
        sources = [dataset_path(PARAGRAPH_SOURCE, split, plan.data_dir) for split in ("train", "dev")]
        try:
            count = build_paragraph_corpus(sources, plan.data_dir / PARAGRAPHS_OUTPUT)
        except DataError as err:
            raise DataError(f"{err}. To fetch it again, delete it and run again") from None
        report(f"{PARAGRAPHS_OUTPUT}: {count:,} passages from {', '.join(s.name for s in sources)}")
    shutil.rmtree(plan.data_dir / DOWNLOADS_DIR, ignore_errors=True)  # holds only converted, removed files now


def parser() -> argparse.ArgumentParser:
    datasets = "\n".join(f"  {name:<16} {', '.join(p.output for p in products)}"
                         for name, products in DATASET_PRODUCTS.items())
    corpora = "\n".join(f"  {name:<20} {text}" for name, text in CORPORA.items())
    result = argparse.ArgumentParser(
        prog="python -m envs.prepare", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Download QA datasets and a retrieval corpus into a data directory laid out as the envs read "
                    "it (docs/environments.md). Files already there are kept; an interrupted download resumes.",
        epilog=f"datasets (the files each writes):\n{datasets}\n\ncorpora (--corpus):\n{corpora}\n\nNo published "
               "retrieval index is fetched: the envs build theirs from the corpus (docs/retrieval.md).")
    result.add_argument("datasets", nargs="+", metavar="DATASET", help="one or more of the datasets below")
    result.add_argument("--corpus", default=PARAGRAPHS_CORPUS, metavar="NAME",
                        help=f"the retrieval corpus: {', '.join(CORPORA)} (default: {PARAGRAPHS_CORPUS})")
    result.add_argument("--data-dir", default=None,
                        help=f"where to write (default: ${DATA_DIR_ENV}, else ./data)")
    result.add_argument("--source", default=None, metavar="DIR-or-URL",
                        help="read every file from DIR/MIRROR/PATH instead of its publisher (a directory or a base "
                             "URL laid out as envs/prepare/sources.py says; for a machine without the network)")
    return result


def main(argv: list[str] | None = None) -> int:
    """Run the command; 0 when the data directory is ready, 1 after an error (said on stderr)."""
    command = parser()
    args = command.parse_args(argv)
    try:
        plan = make_plan(args.datasets, args.corpus, target_dir(args.data_dir), args.source)
    except ValueError as err:
        command.error(str(err))
    except (DownloadError, DamagedFileError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print("\n".join(describe(plan)), flush=True)
    try:
        # a failed run leaves no empty folder behind (./data would hide ../shared/data from the Makefile); with
        # nothing to do, nothing is written (a finished data directory may be read-only)
        with removed_if_failed(plan.files()):
            if plan.tasks or plan.build_paragraphs:
                check_writable(plan.data_dir)
                check_disk(plan)
                execute(plan)
    except (DownloadError, NotEnoughDiskError, DataError, WriteError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted: the same command again resumes where this one stopped", file=sys.stderr)
        return 130
    print(f"ready: {plan.data_dir.resolve()}", flush=True)
    return 0
