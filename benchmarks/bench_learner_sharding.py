"""Learner sharding: step time and per-rank memory of DDP replicas against FSDP shards (``policies/fsdp.py``).

    python -m benchmarks.bench_learner_sharding                              # CPU: SmolLM2-135M's shape, world 1, 2
    python -m benchmarks.bench_learner_sharding --report docs/benchmarks.md
    python -m benchmarks.bench_learner_sharding --gpu                        # one GPU: Qwen2.5-1.5B's shape, world 1
    python -m benchmarks.bench_learner_sharding --startup                    # the learners' build, not their steps

No Ray: each configuration (sharding, world size, activation checkpointing) runs in ``world`` fresh processes that
this script starts (``torch.multiprocessing``, a file-store process group: gloo on the CPU, nccl on GPUs), so it
runs where only torch and transformers are installed. Each rank builds a model of the shape with random weights
(Llama; Qwen2 for shapes with q/k/v biases), wraps it as the learner does (DDP over the whole model at world 2 and
more, nothing at world 1; or ``policies.fsdp.shard_model`` with the learner's mixed precision), and takes
``--steps`` optimizer steps, each of ``--micro-batches`` micro-batches of its own: rows sharing a prompt (about
``--tokens`` unique tokens), forwarded with shared prefixes through ``policies.logprobs.sequence_logprobs``
(log-probs and entropies), the token-mean loss backpropagated as the learner reduces it (DDP: all-reduced after the
step's last micro-batch, ``no_sync`` before; FSDP: reduce-scattered after every micro-batch), the gradient norm over
all ranks, AdamW. Each rank's micro-batches are the same at every world size: a step at world 2 does twice the work
of one at world 1, on twice the processes.

Measured per rank: the median step time after the first step (the first builds AdamW's state), the peak memory
of the steps (GPU: peak allocated; CPU: the process's peak resident set minus its resident set before the model
was built, glibc's mmap threshold fixed at 1 MiB so that freed tensors leave it, as in bench_memory) and the bytes
of parameters, gradients and AdamW state it holds after a step, counted from the tensors
(``policies.fsdp.trained_state_bytes``). Planned: :func:`policies.memory_plan.plan_memory`'s per-GPU total for the
same learners, sharding, precision, checkpointing and micro-batch (its packed tokens and longest segment), no
reference, no engine, no CUDA overhead; the table gives planned / measured. ``--gpu``: bf16 compute over float32
masters (the learner's ``--dtype bfloat16``) and activation checkpointing, as a GPU run trains; world 1 only, where
FSDP's sharding is trivial but its whole path (root, gathers, reductions, sharded optimizer) runs.

``--startup``: the learners' build instead of their steps (``algos/tree_grpo/learner.py``, ``_make_module``), with a
KL reference in the compute dtype: one unsharded learner (the model moved to the device whole, the reference copied
beside it) and FSDP learners (the model kept on the host, ``broadcast_from_rank0``, then
``policies.reference_model.shard_policy_and_reference``: the policy sharded unit by unit, the reference made from
its shards). Measured per rank, above the level before the model is built and after a build of the tiny-random
shape the same way (what a process loads once is then out of the measurement): the peak while the model is
constructed (random weights: the constructor makes an untied LM head and drops it when it ties the weights, the
embeddings' size more for a moment) and the peak of the learner's build from it; the larger against one learner's,
the second against the plan's startup term (``policies.memory_plan.startup_parts``; on the CPU, whose device is the
host, with ``host_is_device``).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

from benchmarks.bench_memory import MMAP_THRESHOLD, resident_gib, tree_batch
from benchmarks.report import machine_description, replace_section
from policies.memory_plan import GIB, MemoryOptions, plan_memory, startup_parts
from policies.model_shape import PRESETS, SMOLLM2, TINY_RANDOM, ModelShape

GPU_SHAPE = "qwen2.5-1.5b-instruct"
ENTROPY_COEF = 0.001  # the learner's default entropy bonus
SECTION_KEY, SECTION_TITLE = "learner-sharding", "Learner sharding: DDP replicas against FSDP shards (CPU)"
STARTUP_KEY, STARTUP_TITLE = "learner-startup", "Learner startup: one learner against FSDP shards (CPU)"


def build_model(shape: ModelShape, seed: int):
    """A float32 causal LM of ``shape`` with random weights (Qwen2 when the shape has q/k/v biases), in train()
    mode, sdpa attention (which takes the tree mask)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common = {"vocab_size": shape.vocab, "hidden_size": shape.hidden, "intermediate_size": shape.intermediate,
              "num_hidden_layers": shape.layers, "num_attention_heads": shape.heads,
              "num_key_value_heads": shape.kv_heads, "tie_word_embeddings": shape.tied_embeddings,
              "max_position_embeddings": 8192, "attn_implementation": "sdpa"}
    torch.manual_seed(seed)
    if shape.qkv_bias:
        return Qwen2ForCausalLM(Qwen2Config(**common)).train()
    return LlamaForCausalLM(LlamaConfig(**common, head_dim=shape.head_dim)).train()


