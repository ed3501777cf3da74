"""Sweep Tree-GRPO settings with Ray Tune, every trial tracked in MLflow.

    python experiments/tune.py --grid M=1,2 --grid N=2,4 --iterations 10                # any config field
    python experiments/tune.py --budget 4 --iterations 10 --seeds 0 1 2               # tree vs chain at budget 4
    python experiments/tune.py --budget 2 4 8 16 --iterations 20 --eval-every 5       # the paper's budget table
    python experiments/tune.py --config experiments/configs/hotpotqa_tree.yaml --grid lr=1e-6,3e-6

Every run.py option sets the base config (``--config FILE`` too). ``--grid KEY=V1,V2`` sweeps a field of the
algorithm config (M, N, L, lr, kl_coef, temperature, ...; the cross product of all grids). ``--budget B``
is the matched-budget mode: for each budget in full-chain equivalents, the tree shapes whose cost matches it
(``--shapes paper``: the paper's shape; ``all``: every shape within ``--tolerance``) and chain GRPO with
G = B. Trials run as many at a time as Ray's resources allow. Writes OUTPUT/tune_results.md and .json (trials
sorted by ``--metric``) and tracks every trial in MLflow (default ``sqlite:///OUTPUT/mlflow.db``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
from pathlib import Path
from typing import Any

from algos.rollout import TreeShape
from algos.tree_grpo import TreeGRPO
from experiments.run import build_config, build_parser, check_resources
from experiments.run import parse_args as parse_run_args
from experiments.tracking import default_tracking_uri, ensure_experiment

# The paper's budget table (notes/tree-grpo.md): budget in full chains -> tree (M, N, L); chain GRPO uses G = budget.
PAPER_SHAPES: dict[int, TreeShape] = {2: TreeShape(1, 2, 1), 4: TreeShape(2, 2, 1), 8: TreeShape(2, 6, 1),
                                      16: TreeShape(4, 5, 1)}
SHAPE_FIELDS = ("M", "N", "L", "advantage_mode")
REWARD = "env_runners/reward_mean"


def shape_cost(shape: TreeShape, expansion_cost: float = 0.5) -> float:
    """Cost per prompt in full chains when one expansion costs ``expansion_cost`` chains (the paper: 0.5)."""
    return shape.M * (1 + shape.L * shape.N * expansion_cost)


def shapes_for_budget(budget: float, *, expansion_cost: float = 0.5, tolerance: float = 0.15, max_L: int = 2,
                      ) -> list[TreeShape]:
    """Every tree shape (L >= 1, M < budget) whose cost is within ``tolerance`` (relative) of ``budget``,
    closest first, then by fewer trees."""
    shapes = []
    for L in range(1, max_L + 1):
        for M in range(1, max(1, math.ceil(budget))):
            # the cost grows with N: try the N values around the exact match
            exact = (budget / M - 1) / (L * expansion_cost)
            for N in {math.floor(exact), math.ceil(exact)}:
                if N >= 1 and abs(shape_cost(TreeShape(M, N, L), expansion_cost) - budget) <= tolerance * budget:
                    shapes.append(TreeShape(M, N, L))
    return sorted(set(shapes), key=lambda s: (abs(shape_cost(s, expansion_cost) - budget), s.M, s.L, s.N))


def budget_points(budgets: list[float], mode: str, *, expansion_cost: float = 0.5,
                  tolerance: float = 0.15) -> list[dict[str, Any]]:
    """The trials of the matched-budget mode: per budget the tree shapes (``paper`` or ``all``) and the chain of
    group size G = budget, as config fields."""
    points = []
    for budget in budgets:
        if mode == "paper":
            if budget not in PAPER_SHAPES:
                raise ValueError(f"the paper's table has budgets {sorted(PAPER_SHAPES)}, not {budget:g}; "
                                 f"use --shapes all for other budgets")
            trees = [PAPER_SHAPES[int(budget)]]
        else:
            trees = shapes_for_budget(budget, expansion_cost=expansion_cost, tolerance=tolerance)
        points += [{"M": s.M, "N": s.N, "L": s.L, "advantage_mode": "tree"} for s in trees]
        if budget != int(budget):
            raise ValueError(f"a chain group needs a whole number of chains, got budget {budget:g}")
        points.append({"M": int(budget), "N": 0, "L": 0, "advantage_mode": "inter"})
    return points


def parse_value(text: str) -> Any:
    """A grid value: int, float, bool, None, else the string."""
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            pass
    return {"true": True, "false": False, "none": None}.get(text.lower(), text)


def parse_grid(items: list[str], fields: set[str]) -> dict[str, list[Any]]:
    """``["M=1,2", "lr=1e-6,3e-6"]`` -> ``{"M": [1, 2], "lr": [1e-06, 3e-06]}``; unknown fields are errors."""
    grid = {}
    for item in items:
        key, sep, values = item.partition("=")
        if not sep or not values:
            raise ValueError(f"--grid takes KEY=V1,V2,...; got {item!r}")
        if key not in fields:
            raise ValueError(f"--grid: {key!r} is not a field of the algorithm config (e.g. M, N, L, lr, kl_coef)")
        grid[key] = [parse_value(v) for v in values.split(",")]
    return grid


def sweep_points(grid: dict[str, list[Any]], shapes: list[dict[str, Any]], seeds: list[int]) -> list[dict[str, Any]]:
    """Every trial's overrides: the cross product of the grids, the shapes (if any) and the seeds."""
    keys = list(grid)
    combos = [dict(zip(keys, values, strict=True)) for values in itertools.product(*grid.values())]
    return [{**combo, **shape, "seed": seed} for combo in combos for shape in (shapes or [{}]) for seed in seeds]


