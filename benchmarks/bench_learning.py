"""Learning benchmark on SynthHop-v0: tree vs chain at matched budgets, from the same warm start, several seeds.

    python benchmarks/bench_learning.py                      # warm start (~45 min) + 5 settings x 3 seeds (~80 min)
    python benchmarks/bench_learning.py --warm outputs/bench_learning/warm2/model          # reuse a warm start
    python benchmarks/bench_learning.py --quick --warm DIR   # 1 seed, 6 iterations, 60 questions (~15 min)

Settings (the paper's budget table, in full-chain equivalents): tree (2,2,1) at budget 4 against chain G=4 and
chain G=16; tree (1,2,1) against chain G=2 at budget 2. Every run has the same prompts per iteration, the same
learning rate and the same warm-started start point; dev EM (greedy, held-out questions) is measured before RL
and every --eval-every iterations. Runs go seed by seed, and the results are rewritten after each run:
OUTPUT/learning.md, learning.json, learning.png (mean dev EM over seeds against iterations and against tokens
generated) and, with --report at the end, the ``learning`` section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np

from experiments.plot import load_metrics, plot_runs

# name -> (budget in full chains, run.py options)
SETTINGS: dict[str, tuple[int, list[str]]] = {
    "tree (2,2,1)": (4, ["--algo", "tree_grpo", "--M", "2", "--N", "2", "--L", "1"]),
    "chain G=4": (4, ["--algo", "grpo", "--group-size", "4"]),
    "chain G=16": (16, ["--algo", "grpo", "--group-size", "16"]),
    "tree (1,2,1)": (2, ["--algo", "tree_grpo", "--M", "1", "--N", "2", "--L", "1"]),
    "chain G=2": (2, ["--algo", "grpo", "--group-size", "2"]),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--warm", default=None, help="warm-started model directory (default: run warmstart.py first)")
    p.add_argument("--quick", action="store_true", help="1 seed, 6 iterations, 60 dev questions")
    p.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--iterations", type=int, default=12)
    p.add_argument("--prompts-per-iter", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--eval-every", type=int, default=6)
    p.add_argument("--eval-questions", type=int, default=100)
    # Not the project's default cap (128 on CPU): SynthHop steps are short (about 50 tokens for a whole leaf in the
    # rollout benchmark), so 64 holds any step the warm start writes and cuts runaway ones early on a CPU; it is
    # also warmstart.py's dev-evaluation cap, so the warm start's dev EM and the runs' are measured alike.
    p.add_argument("--max-step-tokens", type=int, default=64)
    p.add_argument("--output", default="outputs/bench_learning")
    p.add_argument("--report", action="store_true", help="write the learning section of docs/benchmarks.md")
    args = p.parse_args(argv)
    if args.quick:
        args.seeds, args.iterations, args.eval_every, args.eval_questions = args.seeds[:1], 6, 3, 60
    return args


# The warm start: oracle SFT of a 10M-parameter Llama on the train questions of SynthHop-v0's world and of 4
# other worlds (names differ, so copying is learned rather than memorising), then a warm restart at half the
# learning rate. It takes about 40 min on 2 CPU cores.
WARM_START_STAGES: tuple[list[str], ...] = (
    ["--model", "scratch", "--extra-worlds", "4", "--batch-size", "8", "--epochs", "3", "--lr", "3e-3"],
    ["--extra-worlds", "4", "--batch-size", "8", "--epochs", "2", "--lr", "1.5e-3"],
)


def warm_start(args: argparse.Namespace, output: Path) -> Path:
    from experiments.warmstart import main as warmstart

    model = None
    for stage, options in enumerate(WARM_START_STAGES, 1):
        start = [] if model is None else ["--model", str(model)]
        model = warmstart([*options, *start, "--env", "SynthHop-v0", "--output", str(output / f"warm{stage}"),
                           "--dev-questions", str(args.eval_questions), "--max-step-tokens", str(args.max_step_tokens)])
    return model


def dev_em_before(model_dir: str, args: argparse.Namespace) -> float:
    """Greedy dev EM of the start point, with the evaluation settings the runs use."""
    import envs
    from algos.evaluation import mean_results
    from envs.datasets import resolve_data_dir
    from experiments.evaluate import evaluate_env
    from policies.generation import SamplingSettings
    from policies.generators import step_generator
    from policies.models import load_model

    model, tokenizer = load_model(model_dir)
    sampling = SamplingSettings(greedy=True, max_step_tokens=args.max_step_tokens)
    rows = evaluate_env("SynthHop-v0", step_generator("hf", model, tokenizer, sampling), tokenizer,
                        split=envs.eval_split("SynthHop-v0"), limit=args.eval_questions, batch_size=32,
                        env_kwargs={"data_dir": str(resolve_data_dir(None).resolve()), "max_turns": 3, "topk": 3})
    return mean_results(rows)["em"]


def train_run(setting: str, seed: int, model_dir: str, args: argparse.Namespace, output: Path) -> Path:
    from experiments.run import main as run

    directory = output / setting.replace(" ", "_").replace(",", "").replace("(", "").replace(")", "") / f"seed{seed}"
    if directory.exists():
        shutil.rmtree(directory)  # a fresh run: run.py refuses a directory that already holds one
    run([*SETTINGS[setting][1], "--env", "SynthHop-v0", "--model", model_dir, "--seed", str(seed),
         "--iterations", str(args.iterations), "--prompts-per-iter", str(args.prompts_per_iter), "--lr", str(args.lr),
         "--max-step-tokens", str(args.max_step_tokens), "--eval-every", str(args.eval_every),
         "--eval-questions", str(args.eval_questions), "--micro-batch-size", "16", "--checkpoint-every", "0",
         "--trees-every", "0", "--no-mlflow", "--quiet", "--output", str(directory)])
    return directory / "metrics.jsonl"


def summarize(runs: dict[str, list[list[dict]]], before: float) -> dict[str, dict]:
    """Per setting: dev EM per evaluated iteration (mean, std, per seed), tokens and seconds per seed."""
    summary = {}
    for setting, seeds in runs.items():
        evaluated = sorted({r["iteration"] for rows in seeds for r in rows if r.get("dev_em") is not None})
        curve = {it: [next(r["dev_em"] for r in rows if r["iteration"] == it) for rows in seeds] for it in evaluated}
        final = curve[evaluated[-1]] if evaluated else []
        summary[setting] = {
            "budget": SETTINGS[setting][0], "dev_em_before": before,
            "dev_em_by_iteration": {it: {"mean": float(np.mean(v)), "std": float(np.std(v)), "seeds": v}
                                    for it, v in curve.items()},
            "dev_em_final_mean": float(np.mean(final)) if final else None,
            "dev_em_final_std": float(np.std(final)) if final else None,
            "tokens_generated_per_seed": [int(sum(r["tokens_generated"] or 0 for r in rows)) for rows in seeds],
            "train_reward_last": [rows[-1]["reward_mean"] for rows in seeds],
            "seconds_per_seed": [float(sum(r["time_s"] or 0 for r in rows)) for rows in seeds],
        }
    return summary


def mean_rows(seeds: list[list[dict]], before: float) -> list[dict]:
    """Rows averaged over seeds, iteration by iteration, after the start point (iteration 0) (for the plot);
    ``dev_em_std`` is the spread over seeds."""
    by_iteration: dict[int, list[dict]] = {0: [{"iteration": 0, "tokens_generated": 0, "reward_mean": float("nan"),
                                                "dev_em": before}]}
    for rows in seeds:
        for row in rows:
            by_iteration.setdefault(row["iteration"], []).append(row)
    out = []
    for it, rows in sorted(by_iteration.items()):
        devs = [r["dev_em"] for r in rows if r.get("dev_em") is not None]
        out.append({"iteration": it, "tokens_generated": float(np.mean([r["tokens_generated"] or 0 for r in rows])),
                    "reward_mean": float(np.mean([r["reward_mean"] for r in rows])),
                    "dev_em": float(np.mean(devs)) if devs else None,
                    "dev_em_std": float(np.std(devs)) if devs else None})
    return out


def markdown(summary: dict[str, dict], args: argparse.Namespace, warm: str, wall_s: float) -> str:
    lines = [f"Warm start: `{warm}`; {args.prompts_per_iter} prompts per iteration, {args.iterations} iterations, "
             f"lr {args.lr}, seeds {args.seeds}, dev EM on the first {args.eval_questions} held-out questions "
             f"(greedy), every {args.eval_every} iterations. Whole benchmark: {wall_s / 60:.0f} min.", "",
             "| setting | budget | dev EM before | dev EM after (mean ± std) | per seed | tokens generated (mean) "
             "| EM gain per 100k tokens | minutes per seed |",
             "|---|---|---|---|---|---|---|---|"]
    for setting, s in summary.items():
        final = s["dev_em_final_mean"]
        tokens = float(np.mean(s["tokens_generated_per_seed"]))
        last = max(s["dev_em_by_iteration"]) if s["dev_em_by_iteration"] else None
        seeds = ", ".join(f"{v:.3f}" for v in s["dev_em_by_iteration"][last]["seeds"]) if last else "-"
        gain = "-" if final is None else f"{(final - s['dev_em_before']) / tokens * 1e5:+.3f}"
        after = "-" if final is None else f"{final:.3f} ± {s['dev_em_final_std']:.3f}"
        lines.append(f"| {setting} | {s['budget']} | {s['dev_em_before']:.3f} | {after} | {seeds} | {tokens:,.0f} | "
                     f"{gain} | {np.mean(s['seconds_per_seed']) / 60:.1f} |")
    return "\n".join(lines) + "\n"


def write_results(runs: dict[str, list[list[dict]]], before: float, args: argparse.Namespace, warm: str,
                  wall_s: float, output: Path) -> tuple[str, Path]:
    """OUTPUT/learning.md, learning.json and learning.png for the runs so far; (the table, the plot's path)."""
    summary = summarize(runs, before)
    table = markdown(summary, args, warm, wall_s)
    (output / "learning.md").write_text(table, encoding="utf-8")
    (output / "learning.json").write_text(json.dumps({"settings": vars(args), "summary": summary}, indent=1),
                                          encoding="utf-8")
    plot = plot_runs({name: mean_rows(seeds, before) for name, seeds in runs.items()}, output / "learning.png",
                     metrics=("dev_em", "reward_mean"))
    return table, plot


def main(argv: list[str] | None = None) -> Path:
    args = parse_args(argv)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    warm = str(Path(args.warm or warm_start(args, output)).resolve())
    before = dev_em_before(warm, args)
    print(f"start point {warm}: dev EM {before:.3f}")
    runs: dict[str, list[list[dict]]] = {setting: [] for setting in args.settings}
    for seed in args.seeds:  # seed-major: an interrupted benchmark still compares every setting
        for setting in args.settings:
            runs[setting].append(load_metrics(train_run(setting, seed, warm, args, output)))
            table, plot = write_results({k: v for k, v in runs.items() if v}, before, args, warm,
                                        time.perf_counter() - start, output)
    print(table)
    if args.report:
        from benchmarks.report import machine_description, replace_section

        command = " ".join(["python benchmarks/bench_learning.py", *(sys.argv[1:] if argv is None else argv)])
        replace_section("docs/benchmarks.md", "learning", "Learning: tree vs chain on SynthHop-v0 (issue 6)",
                        f"Command: `{command}`. Machine: {machine_description()}.\n\n{table}\n"
                        f"Plot: `{plot}` (mean over seeds, a band of one std; not committed).\n")
    return output / "learning.md"


if __name__ == "__main__":
    main()
