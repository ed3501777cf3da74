"""The retrieval corpus as a file of jsonl passages read on demand, and the on-disk index cache.

A corpus of the paper's size (21M passages, ~13 GB of text) does not fit in Python strings, so the corpus keeps
only the byte offset of every line (8 bytes a passage) and reads a passage when a search returns it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from envs.cache import default_cache_dir
from envs.datasets import CORPUS_LAYOUT, DataError, MissingDataError, Passage, parse_passage
from envs.retrieval.progress import timed

SOURCE_SUFFIX = ".source.json"  # beside each cache entry: the signature of the file it was built from


def file_signature(path: Path) -> dict:
    """What identifies a corpus file's content for caching: absolute path, size and mtime."""
    stat = path.stat()
    return {"path": str(path.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def cache_entry(cache_dir: Path, kind: str, path: Path, options: dict) -> Path:
    """The cache folder for an artifact of ``kind`` built from ``path`` with ``options``. Its source is recorded
    beside it (``ENTRY.source.json``); the first time a key is seen (a changed corpus file, a new one), the
    entries whose source file has since changed or gone are removed (``prune_stale_entries``): the key holds the
    file's mtime, so such entries could never be read again and would only fill the disk."""
    signature = file_signature(path)
    key = json.dumps({"kind": kind, "file": signature, "options": options}, sort_keys=True)
    digest = hashlib.sha1(key.encode()).hexdigest()[:16]
    entry = Path(cache_dir) / f"{kind}-{path.stem}-{digest}"
    record = source_record(entry)
    if not record.is_file():
        prune_stale_entries(Path(cache_dir))
        # kind and options too, for `python -m experiments.cache list` to say what the entry is
        content = json.dumps({"file": signature, "kind": kind, "options": options}, sort_keys=True)
        replace_atomically(record, lambda tmp: tmp.write_text(content, encoding="utf-8"))
    return entry


def source_record(entry: Path) -> Path:
    """The file beside a cache entry that names what it was built from."""
    return entry.with_name(entry.name + SOURCE_SUFFIX)


def recorded_entries(cache_dir: Path) -> list[Path]:
    """Every cache entry that has a source record in ``cache_dir`` (built or still to be built)."""
    records = sorted(cache_dir.glob(f"*{SOURCE_SUFFIX}")) if cache_dir.is_dir() else []
    return [record.with_name(record.name[: -len(SOURCE_SUFFIX)]) for record in records]


def recorded_source(entry: Path) -> dict | None:
    """What ``entry``'s record says it was built from: ``file`` (the signature), and in records written since they
    hold them, ``kind`` and ``options``; None for a record being written by another process, or not ours."""
    try:
        record = json.loads(source_record(entry).read_text(encoding="utf-8"))
        readable = isinstance(record["file"]["path"], str)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return record if readable else None


def source_state(record: dict) -> str:
    """``current`` when the file a record names still has the size and mtime the entry was built from, else
    ``changed`` or ``gone``: the key holds the mtime, so the entry of a changed or gone file is never read again."""
    built_from = record["file"]
    try:
        current = file_signature(Path(built_from["path"]))
    except FileNotFoundError:
        return "gone"
    return "current" if current == built_from else "changed"


def stale_entries(cache_dir: Path) -> list[Path]:
    """The recorded entries whose source file is gone or changed; unreadable records are left out."""
    return [entry for entry in recorded_entries(cache_dir)
            if (record := recorded_source(entry)) is not None and source_state(record) != "current"]


def prune_stale_entries(cache_dir: Path) -> list[Path]:
    """Remove every stale entry (``stale_entries``) and its record; the entries removed."""
    removed = stale_entries(cache_dir)
    for entry in removed:
        shutil.rmtree(entry, ignore_errors=True)
        source_record(entry).unlink(missing_ok=True)
    return removed


@contextmanager
def building(entry: Path) -> Iterator[Path]:
    """A fresh temporary folder beside ``entry`` to write an artifact into; renamed to ``entry`` when the block
    ends without an error (a crashed build never leaves a half-written cache), removed otherwise."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=entry.parent, prefix=entry.name + ".tmp"))
    try:
        yield tmp
        shutil.rmtree(entry, ignore_errors=True)  # an entry of an older layout
        try:
            os.replace(tmp, entry)
        except OSError:
            if not entry.is_dir():  # else a concurrent builder (a Ray worker on a cold cache) renamed its own first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def save_arrays(entry: Path, arrays: dict[str, np.ndarray]) -> None:
    """Write arrays to ``entry`` atomically, one ``NAME.npy`` file each (so that they can be memory-mapped)."""
    with building(entry) as tmp:
        for name, array in arrays.items():
            np.save(tmp / f"{name}.npy", array)


def replace_atomically(file: Path, write) -> None:
    """``write(tmp_path)`` to a unique temporary name beside ``file``, then rename it into place (concurrent
    builders, e.g. Ray workers on a cold cache, never write to one file)."""
    file.parent.mkdir(parents=True, exist_ok=True)
    handle, tmp = tempfile.mkstemp(dir=file.parent, prefix=file.name + ".tmp")
    os.close(handle)
    try:
        write(Path(tmp))
        os.replace(tmp, file)
    finally:
        Path(tmp).unlink(missing_ok=True)


def load_arrays(entry: Path, names: Sequence[str]) -> dict[str, np.ndarray] | None:
    """The arrays ``names`` saved in ``entry``, memory-mapped read-only (the pages are shared by every process
    on the machine and read on demand), or None when the cache holds no complete set."""
    files = {name: entry / f"{name}.npy" for name in names}
    if not all(file.is_file() for file in files.values()):
        return None
    return {name: np.load(file, mmap_mode="r", allow_pickle=False) for name, file in files.items()}


class Corpus:
    """Passages of a jsonl corpus file, indexed by position; reads lines on demand with ``os.pread``."""

    def __init__(self, path: str | os.PathLike, offsets: np.ndarray):
        self.path = Path(path)
        self.offsets = offsets  # start byte of every passage line, plus the file size at the end
        self._fd: int | None = None
        self._fd_pid = -1
        self._lock = threading.Lock()

    @classmethod
    def open(cls, path: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> Corpus:
        """Open a corpus file, scanning its line offsets once and caching them."""
        path = Path(path)
        if not path.is_file():
            raise MissingDataError(f"{path}: corpus not found; expected {CORPUS_LAYOUT}")
        entry = cache_entry(Path(cache_dir or default_cache_dir()), "offsets", path, {})
        cached = load_arrays(entry, ["offsets"])
        if cached is None:
            with timed(f"scanning {path} for its passages (once; cached in {entry.parent})"):
                cached = {"offsets": _scan_offsets(path)}
                save_arrays(entry, cached)
        return cls(path, cached["offsets"])

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def _read(self, i: int) -> bytes:
        with self._lock:
            if self._fd is None or self._fd_pid != os.getpid():  # reopen after a fork
                self._fd, self._fd_pid = os.open(self.path, os.O_RDONLY), os.getpid()
            fd = self._fd
        start, end = int(self.offsets[i]), int(self.offsets[i + 1])
        return os.pread(fd, end - start, start)

    def __getitem__(self, i: int) -> Passage:
        if not 0 <= i < len(self):
            raise IndexError(f"passage {i} out of range for a corpus of {len(self)}")
        return parse_passage(self._read(i), f"{self.path}: passage {i}")

    def __iter__(self) -> Iterator[Passage]:
        """All passages in order, streamed (one sequential read, for index builds)."""
        with self.path.open("rb") as f:
            for i, line in enumerate(_nonblank_lines(f)):
                yield parse_passage(line, f"{self.path}: passage {i}")

    def __getstate__(self) -> dict:
        return {"path": self.path, "offsets": self.offsets}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["path"], state["offsets"])

    def __del__(self) -> None:
        if self._fd is not None and self._fd_pid == os.getpid():
            os.close(self._fd)


def _nonblank_lines(f) -> Iterator[bytes]:
    for line in f:
        if line.strip():
            yield line


def _scan_offsets(path: Path) -> np.ndarray:
    offsets, position = [], 0
    with path.open("rb") as f:
        for line in f:
            if line.strip():
                offsets.append(position)
            position += len(line)
    if not offsets:
        raise DataError(f"{path}: the corpus holds no passages; expected {CORPUS_LAYOUT}")
    offsets.append(position)
    return np.asarray(offsets, dtype=np.int64)
