"""Learner throughput with shared-prefix training against the per-row forward, on tree-shaped batches.

    python benchmarks/bench_prefix_sharing.py                                   # CPU: float32, 1 repeat
    python benchmarks/bench_prefix_sharing.py --device cuda --repeats 5 --report docs/benchmarks.md

One learner pass (forward and backward of log-probs and entropies, as the learner's train step makes) over the
same batch both ways, micro-batched as the learner does: ``--micro-batch-size`` rows at a time per row, whole
prompt groups with prefix sharing. Reports leaf tokens per second (the rows' real tokens over the time), the
speed-up, peak accelerator memory, and the token shares the trees offer (unique tokens of the micro-batch tries
/ real tokens) and the shared forward uses (tokens through the decoder / real tokens).

Batches are built with the trees' exact sharing structure (M trees per prompt, L rounds of N expansions from
random non-leaf steps, each branch regrown to the end) and token counts from the environments (SmolLM2
tokenizer; SynthHop: 144-token prompts, 138-token observations, 32-token steps; HotpotQA: 152-token prompts,
414-token observations (3 passages), 128-token steps, the CPU step cap), 3 turns. The model is built from its
configuration with random weights (the time does not depend on the values; no download, no Ray), so the
script runs on a bare GPU machine with torch and transformers.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from algos.batch import prompt_group_chunks
from benchmarks.report import add_accelerator_options, resolve_dtype
from policies.logprobs import ENTROPY, LOGPROBS, PACKED_TOKENS, REAL_TOKENS, UNIQUE_TOKENS, sequence_logprobs

# SmolLM2-135M's architecture (HuggingFaceTB/SmolLM2-135M-Instruct config.json)
MODELS = {
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192,
                         rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True),
    "qwen2.5-0.5b-shaped": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                                max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
                                tie_word_embeddings=True),
    # Llama-3.2-1B's config.json (1.24B parameters), without its llama3 rope scaling (which changes values, not cost)
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=64, vocab_size=128256, max_position_embeddings=131072,
                         rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=True),
}


@dataclass(frozen=True)
class Profile:
    """Token counts of one environment's trajectories."""

    prompt: int
    observation: int
    step: int
    turns: int = 3


PROFILES = {"synthhop": Profile(prompt=144, observation=138, step=32),
            "hotpotqa": Profile(prompt=152, observation=414, step=128)}
# (env, (M, N, L)): trees as in the paper, chain GRPO G = 4 (no expansions)
SETTINGS = (("synthhop", (2, 2, 1)), ("synthhop", (4, 0, 0)), ("hotpotqa", (2, 2, 1)))


def tree_rows(rng: np.random.Generator, profile: Profile, shape: tuple[int, int, int], prompts: int, vocab: int
              ) -> tuple[list[list[int]], list[list[bool]], list[int]]:
    """Every leaf's tokens, generated mask and prompt index for ``prompts`` prompts of ``shape`` = (M, N, L)
    trees (plain ints: this script runs where gymnasium, which ``algos.rollout`` needs, is not installed)."""
    trees, expansions, rounds = shape
    def tokens(n: int) -> list[int]:
        return rng.integers(5, vocab, n).tolist()

    def turn(last: bool) -> list[tuple[list[int], bool]]:
        return [(tokens(profile.step), True)] + ([] if last else [(tokens(profile.observation), False)])

    ids, masks, prompt_of = [], [], []
    for prompt_index in range(prompts):
        prompt = [(tokens(profile.prompt), False)]
        for _ in range(trees):
            leaves = [[turn(k == profile.turns - 1) for k in range(profile.turns)]]  # turns of each leaf
            for _ in range(rounds):
                nodes = [(leaf, k) for leaf in range(len(leaves)) for k in range(profile.turns - 1)]
                for pick in rng.choice(len(nodes), size=min(expansions, len(nodes)), replace=False):
                    leaf, k = nodes[pick]  # branch after turn k of that leaf: shared turns, then new ones
                    regrown = [turn(j == profile.turns - 1) for j in range(k + 1, profile.turns)]
                    leaves.append(leaves[leaf][: k + 1] + regrown)
            for leaf in leaves:
                pieces = prompt + [piece for t in leaf for piece in t]
                ids.append([t for piece, _ in pieces for t in piece])
                masks.append([generated for piece, generated in pieces for _ in piece])
                prompt_of.append(prompt_index)
    return ids, masks, prompt_of


