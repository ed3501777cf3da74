"""Real questions on a CPU (issue 70; protocol: docs/protocol_hotpotqa.md): SmolLM2-135M-Instruct from its HotpotQA
warm start (experiments/qa_start.py), trained by run.py at the CPU defaults for a fixed number of iterations, then
evaluated greedily on the 594 HotpotQA dev questions with evaluate.py, as a user would.

    python benchmarks/bench_hotpotqa.py --arms tree --seeds 0 1 2     # runs (each resumable), evaluations, summary
    python benchmarks/bench_hotpotqa.py --report                      # the summary of what has finished
    python benchmarks/bench_hotpotqa.py --arms tree chain tree_entropy --output outputs/hotpotqa_cpu \
        --records results/hotpotqa_cpu    # restores the study's records first, saves the finished runs after

Arms (``ARMS``), each with run.py's CPU defaults for HotpotQA-v0 and nothing else changed: ``tree`` (the default,
(M,N,L) = (1,2,1), uniform branching), ``chain`` (chain GRPO, G = 2: the same full-chain budget, 2),
``tree_entropy`` ((1,2,1), entropy branching), ``tree_em`` (the default tree rewarded by exact match alone,
``--reward em``, instead of Search-R1's format-aware reward), ``tree_f1`` (rewarded by token F1, ``--reward f1``),
``tree_t07`` and ``tree_t05`` (sampled at temperature 0.7 or 0.5 instead of the paper's 1.0), ``tree_lr5e-4`` (the
RL learning rate at 5e-4: the CPU default since results/hotpotqa_cpu_lr/, so the ``tree`` runs of the studies before
it trained at 1e-4, the default of their commits). Writes
OUTPUT/start/DIGEST/eval (the start, evaluated once), OUTPUT/ARM_sSEED (each run's directory, its eval/) and
OUTPUT/summary.json + summary.md: held-out EM before and after with the paired 95% interval per seed (t
over questions, bootstrap over questions) and pooled over the seeds (bootstrap over seeds and questions; t over the
seeds' means, with the exact sign-flip p), EM by question type (bridge, comparison), the answer rate and token F1,
each arm's share of prompts with mixed rewards, and arm against arm (paired by seed).

The start is rebuilt on each machine that has no cached copy, and builds on CPUs with different vector units differ
in the last bits: each run records the digest of the start it trained from (RUN/start.json) and is paired with that
start's evaluation (OUTPUT/start/DIGEST/eval, once per digest).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from matplotlib.figure import Figure

from algos.tree_grpo import metrics as metric_keys
from benchmarks.report import compact_plot_copy
from benchmarks.run_records import output_files, read_archive, run_folder_problems, write_archive
from benchmarks.studies import ARCHIVE
from envs.datasets import dataset_path, resolve_data_dir
from experiments.checkpoints import LATEST, checkpoint_iteration
from experiments.cli import yaml_scalar
from experiments.confidence import (
    mean_interval,
    paired_bootstrap_interval,
    paired_difference_interval,
    sign_flip_p_value,
)
from experiments.model_manifest import weights_digest
from experiments.plot import METRICS_FILE, load_metrics
from experiments.qa_start import CPU_OBSERVATION_OPTIONS, qa_warm_start

ENV = "HotpotQA-v0"
ITERATIONS = 20  # the protocol's fixed training length (docs/protocol_hotpotqa.md)
ARMS: dict[str, tuple[str, ...]] = {
    "tree": ("--algo", "tree_grpo"),
    "chain": ("--algo", "grpo"),
    "tree_entropy": ("--algo", "tree_grpo", "--branching", "entropy"),
    "tree_em": ("--algo", "tree_grpo", "--reward", "em"),
    "tree_f1": ("--algo", "tree_grpo", "--reward", "f1"),
    "tree_t07": ("--algo", "tree_grpo", "--temperature", "0.7"),
    "tree_t05": ("--algo", "tree_grpo", "--temperature", "0.5"),
    "tree_lr5e-4": ("--algo", "tree_grpo", "--lr", "5e-4"),
}
ROOT = Path(__file__).resolve().parents[1]
PLOT = "hotpotqa.png"  # in --records: the README's figure (``figure``)
START_RECORD = "start.json"  # in a run's directory: {"start": the digest of the start it trained from}


def run_dir(output: Path, arm: str, seed: int) -> Path:
    return output / f"{arm}_s{seed}"


def start_eval_dir(output: Path, digest: str) -> Path:
    return output / "start" / digest / "eval"


def bind_start(run: Path, digest: str) -> None:
    """Record that ``run`` trains from the start ``digest``; a run begun from another build is refused, naming both."""
    record = run / START_RECORD
    if record.is_file():
        recorded = json.loads(record.read_text(encoding="utf-8"))["start"]
        if recorded != digest:
            raise SystemExit(f"{run} began from the start {recorded}; this machine's start is {digest} (another "
                             f"build, e.g. on a CPU with other vector units): finish the run where it began, or "
                             f"delete {run} to run it again from this start")
        return
    run.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps({"start": digest}), encoding="utf-8")


def run_start(run: Path) -> str:
    """The digest of the start ``run`` trained from."""
    record = run / START_RECORD
    if not record.is_file():
        raise SystemExit(f"{run} has no {START_RECORD}: which start it trained from is unknown, so it has no "
                         f"'before' to be paired with")
    return json.loads(record.read_text(encoding="utf-8"))["start"]


def finished_iterations(run: Path) -> int:
    metrics = run / METRICS_FILE
    return len(load_metrics(metrics)) if metrics.is_file() else 0


def saved_iteration(run: Path) -> int | None:
    """The iteration of the run's newest checkpoint (None before its first)."""
    latest = run / "checkpoints" / LATEST
    return checkpoint_iteration(latest.resolve()) if latest.exists() else None


