"""Evaluate a policy as the paper does: greedy decoding, one chain per question, exact match.

    python experiments/evaluate.py --model smollm2-135m --envs HotpotQA-v0 NQ-v0 --limit 100
    python experiments/evaluate.py --model outputs/run/checkpoints/latest --output outputs/run/eval-latest
    python experiments/evaluate.py --model Qwen/Qwen2.5-3B-Instruct            # all seven envs, full splits

``--model`` takes what ``run.py --model`` takes (a name, or a model directory such as one written by
``experiments/export.py``; a warm start by its directory, which ``experiments/qa_start.py`` prints), or a training
checkpoint (``OUTPUT/checkpoints/latest``, or the run directory ``OUTPUT`` for its newest checkpoint), evaluated with
its run's observations and retriever.
Writes OUTPUT/eval.md (a table shaped like the paper's: single-hop sets, their average, multi-hop sets,
their average; rows EM, F1, tool calls, turns, answer rate) and OUTPUT/eval.json (the same numbers plus every
question's result); an OUTPUT that holds them already is refused unless ``--overwrite`` (a run's OUTPUT/eval holds
its final evaluation). Every env's question file and corpus is found before the model loads. The questions of a
batch advance together through the generator.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import envs
from algos.evaluation import EVAL_COLUMNS, QUERIES, greedy_chains, mean_results, route_taken
from envs.datasets import DataError, MissingDataError, UnknownSplitError, resolve_data_dir
from envs.retrieval import check_retriever_spec
from experiments.checkpoints import (
    CONFIG_FILE,
    RLLIB_MARKER,
    CheckpointError,
    checkpoint_iteration,
    is_sharded,
    names_a_run,
    resolve_checkpoint,
    restore_errors,
    settings_file_at,
    sharded_policy,
    verify_checkpoint,
)
from experiments.cli import SettingsError, check_output_directory, default_of
from policies.generation import GENERATORS
from policies.vllm_generation import vllm_installed

# The paper's column groups (Tree-GRPO, Table 1): single-hop then multi-hop, each with its unweighted average.
SINGLE_HOP = ("NQ-v0", "TriviaQA-v0", "PopQA-v0")
MULTI_HOP = ("HotpotQA-v0", "2WikiMultihopQA-v0", "Musique-v0", "Bamboogle-v0")
# evaluate.py's options that a training run fixes (``trained_with``); where none does, ``untrained_defaults``
RUN_OPTIONS = ("max_turns", "topk", "passage_words", "max_step_tokens", "retriever")
COUNTS = ("limit", "batch_size", "max_turns", "topk", "passage_words", "max_step_tokens")  # each at least 1
ROW_NAMES = {"em": "EM", "f1": "F1", "tool_calls": "tool calls", "turns": "turns", "answered": "answer rate",
             "questions": "questions"}


def group_averages(results: Mapping[str, Mapping[str, float]]) -> dict[str, dict[str, float]]:
    """The unweighted mean over the evaluated datasets of each group (``single-hop``, ``multi-hop``), for every
    column; a group with no evaluated dataset is left out."""
    averages = {}
    for group, members in (("single-hop", SINGLE_HOP), ("multi-hop", MULTI_HOP)):
        present = [results[env_id] for env_id in members if env_id in results]
        if present:
            averages[group] = {key: sum(r[key] for r in present) / len(present) for key in EVAL_COLUMNS}
            averages[group]["questions"] = sum(r.get("questions", 0) for r in present)
    return averages


def results_table(results: Mapping[str, Mapping[str, float]]) -> str:
    """A markdown table: datasets as columns in the paper's order (other env ids after), each group followed by
    its average; one row per metric. EM and F1 are shown in percent as in the paper."""
    averages = group_averages(results)
    columns: list[tuple[str, Mapping[str, float]]] = []
    for group, members in (("single-hop", SINGLE_HOP), ("multi-hop", MULTI_HOP)):
        columns += [(env_id.removesuffix("-v0"), results[env_id]) for env_id in members if env_id in results]
        if group in averages:
            columns.append((f"{group} avg", averages[group]))
    columns += [(env_id, r) for env_id, r in results.items() if env_id not in SINGLE_HOP + MULTI_HOP]
    lines = ["| | " + " | ".join(name for name, _ in columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for key, label in ROW_NAMES.items():
        scale, fmt = (100.0, ".1f") if key in ("em", "f1") else (1.0, ".0f") if key == "questions" else (1.0, ".2f")
        cells = [_cell(r.get(key), scale, fmt) for _, r in columns]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _cell(value: float | None, scale: float, fmt: str) -> str:
    return "-" if value is None or math.isnan(value) else format(value * scale, fmt)


RESULT_FILES = ("eval.md", "eval.json")  # what ``write_results`` writes


def write_results(output: str | Path, results: Mapping[str, Mapping[str, float]], details: Mapping[str, Any],
                  per_question: Mapping[str, Sequence[Mapping[str, float]]] | None = None) -> tuple[Path, Path]:
    """``OUTPUT/eval.md`` and ``OUTPUT/eval.json``; ``details`` (model, split, limit...) go into both."""
    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    header = ", ".join(f"{k}: {v}" for k, v in details.items())
    markdown = output / RESULT_FILES[0]
    markdown.write_text(f"Greedy evaluation ({header})\n\n{results_table(results)}", encoding="utf-8")
    payload = {**details, "datasets": results, "averages": group_averages(results)}
    if per_question is not None:
        payload["questions"] = per_question
    data = output / RESULT_FILES[1]
    data.write_text(json.dumps(payload, indent=1), encoding="utf-8")
    return markdown, data


def load_policy(model: str, dtype: str | None = None):
    """(model, tokenizer) of a model name, a model directory, or a training checkpoint directory, with its weights in
    ``dtype`` (None: float32, and a checkpoint's as its learner held them)."""
    from policies.models import load_model

    checkpoint = Path(model).resolve()  # RLlib reads checkpoints by URI: a relative path has no scheme
    if not (checkpoint / RLLIB_MARKER).exists():
        return load_model(model, dtype=dtype or "float32")
    from ray.rllib.core.rl_module.rl_module import RLModule

    verify_checkpoint(checkpoint, hashes=False)  # names a missing or truncated file; hashing is resume's job
    if is_sharded(checkpoint):  # sharded learners' checkpoint: every learner's shards gathered here
        module = sharded_policy(checkpoint)
    else:
        module_dir = checkpoint / "learner_group" / "learner" / "rl_module" / "default_policy"
        if not module_dir.is_dir():
            raise CheckpointError(f"{checkpoint} is an RLlib checkpoint without a policy module at {module_dir} "
                                  f"(expected a Tree-GRPO training checkpoint, e.g. OUTPUT/checkpoints/latest)")
        with restore_errors(checkpoint):
            module = RLModule.from_checkpoint(str(module_dir))
    if dtype is not None:
        import torch

        module.model.to(getattr(torch, dtype))
    return module.model, module.tokenizer


def evaluate_env(env_id: str, generator, tokenizer, *, split: str, limit: int | None, batch_size: int,
                 env_kwargs: Mapping[str, Any], progress=None) -> list[dict[str, Any]]:
    """Per-question results of greedy chains over the first ``limit`` questions of ``env_id``'s ``split``."""
    import gymnasium as gym

    env = gym.make(env_id, split=split, **env_kwargs)
    count = len(env.unwrapped.records) if limit is None else min(limit, len(env.unwrapped.records))
    if progress is not None:
        progress.reset(total=count)
    rows = chains_in_batches(env, generator, tokenizer, list(range(count)), batch_size, progress)
    env.close()
    return rows


def chains_in_batches(env, generator, tokenizer, indices: Sequence[int], batch_size: int,
                      progress=None) -> list[dict[str, Any]]:
    """``greedy_chains`` over the questions at positions ``indices`` of ``env``, ``batch_size`` at a time."""
    rows: list[dict[str, Any]] = []
    for start in range(0, len(indices), batch_size):
        batch = list(indices[start:start + batch_size])
        rows += greedy_chains(env, generator, tokenizer, batch)
        if progress is not None:
            progress.update(len(batch))
    return rows


def world_held_out(policy: str | Path, data_dir: Path, questions: int, max_step_tokens: int, topk: int,
                   env_id: str = "SynthHop-v0", greedy: bool = True,
                   max_turns: int | None = None) -> list[dict[str, Any]]:
    """Per-question results of ``policy``'s greedy chains (a ``--model`` name, model directory or checkpoint) on the
    first ``questions`` held-out questions of the generated world in ``data_dir`` served by ``env_id`` (SynthHop-v0 or
    SynthBranch-v0; ``topk`` passages per search), each with its hop count (``hops``) and, on SynthBranch, the
    route its chain took at the decision (``route``: ``algos.evaluation.route_taken`` of its queries against the
    question's route and its decoy's). Without ``greedy``, each chain is sampled as rollouts sample (the paper's
    temperature and top-p; the rollout's fixed seed, so the same policy gives the same rows). ``max_turns``: the
    search steps allowed (default: the env's)."""
    from envs.synthetic import branch_questions
    from policies.generation import SamplingSettings
    from policies.generators import step_generator

    model, tokenizer = load_policy(str(policy))
    generator = step_generator("hf", model, tokenizer, SamplingSettings(greedy=greedy, max_step_tokens=max_step_tokens))
    split, dataset = envs.eval_split(env_id), envs.ENV_IDS[env_id][0]
    rows = evaluate_env(env_id, generator, tokenizer, split=split, limit=questions, batch_size=32,
                        env_kwargs={"data_dir": str(data_dir), "topk": topk,
                                    **({} if max_turns is None else {"max_turns": max_turns})})
    facts = json.loads((Path(data_dir) / dataset / f"{split}.json").read_text(encoding="utf-8"))
    rows = [{**row, "hops": float(len(question["supporting_facts"]))} for row, question in zip(rows, facts,
                                                                                             strict=False)]
    if dataset != "synthbranch":
        return rows
    routes = branch_questions(data_dir, split, [question["question"] for question in facts])
    return [{**row, "route": route_taken(row[QUERIES], question.chain, question.decoy.chain)}
            for row, question in zip(rows, routes, strict=False)]


def untrained_defaults() -> dict[str, Any]:
    """The ``RUN_OPTIONS`` where no training run fixes them: the env's own defaults (declared in ``envs.SearchQAEnv``),
    and for max_step_tokens None (the sampler's own default)."""
    return {name: None if name == "max_step_tokens" else default_of(envs.SearchQAEnv, name) for name in RUN_OPTIONS}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    untrained = untrained_defaults()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a run.py --model name, a model directory, a checkpoint or a run "
                                                       "directory (its newest checkpoint)")
    p.add_argument("--envs", nargs="+", default=list(envs.PAPER_ENV_IDS), choices=list(envs.ENV_IDS),
                   metavar="ENV_ID", help=f"environments to evaluate, of {', '.join(envs.ENV_IDS)} (default: the "
                                          f"paper's seven)")
    p.add_argument("--split", default=None,
                   help="the split to evaluate (default: each env's evaluation split, dev or test)")
    p.add_argument("--limit", type=int, default=None, help="the first N questions of each split (default: all)")
    p.add_argument("--batch-size", type=int, default=16, help="questions advancing together (default: %(default)s)")
    p.add_argument("--max-turns", type=int, default=None,
                   help=f"search-capable steps before the final answer-only step (default: the run's, for a "
                        f"training checkpoint; else {untrained['max_turns']})")
    p.add_argument("--topk", type=int, default=None,
                   help=f"passages per search (default: the run's; else {untrained['topk']})")
    p.add_argument("--passage-words", type=int, default=None,
                   help="each passage cut to its first k words (default: the run's; else whole)")
    p.add_argument("--max-step-tokens", type=int, default=None,
                   help="token cap of one step (default: the run's; else training's default, 500 with a GPU and "
                        "128 on CPU)")
    p.add_argument("--retriever", default=None,
                   help=f"a retrieval backend or a retrieval server's URL, as run.py --retriever takes (default: the "
                        f"run's, for a training checkpoint; else {untrained['retriever']})")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                   help="model weights' dtype, a training checkpoint's cast to it (default: float32; a training "
                        "checkpoint's as its learner held them: float32, bfloat16 with --pure-bf16, a LoRA base in "
                        "its run's --dtype)")
    p.add_argument("--device", default=None, help="where the model runs (default: cuda when a GPU is visible)")
    p.add_argument("--generator", choices=GENERATORS, default="auto",
                   help="hf (transformers), vllm, or auto (vllm when it is installed and a GPU is visible) "
                        "(default: %(default)s)")
    p.add_argument("--data-dir", default=None, help="data directory (default: $TREEGRPO_DATA_DIR, else ./data)")
    p.add_argument("--output", default="outputs/eval", help="where eval.md and eval.json go (default: %(default)s)")
    p.add_argument("--overwrite", action="store_true", help="replace the eval.md and eval.json --output holds "
                                                            "(default: refused)")
    p.add_argument("--quiet", action="store_true", help="no progress bar (default: a progress bar per env)")
    args = p.parse_args(argv)
    if args.device is not None:
        import torch

        try:
            torch.device(args.device)
        except RuntimeError:
            p.error(f"--device must be a torch device such as cpu, cuda or cuda:1, got {args.device!r}")
    if args.generator == "vllm" and not vllm_installed():
        p.error("--generator vllm: vLLM is not installed (GPU: pip install -e .[vllm]; CPU: make test-vllm)")
    for name in COUNTS:
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.retriever is not None:
        try:
            check_retriever_spec(args.retriever)
        except ValueError as error:
            p.error(f"--retriever: {error}")
    try:
        check_output_directory(args.output)
    except SettingsError as error:
        p.error(str(error))
    held = [name for name in RESULT_FILES if (Path(args.output) / name).exists()]
    if held and not args.overwrite:
        p.error(f"--output {args.output} holds an evaluation ({', '.join(held)}): choose another --output, or pass "
                f"--overwrite to replace it")
    if names_a_run(args.model):  # a run directory, as export.py and run.py --resume take: its newest checkpoint
        try:
            args.model = str(resolve_checkpoint(args.model, hashes=False))  # hashing is resume's job
        except CheckpointError as error:
            p.error(f"--model: {error}")
    trained = trained_with(args.model)
    for name in RUN_OPTIONS:
        if getattr(args, name) is None:
            setattr(args, name, trained.get(name, untrained[name]))
    return args


