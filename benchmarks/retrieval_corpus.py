"""The generated large corpus of ``bench_retrieval.py``: copy 0 is the real corpus; copy c >= 1 perturbs every
passage with a seeded RNG (a `` ~dupNN`` title suffix, ~10% of words dropped and ~10% of neighbours swapped, unique
ids), so each gold passage has near-duplicates competing for the top ranks. ``gold_title`` strips the suffix, so the
original gold titles count in recall."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from envs.datasets import parse_passage

DUP_SUFFIX = re.compile(r" ~dup\d+$")
GENERATOR_VERSION = 1


def gold_title(title: str) -> str:
    """A passage title with the generated corpus's copy suffix removed."""
    return DUP_SUFFIX.sub("", title)


def perturb(words: list[str], rng: np.random.Generator, drop: float = 0.1, swap: float = 0.1) -> list[str]:
    """Drop a fraction of the words and swap a fraction of neighbouring pairs (keeps at least one word)."""
    if len(words) < 2:
        return words
    kept = [w for w, keep in zip(words, rng.random(len(words)) >= drop, strict=True) if keep] or words[:1]
    for i in np.flatnonzero(rng.random(len(kept) - 1) < swap):
        kept[i], kept[i + 1] = kept[i + 1], kept[i]
    return kept


def generated_lines(source: Path, n_passages: int, seed: int) -> Iterator[str]:
    """``n_passages`` jsonl lines: the source corpus (copy 0), then perturbed copies 1, 2, ... of it."""
    originals = source.read_bytes().splitlines()
    originals = [line for line in originals if line.strip()]
    copy = written = 0
    while written < n_passages:
        rng = np.random.default_rng([seed, copy])
        for i, line in enumerate(originals):
            if written == n_passages:
                return
            if copy == 0:
                yield line.decode("utf-8")
            else:
                passage = parse_passage(line, f"{source}: passage {i}")
                text = " ".join(perturb(passage.text.split(), rng))
                contents = f'"{passage.title} ~dup{copy:02d}"\n{text}'
                yield json.dumps({"id": f"{passage.id}~{copy}", "contents": contents}, ensure_ascii=False)
            written += 1
        copy += 1


def large_corpus(source: Path, n_passages: int, seed: int, workdir: Path, log: Callable[[str], None]) -> Path:
    """The generated corpus file under ``workdir``, reused when a previous run made it with the same inputs;
    ``log`` is told whether it was reused or generated, and how long that took."""
    path = workdir / f"{source.stem}-{n_passages}-seed{seed}.jsonl"
    stat = source.stat()
    meta = {
        "source": str(source.resolve()),
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
        "passages": n_passages,
        "seed": seed,
        "version": GENERATOR_VERSION,
    }
    meta_path = path.with_suffix(".meta.json")
    if path.is_file() and meta_path.is_file() and json.loads(meta_path.read_text()) == meta:
        log(f"reusing {path}")
        return path
    log(f"generating {n_passages:,} passages into {path}")
    start = time.perf_counter()
    tmp = path.with_suffix(".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for line in generated_lines(source, n_passages, seed):
            f.write(line + "\n")
    tmp.replace(path)
    meta_path.write_text(json.dumps(meta))
    log(f"generated {path.stat().st_size / 2**20:,.0f} MiB in {time.perf_counter() - start:.0f}s")
    return path
