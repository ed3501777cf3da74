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

vLLM on the GPU (issue 63, item 4): ``python benchmarks/device_kit.py --vllm`` writes ``.device/vllm1`` ...
``.device/vllmN`` from the wheel list ``benchmarks/vllm_kit_wheels.txt`` (``benchmarks/vllm_kit.py resolve`` writes
it: vLLM 0.26.0, which pins the image's torch 2.11.0, and the wheels it needs beyond the image): the dependency
wheels and what the tests and the bench import beyond them (gymnasium, SmolLM2's tokenizer) packed whole into the
fewest calls, vLLM's 304 MB wheel cut to fill them (``pack_calls``; each call under ``call_room()`` beside the
working tree), with its sha256; HotpotQA's data only where a call has room left. Then, back to back on one warm
machine, ``device_check.sh vllm-part K`` for K = 1 ... N-1 and ``device_check.sh vllm`` with the last
(benchmarks/README.md, "vLLM on the GPU", has the calls and the estimate). The same ``write_split`` /
``join_parts`` cut and join Ray's wheel for calls 1 and 2.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import tarfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from packaging.utils import canonicalize_name

from benchmarks import vllm_kit
from benchmarks.wheels import default_wheel_cache, download_wheels, pip_download, sha256_of

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
VLLM_CALL = "vllm"  # the vLLM calls' folders below the output: vllm1 ... vllmN
# What the vLLM call's tests and bench import beyond vLLM and the image, without Ray (from SMALL_WHEELS)
VLLM_CALL_WHEELS = ("gymnasium", "farama-notifications", "rank-bm25", "typing_extensions")
CPU_DEMO_FILES = ("metrics.jsonl", "demo.json")  # what the learn call compares the GPU's demo with
# The wheel tags pip may take for the lent machine (glibc 2.39: python3 is Ubuntu 24.04's 3.12.3); pip matches
# each manylinux_2_N exactly, so every N a needed wheel is built for is named.
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
    call1, call2 = out / "call1", out / "call2"
    for folder in (call1, call2):  # the learn call's folder (--learn) is kept
        shutil.rmtree(folder, ignore_errors=True)
    (call1 / "wheels").mkdir(parents=True)
    call2.mkdir(parents=True)
    for wheel in download_wheels(SMALL_WHEELS, cache, python):
        shutil.copy2(wheel, call1 / "wheels" / wheel.name)
    write_data(data_dir, call1 / "data.tgz")
    copy_tokenizer(call1)

    ray_wheel = download_wheels((RAY,), cache, python)[0]
    size, room = ray_wheel.stat().st_size, call_room()
    first = room - folder_bytes(call1)
    if first <= 0 or size - first > room:
        raise SystemExit(f"Ray's wheel ({size} bytes) does not fit two calls beside the rest of the kit")
    write_split(ray_wheel, RAY, [(call1, first), (call2, size - first)])
    return {"call1": folder_bytes(call1), "call2": folder_bytes(call2)}


def call_room() -> int:
    """What one call carries beside the working tree."""
    return CALL_LIMIT - MARGIN - tracked_bytes(ROOT)


def write_data(data_dir: Path, path: Path) -> None:
    """HotpotQA and the wiki corpus (``DATA``), a gzip tar of the data directory's folders."""
    with tarfile.open(path, "w:gz") as archive:
        for name in DATA:
            archive.add(data_dir / name, arcname=name)


def copy_tokenizer(folder: Path) -> None:
    """SmolLM2's tokenizer into ``folder/models`` (as the model cache holds it)."""
    from policies.models import model_cache_dir, smollm2_tokenizer

    smollm2_tokenizer(model_cache_dir())  # converted from the GGUF once, if not yet
    shutil.copytree(model_cache_dir() / "smollm2-tokenizer", folder / "models" / "smollm2-tokenizer")


# -- a wheel in parts ----------------------------------------------------------------------------------------------


def write_split(wheel: Path, stem: str, parts: list[tuple[Path, int]]) -> None:
    """``wheel`` as consecutive parts, ``STEM.whl.I`` of the given bytes in the given folders (the I-th of ``parts``),
    and in each of those folders what ``join_parts`` checks: ``STEM.whl.name``, ``.sha256`` and ``.parts``."""
    if sum(length for _, length in parts) != wheel.stat().st_size or any(length <= 0 for _, length in parts):
        raise ValueError(f"{wheel.name}: parts of {[length for _, length in parts]} bytes do not cover it")
    digest = sha256_of(wheel)
    with wheel.open("rb") as source:
        for index, (folder, length) in enumerate(parts):
            folder.mkdir(parents=True, exist_ok=True)
            (folder / f"{stem}.whl.{index}").write_bytes(source.read(length))
    for folder in {folder for folder, _ in parts}:
        (folder / f"{stem}.whl.name").write_text(wheel.name + "\n")
        (folder / f"{stem}.whl.sha256").write_text(digest + "\n")
        (folder / f"{stem}.whl.parts").write_text(f"{len(parts)}\n")


def join_parts(folder: Path, stem: str) -> Path:
    """The wheel that ``write_split`` cut, joined from the parts in ``folder`` (copied there from every call) and
    checked against its sha256; a ``SystemExit`` naming the missing parts or the mismatch."""
    name = (folder / f"{stem}.whl.name").read_text().strip()
    expected = (folder / f"{stem}.whl.sha256").read_text().strip()
    count = int((folder / f"{stem}.whl.parts").read_text())
    missing = [index for index in range(count) if not (folder / f"{stem}.whl.{index}").is_file()]
    if missing:
        raise SystemExit(f"{folder}: {stem}'s parts {missing} of {count} are missing (not stored on this machine)")
    wheel, digest = folder / name, hashlib.sha256()
    with wheel.open("wb") as joined:
        for index in range(count):
            data = (folder / f"{stem}.whl.{index}").read_bytes()
            digest.update(data)
            joined.write(data)
    if digest.hexdigest() != expected:
        wheel.unlink()
        raise SystemExit(f"{name}: sha256 {digest.hexdigest()} after joining, expected {expected}")
    return wheel


# -- packing into calls --------------------------------------------------------------------------------------------


@dataclass
class Call:
    """What one device call carries: whole items (by name), a piece of the split item (offset, bytes) or none."""

    items: list[str] = field(default_factory=list)
    piece: tuple[int, int] | None = None
    used: int = 0


def pack_calls(items: dict[str, int], split: int, room: int, optional: dict[str, int] | None = None) -> list[Call]:
    """The fewest calls of ``room`` bytes for the whole ``items`` (name: bytes) and ``split`` bytes of one item that
    may be cut anywhere: the whole items first fit, largest first; then the split item poured into the calls in
    order, each filled before the next (more calls only as needed: ceil(total / room) when the whole items pack
    without waste); then each ``optional`` item where it still fits, else nowhere (it is left out, no call added)."""
    calls: list[Call] = []
    for name, size in sorted(items.items(), key=lambda item: (-item[1], item[0])):
        if size > room:
            raise SystemExit(f"{name}: {size:,} bytes, over the {room:,} one call carries beside the working tree")
        call = next((c for c in calls if c.used + size <= room), None)
        if call is None:
            call = Call()
            calls.append(call)
        call.items.append(name)
        call.used += size
    while sum(room - c.used for c in calls) < split:
        calls.append(Call())
    offset = 0
    for call in calls:
        length = min(split - offset, room - call.used)
        if length > 0:
            call.piece, offset, call.used = (offset, length), offset + length, call.used + length
    for name, size in sorted((optional or {}).items(), key=lambda item: (-item[1], item[0])):
        call = next((c for c in reversed(calls) if c.used + size <= room), None)
        if call is not None:
            call.items.append(name)
            call.used += size
    return calls


def build_vllm(out: Path, cache: Path, data_dir: Path | None = None, python: str = DEVICE_PYTHON) -> dict[str, int]:
    """Write ``out/vllm1`` ... ``out/vllmN`` (see the module docstring) from the kit list
    (``benchmarks/vllm_kit_wheels.txt``); returns each folder's bytes. The wheels are downloaded into ``cache`` (once)
    and checked against the list's sha256."""
    kit = vllm_kit.read_kit_list(vllm_kit.KIT_LIST.read_text())
    paths = pip_download({w.name: w.version for w in kit.wheels}, cache, python)
    for wheel in kit.wheels:
        if sha256_of(paths[wheel.name]) != wheel.sha256:
            raise SystemExit(f"{paths[wheel.name]}: not the wheel the kit list names (sha256 {wheel.sha256})")
    listed = {canonicalize_name(w.name) for w in kit.wheels}
    extra = [name for name in VLLM_CALL_WHEELS if canonicalize_name(name) not in listed]
    whole = {path.name: path for name, path in paths.items() if name != vllm_kit.VLLM}
    whole.update({path.name: path for path in download_wheels(tuple(extra), cache, python)})
    for folder in out.glob(f"{VLLM_CALL}*"):  # an earlier build's calls, however many
        shutil.rmtree(folder)
    with tempfile.TemporaryDirectory(prefix="vllm-kit-") as tmp:
        staging = Path(tmp)
        copy_tokenizer(staging)
        tokenizer = staging / "models"
        optional = {}
        if data_dir is not None and all((data_dir / name).is_dir() for name in DATA):
            write_data(data_dir, staging / "data.tgz")
            optional["data.tgz"] = (staging / "data.tgz").stat().st_size
        sizes = {name: path.stat().st_size for name, path in whole.items()}
        sizes["models"] = folder_bytes(tokenizer)
        calls = pack_calls(sizes, kit.vllm.size, call_room(), optional)
        folders = [out / f"{VLLM_CALL}{index}" for index in range(1, len(calls) + 1)]
        for folder, call in zip(folders, calls, strict=True):
            (folder / "wheels").mkdir(parents=True)
            (folder / f"{VLLM_CALL}.calls").write_text(f"{len(calls)}\n")
            for name in call.items:
                if name == "models":
                    shutil.copytree(tokenizer, folder / "models")
                elif name == "data.tgz":
                    shutil.copy2(staging / name, folder / name)
                else:
                    shutil.copy2(whole[name], folder / "wheels" / name)
        pieces = [(folder, call.piece[1]) for folder, call in zip(folders, calls, strict=True) if call.piece]
        write_split(paths[vllm_kit.VLLM], vllm_kit.VLLM, pieces)
        if optional and not any("data.tgz" in call.items for call in calls):
            print(f"data.tgz ({optional['data.tgz']:,} bytes) fits no call's spare room: left out (the tree test "
                  "skips without the data)")
    return {folder.name: folder_bytes(folder) for folder in folders}


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
    size, room = folder_bytes(learn), call_room()
    if size > room:
        raise SystemExit(f"{learn}: {size:,} bytes, over the {room:,} one call carries beside the working tree "
                         f"(the start's float32 weights are most of it)")
    return size


def folder_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", default=os.environ.get("TREEGRPO_DATA_DIR"),
                        help="the QA data directory (default: $TREEGRPO_DATA_DIR)")
    parser.add_argument("--output", default=str(ROOT / ".device"), help="where the call folders go")
    parser.add_argument("--wheel-cache", default=None,
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
    parser.add_argument("--cache-dir", default=None,
                        help="with --learn: the project's cache that holds the demo's start (default: "
                             "$TREEGRPO_CACHE_DIR, else ~/.cache/tree-grpo)")
    parser.add_argument("--vllm", action="store_true",
                        help="write only the vLLM calls' folders vllm1 ... vllmN (benchmarks/vllm_kit_wheels.txt's "
                             "wheels, vLLM's in parts; the data directory's HotpotQA where room is left)")
    parser.add_argument("--join", nargs=2, metavar=("DIR", "STEM"),
                        help="on the lent machine: join DIR/STEM.whl.0 ... into the wheel, check its sha256 and "
                             "print its path")
    args = parser.parse_args(argv)
    if args.join:
        print(join_parts(Path(args.join[0]), args.join[1]))
        return
    tree = tracked_bytes(ROOT)
    wheel_cache = Path(args.wheel_cache) if args.wheel_cache else default_wheel_cache()
    if args.learn:
        from envs.cache import default_cache_dir

        size = build_learn(Path(args.cache_dir) if args.cache_dir else default_cache_dir(), Path(args.output),
                           Path(args.cpu_demo) if args.cpu_demo else None)
        sizes = {LEARN: size}
    elif args.vllm:
        sizes = build_vllm(Path(args.output), wheel_cache, Path(args.data_dir) if args.data_dir else None,
                           args.python_version)
    elif not args.data_dir:
        raise SystemExit("no data directory: set TREEGRPO_DATA_DIR or pass --data-dir")
    else:
        sizes = build(Path(args.data_dir), Path(args.output), wheel_cache, args.python_version)
    for call, size in sizes.items():
        print(f"{args.output}/{call}: {size / 2**20:.1f} MiB (+ {tree / 2**20:.1f} MiB of tracked files; "
              f"limit {CALL_LIMIT / 2**20:.0f} MiB)")

if __name__ == "__main__":
    main()
