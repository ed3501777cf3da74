"""The benchmark scripts without measuring anything: their command lines, defaults, reruns and summaries."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import benchmarks.bench_learning as bench_learning
import benchmarks.learning_options as learning_options
import benchmarks.learning_report as learning_report
import benchmarks.learning_runs as learning_runs
import benchmarks.learning_stats as learning_stats
import experiments.run
from algos.tree import Node, Tree
from benchmarks.bench_learning import COMPARISONS, SETTINGS, TESTBED
from benchmarks.decision_draws import draws_at_depth
from benchmarks.learning_report import verdict
from benchmarks.learning_runs import train_run
from benchmarks.learning_stats import compare, mean_rows, reward_first_and_last, summarize
from experiments.confidence import detectable_difference, seeds_for_power
from policies.generation import default_max_step_tokens
from policies.trajectory import TokenTrajectory

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ("bench_branching", "bench_budget", "bench_device", "bench_generation", "bench_learning",
           "bench_pipelining", "bench_retrieval", "bench_rollout", "bench_update")


@pytest.mark.parametrize("name", SCRIPTS)
def test_each_script_parses_its_defaults_and_prints_its_help(name, capsys):
    module = importlib.import_module(f"benchmarks.{name}")
    assert callable(module.main)
    assert isinstance(module.parse_args([]), argparse.Namespace)
    with pytest.raises(SystemExit) as exit_:
        module.parse_args(["--help"])
    assert exit_.value.code == 0
    assert "--output" in capsys.readouterr().out


@pytest.mark.parametrize("name", ["bench_generation", "bench_rollout"])
def test_step_cap_defaults_to_the_projects(name):
    module = importlib.import_module(f"benchmarks.{name}")
    assert module.parse_args([]).max_step_tokens == default_max_step_tokens()


def test_hf_against_vllm_warms_each_backend_up_and_times_both_on_the_same_shapes(tmp_path, monkeypatch):
    import torch

    import benchmarks.bench_generation as bench_generation
    import policies.vllm_generation as vllm_generation
    from algos.rollout import TreeShape
    from policies.generation import SamplingSettings

    grown, closed = [], []

    def grow(generator, tokenizer, questions, shape, seed, env_name="HotpotQA-v0"):
        grown.append((generator, tuple(questions), shape, env_name))
        return {"tokens_generated": 100, "tokens_prefilled": 10, "llm_calls": 4, "forward_passes": 20,
                "tool_calls": 0, "leaves": 6, "seconds": 2.0 if generator == "vllm" else 4.0}

    class Engine:
        def __init__(self, model, tokenizer, settings):
            pass

        def close(self):
            closed.append(True)

    monkeypatch.setattr(bench_generation, "grow_with", grow)
    monkeypatch.setattr(bench_generation, "HFStepGenerator", lambda *args, **kwargs: "hf")
    monkeypatch.setattr(bench_generation, "vllm_installed", lambda: True)
    monkeypatch.setattr(vllm_generation, "VLLMEngine", Engine)
    monkeypatch.setattr(vllm_generation, "VLLMStepGenerator", lambda *args, **kwargs: "vllm")
    args = bench_generation.parse_args(["--generator", "hf", "vllm", "--model", "smollm2-135m-random", "--env",
                                        "SynthHop-v0", "--questions", "3", "--warmup-rollouts", "1", "--device",
                                        "cpu", "--dtype", "bfloat16", "--json", str(tmp_path / "rows.json")])
    model = torch.nn.Linear(2, 2).to(torch.bfloat16)
    section = bench_generation.vllm_against_hf(model, None, args, SamplingSettings(max_step_tokens=8))
    tree, chain, questions = TreeShape(2, 2, 1), TreeShape(6, 0, 0), (0, 1, 2)
    for backend in ("hf", "vllm"):  # one chain, one untimed rollout of each shape, then the timed ones
        assert [(q, s) for g, q, s, _ in grown if g == backend] == [
            ((0,), TreeShape(1, 0, 0)), (questions, tree), (questions, chain), (questions, tree), (questions, chain)]
    assert {env for *_, env in grown} == {"SynthHop-v0"} and closed == [True]
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert [(r["backend"], r["rollout"], r["tokens_per_s"]) for r in rows] == [
        ("hf", "tree", 25.0), ("hf", "chain", 25.0), ("vllm", "tree", 50.0), ("vllm", "chain", 50.0)]
    assert "--device cpu --dtype bfloat16 --env SynthHop-v0 --warmup-rollouts 1`" in section
    assert "SynthHop-v0 questions (bench_device.py's world)" in section and "| 0.50x |" in section


def test_a_script_runs_as_a_file():
    # bench_retrieval runs its measurements as subprocesses of its own file, so the file must run on its own.
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_retrieval.py"), "--help"], cwd=ROOT,
                          env=environment, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "--large-passages" in done.stdout


def test_a_rerun_of_a_setting_starts_a_fresh_run(tmp_path, monkeypatch):
    # run.py refuses an --output that holds a run: the benchmark clears the setting's directory first.
    def planned_run(argv: list[str]) -> None:
        output = Path(experiments.run.plan(argv).settings.output)  # a SettingsError if it holds a run
        output.mkdir(parents=True, exist_ok=True)
        (output / experiments.run.METRICS_FILE).write_text("{}\n")

    monkeypatch.setattr(experiments.run, "main", planned_run)
    args = argparse.Namespace(iterations=1, prompts_per_iter=2, lr=1e-4, warmup_steps=None, top_p=None,
                              entropy_coef=None, stop_after_uniform=None, max_step_tokens=8, eval_every=1,
                              curve_questions=2)
    first = train_run(TESTBED, "chain G=4", 0, "tiny-random", args, tmp_path)
    (first.parent / "checkpoints").mkdir()
    (first.parent / "checkpoints" / "stale").write_text("from the first run")
    again = train_run(TESTBED, "chain G=4", 0, "tiny-random", args, tmp_path)
    assert again == first == tmp_path / "chain_G=4" / "seed0" / experiments.run.METRICS_FILE
    assert not (first.parent / "checkpoints").exists()


def test_resume_reuses_runs_evaluates_again_for_other_questions_and_retrains_on_other_options(tmp_path, monkeypatch):
    trained, evaluated = [], []

    def fake_run(testbed, setting, seed, model_dir, args, output):
        directory = learning_runs.run_directory(setting, seed, output)
        (directory / "checkpoints" / "latest").mkdir(parents=True, exist_ok=True)
        (directory / "metrics.jsonl").write_text(f'{{"iteration": {args.iterations}}}\n')
        trained.append((setting, seed))

    def fake_scores(testbed, policy, args):
        evaluated.append(policy)
        return scores(len(evaluated))

    monkeypatch.setattr(learning_runs, "train_run", fake_run)
    monkeypatch.setattr(learning_runs, "held_out_scores", fake_scores)
    args = bench_learning.parse_args(["--resume", "--iterations", "2", "--output", str(tmp_path)])
    first = learning_runs.finished_run(TESTBED, "chain G=4", 1, "warm", args, tmp_path)
    assert first == ([{"iteration": 2}], scores(1)) and trained == [("chain G=4", 1)]
    assert learning_runs.finished_run(TESTBED, "chain G=4", 1, "warm", args, tmp_path) == first  # reused: nothing ran
    assert len(trained) == 1 and len(evaluated) == 1
    other_questions = bench_learning.parse_args(["--resume", "--iterations", "2", "--eval-questions", "10",
                                                 "--output", str(tmp_path)])
    again = learning_runs.finished_run(TESTBED, "chain G=4", 1, "warm", other_questions, tmp_path)
    assert again == ([{"iteration": 2}], scores(2)) and len(trained) == 1  # the same training, evaluated again
    copy = tmp_path / "copy"  # a run trained and evaluated under another --output (a pilot's) is reused as it is
    run = learning_runs.run_directory("chain G=4", 1, tmp_path)
    shutil.copytree(run, learning_runs.run_directory("chain G=4", 1, copy))
    assert learning_runs.finished_run(TESTBED, "chain G=4", 1, "warm", other_questions, copy) == again
    assert len(trained) == 1 and len(evaluated) == 2
    learning_runs.finished_run(TESTBED, "chain G=4", 1, "warm", args, copy)  # its record is for 10 questions
    assert len(trained) == 1 and len(evaluated) == 3
    longer = bench_learning.parse_args(["--resume", "--iterations", "3", "--output", str(tmp_path)])
    learning_runs.finished_run(TESTBED, "chain G=4", 1, "warm", longer, tmp_path)  # other training: a run of its own
    assert trained == [("chain G=4", 1)] * 2
    learning_runs.finished_run(TESTBED, "chain G=4", 1, "warm", bench_learning.parse_args(["--output", str(tmp_path)]),
                                tmp_path)
    assert len(trained) == 3  # without --resume every run is fresh
    assert learning_runs.start_point_scores(TESTBED, "warm", args, tmp_path) == scores(6)
    assert learning_runs.start_point_scores(TESTBED, "warm", args, tmp_path) == scores(6) and len(evaluated) == 6
    assert learning_runs.start_point_scores(TESTBED, "other", args, tmp_path) == scores(7)


def scores(*ems: float) -> list[dict[str, float]]:
    return [{"em": em, "tool_calls": 2.0, "answered": 1.0, "hops": 2.0} for em in ems]


def two_seed_runs() -> tuple[dict[str, list[list[dict]]], dict[str, list[list[dict[str, float]]]]]:
    """(metrics rows, final held-out scores) of two seeds of the tree (2,2,1) setting."""
    runs = {"tree (2,2,1)": [
        [{"iteration": 1, "dev_em": None, "tokens_generated": 100, "tool_calls": 6, "reward_mean": 0.2, "time_s": 3.0},
         {"iteration": 2, "dev_em": 0.5, "tokens_generated": 50, "tool_calls": 4, "reward_mean": 0.4, "time_s": 2.0}],
        [{"iteration": 1, "dev_em": None, "tokens_generated": 80, "tool_calls": 2, "reward_mean": 0.1, "time_s": 4.0},
         {"iteration": 2, "dev_em": 0.3, "tokens_generated": 70, "tool_calls": 8, "reward_mean": 0.3, "time_s": 1.0}]]}
    for seed in runs["tree (2,2,1)"]:
        for row in seed:
            row["tokens_generated_total"] = sum(r["tokens_generated"] for r in seed[: row["iteration"]])
    finals = {"tree (2,2,1)": [scores(1, 1, 0, 0), scores(1, 1, 1, 1)]}  # seed means 0.5 and 1.0
    return runs, finals


def test_learning_summary_and_plot_rows():
    runs, finals = two_seed_runs()
    s = summarize(TESTBED, runs, finals, before=scores(0, 0, 1, 0))["tree (2,2,1)"]
    assert s["budget"] == SETTINGS["tree (2,2,1)"][0] == 4 and s["dev_em"]["mean"] == pytest.approx(0.75)
    assert s["dev_em_per_seed"] == [0.5, 1.0] and s["dev_em_before"]["mean"] == 0.25
    assert s["dev_em"]["low"] < 0.75 < s["dev_em"]["high"] <= 1.0
    assert s["tokens_generated_per_seed"] == [150, 150] and s["tool_calls_per_seed"] == [10, 10]
    assert s["seconds_per_seed"] == [5.0, 5.0] and s["tool_calls"] == 2.0
    assert s["failures"] == {"correct": 0.75, "wrong answer": 0.25} and s["failures_before"]["correct"] == 0.25
    assert s["reward_first_last"] == pytest.approx([0.15, 0.35])  # (0.2, 0.4) and (0.1, 0.3) over the two seeds
    rows = mean_rows(runs["tree (2,2,1)"], before=0.1)
    assert [r["iteration"] for r in rows] == [0, 1, 2] and rows[0]["dev_em"] == 0.1
    assert rows[1]["tokens_generated"] == 90 and rows[1]["dev_em"] is None and rows[2]["dev_em"] == pytest.approx(0.4)
    assert [r["tool_calls"] for r in rows] == [0, 4, 6]
    assert rows[0]["dev_em_std"] == 0.0 and rows[1]["dev_em_std"] is None
    assert rows[2]["dev_em_std"] == pytest.approx(0.1)  # population std of 0.5 and 0.3


def test_results_are_written_and_the_curves_start_on_the_curve_questions(tmp_path, monkeypatch):
    plotted = {}
    monkeypatch.setattr(learning_report, "plot_runs", lambda runs, path, metrics: plotted.update(runs) or Path(path))
    args = bench_learning.parse_args(["--curve-questions", "2", "--output", str(tmp_path)])
    runs, finals = two_seed_runs()
    table, plot = learning_report.write_results(TESTBED, runs, finals, scores(1, 1, 0, 0), args, "W", 120.0, tmp_path)
    # the curves' dev EM is on the first 2 held-out questions: so is their start point (1.0, not 0.5 over all 4)
    assert plotted["tree (2,2,1)"][0]["dev_em"] == 1.0 and plot == tmp_path / "learning.png"
    saved = json.loads((tmp_path / "learning.json").read_text(encoding="utf-8"))
    assert saved["summary"]["tree (2,2,1)"]["dev_em_before"]["mean"] == 0.5
    assert (tmp_path / "learning.md").read_text(encoding="utf-8") == table
    # nominal budget, measured tokens per run, tokens per prompt (the rows count no prompts), iterations, EM before
    assert "| tree (2,2,1) | 4 | 150 | - | 2.0 | 0.500" in table and "this invocation: 2 min" in table
    assert "| start point | 0.50 | 0.50 |" in table and "wrong route" not in table  # the kinds that occur
    assert "| 0.150 -> 0.350 |" in table and "Plateau exit" not in table  # not this testbed's outcome


def test_a_testbed_with_a_plateau_reports_where_each_run_left_it(tmp_path, monkeypatch):
    monkeypatch.setattr(learning_report, "plot_runs", lambda runs, path, metrics: Path(path))
    args = bench_learning.parse_args(["--seeds", "0", "1", "2", "--output", str(tmp_path)])
    runs, finals = two_seed_runs()  # curves end at 0.5 (150 tokens) and at 0.3; the third seed has not run
    testbed = dataclasses.replace(TESTBED, plateau_threshold=0.4)
    table, _ = learning_report.write_results(testbed, runs, finals, scores(1, 1, 0, 0), args, "W", 1.0, tmp_path)
    saved = json.loads((tmp_path / "learning.json").read_text(encoding="utf-8"))
    assert saved["summary"]["tree (2,2,1)"]["plateau_exit_per_seed"] == [150, None]
    assert "Plateau exit (benchmarks/plateau_exit.py, threshold 0.4)" in table
    assert saved["summary"]["tree (2,2,1)"]["first_passage_per_seed"] == [150, None]
    assert "| setting | seed 0 | seed 1 | seed 2 | runs that left / reached it |" in table
    # no gradient norms in these rows: no share
    assert "| tree (2,2,1) | 150; first 150 | stayed; first never |  | 1 / 1 of 2 |" in table
    runs["tree (2,2,1)"][1] = [{**row, "grad_norm": norm} for row, norm in zip(runs["tree (2,2,1)"][1], (0.5, 0.0),
                                                                             strict=False)]
    table, _ = learning_report.write_results(testbed, runs, finals, scores(1, 1, 0, 0), args, "W", 1.0, tmp_path)
    assert "| tree (2,2,1) | 150; first 150 | stayed; first never (1.00) |  | 1 / 1 of 2 |" in table
    assert "below 0.001 (silent updates" in table


def test_reward_first_and_last_averages_a_tenth_of_the_iterations_at_each_end():
    rows = [{"reward_mean": r} for r in [0.0, 0.2, *[0.5] * 16, 0.6, 1.0]]  # 20 iterations: 2 at each end
    assert reward_first_and_last(rows) == pytest.approx((0.1, 0.8))
    assert reward_first_and_last(rows[:3]) == pytest.approx((0.0, 0.5))  # fewer than 10: one at each end
    assert reward_first_and_last(rows, share=0.5) == pytest.approx((0.42, 0.56))  # halves: 4.2 / 10, 5.6 / 10


def test_comparisons_pair_seeds_and_questions_and_read_the_direction():
    assert set(SETTINGS) == {name for pair in COMPARISONS for name in pair}  # the 7 settings, every one compared
    finals = {"tree (2,2,1)": [scores(1, 1, 0), scores(1, 0, 1)], "chain G=4": [scores(0, 1, 0), scores(0, 0, 1)],
              "chain G=16": [scores(1, 1, 0), scores(1, 0, 1)], "tree (1,2,1)": [scores(1, 1, 1)]}
    differences = compare(TESTBED, finals)
    # tree - chain G=4: question 0 gains 1 on both seeds, nothing else moves -> 1/3 on every resample with q0 once
    tree_vs_chain4 = differences["tree (2,2,1) - chain G=4"]
    assert tree_vs_chain4["mean"] == pytest.approx(1 / 3) and tree_vs_chain4["low"] >= 0
    # the paired differences 1, 0, 0 on both seeds: sample std sqrt(4/15) over the 6 cells, equal seed means
    assert tree_vs_chain4["sd_paired"] == pytest.approx(np.sqrt(4 / 15)) and tree_vs_chain4["sd_seed_means"] == 0
    assert tree_vs_chain4["cells"] == 6
    assert tree_vs_chain4["detectable"] == pytest.approx(detectable_difference(np.sqrt(4 / 15), 6))
    assert tree_vs_chain4["detectable_over_seeds"] == 0  # both seeds' means differ by 1/3: no spread over seeds
    # seeds that differ: the per-seed mean differences 1, 0, 1 (sample std sqrt(1/3)) set what 3 seeds can see
    by_seed = compare(TESTBED, {"tree (2,2,1)": [scores(1, 1), scores(0, 0), scores(1, 1)],
                                "chain G=4": [scores(0, 0)] * 3})["tree (2,2,1) - chain G=4"]
    assert by_seed["sd_seed_means"] == pytest.approx(np.sqrt(1 / 3))
    assert by_seed["detectable_over_seeds"] == pytest.approx(detectable_difference(np.sqrt(1 / 3), 3))
    assert by_seed["detectable_over_seeds"] > by_seed["detectable"]  # 6 cells taken as independent see less
    assert tree_vs_chain4["seeds_for_delta"] == seeds_for_power(np.sqrt(4 / 15), 0.03, questions=3)
    same = differences["tree (2,2,1) - chain G=16"]
    assert {k: same[k] for k in ("mean", "low", "high")} == {"mean": 0.0, "low": 0.0, "high": 0.0}
    assert verdict(same).startswith("inside the noise") and same["seeds_for_delta"] is None
    assert "tree (1,2,1) - chain G=2" not in differences  # chain G=2 did not run
    # the tests over seeds: both seeds' mean differences 1/3 (no spread: t p 0), sign flips of [1/3, 1/3] give sums
    # +-2/3 and 0 twice: p 2/4; the other comparison's [0, 0]: p 1; Holm over the 2: 0.5 x 2 = 1, then max(1, 1)
    assert tree_vs_chain4["t_p"] == 0 and tree_vs_chain4["sign_flip_p"] == 0.5 and same["sign_flip_p"] == 1
    assert tree_vs_chain4["p_holm"] == same["p_holm"] == 1.0
    assert verdict(tree_vs_chain4).startswith("inside the noise")  # the bootstrap excludes 0; 2 seeds cannot
    assert verdict({"mean": 0.2, "p_holm": 0.01}).endswith("the expected direction holds")
    assert verdict({"mean": -0.2, "p_holm": 0.04}).endswith("does not hold here")


def test_prefix_sharing_batches_have_the_trees_structure():
    from benchmarks.bench_prefix_sharing import Profile, parse_args, tree_rows

    profile = Profile(prompt=5, observation=3, step=2, turns=3)
    ids, masks, prompt_of = tree_rows(np.random.default_rng(0), profile, (2, 2, 1), prompts=3, vocab=1000)
    assert len(ids) == 3 * 2 * (1 + 2) and prompt_of == [p for p in range(3) for _ in range(6)]
    full = 5 + 3 * 2 + 2 * 3  # prompt, three steps, two observations
    assert all(len(row) == len(mask) == full for row, mask in zip(ids, masks, strict=True))
    assert all(sum(mask) == 3 * 2 for mask in masks)  # three generated steps
    for tree in range(6):  # a tree's expansions repeat its chain up to a step and its observation, then differ
        chain, *branches = ids[3 * tree: 3 * tree + 3]
        for branch in branches:
            shared = next(i for i, (a, b) in enumerate(zip(chain, branch, strict=True)) if a != b)
            assert shared in (5 + 2 + 3, 5 + 2 * (2 + 3))  # after turn 1 or turn 2
    assert all(ids[6 * p][:5] == ids[6 * p + 5][:5] for p in range(3))  # one prompt per group
    assert parse_args(["--device", "cpu"]).dtype == "float32"


def test_no_script_folder_module_shadows_the_standard_library():
    # `python experiments/demo.py` puts experiments/ first on sys.path: a file named like a standard module
    # (statistics.py, say) would replace it for every library the script imports
    for folder in ("experiments", "benchmarks"):
        names = {path.stem for path in (ROOT / folder).glob("*.py")}
        assert not names & set(sys.stdlib_module_names), (folder, names & set(sys.stdlib_module_names))


def test_the_device_check_runs_on_the_cpu_and_finds_no_fp32_gap(tmp_path, monkeypatch):
    # the Ray-free rollout + learner passes that run on a lent GPU: on the CPU in fp32 the learner's log-probs of
    # the sampled tokens are the sampler's, with the rollout's decode passes in static shapes (as on a GPU, where
    # they are replayed as CUDA graphs)
    from benchmarks.bench_device import main as device_check

    monkeypatch.setenv("TREEGRPO_CACHE_DIR", str(tmp_path / "cache"))
    text = device_check(["--quick", "--static-decode", "on", "--output", str(tmp_path / "device.md"),
                         "--host-profile", str(tmp_path / "profile.txt")])
    rows = dict((cell.strip() for cell in line.strip("|").split("|", 1)) for line in text.splitlines()
                if line.startswith("| "))
    assert rows["leaves / prompts"] == "6 / 1"
    assert float(rows["sampler/learner mean abs log-prob gap"]) < 1e-4
    assert rows["GPU busy share of the rollout (profiler, another rollout)"] == "not measured (no GPU)"
    assert 10.0 < float(rows["mean -log p of the sampled tokens (nats; about the entropy)"]) < 10.81  # flat: ln 49152
    static, captured, passes = (int(v.replace(",", "")) for v in
                                rows["decode passes in static shapes / CUDA graphs captured / all passes"].split(" / "))
    assert 0 < static < passes and captured == 0
    for measure in ("log-prob pass seconds, no gradients", "step seconds", "step peak GiB"):
        per_row, shared = map(float, rows[f"learner {measure} (per row / shared sdpa)"].split(" / "))
        assert per_row > 0 and shared > 0
    assert (tmp_path / "device.md").read_text() == text
    profile = (tmp_path / "profile.txt").read_text()  # one more rollout's host functions, by own and total time
    assert "Ordered by: internal time" in profile and "Ordered by: cumulative time" in profile
    assert "model_runner.py" in profile


def test_kernel_busy_time_is_the_union_of_kernel_intervals():
    from benchmarks.bench_device import covered_seconds

    assert covered_seconds([(0, 2), (1, 3), (5, 6), (5.5, 5.75), (10, 10)]) == 4.0  # [0, 3] and [5, 6]
    assert covered_seconds([]) == 0.0


def test_the_docs_copy_of_a_plot_keeps_its_pixels_size_and_lines(tmp_path):
    from PIL import Image

    from benchmarks.report import compact_plot_copy

    source = tmp_path / "plot.png"
    pixels = np.full((40, 60, 3), 255, dtype=np.uint8)
    pixels[10, :] = (31, 119, 180)  # a line in matplotlib's first colour, on white
    pixels[:, 30] = (255, 127, 14)
    Image.fromarray(pixels).save(source)
    copy = compact_plot_copy(source, tmp_path / "docs" / "plot.png", colors=16)
    with Image.open(copy) as image:
        assert image.mode == "P" and image.size == (60, 40)
        assert np.array_equal(np.asarray(image.convert("RGB")), pixels)  # 3 colours: the palette holds them exactly


def test_processes_sharing_an_output_take_the_start_lock_in_turn(tmp_path):
    order, inside = [], threading.Event()

    def first() -> None:
        with learning_runs.exclusive(tmp_path / "start.lock"):
            inside.set()
            time.sleep(0.3)  # long enough for the second to reach the lock, were it free
            order.append("first leaves")

    thread = threading.Thread(target=first)
    thread.start()
    assert inside.wait(10)
    with learning_runs.exclusive(tmp_path / "start.lock"):
        order.append("second enters")
    thread.join()
    assert order == ["first leaves", "second enters"]


def test_start_only_trains_and_scores_the_start_and_runs_nothing(tmp_path, monkeypatch):
    import benchmarks.bench_budget as bench_budget

    started, scored = [], []

    def no_run(*args, **kwargs):
        raise AssertionError("--start-only trained a run")

    monkeypatch.setattr(learning_runs, "finished_run", no_run)
    monkeypatch.setattr(learning_runs, "start_point_scores",
                        lambda testbed, warm, args, output: scored.append(warm) or scores(0.5))
    args = bench_budget.parse_args(["--start-only", "--output", str(tmp_path)])
    answer = learning_runs.run_benchmark(bench_budget.testbed(args), args,
                                         lambda: started.append(1) or tmp_path / "start", [], "bench_budget.py")
    assert answer == tmp_path / "budget-table.md" and started == [1]
    assert scored == [str((tmp_path / "start").resolve())] and not answer.exists()


@pytest.mark.slow
def test_the_branching_benchmark_at_toy_size_writes_its_report_and_a_resume_reuses_its_runs(tmp_path, monkeypatch):
    # a tiny-random start on a tiny SynthBranch world, 2 settings x 1 seed, each run stopped by its token budget
    # after its first iteration; then --resume again: nothing trains or evaluates, the same table comes back
    import ray

    import benchmarks.bench_branching as bench_branching
    from envs.synthetic import BranchSpec
    from policies.models import load_model

    monkeypatch.setenv("TREEGRPO_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(bench_branching, "WORLD", BranchSpec(people=20, companies=10, cities=6, countries=3,
                                                             train_questions=8, dev_questions=4))
    monkeypatch.chdir(tmp_path)  # --report writes the study's README and plot under results/ here
    model, tokenizer = load_model("tiny-random")
    model.save_pretrained(tmp_path / "warm")
    tokenizer.save_pretrained(tmp_path / "warm")
    argv = ["--warm", str(tmp_path / "warm"), "--settings", bench_branching.UNIFORM, bench_branching.CHAIN_EQUAL,
            "--seeds", "0", "--chain-group-size", "2", "--token-budget", "40", "--iterations", "3",
            "--prompts-per-iter", "2", "--eval-every", "1", "--curve-questions", "2", "--eval-questions", "4",
            "--max-step-tokens", "8", "--output", "out", "--resume", "--report"]
    try:
        first = bench_branching.main(argv)
    finally:
        ray.shutdown()
    table = first.read_text(encoding="utf-8")
    assert first == Path("out") / "branching.md" and (tmp_path / "out" / "branching.png").is_file()
    saved = json.loads((tmp_path / "out" / "branching.json").read_text(encoding="utf-8"))
    for setting, budget in ((bench_branching.UNIFORM, 4), (bench_branching.CHAIN_EQUAL, 2)):
        summary = saved["summary"][setting]
        assert summary["budget"] == budget and summary["iterations_per_seed"] == [1]  # 40 tokens: one iteration
        assert summary["tokens_generated_per_seed"][0] >= 40 and set(summary["routing_before"]) >= {"routed_right"}
        assert f"| {setting} | {budget} | {summary['tokens_generated_per_seed'][0]:,} |" in table
    difference = saved["differences"][f"{bench_branching.UNIFORM} - {bench_branching.CHAIN_EQUAL}"]
    assert difference["cells"] == 4 and "sd_paired" in difference
    assert "Start point: routed right on" in table and "| routed right (after) |" in table
    assert "Plateau exit (benchmarks/plateau_exit.py, threshold 0.7)" in table
    assert all(len(saved["summary"][s]["plateau_exit_per_seed"]) == 1 for s in saved["summary"])
    # no study registers this output: its section and plot go to a study folder named after it, none to docs/
    study = tmp_path / "results" / "out"
    docs = (study / "README.md").read_text(encoding="utf-8")
    assert "<!-- branching:begin -->" in docs and table in docs and (study / "branching.png").is_file()
    assert not (tmp_path / "docs").exists()

    def nothing_runs(*args, **kwargs):
        raise AssertionError("a finished run was trained or evaluated again")

    monkeypatch.setattr(learning_runs, "train_run", nothing_runs)
    monkeypatch.setattr(learning_runs, "held_out_scores", nothing_runs)
    again = bench_branching.main([*argv[:-1]])  # without --report
    # the same runs and scores; only the invocation's own minutes may differ
    assert again.read_text(encoding="utf-8").split("\n", 1)[1] == table.split("\n", 1)[1]


def test_branching_settings_share_one_token_budget_and_the_pilot_its_own_sizes(capsys):
    import benchmarks.bench_branching as bench_branching

    args = bench_branching.parse_args(["--token-budget", "1000", "--chain-group-size", "5"])
    testbed = bench_branching.testbed(args)
    budgets = {name: options[options.index("--token-budget") + 1] for name, (_, options) in testbed.settings.items()}
    assert budgets == {name: "4000" if name == bench_branching.CHAIN_16 else "1000" for name in budgets}
    assert testbed.settings[bench_branching.CHAIN_EQUAL] == (5, ["--algo", "grpo", "--group-size", "5",
                                                                 "--token-budget", "1000"])
    compared = (*bench_branching.COMPARISONS, *bench_branching.LEAD_COMPARISONS)
    assert set(testbed.settings) == {name for pair in compared for name in pair}  # every setting compared
    assert args.seeds == [0, 1, 2, 3, 4] and testbed.name == "branching" and args.output == "outputs/bench_branching"
    pilot = bench_branching.parse_args(["--pilot"])
    assert (pilot.seeds, pilot.eval_questions, pilot.output) == ([0, 1], 100, "outputs/bench_branching_pilot")
    assert bench_branching.parse_args(["--pilot", "--seeds", "1"]).seeds == [1]  # a pilot split over processes
    assert bench_branching.testbed(pilot).name == "branching-pilot"
    assert args.warmup_steps == bench_branching.WARMUP_STEPS  # one warm-up for every setting, not the cap's share
    assert bench_branching.parse_args(["--warmup-steps", "0"]).warmup_steps == 0
    for bad in (["--token-budget", "0"], ["--chain-group-size", "0"], ["--eval-questions", "301"],
                ["--warmup-steps", "-1"], ["--top-p", "0"], ["--top-p", "1.5"], ["--entropy-coef", "-0.1"],
                ["--start-misroute", "1.2"], ["--start-misroute-role", "ceo"], ["--stop-after-uniform", "0"]):
        with pytest.raises(SystemExit):
            bench_branching.parse_args(bad)
    assert "--top-p: must be in (0, 1], got 1.5" in capsys.readouterr().err


def test_a_branching_design_trains_every_setting_with_its_choices_into_its_own_output_and_section(tmp_path):
    import benchmarks.bench_branching as bench_branching

    default = bench_branching.parse_args(["--pilot"])
    options = learning_runs.run_options(bench_branching.testbed(default), bench_branching.UNIFORM, 0, "warm", default,
                                        tmp_path)
    assert "--top-p" not in options and "--entropy-coef" not in options  # run.py's own: the first design's runs
    assert (bench_branching.testbed(default).name, default.output) == ("branching-pilot",
                                                                        "outputs/bench_branching_pilot")
    args = bench_branching.parse_args(["--pilot", "--top-p", "1.0"])
    testbed = bench_branching.testbed(args)
    assert (testbed.name, args.output) == ("branching-pilot-top-p-1", "outputs/bench_branching_pilot_top_p_1")
    both = bench_branching.parse_args(["--top-p", "1", "--entropy-coef", "0.01"])
    assert (bench_branching.testbed(both).name, both.output) == (
        "branching-top-p-1-entropy-coef-0.01", "outputs/bench_branching_top_p_1_entropy_coef_0.01")
    for setting in testbed.settings:
        options = learning_runs.run_options(bench_branching.testbed(both), setting, 0, "warm", both, tmp_path)
        planned = experiments.run.plan([*options[:options.index("--output")], "--output", str(tmp_path / "run")])
        assert (planned.settings.top_p, planned.settings.entropy_coef) == (1.0, 0.01)  # run.py reads them
    guarded = bench_branching.parse_args(["--pilot", "--stop-after-uniform", "3"])
    assert (bench_branching.testbed(guarded).name, guarded.output) == (
        "branching-pilot-stop-after-uniform-3", "outputs/bench_branching_pilot_stop_after_uniform_3")
    options = learning_runs.run_options(bench_branching.testbed(guarded), bench_branching.UNIFORM, 0, "warm", guarded,
                                        tmp_path)
    planned = experiments.run.plan([*options[:options.index("--output")], "--output", str(tmp_path / "run")])
    assert planned.settings.stop_after_uniform == 3
    # a start of its own: the second warm-start stage's misrouting, named in the outputs; the first design's start
    # and names without the options
    assert bench_branching.warm_start_recipe(default) == bench_branching.WARM_START
    start = bench_branching.parse_args(["--pilot", "--start-misroute", "0.85", "--start-misroute-role", "chair"])
    recipe = bench_branching.warm_start_recipe(start)
    assert recipe[recipe.index("--misroute") + 1] == "0.85" and recipe[-2:] == ("--misroute-role", "chair")
    assert len(recipe) == len(bench_branching.WARM_START) + 2
    assert (bench_branching.testbed(start).name, start.output) == (
        "branching-pilot-start-misroute-0.85-chair", "outputs/bench_branching_pilot_start_misroute_0.85_chair")
    assert "a start misrouting 0.85 of the chair questions" in bench_branching.testbed(start).title
    role_only = bench_branching.parse_args(["--start-misroute-role", "founder"])  # WARM_START's share, one role
    assert bench_branching.testbed(role_only).name == "branching-start-misroute-0.7-founder"
    # a start whose thoughts state the asked role: both stages trained so, named in the outputs
    goal = bench_branching.parse_args(["--lead", "--eval-questions", "200", "--start-goal", "--start-misroute", "0.95",
                                       "--start-misroute-role", "chair"])
    second, first = bench_branching.start_recipes(goal, bench_branching.testbed(goal))
    assert second.count("--restate-goal") == first.count("--restate-goal") == 1
    assert first[:len(bench_branching.START_STAGE_1)] == bench_branching.START_STAGE_1
    assert (bench_branching.testbed(goal).name, goal.output) == (
        "branching-lead-start-goal-start-misroute-0.95-chair",
        "outputs/bench_branching_lead_start_goal_start_misroute_0.95_chair")
    assert "carrying the asked role" in bench_branching.testbed(goal).title
    assert "--restate-goal" not in bench_branching.start_recipes(start, bench_branching.testbed(start))[1]
    # a learning-rate schedule away from the benchmark's defaults is a design too (its runs would otherwise be taken
    # for, and trained over, the default design's); given at its default it is not
    started = ["--start-misroute", "0.85", "--start-misroute-role", "chair"]
    schedule = bench_branching.parse_args([*started, "--lr", "2e-5", "--warmup-steps", "0"])
    assert (bench_branching.testbed(schedule).name, schedule.output) == (
        "branching-start-misroute-0.85-chair-lr-2e-05-warmup-steps-0",
        "outputs/bench_branching_start_misroute_0.85_chair_lr_2e_05_warmup_steps_0")
    assert bench_branching.testbed(schedule).title.endswith("a start misrouting 0.85 of the chair questions, "
                                                            "lr 2e-05, warm-up steps 0")
    at_defaults = bench_branching.parse_args([*started, "--lr", "2e-4", "--warmup-steps", "67"])
    assert bench_branching.testbed(at_defaults).name == "branching-start-misroute-0.85-chair"
    # the learning benchmark too: a design's runs get their own directory (a run of other options in a setting's
    # directory would be trained over) and section
    assert bench_learning.parse_args([]).output == "outputs/bench_learning"
    design = bench_learning.parse_args(["--entropy-coef", "0.01"])
    assert design.output == "outputs/bench_learning_entropy_coef_0.01"
    assert learning_options.with_design(TESTBED, design).name == "learning-entropy-coef-0.01"
    assert learning_options.with_design(TESTBED, bench_learning.parse_args([])) is TESTBED
    assert bench_learning.parse_args(["--top-p", "1", "--output", "mine"]).output == "mine"


def test_the_pass_bound_sums_each_rounds_longest_branch_and_takes_the_longest_tree():
    from algos.tree import Node, Tree
    from benchmarks.bench_engine import pass_bound
    from policies.trajectory import TokenTrajectory

    def step(parent: Node, generated: int, observed: int, lineage: tuple[int, int]) -> Node:
        trajectory = parent.trajectory.with_observation((0,) * observed) if observed else parent.trajectory
        trajectory = TokenTrajectory(trajectory.token_ids + (1,) * generated,
                                     trajectory.generated_mask + (True,) * generated,
                                     trajectory.sampling_logprobs + (0.0,) * generated)
        return parent.add_child(Node(trajectory, None, lineage=lineage))

    root = Node(TokenTrajectory.from_prompt((5, 6, 7)), None)
    first = step(root, 4, 0, (0, 0))  # round 0: one chain of 4 + 3 tokens (observations cost no pass)
    second = step(first, 3, 10, (0, 0))
    step(first, 6, 10, (1, 0))  # round 1: branches of 6 and 2 + 5 = 7 tokens; the longest, 7, sets the round
    step(step(root, 2, 0, (1, 1)), 5, 10, (1, 1))
    step(second, 1, 10, (2, 0))  # round 2: one branch of 1
    other = Node(TokenTrajectory.from_prompt((5,)), None)
    step(step(other, 9, 0, (0, 0)), 9, 10, (0, 0))  # a tree of one 18-token chain
    assert pass_bound([Tree(root, 0, 0)]) == 7 + 7 + 1
    assert pass_bound([Tree(root, 0, 0), Tree(other, 0, 1)]) == 18
    assert pass_bound([Tree(Node(TokenTrajectory.from_prompt((5,)), None), 1, 0)]) == 0


def curve_rows(curve: list[tuple[int, float | None]]) -> list[dict]:
    """Metrics rows of one run from (tokens so far, dev EM or None) per iteration, 4 optimizer steps an iteration."""
    return [{"iteration": i, "tokens_generated_total": tokens, "optimizer_steps": 4 * i,
             **({} if em is None else {"dev_em": em})} for i, (tokens, em) in enumerate(curve, start=1)]


def test_times_to_a_threshold_are_compared_with_runs_that_never_got_there_censored():
    testbed = dataclasses.replace(TESTBED, plateau_threshold=0.7, comparisons=(("tree (2,2,1)", "chain G=4"),))
    runs = {"tree (2,2,1)": [curve_rows([(100, 0.8), (300, 0.9)]),  # reached at 100
                             curve_rows([(250, 0.4), (500, 0.5)]),  # never, censored at 500
                             curve_rows([(300, 0.7), (400, 0.8)]),  # reached at 300
                             curve_rows([(150, 0.75)])],  # reached at 150
            "chain G=4": [curve_rows([(100, 0.5), (200, 0.75), (300, 0.8)]),  # reached at 200
                          curve_rows([(250, 0.9)]),  # reached at 250
                          curve_rows([(200, 0.6)]),  # never, censored at 200
                          curve_rows([(200, 0.1), (400, 0.7)])]}  # reached at 400
    d = learning_stats.compare_times(testbed, runs)["tree (2,2,1) - chain G=4"]
    # seed 0: 100 < 200 sooner; seed 1: the chain's 250 came before the tree's end (500): later; seed 2: the tree's
    # 300 is after the chain's end (200), which might have reached it at 201: unordered; seed 3: 150 < 400 sooner
    assert (d["sooner"], d["later"], d["unordered"], d["both"]) == (2, 1, 1, 2)
    assert d["p"] == 1.0 and d["p_holm"] == 1.0  # 2 of 3 ordered pairs: as likely as any split under no difference
    # where both reached it: -100 and -250, mean -175, sd 75 sqrt 2; t = -175 / 75 on 1 degree of freedom (Cauchy):
    # p = 1 - (2 / pi) atan(7 / 3); the interval +- 12.706 x 75; sign flips: sums +-350, +-150, 2 of 4 as far out
    assert d["mean"] == pytest.approx(-175)
    assert d["t_p"] == pytest.approx(1 - 2 / np.pi * np.arctan(7 / 3))
    assert (d["t_low"], d["t_high"]) == pytest.approx((-175 - 12.7062 * 75, -175 + 12.7062 * 75), rel=1e-4)
    assert d["sign_flip_p"] == 0.5 and -250 <= d["low"] <= d["high"] <= -100
    lines = learning_report.time_table({"tree (2,2,1) - chain G=4": d})
    assert lines[1].startswith("Paired comparisons in tokens to first reach the threshold")
    assert lines[-1].startswith("| tree (2,2,1) - chain G=4 | 2 / 1 / 1 | 1.000 | 1.000 | inside the noise | 2 | "
                                "-175 |")
    # counted in optimizer steps the order can turn: more tokens an iteration, fewer iterations to get there
    wide = {"tree (2,2,1)": [curve_rows([(9000, 0.5), (18000, 0.8)])] * 6,
            "chain G=4": [curve_rows([(4000, 0.5), (8000, 0.5), (12000, 0.6), (16000, 0.8)])] * 6}
    in_tokens, in_steps = (learning_stats.compare_times(testbed, wide, learning_stats.FIRST_PASSAGE, unit)
                           ["tree (2,2,1) - chain G=4"] for unit in ("tokens_generated_total", "optimizer_steps"))
    assert (in_tokens["later"], in_steps["sooner"]) == (6, 6) and in_steps["mean"] == 8 - 16
    assert in_steps["p"] == in_steps["p_holm"] == 2 / 64  # 6 of 6 ordered pairs one way
    steps_line = learning_report.time_table({"a - b": in_steps}, learning_stats.FIRST_PASSAGE, "optimizer_steps")[-1]
    assert "| a reached it sooner beyond the noise | 6 | -8.0 |" in steps_line  # steps in tenths, tokens whole
    single = learning_stats.compare_times(testbed, {k: v[:1] for k, v in runs.items()})["tree (2,2,1) - chain G=4"]
    assert single["both"] == 1 and "mean" not in single  # one pair: no interval
    assert learning_report.time_table({"a - b": single})[-1].endswith("| 1 | - | - | - | - | - |")
    assert learning_stats.compare_times(TESTBED, runs) == {}  # no plateau reported: no comparison
    assert learning_report.time_table({}) == []


def test_a_run_leaves_the_plateau_at_the_first_point_it_never_falls_back_below(tmp_path, capsys):
    from benchmarks.plateau_exit import (
        first_passage_at,
        main,
        plateau_exit_at,
        runs_left_by,
        silent_update_share,
    )

    def rows(curve):  # (tokens, dev EM or None) per iteration
        return [{"iteration": i, "tokens_generated_total": t, **({} if em is None else {"dev_em": em})}
                for i, (t, em) in enumerate(curve, start=1)]

    back_down = rows([(100, 0.4), (200, 0.8), (300, None), (400, 0.6), (500, 0.7), (600, 0.9)])
    assert plateau_exit_at(back_down, 0.7) == 500  # 200 does not count: 400 fell back below
    assert plateau_exit_at(rows([(100, 0.4), (200, 0.69)]), 0.7) is None  # ends below: stayed
    assert plateau_exit_at(rows([(100, 0.9), (200, 0.95)]), 0.7) == 100
    assert plateau_exit_at(rows([(100, None)]), 0.7) is None
    assert first_passage_at(back_down, 0.7) == 200  # the first point at or above, whatever follows
    assert first_passage_at(rows([(100, 0.4), (200, 0.69)]), 0.7) is None
    assert first_passage_at(rows([(100, None), (200, 0.7)]), 0.7) == 200  # a point without a curve is skipped
    assert [runs_left_by([500, None, 100], budget) for budget in (99, 100, 499, 500)] == [0, 1, 1, 2]
    norms = [{"grad_norm": g} for g in (0.0, 0.3, 0.2, 0.0009, 0.001)] + [{"grad_norm": None}, {}]
    assert silent_update_share(norms) == pytest.approx(1 / 3)  # second half: 0.2, 0.0009 (silent), 0.001
    assert silent_update_share(norms[:1]) == 1.0 and silent_update_share([{}]) is None

    for name, run_rows in {"left": back_down, "stayed": rows([(100, 0.4), (200, 0.5)])}.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in run_rows))
    exits = main([str(tmp_path / "left"), str(tmp_path / "stayed"), "--budgets", "400", "500"])
    assert exits == {str(tmp_path / "left"): 500, str(tmp_path / "stayed"): None}
    out = capsys.readouterr().out
    assert "left at 500 tokens (curve to 600 tokens)" in out and "stayed (curve to 200 tokens)" in out
    assert "by 400 tokens: 0 of 2 runs had left" in out and "by 500 tokens: 1 of 2 runs had left" in out


def test_the_sharding_reports_command_keeps_the_measured_options_and_drops_where_results_go():
    from benchmarks.bench_learner_sharding import measured_options

    argv = ["--gpu", "--tokens", "2048", "--report", "docs/benchmarks.md", "--json=out.json", "--steps", "3",
            "--json", "x.json"]
    assert measured_options(argv) == ["--gpu", "--tokens", "2048", "--steps", "3"]
    assert measured_options([]) == []


def test_the_start_spread_measures_the_demos_two_stage_start_by_default(tmp_path, monkeypatch):
    from benchmarks import demo_start_spread
    from experiments.demo import start_policy

    assert demo_start_spread.RECIPES["demo"] is start_policy
    model = tmp_path / "stage2" / "model"
    model.mkdir(parents=True)
    (model.parent / "warmstart.json").write_text(json.dumps({"loss_per_epoch": [0.1], "check_per_epoch": [0.9]}))
    asked = []
    monkeypatch.setitem(demo_start_spread.RECIPES, "demo", lambda seed, cache_dir: asked.append(seed) or model)
    rows = [{"em": 1.0, "hops": 1.0, "answered": 1.0, "tool_calls": 1.0},
            {"em": 0.0, "hops": 2.0, "answered": 1.0, "tool_calls": 1.0}]
    monkeypatch.setattr(demo_start_spread, "world_held_out", lambda *args: rows)
    [result] = demo_start_spread.main(["--seeds", "7", "--output", str(tmp_path / "spread" / "starts.jsonl")])
    assert asked == [7] and result["recipe"] == "demo" and result["check_per_epoch"] == [0.9]
    assert (result["em"], result["em_1hop"], result["em_2hop"]) == (0.5, 1.0, 0.0)
    assert result["failures"]["answered before its last hop"] == 0.5


def test_a_lead_world_lets_its_runs_and_evaluations_search_four_times(tmp_path, monkeypatch):
    import benchmarks.bench_branching as bench_branching
    from envs.synthetic import BranchSpec
    from experiments import evaluate

    monkeypatch.setenv("TREEGRPO_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(bench_branching, "LEAD_WORLD", BranchSpec(people=20, companies=10, cities=6, countries=3,
                                                                  train_questions=8, dev_questions=4, hops=4,
                                                                  lead=True, names="given", passages="roles"))
    monkeypatch.setattr(bench_branching, "WORLD", BranchSpec(people=20, companies=10, cities=6, countries=3,
                                                             train_questions=8, dev_questions=4))
    lead = bench_branching.parse_args(["--lead", "--eval-questions", "4", "--output", str(tmp_path / "out")])
    plain = bench_branching.parse_args(["--eval-questions", "4", "--output", str(tmp_path / "out")])
    lead_bed, plain_bed = bench_branching.testbed(lead), bench_branching.testbed(plain)
    assert (lead_bed.max_turns, plain_bed.max_turns) == (4, 3) and lead_bed.name == "branching-lead"
    options = learning_runs.run_options(lead_bed, bench_branching.UNIFORM, 0, "m", lead, tmp_path / "run")
    assert options[options.index("--max-turns") + 1] == "4"
    assert "--max-turns" not in learning_runs.run_options(plain_bed, bench_branching.UNIFORM, 0, "m", plain,
                                                          tmp_path / "run")  # other testbeds' runs as they were
    asked = {}
    monkeypatch.setattr(evaluate, "load_policy", lambda policy: (None, None))
    monkeypatch.setattr("policies.generators.step_generator", lambda *args, **kwargs: None)
    monkeypatch.setattr(evaluate, "evaluate_env", lambda env_id, *a, env_kwargs, **k: asked.update(env_kwargs) or [])
    learning_runs.held_out_scores(lead_bed, "m", lead)
    assert asked["max_turns"] == 4 and asked["data_dir"] == str(lead_bed.data_dir)
    assert Path(bench_branching.parse_args(["--lead", "--eval-questions", "4"]).output).name.startswith(
        "bench_branching_lead")
    # its start's oracle trajectories search every hop too; the default world's recipes are as they were
    recipe, first_stage = bench_branching.start_recipes(lead, lead_bed)
    assert recipe[-2:] == first_stage[-2:] == ("--max-turns", "4")
    stages = (bench_branching.WARM_START, bench_branching.START_STAGE_1)
    assert bench_branching.start_recipes(plain, plain_bed) == stages
    # the sixth design's arms and comparisons on the lead world; the other designs' as they were
    assert lead.settings == list(bench_branching.LEAD_SETTINGS) and lead_bed.comparisons[:3] == (
        (bench_branching.UNIFORM, bench_branching.CHAIN_EQUAL), (bench_branching.ENTROPY, bench_branching.CHAIN_EQUAL),
        (bench_branching.WIDE_TREE, bench_branching.CHAIN_EQUAL))
    assert plain.settings == list(bench_branching.SETTING_NAMES) and bench_branching.WIDE_TREE not in plain.settings
    assert plain_bed.comparisons == bench_branching.COMPARISONS


def test_the_wide_tree_expands_more_at_the_same_token_budget():
    import benchmarks.bench_branching as bench_branching
    from algos.rollout import TreeShape

    arms = bench_branching.settings(token_budget=1000, chain_group_size=5)
    nominal, options = arms[bench_branching.WIDE_TREE]
    shape = TreeShape(*(int(options[options.index(f"--{name}") + 1]) for name in "MNL"))
    assert (shape.leaves_per_prompt, shape.budget_estimate) == (18, nominal) == (18, 10)  # 2 (1 + 2x4), 2 (1 + 4)
    assert options[options.index("--token-budget") + 1] == "1000" == arms[bench_branching.UNIFORM][1][-1]
    wide = bench_branching.parse_args(["--settings", bench_branching.WIDE_TREE, "--seeds", "0"])
    assert wide.settings == [bench_branching.WIDE_TREE]


def test_decision_draws_count_the_steps_at_a_depth_that_no_two_leaves_share():
    def chain(parent: Node, steps: int) -> Node:
        for _ in range(steps):
            parent = parent.add_child(Node(TokenTrajectory.from_prompt(()), None))
        return parent

    # a chain of 4 steps, a branch after its first step (3 steps: draws its own third) and one after its third
    # (1 step: inherits the chain's third)
    root = Node(TokenTrajectory.from_prompt(()), None)
    first = chain(root, 1)
    third = chain(first, 2)
    chain(third, 1)
    chain(first, 3)
    chain(third, 1)
    other = Node(TokenTrajectory.from_prompt(()), None)
    chain(other, 2)  # answered after 2 steps: no third step to draw
    trees = [Tree(root, 0, 0), Tree(other, 0, 1)]
    assert [draws_at_depth(trees, depth) for depth in (0, 1, 2, 3, 4)] == [2, 2, 3, 2, 3]


def test_the_budget_table_pairs_each_budgets_configs_at_equal_prompts_and_iterations():
    import benchmarks.bench_branching as bench_branching
    import benchmarks.bench_budget as bench_budget

    args = bench_budget.parse_args([])
    bed = bench_budget.testbed(args)
    # the shapes come from experiments/configs/budget/*.yaml: (1,2,1) / G=2, (2,2,1) / G=4, (4,5,1) / G=16
    assert list(bed.settings) == ["tree (1,2,1) budget 2", "chain G=2 budget 2", "tree (2,2,1) budget 4",
                                  "chain G=4 budget 4", "tree (4,5,1) budget 16", "chain G=16 budget 16"]
    assert bed.settings["tree (4,5,1) budget 16"] == (16, ["--algo", "tree_grpo", "--M", "4", "--N", "5", "--L", "1",
                                                           "--branching", "uniform"])
    assert not any("--token-budget" in options for _, options in bed.settings.values())  # equal iterations instead
    assert bed.comparisons[-1] == ("chain G=16 budget 16", "chain G=2 budget 2")  # the positive control
    assert [a.split()[0] for a, _ in bed.comparisons[:3]] == ["tree"] * 3
    # every arm's run gets the same prompts, iterations and schedule; the records' folder holds "budget"
    shared = {str(learning_runs.run_options(bed, name, 0, "warm", args, Path("d"))[len(bed.settings[name][1]):])
              for name in bed.settings}
    (common,) = shared
    assert "'--iterations', '12'" in common and "'--prompts-per-iter', '8'" in common
    assert (args.output, args.lr, args.warmup_steps, len(args.seeds), args.eval_questions) == (
        "outputs/budget_table", 2e-5, 0, 10, 300)
    assert bench_budget.parse_args(["--lr", "1e-4"]).output == "outputs/budget_table_lr_0.0001"  # a design of its own
    # the fifth design's start (the same cached warm start)
    fifth = bench_branching.parse_args(["--start-misroute", "0.85", "--start-misroute-role", "chair"])
    fifth_bed = bench_branching.testbed(fifth)
    assert bench_branching.start_recipes(args, bed) == bench_branching.start_recipes(fifth, fifth_bed)


def test_the_budget_scripts_main_runs_its_own_testbed_from_the_fifth_designs_start(monkeypatch):
    import benchmarks.bench_branching as bench_branching
    import benchmarks.bench_budget as bench_budget

    called = {}
    monkeypatch.setattr(bench_branching, "run_benchmark",
                        lambda bed, args, start, argv, script: called.update(bed=bed, start=start, script=script))
    bench_budget.main(["--start-only"])
    assert called["bed"].name == "budget-table" and called["script"] == "benchmarks/bench_budget.py"
    recipe = called["start"].args[1]  # cached_warm_start(world, recipe, ...): the fifth design's second stage
    assert recipe[recipe.index("--misroute") + 1] == "0.85" and recipe[-2:] == ("--misroute-role", "chair")
    assert called["start"].keywords["continues"][:2] == ("--model", "scratch")  # after its first stage


def test_the_report_gives_each_settings_share_of_prompts_with_a_signal(tmp_path, monkeypatch):
    monkeypatch.setattr(learning_report, "plot_runs", lambda runs, path, metrics: Path(path))
    args = bench_learning.parse_args(["--output", str(tmp_path)])
    runs, finals = two_seed_runs()
    table, _ = learning_report.write_results(TESTBED, runs, finals, scores(1, 1, 0, 0), args, "W", 1.0, tmp_path)
    assert "non-zero advantage" not in table  # metrics from before the key: nothing to report
    for rows, shares in zip(runs["tree (2,2,1)"], ((0.5, 1.0), (0.25, None)), strict=True):
        for row, share in zip(rows, shares, strict=True):
            row["nonzero_advantage_share"] = share
    summary = summarize(TESTBED, runs, finals, before=scores(0, 0, 1, 0))
    assert summary["tree (2,2,1)"]["nonzero_advantage_share"] == pytest.approx((0.5 + 1.0 + 0.25) / 3)
    table, _ = learning_report.write_results(TESTBED, runs, finals, scores(1, 1, 0, 0), args, "W", 1.0, tmp_path)
    assert "mean over iterations and seeds): tree (2,2,1) 0.583." in table


def test_the_gpu_run_summary_reads_a_runs_records(tmp_path):
    """device_check.sh 2's summary of the mission's run: where the learner ran (the log's lines), the seconds per
    phase from metrics.jsonl, the busy share and memory from nvidia-smi's samples (a header or a blank line is
    skipped)."""
    from benchmarks.gpu_run_summary import gpu_samples, main

    rows = [{"sample_time_s": 30.0, "scoring_time_s": 2.0, "update_time_s": 9.5, "sync_time_s": 0.5, "time_s": 41.0,
             "learner_peak_memory_gib": 31.2},
            {"sample_time_s": 20.0, "scoring_time_s": 1.5, "update_time_s": 8.0, "sync_time_s": 0.4, "time_s": 29.0,
             "learner_peak_memory_gib": 31.4}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    log = tmp_path / "run.log"
    log.write_text("noise\nplacement: learner: in this process, on a GPU (1 each); rollouts: ...\n"
                   "learner: cuda:0, 1 learner(s) (ddp), torch.bfloat16 compute over torch.float32 weights\n"
                   "memory plan: Qwen ... 37.1 GiB per GPU of 80 GiB (72 usable): fits\n")
    samples = tmp_path / "gpu.csv"
    samples.write_text("utilization.gpu, memory.used\n50, 20480\n\n100, 40960\n")
    assert gpu_samples(samples.read_text()) == [(50.0, 20480.0), (100.0, 40960.0)]
    text = main([str(tmp_path), str(log), str(samples), "--output", str(tmp_path / "summary.md")])
    assert "`learner: cuda:0, 1 learner(s) (ddp)" in text and "`memory plan: Qwen" in text and "noise" not in text
    assert "| rollout | 30.0, 20.0 |" in text and "| old + reference log-probs | 2.0, 1.5 |" in text
    assert "busy share (nvidia-smi utilization, mean of 2 samples): 75%" in text and "at most" in text
    assert "40.0 GiB" in text and "31.2, 31.4" in text
    assert (tmp_path / "summary.md").read_text() == text


def demo_payload(before: tuple, after: tuple, change: tuple, curve: dict[int, float], questions: int) -> dict:
    """The parts of a demo.json the learning comparison reads: exact match's intervals, the curve, the questions."""
    def interval(values: tuple) -> dict:
        return dict(zip(("mean", "low", "high"), values, strict=True))

    return {"metrics": {"em": {"before": interval(before), "after": interval(after), "change": interval(change)}},
            "held_out_em": {str(i): interval((em, em, em)) for i, em in curve.items()},
            "questions": {"before": [{}] * questions, "after": [{}] * questions}}


