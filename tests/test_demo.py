"""The CPU demo's pieces without training: failure kinds, the before/after comparison, the summary, options;
and the update benchmark's report from such payloads. (The whole demo runs in tests/test_learning.py, slow.)"""

from __future__ import annotations

import argparse

import pytest

from algos.evaluation import FAILURES, failure_kind, failure_mix
from benchmarks.bench_update import report as update_report
from experiments.confidence import Interval
from experiments.demo import (
    SHORT_BAND,
    START_BAND,
    band_text,
    compare,
    curve_iterations,
    parse_args,
    short_share,
    summary_text,
)


def row(em=0.0, answered=0.0, tool_calls=1.0, hops=1.0, reward=0.0) -> dict[str, float]:
    return {"em": em, "answered": answered, "tool_calls": tool_calls, "hops": hops, "reward": reward, "f1": em,
            "turns": tool_calls + answered}


@pytest.mark.parametrize(("question", "kind"), [
    (row(em=1.0, answered=1.0, tool_calls=2, hops=2), "correct"),
    (row(answered=1.0, tool_calls=1, hops=2), "answered before its last hop"),
    (row(answered=1.0, tool_calls=3, hops=2), "wrong answer"),
    (row(answered=0.0, tool_calls=3, hops=2), "no answer"),
])
def test_failure_kind(question, kind):
    assert failure_kind(question) == kind and kind in FAILURES


def test_failure_mix_shares():
    rows = [row(em=1.0, answered=1.0, tool_calls=2, hops=2), row(answered=1.0, tool_calls=1, hops=2),
            row(answered=1.0, tool_calls=1, hops=3), row(answered=0.0, tool_calls=3, hops=2)]
    assert failure_mix(rows) == {"correct": 0.25, "answered before its last hop": 0.5, "no answer": 0.25}


def test_compare_pairs_the_questions():
    before = [row(), row(), row(), row()]
    after = [row(answered=1.0, reward=0.2), row(answered=1.0, reward=0.2), row(), row(em=1.0, answered=1.0, reward=1)]
    result = compare(before, after)
    answered = result["metrics"]["answered"]
    assert answered["before"].mean == 0.0 and answered["after"].mean == 0.75
    assert answered["change"].mean == 0.75  # differences 1, 1, 0, 1: std 0.5, t(3) interval 0.75 +- 0.80
    assert answered["change"].low == pytest.approx(0.75 - 3.182446 * 0.25, abs=1e-5)
    assert result["failures"]["before"] == {"no answer": 1.0}
    assert result["failures"]["after"] == {"wrong answer": 0.5, "no answer": 0.25, "correct": 0.25}
    assert result["questions"] == 4


def test_summary_names_every_metric_the_outcomes_and_the_files(tmp_path):
    before = [row() for _ in range(6)]
    after = [row(answered=1.0, reward=0.2) for _ in range(5)] + [row()]
    (tmp_path / "mlflow.db").write_text("")
    text = summary_text(compare(before, after), tmp_path, [{"tokens_generated": 1000, "tool_calls": 7}] * 2, 9.5)
    for needle in ("exact match", "answer rate", "reward", "tool calls", "no answer", "2,000 tokens generated",
                   "14 tool calls", "9.5 minutes", "learning_curve.png", "mlflow ui --backend-store-uri sqlite:///"):
        assert needle in text, needle
    answer_line = next(line for line in text.splitlines() if line.startswith("| answer rate"))
    assert answer_line.endswith("| yes |")  # 5 of 6 answered after, none before: beyond the noise
    em_line = next(line for line in text.splitlines() if line.startswith("| exact match"))
    assert em_line.endswith("| no |")