def train(output: Path, arm: str, seed: int, iterations: int, start: str) -> Path:
    """The arm's run for ``seed`` to ``iterations`` from the start ``start`` (a digest), resumed from the newest
    checkpoint of a killed one (its metrics' rows past that checkpoint are trained again), or begun again where it
    was killed before its first checkpoint (same seed, same run)."""
    run = run_dir(output, arm, seed)
    if finished_iterations(run) >= iterations:  # finished (here, or on another machine and restored from the records)
        return run
    bind_start(run, start)
    saved = saved_iteration(run)
    command = [sys.executable, str(ROOT / "experiments" / "run.py"), "--env", ENV, *ARMS[arm], "--seed", str(seed),
               "--iterations", str(iterations), "--checkpoint-every", "5", "--no-mlflow", "--quiet",
               "--output", str(run)]
    if saved is not None:
        command = [sys.executable, str(ROOT / "experiments" / "run.py"), "--resume", str(run),
                   "--iterations", str(iterations - saved)]  # run.py's --iterations on resume: how many more
    else:  # nothing to resume from: run.py refuses a directory holding a run's rows, so they go
        (run / METRICS_FILE).unlink(missing_ok=True)
        shutil.rmtree(run / "checkpoints", ignore_errors=True)
    print(" ".join(command), flush=True)
    subprocess.run(command, check=True)
    return run


def evaluate(model: str, out: Path, options: tuple[str, ...] = ()) -> Path:
    """evaluate.py on the env's whole evaluation split, once: a run's checkpoint with the run's own observations and
    step cap (evaluate.py reads them from its config), a model directory with ``options``."""
    if not (out / "eval.json").is_file():
        subprocess.run([sys.executable, str(ROOT / "experiments" / "evaluate.py"), "--model", model, "--envs", ENV,
                        *options, "--output", str(out), "--overwrite", "--batch-size", "32", "--quiet"],
                       check=True)  # --overwrite: an eval.md without its eval.json is a killed evaluation's
    return out / "eval.json"


