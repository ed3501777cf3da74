"""Compare training runs: each metric against iterations, cumulative tokens generated and cumulative tool calls.

    python experiments/plot.py outputs/tree outputs/chain                      # writes ./curves.png
    python experiments/plot.py outputs/tree/metrics.jsonl outputs/chain/metrics.jsonl --labels tree chain \\
        --metrics reward_mean em_mean dev_em --output outputs/curves.png
    python experiments/plot.py 3f2a9c... 8b41d0... --mlflow-uri sqlite:///mlruns.db --labels tree chain \\
        --output curves.png

Each RUN is a metrics.jsonl file or a run directory holding one (written by experiments/run.py), or, with
--mlflow-uri, an MLflow run id. The figure has one row per metric and three columns: the metric against the
iteration, against the tokens generated so far, and against the tool calls so far (the budget views: what the
run got for what it spent).
The figure goes to --output, by default curves.png in the current directory (not into a run directory, where
run.py keeps its own learning_curve.png), in the format its suffix names (.png, .pdf, .svg, ...); its path is
printed. A RUN that cannot be read, an MLflow store that does not exist or a run id it lacks is one error line.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import EngFormatter, MaxNLocator

# metrics.jsonl keys (the same names as algos/tree_grpo/metrics.py, kept here so plotting does not import Ray)
ITERATION = "iteration"
TOKENS_GENERATED = "tokens_generated"
TOOL_CALLS = "tool_calls"
X_AXES = {"iteration": "iteration", "tokens": "tokens generated (cumulative)", "tool_calls": "tool calls (cumulative)"}
CUMULATIVE_X = {"tokens": TOKENS_GENERATED, "tool_calls": TOOL_CALLS}  # x axis -> the per-row count it sums
METRICS_FILE = "metrics.jsonl"
DEFAULT_OUTPUT = "curves.png"
SQLITE_PREFIX = "sqlite:///"  # then the store file's path: relative, or absolute (a fourth slash)
SPREAD_SUFFIX = "_std"  # a row's "<metric>_std" (e.g. the std over seeds) is drawn as a band around the metric


def load_metrics(path: str | Path) -> list[dict]:
    """The rows of a metrics.jsonl file (one dict per iteration), given the file or its run directory."""
    path = Path(path)
    file = path / METRICS_FILE if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"{file}: not found; expected a {METRICS_FILE} file or a run directory containing one")
    rows = []
    with file.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if line.strip():
                rows.append(_parse_row(line, file, number))
    return rows


def _parse_row(line: str, file: Path, number: int) -> dict:
    """One metrics.jsonl line as a dict; ValueError naming the file and line number otherwise."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"{file}, line {number}: not valid JSON ({error.msg})") from error
    if not isinstance(row, dict):
        raise ValueError(f"{file}, line {number}: expected a JSON object, got {type(row).__name__}")
    return row


def load_mlflow_run(tracking_uri: str, run_id: str) -> list[dict]:
    """The rows of an MLflow run, as load_metrics gives them: one dict per step, with ``iteration`` = step.

    A metric logged twice at one step keeps its latest value; a metric not logged at a step is absent from that row.
    """
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    if "://" not in tracking_uri:
        raise ValueError(f"--mlflow-uri {tracking_uri}: not a URI; e.g. sqlite:///ABS/PATH/mlflow.db (a SQLite store) "
                         f"or http://HOST:PORT (a server)")
    store = Path(tracking_uri.removeprefix(SQLITE_PREFIX)) if tracking_uri.startswith(SQLITE_PREFIX) else None
    if store is not None and not store.is_file():  # MLflow would create an empty store there
        raise FileNotFoundError(f"--mlflow-uri {tracking_uri}: no MLflow store at {store}")
    client = MlflowClient(tracking_uri)
    rows: dict[int, dict] = {}
    try:
        for key in client.get_run(run_id).data.metrics:
            for point in sorted(client.get_metric_history(run_id, key), key=lambda m: (m.step, m.timestamp)):
                rows.setdefault(point.step, {ITERATION: point.step})[key] = point.value
    except MlflowException as error:
        raise ValueError(f"MLflow run {run_id} in {tracking_uri}: {error.message}") from None
    return [rows[step] for step in sorted(rows)]


