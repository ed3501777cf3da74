"""Ray Tune sweeps: the matched-budget shapes, grid parsing, and a 2-trial grid tracked in MLflow."""

from __future__ import annotations

import json

import pytest
import ray
from mlflow.tracking import MlflowClient

from algos.rollout import TreeShape
from experiments.cli import SettingsError
from experiments.settings import RunSettings, tracked_params
from experiments.tracking import METRICS_FILE, TRIAL_TAG, EndTrialRuns, flatten, read_rows
from experiments.tune import (
    budget_points,
    main,
    parse_grid,
    plan,
    run_config,
    search_space,
    shapes_for_budget,
    sweep_points,
    sweep_tuner,
    trial_table,
    tune_parser,
)


def test_shape_cost_is_the_papers_formula():
    assert TreeShape(2, 2, 1).cost() == TreeShape(2, 2, 1).budget_estimate == 4.0  # 2 (1 + 1 * 2 / 2)
    assert TreeShape(4, 5, 1).cost() == 14.0  # the paper's "budget 16" shape
    assert TreeShape(2, 2, 1).cost(expansion_cost=0.75) == 5.0  # 2 (1 + 2 * 0.75)


def test_shapes_for_budget_4():
    # M=1: 1 + N/2 = 4 -> N=6 (L=1), N=3 (L=2); M=2: 2 (1 + N/2) = 4 -> N=2 (L=1), N=1 (L=2); M=3: 3 (1 + N/2)
    # is 4.5 for N=1 (12.5% off, within 15%)
    assert shapes_for_budget(4) == [TreeShape(1, 6, 1), TreeShape(1, 3, 2), TreeShape(2, 2, 1), TreeShape(2, 1, 2),
                                    TreeShape(3, 1, 1)]
    assert shapes_for_budget(4, tolerance=0.0) == [TreeShape(1, 6, 1), TreeShape(1, 3, 2), TreeShape(2, 2, 1),
                                                   TreeShape(2, 1, 2)]
    # with a measured expansion cost of 1 chain, (2, 1, 1) costs 2 (1 + 1) = 4
    assert TreeShape(2, 1, 1) in shapes_for_budget(4, expansion_cost=1.0, tolerance=0.0)


def test_budget_points_pair_the_papers_tree_with_the_chain_of_the_same_budget():
    tree = {"algo": "tree_grpo", "advantage_mode": "tree"}
    assert budget_points([2, 4], "paper") == [
        {**tree, "M": 1, "N": 2, "L": 1}, {"algo": "grpo", "group_size": 2},
        {**tree, "M": 2, "N": 2, "L": 1}, {"algo": "grpo", "group_size": 4}]
    with pytest.raises(SettingsError, match="budgets \\[2, 4, 8, 16\\], not 6"):
        budget_points([6], "paper")
    assert budget_points([6], "all", tolerance=0.0)[-1] == {"algo": "grpo", "group_size": 6}


def test_every_trial_is_checked_before_ray_starts(tmp_path):
    _, trials, _ = plan(["--budget", "4", "--output", str(tmp_path)])
    assert [(t.algo, t.M, t.N, t.L, t.advantage_mode) for t in trials] == [
        ("tree_grpo", 2, 2, 1, "tree"), ("grpo", 4, 0, 0, "inter")]  # chain GRPO: the same settings, one spelling
    with pytest.raises(SettingsError, match=r"trial \{'M': 0, 'seed': 0\}: M: Input should be greater"):
        plan(["--grid", "M=1,0", "--output", str(tmp_path)])
    with pytest.raises(SettingsError, match=r"lr: Input should be a valid number"):
        plan(["--grid", "lr=fast", "--output", str(tmp_path)])
    # a grid's M that chain GRPO's trials would replace by --group-size: named, not swept in vain
    with pytest.raises(SettingsError, match=r"trial \{'algo': 'grpo', 'M': 3, 'seed': 0\}: M: --algo grpo grows "
                                            r"--group-size \d+ chains"):
        plan(["--grid", "algo=grpo", "--grid", "M=3", "--output", str(tmp_path)])
    _, chains, _ = plan(["--grid", "algo=grpo", "--grid", "group_size=2,3", "--output", str(tmp_path)])
    assert [(t.M, t.N, t.L) for t in chains] == [(2, 0, 0), (3, 0, 0)]


