"""Sweep Tree-GRPO settings with Ray Tune, every trial tracked in MLflow.

    python experiments/tune.py --grid M=1,2 --grid N=2,4 --iterations 10                # any config field
    python experiments/tune.py --budget 4 --iterations 10 --seeds 0 1 2               # tree vs chain at budget 4
    python experiments/tune.py --budget 2 4 8 16 --iterations 20 --eval-every 5       # the paper's budget table
    python experiments/tune.py --config experiments/configs/hotpotqa_tree.yaml --grid lr=1e-6,3e-6
    python experiments/tune.py --resume outputs/tune                                  # continue after Ctrl-C

Every run.py option sets the base settings (``--config FILE`` too). ``--grid KEY=V1,V2`` sweeps a setting of the
algorithm (M, N, L, lr, kl_coef, temperature, ...; the cross product of all grids; a key with one value sets it for
every trial); values are read as YAML scalars and every trial's settings are checked, like run.py's, before Ray
starts. ``--budget B`` is the matched-budget mode: for each budget in full-chain equivalents, the tree shapes whose
cost matches it (``--shapes paper``: the paper's shape; ``all``: every shape within ``--tolerance``) and chain GRPO
with G = B (``algo: grpo``, the same code path). Trials run as many at a time as Ray's resources allow. Every trial
is tracked as run.py's runs are (the ``RunTracker`` callback: its directory's metrics.jsonl and trees, one MLflow
run per trial under run.py's param names, default store ``sqlite:///OUTPUT/mlflow.db``). Writes
OUTPUT/tune_results.md and .json (trials sorted by ``--metric``, a metrics.jsonl column). The defaults differ from
run.py's where a sweep needs it (``--output outputs/tune``, ``--iterations 5``, no periodic checkpoints or trees,
one checkpoint kept; ``--help`` shows them). run.py's own options, which a sweep does not act on (``SWEEP_IGNORES``:
--final-eval, --eval-envs, --run-name), are refused on the command line and named from a --config file. An
--output that already holds a sweep is refused: one directory, one sweep, one table; ``--resume OUTPUT`` continues
an interrupted one (Ctrl-C) with its own options (docs/tracking.md).
"""

from __future__ import annotations

import argparse
import copy
import difflib
import functools
import itertools
import json
import math
import os
import shlex
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from algos.rollout import TreeShape
from algos.tree_grpo import TreeGRPO
from algos.tree_grpo import metrics as metric_keys
from algos.tree_grpo.settings import ALGORITHM_FIELDS
from experiments.cli import (
    SettingsError,
    Sources,
    build_parser,
    check_output_directory,
    flag,
    given_options,
    validate,
    yaml_scalar,
)
from experiments.preflight import check_before_ray, check_resources, node_resources, prepare_start, start_ray
from experiments.settings import (
    CLI_ALIASES,
    RunSettings,
    build_config,
    check_chain_shape,
    help_sections,
    tracked_params,
)
from experiments.tracking import (
    METRICS_FILE,
    EndTrialRuns,
    RunTracker,
    default_tracking_uri,
    ensure_experiment,
    metric_columns,
    read_rows,
    trial_unfinished,
)

# The paper's budget table (arXiv 2509.21240): budget in full chains -> tree (M, N, L); chain GRPO uses G = budget.
PAPER_SHAPES: dict[int, TreeShape] = {2: TreeShape(1, 2, 1), 4: TreeShape(2, 2, 1), 8: TreeShape(2, 6, 1),
                                      16: TreeShape(4, 5, 1)}
GRID_FIELDS = (*ALGORITHM_FIELDS, "seed")  # what a trial may vary: the algorithm's settings and the seed
SUMMARY_FIELDS = ("algo", "M", "N", "L", "advantage_mode")
SWEEP_COMMAND = "sweep_command.json"  # the sweep's options (its command line and directory), read by --resume
SWEEP_FILES = ("sweep", SWEEP_COMMAND, "tune_results.md", "tune_results.json")  # any of them: --output holds a sweep
SWEEP_DEFAULTS = {"output": "outputs/tune", "iterations": 5, "checkpoint_every": 0, "keep_checkpoints": 1,
                  "trees_every": 0, "log_rollout_steps": False}
