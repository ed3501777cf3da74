"""The decision test (benchmarks/bench_decision.py) and its start-policy check (benchmarks/decision_check.py): the
arms, the probe recorded beside each run's metrics, its comparisons, and the check's shares and ratios, on hand-built
runs and trees."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from algos.tree import Node, Tree
from benchmarks import bench_budget, bench_decision, decision_check, learning_runs
from benchmarks.bench_decision import AT_DECISION, CHAIN_2, CHAIN_3, PROBE, UNIFORM
from experiments.checkpoints import checkpoint_iteration
from policies.trajectory import TokenTrajectory


def test_the_arms_are_the_budget_tables_budget_2_the_tree_at_the_decision_and_chain_g3():
    args = bench_decision.parse_args([])
    bed = bench_decision.testbed(args)
    budget = bench_budget.settings()
    assert bed.settings[CHAIN_2] == budget["chain G=2 budget 2"]
    assert bed.settings[UNIFORM] == budget["tree (1,2,1) budget 2"]
    assert bed.settings[AT_DECISION] == (2, ["--algo", "tree_grpo", "--M", "1", "--N", "2", "--L", "1",
                                             "--branching", "at_depth_1"])  # the decision is the world's step 2
    assert bed.settings[CHAIN_3] == (3, ["--algo", "grpo", "--group-size", "3"])
    assert bed.comparisons[0] == (AT_DECISION, CHAIN_2) and (CHAIN_3, CHAIN_2) in bed.comparisons
    # the budget table's start, world and schedule; 20 seeds of 20 iterations; records under a "decision" folder
    budget_args = bench_budget.parse_args([])
    assert bench_decision.start_recipes(args, bed) == bench_decision.start_recipes(budget_args,
                                                                                   bench_budget.testbed(budget_args))
    assert (bed.world, args.lr, args.warmup_steps, args.iterations, len(args.seeds), args.output) == (
        bench_budget.WORLD, 2e-5, 0, 20, 20, "outputs/decision_test")


def test_every_run_saves_a_checkpoint_an_iteration_for_the_probe_and_other_benchmarks_keep_their_options():
    args = bench_decision.parse_args(["--iterations", "7"])
    options = learning_runs.run_options(bench_decision.testbed(args), CHAIN_3, 0, "warm", args, Path("d"))
    # given after the shared "--checkpoint-every 0", so they win (argparse keeps the last)
    assert options[-4:] == ["--checkpoint-every", "1", "--keep-checkpoints", "7"]
    assert options.index("--checkpoint-every") < len(options) - 4
    budget_args = bench_budget.parse_args([])
    budget_options = learning_runs.run_options(bench_budget.testbed(budget_args), "chain G=2 budget 2", 0, "warm",
                                               budget_args, Path("d"))
    assert budget_options[-2:] == ["--output", "d"]  # unchanged: the budget table's records still resume


def test_more_seeds_than_the_exact_sign_flip_takes_is_refused(capsys):
    with pytest.raises(SystemExit):
        bench_decision.parse_args(["--seeds", *map(str, range(21))])
    assert "--seeds takes 1 to 20 seeds, got 21" in capsys.readouterr().err


def fake_run(directory: Path, iterations: int, saved: list[int]) -> Path:
    """A finished run's folder: metrics rows, checkpoints of ``saved`` iterations, latest at the last."""
    directory.mkdir(parents=True)
    rows = [{"iteration": i, "tokens_generated": 100 * i, "dev_em": 0.5} for i in range(1, iterations + 1)]
    (directory / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    for i in saved:
        (directory / "checkpoints" / f"iter_{i:06d}").mkdir(parents=True)
    (directory / "checkpoints" / "latest").symlink_to(f"iter_{saved[-1]:06d}")
    return directory


def by_iteration(policy: str) -> dict[str, float]:
    """A probe reading the iteration from the checkpoint's name: what was measured where shows in the rows."""
    return {PROBE: checkpoint_iteration(policy) / 10}


def test_the_probe_goes_into_each_iterations_row_and_only_the_last_checkpoint_stays(tmp_path):
    run = fake_run(tmp_path / "run", 3, [1, 2, 3])
    bench_decision.record_probe(run, by_iteration)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [(row["iteration"], row[PROBE], row["dev_em"]) for row in rows] == [(1, 0.1, 0.5), (2, 0.2, 0.5),
                                                                                (3, 0.3, 0.5)]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["iter_000003", "latest"]
    assert not list(run.glob("*.probed"))


def test_a_run_without_every_iterations_checkpoint_is_named_and_left_as_it_was(tmp_path):
    run = fake_run(tmp_path / "run", 3, [2, 3])
    before = (run / "metrics.jsonl").read_text()
    with pytest.raises(FileNotFoundError, match=r"no checkpoint of iterations \[1\] to probe.*--checkpoint-every 1"):
        bench_decision.record_probe(run, by_iteration)
    assert (run / "metrics.jsonl").read_text() == before and (run / "checkpoints" / "iter_000002").is_dir()


def rows_of(probes: list[float], mixed: float = 0.5) -> list[dict]:
    """A run's rows: its probe each iteration (the chair's questions at half of it, the founder's at twice)."""
    return [{"iteration": i + 1, "tokens_generated": 10, "tool_calls": 3, "nonzero_advantage_share": mixed, PROBE: p,
             f"{PROBE}_chair": p / 2, f"{PROBE}_founder": 2 * p} for i, p in enumerate(probes)]


def test_the_probe_comparison_pairs_each_seeds_mean_over_the_iterations():
    runs = {AT_DECISION: [rows_of([0.2, 0.4]), rows_of([0.5, 0.7]), rows_of([0.1, 0.5])],
            CHAIN_2: [rows_of([0.2, 0.2]), rows_of([0.4, 0.6]), rows_of([0.1, 0.2])]}
    (name, d), = bench_decision.probe_comparisons(runs, ((AT_DECISION, CHAIN_2), (CHAIN_3, CHAIN_2))).items()
    # per seed: 0.3 - 0.2, 0.6 - 0.5, 0.3 - 0.15; all positive, so 2 of the 8 sign assignments reach |sum|
    assert name == f"{AT_DECISION} - {CHAIN_2}" and d["mean"] == pytest.approx((0.1 + 0.1 + 0.15) / 3)
    assert d["sign_flip_p"] == pytest.approx(0.25) and d["p_holm"] == pytest.approx(0.25)
    means = bench_decision.mean_rows(runs[CHAIN_2], start=0.15)
    assert [(r["iteration"], round(r[PROBE], 6)) for r in means] == [(0, 0.15), (1, round(0.7 / 3, 6)),
                                                                   (2, round(1 / 3, 6))]
    # every point has its spread (the plot draws a band only then) and its counts (the x axes), the start's 0
    assert [round(r[f"{PROBE}_std"], 6) for r in means] == [0.0, round(float(np.std([0.2, 0.4, 0.1])), 6),
                                                            round(float(np.std([0.2, 0.6, 0.2])), 6)]
    assert [(r["tokens_generated"], r["tool_calls"]) for r in means] == [(0, 0), (10, 3), (10, 3)]


def test_the_probe_report_names_every_missing_run_and_reads_nothing(tmp_path):
    args = bench_decision.parse_args(["--output", str(tmp_path), "--seeds", "0", "1", "--settings", CHAIN_2])
    done = fake_run(learning_runs.run_directory(CHAIN_2, 0, tmp_path), 2, [2])
    (done / learning_runs.FINAL_EVALUATION).write_text("{}", encoding="utf-8")
    with pytest.raises(FileNotFoundError, match=r"probed run of chain G=2 seed 0, chain G=2 seed 1; every run"):
        bench_decision.probed_runs(args)  # seed 0 finished without its probe, seed 1 not at all


def step(parent: Node, reward: float = 0.0, leaf: bool = False) -> Node:
    return parent.add_child(Node(TokenTrajectory.from_prompt(()), None, reward=reward, is_leaf=leaf))


def chain(prompt: int, tree_id: int, reward: float) -> Tree:
    root = Node(TokenTrajectory.from_prompt(()), None)
    step(step(root), reward, leaf=True)
    return Tree(root, prompt, tree_id)


def test_a_prompt_is_mixed_when_its_leaves_rewards_differ_across_its_trees_or_inside_one():
    tree = chain(2, 0, 1.0)
    step(tree.root.children[0], 0.0, leaf=True)  # an expansion of prompt 2's only tree, rewarded otherwise
    trees = [chain(0, 0, 1.0), chain(0, 1, 0.0), chain(1, 0, 0.2), chain(1, 1, 0.2), tree]
    assert decision_check.mixed_rewards(trees, [0, 1, 2]).tolist() == [True, False, True]


def test_the_ratio_to_the_baseline_and_its_paired_interval():
    base = np.array([0.5, 0.0, 0.5, 0.0])
    ratio, low, high = decision_check.ratio_interval(2 * base, base)
    assert (ratio, low, high) == (2.0, 2.0, 2.0)  # twice as mixed on every question: every resample says 2
    ratio, low, high = decision_check.ratio_interval(np.array([0.5, 0.5, 0.0, 0.0]), base)
    assert ratio == 1.0 and low < 1.0 < high
    with pytest.raises(ValueError, match="baseline arm had no prompt with mixed rewards"):
        decision_check.ratio_interval(base, np.zeros(4))


def test_the_checks_table_reads_every_arm_against_chain_g2_beside_the_prediction():
    arms = {CHAIN_2: {"mixed": np.array([0.5, 0.0]), "draws": 2.0, "leaves": 2.0, "chains": 2.0},
            AT_DECISION: {"mixed": np.array([0.75, 0.0]), "draws": 3.0, "leaves": 3.0, "chains": 2.5}}
    table, figures = decision_check.check_table(arms, ["chair", "founder"])
    assert figures[AT_DECISION]["ratio"][0] == 1.5 and figures[AT_DECISION]["predicted_ratio"] == 1.5
    assert figures[AT_DECISION]["mixed_by_role"] == {"chair": 0.75, "founder": 0.0}
    assert f"| {AT_DECISION} | 3.00 | 3.00 | 2.50 | 0.375 | 0.000 | 0.750 | 1.500 [" in table
    unmixed = {name: {**arm, "mixed": np.zeros(2)} for name, arm in arms.items()}
    table, figures = decision_check.check_table(unmixed, ["chair", "founder"])  # the figures, with no ratio
    assert figures[AT_DECISION]["ratio"] is None and f"| {AT_DECISION} | 3.00 | 3.00 | 2.50 | 0.000 |" in table
    with pytest.raises(ValueError, match="ratios are against 'chain G=2': include it in --settings"):
        decision_check.check_table({AT_DECISION: arms[AT_DECISION]}, ["chair", "founder"])


def test_the_rule_lets_the_runs_go_only_when_the_tree_finds_the_decision_and_mixes_more_prompts(tmp_path, capsys):
    def figures(draws: float, ratio: tuple[float, float, float] | None) -> dict[str, dict]:
        return {AT_DECISION: {"draws": draws, "ratio": ratio}}

    assert decision_check.rule_verdict(figures(2.95, (1.4, 1.1, 1.7)))[0]
    go, why = decision_check.rule_verdict(figures(2.5, (1.4, 1.1, 1.7)))  # expansions missed the decision
    assert not go and "drew the decision 2.50 times" in why
    go, why = decision_check.rule_verdict(figures(3.0, (1.2, 0.9, 1.5)))  # more mixed, not beyond the noise
    assert not go and "interval starts at 0.900" in why and "drew" not in why
    assert not decision_check.rule_verdict(figures(3.0, None))[0]
    assert not decision_check.rule_verdict({})[0]
    check = tmp_path / "start-check.json"
    for arms, code in ((figures(3.0, (1.5, 1.2, 1.8)), 0), (figures(2.0, (1.5, 1.2, 1.8)), 1)):
        check.write_text(json.dumps({"arms": arms}))
        with pytest.raises(SystemExit) as stop:
            decision_check.main(["--rule", str(check)])
        assert stop.value.code == code and capsys.readouterr().out.startswith(("go" if code == 0 else "stop") + ":")


def test_the_probe_report_writes_its_table_and_with_report_its_section_beside_the_studys(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the study's README: results/<its folder>/README.md, relative to the root
    args = bench_decision.parse_args(["--output", "out", "--seeds", "0", "1", "--settings", CHAIN_2, AT_DECISION,
                                      "--report"])
    for setting, probes in ((CHAIN_2, [0.2, 0.3]), (AT_DECISION, [0.3, 0.6])):
        for seed in (0, 1):
            run = learning_runs.run_directory(setting, seed, Path("out"))
            run.mkdir(parents=True)
            (run / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows_of(probes)))
            (run / learning_runs.FINAL_EVALUATION).write_text("{}", encoding="utf-8")
    table = bench_decision.probe_report(bench_decision.testbed(args), args,
                                        start={PROBE: 0.1, f"{PROBE}_chair": 0.05, f"{PROBE}_founder": 0.2})
    # per arm: the mean over iterations (sd over seeds), asking the chair (half), the founder (twice), the last
    assert f"| {AT_DECISION} | 2 | 0.450 (0.000) | 0.225 | 0.900 | 0.600 |" in table
    assert "the start's 0.100 (chair 0.050, founder 0.200)" in table
    # both seeds +0.2: the sign-flip's smallest p at 2 seeds, 0.5, so inside the noise
    assert f"| {AT_DECISION} - {CHAIN_2} | +0.200 |" in table and "| inside the noise: no difference shown |" in table
    # the mechanism beside: every arm's rows say 0.5, so the ratio to chain G=2 is 1, against the predicted 1.5
    assert f"| {AT_DECISION} | 0.500 | 1.00 | 1.500 |" in table and f"| {CHAIN_2} | 0.500 | 1.00 | 1.000 |" in table
    assert (Path("out") / "decision-probe.md").read_text() == table
    # the section's key is the registered study's: its README (here under the test's working directory)
    readme = (Path("results") / "decision_test" / "README.md").read_text(encoding="utf-8")
    assert "<!-- decision-probe:begin -->" in readme and table in readme
    assert (Path("results") / "decision_test" / "decision-probe.png").is_file()


def test_the_starts_path_is_where_the_start_policy_is_cached(tmp_path, monkeypatch):
    """unfinished_runs names the start by the path cached_warm_start publishes it at, without training it."""
    import experiments.warmstart as warmstart

    monkeypatch.setenv("TREEGRPO_CACHE_DIR", str(tmp_path))
    args = bench_decision.parse_args(["--output", str(tmp_path / "out")])
    bed = bench_decision.testbed(args)
    published = tmp_path / "published"
    monkeypatch.setattr(warmstart, "cached_warm_start", lambda world, recipe, *, topk, continues=None: (
        published if warmstart.warm_start_dir(world, recipe, topk=topk, continues=continues) ==
        Path(bench_decision.start_path(bed, args)) else pytest.fail("another path")))
    assert bench_decision.start_policy(bed, args) == str(published)
    assert str(tmp_path) in bench_decision.start_path(bed, args)


def test_the_starts_probe_is_measured_once_and_then_read_from_its_record(tmp_path, monkeypatch):
    args = bench_decision.parse_args(["--output", str(tmp_path)])
    measured = []
    monkeypatch.setattr(bench_decision, "start_policy", lambda bed, args: "start-model")
    monkeypatch.setattr(bench_decision, "probe_policy", lambda policy, bed: measured.append(policy) or {PROBE: 0.13})
    bed = bench_decision.testbed(args)
    assert bench_decision.start_probe(bed, args) == {PROBE: 0.13} and measured == ["start-model"]
    assert json.loads((tmp_path / bench_decision.START_PROBE).read_text()) == {PROBE: 0.13}
    assert bench_decision.start_probe(bed, args) == {PROBE: 0.13} and measured == ["start-model"]  # not again


def test_the_report_trains_nothing_and_names_the_runs_not_finished_with_todays_options(tmp_path, monkeypatch):
    argv = ["--output", str(tmp_path), "--seeds", "0", "1", "--settings", CHAIN_2, "--resume", "--report"]
    args = bench_decision.parse_args(argv)
    monkeypatch.setattr(bench_decision, "start_path", lambda bed, args: str(tmp_path / "start"))
    monkeypatch.setattr(bench_decision, "start_policy", lambda *a: pytest.fail("the report trained the start"))
    monkeypatch.setattr(bench_decision, "run_from_start", lambda *a: pytest.fail("the report trained"))
    bed = bench_decision.testbed(args)
    for seed, options in ((0, None), (1, ["--lr", "1"])):  # seed 0 as today's command makes it, seed 1 otherwise
        run = learning_runs.run_directory(CHAIN_2, seed, tmp_path)
        run.mkdir(parents=True)
        made = options or learning_runs.run_options(bed, CHAIN_2, seed, str(tmp_path / "start"), args, run)
        (run / learning_runs.FINAL_EVALUATION).write_text(json.dumps({"run": made}), encoding="utf-8")
    assert bench_decision.unfinished_runs(bed, args) == [f"{CHAIN_2} seed 1"]
    with pytest.raises(SystemExit, match=rf"1 run\(s\) have not finished with these options \({CHAIN_2} seed 1\)"):
        bench_decision.main(argv)


def test_a_runs_final_evaluation_is_written_beside_and_moved_into_place(tmp_path, monkeypatch):
    """A records save beside a worker (run_records.py) reads held_out.json whole or not at all."""
    record, written = tmp_path / learning_runs.FINAL_EVALUATION, []
    real_write = Path.write_text
    monkeypatch.setattr(Path, "write_text",
                        lambda path, *a, **k: written.append(path.name) or real_write(path, *a, **k))
    scores = learning_runs.scores_once(record, {"run": ["--seed", "0"]}, False, lambda: [{"em": 1.0}])
    assert scores == [{"em": 1.0}] and json.loads(record.read_text())["scores"] == scores
    assert written and record.name not in written  # never written in place


def test_the_records_keep_the_starts_probe_and_check_under_the_names_they_are_written():
    from benchmarks import run_records

    assert {bench_decision.START_PROBE, decision_check.START_CHECK} <= set(run_records.TOP_FILES)


def test_study_report_checks_the_probe_in_the_records_and_rebuilds_its_section_from_them(tmp_path, monkeypatch):
    """The study's report reads the compressed records alone: the start's probe and every row's probe must be in them,
    and the probe's section is rebuilt beside the learning one, nothing trained or measured."""
    from benchmarks import studies, study_report
    from benchmarks.run_records import read_archive, save, write_archive

    command = ("benchmarks/bench_decision.py", "--seeds", "0", "1", "--settings", CHAIN_2, AT_DECISION,
               "--eval-questions", "4", "--output", "outputs/decide")
    entry = studies.Study("decide", "a toy decision test", None, (studies.Output("decide", command),),
                          ("decision-test", bench_decision.PROBE_SECTION))
    monkeypatch.setattr(studies, "STUDIES", (entry,))
    monkeypatch.setattr(bench_decision, "start_policy", lambda *a: pytest.fail("the report trained the start"))
    monkeypatch.setattr(bench_decision, "probe_policy", lambda *a: pytest.fail("the report measured a probe"))
    args = bench_decision.parse_args(list(command[1:]))
    bed = bench_decision.testbed(args)
    output = tmp_path / "outputs" / "decide"
    for setting, probes in ((CHAIN_2, [0.2, 0.3]), (AT_DECISION, [0.3, 0.6])):
        for seed in (0, 1):
            run = learning_runs.run_directory(setting, seed, output)
            run.mkdir(parents=True)
            rows = [{**row, "dev_em": 0.5, "tokens_generated_total": 10 * row["iteration"], "reward_mean": 0.5,
                     "time_s": 1.0} for row in rows_of(probes)]
            (run / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
            options = learning_runs.run_options(bed, setting, seed, "warm", args, run)
            scores = [{"em": 1.0, "tool_calls": 2.0, "answered": 1.0, "hops": 2.0}] * 4
            (run / learning_runs.FINAL_EVALUATION).write_text(json.dumps({"run": options, "scores": scores}))
    (output / learning_runs.START_POINT).write_text(json.dumps({"model": "warm", "scores": scores}))
    (output / bench_decision.START_PROBE).write_text(json.dumps({PROBE: 0.1}))
    save(output, tmp_path / "records")
    monkeypatch.chdir(tmp_path)
    assert study_report.report("decide", tmp_path / "records") == [Path("results/decide/README.md")]
    readme = (tmp_path / "results" / "decide" / "README.md").read_text(encoding="utf-8")
    assert "<!-- decision-test:begin -->" in readme and "<!-- decision-probe:begin -->" in readme
    assert f"| {AT_DECISION} | 2 | 0.450 (0.000) |" in readme and "the start's 0.100." in readme
    # the start's probe missing, a row without its probe: named, nothing written
    archive = read_archive(tmp_path / "records" / "decide" / studies.ARCHIVE)
    del archive[f"decide/{bench_decision.START_PROBE}"]
    chain_rows = f"decide/{learning_runs.run_directory(CHAIN_2, 1, Path()).as_posix()}/metrics.jsonl"
    archive[chain_rows] = archive[chain_rows].replace(f'"{PROBE}": 0.3'.encode(), f'"{PROBE}": null'.encode())
    write_archive(tmp_path / "records" / "decide" / studies.ARCHIVE, archive)
    with pytest.raises(study_report.IncompleteRecords) as refused:
        study_report.report("decide", tmp_path / "records")
    assert f"no {bench_decision.START_PROBE}" in str(refused.value)
    assert f"has iterations without {PROBE}" in str(refused.value)
