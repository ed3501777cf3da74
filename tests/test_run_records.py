"""benchmarks/run_records.py: a benchmark's finished runs kept, compressed in its study's folder, and brought back,
so --resume reuses them on a new machine without training or evaluating anything."""

from __future__ import annotations

import io
import json
import os
import shutil
import tarfile
from pathlib import Path

import pytest

import benchmarks.bench_learning as bench_learning
import benchmarks.learning_runs as learning_runs
import benchmarks.vllm_kit as vllm_kit
from benchmarks import studies
from benchmarks.bench_learning import TESTBED
from benchmarks.run_records import RECORDS, read_archive, record_files, records_of, restore, save, write_archive

SETTING = "chain G=4"
XZ_MAGIC = b"\xfd7zXZ\x00"


def finish_run(output: Path, seed: int, *, iterations: int = 2) -> None:
    """A run as the benchmark leaves it: metrics, a checkpoint and the final evaluation keyed by its options."""
    args = bench_learning.parse_args(["--iterations", str(iterations), "--output", str(output)])
    directory = learning_runs.run_directory(SETTING, seed, output)
    (directory / "checkpoints" / "latest").mkdir(parents=True)
    (directory / "checkpoints" / "latest" / "model.safetensors").write_bytes(b"weights")
    (directory / "metrics.jsonl").write_text(f'{{"iteration": {iterations}}}\n', encoding="utf-8")
    options = learning_runs.run_options(TESTBED, SETTING, seed, "warm", args, directory)
    key = {"run": options, "eval_questions": args.eval_questions, "scores": [{"em": float(seed)}]}
    (directory / "held_out.json").write_text(json.dumps(key), encoding="utf-8")


def test_save_keeps_the_start_point_and_finished_runs_but_no_weights_or_unfinished_runs(tmp_path):
    output, records = tmp_path / "outputs" / "bench", tmp_path / "records"
    finish_run(output, 0)
    finish_run(output, 1)
    (output / "start_point.json").write_text("{}", encoding="utf-8")
    unfinished = learning_runs.run_directory(SETTING, 2, output)
    unfinished.mkdir(parents=True)
    (unfinished / "metrics.jsonl").write_text('{"iteration": 1}\n', encoding="utf-8")
    saved = save(output, records)
    assert saved == [Path("start_point.json"), Path("chain_G=4/seed0/held_out.json"),
                     Path("chain_G=4/seed0/metrics.jsonl"), Path("chain_G=4/seed1/held_out.json"),
                     Path("chain_G=4/seed1/metrics.jsonl")]
    archive = records / "bench" / "records.tar.xz"
    assert [path for path in records.rglob("*") if path.is_file()] == [archive]  # one compressed file, no copies
    assert archive.read_bytes().startswith(XZ_MAGIC)
    kept = read_archive(archive)
    assert sorted(kept) == sorted(f"bench/{name.as_posix()}" for name in saved)
    assert kept["bench/chain_G=4/seed1/metrics.jsonl"] == (output / "chain_G=4/seed1/metrics.jsonl").read_bytes()


def test_saving_the_same_runs_again_writes_the_same_bytes_and_keeps_the_other_outputs(tmp_path, monkeypatch):
    """Records of two outputs of one study share its archive; a save rewrites one output's runs, byte for byte the
    same when nothing changed (no times or owners inside), so git sees no change."""
    monkeypatch.setattr(studies, "STUDIES", (studies.Study("both", "t", outputs=(
        studies.Output("first", ("benchmarks/bench_learning.py",)),
        studies.Output("second", ("benchmarks/bench_learning.py",)))),))
    records = tmp_path / "records"
    for name in ("first", "second"):
        finish_run(tmp_path / name, 0)
        save(tmp_path / name, records)
    archive = records_of(tmp_path / "first", records)
    assert archive == records / "both" / "records.tar.xz"
    before = archive.read_bytes()
    save(tmp_path / "first", records)
    assert archive.read_bytes() == before
    again = tmp_path / "again" / studies.ARCHIVE
    write_archive(again, dict(reversed(read_archive(archive).items())))  # the same files in another order
    assert again.read_bytes() == before
    assert {name.split("/")[0] for name in read_archive(archive)} == {"first", "second"}


def test_restored_runs_are_reused_by_resume_without_training_or_evaluating(tmp_path, monkeypatch):
    output, records = tmp_path / "outputs" / "bench", tmp_path / "records"
    finish_run(output, 0)
    save(output, records)
    shutil.rmtree(output)  # a new machine: the same command's output folder, empty
    assert restore(output, records) == [Path("chain_G=4/seed0/held_out.json"), Path("chain_G=4/seed0/metrics.jsonl")]

    def must_not_run(*_args):
        raise AssertionError("a restored run was trained or evaluated again")

    monkeypatch.setattr(learning_runs, "train_run", must_not_run)
    monkeypatch.setattr(learning_runs, "held_out_scores", must_not_run)
    args = bench_learning.parse_args(["--resume", "--iterations", "2", "--output", str(output)])
    assert learning_runs.finished_run(TESTBED, SETTING, 0, "warm", args, output) == ([{"iteration": 2}],
                                                                                     [{"em": 0.0}])


