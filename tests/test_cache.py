"""The project's cache: one root for every writer, the test run's own cache, and ``python -m experiments.cache``
on a cache of hand-built entries of every kind (what ``list`` shows; ``prune`` removes exactly the orphans)."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pytest

from envs.cache import CACHE_DIR_ENV, MODELS_DIR, default_cache_dir
from envs.retrieval.corpus import cache_entry, source_record
from envs.synthetic import WorldSpec
from experiments.cache import ABANDONED_AFTER_S, human_size, main, prune, remove, scan

ROOT = Path(__file__).resolve().parents[1]
WORLD = "abc123def456"
KEPT_START = f"{WORLD}-topk1-model-scratch-epochs-6"
FAILED_START = "0123456789ab-topk2-misroute-0.5"
RUNNING_START = f"{WORLD}-topk1-seed-1"
MODELLESS_START = f"{WORLD}-topk1-seed-2"


@dataclass
class FakeCache:
    """A cache of hand-built entries; ``orphans``: what prune must remove, ``kept``: what it must leave."""

    root: Path
    corpus: Path
    orphans: dict[Path, int] = field(default_factory=dict)  # path -> its bytes
    kept: list[Path] = field(default_factory=list)


def write(path: Path, size: int, age_s: float = 0.0) -> Path:
    """A file of ``size`` bytes, last modified ``age_s`` ago (its folder too)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x" * size)
    stamp = time.time() - age_s
    os.utime(path, (stamp, stamp))
    os.utime(path.parent, (stamp, stamp))
    return path


def corpus_file(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"id": "0", "contents": f'"T"\n{text}'}) + "\n", encoding="utf-8")
    return path


@pytest.fixture
def fake(tmp_path: Path) -> FakeCache:
    root, corpora = tmp_path / "cache", tmp_path / "corpora"
    kept_corpus = corpus_file(corpora / "kept" / "paragraphs.jsonl", "stays")
    gone = corpus_file(corpora / "gone" / "paragraphs.jsonl", "removed later")
    changed = corpus_file(corpora / "changed" / "paragraphs.jsonl", "rewritten later")
    cache = FakeCache(root, kept_corpus)

    # indexes: each with its source record, written as the retrievers write it
    index = cache_entry(root, "bm25", kept_corpus, {"k1": 0.9})
    write(index / "idf.npy", 100)
    unbuilt = cache_entry(root, "dense", kept_corpus, {})  # a build that failed: the record alone
    orphan_gone = cache_entry(root, "offsets", gone, {})
    write(orphan_gone / "offsets.npy", 300)
    orphan_changed = cache_entry(root, "rank_bm25", changed, {"b": 0.75})
    write(orphan_changed / "bm25okapi.pkl", 500)
    gone.unlink()
    corpus_file(changed, "rewritten: another size")
    for orphan, size in ((orphan_gone, 300), (orphan_changed, 500)):
        cache.orphans[orphan] = size + source_record(orphan).stat().st_size
    cache.kept += [index, source_record(index), source_record(unbuilt)]
    abandoned = write(root / f"{index.name}.tmpk1ll3d" / "spill-0.npy", 700, age_s=2 * ABANDONED_AFTER_S).parent
    cache.orphans[abandoned] = 700
    cache.kept.append(write(root / f"{index.name}.tmpbusy" / "spill-0.npy", 50).parent)

    # worlds
    world = root / "synthhop" / WORLD
    world_json = world / "synthhop" / "world.json"
    world_json.parent.mkdir(parents=True)
    world_json.write_text(json.dumps(asdict(WorldSpec(seed=3, people=40))), encoding="utf-8")
    cache.kept.append(world)
    staged_world = write(root / "synthbranch" / "fedcba987654.tmp2x9" / "wiki" / "paragraphs.jsonl", 900,
                         age_s=2 * ABANDONED_AFTER_S).parent.parent
    os.utime(staged_world, (time.time() - 2 * ABANDONED_AFTER_S,) * 2)
    cache.orphans[staged_world] = 900

    # warm starts: a published one, a stopped training, a running one (its lock held), one without its model
    starts = root / "warm_starts"
    cache.kept.append(write(starts / KEPT_START / "model" / "config.json", 40).parent.parent)
    failed = write(starts / f"{FAILED_START}.partial" / "checkpoint.pt", 1100).parent
    cache.orphans[failed] = 1100
    cache.kept.append(write(starts / f"{RUNNING_START}.partial" / "checkpoint.pt", 60).parent)
    modelless = write(starts / MODELLESS_START / "warmstart.json", 1300).parent
    cache.orphans[modelless] = 1300
    for key in (KEPT_START, FAILED_START, RUNNING_START, MODELLESS_START):
        cache.kept.append(write(starts / f"{key}.lock", 0))

    # models: a converted one, one linked from elsewhere (as conftest links the user's), an abandoned conversion
    models = root / MODELS_DIR
    cache.kept.append(write(models / "smollm2-135m" / "model.safetensors", 2000).parent)
    linked = models / "smollm2-tokenizer"
    linked.symlink_to(write(tmp_path / "user" / "smollm2-tokenizer" / "tokenizer.json", 5000).parent)
    cache.kept.append(linked)
    conversion = write(models / "smollm2-135m.tmp4242" / "model.safetensors", 1700, age_s=2 * ABANDONED_AFTER_S)
    cache.orphans[conversion.parent] = 1700

    cache.kept.append(write(root / "device-wheels" / "ray.whl", 80).parent)
    cache.kept.append(write(root / "notes.txt", 3))  # not the cache's layout: other, kept
    return cache


