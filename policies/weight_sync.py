"""The weights the rollout engines need, packed into flat byte buckets of bounded size, and loaded back in place.

Sending side: :func:`engine_tensors` walks the sync scope of a model one tensor at a time (a torch ``DTensor``, a
sharded parameter, is cast to the engine's dtype shard by shard, then gathered with ``full_tensor()``, a collective
every rank of its mesh must join); :func:`pack_buckets` casts each tensor to the engine's dtype as it copies it
into a bucket (one pass, no separate cast copy), splitting a tensor larger than a bucket over several. A bucket is
a flat ``uint8`` numpy array over the bytes of a torch tensor (Ray stores a numpy array without pickling it and
hands it back as a read-only view of its object store: no copy on either side) with a manifest of :class:`Piece`
(name, element range, byte offset). So besides its model a process holds one gathered tensor and the bucket being
filled (and whichever buckets its caller keeps), never the whole state dict in float32.

Receiving side: :func:`load_buckets` checks the sender's :class:`TensorSpec` list against the module (the same
names, shapes; a clear error otherwise, before anything is written), then copies each piece straight into the
parameter's storage (``copy_`` casts to the parameter's dtype). No state dict, no ``load_state_dict``.
:func:`copy_weights` does the same tensor to tensor for a learner and an engine in one process, and
:func:`share_weights` lets such an engine hold the learner's own parameters instead, where :func:`shareable` says it
can (on the CPU, in the same dtype: no copy at all).

Sync scope (:func:`engine_tensors`): each parameter and persistent buffer once (tied weights, e.g. the input
embedding and the LM head, are one parameter: the receiving model's own tying restores the other name); for a
LoRA (peft) model only the adapters, since the frozen base is loaded identically on both sides.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import torch
from torch.distributed.tensor import DTensor

DEFAULT_BUCKET_MIB = 64  # the bound on one bucket's bytes
ALIGNMENT = 64  # bytes: every piece starts at an offset that a view of any dtype accepts


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of the sync scope: its name in the model, shape and the dtype it travels in."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Piece:
    """Elements ``[start, start + count)`` of tensor ``name`` (flattened), at byte ``offset`` of a bucket."""

    name: str
    dtype: torch.dtype
    start: int
    count: int
    offset: int

    @property
    def nbytes(self) -> int:
        return self.count * self.dtype.itemsize


@dataclass(frozen=True)
class Bucket:
    """Pieces of tensors and the bytes that hold them (``data``: a flat ``uint8`` array, or a stand-in for it
    such as a Ray ``ObjectRef`` while it travels)."""

    pieces: tuple[Piece, ...]
    data: object


def bucket_bytes(mib: float) -> int:
    """The byte bound of ``mib`` MiB buckets; a ``ValueError`` naming the option when it is not positive."""
    if not mib > 0:
        raise ValueError(f"sync_bucket_mib must be a positive number of MiB, got {mib!r}")
    return max(ALIGNMENT, int(mib * 2**20) // ALIGNMENT * ALIGNMENT)


def _scope(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The sync scope's tensors as the model holds them (sharded ones not gathered), each once."""
    adapters_only = hasattr(model, "peft_config")
    persistent = set(model.state_dict(keep_vars=True))
    buffers = ((name, buffer) for name, buffer in model.named_buffers() if name in persistent)
    for name, tensor in (*model.named_parameters(), *buffers):  # a shared (tied) tensor is listed once
        if not adapters_only or "lora_" in name:
            yield name, tensor


