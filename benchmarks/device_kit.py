"""Pack what the lent GPU machine lacks into ``.device/``, for the GPU check (``device_check.sh``) in two device
calls, and with ``--learn`` for a third that trains the CPU demo's task on the GPU.

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

Learning on the GPU (issue 63, item 3): ``python benchmarks/device_kit.py --learn`` (after the build above, whose two
folders it keeps) writes ``.device/learn``: ``cache/``, a cache directory (``$TREEGRPO_CACHE_DIR``'s layout) holding
the CPU demo's start policy as ``experiments/demo.py`` caches it (the second stage only, float32, about 42 MB: its
key names the first stage's recipe, which is not needed once the second is cached) and the demo's generated world,
so that the demo trains nothing there; and ``cpu_demo/``, the ``metrics.jsonl`` and ``demo.json`` of a CPU demo run
(``--cpu-demo DIR``, optional), the reference the device prints its comparison against. Then three calls back to
back, calls 1 and 2 only installing (``INSTALL_ONLY=1``: no bench, no mission run), the third training::

    run(command="INSTALL_ONLY=1 bash benchmarks/device_check.sh 1", carry=[".device/call1"], timeout_s=180)
    run(command="INSTALL_ONLY=1 bash benchmarks/device_check.sh 2", carry=[".device/call2"], timeout_s=180)
    run(command="bash benchmarks/device_check.sh learn", carry=[".device/learn"], timeout_s=480)

The learn call runs ``experiments/demo.py --no-mlflow --iterations 8 --curve-every 8`` (held-out exact match before
and after) with every GPU default (the learner on the GPU, bf16 compute over float32 masters, CUDA-graph decode),
sized by ``LEARN_TIMEOUT`` (``device_check.sh``), and ``gpu_run_summary.py --compare`` on it (benchmarks/README.md,
"Learning on a GPU through RLlib", has the estimate: about 9-11 minutes of device time with the machine's start).
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
LEARN = "learn"  # the learn call's folder below the output
CPU_DEMO_FILES = ("metrics.jsonl", "demo.json")  # what the learn call compares the GPU's demo with
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

    call1, call2 = out / "call1", out / "call2"
    for folder in (call1, call2):  # the learn call's folder (--learn) is kept
        shutil.rmtree(folder, ignore_errors=True)
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


def build_learn(cache: Path, out: Path, cpu_demo: Path | None = None, seed: int = 0) -> int:
    """Write ``out/learn`` (see the module docstring) from the project's cache ``cache``, in which the CPU demo's
    start policy of warm-start ``seed`` must already be trained (this packs it, it trains nothing); returns the
    folder's bytes, refused over what one call carries beside the working tree."""
    from envs.synthetic import world_data_dir
    from experiments.demo import WORLD, start_policy_dir

    model = start_policy_dir(seed, cache)
    if not (model / "config.json").is_file():
        raise SystemExit(f"{model}: the CPU demo's start policy (warm-start seed {seed}) is not cached: run "
                         f"python experiments/demo.py once (about 13 minutes on 2 cores) with this cache")
    if cpu_demo is not None and not all((cpu_demo / name).is_file() for name in CPU_DEMO_FILES):
        raise SystemExit(f"{cpu_demo}: not a finished demo run (no {' or '.join(CPU_DEMO_FILES)})")
    world = world_data_dir(WORLD, cache)  # generated here if missing (seconds, deterministic)
    learn = out / LEARN
    shutil.rmtree(learn, ignore_errors=True)
    (learn / "cache").mkdir(parents=True)
    # the same paths below the cache root, so that the same keys resolve there
    shutil.copytree(model.parent, learn / "cache" / model.parent.relative_to(cache))
    shutil.copytree(world, learn / "cache" / world.relative_to(cache))
    if cpu_demo is not None:
        (learn / "cpu_demo").mkdir()
        for name in CPU_DEMO_FILES:
            shutil.copy2(cpu_demo / name, learn / "cpu_demo" / name)
    size, room = folder_bytes(learn), CALL_LIMIT - MARGIN - tracked_bytes(ROOT)
    if size > room:
        raise SystemExit(f"{learn}: {size:,} bytes, over the {room:,} one call carries beside the working tree "
                         f"(the start's float32 weights are most of it)")
    return size


def folder_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


def main(argv: list[str] | None = None) -> None:
    from envs.cache import DEVICE_WHEELS_DIR, default_cache_dir

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", default=os.environ.get("TREEGRPO_DATA_DIR"),
                        help="the QA data directory (default: $TREEGRPO_DATA_DIR)")
    parser.add_argument("--output", default=str(ROOT / ".device"), help="where the call folders go")
    parser.add_argument("--wheel-cache", default=str(default_cache_dir() / DEVICE_WHEELS_DIR),
                        help="downloaded wheels, kept between builds (default: device-wheels/ in the project's cache)")
    parser.add_argument("--python-version", default=DEVICE_PYTHON,
                        help="the Python the wheels are for (default: the lent machine's; this machine's "
                             "to rehearse the device script here)")
    parser.add_argument("--learn", action="store_true",
                        help="write only the learn call's folder (the CPU demo's cached start and world, from the "
                             "project's cache; needs no data directory and downloads nothing)")
    parser.add_argument("--cpu-demo", default=None,
                        help="with --learn: a CPU demo run's output directory (python experiments/demo.py "
                             "--no-mlflow --output DIR), carried as the comparison's reference")
    parser.add_argument("--cache-dir", default=str(default_cache_dir()),
                        help="with --learn: the project's cache that holds the demo's start (default: "
                             "$TREEGRPO_CACHE_DIR, else ~/.cache/tree-grpo)")
    args = parser.parse_args(argv)
    tree = tracked_bytes(ROOT)
    if args.learn:
        size = build_learn(Path(args.cache_dir), Path(args.output),
                           Path(args.cpu_demo) if args.cpu_demo else None)
        print(f"{args.output}/{LEARN}: {size / 2**20:.1f} MiB (+ {tree / 2**20:.1f} MiB of tracked files; "
              f"limit {CALL_LIMIT / 2**20:.0f} MiB)")
        return
    if not args.data_dir:
        raise SystemExit("no data directory: set TREEGRPO_DATA_DIR or pass --data-dir")
    sizes = build(Path(args.data_dir), Path(args.output), Path(args.wheel_cache), args.python_version)
    for call, size in sizes.items():
        print(f"{args.output}/{call}: {size / 2**20:.1f} MiB (+ {tree / 2**20:.1f} MiB of tracked files; "
              f"limit {CALL_LIMIT / 2**20:.0f} MiB)")


if __name__ == "__main__":
    main()