def test_options_are_checked_and_the_rest_go_to_run_py():
    args = parse_args(["--iterations", "3", "--ppo-mini-batches", "1"])
    assert args.iterations == 3 and args.run_args == ["--ppo-mini-batches", "1"]
    for bad in (["--iterations", "0"], ["--questions", "0"], ["--lr", "0"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


@pytest.mark.parametrize(("em", "where"), [(START_BAND[0], "inside"), (START_BAND[1], "inside"),
                                           (START_BAND[0] - 0.01, "OUTSIDE"), (START_BAND[1] + 0.01, "OUTSIDE")])
def test_the_demo_says_whether_its_start_exact_match_landed_in_the_band(em, where):
    text = band_text(Interval(em, em - 0.07, em + 0.07), short=sum(SHORT_BAND) / 2)
    assert f"is {where} the band [{START_BAND[0]:.2f}, {START_BAND[1]:.2f}]" in text
    assert text.endswith(".") and ("docs/benchmarks.md" in text) == (where == "OUTSIDE")
    if em < START_BAND[0]:
        assert "copies fewer names" in text
    if em > START_BAND[1]:
        assert "fewer questions one hop short" in text


@pytest.mark.parametrize(("short", "where", "reason"), [
    (SHORT_BAND[0], "inside", None), (SHORT_BAND[1], "inside", None),
    (SHORT_BAND[0] - 0.01, "OUTSIDE", "fewer questions one hop short"),
    (SHORT_BAND[1] + 0.01, "OUTSIDE", "more questions one hop short"),
])
def test_the_demo_says_whether_its_start_answers_the_intended_share_one_hop_short(short, where, reason):
    em = sum(START_BAND) / 2
    text = band_text(Interval(em, em - 0.07, em + 0.07), short=short)
    assert f"before their last hop, {where} the band [{SHORT_BAND[0]:.0%}, {SHORT_BAND[1]:.0%}]" in text
    assert f"answers {short:.0%} of the questions" in text
    if reason:
        assert reason in text and "is inside the band" in text  # the exact match is in its band


def test_the_short_share_counts_answers_before_the_last_hop():
    rows = [row(em=1.0, answered=1.0, tool_calls=2, hops=2), row(answered=1.0, tool_calls=1, hops=2),
            row(answered=1.0, tool_calls=1, hops=2), row(answered=0.0, tool_calls=3, hops=2)]
    assert short_share(rows) == 0.5
    assert short_share(rows[:1]) == 0.0


@pytest.mark.parametrize(("iterations", "every", "points"), [(8, 4, [4, 8]), (8, 3, [3, 6, 8]), (8, 8, [8]),
                                                              (1, 1, [1])])
def test_the_learning_curve_evaluates_every_k_iterations_and_the_last(iterations, every, points):
    assert curve_iterations(iterations, every) == points


def test_curve_and_seed_options_at_their_edges():
    assert parse_args(["--iterations", "8"]).curve_every == 4 and parse_args(["--iterations", "1"]).curve_every == 1
    assert parse_args(["--start-seed", "3"]).start_seed == 3
    for bad in (["--curve-every", "0"], ["--iterations", "4", "--curve-every", "5"], ["--questions", "100000"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_the_held_out_curve_is_drawn_with_its_intervals(tmp_path):
    from experiments.plot import plot_held_out_curve

    rows = [{"iteration": i, "reward_mean": 0.1 * i} for i in range(1, 5)]
    path = plot_held_out_curve(rows, [(0, 0.5, 0.43, 0.57), (4, 0.7, 0.64, 0.76)], tmp_path / "curve.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


def test_update_report_gives_intervals_and_the_paired_difference():
    def payload(answered_after: list[float]) -> dict:
        questions = {"before": [row() for _ in answered_after],
                     "after": [row(answered=a, reward=0.1 * a) for a in answered_after]}
        result = compare(questions["before"], questions["after"])
        return {"questions": questions, "metrics": {k: {p: vars(i) for p, i in v.items()}
                                                   for k, v in result["metrics"].items()}}

    runs = {"K=1": {0: payload([0, 0, 1, 0] * 10), 1: payload([0, 1, 0, 0] * 10)},
            "K=4": {0: payload([1, 1, 1, 0] * 10), 1: payload([1, 1, 0, 1] * 10)}}
    args = argparse.Namespace(settings=["K=1", "K=4"], seeds=[0, 1], iterations=4)
    text = update_report(args, runs, {"K=1": 3.0, "K=4": 3.5})
    assert "| K=1 | " in text and "| K=4 | " in text and "| start policy | 0.000" in text
    difference = next(line for line in text.splitlines() if line.startswith("| answer rate |"))
    assert difference.startswith("| answer rate | 0.500 [") and difference.endswith("| yes |")
    assert Interval(**runs["K=4"][0]["metrics"]["answered"]["after"]).mean == 0.75


def test_the_start_spread_retrains_the_demo_recipe_with_only_its_seed_changed():
    from experiments.demo import WARM_START, recipe_with_seed

    changed = recipe_with_seed(WARM_START, 3)
    differ = [i for i, (a, b) in enumerate(zip(WARM_START, changed, strict=True)) if a != b]
    assert differ == [WARM_START.index("--seed") + 1] and changed[differ[0]] == "3"


def test_the_start_policy_tips_the_seeds_first_stage_with_a_second_of_the_same_seed(tmp_path, monkeypatch):
    import experiments.demo as demo

    calls = []
    monkeypatch.setattr(demo, "cached_warm_start", lambda world, recipe, **kwargs: calls.append((recipe, kwargs)))
    demo.start_policy(7, tmp_path)
    [(recipe, kwargs)] = calls
    assert recipe == demo.recipe_with_seed(demo.ONE_HOP_SHORT, 7)
    assert kwargs == {"topk": demo.TOPK, "cache_dir": tmp_path, "continues": demo.recipe_with_seed(demo.WARM_START, 7)}
    # the second stage trains at the first one's extra-epoch rate, constant, on more answers one hop short than it
    first, second = (dict(zip(r[::2], r[1::2], strict=True)) for r in (demo.WARM_START, demo.ONE_HOP_SHORT))
    assert float(second["--lr"]) == pytest.approx(float(first["--lr"]) * float(first["--extra-lr"]))
    assert second["--lr-floor"] == "1.0" and float(second["--premature"]) > float(first["--premature"])
    assert second["--extra-worlds"] == first["--extra-worlds"] and "--model" not in second


def test_the_demo_leaves_the_device_defaults_to_run_py(tmp_path, monkeypatch):
    """device_check.sh learn runs the demo on a GPU with every GPU default: of run.py's per-device defaults the demo
    sets only its task's (its start as the model, 8 prompts per iteration, 48-token steps), never the device's
    (where the learner runs, the precision, checkpointing, skipping idle updates), so a GPU gets bf16 over float32
    masters with the learner on it, and the CPU what the CPU demo always ran."""
    import algos.tree_grpo.settings as algorithm_settings
    from experiments.cli import given_options
    from experiments.demo import task_options
    from experiments.run import plan, run_parser
    from experiments.settings import RunSettings

    argv = [*task_options(tmp_path, tmp_path / "model", 0), "--output", str(tmp_path / "run")]
    given, _ = given_options(RunSettings, run_parser().parse_args(argv))
    settings = {}
    for gpu in (True, False):
        monkeypatch.setattr(algorithm_settings, "gpu_visible", lambda gpu=gpu: gpu)
        # the defaults of the demo's env (HotpotQA-v0's CPU defaults are its warm start's, not the device's alone)
        settings[gpu] = (plan(["--env", "SynthHop-v0", "--output", str(tmp_path / "defaults")]).settings,
                         plan(argv).settings)
    (gpu_defaults, on_gpu), (cpu_defaults, on_cpu) = settings[True], settings[False]
    per_device = {name for name in RunSettings.model_fields
                  if getattr(gpu_defaults, name) != getattr(cpu_defaults, name)}
    assert {"dtype", "num_gpus_per_learner", "gradient_checkpointing", "skip_uniform_rewards"} <= per_device
    task = {"model", "prompts_per_iteration", "max_step_tokens"}  # max_step_tokens: per device by torch's own check
    assert {"model", "prompts_per_iteration"} <= per_device & set(given) <= task
    assert (on_gpu.dtype, on_gpu.pure_bf16, on_gpu.num_gpus_per_learner, on_gpu.gradient_checkpointing) == (
        "bfloat16", False, 1.0, True)
    assert (on_cpu.dtype, on_cpu.num_gpus_per_learner, on_cpu.gradient_checkpointing) == ("float32", 0.0, False)
    assert on_gpu.prompts_per_iteration == on_cpu.prompts_per_iteration == 8


def test_the_demo_replaces_only_its_own_runs(tmp_path):
    from benchmarks import run_records
    from experiments import demo

    ours = tmp_path / "ours"
    demo.claim_output(ours)  # a new folder: made, and marked as a demo's
    (ours / "metrics.jsonl").write_text("{}\n")  # the demo's run, interrupted before demo.json
    demo.claim_output(ours)
    assert sorted(p.name for p in ours.iterdir()) == [demo.DEMO_MARKER]  # replaced
    theirs = tmp_path / "theirs"
    (theirs / "checkpoints").mkdir(parents=True)
    (theirs / "metrics.jsonl").write_text("{}\n")  # a run.py run
    with pytest.raises(SystemExit, match=r"holds a run that is not a demo's \(metrics.jsonl, checkpoints\)"):
        demo.claim_output(theirs)
    assert (theirs / "checkpoints").is_dir() and (theirs / "metrics.jsonl").is_file()  # left as it was
    assert run_records.DEMO_RESULT == demo.DEMO_RESULT  # the pipelining study's records keep the demo's result


def test_a_first_demo_says_how_long_it_will_take_on_this_cpu(tmp_path, monkeypatch, capsys):
    import torch

    import experiments.demo as demo

    monkeypatch.setattr(demo, "cached_warm_start", lambda world, recipe, **kwargs: None)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    demo.start_policy(0, tmp_path)
    assert f"this demo takes about {demo.FIRST_RUN_MINUTES['AVX2']} minutes" in capsys.readouterr().out
    model = demo.start_policy_dir(0, tmp_path)
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    demo.start_policy(0, tmp_path)  # cached: nothing said
    assert capsys.readouterr().out == ""
