"""docs/scaling.md's memory tables, from the memory plan (``policies/memory_plan.py``): GiB per GPU for the paper's
models under each memory option on one 80 GB GPU, and under FSDP over 2, 4 and 8 of them.

    python -m benchmarks.scaling_tables                          # print both tables
    python -m benchmarks.scaling_tables --write docs/scaling.md  # rewrite their sections

A cell is the plan's per-GPU total and its verdict (a plan fits within ``USABLE_SHARE`` of the GPU's memory).
"""

from __future__ import annotations

import argparse

from benchmarks.report import replace_section
from policies.memory_plan import USABLE_SHARE, MemoryOptions, plan_memory
from policies.model_shape import PRESETS

MODELS = ("qwen2.5-1.5b-instruct", "qwen2.5-3b-instruct", "llama-3.2-3b-instruct", "qwen2.5-7b-instruct")
GPU_GIB = 80.0
CHECKPOINTED = {"gradient_checkpointing": True}
OFFLOADED = {**CHECKPOINTED, "reference_offload": True}
# (column heading, the options besides bf16 over float32 masters on one 80 GB GPU)
ONE_GPU_COLUMNS = (
    ("full fine-tuning", {}),
    ("+ `--gradient-checkpointing`", CHECKPOINTED),
    ("+ checkpointing + `--reference-offload`", OFFLOADED),
    ("LoRA r=16", {"lora_rank": 16}),
    ("LoRA r=16 + checkpointing", {"lora_rank": 16, **CHECKPOINTED}),
    ("checkpointing + offload + colocated vLLM at 0.3",
     {**OFFLOADED, "generator": "vllm", "colocated": True, "vllm_gpu_memory_utilization": 0.3}),
)
FSDP_COLUMNS = (*((f"fsdp over {k}", {**CHECKPOINTED, "learners": k, "sharding": "fsdp"}) for k in (2, 4, 8)),
                ("over 2, + `--reference-offload`", {**OFFLOADED, "learners": 2, "sharding": "fsdp"}))
SECTIONS = {"memory-one-gpu": ("The plan, one GPU", ONE_GPU_COLUMNS),
            "memory-fsdp": ("The plan, FSDP (checkpointing, one 80 GB GPU per learner)", FSDP_COLUMNS)}


def cell(model: str, options: dict) -> str:
    plan = plan_memory(PRESETS[model], MemoryOptions(gpu_memory_gib=GPU_GIB, **options))
    return f"{plan.per_gpu_gib:.0f}, " + ("fits" if plan.fits else "**no**")


def table(columns: tuple[tuple[str, dict], ...]) -> str:
    """One row per model: its plan under each column's options."""
    lines = ["| model | " + " | ".join(name for name, _ in columns) + " |", "|---|" + "---|" * len(columns)]
    for model in MODELS:
        shape = PRESETS[model]
        lines.append(f"| {shape.name} ({shape.parameters / 1e9:.2f}B) | "
                     + " | ".join(cell(model, options) for _, options in columns) + " |")
    return "\n".join(lines)


def body(columns: tuple[tuple[str, dict], ...]) -> str:
    return (f"GiB per GPU, `python -m benchmarks.scaling_tables` (the plan; a plan fits within "
            f"{USABLE_SHARE:.0%} of the GPU's {GPU_GIB:g} GiB).\n\n{table(columns)}\n")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--write", default=None, help="rewrite the tables' sections of this file (docs/scaling.md)")
    args = p.parse_args(argv)
    for key, (title, columns) in SECTIONS.items():
        print(f"{title}\n\n{body(columns)}")
        if args.write:
            replace_section(args.write, key, title, body(columns), level=4)


if __name__ == "__main__":
    main()
