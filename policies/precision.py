"""Numeric precision of a policy: the dtype its matrix products run in and the dtype its trained weights live in.

``--dtype bfloat16`` means what verl, TRL and accelerate mean by it: bf16 *compute* over float32 *master* weights.
The learner keeps its trained parameters, their gradients and AdamW's moments in float32 and runs each forward
under ``torch.autocast`` in bf16; the rollout engines hold bf16 copies, cast from the master at each weight sync.
Pure bf16 weights (``pure_bf16``) halve the learner's static memory but lose almost every small update: at lr
1e-6 an Adam step (about lr in size) is ~100x smaller than half a bf16 ulp of a typical weight (0.02 has an ulp of
~1.2e-4), so it rounds away. It is offered behind its own option, with a warning.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PURE_BF16_WARNING = (
    "pure_bf16: the trained weights, their gradients and AdamW's moments are bfloat16, with no float32 master copy; "
    "updates smaller than half a bf16 ulp of a weight (most updates at lr around 1e-6) round away and the run "
    "may not learn. Drop --pure-bf16 for bf16 compute over float32 master weights.")


@dataclass(frozen=True)
class Precision:
    """``compute``: the dtype of the forward's matrix products and of the rollout engines' weights. ``master``: the
    dtype of the trained parameters, their gradients and the optimizer state."""

    compute: torch.dtype
    master: torch.dtype

    @property
    def mixed(self) -> bool:
        """Whether the forward runs under autocast (compute narrower than the master)."""
        return self.compute != self.master

    def autocast(self, device: torch.device | str) -> contextlib.AbstractContextManager:
        """The context of a forward pass: autocast to ``compute`` on ``device``'s type when mixed, else nothing."""
        if not self.mixed:
            return contextlib.nullcontext()
        return torch.autocast(device_type=torch.device(device).type, dtype=self.compute)


def precision_of(dtype: str, *, pure_bf16: bool = False) -> Precision:
    """The precision of ``--dtype`` (the compute dtype): float32 masters under a narrower compute dtype, unless
    ``pure_bf16`` (bfloat16 only; warns). A ``ValueError`` names the option when it is wrong."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    compute = DTYPES[dtype]
    if pure_bf16:
        if compute != torch.bfloat16:
            raise ValueError(f"pure_bf16 needs dtype bfloat16, got {dtype!r}")
        warnings.warn(PURE_BF16_WARNING, stacklevel=2)
        return Precision(compute=compute, master=compute)
    return Precision(compute=compute, master=torch.float32)


def weights_dtype(precision: Precision, *, inference_only: bool, lora: bool) -> torch.dtype:
    """The dtype a module loads its weights in: an inference copy (a rollout engine) and a LoRA base (frozen; the
    adapters are float32) in the compute dtype, trained weights in the master dtype."""
    return precision.compute if inference_only or lora else precision.master


def cast_floating(state: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """``state`` with its floating-point tensors cast to ``dtype`` (integer buffers as they are)."""
    return {name: tensor.to(dtype) if tensor.is_floating_point() else tensor for name, tensor in state.items()}
