"""Branching benchmark on SynthBranch-v0: where trees should win. Tree (2,2,1) against chains at equal
generated tokens and at 4x, and the branching strategies against each other, every run stopped by a token budget;
the protocol (comparisons, metric, sizes, decision rule) is docs/protocol_branching.md, fixed before the runs.

    python benchmarks/bench_branching.py --pilot --resume     # 2 seeds, 100 questions: what the power analysis needs
    # the benchmark, split over processes sharing --output (the first trains the cached warm start, the others
    # wait for it), then the report
    OMP_NUM_THREADS=1 python benchmarks/bench_branching.py --resume --seeds 0 1 2 &
    OMP_NUM_THREADS=1 python benchmarks/bench_branching.py --resume --seeds 3 4 &
    wait; python benchmarks/bench_branching.py --resume --report
    python benchmarks/bench_branching.py --warm DIR --settings "tree (2,2,1) uniform" --seeds 0   # one run
    # other designs (docs/protocol_branching.md), each into its own output and docs section:
    python benchmarks/bench_branching.py --pilot --resume --top-p 1.0               # rollouts without the nucleus cut
    python benchmarks/bench_branching.py --pilot --resume --entropy-coef 0.01       # a larger entropy bonus
    python benchmarks/bench_branching.py --pilot --resume --stop-after-uniform 3    # runs end once saturated
    python benchmarks/bench_branching.py --pilot --resume --start-misroute 0.85 --start-misroute-role chair
                                                                    # a start misrouting only the chair questions
    # the benchmark as docs/protocol_branching.md declares it, with a constant lr (--lr and --warmup-steps away
    # from their defaults name a design too), 4 settings x 10 seeds, curve points every iteration
    python benchmarks/bench_branching.py --resume --start-misroute 0.85 --start-misroute-role chair --lr 2e-5 \
        --warmup-steps 0 --token-budget 60000 --chain-group-size 5 --iterations 100 --eval-every 1 \
        --curve-questions 50 --seeds 0 1 2 3 4 5 6 7 8 9 --settings "tree (2,2,1) uniform" "chain at equal tokens" \
        "chain G=16 at 4x tokens" "tree (2,2,1) entropy" --report

The testbed (``WORLD``, ``TOPK``): 3-hop SynthBranch questions, each turning on one decision after the first
search (follow the company's founder or its chair), 300 held out; one passage per search; people named by one
given name each, one token for SmolLM2's tokenizer, and each company's passage naming them in the questions' words
("The chair of X is Jose"). The start policy (``WARM_START``, trained once and cached:
``experiments.warmstart.cached_warm_start``) imitates oracle trajectories of 20 worlds in two stages, whose thought
before each search restates the passage's sentence that ends with the query, with the retrieved passages trained as
language modelling (a copying curriculum): ``START_STAGE_1`` on correctly routed trajectories (the decision, the
role word it restates, one token, learns to read the question; the name then follows by induction), then
``WARM_START``, one epoch from it on trajectories 70% of which follow the wrong person (the right choice becomes
the minority while the question stays read at the decision). The report checks the copying: EM on the
held-out questions it routes right (``algos.evaluation.routing``), which must be >= 0.9 so that copying errors do
not drown the strategy signal (docs/protocol_branching.md).

Settings: the tree (2,2,1) with the paper's uniform branching; a chain group at equal tokens (--chain-group-size,
default 4; set it to the tree's measured tokens per prompt over a chain's, from the pilot's table); chain G=16 at
4x the tokens; the tree with ``entropy`` and ``after_tool`` branching (``algos/branching.py``); with --lead, the
sixth design's arms (``LEAD_SETTINGS``: the uniform and entropy trees, the chain at equal tokens and tree (2,4,2),
more expansions at equal tokens) and its comparisons (``LEAD_COMPARISONS``). Every run stops
after the iteration in which it has generated --token-budget tokens (4x for G=16), so the settings are compared
at equal measured cost; --iterations is only a cap. Final dev EM on --eval-questions held-out questions, paired
differences with bootstrap intervals, the std of the per-question paired differences and the seeds a
--delta EM difference needs at 80% power (``experiments.confidence.seeds_for_power``), the failure mix (with
"wrong route"), routing, and curves of dev EM against tokens generated and tool calls. Writes OUTPUT/branching.md,
branching.json, branching.png and, with --report, section ``branching`` (the pilot: ``branching-pilot``; a design's
its own) of its study's README (``benchmarks/studies.py``: results/STUDY/README.md).
"""

