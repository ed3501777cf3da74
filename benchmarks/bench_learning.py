"""Learning benchmark on SynthHop-v0: tree vs chain at matched budgets and the advantage ablation,
from the same warm start, several seeds, with bootstrap intervals.

    python benchmarks/bench_learning.py --report             # warm start (18-26 min) + 7 settings x 5 seeds: about 1 h
    python benchmarks/bench_learning.py --resume --report    # go on after an interruption, reusing finished runs
    # or split the runs over processes sharing --output (the first trains the warm start, the others wait for it;
    # 48 min in all on 2 cores: results/learning_synthhop/README.md)
    OMP_NUM_THREADS=1 python benchmarks/bench_learning.py --resume --seeds 0 1 2 &
    OMP_NUM_THREADS=1 python benchmarks/bench_learning.py --resume --seeds 3 4 &
    wait; python benchmarks/bench_learning.py --resume --report
    python benchmarks/bench_learning.py --warm outputs/bench_learning/warm/model --report   # reuse a warm start
    python benchmarks/bench_learning.py --quick --warm DIR   # 1 seed, 6 iterations, 60 questions

Settings (the paper's budget table, in full-chain equivalents): tree (2,2,1) at budget 4 against chain G=4 and
chain G=16; tree (1,2,1) against chain G=2 at budget 2; the tree (2,2,1) with intra-tree or inter-tree advantages
only. Every run has the same prompts per iteration, the same learning rate and the same warm-started start point,
on the demo's task at a larger size: 1- and 2-hop questions, one passage per search, 300 held out (``WORLD``,
``TOPK``); the start policy copies names but answers half of the 2-hop questions one hop short. Each run's final
policy is evaluated greedily on the first --eval-questions held-out questions, question by question; a setting's
dev EM is the mean over seeds x questions with a bootstrap interval over both, and two settings are compared by the
paired bootstrap of their difference (same seeds, same questions). Learning curves (dev EM on --curve-questions
every --eval-every iterations) are plotted against iterations, tokens generated and tool calls. Runs go seed by
seed and the results are rewritten after each: OUTPUT/learning.md, learning.json, learning.png and, with --report,
the ``learning`` section of its study's README, results/learning_synthhop/README.md (a hand-written reading belongs
outside the section, which a rerun leaves alone).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks.learning_options import add_run_options, check_eval_questions, design_output, with_design
from benchmarks.learning_runs import run_benchmark
from benchmarks.learning_testbed import Testbed
from envs.synthetic import WorldSpec, world_data_dir

TREE = ["--algo", "tree_grpo", "--M", "2", "--N", "2", "--L", "1"]
# name -> (budget in full chains, run.py options)
SETTINGS: dict[str, tuple[int, list[str]]] = {
    "tree (2,2,1)": (4, TREE),
    "chain G=4": (4, ["--algo", "grpo", "--group-size", "4"]),
    "chain G=16": (16, ["--algo", "grpo", "--group-size", "16"]),
    "tree (1,2,1)": (2, ["--algo", "tree_grpo", "--M", "1", "--N", "2", "--L", "1"]),
    "chain G=2": (2, ["--algo", "grpo", "--group-size", "2"]),
    "tree (2,2,1) intra only": (4, [*TREE, "--advantage-mode", "intra"]),
    "tree (2,2,1) inter only": (4, [*TREE, "--advantage-mode", "inter"]),
}
# (a, b): the paired difference a - b, and the paper's direction (a >= b)
COMPARISONS: tuple[tuple[str, str], ...] = (
    ("tree (2,2,1)", "chain G=4"), ("tree (2,2,1)", "chain G=16"), ("tree (1,2,1)", "chain G=2"),
    ("tree (2,2,1)", "tree (2,2,1) inter only"), ("tree (2,2,1) inter only", "tree (2,2,1) intra only"),
)
# the default world's entities, 1- and 2-hop questions (the demo's task, larger), 300 held out and 700 to train on;
# one passage per search (TOPK), a context in which the 10M-parameter warm start learns to copy names
WORLD = WorldSpec(seed=0, train_questions=700, dev_questions=300, hop_mix=(0.5, 0.5, 0.0))
TOPK = 1
TESTBED = Testbed("learning", "Learning: tree vs chain on SynthHop-v0 (issue 15)", "SynthHop-v0", WORLD, TOPK,
                  SETTINGS, COMPARISONS)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_options(p, list(SETTINGS), seeds=[0, 1, 2, 3, 4], iterations=8, eval_every=4,
                    section="learning")
    p.add_argument("--premature", type=float, default=0.5,
                   help="warm start: share of 2-hop oracle trajectories that answer one hop short (the start "
                        "policy's strategy mix: RL's job is the choice at that branch point)")
    p.add_argument("--quick", action="store_true", help="1 seed, 6 iterations, 60 held-out questions")
    args = p.parse_args(argv)
    if args.quick:
        args.seeds, args.iterations, args.eval_every = args.seeds[:1], 6, 3
        args.curve_questions, args.eval_questions = 60, 60
    args.output = args.output or design_output("outputs/bench_learning", args)
    check_eval_questions(p, args, TESTBED)
    return args


# The warm start: oracle SFT of a 10M-parameter Llama on the train questions of the benchmark's world and of 5
# other worlds (names differ, so copying is learned rather than memorised), --premature of the 2-hop trajectories
# answering one hop short (the strategy mix that RL's choice at the branch point can fix): the recipe of the
# demo's warm start (experiments/demo.py) on this larger world.
WARM_START = ("--model", "scratch", "--extra-worlds", "5", "--batch-size", "8", "--epochs", "4", "--lr", "3e-3")


def warm_start(args: argparse.Namespace, output: Path) -> Path:
    """The warm-started model directory (OUTPUT/warm/model; with --resume, one trained earlier is reused)."""
    from experiments.warmstart import main as warmstart

    model = output / "warm" / "model"
    if args.resume and (model / "config.json").exists():
        return model
    return warmstart([*WARM_START, "--premature", str(args.premature), "--env", "SynthHop-v0",
                      "--data-dir", str(world_data_dir(WORLD)), "--topk", str(TOPK), "--output", str(model.parent),
                      "--dev-questions", str(args.curve_questions), "--max-step-tokens", str(args.max_step_tokens)])


def main(argv: list[str] | None = None) -> Path:
    args = parse_args(argv)
    return run_benchmark(with_design(TESTBED, args), args, lambda: warm_start(args, Path(args.output)), argv,
                         "benchmarks/bench_learning.py")


if __name__ == "__main__":
    main()
