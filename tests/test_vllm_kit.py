"""vLLM's kit for the lent GPU machine (benchmarks/vllm_kit.py, device_kit.py --vllm): the wheel list, the walk
that decides what is carried, the wheel in parts and their packing into calls. Nothing is downloaded."""

from __future__ import annotations

import hashlib
import math
import random
import shutil
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

import benchmarks.device_kit as device_kit
import benchmarks.vllm_kit as vllm_kit
from benchmarks.device_kit import join_parts, pack_calls, write_split
from benchmarks.vllm_kit import (
    KIT_LIST,
    OMITTED,
    Dist,
    KitList,
    Wheel,
    format_kit_list,
    read_image,
    read_kit_list,
    target_environment,
    walk,
)


def fake_wheel(folder: Path, name: str = "vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl", size: int = 10_000,
               seed: int = 0) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_bytes(random.Random(seed).randbytes(size))
    return path


# -- the wheel in parts ---------------------------------------------------------------------------------------------


def test_a_wheel_split_over_calls_joins_back_to_the_same_bytes(tmp_path):
    wheel = fake_wheel(tmp_path / "cache")
    calls = [tmp_path / f"vllm{index}" for index in (1, 2, 3)]
    write_split(wheel, "vllm", [(calls[0], 4_000), (calls[1], 4_000), (calls[2], 2_000)])
    assert [(call / f"vllm.whl.{index}").stat().st_size for index, call in enumerate(calls)] == [4_000, 4_000, 2_000]
    kit = tmp_path / "kit"  # the device stores each call's folder here, one call at a time
    for call in calls:
        shutil.copytree(call, kit, dirs_exist_ok=True)
    joined = join_parts(kit, "vllm")
    assert joined == kit / wheel.name and joined.read_bytes() == wheel.read_bytes()
    assert (kit / "vllm.whl.sha256").read_text().strip() == hashlib.sha256(wheel.read_bytes()).hexdigest()


def test_joining_names_the_missing_parts_and_refuses_a_damaged_one(tmp_path):
    wheel = fake_wheel(tmp_path / "cache")
    write_split(wheel, "vllm", [(tmp_path / "kit", 3_000), (tmp_path / "kit", 3_000), (tmp_path / "kit", 4_000)])
    (tmp_path / "kit" / "vllm.whl.1").unlink()
    with pytest.raises(SystemExit, match=r"parts \[1\] of 3 are missing"):
        join_parts(tmp_path / "kit", "vllm")
    write_split(wheel, "vllm", [(tmp_path / "kit", 3_000), (tmp_path / "kit", 3_000), (tmp_path / "kit", 4_000)])
    damaged = bytearray((tmp_path / "kit" / "vllm.whl.2").read_bytes())
    damaged[0] ^= 1
    (tmp_path / "kit" / "vllm.whl.2").write_bytes(bytes(damaged))
    with pytest.raises(SystemExit, match="sha256"):
        join_parts(tmp_path / "kit", "vllm")
    assert not (tmp_path / "kit" / wheel.name).exists()  # no half-checked wheel left to install
    with pytest.raises(ValueError, match="do not cover it"):
        write_split(wheel, "vllm", [(tmp_path / "kit", 3_000)])


# -- packing into calls ---------------------------------------------------------------------------------------------


def check_packing(calls, items: dict[str, int], split: int, room: int) -> None:
    placed = [name for call in calls for name in call.items]
    assert sorted(n for n in placed if n in items) == sorted(items)  # every whole item once
    for call in calls:
        whole = sum(items.get(name, 0) for name in call.items)
        piece = call.piece[1] if call.piece else 0
        assert call.used <= room and whole + piece <= call.used
    pieces = [call.piece for call in calls if call.piece]
    assert [offset for offset, _ in pieces] == [sum(length for _, length in pieces[:i]) for i in range(len(pieces))]
    assert sum(length for _, length in pieces) == split


def test_the_split_wheel_fills_the_calls_the_whole_wheels_leave_and_no_call_goes_over_the_room():
    room = 1_000
    items = {"a.whl": 700, "b.whl": 450, "c.whl": 300, "d.whl": 120, "models": 90}
    calls = pack_calls(items, split=2_300, room=room)
    check_packing(calls, items, 2_300, room)
    assert len(calls) == math.ceil((sum(items.values()) + 2_300) / room) == 4  # the fewest: nothing wasted
    assert [call.used for call in calls][:-1] == [room] * 3  # each call full before the next


def test_optional_items_take_spare_room_only_and_an_oversized_item_is_refused():
    items, room = {"wheels": 600}, 1_000
    calls = pack_calls(items, split=1_100, room=room, optional={"data.tgz": 250, "huge.tgz": 900})
    check_packing(calls, items, 1_100, room)
    assert len(calls) == 2 and [n for call in calls for n in call.items].count("data.tgz") == 1
    assert all("huge.tgz" not in call.items for call in calls)  # no call added for it
    with pytest.raises(SystemExit, match="over the 1,000 one call carries"):
        pack_calls({"ray.whl": 1_001}, split=0, room=room)