def question_rows(eval_json: Path) -> list[dict]:
    return json.loads(eval_json.read_text(encoding="utf-8"))["questions"][ENV]


def question_types(data_dir: Path) -> list[str]:
    return [q.get("type", "") for q in json.loads(dataset_path("hotpotqa", "dev", data_dir).read_text("utf-8"))]


def interval(values) -> dict:
    i = mean_interval(values)
    return {"mean": i.mean, "low": i.low, "high": i.high}


def seed_summary(before: list[dict], after: list[dict], types: list[str]) -> dict:
    b, a = np.array([r["em"] for r in before]), np.array([r["em"] for r in after])
    t = paired_difference_interval(b, a)
    boot = paired_bootstrap_interval(a[None], b[None])
    by_type = {kind: {"before": float(b[mask].mean()), "after": float(a[mask].mean()),
                      "change": interval(a[mask] - b[mask])}
               for kind in sorted(set(types)) if (mask := np.array([x == kind for x in types])).any()}
    return {"em_before": float(b.mean()), "em_after": float(a.mean()),
            "change_t": {"mean": t.mean, "low": t.low, "high": t.high},
            "change_bootstrap": {"mean": boot.mean, "low": boot.low, "high": boot.high},
            **column_change("answered", before, after), **column_change("f1", before, after),
            "by_type": by_type}


def column_change(key: str, before: list[dict], after: list[dict]) -> dict:
    """A per-question column's mean before and after, and its paired change with a t-interval: KEY_before, KEY_after,
    KEY_change."""
    b, a = np.array([r[key] for r in before]), np.array([r[key] for r in after])
    return {f"{key}_before": float(b.mean()), f"{key}_after": float(a.mean()), f"{key}_change": interval(a - b)}


def run_rows(output: Path, run: Path) -> tuple[list[dict], list[dict]]:
    """A finished run's per-question evaluation before (the start it trained from) and after."""
    return (question_rows(start_eval_dir(output, run_start(run)) / "eval.json"),
            question_rows(run / "eval" / "eval.json"))


def em_change(output: Path, run: Path) -> np.ndarray:
    """A finished run's per-question EM after minus before."""
    before, after = run_rows(output, run)
    return np.array([r["em"] for r in after]) - np.array([r["em"] for r in before])


def mixed_reward_share(metrics: list[dict]) -> float:
    """A run's share of prompts with mixed rewards, the mean over its iterations (the protocol's mechanism metric)."""
    return float(np.mean([x for row in metrics if (x := row.get(metric_keys.NONZERO_ADVANTAGE_SHARE)) is not None]))


def finished_runs(output: Path, arm: str, seeds: list[int]) -> dict[int, Path]:
    """The arm's runs that have been evaluated, by seed."""
    runs = {seed: run_dir(output, arm, seed) for seed in seeds}
    return {seed: run for seed, run in runs.items() if (run / "eval" / "eval.json").is_file()}


