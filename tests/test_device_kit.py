"""The GPU machine's kit (benchmarks/device_kit.py): wheel lookup and the data check (no download here)."""

from pathlib import Path

import pytest

from benchmarks.device_kit import build, build_learn
from benchmarks.wheels import find_wheel


def touch(folder: Path, *names: str) -> None:
    for name in names:
        (folder / name).write_bytes(b"")


def test_find_wheel_matches_the_normalised_name_and_the_exact_version(tmp_path):
    touch(tmp_path, "tensorboardx-2.6.5-py3-none-any.whl", "farama_notifications-0.0.6-py3-none-any.whl",
          "pydantic_core-2.50.5-cp312-cp312-manylinux2014_x86_64.whl", "pydantic-2.14.3-py3-none-any.whl",
          "pydantic-2.14.4-py3-none-any.whl")
    assert find_wheel(tmp_path, "tensorboardX", "2.6.5").name.startswith("tensorboardx-2.6.5")
    assert find_wheel(tmp_path, "farama-notifications", "0.0.6").name.startswith("farama_notifications")
    assert find_wheel(tmp_path, "pydantic", "2.14.4").name == "pydantic-2.14.4-py3-none-any.whl"
    assert find_wheel(tmp_path, "pydantic_core", "2.50.5").name.startswith("pydantic_core-2.50.5")
    with pytest.raises(FileNotFoundError, match=r"rank-bm25==0\.2\.2"):
        find_wheel(tmp_path, "rank-bm25", "0.2.2")


def test_build_names_the_missing_data_folders_before_downloading(tmp_path):
    (tmp_path / "data" / "hotpotqa").mkdir(parents=True)
    with pytest.raises(SystemExit, match=r"data: no wiki folder"):
        build(tmp_path / "data", tmp_path / "kit", tmp_path / "wheels")
    assert not (tmp_path / "kit").exists() and not (tmp_path / "wheels").exists()


def fake_demo_cache(cache: Path) -> tuple[Path, Path]:
    """A cache holding what the CPU demo caches, small: its start policy's directory (as cached_warm_start leaves it)
    and its world's."""
    from envs.synthetic import world_data_dir
    from experiments.demo import WORLD, start_policy_dir
    from experiments.model_manifest import write_manifest

    model = start_policy_dir(0, cache)
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"\0" * 1000)
    (model.parent / "recipe.txt").write_text("the recipe\n")
    write_manifest(model)  # as cached_warm_start publishes a start: checked against it before use
    world = cache / WORLD.DATASET / WORLD.key
    (world / WORLD.DATASET).mkdir(parents=True)
    (world / WORLD.DATASET / "world.json").write_text("{}")
    assert world_data_dir(WORLD, cache) == world  # found, not generated
    return model, world


def test_the_learn_folder_is_a_cache_in_which_the_demo_finds_its_start_and_world(tmp_path, monkeypatch):
    import experiments.warmstart as warmstart
    from envs.synthetic import world_data_dir
    from experiments.demo import WORLD, start_policy

    model, world = fake_demo_cache(tmp_path / "cache")
    (tmp_path / "cpu").mkdir()
    for name in ("metrics.jsonl", "demo.json", "summary.md"):
        (tmp_path / "cpu" / name).write_text(name)
    size = build_learn(tmp_path / "cache", tmp_path / ".device", tmp_path / "cpu")
    learn = tmp_path / ".device" / "learn"
    assert size == sum(path.stat().st_size for path in learn.rglob("*") if path.is_file()) > 1000
    assert sorted(path.name for path in (learn / "cpu_demo").iterdir()) == ["demo.json", "metrics.jsonl"]

    def no_training(argv):
        raise AssertionError(f"trained {argv}")

    monkeypatch.setattr(warmstart, "main", no_training)
    packed = learn / "cache"
    assert start_policy(0, packed) == packed / model.relative_to(tmp_path / "cache")  # the same key, nothing trained
    assert (start_policy(0, packed) / "model.safetensors").stat().st_size == 1000
    assert world_data_dir(WORLD, packed) == packed / world.relative_to(tmp_path / "cache")
    assert not list(packed.glob("warm_starts/*.partial"))
    (tmp_path / ".device" / "call1").mkdir()  # the other calls' folders are kept by a rebuild
    build_learn(tmp_path / "cache", tmp_path / ".device")
    assert (tmp_path / ".device" / "call1").is_dir() and not (learn / "cpu_demo").exists()


def test_the_learn_folder_needs_the_trained_start_and_fits_one_call(tmp_path, monkeypatch):
    import benchmarks.device_kit as device_kit

    with pytest.raises(SystemExit, match=r"policy \(warm-start seed 0\) is not cached: run python experiments/demo"):
        build_learn(tmp_path / "cache", tmp_path / ".device")
    fake_demo_cache(tmp_path / "cache")
    with pytest.raises(SystemExit, match="not a finished demo run"):
        build_learn(tmp_path / "cache", tmp_path / ".device", tmp_path / "no-run")
    tree = device_kit.tracked_bytes(device_kit.ROOT)
    monkeypatch.setattr(device_kit, "CALL_LIMIT", device_kit.MARGIN + tree + 500)  # room for 500 bytes only
    with pytest.raises(SystemExit, match=r"bytes, over the 500 one call carries beside the working tree"):
        build_learn(tmp_path / "cache", tmp_path / ".device")