def rank_main(rank: int, world: int, store: str, args: argparse.Namespace, config: tuple[str, bool], out: str
              ) -> None:
    """One rank of one configuration (sharding, checkpointing): its steps, then its measurements to
    ``out/<rank>.json``."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from policies.fsdp import ShardedRoot, global_norm, mixed_precision, shard_model, trained_state_bytes
    from policies.logprobs import ENTROPY, LOGPROBS, PACKED_TOKENS, PACKING, pack_rows, sequence_logprobs
    from policies.memory import peak_memory_gib, reset_peak_memory
    from policies.precision import precision_of

    sharding, checkpointing = config
    torch.set_num_threads(args.threads)
    cuda = args.device == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(minutes=10))
    shape = PRESETS[args.shape]
    precision = precision_of(args.dtype)
    batches = [tree_batch(shape.vocab, args.rows, args.prompt_tokens, args.tokens, args.seed + 100 * rank + i)
               for i in range(args.micro_batches)]
    before = resident_gib("VmRSS")
    model = build_model(shape, args.seed).to(device)  # the same seed on every rank: the same initial weights
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if sharding == "fsdp":
        root = shard_model(model, mp_policy=mixed_precision(precision.compute, precision.master))
        autocast = contextlib.nullcontext  # the units gather in the compute dtype (the learner's way)
    else:  # as RLlib wraps a learner: DDP only over several (one learner keeps no reducer buckets)
        root = ShardedRoot(model)
        if world > 1:
            root = DistributedDataParallel(root, device_ids=[rank] if cuda else None)
        autocast = functools.partial(precision.autocast, device)
    for batch in batches:
        for key, value in list(batch.items()):
            batch[key] = value.to(device)
        batch[PACKING] = pack_rows(model, batch)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    packed = {}

    def loss_of(batch):
        with autocast():
            out = sequence_logprobs(model, batch, share_prefixes=True, return_entropy=True)
        packed.update(tokens=out[PACKED_TOKENS], segment=int(batch[PACKING].token_ids.shape[1]))
        scored = batch["attention_mask"][:, 1:].sum()
        return -(out[LOGPROBS].sum() + ENTROPY_COEF * out[ENTROPY].sum()) / scored

    times, norm = [], 0.0
    reset_peak_memory(device)
    for _ in range(args.steps):
        if cuda:
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        for i, batch in enumerate(batches):
            replicas_wait = sharding == "ddp" and world > 1 and i < len(batches) - 1
            with root.no_sync() if replicas_wait else contextlib.nullcontext():
                (root(loss_of, batch) / len(batches)).backward()
        norm = global_norm([p.grad for p in model.parameters() if p.grad is not None])
        optimizer.step()
        if cuda:
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    peak = peak_memory_gib(device) - (0.0 if cuda else before)
    result = {"sharding": sharding, "world": world, "checkpointing": checkpointing, "rank": rank,
              "step_s": statistics.median(times[1:] or times), "peak_gib": peak,
              "trained_gib": trained_state_bytes(model, optimizer) / GIB, "grad_norm": norm,
              "parameters": shape.parameters, "packed_tokens": int(packed["tokens"]),
              "segment_tokens": packed["segment"]}
    result["planned_gib"] = planned_gib(args, result)
    Path(out, f"{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def startup_rank_main(rank: int, world: int, store: str, args: argparse.Namespace, config: tuple[str, bool],
                      out: str) -> None:
    """One rank of a build (``--startup``): the model and its KL reference as the learner builds them (see the
    module docstring), its peak to ``out/<rank>.json``."""
    import torch
    import torch.distributed as dist

    from policies.fsdp import broadcast_from_rank0
    from policies.memory import peak_memory_gib, reset_peak_memory
    from policies.precision import precision_of
    from policies.reference_model import ReferenceModel, shard_policy_and_reference

    sharding = config[0]
    torch.set_num_threads(args.threads)
    cuda = args.device == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if sharding == "fsdp":
        dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{store}", rank=rank,
                                world_size=world, timeout=timedelta(minutes=10))
    precision = precision_of(args.dtype)

    def build(model: torch.nn.Module) -> None:  # the learner's _make_module, from the module RLlib built
        if sharding == "fsdp":
            broadcast_from_rank0(model, device)
            shard_policy_and_reference(model, precision, reference=True)
        else:
            model.to(device)
            ReferenceModel(model, dtype=precision.compute, device=device)

    build(build_model(PRESETS[TINY_RANDOM], args.seed))  # what a process loads once: out of the measurement
    gc.collect()
    before = resident_gib("VmRSS")
    reset_peak_memory(device)
    model = build_model(PRESETS[args.shape], args.seed)  # on the host, as RLlib builds the module
    constructed = peak_memory_gib(device) - (0.0 if cuda else before)
    reset_peak_memory(device)
    build(model)
    learner = peak_memory_gib(device) - (0.0 if cuda else before)
    options = MemoryOptions(learners=world, sharding=sharding, dtype=args.dtype, overhead_gib=0.0)
    planned = sum(startup_parts(PRESETS[args.shape], options, host_is_device=not cuda).values()) / GIB
    result = {"sharding": sharding, "world": world, "rank": rank, "constructed_gib": constructed,
              "learner_gib": learner, "peak_gib": max(constructed, learner), "planned_gib": planned}
    Path(out, f"{rank}.json").write_text(json.dumps(result))
    if dist.is_initialized():
        dist.destroy_process_group()


def startup_table(results: list[list[dict]]) -> str:
    """One row per build, the largest rank's figures: the model's construction, the learner's build from it, the
    startup's peak (the larger) and its share of one learner's, the plan's startup term against the learner's
    build."""
    lines = ["| learners | sharding | constructed (GiB) | learner's build (GiB) | startup peak (GiB) "
             "| of one learner's | planned (GiB) | planned / learner's build |",
             "|---:|---|---:|---:|---:|---:|---:|---:|"]
    one = max(r["peak_gib"] for r in results[0])
    for ranks in results:
        constructed, learner = (max(r[key] for r in ranks) for key in ("constructed_gib", "learner_gib"))
        peak, planned = max(r["peak_gib"] for r in ranks), ranks[0]["planned_gib"]
        lines.append(f"| {ranks[0]['world']} | {ranks[0]['sharding']} | {constructed:.3f} | {learner:.3f} | "
                     f"{peak:.3f} | {peak / one:.2f} | {planned:.3f} | {planned / learner:.2f} |")
    return "\n".join(lines)


def planned_gib(args: argparse.Namespace, result: dict) -> float:
    """The plan's per-GPU total for a measured configuration (see the module docstring)."""
    options = MemoryOptions(learners=result["world"], sharding=result["sharding"], dtype=args.dtype,
                            gradient_checkpointing=result["checkpointing"], reference=False,
                            micro_batch_tokens=result["packed_tokens"], sequence_tokens=result["segment_tokens"],
                            overhead_gib=0.0)
    return plan_memory(PRESETS[args.shape], options).per_gpu_gib


