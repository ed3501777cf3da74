"""Fetching one file over HTTP(S) or file:// with the standard library: a progress bar on stderr, the bytes landing in
``NAME.part`` until they are checked, a resume with an HTTP Range request after an interruption (in this run or an
earlier one), and a size and sha256 check where they are known. A file that fails its check is fetched again."""

from __future__ import annotations

import hashlib
import http.client
import sys
import urllib.request
import urllib.response
from pathlib import Path
from urllib.error import HTTPError, URLError

from tqdm import tqdm

PART_SUFFIX = ".part"
ATTEMPTS = 3  # transfers per file (an interrupted one resumes, a corrupted one starts over) before giving up
TIMEOUT_S = 60.0  # per socket operation, not per file
CHUNK = 1 << 20
RANGE_NOT_SATISFIABLE = 416


class DownloadError(RuntimeError):
    """A file could not be fetched or did not pass its check; the message names the URL and the manual route."""


def report(message: str) -> None:
    """One line on stderr, beside the progress bars."""
    print(f"[prepare] {message}", file=sys.stderr, flush=True)


def part_path(target: Path) -> Path:
    """Where ``target``'s bytes gather until they are checked."""
    return target.with_name(target.name + PART_SUFFIX)


def open_url(url: str, offset: int = 0) -> http.client.HTTPResponse | urllib.response.addinfourl:
    """The response to a GET of ``url``, from byte ``offset`` on when it is not 0 (a server that ignores the Range
    header answers 200 with the whole file, file:// among them)."""
    headers = {"Range": f"bytes={offset}-"} if offset else {}
    return urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=TIMEOUT_S)


def _unreachable(url: str, err: Exception, manual_route: str) -> DownloadError:
    reason = f"HTTP {err.code} {err.reason}" if isinstance(err, HTTPError) else getattr(err, "reason", err)
    return DownloadError(f"cannot fetch {url} ({reason}). {manual_route}")


def remote_size(url: str, manual_route: str) -> int | None:
    """The file's size from its Content-Length, None when the server gives none; its body is never read."""
    try:
        with open_url(url) as response:
            length = response.headers.get("Content-Length")
    except (URLError, OSError) as err:  # URLError: no network, no such host or file, an HTTP error status
        raise _unreachable(url, err, manual_route) from None
    return int(length) if length else None


def file_problem(path: Path, size: int | None, sha256: str | None) -> str:
    """What is wrong with a fetched file against its expected size and sha256 (either may be unknown): "" if
    nothing."""
    actual = path.stat().st_size
    if size is not None and actual != size:
        return f"{'truncated' if actual < size else 'too long'}: {actual:,} of {size:,} bytes"
    if sha256 is not None:
        digest = hashlib.sha256()
        with path.open("rb") as f:
            while chunk := f.read(CHUNK):
                digest.update(chunk)
        if digest.hexdigest() != sha256:
            return f"corrupted: sha256 {digest.hexdigest()}, expected {sha256}"
    return ""


def _transfer(url: str, part: Path, size: int | None, label: str, manual_route: str) -> None:
    """Append the rest of ``url`` to ``part`` (all of it when the server will not resume); a connection lost midway
    keeps what arrived and returns, for the size check to find the file short."""
    offset = part.stat().st_size if part.exists() else 0
    try:
        response = open_url(url, offset)
    except HTTPError as err:
        if err.code == RANGE_NOT_SATISFIABLE:  # the part is no prefix of the file: start over
            part.unlink()
            return
        raise _unreachable(url, err, manual_route) from None
    except (URLError, OSError) as err:
        raise _unreachable(url, err, manual_route) from None
    with response:
        if offset and getattr(response, "status", None) != 206:
            offset = 0  # the whole file came back
        with part.open("ab" if offset else "wb") as out, tqdm(
                total=size, initial=offset, unit="B", unit_scale=True, unit_divisor=1024, desc=label,
                file=sys.stderr) as bar:
            try:
                # read1: what has arrived, up to CHUNK, so that the bar moves and an interruption loses little
                while chunk := response.read1(CHUNK):
                    out.write(chunk)
                    bar.update(len(chunk))
            except OSError as err:  # reset, timed out: resumed by the next attempt
                report(f"{url}: connection lost at byte {bar.n:,} ({err})")


def fetch(url: str, target: Path, size: int | None, sha256: str | None, manual_route: str,
          attempts: int = ATTEMPTS) -> None:
    """Fetch ``url`` to ``target`` through ``target.part``, resuming what a part file already holds when the size
    is known, and check it; ``manual_route`` ends every error message (what to do without the network)."""
    if size is not None and target.is_file() and not file_problem(target, size, sha256):
        return  # fetched by an earlier run whose conversion of it did not finish
    part = part_path(target)
    part.parent.mkdir(parents=True, exist_ok=True)
    if size is None:
        part.unlink(missing_ok=True)  # with no size to check against, a part file cannot be known to be a prefix
    problem = ""
    for _ in range(attempts):
        if part.exists() and size is not None and part.stat().st_size > size:
            part.unlink()
        if not (part.exists() and part.stat().st_size == size):
            _transfer(url, part, size, target.name, manual_route)
        problem = file_problem(part, size, sha256) if part.exists() else "nothing fetched"
        if not problem:
            part.replace(target)
            return
        report(f"{url}: {problem}; fetching it again")
        if not problem.startswith("truncated"):
            part.unlink(missing_ok=True)
    raise DownloadError(f"{url}: {problem} after {attempts} attempts. {manual_route}")
