"""benchmarks/bench_hotpotqa.py: the start and the runs are evaluated on the same observations, and each run is
paired with the build of the start it trained from."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import benchmarks.bench_hotpotqa as bench
from experiments.model_manifest import weights_digest, write_manifest
from experiments.qa_start import CPU_OBSERVATION_OPTIONS, CPU_QA_DEFAULTS


def test_the_start_is_evaluated_with_the_runs_observations_and_a_run_with_its_own(tmp_path, monkeypatch):
    commands = []
    monkeypatch.setattr(bench.subprocess, "run", lambda command, check: commands.append(command))
    bench.evaluate("START_DIR", tmp_path / "start", CPU_OBSERVATION_OPTIONS)
    bench.evaluate("RUN/checkpoints/latest", tmp_path / "run")
    start, run = (" ".join(command) for command in commands)
    assert (f"--topk {CPU_QA_DEFAULTS['topk']} --passage-words {CPU_QA_DEFAULTS['passage_words']} "
            f"--max-step-tokens {CPU_QA_DEFAULTS['max_step_tokens']}") in start
    assert "--topk" not in run and "--passage-words" not in run  # evaluate.py reads them from the run's config
    (tmp_path / "done").mkdir()
    (tmp_path / "done" / "eval.json").write_text("{}")
    bench.evaluate("START_DIR", Path(tmp_path / "done"), CPU_OBSERVATION_OPTIONS)
    assert len(commands) == 2  # evaluated once


def write_eval(directory: Path, ems: list[float], f1s: list[float] | None = None) -> None:
    directory.mkdir(parents=True)
    rows = [{"em": em, "f1": f1, "answered": 1.0} for em, f1 in zip(ems, f1s or ems, strict=True)]
    (directory / "eval.json").write_text(json.dumps({"questions": {bench.ENV: rows}}))


def test_each_run_is_paired_with_the_start_it_trained_from(tmp_path):
    """Two builds of the start (two machines) give two 'before's: a run is compared with its own, never another's."""
    write_eval(bench.start_eval_dir(tmp_path, "aaaa"), [0, 0, 0, 0])
    write_eval(bench.start_eval_dir(tmp_path, "bbbb"), [1, 1, 0, 0])
    for seed, digest in ((0, "aaaa"), (1, "bbbb")):
        run = bench.run_dir(tmp_path, "tree", seed)
        bench.bind_start(run, digest)
        write_eval(run / "eval", [1, 1, 1, 0])
        (run / "metrics.jsonl").write_text(json.dumps({"reward_mean": 0.1, "nonzero_advantage_share": 0.5,
                                                       "time_s": 60.0}) + "\n")
    summary = bench.arm_summary(tmp_path, "tree", [0, 1], ["bridge", "bridge", "comparison", "comparison"])
    assert [summary["per_seed"][seed]["em_before"] for seed in (0, 1)] == [0.0, 0.5]
    assert [summary["per_seed"][seed]["start"] for seed in (0, 1)] == ["aaaa", "bbbb"]
    assert summary["pooled_change_bootstrap"]["mean"] == pytest.approx((0.75 + 0.25) / 2)
    em, reward = bench.figure({"arms": {"tree": summary}}).axes  # the plot draws each seed against its own start
    assert sorted(tuple(line.get_ydata()) for line in em.get_lines()) == [(0.0, 0.75), (0.5, 0.75)]
    assert list(reward.get_lines()[0].get_ydata()) == [0.1]
    with pytest.raises(SystemExit, match=r"aaaa.*bbbb"):  # a run is not continued from another build
        bench.bind_start(bench.run_dir(tmp_path, "tree", 0), "bbbb")


def test_a_seed_reports_its_f1_change_beside_its_em_change(tmp_path):
    """Token F1 moves where exact match does not (a partly right answer): the F1 study's secondary outcome."""
    before = [{"em": 0.0, "f1": 0.0, "answered": 1.0}, {"em": 1.0, "f1": 1.0, "answered": 1.0}]
    after = [{"em": 0.0, "f1": 0.5, "answered": 1.0}, {"em": 1.0, "f1": 1.0, "answered": 1.0}]
    summary = bench.seed_summary(before, after, ["bridge", "comparison"])
    assert summary["em_after"] - summary["em_before"] == 0.0
    assert (summary["f1_before"], summary["f1_after"], summary["f1_change"]["mean"]) == (0.5, 0.75, 0.25)


