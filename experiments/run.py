"""Train a search agent with Tree-GRPO (or chain GRPO) on RLlib.

    python experiments/run.py --algo tree_grpo --env HotpotQA-v0                 # CPU defaults, smollm2-135m
    python experiments/run.py --algo grpo --group-size 4 --env HotpotQA-v0
    python experiments/run.py --model tiny-random --iterations 2 --output outputs/smoke
    python experiments/run.py --resume outputs/run/checkpoints/latest --iterations 10
    python experiments/run.py --config experiments/configs/hotpotqa_tree.yaml --iterations 5   # file + overrides

Writes OUTPUT/config.yaml (every option, reusable with --config), OUTPUT/metrics.jsonl (one JSON object per
iteration), checkpoints under OUTPUT/checkpoints/ (every --checkpoint-every iterations, at the end, and on
Ctrl-C), a few sampled trees every --trees-every iterations (OUTPUT/trees/iter_N.json and .html), and at the
end OUTPUT/learning_curve.png (and with --final-eval OUTPUT/eval/eval.md + eval.json). Everything is tracked in
MLflow: by default in sqlite:///OUTPUT/mlflow.db (open it with
`mlflow ui --backend-store-uri sqlite:///ABS/OUTPUT/mlflow.db --host 127.0.0.1`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import yaml

import envs
from algos.tree_grpo import ALGORITHMS
from algos.tree_grpo import metrics as M
from algos.tree_grpo.algorithm import DEV_PREFIX, ITERATION_TIME_S, PROMPTS
from envs.datasets import resolve_data_dir
from experiments.evaluate import write_results
from experiments.plot import load_metrics, plot_runs
from experiments.tracking import MLflowTracker, default_tracking_uri

# metrics.jsonl columns: (name, where in RLlib's result: env runner results, learner results or top level)
ENV_RUNNER_KEYS = (M.REWARD, M.EM, M.TREES, M.LEAVES, M.TOKENS_GENERATED, M.TOKENS_PREFILLED, M.LLM_CALLS,
                   M.TOOL_CALLS, M.SAMPLE_TIME_S, M.GENERATION_TIME_S, M.ENV_TIME_S, M.BUDGET_ESTIMATE,
                   M.BUDGET_MEASURED)
LEARNER_KEYS = (M.POLICY_LOSS, M.KL, M.ENTROPY, M.CLIP_FRACTION, M.DUAL_CLIP_FRACTION, M.RATIO_MEAN, M.RATIO_MAX,
                M.RATIO_MIN, M.GRAD_NORM, M.LEARNING_RATE, M.SAMPLER_LOGPROB_GAP, M.TRAINED_TOKENS)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None, help="a YAML file of options (keys as the option names); the "
                                                  "command line overrides it")
    p.add_argument("--algo", choices=list(ALGORITHMS), default="tree_grpo")
    p.add_argument("--env", choices=list(envs.ENV_IDS), default="HotpotQA-v0")
    p.add_argument("--split", default=None, help="training split (default: the env id's default)")
    p.add_argument("--model", default="smollm2-135m", help="tiny-random, smollm2-135m, a hub id or a directory")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--M", type=int, default=2, help="trees per prompt")
    p.add_argument("--N", type=int, default=2, help="nodes expanded per tree per round")
    p.add_argument("--L", type=int, default=1, help="expansion rounds")
    p.add_argument("--group-size", type=int, default=4, help="chains per prompt for --algo grpo")
    p.add_argument("--prompts-per-iter", type=int, default=None, help="default: 4 on CPU, 32 with a GPU")
    p.add_argument("--train-questions", type=int, default=None,
                   help="draw prompts from the first k training questions only (default: all)")
    p.add_argument("--iterations", type=int, default=20)
    p.add_argument("--max-turns", type=int, default=3)
    p.add_argument("--topk", type=int, default=3)
    p.add_argument("--max-step-tokens", type=int, default=None,
                   help="token cap of one step (default: 128 on CPU, where an untrained model rarely closes a tag "
                        "and every step runs to the cap; 500, the paper's, with a GPU)")
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--warmup-steps", type=int, default=0)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--output", default="outputs/run")
    p.add_argument("--data-dir", default=None, help="default: $TREEGRPO_DATA_DIR, else ./data")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-env-runners", type=int, default=0, help="remote Ray env runners (0: in this process)")
    p.add_argument("--num-learners", type=int, default=0, help="remote learners, DDP (0: in this process)")
    p.add_argument("--num-gpus-per-learner", type=float, default=0)
    p.add_argument("--num-cpus-per-learner", type=float, default=1)
    p.add_argument("--num-cpus-per-env-runner", type=float, default=1)
    p.add_argument("--checkpoint-every", type=int, default=10)
    p.add_argument("--eval-every", type=int, default=0, help="greedy evaluation every k iterations (0: never)")
    p.add_argument("--eval-questions", type=int, default=50, help="questions of the evaluation split")
    p.add_argument("--resume", default=None, help="a checkpoint directory to continue from")
    p.add_argument("--final-eval", action="store_true", help="greedy evaluation at the end: eval/eval.md + .json")
    p.add_argument("--eval-envs", nargs="+", default=None, choices=list(envs.ENV_IDS), metavar="ENV_ID",
                   help="envs of the final evaluation (default: the training env)")
    p.add_argument("--trees-every", type=int, default=10, help="write sampled trees every k iterations (0: never)")
    p.add_argument("--trees-count", type=int, default=4, help="trees written each time")
    p.add_argument("--mlflow-uri", default=None, help="MLflow tracking URI (default: sqlite:///OUTPUT/mlflow.db)")
    p.add_argument("--no-mlflow", action="store_true", help="no MLflow tracking")
    p.add_argument("--experiment", default="tree-grpo", help="MLflow experiment name")
    p.add_argument("--run-name", default=None, help="MLflow run name (default: the output directory's name)")
    p.add_argument("--quiet", action="store_true", help="no progress line per rollout step")
    return p


def read_config_file(path: str | Path, parser: argparse.ArgumentParser, _seen: tuple[Path, ...] = ()) -> dict:
    """The options of a YAML file, checked like command-line values: unknown keys, invalid choices and values
    of the wrong type are errors that name the key. ``base: OTHER.yaml`` (relative to the file) is read first
    and overridden by the file's own keys."""
    import yaml

    path = Path(path).resolve()
    if not path.is_file():
        parser.error(f"--config: no file {path} (expected a YAML mapping of option names to values)")
    if path in _seen:
        parser.error(f"--config {path}: 'base' files include each other in a cycle")
    values = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    if not isinstance(values, dict):
        parser.error(f"--config {path}: expected a YAML mapping of option names to values")
    base = values.pop("base", None)
    options = read_config_file(path.parent / base, parser, (*_seen, path)) if base else {}
    actions = {action.dest: action for action in parser._actions if action.dest not in ("help", "config")}
    for key, value in values.items():
        dest = str(key).replace("-", "_")
        if dest not in actions:
            parser.error(f"--config {path}: unknown option {key!r}; known: base, {', '.join(sorted(actions))}")
        options[dest] = _checked_value(parser, path, key, actions[dest], value)
    return options


