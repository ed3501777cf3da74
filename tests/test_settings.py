"""Settings declared once (experiments/settings.py, algos/tree_grpo/settings.py): the command line and YAML
files derived from them, strict validation before Ray starts, resume and output-directory rules, the shipped
configs, and the RLlib config built from them."""

from __future__ import annotations

import os
from pathlib import Path

import gymnasium as gym
import pytest
import ray
import yaml

import algos.tree_grpo.settings as algorithm_settings
import experiments.settings as settings_module
from algos.tree_grpo import TreeGRPOConfig
from experiments.checkpoints import write_manifest
from experiments.cli import SettingsError, dump_yaml, read_yaml
from experiments.run import plan, run_parser
from experiments.settings import HELP_SECTIONS, MAY_CHANGE_ON_RESUME, RunSettings, build_config, help_sections
from policies.models import LORA_TARGETS

PAPER_TABLE = {2: (1, 2, 1), 4: (2, 2, 1), 8: (2, 6, 1), 16: (4, 5, 1)}  # the paper's budget table
CONFIGS = sorted((Path(__file__).parent.parent / "experiments" / "configs").rglob("*.yaml"))
NUMERIC_OPTIONS = ("--M", "--N", "--L", "--lr", "--micro-batch-size", "--prompts-per-iter", "--max-step-tokens",
                   "--seed", "--iterations", "--topk", "--max-turns", "--kl-coef", "--temperature", "--top-p",
                   "--token-budget")


def settings_of(argv: list[str]) -> RunSettings:
    return plan(argv).settings


def error_of(argv: list[str]) -> str:
    with pytest.raises(SettingsError) as caught:
        plan(argv)
    return str(caught.value)


