"""Generation benchmark: our step generator against plain ``model.generate``, and what prefix reuse saves.

    python benchmarks/bench_generation.py                  # smollm2-135m, HotpotQA dev question 0
    python benchmarks/bench_generation.py --model tiny-random --max-step-tokens 32   # a quick smoke run
    python benchmarks/bench_generation.py --generator hf vllm --questions 4 --json out.json   # HF against vLLM
    python benchmarks/bench_generation.py --generator hf vllm --model smollm2-135m-random --env SynthHop-v0 \
        --questions 32 --max-step-tokens 128 --warmup-rollouts 1       # on a GPU (device_check.sh vllm), bf16

Measures, on one HotpotQA question:
1. tokens/s of ``HFStepGenerator.generate_step`` against ``model.generate`` (same sampling, same stop strings)
   on the same batch: the first step of M = 6 copies of the prompt;
2. a (M, N, L) = (2, 2, 1) tree and a chain group of 6 grown to their leaves, with prefix reuse and with
   re-prefilling every step (``keep_cache=False``): tokens generated, tokens prefilled, LLM calls, seconds.
Results replace the ``generation`` section of docs/benchmarks.md.

With ``--generator hf vllm``: the HF backend against the vLLM one (the peer) in the same run, on the same prompts
and tree shapes (a (2, 2, 1) tree and a chain group of 6 per question, over ``--questions`` questions): tokens/s,
tokens prefilled (vLLM: prompt tokens its prefix cache did not serve), forward passes (engine steps) and seconds;
both warmed up on one chain first. ``--json PATH`` also writes the rows (backend, rollout, tokens_generated,
tokens_prefilled, forward_passes, seconds, tokens_per_s).
Results replace the ``generation-vllm`` section.

``--model``: ``run.py --model`` names, or ``SHAPE-random`` (bench_device.py's: ``smollm2-135m-random``, an
architecture with random weights and SmolLM2's tokenizer); ``--device`` and ``--dtype`` (default: cuda and bf16 when
a GPU is visible, else the CPU and float32). ``--env SynthHop-v0`` takes bench_device.py's generated world instead of
HotpotQA's data (needs no data directory). ``--warmup-rollouts N``: N untimed rollouts of each shape per backend
before the timed ones (CUDA graphs captured, pools grown), beside the one-chain warm-up.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import gymnasium as gym
import torch

import envs  # noqa: F401  (registers the env ids)
from algos.rollout import TreeRollout, TreeShape
from benchmarks.report import add_accelerator_options, machine_description, replace_section, resolve_dtype
from policies.generation import (
    STOP_STRINGS,
    Branch,
    SamplingSettings,
    StepGenerator,
    default_max_step_tokens,
    prompt_ids,
)
from policies.hf_generation import HFStepGenerator
from policies.vllm_generation import vllm_installed

ENVS = ("HotpotQA-v0", "SynthHop-v0")


def make_env(name: str = "HotpotQA-v0") -> gym.Env:
    """HotpotQA's dev split, or SynthHop-v0 on bench_device.py's world (generated here once, no data needed)."""
    if name == "SynthHop-v0":
        from benchmarks.bench_device import WORLD
        from envs.synthetic import world_data_dir

        return gym.make(name, split="train", data_dir=str(world_data_dir(WORLD)))
    return gym.make(name, split="dev")


def time_generate_step(model, tokenizer, batch: list[tuple[int, ...]], settings: SamplingSettings,
                       seed: int) -> tuple[int, int, float]:
    """(tokens sampled, forward passes, seconds): every row runs until the longest one finishes."""
    generator = HFStepGenerator(model, tokenizer, settings, keep_cache=False)
    start = time.perf_counter()
    outputs = generator.generate_step([Branch(ids) for ids in batch], seed=seed)
    elapsed = time.perf_counter() - start
    return sum(len(o.token_ids) for o in outputs), max(len(o.token_ids) for o in outputs), elapsed


def time_hf_generate(model, tokenizer, batch: list[tuple[int, ...]], settings: SamplingSettings,
                     seed: int) -> tuple[int, int, float]:
    torch.manual_seed(seed)
    ids = torch.tensor(batch)  # copies of one prompt: no padding needed
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True,
                             temperature=settings.temperature, top_p=settings.top_p, top_k=0,
                             max_new_tokens=settings.max_step_tokens, stop_strings=list(STOP_STRINGS),
                             tokenizer=tokenizer, pad_token_id=tokenizer.pad_token_id)
    elapsed = time.perf_counter() - start
    new = out[:, ids.shape[1]:]
    # tokens of each row up to and including its first end-of-turn/pad token (generate pads finished rows)
    ends = [(row == tokenizer.pad_token_id).nonzero() for row in new]
    tokens = sum(int(e[0]) + 1 if len(e) else new.shape[1] for e in ends)
    return tokens, new.shape[1], elapsed


def grow_once(model, tokenizer, question: int, shape: TreeShape, settings: SamplingSettings, seed: int,
              keep_cache: bool, env: str = "HotpotQA-v0") -> dict:
    return grow_with(HFStepGenerator(model, tokenizer, settings, keep_cache=keep_cache), tokenizer, [question],
                     shape, seed, env)


def grow_with(generator: StepGenerator, tokenizer, questions: list[int], shape: TreeShape, seed: int,
              env_name: str = "HotpotQA-v0") -> dict:
    """Trees of ``shape`` for ``questions`` grown with ``generator``: its counters, tool calls, leaves, seconds."""
    env = make_env(env_name)
    rollout = TreeRollout(env, generator, tokenizer, seed=seed)
    start = time.perf_counter()
    trees = rollout.grow(questions, shape)
    elapsed = time.perf_counter() - start
    leaves = sum(len(t.leaves()) for t in trees)
    return {**generator.counters.as_dict(), "tool_calls": rollout.counters.tool_calls, "leaves": leaves,
            "seconds": elapsed}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m",
                        help="a run.py --model name, or SHAPE-random (bench_device.py's: smollm2-135m-random)")
    add_accelerator_options(parser)
    parser.add_argument("--env", choices=ENVS, default="HotpotQA-v0",
                        help="HotpotQA's dev questions, or SynthHop-v0 on bench_device.py's generated world")
    parser.add_argument("--question", type=int, default=0, help="the first question's index")
    parser.add_argument("--max-step-tokens", type=int, default=default_max_step_tokens(),
                        help="token cap of one agent step (default: the project's, %(default)s on this machine)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--generator", choices=["hf", "vllm"], nargs="+", default=["hf"],
                        help="hf vllm: the two backends side by side on whole rollouts (needs vLLM)")
    parser.add_argument("--json", help="with --generator hf vllm: also write the rows as a JSON list to this path")
    parser.add_argument("--questions", type=int, default=8, help="with --generator vllm: questions per rollout")
    parser.add_argument("--warmup-rollouts", type=int, default=0,
                        help="with --generator hf vllm: untimed rollouts of each shape per backend before the timed "
                             "ones (beside the one-chain warm-up)")
    parser.add_argument("--output", default="docs/benchmarks.md")
    args = resolve_dtype(parser.parse_args(argv))
    if "vllm" in args.generator and not vllm_installed():
        parser.error("--generator hf vllm: vLLM is not installed (GPU: pip install -e .[vllm]; CPU: make test-vllm)")
    if args.questions < 1:
        parser.error(f"--questions must be >= 1, got {args.questions}")
    if args.warmup_rollouts < 0:
        parser.error(f"--warmup-rollouts must be >= 0, got {args.warmup_rollouts}")
    return args


def vllm_against_hf(model, tokenizer, args: argparse.Namespace, settings: SamplingSettings) -> str:
    """The ``generation-vllm`` section: both backends grow the same shapes on the same questions."""
    from policies.vllm_generation import VLLMEngine, VLLMStepGenerator

    questions = list(range(args.question, args.question + args.questions))
    shapes = {"tree (2,2,1)": TreeShape(2, 2, 1), "chain G=6": TreeShape(6, 0, 0)}
    rows = {}

    def measure(name: str, make) -> None:
        grow_with(make(), tokenizer, questions[:1], TreeShape(1, 0, 0), args.seed, args.env)  # warm-up
        for _ in range(args.warmup_rollouts):
            for shape in shapes.values():
                grow_with(make(), tokenizer, questions, shape, args.seed, args.env)
        for shape_name, shape in shapes.items():
            rows[name, shape_name] = grow_with(make(), tokenizer, questions, shape, args.seed, args.env)
            print(name, shape_name, rows[name, shape_name], flush=True)

    # HF first: the in-process vLLM engine pins this process's CPU threads when it starts
    measure("HF", lambda: HFStepGenerator(model, tokenizer, settings))
    engine = VLLMEngine(model, tokenizer, settings)
    measure("vLLM", lambda: VLLMStepGenerator(engine, tokenizer, model, settings))
    engine.close()
    lines = [
        f"Command: `python benchmarks/bench_generation.py --generator hf vllm --model {args.model} --question "
        f"{args.question} --questions {args.questions} --max-step-tokens {args.max_step_tokens} --seed "
        f"{args.seed}{command_options(args)}`  ",
        f"Machine: {machine_description()}; {next(model.parameters()).dtype}",
        "",
        f"Whole rollouts of {args.questions} {question_kind(args.env)} (T=1, top-p 0.95), each backend warmed up on "
        f"one chain first{warmup_words(args.warmup_rollouts)}. Prefilled: tokens computed without a cache (HF: not "
        "covered by a node's KV cache; vLLM: not served by its prefix cache, which works in whole blocks).",
        "",
        "| rollout | backend | leaves | tokens generated | tokens prefilled | LLM calls | forward passes "
        "| tokens per pass | seconds | tokens/s | HF tokens/s vs vLLM's |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    records = []
    for (name, shape_name), r in rows.items():
        speed = r["tokens_generated"] / r["seconds"]
        peer = rows["vLLM", shape_name]
        ratio = (speed / (peer["tokens_generated"] / peer["seconds"])) if name != "vLLM" else 1.0
        lines.append(f"| {shape_name} | {name} | {r['leaves']} | {r['tokens_generated']} | {r['tokens_prefilled']} "
                     f"| {r['llm_calls']} | {r['forward_passes']} | {r['tokens_generated'] / r['forward_passes']:.1f} "
                     f"| {r['seconds']:.1f} | {speed:.1f} | {ratio:.2f}x |")
        records.append({"backend": "vllm" if name == "vLLM" else "hf", "rollout": shape_name.split()[0],
                        "tokens_generated": r["tokens_generated"], "tokens_prefilled": r["tokens_prefilled"],
                        "forward_passes": r["forward_passes"], "seconds": r["seconds"], "tokens_per_s": speed})
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=1) + "\n")
    return "\n".join(lines)


def command_options(args: argparse.Namespace) -> str:
    """The options away from their CPU defaults, as the section's command line names them."""
    options = ""
    if args.device != "cpu" or args.dtype != "float32":
        options += f" --device {args.device} --dtype {args.dtype}"
    if args.env != "HotpotQA-v0":
        options += f" --env {args.env}"
    if args.warmup_rollouts:
        options += f" --warmup-rollouts {args.warmup_rollouts}"
    return options