# run.py's options that a sweep does not act on, and why: given on the command line they are refused, from a
# --config file (a run's file, which may set them for run.py) named on stderr
SWEEP_IGNORES = {
    "final_eval": "a trial ends without run.py's final evaluation (--eval-every evaluates during a trial; "
                  "experiments/evaluate.py evaluates a trial's checkpoint)",
    "eval_envs": "the envs of run.py's final evaluation, which a trial does not run",
    "run_name": "each trial's MLflow run is named after its trial directory",
}


def shapes_for_budget(budget: float, *, expansion_cost: float = 0.5, tolerance: float = 0.15, max_L: int = 2,
                      ) -> list[TreeShape]:
    """Every tree shape (L >= 1, M < budget) whose cost is within ``tolerance`` (relative) of ``budget``,
    closest first, then by fewer trees."""
    shapes = []
    for L in range(1, max_L + 1):
        for M_ in range(1, max(1, math.ceil(budget))):
            # the cost grows with N: try the N values around the exact match
            exact = (budget / M_ - 1) / (L * expansion_cost)
            for N in {math.floor(exact), math.ceil(exact)}:
                if N >= 1 and abs(TreeShape(M_, N, L).cost(expansion_cost) - budget) <= tolerance * budget:
                    shapes.append(TreeShape(M_, N, L))
    return sorted(set(shapes), key=lambda s: (abs(s.cost(expansion_cost) - budget), s.M, s.L, s.N))


def budget_points(budgets: list[float], mode: str, *, expansion_cost: float = 0.5,
                  tolerance: float = 0.15) -> list[dict[str, Any]]:
    """The trials of the matched-budget mode: per budget the tree shapes (``paper`` or ``all``) and chain GRPO
    with G = budget, as settings."""
    points = []
    for budget in budgets:
        if mode == "paper":
            if budget not in PAPER_SHAPES:
                raise SettingsError(f"--budget: the paper's table has budgets {sorted(PAPER_SHAPES)}, not "
                                    f"{budget:g}; use --shapes all for other budgets")
            trees = [PAPER_SHAPES[int(budget)]]
        else:
            trees = shapes_for_budget(budget, expansion_cost=expansion_cost, tolerance=tolerance)
        points += [{"algo": "tree_grpo", "M": s.M, "N": s.N, "L": s.L, "advantage_mode": "tree"} for s in trees]
        if budget != int(budget):
            raise SettingsError(f"--budget: a chain group needs a whole number of chains, got {budget:g}")
        points.append({"algo": "grpo", "group_size": int(budget)})
    return points


def parse_grid(items: list[str]) -> dict[str, list[Any]]:
    """``["M=1,2", "lr=1e-6,3e-6"]`` -> ``{"M": [1, 2], "lr": [1e-06, 3e-06]}`` (values as YAML scalars; checked
    later with the trial's settings); unknown fields are errors."""
    grid = {}
    for item in items:
        key, sep, values = item.partition("=")
        if not sep or not values:
            raise SettingsError(f"--grid takes KEY=V1,V2,...; got {item!r}")
        if key not in GRID_FIELDS:
            raise SettingsError(f"--grid: {key!r} is not a setting a trial may vary; choose from "
                                f"{', '.join(GRID_FIELDS)}")
        if key in grid:
            raise SettingsError(f"--grid: {key} is given twice; give its values once: --grid {key}=V1,V2,...")
        grid[key] = [yaml_scalar(v) for v in values.split(",")]
    return grid


def sweep_points(grid: dict[str, list[Any]], shapes: list[dict[str, Any]], seeds: list[int]) -> list[dict[str, Any]]:
    """Every trial's overrides: the cross product of the grids, the shapes (if any) and the seeds."""
    keys = list(grid)
    combos = [dict(zip(keys, values, strict=True)) for values in itertools.product(*grid.values())]
    return [{**combo, **shape, "seed": seed} for combo in combos for shape in (shapes or [{}]) for seed in seeds]