def test_a_run_without_its_start_record_is_refused_by_name(tmp_path):
    run = bench.run_dir(tmp_path, "chain", 0)
    write_eval(run / "eval", [1.0])
    with pytest.raises(SystemExit, match=f"chain_s0 has no {bench.START_RECORD}"):
        bench.arm_summary(tmp_path, "chain", [0], ["bridge"])


def test_the_weights_digest_tells_two_builds_apart(tmp_path):
    builds = []
    for byte in (b"\0", b"\1"):
        model = tmp_path / f"build{byte[0]}" / "model"
        model.mkdir(parents=True)
        (model / "model.safetensors").write_bytes(b"weights" + byte)
        (model / "config.json").write_text("{}")
        builds.append(model)
    assert weights_digest(builds[0]) != weights_digest(builds[1])
    before = weights_digest(builds[0])
    write_manifest(builds[0])  # the manifest's sha256 stands for the file, with the same digest
    assert weights_digest(builds[0]) == before
    (builds[0] / "config.json").write_text('{"changed": 1}')  # only the weights count
    assert weights_digest(builds[0]) == before


def test_records_carry_finished_runs_to_a_new_machine_which_does_not_train_them_again(tmp_path, monkeypatch):
    here, records, there = tmp_path / "hotpotqa_cpu", tmp_path / "study", tmp_path / "new" / "hotpotqa_cpu"
    write_eval(bench.start_eval_dir(here, "aaaa"), [0, 1])
    finished, unfinished = bench.run_dir(here, "tree", 0), bench.run_dir(here, "chain", 0)
    for run in (finished, unfinished):
        bench.bind_start(run, "aaaa")
        (run / "metrics.jsonl").write_text("".join(json.dumps({"iteration": i}) + "\n" for i in (1, 2)))
    write_eval(finished / "eval", [1, 1])
    bench.save_records(here, records)
    first = (records / bench.ARCHIVE).read_bytes()
    bench.save_records(here, records)
    assert (records / bench.ARCHIVE).read_bytes() == first  # saving again changes nothing git sees
    assert bench.restore_records(there, records) == 4  # the start's evaluation and the finished run's three files
    assert not bench.run_dir(there, "chain", 0).exists()  # an unfinished run is of no use without its checkpoints
    assert (bench.run_dir(there, "tree", 0) / "eval" / "eval.json").read_bytes() == (finished / "eval" /
                                                                                     "eval.json").read_bytes()
    trained = []
    monkeypatch.setattr(bench.subprocess, "run", lambda command, check: trained.append(command))
    bench.train(there, "tree", 0, 2, "bbbb")  # finished under another build of the start: reported, not retrained
    assert trained == []
    assert bench.restore_records(there, records) == 0  # what the machine has is left alone
    elsewhere = tmp_path / "third" / "hotpotqa_cpu"  # a machine that began the run the records hold finished
    (bench.run_dir(elsewhere, "tree", 0)).mkdir(parents=True)
    (bench.run_dir(elsewhere, "tree", 0) / "metrics.jsonl").write_text(json.dumps({"iteration": 1}) + "\n")
    assert bench.restore_records(elsewhere, records) == 4
    assert bench.finished_iterations(bench.run_dir(elsewhere, "tree", 0)) == 2  # the finished run, whole


