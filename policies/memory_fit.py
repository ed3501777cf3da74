"""What would make a memory plan (``policies/memory_plan.py``) that does not fit its GPU fit: the change a run
could make, as run.py's flags, with the GiB per GPU it would need (:func:`fitting_change`, which ``run.py``'s
refusal and ``experiments/plan_memory.py`` print).

The search, cheapest first: the learners' layout as it is, then FSDP over the same learners, over more of them,
then LoRA; in each, the fewest memory options added (checkpointing, an offloaded reference, half the micro-batch);
and, before any of those options, what a colocated vLLM engine can give up on the same GPU: a smaller share of it
(:func:`engine_share_that_fits`) or its sleep through the updates (both offered when both fit). No torch, no Ray.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from policies.memory_plan import GIB, MemoryOptions, MemoryPlan, engine_weights_and_kv_bytes, plan_memory
from policies.model_shape import ModelShape

ENGINE_SHARE_STEP = 0.05  # the vLLM engine's shares offered: multiples of it


def _memory_options_changes(options: MemoryOptions) -> list[tuple[str, dict[str, Any]]]:
    """The memory options a run could add, in the order a user would reach for them: (flag, the change)."""
    changes: list[tuple[str, dict[str, Any]]] = []
    if not options.gradient_checkpointing:
        changes.append(("--gradient-checkpointing", {"gradient_checkpointing": True}))
    if options.reference and options.lora_rank is None and not options.reference_offload:
        changes.append(("--reference-offload", {"reference_offload": True}))
    if options.micro_batch_tokens > 2048:
        half = options.micro_batch_tokens // 2
        changes.append((f"--micro-batch-tokens {half}", {"micro_batch_tokens": half, "sequence_tokens": None}))
    return changes


def _layout_changes(options: MemoryOptions) -> list[tuple[str, dict[str, Any]]]:
    """The learners' layouts to try, none first: FSDP over the same learners, over more, then LoRA."""
    layouts: list[tuple[str, dict[str, Any]]] = [("", {})]
    if options.sharding == "ddp" and options.learners > 1:
        layouts.append(("--learner-sharding fsdp", {"sharding": "fsdp"}))
    layouts += [(f"--num-learners {k} --learner-sharding fsdp", {"learners": k, "sharding": "fsdp"})
                for k in (2, 4, 8, 16) if k > options.learners]
    if options.lora_rank is None:
        layouts.append(("--lora-rank 16", {"lora_rank": 16, "reference_offload": False}))
    return layouts


def engine_share_that_fits(shape: ModelShape, options: MemoryOptions) -> float | None:
    """The largest share of the GPU below a colocated vLLM engine's own, in steps of :data:`ENGINE_SHARE_STEP`,
    with which the plan fits and which still holds the engine's weights and the KV cache of every branch it decodes
    at once (``policies.memory_plan.engine_weights_and_kv_bytes``: below that the engine would pre-empt branches,
    or fail to start); None when there is none, or no colocated vLLM engine."""
    if not (options.colocated and options.generator == "vllm"):
        return None
    least = engine_weights_and_kv_bytes(shape, options) / (options.gpu_memory_gib * GIB)
    below = math.ceil(round(options.vllm_gpu_memory_utilization / ENGINE_SHARE_STEP, 6)) - 1
    for step in range(below, 0, -1):
        share = round(step * ENGINE_SHARE_STEP, 2)
        if share < least:
            return None
        if plan_memory(shape, replace(options, vllm_gpu_memory_utilization=share)).fits:
            return share
    return None


def _engine_changes(shape: ModelShape, options: MemoryOptions) -> list[tuple[str, MemoryPlan]]:
    """What a colocated vLLM engine can give up to make ``options``' plan fit, each as (flag, the plan with it):
    a smaller share of the GPU, its sleep through the updates."""
    changes = []
    share = engine_share_that_fits(shape, options)
    if share is not None:
        changes.append((f"--vllm-gpu-memory-utilization {share:g}",
                        plan_memory(shape, replace(options, vllm_gpu_memory_utilization=share))))
    if options.colocated and options.generator == "vllm" and not options.vllm_sleep:
        asleep = plan_memory(shape, replace(options, vllm_sleep=True))
        if asleep.fits:
            changes.append(("--vllm-sleep", asleep))
    return changes


def fitting_change(plan: MemoryPlan) -> str | None:
    """What would make a plan that does not fit fit (see the module docstring), as flags with the GiB per GPU it
    would need, the engine's alternatives joined by "or"; None when the plan fits or nothing tried does."""
    if plan.fits is not False:
        return None
    for layout_flags, layout in _layout_changes(plan.options):
        # LoRA has no separate reference to offload: that option is not offered beside it
        extras = [(flag, extra) for flag, extra in _memory_options_changes(plan.options)
                  if not (layout.get("lora_rank") and "reference_offload" in extra)]
        for count in range(len(extras) + 1):
            change = {**layout}
            for _, extra in extras[:count]:
                change.update(extra)
            flags = [flag for flag in (layout_flags, *(f for f, _ in extras[:count])) if flag]
            options = replace(plan.options, **change)
            candidate = plan_memory(plan.shape, options)
            if change and candidate.fits:
                return f"{' '.join(flags)} ({candidate.per_gpu_gib:.1f} GiB per GPU)"
            engine = _engine_changes(plan.shape, options)
            if engine:
                return " or ".join(f"{' '.join([*flags, flag])} ({fits.per_gpu_gib:.1f} GiB per GPU)"
                                   for flag, fits in engine)
    return None
