"""evaluate.py: the paper-shaped table from hand-made results, and an end-to-end run on two envs."""

from __future__ import annotations

import json
import math

import pytest

from algos.evaluation import EVAL_COLUMNS, mean_results
from experiments.checkpoints import RLLIB_MARKER
from experiments.evaluate import group_averages, main, results_table


def result(em: float, **others: float) -> dict[str, float]:
    return {**dict.fromkeys(EVAL_COLUMNS, 0.0), "em": em, **others, "questions": 10}


def test_mean_results():
    rows = [dict.fromkeys(EVAL_COLUMNS, 1.0), {**dict.fromkeys(EVAL_COLUMNS, 0.0), "turns": 3.0}]
    means = mean_results(rows)
    assert means["em"] == 0.5 and means["turns"] == 2.0
    assert all(math.isnan(v) for v in mean_results([]).values())


def test_group_averages_are_unweighted_means_over_the_groups_datasets():
    results = {"NQ-v0": result(0.4), "PopQA-v0": result(0.2), "HotpotQA-v0": result(0.3, tool_calls=2.0),
               "Bamboogle-v0": result(0.1, tool_calls=1.0)}
    averages = group_averages(results)
    assert averages["single-hop"]["em"] == pytest.approx(0.3)
    assert averages["multi-hop"]["em"] == pytest.approx(0.2)
    assert averages["multi-hop"]["tool_calls"] == pytest.approx(1.5)
    assert averages["multi-hop"]["questions"] == 20
    assert set(group_averages({"NQ-v0": result(0.4)})) == {"single-hop"}


def test_results_table_follows_the_papers_column_order():
    results = {"Bamboogle-v0": result(0.125), "NQ-v0": result(0.5), "HotpotQA-v0": result(0.25)}
    lines = results_table(results).splitlines()
    assert lines[0] == "| | NQ | single-hop avg | HotpotQA | Bamboogle | multi-hop avg |"
    assert lines[2] == "| EM | 50.0 | 50.0 | 25.0 | 12.5 | 18.8 |"
    assert [line.split(" | ")[0] for line in lines[2:]] == [
        "| EM", "| F1", "| tool calls", "| turns", "| answer rate", "| questions"]


def test_evaluate_five_questions_of_two_envs(data_dir, tmp_path):
    main(["--model", "tiny-random", "--envs", "HotpotQA-v0", "NQ-v0", "--limit", "5", "--batch-size", "3",
          "--max-step-tokens", "8", "--output", str(tmp_path), "--quiet"])
    table = (tmp_path / "eval.md").read_text()
    assert "| | NQ | single-hop avg | HotpotQA | multi-hop avg |" in table.splitlines()
    data = json.loads((tmp_path / "eval.json").read_text())
    assert set(data["datasets"]) == {"HotpotQA-v0", "NQ-v0"}
    for env_id, means in data["datasets"].items():
        assert set(means) == {*EVAL_COLUMNS, "questions"} and means["questions"] == 5
        assert len(data["questions"][env_id]) == 5
        assert 1 <= means["turns"] <= 4 and 0 <= means["answered"] <= 1
    assert set(data["averages"]) == {"single-hop", "multi-hop"}


