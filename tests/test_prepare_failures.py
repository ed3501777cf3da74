"""envs.prepare when it cannot finish: a data directory that cannot be written, a disk that fills up midway, no
network, a file already there that is not whole. Each ends in one line naming the path and the way out, and leaves
nothing that changes which data a later command reads (the Makefile's choice of data directory included)."""

from __future__ import annotations

import errno
import gzip
import hashlib
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import urllib.request
from collections import namedtuple
from collections.abc import Iterator
from pathlib import Path
from urllib.error import URLError

import pytest

from envs.prepare.cli import main
from envs.prepare.datadir import write_error
from envs.prepare.download import part_path
from envs.prepare.sources import DATASET_PRODUCTS, HOTPOTQA_SITE, Product, RemoteFile
from tests.publisher import Publisher, serving

ROOT = Path(__file__).resolve().parents[1]
TRAIN, DEV = "hotpotqa/hotpot_train_v1.1.json", "hotpotqa/hotpot_dev_distractor_v1.json"
WAY_OUT_WRITE = "choose another --data-dir, or make it writable"


@pytest.fixture
def publisher() -> Iterator[Publisher]:
    with serving() as server:
        yield server


def last_error(err: str) -> str:
    lines = err.strip().splitlines()
    assert "Traceback" not in err, err
    return lines[-1]


def no_network(request, timeout):
    raise URLError(OSError(-3, "Temporary failure in name resolution"))


def limited_file_size(limit: int):
    """A child's preexec: the kernel refuses to grow any file past ``limit`` bytes (EFBIG, as a full disk refuses
    with ENOSPC), for root too, with the signal that would kill the process ignored."""
    def setup() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return setup


