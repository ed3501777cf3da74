"""The command line every learning benchmark shares (``add_run_options``) and the design choices in it: the
options (top-p, entropy bonus, a learning-rate schedule away from the benchmark's defaults) that make a design of
their own, passed to every run and named in the benchmark's outputs, section and title."""

from __future__ import annotations

import argparse
import dataclasses

from algos.tree_grpo.settings import TreeGRPOSettings
from benchmarks.learning_stats import DELTA
from benchmarks.learning_testbed import Testbed
from experiments.arg_types import fraction, non_negative_float, non_negative_int, positive_int
from policies.generation import SamplingSettings

# benchmark option -> (run.py's option, what it is): design choices a benchmark can set for every setting
DESIGN_OPTIONS = {"top_p": ("--top-p", "rollouts' top-p"), "entropy_coef": ("--entropy-coef", "entropy bonus"),
                  "stop_after_uniform": ("--stop-after-uniform", "stop after uniform iterations")}
# the same for the options every run is given (run_options): a design choice where set away from the benchmark's
# default, which the parser records in ``schedule_defaults``
SCHEDULE_OPTIONS = {"lr": ("--lr", "lr"), "warmup_steps": ("--warmup-steps", "warm-up steps")}


def add_run_options(p: argparse.ArgumentParser, settings: list[str], *, seeds: list[int] | None, iterations: int,
                    eval_every: int, section: str, warmup_steps: int | None = None) -> None:
    """The options every learning benchmark has: which settings and seeds, the runs' shared hyperparameters, the
    evaluations, --output, --report and --resume."""
    p.add_argument("--warm", default=None, help="start policy's model directory (default: the benchmark's warm start)")
    p.add_argument("--settings", nargs="+", default=settings, choices=settings)
    p.add_argument("--seeds", type=int, nargs="+", default=seeds)
    p.add_argument("--iterations", type=int, default=iterations)
    p.add_argument("--prompts-per-iter", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--warmup-steps", type=non_negative_int, default=warmup_steps,
                   help="optimizer steps of learning-rate warm-up, the same for every setting (default: %(default)s; "
                        "None: run.py's, the paper's share of the --iterations cap's steps, 0.285 for trees and 0.5 "
                        "for chains)")
    p.set_defaults(schedule_defaults={"lr": p.get_default("lr"), "warmup_steps": warmup_steps})
    p.add_argument("--eval-every", type=int, default=eval_every, help="learning-curve evaluations every k iterations")
    p.add_argument("--curve-questions", type=int, default=100, help="held-out questions of each curve point")
    p.add_argument("--eval-questions", type=int, default=300, help="held-out questions of the final evaluation")
    # Not the project's default cap (128 on CPU): generated-world steps are short (about 50 tokens for a whole
    # SynthHop leaf in the rollout benchmark), so 64 holds any step a warm start writes and cuts runaway ones early
    # on a CPU; it is also warmstart.py's dev-evaluation cap, so a warm start's dev EM and the runs' are alike.
    p.add_argument("--max-step-tokens", type=int, default=64)
    p.add_argument("--top-p", type=fraction, default=None,
                   help=f"nucleus of the rollouts' sampling, the same for every setting (default: run.py's, "
                        f"{SamplingSettings().top_p})")
    p.add_argument("--entropy-coef", type=non_negative_float, default=None,
                   help=f"entropy bonus of the update, the same for every setting (default: run.py's, "
                        f"{TreeGRPOSettings.model_fields['entropy_coef'].default})")
    p.add_argument("--stop-after-uniform", type=positive_int, default=None,
                   help="end each run after this many iterations in a row whose prompts' leaves were each rewarded "
                        "alike (run.py's guard against the drift of a run that has solved its prompts; default: off)")
    p.add_argument("--delta", type=float, default=DELTA,
                   help="the EM difference the power analysis sizes the benchmark for (seeds needed at 80%% power)")
    p.add_argument("--output", default=None,
                   help="where the runs and results go (default: the benchmark's outputs/bench_NAME, with the design "
                        "choices set, e.g. --top-p, in its name: design_output)")
    p.add_argument("--report", action="store_true",
                   help=f"write the {section} section of its study's README (results/STUDY/README.md)")
    p.add_argument("--start-only", action="store_true",
                   help="train (or find) the start policy and evaluate it, then stop: the start on all the machine's "
                        "threads before one-thread workers share the output with --resume")
    p.add_argument("--resume", action="store_true",
                   help="reuse what --output holds: the start point's evaluation and the finished runs whose options "
                        "match, e.g. after an interruption, or to report on seeds run by several processes")




def check_eval_questions(p: argparse.ArgumentParser, args: argparse.Namespace, testbed: Testbed) -> None:
    if not 1 <= args.eval_questions <= testbed.world.dev_questions:
        p.error(f"--eval-questions must be in [1, {testbed.world.dev_questions}] (the world's held-out questions), "
                f"got {args.eval_questions}")


def design_options(args: argparse.Namespace) -> list[str]:
    """run.py's options for the design choices set on the benchmark (``DESIGN_OPTIONS``); none for run.py's
    defaults, so the runs of a design that keeps them are the runs made before these options existed."""
    return [item for name, (flag, _) in DESIGN_OPTIONS.items() if getattr(args, name) is not None
            for item in (flag, str(getattr(args, name)))]


def design_choices(args: argparse.Namespace) -> list[tuple[str, str, float]]:
    """(run.py's option, what it is, value) of each design choice set on the benchmark: the ``DESIGN_OPTIONS``
    given at all, the ``SCHEDULE_OPTIONS`` given away from the benchmark's defaults."""
    defaults = {**dict.fromkeys(DESIGN_OPTIONS), **getattr(args, "schedule_defaults", {})}
    return [(flag, what, getattr(args, name)) for name, (flag, what) in {**DESIGN_OPTIONS, **SCHEDULE_OPTIONS}.items()
            if name in defaults and getattr(args, name) != defaults[name]]


def design_suffix(args: argparse.Namespace) -> str:
    """``-top-p-1-entropy-coef-0.01``-like: the design choices set on the benchmark, for its outputs' names."""
    return "".join(f"-{flag.strip('-')}-{value:g}" for flag, _, value in design_choices(args))


def with_design(testbed: Testbed, args: argparse.Namespace) -> Testbed:
    """The testbed under the design choices set on the benchmark: its section and files named after them, so a
    design's report sits beside the first design's instead of over it."""
    chosen = [f"{what} {value:g}" for _, what, value in design_choices(args)]
    if not chosen:
        return testbed
    return dataclasses.replace(testbed, name=testbed.name + design_suffix(args),
                               title=f"{testbed.title}, {', '.join(chosen)}")


def design_output(base: str, args: argparse.Namespace) -> str:
    """The default --output of a benchmark (``base``) under its design choices: a design's runs never share a
    directory with another's (a run of other options in a setting's directory would be trained over)."""
    return base + design_suffix(args).replace("-", "_")