def stub_study(tmp_path: Path, monkeypatch, killed_seed: int | None = None) -> tuple[Path, Path]:
    """``bench.main`` without models: a start "aaaa", runs of two iterations and evaluations of two questions (one
    right); training ``killed_seed`` is interrupted (a session's end). The study's output and records folders."""
    monkeypatch.setattr(bench, "qa_warm_start", lambda env: tmp_path / "start")
    monkeypatch.setattr(bench, "weights_digest", lambda model: "aaaa")
    monkeypatch.setattr(bench, "question_types", lambda data_dir: ["bridge", "comparison"])

    def train(output: Path, arm: str, seed: int, iterations: int, start: str) -> Path:
        if seed == killed_seed:
            raise KeyboardInterrupt
        run = bench.run_dir(output, arm, seed)
        bench.bind_start(run, start)
        row = {"reward_mean": 0.1, "nonzero_advantage_share": 0.5, "time_s": 60.0}
        (run / "metrics.jsonl").write_text("".join(json.dumps({**row, "iteration": i}) + "\n" for i in (1, 2)))
        return run

    monkeypatch.setattr(bench, "train", train)
    monkeypatch.setattr(bench, "evaluate", lambda model, out, options=(): write_eval(out, [1, 0]))
    return tmp_path / "hotpotqa_cpu", tmp_path / "study"


def test_each_evaluated_run_is_saved_to_the_records_before_the_next_one_trains(tmp_path, monkeypatch):
    """A study killed in its second run (a session's end, a lost machine) has the first run in its records."""
    output, records = stub_study(tmp_path, monkeypatch, killed_seed=1)
    with pytest.raises(KeyboardInterrupt):
        bench.main(["--arms", "tree", "--seeds", "0", "1", "--output", str(output), "--records", str(records)])
    assert bench.restore_records(tmp_path / "new" / "hotpotqa_cpu", records) == 4  # the start's eval, seed 0's three


def test_a_finished_study_keeps_a_palette_copy_of_its_plot_in_the_records(tmp_path, monkeypatch):
    """The committed figure is the compact copy (results/ is held under 4 MB); the full one stays beside the runs."""
    from PIL import Image

    output, records = stub_study(tmp_path, monkeypatch)
    bench.main(["--arms", "tree", "--seeds", "0", "1", "--output", str(output), "--records", str(records)])
    with Image.open(output / bench.PLOT) as full, Image.open(records / bench.PLOT) as kept:
        assert (full.mode, kept.mode, kept.size) == ("RGBA", "P", full.size)
    assert (records / bench.PLOT).stat().st_size < (output / bench.PLOT).stat().st_size / 2


def write_run(output: Path, arm: str, seed: int, start: str, ems: list[float], mixed: float) -> None:
    run = bench.run_dir(output, arm, seed)
    bench.bind_start(run, start)
    write_eval(run / "eval", ems)
    (run / "metrics.jsonl").write_text(json.dumps({"reward_mean": 0.1, "nonzero_advantage_share": mixed,
                                                   "time_s": 60.0}) + "\n")


def test_arms_are_compared_by_their_changes_on_the_seeds_both_finished(tmp_path):
    """Rule 2 (tree - chain): each arm's change from its own start, paired by seed and question. Seed 1's chain
    trained from another build of the start, whose 'before' is lower: comparing EM after training would credit the
    tree with its start's head start (0.75 there, not 0.25)."""
    write_eval(bench.start_eval_dir(tmp_path, "aaaa"), [0, 0, 0, 0])
    write_eval(bench.start_eval_dir(tmp_path, "bbbb"), [1, 1, 0, 0])
    write_run(tmp_path, "tree", 0, "aaaa", [1, 1, 1, 0], 0.5)  # change 0.75
    write_run(tmp_path, "chain", 0, "aaaa", [1, 0, 0, 0], 0.25)  # change 0.25
    write_run(tmp_path, "tree", 1, "bbbb", [1, 1, 1, 0], 0.5)  # change 0.25
    write_run(tmp_path, "chain", 1, "aaaa", [0, 0, 0, 0], 0.25)  # change 0
    write_run(tmp_path, "tree", 2, "aaaa", [1, 1, 1, 1], 0.5)  # its chain has not finished: not paired
    c = bench.arm_contrast(tmp_path, "tree", "chain", [0, 1, 2])
    assert c["seeds"] == [0, 1]
    assert c["difference_by_seed"] == pytest.approx([0.5, 0.25])
    assert c["pooled_difference_bootstrap"]["mean"] == pytest.approx(0.375)
    t = c["difference_t_over_seeds"]  # mean 0.375, sd 0.25/sqrt(2), t(0.975, 1 df) = 12.706
    assert (t["low"], t["high"]) == pytest.approx((0.375 - 1.5882, 0.375 + 1.5882), abs=1e-3)
    assert c["sign_flip_p"] == pytest.approx(0.5)  # two positive differences: 1 sign pattern in 4 as extreme, twice
    assert c["mixed_reward_share_difference"] == pytest.approx({"mean": 0.25, "low": 0.25, "high": 0.25})
    assert bench.arm_contrast(tmp_path, "tree_entropy", "tree", [0, 1, 2]) is None  # nothing to pair
    table = bench.markdown({"starts": {}, "arms": {}, "contrasts": [c]})
    assert "| tree - chain | 2 | +0.375 [" in table
    one_seed = bench.markdown({"starts": {}, "arms": {}, "contrasts": [bench.arm_contrast(tmp_path, "tree", "chain",
                                                                                          [0])]})
    assert "| tree - chain | 1 | +0.500 [" in one_seed and "- (1 seed)" in one_seed  # no t-interval from one seed