def test_restore_leaves_runs_finished_here_alone_and_completes_a_killed_one(tmp_path):
    first_machine, records = tmp_path / "first" / "bench", tmp_path / "records"
    finish_run(first_machine, 0)
    finish_run(first_machine, 1)
    save(first_machine, records)
    output = tmp_path / "second" / "bench"
    finish_run(output, 0, iterations=5)  # finished here: newer than the record
    killed = learning_runs.run_directory(SETTING, 1, output)
    killed.mkdir(parents=True)
    (killed / "metrics.jsonl").write_text('{"iteration": 1}\n', encoding="utf-8")
    assert restore(output, records) == [Path("chain_G=4/seed1/held_out.json"), Path("chain_G=4/seed1/metrics.jsonl")]
    here = learning_runs.run_directory(SETTING, 0, output) / "metrics.jsonl"
    assert here.read_text(encoding="utf-8") == '{"iteration": 5}\n'
    assert (killed / "metrics.jsonl").read_text(encoding="utf-8") == '{"iteration": 2}\n'


def test_missing_records_and_half_written_runs_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no records of bench in .*records\.tar\.xz"):
        restore(tmp_path / "bench", tmp_path / "records")
    with pytest.raises(FileNotFoundError, match="no benchmark output folder"):
        save(tmp_path / "absent", tmp_path / "records")
    run = learning_runs.run_directory(SETTING, 0, tmp_path / "bench")
    run.mkdir(parents=True)
    (run / "held_out.json").write_text("{}", encoding="utf-8")
    with pytest.raises(FileNotFoundError, match=r"holds held_out\.json but not metrics\.jsonl"):
        record_files(tmp_path / "bench")


def test_a_demo_runs_records_are_its_result_and_metrics(tmp_path):
    """The pipelining protocol's runs are demo runs: demo.json is their final evaluation."""
    run = tmp_path / "pipelining" / "k0-seed0"
    run.mkdir(parents=True)
    (run / "demo.json").write_text("{}", encoding="utf-8")
    (run / "metrics.jsonl").write_text("{}\n", encoding="utf-8")
    (tmp_path / "pipelining" / "pipelining_learning.json").write_text("{}", encoding="utf-8")  # a report, no record
    assert save(tmp_path / "pipelining", tmp_path / "records") == [Path("k0-seed0/demo.json"),
                                                                   Path("k0-seed0/metrics.jsonl")]
    elsewhere = tmp_path / "new_machine" / "pipelining"
    assert restore(elsewhere, tmp_path / "records") == [Path("k0-seed0/demo.json"), Path("k0-seed0/metrics.jsonl")]
    assert (elsewhere / "k0-seed0" / "demo.json").read_text(encoding="utf-8") == "{}"
    assert restore(elsewhere, tmp_path / "records") == []  # finished here now: left alone


def test_records_live_outside_the_code_compressed() -> None:
    """The kept records are the repository's top-level results/, one compressed archive per study (no loose run
    files); benchmarks/ holds code, its README and the pinned input lists the code names (the lent machine's image
    and the vLLM kit's wheels), nothing a run wrote."""
    root = Path(__file__).resolve().parent.parent
    assert root / "results" == RECORDS
    loose = [path for path in RECORDS.rglob("*") if path.name in ("metrics.jsonl", "held_out.json", "demo.json",
                                                                 "start_point.json")]
    assert loose == []
    assert any(name.endswith("/metrics.jsonl") for name in read_archive(RECORDS / "budget_table" / studies.ARCHIVE))
    assert list(RECORDS.glob(f"*/{studies.LEGACY_ARCHIVE}")) == []  # converted: xz only
    code = {".py", ".sh", ".md"}
    inputs = {vllm_kit.IMAGE_FILE, vllm_kit.KIT_LIST}
    assert all(path.is_file() for path in inputs)
    assert [path for path in (root / "benchmarks").rglob("*")
            if path.is_file() and path.suffix not in code and "__pycache__" not in path.parts
            and path not in inputs] == []


