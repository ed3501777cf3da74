"""Wheels for the lent GPU machine, shared by its two kits (``device_kit.py``, ``vllm_kit.py``): pip's platform
options for CPython on manylinux x86-64, downloading wheels into a cache kept between builds, finding one by name and
version, its sha256, and an empty stand-in wheel for a package the machine's image has its own build of."""

from __future__ import annotations

import hashlib
import importlib.metadata
import subprocess
import sys
import zipfile
from pathlib import Path

from packaging.utils import canonicalize_name, parse_wheel_filename

PLATFORMS = ("manylinux_2_35_x86_64", "manylinux_2_34_x86_64", "manylinux_2_31_x86_64", "manylinux_2_28_x86_64",
             "manylinux_2_27_x86_64", "manylinux_2_26_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux_2_12_x86_64", "manylinux2010_x86_64", "manylinux_2_5_x86_64",
             "manylinux1_x86_64", "any")


def pip_platform_args(python: str) -> list[str]:
    """pip's options for binary wheels of CPython ``python`` (e.g. "3.12") on the lent machine's platforms."""
    return ["--only-binary=:all:", "--python-version", python, "--implementation", "cp",
            *(arg for platform in PLATFORMS for arg in ("--platform", platform))]


def download_wheels(names: tuple[str, ...], into: Path, python: str) -> list[Path]:
    """Wheels of ``names`` at the versions installed here, for Python ``python`` (e.g. "3.12") on x86-64."""
    paths = pip_download({name: importlib.metadata.version(name) for name in names}, into, python)
    return list(paths.values())


def pip_download(versions: dict[str, str], into: Path, python: str) -> dict[str, Path]:
    """The wheel of each ``name: version`` for Python ``python`` on x86-64 (pip downloads what the folder lacks)."""
    into = into / f"python{python}"  # one folder per Python: a wheel's name alone does not say which it runs on
    into.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", *pip_platform_args(python),
                    "-d", str(into), *(f"{name}=={version}" for name, version in versions.items())], check=True)
    return {name: find_wheel(into, name, version) for name, version in versions.items()}


def default_wheel_cache() -> Path:
    """Downloaded wheels, kept between builds: device-wheels/ in the project's cache."""
    from envs.cache import DEVICE_WHEELS_DIR, default_cache_dir

    return default_cache_dir() / DEVICE_WHEELS_DIR


def find_wheel(folder: Path, name: str, version: str) -> Path:
    """The wheel of ``name`` ``version`` in ``folder`` (wheel file names normalise the project's name)."""
    for wheel in folder.glob("*.whl"):
        wheel_name, wheel_version, _, _ = parse_wheel_filename(wheel.name)
        if wheel_name == canonicalize_name(name) and str(wheel_version) == version:
            return wheel
    raise FileNotFoundError(f"{folder}: no wheel of {name}=={version} after pip download")


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(2**20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_stub_wheel(folder: Path, name: str, version: str) -> Path:
    """An empty wheel of ``name`` ``version`` with no requirements (it stands in for the image's build)."""
    dist = f"{canonicalize_name(name).replace('-', '_')}-{version}"
    files = {f"{dist}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{dist}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: benchmarks.wheels\nRoot-Is-Purelib: true\n"
                                        "Tag: py3-none-any\n"}
    files[f"{dist}.dist-info/RECORD"] = "".join(f"{path},,\n" for path in [*files, f"{dist}.dist-info/RECORD"])
    path = folder / f"{dist}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        for name_in_archive, text in files.items():
            archive.writestr(name_in_archive, text)
    return path
