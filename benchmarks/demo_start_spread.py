"""How far the CPU demo's start policy lands from one training to another: its warm start trained with each
``--seeds`` value at ``--threads`` torch threads (another thread count sums in another order), then greedy held-out
exact match of each start on the demo world's held-out questions.

    python benchmarks/demo_start_spread.py --seeds 0 1 2 3 4 --threads 2 --output outputs/demo_spread/starts.jsonl
    python benchmarks/demo_start_spread.py --seeds 0 1 2 3 4 --threads 1 --output outputs/demo_spread/starts.jsonl
    python benchmarks/demo_start_spread.py --recipe fixed --seeds 0 1 --output outputs/demo_spread/starts.jsonl

``--recipe demo`` (the default) is the demo's start policy (``demo.start_policy``: ``WARM_START``, then
``ONE_HOP_SHORT``); ``--recipe checked`` its first stage alone: a schedule, then more epochs while a check on another
world's questions fails; ``--recipe fixed`` the recipe the demo had before: four epochs of a cosine to zero, whatever
they reach (kept to measure what the check changes). One JSON line per start (appended): seed,
threads, the recipe, the loss per epoch and the check after each checked epoch, held-out EM with its 95%
interval, EM on the 1-hop and the 2-hop questions, and the failure mix (``one hop short`` is the start's designed
flaw: answering after the first search). Each thread count trains into its own cache folder beside ``--output``
(the warm-start cache is keyed by the recipe, not by the threads), so a rerun finds its starts trained.
"""

from __future__ import annotations

import argparse
import functools
import json
from collections.abc import Callable
from pathlib import Path

import torch

from algos.evaluation import failure_mix
from envs.synthetic import world_data_dir
from experiments.confidence import mean_interval
from experiments.demo import MAX_STEP_TOKENS, TOPK, WARM_START, WORLD, recipe_with_seed, start_policy
from experiments.evaluate import world_held_out
from experiments.warmstart import cached_warm_start

# the demo's warm start before the check: four epochs of a cosine to zero, whatever they reach
FIXED_EPOCHS = ("--extra-worlds", "9", "--epochs", "4", "--premature", "0.5", "--batch-size", "8", "--lr", "3e-3",
                "--seed", "0")


def one_stage(recipe: tuple[str, ...], seed: int, cache_dir: Path) -> Path:
    """The cached warm start of ``recipe`` with ``seed`` on the demo world (trained first if missing)."""
    return cached_warm_start(WORLD, recipe_with_seed(recipe, seed), topk=TOPK, cache_dir=cache_dir)


# recipe name -> (seed, cache folder) -> the start's model directory
RECIPES: dict[str, Callable[[int, Path], Path]] = {"demo": start_policy,
                                                    "checked": functools.partial(one_stage, WARM_START),
                                                    "fixed": functools.partial(one_stage, FIXED_EPOCHS)}


def measure_start(seed: int, threads: int, cache_dir: Path, questions: int, recipe: str) -> dict:
    """Train (or find cached) the start of ``RECIPES[recipe]`` with ``seed`` at ``threads`` threads; its held-out
    results."""
    torch.set_num_threads(threads)
    model = RECIPES[recipe](seed, cache_dir)
    rows = world_held_out(model, world_data_dir(WORLD, cache_dir), questions, MAX_STEP_TOKENS, TOPK)
    summary = json.loads((model.parent / "warmstart.json").read_text(encoding="utf-8"))
    by_hops = {hops: [row["em"] for row in rows if row["hops"] == hops] for hops in (1.0, 2.0)}
    em = mean_interval([row["em"] for row in rows])
    return {"seed": seed, "threads": threads, "recipe": recipe, "loss_per_epoch": summary["loss_per_epoch"],
            "check_per_epoch": summary.get("check_per_epoch", []),
            "questions": len(rows), "em": em.mean, "em_low": em.low, "em_high": em.high,
            "em_1hop": sum(by_hops[1.0]) / max(len(by_hops[1.0]), 1),
            "em_2hop": sum(by_hops[2.0]) / max(len(by_hops[2.0]), 1), "failures": failure_mix(rows),
            "model": str(model)}


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--recipe", choices=RECIPES, default="demo",
                   help="the demo's start (demo), its first stage alone (checked) or that stage's schedule (fixed)")
    p.add_argument("--questions", type=int, default=WORLD.dev_questions, help="held-out questions evaluated")
    p.add_argument("--output", type=Path, default=Path("outputs/demo_spread/starts.jsonl"))
    args = p.parse_args(argv)
    cache_dir = args.output.parent / f"cache-threads{args.threads}"
    args.output.parent.mkdir(parents=True, exist_ok=True)
    results = []
    for seed in args.seeds:
        result = measure_start(seed, args.threads, cache_dir, args.questions, args.recipe)
        with args.output.open("a", encoding="utf-8") as handle:
            handle.write(json.dumps(result) + "\n")
        print(json.dumps(result), flush=True)
        results.append(result)
    return results


if __name__ == "__main__":
    main()