from __future__ import annotations

import argparse
import functools
from pathlib import Path

from benchmarks.learning_options import add_run_options, check_eval_questions, design_output, with_design
from benchmarks.learning_runs import max_turns_options, run_benchmark
from benchmarks.learning_testbed import Testbed
from benchmarks.plateau_exit import PLATEAU_THRESHOLD
from envs.synthetic import BRANCH_ROLES, BranchSpec

TREE = ["--algo", "tree_grpo", "--M", "2", "--N", "2", "--L", "1"]
UNIFORM, ENTROPY, AFTER_TOOL = "tree (2,2,1) uniform", "tree (2,2,1) entropy", "tree (2,2,1) after_tool"
CHAIN_EQUAL, CHAIN_16 = "chain at equal tokens", "chain G=16 at 4x tokens"
WIDE_TREE = "tree (2,4,2) uniform"  # more expansions (18 leaves a prompt, 10 chains' nominal cost), at equal tokens
SETTING_NAMES = (UNIFORM, CHAIN_EQUAL, CHAIN_16, ENTROPY, AFTER_TOOL)  # the default settings (--lead: LEAD_SETTINGS)
# (a, b): the paired difference a - b, the first three the protocol's primary comparisons (a >= b expected)
COMPARISONS: tuple[tuple[str, str], ...] = (
    (UNIFORM, CHAIN_EQUAL), (UNIFORM, CHAIN_16), (ENTROPY, UNIFORM), (AFTER_TOOL, UNIFORM), (ENTROPY, AFTER_TOOL),
)
# the sixth design's (docs/protocol_branching.md): every tree against chains at equal tokens, then the trees' own
LEAD_SETTINGS = (UNIFORM, CHAIN_EQUAL, ENTROPY, WIDE_TREE)
LEAD_COMPARISONS: tuple[tuple[str, str], ...] = (
    (UNIFORM, CHAIN_EQUAL), (ENTROPY, CHAIN_EQUAL), (WIDE_TREE, CHAIN_EQUAL), (ENTROPY, UNIFORM), (WIDE_TREE, UNIFORM),
)
# a small world: 80 people, 300 companies (each asks its founder's and its chair's question: 600, 300 held out),
# 3 hops (company, person, birth city; answer the country), so a branch after the first search saves half a chain;
# one-word names, each company's passage naming its people in the questions' words ("The chair of X is Jose"), so
# the decision is one token, the role a policy restates, and the name follows by induction (docs/protocol_branching.md)
WORLD = BranchSpec(seed=0, people=80, companies=300, cities=20, countries=8, train_questions=300, dev_questions=300,
                   hops=3, names="given", passages="roles")
# --lead: each question names a person who works for the company ("the chair of the company Anna works for"), searched
# first, so the decision is the middle of 4 searches and an answer; a company's lead works there alone, so the world
# has more people than companies (the given names allow 217): 200 companies, 400 questions
LEAD_WORLD = BranchSpec(seed=0, people=210, companies=200, cities=20, countries=8, train_questions=200,
                        dev_questions=200, hops=4, names="given", passages="roles", lead=True)
TOPK = 1  # one passage per search: a short context, in which a 10M-parameter model trained for minutes copies names
# Oracle SFT of a 10M-parameter Llama from scratch on the train questions of WORLD and 19 other worlds (other names:
# copying is learned, not memorised), the passages trained at half weight (their titles repeat the query: copying),
# each search's thought restating the passage's sentence that ends with its query (--restate), in two stages:
# every trajectory routed right (reading the role from the question is worth log 2 nats a trajectory), then one
# epoch with 70% following the wrong person (--misroute); docs/protocol_branching.md says why this recipe
START_STAGE_1 = ("--model", "scratch", "--extra-worlds", "19", "--observation-weight", "0.5", "--restate",
                 "--epochs", "6", "--batch-size", "8", "--lr", "3e-3", "--seed", "0")