def test_command_line_overrides_the_file_which_overrides_the_defaults(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("algo: grpo\ngroup_size: 6\nlr: 3.0e-6\niterations: 7\nkl_coef: 0.01\n")
    s = settings_of(["--config", str(config), "--iterations", "2", "--output", str(tmp_path / "run")])
    assert (s.algo, s.group_size, s.lr, s.iterations, s.kl_coef) == ("grpo", 6, 3e-6, 2, 0.01)
    assert (s.M, s.N, s.L, s.advantage_mode) == (6, 0, 0, "inter")  # chain GRPO's one spelling
    assert s.topk == 2  # HotpotQA-v0 from its warm start on a CPU: CPU_QA_DEFAULTS (tests/test_qa_start.py)
    assert settings_of(["--model", "tiny-random", "--output", str(tmp_path / "run")]).topk == 3  # the env's own


def test_base_files_are_read_first(tmp_path):
    (tmp_path / "base.yaml").write_text("M: 4\nN: 3\noutput: base_out\n")
    (tmp_path / "child.yaml").write_text("base: base.yaml\nN: 5\n")
    s = settings_of(["--config", str(tmp_path / "child.yaml")])
    assert (s.M, s.N, s.output) == (4, 5, "base_out")


def test_core_settings_are_reachable_from_the_command_line_and_yaml(tmp_path, monkeypatch):
    monkeypatch.setattr(algorithm_settings, "gpu_visible", lambda: False)  # the CPU command: from the warm start
    s = settings_of(["--kl-coef", "0.01", "--temperature", "0.7", "--top-p", "0.9", "--clip-eps", "0.3",
                     "--entropy-coef", "0", "--lora-rank", "8", "--dual-clip", "none", "--output", str(tmp_path)])
    assert (s.kl_coef, s.temperature, s.top_p, s.clip_eps, s.entropy_coef, s.lora_rank, s.dual_clip) == (
        0.01, 0.7, 0.9, 0.3, 0.0, 8, None)
    config = build_config(s)
    assert (config.kl_coef, config.temperature, config.clip_eps) == (0.01, 0.7, 0.3)
    assert config.model_config["lora"] == {"rank": 8, "alpha": 32, "layers": 10,  # the CPU profile's other LoRA
                                           "target_modules": LORA_TARGETS["all"]}  # options stay with a given rank


@pytest.mark.parametrize("option", NUMERIC_OPTIONS)
def test_minus_one_is_an_error_not_the_default(option):
    message = error_of([option, "-1"])
    assert option.removeprefix("--").replace("-", "_").replace("prompts_per_iter", "prompts_per_iteration") \
        in message and "(got -1" in message


@pytest.mark.parametrize(("text", "line", "message"), [
    ("iterations: 2\nlrr: 1\n", 2, "unknown option 'lrr'; did you mean 'lr'?"),
    ("algo: ppo\n", 1, "algo: Input should be 'tree_grpo' or 'grpo'"),
    ("M: two\n", 1, "M: Input should be a valid integer"),
    ("M: 2.7\n", 1, "M: Input should be a valid integer (got 2.7)"),
    ("\nM: true\n", 2, "M: Input should be a valid integer (got True)"),
    ("iterations: [1, 2]\n", 1, "iterations: Input should be a valid integer"),
    ("M: 0\n", 1, "M: Input should be greater than or equal to 1"),
    ("M: 2\nN: [1\n", 3, "malformed YAML"),
])
def test_bad_config_files_name_the_option_file_and_line(tmp_path, text, line, message):
    config = tmp_path / "bad.yaml"
    config.write_text(text)
    error = error_of(["--config", str(config)])
    assert message in error and f"{config}:{line}" in error


def test_not_a_mapping_a_cycle_and_a_missing_file(tmp_path):
    (tmp_path / "list.yaml").write_text("- a\n")
    assert "expected a YAML mapping" in error_of(["--config", str(tmp_path / "list.yaml")])
    (tmp_path / "self.yaml").write_text("base: self.yaml\n")
    assert "cycle" in error_of(["--config", str(tmp_path / "self.yaml")])
    assert str(tmp_path / "nope.yaml") in error_of(["--config", str(tmp_path / "nope.yaml")])


def test_shape_errors_come_before_ray_starts(tmp_path):
    assert not ray.is_initialized()
    assert "M: Input should be greater than or equal to 1" in error_of(["--M", "0"])
    assert "N >= 1 when L >= 1" in error_of(["--N", "0", "--L", "1"])
    assert not ray.is_initialized()


@pytest.mark.parametrize(("argv", "message"), [
    (["--L", "0"], "M, N, L: the shape (1, 2, 0) grows 1 leaf per prompt"),  # the CPU profile's M = 1, unexpanded
    (["--model", "tiny-random", "--M", "1", "--L", "0"], "M, N, L: the shape (1, 2, 0) grows 1 leaf per prompt"),
    (["--algo", "grpo", "--group-size", "1"], "group_size: 1 chain per prompt has no other chain to compare"),
    (["--M", "2", "--L", "0", "--advantage-mode", "intra"], "advantage_mode: intra compares the leaves of one tree"),
], ids=["cpu-profile-unexpanded", "one-chain-tree", "one-chain-grpo", "intra-over-chains"])
def test_a_shape_whose_advantages_are_all_zero_is_refused_naming_the_options(argv, message, tmp_path, monkeypatch):
    """algos/advantages.py gives a group of one leaf 0: such a run would train on the KL and entropy terms alone."""
    monkeypatch.setattr(algorithm_settings, "gpu_visible", lambda: False)  # the CPU command: from the warm start
    refusal = error_of([*argv, "--output", str(tmp_path)])
    assert message in refusal and "every advantage would be 0" in refusal
    for valid in (["--L", "0", "--M", "2"], ["--algo", "grpo", "--group-size", "2"], ["--L", "1"]):
        assert settings_of([*valid, "--output", str(tmp_path)]).tree_shape.leaves_per_prompt >= 2


def test_chain_grpo_refuses_a_tree_shape_given_on_the_command_line_and_replaces_a_files(tmp_path):
    out = ["--output", str(tmp_path / "run")]
    message = error_of(["--algo", "grpo", "--group-size", "3", "--M", "4", *out])
    assert message == ("M: --algo grpo grows --group-size 3 chains per prompt, the shape (3, 0, 0), which would "
                       "replace --M 4: set the chains with --group-size and drop --M 4, or grow trees of (M, N, L) "
                       "with --algo tree_grpo")
    assert "N, L: --algo grpo grows --group-size" in error_of(["--algo", "grpo", "--N", "2", "--L", "1", *out])
    (tmp_path / "tree.yaml").write_text("algo: tree_grpo\nM: 2\nN: 2\nL: 1\n")
    (tmp_path / "chain.yaml").write_text("base: tree.yaml\nalgo: grpo\ngroup_size: 4\n")
    assert "M, N, L: --algo grpo grows --group-size 4" in error_of(
        ["--config", str(tmp_path / "chain.yaml"), "--M", "2", "--N", "2", "--L", "1", *out])
    agreeing = settings_of(["--algo", "grpo", "--group-size", "3", "--M", "3", "--N", "0", "--L", "0", *out])
    assert (agreeing.M, agreeing.N, agreeing.L) == (3, 0, 0)
    # a file's shape is replaced: a chain's file inheriting a tree's (configs/budget/*_chain.yaml), a chain run's own
    # config.yaml with another --group-size
    assert settings_of(["--config", str(tmp_path / "chain.yaml"), *out]).tree_shape.M == 4
    dump_yaml(settings_of(["--algo", "grpo", "--group-size", "4", *out]), tmp_path / "config.yaml")
    again = settings_of(["--config", str(tmp_path / "config.yaml"), "--group-size", "8", *out])
    assert (again.M, again.N, again.L) == (8, 0, 0)
    run = fake_run(tmp_path, algo="grpo", group_size=4)  # and on resume, with the changes allowed
    assert "M: --algo grpo grows --group-size 4" in error_of(["--resume", str(run), "--allow-changes", "--M", "8"])
    assert plan(["--resume", str(run), "--allow-changes", "--group-size", "8"]).settings.M == 8


@pytest.mark.parametrize(("argv", "line"), [
    (["--N", "-1"], "N: Input should be greater than or equal to 0 (got -1)"),
    (["--iterations", "0"], "iterations: Input should be greater than or equal to 1 (got 0)"),  # not also as
    # total_iterations, a setting derived from it that the user never gave
])
def test_command_line_errors_exit_with_one_line(capsys, argv, line):
    from experiments.run import main

    with pytest.raises(SystemExit) as caught:
        main(argv)
    assert caught.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"run.py: error: {line}"]


