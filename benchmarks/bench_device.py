"""One Tree-GRPO rollout and the learner's passes on an accelerator, without Ray: the GPU check of the rollout
(HFStepGenerator in TreeRollout) and of the learner (log-probs, clipped loss and backward), per row and with
shared prefixes under each attention kernel.

    python benchmarks/bench_device.py                     # on a GPU: SmolLM2-135M's and Llama-3.2-1B's shapes, bf16
    python benchmarks/bench_device.py --quick             # CPU smoke run in seconds (tiny-random, 1 prompt)
    python benchmarks/bench_device.py --model tiny-random --prompts 4 --attention sdpa flex_attention  # CPU

SynthHop-v0 questions (a small world generated in-process), trees (2,2,1), 32 prompts, 128-token steps by default.
Per model (one column each) it reports:
- the rollout, timed after ``--warmup-rollouts`` untimed ones: tokens generated and prefilled, LLM calls, seconds,
  generation tokens/s, the decode passes run in static shapes (``--static-decode``: replayed as CUDA graphs on a
  GPU, ``policies.static_decode``), the GPU's busy share (the union of its kernels' intervals over the wall time,
  from torch.profiler, on one more rollout: the profiler's tracing slows the host; not measured on the CPU), the
  peak memory, and the mean surprisal of the sampled tokens (a random model at ``--temperature`` 1 samples from
  nearly flat distributions, the sampler's worst case: about 10 nats over 49k tokens);
- the sampler/learner log-prob gap (the learner's recomputed log-probs of the sampled tokens against the
  sampler's: mean |gap|, the ratio's mean, p99 and share outside [0.9, 1.1]);
- the learner, per row (sdpa) and with shared prefixes under each ``--attention`` kernel: the packing's seconds
  (trie, segments, flex_attention's block mask; once per batch, as the learner does), one log-prob pass without
  gradients (the old or reference log-probs), one step (clipped loss, backward) and its peak memory. Each is
  timed after one untimed warm-up pass (flex_attention compiles per shape). torch's flex_attention has no CPU
  backward: on the CPU its step is not measured.
Peak memory: CUDA, ``max_memory_allocated`` (tensors); CPU, the process's peak resident set (``policies.memory``).

``--model``: ``run.py --model`` names or directories, or ``SHAPE-random`` for a shape of
``benchmarks.bench_prefix_sharing.MODELS`` (``smollm2-135m-random``, ``llama-3.2-1b-random``): that architecture
with random weights and SmolLM2's tokenizer and vocabulary (the bench decodes what it samples; a bare GPU machine
cannot download the real tokenizers). Random weights never close a tag, so every step runs to
``--max-step-tokens``.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterable
from dataclasses import dataclass

import gymnasium as gym
import numpy as np
import torch

import envs  # noqa: F401  (registers the env ids)
from algos.batch import (
    ADVANTAGES,
    SAMPLING_LOGPROBS,
    leaf_records,
    micro_batch_slices,
    pad_batch,
    prompt_advantages,
)
from algos.losses import clipped_policy_loss, sampler_mismatch
from algos.rollout import TreeRollout, TreeShape
from benchmarks.report import add_accelerator_options, machine_description, resolve_dtype
from envs.synthetic import WorldSpec, world_data_dir
from policies.generation import GenerationCounters, SamplingSettings
from policies.hf_generation import HFStepGenerator
from policies.logprobs import FLEX_ATTENTION, GENERATED_MASK, LOGPROBS, PACKING, pack_rows, sequence_logprobs
from policies.memory import peak_memory_gib, reset_peak_memory

RANDOM_SUFFIX = "-random"
DEFAULT_MODELS = ("smollm2-135m-random", "llama-3.2-1b-random")
QUICK = {"model": ["tiny-random"], "prompts": 1, "max_step_tokens": 4, "device": "cpu", "warmup_rollouts": 0}
# the CPU demo's earlier world (its figures in docs/benchmarks.md were measured on it; experiments.demo is not
# imported: that module needs Ray, which the GPU machine lacks)
WORLD = WorldSpec(seed=0, people=60, companies=30, cities=12, countries=5, train_questions=240, dev_questions=60)


def build_policy(name: str, dtype: torch.dtype, device: str):
    from benchmarks.bench_prefix_sharing import MODELS
    from policies.models import load_model, model_cache_dir, smollm2_tokenizer

    shape = name.removesuffix(RANDOM_SUFFIX)
    if name.endswith(RANDOM_SUFFIX) and shape in MODELS:
        from transformers import LlamaConfig, LlamaForCausalLM

        tokenizer = smollm2_tokenizer(model_cache_dir())
        torch.manual_seed(0)
        config = LlamaConfig(**{**MODELS[shape], "vocab_size": len(tokenizer)}, attn_implementation="sdpa",
                             bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
        model = LlamaForCausalLM(config)
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
    else:
        model, tokenizer = load_model(name)
    return model.to(device=device, dtype=dtype).eval(), tokenizer


def covered_seconds(intervals: Iterable[tuple[float, float]]) -> float:
    """Length of the union of (start, end) intervals: the time at least one kernel ran."""
    covered, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            covered += end - max(start, reach)
            reach = end
    return covered


def profiled(device: str):
    """torch.profiler over the GPU's kernels (None on the CPU: nothing to measure)."""
    if device != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    return profile(activities=[ProfilerActivity.CUDA])