def trained_with(model: str) -> dict[str, Any]:
    """The env and step options a training checkpoint (``RUN/checkpoints/iter_NNNNNN``) was trained with, so that a run
    is evaluated on the observations it trained on: from its run's ``config.yaml``, or the resume record
    (``resumes/iter_NNNNNN.yaml``) in effect at its iteration when the run was resumed with changes before it; {} for
    anything else."""
    import yaml


    checkpoint = Path(model).resolve()
    run_dir = checkpoint.parent.parent
    if not (checkpoint / RLLIB_MARKER).exists() or not (run_dir / CONFIG_FILE).is_file():
        return {}
    iteration = checkpoint_iteration(checkpoint)  # its last iteration, which the settings before it trained
    path = settings_file_at(run_dir, None if iteration is None else iteration - 1)
    saved = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    return {name: saved[name] for name in RUN_OPTIONS if name in saved}


def main(argv: list[str] | None = None) -> Path:
    """The command line's entry point; a missing model, checkpoint or data file, a malformed data file or a split the
    dataset lacks is one line naming it (exit 2)."""
    args = parse_args(argv)
    from policies.models import ModelNotFoundError

    try:
        return evaluate(args)
    except UnknownSplitError as error:
        print(f"evaluate.py: error: --split {args.split}: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    except (ModelNotFoundError, MissingDataError, DataError, CheckpointError) as error:
        print(f"evaluate.py: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None


def check_env_data(env_ids: Sequence[str], split: str | None, env_kwargs: Mapping[str, Any]) -> None:
    """Each env's questions (``split``, else its evaluation split) and corpus found and read, before the model loads
    and before an env's results are computed: a file missing for the last env fails at once, not after the others."""
    for env_id in env_ids:
        envs.question_count(env_id, **{**env_kwargs, "split": split or envs.eval_split(env_id)})
        envs.corpus_file(env_id, **env_kwargs)


def evaluate(args: argparse.Namespace) -> Path:
    """Greedy chains of ``args.model`` on each of ``args.envs``; writes eval.md and eval.json, returns eval.md."""
    import torch
    from tqdm import tqdm

    from policies.generation import SamplingSettings
    from policies.generators import resolve_generator, step_generator

    data_dir = resolve_data_dir(args.data_dir).resolve()  # before the model loads: a wrong folder fails at once
    env_kwargs = {"data_dir": str(data_dir), "max_turns": args.max_turns, "topk": args.topk,
                  "passage_words": args.passage_words, "retriever": args.retriever}
    check_env_data(args.envs, args.split, env_kwargs)
    model, tokenizer = load_policy(args.model, args.dtype)
    model.to(args.device or ("cuda" if torch.cuda.is_available() else "cpu")).eval()
    cap = {} if args.max_step_tokens is None else {"max_step_tokens": args.max_step_tokens}
    sampling = SamplingSettings(greedy=True, **cap)  # without a cap given, SamplingSettings' one default
    generator = step_generator(resolve_generator(args.generator), model, tokenizer, sampling)
    results, per_question = {}, {}
    for env_id in args.envs:
        split = args.split or envs.eval_split(env_id)
        with tqdm(desc=f"{env_id} ({split})", unit="q", disable=args.quiet) as progress:
            rows = evaluate_env(env_id, generator, tokenizer, split=split, limit=args.limit,
                                batch_size=args.batch_size, env_kwargs=env_kwargs, progress=progress)
        results[env_id] = {**mean_results(rows), "questions": len(rows)}
        per_question[env_id] = rows
    details = {"model": args.model, "split": args.split or "evaluation split", "limit": args.limit,
               "max_turns": args.max_turns, "topk": args.topk, "passage_words": args.passage_words,
               "max_step_tokens": args.max_step_tokens, "retriever": args.retriever}
    markdown, data = write_results(args.output, results, details, per_question)
    print(markdown.read_text(encoding="utf-8"))
    print(f"table: {markdown}; JSON: {data}")
    return markdown


if __name__ == "__main__":
    main()