@pytest.mark.parametrize(("argv", "environ", "message"), [
    (["--data-dir", "{missing}"], None, "data directory {missing} (from the data_dir argument) does not exist"),
    ([], "{missing}", "data directory {missing} (from $TREEGRPO_DATA_DIR) does not exist"),
    (["--data-dir", "{empty}"], None, "no hotpotqa train file in {empty}: looked for hotpotqa/"),
    (["--eval-every", "1", "--data-dir", "{train_only}"], None, "no hotpotqa dev file in {train_only}"),
    (["--num-env-runners", "3", "--prompts-per-iter", "2"], None,
     "num_env_runners (3) must not exceed prompts_per_iteration (2)"),
], ids=["missing-dir", "bad-env-var", "empty-dir", "no-eval-split", "runners-over-prompts"])
def test_data_and_runner_errors_are_one_line_before_ray_and_write_nothing(argv, environ, message, data_dir, tmp_path,
                                                                         monkeypatch, capsys):
    from experiments.run import main

    paths = {"missing": tmp_path / "missing", "empty": tmp_path / "empty", "train_only": tmp_path / "train_only"}
    paths["empty"].mkdir()
    (paths["train_only"] / "hotpotqa").mkdir(parents=True)
    train_file = next((data_dir / "hotpotqa").glob("hotpot_train*.json"))
    (paths["train_only"] / "hotpotqa" / train_file.name).symlink_to(train_file)
    if environ:
        monkeypatch.setenv("TREEGRPO_DATA_DIR", environ.format(**paths))
    output = tmp_path / "run"
    with pytest.raises(SystemExit) as caught:
        main([*(arg.format(**paths) for arg in argv), "--output", str(output)])
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert caught.value.code == 2 and line.startswith("run.py: error: ") and message.format(**paths) in line
    assert not output.exists() and not ray.is_initialized()


def test_actors_beyond_the_local_resources_are_refused_before_ray_starts(data_dir, tmp_path, monkeypatch):
    from experiments import preflight, run

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(preflight, "local_resources", lambda: {"CPU": 2.0, "GPU": 0.0})
    settings = settings_of(["--num-env-runners", "3", "--prompts-per-iter", "4", "--output", str(tmp_path / "run")])
    with pytest.raises(SettingsError, match="need 3 CPUs and 0 GPUs but Ray has 2 CPUs"):
        run.train(run.RunPlan(settings))
    assert not ray.is_initialized() and not (tmp_path / "run").exists()


def test_training_on_the_evaluation_split_is_refused_unless_allowed(tmp_path):
    message = error_of(["--env", "NQ-v0", "--output", str(tmp_path)])
    assert "NQ-v0 would train on split 'test', which is also its evaluation split" in message
    assert "--allow-eval-split-training" in message
    s = settings_of(["--env", "NQ-v0", "--allow-eval-split-training", "--output", str(tmp_path)])
    assert s.contaminated
    assert not settings_of(["--env", "NQ-v0", "--split", "train", "--output", str(tmp_path)]).contaminated


def test_a_directory_holding_a_run_is_refused_without_resume(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"iteration": 1}\n')
    message = error_of(["--output", str(tmp_path)])
    assert "already holds a run (metrics.jsonl)" in message and f"--resume {tmp_path}" in message


def test_config_yaml_reads_back_to_the_same_settings(tmp_path):
    s = settings_of(["--algo", "grpo", "--group-size", "3", "--lr", "2e-5", "--eval-envs", "HotpotQA-v0",
                     "Bamboogle-v0", "--output", str(tmp_path / "a")])
    dump_yaml(s, tmp_path / "config.yaml")
    values, _ = read_yaml(tmp_path / "config.yaml", RunSettings)
    assert RunSettings.model_validate(values) == s


def fake_run(tmp_path: Path, **settings) -> Path:
    """A run directory with config.yaml and one (sealed, near-empty) checkpoint, as run.py lays them out."""
    run = tmp_path / "run"
    checkpoint = run / "checkpoints" / "iter_000001"
    checkpoint.mkdir(parents=True)
    (checkpoint / "algorithm_state.pkl").write_bytes(b"state")
    write_manifest(checkpoint)
    (run / "checkpoints" / "latest").symlink_to("iter_000001")
    dump_yaml(RunSettings(output=str(run), **settings), run / "config.yaml")
    return run


def test_resume_refuses_changes_to_the_experiment_and_lists_them(tmp_path):
    run = fake_run(tmp_path, M=2, lr=1e-6)
    message = error_of(["--resume", str(run), "--M", "4", "--lr", "0.5"])
    assert "M: 2 -> 4" in message and "lr: 1e-06 -> 0.5" in message and "--allow-changes" in message
    forced = plan(["--resume", str(run), "--M", "4", "--lr", "0.5", "--allow-changes"])
    assert (forced.settings.M, forced.settings.lr) == (4, 0.5)
    assert forced.changes["M"] == (2, 4)


@pytest.mark.skipif(not Path(os.environ.get("TREEGRPO_DATA_DIR", "/nonexistent"), "hotpotqa").is_dir(),
                    reason="needs the shared data (TREEGRPO_DATA_DIR)")
def test_a_run_from_the_warm_start_resumes_only_from_the_start_it_began_from(tmp_path, monkeypatch):
    from experiments.run import WARM_START_FILE, record_start

    monkeypatch.setattr(algorithm_settings, "gpu_visible", lambda: False)  # the CPU command: from the warm start
    run = fake_run(tmp_path)
    began = plan(["--resume", str(run)])
    assert began.settings.model == "warm-start"
    record_start(began.settings, run)
    key = (run / WARM_START_FILE).read_text().strip()
    assert key.startswith("hotpotqa-") and "warm start" not in plan(["--resume", str(run)]).changes
    (run / WARM_START_FILE).write_text("hotpotqa-an-older-start\n")  # the oracle, its recipe or the data changed
    message = error_of(["--resume", str(run)])
    assert "hotpotqa-an-older-start" in message and key in message and "--allow-changes" in message
    assert plan(["--resume", str(run), "--allow-changes"]).changes["warm start"] == ("hotpotqa-an-older-start", key)


