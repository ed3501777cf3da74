"""Fetching one file over HTTP(S) or file:// with the standard library: a progress bar on stderr, the bytes landing in
``NAME.part`` until they are checked, a resume with an HTTP Range request after an interruption (in this run or an
earlier one), and a size and sha256 check where they are known. A file that fails its check is fetched again; one
that cannot be fetched from its publisher is fetched from another public copy where there is one.

A resume splices two transfers, so it must be of one version of the file: where no sha256 would catch a splice, the
version the part's first bytes came with (its ETag, else its Last-Modified) is recorded beside it
(``NAME.part.version``) and sent as ``If-Range``, so that a server whose file has changed sends the new one whole; a
part with no such record is fetched again from its start.

Reading and writing fail apart: a lost connection is resumed and retried, a failed write (a full disk) is a
``WriteError`` at once (envs/prepare/datadir.py)."""

from __future__ import annotations

import hashlib
import http.client
import json
import sys
import urllib.request
import urllib.response
from collections.abc import Iterator, Sequence
from pathlib import Path
from urllib.error import HTTPError, URLError

from tqdm import tqdm

from envs.prepare.datadir import writing

PART_SUFFIX = ".part"
VERSION_SUFFIX = ".version"  # beside NAME.part: {"url", "validator"} of the transfer that began it
ATTEMPTS = 3  # transfers per file (an interrupted one resumes, a corrupted one starts over) before giving up
TIMEOUT_S = 60.0  # per socket operation, not per file
CHUNK = 1 << 20
PARTIAL_CONTENT, RANGE_NOT_SATISFIABLE = 206, 416

Response = http.client.HTTPResponse | urllib.response.addinfourl


class DownloadError(RuntimeError):
    """A file could not be fetched or did not pass its check; the message names the URL and the manual route."""


def report(message: str) -> None:
    """One line on stderr, beside the progress bars."""
    print(f"[prepare] {message}", file=sys.stderr, flush=True)


def part_path(target: Path) -> Path:
    """Where ``target``'s bytes gather until they are checked."""
    return target.with_name(target.name + PART_SUFFIX)


def version_path(part: Path) -> Path:
    """Where the version of ``part``'s first bytes is recorded."""
    return part.with_name(part.name + VERSION_SUFFIX)


def validator(response: Response) -> str | None:
    """What names the version of the file a response holds, as If-Range takes it: its strong ETag, else its
    Last-Modified (a weak ETag may not be sent there)."""
    etag = response.headers.get("ETag")
    return etag if etag and not etag.startswith("W/") else response.headers.get("Last-Modified")


def recorded_version(part: Path, url: str) -> str | None:
    """The validator ``part``'s first bytes came with from ``url``; None when none was recorded, or they came from
    another URL."""
    try:
        record = json.loads(version_path(part).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return record.get("validator") if isinstance(record, dict) and record.get("url") == url else None


def _record_version(part: Path, url: str, response: Response) -> None:
    version = validator(response)
    with writing(version_path(part)):
        if version is None:
            version_path(part).unlink(missing_ok=True)
        else:
            version_path(part).write_text(json.dumps({"url": url, "validator": version}), encoding="utf-8")


def discard(part: Path) -> None:
    """Remove a part file and its version record."""
    with writing(part):
        part.unlink(missing_ok=True)
        version_path(part).unlink(missing_ok=True)


def resume_offset(part: Path, url: str, size: int | None, sha256: str | None) -> int:
    """The bytes of ``part`` a transfer of ``url`` continues from: all of them when the file's size is known, they
    are no more than it, and a splice would be caught (by the sha256, or by asking for the rest of the recorded
    version); else 0, a transfer from the start."""
    if size is None or not part.exists() or (sha256 is None and recorded_version(part, url) is None):
        return 0
    held = part.stat().st_size
    return held if held <= size else 0


def open_url(url: str, offset: int = 0, version: str | None = None) -> Response:
    """The response to a GET of ``url``, from byte ``offset`` on when it is not 0, and then only if the file is still
    of ``version`` (If-Range; a server whose file has changed, or that ignores Range, file:// among them, answers 200
    with the whole file)."""
    headers = {"Range": f"bytes={offset}-"} if offset else {}
    if offset and version is not None:
        headers["If-Range"] = version
    return urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=TIMEOUT_S)


def _unreachable(url: str, err: Exception) -> DownloadError:
    reason = f"HTTP {err.code} {err.reason}" if isinstance(err, HTTPError) else getattr(err, "reason", err)
    return DownloadError(f"cannot fetch {url} ({reason})")


