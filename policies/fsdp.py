"""A causal LM sharded with torch's FSDP2 (``fully_shard``) across a process group: each decoder layer one unit,
the rest of the model (embeddings, final norm, LM head, tied or not) the root's unit. Ray-free: the learner, the
tests and the benchmarks run it under any ``torch.distributed`` process group (gloo on the CPU, nccl on GPUs).

Every parameter is split along its first dimension over the ranks (a ``DTensor`` with a ``Shard(0)`` placement), and
so are its gradient and, built over the sharded parameters, AdamW's moments: each rank holds about 1 / world of the
model's trained state. A unit's full parameters exist only while it runs (all-gathered before its forward and again
before its backward, freed after); its gradients are reduce-scattered (averaged) after its backward, after every
micro-batch's, into the sharded gradient, where the micro-batches of an optimizer step accumulate. Reducing once per
step instead would keep every rank's whole-model gradient unreduced until the step's last micro-batch (4 bytes a
parameter: 28 GiB for 7B), the memory sharding exists to free; verl and torchtitan reduce-scatter every micro-batch.

The log-prob passes (:func:`policies.logprobs.sequence_logprobs`) call the decoder and the LM head separately, not
the model's ``forward``, so FSDP's root is :class:`ShardedRoot`: a module over the model whose ``forward`` runs the
given pass, so that the root's parameters are gathered around the whole pass and its gradients reduced after it.
The root's parameters stay gathered from a pass's forward to its backward (``reshard_after_forward=False``, as
torchtitan and NeMo-RL keep their root; pinned, since FSDP2 forced it before torch 2.8 and honours it from 2.8 on: a
root resharded after its forward is gathered again in every backward); a pass without gradients has no backward to
free them, so :func:`run_pass` frees them after it.

Startup (:func:`policies.reference_model.shard_policy_and_reference`): the policy is sharded from the host copy it
was built in, each unit moved to the device whole only while its own shard is cut (``fully_shard`` does so), so the
device never holds the whole model; the KL reference is made from the policy's shards, never whole.

Precision (:func:`mixed_precision`): with ``--dtype bfloat16`` over float32 master shards, FSDP's
``MixedPrecisionPolicy`` all-gathers each unit's parameters cast to bf16 (half the bytes of float32 gathers) and
reduce-scatters the gradients in float32; the passes then run without ``torch.autocast``, whose cast cache would keep
a bf16 copy of every gathered weight until the pass ends. The residual stream is bf16, as in the bf16 KL reference,
so a sharded policy and its sharded reference compute alike (the first step's KL is 0). A DDP or single learner keeps
autocast over its float32 weights (float32 residual stream; see :mod:`policies.precision`).

An offloaded module (``offload``: the frozen KL reference with ``--reference-offload``) keeps its shards in host
memory (pinned where CUDA is available) and brings each unit's in for its all-gather, unit by unit.

Anything that reads the full weights (:func:`full_state`) is a collective: every rank must call it, in the same
order.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

MODEL, OPTIMIZER = "model", "optimizer"  # the two entries of a sharded checkpoint


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder layers of a causal LM (or of a peft model's base): ``get_decoder().layers``. A ``ValueError``
    names the model class when they cannot be found."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    decoder = base.get_decoder() if hasattr(base, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or not len(layers):
        raise ValueError(f"learner_sharding fsdp: cannot find the decoder layers of {type(base).__name__} (expected "
                         f"get_decoder().layers, a non-empty ModuleList, as transformers' causal LMs have); use "
                         f"--learner-sharding ddp for this model")
    return layers


class ShardedRoot(torch.nn.Module):
    """FSDP's root over ``model``: ``root(fn, *args, **kwargs)`` runs ``fn(*args, **kwargs)`` (a pass over the model)
    with the root unit's parameters gathered; see the module docstring."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)


def broadcast_from_rank0(model: torch.nn.Module, device: torch.device | str) -> None:
    """Give every rank rank 0's parameters and buffers, as DDP's replicas start (a rank's own random
    initialisation, e.g. of LoRA adapters, would otherwise give each shard another model's values), one tensor at a
    time through ``device`` (NCCL sends device memory; the model may be on the host: one tensor is on the device at
    once). A collective."""
    for tensor in [*model.parameters(), *model.buffers()]:
        staged = tensor.detach().to(device)
        dist.broadcast(staged, src=0)
        if staged.data_ptr() != tensor.data_ptr():
            tensor.detach().copy_(staged)


def mixed_precision(compute: torch.dtype, master: torch.dtype) -> MixedPrecisionPolicy:
    """Gather the parameters in the ``compute`` dtype when it is narrower than the ``master`` one, and reduce the
    gradients in float32 (see the module docstring)."""
    return MixedPrecisionPolicy(param_dtype=compute if compute != master else None, reduce_dtype=torch.float32)