def test_a_run_whose_warm_start_changed_resumes_from_the_first_one_by_its_directory_as_advised(tmp_path,
                                                                                                monkeypatch):
    from envs.cache import CACHE_DIR_ENV, WARM_STARTS_DIR
    from experiments.run import WARM_START_FILE, start_key

    monkeypatch.setattr(algorithm_settings, "gpu_visible", lambda: False)  # the CPU command: from the warm start
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "cache"))
    data = tmp_path / "data"  # what the start's key reads: its train file and corpus
    (data / "hotpotqa").mkdir(parents=True)
    (data / "hotpotqa" / "hotpot_train_distractor_subset.json").write_text("[]")
    (data / "wiki").mkdir()
    (data / "wiki" / "paragraphs.jsonl").write_text("")
    run = fake_run(tmp_path, data_dir=str(data))
    now = start_key(plan(["--resume", str(run)]).settings)
    (run / WARM_START_FILE).write_text("hotpotqa-the-first-start\n")  # the oracle, its recipe or the data changed
    first = tmp_path / "cache" / WARM_STARTS_DIR / "hotpotqa-the-first-start" / "model"
    gone = error_of(["--resume", str(run)])
    assert f"is now {now} " in gone and f"no longer cached (no {first}): pass --allow-changes to continue" in gone
    first.mkdir(parents=True)
    (first / "config.json").write_text("{}")
    advice = error_of(["--resume", str(run)])
    assert f"pass --model {first} (still cached) to continue from it, or --allow-changes" in advice
    resumed = plan(["--resume", str(run), "--model", str(first)])  # the advice, followed: no --allow-changes needed
    assert resumed.settings.model == str(first) and resumed.changes == {"model": ("warm-start", str(first))}
    another = first.parent.parent / "hotpotqa-another-start" / "model"  # any other model still changes the experiment
    assert f"model: 'warm-start' -> '{another}'" in error_of(["--resume", str(run), "--model", str(another)])


def test_a_resume_from_the_warm_start_whose_data_no_longer_resolves_is_one_line_naming_the_path(tmp_path,
                                                                                                monkeypatch, capsys):
    """A run started with $TREEGRPO_DATA_DIR (the Makefile exports it), resumed in a shell without it: the warm
    start is found by its data, and the missing directory is named, not a traceback."""
    from experiments.run import main

    monkeypatch.setattr(algorithm_settings, "gpu_visible", lambda: False)  # the CPU command: from the warm start
    run = fake_run(tmp_path)  # data_dir None: the environment's
    monkeypatch.delenv("TREEGRPO_DATA_DIR", raising=False)
    monkeypatch.chdir(tmp_path)  # and no ./data here
    with pytest.raises(SystemExit) as caught:
        main(["--resume", str(run)])
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert caught.value.code == 2 and line.startswith(f"run.py: error: --resume {run}: the run trains from ")
    assert f"data directory {tmp_path.resolve() / 'data'} " in line and "--data-dir may change on resume" in line


def test_resume_applies_options_that_may_change_and_keeps_the_rest(tmp_path):
    run = fake_run(tmp_path, M=3, iterations=5)
    resumed = plan(["--resume", str(run / "checkpoints" / "latest"), "--iterations", "9", "--eval-every", "2",
                    "--num-cpus-per-env-runner", "2"])  # placement: a run resumed on another machine
    assert (resumed.settings.iterations, resumed.settings.eval_every, resumed.settings.M) == (9, 2, 3)
    assert resumed.settings.num_cpus_per_env_runner == 2
    assert Path(resumed.settings.output) == run.resolve()  # the run's own directory, not ./outputs/run
    assert resumed.checkpoint.name == "iter_000001"
    assert {"iterations", "eval_every"} <= MAY_CHANGE_ON_RESUME


def test_how_the_learner_computes_may_change_on_resume_and_the_reward_may_not(tmp_path):
    run = fake_run(tmp_path)
    assert not plan(["--resume", str(run), "--no-frozen-bottom-replay"]).settings.frozen_bottom_replay
    assert "reward: 'format' -> 'em'" in error_of(["--resume", str(run), "--reward", "em"])


def test_resume_continues_from_the_settings_in_effect_at_the_checkpoint(tmp_path):
    run = fake_run(tmp_path, lr=1e-6)  # its checkpoint: iteration 1
    (run / "resumes").mkdir()
    dump_yaml(RunSettings(output=str(run), lr=2e-6), run / "resumes" / "iter_000002.yaml")  # resumed with a change
    dump_yaml(RunSettings(output=str(run), lr=3e-6), run / "resumes" / "iter_000009.yaml")  # later than the checkpoint
    resumed = plan(["--resume", str(run)])
    assert resumed.settings.lr == 2e-6 and not resumed.changes  # not config.yaml's 1e-6: no silent revert
    assert "lr: 2e-06 -> 1e-06" in error_of(["--resume", str(run), "--lr", "1e-6"])


