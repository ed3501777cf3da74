"""A learning benchmark's run records, kept in the repository, so that a benchmark longer than one machine's life
(whose disk, with outputs/ and the cache, is not kept between sessions) goes on where it stopped, and its report can
be rebuilt without training (``benchmarks/study_report.py``).

    python benchmarks/run_records.py save outputs/budget_table      # after runs end: keep their records
    python benchmarks/run_records.py restore outputs/budget_table   # on a new machine, before --resume

A finished run's record is what ``--resume`` and the reports read of it: its final evaluation (``held_out.json``,
keyed by the run's options, so it is reused only by the same command from the same start; a demo run's
``demo.json``) and its metrics (``metrics.jsonl``); with them the output's top-level files that say where its runs
started (``TOP_FILES``: the start point's evaluation, ``start_point.json``; the decision test's start check and
probe). Checkpoints and models are not kept: a restored run is reported, never trained on. A run without its final
evaluation is not finished and is not kept. Records live compressed in their study's folder at the repository's top
level (``benchmarks/studies.py``: ``results/STUDY/records.tar.xz``, one top-level folder per benchmark output, laid
out as the output; an output no study registers gets ``results/NAME/``), written byte for byte the same for the
same files, so that saving again changes nothing git sees. An older checkout wrote them as ``records.tar.gz``
(``studies.LEGACY_ARCHIVE``, the same files): read too where one is beside ``records.tar.xz`` (or alone), removed
once ``records.tar.xz`` is written.
"""

from __future__ import annotations

import argparse
import io
import lzma
import os
import tarfile
from pathlib import Path

from benchmarks.learning_runs import FINAL_EVALUATION, START_POINT
from benchmarks.studies import ARCHIVE, LEGACY_ARCHIVE, RESULTS, folder_of_output
from experiments.plot import METRICS_FILE

RECORDS = Path(__file__).resolve().parent.parent / RESULTS  # the repository's top level: benchmarks/ holds code
DEMO_RESULT = "demo.json"  # experiments/demo.py's final evaluation (the pipelining protocol's runs)
RUN_ENDS = (FINAL_EVALUATION, DEMO_RESULT)  # a run folder holding one of these has finished
# An output's top-level files kept, where present: the start point's evaluation; the decision test's start-policy
# check (benchmarks/decision_check.py's START_CHECK) and start probe (benchmarks/bench_decision.py's
# START_PROBE), named here because the queue's save loop runs this file, which imports no benchmark
# (tests/test_bench_decision.py checks the names agree)
TOP_FILES = (START_POINT, "start-check.json", "start_probe.json")
CHECKPOINTS = "checkpoints"  # a run's checkpoint folder: no record in it, and runs delete it as they end
XZ_PRESET = 9 | lzma.PRESET_EXTREME


def run_ends(output: Path) -> list[Path]:
    """Every finished run's end file (``RUN_ENDS``) below ``output``, sorted. Runs in progress delete their
    checkpoints as a save walks them: checkpoint folders are not entered, and a folder gone before it is listed is
    passed over (``os.walk`` leaves out what it cannot list) rather than ending the save."""
    ends = []
    for folder, subfolders, names in os.walk(output):
        subfolders[:] = [name for name in subfolders if name != CHECKPOINTS]
        ends += [Path(folder) / name for name in names if name in RUN_ENDS]
    return sorted(ends)


def record_files(output: Path) -> list[Path]:
    """The files of ``output`` (a benchmark's output folder) that its records keep, relative to it: its top-level
    files (``TOP_FILES``) and every finished run's files, sorted."""
    kept = [Path(name) for name in TOP_FILES if (output / name).is_file()]
    for end in run_ends(output):  # run by run
        run = end.parent
        if not (run / METRICS_FILE).is_file():
            raise FileNotFoundError(f"{run} holds {end.name} but not {METRICS_FILE}: a finished run holds "
                                    f"{end.name} and {METRICS_FILE}")
        kept += [(run / name).relative_to(output) for name in (end.name, METRICS_FILE)]
    return kept


def records_of(output: Path, records: Path = RECORDS) -> Path:
    """The archive that keeps the records of ``output``."""
    return records / folder_of_output(output.resolve().name) / ARCHIVE


def legacy_of(path: Path) -> Path | None:
    """The gzip archive an older checkout wrote where ``path`` (a study's ``ARCHIVE``) now goes; None for any other
    path."""
    return path.with_name(LEGACY_ARCHIVE) if path.name == ARCHIVE else None


