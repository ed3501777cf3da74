"""Linear layers through oneDNN with weights packed once, for the HF engine's forward passes on the CPU.

A decode pass feeds a few rows, so every weight matrix is read once per pass for little arithmetic: on the CPU the
pass is bound by reading the weights, and torch's fp32 ``linear`` (MKL) spends about two thirds of a SmolLM2-135M
tree rollout there. oneDNN reading weights reordered once into its blocked layout does the same GEMMs in about
60-75% of the time (docs/benchmarks.md, "Generation: HF against vLLM"). Its sums run in another order, so
log-probs differ from a plain forward's in the last bits (about 1e-5, as the engine's attention already does).

:func:`packed_linears_for` switches every ``nn.Linear`` of a model to the packed path for the duration of a block
(the learner, outside it, keeps torch's own kernels and their gradients). A packed weight is kept until its
parameter changes: every in-place update (an optimizer step, ``load_state_dict``) moves the tensor's version
counter, and the next pass packs it again. The packed copies are a second copy of the linear weights in memory
(540 MB for SmolLM2-135M in float32), freed with the model.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

# module -> (weight version, weight storage, packed weight, packed bias): packed again when the weight moves
_PACKED: weakref.WeakKeyDictionary[nn.Linear, tuple[int, int, torch.Tensor, torch.Tensor | None]] = (
    weakref.WeakKeyDictionary())
# model -> its linear layers, each with its packed forward
_LINEARS: weakref.WeakKeyDictionary[nn.Module, tuple[tuple[nn.Linear, Callable], ...]] = weakref.WeakKeyDictionary()


def packing_applies(model: nn.Module) -> bool:
    """Whether :func:`packed_linears_for` packs ``model``: float32 weights on the CPU, with oneDNN available."""
    weight = next(model.parameters())
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and torch.backends.mkldnn.is_available()


def _packed(module: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    weight = module.weight
    entry = _PACKED.get(module)
    if entry is None or entry[0] != weight._version or entry[1] != weight.data_ptr():
        bias = None if module.bias is None else module.bias.detach().to_mkldnn()
        entry = (weight._version, weight.data_ptr(), weight.detach().to_mkldnn(), bias)
        _PACKED[module] = entry
    return entry[2], entry[3]


def packed_linear(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``module(x)`` through oneDNN with the module's packed weight (no gradient)."""
    weight, bias = _packed(module)
    rows = x.reshape(-1, x.shape[-1]).contiguous().to_mkldnn()
    out = torch._C._nn.mkldnn_linear(rows, weight, bias).to_dense()
    return out.reshape(*x.shape[:-1], out.shape[-1])


@contextmanager
def packed_linears_for(model: nn.Module) -> Iterator[None]:
    """Run every ``nn.Linear`` of ``model`` as :func:`packed_linear` inside the block (gradients off); nothing
    changes where :func:`packing_applies` is false."""
    if not packing_applies(model):
        yield
        return
    linears = _LINEARS.get(model)
    if linears is None:  # found once per model: the walk over its modules costs more than a small model's pass
        linears = _LINEARS[model] = tuple((m, lambda x, m=m: packed_linear(m, x))
                                          for m in model.modules() if isinstance(m, nn.Linear))
    for m, forward in linears:
        m.__dict__["forward"] = forward  # an instance attribute shadows the class's forward (no Module bookkeeping)
    try:
        with torch.no_grad():
            yield
    finally:
        for m, _ in linears:
            del m.__dict__["forward"]