def test_resume_into_another_output_is_refused(tmp_path):
    run = fake_run(tmp_path)
    assert "continues the run in its own directory" in error_of(["--resume", str(run), "--output",
                                                                 str(tmp_path / "elsewhere")])


def test_ray_dashboard_without_its_packages_is_refused_before_ray_with_the_reason(tmp_path, monkeypatch):
    monkeypatch.setattr(settings_module, "dashboard_dependency_error",
                        lambda: ImportError("No module named 'aiohttp_cors'"))
    message = error_of(["--ray-dashboard", "--output", str(tmp_path)])
    assert "ray_dashboard: Ray's dashboard needs ray[default], which is not installed here" in message
    assert "aiohttp_cors" in message and "pip install -e .[dashboard]" in message
    assert not settings_of(["--output", str(tmp_path)]).ray_dashboard  # not asked for: not checked
    monkeypatch.setattr(settings_module, "dashboard_dependency_error", lambda: None)
    assert settings_of(["--ray-dashboard", "--output", str(tmp_path)]).ray_dashboard


def test_allow_changes_needs_resume():
    assert "--allow-changes only applies with --resume" in error_of(["--allow-changes"])


def test_help_lists_every_setting_once():
    text = run_parser().format_help()
    for name in RunSettings.model_fields:
        assert "--" + name.replace("_", "-") in text


def test_help_groups_the_options_by_section_with_one_default_each():
    text = run_parser().format_help()
    starts = [text.index(f"\n{section}:\n") for section in HELP_SECTIONS]
    assert starts == sorted(starts)  # in the declared order
    block = dict(zip(HELP_SECTIONS, (text[a:b] for a, b in zip(starts, [*starts[1:], len(text)], strict=True)),
                     strict=True))
    for section, flags in {"environment": ["--env ", "--data-dir "], "model": ["--model ", "--lora-rank "],
                           "shape": ["--M ", "--temperature "], "update": ["--lr ", "--micro-batch-size "],
                           "resources": ["--num-env-runners ", "--generator "], "run": ["--iterations ", "--seed "],
                           "tracking": ["--mlflow-uri ", "--quiet "]}.items():
        assert all(flag in block[section] for flag in flags), section
    assert set(help_sections()) == set(RunSettings.model_fields)
    assert text.count("default:") == len(RunSettings.model_fields)  # one each, and none twice
    flat = " ".join(text.split())  # a description that says its default (e.g. "; default: never)") keeps it alone
    assert "final evaluation; default: never) --output" in flat and "OUTPUT/mlflow.db) --experiment" in flat
    assert "--quiet               same as --no-log-rollout-steps\n" in text  # the flag that exists
    assert "--split SPLIT         training split (default: the env" in text  # its own words, not "None" too


def test_help_shows_the_cpu_profiles_defaults_beside_the_generic_ones():
    from experiments.qa_start import CPU_QA_DEFAULTS

    text = " ".join(run_parser().format_help().split())
    profile = "on a CPU for HotpotQA-v0 from its warm start"
    assert f"--lr LR learning rate (AdamW) (default: 1e-06; 0.0005 {profile})" in text
    assert f"--M M trees per prompt (default: 2; 1 {profile})" in text
    # inside a description's own parentheses, where it explains its default
    assert f"(default: all; 10 {profile}); the backward pass stops below them" in text
    assert f"every step runs to the cap; 80 {profile})" in text
    assert "--N N nodes expanded per tree in each expansion round (default: 2) --L" in text  # the profile's too
    # each but those and --model, whose description names the profile
    assert text.count(profile) == len(CPU_QA_DEFAULTS.keys() - {"model", "N", "L"})


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_shipped_configs_build_valid_algorithm_configs(path, data_dir):
    settings = settings_of(["--config", str(path), "--output", "/nonexistent/out"])
    config = build_config(settings)
    config.validate()
    if "budget" in path.name:
        budget = int(path.name.removeprefix("budget").split("_")[0])
        expected = (budget, 0, 0) if settings.algo == "grpo" else PAPER_TABLE[budget]
        assert expected == (config.M, config.N, config.L)


def test_rllib_config_round_trip_keeps_every_setting():
    """RLlib drops values equal to -1 when it rebuilds a config from its state; none of ours can be -1, and every
    value survives the round trip."""
    config = TreeGRPOConfig().training(M=3, N=1, L=2, lr=3e-6, kl_coef=0.0, train_questions=5)
    rebuilt = TreeGRPOConfig.from_state(config.get_state())
    assert rebuilt.settings_dict() == config.settings_dict()


def test_python_api_checks_values_where_they_are_set():
    with pytest.raises(ValueError, match="advantage_mode"):
        TreeGRPOConfig().training(advantage_mode="global")
    with pytest.raises(ValueError, match=r"N: Input should be greater than or equal to 0 \(got -1\)"):
        TreeGRPOConfig().training(N=-1)
    config = TreeGRPOConfig().training(algo="grpo", group_size=5)
    assert (config.M, config.N, config.L, config.advantage_mode) == (5, 0, 0, "inter")
    config.M = 2  # by hand, bypassing .training(): caught by validate()
    with pytest.raises(ValueError, match="chain GRPO whose shape follows from group_size"):
        config.environment("HotpotQA-v0").validate()


def test_yaml_keys_are_the_settings_fields():
    for path in CONFIGS:
        keys = set(yaml.safe_load(path.read_text())) - {"base"}
        assert keys <= set(RunSettings.model_fields), path