def padded(ids: list[list[int]], masks: list[list[bool]], device: str) -> dict[str, torch.Tensor]:
    width = max(map(len, ids))
    batch = {"input_ids": torch.zeros(len(ids), width, dtype=torch.long),
             "attention_mask": torch.zeros(len(ids), width, dtype=torch.long),
             "generated_mask": torch.zeros(len(ids), width)}
    for row, (tokens, mask) in enumerate(zip(ids, masks, strict=True)):
        batch["input_ids"][row, : len(tokens)] = torch.tensor(tokens)
        batch["attention_mask"][row, : len(tokens)] = 1
        batch["generated_mask"][row, : len(tokens)] = torch.tensor(mask, dtype=torch.float32)
    return {k: v.to(device) for k, v in batch.items()}


def learner_pass(model: torch.nn.Module, batch: dict[str, torch.Tensor], slices: list[slice],
                 share_prefixes: bool) -> dict[str, int]:
    """Forward and backward over the micro-batches (gradients accumulate, as in a learner step)."""
    counts = {UNIQUE_TOKENS: 0, PACKED_TOKENS: 0, REAL_TOKENS: 0}
    model.zero_grad(set_to_none=True)
    for piece in slices:
        part = {k: v[piece] for k, v in batch.items()}
        out = sequence_logprobs(model, part, return_entropy=True, share_prefixes=share_prefixes)
        weights = part["generated_mask"]
        ((out[LOGPROBS] * weights).sum() + 1e-3 * (out[ENTROPY] * weights).sum()).backward()
        for key in counts:
            counts[key] += out.get(key, 0)
    return counts


def measure(model, batch, slices, share_prefixes: bool, repeats: int, device: str) -> tuple[float, float, dict]:
    """(median seconds, peak accelerator GiB or nan, token counts) of ``repeats`` passes after one warm-up."""
    learner_pass(model, batch, slices, share_prefixes)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        counts = learner_pass(model, batch, slices, share_prefixes)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else float("nan")
    return statistics.median(times), peak, counts


def run(args: argparse.Namespace) -> str:
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    config = LlamaConfig(**MODELS[args.model], attn_implementation="sdpa")
    model = LlamaForCausalLM(config).to(device=args.device, dtype=dtype)
    lines = ["| setting | rows | real tokens | unique / real | forwarded / real | per-row tok/s | shared tok/s "
             "| speed-up | peak GiB per-row | peak GiB shared |", "|" + "---|" * 10]
    for env, shape in SETTINGS:
        ids, masks, prompt_of = tree_rows(np.random.default_rng(args.seed), PROFILES[env], shape, args.prompts,
                                          config.vocab_size)
        batch = padded(ids, masks, args.device)
        per_row = [slice(s, s + args.micro_batch_size) for s in range(0, len(ids), args.micro_batch_size)]
        grouped = prompt_group_chunks(np.asarray(prompt_of), args.micro_batch_size)
        plain_s, plain_peak, _ = measure(model, batch, per_row, False, args.repeats, args.device)
        shared_s, shared_peak, counts = measure(model, batch, grouped, True, args.repeats, args.device)
        real = counts[REAL_TOKENS]
        name = f"{env} {'tree' if shape[2] else 'chains'} {shape}"
        lines.append(f"| {name} | {len(ids)} | {real} | {counts[UNIQUE_TOKENS] / real:.3f} "
                     f"| {counts[PACKED_TOKENS] / real:.3f} | {real / plain_s:,.0f} | {real / shared_s:,.0f} "
                     f"| {plain_s / shared_s:.2f}x | {plain_peak:.2f} | {shared_peak:.2f} |")
        print(lines[-1], flush=True)
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(MODELS), default="smollm2-135m")
    add_accelerator_options(p)
    p.add_argument("--prompts", type=int, default=4, help="prompts per batch")
    p.add_argument("--micro-batch-size", type=int, default=4, help="rows per micro-batch (the project default)")
    p.add_argument("--repeats", type=int, default=1, help="timed passes per setting (the median is reported)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--report", default=None, help="write the table as section prefix-sharing of this file")
    return resolve_dtype(p.parse_args(argv))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    table = run(args)
    if args.report:
        from benchmarks.report import machine_description, replace_section

        given = argv if argv is not None else sys.argv[1:]
        command = "python benchmarks/bench_prefix_sharing.py " + " ".join(given)
        replace_section(args.report, "prefix-sharing", "Shared-prefix training: learner throughput",
                        f"`{command.strip()}` on {machine_description()}; {args.model} ({args.dtype}, random "
                        f"weights), {args.prompts} prompts, micro-batches of {args.micro_batch_size} rows.\n\n"
                        + table)


if __name__ == "__main__":
    main()