def _is_number(value: object) -> bool:
    """True for a finite int or float (not None, NaN, infinity, a bool or a string)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def curve(rows: Sequence[dict], metric: str, x: str = "iteration") -> tuple[np.ndarray, np.ndarray]:
    """The points (x, y) of one metric, skipping rows where it is missing, None or NaN.

    ``x="iteration"``: the row's iteration. ``x="tokens"`` (``"tool_calls"``): the cumulative sum of
    ``tokens_generated`` (``tool_calls``) up to and including the row; rows whose metric is skipped still count
    theirs, and a row without a count adds 0. Returns two float arrays of the same length (empty when no row has
    the metric).
    """
    if x not in X_AXES:
        raise ValueError(f"x must be one of {list(X_AXES)}, got {x!r}")
    if x in CUMULATIVE_X:
        key = CUMULATIVE_X[x]
        xs = np.cumsum([row.get(key) if _is_number(row.get(key)) else 0 for row in rows])
    else:
        xs = np.array([row.get(ITERATION) for row in rows])
    keep = [i for i, row in enumerate(rows) if _is_number(row.get(metric))]
    ys = np.array([rows[i][metric] for i in keep], dtype=float)
    return np.asarray(xs[keep], dtype=float), ys


def plot_runs(runs: dict[str, list[dict]], path: str | Path,
              metrics: Sequence[str] = ("reward_mean", "em_mean")) -> Path:
    """Write one figure comparing ``runs`` (label -> rows), in the format ``path``'s suffix names: a row of panels
    per metric, against iterations, cumulative tokens generated and cumulative tool calls, one labelled line per
    run. Metrics that no run has are left out (with a warning); ValueError if none is left. Returns the path
    written."""
    present = [m for m in metrics if any(len(curve(rows, m)[1]) for rows in runs.values())]
    if not present:
        raise ValueError(f"no run has any of the metrics {list(metrics)}")
    if missing := [m for m in metrics if m not in present]:
        warnings.warn(f"left out (no run has them): {missing}", stacklevel=2)
    figure = Figure(figsize=(5 * len(X_AXES), 3.5 * len(present)), layout="constrained")
    axes = figure.subplots(len(present), len(X_AXES), squeeze=False)
    for row_axes, metric in zip(axes, present, strict=True):
        for ax, (x, xlabel) in zip(row_axes, X_AXES.items(), strict=True):
            _draw_panel(ax, runs, metric, x)
            ax.set(xlabel=xlabel, ylabel=metric)
    return _save(figure, path)


def _save(figure: Figure, path: str | Path) -> Path:
    """Write ``figure`` to ``path`` in the format its suffix names (PNG without one); a ValueError naming the
    formats for a suffix that names none."""
    path = Path(path)
    formats = figure.canvas.get_supported_filetypes()
    if path.suffix and path.suffix[1:].lower() not in formats:
        raise ValueError(f"--output {path}: {path.suffix} is not a figure format; use one of "
                         f"{', '.join('.' + name for name in sorted(formats))}")
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, format=path.suffix[1:].lower() or "png", dpi=120)
    return path


def _draw_panel(ax, runs: dict[str, list[dict]], metric: str, x: str) -> None:
    """One line per run of ``metric`` against ``x`` (markers, so sparse series such as dev_em show), with a band
    of +- ``<metric>_std`` where the rows give one at every point of the line."""
    for label, rows in runs.items():
        xs, ys = curve(rows, metric, x)
        (line,) = ax.plot(xs, ys, marker=".", label=label)
        spread_xs, spread = curve(rows, metric + SPREAD_SUFFIX, x)
        if len(ys) and np.array_equal(spread_xs, xs):
            ax.fill_between(xs, ys - spread, ys + spread, color=line.get_color(), alpha=0.15, linewidth=0)
    if x == "iteration":
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    else:  # cumulative counts reach millions: "200k", not "200000" running into its neighbour
        ax.xaxis.set_major_formatter(EngFormatter(sep=""))
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")


def plot_held_out_curve(rows: Sequence[dict], held_out: Sequence[tuple[int, float, float, float]],
                        path: str | Path, reward: str = "reward_mean") -> Path:
    """Write one PNG of a single run against iterations: its sampled training ``reward`` per iteration (a line)
    and held-out greedy exact match at a few iterations (``held_out``: (iteration, mean, low, high) of its 95%
    interval; markers with error bars). The training reward is sampled at temperature on each iteration's prompts
    and moves with them; the held-out points are what the policy has learnt. Returns the path written."""
    figure = Figure(figsize=(6.5, 4), layout="constrained")
    ax = figure.subplots()
    xs, ys = curve(rows, reward)
    ax.plot(xs, ys, marker=".", color="tab:gray", label=f"training {reward} (sampled, this iteration's prompts)")
    if held_out:
        its, means, lows, highs = (np.array(column, dtype=float) for column in zip(*held_out, strict=True))
        ax.errorbar(its, means, yerr=[means - lows, highs - means], marker="o", capsize=4, color="tab:blue",
                    label="held-out exact match (greedy, 95% interval)")
    ax.set(xlabel="iteration", ylabel="score", ylim=(0, 1))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small", loc="lower right")
    return _save(figure, path)


def run_label(run: str) -> str:
    """The default label of a RUN path: the run directory's name (or, for another file name, the file's stem)."""
    path = Path(run).resolve()
    if path.name == METRICS_FILE:
        return path.parent.name
    return path.stem if path.is_file() else path.name


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", metavar="RUN", help="metrics.jsonl, run directory, or MLflow run id")
    p.add_argument("--output", default=DEFAULT_OUTPUT,
                   help=f"the figure to write, in the format its suffix names (default: ./{DEFAULT_OUTPUT})")
    p.add_argument("--labels", nargs="+", default=None, help="one per run (default: run directory name or run id)")
    p.add_argument("--metrics", nargs="+", default=["reward_mean", "em_mean"], help="one figure row each")
    p.add_argument("--mlflow-uri", default=None, help="MLflow tracking URI: then each RUN is a run id")
    args = p.parse_args(argv)
    if args.labels is not None and len(args.labels) != len(args.runs):
        p.error(f"--labels has {len(args.labels)} labels for {len(args.runs)} runs: give one label per run")
    if args.labels is None:
        args.labels = list(args.runs) if args.mlflow_uri else [run_label(run) for run in args.runs]
    if len(set(args.labels)) != len(args.labels):
        p.error(f"labels {args.labels} repeat, so runs would overwrite each other: give distinct --labels")
    return args


def main(argv: list[str] | None = None) -> Path:
    args = parse_args(argv)
    load = functools.partial(load_mlflow_run, args.mlflow_uri) if args.mlflow_uri else load_metrics
    try:
        runs = {label: load(run) for label, run in zip(args.labels, args.runs, strict=True)}
        path = plot_runs(runs, args.output, args.metrics)
    except (OSError, ValueError) as error:
        print(f"plot.py: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    print(path)
    return path


if __name__ == "__main__":
    main()