def arm_summary(output: Path, arm: str, seeds: list[int], types: list[str]) -> dict | None:
    """The arm's finished runs, each paired with the evaluation of the start it trained from."""
    runs = finished_runs(output, arm, seeds)
    if not runs:
        return None
    per_seed, before, after, curves = {}, [], [], {}
    expansions = {metric_keys.EXPANSIONS: 0, metric_keys.EXPANSIONS_BEFORE_ANSWER_READ: 0}  # over the arm's runs
    for seed, run in runs.items():
        start, rows = run_rows(output, run)
        metrics = load_metrics(run / METRICS_FILE)
        per_seed[seed] = seed_summary(start, rows, types) | {"start": run_start(run),
                                                            "mixed_reward_share": mixed_reward_share(metrics)}
        before.append([r["em"] for r in start])
        after.append([r["em"] for r in rows])
        for key in expansions:
            expansions[key] += sum(row.get(key) or 0 for row in metrics)
        curves[seed] = {key: [row.get(key) for row in metrics]
                        for key in (metric_keys.REWARD, metric_keys.NONZERO_ADVANTAGE_SHARE,
                                    "time_s")}  # metrics.jsonl names the iteration's seconds time_s
    pooled = paired_bootstrap_interval(np.array(after), np.array(before))
    changes = [s["em_after"] - s["em_before"] for s in per_seed.values()]
    seconds = [float(np.median([x for x in c["time_s"][1:] if x is not None] or [np.nan]))
               for c in curves.values()]
    # the share of expansions made before any observation on their path named the answer (chains make none)
    made = expansions[metric_keys.EXPANSIONS]
    before_answer = expansions[metric_keys.EXPANSIONS_BEFORE_ANSWER_READ] / made if made else None
    return {"seeds": sorted(runs), "per_seed": per_seed,
            "pooled_change_bootstrap": {"mean": pooled.mean, "low": pooled.low, "high": pooled.high},
            "pooled_change_t_over_seeds": interval(changes),
            "sign_flip_p": sign_flip_p_value(changes) if changes else None,
            "mixed_reward_share": interval([s["mixed_reward_share"] for s in per_seed.values()]),
            "median_iteration_s": seconds, "expansions_before_answer_read": before_answer, "curves": curves}


# first - second: docs/protocol_hotpotqa.md's decision rules 2 and 3, docs/protocol_hotpotqa_em.md's,
# docs/protocol_hotpotqa_f1.md's, docs/protocol_hotpotqa_temperature.md's and docs/protocol_hotpotqa_lr.md's rule 3
CONTRASTS = (("tree", "chain"), ("tree_entropy", "tree"), ("tree_em", "tree"), ("tree_f1", "tree"),
             ("tree_t07", "tree"), ("tree_t05", "tree"), ("tree_lr5e-4", "tree"))


def arm_contrast(output: Path, first: str, second: str, seeds: list[int]) -> dict | None:
    """EM(first) - EM(second) on the seeds both arms have finished, paired by seed and question.

    Each arm is measured by its change from the start it trained from, so that two arms of a seed trained from two
    builds of the start (two machines) are still compared fairly; from one start this is EM(first) - EM(second)
    after training, exactly. The mixed-reward shares are compared by seed (t over the seeds' differences)."""
    runs = {arm: finished_runs(output, arm, seeds) for arm in (first, second)}
    paired = sorted(set(runs[first]) & set(runs[second]))
    if not paired:
        return None
    changes = {arm: np.array([em_change(output, runs[arm][seed]) for seed in paired]) for arm in (first, second)}
    pooled = paired_bootstrap_interval(changes[first], changes[second])
    by_seed = [float(a.mean() - b.mean()) for a, b in zip(changes[first], changes[second], strict=True)]
    shares = {arm: [mixed_reward_share(load_metrics(runs[arm][seed] / METRICS_FILE)) for seed in paired]
              for arm in (first, second)}
    return {"first": first, "second": second, "seeds": paired,
            "pooled_difference_bootstrap": {"mean": pooled.mean, "low": pooled.low, "high": pooled.high},
            "difference_t_over_seeds": interval(by_seed), "difference_by_seed": by_seed,
            "sign_flip_p": sign_flip_p_value(by_seed),
            "mixed_reward_share_difference": interval(np.subtract(shares[first], shares[second]))}


def over_seeds(t: dict, seeds: int) -> str:
    """A t-interval over the seeds, or a dash where one seed gives none."""
    return f"[{t['low']:+.3f}, {t['high']:+.3f}]" if seeds > 1 else "- (1 seed)"


