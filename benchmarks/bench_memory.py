"""The memory plan (``policies/memory_plan.py``, ``experiments/plan_memory.py``) against measured peaks on the CPU.

    python benchmarks/bench_memory.py                      # tiny-random and SmolLM2-135M's shape, ~4,000 tokens
    python benchmarks/bench_memory.py --report docs/benchmarks.md

Each configuration (a model shape, with or without activation checkpointing) runs in a fresh subprocess: a
float32 ``LlamaForCausalLM`` of the shape with random weights, in train() mode (checkpointing enabled as the learner
does, non-reentrant), one micro-batch of ``--rows`` rows that share a ``--prompt-tokens`` prompt (about
``--tokens`` unique tokens), forwarded with shared prefixes (the learner's default: a tree mask, sdpa) through
``policies.logprobs.sequence_logprobs(..., return_entropy=True)``, the token-mean of the log-probs plus the
learner's entropy bonus (0.001 x the entropy) backpropagated, then an AdamW step. The step measured is a
steady-state one: AdamW's moments exist and the gradients of an earlier micro-batch are alive (accumulation), as in
every micro-batch but an update's first. Measured: the process's peak resident
set (``VmHWM``) minus its resident set just before the model is built, twice: with glibc's mmap threshold fixed
at 1 MiB (``MALLOC_MMAP_THRESHOLD_``: every tensor of 1 MiB or more is its own mapping, returned when freed, so the
resident set follows the tensors alive, which is what the plan models and what a GPU's peak allocated memory
counts), and with glibc's defaults (its dynamic threshold rises to 32 MiB and freed heap memory stays resident: the
CPU process's real peak). Planned: the learner's parts of
:func:`policies.memory_plan.plan_memory` for the same micro-batch (its packed tokens, its longest segment and its
LM-head chunk), float32, no reference, no rollout engine, no CUDA overhead.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from benchmarks.report import machine_description, replace_section
from policies.memory_plan import GIB, MemoryOptions, plan_memory
from policies.model_shape import PRESETS, SMOLLM2, TINY_RANDOM, ModelShape

SHAPES = (TINY_RANDOM, SMOLLM2)
LEARNER_PARTS = ("weights", "gradients", "optimizer", "activations")
# The learner's default entropy bonus. The entropy must reach the loss: a chunk's entropy branch that the backward
# never runs keeps its recomputed [C, V] tensors alive (the checkpoint's frame) until the outputs are released.
ENTROPY_COEF = 0.001
MEASUREMENT_ARGS = ("shapes", "tokens", "rows", "prompt_tokens", "threads", "seed")  # saved with --json
MMAP_THRESHOLD = "MALLOC_MMAP_THRESHOLD_"
SECTION_KEY, SECTION_TITLE = "memory-plan", "Memory plan against measured peaks (CPU)"


def resident_gib(field: str) -> float:
    """``VmRSS`` or ``VmHWM`` of this process, in GiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024 / GIB
    raise RuntimeError(f"/proc/self/status has no {field} (Linux only)")


def tree_batch(vocab: int, rows: int, prompt_tokens: int, tokens: int, seed: int) -> dict:
    """``rows`` rows sharing a prompt of ``prompt_tokens`` tokens, each with its own continuation, about
    ``tokens`` unique tokens in all."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    continuation = max(1, (tokens - prompt_tokens) // rows)
    prompt = torch.randint(0, vocab, (prompt_tokens,), generator=generator)
    ids = torch.stack([torch.cat([prompt, torch.randint(0, vocab, (continuation,), generator=generator)])
                       for _ in range(rows)])
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def measure(shape: ModelShape, checkpointing: bool, rows: int, prompt_tokens: int, tokens: int, seed: int) -> dict:
    """One steady-state learner step (see the module docstring); its peak and the micro-batch's geometry."""
    import gc

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from policies.logprobs import ENTROPY, LOGPROBS, PACKED_TOKENS, PACKING, pack_rows, sequence_logprobs
    from policies.memory import peak_memory_gib, reset_peak_memory

    batch = tree_batch(shape.vocab, rows, prompt_tokens, tokens, seed)
    gc.collect()
    before = resident_gib("VmRSS")
    reset_peak_memory("cpu")
    config = LlamaConfig(vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                         num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                         num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim,
                         tie_word_embeddings=shape.tied_embeddings, max_position_embeddings=8192,
                         attn_implementation="sdpa")
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    packing = pack_rows(model, batch)
    batch[PACKING] = packing
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    for param in model.parameters():  # an earlier micro-batch's gradients, and AdamW's moments from a step
        param.grad = torch.zeros_like(param)
    optimizer.step()
    out = sequence_logprobs(model, batch, share_prefixes=True, return_entropy=True)
    scored = batch["attention_mask"][:, 1:].sum()
    (-(out[LOGPROBS].sum() + ENTROPY_COEF * out[ENTROPY].sum()) / scored).backward()
    optimizer.step()
    peak = peak_memory_gib("cpu")
    segments, segment_tokens = packing.token_ids.shape
    return {"shape": shape.name, "checkpointing": checkpointing, "rows": rows,
            "unique_tokens": int(packing.counts["unique_tokens"]), "packed_tokens": int(out[PACKED_TOKENS]),
            "segments": int(segments), "segment_tokens": int(segment_tokens), "before_gib": before,
            "peak_gib": peak - before, "parameters": sum(p.numel() for p in model.parameters())}