def test_a_killed_run_resumes_from_its_checkpoint_to_the_full_length_or_begins_again(tmp_path, monkeypatch):
    """Killed at iteration 7 with its newest checkpoint at 5: run.py drops rows 6-7 and trains 15 more (not 13, which
    the rows' count would give). Killed before its first checkpoint: begun again, its rows cleared (run.py refuses a
    directory that holds a run's rows, and nothing could resume them)."""
    commands = []
    monkeypatch.setattr(bench.subprocess, "run", lambda command, check: commands.append(command))
    rows = "".join(json.dumps({"iteration": i}) + "\n" for i in range(1, 8))
    resumed, restarted = bench.run_dir(tmp_path, "tree", 0), bench.run_dir(tmp_path, "chain", 0)
    (resumed / "checkpoints" / "iter_000005").mkdir(parents=True)
    (resumed / "checkpoints" / "latest").symlink_to("iter_000005")
    (restarted / "checkpoints").mkdir(parents=True)
    for run in (resumed, restarted):
        (run / "metrics.jsonl").write_text(rows if run is resumed else rows[:rows.index("\n") + 1])
    bench.train(tmp_path, "tree", 0, 20, "aaaa")
    bench.train(tmp_path, "chain", 0, 20, "aaaa")
    resume, fresh = commands
    assert resume[-4:] == ["--resume", str(resumed), "--iterations", "15"]
    assert "--resume" not in fresh and fresh[fresh.index("--iterations") + 1] == "20"
    assert not (restarted / "metrics.jsonl").exists() and not (restarted / "checkpoints").exists()


def test_every_arm_is_a_valid_run_py_command_that_changes_only_what_its_name_says(tmp_path):
    from benchmarks.decision_draws import arm_settings

    default = arm_settings(["--env", bench.ENV, *bench.ARMS["tree"]])
    runs = {arm: arm_settings(["--env", bench.ENV, *options]) for arm, options in bench.ARMS.items()}
    changed = {arm: {name for name, value in run.model_dump().items() if value != getattr(default, name)} - {"output"}
               for arm, run in runs.items()}
    # chain GRPO: its algorithm's own shape (G chains: M = G, N = L = 0) and advantages
    assert changed == {"tree": set(), "chain": {"algo", "M", "N", "L", "advantage_mode"},
                       "tree_entropy": {"branching"}, "tree_em": {"reward"}, "tree_f1": {"reward"},
                       "tree_t07": {"temperature"}, "tree_t05": {"temperature"},
                       "tree_lr5e-4": set()}  # 5e-4 is the CPU profile's lr since results/hotpotqa_cpu_lr/
    assert (runs["tree"].temperature, runs["tree_t07"].temperature, runs["tree_t05"].temperature) == (1.0, 0.7, 0.5)
    assert runs["tree"].lr == CPU_QA_DEFAULTS["lr"] == runs["tree_lr5e-4"].lr == 5e-4
    assert {first for first, _ in bench.CONTRASTS} | {second for _, second in bench.CONTRASTS} <= set(bench.ARMS)