def markdown(summary: dict) -> str:
    lines = [f"Start {digest} (the warm start): dev EM {start['em']['mean']:.3f} [{start['em']['low']:.3f}, "
             f"{start['em']['high']:.3f}], answer rate {start['answered']['mean']:.3f} over {start['questions']} "
             f"questions." for digest, start in summary["starts"].items()]
    lines += ["", "| arm | seeds | EM before | EM after (mean of seeds) | pooled change (bootstrap) | t over seeds | "
             "sign-flip p | mixed-reward share | expansions before the answer was read | s / iteration |",
             "|" + "---|" * 10]
    for arm, s in summary["arms"].items():
        before, after = (np.mean([x[key] for x in s["per_seed"].values()]) for key in ("em_before", "em_after"))
        p, t, m = s["pooled_change_bootstrap"], s["pooled_change_t_over_seeds"], s["mixed_reward_share"]
        before_answer = s["expansions_before_answer_read"]
        lines.append(f"| {arm} | {len(s['seeds'])} | {before:.3f} | {after:.3f} | {p['mean']:+.3f} "
                     f"[{p['low']:+.3f}, {p['high']:+.3f}] | {over_seeds(t, len(s['seeds']))} | "
                     f"{s['sign_flip_p']:.3f} | {m['mean']:.3f} | "
                     f"{'-' if before_answer is None else format(before_answer, '.3f')} | "
                     f"{np.nanmedian(s['median_iteration_s']):.0f} |")
    lines += ["", "Per seed (change after - before, paired over the questions):", "",
              "| arm | seed | EM after | change (t) | change (bootstrap) | bridge | comparison | "
              "answer rate (change, t) | F1 (change, t) |",
              "|" + "---|" * 9]
    for arm, s in summary["arms"].items():
        for seed, x in s["per_seed"].items():
            t, b, kinds, a, f = (x["change_t"], x["change_bootstrap"], x["by_type"], x["answered_change"],
                                 x["f1_change"])
            kind = {k: f"{v['before']:.3f} -> {v['after']:.3f}" for k, v in kinds.items()}
            lines.append(f"| {arm} | {seed} | {x['em_after']:.3f} | {t['mean']:+.3f} [{t['low']:+.3f}, "
                         f"{t['high']:+.3f}] | [{b['low']:+.3f}, {b['high']:+.3f}] | {kind.get('bridge', '')} | "
                         f"{kind.get('comparison', '')} | {x['answered_before']:.3f} -> {x['answered_after']:.3f} "
                         f"({a['mean']:+.3f} [{a['low']:+.3f}, {a['high']:+.3f}]) | {x['f1_before']:.3f} -> "
                         f"{x['f1_after']:.3f} ({f['mean']:+.3f} [{f['low']:+.3f}, {f['high']:+.3f}]) |")
    if summary["contrasts"]:
        lines += ["", "Arm against arm (rules 2 and 3; each arm's change from its start, paired by seed and question):",
                  "", "| first - second | seeds | EM difference, pooled (bootstrap) | t over seeds | sign-flip p | "
                  "mixed-reward share difference (t over seeds) |", "|" + "---|" * 6]
    for c in summary["contrasts"]:
        p, t, m = c["pooled_difference_bootstrap"], c["difference_t_over_seeds"], c["mixed_reward_share_difference"]
        lines.append(f"| {c['first']} - {c['second']} | {len(c['seeds'])} | {p['mean']:+.3f} [{p['low']:+.3f}, "
                     f"{p['high']:+.3f}] | {over_seeds(t, len(c['seeds']))} | {c['sign_flip_p']:.3f} | "
                     f"{m['mean']:+.3f} {over_seeds(m, len(c['seeds']))} |")
    return "\n".join(lines) + "\n"