def test_help_shows_every_options_default(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    options = capsys.readouterr().out.split("\noptions:\n")[1]
    assert options.count("(default") == options.count("\n  --") - 1 == 16  # every option but --model (required)


def test_invalid_limit_names_the_option(capsys):
    with pytest.raises(SystemExit):
        main(["--model", "tiny-random", "--limit", "0"])
    assert "--limit must be >= 1" in capsys.readouterr().err


class _StopAfterPlacement(Exception):
    pass


@pytest.mark.parametrize(("cuda", "device", "expected"), [(True, None, "cuda"), (False, None, "cpu"),
                                                          (True, "cpu", "cpu")])
def test_the_model_runs_on_the_gpu_when_one_is_visible(monkeypatch, cuda, device, expected):
    import torch

    import experiments.evaluate as evaluate

    placed = []

    class Model:
        def to(self, where):
            placed.append(where)
            return self

        def eval(self):
            raise _StopAfterPlacement  # placement is what this test is about; no evaluation follows

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(evaluate, "load_policy", lambda model, dtype: (Model(), None))
    with pytest.raises(_StopAfterPlacement):
        main(["--model", "any", "--envs", "NQ-v0", *(["--device", device] if device else [])])
    assert placed == [expected]


def test_an_invalid_device_names_the_option(capsys):
    with pytest.raises(SystemExit):
        main(["--model", "tiny-random", "--device", "gpu0"])
    assert "--device must be a torch device" in capsys.readouterr().err


def test_the_vllm_generator_without_vllm_names_the_install(monkeypatch, capsys):
    import experiments.evaluate as evaluate

    monkeypatch.setattr(evaluate, "vllm_installed", lambda: False)
    with pytest.raises(SystemExit):
        main(["--model", "tiny-random", "--generator", "vllm"])
    assert "pip install -e .[vllm]" in capsys.readouterr().err


@pytest.mark.parametrize("case", ["model", "data", "checkpoint"])
def test_what_is_missing_is_one_line_naming_it_and_nothing_is_written(case, tmp_path, capsys):
    """A user's wrong --model, --data-dir or a damaged checkpoint: one line naming the path (exit 2), no traceback."""
    missing = tmp_path / "nope"
    argv = {"model": ["--model", str(missing)], "data": ["--model", "tiny-random", "--data-dir", str(missing)],
            "checkpoint": ["--model", str(tmp_path / "checkpoint")]}[case]
    if case == "checkpoint":  # an RLlib checkpoint whose policy module is gone
        (tmp_path / "checkpoint").mkdir()
        (tmp_path / "checkpoint" / RLLIB_MARKER).write_text("{}")
    with pytest.raises(SystemExit) as caught:
        main([*argv, "--envs", "HotpotQA-v0", "--output", str(tmp_path / "out"), "--quiet"])
    assert caught.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("evaluate.py: error: ")
    assert str(missing if case != "checkpoint" else tmp_path / "checkpoint") in err[0]
    assert not (tmp_path / "out").exists()


def test_an_evaluation_in_output_is_kept_unless_overwrite(tmp_path, capsys):
    """A run's OUTPUT/eval holds its final evaluation: evaluating into it again is refused before the model loads."""
    (tmp_path / "eval.md").write_text("the run's final evaluation")
    with pytest.raises(SystemExit) as caught:
        main(["--model", "tiny-random", "--output", str(tmp_path)])
    assert caught.value.code == 2 and (tmp_path / "eval.md").read_text() == "the run's final evaluation"
    assert f"--output {tmp_path} holds an evaluation (eval.md): choose another --output, or pass --overwrite" in \
        capsys.readouterr().err
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit):
        main(["--model", "tiny-random", "--output", str(tmp_path / "file")])
    assert f"--output {tmp_path / 'file'}: a file is there, not a directory" in capsys.readouterr().err


def test_every_envs_files_are_found_before_the_model_loads(data_dir, tmp_path, monkeypatch, capsys):
    """A later env's missing questions or an unknown --split: one line naming it, before the model loads (not after
    the earlier envs' evaluations, which would be lost)."""
    import experiments.evaluate as evaluate

    monkeypatch.setattr(evaluate, "load_policy", lambda model, dtype: pytest.fail("the model loaded"))
    partial = tmp_path / "data"
    partial.mkdir()
    for folder in ("wiki", "hotpotqa"):
        (partial / folder).symlink_to(data_dir / folder)
    for argv, message in ((["--data-dir", str(partial)], "nq"), (["--split", "nosuch"], "--split nosuch: dataset "
                                                                                        "'hotpotqa' has no split")):
        with pytest.raises(SystemExit) as caught:
            main(["--model", "tiny-random", "--envs", "HotpotQA-v0", "NQ-v0", *argv, "--output",
                  str(tmp_path / "out"), "--quiet"])
        err = capsys.readouterr().err.strip().splitlines()
        assert caught.value.code == 2 and len(err) == 1 and message in err[0]
    assert not (tmp_path / "out").exists()


