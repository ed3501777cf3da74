"""envs.prepare's downloader against a publisher served over HTTP on loopback (Range requests honoured, faults
injected): a transfer cut midway resumes, a corrupted file is fetched again, a run interrupted mid-file and run
again resumes where it stopped."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from envs.prepare.cli import main
from envs.prepare.download import DownloadError, fetch, part_path

ROOT = Path(__file__).resolve().parents[1]
ROUTE = "the manual route"


class Publisher(ThreadingHTTPServer):
    """Files on loopback. ``faults[path]`` is consumed one entry per request: "ok", "cut" (half the body, then the
    connection closes), "corrupt" (a flipped first byte), "stall" (half the body, then nothing until ``release``)."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.files: dict[str, bytes] = {}
        self.faults: dict[str, list[str]] = {}
        self.requests: list[tuple[str, str | None]] = []  # (path, Range header)
        self.ignore_range = False
        self.release = threading.Event()

    def url(self, path: str = "") -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/{path}"

    def handle_error(self, request, client_address) -> None:
        """A client that hangs up early (the size probe reads only the headers) is no error here."""


class Handler(BaseHTTPRequestHandler):
    server: Publisher

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        path, wanted = self.path.lstrip("/"), self.headers.get("Range")
        self.server.requests.append((path, wanted))
        data = self.server.files.get(path)
        if data is None:
            self.send_error(404)
            return
        start = 0 if wanted is None or self.server.ignore_range else int(wanted.removeprefix("bytes=").rstrip("-"))
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


@pytest.fixture
def publisher():
    server = Publisher()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.release.set()
    server.shutdown()
    server.server_close()


DATA = os.urandom(3 * 1024 * 1024 + 17)
SHA256 = hashlib.sha256(DATA).hexdigest()


def test_a_file_is_fetched_through_its_part_file_and_checked(publisher, tmp_path):
    publisher.files["a.bin"] = DATA
    fetch(publisher.url("a.bin"), tmp_path / "a.bin", len(DATA), SHA256, ROUTE)
    assert (tmp_path / "a.bin").read_bytes() == DATA and not part_path(tmp_path / "a.bin").exists()
    assert publisher.requests == [("a.bin", None)]
    fetch(publisher.url("a.bin"), tmp_path / "a.bin", len(DATA), SHA256, ROUTE)  # there and checked: not fetched
    assert publisher.requests == [("a.bin", None)]


def test_a_transfer_cut_midway_resumes_from_where_it_stopped(publisher, tmp_path, capsys):
    publisher.files["a.bin"], publisher.faults["a.bin"] = DATA, ["cut"]
    fetch(publisher.url("a.bin"), tmp_path / "a.bin", len(DATA), SHA256, ROUTE)
    assert (tmp_path / "a.bin").read_bytes() == DATA
    assert publisher.requests == [("a.bin", None), ("a.bin", f"bytes={len(DATA) // 2}-")]
    assert f"truncated: {len(DATA) // 2:,} of {len(DATA):,} bytes; fetching it again" in capsys.readouterr().err


def test_a_corrupted_download_is_detected_and_fetched_again_whole(publisher, tmp_path, capsys):
    publisher.files["a.bin"], publisher.faults["a.bin"] = DATA, ["corrupt"]
    fetch(publisher.url("a.bin"), tmp_path / "a.bin", len(DATA), SHA256, ROUTE)
    assert (tmp_path / "a.bin").read_bytes() == DATA
    assert publisher.requests == [("a.bin", None), ("a.bin", None)]
    assert f"corrupted: sha256 {hashlib.sha256(bytes([DATA[0] ^ 0xFF]) + DATA[1:]).hexdigest()}, expected {SHA256}" \
        in capsys.readouterr().err


def test_a_file_corrupted_on_every_attempt_is_an_error_naming_the_url(publisher, tmp_path):
    publisher.files["a.bin"], publisher.faults["a.bin"] = DATA, ["corrupt"] * 3
    with pytest.raises(DownloadError, match=rf"{publisher.url('a.bin')}: corrupted: .* after 3 attempts\. {ROUTE}"):
        fetch(publisher.url("a.bin"), tmp_path / "a.bin", len(DATA), SHA256, ROUTE)
    assert list(tmp_path.iterdir()) == []


def test_a_server_that_ignores_range_sends_the_file_again_from_its_start(publisher, tmp_path):
    publisher.files["a.bin"], publisher.ignore_range = DATA, True
    part_path(tmp_path / "a.bin").write_bytes(DATA[:1000])
    fetch(publisher.url("a.bin"), tmp_path / "a.bin", len(DATA), SHA256, ROUTE)
    assert (tmp_path / "a.bin").read_bytes() == DATA
    assert publisher.requests == [("a.bin", "bytes=1000-")]


def test_a_part_file_the_server_cannot_continue_is_started_over(publisher, tmp_path):
    """A size larger than the server's file (a stale manifest): Range past its end is refused (416), the part is
    fetched again, and the size check names the difference."""
    publisher.files["a.bin"] = DATA
    part_path(tmp_path / "a.bin").write_bytes(DATA)
    with pytest.raises(DownloadError, match=rf"truncated: {len(DATA):,} of {len(DATA) + 1:,} bytes after 2 attempts"):
        fetch(publisher.url("a.bin"), tmp_path / "a.bin", len(DATA) + 1, None, ROUTE, attempts=2)
    assert publisher.requests == [("a.bin", f"bytes={len(DATA)}-"), ("a.bin", None)]


def test_a_missing_file_is_an_error_naming_the_url_and_the_status(publisher, tmp_path):
    with pytest.raises(DownloadError, match=rf"cannot fetch {publisher.url('gone.bin')} \(HTTP 404 Not Found\)\. "
                                            f"{ROUTE}"):
        fetch(publisher.url("gone.bin"), tmp_path / "gone.bin", 10, None, ROUTE)


def wait_for(condition, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_run_interrupted_mid_file_resumes_when_run_again(publisher, tmp_path):
    """Ctrl-C in the middle of a file (the server stalls half-way), then the same command again: it asks for the
    rest only, and the file is whole."""
    train, dev = "hotpotqa/hotpot_train_v1.1.json", "hotpotqa/hotpot_dev_distractor_v1.json"
    publisher.files.update({train: DATA, dev: b"[]"})
    publisher.faults[train] = ["ok", "stall"]  # the size probe, then the transfer
    out = tmp_path / "out"
    command = ["hotpotqa", "--corpus", "none", "--source", publisher.url(), "--data-dir", str(out)]
    # SIGINT at its default in the child, whatever this process inherited (a SIGINT ignored here would be ignored
    # there too, and Python installs no KeyboardInterrupt handler for an ignored signal)
    first = subprocess.Popen([sys.executable, "-m", "envs.prepare", *command], cwd=ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    part = part_path(out / train)
    try:
        wait_for(lambda: part.exists() and part.stat().st_size == len(DATA) // 2)
        first.send_signal(signal.SIGINT)
        _, err = first.communicate(timeout=60)
    finally:
        first.kill()
    assert first.returncode == 130 and "interrupted: the same command again resumes" in err
    publisher.release.set()
    assert main(command) == 0
    assert (out / train).read_bytes() == DATA and (out / dev).read_bytes() == b"[]"
    # the sizes asked, then the rest of the train file only
    assert publisher.requests[-4:] == [(train, None), (dev, None), (train, f"bytes={len(DATA) // 2}-"), (dev, None)]
