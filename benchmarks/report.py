"""Writing benchmark results: the machine's description and one replaceable section of docs/benchmarks.md."""

from __future__ import annotations

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


def replace_section(path: str | os.PathLike, key: str, title: str, body: str) -> None:
    """Write ``body`` under ``## title`` between ``<!-- key:begin -->`` / ``<!-- key:end -->`` markers,
    replacing an earlier version of the section and keeping the rest of the file."""
    path = Path(path)
    text = path.read_text(encoding="utf-8") if path.is_file() else "# Benchmarks\n"
    begin, end = f"<!-- {key}:begin -->", f"<!-- {key}:end -->"
    block = f"{begin}\n## {title}\n\n{body.rstrip()}\n{end}"
    if begin in text and end in text:
        text = text[: text.index(begin)] + block + text[text.index(end) + len(end) :]
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
