"""Learning benchmark on SynthHop-v0 (issue 15): tree vs chain at matched budgets and the advantage ablation,
from the same warm start, several seeds, with bootstrap intervals.

    python benchmarks/bench_learning.py --report             # warm start (18 min) + 7 settings x 5 seeds: 1.5-2.5 h
    python benchmarks/bench_learning.py --resume --report    # go on after an interruption, reusing finished runs
    # or split the runs over processes sharing --output (the first trains the warm start, the others wait for it;
    # about 1.5 h in all on 2 cores: docs/benchmarks.md)
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
the ``learning`` section of docs/benchmarks.md (a hand-written reading belongs in a section of its own, which a
rerun leaves alone).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import shlex
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from algos.evaluation import FAILURES, failure_mix
from envs.synthetic import WorldSpec, world_data_dir
from experiments.confidence import Interval, bootstrap_interval, mean_interval, paired_bootstrap_interval
from experiments.plot import load_metrics, plot_runs

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
# --report's copy of the plot, beside the docs page that shows it
REPORT_PLOT = Path("docs/learning.png")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--warm", default=None, help="warm-started model directory (default: run warmstart.py first)")
    p.add_argument("--premature", type=float, default=0.5,
                   help="warm start: share of 2-hop oracle trajectories that answer one hop short (the start "
                        "policy's strategy mix: RL's job is the choice at that branch point)")
    p.add_argument("--quick", action="store_true", help="1 seed, 6 iterations, 60 held-out questions")
    p.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    p.add_argument("--iterations", type=int, default=8, help="the demo's: enough for the strategy fix")
    p.add_argument("--prompts-per-iter", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--eval-every", type=int, default=4, help="learning-curve evaluations every k iterations")
    p.add_argument("--curve-questions", type=int, default=100, help="held-out questions of each curve point")
    p.add_argument("--eval-questions", type=int, default=300, help="held-out questions of the final evaluation")
    # Not the project's default cap (128 on CPU): SynthHop steps are short (about 50 tokens for a whole leaf in the
    # rollout benchmark), so 64 holds any step the warm start writes and cuts runaway ones early on a CPU; it is
    # also warmstart.py's dev-evaluation cap, so the warm start's dev EM and the runs' are measured alike.
    p.add_argument("--max-step-tokens", type=int, default=64)
    p.add_argument("--output", default="outputs/bench_learning")
    p.add_argument("--report", action="store_true", help="write the learning section of docs/benchmarks.md")
    p.add_argument("--resume", action="store_true",
                   help="reuse what --output holds: the warm start (OUTPUT/warm/model), the start point's evaluation "
                        "and the finished runs whose options match, e.g. after an interruption, or to report on seeds "
                        "run by several processes")
    args = p.parse_args(argv)
    if args.quick:
        args.seeds, args.iterations, args.eval_every = args.seeds[:1], 6, 3
        args.curve_questions, args.eval_questions = 60, 60
    if not 1 <= args.eval_questions <= WORLD.dev_questions:
        p.error(f"--eval-questions must be in [1, {WORLD.dev_questions}] (the world's held-out questions), "
                f"got {args.eval_questions}")
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


@contextlib.contextmanager
def exclusive(lock: Path):
    """Hold an exclusive lock on the file ``lock`` while the block runs: of several processes sharing --output
    with --resume, the first trains the warm start and evaluates the start point, and the others, waiting here,
    reuse them."""
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def held_out_scores(policy: str, args: argparse.Namespace) -> list[dict[str, float]]:
    """Greedy results of ``policy`` (a model directory or a run's checkpoint) on the first --eval-questions
    held-out questions, one dict of ``algos.evaluation.EVAL_COLUMNS`` and ``hops`` per question."""
    from experiments.evaluate import synthhop_held_out

    return synthhop_held_out(policy, world_data_dir(WORLD), args.eval_questions, args.max_step_tokens, TOPK)


def run_directory(setting: str, seed: int, output: Path) -> Path:
    return output / setting.replace(" ", "_").replace(",", "").replace("(", "").replace(")", "") / f"seed{seed}"


def run_options(setting: str, seed: int, model_dir: str, args: argparse.Namespace, directory: Path) -> list[str]:
    """run.py's options for one training run of ``setting`` from ``model_dir`` into ``directory``."""
    return [*SETTINGS[setting][1], "--env", "SynthHop-v0", "--data-dir", str(world_data_dir(WORLD)),
            "--topk", str(TOPK), "--model", model_dir, "--seed", str(seed), "--iterations", str(args.iterations),
            "--prompts-per-iter", str(args.prompts_per_iter), "--lr", str(args.lr),
            "--max-step-tokens", str(args.max_step_tokens), "--eval-every", str(args.eval_every),
            "--eval-questions", str(args.curve_questions), "--micro-batch-size", "16", "--checkpoint-every", "0",
            "--trees-every", "0", "--no-mlflow", "--quiet", "--output", str(directory)]


def train_run(setting: str, seed: int, model_dir: str, args: argparse.Namespace, output: Path) -> Path:
    """One training run from ``model_dir``; its metrics.jsonl. The final checkpoint is what gets evaluated."""
    from experiments.run import main as run

    directory = run_directory(setting, seed, output)
    if directory.exists():
        shutil.rmtree(directory)  # a fresh run: run.py refuses a directory that already holds one
    run(run_options(setting, seed, model_dir, args, directory))
    return directory / "metrics.jsonl"


def finished_run(setting: str, seed: int, model_dir: str, args: argparse.Namespace,
                 output: Path) -> tuple[list[dict], list[dict[str, float]]]:
    """(metrics rows, held-out scores) of one run: with --resume, those of a finished run in its directory whose
    options and evaluation match this one's; otherwise (or if none) trained and evaluated now. Each finished
    run leaves RUN/held_out.json, so benchmarks split over processes (--seeds) or interrupted reuse its work."""
    directory = run_directory(setting, seed, output)

    def train_and_evaluate() -> list[dict[str, float]]:
        train_run(setting, seed, model_dir, args, output)
        return held_out_scores(str(directory / "checkpoints" / "latest"), args)

    key = {"run": run_options(setting, seed, model_dir, args, directory), "eval_questions": args.eval_questions}
    scores = scores_once(directory / "held_out.json", key, args.resume, train_and_evaluate)
    return load_metrics(directory / "metrics.jsonl"), scores


def start_point_scores(model_dir: str, args: argparse.Namespace, output: Path) -> list[dict[str, float]]:
    """The start point's held-out scores (reused with --resume, as ``finished_run`` does)."""
    key = {"model": model_dir, "eval_questions": args.eval_questions, "max_step_tokens": args.max_step_tokens}
    return scores_once(output / "start_point.json", key, args.resume, lambda: held_out_scores(model_dir, args))


def scores_once(record: Path, key: dict, resume: bool,
                compute: Callable[[], list[dict[str, float]]]) -> list[dict[str, float]]:
    """The scores saved in ``record`` under ``key`` when ``resume`` and they exist; else ``compute()``'s, saved
    there with their key."""
    if resume and record.exists():
        saved = json.loads(record.read_text(encoding="utf-8"))
        if {k: saved.get(k) for k in key} == key:
            print(f"reusing {record}")
            return saved["scores"]
    scores = compute()
    record.write_text(json.dumps({**key, "scores": scores}), encoding="utf-8")
    return scores


def em_matrix(scores: list[list[dict[str, float]]]) -> np.ndarray:
    """Seeds x questions of exact match."""
    return np.array([[row["em"] for row in seed] for seed in scores], dtype=float)


def summarize(runs: dict[str, list[list[dict]]], finals: dict[str, list[list[dict]]],
              before: list[dict[str, float]]) -> dict[str, dict]:
    """Per setting: the final dev EM over seeds x questions with its bootstrap interval, per-seed means, tool
    calls, tokens and seconds per seed."""
    summary = {}
    for setting, seeds in runs.items():
        em = em_matrix(finals[setting])
        summary[setting] = {
            "budget": SETTINGS[setting][0],
            "dev_em_before": interval_dict(mean_interval([row["em"] for row in before])),
            "dev_em": interval_dict(bootstrap_interval(em)),
            "dev_em_per_seed": [float(v) for v in em.mean(axis=1)],
            "failures_before": failure_mix(before),
            "failures": failure_mix([row for seed in finals[setting] for row in seed]),
            "tool_calls": float(np.mean([[row["tool_calls"] for row in seed] for seed in finals[setting]])),
            "tokens_generated_per_seed": [int(sum(r["tokens_generated"] or 0 for r in rows)) for rows in seeds],
            "tool_calls_per_seed": [int(sum(r["tool_calls"] or 0 for r in rows)) for rows in seeds],
            "seconds_per_seed": [float(sum(r["time_s"] or 0 for r in rows)) for rows in seeds],
        }
    return summary


def compare(finals: dict[str, list[list[dict]]]) -> dict[str, dict]:
    """The paired bootstrap interval of every comparison whose two settings ran on the same seeds."""
    out = {}
    for a, b in COMPARISONS:
        if finals.get(a) and finals.get(b) and len(finals[a]) == len(finals[b]):
            out[f"{a} - {b}"] = interval_dict(paired_bootstrap_interval(em_matrix(finals[a]), em_matrix(finals[b])))
    return out


def interval_dict(interval: Interval) -> dict[str, float]:
    return {"mean": interval.mean, "low": interval.low, "high": interval.high}


def verdict(difference: dict[str, float]) -> str:
    """Whether a - b >= 0 (the paper's direction) holds beyond the noise, is reversed beyond it, or neither."""
    if difference["low"] > 0:
        return "a > b beyond the noise: the paper's direction holds"
    if difference["high"] < 0:
        return "a < b beyond the noise: the paper's direction does not hold here"
    return "inside the noise: no difference shown"


def mean_rows(seeds: list[list[dict]], before: float) -> list[dict]:
    """Rows averaged over seeds, iteration by iteration, after the start point (iteration 0) (for the plot);
    ``dev_em_std`` is the spread over seeds."""
    by_iteration: dict[int, list[dict]] = {0: [{"iteration": 0, "tokens_generated": 0, "tool_calls": 0,
                                                "reward_mean": float("nan"), "dev_em": before}]}
    for rows in seeds:
        for row in rows:
            by_iteration.setdefault(row["iteration"], []).append(row)
    out = []
    for it, rows in sorted(by_iteration.items()):
        devs = [r["dev_em"] for r in rows if r.get("dev_em") is not None]
        out.append({"iteration": it, "tokens_generated": float(np.mean([r["tokens_generated"] or 0 for r in rows])),
                    "tool_calls": float(np.mean([r.get("tool_calls") or 0 for r in rows])),
                    "reward_mean": float(np.mean([r["reward_mean"] for r in rows])),
                    "dev_em": float(np.mean(devs)) if devs else None,
                    "dev_em_std": float(np.std(devs)) if devs else None})
    return out


def _interval(d: dict[str, float]) -> str:
    return f"{d['mean']:.3f} [{d['low']:.3f}, {d['high']:.3f}]"


def markdown(summary: dict[str, dict], differences: dict[str, dict], args: argparse.Namespace, warm: str,
             wall_s: float) -> str:
    run_minutes = sum(sum(s["seconds_per_seed"]) for s in summary.values()) / 60
    lines = [f"Warm start: `{warm}`; {args.prompts_per_iter} prompts per iteration, {args.iterations} iterations, "
             f"lr {args.lr}, seeds {args.seeds}; final dev EM: greedy, on the first {args.eval_questions} held-out "
             f"questions, mean over seeds x questions with its 95% bootstrap interval (seeds and questions "
             f"resampled). Training iterations, summed over the runs: {run_minutes:.0f} min (from their metrics; "
             f"warm start and final evaluations not included); this invocation: {wall_s / 60:.0f} min (runs "
             f"reused with --resume cost it nothing).", "",
             "| setting | budget | dev EM before | dev EM after [95% interval] | per seed | tool calls per question "
             "(after) | tokens generated per run | tool calls per run | minutes per run |",
             "|---|---|---|---|---|---|---|---|---|"]
    for setting, s in summary.items():
        seeds = ", ".join(f"{v:.3f}" for v in s["dev_em_per_seed"])
        lines.append(f"| {setting} | {s['budget']} | {_interval(s['dev_em_before'])} | {_interval(s['dev_em'])} | "
                     f"{seeds} | {s['tool_calls']:.2f} | {np.mean(s['tokens_generated_per_seed']):,.0f} | "
                     f"{np.mean(s['tool_calls_per_seed']):,.0f} | {np.mean(s['seconds_per_seed']) / 60:.1f} |")
    lines += ["", "Failure mix of the held-out questions (shares; after: pooled over seeds):", "",
              "| setting | " + " | ".join(FAILURES) + " |", "|---" * (len(FAILURES) + 1) + "|"]
    first = next(iter(summary.values()), None)
    for name, mix in ([("start point", first["failures_before"])] if first else []) + [
            (setting, s["failures"]) for setting, s in summary.items()]:
        lines.append(f"| {name} | " + " | ".join(f"{mix.get(kind, 0.0):.2f}" for kind in FAILURES) + " |")
    if differences:
        lines += ["", "Paired differences of final dev EM (a - b; same seeds, same questions; 95% paired bootstrap):",
                  "", "| a - b | difference [95% interval] | reading |", "|---|---|---|"]
        lines += [f"| {name} | {_interval(d)} | {verdict(d)} |" for name, d in differences.items()]
    return "\n".join(lines) + "\n"


def write_results(runs: dict[str, list[list[dict]]], finals: dict[str, list[list[dict]]],
                  before: list[dict[str, float]], args: argparse.Namespace, warm: str, wall_s: float,
                  output: Path) -> tuple[str, Path]:
    """OUTPUT/learning.md, learning.json and learning.png for the runs so far; (the table, the plot's path)."""
    summary, differences = summarize(runs, finals, before), compare(finals)
    table = markdown(summary, differences, args, warm, wall_s)
    (output / "learning.md").write_text(table, encoding="utf-8")
    payload = {"settings": vars(args), "world": WORLD.key, "summary": summary, "differences": differences}
    (output / "learning.json").write_text(json.dumps(payload, indent=1), encoding="utf-8")
    # the curves' questions: the first --curve-questions held-out ones, the start point's included
    start = float(np.mean([row["em"] for row in before[: args.curve_questions]]))
    plot = plot_runs({name: mean_rows(seeds, start) for name, seeds in runs.items()}, output / "learning.png",
                     metrics=("dev_em", "reward_mean"))
    return table, plot


def main(argv: list[str] | None = None) -> Path:
    args = parse_args(argv)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with exclusive(output / "start.lock"):
        warm = str(Path(args.warm or warm_start(args, output)).resolve())
        before = start_point_scores(warm, args, output)
    print(f"start point {warm}: dev EM {np.mean([row['em'] for row in before]):.3f}")
    runs: dict[str, list[list[dict]]] = {setting: [] for setting in args.settings}
    finals: dict[str, list[list[dict]]] = {setting: [] for setting in args.settings}
    for seed in args.seeds:  # seed-major: an interrupted benchmark still compares every setting
        for setting in args.settings:
            rows, scores = finished_run(setting, seed, warm, args, output)
            runs[setting].append(rows)
            finals[setting].append(scores)
            table, plot = write_results({k: v for k, v in runs.items() if v}, finals, before, args, warm,
                                        time.perf_counter() - start, output)
    print(table)
    if args.report:
        from benchmarks.report import compact_plot_copy, machine_description, replace_section

        command = shlex.join(["python", "benchmarks/bench_learning.py", *(sys.argv[1:] if argv is None else argv)])
        compact_plot_copy(plot, REPORT_PLOT)
        replace_section("docs/benchmarks.md", "learning", "Learning: tree vs chain on SynthHop-v0 (issue 15)",
                        f"Command: `{command}`. Machine: {machine_description()}.\n\n{table}\n"
                        f"![dev EM and training reward, mean over seeds](learning.png)\n\n"
                        f"Plot: `docs/learning.png` (a copy of `{plot}`): dev EM on the first {args.curve_questions} "
                        f"held-out questions and the training reward, mean over seeds against iterations, tokens "
                        f"generated and tool calls (dev EM with a band of one std over seeds).\n")
    return output / "learning.md"


if __name__ == "__main__":
    main()
