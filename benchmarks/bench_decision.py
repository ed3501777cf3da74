"""The decision test (issue 72 item 1; protocol: docs/protocol_decision.md): at budget 2, from the budget table's start
and world, whether a tree whose expansions each re-draw SynthBranch's routing decision learns it sooner than chains.
Four arms, 8 prompts an iteration, 20 iterations each (none censored at 0.7 by design), 20 seeds:

- ``chain G=2``: 2 draws of the decision a prompt, 2 chains of tokens;
- ``tree (1,2,1) uniform``: the budget table's tree (an expansion re-draws the decision only when it picks the root
  or the node before it: 2 draws on average, about 2.25 chains);
- ``tree (1,2,1) at the decision``: ``--branching at_depth_1``, both expansions from the node before the decision
  (``algos/branching.py``): 3 draws for about 2.5 chains;
- ``chain G=3``: 3 draws, 3 chains: what 3 draws are worth.

    # before any run, the start-policy check (no training; minutes): each arm's trees from the start, the share of
    # prompts with mixed rewards against chain G=2's, beside the predicted ratios
    python benchmarks/decision_check.py
    # the 80 runs: the start on every thread, then two one-thread workers sharing --output, then the report
    python benchmarks/bench_decision.py --resume --start-only
    OMP_NUM_THREADS=1 python benchmarks/bench_decision.py --resume --seeds 0 2 4 6 8 10 12 14 16 18 &
    OMP_NUM_THREADS=1 python benchmarks/bench_decision.py --resume --seeds 1 3 5 7 9 11 13 15 17 19 &
    wait; python benchmarks/bench_decision.py --resume --report    # both sections: results/decision_test/README.md
    python benchmarks/run_records.py save outputs/decision_test    # results/decision_test/records.tar.xz

Outcomes (the learning benchmarks' report, ``learning_runs``): the final dev EM on the 300 held-out questions, the
iterations (and tokens) to first reach dev EM 0.7 on the 50-question curve, a run that never reaches it censored at
its end, and each arm's share of prompts with a non-zero advantage. Beside them, the continuous outcome: after every
iteration, the teacher-forced probability of the right role at the decision (``check_start.policy_decision``'s
``role_p``) on the first ``PROBE_QUESTIONS`` held-out questions, in the run's metrics.jsonl (``probe_role_p``, and
per asked role); it is measured on a checkpoint saved every iteration, and those checkpoints, the last aside, are
then removed. Each run's probe is read as its mean over the iterations; the arms are compared on it seed by seed
(Student-t, exact sign-flip, Holm over the comparisons): OUTPUT/decision-probe.md, .json and .png, and with
--report section ``decision-probe`` of the study's README beside the testbed's ``decision-test``
(``studies.section_file``), with each arm's share of prompts with mixed rewards against the predicted ratio. The
start's probe is measured once into OUTPUT/start_probe.json, kept with the records. A probe section is rebuilt from
the records by ``run_records.py restore`` and this script's ``--resume --report``, which trains nothing: it refuses
while a run has not finished with today's options, and names them.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np

from benchmarks import bench_budget
from benchmarks.bench_branching import TOPK, WORLD, run_from_start, start_recipes
from benchmarks.check_start import policy_decision
from benchmarks.learning_options import add_run_options, check_eval_questions, design_output, with_design
from benchmarks.learning_report import verdict
from benchmarks.learning_runs import FINAL_EVALUATION, run_directory, run_options, trained_with
from benchmarks.learning_stats import seed_tests, with_holm
from benchmarks.learning_testbed import RunProbe, Testbed
from benchmarks.plateau_exit import PLATEAU_THRESHOLD
from envs.retrieval.corpus import replace_atomically
from experiments.checkpoints import LATEST, PREFIX, checkpoint_iteration
from experiments.plot import METRICS_FILE, load_metrics, plot_runs
from policies.generation import SamplingSettings

BUDGET = 2  # the budget table's tightest, where the paper claims its largest gain
CHAIN_2, UNIFORM, AT_DECISION, CHAIN_3 = ("chain G=2", "tree (1,2,1) uniform", "tree (1,2,1) at the decision",
                                          "chain G=3")
# (a, b): the paired difference a - b, a >= b the direction expected; the first is the test's question, the second
# its calibration (what a third draw is worth to chains), the rest how the tree's branching and budget read beside
COMPARISONS: tuple[tuple[str, str], ...] = (
    (AT_DECISION, CHAIN_2), (CHAIN_3, CHAIN_2), (AT_DECISION, UNIFORM), (UNIFORM, CHAIN_2), (CHAIN_3, AT_DECISION),
)
# the share of prompts with mixed rewards against chain G=2's, if the steps after the decision were deterministic
# (docs/protocol_decision.md derives them: 1.75 p(1-p) and 3 p(1-p) against 2 p(1-p))
PREDICTED_MIXED_RATIO = {CHAIN_2: 1.0, UNIFORM: 0.875, AT_DECISION: 1.5, CHAIN_3: 1.5}
SEEDS = list(range(20))
ITERATIONS = 20
PROBE = "probe_role_p"  # metrics.jsonl: p(the right role's word) at the decision, mean over the probe questions
PROBE_QUESTIONS = 50  # the first held-out questions: the curve's, 30 of them asking the chair
PROBE_SECTION = "decision-probe"  # its section's key in the study's README (beside the testbed's, decision-test)
PROBE_ROLES = ("chair", "founder")  # the probe per asked role: metrics.jsonl's probe_role_p_chair, ..._founder
START_PROBE = "start_probe.json"  # OUTPUT's record of the start policy's probe (iteration 0 of the curves)
MIXED = "nonzero_advantage_share"  # metrics.jsonl: the share of the iteration's prompts with mixed rewards


def settings() -> dict[str, tuple[int, list[str]]]:
    """name -> (nominal budget in full chains, run.py options): budget 2's chain and tree as the budget table runs
    them (experiments/configs/budget/budget2_*.yaml), the tree also branching before the decision, and chain G=3."""
    budget = bench_budget.settings()
    tree, chain = (budget[name][1] for name in bench_budget.arm_names(BUDGET))
    at = tree.index("--branching") + 1
    return {CHAIN_2: (BUDGET, chain), UNIFORM: (BUDGET, tree),
            AT_DECISION: (BUDGET, [*tree[:at], f"at_depth_{WORLD.decision_hop}", *tree[at + 1:]]),
            CHAIN_3: (3, ["--algo", "grpo", "--group-size", "3"])}


def testbed(args: argparse.Namespace) -> Testbed:
    bed = with_design(Testbed("decision-test", "The decision test (issue 72): at budget 2, trees that re-draw the "
                              "decision against chains on SynthBranch-v0", "SynthBranch-v0", WORLD, TOPK, settings(),
                              COMPARISONS, plateau_threshold=PLATEAU_THRESHOLD), args)
    # a checkpoint every iteration, all kept until the probe has read them
    options = ("--checkpoint-every", "1", "--keep-checkpoints", str(args.iterations))
    return dataclasses.replace(bed, probe=RunProbe(options, functools.partial(
        record_probe, probe=functools.partial(probe_policy, bed=bed))))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_options(p, list(settings()), seeds=SEEDS, iterations=ITERATIONS, eval_every=1,
                    section="decision-test", warmup_steps=0)
    # the budget table's schedule and curve (a design of its own only away from them)
    p.set_defaults(lr=bench_budget.LR, schedule_defaults={"lr": bench_budget.LR, "warmup_steps": 0},
                   curve_questions=50)
    args = p.parse_args(argv)
    if not 1 <= len(args.seeds) <= 20:  # the sign-flip test's exact limit (experiments/confidence.py)
        p.error(f"--seeds takes 1 to 20 seeds, got {len(args.seeds)}")
    if args.iterations < 1:
        p.error(f"--iterations must be >= 1, got {args.iterations}")
    # bench_branching's start options: the budget table's start (its fifth design's)
    args.start_misroute, args.start_misroute_role, args.start_goal = bench_budget.START_MISROUTE, "chair", False
    args.output = args.output or design_output("outputs/decision_test", args)
    check_eval_questions(p, args, testbed(args))
    return args


def probe_policy(policy: str, bed: Testbed) -> dict[str, float]:
    """The probe of ``policy`` (a model directory or a training checkpoint): the teacher-forced probability of the
    right role's word at the decision, mean over the first ``PROBE_QUESTIONS`` held-out questions and per asked
    role."""
    summary = policy_decision(policy, bed.data_dir, "dev", PROBE_QUESTIONS, bed.max_turns, SamplingSettings().top_p,
                              bed.world.decision_hop)
    if "role_p" not in summary:
        raise ValueError(f"{policy}: its start was not trained on restating thoughts (warmstart.py --restate), so "
                         f"no role word is written at the decision to probe")
    return {PROBE: summary["role_p"], **{f"{PROBE}_{role}": summary[f"role_p_{role}"] for role in PROBE_ROLES
                                         if f"role_p_{role}" in summary}}


def start_probe(bed: Testbed, args: argparse.Namespace) -> dict[str, float]:
    """The start policy's probe: read from OUTPUT/``START_PROBE`` (kept with the records, so that a report rebuilt
    on another machine, whose build of the start may differ, reads the one the runs were compared with), else
    measured now and written there."""
    path = Path(args.output) / START_PROBE
    if path.is_file():
        return json.loads(path.read_text(encoding="utf-8"))
    probe = probe_policy(start_policy(bed, args), bed)
    replace_atomically(path, lambda staged: staged.write_text(json.dumps(probe), encoding="utf-8"))
    return probe


def record_probe(directory: Path, probe: Callable[[str], dict[str, float]]) -> None:
    """Measure ``probe`` on each checkpoint of the finished run in ``directory``, write it into that iteration's
    row of its metrics.jsonl (replaced whole), then remove every checkpoint but the latest (the one evaluated)."""
    checkpoints = directory / "checkpoints"
    saved = {checkpoint_iteration(path): path for path in checkpoints.glob(f"{PREFIX}*") if path.is_dir()}
    rows = load_metrics(directory / METRICS_FILE)
    if missing := [row["iteration"] for row in rows if row["iteration"] not in saved]:
        raise FileNotFoundError(f"{checkpoints}: no checkpoint of iterations {missing} to probe (a probed run saves "
                                f"one every iteration and keeps them all: --checkpoint-every 1 --keep-checkpoints "
                                f"at least its iterations)")
    for row in rows:
        row.update(probe(str(saved[row["iteration"]])))
    metrics = directory / METRICS_FILE
    staged = metrics.with_name(metrics.name + ".probed")
    staged.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    os.replace(staged, metrics)
    latest = (checkpoints / LATEST).resolve()
    for path in saved.values():
        if path.resolve() != latest:
            shutil.rmtree(path)


def probed_runs(args: argparse.Namespace) -> dict[str, list[list[dict]]]:
    """Per setting, per seed: the metrics rows of the run, its probe in each. Every run of --settings x --seeds must
    have finished with its probe: the missing ones are named, and nothing is read."""
    output, runs, missing = Path(args.output), {}, []
    for setting in args.settings:
        for seed in args.seeds:
            directory = run_directory(setting, seed, output)
            rows = load_metrics(directory) if (directory / FINAL_EVALUATION).is_file() else []
            if not rows or any(row.get(PROBE) is None for row in rows):
                missing.append(f"{setting} seed {seed}")
            runs.setdefault(setting, []).append(rows)
    if missing:
        raise FileNotFoundError(f"{output}: no finished, probed run of {', '.join(missing)}; every run is reported "
                                f"or none (run them with --resume)")
    return runs


def probe_means(runs: list[list[dict]]) -> np.ndarray:
    """Each run's probe, mean over its iterations (the continuous outcome's reading)."""
    return np.array([np.mean([row[PROBE] for row in rows]) for rows in runs])


def probe_comparisons(runs: dict[str, list[list[dict]]], comparisons: tuple[tuple[str, str], ...],
                      ) -> dict[str, dict[str, float]]:
    """Each comparison whose two settings ran: the per-seed differences of the runs' mean probe, with
    ``seed_tests`` and the sign-flip p Holm-adjusted over the comparisons (``p_holm``)."""
    out = {}
    for a, b in comparisons:
        if a in runs and b in runs:
            differences = probe_means(runs[a]) - probe_means(runs[b])
            out[f"{a} - {b}"] = {"mean": float(differences.mean()), **seed_tests(differences)}
    return with_holm(out, "sign_flip_p") if out else out


def mean_rows(runs: list[list[dict]], start: float) -> list[dict[str, float]]:
    """A setting's rows averaged over seeds, iteration by iteration after the start (iteration 0, whose spread is
    0): tokens generated, tool calls, the probe and its std over seeds (the plot's band)."""
    counts = ("tokens_generated", "tool_calls")
    means = [{"iteration": 0, **dict.fromkeys(counts, 0.0), PROBE: start, f"{PROBE}_std": 0.0}]
    for rows in zip(*runs, strict=True):
        probes = [row[PROBE] for row in rows]
        means.append({"iteration": rows[0]["iteration"], PROBE: float(np.mean(probes)),
                      f"{PROBE}_std": float(np.std(probes)),
                      **{count: float(np.mean([row.get(count) or 0 for row in rows])) for count in counts}})
    return means


def mixed_reward_shares(runs: dict[str, list[list[dict]]]) -> dict[str, dict[str, float]]:
    """Per arm, the share of prompts with mixed rewards in training (mean over iterations and seeds), its ratio to
    chain G=2's and the ratio predicted at the start (``PREDICTED_MIXED_RATIO``): the mechanism, read beside."""
    shares = {setting: float(np.mean([row[MIXED] for rows in seeds for row in rows if row.get(MIXED) is not None]))
              for setting, seeds in runs.items()}
    base = shares.get(CHAIN_2)
    return {setting: {"share": share, "ratio": share / base if base else float("nan"),
                      "predicted": PREDICTED_MIXED_RATIO.get(setting, float("nan"))}
            for setting, share in shares.items()}


def role_mean(seeds: list[list[dict]], role: str) -> str:
    """An arm's probe on the questions asking ``role``: mean over iterations, then seeds (- where not recorded)."""
    key = f"{PROBE}_{role}"
    values = [row[key] for rows in seeds for row in rows if row.get(key) is not None]
    return f"{np.mean(values):.3f}" if values else "-"


def probe_report(bed: Testbed, args: argparse.Namespace, start: dict[str, float]) -> str:
    """OUTPUT/decision-probe.md, .json and .png: each arm's probe (mean over iterations, then seeds; per asked role;
    after the last iteration), the comparisons with their reading, and each arm's share of prompts with mixed rewards
    against the predicted ratio; ``start``: the start policy's probe (iteration 0 of the curves)."""
    output, runs = Path(args.output), probed_runs(args)
    differences = probe_comparisons(runs, bed.comparisons)
    by_role = ", ".join(f"{role} {start[f'{PROBE}_{role}']:.3f}" for role in PROBE_ROLES if f"{PROBE}_{role}" in start)
    lines = [f"Probe: p(the right role) at the decision, teacher-forced, on the first {PROBE_QUESTIONS} held-out "
             f"questions after each iteration; the start's {start[PROBE]:.3f}" + (f" ({by_role})." if by_role else "."),
             "", "| arm | seeds | mean over the iterations (sd over seeds) | asking the chair | asking the founder | "
             "after the last |", "|---|---|---|---|---|---|"]
    for setting, seeds in runs.items():
        means = probe_means(seeds)
        spread = np.std(means, ddof=1) if len(means) > 1 else 0.0
        lines.append(f"| {setting} | {len(seeds)} | {means.mean():.3f} ({spread:.3f}) | "
                     + " | ".join(role_mean(seeds, role) for role in PROBE_ROLES)
                     + f" | {np.mean([rows[-1][PROBE] for rows in seeds]):.3f} |")
    lines += ["", "| a - b | mean | t 95% interval | t p | sign-flip p | Holm p | reading |",
              "|---|---|---|---|---|---|---|"]
    lines += [f"| {name} | {d['mean']:+.3f} | [{d['t_low']:+.3f}, {d['t_high']:+.3f}] | {d['t_p']:.3g} | "
              f"{d['sign_flip_p']:.3g} | {d['p_holm']:.3g} | {verdict(d)} |" for name, d in differences.items()]
    mixed = mixed_reward_shares(runs)
    lines += ["", "| arm | prompts with mixed rewards in training | against chain G=2 | predicted |",
              "|---|---|---|---|"]
    lines += [f"| {setting} | {m['share']:.3f} | {m['ratio']:.2f} | {m['predicted']:.3f} |"
              for setting, m in mixed.items()]
    table = "\n".join(lines) + "\n"
    (output / "decision-probe.md").write_text(table, encoding="utf-8")
    curves = {setting: [[row[PROBE] for row in rows] for rows in seeds] for setting, seeds in runs.items()}
    (output / "decision-probe.json").write_text(json.dumps({"start": start, "curves": curves, "mixed": mixed,
                                                            "differences": differences}, indent=1), encoding="utf-8")
    plot = plot_runs({setting: mean_rows(seeds, start[PROBE]) for setting, seeds in runs.items()},
                     output / "decision-probe.png", metrics=(PROBE,))
    if args.report:
        write_probe_section(bed, args, table, plot)
    return table


def write_probe_section(bed: Testbed, args: argparse.Namespace, table: str, plot: Path) -> Path:
    """Section ``PROBE_SECTION`` of the study's README (the one ``learning_runs`` writes the testbed's section into)
    and its plot's compact copy beside it; the README's path."""
    from benchmarks.report import compact_plot_copy, replace_section
    from benchmarks.studies import section_file

    readme = section_file(bed.name, args.output)
    copy = compact_plot_copy(plot, readme.parent / plot.name)
    replace_section(readme, PROBE_SECTION, "The probe: p(the right role) at the decision, each iteration",
                    f"{table}\n![the probe, mean over seeds]({copy.name})\n\nPlot: `{copy.name}`: the probe, mean "
                    f"over seeds (a band of one std), against iterations and tokens generated; the start's at 0.\n")
    return readme


def record_problems_beside(files: dict[Path, bytes], args: argparse.Namespace) -> list[str]:
    """``study_report``'s check of what this testbed's records hold beside the learning runs: the start's probe, and
    the probe in every iteration's row of every run (``probed_runs`` reads them so)."""
    problems = [] if Path(START_PROBE) in files else [f"no {START_PROBE} (the start's probe)"]
    for setting in args.settings:
        for seed in args.seeds:
            run = run_directory(setting, seed, Path())
            rows = [json.loads(line) for line in files.get(run / METRICS_FILE, b"").decode("utf-8").splitlines()
                    if line.strip()]
            if any(row.get(PROBE) is None for row in rows):
                problems.append(f"run {run} has iterations without {PROBE}")
    return problems


def rebuild_sections_beside(output: Path, args: argparse.Namespace) -> None:
    """``study_report``'s rebuild of this testbed's section beside the learning section: the probe's, from the
    records written into ``output`` (its start's probe read from them, never measured)."""
    args = argparse.Namespace(**{**vars(args), "output": str(output), "report": True})
    if not (output / START_PROBE).is_file():
        raise FileNotFoundError(f"{output / START_PROBE}: the start's probe is not in the records")
    bed = testbed(args)
    probe_report(bed, args, start_probe(bed, args))


def start_policy(bed: Testbed, args: argparse.Namespace) -> str:
    """The start policy's model directory: --warm, else the budget table's cached start (trained first if missing)."""
    from experiments.warmstart import cached_warm_start

    recipe, first_stage = start_recipes(args, bed)
    return args.warm or str(cached_warm_start(bed.world, recipe, topk=bed.topk, continues=first_stage))


def start_path(bed: Testbed, args: argparse.Namespace) -> str:
    """Where ``start_policy``'s model directory is (--warm, else the cache's), nothing trained: it may not exist."""
    from experiments.warmstart import warm_start_dir

    recipe, first_stage = start_recipes(args, bed)
    return args.warm or str(warm_start_dir(bed.world, recipe, topk=bed.topk, continues=first_stage))


def unfinished_runs(bed: Testbed, args: argparse.Namespace) -> list[str]:
    """The runs of --settings x --seeds without a final evaluation made with today's run.py options from the start
    policy (which ``run_benchmark`` would train again); the start is named by its path, not trained (a machine
    without it learns what is missing before hours of training)."""
    warm, output = str(Path(start_path(bed, args)).resolve()), Path(args.output)
    return [f"{setting} seed {seed}" for setting in args.settings for seed in args.seeds
            if not trained_with(run_directory(setting, seed, output) / FINAL_EVALUATION,
                                run_options(bed, setting, seed, warm, args, run_directory(setting, seed, output)))]


def main(argv: list[str] | None = None) -> Path:
    args = parse_args(argv)
    bed = testbed(args)
    if args.report and (unfinished := unfinished_runs(bed, args)):  # the protocol's report trains nothing
        raise SystemExit(f"bench_decision.py --report: {len(unfinished)} run(s) have not finished with these options "
                         f"({', '.join(unfinished[:5])}{', ...' if len(unfinished) > 5 else ''}): run them first "
                         f"(--resume without --report); the report reads every run or none")
    report = run_from_start(bed, args, argv, "benchmarks/bench_decision.py")
    if not args.start_only:
        print(probe_report(bed, args, start_probe(bed, args)))
    return report


if __name__ == "__main__":
    main()
