"""One Tree-GRPO rollout and one learner step on an accelerator, without Ray: the GPU check of the rollout
(HFStepGenerator in TreeRollout) and of the learner's loss and backward, where Ray is not installed.

    python benchmarks/bench_device.py --model smollm2-135m-random --prompts 32          # on a GPU: bf16
    python benchmarks/bench_device.py --model tiny-random --prompts 2 --max-step-tokens 8 --device cpu  # smoke

SynthHop-v0 questions (a small world generated in-process), trees (2,2,1). Reports generation tokens/s (tokens
sampled over the rollout's wall time), the rollout's tokens prefilled and LLM calls, the sampler/learner
log-prob gap (the learner's recomputed log-probs of the sampled tokens against the sampler's: mean |gap|, the
ratio's mean, p99 and share outside [0.9, 1.1]), one learner step (clipped loss on tree advantages, backward,
per row and with shared prefixes) with its time, and the peak accelerator memory of each phase.

``--model``: a ``run.py --model`` name or directory, or ``smollm2-135m-random`` (SmolLM2-135M's architecture
with random weights and SmolLM2's tokenizer: the speed of the real model without its weights, which a bare GPU
machine cannot download). Random weights never close a tag, so every step runs to ``--max-step-tokens``.
"""

from __future__ import annotations

import argparse
import time

import gymnasium as gym
import numpy as np
import torch

import envs  # noqa: F401  (registers the env ids)
from algos.batch import (
    ADVANTAGES,
    PROMPT_INDEX,
    SAMPLING_LOGPROBS,
    leaf_records,
    pad_batch,
    prompt_advantages,
    prompt_group_chunks,
)
from algos.losses import clipped_policy_loss, sampler_mismatch
from algos.rollout import TreeRollout, TreeShape
from benchmarks.report import add_accelerator_options, machine_description, resolve_dtype
from envs.synthetic import WorldSpec, world_data_dir
from policies.generation import SamplingSettings
from policies.hf_generation import HFStepGenerator
from policies.logprobs import GENERATED_MASK, LOGPROBS, sequence_logprobs

SMOLLM2_RANDOM = "smollm2-135m-random"
# the demo's world (experiments.demo.WORLD, not imported: that module needs Ray, which the GPU machine lacks)
WORLD = WorldSpec(seed=0, people=60, companies=30, cities=12, countries=5, train_questions=240, dev_questions=60)


def build_policy(name: str, dtype: torch.dtype, device: str):
    from policies.models import load_model, model_cache_dir, smollm2_tokenizer

    if name == SMOLLM2_RANDOM:
        from transformers import LlamaConfig, LlamaForCausalLM

        from benchmarks.bench_prefix_sharing import MODELS

        tokenizer = smollm2_tokenizer(model_cache_dir())
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**MODELS["smollm2-135m"], attn_implementation="sdpa",
                                             bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id))
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
    else:
        model, tokenizer = load_model(name)
    return model.to(device=device, dtype=dtype).eval(), tokenizer


def peak_gib(device: str) -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else float("nan")


