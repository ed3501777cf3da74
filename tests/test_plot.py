"""experiments/plot.py: curve points by hand, loading metrics.jsonl and MLflow runs, the figure and the CLI."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from experiments.plot import curve, load_metrics, load_mlflow_run, main, plot_runs

ROWS = [
    {"iteration": 1, "reward_mean": 0.1, "tokens_generated": 10},
    {"iteration": 2, "reward_mean": math.nan, "tokens_generated": 20},
    {"iteration": 3, "reward_mean": None, "tokens_generated": 30, "dev_em": 0.5},
    {"iteration": 4, "reward_mean": 0.4, "tokens_generated": 40},
]
CLI_ROWS = [{**row, "em_mean": 0.25 * row["iteration"]} for row in ROWS]  # both default metrics


def write_jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def test_curve_against_iterations_skips_missing_values():
    xs, ys = curve(ROWS, "reward_mean")
    np.testing.assert_array_equal(xs, [1, 4])
    np.testing.assert_array_equal(ys, [0.1, 0.4])


def test_curve_against_cumulative_tokens_counts_skipped_rows():
    # cumulative tokens: 10, 30, 60, 100; rows 2 (NaN) and 3 (None) are skipped but their tokens count
    xs, ys = curve(ROWS, "reward_mean", x="tokens")
    np.testing.assert_array_equal(xs, [10, 100])
    np.testing.assert_array_equal(ys, [0.1, 0.4])
    xs, ys = curve(ROWS, "dev_em", x="tokens")
    np.testing.assert_array_equal(xs, [60])
    np.testing.assert_array_equal(ys, [0.5])


def test_curve_every_row_and_missing_token_counts():
    rows = [{"iteration": i, "m": float(i), "tokens_generated": t} for i, t in [(1, 10), (2, 20), (3, 30)]]
    np.testing.assert_array_equal(curve(rows, "m", x="tokens")[0], [10, 30, 60])
    rows[1]["tokens_generated"] = None  # a row without a token count adds 0
    np.testing.assert_array_equal(curve(rows, "m", x="tokens")[0], [10, 10, 40])


def test_curve_against_cumulative_tool_calls():
    rows = [{"iteration": i, "m": float(i), "tool_calls": c} for i, c in [(1, 4), (2, 0), (3, 6)]]
    rows[1]["m"] = None  # skipped, but its tool calls still count
    xs, ys = curve(rows, "m", x="tool_calls")
    np.testing.assert_array_equal(xs, [4, 10])
    np.testing.assert_array_equal(ys, [1.0, 3.0])


def test_curve_metric_absent_and_bad_x():
    xs, ys = curve(ROWS, "em_mean")
    assert xs.shape == ys.shape == (0,)
    with pytest.raises(ValueError, match="iteration"):
        curve(ROWS, "reward_mean", x="seconds")


def test_load_metrics_file_and_directory(tmp_path):
    file = write_jsonl(tmp_path / "run" / "metrics.jsonl", ROWS)
    file.write_text(file.read_text() + "\n")  # a trailing blank line is fine
    for path in (file, tmp_path / "run", str(tmp_path / "run")):
        rows = load_metrics(path)
        assert [row["iteration"] for row in rows] == [1, 2, 3, 4]
        assert math.isnan(rows[1]["reward_mean"]) and rows[2]["reward_mean"] is None


def test_load_metrics_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match="run directory containing one") as error:
        load_metrics(tmp_path / "nowhere.jsonl")
    assert "nowhere.jsonl" in str(error.value)
    with pytest.raises(FileNotFoundError) as error:
        load_metrics(tmp_path)  # a directory without metrics.jsonl
    assert str(tmp_path / "metrics.jsonl") in str(error.value)


@pytest.mark.parametrize("bad_line", ['{"iteration": 2, "reward_mean": ', "[1, 2]"])
def test_load_metrics_malformed_line(tmp_path, bad_line):
    file = tmp_path / "metrics.jsonl"
    file.write_text(json.dumps(ROWS[0]) + "\n" + bad_line + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match="line 2") as error:
        load_metrics(file)
    assert str(file) in str(error.value)


def test_plot_runs_writes_png(tmp_path):
    chain = [{**row, "reward_mean": 0.2, "tokens_generated": 50} for row in ROWS]
    path = plot_runs({"tree": ROWS, "chain": chain}, tmp_path / "figs" / "curves.png",
                     metrics=("reward_mean", "dev_em"))
    assert path == tmp_path / "figs" / "curves.png"
    assert path.read_bytes()[:4] == b"\x89PNG"


def test_a_std_column_at_every_point_draws_a_band():
    from matplotlib.figure import Figure

    from experiments.plot import _draw_panel

    banded = [{"iteration": 0, "dev_em": 0.5, "dev_em_std": 0.0}, {"iteration": 6, "dev_em": 0.6, "dev_em_std": 0.1}]
    partial = [{"iteration": 0, "dev_em": 0.5, "dev_em_std": 0.0}, {"iteration": 6, "dev_em": 0.6}]
    ax = Figure().subplots()
    _draw_panel(ax, {"seeds": banded, "one seed": partial}, "dev_em", "iteration")
    (band,) = ax.collections  # the partial spread draws none
    lower, upper = band.get_paths()[0].vertices[:, 1].min(), band.get_paths()[0].vertices[:, 1].max()
    assert (lower, upper) == pytest.approx((0.5, 0.7))


def test_cumulative_axes_write_counts_short():
    from matplotlib.figure import Figure

    from experiments.plot import _draw_panel

    rows = [{"iteration": i, "reward_mean": 0.5, "tokens_generated": 200_000} for i in range(1, 6)]
    tokens, iterations = Figure().subplots(1, 2)
    _draw_panel(tokens, {"run": rows}, "reward_mean", "tokens")
    _draw_panel(iterations, {"run": rows}, "reward_mean", "iteration")
    short = tokens.xaxis.get_major_formatter()
    assert (short(200_000), short(1_000_000)) == ("200k", "1M")
    assert type(iterations.xaxis.get_major_formatter()) is not type(short)  # iterations keep plain integers


def test_plot_runs_leaves_out_absent_metrics(tmp_path):
    with pytest.warns(UserWarning, match="em_mean"):
        plot_runs({"tree": ROWS}, tmp_path / "curves.png", metrics=("reward_mean", "em_mean"))
    with pytest.raises(ValueError, match="em_mean"):
        plot_runs({"tree": ROWS}, tmp_path / "none.png", metrics=("em_mean",))


def test_load_mlflow_run_rebuilds_rows(tmp_path):
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("plot")).info.run_id
    for step, reward, tokens in [(2, 0.3, 20), (1, 0.1, 10), (3, 0.6, 30)]:
        client.log_metric(run_id, "reward_mean", reward, step=step)
        client.log_metric(run_id, "tokens_generated", tokens, step=step)
    client.log_metric(run_id, "dev_em", 0.5, step=2)
    rows = load_mlflow_run(uri, run_id)
    assert rows == [
        {"iteration": 1, "reward_mean": 0.1, "tokens_generated": 10},
        {"iteration": 2, "reward_mean": 0.3, "tokens_generated": 20, "dev_em": 0.5},
        {"iteration": 3, "reward_mean": 0.6, "tokens_generated": 30},
    ]
    np.testing.assert_array_equal(curve(rows, "reward_mean", x="tokens")[0], [10, 30, 60])


def test_cli_end_to_end(tmp_path, capsys):
    tree = write_jsonl(tmp_path / "tree" / "metrics.jsonl", CLI_ROWS)
    chain = write_jsonl(tmp_path / "chain.jsonl", CLI_ROWS)
    output = tmp_path / "out" / "curves.png"
    path = main([str(tree), str(chain), "--labels", "tree", "chain", "--output", str(output)])
    assert path == output and output.read_bytes()[:4] == b"\x89PNG"
    assert str(output) in capsys.readouterr().out


def test_cli_default_labels_and_errors(tmp_path, capsys):
    tree = write_jsonl(tmp_path / "tree" / "metrics.jsonl", CLI_ROWS)
    chain = write_jsonl(tmp_path / "chain" / "metrics.jsonl", CLI_ROWS)
    assert main([str(tree), str(tmp_path / "chain"), "--output", str(tmp_path / "c.png")]).is_file()
    with pytest.raises(SystemExit):
        main([str(tree), str(chain), "--labels", "tree", "--output", str(tmp_path / "x.png")])
    assert "--labels has 1 labels for 2 runs" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # same default label for both
        main([str(tree), str(tree), "--output", str(tmp_path / "x.png")])
    assert "repeat" in capsys.readouterr().err


def test_cli_without_output_writes_curves_png_in_the_current_directory(tmp_path, monkeypatch, capsys):
    run = write_jsonl(tmp_path / "runs" / "tree" / "metrics.jsonl", CLI_ROWS).parent
    monkeypatch.chdir(tmp_path)
    path = main([str(run)])
    assert path.resolve() == tmp_path / "curves.png" and path.read_bytes()[:4] == b"\x89PNG"
    assert "curves.png" in capsys.readouterr().out
    assert not (run / "curves.png").exists() and not (run / "learning_curve.png").exists()  # the run is left as it was


def test_the_output_suffix_picks_the_format_and_an_unknown_one_is_named(tmp_path, capsys):
    run = write_jsonl(tmp_path / "tree" / "metrics.jsonl", CLI_ROWS)
    assert main([str(run), "--output", str(tmp_path / "c.pdf")]).read_bytes()[:4] == b"%PDF"
    assert b"<svg" in main([str(run), "--output", str(tmp_path / "c.svg")]).read_bytes()[:400]
    with pytest.raises(SystemExit) as exit_:
        main([str(run), "--output", str(tmp_path / "c.xyz")])
    assert exit_.value.code == 2 and ".xyz is not a figure format; use one of" in capsys.readouterr().err


@pytest.mark.parametrize("case", ["missing run", "empty run directory", "output is a directory", "no store",
                                  "not a uri", "unknown run id"])
def test_bad_input_is_one_error_line_and_creates_nothing(tmp_path, capsys, case):
    from mlflow import MlflowClient

    run = write_jsonl(tmp_path / "tree" / "metrics.jsonl", CLI_ROWS)
    (tmp_path / "empty").mkdir()
    store = tmp_path / "mlflow.db"
    if case == "unknown run id":
        MlflowClient(f"sqlite:///{store}").create_experiment("plot")
    capsys.readouterr()  # MLflow's lines about the store it made
    argv, message = {
        "missing run": ([str(tmp_path / "nope")], "nope: not found; expected a metrics.jsonl file"),
        "empty run directory": ([str(tmp_path / "empty")], "empty/metrics.jsonl: not found"),
        "output is a directory": ([str(run), "--output", str(tmp_path / "empty")], "Is a directory"),
        "no store": (["abc", "--mlflow-uri", f"sqlite:///{tmp_path / 'typo.db'}"], "no MLflow store at"),
        "not a uri": (["abc", "--mlflow-uri", str(store)], "not a URI; e.g. sqlite:///"),
        "unknown run id": (["deadbeef", "--mlflow-uri", f"sqlite:///{store}"], "MLflow run deadbeef in sqlite:///"),
    }[case]
    with pytest.raises(SystemExit) as exit_:
        main([*argv, *([] if "--output" in argv else ["--output", str(tmp_path / "out.png")])])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith("plot.py: error: ") and message in err and err.count("\n") == 1
    assert not (tmp_path / "typo.db").exists() and not (tmp_path / "out.png").exists()
