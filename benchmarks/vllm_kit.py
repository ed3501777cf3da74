"""vLLM for the lent GPU machine (issue 63, item 4): which wheels its install needs beyond the machine's image, and
whether what got installed there meets vLLM's requirements.

    python benchmarks/vllm_kit.py resolve   # here, on the CPU (PyPI): writes benchmarks/vllm_kit_wheels.txt
    python3 benchmarks/vllm_kit.py check    # there, after the install: vLLM's requirements against what is installed

``resolve`` asks pip's resolver (``pip install --dry-run --report``, wheels only, for CPython 3.12 on manylinux
x86-64) what ``vllm==0.26.0`` installs, with the image's packages of known version pinned at it
(``benchmarks/device_image.txt``; the torch family and triton as stub wheels of the image's versions: PyPI's
torch 2.11.0 asks for an nvidia-nccl-cu13 release PyPI does not serve, and the image has its own build). Then it
walks vLLM's requirements from the top with the markers of the lent machine's Python (pip evaluates markers with the
Python that runs it, 3.11 here): a requirement the image meets (its version known and inside the specifier, or
unknown) is left to the image and written as an ``image`` line, for the device's check; everything else is carried,
at the version pip picked, and its own requirements are walked in turn. Requirements that the walk finds and the
resolution lacks (a marker that holds on 3.12 only) go back to pip as requirements of their own, until none is left.
The carried wheels are downloaded once (the wheel cache) for their sizes and sha256.

The list's lines (``read_kit_list``)::

    wheel NAME VERSION BYTES SHA256 FILE     carried: the wheel that pip downloads as NAME==VERSION
    image NAME SPECIFIER IMAGE_VERSION       left to the image: what the walk asks of it ("*": any version; "?": the
                                             image's version was not read)
    omit NAME VERSION BYTES WHY...           installed by pip, left out by the kit (``OMITTED``, or needed only by
                                             what is left out)

``check`` runs with the machine's python3 and the install on ``PYTHONPATH``; it needs ``packaging`` only (the image
has it) and prints every requirement of vLLM's walk that the installed distributions miss, the image's versions of
the ``image`` lines beside what they were asked for; it exits 0 either way (an unmet pin is a finding, not a stop).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

from benchmarks.wheels import default_wheel_cache, pip_download, pip_platform_args, sha256_of, write_stub_wheel

HERE = Path(__file__).resolve().parent
VLLM = "vllm"
VLLM_VERSION = "0.26.0"  # the release that pins the image's torch (torch==2.11.0, torchvision==0.26.0)
IMAGE_FILE = HERE / "device_image.txt"
KIT_LIST = HERE / "vllm_kit_wheels.txt"
# The image's packages that stand in the resolution as stub wheels of the image's versions (no requirements of their
# own): PyPI's torch 2.11.0 needs nvidia-nccl-cu13==2.28.9, which PyPI does not serve, and the image's CUDA 13 builds
# are not PyPI's; what they need is in the image.
STUBBED = ("torch", "torchvision", "torchaudio", "triton")
# The image's packages whose version vLLM's requirements exclude, so the resolution may not pin them (carried then).
UNPINNED = {"numpy": "mistral_common (every release vLLM 0.26.0 admits) needs numpy<2.4 on Python 3.12 and numba "
                     "0.65.0 (pinned by vLLM) numpy<2.5: the image's 2.5.2 meets neither"}
# The lent machine's Python: the markers the walk evaluates (python3 there is 3.12.3 on x86-64 Linux).
TARGET_PYTHON = "3.12"
TARGET_MARKERS = {"python_version": "3.12", "python_full_version": "3.12.3", "implementation_name": "cpython",
                  "implementation_version": "3.12.3", "platform_python_implementation": "CPython",
                  "platform_machine": "x86_64", "platform_system": "Linux", "sys_platform": "linux",
                  "os_name": "posix"}
RESOLVE_ROUNDS = 4
# What pip installs with vLLM and the kit leaves out: none of it is imported where the vLLM generator goes (a Llama
# in bf16 or float32 on one Hopper GPU, vLLM's own FlashAttention 3 and Triton kernels), and together it is most of the
# bytes (benchmarks/README.md, "vLLM on the GPU"). What these alone need is left out with them.
OMITTED = {
    "flashinfer-python": "FlashInfer's kernels, compiled at first use; its top-p/top-k sampler is vLLM's default, so "
                         "the device call sets VLLM_USE_FLASHINFER_SAMPLER=0 (vLLM's Triton top-p path instead)",
    "nvidia-cutlass-dsl": "CuTe DSL kernels (FlashAttention 4 on Blackwell GPUs, quack)",
    "quack-kernels": "CuTe DSL kernels",
    "humming-kernels": "quantised linear kernels (vLLM imports them only when present: has_humming)",
    "tilelang": "TileLang kernels (mHC)",
    "tokenspeed-mla": "MLA attention (DeepSeek's architectures)",
    "pynvvideocodec": "video decoding (multimodal inputs)",
    "torchcodec": "audio and video decoding (multimodal inputs)",
    "mistral-common": "Mistral's tokenizers and llguidance's grammars; it needs numpy<2.4 on Python 3.12, which the "
                      "image's 2.5.2 is not (so numpy would be carried too)",
    "nvidia-cudnn-frontend": "cuDNN attention through FlashInfer (vision encoders)",
    "apache-tvm-ffi": "TVM FFI, for FlashInfer's and the CuTe DSL's kernels",
    "fastsafetensors": "the fastsafetensors load format (the generator hands weights over in memory)",
    "anthropic": "the server's Anthropic Messages API",
    "mcp": "the server's tool servers (Model Context Protocol)",
    "model-hosting-container-standards": "the server's SageMaker routes",
    "opentelemetry-sdk": "tracing (vllm.tracing imports OpenTelemetry inside a try)",
    "opentelemetry-api": "tracing",
    "opentelemetry-exporter-otlp": "tracing",
    "opentelemetry-semantic-conventions-ai": "tracing",
    "fastapi-cli": "the server's command line (fastapi[standard])",
    "uvicorn": "the HTTP server (fastapi[standard])",
    "watchfiles": "the server's reload (vLLM imports it nowhere)",
    "email-validator": "fastapi[standard]'s e-mail fields",
}


@dataclass(frozen=True)
class Wheel:
    """A carried wheel: pip downloads it as ``name==version``."""

    name: str
    version: str
    size: int
    sha256: str
    file: str


@dataclass(frozen=True)
class ImageRequirement:
    """A requirement left to the image: ``specifier`` is what the walk asks ("" for any version); ``image_version``
    the version read there, None when none was read."""

    name: str
    specifier: str
    image_version: str | None


@dataclass(frozen=True)
class Omitted:
    """A wheel pip installs with vLLM that the kit leaves out, and why."""

    name: str
    version: str
    size: int
    why: str


@dataclass(frozen=True)
class KitList:
    wheels: tuple[Wheel, ...]
    image: tuple[ImageRequirement, ...]
    omitted: tuple[Omitted, ...] = ()

    @property
    def vllm(self) -> Wheel:
        (wheel,) = (w for w in self.wheels if w.name == VLLM)
        return wheel

    @property
    def dependencies(self) -> tuple[Wheel, ...]:
        return tuple(w for w in self.wheels if w.name != VLLM)

    @property
    def total_bytes(self) -> int:
        return sum(w.size for w in self.wheels)


def read_image(path: Path = IMAGE_FILE) -> dict[str, str | None]:
    """The image's packages (canonical names) and the version read there, None where none was."""
    packages: dict[str, str | None] = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            packages[canonicalize_name(name)] = version or None
    return packages