def start_measuring(device: str) -> None:
    """Wait for queued GPU work and reset the peak-memory counter, so what follows is measured alone."""
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def learner_step(model, batch: dict[str, torch.Tensor], slices: list[slice], share: bool, device: str) -> float:
    """Seconds of one optimizer-free learner step: clipped loss on the sampler's old log-probs, backward."""
    start_measuring(device)
    start = time.perf_counter()
    model.zero_grad(set_to_none=True)
    tokens = batch[GENERATED_MASK].sum()
    for piece in slices:
        part = {k: v[piece] for k, v in batch.items()}
        logprobs = sequence_logprobs(model, part, share_prefixes=share)[LOGPROBS]
        loss, _ = clipped_policy_loss(logprobs, part[SAMPLING_LOGPROBS], part[ADVANTAGES][:, None],
                                      part[GENERATED_MASK])
        (loss * part[GENERATED_MASK].sum() / tokens).backward()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def run(args: argparse.Namespace) -> str:
    dtype = getattr(torch, args.dtype)
    model, tokenizer = build_policy(args.model, dtype, args.device)
    env = gym.make("SynthHop-v0", split="train", data_dir=str(world_data_dir(WORLD)))
    generator = HFStepGenerator(model, tokenizer, SamplingSettings(max_step_tokens=args.max_step_tokens))
    rollout = TreeRollout(env, generator, tokenizer, seed=args.seed)
    start_measuring(args.device)
    start = time.perf_counter()
    records = leaf_records(rollout.grow(list(range(args.prompts)), TreeShape(2, 2, 1)))
    if args.device == "cuda":
        torch.cuda.synchronize()
    rollout_s, rollout_peak = time.perf_counter() - start, peak_gib(args.device)
    counters = generator.counters.as_dict()
    arrays = pad_batch(records, prompt_advantages(records), tokenizer.pad_token_id)
    batch = {k: torch.as_tensor(v, device=args.device) for k, v in arrays.items()}
    with torch.no_grad():
        learner = sequence_logprobs(model, batch, share_prefixes=True)[LOGPROBS].float()
    mask = batch[GENERATED_MASK]
    gap = ((learner - batch[SAMPLING_LOGPROBS]).abs() * mask).sum() / mask.sum()
    mismatch = sampler_mismatch(learner, batch[SAMPLING_LOGPROBS], mask)
    per_row = [slice(s, s + args.micro_batch_size) for s in range(0, len(records), args.micro_batch_size)]
    grouped = prompt_group_chunks(np.asarray(arrays[PROMPT_INDEX]), args.micro_batch_size)
    plain_s = learner_step(model, batch, per_row, False, args.device)
    plain_peak = peak_gib(args.device)
    shared_s = learner_step(model, batch, grouped, True, args.device)
    shared_peak = peak_gib(args.device)
    rows = [("leaves / prompts", f"{len(records)} / {args.prompts}"),
            ("tokens generated", f"{counters['tokens_generated']:,}"),
            ("tokens prefilled", f"{counters['tokens_prefilled']:,}"),
            ("LLM calls (batched steps)", f"{counters['llm_calls']:,}"),
            ("tool calls", f"{rollout.counters.tool_calls:,}"),
            ("rollout seconds", f"{rollout_s:.1f}"),
            ("generation tokens/s", f"{counters['tokens_generated'] / rollout_s:,.0f}"),
            ("rollout peak GiB", f"{rollout_peak:.2f}"),
            ("sampler/learner mean abs log-prob gap", f"{gap.item():.4f}"),
            ("ratio mean / p99 / share outside [0.9, 1.1]",
             f"{mismatch.ratio_mean:.4f} / {mismatch.ratio_p99:.4f} / {mismatch.outside:.4f}"),
            ("learner step seconds, per row / shared prefixes", f"{plain_s:.2f} / {shared_s:.2f}"),
            ("learner step peak GiB, per row / shared prefixes", f"{plain_peak:.2f} / {shared_peak:.2f}")]
    return "\n".join(["| measure | value |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows)])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=SMOLLM2_RANDOM)
    add_accelerator_options(p)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--max-step-tokens", type=int, default=128)
    p.add_argument("--micro-batch-size", type=int, default=16, help="rows per micro-batch of the learner step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default=None, help="also write the table (markdown) to this file")
    return resolve_dtype(p.parse_args(argv))


def main(argv: list[str] | None = None) -> str:
    args = parse_args(argv)
    table = run(args)
    text = (f"`python benchmarks/bench_device.py --model {args.model} --device {args.device} --dtype {args.dtype} "
            f"--prompts {args.prompts} --max-step-tokens {args.max_step_tokens}` on {machine_description()}\n\n"
            + table + "\n")
    print(text)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as handle:
            handle.write(text)
    return text


if __name__ == "__main__":
    main()
