"""What the benchmarks share: the machine's description, one replaceable section of docs/benchmarks.md, a compact
copy of a plot for the docs, and the accelerator options of the scripts that run on a bare GPU machine."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.metadata
import os
import platform
import re
from pathlib import Path


def machine_description(packages: tuple[str, ...] = ("torch", "transformers", "numpy", "scipy")) -> str:
    """CPU model, cores, memory, Python and package versions, and today's date."""
    cpu = "unknown CPU"
    info = Path("/proc/cpuinfo")
    if info.is_file():
        match = re.search(r"model name\s*:\s*(.+)", info.read_text())
        cpu = match.group(1).strip() if match else cpu
    memory = ""
    meminfo = Path("/proc/meminfo")
    if meminfo.is_file():
        kb = int(re.search(r"MemTotal:\s*(\d+)", meminfo.read_text()).group(1))
        memory = f", {kb / 2**20:.0f} GiB RAM"
    versions = [f"Python {platform.python_version()}"]
    for package in packages:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions.append(f"{package} {importlib.metadata.version(package)}")
    return f"{cpu}, {os.cpu_count()} cores{memory}; {', '.join(versions)}; {datetime.date.today().isoformat()}"


def replace_section(path: str | os.PathLike, key: str, title: str, body: str, level: int = 2) -> None:
    """Write ``body`` under a ``level`` heading ``title`` (``## title``) between ``<!-- key:begin -->`` /
    ``<!-- key:end -->`` markers, replacing an earlier version of the section and keeping the rest of the file."""
    path = Path(path)
    text = path.read_text(encoding="utf-8") if path.is_file() else "# Benchmarks\n"
    begin, end = f"<!-- {key}:begin -->", f"<!-- {key}:end -->"
    block = f"{begin}\n{'#' * level} {title}\n\n{body.rstrip()}\n{end}"
    if begin in text and end in text:
        text = text[: text.index(begin)] + block + text[text.index(end) + len(end) :]
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")


def compact_plot_copy(source: str | os.PathLike, destination: str | os.PathLike, colors: int = 128) -> Path:
    """Copy a PNG plot to ``destination`` with a palette of ``colors`` (a committed docs figure at about a third
    of matplotlib's size; line plots use few colours)."""
    from PIL import Image

    destination = Path(destination)
    destination.parent.mkdir(parents=True, exist_ok=True)
    with Image.open(source) as image:
        image.convert("RGB").quantize(colors=colors).save(destination, optimize=True)
    return destination


def add_accelerator_options(parser: argparse.ArgumentParser) -> None:
    """``--device`` (default: cuda when a GPU is visible) and ``--dtype`` (see ``resolve_dtype``)."""
    import torch

    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                        help="default: bfloat16 on cuda, float32 on cpu")


def resolve_dtype(args: argparse.Namespace) -> argparse.Namespace:
    """Fill ``args.dtype`` when not given: bfloat16 on cuda (what GPU training uses), float32 elsewhere."""
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    return args