def busy_share_of_rollout(rollout: TreeRollout, prompts: list[int], shape: TreeShape, device: str) -> str:
    """The GPU's busy share of one more rollout under torch.profiler (its tracing slows the host, so the timed
    rollout runs without it)."""
    profiler = profiled(device)
    if profiler is None:
        return "not measured (no GPU)"
    from torch.autograd import DeviceType

    start = time.perf_counter()
    with profiler:
        rollout.grow(prompts, shape)
        torch.cuda.synchronize()
    wall_s = time.perf_counter() - start
    kernels = [(e.time_range.start, e.time_range.end) for e in profiler.events() if e.device_type == DeviceType.CUDA]
    return f"{covered_seconds(kernels) / 1e6 / wall_s:.2f}"


def host_profile_of_rollout(rollout: TreeRollout, prompts: list[int], shape: TreeShape, device: str,
                            path: str, lines: int = 45) -> None:
    """cProfile of one more rollout, its functions by own time and by cumulative time, written to ``path``: where
    the host spends a rollout whose GPU waits on it (the profiler's own cost inflates small Python calls)."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    rollout.grow(prompts, shape)
    if device == "cuda":
        torch.cuda.synchronize()
    profiler.disable()
    text = io.StringIO()
    for key in ("tottime", "cumulative"):
        pstats.Stats(profiler, stream=text).sort_stats(key).print_stats(lines)
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(text.getvalue())


@dataclass(frozen=True)
class LearnerRun:
    """The learner's passes over one batch: per row, or with shared prefixes under an attention kernel."""

    share: bool
    attention: str

    @property
    def label(self) -> str:
        return f"shared {self.attention}" if self.share else "per row"


@dataclass
class LearnerTimes:
    packing_s: float = float("nan")
    logprob_s: float = float("nan")
    step_s: float = float("nan")
    step_peak_gib: float = float("nan")


def timed(device: str, work) -> float:
    """Seconds of ``work()``, GPU work included."""
    start = time.perf_counter()
    work()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def learner_passes(model, batch: dict[str, torch.Tensor], pieces: list[slice], run: LearnerRun,
                   device: str) -> LearnerTimes:
    """Times of the packing, one log-prob pass without gradients and one step (clipped loss on the sampler's old
    log-probs, backward), each after an untimed warm-up."""
    model.set_attn_implementation(run.attention)
    parts = [{k: v[piece] for k, v in batch.items()} for piece in pieces]
    times = LearnerTimes()

    def pack() -> None:
        for part in parts:
            part[PACKING] = pack_rows(model, part)

    if run.share:
        times.packing_s = timed(device, pack)
    tokens = batch[GENERATED_MASK].sum()

    def logprob_pass() -> None:
        with torch.no_grad():
            for part in parts:
                sequence_logprobs(model, part, share_prefixes=run.share)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        for part in parts:
            logprobs = sequence_logprobs(model, part, share_prefixes=run.share)[LOGPROBS]
            loss, _ = clipped_policy_loss(logprobs, part[SAMPLING_LOGPROBS], part[ADVANTAGES][:, None],
                                          part[GENERATED_MASK])
            (loss * part[GENERATED_MASK].sum() / tokens).backward()

    can_backward = not (run.attention == FLEX_ATTENTION and device == "cpu")  # torch: no CPU flex backward
    (step if can_backward else logprob_pass)()  # warm-up (compilation, allocator)
    times.logprob_s = timed(device, logprob_pass)
    if can_backward:
        reset_peak_memory(device)
        times.step_s = timed(device, step)
        times.step_peak_gib = peak_memory_gib(device)
    model.zero_grad(set_to_none=True)
    return times