def test_help_shows_the_sweeps_own_defaults():
    text = tune_parser().format_help()
    assert "(default: outputs/tune)" in text and "(default: 5)" in text
    assert "(default: outputs/run)" not in text and "(default: 20)" not in text


def test_sweep_options_that_mean_nothing_are_refused_by_name(tmp_path):
    """Values that would crash the planning (an expansion cost of 0), drop every tree from it (a negative tolerance
    or cost) or mean something else than they say (a time budget of 0, no limit to Ray) are refused before Ray."""
    out = ["--output", str(tmp_path)]
    for options, message in ((["--budget", "4", "--shapes", "all", "--expansion-cost", "0"], "--expansion-cost must "
                               "be > 0"),
                             (["--budget", "4", "--shapes", "all", "--tolerance", "-1"], "--tolerance must be >= 0"),
                             (["--budget", "0"], "--budget must be > 0 full chains, got 0"),
                             (["--time-budget-s", "0"], "--time-budget-s must be > 0 seconds"),
                             (["--max-concurrent", "-1"], "--max-concurrent must be >= 0")):
        with pytest.raises(SettingsError, match=message):
            plan([*options, *out])
    _, trials, _ = plan(["--budget", "4", "--shapes", "all", "--tolerance", "0", *out])
    assert {t.algo for t in trials} == {"tree_grpo", "grpo"}


def test_help_names_the_sweeps_directory_and_not_the_options_it_refuses():
    text = tune_parser().format_help()
    assert "the sweep's directory" in text and "the run's directory" not in text
    for refused in ("--final-eval", "--eval-envs", "--run-name"):
        assert f"{refused} " not in text.split("docs/tracking.md")[-1]  # past the description, which names them


def test_an_output_holding_a_sweep_is_refused_before_ray_starts(tmp_path):
    plan(["--output", str(tmp_path)])  # empty: fine
    (tmp_path / "sweep").mkdir()
    with pytest.raises(SettingsError, match=f"--output {tmp_path} already holds a sweep \\(sweep\\)"):
        plan(["--output", str(tmp_path)])


def test_parse_grid_and_sweep_points():
    grid = parse_grid(["M=1,2", "lr=1e-6,3.0e-6", "advantage_mode=tree,inter", "dual_clip=none,3"])
    assert grid == {"M": [1, 2], "lr": [1e-6, 3e-6], "advantage_mode": ["tree", "inter"], "dual_clip": [None, 3]}
    points = sweep_points({"M": [1, 2]}, [], [0, 1])
    assert points == [{"M": 1, "seed": 0}, {"M": 1, "seed": 1}, {"M": 2, "seed": 0}, {"M": 2, "seed": 1}]
    with pytest.raises(SettingsError, match="'lrr' is not a setting a trial may vary"):
        parse_grid(["lrr=1"])
    with pytest.raises(SettingsError, match="KEY=V1,V2"):
        parse_grid(["M"])
    with pytest.raises(SettingsError, match=r"--grid: M is given twice; give its values once: --grid M=V1,V2"):
        parse_grid(["M=1", "M=2"])  # not one trial of the last


def test_search_space_varies_what_differs_and_keeps_one_valued_keys_as_constants():
    configs = [{"M": 1, "lr": 1e-5, "seed": 0, "model": {"seed": 0, "name": "x"}},
               {"M": 1, "lr": 1e-5, "seed": 1, "model": {"seed": 1, "name": "x"}},
               {"M": 1, "lr": 1e-5, "seed": 1, "model": {"seed": 1, "name": "x"}}]
    space, points = search_space(configs, choice=lambda values: ("choice", values))
    assert space == {"M": 1, "lr": 1e-5, "seed": ("choice", [0, 1]), "model": {"seed": ("choice", [0, 1]),
                                                                             "name": "x"}}
    assert points == [{"seed": 0, "model": {"seed": 0}}, {"seed": 1, "model": {"seed": 1}},
                      {"seed": 1, "model": {"seed": 1}}]
    assert search_space(configs[:1], choice=list) == (configs[0], [{}])


def test_trial_table_sorts_by_the_metric_trials_without_it_last():
    rows = [{"trial": "a", "dev_em": 0.1}, {"trial": "b", "dev_em": None}, {"trial": "c", "dev_em": 0.3}]
    lines = trial_table(rows, "dev_em").splitlines()
    assert [line.split(" | ")[0] for line in lines[2:]] == ["| c", "| a", "| b"]
    lines = trial_table(rows, "dev_em", mode="min").splitlines()  # e.g. kl or time_s: the smallest first
    assert [line.split(" | ")[0] for line in lines[2:]] == ["| a", "| c", "| b"]


