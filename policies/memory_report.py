"""A memory plan (``policies/memory_plan.py``) in words: its options, one line (what ``run.py`` prints before a
run) and a table of the parts (what ``experiments/plan_memory.py`` prints)."""

from __future__ import annotations

from policies.memory_fit import fitting_change
from policies.memory_plan import MemoryOptions, MemoryPlan


def describe_options(options: MemoryOptions) -> str:
    """The options that shape a plan, in words (for its line and its table)."""
    precision = ("pure bf16" if options.pure_bf16 else "bf16 compute, float32 master"
                 if options.dtype == "bfloat16" else "float32")
    words = [f"{options.learners} learner{'s' * (options.learners > 1)} ({options.sharding})", precision]
    if options.gradient_checkpointing:
        words.append("checkpointing")
    if options.lora_rank is not None:
        words.append(f"LoRA r={options.lora_rank}")
    elif not options.reference:
        words.append("no reference")
    elif options.reference_offload:
        words.append("reference offloaded")
    words.append(f"{options.micro_batch_tokens:,} tokens per micro-batch")
    if options.colocated:
        words.append(f"{options.generator} engine colocated" + (" (sleeping)" if options.vllm_sleep else ""))
    return ", ".join(words)


def plan_line(plan: MemoryPlan) -> str:
    """One line: the total per GPU, its biggest parts, and whether it fits."""
    verdict = ("" if plan.fits is None else f" of {plan.gpu_memory_gib:g} GiB ({plan.usable_gib:.3g} usable): "
               + ("fits" if plan.fits else "DOES NOT FIT"))
    biggest = sorted(((v, k) for k, v in plan.parts.items() if v >= 0.05), reverse=True)
    parts = ", ".join(f"{k.replace('_', ' ')} {v:.1f}" for v, k in biggest)
    return (f"memory plan: {plan.model} ({plan.parameters / 1e9:.2f}B), {describe_options(plan.options)}: "
            f"{plan.per_gpu_gib:.1f} GiB per GPU{verdict} ({parts}; peak in the {plan.phase})")


def plan_table(plan: MemoryPlan) -> str:
    """The plan as a table: GiB per GPU for each part, the total, and the verdict."""
    rows = [f"memory plan: {plan.model} ({plan.parameters:,} parameters); {describe_options(plan.options)}",
            f"{'part':<16}{'GiB per GPU':>12}"]
    rows += [f"{name.replace('_', ' '):<16}{value:>12.2f}" for name, value in plan.parts.items()]
    rows.append(f"{'total':<16}{plan.per_gpu_gib:>12.2f}   (peak in the {plan.phase})")
    if plan.fits is not None:
        rows.append(f"fits a {plan.gpu_memory_gib:g} GiB GPU ({plan.usable_gib:.1f} GiB usable, the rest headroom): "
                    + ("yes" if plan.fits else f"NO ({plan.per_gpu_gib - plan.usable_gib:.1f} GiB over)"))
        if not plan.fits:
            rows.append(f"it would fit with: {fitting_change(plan) or 'none of the options tried'}")
    return "\n".join(rows)