def planned(result: dict) -> dict[str, float]:
    """The plan's learner parts for a measured micro-batch."""
    options = MemoryOptions(dtype="float32", gradient_checkpointing=result["checkpointing"], reference=False,
                            micro_batch_tokens=result["segments"] * result["segment_tokens"],
                            sequence_tokens=result["segment_tokens"], overhead_gib=0.0)
    plan = plan_memory(PRESETS[result["shape"]], options)
    return {name: plan.parts[name] for name in LEARNER_PARTS}


def run_child(shape: str, checkpointing: bool, args: argparse.Namespace, *, fixed_mmap_threshold: bool) -> dict:
    """``measure`` in a fresh Python process (its own peak), the result read from its last output line."""
    env = dict(os.environ)
    env.pop(MMAP_THRESHOLD, None)
    if fixed_mmap_threshold:
        env[MMAP_THRESHOLD] = str(2**20)
    command = [sys.executable, "-m", "benchmarks.bench_memory", "--child", shape, "--threads", str(args.threads),
               "--tokens", str(args.tokens), "--rows", str(args.rows), "--prompt-tokens", str(args.prompt_tokens),
               "--seed", str(args.seed)] + (["--checkpointing"] if checkpointing else [])
    done = subprocess.run(command, capture_output=True, text=True, check=False, env=env)
    if done.returncode:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure_in_children(shape: str, checkpointing: bool, args: argparse.Namespace) -> dict:
    """One configuration measured in two fresh processes: with the mmap threshold fixed, and with glibc's
    defaults (``peak_default_malloc_gib``)."""
    result = run_child(shape, checkpointing, args, fixed_mmap_threshold=True)
    result["peak_default_malloc_gib"] = run_child(shape, checkpointing, args, fixed_mmap_threshold=False)["peak_gib"]
    print(f"{shape} checkpointing={checkpointing}: measured {result['peak_gib']:.3f} GiB "
          f"({result['peak_default_malloc_gib']:.3f} GiB with glibc's defaults)", flush=True)
    return result


