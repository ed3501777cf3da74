"""Train a search agent with Tree-GRPO (or chain GRPO) on RLlib.

    python experiments/run.py --algo tree_grpo --env HotpotQA-v0                 # on a CPU: its warm start (built once)
    python experiments/run.py --algo grpo --group-size 4 --env HotpotQA-v0
    python experiments/run.py --model tiny-random --iterations 2 --output outputs/smoke
    python experiments/run.py --resume outputs/smoke --iterations 10                 # continue a run
    python experiments/run.py --config experiments/configs/hotpotqa_tree.yaml --iterations 5   # file + overrides

Every option is a field of ``experiments.settings.RunSettings`` (``--help`` lists them); a ``--config`` YAML
file takes the same names. Everything is checked before Ray starts.

The run's directory (``--output``) gets ``config.yaml`` (every setting the run started with; ``--config`` reads it
back; a resume records its own beside it, ``resumes/iter_NNNNNN.yaml`` from the first iteration it ran),
``metrics.jsonl`` (one JSON object per iteration), ``checkpoints/iter_NNNNNN`` (every ``--checkpoint-every``
iterations, at the end and on SIGINT / SIGTERM; the last ``--keep-checkpoints`` kept, ``checkpoints/latest``
points at the newest), ``trees/`` (sampled trees every ``--trees-every`` iterations), ``learning_curve.png``,
with ``--final-eval`` ``eval/eval.md`` + ``eval.json``, from a warm start ``warm_start.txt`` (the cached start's key:
a resume from another start is refused; ``--model`` with the first start's cached directory continues from it),
and the MLflow store ``mlflow.db`` (open it with ``mlflow ui --backend-store-uri sqlite:///ABS/OUTPUT/mlflow.db
--host 127.0.0.1``).

Lifecycle: a directory that already holds a run is refused unless ``--resume`` continues it (``--resume`` takes
the run's directory or one of its checkpoints, and continues in the run's own directory). Options that would
change the experiment (shape, lr, model, env, seed, ...) are refused on resume unless ``--allow-changes``;
options that may change (iterations, evaluation and checkpoint cadence, tracking) are applied and recorded.
SIGINT (Ctrl-C) and SIGTERM save a checkpoint once and exit with 130 / 143; a second signal does not interrupt
the save. Checkpoints are pickles: load only your own (``experiments/export.py`` writes safetensors).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import math
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import envs
from algos.tree_grpo import metrics as metric_keys
from envs.cache import WARM_STARTS_DIR
from envs.datasets import MissingDataError
from experiments.checkpoints import (
    CONFIG_FILE,
    RESUMES_DIR,
    CheckpointError,
    CheckpointManager,
    checkpoint_iteration,
    checkpoint_name,
    resolve_checkpoint,
    restore_errors,
    settings_file_at,
)
from experiments.cli import (
    SettingsError,
    build_parser,
    check_output_directory,
    dump_yaml,
    given_options,
    read_yaml,
    validate,
)
from experiments.evaluate import write_results
from experiments.plot import load_metrics, plot_runs
from experiments.preflight import check_before_ray, check_resources, node_resources, prepare_start, start_ray
from experiments.qa_start import WARM_START_MODEL
from experiments.settings import (
    CLI_ALIASES,
    RunSettings,
    build_config,
    check_chain_shape,
    cpu_qa_help,
    help_sections,
    model_config,
    resume_conflicts,
    tracked_params,
)
from experiments.signals import GracefulStop, StopRequested
from experiments.tracking import METRICS_FILE, RunTracker, default_tracking_uri, tracker_of, truncate_rows

RUN_FILES = (METRICS_FILE, "checkpoints")  # any of them: the directory holds a run
WARM_START_FILE = "warm_start.txt"  # with --model warm-start: the cached start the run began from (its key)


@dataclass
class RunPlan:
    """What ``main`` will do, decided and checked before anything starts."""

    settings: RunSettings
    checkpoint: Path | None = None  # resume from it
    changes: dict[str, tuple[Any, Any]] = field(default_factory=dict)  # options changed on resume
    command: str = ""  # the invocation, as typed (recorded beside config.yaml on resume)


def run_parser() -> argparse.ArgumentParser:
    parser = build_parser(RunSettings, description=__doc__, aliases=CLI_ALIASES, sections=help_sections(),
                          also=cpu_qa_help())
    parser.add_argument("--resume", metavar="RUN_OR_CHECKPOINT", default=None,
                        help="continue a run: its directory (from its newest checkpoint) or a checkpoint of it")
    parser.add_argument("--allow-changes", action="store_true", default=False,
                        help="with --resume: allow options that change the experiment (listed when refused)")
    return parser


def run_directory(checkpoint: Path) -> Path:
    """The run directory holding ``checkpoint`` (the nearest parent with a config.yaml)."""
    for parent in checkpoint.resolve().parents:
        if (parent / CONFIG_FILE).is_file():
            return parent
    raise CheckpointError(f"--resume {checkpoint}: no {CONFIG_FILE} in any parent directory, so this is not a "
                          f"checkpoint of a run written by experiments/run.py")


def plan(argv: list[str] | None = None) -> RunPlan:
    """Parse and check everything (no Ray, no model): a ``SettingsError`` / ``CheckpointError`` names the problem."""
    namespace = run_parser().parse_args(argv)
    given, sources = given_options(RunSettings, namespace)
    if not namespace.resume:
        if namespace.allow_changes:
            raise SettingsError("--allow-changes only applies with --resume")
        settings = validate(RunSettings, given, sources)
        check_chain_shape(settings, vars(namespace))
        check_output_directory(settings.output)
        existing = [name for name in RUN_FILES if (Path(settings.output) / name).exists()]
        if existing:
            raise SettingsError(f"--output {settings.output} already holds a run ({', '.join(existing)}): continue "
                                f"it with --resume {settings.output}, or choose another --output")
        return RunPlan(settings)
    checkpoint = resolve_checkpoint(namespace.resume)
    run_dir = run_directory(checkpoint)
    saved, saved_sources = read_yaml(settings_file_at(run_dir, checkpoint_iteration(checkpoint)), RunSettings)
    if "output" in given and Path(given["output"]).resolve() != run_dir.resolve():
        raise SettingsError(f"--resume continues the run in its own directory {run_dir}; drop --output "
                            f"{given['output']} (or copy the run there first)")
    given["output"] = saved["output"] = str(run_dir)
    began = start_began(run_dir)
    conflicts = resume_conflicts(saved, given)
    if began and saved.get("model") == WARM_START_MODEL and began == cached_start_key(given.get("model")):
        del conflicts["model"]  # the start the run began from, by its own directory: the same weights
    if conflicts and not namespace.allow_changes:
        listed = "; ".join(f"{name}: {old!r} -> {new!r}" for name, (old, new) in conflicts.items())
        raise SettingsError(f"--resume {namespace.resume}: these options would change the experiment: {listed}. "
                            f"Drop them, or pass --allow-changes to continue with the new values")
    settings = validate(RunSettings, {**saved, **given}, {**saved_sources, **sources})
    check_chain_shape(settings, vars(namespace))
    changes = {name: (saved.get(name), value) for name, value in given.items() if saved.get(name) != value}
    try:
        now = start_dir(settings)
    except MissingDataError as error:  # the start is found by its data, which no longer resolves
        raise SettingsError(f"--resume {namespace.resume}: the run trains from {settings.env}'s warm start "
                            f"(--model {WARM_START_MODEL}), found by the data it was built from: {error} "
                            f"(--data-dir may change on resume)") from None
    if began and now and began != now.parent.name:
        if not namespace.allow_changes:
            first = now.parent.parent / began / "model"  # where that start was cached, beside the new one
            cached = (first / "config.json").is_file()
            advice = (f"pass --model {first} (still cached) to continue from it, or" if cached
                      else f"it is no longer cached (no {first}): pass")
            raise SettingsError(f"--resume {namespace.resume}: the run began from the warm start {began}, and "
                                f"--model {WARM_START_MODEL} is now {now.parent.name} (the oracle's text, its recipe "
                                f"or the data changed): {advice} --allow-changes to continue from the new one")
        changes["warm start"] = (began, now.parent.name)
    return RunPlan(settings, checkpoint, changes, shlex.join(["experiments/run.py", *(argv or sys.argv[1:])]))


def start_dir(settings: RunSettings) -> Path | None:
    """The model directory of the warm start ``--model warm-start`` stands for (built or not; its parent's name is
    its cache key), else None."""
    if settings.model != WARM_START_MODEL:
        return None
    return Path(model_config(settings)["model"])


def start_key(settings: RunSettings) -> str | None:
    """The cache key of the warm start ``--model warm-start`` stands for (its directory's name), else None."""
    directory = start_dir(settings)
    return None if directory is None else directory.parent.name


def cached_start_key(model: Any) -> str | None:
    """The cache key of the warm start whose cached model directory (``CACHE/warm_starts/KEY/model``) ``model``
    names, else None."""
    if not isinstance(model, str):
        return None
    path = Path(model).expanduser().resolve()
    return path.parent.name if path.name == "model" and path.parent.parent.name == WARM_STARTS_DIR else None


def start_began(run_dir: Path) -> str | None:
    """The key of the warm start the run in ``run_dir`` began from, where it recorded one."""
    record = run_dir / WARM_START_FILE
    return record.read_text(encoding="utf-8").strip() if record.is_file() else None


def record_start(settings: RunSettings, output: Path) -> None:
    """Record the warm start the run trains from (``WARM_START_FILE``): its key changes with the oracle's text, the
    recipe and the data, and a resume from another start would change the reference policy (and, with LoRA, the
    base weights) mid-run, so ``plan`` refuses one."""
    key = start_key(settings)
    if key is not None:
        (output / WARM_START_FILE).write_text(key + "\n", encoding="utf-8")


def record_settings(run: RunPlan, first_iteration: int) -> Path:
    """The settings file of this invocation: a new run's config.yaml (``--config`` it to repeat the run), or,
    when resuming, ``resumes/iter_NNNNNN.yaml`` beside it (config.yaml keeps the run's own settings), headed by
    the command, the checkpoint and the changed options."""
    output = Path(run.settings.output).resolve()
    if run.checkpoint is None:
        path, header = output / CONFIG_FILE, "# experiments/run.py --config this file reproduces the run\n"
    else:
        path = output / RESUMES_DIR / f"{checkpoint_name(first_iteration)}.yaml"
        changed = "; ".join(f"{name}: {old!r} -> {new!r}" for name, (old, new) in run.changes.items()) or "nothing"
        header = (f"# the run's settings from iteration {first_iteration} on, as resumed from {run.checkpoint} by\n"
                  f"#   {run.command}\n# changed: {changed}\n# ({CONFIG_FILE} keeps the settings the run started "
                  f"with)\n")
        path.parent.mkdir(exist_ok=True)
    dump_yaml(run.settings, path, header)
    return path


def progress_line(row: dict[str, Any], total: int) -> str:
    """One console line per iteration (counts are ints whatever the number of runners)."""

    def f(key: str, fmt: str) -> str:
        value = row.get(key)
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return "-"
        return format(round(value) if fmt == "d" else value, fmt)

    return (f"iter {row['iteration']:>4}/{total}  reward {f(metric_keys.REWARD, '.3f')}  "
            f"EM {f(metric_keys.EM, '.3f')}  leaves {f(metric_keys.LEAVES, 'd')}  "
            f"tokens {f(metric_keys.TOKENS_GENERATED, 'd')}  tool calls {f(metric_keys.TOOL_CALLS, 'd')}  "
            f"KL {f(metric_keys.KL, '.4f')}  {f('time_s', '.1f')} s"
            + (f"  dev EM {f('dev_em', '.3f')}" if "dev_em" in row else "")
            + (f"  runner restarts {f(metric_keys.ENV_RUNNER_RESTARTS, 'd')}"
               if row.get(metric_keys.ENV_RUNNER_RESTARTS) else "")
            + ("  update skipped (every prompt's leaves rewarded alike)"
               if row.get(metric_keys.UPDATE_SKIPPED) else ""))


def remove_empty_logdir(logdir: Path) -> None:
    """Remove the log folder an RLlib Algorithm built outside Tune makes (``~/ray_results/<date>``) when it is
    empty: this run logs into its own directory, so every run would otherwise leave one behind."""
    with contextlib.suppress(OSError):  # not empty (something wrote there) or already gone: left as it is
        logdir.rmdir()


def build_algorithm(run: RunPlan):
    """The algorithm of ``run``, with its tracker, restored from the checkpoint when resuming."""
    settings = run.settings
    output = Path(settings.output).resolve()
    mlflow_uri = (settings.mlflow_uri or default_tracking_uri(output)) if settings.mlflow else None
    tracker = functools.partial(
        RunTracker, output=output, mlflow_uri=mlflow_uri, experiment=settings.experiment,
        run_name=settings.run_name, tags={"model": settings.model}, resume=run.checkpoint is not None,
        params=tracked_params(settings))
    algo = build_config(settings).callbacks(tracker).build_algo()
    if run.checkpoint is not None:
        with restore_errors(run.checkpoint):
            algo.restore_from_path(str(run.checkpoint))
        dropped = truncate_rows(output / METRICS_FILE, algo.iteration)
        if dropped:
            print(f"resume: dropped {dropped} metrics row(s) written after the checkpoint (iteration "
                  f"{algo.iteration})", file=sys.stderr)
        tracker_of(algo).log_params(algo)  # now that the iteration a changed value applies from is known
    return algo


def final_evaluation(algo, settings: RunSettings, output: Path) -> list[Path]:
    """Greedy evaluation of the trained policy on the evaluation envs: eval/eval.md and eval/eval.json."""
    env_ids = settings.eval_envs or [settings.env]
    results = {env_id: algo.greedy_eval(envs.eval_split(env_id), settings.eval_questions, env_id=env_id)
               for env_id in env_ids}
    details = {"model": f"{settings.algo} on {settings.env} ({settings.model}), iteration {algo.iteration}",
               "questions per env": settings.eval_questions}
    if settings.contaminated:
        details["warning"] = f"trained on {settings.env}'s evaluation split ({settings.training_split})"
    return list(write_results(output / "eval", results, details))


def save_learning_curve(output: Path) -> Path | None:
    if not (output / METRICS_FILE).exists() or not (rows := load_metrics(output / METRICS_FILE)):
        return None
    metrics = [m for m in (metric_keys.REWARD, metric_keys.EM, "dev_em") if any(row.get(m) is not None for row in rows)]
    return plot_runs({output.resolve().name: rows}, output / "learning_curve.png", metrics=metrics)


def budget_spent(algo, token_budget: int | None) -> bool:
    """Whether the run has generated ``token_budget`` tokens (never, without a budget). Checked between
    iterations, so the iteration that reaches the budget is never cut short."""
    return token_budget is not None and algo.tokens_generated_total >= token_budget


def saturated(algo, stop_after_uniform: int | None) -> bool:
    """Whether the last ``stop_after_uniform`` iterations each rewarded every prompt's leaves alike (never, without
    the option). Checked between iterations, as the token budget is."""
    return stop_after_uniform is not None and algo.uniform_streak >= stop_after_uniform


def train(run: RunPlan) -> tuple[Path | None, int]:
    """Run the plan; (the newest checkpoint, the exit status: 0, or 130 / 143 after SIGINT / SIGTERM)."""
    import ray

    settings = run.settings
    output = Path(settings.output).resolve()
    check_before_ray(settings)
    if settings.contaminated:
        print(f"warning: training on {settings.env}'s evaluation split ({settings.training_split}); its "
              f"evaluations score questions the policy trained on", file=sys.stderr)
    start_ray(settings)
    check_resources(settings, ray.cluster_resources(), node_resources())  # again: a joined cluster has its own
    prepare_start(settings)  # last: minutes the first time, spent only on a run that every check let start
    output.mkdir(parents=True, exist_ok=True)
    record_start(settings, output)
    algo = build_algorithm(run)
    settings_file = record_settings(run, algo.iteration + 1)
    tracker = tracker_of(algo)
    for name, (old, new) in run.changes.items():
        print(f"resume: {name} {old!r} -> {new!r}", file=sys.stderr)
    tracker.mlflow.log_artifact(settings_file, RESUMES_DIR if run.checkpoint else None)
    checkpoints = CheckpointManager(output / "checkpoints", keep=settings.keep_checkpoints)
    latest, saved_at, status = None, None, "FINISHED"
    end = algo.iteration + settings.iterations
    with GracefulStop(can_interrupt=lambda: not algo.mid_update) as stop:
        try:
            while (algo.iteration < end and not budget_spent(algo, settings.token_budget)
                   and not saturated(algo, settings.stop_after_uniform)):
                algo.train()
                print(progress_line(tracker.last_row, end), flush=True)
                if settings.checkpoint_every and algo.iteration % settings.checkpoint_every == 0:
                    latest, saved_at = checkpoints.save(algo, algo.iteration), algo.iteration
                stop.check()
            if budget_spent(algo, settings.token_budget):
                print(f"token budget reached: {algo.tokens_generated_total:,} tokens generated (--token-budget "
                      f"{settings.token_budget:,})", file=sys.stderr)
            if saturated(algo, settings.stop_after_uniform):
                print(f"stopping: every prompt's leaves were rewarded alike in the last {algo.uniform_streak} "
                      f"iterations (--stop-after-uniform {settings.stop_after_uniform}): nothing left to learn from "
                      f"the prompts drawn", file=sys.stderr)
            if settings.final_eval:
                for path in final_evaluation(algo, settings, output):
                    tracker.mlflow.log_artifact(path, "eval")
        except StopRequested:
            status = "KILLED"
            print("stopping: saving a checkpoint (a second signal does not interrupt it)", file=sys.stderr)
        except BaseException:
            status = "FAILED"
            raise
        finally:
            if algo.iteration and not algo.mid_update and saved_at != algo.iteration:  # never a half-done update
                latest = checkpoints.save(algo, algo.iteration)
            algo.stop()
            remove_empty_logdir(Path(algo.logdir))
            tracker.mlflow.log_artifact(output / METRICS_FILE)
            curve = save_learning_curve(output)
            if curve is not None:
                tracker.mlflow.log_artifact(curve)
            tracker.mlflow.end(status)
    mlflow = tracker.mlflow
    print(f"metrics: {output / METRICS_FILE}; checkpoint: {latest}"
          + (f"; MLflow: {mlflow.tracking_uri} (run {mlflow.run_id})" if mlflow.enabled else ""))
    return latest, stop.exit_code if stop.requested else 0


def main(argv: list[str] | None = None) -> Path | None:
    """The command line's entry point; returns the newest checkpoint (exits non-zero on a signal)."""
    try:
        run = plan(argv)
        latest, status = train(run)
    except (SettingsError, CheckpointError) as error:
        run_parser().exit(2, f"run.py: error: {error}\n")
    if status:
        sys.exit(status)
    return latest


if __name__ == "__main__":
    main()