def _checked_value(parser: argparse.ArgumentParser, path: Path, key: str, action: argparse.Action, value: Any):
    if value is not None and action.type is not None:
        try:
            value = [action.type(v) for v in value] if isinstance(value, list) else action.type(value)
        except (TypeError, ValueError):
            parser.error(f"--config {path}: {key} must be {action.type.__name__}, got {value!r}")
    values = value if isinstance(value, list) else [value]
    if action.choices is not None and value is not None and any(v not in action.choices for v in values):
        parser.error(f"--config {path}: {key} must be one of {list(action.choices)}, got {value!r}")
    return value


def parse_args(argv: list[str] | None = None, parser: argparse.ArgumentParser | None = None) -> argparse.Namespace:
    """The command line over the --config file over the defaults (of ``parser``, default ``build_parser()``)."""
    parser = parser or build_parser()
    known, _ = parser.parse_known_args(argv)
    if known.config:
        parser.set_defaults(**read_config_file(known.config, parser))
    return parser.parse_args(argv)


def default_prompts_per_iter() -> int:
    import torch

    return 32 if torch.cuda.is_available() else 4


def default_max_step_tokens() -> int:
    import torch

    return 500 if torch.cuda.is_available() else 128


def build_config(args: argparse.Namespace):
    """The algorithm config for the command-line settings."""
    config_cls = ALGORITHMS[args.algo][1]
    prompts = args.prompts_per_iter or default_prompts_per_iter()
    env_config: dict[str, Any] = {"data_dir": str(resolve_data_dir(args.data_dir).resolve()),
                                  "max_turns": args.max_turns, "topk": args.topk}
    if args.split:
        env_config["split"] = args.split
    shape = {"group_size": args.group_size} if args.algo == "grpo" else {"M": args.M, "N": args.N, "L": args.L}
    return (
        config_cls()
        .environment(args.env, env_config=env_config)
        .training(**shape, prompts_per_iteration=prompts, train_questions=args.train_questions,
                  max_step_tokens=args.max_step_tokens or default_max_step_tokens(),
                  lr=args.lr, warmup_steps=args.warmup_steps, micro_batch_size=args.micro_batch_size,
                  log_rollout_steps=not args.quiet, trees_every=args.trees_every, trees_count=args.trees_count,
                  trees_dir=str((Path(args.output) / "trees").resolve()), dev_eval_every=args.eval_every,
                  dev_eval_questions=args.eval_questions)
        .rl_module(model_config={"model": args.model, "dtype": args.dtype, "seed": args.seed})
        .env_runners(num_env_runners=args.num_env_runners, create_local_env_runner=args.num_env_runners == 0,
                     num_cpus_per_env_runner=args.num_cpus_per_env_runner)
        .learners(num_learners=args.num_learners, num_gpus_per_learner=args.num_gpus_per_learner,
                  num_cpus_per_learner=args.num_cpus_per_learner)
        .debugging(seed=args.seed)
    )