def measure(args: argparse.Namespace, config: tuple[str, bool], world: int, target=rank_main) -> list[dict]:
    """One configuration (sharding, checkpointing) on ``world`` fresh processes running ``target`` (``rank_main``,
    or ``startup_rank_main``); each rank's measurements."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as out:
        mp.spawn(target, args=(world, str(Path(out) / "store"), args, config, out), nprocs=world, join=True)
        return [json.loads(Path(out, f"{rank}.json").read_text()) for rank in range(world)]


def table(results: list[list[dict]]) -> str:
    """One row per configuration: the largest rank's step time, peak and plan, the per-rank counted bytes; the
    FSDP/DDP peak ratio at the same world and checkpointing."""
    lines = ["| sharding | learners | checkpointing | step (s), slowest rank | peak per rank (GiB) | planned (GiB) | "
             "planned / peak | of DDP's peak | params + grads + AdamW per rank (GiB, counted) | of world 1's |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    first = {(ranks[0]["sharding"], ranks[0]["world"], ranks[0]["checkpointing"]): ranks for ranks in results}
    for ranks in results:
        head = ranks[0]
        key = (head["sharding"], head["world"], head["checkpointing"])
        peak, planned = max(r["peak_gib"] for r in ranks), max(r["planned_gib"] for r in ranks)
        trained = max(rank["trained_gib"] for rank in ranks)
        alone = first.get((key[0], 1, key[2]))
        share = f"{trained / alone[0]['trained_gib']:.2f}" if alone else "n/a"
        ddp = first.get(("ddp", key[1], key[2]))
        of_ddp = f"{peak / max(r['peak_gib'] for r in ddp):.2f}" if ddp else "n/a"
        lines.append(f"| {key[0]} | {key[1]} | {'on' if key[2] else 'off'} | {max(r['step_s'] for r in ranks):.2f} "
                     f"| {peak:.2f} | {planned:.2f} | {planned / peak:.2f} | {of_ddp} | {trained:.3f} | {share} |")
    return "\n".join(lines)


def report(results: list[list[dict]], args: argparse.Namespace, command: str) -> str:
    return (f"`{command}` on {machine_description()}.\n\n"
            f"{PRESETS[args.shape].name}'s shape ({PRESETS[args.shape].parameters / 1e6:.0f}M parameters, random "
            f"weights, {args.dtype}); per rank and "
            f"step {args.micro_batches} micro-batches of {args.rows} rows sharing a {args.prompt_tokens}-token "
            f"prompt (about {args.tokens} unique tokens each), {args.steps} steps (the first not timed), "
            f"{args.threads} thread(s) per rank. Peak: the process's resident set above its level before the "
            f"model was built (CPU) or peak allocated (GPU).\n\n{table(results)}\n")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpu", action="store_true", help=f"one GPU: {GPU_SHAPE}'s shape, world 1, bf16 autocast and "
                                                      f"activation checkpointing (defaults of the options below)")
    p.add_argument("--shape", choices=sorted(PRESETS), default=None, help=f"default: {SMOLLM2} ({GPU_SHAPE} with "
                                                                          "--gpu)")
    p.add_argument("--worlds", type=int, nargs="+", default=None, help="world sizes (default: 1 2; 1 with --gpu)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                   help="compute dtype over float32 masters (default: float32; bfloat16 with --gpu)")
    p.add_argument("--checkpointing", choices=("off", "on", "both"), default=None,
                   help="activation checkpointing (default: both, each configuration without then with; on with --gpu)")
    p.add_argument("--shardings", nargs="+", choices=("ddp", "fsdp"), default=["ddp", "fsdp"])
    p.add_argument("--startup", action="store_true", help="measure the learners' build (one learner, then FSDP at "
                                                          "each --worlds size above 1) instead of their steps")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--micro-batches", type=int, default=4, help="micro-batches per optimizer step (K)")
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--tokens", type=int, default=384, help="unique tokens per micro-batch (about)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the per-rank results here")
    p.add_argument("--report", default=None, help="rewrite this section of a markdown file (docs/benchmarks.md)")
    args = p.parse_args(argv)
    args.device = "cuda" if args.gpu else "cpu"
    args.shape = args.shape or (GPU_SHAPE if args.gpu else SMOLLM2)
    args.worlds = args.worlds or ([1] if args.gpu else [1, 2])
    args.dtype = args.dtype or ("bfloat16" if args.gpu else "float32")
    args.checkpointing = args.checkpointing or ("on" if args.gpu else "both")
    return args


def measured_options(argv: list[str] | None) -> list[str]:
    """The command line's options without where the results go (``--json``, ``--report`` and their values)."""
    options, skip = [], False
    for arg in sys.argv[1:] if argv is None else argv:
        if skip:
            skip = False
        elif arg in ("--json", "--report"):
            skip = True
        elif not arg.startswith(("--json=", "--report=")):
            options.append(arg)
    return options