def test_without_a_run_the_options_a_run_fixes_default_to_the_envs_own(monkeypatch, capsys):
    import envs
    import experiments.evaluate as evaluate
    import experiments.settings  # noqa: F401  imported before the env stands in: its fields derive from the real one

    def env(dataset: str = "hotpotqa", *, max_turns: int = 5, topk: int = 7, passage_words: int | None = 40,
            retriever: str = "dense"):  # an env whose defaults differ from the real one's
        raise AssertionError("not built")

    monkeypatch.setattr(envs, "SearchQAEnv", env)
    args = evaluate.parse_args(["--model", "tiny-random", "--envs", "HotpotQA-v0"])
    assert (args.max_turns, args.topk, args.passage_words, args.retriever, args.max_step_tokens) == (
        5, 7, 40, "dense", None)
    with pytest.raises(SystemExit):
        evaluate.parse_args(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "passages per search (default: the run's; else 7)" in help_text and "else dense)" in help_text


def fake_checkpoint(run, name: str) -> str:
    checkpoint = run / "checkpoints" / name
    checkpoint.mkdir(parents=True)
    (checkpoint / RLLIB_MARKER).write_text("{}")
    return str(checkpoint)


def test_a_checkpoint_is_evaluated_with_the_settings_its_iterations_trained_with_across_a_resume(tmp_path):
    from experiments.evaluate import parse_args

    run = tmp_path / "run"
    before, after = fake_checkpoint(run, "iter_000010"), fake_checkpoint(run, "iter_000020")
    (run / "checkpoints" / "latest").symlink_to("iter_000020")
    (run / "config.yaml").write_text("topk: 2\nmax_turns: 3\npassage_words: 64\n")
    (run / "resumes").mkdir()  # resumed from iteration 10 with --allow-changes --topk 3 --max-turns 4
    (run / "resumes" / "iter_000011.yaml").write_text("topk: 3\nmax_turns: 4\npassage_words: 64\n")

    def observations(checkpoint: str) -> tuple[int, int]:
        args = parse_args(["--model", checkpoint, "--envs", "HotpotQA-v0"])
        return args.topk, args.max_turns

    assert observations(after) == observations(str(run / "checkpoints" / "latest")) == (3, 4)
    assert observations(before) == (2, 3)  # saved before the resume changed them
    # the run directory and its checkpoints/ folder name the newest checkpoint, as export.py and --resume take them
    for spelling in (run, run / "checkpoints"):
        args = parse_args(["--model", str(spelling), "--envs", "HotpotQA-v0"])
        assert (args.model, args.topk, args.max_turns) == (after, 3, 4)


def test_a_run_without_a_checkpoint_names_it(tmp_path, capsys):
    from experiments.evaluate import parse_args

    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    with pytest.raises(SystemExit) as caught:
        parse_args(["--model", str(tmp_path / "run"), "--envs", "HotpotQA-v0"])
    assert caught.value.code == 2
    assert f"--model: the run {tmp_path / 'run'} has no checkpoint yet" in capsys.readouterr().err


def test_dtype_casts_a_checkpoints_weights_and_without_it_they_stay_as_the_learner_held_them(tmp_path):
    import torch
    from ray.rllib.core.rl_module.rl_module import RLModuleSpec

    from envs.search_qa import UnicodeText
    from experiments.evaluate import load_policy, parse_args
    from policies.rl_module import LLMRLModule

    checkpoint = fake_checkpoint(tmp_path / "run", "iter_000001")
    spec = RLModuleSpec(module_class=LLMRLModule, observation_space=UnicodeText(100), action_space=UnicodeText(100),
                        model_config={"model": "tiny-random"})
    spec.build().save_to_path(f"{checkpoint}/learner_group/learner/rl_module/default_policy")
    assert parse_args(["--model", checkpoint, "--envs", "HotpotQA-v0"]).dtype is None
    dtypes = {dtype: {p.dtype for p in load_policy(checkpoint, dtype)[0].parameters()}
              for dtype in (None, "bfloat16")}
    assert dtypes == {None: {torch.float32}, "bfloat16": {torch.bfloat16}}
