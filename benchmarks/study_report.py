"""A learning study's report rebuilt from its records alone: no training, no evaluation, no start policy.

    python benchmarks/study_report.py budget_table    # results/budget_table/README.md's generated section, its plot

For each benchmark output the study keeps (``benchmarks/studies.py``), the command that trained it declares the runs
(its settings x seeds) and each run's run.py options; the records (``records.tar.xz``) must hold exactly those runs,
made with those options (less ``--output``, ``--model`` and ``--data-dir``, which say where a machine kept things)
and the start point: a run missing, one not declared or one made otherwise is named, and no table is printed
(``SystemExit``). The first output whose section the study's README holds then gets it rewritten from the records
(the benchmark's own table and plot, ``learning_report``), under the protocol's line (``protocol_times``: whether the
protocol was committed before the first record and left alone since). The other outputs (pilots kept beside, whose
testbed may share the section's name) are only checked. A script that is not a learning benchmark (no ``testbed``)
but says what its records must hold (``record_problems``, as ``bench_hotpotqa.py``) is checked the same way and its
report left to its own command; a folder in the archive that no output of the study names is named too. A study that
declares no command has nothing to check against: the report says so. A testbed that keeps more beside its runs
(``record_problems_beside``) has it checked, and its other sections rebuilt (``rebuild_sections_beside``).
"""

from __future__ import annotations

import argparse
import importlib
import json
import shlex
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any

from benchmarks.learning_report import write_docs_section, write_results
from benchmarks.learning_runs import FINAL_EVALUATION, START_POINT, run_directory, run_options
from benchmarks.learning_testbed import Testbed
from benchmarks.protocol_times import protocol_reading
from benchmarks.run_records import RECORDS, output_files, read_archive
from benchmarks.studies import ARCHIVE, Output, Study, study
from experiments.plot import METRICS_FILE

WHERE_OPTIONS = ("--output", "--model", "--data-dir")  # say where a machine kept things, not how a run was made


class IncompleteRecords(SystemExit):
    """The records are not the declared runs: what is missing or unexpected, one line each."""


def benchmark(command: tuple[str, ...]) -> ModuleType | None:
    """The learning benchmark that ``command`` runs (``benchmarks/NAME.py`` with ``parse_args`` and a ``testbed``
    function or a ``TESTBED``), else None."""
    module = importlib.import_module("benchmarks." + Path(command[0]).stem)
    has_testbed = hasattr(module, "testbed") or hasattr(module, "TESTBED")
    return module if has_testbed and hasattr(module, "parse_args") else None


def declared(output: Output, module: ModuleType) -> tuple[argparse.Namespace, Testbed]:
    """The benchmark's options and testbed as ``output``'s command gives them; a ``SystemExit`` where the command
    would write another output."""
    args = module.parse_args(list(output.command[1:]))
    writes_here(output, args)
    return args, module.testbed(args) if hasattr(module, "testbed") else module.TESTBED


def writes_here(output: Output, args: argparse.Namespace) -> None:
    """A ``SystemExit`` where ``output``'s command (parsed into ``args``) would write another output."""
    if Path(args.output).name != output.name:
        raise SystemExit(f"benchmarks/studies.py: {shlex.join(output.command)} writes {args.output}, not "
                         f"outputs/{output.name}: fix the study's command")


def without_where(options: list[str]) -> list[str]:
    """run.py's options less ``WHERE_OPTIONS`` and their values."""
    kept, skip = [], False
    for option in options:
        if skip:
            skip = False
        elif option in WHERE_OPTIONS:
            skip = True
        else:
            kept.append(option)
    return kept


def check_runs(output: Output, files: dict[Path, bytes], args: argparse.Namespace, bed: Testbed) -> list[str]:
    """What is wrong with ``output``'s records against its declared runs, one line each (none: complete)."""
    problems = [] if Path(START_POINT) in files else [f"{output.name}: no {START_POINT}"]
    runs = {run_directory(setting, seed, Path()): (setting, seed) for seed in args.seeds for setting in args.settings}
    present = {name.parent for name in files if name.name in (FINAL_EVALUATION, METRICS_FILE)}
    problems += [f"{output.name}: run {run} is missing" for run in sorted(runs.keys() - present)]
    problems += [f"{output.name}: run {run} is not declared by its command" for run in sorted(present - runs.keys())]
    for run in sorted(present & runs.keys()):
        missing = [name for name in (METRICS_FILE, FINAL_EVALUATION) if run / name not in files]
        if missing:
            problems += [f"{output.name}: run {run} has no {name}" for name in missing]
            continue
        setting, seed = runs[run]
        saved = json.loads(files[run / FINAL_EVALUATION]).get("run") or []
        expected = run_options(bed, setting, seed, "-", args, run)
        if without_where(saved) != without_where(expected):
            problems.append(f"{output.name}: run {run} was made with other options than its command's "
                            f"({shlex.join(without_where(saved))})")
    return problems


