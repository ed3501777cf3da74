"""Plan a run's GPU memory before starting it: GiB per GPU for the weights, gradients, optimizer state, the KL
reference, the activations of one micro-batch and a colocated rollout engine, and whether it fits.

    python experiments/plan_memory.py --model qwen2.5-3b-instruct --learners 1 --gradient-checkpointing \\
        --reference-offload --gpu-memory-gib 80
    python experiments/plan_memory.py --model Qwen/Qwen2.5-7B-Instruct --learners 4 --learner-sharding fsdp \\
        --gradient-checkpointing --gpu-memory-gib 80 --json plan.json

MODEL is a model directory (its config.json), a hub id whose config.json is in the Hugging Face cache (nothing is
downloaded), or a preset: qwen2.5-1.5b-instruct, qwen2.5-3b-instruct, qwen2.5-7b-instruct, llama-3.2-3b-instruct,
smollm2-135m, tiny-random (shapes only). The options mean what run.py's do; ``--dtype bfloat16`` (the default here:
what a GPU run uses) is bf16 compute over float32 master weights. A colocated engine's KV cache is sized by the
branches it decodes at once (``--prompts-per-iteration`` x ``--M`` x ``--N``, the GPU defaults' unless given). What
is counted, and what is assumed, is in ``policies/memory_plan.py``'s docstring; what would make a plan fit, in
``policies/memory_fit.py``'s. ``--json PATH`` writes ``per_gpu_gib`` (the total), ``parts`` (the rows) and
``fits``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from experiments.arg_types import fraction, non_negative_float, non_negative_int, positive_float, positive_int
from policies.memory_plan import (
    DEFAULT_MICRO_BATCH_TOKENS,
    DEFAULT_ROLLOUT_CONTEXT,
    DEFAULT_ROLLOUT_PROMPTS,
    DEFAULT_TREE,
    DEFAULT_VLLM_GPU_MEMORY_UTILIZATION,
    MemoryOptions,
    MemoryPlan,
    plan_memory,
    rollout_sequences,
)
from policies.memory_report import plan_table
from policies.model_shape import ModelShapeError, model_shape


def plan_memory_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a model directory, a cached hub id, or a preset")
    p.add_argument("--learners", type=positive_int, default=1,
                   help="learners, one GPU each (default 1; run.py's --num-learners, where 0 learns in the driver: "
                        "plan that as 1)")
    p.add_argument("--learner-sharding", choices=("ddp", "fsdp"), default="ddp",
                   help="ddp: each learner holds everything; fsdp: weights, gradients, optimizer state and the "
                        "reference sharded over the learners")
    p.add_argument("--sharding", action=RenamedOption, nargs="?", help=argparse.SUPPRESS)
    p.add_argument("--gradient-checkpointing", action="store_true", help="recompute each decoder layer in the "
                                                                         "backward")
    p.add_argument("--reference-offload", action="store_true", help="the KL reference in CPU memory between its "
                                                                    "passes")
    p.add_argument("--kl-coef", type=non_negative_float, default=0.001, help="0: no KL term, no reference model")
    p.add_argument("--lora-rank", type=positive_int, default=None, help="train LoRA adapters of this rank (q, k, v, o)")
    p.add_argument("--micro-batch-tokens", type=positive_int, default=DEFAULT_MICRO_BATCH_TOKENS,
                   help="decoder tokens per forward/backward pass (default: a (2,2,1) prompt group at 500-token "
                        "steps, %(default)s)")
    p.add_argument("--learner-attention", choices=("sdpa", "flex_attention"), default="sdpa",
                   help="sdpa keeps a dense tree mask per layer; flex_attention a block mask (run.py's eager, which "
                        "holds every head's scores, is not planned)")
    p.add_argument("--generator", choices=("hf", "vllm"), default="hf", help="the rollout engine")
    p.add_argument("--colocated", action="store_true", help="the rollout engine on the learner's GPU")
    p.add_argument("--vllm-gpu-memory-utilization", type=fraction, default=DEFAULT_VLLM_GPU_MEMORY_UTILIZATION,
                   help="a colocated vLLM engine's share of the GPU (default %(default)s)")
    p.add_argument("--vllm-sleep", action="store_true", help="the vLLM engine frees its memory during updates")
    p.add_argument("--prompts-per-iteration", type=positive_int, default=DEFAULT_ROLLOUT_PROMPTS,
                   help="prompts the colocated engine samples (with R env runners sharing GPUs: one runner's share) "
                        "(default: the GPU default, %(default)s)")
    for name, value, what in zip("MNL", DEFAULT_TREE, ("trees per prompt", "nodes expanded per tree per round",
                                                       "expansion rounds"), strict=True):
        p.add_argument(f"--{name}", type=positive_int if name == "M" else non_negative_int, default=value,
                       help=f"{what} (default %(default)s)")
    p.add_argument("--max-context-tokens", type=positive_int, default=DEFAULT_ROLLOUT_CONTEXT,
                   help="token cap of a whole trajectory: each KV cache row's length (default %(default)s)")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                   help="compute dtype (default bfloat16: bf16 compute over float32 master weights)")
    p.add_argument("--pure-bf16", action="store_true", help="bf16 weights, gradients and AdamW state (no float32 "
                                                            "master)")
    p.add_argument("--gpu-memory-gib", type=positive_float, required=True, help="each GPU's memory, GiB")
    p.add_argument("--json", metavar="PATH", help="write the plan as JSON")
    return p


class RenamedOption(argparse.Action):
    """An old spelling: refused, naming run.py's (an option's one spelling, whichever script takes it)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        parser.exit(2, f"plan_memory.py: error: {option_string} is spelled --learner-sharding, as run.py spells it: "
                       f"pass --learner-sharding {values or 'ddp|fsdp'}\n")


def options_from_args(args: argparse.Namespace) -> MemoryOptions:
    """The plan's options from the command line's (a ``ValueError`` names a bad combination)."""
    return MemoryOptions(
        learners=args.learners, sharding=args.learner_sharding, dtype=args.dtype, pure_bf16=args.pure_bf16,
        gradient_checkpointing=args.gradient_checkpointing, reference=args.kl_coef > 0,
        reference_offload=args.reference_offload, lora_rank=args.lora_rank, micro_batch_tokens=args.micro_batch_tokens,
        learner_attention=args.learner_attention, generator=args.generator, colocated=args.colocated,
        vllm_gpu_memory_utilization=args.vllm_gpu_memory_utilization, vllm_sleep=args.vllm_sleep,
        rollout_sequences=rollout_sequences(args.prompts_per_iteration, (args.M, args.N, args.L)),
        rollout_context=args.max_context_tokens, gpu_memory_gib=args.gpu_memory_gib)


def main(argv: list[str] | None = None) -> MemoryPlan:
    parser = plan_memory_parser()
    args = parser.parse_args(argv)
    try:
        plan = plan_memory(model_shape(args.model), options_from_args(args))
    except (ModelShapeError, ValueError) as error:
        parser.exit(2, f"plan_memory.py: error: {error}\n")
    print(plan_table(plan))
    if args.json:
        try:
            Path(args.json).write_text(json.dumps(plan.to_json(), indent=1) + "\n")
        except OSError as error:
            parser.exit(2, f"plan_memory.py: error: --json {args.json}: {error.strerror}\n")
    return plan


if __name__ == "__main__":
    main()