def test_generator_choice_is_checked_before_ray_starts(tmp_path, monkeypatch):
    import algos.tree_grpo.settings as algo_settings

    out = ["--output", str(tmp_path)]
    monkeypatch.setattr(algo_settings, "vllm_installed", lambda: False)
    assert "pip install -e .[vllm]" in error_of(["--generator", "vllm", *out])
    with pytest.raises(ValueError, match="generator: Input should be 'auto', 'hf' or 'vllm'"):
        TreeGRPOConfig().training(generator="tgi")
    assert settings_of(["--generator", "hf", *out]).generator == "hf"
    monkeypatch.setattr(algo_settings, "vllm_installed", lambda: True)
    assert "temperature, top_p" in error_of(["--generator", "vllm", "--temperature", "0.7", *out])
    assert settings_of(["--generator", "vllm", "--temperature", "0.7", "--top-p", "1.0", *out]).top_p == 1.0
    if not algo_settings.gpu_visible():
        assert "vllm_sleep" in error_of(["--generator", "vllm", "--vllm-sleep", *out])
    assert "vllm_gpu_memory_utilization" in error_of(["--vllm-gpu-memory-utilization", "1.5", *out])


def test_branching_is_checked_before_ray_starts_and_reaches_the_sampler(tmp_path, monkeypatch, capsys):
    import algos.tree_grpo.settings as algo_settings

    out = ["--output", str(tmp_path)]
    assert settings_of(out).branching == "uniform" and settings_of(out).sampling.entropy_tokens == 0
    entropy = settings_of(["--branching", "entropy", "--generator", "hf", *out])
    assert entropy.sampling.entropy_tokens == 20 and build_config(entropy).branching == "entropy"
    with pytest.raises(SystemExit):
        run_parser().parse_args(["--branching", "widest"])
    assert "--branching: invalid choice: 'widest'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="branching: Input should be 'uniform', 'entropy', 'after_tool', 'at_dept"):
        TreeGRPOConfig().training(branching="widest")
    monkeypatch.setattr(algo_settings, "vllm_installed", lambda: True)
    message = error_of(["--branching", "entropy", "--generator", "vllm", "--top-p", "1.0", *out])
    assert "branching: entropy" in message and "the vllm generator does not measure" in message
    assert not ray.is_initialized()


def test_auto_generator_is_vllm_only_with_vllm_and_a_gpu(monkeypatch):
    import policies.generators as generators

    for installed, gpu, expected in ((True, True, "vllm"), (True, False, "hf"), (False, True, "hf")):
        monkeypatch.setattr(generators, "vllm_installed", lambda installed=installed: installed)
        monkeypatch.setattr(generators.torch.cuda, "is_available", lambda gpu=gpu: gpu)
        assert generators.resolve_generator("auto") == expected
    assert generators.resolve_generator("hf") == "hf" and generators.resolve_generator("vllm") == "vllm"
    with pytest.raises(ValueError, match="generator must be one of"):
        generators.resolve_generator("tgi")


@pytest.mark.parametrize(("argv", "message"), [
    (["--max-staleness", "2"], "max_staleness: Input should be less than or equal to 1 (got 2)"),
    (["--max-staleness", "-1"], "max_staleness: Input should be greater than or equal to 0 (got -1)"),
    (["--max-staleness", "1", "--old-logprobs", "sampler", "--num-env-runners", "1"],
     "old_logprobs: sampler takes the rollout's log-probs as the PPO ratio's old ones, but with max_staleness 1"),
    (["--max-staleness", "1"], "max_staleness: 1 samples the next iteration on the remote env runners while the "
                               "learner updates, but num_env_runners is 0"),
    (["--max-staleness", "1", "--tis-cap", "none", "--num-env-runners", "1"],
     "tis_cap: None turns off the truncated importance weights, the only correction of the sampler's lag"),
    (["--learner-threads", "2", "--num-learners", "1"],
     "learner_threads: sets the torch threads of the learner in the driver, but num_learners is 1"),
], ids=["above-bound", "negative", "sampler-old-logprobs", "no-remote-runners", "no-tis", "threads-remote"])
def test_bad_staleness_is_one_line_naming_the_option_before_ray(argv, message, data_dir, tmp_path, capsys):
    from experiments.run import main

    with pytest.raises(SystemExit) as caught:
        main([*argv, "--output", str(tmp_path / "run")])
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert caught.value.code == 2 and line.startswith("run.py: error: ") and message in line
    assert not (tmp_path / "run").exists() and not ray.is_initialized()


def test_a_staleness_of_one_with_remote_runners_is_valid():
    config = build_config(settings_of(["--max-staleness", "1", "--num-env-runners", "1"]))
    config.validate()
    evaluation = config.get_evaluation_config_object()  # RLlib's copy: no runners of its own (it runs on ours)
    assert evaluation.num_env_runners == 0 and evaluation.max_staleness == 1
    evaluation.validate()


def test_old_logprobs_are_recomputed_for_another_engine():
    import torch

    from algos.tree_grpo.learner import old_logprobs_source

    assert old_logprobs_source("auto", torch.float32, "hf") == "sampler"
    assert old_logprobs_source("auto", torch.float32, "vllm") == "recompute"
    # bf16 compute (over float32 master weights too): the sampler's numerics are not the learner's
    assert old_logprobs_source("auto", torch.bfloat16, "hf") == "recompute"
    assert old_logprobs_source("sampler", torch.float32, "vllm") == "sampler"  # asked for explicitly
    # a batch sampled an update ago: the learner's current weights are the proximal policy
    assert old_logprobs_source("auto", torch.float32, "hf", stale=True) == "recompute"