def gzip_archive(path: Path, files: dict[str, bytes]) -> None:
    """A records archive as an older checkout wrote it: a gzip tar."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w:gz") as archive:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))


def test_a_legacy_gzip_archive_is_read_restored_and_replaced_by_the_xz_one_on_save(tmp_path):
    """Records an older checkout saved (records.tar.gz) are read, alone or beside a records.tar.xz (merged, the xz
    copy of a file winning); a save keeps them in the xz archive with the new runs and removes the gzip one."""
    records = tmp_path / "records"
    legacy = records / "bench" / studies.LEGACY_ARCHIVE
    gzip_archive(legacy, {"bench/start_point.json": b"{}", "bench/chain_G=4/seed0/held_out.json": b"{}",
                          "bench/chain_G=4/seed0/metrics.jsonl": b"{}\n"})
    output = tmp_path / "outputs" / "bench"
    assert restore(output, records) == [Path("chain_G=4/seed0/held_out.json"), Path("chain_G=4/seed0/metrics.jsonl"),
                                        Path("start_point.json")]
    shutil.rmtree(output / "chain_G=4")
    finish_run(output, 1)
    save(output, records)
    assert [path for path in records.rglob("*") if path.is_file()] == [records / "bench" / studies.ARCHIVE]
    assert sorted(read_archive(records / "bench" / studies.ARCHIVE)) == [
        "bench/chain_G=4/seed0/held_out.json", "bench/chain_G=4/seed0/metrics.jsonl",
        "bench/chain_G=4/seed1/held_out.json", "bench/chain_G=4/seed1/metrics.jsonl", "bench/start_point.json"]
    # a legacy archive copied in beside the xz one (an older checkout's queue saved a run since): nothing is lost
    gzip_archive(legacy, {"bench/start_point.json": b"older", "bench/chain_G=4/seed2/held_out.json": b"{}"})
    save(output, records)
    assert not legacy.exists()
    kept = read_archive(records / "bench" / studies.ARCHIVE)
    assert "bench/chain_G=4/seed2/held_out.json" in kept and kept["bench/start_point.json"] == b"{}"


def test_an_interrupted_write_leaves_the_old_archive_whole(tmp_path, monkeypatch):
    path = tmp_path / studies.ARCHIVE
    write_archive(path, {"bench/a": b"old"})

    def killed(*_args):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        write_archive(path, {"bench/a": b"new"})
    assert read_archive(path) == {"bench/a": b"old"}


def test_folders_removed_while_a_save_walks_the_output_are_passed_over(tmp_path, monkeypatch):
    """Runs in progress delete their checkpoints as they end, while the queue's save loop walks the output: a folder
    gone before it is listed must not end the save (pathlib's rglob raised FileNotFoundError)."""
    output = tmp_path / "bench"
    finish_run(output, 0)
    running = learning_runs.run_directory(SETTING, 1, output)
    (running / "checkpoints" / "iteration_1").mkdir(parents=True)
    (running / "scratch" / "part").mkdir(parents=True)
    listing = os.scandir

    def removed_first(path="."):
        gone = ("checkpoints", "latest", "iteration_1", "scratch", "part")
        if isinstance(path, (str, os.PathLike)) and Path(path).name in gone:  # the run removes it now (not rmtree's fd)
            shutil.rmtree(path, ignore_errors=True)
        return listing(path)

    monkeypatch.setattr(os, "scandir", removed_first)
    assert save(output, tmp_path / "records") == [Path("chain_G=4/seed0/held_out.json"),
                                                  Path("chain_G=4/seed0/metrics.jsonl")]
    assert not (running / "scratch").exists()  # removed mid-walk indeed


def test_the_outputs_top_level_files_are_kept_and_restored_but_not_over_this_machines(tmp_path):
    """The decision test's start check and start probe go with the start point: a new machine neither checks nor
    probes its start again."""
    output, records = tmp_path / "first" / "bench", tmp_path / "records"
    finish_run(output, 0)
    for name in ("start_point.json", "start-check.json", "start_probe.json"):
        (output / name).write_text(f'"{name} from the first machine"', encoding="utf-8")
    (output / "start-check.md").write_text("a report, no record", encoding="utf-8")
    assert save(output, records)[:3] == [Path("start_point.json"), Path("start-check.json"),
                                         Path("start_probe.json")]
    elsewhere = tmp_path / "second" / "bench"
    elsewhere.mkdir(parents=True)
    (elsewhere / "start_probe.json").write_text('"this machine\'s"', encoding="utf-8")
    assert restore(elsewhere, records) == [Path("chain_G=4/seed0/held_out.json"), Path("chain_G=4/seed0/metrics.jsonl"),
                                           Path("start-check.json"), Path("start_point.json")]
    assert (elsewhere / "start-check.json").read_text(encoding="utf-8") == '"start-check.json from the first machine"'
    assert (elsewhere / "start_probe.json").read_text(encoding="utf-8") == '"this machine\'s"'
    assert not (elsewhere / "start-check.md").exists()
