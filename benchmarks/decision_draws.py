"""Independent draws of a decision per generated token, by arm (the ninth design's reading:
results/branching_rare_decision/).

    python benchmarks/decision_draws.py --prompts 24

A node at depth d is a sample of the trajectory's d-th step that no other leaf shares; a branch from a deeper node
inherits it. So the nodes at the decision's depth count the tree's independent draws of the decision, and a
shape that branches below it buys leaves that compare only what follows. Grows each arm of ``bench_branching
--lead`` (its run.py options: shape, branching, sampling) once from the ninth design's cached start, on the first
``--prompts`` train questions of its lead world, and prints per prompt the draws, leaves and generated tokens, and
the draws per 1,000 tokens. The start is trained first if it is not cached (about 100 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Sequence

import gymnasium as gym
import torch

import envs  # noqa: F401  (registers the env ids)
from algos.rollout import TreeRollout
from algos.tree import Tree
from benchmarks import bench_branching
from experiments.run import plan
from experiments.warmstart import cached_warm_start
from policies.generators import step_generator
from policies.models import load_model

# the ninth design's start and rollouts (docs/protocol_branching.md)
NINTH_DESIGN = ["--lead", "--eval-questions", "200", "--start-goal", "--start-misroute", "0.98",
                "--start-misroute-role", "chair", "--top-p", "1.0", "--token-budget", "200000",
                "--chain-group-size", "4"]


def draws_at_depth(trees: Sequence[Tree], depth: int) -> int:
    """The nodes at ``depth`` (the root is 0) over ``trees``: the independent samples of that step."""
    return sum(node.depth == depth for tree in trees for node in tree.nodes())


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=24, help="train questions to grow each arm's trees for")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.prompts < 1:
        p.error(f"--prompts must be >= 1, got {args.prompts}")
    bench = bench_branching.parse_args(NINTH_DESIGN)
    bed = bench_branching.testbed(bench)
    recipe, first_stage = bench_branching.start_recipes(bench, bed)
    model, tokenizer = load_model(str(cached_warm_start(bed.world, recipe, topk=bed.topk, continues=first_stage)))
    env = gym.make(bed.env, split="train", data_dir=str(bed.data_dir), max_turns=bed.max_turns, topk=bed.topk)
    prompts = list(range(args.prompts))
    for name in bench.settings:
        with tempfile.TemporaryDirectory() as output:
            run = plan([*bed.settings[name][1], "--top-p", str(bench.top_p), "--max-turns", str(bed.max_turns),
                        "--output", output]).settings
        torch.manual_seed(args.seed)
        generator = step_generator("hf", model, tokenizer, run.sampling)
        trees = TreeRollout(env, generator, tokenizer, seed=args.seed, branching=run.branching).grow(prompts,
                                                                                                     run.tree_shape)
        tokens = generator.counters.tokens_generated
        draws, leaves = draws_at_depth(trees, bed.world.decision_hop + 1), sum(len(tree.leaves()) for tree in trees)
        print(f"{name}: per prompt {draws / len(prompts):.2f} decision draws, {leaves / len(prompts):.1f} leaves, "
              f"{tokens / len(prompts):.0f} tokens; {1000 * draws / tokens:.2f} draws per 1,000 tokens", flush=True)


if __name__ == "__main__":
    main()