def read_kit_list(text: str) -> KitList:
    """The kit list's ``wheel`` and ``image`` lines (see the module docstring); anything else is refused."""
    wheels, image, omitted = [], [], []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        kind, *fields = line.split(maxsplit=4 if line.startswith("omit ") else -1)
        if kind == "omit" and len(fields) == 4:
            name, version, size, why = fields
            omitted.append(Omitted(name, version, int(size), why))
        elif kind == "wheel" and len(fields) == 5:
            name, version, size, sha256, file = fields
            wheels.append(Wheel(name, version, int(size), sha256, file))
        elif kind == "image" and len(fields) == 3:
            name, specifier, version = fields
            image.append(ImageRequirement(name, "" if specifier == "*" else specifier,
                                          None if version == "?" else version))
        else:
            raise ValueError(f"line {number}: not a wheel, image or omit line: {line!r}")
    carried = [w.name for w in wheels]
    for others in ([r.name for r in image], [o.name for o in omitted]):  # an omitted one may be left to the image
        names = carried + others
        twice = sorted({name for name in names if names.count(name) > 1})
        if twice:
            raise ValueError(f"listed twice: {', '.join(twice)}")
    if sum(w.name == VLLM for w in wheels) != 1:
        raise ValueError(f"no {VLLM} wheel line")
    return KitList(tuple(wheels), tuple(image), tuple(omitted))