def measure(name: str, args: argparse.Namespace) -> dict[str, str]:
    """The rows of one model's column."""
    dtype = getattr(torch, args.dtype)
    model, tokenizer = build_policy(name, dtype, args.device)
    env = gym.make("SynthHop-v0", split="train", data_dir=str(world_data_dir(WORLD)))
    static = {"auto": None, "on": True, "off": False}[args.static_decode]
    sampling = SamplingSettings(max_step_tokens=args.max_step_tokens, temperature=args.temperature)
    generator = HFStepGenerator(model, tokenizer, sampling, static_decode=static)
    rollout = TreeRollout(env, generator, tokenizer, seed=args.seed)
    prompts, shape = list(range(args.prompts)), TreeShape(2, 2, 1)
    for _ in range(args.warmup_rollouts):  # graphs captured, the KV pool at its size, kernels chosen
        rollout.grow(prompts, shape)
    generator.counters = GenerationCounters()  # the timed rollout's own
    passes_before = (generator.static_decode.passes, generator.static_decode.captures) if generator.static_decode \
        else (0, 0)
    reset_peak_memory(args.device)
    start = time.perf_counter()
    records = leaf_records(rollout.grow(prompts, shape))
    if args.device == "cuda":
        torch.cuda.synchronize()
    rollout_s, rollout_peak = time.perf_counter() - start, peak_memory_gib(args.device)
    counters = generator.counters.as_dict()
    static_passes, captures = ((generator.static_decode.passes - passes_before[0],
                                generator.static_decode.captures - passes_before[1])
                               if generator.static_decode is not None else (0, 0))
    busy = busy_share_of_rollout(rollout, prompts, shape, args.device) if args.busy_share else "not measured"
    if args.host_profile:
        host_profile_of_rollout(rollout, prompts, shape, args.device, args.host_profile)
    arrays = pad_batch(records, prompt_advantages(records), tokenizer.pad_token_id)
    batch = {k: torch.as_tensor(v, device=args.device) for k, v in arrays.items()}
    with torch.no_grad():
        learner = sequence_logprobs(model, batch, share_prefixes=True, temperature=args.temperature)[LOGPROBS]
        learner = learner.float()
    mask = batch[GENERATED_MASK]
    gap = ((learner - batch[SAMPLING_LOGPROBS]).abs() * mask).sum() / mask.sum()
    mismatch = sampler_mismatch(learner, batch[SAMPLING_LOGPROBS], mask)
    surprisal = -(batch[SAMPLING_LOGPROBS] * mask).sum() / mask.sum()
    rows = {
        "leaves / prompts": f"{len(records)} / {args.prompts}",
        "tokens generated": f"{counters['tokens_generated']:,}",
        "tokens prefilled": f"{counters['tokens_prefilled']:,}",
        "LLM calls (batched steps)": f"{counters['llm_calls']:,}",
        "tool calls": f"{rollout.counters.tool_calls:,}",
        "rollout seconds": f"{rollout_s:.1f}",
        "generation tokens/s": f"{counters['tokens_generated'] / rollout_s:,.0f}",
        "decode passes in static shapes / CUDA graphs captured / all passes":
            f"{static_passes:,} / {captures} / {counters['forward_passes']:,}",
        "GPU busy share of the rollout (profiler, another rollout)": busy,
        "mean -log p of the sampled tokens (nats; about the entropy)": f"{surprisal.item():.2f}",
        "rollout peak GiB": f"{rollout_peak:.2f}",
        "sampler/learner mean abs log-prob gap": f"{gap.item():.4f}",
        "ratio mean / p99 / share outside [0.9, 1.1]":
            f"{mismatch.ratio_mean:.4f} / {mismatch.ratio_p99:.4f} / {mismatch.outside:.4f}",
    }
    if not args.rollout_only:
        rows.update(learner_rows(model, arrays, batch, args))
    return rows