def figure(summary: dict) -> Figure:
    """The study's plot: left, held-out EM before (the start) and after ITERATIONS per arm, each seed a pair of
    points joined by a line, the pooled change's 95% bootstrap interval written above the arm; right, each arm's
    training reward per iteration, the mean over its seeds (sampled on the iteration's prompts)."""
    fig = Figure(figsize=(11, 4), layout="constrained")
    em, reward = fig.subplots(1, 2)
    for position, (arm, s) in enumerate(summary["arms"].items()):
        for x in s["per_seed"].values():
            em.plot([position - 0.15, position + 0.15], [x["em_before"], x["em_after"]], marker="o", color="tab:blue",
                    alpha=0.6)
        p = s["pooled_change_bootstrap"]
        em.annotate(f"change {p['mean']:+.3f}\n[{p['low']:+.3f}, {p['high']:+.3f}]", (position, 0.98), ha="center",
                    va="top", fontsize="small", xycoords=("data", "axes fraction"))
        curves = [c[metric_keys.REWARD] for c in s["curves"].values()]
        length = min(len(c) for c in curves)
        mean = np.mean([[np.nan if v is None else v for v in c[:length]] for c in curves], axis=0)
        seeds = f"{len(curves)} seed{'s' * (len(curves) > 1)}"
        reward.plot(np.arange(1, length + 1), mean, marker=".", label=f"{arm} ({seeds})")
    arms = list(summary["arms"])
    em.set(xticks=range(len(arms)), xticklabels=[f"{arm}\nbefore -> after" for arm in arms],
           ylabel=f"dev EM, greedy ({ENV}, 594 questions)", xlim=(-0.5, len(arms) - 0.5))
    reward.set(xlabel="iteration (4 prompts)", ylabel="training reward (sampled)")
    em.margins(y=0.3)  # room for the intervals written above the points
    for ax in (em, reward):
        ax.grid(alpha=0.3)
    reward.legend(fontsize="small")
    return fig


RUN_RECORDS = ("eval/eval.json", START_RECORD, METRICS_FILE, "config.yaml")  # a finished run's, in its folder


def record_files(output: Path) -> list[Path]:
    """What the records keep of ``output``, relative to it: each start's evaluation and each finished run's files
    (a run is finished once evaluated; an unfinished one is of no use without its checkpoints)."""
    kept = sorted(path.relative_to(output) for path in output.glob("start/*/eval/eval.json"))
    for end in sorted(output.glob("*_s*/eval/eval.json")):
        run = end.parents[1]
        kept += [(run / name).relative_to(output) for name in RUN_RECORDS if (run / name).is_file()]
    return kept


def save_records(output: Path, records: Path) -> None:
    """The starts' evaluations and the finished runs' records, into ``records``/records.tar.xz (one top-level folder
    named after ``output``; the same bytes for the same files), beside those kept before."""
    archive = read_archive(records / ARCHIVE)
    archive.update({f"{output.name}/{name.as_posix()}": (output / name).read_bytes() for name in record_files(output)})
    write_archive(records / ARCHIVE, archive)


def restore_records(output: Path, records: Path) -> int:
    """The kept records of ``output`` written back where this machine has not finished the same (a new machine goes
    on with the runs left; a run finished elsewhere is reported, never trained again, and replaces whatever part of it
    this machine began, whole); returns how many files were written."""
    kept = output_files(read_archive(records / ARCHIVE), output.name)
    missing = {name: data for name, data in kept.items()
               if not (output / name if name.parts[0] == "start" else output / name.parts[0] / "eval" / "eval.json")
               .exists()}
    for name, data in missing.items():
        (output / name).parent.mkdir(parents=True, exist_ok=True)
        (output / name).write_bytes(data)
    return len(missing)


def arm_settings(arm: str) -> dict[str, Any]:
    """The run.py settings ``ARMS[arm]`` sets (config.yaml's names and values); {} for an unknown arm."""
    options = ARMS.get(arm, ())
    return {flag[2:].replace("-", "_"): yaml_scalar(value) for flag, value in zip(options[::2], options[1::2],
                                                                                   strict=True)}