def format_kit_list(kit: KitList, header: Iterable[str] = ()) -> str:
    lines = [f"# {line}" if line else "#" for line in header]
    lines += [f"wheel {w.name} {w.version} {w.size} {w.sha256} {w.file}" for w in kit.wheels]
    lines += [f"image {r.name} {r.specifier or '*'} {r.image_version or '?'}" for r in kit.image]
    lines += [f"omit {o.name} {o.version} {o.size} {o.why}" for o in kit.omitted]
    return "\n".join(lines) + "\n"


# -- the walk ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Dist:
    """A resolved distribution: its version and its ``Requires-Dist`` lines."""

    version: str
    requires: tuple[str, ...] = ()


@dataclass
class Walk:
    carried: dict[str, Dist] = field(default_factory=dict)  # canonical name -> the resolution's distribution
    image: dict[str, SpecifierSet] = field(default_factory=dict)  # left to the image: what is asked of it
    unresolved: list[Requirement] = field(default_factory=list)  # asked, and neither resolved nor in the image
    omitted: set[str] = field(default_factory=set)  # asked for, and left out (``omit``)
    required_by: dict[str, set[str]] = field(default_factory=dict)  # carried name -> who asks: NAME[EXTRAS]


def applies(requirement: Requirement, extras: frozenset[str], environment: Mapping[str, str]) -> bool:
    """Whether ``requirement`` holds in ``environment`` for a distribution asked for with ``extras``."""
    if requirement.marker is None:
        return True
    return any(requirement.marker.evaluate({**environment, "extra": extra}) for extra in (*sorted(extras), ""))


def walk(root: str, resolved: Mapping[str, Dist], image: Mapping[str, str | None],
         environment: Mapping[str, str], omit: Iterable[str] = ()) -> Walk:
    """vLLM's requirements from ``root`` down (see the module docstring): what is carried, what is left to the
    image, what neither holds; the names in ``omit`` are neither carried nor walked. ``resolved`` and ``image`` are
    keyed by canonical names."""
    omit = {canonicalize_name(name) for name in omit}
    result = Walk()
    asked: dict[str, list[Requirement]] = {}  # every requirement met so far, by name
    queue: list[tuple[str, frozenset[str]]] = [(canonicalize_name(root), frozenset())]
    walked: set[tuple[str, frozenset[str]]] = set()
    result.carried[queue[0][0]] = resolved[queue[0][0]]
    while queue:
        name, extras = queue.pop()
        if (name, extras) in walked:
            continue
        walked.add((name, extras))
        for text in resolved[name].requires:
            requirement = Requirement(text)
            if not applies(requirement, extras, environment):
                continue
            wanted = canonicalize_name(requirement.name)
            if wanted in omit:
                result.omitted.add(wanted)
                continue
            asked.setdefault(wanted, []).append(requirement)
            if wanted not in result.carried and image_meets(wanted, asked[wanted], image):
                specifier = result.image.get(wanted, SpecifierSet())
                result.image[wanted] = specifier & requirement.specifier
                continue
            dist = resolved.get(wanted)
            if dist is None or not requirement.specifier.contains(dist.version, prereleases=True):
                result.unresolved.append(requirement)
                continue
            result.image.pop(wanted, None)  # an image package a later requirement excludes: carried after all
            result.carried[wanted] = dist
            result.required_by.setdefault(wanted, set()).add(f"{name}[{','.join(sorted(extras))}]" if extras else name)
            queue.append((wanted, frozenset(map(canonicalize_name, requirement.extras))))
    return result


def image_meets(name: str, requirements: list[Requirement], image: Mapping[str, str | None]) -> bool:
    """Whether the image's ``name`` meets every requirement on it (a version not read meets any)."""
    if name not in image:
        return False
    version = image[name]
    return version is None or all(r.specifier.contains(Version(version), prereleases=True) for r in requirements)


# -- the resolution ---------------------------------------------------------------------------------------------------