def travel_dtype(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    """The dtype ``tensor`` travels in: the engine's ``dtype`` for floating point (None: its own), its own
    otherwise."""
    return dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype


def tensor_specs(model: torch.nn.Module, dtype: torch.dtype | None = None) -> tuple[TensorSpec, ...]:
    """The specs of ``model``'s sync scope travelling in ``dtype`` (None: as held), without gathering anything
    (a ``DTensor``'s shape is the whole tensor's)."""
    return tuple(TensorSpec(name, tuple(tensor.shape), travel_dtype(tensor, dtype)) for name, tensor in _scope(model))


def engine_tensors(model: torch.nn.Module, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """The sync scope of ``model`` (see the module docstring), one tensor at a time, each whole (a ``DTensor``
    gathered: every rank holding a shard must iterate too, in the same order), detached. A sharded or device
    tensor is cast to ``dtype`` first (its floating point; None: as held), so that the gather and the copy to
    the host move the engine's bytes; a host tensor is left to be cast where it is copied."""
    for name, tensor in _scope(model):
        tensor = tensor.detach()
        if isinstance(tensor, DTensor) or tensor.device.type != "cpu":
            tensor = tensor.to(travel_dtype(tensor, dtype))
        yield name, tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def pack_buckets(tensors: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype, max_bytes: int, *,
                 pin_memory: bool = False) -> Iterator[Bucket]:
    """``tensors`` cast to ``dtype`` (floating point only) into buckets of at most ``max_bytes`` bytes, in order; a
    tensor that does not fit in the rest of a bucket continues in the next one. Each bucket's ``data`` is a new
    ``uint8`` numpy array over the bytes written (the caller may keep it); ``pin_memory``: in page-locked memory,
    which a GPU copies into many times faster than into pageable memory."""
    if max_bytes < ALIGNMENT:
        raise ValueError(f"a bucket must hold at least {ALIGNMENT} bytes, got {max_bytes}")

    def new_buffer() -> torch.Tensor:
        return torch.empty(max_bytes, dtype=torch.uint8, pin_memory=pin_memory)

    buffer, pieces, end, free = new_buffer(), [], 0, 0  # free: the next aligned byte
    for name, tensor in tensors:
        target = travel_dtype(tensor, dtype)
        flat = tensor.reshape(-1)
        start = 0
        while start < flat.numel():
            count = min((max_bytes - free) // target.itemsize, flat.numel() - start)
            if count == 0:  # full: the rest goes to the next bucket
                yield Bucket(tuple(pieces), buffer[:end].numpy())
                buffer, pieces, end, free = new_buffer(), [], 0, 0
                continue
            piece = Piece(name, target, start, count, free)
            end = free + piece.nbytes
            buffer[free:end].view(target).copy_(flat[start:start + count])
            pieces.append(piece)
            free = min(max_bytes, -(-end // ALIGNMENT) * ALIGNMENT)
            start += count
    if pieces:
        yield Bucket(tuple(pieces), buffer[:end].numpy())


def check_specs(model: torch.nn.Module, specs: Iterable[TensorSpec]) -> dict[str, torch.Tensor]:
    """``model``'s sync-scope tensors by name when ``specs`` name exactly those, with their shapes; otherwise a
    ``ValueError`` naming what is missing, unexpected or of another shape."""
    own = dict(_scope(model))
    sent = {spec.name: spec for spec in specs}
    missing, unexpected = sorted(set(own) - set(sent)), sorted(set(sent) - set(own))
    shapes = [f"{name} {tuple(own[name].shape)} != sent {spec.shape}" for name, spec in sent.items()
              if name in own and tuple(own[name].shape) != spec.shape]
    if missing or unexpected or shapes:
        raise ValueError(f"the synced weights do not match the {type(model).__name__}: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}, other shapes {shapes[:5]}")
    return own


def _bytes_of(data: object) -> torch.Tensor:
    with warnings.catch_warnings():  # a Ray object is a read-only view of its store; it is only read from here
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(np.asarray(data, dtype=np.uint8))


def load_buckets(model: torch.nn.Module, specs: Iterable[TensorSpec], buckets: Iterable[Bucket]) -> None:
    """Copy the pieces of ``buckets`` (their ``data``: uint8 arrays) into ``model``'s tensors in place, after
    :func:`check_specs`; a ``ValueError`` when a piece names an unknown tensor or a tensor is left incomplete."""
    targets = check_specs(model, specs)
    received = dict.fromkeys(targets, 0)
    with torch.no_grad():
        for bucket in buckets:
            data = _bytes_of(bucket.data)
            for piece in bucket.pieces:
                if piece.name not in targets:
                    raise ValueError(f"a bucket holds {piece.name!r}, which is not in the synced weights' specs")
                source = data[piece.offset:piece.offset + piece.nbytes].view(piece.dtype)
                targets[piece.name].view(-1)[piece.start:piece.start + piece.count].copy_(source)
                received[piece.name] += piece.count
    incomplete = [name for name, count in received.items() if count != targets[name].numel()]
    if incomplete:
        raise ValueError(f"the synced weights left {len(incomplete)} tensor(s) incomplete: {incomplete[:5]}")


def copy_weights(source: torch.nn.Module, target: torch.nn.Module) -> None:
    """``source``'s sync scope copied into ``target``'s tensors in place (one process: no buckets), cast to the
    target's dtypes; ``check_specs`` first."""
    targets = check_specs(target, tensor_specs(source))
    with torch.no_grad():
        for name, tensor in engine_tensors(source):
            targets[name].copy_(tensor)


def shareable(source: torch.nn.Module, target: torch.nn.Module) -> bool:
    """Whether ``target`` (an engine's model in ``source``'s process) can hold ``source``'s own parameters instead of
    copies: both on the CPU, neither sharded nor with adapters, the same parameter names, shapes and dtypes (the
    CPU default: a float32 learner beside a float32 engine). On a GPU an engine's CUDA graphs hold the addresses
    of its own weights, and a bf16 engine beside float32 masters needs its cast copy: there it keeps its copy."""
    if hasattr(source, "peft_config") or hasattr(target, "peft_config"):
        return False
    theirs, own = dict(source.named_parameters()), dict(target.named_parameters())
    if theirs.keys() != own.keys():
        return False
    return all(not isinstance(t, DTensor) and t.device.type == "cpu" == o.device.type and t.dtype == o.dtype
               and t.shape == o.shape for t, o in ((theirs[name], own[name]) for name in theirs))


def share_weights(source: torch.nn.Module, target: torch.nn.Module) -> None:
    """``target``'s parameters replaced by ``source``'s own parameter objects, name by name (tied names too, so the
    tying holds), and its persistent buffers copied: one copy of the weights in the process, and ``target`` sees each
    in-place optimizer step of ``source`` as it happens (the packed linears notice it by the parameters' version
    counters, which the shared objects carry). Call when :func:`shareable`; again after ``source``'s parameters
    were replaced (a rebuilt learner), which it finds and shares anew."""
    theirs = dict(source.named_parameters(remove_duplicate=False))
    for name, _ in list(target.named_parameters(remove_duplicate=False)):
        owner, _, leaf = name.rpartition(".")
        module = target.get_submodule(owner)
        if getattr(module, leaf) is not theirs[name]:
            setattr(module, leaf, theirs[name])  # a Parameter assigned to a module registers as its parameter
    persistent = set(target.state_dict(keep_vars=True))
    buffers = dict(source.named_buffers())
    with torch.no_grad():
        for name, buffer in target.named_buffers():
            if name in persistent:
                buffer.copy_(buffers[name])


def sync_in_process(source: torch.nn.Module, target: torch.nn.Module) -> None:
    """``source``'s weights into ``target`` in the same process: shared where :func:`shareable`, else copied."""
    if shareable(source, target):
        share_weights(source, target)
    else:
        copy_weights(source, target)