def build_tune_parser() -> argparse.ArgumentParser:
    parser = build_parser()
    parser.description = __doc__
    parser.set_defaults(output="outputs/tune", iterations=5, checkpoint_every=0, trees_every=0, quiet=True)
    tune = parser.add_argument_group("sweep")
    tune.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2", help="sweep a config field")
    tune.add_argument("--budget", type=float, nargs="+", default=None,
                      help="matched-budget mode: budgets in full-chain equivalents")
    tune.add_argument("--shapes", choices=["paper", "all"], default="paper", help="tree shapes of a budget")
    tune.add_argument("--expansion-cost", type=float, default=0.5,
                      help="one expansion in full chains (paper 0.5; a measured value, e.g. 0.7, works too)")
    tune.add_argument("--tolerance", type=float, default=0.15, help="relative budget mismatch allowed (--shapes all)")
    tune.add_argument("--seeds", type=int, nargs="+", default=None, help="default: --seed")
    tune.add_argument("--time-budget-s", type=float, default=None, help="stop each trial after this many seconds")
    tune.add_argument("--metric", default=None, help="sort key (default: dev_em with --eval-every, else "
                                                     "env_runners/reward_mean)")
    tune.add_argument("--max-concurrent", type=int, default=0, help="trials at a time (0: as resources allow)")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_tune_parser()
    args = parse_run_args(argv, parser)
    if args.resume:
        parser.error("--resume is not a sweep option: restore a trial with Tuner.restore on OUTPUT")
    return args