def target_environment() -> dict[str, str]:
    return {**default_environment(), **TARGET_MARKERS}


def stub_version(version: str) -> str:
    """A version only the stub wheel has (a local label), so that pip never takes PyPI's build instead."""
    return version if "+" in version else f"{version}+image"


def resolve(requirements: list[str], image: Mapping[str, str | None], python: str = TARGET_PYTHON) -> dict[str, Dist]:
    """pip's resolution of ``requirements`` for the lent machine's Python, the image's known versions pinned (see
    the module docstring): every distribution it installs, by canonical name."""
    with tempfile.TemporaryDirectory(prefix="vllm-kit-") as tmp:
        stubs, constraints = Path(tmp) / "stubs", []
        stubs.mkdir()
        for name, version in image.items():
            if version is None or name in UNPINNED:
                continue
            if name in STUBBED:
                version = stub_version(version)
                write_stub_wheel(stubs, name, version)
            constraints.append(f"{name}=={version}")
        (Path(tmp) / "constraints.txt").write_text("\n".join(constraints) + "\n")
        report = Path(tmp) / "report.json"
        subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                        "--report", str(report), "--target", str(Path(tmp) / "target"), *pip_platform_args(python),
                        "--find-links", str(stubs), "-c", str(Path(tmp) / "constraints.txt"), *requirements],
                       check=True)
        installs = json.loads(report.read_text())["install"]
    return {canonicalize_name(item["metadata"]["name"]):
            Dist(item["metadata"]["version"], tuple(item["metadata"].get("requires_dist", ())))
            for item in installs}


def resolve_vllm(image: Mapping[str, str | None], version: str = VLLM_VERSION) -> tuple[dict[str, Dist], Walk]:
    """Resolve, walk, and resolve again with what the walk found missing, until nothing is: the resolution and the
    whole walk (nothing omitted)."""
    requirements, environment = [f"{VLLM}=={version}"], target_environment()
    for _ in range(RESOLVE_ROUNDS):
        resolved = resolve(requirements, image)
        result = walk(VLLM, resolved, image, environment)
        if not result.unresolved:
            return resolved, result
        missing = [str(Requirement(f"{r.name}{r.specifier}")) for r in result.unresolved]
        print(f"resolving again with {', '.join(missing)} (markers that hold on Python {TARGET_PYTHON})")
        requirements += [m for m in missing if m not in requirements]
    raise SystemExit(f"still unresolved after {RESOLVE_ROUNDS} rounds: {', '.join(map(str, result.unresolved))}")


def omission_reasons(whole: Walk, kept: Walk, image: Mapping[str, str | None]) -> dict[str, str]:
    """Why each package of the whole walk is not in the kept one: its ``OMITTED`` entry, else who asked for it (an
    image package that only an omitted one wanted at another version: the image's serves the rest)."""
    reasons = {}
    for name in sorted(set(whole.carried) - set(kept.carried)):
        asking = ", ".join(sorted(whole.required_by.get(name, ())))
        if name in OMITTED:
            reasons[name] = OMITTED[name]
        elif name in image:
            reasons[name] = f"the image's {image[name] or 'own'} serves what is kept; pip carries it for {asking}"
        else:
            reasons[name] = f"needed only by {asking}"
    return reasons


def kit_list(whole: Walk, kept: Walk, image: Mapping[str, str | None], cache: Path,
             python: str = TARGET_PYTHON) -> KitList:
    """The carried wheels (``kept``'s), the image's lines (what ``kept`` asks of it) and the omitted wheels (the
    rest of ``whole``), every wheel downloaded into ``cache`` for its size and hash."""
    versions = {name: dist.version for name, dist in whole.carried.items()}
    paths = pip_download(versions, cache, python)
    wheels = sorted((Wheel(name, versions[name], paths[name].stat().st_size, sha256_of(paths[name]), paths[name].name)
                     for name in kept.carried), key=lambda w: (w.name != VLLM, -w.size, w.name))
    requirements = sorted((ImageRequirement(name, str(specifier), image[name])
                           for name, specifier in kept.image.items()), key=lambda r: r.name)
    omitted = sorted((Omitted(name, versions[name], paths[name].stat().st_size, why)
                      for name, why in omission_reasons(whole, kept, image).items()), key=lambda o: (-o.size, o.name))
    return KitList(tuple(wheels), tuple(requirements), tuple(omitted))


