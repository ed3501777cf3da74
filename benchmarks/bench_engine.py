"""The rollout engine against another checkout of the code (an older commit in a git worktree), side by side.

    git worktree add --detach ../old a86a703
    python benchmarks/bench_engine.py --baseline ../old --model ~/.cache/tree-grpo/warm_starts/KEY/model \\
        --data-dir ~/.cache/tree-grpo/synthhop/WORLD --topk 1 --max-step-tokens 48 --questions 8

Each checkout grows the same rollouts, tree (2,2,1) and chains G=4, of the same questions with the same model in a
process of its own (``PYTHONPATH`` = that checkout, so its own ``policies`` and ``algos`` run), and the rounds
alternate between the two checkouts, so a machine's drift hits both. Per rollout: tokens generated, wall seconds,
tokens/s and forward passes of the model (counted by a forward hook on the model, the same for any engine: one call
of the model is one pass), and the ratio of this checkout's tokens/s and tokens per pass to the baseline's (the
median of the rounds' ratios). Sampling differs between engines (their random streams do), so compare rates, not
token totals. For this checkout's trees it also reports the most tokens per pass that any engine decoding one
token per row per pass could reach on them (``pass_bound``): the ceiling the batching alone can approach.
Results replace section ``engine`` of ``--output``.

The worker (``--worker``) uses only what both checkouts have: ``load_model``, ``HFStepGenerator``,
``SamplingSettings``, ``TreeRollout(...).grow`` and the env ids.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
SHAPES = {"tree (2,2,1)": (2, 2, 1), "chain G=4": (4, 0, 0)}


def pass_bound(trees: list) -> int:
    """The fewest forward passes in which an engine that decodes one token per row per pass can grow ``trees``.

    A step's tokens come one pass after another (its first with the prefill of what came before it), a branch's
    steps follow each other, and a tree's expansion round starts once its previous round has ended (its nodes are
    picked from the finished round); trees grow side by side. So: over trees, the most of the sum over rounds of the
    round's longest branch, in generated tokens (a branch is the steps of one lineage, ``Node.lineage``).
    """
    most = 0
    for tree in trees:
        branch_tokens: dict[tuple[int, int], int] = {}
        for node in tree.nodes():
            if node.parent is not None:
                step = node.trajectory.num_generated - node.parent.trajectory.num_generated
                branch_tokens[node.lineage] = branch_tokens.get(node.lineage, 0) + step
        longest_in_round: dict[int, int] = {}
        for (expansion_round, _), tokens in branch_tokens.items():
            longest_in_round[expansion_round] = max(longest_in_round.get(expansion_round, 0), tokens)
        most = max(most, sum(longest_in_round.values()))
    return most


def worker(args: argparse.Namespace) -> None:
    """Grow the rollouts with the checkout on ``sys.path`` and print one JSON line per rollout."""
    import gymnasium as gym
    import torch

    import envs
    from algos.rollout import TreeRollout, TreeShape
    from policies.generation import SamplingSettings
    from policies.hf_generation import HFStepGenerator
    from policies.models import load_model

    torch.manual_seed(args.seed)
    model, tokenizer = load_model(args.model)
    model.eval()
    passes = [0]
    model.register_forward_pre_hook(lambda *_: passes.__setitem__(0, passes[0] + 1))
    env_kwargs = {"data_dir": args.data_dir, "topk": args.topk} if args.data_dir else {}
    env = gym.make(args.env, split=envs.eval_split(args.env), **env_kwargs)
    settings = SamplingSettings(max_step_tokens=args.max_step_tokens)
    questions = list(range(args.questions))
    warm = HFStepGenerator(model, tokenizer, settings)
    TreeRollout(env, warm, tokenizer, seed=args.seed).grow(questions[:1], TreeShape(1, 0, 0))  # first-call costs
    for name, shape in SHAPES.items():
        generator = HFStepGenerator(model, tokenizer, settings)
        passes[0] = 0
        start = time.perf_counter()
        trees = TreeRollout(env, generator, tokenizer, seed=args.seed).grow(questions, TreeShape(*shape))
        seconds = time.perf_counter() - start
        tokens = generator.counters.tokens_generated
        row = {"rollout": name, "tokens_generated": tokens, "seconds": seconds, "forward_passes": passes[0],
               "tokens_per_s": tokens / seconds}
        if args.pass_bound:  # this checkout's trees only: older ones do not record a step's lineage
            row["pass_bound"] = pass_bound(trees)
        print(json.dumps(row), flush=True)


def run_checkout(checkout: Path, args: argparse.Namespace) -> dict[str, dict]:
    """One round of the worker in ``checkout``: its rows by rollout name."""
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", "--model", args.model, "--env", args.env,
               "--questions", str(args.questions), "--max-step-tokens", str(args.max_step_tokens),
               "--seed", str(args.seed), "--topk", str(args.topk)] + (["--pass-bound"] if checkout == HERE else [])
    if args.data_dir:
        command += ["--data-dir", args.data_dir]
    environment = {**os.environ, "PYTHONPATH": str(checkout)}
    done = subprocess.run(command, cwd=checkout, env=environment, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the worker failed in {checkout}:\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return {row["rollout"]: row for row in rows}


def commit_of(checkout: Path) -> str:
    return subprocess.run(["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip() or "?"


def tokens_per_pass(measured: dict) -> float:
    return measured["tokens_generated"] / measured["forward_passes"]


def median_row(rounds: list[dict], name: str) -> dict[str, float]:
    keys = ("tokens_generated", "seconds", "forward_passes", "tokens_per_s")
    row = {key: statistics.median(r[name][key] for r in rounds) for key in keys}
    row["tokens_per_pass"] = statistics.median(tokens_per_pass(r[name]) for r in rounds)
    return row


def paired_ratio(results: dict[str, list[dict]], name: str, value: Callable[[dict], float]) -> float:
    """The median over rounds of this checkout's value over the baseline's in the same round (the two ran one
    after the other, so a slow spell of the machine hits both)."""
    return statistics.median(value(this[name]) / value(base[name])
                             for base, this in zip(results["baseline"], results["this"], strict=True))


def report(args: argparse.Namespace, results: dict[str, list[dict]], labels: dict[str, str]) -> str:
    from benchmarks.report import machine_description

    lines = [f"Command: `python benchmarks/bench_engine.py {' '.join(sys.argv[1:])}`  ",
             f"Machine: {machine_description()}", "",
             f"Rounds: {args.rounds}, alternating baseline and this checkout; medians over rounds; the ratios are "
             "medians of each round's ratio.", "",
             "| rollout | code | tokens generated | forward passes | tokens per pass | seconds | tokens/s | "
             "tokens/s vs baseline | tokens per pass vs baseline |", "|---|---|---|---|---|---|---|---|---|"]
    for name in SHAPES:
        for side in ("baseline", "this"):
            row = median_row(results[side], name)
            speed = paired_ratio(results, name, lambda r: r["tokens_per_s"]) if side == "this" else 1.0
            per_pass = paired_ratio(results, name, tokens_per_pass) if side == "this" else 1.0
            lines.append(f"| {name} | {labels[side]} | {row['tokens_generated']:.0f} | {row['forward_passes']:.0f} | "
                         f"{row['tokens_per_pass']:.2f} | {row['seconds']:.1f} | {row['tokens_per_s']:.1f} | "
                         f"{speed:.2f}x | {per_pass:.2f}x |")
    lines += ["", "The ceiling of batching (`pass_bound`): the most tokens per pass that an engine decoding one token "
              "per row per pass could reach on this checkout's trees (each tree's rounds one after the other, the "
              "longest branch of a round setting its passes), against the baseline's measured tokens per pass:", ""]
    for name in SHAPES:
        ceiling = statistics.median(r[name]["tokens_generated"] / r[name]["pass_bound"] for r in results["this"])
        reached = statistics.median(r[name]["pass_bound"] / r[name]["forward_passes"] for r in results["this"])
        lines.append(f"- {name}: at most {ceiling:.2f} tokens per pass, "
                     f"{ceiling / median_row(results['baseline'], name)['tokens_per_pass']:.2f}x the baseline's; this "
                     f"checkout reaches {reached:.0%} of it")
    lines += ["", "Every round (tokens/s, baseline then this checkout):", ""]
    for i in range(args.rounds):
        cells = [f"{name}: {results['baseline'][i][name]['tokens_per_s']:.1f} / "
                 f"{results['this'][i][name]['tokens_per_s']:.1f}" for name in SHAPES]
        lines.append(f"- round {i + 1}: " + "; ".join(cells))
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", help="the other checkout (a git worktree of an older commit)")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--env", default="SynthHop-v0")
    parser.add_argument("--data-dir", default=None, help="the env's data directory (SynthHop-v0: a world)")
    parser.add_argument("--topk", type=int, default=1, help="passages per search")
    parser.add_argument("--questions", type=int, default=8)
    parser.add_argument("--max-step-tokens", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--output", default="docs/benchmarks.md")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--pass-bound", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not args.worker and not args.baseline:
        parser.error("--baseline CHECKOUT is required (a git worktree of the code to compare against)")
    if args.rounds < 1 or args.questions < 1:
        parser.error("--rounds and --questions must be at least 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return
    from benchmarks.report import replace_section

    checkouts = {"baseline": Path(args.baseline).resolve(), "this": HERE}
    labels = {side: commit_of(path) for side, path in checkouts.items()}
    results: dict[str, list[dict]] = {"baseline": [], "this": []}
    for i in range(args.rounds):
        for side in ("baseline", "this") if i % 2 == 0 else ("this", "baseline"):
            print(f"round {i + 1}: {side} ({labels[side]}) ...", flush=True)
            results[side].append(run_checkout(checkouts[side], args))
    section = report(args, results, labels)
    print(section)
    replace_section(args.output, "engine", "Rollout engine against the old code (issue 24)", section)


if __name__ == "__main__":
    main()