def check_resources(args: argparse.Namespace, available: dict[str, float]) -> None:
    """Fail fast, naming the options, when the actors cannot all be placed (Ray would wait forever)."""
    gpus = args.num_learners * args.num_gpus_per_learner
    cpus = args.num_env_runners * args.num_cpus_per_env_runner
    cpus += args.num_learners * (args.num_cpus_per_learner if not args.num_gpus_per_learner else 0)
    if cpus > available.get("CPU", 0) or gpus > available.get("GPU", 0):
        raise SystemExit(
            f"the requested actors need {cpus:g} CPUs and {gpus:g} GPUs but Ray has {available.get('CPU', 0):g} "
            f"CPUs and {available.get('GPU', 0):g} GPUs: lower --num-env-runners / --num-learners, or "
            f"--num-cpus-per-env-runner / --num-cpus-per-learner (fractions are fine, e.g. 0.5)"
        )


def metrics_row(iteration: int, result: dict) -> dict[str, Any]:
    """One metrics.jsonl line from RLlib's result dict."""
    runners = result.get("env_runners", {})
    learner = result.get("learners", {}).get("default_policy", {})
    row: dict[str, Any] = {"iteration": iteration, "prompts": result.get(PROMPTS),
                           "time_s": result.get(ITERATION_TIME_S)}
    row.update({key: runners.get(key) for key in ENV_RUNNER_KEYS})
    row.update({key: learner.get(key) for key in LEARNER_KEYS})
    # evaluation keys only on the iterations that evaluated (RLlib reports NaN for the others)
    row.update({key: value for key, value in result.items() if key.startswith(DEV_PREFIX) and value == value})
    return {k: (float(v) if hasattr(v, "__float__") and not isinstance(v, int) else v) for k, v in row.items()}


def progress_line(row: dict[str, Any], total: int) -> str:
    def f(key: str, fmt: str) -> str:
        value = row.get(key)
        return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, fmt)

    return (f"iter {row['iteration']:>4}/{total}  reward {f(M.REWARD, '.3f')}  EM {f(M.EM, '.3f')}  "
            f"leaves {f(M.LEAVES, 'd')}  tokens {f(M.TOKENS_GENERATED, 'd')}  tool calls {f(M.TOOL_CALLS, 'd')}  "
            f"KL {f(M.KL, '.4f')}  {f('time_s', '.1f')} s"
            + (f"  dev EM {row['dev_em']:.3f}" if "dev_em" in row else ""))