def table(results: list[dict]) -> str:
    lines = ["| shape | checkpointing | tokens (unique / forwarded, segments x length) | planned GiB (weights + "
             "gradients + optimizer + activations) | measured peak GiB (mmap threshold 1 MiB) | planned / measured "
             "| measured peak GiB (glibc defaults) | planned / measured |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        parts = r["planned"]
        total = sum(parts.values())
        lines.append(f"| {r['shape']} | {'yes' if r['checkpointing'] else 'no'} | {r['unique_tokens']:,} / "
                     f"{r['packed_tokens']:,} ({r['segments']} x {r['segment_tokens']:,}) | {total:.3f} "
                     f"({' + '.join(f'{parts[k]:.3f}' for k in LEARNER_PARTS)}) | {r['peak_gib']:.3f} | "
                     f"{total / r['peak_gib']:.3f} | {r['peak_default_malloc_gib']:.3f} | "
                     f"{total / r['peak_default_malloc_gib']:.3f} |")
    return "\n".join(lines)


def checkpointing_ratio(results: list[dict], shape: str, key: str = "peak_gib") -> float | None:
    """Peak with checkpointing / peak without, for ``shape`` (None unless both ran)."""
    peaks = {r["checkpointing"]: r[key] for r in results if r["shape"] == shape}
    return peaks[True] / peaks[False] if len(peaks) == 2 else None


def largest_gap(results: list[dict], key: str) -> float:
    """The largest |planned / measured - 1| over the configurations."""
    return max(abs(sum(r["planned"].values()) / r[key] - 1) for r in results)


def report(results: list[dict], args: argparse.Namespace, machine: str) -> str:
    lines = [f"Command: `python benchmarks/bench_memory.py --tokens {args.tokens} --rows {args.rows} "
             f"--prompt-tokens {args.prompt_tokens} --threads {args.threads}`  ",
             f"Machine: {machine}", "",
             "One steady-state learner step per configuration, each in a fresh process: float32 weights (random), "
             f"{args.rows} rows sharing a {args.prompt_tokens:,}-token prompt forwarded with shared prefixes (the "
             "learner's default; sdpa, a dense tree mask; the packing decides the segments), "
             "`sequence_logprobs(..., return_entropy=True)`, the token-mean log-prob plus the learner's entropy "
             "bonus (0.001) backpropagated into the gradients of an earlier micro-batch, then an AdamW step whose "
             "moments exist. Measured: peak resident set (VmHWM) minus the resident set before the model is built, "
             "with glibc's mmap threshold fixed at 1 MiB (the resident set follows the tensors alive: what the plan "
             "models and what a GPU's allocated peak counts) and with glibc's defaults (freed heap memory stays "
             "resident). Planned: `policies/memory_plan.py` for the same micro-batch, learner parts only (no "
             "reference, no rollout engine, no CUDA overhead).",
             "", table(results), "",
             f"Largest gap between plan and measurement: {largest_gap(results, 'peak_gib'):.1%} with the mmap "
             f"threshold fixed (target: within 15%), {largest_gap(results, 'peak_default_malloc_gib'):.1%} against "
             "glibc's defaults: there, freed heap memory stays resident (tensors under 32 MiB go to the heap once "
             "glibc's dynamic mmap threshold has risen), most with checkpointing, whose many layer-sized "
             "temporaries come and go; the plan models the tensors, not the CPU allocator."]
    ratio = checkpointing_ratio(results, SMOLLM2)
    if ratio is not None:
        default = checkpointing_ratio(results, SMOLLM2, "peak_default_malloc_gib")
        lines.append(f"Peak with checkpointing / without, SmolLM2-135M's shape: {ratio:.2f} ({default:.2f} with "
                     "glibc's defaults; target: at most 0.5).")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--tokens", type=int, default=4000, help="unique tokens of the micro-batch (about)")
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--prompt-tokens", type=int, default=1000, help="the prompt all rows share")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--report", metavar="PATH", help="write the section of this markdown file (docs/benchmarks.md)")
    p.add_argument("--json", metavar="PATH", help="write the measurements as JSON")
    p.add_argument("--from-json", metavar="PATH", help="plan and report the measurements of an earlier --json "
                                                       "instead of measuring again")
    p.add_argument("--child", choices=list(SHAPES), help=argparse.SUPPRESS)
    p.add_argument("--checkpointing", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    if args.child:
        import torch

        torch.set_num_threads(args.threads)
        result = measure(PRESETS[args.child], args.checkpointing, args.rows, args.prompt_tokens, args.tokens,
                         args.seed)
        print(json.dumps(result))
        return [result]
    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text())
        results, machine = saved["results"], saved["machine"]
        vars(args).update(saved["args"])
    else:
        machine = machine_description()
        results = [measure_in_children(shape, checkpointing, args)
                   for shape in args.shapes for checkpointing in (False, True)]
        if args.json:
            measured = {key: getattr(args, key) for key in MEASUREMENT_ARGS}
            Path(args.json).write_text(json.dumps({"args": measured, "machine": machine, "results": results},
                                                  indent=1))
    for result in results:
        result["planned"] = planned(result)
    print(table(results))
    text = report(results, args, machine)
    print("\n".join(text.splitlines()[-2:]))
    if args.report:
        replace_section(args.report, SECTION_KEY, SECTION_TITLE, text)
    return results


if __name__ == "__main__":
    main()