def test_the_retriever_setting_reaches_the_env_and_is_checked_before_ray(tmp_path):
    url = "http://10.0.0.5:8000/retrieve"
    assert build_config(settings_of(["--retriever", url, "--output", str(tmp_path)])).env_config["retriever"] == url
    assert build_config(settings_of(["--output", str(tmp_path)])).env_config["retriever"] == "bm25"
    assert "unknown retriever backend 'elastic'" in error_of(["--retriever", "elastic"])
    assert "must look like http://HOST:PORT" in error_of(["--retriever", "http://"])
    assert not ray.is_initialized()


def test_the_reward_setting_reaches_the_env_and_a_bad_one_is_named(data_dir, tmp_path, capsys):
    config = build_config(settings_of(["--reward", "em", "--data-dir", str(data_dir), "--output", str(tmp_path)]))
    env = gym.make(config.env, **config.env_config).unwrapped
    # a wrong answer in the agent format: Search-R1's format reward pays 0.2, exact match alone 0
    assert env.reward_fn("not the answer", ["Paris"], True) == 0.0
    assert env.reward_fn("paris", ["Paris"], True) == 1.0
    assert build_config(settings_of(["--output", str(tmp_path)])).env_config["reward"] == "format"
    with pytest.raises(SystemExit):
        plan(["--reward", "accuracy"])
    assert "argument --reward: invalid choice: 'accuracy' (choose from 'format', 'em', 'f1')" in capsys.readouterr().err
    with pytest.raises(ValueError, match="reward"):  # the Python API checks it too
        RunSettings(reward="accuracy")
    assert not ray.is_initialized()


def test_env_runner_resources_reach_rllib_from_the_command_line_and_yaml(tmp_path):
    out = ["--num-env-runners", "2", "--output", str(tmp_path / "a")]
    s = settings_of(["--env-runner-resources", "rollout_node=1, accelerator_type:A100=0.5", *out])
    assert s.env_runner_resources == {"rollout_node": 1.0, "accelerator_type:A100": 0.5}
    assert build_config(s).custom_resources_per_env_runner == {"rollout_node": 1.0, "accelerator_type:A100": 0.5}
    assert build_config(settings_of(out)).custom_resources_per_env_runner == {}
    dump_yaml(s, tmp_path / "config.yaml")  # a YAML mapping, read back to the same settings
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["env_runner_resources"] == {
        "rollout_node": 1.0, "accelerator_type:A100": 0.5}
    assert RunSettings.model_validate(read_yaml(tmp_path / "config.yaml", RunSettings)[0]) == s
    assert "env_runner_resources" in MAY_CHANGE_ON_RESUME  # placement, not the experiment


@pytest.mark.parametrize(("value", "message"), [
    ("rollout_node", "expected NAME=AMOUNT[,NAME=AMOUNT] (e.g. rollout_node=1), got 'rollout_node'"),
    ("rollout_node=one", "got 'rollout_node=one'"),
    ("=1", "got '=1'"),
    ("a=1,,b=2", "got ''"),
    ("a=1,a=2", "a is given twice"),
    ("rollout_node=0", "rollout_node=0: an amount must be positive"),
    ("CPU=1", "CPU is one of Ray's own resources, not a custom one; use --num-cpus-per-env-runner"),
    ("memory=1", "memory is one of Ray's own resources"),
])
def test_bad_env_runner_resources_name_the_option(tmp_path, value, message):
    error = error_of(["--env-runner-resources", value, "--num-env-runners", "1", "--output", str(tmp_path)])
    assert error.startswith("env_runner_resources: ") and message in error


def test_env_runner_resources_need_remote_runners(tmp_path):
    error = error_of(["--env-runner-resources", "rollout_node=1", "--output", str(tmp_path)])
    assert "env_runner_resources: places remote env runners, but num_env_runners is 0" in error


def test_precision_and_memory_options_reach_the_module_and_learner_and_bad_ones_are_named(tmp_path):
    s = settings_of(["--dtype", "bfloat16", "--gradient-checkpointing", "--reference-offload", "--output",
                     str(tmp_path)])
    config = build_config(s)
    assert (config.model_config["dtype"], config.model_config["gradient_checkpointing"],
            config.model_config["pure_bf16"], config.reference_offload) == ("bfloat16", True, False, True)
    assert "pure_bf16: needs --dtype bfloat16" in error_of(["--pure-bf16"])
    assert "reference_offload: with LoRA the reference is the base model with its adapters off" in error_of(
        ["--reference-offload", "--lora-rank", "4"])
    assert "reference_offload: kl_coef is 0, so there is no reference model to offload" in error_of(
        ["--reference-offload", "--kl-coef", "0"])
    assert not ray.is_initialized()