def learner_rows(model, arrays: dict, batch: dict[str, torch.Tensor], args: argparse.Namespace) -> dict[str, str]:
    """The learner's passes over the rollout's batch: per row and with shared prefixes under each kernel."""
    runs = [LearnerRun(share=False, attention="sdpa")] + [LearnerRun(True, kernel) for kernel in args.attention]
    times = {}
    for run in runs:
        pieces = micro_batch_slices(arrays, share_prefixes=run.share, max_rows=args.micro_batch_size,
                                    max_tokens=args.micro_batch_tokens)
        times[run] = learner_passes(model, batch, pieces, run, args.device)

    def per_run(field: str, digits: int, runs=runs) -> str:
        values = [getattr(times[run], field) for run in runs]
        return " / ".join("n/a" if np.isnan(v) else f"{v:.{digits}f}" for v in values)

    labels = " / ".join(run.label for run in runs)
    shared_labels = " / ".join(run.label for run in runs if run.share)
    return {
        f"learner packing seconds, once per batch ({shared_labels})": per_run("packing_s", 3, [r for r in runs
                                                                                              if r.share]),
        f"learner log-prob pass seconds, no gradients ({labels})": per_run("logprob_s", 2),
        f"learner step seconds ({labels})": per_run("step_s", 2),
        f"learner step peak GiB ({labels})": per_run("step_peak_gib", 2),
    }


def run(args: argparse.Namespace) -> str:
    columns = {name: measure(name, args) for name in args.model}
    keys = list(next(iter(columns.values())))
    header = "| measure | " + " | ".join(f"{name}, {args.dtype}" for name in columns) + " |"
    lines = [header, "|---" * (len(columns) + 1) + "|"]
    lines += [f"| {key} | " + " | ".join(column[key] for column in columns.values()) + " |" for key in keys]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", nargs="+", default=list(DEFAULT_MODELS), help="one column per model")
    add_accelerator_options(p)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--max-step-tokens", type=int, default=128)
    p.add_argument("--micro-batch-size", type=int, default=16, help="rows per micro-batch of the learner")
    p.add_argument("--micro-batch-tokens", type=int, default=None,
                   help="decoder tokens per micro-batch instead (the learner's micro_batch_tokens)")
    p.add_argument("--attention", nargs="+", choices=("sdpa", "eager", FLEX_ATTENTION), default=None,
                   help="kernels of the shared-prefix learner passes (default: sdpa and flex_attention on cuda, "
                        "sdpa on the CPU, where flex_attention compiles per shape and has no backward)")
    p.add_argument("--static-decode", choices=("auto", "on", "off"), default="auto",
                   help="decode-only passes in static shapes, replayed as CUDA graphs on a GPU "
                        "(HFStepGenerator static_decode; auto: on a GPU only)")
    p.add_argument("--quick", action="store_true",
                   help="a smoke run in seconds on the CPU: " + ", ".join(f"--{k.replace('_', '-')} {v}"
                                                                           for k, v in QUICK.items()))
    p.add_argument("--temperature", type=float, default=1.0,
                   help="sampling temperature: a random model's logits are nearly flat at 1.0 (the sampler's worst "
                        "case); a low one gives the peaked distributions of a trained model")
    p.add_argument("--rollout-only", action="store_true", help="skip the learner's passes")
    p.add_argument("--busy-share", action=argparse.BooleanOptionalAction, default=True,
                   help="profile one more rollout for the GPU's busy share")
    p.add_argument("--host-profile", default=None, metavar="PATH",
                   help="cProfile one more rollout (after the timed one) and write its top functions here")
    p.add_argument("--warmup-rollouts", type=int, default=1,
                   help="untimed rollouts first (CUDA graphs captured, the KV pool grown, kernels chosen)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default=None, help="also write the table (markdown) to this file")
    args = p.parse_args(argv)
    if args.quick:
        vars(args).update(QUICK)
    args = resolve_dtype(args)
    args.attention = args.attention or (["sdpa", FLEX_ATTENTION] if args.device == "cuda" else ["sdpa"])
    return args


def main(argv: list[str] | None = None) -> str:
    args = parse_args(argv)
    table = run(args)
    text = (f"`python benchmarks/bench_device.py --model {' '.join(args.model)} --device {args.device} "
            f"--dtype {args.dtype} --prompts {args.prompts} --max-step-tokens {args.max_step_tokens} "
            f"--attention {' '.join(args.attention)} --static-decode {args.static_decode} "
            f"--temperature {args.temperature} --warmup-rollouts {args.warmup_rollouts}"
            f"{' --rollout-only' if args.rollout_only else ''}` on "
            f"{machine_description()}\n\n" + table + "\n")
    print(text)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as handle:
            handle.write(text)
    return text


if __name__ == "__main__":
    main()