# -- the check on the machine -----------------------------------------------------------------------------------------


def installed_requirements_report(root: str = VLLM, kit: KitList | None = None) -> list[str]:
    """What the installed distributions (this Python's ``sys.path``) miss of ``root``'s requirements, walked down
    through the carried ones (``kit``'s wheels; every installed one without a kit), the kit's omitted ones said so;
    then the image lines' installed versions. One line each."""
    import importlib.metadata as metadata

    def version(name: str) -> str | None:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    if version(root) is None:
        return [f"missing: {root} is not installed"]
    carried = {canonicalize_name(w.name) for w in kit.wheels} if kit else None
    omitted = {canonicalize_name(o.name) for o in kit.omitted} if kit else set()
    environment, lines = {**default_environment()}, []
    queue, walked = [(root, frozenset())], set()
    while queue:
        name, extras = queue.pop()
        if (canonicalize_name(name), extras) in walked:
            continue
        walked.add((canonicalize_name(name), extras))
        for text in metadata.requires(name) or ():
            requirement = Requirement(text)
            if not applies(requirement, extras, environment):
                continue
            found = version(requirement.name)
            if found is None:
                kind = "omitted" if canonicalize_name(requirement.name) in omitted else "missing"
                lines.append(f"{kind}: {requirement.name}{requirement.specifier} (for {name})")
                continue
            if not requirement.specifier.contains(found, prereleases=True):
                lines.append(f"unmet: {requirement.name}{requirement.specifier} (for {name}), {found} installed")
            if carried is None or canonicalize_name(requirement.name) in carried:  # the image's own are its business
                queue.append((requirement.name, frozenset(map(canonicalize_name, requirement.extras))))
    for line in kit.image if kit else ():
        found = version(line.name)
        status = "missing" if found is None else "ok" if SpecifierSet(line.specifier).contains(
            found, prereleases=True) else "UNMET"
        lines.append(f"image {status}: {line.name} {found or '-'} (asked {line.specifier or 'any'}; the list read "
                     f"{line.image_version or 'no version'})")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=("resolve", "check"))
    parser.add_argument("--list", default=str(KIT_LIST), help="the kit list (default: %(default)s)")
    parser.add_argument("--wheel-cache", default=None,
                        help="resolve: where the carried wheels are downloaded (default: the device kit's)")
    args = parser.parse_args(argv)
    if args.command == "check":
        kit = read_kit_list(Path(args.list).read_text()) if Path(args.list).is_file() else None
        lines = installed_requirements_report(VLLM, kit)
        print("\n".join(lines) if lines else f"{VLLM}: every requirement met")
        return
    image = read_image()
    resolved, whole = resolve_vllm(image)
    kept = walk(VLLM, resolved, image, target_environment(), omit=OMITTED)
    cache = Path(args.wheel_cache) if args.wheel_cache else default_wheel_cache()
    kit = kit_list(whole, kept, image, cache)
    omitted_bytes = sum(o.size for o in kit.omitted)
    header = [f"What {VLLM}=={VLLM_VERSION} needs on the lent GPU machine beyond its image "
              "(benchmarks/device_image.txt),",
              f"for CPython {TARGET_PYTHON} on manylinux x86-64: written by `python benchmarks/vllm_kit.py resolve` "
              "(do not edit by hand).",
              f"pip would install {len(kit.wheels) + len(kit.omitted)} wheels, "
              f"{kit.total_bytes + omitted_bytes:,} bytes; the kit carries {len(kit.wheels)}, {kit.total_bytes:,} "
              f"bytes, and omits {len(kit.omitted)} ({omitted_bytes:,} bytes: vllm_kit.OMITTED);",
              f"{len(kit.image)} requirements are left to the image.",
              "", "wheel NAME VERSION BYTES SHA256 FILE | image NAME SPECIFIER IMAGE_VERSION | "
              "omit NAME VERSION BYTES WHY"]
    Path(args.list).write_text(format_kit_list(kit, header))
    print(f"{args.list}: {len(kit.wheels)} wheels, {kit.total_bytes / 1e6:.1f} MB carried; {len(kit.omitted)} "
          f"omitted, {omitted_bytes / 1e6:.1f} MB; {len(kit.image)} image lines")

if __name__ == "__main__":
    main()