WARM_START = ("--extra-worlds", "19", "--misroute", "0.7", "--observation-weight", "0.5", "--restate",
              "--epochs", "1", "--batch-size", "8", "--lr", "1e-3", "--seed", "0")
# The same learning-rate warm-up for every setting, in optimizer steps (4 an iteration at 8 prompts): run.py's default,
# the paper's share of the --iterations cap (0.285 trees, 0.5 chains), would differ between settings and depend on a
# cap that must not bind. 67 = 0.285 x the uniform tree's 236 steps to T = 200,000 in the learnability pilot
WARMUP_STEPS = 67
SEEDS = [0, 1, 2, 3, 4]  # the default until the pilot sizes the benchmark (docs/protocol_branching.md)
PILOT = {"seeds": [0, 1], "eval_questions": 100, "curve_questions": 50}


def settings(token_budget: int, chain_group_size: int) -> dict[str, tuple[int, list[str]]]:
    """name -> (nominal budget in full chains, run.py options), each with its token budget."""
    def budget(multiple: int) -> list[str]:
        return ["--token-budget", str(multiple * token_budget)]

    return {
        UNIFORM: (4, [*TREE, "--branching", "uniform", *budget(1)]),
        CHAIN_EQUAL: (chain_group_size, ["--algo", "grpo", "--group-size", str(chain_group_size), *budget(1)]),
        CHAIN_16: (16, ["--algo", "grpo", "--group-size", "16", *budget(4)]),
        ENTROPY: (4, [*TREE, "--branching", "entropy", *budget(1)]),
        AFTER_TOOL: (4, [*TREE, "--branching", "after_tool", *budget(1)]),
        WIDE_TREE: (10, ["--algo", "tree_grpo", "--M", "2", "--N", "4", "--L", "2", "--branching", "uniform",
                         *budget(1)]),
    }


def warm_start_recipe(args: argparse.Namespace) -> tuple[str, ...]:
    """``WARM_START`` with its second stage's misrouting as --start-misroute and --start-misroute-role set it."""
    recipe = list(WARM_START)
    if args.start_misroute is not None:
        recipe[recipe.index("--misroute") + 1] = f"{args.start_misroute:g}"
    if args.start_misroute_role is not None:
        recipe += ["--misroute-role", args.start_misroute_role]
    return tuple(recipe) + goal_option(args)


def goal_option(args: argparse.Namespace) -> tuple[str, ...]:
    """warmstart.py's ``--restate-goal`` for both of the start's stages where --start-goal asks for it."""
    return ("--restate-goal",) if args.start_goal else ()


def start_misrouting(args: argparse.Namespace) -> tuple[float, str | None] | None:
    """(share, role) of the start's misrouting where the options change ``WARM_START``'s, else None."""
    if args.start_misroute is None and args.start_misroute_role is None:
        return None
    recipe = warm_start_recipe(args)
    return float(recipe[recipe.index("--misroute") + 1]), args.start_misroute_role


def start_suffix(args: argparse.Namespace) -> str:
    """``-start-misroute-0.85-chair``-like for a start other than ``WARM_START`` (its outputs' names), else ''."""
    goal = "-start-goal" if args.start_goal else ""
    if (misrouting := start_misrouting(args)) is None:
        return goal
    share, role = misrouting
    return f"{goal}-start-misroute-{share:g}" + (f"-{role}" if role else "")