def record_problems(files: dict[Path, bytes], args: argparse.Namespace, copied: Sequence[str] = ()) -> list[str]:
    """What is wrong with one output's records (paths relative to it -> bytes) against the runs of ``args.arms`` x
    ``args.seeds`` and the ``copied`` run folders (``run_folder_problems``: each with ``RUN_RECORDS``), no start
    evaluated, or a run whose start's evaluation is not kept; one line each (none: complete)."""
    declared = {run_dir(Path(), arm, seed) for arm in args.arms for seed in args.seeds} | {Path(n) for n in copied}
    starts = {name.parts[1] for name in files if name.parts[0] == "start" and name.name == "eval.json"}
    problems = run_folder_problems(files, declared, RUN_RECORDS, others=("start",))
    if not starts:
        problems.append("no start's evaluation (start/DIGEST/eval/eval.json)")
    for run in sorted(declared):  # made as its arm says: its options in config.yaml, the command's iterations
        if run / "config.yaml" in files:
            saved = yaml.safe_load(files[run / "config.yaml"]) or {}
            problems += [f"run {run} was made with {name} {saved.get(name)!r}, not {value!r}"
                         for name, value in arm_settings(run.name.rsplit("_s", 1)[0]).items()
                         if saved.get(name) != value]
        if run / METRICS_FILE in files and run.name not in copied:
            rows = sum(1 for line in files[run / METRICS_FILE].decode("utf-8").splitlines() if line.strip())
            if rows != args.iterations:
                problems.append(f"run {run} trained {rows} iterations, not the command's {args.iterations}")
    return problems + [f"run {run} trained from a start whose evaluation is not kept" for run in sorted(declared)
                       if run / START_RECORD in files and json.loads(files[run / START_RECORD])["start"] not in starts]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arms", nargs="+", choices=list(ARMS), default=["tree"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--iterations", type=int, default=ITERATIONS)
    parser.add_argument("--output", type=Path, default=Path("outputs/hotpotqa_cpu"))
    parser.add_argument("--records", type=Path, default=None,
                        help="a study folder: its records.tar.xz is restored into --output first (runs finished on "
                             "another machine are not trained again), and each run is saved into it once evaluated")
    parser.add_argument("--report", action="store_true", help="summarise what has finished; train nothing")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    output = args.output.resolve()
    if args.records:
        print(f"records: {restore_records(output, args.records)} files restored from {args.records / ARCHIVE}")
    if not args.report:
        model = qa_warm_start(ENV)
        digest = weights_digest(model)
        evaluate(str(model), start_eval_dir(output, digest), CPU_OBSERVATION_OPTIONS)
        for seed in args.seeds:  # seed by seed, so that a short session ends with whole pairs of arms
            for arm in args.arms:
                run = train(output, arm, seed, args.iterations, digest)
                evaluate(str(run / "checkpoints" / "latest"), run / "eval")
                if args.records:  # each evaluated run at once: a machine lost mid-study loses only the run in progress
                    save_records(output, args.records)
    starts = {path.parents[1].name: question_rows(path) for path in sorted(output.glob("start/*/eval/eval.json"))}
    types = question_types(resolve_data_dir(None))
    summary = {"env": ENV, "iterations": args.iterations,
               "starts": {digest: {"questions": len(rows), "em": interval([r["em"] for r in rows]),
                                   "answered": interval([r["answered"] for r in rows])}
                          for digest, rows in starts.items()},
               "arms": {arm: s for arm in ARMS if (s := arm_summary(output, arm, args.seeds, types))},
               "contrasts": [c for first, second in CONTRASTS
                             if (c := arm_contrast(output, first, second, args.seeds))]}
    (output / "summary.json").write_text(json.dumps(summary, indent=1), encoding="utf-8")
    (output / "summary.md").write_text(markdown(summary), encoding="utf-8")
    print(markdown(summary))
    if args.records:
        save_records(output, args.records)
        (args.records / "summary.json").write_text(json.dumps(summary, indent=1), encoding="utf-8")
        if summary["arms"]:  # drawn in full beside the runs; the records keep a palette copy (a third of its size)
            figure(summary).savefig(output / PLOT, format="png", dpi=120)
            compact_plot_copy(output / PLOT, args.records / PLOT)
    return summary


if __name__ == "__main__":
    main()
