"""envs.prepare without the network: the conversions on the real files of the data directory, the plan's rules, and
the command end to end from a directory standing in for the publishers (file://, the same code path as HTTP)."""

from __future__ import annotations

import gzip
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import urllib.request
from collections import namedtuple
from pathlib import Path
from urllib.error import URLError

import pytest

from envs.datasets import (
    DATASETS,
    DataError,
    corpus_path,
    load_dataset,
    load_records,
    parse_passage,
    read_parquet_records,
    split_contents,
)
from envs.prepare import plan as plan_module
from envs.prepare.cli import main
from envs.prepare.convert import (
    build_paragraph_corpus,
    corpus_lines,
    flashrag_to_parquet,
    paragraph_text,
    pooled_paragraphs,
    unpack_corpus,
)
from envs.prepare.plan import human_bytes, kept_instead
from envs.prepare.sources import DATASET_PRODUCTS, HOTPOTQA_SITE, WIKI18, RemoteFile

ROOT = Path(__file__).resolve().parents[1]
HOTPOTQA_SUBSETS = {"train": "hotpotqa/hotpot_train_distractor_subset.json",
                    "dev": "hotpotqa/hotpot_dev_distractor_subset.json"}


def read_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def files_under(folder: Path) -> list[Path]:
    return sorted(path for path in folder.rglob("*") if path.is_file())


# ---------------------------------------------------------------------------------------------------------
# Conversions


def test_a_paragraph_is_its_sentences_joined_with_whitespace_runs_made_one_space():
    assert paragraph_text(["Paris is a city.", "  It is in France. ", "\nBig."]) == \
        "Paris is a city. It is in France. Big."


def test_pooled_paragraphs_keep_a_titles_first_text_and_name_a_record_without_context():
    questions = [{"context": [["A", ["a1.", " a2."]], ["B", ["b."]]]}, {"context": [["A", ["other."]], ["C", ["c."]]]}]
    assert pooled_paragraphs(questions, "f.json") == {"A": "a1. a2.", "B": "b.", "C": "c."}
    with pytest.raises(DataError, match=r"f\.json: record 1: no 'context'"):
        pooled_paragraphs([questions[0], {"question": "q?"}], "f.json")


def test_corpus_lines_are_sorted_by_title_with_ids_in_order_and_read_back_as_written():
    lines = list(corpus_lines({"Zeta": "z text", "Alpha \"x\"": "a text", "Mu": "m é"}))
    passages = [parse_passage(line, f"line {i}") for i, line in enumerate(lines)]
    assert [(p.id, p.title, p.text) for p in passages] == [
        ("0", 'Alpha "x"', "a text"), ("1", "Mu", "m é"), ("2", "Zeta", "z text")]
    assert "é" in lines[1]  # written as UTF-8, as the shared corpus is, not \u escapes


def test_the_first_run_corpus_from_the_real_hotpotqa_files(data_dir, tmp_path):
    """Built from the shared HotpotQA files: every question's supporting titles are passages, and the passages are
    those of the shared corpus (pooled from fuller copies of the same paragraphs) under the same titles."""
    sources = [data_dir / rel for rel in HOTPOTQA_SUBSETS.values()]
    target = tmp_path / "wiki" / "paragraphs.jsonl"
    count = build_paragraph_corpus(sources, target)
    built = {split_contents(row["contents"]) for row in read_lines(target)}
    titles = {title for title, _ in built}
    assert count == len(built) == len(titles) > 10_000
    assert [row["id"] for row in read_lines(target)] == [str(i) for i in range(count)]
    for split in HOTPOTQA_SUBSETS:
        for record in load_dataset("hotpotqa", split, data_dir):
            assert set(record.supporting_titles) <= titles, record.id
    shared = {split_contents(row["contents"]) for row in read_lines(data_dir / "wiki" / "paragraphs.jsonl")}
    assert len(built & shared) / len(built) > 0.995  # a handful differ in how their source split sentences