def prepare(*args: str, limit: int | None = None) -> subprocess.CompletedProcess:
    """``python -m envs.prepare ARGS`` as a user runs it."""
    return subprocess.run([sys.executable, "-m", "envs.prepare", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, preexec_fn=limited_file_size(limit) if limit else None)


# ---------------------------------------------------------------------------------------------------------
# Writing


def test_a_write_that_fails_midway_is_said_once_as_a_write_error(publisher, tmp_path):
    """The disk refuses the download's bytes past 1 MiB: one transfer, no retry, no network advice; the last line
    names the file and the way out."""
    data = os.urandom(3 << 20)
    publisher.files.update({TRAIN: data, DEV: b"[]"})
    out = tmp_path / "out"
    done = prepare("hotpotqa", "--corpus", "none", "--source", publisher.url(), "--data-dir", str(out), limit=1 << 20)
    assert done.returncode == 1
    assert last_error(done.stderr) == (f"error: cannot write {part_path(out / TRAIN)} (File too large): "
                                       f"{WAY_OUT_WRITE}")
    assert [request for request in publisher.requests if request[0] == TRAIN] == [(TRAIN, None)] * 2  # size, fetch
    assert "network" not in done.stderr and "connection lost" not in done.stderr


def test_a_write_that_fails_while_unpacking_is_not_blamed_on_the_download(data_dir, tmp_path):
    """The corpus unpacks past what the disk takes: the error is the output's, not "cannot be unpacked"."""
    hub = tmp_path / "hub"
    corpus = b"".join(json.dumps({"id": str(i), "contents": f'"T{i}"\n' + "text " * 40}).encode() + b"\n"
                      for i in range(10_000))  # 2.3 MiB, gzipped to far less
    (hub / "PeterJinGo/wiki-18-corpus").mkdir(parents=True)
    (hub / "PeterJinGo/wiki-18-corpus/wiki-18.jsonl.gz").write_bytes(gzip.compress(corpus))
    (hub / "RUC-NLPIR/FlashRAG_datasets/bamboogle").mkdir(parents=True)
    shutil.copyfile(data_dir / "qa" / "bamboogle_test.jsonl", hub / "RUC-NLPIR/FlashRAG_datasets/bamboogle/test.jsonl")
    out = tmp_path / "out"
    done = prepare("bamboogle", "--corpus", "wiki-18", "--source", str(hub), "--data-dir", str(out), limit=1 << 20)
    assert done.returncode == 1
    assert last_error(done.stderr) == f"error: cannot write {out / 'wiki/wiki-18.jsonl'} (File too large): " \
                                      f"{WAY_OUT_WRITE}"
    assert not (out / "wiki").exists()  # no partial corpus


def test_a_full_disk_says_to_free_space(tmp_path):
    err = write_error(tmp_path / "x.part", OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
    assert str(err) == (f"cannot write {tmp_path / 'x.part'} (No space left on device): free some space there, or "
                        f"choose another --data-dir")


def _cannot_write(folder: Path) -> bool:
    try:
        tempfile.TemporaryFile(dir=folder).close()
    except OSError:
        return True
    return False


@pytest.fixture
def read_only_dir(tmp_path) -> Iterator[Path]:
    """A directory this process cannot write: one made read-only by its mode where that binds, else (as root, whom
    modes do not stop) /sys, whose file system refuses new files to root too."""
    folder = tmp_path / "read-only"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        if _cannot_write(folder):
            yield folder
        elif Path("/sys").is_dir() and _cannot_write(Path("/sys")):
            yield Path("/sys")
        else:
            pytest.skip("no directory here refuses this process's writes")
    finally:
        folder.chmod(0o755)


def stand_in_hotpotqa(data_dir: Path, hub: Path) -> Path:
    (hub / "hotpotqa").mkdir(parents=True)
    shutil.copyfile(data_dir / "hotpotqa/hotpot_train_distractor_subset.json", hub / TRAIN)
    shutil.copyfile(data_dir / "hotpotqa/hotpot_dev_distractor_subset.json", hub / DEV)
    return hub


@pytest.mark.parametrize("where", ["itself", "below"])
def test_a_data_directory_that_cannot_be_written_is_one_line_naming_it(read_only_dir, data_dir, tmp_path, capsys,
                                                                       where):
    hub = stand_in_hotpotqa(data_dir, tmp_path / "hub")
    target = read_only_dir if where == "itself" else read_only_dir / "treegrpo-data"
    before = sorted(read_only_dir.iterdir())
    assert main(["hotpotqa", "--data-dir", str(target), "--source", str(hub)]) == 1
    last = last_error(capsys.readouterr().err)
    assert last.startswith(f"error: cannot write {target} (") and last.endswith(f"): {WAY_OUT_WRITE}"), last
    assert sorted(read_only_dir.iterdir()) == before


def test_the_command_on_a_read_only_directory_ends_in_that_error(read_only_dir, data_dir, tmp_path):
    """The issue's contract, as a user runs it: non-zero, no traceback, the last line names the directory."""
    hub = stand_in_hotpotqa(data_dir, tmp_path / "hub")
    done = prepare("hotpotqa", "--data-dir", str(read_only_dir / "D"), "--source", str(hub))
    assert done.returncode == 1
    assert last_error(done.stderr).startswith(f"error: cannot write {read_only_dir / 'D'} (")


def test_a_file_in_the_way_of_the_data_directory_is_named(data_dir, tmp_path, capsys):
    hub = stand_in_hotpotqa(data_dir, tmp_path / "hub")
    (tmp_path / "a-file").write_text("mine")
    assert main(["hotpotqa", "--data-dir", str(tmp_path / "a-file" / "data"), "--source", str(hub)]) == 1
    assert last_error(capsys.readouterr().err) == (f"error: cannot write {tmp_path / 'a-file' / 'data'} (Not a "
                                                   f"directory): {WAY_OUT_WRITE}")
    assert (tmp_path / "a-file").read_text() == "mine"


def test_with_nothing_to_do_the_data_directory_is_not_written(data_dir, tmp_path, capsys):
    """A finished data directory may be read-only (a shared one): a run with nothing to do writes nothing there."""
    hub = stand_in_hotpotqa(data_dir, tmp_path / "hub")
    out = tmp_path / "out"
    assert main(["hotpotqa", "--data-dir", str(out), "--source", str(hub)]) == 0
    stamp = {path: path.stat().st_mtime_ns for path in [out, *out.rglob("*")]}
    assert main(["hotpotqa", "--data-dir", str(out), "--source", str(hub)]) == 0
    assert "nothing to do" in capsys.readouterr().out
    assert {path: path.stat().st_mtime_ns for path in [out, *out.rglob("*")]} == stamp


# ---------------------------------------------------------------------------------------------------------
# What a failed run leaves


def test_an_offline_run_leaves_no_folder_behind(tmp_path, capsys, monkeypatch):
    """An empty ./data/hotpotqa/ would shadow ../shared/data for every later `make` target."""
    monkeypatch.setattr(urllib.request, "urlopen", no_network)
    out = tmp_path / "data"
    assert main(["hotpotqa", "--data-dir", str(out / "nested")]) == 1
    assert not out.exists()
    out.mkdir()
    assert main(["hotpotqa", "--data-dir", str(out)]) == 1
    assert list(out.iterdir()) == []  # its own folder is kept, nothing is made in it
    assert "cannot fetch" in last_error(capsys.readouterr().err)


def make_check_data(checkout: Path, target: str = "check-data") -> subprocess.CompletedProcess:
    """`make check-data` (or ``target``) in a copy of the Makefile at ``checkout``, with no data directory set: which
    one it finds."""
    shutil.copyfile(ROOT / "Makefile", checkout / "Makefile")
    env = {name: value for name, value in os.environ.items() if name not in ("TREEGRPO_DATA_DIR", "MAKEFLAGS")}
    return subprocess.run(["make", "--no-print-directory", target], cwd=checkout, env=env, capture_output=True,
                          text=True, timeout=60)


def test_make_reads_a_data_folder_only_when_it_holds_a_corpus(tmp_path):
    root = tmp_path.resolve()
    checkout, shared = root / "checkout", root / "shared" / "data"
    (checkout / "data" / "hotpotqa").mkdir(parents=True)  # what an interrupted `make data` leaves: a part file
    (checkout / "data" / "hotpotqa" / "hotpot_train_v1.1.json.part").write_bytes(b"[")
    (shared / "wiki").mkdir(parents=True)
    (shared / "wiki" / "paragraphs.jsonl").write_text("")
    assert make_check_data(checkout).stdout.strip() == f"data: {shared}"
    (checkout / "data" / "wiki").mkdir()
    (checkout / "data" / "wiki" / "wiki-18.jsonl").write_text("")
    assert make_check_data(checkout).stdout.strip() == f"data: {checkout / 'data'}"
    shutil.rmtree(checkout / "data" / "wiki")
    shutil.rmtree(shared)
    done = make_check_data(checkout)
    assert done.returncode != 0 and done.stdout.startswith("No data directory"), done.stdout
    # `make test` goes on without data: the tests that read it skip (tests/conftest.py), and it says so first
    note = make_check_data(checkout, "data-note")
    assert note.returncode == 0 and "the tests that read the QA sets are skipped" in note.stdout, note.stdout


# ---------------------------------------------------------------------------------------------------------
# Files already there


def test_a_truncated_file_already_there_is_named_with_the_way_out(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(urllib.request, "urlopen", no_network)  # nothing is fetched: the refusal comes first
    out = tmp_path / "data"
    (out / "hotpotqa").mkdir(parents=True)
    (out / TRAIN).write_text("[]")
    assert main(["hotpotqa", "--data-dir", str(out)]) == 1
    said = capsys.readouterr()
    assert "have" not in said.out
    assert last_error(said.err) == (f"error: {out / TRAIN}: truncated: 2 of 566,426,227 bytes (already there, not "
                                    f"fetched by this run): delete it and run again to fetch it")
    assert (out / TRAIN).read_text() == "[]"  # the user's file is left as it is


def test_a_file_already_there_is_checked_by_its_pinned_sha256(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(urllib.request, "urlopen", no_network)
    pinned = b'[{"_id": "1"}]'
    train = Product(TRAIN, RemoteFile(HOTPOTQA_SITE, "hotpot_train_v1.1.json", len(pinned),
                                      hashlib.sha256(pinned).hexdigest()), "train")
    monkeypatch.setitem(DATASET_PRODUCTS, "hotpotqa", (train, DATASET_PRODUCTS["hotpotqa"][1]))
    out = tmp_path / "data"
    (out / "hotpotqa").mkdir(parents=True)
    other = pinned.replace(b"1", b"2")
    (out / TRAIN).write_bytes(other)
    assert main(["hotpotqa", "--corpus", "none", "--data-dir", str(out)]) == 1
    assert last_error(capsys.readouterr().err) == (
        f"error: {out / TRAIN}: corrupted: sha256 {hashlib.sha256(other).hexdigest()}, expected "
        f"{hashlib.sha256(pinned).hexdigest()} (already there, not fetched by this run): delete it and run again to "
        f"fetch it")
    (out / TRAIN).write_bytes(pinned)  # the publisher's file: kept, the run goes on to the next one
    assert main(["hotpotqa", "--corpus", "none", "--data-dir", str(out)]) == 1
    said = capsys.readouterr()
    assert f"have      {TRAIN}" in said.out and "cannot fetch http://curtis" in said.err


def test_with_a_source_a_file_already_there_is_checked_against_the_sources(data_dir, tmp_path, capsys):
    hub = stand_in_hotpotqa(data_dir, tmp_path / "hub")
    out = tmp_path / "out"
    (out / "hotpotqa").mkdir(parents=True)
    (out / DEV).write_bytes((hub / DEV).read_bytes()[:100])
    assert main(["hotpotqa", "--data-dir", str(out), "--source", str(hub)]) == 1
    assert last_error(capsys.readouterr().err) == (
        f"error: {out / DEV}: truncated: 100 of {(hub / DEV).stat().st_size:,} bytes (already there, not fetched by "
        f"this run): delete it and run again to fetch it")


# ---------------------------------------------------------------------------------------------------------
# The disk check


def test_with_a_source_the_disk_is_sized_from_its_files(data_dir, tmp_path, capsys, monkeypatch):
    """A small mirror of wiki-18 needs little disk: the check sizes it from the mirror's file, not the real 13 GiB."""
    hub = tmp_path / "hub"
    corpus = b'{"id": "0", "contents": "\\"A\\"\\na text"}\n' * 1000
    (hub / "PeterJinGo/wiki-18-corpus").mkdir(parents=True)
    (hub / "PeterJinGo/wiki-18-corpus/wiki-18.jsonl.gz").write_bytes(gzip.compress(corpus))
    (hub / "RUC-NLPIR/FlashRAG_datasets/bamboogle").mkdir(parents=True)
    shutil.copyfile(data_dir / "qa" / "bamboogle_test.jsonl", hub / "RUC-NLPIR/FlashRAG_datasets/bamboogle/test.jsonl")
    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(10**12, 10**12 - 10**8, 10**8))
    out = tmp_path / "out"
    assert main(["bamboogle", "--corpus", "wiki-18", "--source", str(hub), "--data-dir", str(out)]) == 0
    assert (out / "wiki" / "wiki-18.jsonl").read_bytes() == corpus


def test_a_download_that_cannot_be_converted_is_named_with_the_way_out(tmp_path, capsys):
    """A mirror's file that is not what it should be: the error names the line, the kept download and how to fetch
    it again (the next run would otherwise find it there, checked, and convert it again)."""
    hub = tmp_path / "hub"
    (hub / "RUC-NLPIR/FlashRAG_datasets/musique").mkdir(parents=True)
    good = json.dumps({"id": "1", "question": "q?", "golden_answers": ["a"]})
    (hub / "RUC-NLPIR/FlashRAG_datasets/musique/train.jsonl").write_text(good + "\n")
    (hub / "RUC-NLPIR/FlashRAG_datasets/musique/dev.jsonl").write_text(good + '\n{"id": "2"}\n')
    out = tmp_path / "out"
    assert main(["musique", "--corpus", "none", "--source", str(hub), "--data-dir", str(out)]) == 1
    download = out / "downloads/RUC-NLPIR/FlashRAG_datasets/musique/dev.jsonl"
    last = last_error(capsys.readouterr().err)
    assert last.startswith(f"error: {download}:2: ") and last.endswith(f". To fetch it again, delete {download} and "
                                                                        f"run again"), last
    assert (out / "musique/train.parquet").is_file() and not (out / "musique/dev.parquet").exists()