def test_the_metric_is_a_numeric_column_the_trials_write_checked_before_ray_starts(tmp_path):
    """A misspelt --metric gave a table of "-", a list column (sampled_by) a TypeError after the sweep, an evaluation
    column without --eval-every a table of "-": each is refused before Ray starts, naming the close columns."""
    out = ["--output", str(tmp_path)]
    assert plan(out)[2].metric == "reward_mean" and plan(["--eval-every", "2", *out])[2].metric == "dev_em"
    for column in ("kl", "time_s", "tokens_per_forward_pass", "iteration", "budget_chains_measured"):
        assert plan(["--metric", column, *out])[2].metric == column
    options = plan(["--metric", "dev_f1", "--eval-every", "1", "--mode", "min", *out])[2]
    assert (options.metric, options.mode) == ("dev_f1", "min")
    with pytest.raises(SettingsError, match=r"^--metric reward_mena: not a numeric metrics.jsonl column; did you "
                                            r"mean reward_mean\b"):
        plan(["--metric", "reward_mena", *out])
    with pytest.raises(SettingsError, match=r"--metric sampled_by: not a numeric metrics\.jsonl column"):
        plan(["--metric", "sampled_by", *out])
    with pytest.raises(SettingsError, match=r"--metric dev_em: a column of the greedy evaluation, which the trials "
                                            r"run only with --eval-every K"):
        plan(["--metric", "dev_em", *out])
    assert not ray.is_initialized()


def test_run_py_options_a_sweep_does_not_act_on_are_refused_or_named(tmp_path, capsys):
    """--final-eval, --eval-envs and --run-name act in run.py alone: given to a sweep they are refused before Ray
    starts, naming each; set by a --config file (a run's, e.g. experiments/configs/hotpotqa_tree.yaml) they are
    named on stderr, and the sweep goes on."""
    out = ["--output", str(tmp_path / "out")]
    with pytest.raises(SettingsError, match=r"^final_eval: run.py's option, which a sweep does not act on \(a trial "
                                            r"ends without run.py's final evaluation.*\); drop --final-eval$"):
        plan(["--final-eval", *out])
    with pytest.raises(SettingsError) as caught:
        plan(["--run-name", "mine", "--eval-envs", "NQ-v0", *out])
    assert [line.split(":")[0] for line in str(caught.value).splitlines()] == ["eval_envs", "run_name"]
    plan(["--no-final-eval", *out])  # their defaults: nothing ignored
    assert capsys.readouterr().err == ""
    config = tmp_path / "run.yaml"
    config.write_text("lr: 1.0e-6\nfinal_eval: true\neval_envs: [NQ-v0]\n")
    base, _, _ = plan(["--config", str(config), *out])
    assert base.final_eval and base.lr == 1e-6
    err = capsys.readouterr().err
    assert f"tune.py: {config}:2: final_eval is not acted on by a sweep" in err
    assert f"tune.py: {config}:3: eval_envs is not acted on by a sweep" in err