@pytest.fixture
def training(fake: FakeCache):
    """The lock of the running warm start, held as ``cached_warm_start`` holds it while it trains."""
    with (fake.root / "warm_starts" / f"{RUNNING_START}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def test_list_shows_each_entry_with_its_size_state_and_source(fake, training, capsys):
    main(["list", "--cache-dir", str(fake.root)])
    out = capsys.readouterr().out
    index = next(p for p in fake.kept if p.name.startswith("bm25-") and p.is_dir() and ".tmp" not in p.name)
    expected = [
        "indexes (6, ",
        f"  {index.name}  [{human_size(100 + len(source_record(index).read_bytes()))}]  ok",
        f"      bm25 over {fake.corpus.resolve()} (k1=0.9)",
        f"      dense over {fake.corpus.resolve()}\n",
        "  not built (yet)\n",
        "  orphaned: corpus gone\n      offsets over ",
        "  orphaned: corpus changed\n      rank_bm25 over ",
        f"{index.name}.tmpbusy  [50 B]  build under way",
        f"{index.name}.tmpk1ll3d  [700 B]  abandoned build (untouched 2.0 h)",
        "worlds (2, ",
        f"  synthhop/{WORLD}  [",
        "      synthhop world, seed=3, people=40\n",
        "  synthbranch/fedcba987654.tmp2x9  [900 B]  abandoned build",
        "warm starts (4, ",
        f"  warm_starts/{KEPT_START}  [40 B]  ok\n"
        f"      recipe model-scratch-epochs-6, topk 1, world synthhop/{WORLD}\n",
        f"  warm_starts/{FAILED_START}.partial  [1.1 kB]  failed: a stopped training's staging\n"
        "      recipe misroute-0.5, topk 2, world 0123456789ab (not in the cache)\n",
        f"  warm_starts/{RUNNING_START}.partial  [60 B]  training now\n",
        f"  warm_starts/{MODELLESS_START}  [1.3 kB]  failed: no model\n",
        "models (3, ",
        "  models/smollm2-135m  [2.0 kB]  ok\n",
        "  models/smollm2-135m.tmp4242  [1.7 kB]  abandoned build",
        f"      linked to {fake.root.parent / 'user' / 'smollm2-tokenizer'}\n",
        "other (2, 83 B)\n  device-wheels  [80 B]  ok\n      wheels for a lent GPU machine",
        "  notes.txt  [3 B]  ok\n      not in the cache's layout (envs.cache)\n",
        f"prunable: {len(fake.orphans)} entries, {human_size(sum(fake.orphans.values()))}",
    ]
    for text in expected:
        assert text in out, f"{text!r} not in:\n{out}"
    linked = next(line for line in out.splitlines() if "models/smollm2-tokenizer " in line)
    assert "5.0 kB" not in linked  # the link, not the user's files it points to


def test_prune_removes_exactly_the_orphans_and_says_what_it_freed(fake, training, capsys):
    before = {entry.path for entry in scan(fake.root)}
    removed, freed = prune(fake.root)
    assert {entry.path for entry in removed} == set(fake.orphans)
    assert freed == sum(fake.orphans.values())
    assert not any(os.path.lexists(path) for path in fake.orphans)
    assert not any(source_record(path).exists() for path in fake.orphans)  # an index goes with its record
    assert all(os.path.lexists(path) for path in fake.kept)
    assert (fake.root.parent / "user" / "smollm2-tokenizer" / "tokenizer.json").is_file()
    assert {entry.path for entry in scan(fake.root)} == before - set(fake.orphans)
    out = capsys.readouterr().out
    assert out.count("removed ") == len(fake.orphans)
    assert f"freed {freed} bytes ({human_size(freed)}) in {len(fake.orphans)} entries" in out
    assert prune(fake.root) == ([], 0)  # nothing left to prune


def test_a_dry_run_removes_nothing(fake, training, capsys):
    files = sorted(fake.root.rglob("*"))
    main(["prune", "--dry-run", "--cache-dir", str(fake.root)])
    assert sorted(fake.root.rglob("*")) == files
    out = capsys.readouterr().out
    assert out.count("would remove ") == len(fake.orphans)
    assert f"would free {sum(fake.orphans.values())} bytes" in out


def test_a_staging_whose_training_starts_after_the_scan_stays(fake):
    failed = next(entry for entry in scan(fake.root) if entry.path.name == f"{FAILED_START}.partial")
    with failed.lock.open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        assert not remove(failed)
    assert failed.path.is_dir()


def test_every_writer_resolves_one_cache_root(tmp_path, monkeypatch):
    from policies.models import model_cache_dir

    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "mine"))
    assert default_cache_dir() == tmp_path / "mine" and model_cache_dir() == tmp_path / "mine" / MODELS_DIR
    monkeypatch.delenv(CACHE_DIR_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "tree-grpo" and model_cache_dir().parent == default_cache_dir()
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "tree-grpo"


def test_the_tests_write_into_a_folder_of_their_own_not_the_users_cache_or_home(test_root):
    cache = default_cache_dir()
    assert cache == test_root / "cache" and cache.is_dir()
    code = "from envs.cache import default_cache_dir; print(default_cache_dir())"
    child = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert child.stdout.strip() == str(cache)  # Ray workers and subprocesses inherit it
    for model in (cache / MODELS_DIR).iterdir():
        if model.is_symlink():  # the user's converted model, linked in to be read
            assert not model.resolve().is_relative_to(test_root)
    assert Path(os.environ["MPLCONFIGDIR"]).parent == test_root
    from ray.tune import Trainable  # what an RLlib Algorithm builds on

    class Empty(Trainable):
        def step(self) -> dict:
            return {}

    trainable = Empty()
    try:
        assert Path(trainable.logdir).parent == test_root / "ray_results"  # not ~/ray_results
    finally:
        trainable.stop()


def test_entries_the_writers_never_leave_are_listed_and_only_a_world_without_its_spec_pruned(tmp_path, capsys):
    root = tmp_path / "cache"
    write(root / "bm25-paragraphs-0123456789abcdef" / "idf.npy", 10)  # an index from before source records
    write(root / "offsets-paragraphs-fedcba9876543210.source.json", 5)  # a record that is no JSON
    write(root / "synthhop" / "000000000001" / "wiki" / "paragraphs.jsonl", 20)  # a world without its spec
    write(root / "synthhop" / "000000000002" / "synthhop" / "world.json", 0).write_text('{"colour": 1}')
    main(["list", "--cache-dir", str(root)])
    out = capsys.readouterr().out
    for text in ("bm25-paragraphs-0123456789abcdef  [10 B]  no source record",
                 "offsets-paragraphs-fedcba9876543210  [5 B]  source record unreadable",
                 "synthhop/000000000001  [20 B]  incomplete: no world.json",
                 "synthhop/000000000002  [13 B]  world.json unreadable: synthhop worlds have no field colour"):
        assert text in out, f"{text!r} not in:\n{out}"
    removed, _ = prune(root)
    assert [entry.path for entry in removed] == [root / "synthhop" / "000000000001"]
