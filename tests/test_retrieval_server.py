"""Retrieval as a service: the project's server (a real process on 127.0.0.1) answers as the in-process index does,
the env searches through it, and every way a server can fail gives a named error or a counted retry."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import gymnasium as gym
import pytest

import envs  # noqa: F401  (registers the env ids)
from envs.cache import CACHE_DIR_ENV
from envs.datasets import corpus_path, load_dataset
from envs.retrieval import RemoteRetriever, RetrievalError, get_retriever
from envs.retrieval.serve import main as serve_main
from envs.retrieval.serve import parse_args
from tests.ports import free_port, refused_port

ROOT = Path(__file__).resolve().parents[1]
PASSAGES = 3000


@pytest.fixture(scope="module")
def small_corpus(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("served") / "wiki" / "paragraphs.jsonl"
    path.parent.mkdir()
    with corpus_path(data_dir).open(encoding="utf-8") as fin, path.open("w", encoding="utf-8") as fout:
        for _, line in zip(range(PASSAGES), fin, strict=False):
            fout.write(line)
    return path


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("served-cache")


@pytest.fixture(scope="module")
def server(small_corpus: Path, cache_dir: Path) -> Iterator[str]:
    """``python -m envs.retrieval.serve`` over the small corpus on a free loopback port; stopped by pid."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "envs.retrieval.serve", "--corpus", str(small_corpus),
                             "--cache-dir", str(cache_dir), "--port", str(port)], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    break
            except OSError:
                if proc.poll() is not None:
                    pytest.fail(f"the server exited: {proc.stderr.read()}")
                if time.monotonic() > deadline:
                    pytest.fail("the server did not listen within 120 s")
                time.sleep(0.2)
        yield f"http://127.0.0.1:{port}/retrieve"
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        proc.stderr.close()


def test_the_server_answers_as_the_in_process_index(server: str, small_corpus: Path, cache_dir: Path,
                                                   data_dir: Path) -> None:
    local = get_retriever("bm25", small_corpus, cache_dir=cache_dir)
    remote = RemoteRetriever(server)
    questions = [r.question for r in load_dataset("hotpotqa", "dev", data_dir)[:30]] + ["zzqxv", ""]
    for k in (1, 3, 5):
        ours, theirs = local.search(questions, k=k), remote.search(questions, k=k)
        assert len(theirs) == len(questions)
        for mine, served in zip(ours, theirs, strict=True):
            fields = [[(h.id, h.title, h.text, h.score) for h in hits] for hits in (mine, served)]
            assert fields[0] == fields[1]
            assert all(h.index is None for h in served)
    assert remote.retries == 0