def test_a_trial_stops_and_keeps_checkpoints_as_run_py_would(tmp_path):
    """--stop-after-uniform stops a trial as it stops a run (the result's uniform_streak), beside --iterations,
    --time-budget-s and --token-budget; --keep-checkpoints keeps that many of a trial's (a sweep's default: 1)."""
    base, _, _ = plan(["--stop-after-uniform", "2", "--token-budget", "1000", "--keep-checkpoints", "3",
                       "--iterations", "7", "--output", str(tmp_path)])
    config = run_config(base, tmp_path, time_budget_s=60.0)
    assert config.stop == {"training_iteration": 7, "time_total_s": 60.0, "tokens_generated_total": 1000,
                           "uniform_streak": 2}
    assert config.checkpoint_config.num_to_keep == 3
    default, _, _ = plan(["--output", str(tmp_path)])
    assert run_config(default, tmp_path, time_budget_s=None).stop == {"training_iteration": 5}
    assert run_config(default, tmp_path, time_budget_s=None).checkpoint_config.num_to_keep == 1
    # tracked, the driver ends the MLflow runs of the trials that stop early (tests/test_tracking.py)
    tracked = run_config(default, tmp_path, None, mlflow_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert [type(callback) for callback in tracked.callbacks] == [EndTrialRuns]
    assert not run_config(default, tmp_path, None, mlflow_uri=None).callbacks  # --no-mlflow


def test_two_trial_grid_is_tracked_in_mlflow(data_dir, tmp_path):
    main(["--model", "tiny-random", "--max-step-tokens", "8", "--prompts-per-iter", "2", "--micro-batch-size", "6",
          "--grid", "M=1,2", "--iterations", "1", "--output", str(tmp_path)])
    ray.shutdown()
    results = json.loads((tmp_path / "tune_results.json").read_text())
    assert sorted(t["M"] for t in results["trials"]) == [1, 2]
    assert all(t["iterations"] == 1 and t["error"] is None for t in results["trials"])
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("tree-grpo").experiment_id])
    assert len(runs) == 2 and {r.info.status for r in runs} == {"FINISHED"}
    assert all(r.info.artifact_uri.startswith((tmp_path / "mlartifacts").as_uri()) for r in runs)
    assert sorted(r.data.params["M"] for r in runs) == ["1", "2"]
    run_py_params = set(flatten(tracked_params(RunSettings(output=str(tmp_path)))))
    assert all(set(r.data.params) == run_py_params for r in runs)  # run.py's names, all of them
    assert {r.data.params["model"] for r in runs} == {"tiny-random"}
    # leaves per prompt = M (1 + L N): 3 and 6, two prompts
    assert sorted(r.data.metrics["leaves"] for r in runs) == [6, 12]  # the same metric names as run.py
    # one directory per trial, first (a sweep that kept none would pass any check of their contents), each the one
    # its results row names, holding Tune's params.json and run.py's metrics.jsonl (one tracking path)
    trial_dirs = sorted(path for path in (tmp_path / "sweep").iterdir() if path.is_dir())
    assert len(trial_dirs) == 2, f"the sweep kept {len(trial_dirs)} trial directories, not 2: {trial_dirs}"
    assert sorted(path.name for path in trial_dirs) == sorted(t["trial"] for t in results["trials"])
    # each trial's run is tagged with its directory's name, by which the sweep's driver ends a run that stops early
    assert sorted(r.data.tags[TRIAL_TAG] for r in runs) == [path.name for path in trial_dirs]
    for trial in trial_dirs:
        assert json.loads((trial / "params.json").read_text())["M"] in (1, 2), trial
        assert [row["iteration"] for row in read_rows(trial / METRICS_FILE)] == [1], trial


def test_a_one_valued_grid_key_is_what_the_trial_trains_and_a_token_budget_stops_it(data_dir, tmp_path):
    main(["--model", "tiny-random", "--max-step-tokens", "8", "--prompts-per-iter", "2", "--micro-batch-size", "6",
          "--grid", "M=1", "--grid", "lr=1e-5", "--iterations", "3", "--token-budget", "1", "--no-mlflow",
          "--output", str(tmp_path)])
    ray.shutdown()
    (params,) = [json.loads(path.read_text()) for path in (tmp_path / "sweep").glob("*/params.json")]
    assert (params["M"], params["lr"]) == (1, 1e-5)  # not the defaults (2, 1e-6)
    (trial,) = json.loads((tmp_path / "tune_results.json").read_text())["trials"]
    # the first iteration generates more than 1 token: the trial stops after it, as run.py's runs do
    assert trial["M"] == 1 and trial["error"] is None and trial["iterations"] == 1


def test_max_concurrent_caps_the_trials_generator(tmp_path, monkeypatch):
    """Tune ignores TuneConfig's max_concurrent_trials beside a search algorithm (it warns, and runs every trial at
    once): the cap goes to the generator of the sweep's trials."""
    from ray.tune.search import basic_variant

    made = []

    class Recorded(basic_variant.BasicVariantGenerator):
        def __init__(self, **kwargs):
            made.append(kwargs)
            super().__init__(**kwargs)

    monkeypatch.setattr(basic_variant, "BasicVariantGenerator", Recorded)
    base, trials, options = plan(["--model", "tiny-random", "--grid", "M=1,2", "--max-concurrent", "1",
                                  "--output", str(tmp_path)])
    sweep_tuner(base, trials, options, tmp_path, mlflow_uri=None)
    assert made[0]["max_concurrent"] == 1 and len(made[0]["points_to_evaluate"]) == 2
