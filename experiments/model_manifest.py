"""A cached model directory's manifest (each file's size and sha256, ``MANIFEST``), so that a damaged cache entry (a
truncated or altered file, one gone) is found before a run trains from it, and rebuilt rather than half-loaded."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

MANIFEST = "manifest.json"  # beside the model directory: {file name: {"size", "sha256"}}


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def manifest_path(model: Path) -> Path:
    return model.parent / MANIFEST


def write_manifest(model: Path) -> None:
    """Record the size and sha256 of every file in ``model`` (written to a temporary name, then renamed)."""
    entries = {f.name: {"size": f.stat().st_size, "sha256": file_sha256(f)}
               for f in sorted(model.iterdir()) if f.is_file()}
    staged = manifest_path(model).with_name(f"{MANIFEST}.tmp{os.getpid()}")
    staged.write_text(json.dumps(entries, indent=1), encoding="utf-8")
    os.replace(staged, manifest_path(model))


def weights_digest(model: Path) -> str:
    """A short digest of ``model``'s weights (its safetensors files' sha256, from the manifest where there is one):
    two builds of one recipe on CPUs with different vector units differ in the last bits, and this tells them apart."""
    recorded = manifest_path(model)
    entries = json.loads(recorded.read_text(encoding="utf-8")) if recorded.is_file() else {}
    weights = sorted(model.glob("*.safetensors"))
    if not weights:
        raise FileNotFoundError(f"{model} holds no *.safetensors weights")
    digest = hashlib.sha256()
    for path in weights:
        digest.update(path.name.encode() + (entries.get(path.name, {}).get("sha256") or file_sha256(path)).encode())
    return digest.hexdigest()[:12]


def damage(model: Path) -> str | None:
    """What is wrong with ``model`` against its manifest (a file missing, of another size or content), or None.
    A directory cached before manifests were written is checked for what a load needs (``config.json`` parses, each
    safetensors file's header and data are whole). Nothing is written: a cache the user may only read is checked too."""
    recorded = manifest_path(model)
    if not recorded.is_file():
        return structural_damage(model)
    for name, entry in json.loads(recorded.read_text(encoding="utf-8")).items():
        path = model / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != entry["size"]:
            return f"{name} holds {path.stat().st_size} bytes, not the {entry['size']} written"
        if file_sha256(path) != entry["sha256"]:
            return f"{name}'s content differs from what was written (sha256)"
    return None


def structural_damage(model: Path) -> str | None:
    """Whether ``model`` holds a parseable config.json and whole safetensors files (the header's offsets within the
    file), without a manifest to compare with."""
    try:
        json.loads((model / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        return f"config.json cannot be read ({error})"
    weights = sorted(model.glob("*.safetensors"))
    if not weights:
        return "no *.safetensors weights"
    for path in weights:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            length = int.from_bytes(head, "little") if len(head) == 8 else size
            try:
                header = json.loads(f.read(length)) if 8 + length <= size else None
            except ValueError:
                header = None
        if header is None:
            return f"{path.name}'s header is cut short or unreadable"
        end = max((entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"), default=0)
        if 8 + length + end != size:
            return f"{path.name} holds {size} bytes, its header describes {8 + length + end}"
    return None