def remote_size(url: str, manual_route: str) -> int | None:
    """The file's size from its Content-Length, None when the server gives none; its body is never read."""
    try:
        with open_url(url) as response:
            length = response.headers.get("Content-Length")
    except (URLError, OSError) as err:  # URLError: no network, no such host or file, an HTTP error status
        raise DownloadError(f"{_unreachable(url, err)}. {manual_route}") from None
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


def _open(url: str, part: Path, offset: int, version: str | None) -> Response | None:
    """``open_url``, its failures said as the URL's; None when the server cannot continue ``part`` (416: it is no
    prefix of the file), which is then removed for the next attempt to start over."""
    try:
        return open_url(url, offset, version)
    except HTTPError as err:
        if err.code == RANGE_NOT_SATISFIABLE:
            discard(part)
            return None
        raise _unreachable(url, err) from None
    except (URLError, OSError) as err:
        raise _unreachable(url, err) from None


def _received(response: Response, url: str, bar: tqdm) -> Iterator[bytes]:
    """The body as it arrives, up to CHUNK at a time (read1: the bar moves and an interruption loses little); a
    connection lost midway (reset, timed out) ends it early, for the size check to find the file short and the next
    attempt to resume. Only reading happens here: a failed write is its caller's."""
    try:
        while chunk := response.read1(CHUNK):
            yield chunk
    except OSError as err:
        report(f"{url}: connection lost at byte {bar.n:,} ({err})")


def _transfer(url: str, part: Path, size: int | None, sha256: str | None, label: str) -> None:
    """Append the rest of ``url`` to ``part`` (all of it when the part cannot be continued, or the server will not
    continue it); a connection lost midway keeps what arrived and returns."""
    offset = resume_offset(part, url, size, sha256)
    version = recorded_version(part, url) if offset else None
    response = _open(url, part, offset, version)
    if response is not None and offset and getattr(response, "status", None) == PARTIAL_CONTENT and \
            version is not None and validator(response) not in (None, version):
        response.close()  # a server that ignores If-Range, and a file changed since the part began
        report(f"{url}: changed since {part.name} began; fetching it whole")
        offset, response = 0, _open(url, part, 0, None)
    if response is None:
        return
    with response:
        if offset and getattr(response, "status", None) != PARTIAL_CONTENT:
            offset = 0  # the whole file came back
        if not offset:
            _record_version(part, url, response)
        with tqdm(total=size, initial=offset, unit="B", unit_scale=True, unit_divisor=1024, desc=label,
                  file=sys.stderr) as bar, writing(part), part.open("ab" if offset else "wb") as out:
            for chunk in _received(response, url, bar):
                out.write(chunk)
                bar.update(len(chunk))


def _fetch_from(url: str, target: Path, size: int | None, sha256: str | None, attempts: int) -> None:
    part = part_path(target)
    with writing(part.parent):
        part.parent.mkdir(parents=True, exist_ok=True)
    problem = ""
    for _ in range(attempts):
        if not (part.exists() and resume_offset(part, url, size, sha256) == size):
            _transfer(url, part, size, sha256, target.name)
        problem = file_problem(part, size, sha256) if part.exists() else "nothing fetched"
        if not problem:
            with writing(target):
                part.replace(target)
            discard(part)
            return
        report(f"{url}: {problem}; fetching it again")
        if not problem.startswith("truncated"):
            discard(part)
    raise DownloadError(f"{url}: {problem} after {attempts} attempts")


def fetch(url: str, target: Path, size: int | None, sha256: str | None, manual_route: str,
          attempts: int = ATTEMPTS, fallbacks: Sequence[str] = ()) -> None:
    """Fetch ``url`` to ``target`` through ``target.part`` and check it, resuming what a part file already holds
    where a splice would be caught; when ``url`` cannot be fetched or fails its check, each of ``fallbacks`` (other
    copies of the same file) in turn. ``manual_route`` ends the error (what to do without the network), which
    names every URL tried; a failed write is a WriteError at once."""
    if size is not None and target.is_file() and not file_problem(target, size, sha256):
        return  # fetched by an earlier run whose conversion of it did not finish
    failures = []
    for i, where in enumerate((url, *fallbacks)):
        try:
            _fetch_from(where, target, size, sha256, attempts)
            return
        except DownloadError as err:
            failures.append(str(err))
            if i < len(fallbacks):
                report(f"{err}; trying another copy: {fallbacks[i]}")
    raise DownloadError(f"{'; '.join(failures)}. {manual_route}")