def start_tracking(args: argparse.Namespace, output: Path) -> MLflowTracker:
    """The run's MLflow run (continued when resuming in the same output directory), or a disabled tracker."""
    if args.no_mlflow:
        return MLflowTracker(None, experiment=args.experiment)
    run_id_file = output / "mlflow_run_id"
    run_id = run_id_file.read_text().strip() if args.resume and run_id_file.exists() else None
    tracker = MLflowTracker(args.mlflow_uri or default_tracking_uri(output), experiment=args.experiment,
                            run_name=args.run_name or output.resolve().name, run_id=run_id,
                            tags={"algo": args.algo, "env": args.env, "model": args.model})
    if tracker.enabled:
        run_id_file.write_text(tracker.run_id)
    return tracker


def final_evaluation(algo, args: argparse.Namespace, output: Path) -> list[Path]:
    """Greedy evaluation of the trained policy on --eval-envs: eval/eval.md and eval/eval.json."""
    results = {env_id: algo.greedy_eval(envs.eval_split(env_id), args.eval_questions, env_id=env_id)
               for env_id in args.eval_envs or [args.env]}
    details = {"model": f"{args.algo} on {args.env} ({args.model}), iteration {algo.iteration}",
               "questions per env": args.eval_questions}
    return list(write_results(output / "eval", results, details))


def save_learning_curve(output: Path) -> Path | None:
    rows = load_metrics(output / "metrics.jsonl")
    if not rows:
        return None
    metrics = [m for m in (M.REWARD, M.EM, "dev_em") if any(row.get(m) is not None for row in rows)]
    return plot_runs({output.resolve().name: rows}, output / "learning_curve.png", metrics=metrics)


def main(argv: list[str] | None = None) -> Path:
    args = parse_args(argv)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray

    output = Path(args.output)
    (output / "checkpoints").mkdir(parents=True, exist_ok=True)
    config_file = output / "config.yaml"
    config_file.write_text(yaml.safe_dump({k: v for k, v in vars(args).items() if k != "config"}, sort_keys=False),
                           encoding="utf-8")
    if not ray.is_initialized():
        ray.init(num_cpus=os.cpu_count(), object_store_memory=1_000_000_000, include_dashboard=False,
                 log_to_driver=not args.quiet)  # remote runners' progress lines reach this console
    check_resources(args, ray.cluster_resources())
    algo = ALGORITHMS[args.algo][0].from_checkpoint(args.resume) if args.resume else build_config(args).build_algo()
    tracker = start_tracking(args, output)
    tracker.log_params({**{k: v for k, v in vars(args).items() if k != "config"},
                        "algorithm": algo.config.tracked_params()})
    tracker.log_artifact(config_file)
    start_iteration = algo.iteration
    latest = output / "checkpoints" / "latest"
    status = "FINISHED"
    try:
        with (output / "metrics.jsonl").open("a", encoding="utf-8") as log:
            for _ in range(args.iterations):
                start = time.perf_counter()
                result = algo.train()
                row = metrics_row(algo.iteration, result)
                row["time_s"] = row["time_s"] or time.perf_counter() - start
                log.write(json.dumps(row) + "\n")
                log.flush()
                tracker.log_metrics(row, step=algo.iteration)
                for path in algo.tree_files:
                    tracker.log_artifact(path, "trees")
                print(progress_line(row, start_iteration + args.iterations), flush=True)
                if args.checkpoint_every and algo.iteration % args.checkpoint_every == 0:
                    algo.save_to_path(str(latest.resolve()))
        if args.final_eval:
            for path in final_evaluation(algo, args, output):
                tracker.log_artifact(path, "eval")
    except KeyboardInterrupt:
        status = "KILLED"
        print("interrupted: saving a checkpoint before stopping", file=sys.stderr)
    except BaseException:
        status = "FAILED"
        raise
    finally:
        algo.save_to_path(str(latest.resolve()))
        algo.stop()
        tracker.log_artifact(output / "metrics.jsonl")
        curve = save_learning_curve(output)
        if curve is not None:
            tracker.log_artifact(curve)
        tracker.end(status)
    print(f"metrics: {output / 'metrics.jsonl'}; checkpoint: {latest}"
          + (f"; MLflow: {tracker.tracking_uri} (run {tracker.run_id})" if tracker.enabled else ""))
    return latest


if __name__ == "__main__":
    main()