def test_the_gpu_defaults_are_the_papers_smallest_model_in_bf16_that_skips_idle_updates(monkeypatch, tmp_path):
    import algos.tree_grpo.settings as algorithm_settings

    monkeypatch.setattr(algorithm_settings, "gpu_visible", lambda: True)
    gpu = settings_of(["--output", str(tmp_path)])
    assert (gpu.model, gpu.dtype, gpu.skip_uniform_rewards, gpu.gradient_checkpointing) == (
        "Qwen/Qwen2.5-1.5B-Instruct", "bfloat16", True, True)
    monkeypatch.setattr(algorithm_settings, "gpu_visible", lambda: False)
    cpu = settings_of(["--output", str(tmp_path)])
    assert (cpu.model, cpu.dtype, cpu.skip_uniform_rewards, cpu.gradient_checkpointing) == (
        "warm-start", "float32", False, False)  # HotpotQA-v0's warm start (tests/test_qa_start.py)


def test_learner_on_gpu_by_default(monkeypatch, tmp_path):
    """With a GPU visible, the run's resolved RLlib config puts every learner on a GPU: RLlib's learner takes a GPU
    device when its config requests more than 0 GPUs per learner (``TorchLearner.build``: ``get_device(config,
    config.num_gpus_per_learner)``), the local learner in the driver, and Ray gives each remote one a GPU; without a
    GPU, on the CPU."""
    import torch
    from ray.rllib.utils.framework import get_device

    import algos.tree_grpo.settings as algorithm_settings
    from experiments.preflight import actor_demands

    monkeypatch.setattr(algorithm_settings, "gpu_visible", lambda: True)
    local = build_config(settings_of(["--output", str(tmp_path)]))
    assert local.num_learners == 0 and local.num_gpus_per_learner == 1
    remote = settings_of(["--num-learners", "2", "--output", str(tmp_path)])
    assert build_config(remote).num_gpus_per_learner == 1
    assert ("learner", 2, {"CPU": 1.0, "GPU": 1.0}) in [demand[:3] for demand in actor_demands(remote)]
    monkeypatch.setattr(algorithm_settings, "gpu_visible", lambda: False)
    config = build_config(settings_of(["--output", str(tmp_path)]))
    assert config.num_gpus_per_learner == 0 and get_device(config, config.num_gpus_per_learner) == torch.device("cpu")
    assert "default: 1 with a GPU visible" in " ".join(run_parser().format_help().split())


def test_a_gpu_learner_without_a_gpu_is_refused_before_ray_starts(monkeypatch, tmp_path):
    from experiments.preflight import check_learner_device

    out = ["--output", str(tmp_path)]
    for learners in ([], ["--num-learners", "1"]):  # the local learner and a remote one
        settings = settings_of([*learners, "--num-gpus-per-learner", "1", *out])
        with pytest.raises(SettingsError, match=r"--num-gpus-per-learner 1: no GPU is visible here.*"
                                                r"--num-gpus-per-learner 0 to train on the CPU"):
            check_learner_device(settings)
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")  # a cluster's nodes bring GPUs: Ray checks them there
    check_learner_device(settings_of(["--num-learners", "1", "--num-gpus-per-learner", "1", *out]))
    with pytest.raises(SettingsError, match="the local learner"):  # ... but never to the driver's own learner
        check_learner_device(settings_of(["--num-gpus-per-learner", "1", *out]))
    assert not ray.is_initialized()


def test_a_plain_path_as_mlflow_uri_is_refused_naming_the_option_and_a_sqlite_uri(tmp_path, monkeypatch):
    """MLflow 3 refuses its file store: a path (or file: URI) used to train untracked (run.py) or fail after Ray
    started (tune.py); it is an error naming mlflow_uri and the sqlite URI of the same place."""
    from experiments.cli import validate

    monkeypatch.chdir(tmp_path)
    for plain in ("./mlruns", "mlruns", str(tmp_path / "mlruns"), (tmp_path / "mlruns").as_uri()):
        with pytest.raises(SettingsError, match=rf"^mlflow_uri: .*file store, which MLflow 3 refuses.* "
                                                rf"sqlite:///{tmp_path}/mlruns/mlflow\.db \("):
            validate(RunSettings, {"mlflow_uri": plain})
    assert "mlflow_uri: './mlruns' is a directory for MLflow's file store" in error_of(
        ["--mlflow-uri", "./mlruns", "--output", str(tmp_path)])
    for uri in (f"sqlite:///{tmp_path}/mlflow.db", "http://127.0.0.1:5000", "https://mlflow.example.org",
                "postgresql://user@host/mlflow", "databricks", "databricks://profile", None):
        assert validate(RunSettings, {"mlflow_uri": uri}).mlflow_uri == uri


def test_a_relative_sqlite_mlflow_uri_is_made_absolute_once(tmp_path, monkeypatch):
    """A Tune trial runs in its own directory: ``sqlite:///mlflow.db`` resolved there would give every trial a store
    of its own and leave the sweep's empty. The settings hold the absolute file, from the directory they were given
    in, and keep it wherever they are read again (a trial's params)."""
    from experiments.cli import validate

    monkeypatch.chdir(tmp_path)
    absolute = f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}"
    assert validate(RunSettings, {"mlflow_uri": "sqlite:///runs/mlflow.db"}).mlflow_uri == absolute
    assert settings_of(["--mlflow-uri", "sqlite:///./runs/mlflow.db", "--output", "out"]).mlflow_uri == absolute
    monkeypatch.chdir(tmp_path / "..")  # elsewhere, as a trial's directory is
    assert validate(RunSettings, {"mlflow_uri": absolute}).mlflow_uri == absolute
    assert validate(RunSettings, {"mlflow_uri": "sqlite:///:memory:"}).mlflow_uri == "sqlite:///:memory:"