def read_archive(path: Path) -> dict[str, bytes]:
    """Every file of a records archive, by its name inside it (``OUTPUT/SETTING/seedS/metrics.jsonl``), with those
    of the legacy gzip archive beside it (saved by an older checkout; ``path``'s own copy of a file wins), so that a
    save, which removes the legacy archive, loses none of its runs; none without either."""
    legacy = legacy_of(path)
    files: dict[str, bytes] = {}
    for source in (legacy, path):
        if source is not None and source.is_file():
            with tarfile.open(source, "r:*") as archive:
                files.update({member.name: archive.extractfile(member).read() for member in archive.getmembers()
                              if member.isfile()})
    return files


def write_archive(path: Path, files: dict[str, bytes]) -> None:
    """``files`` as an xz-compressed tar at ``path``, the same bytes for the same files (sorted, no times, no owners),
    written beside it first and moved over it, so that an interrupted write leaves the old archive whole; then the
    legacy gzip archive beside it, if any, is removed (its files were read into ``files`` by ``save``), so that a
    folder never holds both."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as archive:
        for name in sorted(files):
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(files[name]), 0o644
            archive.addfile(info, io.BytesIO(files[name]))
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_bytes(lzma.compress(buffer.getvalue(), format=lzma.FORMAT_XZ, preset=XZ_PRESET))
    os.replace(partial, path)
    legacy = legacy_of(path)
    if legacy is not None:
        legacy.unlink(missing_ok=True)


def output_files(archive: dict[str, bytes], name: str) -> dict[Path, bytes]:
    """The files of benchmark output ``name`` in a records archive, relative to the output."""
    prefix = f"{name}/"
    return {Path(member[len(prefix):]): data for member, data in archive.items() if member.startswith(prefix)}


def run_folder_problems(files: dict[Path, bytes], declared: set[Path], required: tuple[str, ...],
                        others: tuple[str, ...] = ()) -> list[str]:
    """What is wrong with one output's records (paths relative to it -> bytes) against its ``declared`` run folders,
    each of which must hold every file in ``required``: a run missing, one lacking a file, a top-level folder that is
    no declared run (``others``: folders that are not runs, such as a start's evaluation). One line each."""
    folders = {Path(name.parts[0]) for name in files if name.parts[0] not in others}
    problems = [f"run {run} is missing" for run in sorted(declared - folders)]
    problems += [f"{folder} is not a run its command declares" for folder in sorted(folders - declared)]
    return problems + [f"run {run} has no {name}" for run in sorted(declared & folders) for name in required
                       if run / name not in files]


def save(output: Path, records: Path = RECORDS) -> list[Path]:
    """Writes the records of ``output`` into its study's archive (over older copies of the same runs, the other
    outputs' kept); returns the files kept, relative to ``output``."""
    if not output.is_dir():
        raise FileNotFoundError(f"no benchmark output folder at {output}")
    files = record_files(output)
    path = records_of(output, records)
    archive = read_archive(path)
    archive.update({f"{output.resolve().name}/{name.as_posix()}": (output / name).read_bytes() for name in files})
    write_archive(path, archive)
    return files


def restore(output: Path, records: Path = RECORDS) -> list[Path]:
    """Writes the kept records of ``output`` back into it, leaving alone every run and top-level file it already
    holds (a run finished on this machine is newer than its record); returns the files written, relative to
    ``output``."""
    path = records_of(output, records)
    kept = output_files(read_archive(path), output.resolve().name)
    if not kept:
        raise FileNotFoundError(f"no records of {output.resolve().name} in {path} (saved with `run_records.py save "
                                f"{output}`)")
    files = sorted(name for name in kept if not finished_here(output, name))
    for name in files:
        (output / name).parent.mkdir(parents=True, exist_ok=True)
        (output / name).write_bytes(kept[name])
    return files


def finished_here(output: Path, name: Path) -> bool:
    """Whether what the record ``name`` belongs to (a top-level file such as the start point, or a run) is in
    ``output`` already."""
    if name.name in TOP_FILES:
        return (output / name).exists()
    return any((output / name.parent / end).exists() for end in RUN_ENDS)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("action", choices=("save", "restore"))
    p.add_argument("output", type=Path, help="the benchmark's output folder (its --output)")
    args = p.parse_args(argv)
    files = (save if args.action == "save" else restore)(args.output)
    print(f"{args.action}: {len(files)} files between {args.output} and {records_of(args.output)}")


if __name__ == "__main__":
    main()
