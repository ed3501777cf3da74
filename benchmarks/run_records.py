"""A learning benchmark's run records, kept in the repository, so that a benchmark longer than one machine's life
(whose disk, with outputs/ and the cache, is not kept between sessions) goes on where it stopped.

    python benchmarks/run_records.py save outputs/bench_branching_lead_...      # after runs end: keep their records
    python benchmarks/run_records.py restore outputs/bench_branching_lead_...   # on a new machine, before --resume

A finished run's record is what ``--resume`` and the reports read of it: its final evaluation (``held_out.json``,
keyed by the run's options, so it is reused only by the same command from the same start) and its metrics
(``metrics.jsonl``); with them the benchmark's start point (``start_point.json``). Checkpoints and models are not
kept: a restored run is reported, never trained on. A run without its final evaluation is not finished and is not
kept. Records live in ``results/NAME/`` at the repository's top level (NAME: the output folder's name; ``benchmarks/``
holds code only), laid out as in the output.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from benchmarks.learning_runs import FINAL_EVALUATION, START_POINT
from experiments.plot import METRICS_FILE

RECORDS = Path(__file__).resolve().parent.parent / "results"  # the repository's top level: benchmarks/ holds code
RUN_FILES = (FINAL_EVALUATION, METRICS_FILE)


def record_files(output: Path) -> list[Path]:
    """The files of ``output`` (a benchmark's output folder) that its records keep, relative to it: the start point
    and every finished run's files, sorted."""
    kept = [Path(START_POINT)] if (output / START_POINT).is_file() else []
    for evaluation in sorted(output.rglob(FINAL_EVALUATION)):
        run = evaluation.parent
        missing = [name for name in RUN_FILES if not (run / name).is_file()]
        if missing:
            raise FileNotFoundError(f"{run} holds {FINAL_EVALUATION} but not {', '.join(missing)}: a finished run "
                                    f"holds {' and '.join(RUN_FILES)}")
        kept += [(run / name).relative_to(output) for name in RUN_FILES]
    return kept


def records_of(output: Path, records: Path = RECORDS) -> Path:
    """Where the records of ``output`` live."""
    return records / output.resolve().name


def save(output: Path, records: Path = RECORDS) -> list[Path]:
    """Copies the records of ``output`` into ``records_of(output)`` (over older copies of the same runs); returns
    the files copied, relative to ``output``."""
    if not output.is_dir():
        raise FileNotFoundError(f"no benchmark output folder at {output}")
    files = record_files(output)
    for name in files:
        copy(output / name, records_of(output, records) / name)
    return files


def restore(output: Path, records: Path = RECORDS) -> list[Path]:
    """Copies the kept records of ``output`` back into it, leaving alone every run it already holds (a run finished
    on this machine is newer than its record); returns the files copied, relative to ``output``."""
    kept = records_of(output, records)
    if not kept.is_dir():
        raise FileNotFoundError(f"no records of {output.name} in {records} (saved with `run_records.py save "
                                f"{output}`)")
    files = [name for name in record_files(kept) if not (output / finished_marker(name)).exists()]
    for name in files:
        copy(kept / name, output / name)
    return files


def finished_marker(name: Path) -> Path:
    """The file whose presence says that what ``name`` belongs to (the start point, or a run) is there already."""
    return name if name.name == START_POINT else name.parent / FINAL_EVALUATION


def copy(source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, target)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("action", choices=("save", "restore"))
    p.add_argument("output", type=Path, help="the benchmark's output folder (its --output)")
    args = p.parse_args(argv)
    files = (save if args.action == "save" else restore)(args.output)
    where = records_of(args.output)
    print(f"{args.action}: {len(files)} files between {args.output} and {where}")


if __name__ == "__main__":
    main()
