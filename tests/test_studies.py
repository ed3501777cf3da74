"""The science record as an appendix (benchmarks/studies.py, study_report.py, protocol_times.py): each study's
folder, a report rebuilt from the compressed records alone that refuses records that are not the declared runs, and
the protocol's commit time against the first record's."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
from pathlib import Path

import pytest

import benchmarks.bench_learning as bench_learning
import benchmarks.learning_runs as learning_runs
import benchmarks.study_report as study_report
from benchmarks import studies
from benchmarks.protocol_times import protocol_reading, section
from benchmarks.run_records import RECORDS, output_files, read_archive, save
from benchmarks.studies import Output, Protocol, Study, folder_of_output, section_file

ROOT = Path(__file__).resolve().parent.parent
SETTING = "tree (2,2,1)"
COMMAND = ("benchmarks/bench_learning.py", "--settings", SETTING, "--seeds", "0", "1", "--eval-questions", "4",
           "--curve-questions", "2", "--output", "outputs/bench")


def toy_study(monkeypatch, protocol: Protocol | None = None) -> Study:
    entry = Study("toy", "a toy study", protocol, (Output("bench", COMMAND),), ("learning",))
    monkeypatch.setattr(studies, "STUDIES", (entry,))
    return entry


def finish_run(output: Path, seed: int, args, *, lr: str | None = None) -> None:
    """A finished run as the benchmark leaves it (metrics, final evaluation keyed by its options); ``lr``: made with
    another learning rate than its command's."""
    directory = learning_runs.run_directory(SETTING, seed, output)
    directory.mkdir(parents=True)
    rows = [{"iteration": i, "dev_em": 0.5 * i, "tokens_generated": 100, "tokens_generated_total": 100 * i,
             "tool_calls": 4, "reward_mean": 0.2 * i, "time_s": 2.0} for i in (1, 2)]
    (directory / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    options = learning_runs.run_options(bench_learning.TESTBED, SETTING, seed, "warm", args, directory)
    if lr is not None:
        options[options.index("--lr") + 1] = lr
    scores = [{"em": em, "tool_calls": 2.0, "answered": 1.0, "hops": 2.0} for em in (1, 0, 1, seed % 2)]
    (directory / "held_out.json").write_text(json.dumps({"run": options, "eval_questions": 4, "scores": scores}),
                                             encoding="utf-8")


def records(tmp_path: Path, seeds: tuple[int, ...], *, lr: str | None = None) -> Path:
    """The toy study's records of ``seeds`` (one made with ``lr``), saved as run_records.py saves them."""
    output = tmp_path / "outputs" / "bench"
    args = bench_learning.parse_args(list(COMMAND[1:]))
    (output / "start_point.json").parent.mkdir(parents=True)
    start = [{"em": 0.0, "tool_calls": 2.0, "answered": 1.0, "hops": 2.0}] * 4
    (output / "start_point.json").write_text(json.dumps({"model": "warm", "scores": start}), encoding="utf-8")
    for seed in seeds:
        finish_run(output, seed, args, lr=lr if seed == seeds[-1] else None)
    save(output, tmp_path / "records")
    return tmp_path / "records"


def nothing_trains(monkeypatch) -> None:
    def must_not_run(*_args, **_kwargs):
        raise AssertionError("the report trained or evaluated a run")

    monkeypatch.setattr(learning_runs, "train_run", must_not_run)
    monkeypatch.setattr(learning_runs, "held_out_scores", must_not_run)


def test_complete_records_rebuild_the_studys_section_and_plot_without_training(tmp_path, monkeypatch):
    toy_study(monkeypatch)
    kept = records(tmp_path, (0, 1))
    nothing_trains(monkeypatch)
    monkeypatch.chdir(tmp_path)
    assert study_report.report("toy", kept) == [Path("results/toy/README.md")]
    readme = (tmp_path / "results" / "toy" / "README.md").read_text(encoding="utf-8")
    assert readme.startswith("# Learning: tree vs chain on SynthHop-v0") and "<!-- learning:begin -->" in readme
    assert "Rebuilt from the records (`outputs/bench` in `records.tar.xz`: 2 runs)" in readme
    assert "No protocol was declared for this study." in readme
    assert f"| {SETTING} | 4 | 200 |" in readme and (tmp_path / "results" / "toy" / "learning.png").is_file()


def test_a_pilot_kept_beside_the_study_is_checked_but_does_not_write_over_its_section(tmp_path, monkeypatch):
    """A pilot's output (another --output, the same testbed) shares the section's key: the section is the study's
    main output's, whatever order the archive holds them in."""
    pilot = ("benchmarks/bench_learning.py", "--settings", SETTING, "--seeds", "0", "--eval-questions", "4",
             "--curve-questions", "2", "--output", "outputs/pilot")
    toy = Study("toy", "a toy study", None, (Output("bench", COMMAND), Output("pilot", pilot)), ("learning",))
    monkeypatch.setattr(studies, "STUDIES", (toy,))
    kept = records(tmp_path, (0, 1))
    output, args = tmp_path / "outputs" / "pilot", bench_learning.parse_args(list(pilot[1:]))
    output.mkdir()
    (output / "start_point.json").write_bytes((tmp_path / "outputs" / "bench" / "start_point.json").read_bytes())
    finish_run(output, 0, args)
    save(output, kept)
    monkeypatch.chdir(tmp_path)
    assert study_report.report("toy", kept) == [Path("results/toy/README.md")]
    assert "`outputs/bench` in `records.tar.xz`: 2 runs" in (tmp_path / "results" / "toy" / "README.md").read_text()
    finish_run(output, 1, args)  # a pilot run its command does not declare: named all the same
    save(output, kept)
    with pytest.raises(study_report.IncompleteRecords, match="pilot: run tree_221/seed1 is not declared"):
        study_report.report("toy", kept)


@pytest.mark.parametrize(("seeds", "lr", "named"), [
    ((0,), None, "bench: run tree_221/seed1 is missing"),
    ((0, 1, 2), None, "bench: run tree_221/seed2 is not declared by its command"),
    ((0, 1), "0.5", "bench: run tree_221/seed1 was made with other options than its command's"),
])
def test_records_that_are_not_the_declared_runs_are_named_and_no_table_is_printed(tmp_path, monkeypatch, seeds, lr,
                                                                                   named):
    toy_study(monkeypatch)
    kept = records(tmp_path, seeds, lr=lr)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(study_report.IncompleteRecords, match="no table printed") as refused:
        study_report.report("toy", kept)
    assert named in str(refused.value) and not (tmp_path / "results").exists()


def test_a_run_without_its_final_evaluation_and_a_folder_no_output_names_are_refused(tmp_path, monkeypatch):
    toy_study(monkeypatch)
    kept = records(tmp_path, (0, 1))
    (tmp_path / "outputs" / "bench" / "tree_221" / "seed1" / "held_out.json").unlink()  # metrics only: unfinished
    stray = tmp_path / "outputs" / "other"  # an output the study does not name
    stray.mkdir()
    (stray / "start_point.json").write_text("{}", encoding="utf-8")
    archive = read_archive(kept / "toy" / studies.ARCHIVE)
    del archive["bench/tree_221/seed1/held_out.json"]
    archive["other/start_point.json"] = b"{}"
    from benchmarks.run_records import write_archive

    write_archive(kept / "toy" / studies.ARCHIVE, archive)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(study_report.IncompleteRecords) as refused:
        study_report.report("toy", kept)
    assert "bench: run tree_221/seed1 has no held_out.json" in str(refused.value)
    assert "other: a folder no output of the study names" in str(refused.value)


def hotpotqa_records(arms: dict[str, tuple[int, ...]], start: str = "d1", iterations: int = 20) -> dict[Path, bytes]:
    """An output of bench_hotpotqa as its records keep it: the start's evaluation, each run's files (its config.yaml
    with its arm's options, ``iterations`` rows of metrics)."""
    import yaml

    from benchmarks.bench_hotpotqa import RUN_RECORDS, START_RECORD, arm_settings

    files = {Path("start") / start / "eval" / "eval.json": b"{}"}
    for arm, seeds in arms.items():
        config = arm_settings(arm)
        for seed in seeds:
            run = Path(f"{arm}_s{seed}")
            files |= {run / name: b"{}" for name in RUN_RECORDS}
            files[run / START_RECORD] = json.dumps({"start": start}).encode()
            files[run / "config.yaml"] = yaml.safe_dump(config).encode()
            files[run / "metrics.jsonl"] = "".join(f'{{"iteration": {i}}}\n' for i in range(iterations)).encode()
    return files


def test_a_studys_own_record_rules_are_checked_with_its_copied_runs():
    """bench_hotpotqa is no learning testbed: its records are checked by its own rules (record_problems), the runs
    its command declares and those copied in from another study."""
    from benchmarks.bench_hotpotqa import parse_args, record_problems

    args = parse_args(["--arms", "tree_f1", "--seeds", "0", "1"])
    copied = ("tree_s0",)
    complete = hotpotqa_records({"tree_f1": (0, 1), "tree": (0,)})
    assert record_problems(complete, args, copied) == []
    assert record_problems(complete, args) == ["tree_s0 is not a run its command declares"]
    partial = {k: v for k, v in complete.items() if k != Path("tree_f1_s1") / "metrics.jsonl"}
    assert record_problems(partial, args, copied) == ["run tree_f1_s1 has no metrics.jsonl"]
    assert record_problems(hotpotqa_records({"tree_f1": (0,), "tree": (0,)}), args, copied) == [
        "run tree_f1_s1 is missing"]
    other_start = {**complete, Path("tree_s0") / "start.json": json.dumps({"start": "d2"}).encode()}
    assert record_problems(other_start, args, copied) == ["run tree_s0 trained from a start whose evaluation is not "
                                                          "kept"]
    # a run made otherwise than its arm (another reward), or trained for other iterations than the command's
    other = {**complete, **{k: v for k, v in hotpotqa_records({"tree_f1": (1,)}, iterations=12).items()
                            if k.parts[0] != "start"}}
    other[Path("tree_f1_s0") / "config.yaml"] = b"algo: tree_grpo\nreward: em\n"
    assert record_problems(other, args, copied) == ["run tree_f1_s0 was made with reward 'em', not 'f1'",
                                                    "run tree_f1_s1 trained 12 iterations, not the command's 20"]


def test_a_command_that_writes_another_output_than_its_studys_is_refused(tmp_path, monkeypatch):
    from benchmarks.run_records import write_archive

    command = ("benchmarks/bench_hotpotqa.py", "--arms", "tree", "--seeds", "0")  # writes outputs/hotpotqa_cpu
    monkeypatch.setattr(studies, "STUDIES", (Study("toy", "t", None, (Output("hotpotqa_x", command),)),))
    files = {f"hotpotqa_x/{name.as_posix()}": data for name, data in hotpotqa_records({"tree": (0,)}).items()}
    write_archive(tmp_path / "toy" / studies.ARCHIVE, files)
    with pytest.raises(SystemExit, match="writes outputs/hotpotqa_cpu, not outputs/hotpotqa_x: fix the study's"):
        study_report.report("toy", tmp_path)


def test_a_study_without_a_command_says_it_was_not_checked(monkeypatch, capsys):
    monkeypatch.setattr(studies, "STUDIES", (Study("toy", "a toy study"),))
    monkeypatch.setattr(study_report, "report", lambda folder: [])
    study_report.main(["toy"])
    out = capsys.readouterr().out
    assert "results/toy: not checked" in out and "No protocol was declared" in out and "complete" not in out


def test_a_study_not_registered_is_named_with_the_registered_ones(monkeypatch):
    toy_study(monkeypatch)
    with pytest.raises(KeyError, match=r"no study 'elsewhere' .*registered: toy"):
        study_report.report("elsewhere")


def test_sections_and_records_go_to_their_studys_folder(monkeypatch):
    toy_study(monkeypatch)
    assert section_file("learning", "outputs/anything") == Path("results/toy/README.md")  # a registered section
    assert section_file("branching-pilot", "outputs/bench") == Path("results/toy/README.md")  # its output's study
    assert section_file("branching-pilot", "outputs/bench_x") == Path("results/bench_x/README.md")  # neither
    assert folder_of_output("bench") == "toy" and folder_of_output("other") == "other"


def test_a_section_is_its_heading_to_the_next_of_its_level():
    text = "# P\n## A design\nx\n### its log\ny\n## B\nz\n"
    assert section(text, "A design") == "## A design\nx\n### its log\ny"
    assert section(text, "B") == "## B\nz" and section(text, "C") is None


def git(root: Path, *args: str, when: int = 0) -> None:
    date = f"@{1_700_000_000 + when} +0000"
    env = {**os.environ, "GIT_AUTHOR_DATE": date, "GIT_COMMITTER_DATE": date, "GIT_AUTHOR_NAME": "t",
           "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    subprocess.run(["git", *args], cwd=root, env=env, check=True, capture_output=True)


def commit(root: Path, files: dict[str, str], when: int) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text, encoding="utf-8")
    git(root, "add", "-A")
    git(root, "commit", "-q", "-m", f"at {when}", when=when)


PROTOCOL = Protocol("docs/protocol.md", "The design")
DECLARED = "# Protocols\n## The design\nten seeds\n## Another\n"
LOGGED = "# Protocols\n## The design\nten seeds\n### Log\n- started\n## Another\n"


@pytest.mark.parametrize(("history", "reading"), [
    ([{"docs/protocol.md": DECLARED}, {"results/toy/records.tar.gz": "r"},
      {"docs/protocol.md": DECLARED + "more about another design\n"}], "and not edited since"),
    ([{"docs/protocol.md": "# Protocols\n## The design\nten seeds\n"}, {"results/toy/records.tar.gz": "r"},
      {"docs/protocol.md": "# Protocols\n## The design\nten seeds\n\n## A later design\n"}], "and not edited since"),
    ([{"docs/protocol.md": DECLARED}, {"results/toy/records.tar.gz": "r"},
      {"docs/protocol.md": DECLARED.replace("ten", "twelve")}], "PROTOCOL EDITED AFTER ITS FIRST RECORD, in "),
    ([{"docs/protocol.md": "# Protocols\n"}, {"results/toy/records.tar.gz": "r"}, {"docs/protocol.md": DECLARED}],
     "PROTOCOL COMMITTED AFTER ITS FIRST RECORD"),
    ([{"docs/protocol.md": DECLARED, "results/toy/records.tar.gz": "r"}],
     "PROTOCOL COMMITTED IN THE SAME COMMIT AS ITS FIRST RECORD"),
    ([{"docs/protocol.md": LOGGED}, {"results/toy/records.tar.gz": "r"},  # the log grows as runs go: no edit
      {"docs/protocol.md": LOGGED.replace("- started\n", "- started\n- seed 0 done\n")}], "and not edited since"),
    ([{"docs/protocol.md": LOGGED}, {"results/toy/records.tar.gz": "r"},
      {"docs/protocol.md": LOGGED.replace("ten", "twelve")}], "PROTOCOL EDITED AFTER ITS FIRST RECORD, in "),
    ([{"results/toy/README.md": "the question"}, {"docs/protocol.md": DECLARED},  # the folder's README is no record
      {"results/toy/records.tar.gz": "r"}], "and not edited since"),
    ([{"docs/protocol.md": DECLARED}, {"results/bench/seed0/held_out.json": "r"},  # before the study's folder
      {"docs/protocol.md": DECLARED.replace("ten", "twelve")}, {"results/toy/records.tar.gz": "r"}],
     "PROTOCOL EDITED AFTER ITS FIRST RECORD"),
    ([{"docs/protocol.md": DECLARED}, {"results/toy/records.tar.gz": "r"},  # records converted to xz later
      {"docs/protocol.md": DECLARED.replace("ten", "twelve")}, {"results/toy/records.tar.xz": "x"}],
     "PROTOCOL EDITED AFTER ITS FIRST RECORD"),
])
def test_the_protocols_commit_time_is_read_against_the_first_records(tmp_path, history, reading):
    git(tmp_path, "init", "-q")
    for when, files in enumerate(history):
        commit(tmp_path, files, when * 60)
    entry = Study("toy", "a toy study", PROTOCOL, (Output("bench", COMMAND),))
    assert reading in protocol_reading(entry, tmp_path)


def test_the_reading_names_the_commit_that_gave_the_section_its_form_and_plots_are_no_records(tmp_path):
    git(tmp_path, "init", "-q")
    twelve = DECLARED.replace("ten", "twelve")
    history = [{"docs/protocol.md": DECLARED}, {"results/toy/curves.png": "drawn"}, {"docs/protocol.md": twelve},
               {"docs/protocol.md": twelve + "more about another design\n"}, {"results/toy/records.tar.xz": "r"}]
    for when, files in enumerate(history):
        commit(tmp_path, files, when * 60)
    shas = subprocess.run(["git", "rev-list", "--reverse", "HEAD"], cwd=tmp_path, check=True, capture_output=True,
                          text=True).stdout.split()
    reading = protocol_reading(Study("toy", "a toy study", PROTOCOL, (Output("bench", COMMAND),)), tmp_path)
    # the plot came before the edit to twelve seeds, the records after it; the last commit before the records
    # touched another section only
    assert f"the section as committed at {shas[2][:7]} " in reading and "not edited since" in reading


def test_an_uncommitted_edit_and_a_study_without_records_are_said_so(tmp_path):
    git(tmp_path, "init", "-q")
    commit(tmp_path, {"docs/protocol.md": DECLARED}, 0)
    entry = Study("toy", "a toy study", PROTOCOL)
    assert "no record of the study is committed yet" in protocol_reading(entry, tmp_path)
    commit(tmp_path, {"results/toy/records.tar.gz": "r"}, 60)
    (tmp_path / "docs" / "protocol.md").write_text(DECLARED.replace("ten", "nine"), encoding="utf-8")
    assert "EDITED AFTER ITS FIRST RECORD, in the working tree (not committed)" in protocol_reading(entry, tmp_path)
    assert protocol_reading(Study("none", "t"), tmp_path) == "No protocol was declared for this study."


# -- the committed record ---------------------------------------------------------------------------------------------


def test_every_study_has_its_folder_and_readme_and_keeps_its_outputs_records():
    for entry in studies.STUDIES:
        readme = ROOT / studies.RESULTS / entry.folder / studies.README
        assert readme.is_file(), readme
        text = readme.read_text(encoding="utf-8")
        assert all(f"<!-- {key}:begin -->" in text for key in entry.sections), entry.folder
        names = {name.split("/")[0] for name in read_archive(RECORDS / entry.folder / studies.ARCHIVE)}
        assert names == {output.name for output in entry.outputs}, entry.folder


def test_the_index_points_to_every_study_and_the_pages_keep_their_sizes():
    index = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    assert all(f"results/{entry.folder}/" in index for entry in studies.STUDIES)
    assert len(index.splitlines()) <= 600
    assert len((ROOT / "docs" / "status.md").read_text(encoding="utf-8").splitlines()) <= 120
    assert sum(path.stat().st_size for path in RECORDS.rglob("*") if path.is_file()) <= 4 * 2**20


def test_every_kept_output_holds_the_runs_its_command_declares():
    """The studies' commands are the ones that made their records: each output's runs, options and start point."""
    for entry in studies.STUDIES:
        archive = read_archive(RECORDS / entry.folder / studies.ARCHIVE)
        for output in entry.outputs:
            module = study_report.benchmark(output.command)
            files = output_files(archive, output.name)
            if module is not None:
                args, bed = study_report.declared(output, module)
                assert study_report.check_runs(output, files, args, bed) == [], output.name
            else:  # a benchmark with its own record rules (bench_hotpotqa, pipelining_learning)
                own = importlib.import_module("benchmarks." + Path(output.command[0]).stem)
                args = own.parse_args(list(output.command[1:]))
                assert own.record_problems(files, args, output.copied) == [], output.name
