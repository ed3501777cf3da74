"""The paper's budget table at small scale (issue 64; protocol: docs/protocol_branching.md, "The budget table"): at
budgets 2, 4 and 16 full-chain equivalents, the tree (M, N, L) against chain GRPO with G of the same full-chain cost,
as experiments/configs/budget/budget{B}_{tree,chain}.yaml define them, every arm with the same prompts per iteration
and the same number of iterations (no token budget: the tree's token saving is reported beside, not equalised).

    # the table as declared: the start on every thread, then 6 arms x 10 seeds over two processes sharing --output
    python benchmarks/bench_budget.py --resume --start-only
    OMP_NUM_THREADS=1 python benchmarks/bench_budget.py --resume --seeds 0 2 4 6 8 &
    OMP_NUM_THREADS=1 python benchmarks/bench_budget.py --resume --seeds 1 3 5 7 9 &
    wait; python benchmarks/bench_budget.py --resume --report
    python benchmarks/run_records.py save outputs/budget_table    # the records: results/budget_table/

The testbed is the fifth design's (``bench_branching``): ``WORLD`` (3 hops, the decision after the first search), the
start misrouting 0.85 of the chair questions (``START_MISROUTE``; checked p = 0.129 for the right choice, so a group of
2 chains holds both choices about 22% of the time), lr 2e-5 constant from the first step. Primary outcomes: the final
dev EM on the held-out questions after --iterations iterations, and the iterations to first reach dev EM 0.7 on the
curve (a point every iteration; runs that never reach it censored at their end); tokens and optimizer steps beside;
the mechanism, per arm, the share of prompts with a non-zero advantage per iteration (``nonzero_advantage_share``).
Writes OUTPUT/budget-table.md, .json, .png and, with --report, section ``budget-table`` of its study's README
(results/budget_table/README.md, ``benchmarks/studies.py``); ``benchmarks/study_report.py budget_table`` rebuilds
it from the records alone.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import yaml

from benchmarks.bench_branching import TOPK, WORLD, run_from_start
from benchmarks.learning_options import add_run_options, check_eval_questions, design_output, with_design
from benchmarks.learning_testbed import Testbed
from benchmarks.plateau_exit import PLATEAU_THRESHOLD

CONFIGS = Path(__file__).resolve().parent.parent / "experiments" / "configs" / "budget"
BUDGETS = (2, 4, 16)
START_MISROUTE = 0.85  # of the chair questions: the fourth and fifth designs' start (docs/protocol_branching.md)
LR = 2e-5  # the fifth design's: constant from the first step, every run learned within its 60,000 tokens
SEEDS = list(range(10))


def arm_names(budget: int) -> tuple[str, str]:
    """(tree, chain) setting names of ``budget``, with the shapes its configs give."""
    tree, chain = (budget_config(budget, kind) for kind in ("tree", "chain"))
    return (f"tree ({tree['M']},{tree['N']},{tree['L']}) budget {budget}",
            f"chain G={chain['group_size']} budget {budget}")


def budget_config(budget: int, kind: str) -> dict:
    """experiments/configs/budget/budget{budget}_{kind}.yaml's own keys (its shape; ``base`` and ``output`` aside)."""
    return yaml.safe_load((CONFIGS / f"budget{budget}_{kind}.yaml").read_text(encoding="utf-8"))


def settings() -> dict[str, tuple[int, list[str]]]:
    """name -> (budget in full chains, run.py options): each budget's tree (uniform branching) and chain."""
    out: dict[str, tuple[int, list[str]]] = {}
    for budget in BUDGETS:
        tree, chain = (budget_config(budget, kind) for kind in ("tree", "chain"))
        tree_name, chain_name = arm_names(budget)
        out[tree_name] = (budget, ["--algo", "tree_grpo", "--M", str(tree["M"]), "--N", str(tree["N"]), "--L",
                                   str(tree["L"]), "--branching", "uniform"])
        out[chain_name] = (budget, ["--algo", "grpo", "--group-size", str(chain["group_size"])])
    return out


def comparisons() -> tuple[tuple[str, str], ...]:
    """Tree - chain at each budget (the primary three), then the positive control: chain G=16 - chain G=2 (more
    rollouts a prompt must learn faster per iteration, or the testbed cannot show a budget's effect)."""
    pairs = tuple(arm_names(budget) for budget in BUDGETS)
    return (*pairs, (arm_names(16)[1], arm_names(2)[1]))


def testbed(args: argparse.Namespace) -> Testbed:
    return with_design(Testbed("budget-table", "The budget table at small scale (issue 64): tree against chain at "
                               "equal full-chain cost, prompts and iterations on SynthBranch-v0", "SynthBranch-v0",
                               WORLD, TOPK, settings(), comparisons(), plateau_threshold=PLATEAU_THRESHOLD), args)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_options(p, list(settings()), seeds=SEEDS, iterations=12, eval_every=1,
                    section="budget-table", warmup_steps=0)
    # the benchmark's own schedule (a design of its own only away from it, as in the branching benchmark)
    p.set_defaults(lr=LR, schedule_defaults={"lr": LR, "warmup_steps": 0}, curve_questions=50)
    args = p.parse_args(argv)
    if args.iterations < 1:
        p.error(f"--iterations must be >= 1, got {args.iterations}")
    # bench_branching's start options: the fifth design's start
    args.start_misroute, args.start_misroute_role, args.start_goal = START_MISROUTE, "chair", False
    args.output = args.output or design_output("outputs/budget_table", args)
    check_eval_questions(p, args, testbed(args))
    return args


def main(argv: list[str] | None = None) -> Path:
    args = parse_args(argv)
    return run_from_start(testbed(args), args, argv, "benchmarks/bench_budget.py")


if __name__ == "__main__":
    main()
