"""Pack what the lent GPU machine lacks into ``.device/``, for the GPU check (``device_check.sh``) in two device
calls.

The lent machine has torch, transformers, pyarrow, grpcio, msgpack and aiohttp, and reaches no network: it has
no Ray, gymnasium or pydantic, no QA data and no tokenizer files, and one call carries at most 64 MiB (Ray's
wheel alone is about 79 MB). This script writes two folders that git ignores, each under that limit with the
working tree beside it:

- ``.device/call1``: the small wheels (the versions installed here), the first part of Ray's wheel, HotpotQA and
  the wiki corpus from the data directory (a gzip tar), SmolLM2's tokenizer (the model cache's copy);
- ``.device/call2``: the rest of Ray's wheel and its sha256.

Then, with the device tool, one call right after the other (the machine stays warm for 30 s)::

    run(command="bash benchmarks/device_check.sh 1", carry=[".device/call1"], timeout_s=600)
    run(command="bash benchmarks/device_check.sh 2", carry=[".device/call2"], timeout_s=600)

Call 1 installs the small wheels and runs ``bench_device.py`` (it needs no Ray); call 2 joins and installs Ray and
runs ``experiments/run.py --algo tree_grpo --env HotpotQA-v0`` for two iterations with one GPU learner. Fit them to
the session's device time with ``MODELS``, ``BENCH_TIMEOUT`` and ``RUN_TIMEOUT`` (``device_check.sh``): a 32-prompt
bench takes more than 160 s per model on an H200, one run.py iteration 75 s after 20 s of setup.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

from packaging.utils import canonicalize_name, parse_wheel_filename

ROOT = Path(__file__).resolve().parents[1]
CALL_LIMIT = 64 * 2**20  # what one device call carries: the working tree and the carried paths together
MARGIN = 2 * 2**20  # the tree's untracked-but-not-ignored files and the tar's own bytes
RAY = "ray"
DEVICE_PYTHON = "3.12"  # the lent machine's python3 (KINDS.md)
# What run.py needs beyond the lent machine's image (its package list: /work/.library/device/KINDS.md).
SMALL_WHEELS = ("gymnasium", "farama-notifications", "pydantic", "pydantic_core", "annotated-types",
                "typing-inspection", "typing_extensions", "dm-tree", "lz4", "ormsgpack", "jsonschema",
                "jsonschema-specifications", "referencing", "rpds-py", "tensorboardX", "rank-bm25")
DATA = ("hotpotqa", "wiki")  # HotpotQA-v0's questions and corpus, below the data directory
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64", "any")


def download_wheels(names: tuple[str, ...], into: Path, python: str) -> list[Path]:
    """Wheels of ``names`` at the versions installed here, for Python ``python`` (e.g. "3.12") on x86-64."""
    into = into / f"python{python}"  # one folder per Python: a wheel's name alone does not say which it runs on
    into.mkdir(parents=True, exist_ok=True)
    versions = {name: importlib.metadata.version(name) for name in names}
    platforms = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", python, "--implementation", "cp", *platforms, "-d", str(into),
                    *(f"{name}=={version}" for name, version in versions.items())], check=True)
    return [find_wheel(into, name, version) for name, version in versions.items()]


def find_wheel(folder: Path, name: str, version: str) -> Path:
    """The wheel of ``name`` ``version`` in ``folder`` (wheel file names normalise the project's name)."""
    for wheel in folder.glob("*.whl"):
        wheel_name, wheel_version, _, _ = parse_wheel_filename(wheel.name)
        if wheel_name == canonicalize_name(name) and str(wheel_version) == version:
            return wheel
    raise FileNotFoundError(f"{folder}: no wheel of {name}=={version} after pip download")


def tracked_bytes(root: Path) -> int:
    """What the working tree's tracked files weigh (they travel with every call)."""
    names = subprocess.run(["git", "ls-files", "-z"], cwd=root, check=True, capture_output=True).stdout
    return sum((root / name).stat().st_size for name in names.decode().split("\0") if (root / name).is_file())


def build(data_dir: Path, out: Path, cache: Path, python: str = DEVICE_PYTHON) -> dict[str, int]:
    """Write ``out/call1`` and ``out/call2``; returns each folder's bytes."""
    missing = [name for name in DATA if not (data_dir / name).is_dir()]
    if missing:
        raise SystemExit(f"{data_dir}: no {', '.join(missing)} folder (the data directory holds hotpotqa/ and "
                         "wiki/paragraphs.jsonl; set TREEGRPO_DATA_DIR or --data-dir)")
    from policies.models import model_cache_dir, smollm2_tokenizer

    shutil.rmtree(out, ignore_errors=True)
    call1, call2 = out / "call1", out / "call2"
    (call1 / "wheels").mkdir(parents=True)
    call2.mkdir(parents=True)
    for wheel in download_wheels(SMALL_WHEELS, cache, python):
        shutil.copy2(wheel, call1 / "wheels" / wheel.name)
    with tarfile.open(call1 / "data.tgz", "w:gz") as archive:
        for name in DATA:
            archive.add(data_dir / name, arcname=name)
    smollm2_tokenizer(model_cache_dir())  # converted from the GGUF once, if not yet
    shutil.copytree(model_cache_dir() / "smollm2-tokenizer", call1 / "models" / "smollm2-tokenizer")

    ray_wheel = download_wheels((RAY,), cache, python)[0]
    ray = ray_wheel.read_bytes()
    room = CALL_LIMIT - MARGIN - tracked_bytes(ROOT)  # what one call carries beside the working tree
    first = room - folder_bytes(call1)
    if first <= 0 or len(ray) - first > room:
        raise SystemExit(f"Ray's wheel ({len(ray)} bytes) does not fit two calls beside the rest of the kit")
    (call1 / "ray.whl.0").write_bytes(ray[:first])
    (call2 / "ray.whl.1").write_bytes(ray[first:])
    (call2 / "ray.whl.name").write_text(ray_wheel.name + "\n")
    (call2 / "ray.whl.sha256").write_text(hashlib.sha256(ray).hexdigest() + "\n")
    return {"call1": folder_bytes(call1), "call2": folder_bytes(call2)}


def folder_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


def main(argv: list[str] | None = None) -> None:
    from envs.cache import DEVICE_WHEELS_DIR, default_cache_dir

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", default=os.environ.get("TREEGRPO_DATA_DIR"),
                        help="the QA data directory (default: $TREEGRPO_DATA_DIR)")
    parser.add_argument("--output", default=str(ROOT / ".device"), help="where the two call folders go")
    parser.add_argument("--wheel-cache", default=str(default_cache_dir() / DEVICE_WHEELS_DIR),
                        help="downloaded wheels, kept between builds (default: device-wheels/ in the project's cache)")
    parser.add_argument("--python-version", default=DEVICE_PYTHON,
                        help="the Python the wheels are for (default: the lent machine's; this machine's "
                             "to rehearse the device script here)")
    args = parser.parse_args(argv)
    if not args.data_dir:
        raise SystemExit("no data directory: set TREEGRPO_DATA_DIR or pass --data-dir")
    sizes = build(Path(args.data_dir), Path(args.output), Path(args.wheel_cache), args.python_version)
    tree = tracked_bytes(ROOT)
    for call, size in sizes.items():
        print(f"{args.output}/{call}: {size / 2**20:.1f} MiB (+ {tree / 2**20:.1f} MiB of tracked files; "
              f"limit {CALL_LIMIT / 2**20:.0f} MiB)")


if __name__ == "__main__":
    main()