def scores_and_metrics(files: dict[Path, bytes], run: Path) -> tuple[list[dict], list[dict[str, Any]]]:
    rows = [json.loads(line) for line in files[run / METRICS_FILE].decode("utf-8").splitlines() if line.strip()]
    return rows, json.loads(files[run / FINAL_EVALUATION])["scores"]


def rewrite_section(entry: Study, output: Output, files: dict[Path, bytes], args: argparse.Namespace,
                    bed: Testbed, protocol: str) -> Path:
    """The output's section of the study's README and its plot, from the records; the README's path."""
    start = json.loads(files[Path(START_POINT)])
    runs: dict[str, list[list[dict]]] = {setting: [] for setting in args.settings}
    finals: dict[str, list[list[dict[str, Any]]]] = {setting: [] for setting in args.settings}
    for seed in args.seeds:
        for setting in args.settings:
            rows, scores = scores_and_metrics(files, run_directory(setting, seed, Path()))
            runs[setting].append(rows)
            finals[setting].append(scores)
    with tempfile.TemporaryDirectory(prefix="study-report-") as tmp:
        table, plot = write_results(bed, runs, finals, start["scores"], args, start["model"], 0.0, Path(tmp))
        count = sum(len(seeds) for seeds in runs.values())
        header = (f"Rebuilt from the records (`outputs/{output.name}` in `{ARCHIVE}`: {count} runs) by `python "
                  f"benchmarks/study_report.py {entry.folder}`; trained by `python {shlex.join(output.command)}` "
                  f"(with --resume, then --report). {protocol}")
        return write_docs_section(bed, args, table, plot, header)


def report(folder: str, records: Path = RECORDS) -> list[Path]:
    """Check every output of study ``folder`` against its command, then rewrite the sections its README holds;
    the READMEs written. ``IncompleteRecords`` (naming each problem) before anything is written."""
    entry = study(folder)
    archive = read_archive(records / folder / ARCHIVE)
    checked, problems = [], []
    names = {output.name for output in entry.outputs}
    problems += [f"{top}: a folder no output of the study names" for top in sorted({name.split("/")[0]
                                                                                    for name in archive} - names)]
    for output in entry.outputs:
        files = output_files(archive, output.name)
        if not files:
            problems.append(f"{output.name}: no records in {ARCHIVE}")
            continue
        module = benchmark(output.command)
        if module is None:  # not a learning benchmark: its own rules for what a record holds
            own = importlib.import_module("benchmarks." + Path(output.command[0]).stem)
            if not hasattr(own, "record_problems"):
                raise SystemExit(f"{output.command[0]} is neither a learning benchmark nor says what its records "
                                 f"hold (record_problems): results/{folder} cannot be checked")
            args = own.parse_args(list(output.command[1:]))
            writes_here(output, args)
            problems += [f"{output.name}: {problem}" for problem in own.record_problems(files, args, output.copied)]
            continue
        args, bed = declared(output, module)
        problems += check_runs(output, files, args, bed)
        if hasattr(module, "record_problems_beside"):  # what the testbed keeps beside its runs (bench_decision)
            problems += [f"{output.name}: {problem}" for problem in module.record_problems_beside(files, args)]
        checked.append((output, files, args, bed, module))
    if problems:
        raise IncompleteRecords(f"results/{folder}/{ARCHIVE} is not the study's declared runs; no table printed:\n"
                                + "\n".join(f"  {problem}" for problem in problems))
    protocol, written, readmes = protocol_reading(entry), set(), []
    for output, files, args, bed, module in checked:
        if bed.name in entry.sections and bed.name not in written:  # a pilot kept beside shares its testbed's name
            readmes.append(rewrite_section(entry, output, files, args, bed, protocol))
            written.add(bed.name)
            if hasattr(module, "rebuild_sections_beside"):  # its other sections, from the records on disk
                with tempfile.TemporaryDirectory(prefix="study-records-") as tmp:
                    for name, data in files.items():
                        (Path(tmp) / output.name / name).parent.mkdir(parents=True, exist_ok=True)
                        (Path(tmp) / output.name / name).write_bytes(data)
                    module.rebuild_sections_beside(Path(tmp) / output.name, args)
    return readmes


def main(argv: list[str] | None = None) -> list[Path]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("study", help="a study's folder name (benchmarks/studies.py)")
    entry = study(p.parse_args(argv).study)
    written = report(entry.folder)
    if not entry.outputs:
        print(f"results/{entry.folder}: not checked: the study declares no command whose runs its records must hold")
    else:
        print("\n".join(str(path) for path in written) or "records complete (each output's declared runs); no "
                                                          "section of this study is rebuilt here")
    print(protocol_reading(entry))
    return written


if __name__ == "__main__":
    main()