def test_the_learn_calls_comparison_reads_a_gpu_and_a_cpu_demo(tmp_path):
    """device_check.sh learn's comparison (hand-computed): held-out exact match before and after with the paired
    change for both demos, and each phase's seconds per iteration past the first, the GPU's beside the CPU's."""
    from benchmarks.gpu_run_summary import main

    keys = ("sample_time_s", "scoring_time_s", "update_time_s", "sync_time_s", "time_s")
    gpu_rows = [dict(zip(keys, v, strict=True)) for v in ((6.0, 0.5, 3.0, 0.1, 10.0), (2.0, 0.2, 1.0, 0.1, 4.0),
                                                           (3.0, 0.4, 2.0, 0.1, 6.0))]
    cpu_rows = [dict(zip(keys, v, strict=True)) for v in ((4.0, 0.3, 2.0, 0.02, 7.0), (3.0, 0.4, 2.0, 0.02, 6.0),
                                                           (5.0, 0.6, 3.0, 0.04, 9.0))]
    gpu_demo = demo_payload((0.349, 0.277, 0.420), (0.5, 0.43, 0.57), (0.151, 0.09, 0.21), {0: 0.349, 2: 0.45, 3: 0.5},
                            175)
    cpu_demo = demo_payload((0.349, 0.277, 0.420), (0.4, 0.33, 0.47), (0.051, -0.01, 0.11), {0: 0.349, 3: 0.4}, 175)
    for name, rows, demo in (("gpu", gpu_rows, gpu_demo), ("cpu", cpu_rows, cpu_demo)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
        (tmp_path / name / "demo.json").write_text(json.dumps(demo))
    (tmp_path / "learn.log").write_text("learner: cuda:0, 1 learner(s) (ddp), torch.bfloat16 compute over "
                                        "torch.float32 weights\n")
    text = main([str(tmp_path / "gpu"), str(tmp_path / "learn.log"), str(tmp_path / "absent.csv"),
                 "--compare", str(tmp_path / "cpu")])
    assert "`learner: cuda:0, 1 learner(s) (ddp), torch.bfloat16 compute" in text  # the run's own summary first
    assert "(175 questions; 95% intervals)" in text
    assert "| GPU | 0.349 [0.277, 0.420] | 0.500 [0.430, 0.570] | 0.151 [0.090, 0.210] | yes |" in text
    assert "| CPU | 0.349 [0.277, 0.420] | 0.400 [0.330, 0.470] | 0.051 [-0.010, 0.110] | no |" in text
    assert "GPU: a gain beyond the noise; held-out exact match by iteration 0: 0.349, 2: 0.450, 3: 0.500" in text
    assert "the start's held-out exact match is the same on both machines" in text
    # the rest's means: GPU (2 + 3) / 2 = 2.5 s of rollout, CPU (3 + 5) / 2 = 4.0, 1.60x; iterations 5.0 and 7.5
    assert "| rollout | 6.00 | 2.50 | 4.00 | 1.60x |" in text
    assert "| old + reference log-probs | 0.50 | 0.30 | 0.50 | 1.67x |" in text
    assert "| update (all of it) | 3.00 | 1.50 | 2.50 | 1.67x |" in text
    assert "| weight sync | 0.10 | 0.10 | 0.03 | 0.30x |" in text
    assert "| iteration | 10.00 | 5.00 | 7.50 | 1.50x |" in text and "Iterations: GPU 3, CPU 3." in text


def test_the_learn_calls_comparison_says_when_the_gain_is_inside_the_noise_or_the_gpu_run_did_not_finish():
    from benchmarks.gpu_run_summary import learning_comparison

    inside = demo_payload((0.35, 0.28, 0.42), (0.36, 0.29, 0.43), (0.01, -0.02, 0.04), {0: 0.35, 8: 0.36}, 175)
    cpu = demo_payload((0.349, 0.277, 0.420), (0.4, 0.33, 0.47), (0.051, -0.01, 0.11), {0: 0.349, 8: 0.4}, 175)
    text = learning_comparison(inside, [{"time_s": 4.0}], cpu, [{"time_s": 8.0}, {"time_s": 6.0}])
    assert "no change beyond the noise: a finding of why not is owed" in text
    assert "is NOT the same on both machines" in text
    assert "| iteration | 4.00 | 4.00 | 6.00 | 1.50x |" in text  # one GPU iteration: itself is the mean
    assert "| rollout | n/a | n/a | n/a | n/a |" in text
    timed_out = learning_comparison(None, [], cpu, [{"time_s": 8.0}])  # killed by LEARN_TIMEOUT before demo.json
    assert "| GPU |" not in timed_out and "| CPU |" in timed_out
    fewer = demo_payload((0.5, 0.05, 0.95), (0.5, 0.05, 0.95), (0.0, 0.0, 0.0), {0: 0.5, 1: 0.5}, 8)
    assert "on both machines" not in learning_comparison(fewer, [], cpu, [])  # 8 questions against 175: not compared
    assert "| iteration | n/a | n/a | 8.00 | n/a |" in timed_out


def test_pipelining_figures_leave_out_the_warm_up_and_compare_with_the_faster_synchronous_arm():
    from benchmarks import bench_pipelining

    def row(wall: float, tokens: int, staleness: int) -> dict:
        return {"wall_s": wall, "tokens_generated": tokens, "sample_time_s": 1.0, "update_time_s": 2.0,
                "sync_time_s": 0.1, "sample_wait_time_s": 0.5, "staleness": staleness}

    figures = bench_pipelining.summary([row(30.0, 10, 0), row(2.0, 100, 1), row(4.0, 200, 1)], warmup=1)
    assert figures["s_per_iteration"] == 3.0 and figures["iterations_per_hour"] == 1200
    assert figures["tokens_per_s"] == 50 and figures["staleness"] == 1
    arms = {"sync-1-2": 1000.0, "sync-2-2": 1200.0, "ahead-1-1": 1800.0}
    text = bench_pipelining.report(bench_pipelining.parse_args([]), {
        name: {**figures, "iterations_per_hour": per_hour} for name, per_hour in arms.items()})
    ratios = {line.split(" | ")[0].strip("| "): line.split(" | ")[5] for line in text.splitlines()
              if line.startswith("| ") and line.split(" | ")[0].strip("| ") in arms}
    assert ratios == {"sync-1-2": "0.83", "sync-2-2": "1.00", "ahead-1-1": "1.50"}