def question_kind(env: str) -> str:
    return "HotpotQA dev questions" if env == "HotpotQA-v0" else f"{env} questions (bench_device.py's world)"


def warmup_words(rollouts: int) -> str:
    return f" and on {rollouts} untimed rollout{'s' if rollouts > 1 else ''} of each shape" if rollouts else ""


def main(argv: list[str] | None = None) -> None:
    from benchmarks.bench_device import build_policy

    args = parse_args(argv)

    torch.manual_seed(args.seed)
    model, tokenizer = build_policy(args.model, getattr(torch, args.dtype), args.device)
    settings = SamplingSettings(max_step_tokens=args.max_step_tokens)
    env = make_env(args.env)
    if "vllm" in args.generator:
        section = vllm_against_hf(model, tokenizer, args, settings)
        print(section)
        replace_section(args.output, "generation-vllm", "Generation: HF against vLLM (issues 16, 24)", section)
        return
    prompt, _ = env.reset(options={"index": args.question})
    batch = [prompt_ids(tokenizer, prompt)] * 6

    ours_tokens, ours_passes, ours_s = time_generate_step(model, tokenizer, batch, settings, args.seed)
    hf_tokens, hf_passes, hf_s = time_hf_generate(model, tokenizer, batch, settings, args.seed)
    runs = {
        (name, reuse): grow_once(model, tokenizer, args.question, shape, settings, args.seed, reuse, args.env)
        for name, shape in (("tree (2,2,1)", TreeShape(2, 2, 1)), ("chain G=6", TreeShape(6, 0, 0)))
        for reuse in (True, False)
    }

    lines = [
        f"Command: `python benchmarks/bench_generation.py --model {args.model} --question {args.question} "
        f"--max-step-tokens {args.max_step_tokens} --seed {args.seed}{command_options(args)}`  ",
        f"Machine: {machine_description()}",
        "",
        "First step of 6 copies of the prompt, same sampling (T=1, top-p 0.95) and stop strings. Both run every "
        "row until the longest finishes, and their random streams differ, so the rows stop at different points: "
        "compare the time per forward pass as well as tokens/s.",
        "",
        "| generator | tokens | forward passes | seconds | tokens/s | ms per pass | speed ratio (tokens/s; per pass) |",
        "|---|---|---|---|---|---|---|",
        f"| `model.generate` (baseline) | {hf_tokens} | {hf_passes} | {hf_s:.2f} | {hf_tokens / hf_s:.1f} | "
        f"{1000 * hf_s / hf_passes:.0f} | 1.00; 1.00 |",
        f"| `HFStepGenerator.generate_step` | {ours_tokens} | {ours_passes} | {ours_s:.2f} | "
        f"{ours_tokens / ours_s:.1f} | {1000 * ours_s / ours_passes:.0f} | "
        f"{(ours_tokens / ours_s) / (hf_tokens / hf_s):.2f}; {(hf_s / hf_passes) / (ours_s / ours_passes):.2f} |",
        "",
        "Whole rollouts to the leaves (prefix reuse = KV caches of the nodes; without = re-prefill every step):",
        "",
        "| rollout | prefix reuse | leaves | tokens generated | tokens prefilled | prefilled / without reuse "
        "| LLM calls | tool calls | seconds |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for (name, reuse), r in runs.items():
        ratio = r["tokens_prefilled"] / runs[name, False]["tokens_prefilled"]
        lines.append(f"| {name} | {'yes' if reuse else 'no'} | {r['leaves']} | {r['tokens_generated']} | "
                     f"{r['tokens_prefilled']} | {ratio:.2f} | {r['llm_calls']} | {r['tool_calls']} | "
                     f"{r['seconds']:.1f} |")
    section = "\n".join(lines)
    print(section)
    replace_section(args.output, "generation", "Generation (issue 3)", section)


if __name__ == "__main__":
    main()