def test_the_vllm_folders_stay_under_the_call_limit_and_join_to_the_listed_wheel(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    vllm = fake_wheel(cache, size=5_000)
    deps = [fake_wheel(cache, f"dep{i}-1.0-py3-none-any.whl", size, seed=i) for i, size in enumerate((900, 400, 50))]
    gymnasium = fake_wheel(cache, "gymnasium-1.2.2-py3-none-any.whl", 300, seed=9)
    wheels = [Wheel("vllm", "0.26.0", vllm.stat().st_size, device_kit.sha256_of(vllm), vllm.name)]
    wheels += [Wheel(f"dep{i}", "1.0", p.stat().st_size, device_kit.sha256_of(p), p.name) for i, p in enumerate(deps)]
    (tmp_path / "list.txt").write_text(format_kit_list(KitList(tuple(wheels), ())))
    monkeypatch.setattr(vllm_kit, "KIT_LIST", tmp_path / "list.txt")
    monkeypatch.setattr(device_kit, "pip_download", lambda versions, into, python: {
        "vllm": vllm, **{f"dep{i}": p for i, p in enumerate(deps)}})
    monkeypatch.setattr(device_kit, "download_wheels", lambda names, into, python: [gymnasium])

    def copy_tokenizer(folder: Path) -> None:
        (folder / "models" / "smollm2-tokenizer").mkdir(parents=True)
        (folder / "models" / "smollm2-tokenizer" / "tokenizer.json").write_text("{}" * 50)

    monkeypatch.setattr(device_kit, "copy_tokenizer", copy_tokenizer)
    room = 2_000
    monkeypatch.setattr(device_kit, "call_room", lambda: room)
    (tmp_path / ".device" / "vllm9").mkdir(parents=True)  # an earlier build's extra call: removed
    sizes = device_kit.build_vllm(tmp_path / ".device", cache)
    assert list(sizes) == [f"vllm{i}" for i in range(1, len(sizes) + 1)] and not (tmp_path / ".device/vllm9").exists()
    assert all(size <= room + 200 for size in sizes.values())  # + the part's name, sha256 and count (MARGIN's)
    assert len(sizes) == math.ceil((5_000 + 900 + 400 + 50 + 300 + 100) / room)
    kit = tmp_path / "kit"
    for name in sizes:
        assert (tmp_path / ".device" / name / "vllm.calls").read_text() == f"{len(sizes)}\n"
        shutil.copytree(tmp_path / ".device" / name, kit, dirs_exist_ok=True)
    assert join_parts(kit, "vllm").read_bytes() == vllm.read_bytes()
    assert sorted(p.name for p in (kit / "wheels").iterdir()) == sorted([gymnasium.name, *(p.name for p in deps)])
    assert (kit / "models" / "smollm2-tokenizer" / "tokenizer.json").is_file()
    deps[1].write_bytes(b"another build")
    with pytest.raises(SystemExit, match="not the wheel the kit list names"):
        device_kit.build_vllm(tmp_path / ".device", cache)


# -- the wheel list -------------------------------------------------------------------------------------------------


def test_the_committed_list_parses_and_carries_nothing_the_image_has_at_a_fitting_version():
    kit, image = read_kit_list(KIT_LIST.read_text()), read_image()
    assert (kit.vllm.version, kit.vllm.size) == (vllm_kit.VLLM_VERSION, kit.wheels[0].size) and kit.vllm.size > 2e8
    assert image["torch"] == "2.11.0+cu130" and image["numpy"] == "2.5.2" and len(image) > 150
    for wheel in kit.wheels:
        assert wheel.name not in image, f"{wheel.name} is in the image and carried"
        assert len(wheel.sha256) == 64 and wheel.file.endswith(".whl") and wheel.size > 0
    for line in kit.image:
        assert line.name in image and line.image_version == image[line.name]
        if line.image_version is not None:  # what the walk asks of the image, the image's version meets
            assert Version(line.image_version) in SpecifierSet(line.specifier), line
    assert {o.name for o in kit.omitted} >= set(OMITTED)
    assert not {o.name for o in kit.omitted} & {w.name for w in kit.wheels}
    torch = next(line for line in kit.image if line.name == "torch")
    assert Version("2.11.0") in SpecifierSet(torch.specifier)  # vLLM 0.26.0 pins the image's torch


def test_the_list_refuses_malformed_and_doubled_lines():
    good = "wheel vllm 0.26.0 10 " + "0" * 64 + " vllm.whl\nimage torch ==2.11.0 2.11.0\n"
    assert read_kit_list(good + "omit numpy 2.3.5 16 needed only by mistral-common\n").omitted[0].why == \
        "needed only by mistral-common"
    with pytest.raises(ValueError, match="line 3"):
        read_kit_list(good + "wheel pydantic 2.14.4\n")
    with pytest.raises(ValueError, match="listed twice: torch"):
        read_kit_list(good + "wheel torch 2.11.0 10 " + "0" * 64 + " torch.whl\n")
    with pytest.raises(ValueError, match="no vllm wheel"):
        read_kit_list("image torch * ?\n")


# -- the walk -------------------------------------------------------------------------------------------------------


RESOLVED = {
    "vllm": Dist("0.26.0", ("torch==2.11.0", "numpy", "pydantic>=2.12", "mistral-common[image]>=1.11",
                            "setuptools<81; python_version > '3.11'", "six; python_version > '3.11'",
                            "colorama; python_version < '3.12'", "flashinfer-python==0.6.14",
                            "bench; extra == 'bench'")),
    "pydantic": Dist("2.14.4", ("typing-extensions>=4.14", "pydantic-core==2.50.5")),
    "pydantic-core": Dist("2.50.5", ("typing-extensions>=4.14",)),
    "mistral-common": Dist("1.13.1", ("numpy<2.4", "pillow; extra == 'image'", "opencv; extra == 'video'")),
    "numpy": Dist("2.3.5"),
    "flashinfer-python": Dist("0.6.14", ("cuda-tile",)),
    "cuda-tile": Dist("1.7.0"),
    "setuptools": Dist("84.2.1"),
    "torch": Dist("2.11.0+cu130"),
}
IMAGE = {"torch": "2.11.0+cu130", "numpy": "2.5.2", "typing-extensions": None, "pillow": None, "setuptools": None,
         "six": None}


def test_the_walk_leaves_the_image_its_packages_and_carries_what_it_lacks_or_has_at_another_version():
    result = walk("vllm", RESOLVED, IMAGE, target_environment())
    assert set(result.carried) == {"vllm", "pydantic", "pydantic-core", "mistral-common", "numpy",
                                   "flashinfer-python", "cuda-tile"}
    # numpy: the image's 2.5.2 meets vllm but not mistral-common's <2.4, so the resolution's 2.3.5 is carried
    assert result.carried["numpy"].version == "2.3.5" and "numpy" not in result.image
    assert str(result.image["torch"]) == "==2.11.0" and str(result.image["typing-extensions"]) == ">=4.14"
    assert "pillow" in result.image  # mistral-common[image]'s extra is walked
    # the lent machine's Python 3.12: setuptools<81 and six hold, colorama (< 3.12) does not; extras are not asked
    assert str(result.image["setuptools"]) == "<81" and "six" in result.image
    assert "colorama" not in result.image and "colorama" not in result.carried and not result.unresolved
    assert result.required_by["numpy"] == {"mistral-common[image]"}  # who asked, with the extras it asked with


def test_omitted_packages_are_not_walked_and_unresolved_ones_are_named():
    kept = walk("vllm", RESOLVED, IMAGE, target_environment(), omit=("mistral-common", "flashinfer-python"))
    assert set(kept.carried) == {"vllm", "pydantic", "pydantic-core"}  # numpy and cuda-tile went with them
    assert kept.omitted == {"mistral-common", "flashinfer-python"} and str(kept.image["numpy"]) == ""
    missing = dict(RESOLVED)
    del missing["pydantic-core"]
    assert walk("vllm", missing, IMAGE, target_environment()).unresolved == [Requirement("pydantic-core==2.50.5")]


def test_the_devices_check_reports_what_the_installed_distributions_miss(monkeypatch):
    import importlib.metadata as metadata

    from benchmarks.vllm_kit import ImageRequirement, Omitted, installed_requirements_report

    installed = {"vllm": ("0.26.0", ["numpy<2.4", "pydantic>=2.12", "flashinfer-python==0.6.14", "blake3",
                                     "colorama; python_version < '3.0'"]),
                 "pydantic": ("2.14.4", ["typing-extensions>=4.14"]), "numpy": ("2.5.2", []),
                 "typing-extensions": ("4.12.0", [])}

    def version(name):
        if name not in installed:
            raise metadata.PackageNotFoundError(name)
        return installed[name][0]

    monkeypatch.setattr(metadata, "version", version)
    monkeypatch.setattr(metadata, "requires", lambda name: installed[name][1])
    kit = KitList((Wheel("vllm", "0.26.0", 1, "0" * 64, "v.whl"), Wheel("pydantic", "2.14.4", 1, "0" * 64, "p.whl")),
                  (ImageRequirement("numpy", "", "2.5.2"),), (Omitted("flashinfer-python", "0.6.14", 1, "why"),))
    assert installed_requirements_report("vllm", kit) == [
        "unmet: numpy<2.4 (for vllm), 2.5.2 installed", "omitted: flashinfer-python==0.6.14 (for vllm)",
        "missing: blake3 (for vllm)",
        "unmet: typing-extensions>=4.14 (for pydantic), 4.12.0 installed",
        "image ok: numpy 2.5.2 (asked any; the list read 2.5.2)"]
    assert installed_requirements_report("nothing-here") == ["missing: nothing-here is not installed"]
