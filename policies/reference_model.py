"""The frozen reference policy of the KL term: a copy of the initial weights in the compute dtype, optionally kept
off the accelerator between its passes, or sharded as its policy is.

The reference runs once per update, without gradients, over the update's micro-batches. Kept on the accelerator it
costs a whole model's weights for the run (a 7B model in bf16: 14 GiB); offloaded, its weights live in (pinned) CPU
memory and are copied in for that pass only, while the policy holds no gradients (they are freed before each
optimizer step's accumulation), so the update's peak is unchanged.

Sharded learners (:func:`shard_policy_and_reference`) never make it whole: its shards are copied from the policy's.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator

import torch

from policies.fsdp import ShardedRoot, mixed_precision, shard_model
from policies.precision import Precision


def frozen_copy(model: torch.nn.Module, dtype: torch.dtype, device: torch.device | str) -> torch.nn.Module:
    """A no-gradient, eval-mode copy of ``model`` with its floating-point parameters cast to ``dtype`` on ``device``,
    made parameter by parameter (no second copy of the whole model in the source dtype on the way). Tied parameters
    stay tied; buffers (rotary frequencies) keep their dtype."""
    memo: dict[int, torch.Tensor] = {}
    for param in model.parameters():
        value = param.detach().to(device=device, dtype=dtype if param.is_floating_point() else param.dtype, copy=True)
        memo[id(param)] = torch.nn.Parameter(value, requires_grad=False)
    for buffer in model.buffers():
        memo[id(buffer)] = buffer.detach().to(device=device, copy=True)
    return copy.deepcopy(model, memo).eval()


class ReferenceModel:
    """A frozen copy of a policy's weights (:func:`frozen_copy`) for the reference log-probs.

    ``offload``: its weights stay on the CPU (pinned where CUDA is available, so the copy in is asynchronous) and
    :meth:`on_device` brings them to ``device`` for the duration of a pass; without it they live on ``device``.
    """

    def __init__(self, model: torch.nn.Module, *, dtype: torch.dtype, device: torch.device | str,
                 offload: bool = False) -> None:
        self.device, self.offload = torch.device(device), offload
        self.model = frozen_copy(model, dtype, "cpu" if offload else self.device)
        if offload and torch.cuda.is_available():
            self._place({id(p): torch.nn.Parameter(p.detach().pin_memory(), requires_grad=False)
                         for p in self.model.parameters()})

    def _place(self, replacements: dict[int, torch.nn.Parameter]) -> None:
        """Put ``replacements[id(p)]`` in the place of every parameter ``p`` (tied ones share one replacement)."""
        for module in self.model.modules():
            for name, param in list(module.named_parameters(recurse=False)):
                module.register_parameter(name, replacements[id(param)])

    @contextlib.contextmanager
    def on_device(self) -> Iterator[torch.nn.Module]:
        """The reference model with its weights on ``device`` inside the block (and back on the host after it,
        when offloaded: the device copies are freed)."""
        if not self.offload or self.device.type == "cpu":
            yield self.model
            return
        host = {id(p): p for p in self.model.parameters()}
        placed = {key: torch.nn.Parameter(p.detach().to(self.device, non_blocking=True), requires_grad=False)
                  for key, p in host.items()}
        self._place(placed)
        try:
            yield self.model
        finally:
            self._place({id(placed[key]): param for key, param in host.items()})

    def parameter_devices(self) -> set[torch.device]:
        """Where the reference's weights are now (outside :meth:`on_device`: the host when offloaded)."""
        return {param.device for param in self.model.parameters()}


def shard_policy_and_reference(model: torch.nn.Module, precision: Precision, *, reference: bool,
                               offload: bool = False) -> tuple[ShardedRoot, ShardedRoot | None]:
    """Shard ``model``, the policy, built on the host (``policies.fsdp.shard_model``: each unit is moved to the
    device whole only while its shard is cut, so the device never holds the whole model) in ``precision``; with
    ``reference``, also its frozen KL reference in the compute dtype, sharded the same way (its shards on the host
    when ``offload``) and made from the policy's shards, so that no rank ever holds the whole reference: a skeleton
    (:func:`frozen_copy` on the meta device, taken before the policy is sharded), sharded, given memory for its
    shards only, then each shard copied from the policy's (cast) and the buffers from the policy's. Returns the two
    FSDP roots (the reference's model is ``root.model``; None without ``reference``). The ranks must hold the same
    values (``policies.fsdp.broadcast_from_rank0``). A collective."""
    policy = mixed_precision(precision.compute, precision.master)
    skeleton = frozen_copy(model, precision.compute, "meta") if reference else None
    policy_root = shard_model(model, mp_policy=policy)
    if skeleton is None:
        return policy_root, None
    reference_root = shard_model(skeleton, mp_policy=policy, offload=offload)
    shards = dict(model.named_parameters())
    reference_root.to_empty(device="cpu" if offload else next(iter(shards.values())).device)
    buffers = dict(model.named_buffers())
    with torch.no_grad():
        for name, param in skeleton.named_parameters():
            param.to_local().copy_(shards[name].to_local())
        for module_name, module in skeleton.named_modules():
            for name, _ in list(module.named_buffers(recurse=False)):  # where the policy keeps them (the device)
                setattr(module, name, buffers[f"{module_name}.{name}" if module_name else name].clone())
    return policy_root, reference_root