def trial_settings(base: dict[str, Any], points: list[dict[str, Any]],
                   typed: Mapping[str, Any] | None = None) -> list[RunSettings]:
    """Every trial's settings, checked (a wrong grid value names the trial and the field; a shape that chain GRPO
    would replace, typed on the command line (``typed``) or in the grid, too)."""
    trials = []
    for point in points:
        try:
            trials.append(validate(RunSettings, {**base, **point}))
            check_chain_shape(trials[-1], {**(typed or {}), **point})
        except SettingsError as error:
            raise SettingsError(f"trial {point}: {error}") from None
    return trials


def differing_leaves(configs: list[dict[str, Any]]) -> list[tuple[str, ...]]:
    """The paths (keys from the top) of the leaves whose values differ between ``configs``, nested dicts of one
    layout (RLlib configs as dicts)."""

    def leaves(tree: dict[str, Any], path: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
        found = {}
        for key, value in tree.items():
            found.update(leaves(value, (*path, key)) if isinstance(value, dict) and value else {(*path, key): value})
        return found

    first, *others = [leaves(config) for config in configs]
    return [path for path, value in first.items() if any(other[path] != value for other in others)]


def search_space(configs: list[dict[str, Any]], choice: Callable[[list[Any]], Any],
                 ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Tune's space and its points from every trial's RLlib config (as a dict): the space is the first trial's
    config with ``choice(values)`` at each leaf that differs between trials, a point per trial sets those leaves.
    Everything else is the value the trials share, so a grid key with one value is a constant of every trial
    (not the base's default), and a setting that reaches the config twice (the seed: ``seed`` and the model's
    ``seed``) varies in both places."""
    space, points = copy.deepcopy(configs[0]), [{} for _ in configs]
    for path in differing_leaves(configs):
        values = [functools.reduce(dict.__getitem__, path, config) for config in configs]
        for point, value in zip(points, values, strict=True):
            _assign(point, path, value)
        _assign(space, path, choice([v for i, v in enumerate(values) if v not in values[:i]]))
    return space, points


def _assign(tree: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def trial_params(base: RunSettings, config: Any) -> dict[str, Any]:
    """A trial's MLflow params, named as run.py's (``tracked_params``): the sweep's base settings with the values
    a trial may vary read from its RLlib config."""
    return tracked_params(validate(RunSettings, {**base.model_dump(), **{k: getattr(config, k) for k in GRID_FIELDS}}))


def varied_fields(trials: list[RunSettings]) -> dict[str, list[Any]]:
    """Per trial, the values of the fields that differ between trials (the searched keys)."""
    keys = [k for k in GRID_FIELDS if len({json.dumps(getattr(t, k)) for t in trials}) > 1] or ["seed"]
    return {k: [getattr(t, k) for t in trials] for k in keys}


def tune_parser():
    descriptions = {"output": "the sweep's directory: a directory per trial, tune_results.md and .json (must not "
                              "hold another sweep)", **dict.fromkeys(SWEEP_IGNORES, argparse.SUPPRESS)}
    parser = build_parser(RunSettings, description=__doc__, aliases=CLI_ALIASES, sections=help_sections(),
                          defaults=SWEEP_DEFAULTS, descriptions=descriptions)
    sweep = parser.add_argument_group("sweep")
    sweep.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2",
                       help="sweep a setting; repeat for more (default: none)")
    sweep.add_argument("--budget", type=float, nargs="+", default=None,
                       help="matched-budget mode: budgets in full-chain equivalents (default: off)")
    sweep.add_argument("--shapes", choices=["paper", "all"], default="paper",
                       help="tree shapes of a budget (default: %(default)s)")
    sweep.add_argument("--expansion-cost", type=float, default=0.5,
                       help="one expansion in full chains (paper 0.5; a measured value, e.g. 0.7, works too) "
                            "(default: %(default)s)")
    sweep.add_argument("--tolerance", type=float, default=0.15,
                       help="relative budget mismatch allowed with --shapes all (default: %(default)s)")
    sweep.add_argument("--seeds", type=int, nargs="+", default=None, help="(default: --seed)")
    sweep.add_argument("--time-budget-s", type=float, default=None,
                       help="stop each trial after this many seconds (default: no limit)")
    sweep.add_argument("--metric", default=None, help="a numeric metrics.jsonl column to sort by (default: dev_em "
                                                      "with --eval-every, else reward_mean)")
    sweep.add_argument("--mode", choices=["max", "min"], default="max",
                       help="best --metric first: the largest (max) or the smallest (min) (default: %(default)s)")
    sweep.add_argument("--max-concurrent", type=int, default=0,
                       help="trials at a time, 0: as resources allow (default: %(default)s)")
    sweep.add_argument("--resume", metavar="OUTPUT", default=None,
                       help="continue the interrupted sweep in OUTPUT with its own options: its unfinished trials "
                            "from their last checkpoints (--checkpoint-every), or from their start (default: off)")
    return parser


def check_sweep_numbers(namespace: argparse.Namespace) -> None:
    """A ``SettingsError`` naming a sweep option whose value means nothing: a budget or an expansion cost at or
    below 0, a negative tolerance, a time budget at or below 0, a negative ``--max-concurrent``."""
    problems = [f"--budget must be > 0 full chains, got {budget:g}" for budget in namespace.budget or () if budget <= 0]
    if namespace.expansion_cost <= 0:
        problems.append(f"--expansion-cost must be > 0 (one expansion in full chains), got "
                        f"{namespace.expansion_cost:g}")
    if namespace.tolerance < 0:
        problems.append(f"--tolerance must be >= 0 (a relative budget mismatch), got {namespace.tolerance:g}")
    if namespace.time_budget_s is not None and namespace.time_budget_s <= 0:
        problems.append(f"--time-budget-s must be > 0 seconds (leave it out for no limit), got "
                        f"{namespace.time_budget_s:g}")
    if namespace.max_concurrent < 0:
        problems.append(f"--max-concurrent must be >= 0 (0: as resources allow), got {namespace.max_concurrent}")
    if problems:
        raise SettingsError("\n".join(problems))


def check_sweep_options(given: Mapping[str, Any], sources: Sources) -> None:
    """A ``SettingsError`` naming the options given on the command line that a sweep would not act on
    (``SWEEP_IGNORES``: run.py's alone); those a ``--config`` file sets (``sources``: where each came from), named
    on stderr: a run's file may set them for run.py, and sweeping from it is what the file is for."""
    ignored = [name for name in SWEEP_IGNORES if name in given
               and given[name] != RunSettings.model_fields[name].default]
    typed = [name for name in ignored if name not in sources]
    if typed:
        raise SettingsError("\n".join(f"{name}: run.py's option, which a sweep does not act on ({SWEEP_IGNORES[name]});"
                                      f" drop {flag(name)}" for name in typed))
    for name in ignored:
        print(f"tune.py: {sources[name]}: {name} is not acted on by a sweep ({SWEEP_IGNORES[name]})",
              file=sys.stderr)


def plan(argv: list[str] | None = None):
    """(base settings, every trial's settings, sweep options), all checked before Ray starts. With ``--resume
    OUTPUT``, those of the sweep in OUTPUT (``resumed_argv``), and ``options.resume`` its Tune state's directory."""
    argv = argv_of(argv)
    namespace = tune_parser().parse_args(argv)
    if namespace.resume is not None:
        state = Path(namespace.resume).resolve() / "sweep"
        base, trials, options = plan_sweep(resumed_argv(namespace.resume, argv), resuming=True)
        options.resume = state
        return base, trials, options
    return plan_sweep(argv)


def resumed_argv(output: str, argv: list[str]) -> list[str]:
    """The command line of the sweep in ``output`` (``SWEEP_COMMAND``), its --output made absolute; the working
    directory becomes the sweep's (its relative paths, such as --config or --data-dir, are read from there). A
    ``SettingsError`` where ``argv`` gives more than ``--resume`` (a sweep continues with its own options), or
    ``output`` holds no sweep that Tune can continue."""
    from ray import tune

    extra = [arg for arg in argv if arg not in ("--resume", output) and not arg.startswith("--resume=")]
    if extra:
        raise SettingsError(f"--resume continues a sweep with the options it started with; drop {' '.join(extra)}")
    directory = Path(output).resolve()
    command, state = directory / SWEEP_COMMAND, directory / "sweep"
    if command.is_file() and not state.exists():
        started = shlex.join(json.loads(command.read_text(encoding="utf-8"))["argv"])
        raise SettingsError(f"--resume {output}: the sweep stopped before Ray Tune saved its state (no trial ran); "
                            f"start it again: python experiments/tune.py {started}")
    if not command.is_file() or not tune.Tuner.can_restore(state):
        raise SettingsError(f"--resume {output}: no sweep to continue there; a sweep's --output holds {SWEEP_COMMAND} "
                            f"(its options) and sweep/ (Ray Tune's state), both written when it starts")
    saved = json.loads(command.read_text(encoding="utf-8"))
    if Path(saved["cwd"]).resolve() != Path.cwd().resolve():
        if not Path(saved["cwd"]).is_dir():
            raise SettingsError(f"--resume {output}: the sweep ran from {saved['cwd']}, which is gone (its relative "
                                f"paths were read from there)")
        print(f"tune.py: resuming from {saved['cwd']}, the directory the sweep ran from", file=sys.stderr)
        os.chdir(saved["cwd"])
    return [*saved["argv"], "--output", str(directory)]


def plan_sweep(argv: list[str], resuming: bool = False):
    """``plan`` for a sweep's own command line; ``resuming``: its --output holds it already."""
    namespace = tune_parser().parse_args(argv)
    given, sources = given_options(RunSettings, namespace)
    check_sweep_options(given, sources)
    check_sweep_numbers(namespace)
    base_values = {**SWEEP_DEFAULTS, **given}
    base = validate(RunSettings, base_values, sources)
    check_output_directory(base.output)
    existing = [name for name in SWEEP_FILES if (Path(base.output) / name).exists()]
    if existing == [SWEEP_COMMAND] and not resuming:  # stopped before Tune saved anything: nothing to keep
        existing = []
    if existing and not resuming:
        raise SettingsError(f"--output {base.output} already holds a sweep ({', '.join(existing)}): continue it with "
                            f"--resume {base.output}, or choose another --output (two sweeps' trials would mix in "
                            f"one directory)")
    shapes = budget_points(namespace.budget, namespace.shapes, expansion_cost=namespace.expansion_cost,
                           tolerance=namespace.tolerance) if namespace.budget else []
    points = sweep_points(parse_grid(namespace.grid), shapes, namespace.seeds or [base.seed])
    namespace.metric = sweep_metric(namespace.metric, base)
    return base, trial_settings(base_values, points, vars(namespace)), namespace


def sweep_metric(metric: str | None, base: RunSettings) -> str:
    """The metrics.jsonl column the table sorts by: ``metric`` (--metric), else dev_em with --eval-every, else the
    mean reward. A ``SettingsError`` where no trial would write it as a number (naming the close columns), or where it
    is the greedy evaluation's and the trials do not evaluate."""
    if metric is None:
        return f"{metric_keys.DEV_PREFIX}em" if base.eval_every else metric_keys.REWARD
    columns = metric_columns()
    if metric not in columns:
        near = difflib.get_close_matches(metric, columns, n=3, cutoff=0.6)
        hint = f"did you mean {', '.join(near)}?" if near else f"choose from {', '.join(columns)}"
        raise SettingsError(f"--metric {metric}: not a numeric metrics.jsonl column; {hint}")
    if metric.startswith(metric_keys.DEV_PREFIX) and not base.eval_every:
        raise SettingsError(f"--metric {metric}: a column of the greedy evaluation, which the trials run only with "
                            f"--eval-every K; set it, or sort by another column")
    return metric


def stop_criteria(base: RunSettings, time_budget_s: float | None) -> dict[str, float]:
    """Tune's stop: a trial ends after ``--iterations`` or ``--time-budget-s``, or as run.py ends a run, after the
    iteration that reaches ``--token-budget`` or makes ``--stop-after-uniform`` iterations in a row whose prompts'
    leaves were each rewarded alike (the result's ``uniform_streak``)."""
    stop: dict[str, float] = {"training_iteration": base.iterations}
    if time_budget_s:
        stop["time_total_s"] = time_budget_s
    if base.token_budget:
        stop[metric_keys.TOKENS_GENERATED_TOTAL] = base.token_budget
    if base.stop_after_uniform:
        stop[metric_keys.UNIFORM_STREAK] = base.stop_after_uniform
    return stop


def run_config(base: RunSettings, output: Path, time_budget_s: float | None, mlflow_uri: str | None = None):
    """The sweep's ``tune.RunConfig``: its directory, stop criteria, checkpoints (``--checkpoint-every``, the last
    ``--keep-checkpoints``, and one at the end) and, tracking into ``mlflow_uri``, ``EndTrialRuns``."""
    from ray import tune

    return tune.RunConfig(
        name="sweep", storage_path=str(output), stop=stop_criteria(base, time_budget_s), verbose=1,
        callbacks=[EndTrialRuns(mlflow_uri, base.experiment)] if mlflow_uri else None,
        # each trial's RunTracker writes into its working directory; Tune copies it to the trial directory
        sync_config=tune.SyncConfig(sync_artifacts=True),
        checkpoint_config=tune.CheckpointConfig(checkpoint_frequency=base.checkpoint_every, checkpoint_at_end=True,
                                                num_to_keep=base.keep_checkpoints))


def trial_table(rows: list[dict[str, Any]], metric: str, mode: str = "max") -> str:
    """Markdown: one line per trial, best ``metric`` first (the largest with ``mode`` max, the smallest with min;
    trials without it last)."""
    columns = list(dict.fromkeys(["trial", *SUMMARY_FIELDS, "seed", "iterations", metric, metric_keys.REWARD,
                                  metric_keys.TOKENS_GENERATED, metric_keys.BUDGET_MEASURED]))
    sign = -1.0 if mode == "max" else 1.0
    rows = sorted(rows, key=lambda r: (r.get(metric) is None, sign * (r.get(metric) or 0.0)))
    lines = ["| " + " | ".join(columns) + " |", "|---" * len(columns) + "|"]
    for row in rows:
        cells = [f"{v:.4g}" if isinstance(v, float) else "-" if v is None else str(v)
                 for v in (row.get(c) for c in columns)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def trial_summary(trial_dir: Path, config: dict[str, Any], metric: str, error: Any = None) -> dict[str, Any]:
    """One trial's row from its metrics.jsonl: its settings, the last value of ``metric``, its total tokens."""
    rows = read_rows(trial_dir / METRICS_FILE)

    def last(column: str) -> Any:
        values = [row[column] for row in rows if row.get(column) is not None]
        return values[-1] if values else None

    tokens = sum(row.get(metric_keys.TOKENS_GENERATED) or 0 for row in rows) if rows else None
    return {"trial": trial_dir.name, **{f: config.get(f) for f in SUMMARY_FIELDS}, "seed": config.get("seed"),
            "iterations": last("iteration"), metric: last(metric), metric_keys.REWARD: last(metric_keys.REWARD),
            metric_keys.TOKENS_GENERATED: tokens, metric_keys.BUDGET_MEASURED: last(metric_keys.BUDGET_MEASURED),
            "error": str(error) if error else None}


def main(argv: list[str] | None = None) -> Path:
    import ray

    argv = argv_of(argv)
    try:
        base, trials, options = plan(argv)
        for trial in trials:  # as run.py checks a run
            check_before_ray(trial)
        start_ray(base)
        check_resources(base, ray.cluster_resources(), node_resources())
        for trial in trials:  # last: minutes the first time, spent only on a sweep that every check let start
            prepare_start(trial)
    except SettingsError as error:
        tune_parser().exit(2, f"tune.py: error: {error}\n")

    output = Path(base.output).resolve()
    metric = options.metric  # checked, or the default, by plan
    varied = varied_fields(trials)
    shown = [{key: values[i] for key, values in varied.items()} for i in range(len(trials))]
    print(f"{len(shown)} trials: " + "; ".join(", ".join(f"{k}={v}" for k, v in p.items()) for p in shown))

    output.mkdir(parents=True, exist_ok=True)
    mlflow_uri = (base.mlflow_uri or default_tracking_uri(output)) if base.mlflow else None
    if mlflow_uri:  # created here so that its artifacts go beside the store, not into ./mlruns
        from mlflow.tracking import MlflowClient

        ensure_experiment(MlflowClient(mlflow_uri), base.experiment, mlflow_uri)
    if not options.resume:
        (output / SWEEP_COMMAND).write_text(json.dumps({"argv": argv, "cwd": os.getcwd()}, indent=1),
                                            encoding="utf-8")
    results = sweep_tuner(base, trials, options, output, mlflow_uri).fit()
    rows = [trial_summary(Path(result.path), result.config, metric, result.error) for result in results]
    table = trial_table(rows, metric, options.mode)
    (output / "tune_results.md").write_text(table, encoding="utf-8")
    (output / "tune_results.json").write_text(json.dumps({"metric": metric, "mode": options.mode, "trials": rows},
                                                         indent=1), encoding="utf-8")
    print(table)
    print(f"results: {output / 'tune_results.md'}; trials: {output / 'sweep'}")
    # Ctrl-C: Tune saved its state; trials it had not yet started are not among the results
    unfinished = len(trials) - sum(not trial_unfinished(result.error is not None, result.metrics) for result in results)
    if unfinished:
        print(f"tune.py: the sweep was interrupted with {unfinished} of {len(trials)} trials unfinished; continue it "
              f"with: python experiments/tune.py --resume {output}", file=sys.stderr)
        raise SystemExit(130)
    return output / "tune_results.md"


def sweep_space(base: RunSettings, trials: list[RunSettings], output: Path, mlflow_uri: str | None,
                ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Tune's param space and one point per trial of ``trials``, each trial tracked by a ``RunTracker``. A resumed
    sweep gives Tune the same space again: Tune keeps the objects in it (the tracker, classes) as placeholders."""
    from ray import tune

    tracker = functools.partial(RunTracker, mlflow_uri=mlflow_uri, experiment=base.experiment,
                                tags={"model": base.model, "sweep": output.name}, final_iteration=base.iterations,
                                params=functools.partial(trial_params, base))
    # Explicit trials (points_to_evaluate) instead of grid_search: the budget mode's shapes are a list, not a
    # cross product.
    space, trial_points = search_space([build_config(trial).to_dict() for trial in trials], tune.choice)
    space["callbacks"] = tracker  # after the comparison: each config's copy of it would differ from the others
    return space, trial_points


def sweep_tuner(base: RunSettings, trials: list[RunSettings], options, output: Path, mlflow_uri: str | None):
    """The sweep's ``tune.Tuner``: a new one, or with ``options.resume`` the one restored from its state."""
    from ray import tune
    from ray.tune.search.basic_variant import BasicVariantGenerator

    space, trial_points = sweep_space(base, trials, output, mlflow_uri)
    if options.resume:  # Tune's state holds the trials, their checkpoints and the run config
        return tune.Tuner.restore(str(options.resume), TreeGRPO, resume_unfinished=True, param_space=space)
    return tune.Tuner(
        TreeGRPO,
        param_space=space,
        # the cap goes to the generator: Tune ignores max_concurrent_trials beside a search algorithm's generator
        tune_config=tune.TuneConfig(
            search_alg=BasicVariantGenerator(points_to_evaluate=trial_points, max_concurrent=options.max_concurrent),
            num_samples=len(trials)),
        run_config=run_config(base, output, options.time_budget_s, mlflow_uri),
    )


def argv_of(argv: list[str] | None) -> list[str]:
    """The sweep's command line as given (``sys.argv``'s when ``main`` was called without one)."""
    return sys.argv[1:] if argv is None else list(argv)


if __name__ == "__main__":
    main()
