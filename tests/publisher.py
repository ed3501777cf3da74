"""A publisher of files over HTTP on loopback for envs.prepare's tests: Range requests honoured, an ETag per version
of a file and ``If-Range`` honoured as RFC 9110 says (a Range whose validator no longer matches gets the whole new
file), and faults injected per request."""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Publisher(ThreadingHTTPServer):
    """Files on loopback. ``faults[path]`` is consumed one entry per request: "ok", "cut" (half the body, then the
    connection closes), "corrupt" (a flipped first byte), "stall" (half the body, then nothing until ``release``).
    ``ignore_range``: every answer is the whole file (200); ``ignore_if_range``: a Range is served whatever its
    ``If-Range`` (as a server that does not know the header)."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.files: dict[str, bytes] = {}
        self.faults: dict[str, list[str]] = {}
        self.requests: list[tuple[str, str | None]] = []  # (path, Range header)
        self.if_ranges: list[str | None] = []  # the If-Range header of each request, in the same order
        self.ignore_range = False
        self.ignore_if_range = False
        self.release = threading.Event()

    def url(self, path: str = "") -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/{path}"

    def etag(self, path: str) -> str:
        """The strong validator of a file's current version."""
        return f'"{hashlib.sha256(self.files[path]).hexdigest()[:16]}"'

    def handle_error(self, request, client_address) -> None:
        """A client that hangs up early (the size probe reads only the headers) is no error here."""


class Handler(BaseHTTPRequestHandler):
    server: Publisher

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        path, wanted, if_range = self.path.lstrip("/"), self.headers.get("Range"), self.headers.get("If-Range")
        self.server.requests.append((path, wanted))
        self.server.if_ranges.append(if_range)
        data = self.server.files.get(path)
        if data is None:
            self.send_error(404)
            return
        etag = self.server.etag(path)
        honoured = (wanted is not None and not self.server.ignore_range
                    and (if_range in (None, etag) or self.server.ignore_if_range))
        start = int(wanted.removeprefix("bytes=").rstrip("-")) if honoured else 0
        if start >= len(data) > 0:
            self.send_error(416)
            return
        pending = self.server.faults.get(path)
        fault = pending.pop(0) if pending else "ok"
        body = data[start:]
        if fault == "corrupt":
            body = bytes([body[0] ^ 0xFF]) + body[1:]
        self.send_response(206 if start else 200)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("ETag", etag)
        if start:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.end_headers()
        if fault in ("cut", "stall"):
            self.wfile.write(body[:len(body) // 2])
            if fault == "stall":
                self.server.release.wait(60)
            self.close_connection = True
            return
        self.wfile.write(body)


@contextmanager
def serving() -> Iterator[Publisher]:
    """A publisher serving until the block ends (each test module's ``publisher`` fixture)."""
    server = Publisher()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.release.set()
        server.shutdown()
        server.server_close()
