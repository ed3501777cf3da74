"""What the project's cache holds, and removing what can never be used again.

    python -m experiments.cache list [--cache-dir DIR]
    python -m experiments.cache prune [--dry-run] [--cache-dir DIR]

The cache (``envs.cache``: ``$TREEGRPO_CACHE_DIR``, else ``~/.cache/tree-grpo``) only grows on its own: every
corpus file an index was built over keeps its index after it changes or goes, and a stopped warm-start training
keeps its staging directory. ``list`` shows every entry with its size, its state and what it belongs to (an
index's corpus file and options, a world's spec, a warm start's recipe and world). ``prune`` removes, printing
each with its size and the bytes freed in all:

- orphaned indexes: their corpus file is gone or changed (the key holds the file's size and mtime, so they are
  never read again);
- failed warm starts: a staging directory (``KEY.partial``) that no process is training in (its lock is free; it
  is removed holding the lock, so a training cannot start in it meanwhile), a warm start without its model;
- builds a killed process left half-done: staging folders (``*.tmp*``) of indexes, worlds and models in which
  nothing changed for ``ABANDONED_AFTER_S``.

Warm starts' lock files stay (empty; deleting one a process waits on would let two processes train one start).
What the cache's layout does not name is listed as ``other`` and never removed.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import re
import shutil
import stat
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from envs.cache import (
    DEVICE_WHEELS_DIR,
    MODELS_DIR,
    WARM_START_LOCK,
    WARM_START_RECIPE,
    WARM_START_STAGING,
    WARM_STARTS_DIR,
    default_cache_dir,
)
from envs.retrieval import BACKENDS
from envs.retrieval.corpus import recorded_entries, recorded_source, source_record, source_state
from envs.synthetic import SPECS, read_spec

GROUPS = ("indexes", "worlds", "warm starts", "models", "other")
INDEX_KINDS = ("offsets", *BACKENDS)  # the first word of an index entry's name (envs.retrieval.corpus.cache_entry)
STAGING_MARK = ".tmp"  # in the name of a folder a build writes before it is published under its final name
ABANDONED_AFTER_S = 3600.0  # a staging folder untouched this long belongs to no running build
WARM_START_KEY = re.compile(r"^(?P<world>[0-9a-f]{12})-topk(?P<topk>\d+)-(?P<recipe>.*)$")


@dataclass(frozen=True)
class Entry:
    """One thing in the cache: where it is, its bytes, its state (``ok``, or what is wrong), what it belongs to,
    and whether ``prune`` removes it (under ``lock`` when it has one)."""

    group: str
    path: Path
    size: int
    state: str
    about: str
    prunable: bool
    lock: Path | None = None


def scan(cache_dir: Path, now: float | None = None) -> list[Entry]:
    """Every entry of ``cache_dir``, by group then name; ``now`` (default: the clock) dates staging folders."""
    now = time.time() if now is None else now
    if not cache_dir.is_dir():
        return []
    entries = [index_entry(entry) for entry in recorded_entries(cache_dir)]
    claimed = {entry.path.name for entry in entries} | {source_record(entry.path).name for entry in entries}
    for child in sorted(cache_dir.iterdir()):
        if child.name in claimed:
            continue
        if child.name in SPECS and child.is_dir():
            entries += world_entries(child, now)
        elif child.name == WARM_STARTS_DIR and child.is_dir():
            entries += warm_start_entries(child)
        elif child.name == MODELS_DIR and child.is_dir():
            entries += [staging_entry("models", model, now) if STAGING_MARK in model.name else model_entry(model)
                        for model in sorted(child.iterdir())]
        elif child.name.split("-", 1)[0] in INDEX_KINDS and STAGING_MARK in child.name:
            entries.append(staging_entry("indexes", child, now))
        elif child.name.split("-", 1)[0] in INDEX_KINDS and child.is_dir():
            entries.append(Entry("indexes", child, tree_size(child), "no source record", "", prunable=False))
        elif child.name == DEVICE_WHEELS_DIR:
            entries.append(Entry("other", child, tree_size(child), "ok", "wheels for a lent GPU machine "
                                 "(benchmarks/device_kit.py)", prunable=False))
        else:
            entries.append(Entry("other", child, tree_size(child), "ok", "not in the cache's layout (envs.cache)",
                                 prunable=False))
    return sorted(entries, key=lambda e: (GROUPS.index(e.group), str(e.path)))


def index_entry(entry: Path) -> Entry:
    """An index (or corpus offsets) entry with its source record: orphaned when its corpus changed or went."""
    size = tree_size(entry) + tree_size(source_record(entry))
    record = recorded_source(entry)
    if record is None:
        return Entry("indexes", entry, size, "source record unreadable", "", prunable=False)
    kind = record.get("kind") or entry.name.split("-", 1)[0]
    options = ", ".join(f"{k}={v}" for k, v in sorted(record.get("options", {}).items()))
    about = f"{kind} over {record['file']['path']}" + (f" ({options})" if options else "")
    source = source_state(record)
    if source != "current":
        return Entry("indexes", entry, size, f"orphaned: corpus {source}", about, prunable=True)
    return Entry("indexes", entry, size, "ok" if entry.exists() else "not built (yet)", about, prunable=False)


def world_entries(folder: Path, now: float) -> list[Entry]:
    """The generated worlds of one dataset (``folder``: the cache's ``synthhop/`` or ``synthbranch/``)."""
    dataset, entries = folder.name, []
    for world in sorted(folder.iterdir()):
        if STAGING_MARK in world.name:
            entries.append(staging_entry("worlds", world, now))
        elif not (world / dataset / "world.json").is_file():
            entries.append(Entry("worlds", world, tree_size(world), "incomplete: no world.json", "", prunable=True))
        else:
            try:
                about = describe_world(dataset, world)
            except (OSError, ValueError, TypeError) as error:
                entries.append(Entry("worlds", world, tree_size(world), f"world.json unreadable: {error}", "",
                                     prunable=False))
                continue
            entries.append(Entry("worlds", world, tree_size(world), "ok", about, prunable=False))
    return entries


def describe_world(dataset: str, world: Path) -> str:
    """The dataset and the spec fields of the world in ``world`` that differ from the defaults."""
    spec, default = asdict(read_spec(dataset, world)), asdict(SPECS[dataset]())
    changed = ", ".join(f"{k}={v}" for k, v in spec.items() if v != default[k])
    return f"{dataset} world, {changed or 'the default spec'}"


def warm_start_entries(folder: Path) -> list[Entry]:
    """The cached warm starts (``folder``: the cache's ``warm_starts/``): published ones, whose ``model/`` holds
    its config, and the staging directories of trainings that are running or stopped."""
    entries = []
    for child in sorted(folder.iterdir()):
        if child.name.endswith(WARM_START_LOCK):
            continue
        staged = child.name.endswith(WARM_START_STAGING)
        key = child.name.removesuffix(WARM_START_STAGING)
        lock = folder / f"{key}{WARM_START_LOCK}"
        recorded = folder / key / WARM_START_RECIPE  # the whole key, where a long recipe's name ends in a hash
        about = describe_warm_start(recorded.read_text(encoding="utf-8").strip() if recorded.is_file() else key,
                                    folder.parent)
        if (child / "model" / "config.json").is_file() and not staged:
            entries.append(Entry("warm starts", child, tree_size(child), "ok", about, prunable=False))
        elif lock_held(lock):
            entries.append(Entry("warm starts", child, tree_size(child), "training now", about, prunable=False))
        else:
            state = "failed: a stopped training's staging" if staged else "failed: no model"
            entries.append(Entry("warm starts", child, tree_size(child), state, about, prunable=True, lock=lock))
    return entries


def describe_warm_start(key: str, cache_dir: Path) -> str:
    """A warm start's recipe, top-k and world (``cached_warm_start``'s key: WORLD-topkK-RECIPE, the recipe's options
    without their dashes), and whether that world is still in the cache."""
    match = WARM_START_KEY.match(key)
    if match is None:
        return f"recipe {key}"
    worlds = [f"{dataset}/{match['world']}" for dataset in SPECS if (cache_dir / dataset / match["world"]).is_dir()]
    world = ", ".join(worlds) if worlds else f"{match['world']} (not in the cache)"
    return f"recipe {match['recipe']}, topk {match['topk']}, world {world}"


def model_entry(model: Path) -> Entry:
    """A converted model, or a link to one elsewhere (a test run's cache links the user's)."""
    about = "rebuilt from packaged weights (policies.models)"
    if model.is_symlink():
        about = f"linked to {os.readlink(model)}"
    return Entry("models", model, tree_size(model), "ok", about, prunable=False)


def staging_entry(group: str, path: Path, now: float) -> Entry:
    """A folder (or file) a build writes before publishing it: abandoned once nothing in it changed for a while."""
    idle = now - newest_mtime(path)
    if idle < ABANDONED_AFTER_S:
        return Entry(group, path, tree_size(path), "build under way", "", prunable=False)
    return Entry(group, path, tree_size(path), f"abandoned build (untouched {idle / 3600:.1f} h)", "", prunable=True)


def tree_stats(path: Path) -> list[os.stat_result]:
    """The ``lstat`` of ``path`` and of everything under it, links not followed (a linked model is not ours to
    count); what vanishes meanwhile (a build publishing its staging folder) is left out."""
    paths = [str(path)]
    if path.is_dir() and not path.is_symlink():
        paths += [os.path.join(root, name) for root, dirs, files in os.walk(path) for name in [*dirs, *files]]
    stats = []
    for name in paths:
        try:
            stats.append(os.lstat(name))
        except FileNotFoundError:
            continue
    return stats


def tree_size(path: Path) -> int:
    """Bytes of the files (and links) at and under ``path``."""
    return sum(st.st_size for st in tree_stats(path) if not stat.S_ISDIR(st.st_mode))


def newest_mtime(path: Path) -> float:
    """The latest modification time of ``path`` and everything under it."""
    return max((st.st_mtime for st in tree_stats(path)), default=0.0)


@contextmanager
def locked(lock: Path | None) -> Iterator[bool]:
    """Hold ``lock`` (a warm start's) without waiting: yields False when another process holds it. None: no lock."""
    if lock is None or not lock.exists():
        yield True
        return
    with lock.open("r") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True  # released when the file closes


def lock_held(lock: Path) -> bool:
    """Whether another process holds ``lock`` (``cached_warm_start`` holds its key's while it trains)."""
    with locked(lock) as free:
        return not free


def remove(entry: Entry) -> bool:
    """Remove ``entry`` (and an index's source record); False when its lock was taken meanwhile (a training
    started in it), so it stays."""
    with locked(entry.lock) as free:
        if not free:
            return False
        if entry.path.is_dir() and not entry.path.is_symlink():
            shutil.rmtree(entry.path)
        else:
            entry.path.unlink(missing_ok=True)
        if entry.group == "indexes":
            source_record(entry.path).unlink(missing_ok=True)
    return True


def prune(cache_dir: Path, *, dry_run: bool = False, now: float | None = None) -> tuple[list[Entry], int]:
    """Remove the prunable entries of ``cache_dir`` (none with ``dry_run``), printing each; the entries removed
    (would be) and their bytes."""
    removed = []
    for entry in scan(cache_dir, now):
        if not entry.prunable:
            continue
        if not dry_run and not remove(entry):
            print(f"kept {entry.path.relative_to(cache_dir)}: a training started in it")
            continue
        removed.append(entry)
        about = f"; {entry.about}" if entry.about else ""
        print(f"{'would remove' if dry_run else 'removed'} {entry.path.relative_to(cache_dir)} "
              f"[{human_size(entry.size)}]: {entry.state}{about}")
    freed = sum(entry.size for entry in removed)
    print(f"{'would free' if dry_run else 'freed'} {freed} bytes ({human_size(freed)}) in {len(removed)} "
          f"entries of {cache_dir}")
    return removed, freed


def listing(cache_dir: Path, now: float | None = None) -> str:
    """The ``list`` report: the groups, each entry with its size, state and what it belongs to."""
    entries = scan(cache_dir, now)
    lines = [f"{cache_dir}: {len(entries)} entries, {human_size(sum(e.size for e in entries))}"]
    for group in GROUPS:
        members = [e for e in entries if e.group == group]
        lines.append(f"{group} ({len(members)}, {human_size(sum(e.size for e in members))})")
        for e in members:
            lines.append(f"  {e.path.relative_to(cache_dir)}  [{human_size(e.size)}]  {e.state}")
            if e.about:
                lines.append(f"      {e.about}")
    prunable = [e for e in entries if e.prunable]
    if prunable:
        lines.append(f"prunable: {len(prunable)} entries, {human_size(sum(e.size for e in prunable))} "
                     f"(python -m experiments.cache prune)")
    return "\n".join(lines)


def human_size(size: float) -> str:
    """``size`` bytes in decimal units, for people (the exact count is printed where it matters)."""
    units = ("B", "kB", "MB", "GB", "TB")
    exponent = 0
    while size >= 1000 and exponent < len(units) - 1:
        size, exponent = size / 1000, exponent + 1
    return f"{size:.0f} B" if exponent == 0 else f"{size:.1f} {units[exponent]}"


def main(argv: list[str] | None = None) -> None:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--cache-dir", type=Path, default=None,
                        help="the cache (default: $TREEGRPO_CACHE_DIR, else $XDG_CACHE_HOME/tree-grpo, else "
                             "~/.cache/tree-grpo)")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("list", parents=[common], help="what the cache holds, with sizes")
    prune_parser = commands.add_parser("prune", parents=[common],
                                       help="remove orphaned indexes, failed warm starts, abandoned builds")
    prune_parser.add_argument("--dry-run", action="store_true", help="print what would be removed, remove nothing")
    args = parser.parse_args(argv)
    cache_dir = args.cache_dir or default_cache_dir()
    if args.command == "list":
        print(listing(cache_dir))
    else:
        prune(cache_dir, dry_run=args.dry_run)


if __name__ == "__main__":
    main()