def test_a_flashrag_file_becomes_a_parquet_file_with_the_same_records(data_dir, tmp_path):
    source = data_dir / "qa" / "nq_test.jsonl"
    flashrag_to_parquet(source, tmp_path / "nq" / "test.parquet")
    assert read_parquet_records(tmp_path / "nq" / "test.parquet") == load_records(source, "flashrag")


def test_a_bad_flashrag_line_is_named_and_nothing_is_written(tmp_path):
    source = tmp_path / "dev.jsonl"
    source.write_text('{"id": "1", "question": "q?", "golden_answers": ["a"]}\n{"id": "2", "question": "q?"}\n')
    with pytest.raises(DataError, match=r"dev\.jsonl:2: missing field 'golden_answers'"):
        flashrag_to_parquet(source, tmp_path / "out" / "dev.parquet")
    assert files_under(tmp_path) == [source]


CORPUS = b'{"id": "0", "contents": "\\"A\\"\\na text"}\n{"id": "1", "contents": "\\"B\\"\\nb text"}\n'


def tar_gz(members: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


@pytest.mark.parametrize("packed", [gzip.compress(CORPUS), tar_gz({"data00/x/wiki_dump.jsonl": CORPUS})],
                         ids=["gzip", "tar-in-gzip"])
def test_a_gzipped_corpus_is_unpacked_alone_or_from_the_tar_it_holds(tmp_path, packed):
    """Search-R1's wiki-18.jsonl.gz is a gzipped tar of one jsonl file; a plain gzip is read too."""
    (tmp_path / "wiki-18.jsonl.gz").write_bytes(packed)
    unpack_corpus(tmp_path / "wiki-18.jsonl.gz", tmp_path / "wiki" / "wiki-18.jsonl")
    assert (tmp_path / "wiki" / "wiki-18.jsonl").read_bytes() == CORPUS


@pytest.mark.parametrize("packed, error", [
    (gzip.compress(b"<html>not found</html>\n"), "invalid JSON"),
    (tar_gz({"README.txt": b"x"}), "a tar archive without a .jsonl file"),
    (b"not gzip at all", "cannot be unpacked"),
], ids=["not-a-corpus", "no-jsonl-member", "not-gzip"])
def test_a_corpus_download_that_is_not_one_is_refused_and_nothing_is_written(tmp_path, packed, error):
    (tmp_path / "wiki-18.jsonl.gz").write_bytes(packed)
    with pytest.raises(DataError, match=error):
        unpack_corpus(tmp_path / "wiki-18.jsonl.gz", tmp_path / "wiki" / "wiki-18.jsonl")
    assert files_under(tmp_path) == [tmp_path / "wiki-18.jsonl.gz"]


# ---------------------------------------------------------------------------------------------------------
# The plan


def test_a_file_is_kept_when_it_or_one_read_before_it_is_there(tmp_path):
    hotpot_train = DATASETS["hotpotqa"][1]["train"]
    (tmp_path / "hotpotqa").mkdir()
    (tmp_path / HOTPOTQA_SUBSETS["train"]).write_text("[]")
    assert kept_instead(hotpot_train, "hotpotqa/hotpot_train_v1.1.json", tmp_path) is None  # a subset is no stand-in
    (tmp_path / "wiki").mkdir()
    (tmp_path / "wiki" / "paragraphs.jsonl").write_text("")
    corpora = ("wiki/wiki-18.jsonl", "wiki/paragraphs.jsonl")
    assert kept_instead(corpora, "wiki/wiki-18.jsonl", tmp_path) is None  # the smaller corpus does not stand for it
    assert kept_instead(corpora, "wiki/paragraphs.jsonl", tmp_path) == tmp_path / "wiki" / "paragraphs.jsonl"
    (tmp_path / "wiki" / "wiki-18.jsonl").write_text("")
    # with wiki-18 there, paragraphs.jsonl would never be read: it is not built
    assert kept_instead(corpora, "wiki/paragraphs.jsonl", tmp_path) == tmp_path / "wiki" / "wiki-18.jsonl"


def test_every_product_is_a_file_envs_datasets_reads():
    for name, products in DATASET_PRODUCTS.items():
        for product in products:
            assert product.output in DATASETS[name][1][product.split], product.output
    assert WIKI18.output == "wiki/wiki-18.jsonl"


def test_sizes_are_said_in_binary_units():
    assert [human_bytes(n) for n in (512, 2048, 566_426_227, 5_123_307_260)] == [
        "512 B", "2.0 KiB", "540.2 MiB", "4.8 GiB"]


def test_a_source_directory_is_read_at_the_mirror_path():
    remote = RemoteFile(HOTPOTQA_SITE, "hotpot_train_v1.1.json")
    assert remote.url() == "http://curtis.ml.cmu.edu/datasets/hotpot/hotpot_train_v1.1.json"
    assert remote.url("/mirror/") == "file:///mirror/hotpotqa/hotpot_train_v1.1.json"
    assert remote.url("https://example.org/m") == "https://example.org/m/hotpotqa/hotpot_train_v1.1.json"


# ---------------------------------------------------------------------------------------------------------
# The command


def stand_in_hub(data_dir: Path, root: Path) -> Path:
    """A directory laid out as --source reads it, holding the shared data's files in the publishers' places."""
    files = {"hotpotqa/hotpot_train_v1.1.json": HOTPOTQA_SUBSETS["train"],
             "hotpotqa/hotpot_dev_distractor_v1.json": HOTPOTQA_SUBSETS["dev"],
             "RUC-NLPIR/FlashRAG_datasets/bamboogle/test.jsonl": "qa/bamboogle_test.jsonl",
             "RUC-NLPIR/FlashRAG_datasets/musique/train.jsonl": "qa/popqa_test.jsonl",  # any FlashRAG file
             "RUC-NLPIR/FlashRAG_datasets/musique/dev.jsonl": "qa/nq_test.jsonl"}
    for mirror_path, rel in files.items():
        (root / mirror_path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(data_dir / rel, root / mirror_path)
    return root


def test_help_lists_the_datasets_and_corpora(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--help"])
    out = capsys.readouterr().out
    assert stop.value.code == 0
    for name in [*DATASET_PRODUCTS, "hotpotqa-paragraphs", "wiki-18"]:
        assert f"\n  {name} " in out, name


def test_an_unknown_dataset_is_refused_with_the_known_ones(capsys, tmp_path):
    with pytest.raises(SystemExit) as stop:
        main(["hotpot", "--data-dir", str(tmp_path / "out")])
    assert stop.value.code == 2
    assert ("unknown dataset hotpot; known datasets: hotpotqa, 2wikimultihopqa, musique, nq, triviaqa, popqa, "
            "bamboogle") in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_from_a_directory_standing_in_for_the_publishers(data_dir, tmp_path, capsys):
    hub = stand_in_hub(data_dir, tmp_path / "hub")
    out = tmp_path / "out"
    assert main(["hotpotqa", "musique", "bamboogle", "--source", str(hub), "--data-dir", str(out)]) == 0
    said = capsys.readouterr().out
    assert "download  hotpotqa/hotpot_train_v1.1.json" in said and "build     wiki/paragraphs.jsonl" in said
    for split in HOTPOTQA_SUBSETS:
        assert load_dataset("hotpotqa", split, out) == load_dataset("hotpotqa", split, data_dir)
    assert load_dataset("musique", "dev", out) == tuple(load_records(data_dir / "qa" / "nq_test.jsonl", "flashrag"))
    assert (out / "bamboogle" / "test.jsonl").read_bytes() == (data_dir / "qa" / "bamboogle_test.jsonl").read_bytes()
    assert corpus_path(out) == out / "wiki" / "paragraphs.jsonl"
    # built files are as readable as downloaded ones (not only by their owner, as a temporary file is)
    assert {(out / rel).stat().st_mode for rel in ("wiki/paragraphs.jsonl", "musique/dev.parquet")} == {
        (out / "hotpotqa" / "hotpot_train_v1.1.json").stat().st_mode}
    assert not (out / "downloads").exists()  # the converted downloads are gone
    # run again: everything is there, nothing is fetched
    assert main(["hotpotqa", "musique", "bamboogle", "--source", str(tmp_path / "gone"), "--data-dir", str(out)]) == 0
    assert "nothing to do" in capsys.readouterr().out


def test_without_the_network_the_error_names_the_url_and_the_manual_route(tmp_path, capsys, monkeypatch):
    def no_network(request, timeout):
        raise URLError(OSError(-3, "Temporary failure in name resolution"))

    monkeypatch.setattr(urllib.request, "urlopen", no_network)
    out = tmp_path / "out"
    assert main(["hotpotqa", "--data-dir", str(out)]) == 1
    err = capsys.readouterr().err
    assert "cannot fetch http://curtis.ml.cmu.edu/datasets/hotpot/hotpot_train_v1.1.json" in err
    assert "Temporary failure in name resolution" in err
    assert "into DIR/hotpotqa/hotpot_train_v1.1.json, and run again with --source DIR" in err
    assert "docs/environments.md" in err
    # the official host is plain HTTP with outages: the other public copy of the same files is tried, and named
    assert "cannot fetch https://web.archive.org/web/2019id_/http://curtis.ml.cmu.edu/datasets/hotpot/" in err
    # a file whose size no manifest gives is asked for before anything starts: the same error, at once
    assert main(["nq", "--corpus", "none", "--data-dir", str(out)]) == 1
    assert ("cannot fetch https://huggingface.co/datasets/RUC-NLPIR/FlashRAG_datasets/resolve/main/nq/train.jsonl"
            in capsys.readouterr().err)


def test_too_little_disk_is_refused_before_anything_starts_with_the_sizes(tmp_path, capsys, monkeypatch):
    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(10**12, 10**12 - 10**8, 10**8))
    out = tmp_path / "out"
    assert main(["hotpotqa", "--corpus", "wiki-18", "--data-dir", str(out)]) == 1
    err = capsys.readouterr().err
    # 540.2 + 44.2 MiB of HotpotQA and 4.8 GiB of wiki-18 to fetch, 13.4 GiB to unpack it into: 18.7 GiB
    assert "refused: 18.7 GiB needed in" in err and "(5.3 GiB to download" in err and "95.4 MiB free" in err
    assert not out.exists()
    assert plan_module.free_bytes(out) == 10**8


def test_make_data_writes_what_run_py_reads(data_dir, tmp_path):
    """The Makefile's data target, as `make run` calls it on a GPU machine, from a stand-in directory."""
    hub = stand_in_hub(data_dir, tmp_path / "hub")
    out = tmp_path / "data"
    make = ["make", "--no-print-directory", "-o", "setup", "data", f"PY={sys.executable}"]  # this venv, as it is
    done = subprocess.run([*make, f"PREPARE_DIR={out}", f"PREPARE_ARGS=--source {hub}"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "hotpotqa/hotpot_train_v1.1.json" in done.stdout
    assert corpus_path(out) == out / "wiki" / "paragraphs.jsonl"


@pytest.mark.slow
def test_run_py_trains_on_a_prepared_directory(data_dir, tmp_path):
    """The issue's target: `python -m envs.prepare hotpotqa --source DIR --data-dir OUT`, then one iteration of
    run.py on OUT, each in a process of its own as a user runs them."""
    hub = stand_in_hub(data_dir, tmp_path / "hub")
    out = tmp_path / "out"
    env = {**os.environ, "TREEGRPO_DATA_DIR": str(out)}
    prepare = [sys.executable, "-m", "envs.prepare", "hotpotqa", "--source", str(hub), "--data-dir", str(out)]
    subprocess.run(prepare, cwd=ROOT, env=env, check=True, capture_output=True, timeout=300)
    run = [sys.executable, "experiments/run.py", "--env", "HotpotQA-v0", "--iterations", "1", "--model",
           "tiny-random", "--max-step-tokens", "8", "--prompts-per-iter", "2", "--micro-batch-size", "6",
           "--checkpoint-every", "0", "--no-mlflow", "--output", str(tmp_path / "run")]
    subprocess.run(run, cwd=ROOT, env=env, check=True, capture_output=True, timeout=900)
    (row,) = read_lines(tmp_path / "run" / "metrics.jsonl")
    assert row["iteration"] == 1 and row["leaves"] > 0