def testbed(args: argparse.Namespace) -> Testbed:
    name, title = "branching", "Branching: tree vs chain at equal tokens on SynthBranch-v0 (issue 27)"
    if args.pilot:
        name, title = "branching-pilot", "Branching: the pilot (issue 27; sizes the benchmark)"
    if args.lead:
        name, title = name + "-lead", f"{title}, a lead hop before the company (the decision mid-trajectory)"
    if (misrouting := start_misrouting(args)) is not None:
        share, role = misrouting
        asked = f"the {role} questions" if role else "every question"
        title = f"{title}, a start misrouting {share:g} of {asked}"
    if args.start_goal:
        title = f"{title}, its thoughts carrying the asked role to the decision"
    name += start_suffix(args)
    return with_design(Testbed(name, title, "SynthBranch-v0", LEAD_WORLD if args.lead else WORLD, TOPK,
                               settings(args.token_budget, args.chain_group_size),
                               LEAD_COMPARISONS if args.lead else COMPARISONS,
                               plateau_threshold=PLATEAU_THRESHOLD), args)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_options(p, [*SETTING_NAMES, WIDE_TREE], seeds=None, iterations=60, eval_every=3,
                    section="branching (with --pilot: branching-pilot)", warmup_steps=WARMUP_STEPS)
    p.set_defaults(settings=None)  # SETTING_NAMES, or LEAD_SETTINGS with --lead: set after parsing
    p.add_argument("--token-budget", type=int, default=40_000,
                   help="T: each run stops after the iteration in which it has generated T tokens (4T for G=16)")
    p.add_argument("--chain-group-size", type=int, default=4,
                   help="G of the chain at equal tokens (the tree's measured tokens per prompt over a chain's)")
    p.add_argument("--start-misroute", type=float, default=None,
                   help="the start's second stage follows the wrong person on this share of its questions (default: "
                        "WARM_START's); with --start-misroute-role, of the questions about that role only")
    p.add_argument("--start-misroute-role", choices=BRANCH_ROLES, default=None,
                   help="draw --start-misroute among the questions about this role (the other role's stay right)")
    p.add_argument("--start-goal", action="store_true",
                   help="the start's thoughts (both stages) carry the asked role from the question to the decision, "
                        "each copying the one before (warmstart.py --restate-goal)")
    p.add_argument("--lead", action="store_true",
                   help="LEAD_WORLD: the questions name a person who works for the company, so the decision is the "
                        "middle of 4 searches (its own start policy, trained on its worlds)")
    p.add_argument("--pilot", action="store_true",
                   help=f"seeds {PILOT['seeds']} (unless --seeds), {PILOT['eval_questions']} held-out questions, "
                        f"{PILOT['curve_questions']} per curve point, into outputs/bench_branching_pilot: the "
                        f"paired differences' spread that sizes the benchmark")
    args = p.parse_args(argv)
    for name in ("token_budget", "chain_group_size", "iterations"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.pilot:
        vars(args).update({**PILOT, "seeds": args.seeds or PILOT["seeds"]})  # --seeds splits a pilot over processes
    args.seeds = args.seeds or SEEDS
    args.settings = args.settings or list(LEAD_SETTINGS if args.lead else SETTING_NAMES)
    if args.start_misroute is not None and not 0 <= args.start_misroute <= 1:
        p.error(f"--start-misroute must be in [0, 1], got {args.start_misroute}")
    base = ("outputs/bench_branching" + ("_lead" if args.lead else "") + ("_pilot" if args.pilot else "")
            + start_suffix(args))
    args.output = args.output or design_output(base.replace("-", "_"), args)
    check_eval_questions(p, args, testbed(args))
    return args


def start_recipes(args: argparse.Namespace, bed: Testbed) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The start policy's two stages (``warm_start_recipe`` on from ``START_STAGE_1``), each with the testbed's
    ``--max-turns`` where its questions need more searches than the default (the oracle searches every hop)."""
    searches = tuple(max_turns_options(bed))
    return (*warm_start_recipe(args), *searches), (*START_STAGE_1, *goal_option(args), *searches)


def run_from_start(bed: Testbed, args: argparse.Namespace, argv: list[str] | None, script: str) -> Path:
    """The runs of ``bed`` (``run_benchmark``) from the design's cached two-stage start policy (trained first if not
    cached)."""
    from experiments.warmstart import cached_warm_start

    recipe, first_stage = start_recipes(args, bed)
    start = functools.partial(cached_warm_start, bed.world, recipe, topk=TOPK, continues=first_stage)
    return run_benchmark(bed, args, start, argv, script)


def main(argv: list[str] | None = None) -> Path:
    args = parse_args(argv)
    return run_from_start(testbed(args), args, argv, "benchmarks/bench_branching.py")


if __name__ == "__main__":
    main()