def shard_model(model: torch.nn.Module, *, mp_policy: MixedPrecisionPolicy | None = None,
                offload: bool = False) -> ShardedRoot:
    """Shard ``model``'s parameters in place over the default process group, one unit per decoder layer plus the
    root, each unit gathering and reducing as ``mp_policy`` says (default: in the parameters' own dtype), its
    shards in host memory when ``offload``; returns the root, through which every pass must run. The ranks must
    hold the same values (:func:`broadcast_from_rank0`). The model's parameters are ``DTensor`` shards from here on:
    build its optimizer after this call. Tied parameters stay tied (both uses are in the root's unit)."""
    layers = decoder_layers(model)
    options: dict[str, Any] = {"mp_policy": mp_policy or MixedPrecisionPolicy()}
    if offload:
        options["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    for layer in layers:
        fully_shard(layer, **options)
    # kept gathered from a pass's forward to its backward whatever the torch version (see the module docstring)
    return fully_shard(ShardedRoot(model), reshard_after_forward=False, **options)


def run_pass(root: ShardedRoot, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, a pass over the model of FSDP's ``root``; after a pass without gradients (old or
    reference log-probs) the root's gathered parameters are freed: no backward will free them."""
    out = root(fn, *args, **kwargs)
    if not torch.is_grad_enabled():
        root.reshard()
    return out


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A shard's full tensor (a collective: every rank calls it), a plain tensor as it is."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def full_state(module: torch.nn.Module, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """``module.state_dict()``'s entries one at a time, each gathered to its full tensor on the CPU (floating ones
    cast to ``dtype`` when given) before the next is gathered, so that no rank holds more than one full tensor of
    the device at once. A collective: every rank iterates it to the end."""
    for name, tensor in module.state_dict().items():
        value = full_tensor(tensor.detach())
        if dtype is not None and value.is_floating_point():
            value = value.to(dtype)
        yield name, value.cpu()


def squared_norms(tensors: list[torch.Tensor]) -> list[float]:
    """Each tensor's squared L2 norm, accumulated in float64 (a float32 sum over millions of small gradient entries
    drifts by 1e-5 of the norm, more than the learners' reduction order moves it); of the full tensor when it is a
    ``DTensor`` shard: the shards' partial sums of all the tensors in one all-reduce (a collective) and one host
    sync, however many tensors. NaN or inf where an entry is."""
    if not tensors:
        return []
    sharded = [isinstance(tensor, DTensor) for tensor in tensors]
    squares = torch.stack([torch.linalg.vector_norm(tensor.to_local() if shard else tensor, dtype=torch.float64)
                           for tensor, shard in zip(tensors, sharded, strict=True)]).square()
    if any(sharded):
        partial = torch.tensor(sharded, device=squares.device)
        summed = torch.where(partial, squares, 0.0)  # a plain (replicated) tensor's is whole on every rank already
        dist.all_reduce(summed)
        squares = torch.where(partial, summed, squares)
    return squares.tolist()


def global_norm(tensors: list[torch.Tensor]) -> float:
    """The L2 norm of ``tensors`` taken together (:func:`squared_norms`: of the full tensors, one collective when
    they are shards). NaN or inf when an entry is."""
    return math.sqrt(sum(squared_norms(tensors)))


def local_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes this rank holds of ``tensors`` (a ``DTensor``'s local shard only), each storage counted once."""
    seen, total = set(), 0
    for tensor in tensors:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        key = (local.untyped_storage().data_ptr(), local.storage_offset(), tuple(local.shape))
        if key not in seen:
            seen.add(key)
            total += local.numel() * local.element_size()
    return total


def trained_state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of ``model``'s parameters, their gradients and ``optimizer``'s state on this rank (counted from the
    tensors; a sharded model's shards only)."""
    params = list(model.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    states = [value for per_param in optimizer.state.values() for value in per_param.values()
              if torch.is_tensor(value) and value.dim() > 0]  # AdamW's step counters are scalars
    return local_bytes(params) + local_bytes(grads) + local_bytes(states)


def save_sharded(model: torch.nn.Module, optimizer: torch.optim.Optimizer, directory: str | Path) -> None:
    """Every rank writes its shards of ``model``'s weights and ``optimizer``'s state into ``directory`` (torch
    distributed checkpoint: one file per rank and the metadata; a collective)."""
    dcp.save({MODEL: get_model_state_dict(model), OPTIMIZER: get_optimizer_state_dict(model, optimizer)},
             checkpoint_id=str(directory))


def load_sharded(model: torch.nn.Module, optimizer: torch.optim.Optimizer, directory: str | Path) -> None:
    """Every rank reads its shards of what :func:`save_sharded` wrote into ``model`` and ``optimizer`` (a
    collective)."""
    state = {MODEL: get_model_state_dict(model), OPTIMIZER: get_optimizer_state_dict(model, optimizer)}
    dcp.load(state, checkpoint_id=str(directory))
    set_model_state_dict(model, state[MODEL])
    set_optimizer_state_dict(model, optimizer, state[OPTIMIZER])


def load_full_weights(model: torch.nn.Module, directory: str | Path) -> None:
    """Read the weights that :func:`save_sharded` wrote (at any world size) into the plain (unsharded) ``model`` of
    the same architecture, in this process alone (no process group)."""
    state = model.state_dict()
    dcp.load({MODEL: state}, checkpoint_id=str(directory), no_dist=True)
    model.load_state_dict(state)


def world_size() -> int:
    """The default process group's size (1 without one)."""
    return dist.get_world_size() if dist.is_initialized() else 1