def test_the_protocol_with_and_without_scores(server: str) -> None:
    import urllib.request

    def post(body: dict) -> dict:
        request = urllib.request.Request(server, json.dumps(body).encode(), {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.loads(response.read())

    scored = post({"queries": ["comedy film", "river"], "topk": 2, "return_scores": True})["result"]
    assert len(scored) == 2 and all(len(hits) == 2 for hits in scored)
    assert set(scored[0][0]) == {"document", "score"} and set(scored[0][0]["document"]) == {"id", "contents"}
    assert scored[0][0]["document"]["contents"].startswith('"')  # "Title"\ntext, as in the corpus
    plain = post({"queries": ["comedy film"], "topk": 2})["result"]  # return_scores defaults to false
    assert plain == [[hit["document"] for hit in scored[0]]]
    assert len(post({"queries": ["comedy film"]})["result"][0]) == 3  # the server's default topk


def test_the_env_searches_through_the_server_as_in_process(server: str, small_corpus: Path, cache_dir: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CACHE_DIR_ENV, str(cache_dir))
    remote = gym.make("HotpotQA-v0", split="dev", retriever=server).unwrapped
    local = gym.make("HotpotQA-v0", split="dev", corpus_path=small_corpus).unwrapped
    assert isinstance(remote.retriever, RemoteRetriever)
    actions = ["<search> comedy film director </search>", "<search> Paris river </search>", "<answer> x </answer>"]
    for env in (remote, local):
        env.reset(options={"index": 3})
    for action in actions:
        assert remote.step(action)[:4] == local.step(action)[:4]
    # a batch of an agent step's searches is one request, and the steps then read it
    states = []
    for index in range(3):
        remote.reset(options={"index": index})
        states.append(remote.get_state())
    remote.prefetch([(state, action) for state in states for action in actions])
    assert set(remote._prefetched) == {"comedy film director", "Paris river"}


# ---------------------------------------------------------------------------------------------------------
# Bad servers: named errors and counted retries


class Scripted(BaseHTTPRequestHandler):
    """Answers each POST with the next (status, body) of the server's script (the last one repeats)."""

    def do_POST(self) -> None:  # http.server's naming
        self.rfile.read(int(self.headers["Content-Length"]))
        script = self.server.script
        status, body = script.pop(0) if len(script) > 1 else script[0]
        self.server.requests += 1
        if status == "hang":
            time.sleep(body)
            return
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def scripted_server() -> Iterator:
    servers = []

    def start(*script) -> tuple[str, ThreadingHTTPServer]:
        httpd = ThreadingHTTPServer(("127.0.0.1", 0), Scripted)
        httpd.script, httpd.requests = list(script), 0
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        servers.append(httpd)
        return f"http://127.0.0.1:{httpd.server_address[1]}", httpd

    yield start
    for httpd in servers:
        httpd.shutdown()
        httpd.server_close()


ONE_HIT = json.dumps({"result": [[{"document": {"id": "7", "contents": '"T"\nbody'}, "score": 1.5}]]}).encode()


def test_a_refused_connection_is_retried_then_named() -> None:
    with refused_port() as port, pytest.raises(RetrievalError, match=f"{port}/retrieve.*ConnectionRefusedError.*"
                                                                    "after 3 attempts"):
        retriever = RemoteRetriever(f"http://127.0.0.1:{port}/retrieve", retries=2, backoff_s=0.01)
        retriever.search(["q"], k=3)
    assert retriever.retries == 2


def test_a_server_that_times_out_is_retried_then_named(scripted_server) -> None:
    url, httpd = scripted_server(("hang", 2.0))
    retriever = RemoteRetriever(url, timeout_s=0.3, retries=1, backoff_s=0.01)
    with pytest.raises(RetrievalError, match=f"{url}/retrieve: timed out.*after 2 attempts, timeout 0.3 s"):
        retriever.search(["q"], k=3)
    assert retriever.retries == 1 and httpd.requests == 2


def test_an_overloaded_server_is_retried_and_counted(scripted_server) -> None:
    url, httpd = scripted_server((503, b"busy"), (502, b"gateway"), (200, ONE_HIT))
    retriever = RemoteRetriever(url, retries=3, backoff_s=0.01)
    [[hit]] = retriever.search(["q"], k=3)
    assert (hit.id, hit.title, hit.text, hit.score, hit.index) == ("7", "T", "body", 1.5, None)
    assert retriever.retries == 2 and httpd.requests == 3


class ClosesSilently(Scripted):
    """Answers in HTTP/1.1 without ``Connection: close``, then closes: the client's kept-alive connection goes
    stale, as uvicorn's do after 5 idle seconds."""

    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:
        super().do_POST()
        self.close_connection = True


def test_a_stale_kept_alive_connection_is_reopened_without_a_retry(scripted_server) -> None:
    url, httpd = scripted_server((200, ONE_HIT))
    httpd.RequestHandlerClass = ClosesSilently
    retriever = RemoteRetriever(url, retries=0)
    for _ in range(3):
        assert retriever.search_one("q", k=1)[0].id == "7"
    assert retriever.retries == 0 and httpd.requests == 3


@pytest.mark.parametrize(("status", "body", "message"), [
    (200, json.dumps({"result": [[]]}).encode(), "answered 1 result lists for 2 queries"),
    (200, b"{not json", "answered malformed JSON"),
    (200, json.dumps({"docs": []}).encode(), "answered no 'result' list"),
    (200, json.dumps({"result": [[{"document": {"id": "1"}, "score": 1}], []]}).encode(),
     "answered a document without 'contents'"),
    (400, b"bad request", "answered HTTP 400"),
])
def test_an_answer_outside_the_protocol_is_named_at_once(scripted_server, status: int, body: bytes,
                                                         message: str) -> None:
    url, httpd = scripted_server((status, body))
    retriever = RemoteRetriever(url, retries=3, backoff_s=0.01)
    with pytest.raises(RetrievalError, match=f"retrieval server {url}/retrieve {message}"):
        retriever.search(["q1", "q2"], k=3)
    assert retriever.retries == 0 and httpd.requests == 1  # not retried: the server would answer the same


def test_plain_documents_are_read_without_scores(scripted_server) -> None:
    url, _ = scripted_server((200, json.dumps({"result": [[{"id": "3", "contents": '"A"\ntext'}]]}).encode()))
    [[hit]] = RemoteRetriever(url).search(["q"], k=3)
    assert (hit.id, hit.title, hit.text) == ("3", "A", "text") and hit.score != hit.score  # NaN: no score


def test_a_failed_search_is_an_error_not_an_empty_observation(data_dir: Path) -> None:
    with refused_port() as port:
        url = f"http://127.0.0.1:{port}"
        env = gym.make("HotpotQA-v0", split="dev", retriever=url).unwrapped
        env.retriever.backoff_s = 0.0
        env.reset(options={"index": 0})
        with pytest.raises(RetrievalError, match=f"{url}/retrieve"):
            env.step("<search> anything </search>")
        assert env.step("<answer> x </answer>")[2]  # the failed step changed nothing: the episode goes on


def test_bad_urls_and_server_options_are_refused(tmp_path: Path) -> None:
    for url in ("http://", "http://host:port/retrieve", "ftp://host/retrieve"):
        with pytest.raises(ValueError, match="retriever"):
            get_retriever(url)
    with pytest.raises(ValueError, match="reads its own corpus"):
        get_retriever("http://127.0.0.1:1/retrieve", tmp_path / "corpus.jsonl")
    with pytest.raises(SystemExit):
        parse_args(["--index", "bm25", "--query-prefix", "query: "])


@pytest.mark.parametrize(("argv", "message"), [
    (["--port", "70000"], "--port must be a TCP port, 1-65535, got 70000"),
    (["--port", "0"], "--port must be a TCP port"), (["--topk", "0"], "--topk must be at least 1"),
    (["--data-dir", "/no/such/dir"], "data directory /no/such/dir (from the data_dir argument) does not exist"),
    (["--corpus", "/no/such/corpus.jsonl"], "/no/such/corpus.jsonl")])
def test_a_bad_server_option_or_a_missing_corpus_is_one_error_line_before_any_index(capsys, argv, message) -> None:
    with pytest.raises(SystemExit) as exit_:
        serve_main(argv)
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert exit_.value.code == 2 and "error: " in last and message in last and "Traceback" not in err


def test_the_servers_help_keeps_its_description_and_says_each_default_once(capsys) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    text = capsys.readouterr().out
    assert "no authentication" in text and "POST /retrieve" in text  # the whole description, not its first line
    assert "(default: None)" not in text and text.count("(default: 8000)") == 1


def test_a_remote_retriever_pickles_as_its_url() -> None:
    import pickle

    retriever = get_retriever("http://127.0.0.1:9/retrieve", timeout_s=5.0)
    clone = pickle.loads(pickle.dumps(retriever))
    assert clone is retriever  # one per process and settings
    assert (clone.url, clone.timeout_s) == ("http://127.0.0.1:9/retrieve", 5.0)
