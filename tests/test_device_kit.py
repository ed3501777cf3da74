"""The GPU machine's kit (benchmarks/device_kit.py): wheel lookup and the data check (no download here)."""

from pathlib import Path

import pytest

from benchmarks.device_kit import build, find_wheel


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