def startup(args: argparse.Namespace, argv: list[str] | None) -> list[list[dict]]:
    """``--startup``: one learner's build, then FSDP's at each world size above 1; the table, the report."""
    results = [measure(args, ("ddp", False), 1, startup_rank_main)]
    results += [measure(args, ("fsdp", False), world, startup_rank_main) for world in args.worlds if world > 1]
    text = startup_table(results)
    print(text)
    if args.report:
        command = " ".join(["python -m benchmarks.bench_learner_sharding", *measured_options(argv)])
        replace_section(args.report, STARTUP_KEY, STARTUP_TITLE,
                        f"`{command}` on {machine_description()}.\n\n{PRESETS[args.shape].name}'s shape (random "
                        f"weights), {args.dtype} compute, a KL reference; peak: the process's resident set above "
                        f"its level before the build (CPU) or peak allocated (GPU).\n\n{text}\n")
    return results


def main(argv: list[str] | None = None) -> list[list[dict]]:
    args = parse_args(argv)
    os.environ[MMAP_THRESHOLD] = str(2**20)  # inherited by the spawned ranks (see the module docstring)
    if args.startup:
        return startup(args, argv)
    results = []
    checkpointing = {"off": [False], "on": [True], "both": [False, True]}[args.checkpointing]
    for sharding in args.shardings:
        for world in args.worlds:
            for recompute in checkpointing:
                ranks = measure(args, (sharding, recompute), world)
                print(json.dumps(ranks), flush=True)
                results.append(ranks)
    print(table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    if args.report:
        command = " ".join(["python -m benchmarks.bench_learner_sharding", *measured_options(argv)])
        title = SECTION_TITLE if not args.gpu else SECTION_TITLE.replace("(CPU)", "(one GPU)")
        replace_section(args.report, SECTION_KEY + ("-gpu" if args.gpu else ""), title, report(results, args, command))
    return results


if __name__ == "__main__":
    main()
