"""Generation benchmark: our step generator against plain ``model.generate``, and what prefix reuse saves.

    python benchmarks/bench_generation.py                  # smollm2-135m, HotpotQA dev question 0
    python benchmarks/bench_generation.py --model tiny-random --max-step-tokens 32   # a quick smoke run
    python benchmarks/bench_generation.py --generator hf vllm --questions 4 --json out.json   # HF against vLLM

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
from benchmarks.report import machine_description, replace_section
from policies.generation import (
    STOP_STRINGS,
    Branch,
    SamplingSettings,
    StepGenerator,
    default_max_step_tokens,
    prompt_ids,
)
from policies.hf_generation import HFStepGenerator
from policies.models import load_model
from policies.vllm_generation import vllm_installed


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
              keep_cache: bool) -> dict:
    return grow_with(HFStepGenerator(model, tokenizer, settings, keep_cache=keep_cache), tokenizer, [question],
                     shape, seed)


def grow_with(generator: StepGenerator, tokenizer, questions: list[int], shape: TreeShape, seed: int) -> dict:
    """Trees of ``shape`` for ``questions`` grown with ``generator``: its counters, tool calls, leaves, seconds."""
    env = gym.make("HotpotQA-v0", split="dev")
    rollout = TreeRollout(env, generator, tokenizer, seed=seed)
    start = time.perf_counter()
    trees = rollout.grow(questions, shape)
    elapsed = time.perf_counter() - start
    leaves = sum(len(t.leaves()) for t in trees)
    return {**generator.counters.as_dict(), "tool_calls": rollout.counters.tool_calls, "leaves": leaves,
            "seconds": elapsed}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--question", type=int, default=0, help="HotpotQA dev question index")
    parser.add_argument("--max-step-tokens", type=int, default=default_max_step_tokens(),
                        help="token cap of one agent step (default: the project's, %(default)s on this machine)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--generator", choices=["hf", "vllm"], nargs="+", default=["hf"],
                        help="hf vllm: the two backends side by side on whole rollouts (needs vLLM)")
    parser.add_argument("--json", help="with --generator hf vllm: also write the rows as a JSON list to this path")
    parser.add_argument("--questions", type=int, default=8, help="with --generator vllm: questions per rollout")
    parser.add_argument("--output", default="docs/benchmarks.md")
    args = parser.parse_args(argv)
    if "vllm" in args.generator and not vllm_installed():
        parser.error("--generator hf vllm: vLLM is not installed (GPU: pip install -e .[vllm]; CPU: make test-vllm)")
    if args.questions < 1:
        parser.error(f"--questions must be >= 1, got {args.questions}")
    return args


def vllm_against_hf(model, tokenizer, args: argparse.Namespace, settings: SamplingSettings) -> str:
    """The ``generation-vllm`` section: both backends grow the same shapes on the same questions."""
    from policies.vllm_generation import VLLMEngine, VLLMStepGenerator

    questions = list(range(args.question, args.question + args.questions))
    shapes = {"tree (2,2,1)": TreeShape(2, 2, 1), "chain G=6": TreeShape(6, 0, 0)}
    rows = {}

    def measure(name: str, make) -> None:
        grow_with(make(), tokenizer, questions[:1], TreeShape(1, 0, 0), args.seed)  # warm-up
        for shape_name, shape in shapes.items():
            rows[name, shape_name] = grow_with(make(), tokenizer, questions, shape, args.seed)
            print(name, shape_name, rows[name, shape_name], flush=True)

    # HF first: the in-process vLLM engine pins this process's CPU threads when it starts
    measure("HF", lambda: HFStepGenerator(model, tokenizer, settings))
    engine = VLLMEngine(model, tokenizer, settings)
    measure("vLLM", lambda: VLLMStepGenerator(engine, tokenizer, model, settings))
    engine.close()
    lines = [
        f"Command: `python benchmarks/bench_generation.py --generator hf vllm --model {args.model} --question "
        f"{args.question} --questions {args.questions} --max-step-tokens {args.max_step_tokens} --seed "
        f"{args.seed}`  ",
        f"Machine: {machine_description()}; {next(model.parameters()).dtype}",
        "",
        f"Whole rollouts of {args.questions} HotpotQA dev questions (T=1, top-p 0.95), each backend warmed up on "
        "one chain first. Prefilled: tokens computed without a cache (HF: not covered by a node's KV cache; vLLM: "
        "not served by its prefix cache, which works in whole blocks).",
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


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)

    torch.manual_seed(args.seed)
    model, tokenizer = load_model(args.model)
    model.eval()
    settings = SamplingSettings(max_step_tokens=args.max_step_tokens)
    env = gym.make("HotpotQA-v0", split="dev")
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
        (name, reuse): grow_once(model, tokenizer, args.question, shape, settings, args.seed, reuse)
        for name, shape in (("tree (2,2,1)", TreeShape(2, 2, 1)), ("chain G=6", TreeShape(6, 0, 0)))
        for reuse in (True, False)
    }

    lines = [
        f"Command: `python benchmarks/bench_generation.py --model {args.model} --question {args.question} "
        f"--max-step-tokens {args.max_step_tokens} --seed {args.seed}`  ",
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
