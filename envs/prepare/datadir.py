"""The data directory as something written to: the one way a failed write is said (``WriteError``: the path and the
way out, never retried, never blamed on the network or the download), the check that the directory can be written
before anything starts, and the removal of the folders a failed run created and left empty."""

from __future__ import annotations

import errno
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


class WriteError(RuntimeError):
    """A file or folder of the data directory could not be written (a full disk, a quota, a read-only or foreign
    directory); the message names it and the way out. Not an OSError, so that no handler of read errors takes it."""


def write_error(path: Path, err: OSError) -> WriteError:
    """``err``, met writing ``path``, as the one-line error the user reads."""
    reason = err.strerror or str(err)
    way_out = ("free some space there, or choose another --data-dir" if err.errno in DISK_FULL
               else "choose another --data-dir, or make it writable")
    return WriteError(f"cannot write {path} ({reason}): {way_out}")


@contextmanager
def writing(path: Path) -> Iterator[None]:
    """A block that writes ``path`` and reads nothing that may fail: any OSError in it is a failed write."""
    try:
        yield
    except OSError as err:
        raise write_error(path, err) from None


def check_writable(data_dir: Path) -> None:
    """Create ``data_dir`` if needed and make a file in it, the one test that holds everywhere (modes do not stop
    root; a read-only mount, a quota or a file in the way show only when written)."""
    with writing(data_dir):
        data_dir.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=data_dir).close()


def _missing_folders(file: Path) -> Iterator[Path]:
    folder = file.parent
    while not folder.exists() and folder != folder.parent:
        yield folder
        folder = folder.parent


@contextmanager
def removed_if_failed(files: Iterable[Path]) -> Iterator[None]:
    """Run the block; when it fails (an error, Ctrl-C), remove the folders it created on the way to ``files`` and
    left empty. A part file keeps its folder, for the next run to resume; an empty folder is never left where a
    later command (the Makefile's choice of data directory) would take it for data."""
    created = sorted({folder for file in files for folder in _missing_folders(file)}, key=lambda p: len(p.parts),
                     reverse=True)
    try:
        yield
    except BaseException:
        for folder in created:
            with suppress(OSError):  # not empty, or not made after all: kept
                folder.rmdir()
        raise
