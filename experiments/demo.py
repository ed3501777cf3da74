"""The CPU learning demo behind ``make run`` on a machine without a GPU: Tree-GRPO teaches an agent when to
search again, and held-out exact match rises within minutes, with 95% intervals.

    python experiments/demo.py                          # about 12 minutes on 2 cores the first time
    python experiments/demo.py --output outputs/demo2   # again: the world and the warm start come from the cache
    python experiments/demo.py --ppo-mini-batches 1     # any other option goes to run.py (after the demo's own)

The task is SynthHop-v0 on a small generated world (60 people, 30 companies; 240 training and 60 held-out
questions, half of them 1-hop, half 2-hop; one passage per search). The start policy is a 10M-parameter Llama
trained from scratch for about ten minutes on oracle search trajectories of this world and of 9 others (other
names, so it learns to copy names rather than memorise them), in which half the 2-hop questions are answered
right after the first search, with the entity it found: a wrong answer in the right format. So the start
policy copies names well but, at the branch point after its first search, often answers one hop short. The
world and this warm start are built on the first run and cached (``$TREEGRPO_CACHE_DIR``, default
``~/.cache/tree-grpo``), so a second run starts training at once. Then Tree-GRPO, (M, N, L) = (2, 2, 1), 8
prompts per iteration, the paper's update (PPO mini-batches, warm-up). Sibling leaves that branch after the
same first search, one answering and one searching again, earn different rewards: the step-level signal the
trees give. (Chain GRPO learns the second search as well on this task: docs/benchmarks.md, "Learning: tree vs
chain".)

Before and after, the same held-out questions are answered greedily; the summary gives each metric's mean with
its 95% interval and the paired change (per question) with its interval, the failure mix, the tokens generated,
and where the plot, the sampled trees and the MLflow store are. Everything lands in ``--output``:
``summary.md``, ``summary.json`` and the run's own files (``metrics.jsonl``, ``learning_curve.png``, ``trees/``,
``checkpoints/``, ``mlflow.db``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from algos.evaluation import failure_mix, mean_results, occurring_failures
from algos.tree_grpo import metrics as metric_keys
from envs.cache import default_cache_dir
from envs.synthetic import WorldSpec, world_data_dir
from experiments.confidence import mean_interval, paired_difference_interval
from experiments.evaluate import world_held_out
from experiments.warmstart import cached_warm_start

WORLD = WorldSpec(seed=0, people=60, companies=30, cities=12, countries=5, train_questions=240, dev_questions=60,
                  hop_mix=(0.5, 0.5, 0.0))
TOPK = 1  # one passage per search: a short context, in which a model trained for minutes learns to copy names
MAX_STEP_TOKENS = 48
# the warm start: oracle trajectories of 10 worlds, half the 2-hop ones answering one hop short (one cached start
# for every --seed)
WARM_START = ("--extra-worlds", "9", "--epochs", "4", "--premature", "0.5", "--batch-size", "8", "--lr", "3e-3",
              "--seed", "0")
SUMMARY_METRICS = {"em": "exact match", "answered": "answer rate", "reward": "reward", "tool_calls": "tool calls"}


def compare(before: Sequence[Mapping[str, float]], after: Sequence[Mapping[str, float]]) -> dict[str, Any]:
    """Per metric: the mean before and after with 95% intervals, and the paired change with its interval; and
    the failure mix before and after."""
    metrics = {}
    for key in SUMMARY_METRICS:
        b, a = [row[key] for row in before], [row[key] for row in after]
        metrics[key] = {"before": mean_interval(b), "after": mean_interval(a),
                        "change": paired_difference_interval(b, a)}
    mix = {"before": failure_mix(before), "after": failure_mix(after)}
    return {"metrics": metrics, "failures": mix, "questions": len(before)}


def summary_text(comparison: Mapping[str, Any], run_dir: Path, rows: Sequence[Mapping[str, Any]],
                 minutes: float) -> str:
    """The summary a person reads in seconds (markdown, also printed)."""
    lines = [f"## Tree-GRPO demo: held-out SynthHop questions, before and after ({comparison['questions']} "
             f"questions, greedy; 95% intervals)", "",
             "| metric | before | after | change (paired) | beyond noise |", "|---|---|---|---|---|"]
    for key, label in SUMMARY_METRICS.items():
        m = comparison["metrics"][key]
        lines.append(f"| {label} | {m['before']} | {m['after']} | {m['change']} | "
                     f"{'yes' if m['change'].excludes(0.0) else 'no'} |")
    lines += ["", "| outcome | before | after |", "|---|---|---|"]
    mix = comparison["failures"]
    lines += [f"| {kind} | {mix['before'].get(kind, 0.0):.0%} | {mix['after'].get(kind, 0.0):.0%} |"
              for kind in occurring_failures(mix["before"], mix["after"])]
    tokens = sum(row.get(metric_keys.TOKENS_GENERATED) or 0 for row in rows)
    tool_calls = sum(row.get(metric_keys.TOOL_CALLS) or 0 for row in rows)
    trees = sorted((run_dir / "trees").glob("*.html"))
    mlflow_db = run_dir / "mlflow.db"
    lines += ["", f"Training: {len(rows)} iterations, {tokens:,} tokens generated, {tool_calls:,} tool calls, "
                  f"{minutes:.1f} minutes in all.", "",
              f"- learning curve: {run_dir / 'learning_curve.png'}",
              f"- sampled trees: {trees[-1] if trees else '(none exported)'}",
              f"- per-iteration metrics: {run_dir / 'metrics.jsonl'}"]
    if mlflow_db.exists():
        lines.append(f"- MLflow: `mlflow ui --backend-store-uri sqlite:///{mlflow_db} --host 127.0.0.1`")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output", default="outputs/demo", help="the run's directory (replaced if it holds a demo run)")
    p.add_argument("--iterations", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--seed", type=int, default=0, help="the training run's seed (the warm start is one, cached)")
    p.add_argument("--questions", type=int, default=WORLD.dev_questions, help="held-out questions evaluated")
    p.add_argument("--no-mlflow", action="store_true", help="do not track the run in MLflow")
    args, args.run_args = p.parse_known_args(argv)
    for name in ("iterations", "questions"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if not 0 < args.lr < 1:
        p.error(f"--lr must be in (0, 1), got {args.lr}")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    import time

    from experiments.plot import load_metrics
    from experiments.run import main as run
    from experiments.tracking import METRICS_FILE

    args = parse_args(argv)
    start = time.perf_counter()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    cache_dir = default_cache_dir()
    data_dir = world_data_dir(WORLD, cache_dir)
    model = cached_warm_start(WORLD, WARM_START, topk=TOPK, cache_dir=cache_dir)
    print(f"held-out questions: evaluating the start policy on {args.questions} ...", flush=True)
    before = world_held_out(model, data_dir, args.questions, MAX_STEP_TOKENS, TOPK)
    output = Path(args.output).resolve()
    if (output / "demo.json").exists() or (output / METRICS_FILE).exists():
        shutil.rmtree(output)  # a demo's own earlier run: the demo always starts fresh
    latest = run(["--env", "SynthHop-v0", "--data-dir", str(data_dir), "--topk", str(TOPK), "--model", str(model),
                  "--max-step-tokens", str(MAX_STEP_TOKENS), "--seed", str(args.seed), "--M", "2", "--N", "2",
                  "--L", "1", "--iterations", str(args.iterations), "--prompts-per-iter", "8", "--lr", str(args.lr),
                  "--micro-batch-size", "16", "--eval-every", "0", "--checkpoint-every", "0",
                  "--trees-every", str(args.iterations), "--trees-count", "2", "--quiet", "--output", str(output),
                  *(["--no-mlflow"] if args.no_mlflow else []), *args.run_args])
    print(f"held-out questions: evaluating the trained policy on {args.questions} ...", flush=True)
    after = world_held_out(latest, data_dir, args.questions, MAX_STEP_TOKENS, TOPK)
    comparison = compare(before, after)
    text = summary_text(comparison, output, load_metrics(output / METRICS_FILE), (time.perf_counter() - start) / 60)
    payload = {"settings": vars(args), "world": asdict(WORLD), "warm_start": str(model),
               "before": mean_results(before), "after": mean_results(after),
               "metrics": {k: {part: asdict(i) for part, i in v.items()} for k, v in comparison["metrics"].items()},
               "failures": comparison["failures"], "questions": {"before": before, "after": after}}
    (output / "demo.json").write_text(json.dumps(payload, indent=1), encoding="utf-8")
    (output / "summary.md").write_text(text, encoding="utf-8")
    print("\n" + text, flush=True)
    return payload


if __name__ == "__main__":
    main()