def trial_table(rows: list[dict[str, Any]], metric: str) -> str:
    """Markdown: one line per trial, best ``metric`` first (trials without it last)."""
    columns = list(dict.fromkeys(["trial", *SHAPE_FIELDS, "seed", "iterations", metric, REWARD, "tokens_generated",
                                  "budget_chains_measured"]))
    rows = sorted(rows, key=lambda r: (r.get(metric) is None, -(r.get(metric) or 0.0)))
    lines = ["| " + " | ".join(columns) + " |", "|---" * len(columns) + "|"]
    for row in rows:
        cells = [f"{v:.4g}" if isinstance(v, float) else "-" if v is None else str(v)
                 for v in (row.get(c) for c in columns)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def trial_summary(result, metric: str) -> dict[str, Any]:
    """One trial's row: its settings, the last value of ``metric`` it reported, its total tokens."""
    frame = result.metrics_dataframe
    config = result.config

    def last(column: str) -> float | None:
        if frame is None or column not in frame:
            return None
        values = frame[column].dropna()
        return float(values.iloc[-1]) if len(values) else None

    tokens = frame["env_runners/tokens_generated"].sum() if frame is not None and \
        "env_runners/tokens_generated" in frame else None
    return {"trial": Path(result.path).name, **{f: config.get(f) for f in SHAPE_FIELDS}, "seed": config.get("seed"),
            "iterations": last("training_iteration"), metric: last(metric),
            REWARD: last(REWARD), "tokens_generated": None if tokens is None else
            float(tokens), "budget_chains_measured": last("env_runners/budget_chains_measured"),
            "error": str(result.error) if result.error else None}


def main(argv: list[str] | None = None) -> Path:
    args = parse_args(argv)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray
    from ray import tune
    from ray.air.integrations.mlflow import MLflowLoggerCallback
    from ray.tune.search.basic_variant import BasicVariantGenerator

    output = Path(args.output).resolve()
    output.mkdir(parents=True, exist_ok=True)
    base = build_config(args)
    try:
        grid = parse_grid(args.grid, set(base.to_dict()))
        shapes = budget_points(args.budget, args.shapes, expansion_cost=args.expansion_cost,
                               tolerance=args.tolerance) if args.budget else []
    except ValueError as error:
        build_tune_parser().error(str(error))
    points = sweep_points(grid, shapes, args.seeds or [args.seed])
    metric = args.metric or ("dev_em" if args.eval_every else REWARD)
    print(f"{len(points)} trials: " + "; ".join(", ".join(f"{k}={v}" for k, v in p.items()) for p in points))

    if not ray.is_initialized():
        ray.init(num_cpus=os.cpu_count(), object_store_memory=1_000_000_000, include_dashboard=False,
                 log_to_driver=False)
    check_resources(args, ray.cluster_resources())
    # Explicit trials (points_to_evaluate) instead of grid_search: the budget mode's shapes are a list, not a
    # cross product. The searched keys need a domain in the space for the points to fill.
    space = base.to_dict()
    for key in points[0]:
        space[key] = tune.choice(sorted({p[key] for p in points}, key=str))
    space["trees_dir"] = None  # each trial writes its trees into its own directory (uploaded to MLflow at its end)
    tracking_uri = args.mlflow_uri or default_tracking_uri(output)
    if not args.no_mlflow:  # created here so that its artifacts go beside the store, not into ./mlruns
        from mlflow.tracking import MlflowClient

        ensure_experiment(MlflowClient(tracking_uri), args.experiment, tracking_uri)
    callbacks = [] if args.no_mlflow else [MLflowLoggerCallback(
        tracking_uri=tracking_uri, experiment_name=args.experiment,
        save_artifact=True, tags={"algo": args.algo, "env": args.env, "model": args.model, "sweep": output.name})]
    stop = {"training_iteration": args.iterations}
    if args.time_budget_s:
        stop["time_total_s"] = args.time_budget_s
    tuner = tune.Tuner(
        TreeGRPO if shapes else base.algo_class,  # chain GRPO is TreeGRPO with L = 0 and inter advantages
        param_space=space,
        tune_config=tune.TuneConfig(
            search_alg=BasicVariantGenerator(points_to_evaluate=points), num_samples=len(points),
            max_concurrent_trials=args.max_concurrent or None),
        run_config=tune.RunConfig(
            name="sweep", storage_path=str(output), stop=stop, callbacks=callbacks, verbose=1,
            checkpoint_config=tune.CheckpointConfig(checkpoint_frequency=args.checkpoint_every,
                                                    checkpoint_at_end=True, num_to_keep=1)),
    )
    results = tuner.fit()
    rows = [trial_summary(result, metric) for result in results]
    table = trial_table(rows, metric)
    (output / "tune_results.md").write_text(table, encoding="utf-8")
    (output / "tune_results.json").write_text(json.dumps({"metric": metric, "trials": rows}, indent=1),
                                              encoding="utf-8")
    print(table)
    print(f"results: {output / 'tune_results.md'}; trials: {output / 'sweep'}")
    return output / "tune_results.md"


if __name__ == "__main__":
    main()
