"""The warm start of the real QA sets: SmolLM2-135M-Instruct (or any ``--model`` with a chat template) fine-tuned on
the retrieval oracle's search trajectories of an env's train split, the start that ``run.py --model warm-start``
(the CPU default of ``QA_START_ENVS``) trains from.

    python experiments/qa_start.py --env HotpotQA-v0             # build it (once; cached), then print its directory
    python experiments/qa_start.py --env HotpotQA-v0 --evaluate outputs/start_eval  # and its greedy dev EM, answer rate

The recipe (``QA_START_RECIPE``, ``experiments/warmstart.py``'s options) is declared once here. The oracle searches
each question's supporting titles and answers the gold answer; its thoughts quote the passage sentence that names
the next query or the answer (``--cite``). Questions whose supporting passages do not all come back are skipped and
counted (``--require-gold``). LoRA adapters on the top layers, whose frozen bottom runs once per trajectory
(``--replay-bottom``), keep the first build to about 22 minutes on 2 cores with AVX-512, an estimated 57 with AVX2
only (``BUILD_MINUTES``); they are merged into the saved model. The start is
cached like the demo's (``warmstart.cached_warm_start``), keyed by the recipe and by the content of the train file and
the corpus, so a changed recipe or data is a new start.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import envs
from envs.datasets import MissingDataError, corpus_path, dataset_path, resolve_data_dir, train_and_corpus_digest
from experiments.warmstart import cached_warm_start, minutes_on_this_cpu, warm_start_dir
from policies.models import WARM_START_MODEL

# The real QA envs whose CPU runs start from their warm start: those with a train split to build it from.
QA_START_ENVS = ("HotpotQA-v0",)
# On a CPU, a real QA env's defaults: an iteration that 2 cores finish in about a minute, from a start that answers.
# Each value is chosen by a measurement in results/hotpotqa_cpu/README.md ("The CPU defaults"), the lr by
# results/hotpotqa_cpu_lr/ (5e-4 over 1e-4); with a GPU the defaults stay the paper's. Float32 (not bf16) so that a
# run does not depend on whether the CPU has AVX-512 BF16.
CPU_QA_DEFAULTS: dict[str, Any] = {
    "model": WARM_START_MODEL, "topk": 2, "passage_words": 64, "M": 1, "N": 2, "L": 1, "group_size": 2,
    "max_step_tokens": 80, "lora_rank": 16, "lora_layers": 10, "lora_targets": "all", "lr": 5e-4,
}
# The profile's options that go with its LoRA adapters (its lr was measured for them): full fine-tuning of the start
# keeps them all at their own defaults.
CPU_QA_LORA_OPTIONS = ("lora_rank", "lora_layers", "lora_targets", "lr")

# Oracle SFT of SmolLM2-135M-Instruct: LoRA (rank 16, every projection) on the top 10 of its 30 layers, two epochs
# at 1e-3 over the readable trajectories of the first 817 train questions (the whole of the shared data's train
# subset; 406 readable), laid out with the CPU runs' passages (CPU_QA_DEFAULTS). Chosen over 3e-4 on 640 questions by
# docs/protocol_hotpotqa_start.md's rule: results/hotpotqa_cpu_start_lr/. A full train file gives its first 817. The
# frozen bottom's outputs are recorded in epoch 1 and replayed in epoch 2 (--replay-bottom): the same fine-tuning to
# the last bits, 1.42x faster, adopted by docs/protocol_hotpotqa_replay.md's rule: results/hotpotqa_cpu_replay/.
QA_START_BASE_MODEL = "smollm2-135m"  # the start has its shape: the adapters are merged into it
QA_START_RECIPE = ("--model", QA_START_BASE_MODEL, "--cite", "--require-gold", "--read", "--lora-rank", "16",
                   "--lora-layers", "10", "--lora-targets", "all", "--questions", "817", "--epochs", "2",
                   "--lr", "1e-3", "--lr-floor", "0.1", "--batch-size", "4",
                   "--passage-words", str(CPU_QA_DEFAULTS["passage_words"]), "--seed", "0", "--replay-bottom")
QA_START_TOPK = CPU_QA_DEFAULTS["topk"]
# evaluate.py's options for the start (a model directory, which carries no run's settings): the CPU runs'
# observations and step cap, as a run's checkpoint is evaluated with its own
CPU_OBSERVATION_OPTIONS = ("--topk", str(QA_START_TOPK), "--passage-words", str(CPU_QA_DEFAULTS["passage_words"]),
                           "--max-step-tokens", str(CPU_QA_DEFAULTS["max_step_tokens"]))
# The first build's minutes on 2 cores by the CPU's widest vector unit, as torch dispatches to it: with AVX-512, 21.6
# min measured from an empty cache on a Zen 5 (results/hotpotqa_cpu_replay/; 30.8 there without the replay); with AVX2
# only, not measured: the 66 min measured for 640 questions without the replay, scaled by the trajectories' tokens
# (1.23x) and by the replay's measured 0.70x of the whole build
BUILD_MINUTES = {"AVX512": 22, "AVX2": 57}


def build_minutes(capability: str | None = None) -> int:
    """About how many minutes the first build takes on 2 cores of this CPU (``capability``: torch's CPU capability,
    this machine's by default); the slower figure where the vector unit has not been measured."""
    return minutes_on_this_cpu(BUILD_MINUTES, capability)


@dataclass(frozen=True)
class QASource:
    """A real QA set's train split and corpus, as ``cached_warm_start`` takes a generated world: ``DATASET``, a cache
    ``key`` and the data directory its trajectories come from."""

    DATASET: str
    data_dir: Path

    @classmethod
    def of(cls, env_id: str, data_dir: str | os.PathLike | None = None) -> QASource:
        """The source of ``env_id``'s warm start; no train file, or no corpus (its oracle searches it), is a
        MissingDataError naming the file it needs."""
        dataset = envs.ENV_IDS[env_id][0]
        directory = resolve_data_dir(data_dir).resolve()
        for needed, find in (("trains on its train split", lambda: dataset_path(dataset, "train", directory)),
                             ("searches its corpus", lambda: corpus_path(directory))):
            try:
                find()
            except MissingDataError as error:
                raise MissingDataError(f"the warm start of {env_id} {needed}, which is missing: {error}") from None
        return cls(dataset, directory)

    @property
    def key(self) -> str:
        return f"{self.DATASET}-{train_and_corpus_digest(self.DATASET, self.data_dir)}"


def check_has_warm_start(env_id: str) -> None:
    """A ``ValueError`` naming the model setting where ``env_id`` has no warm start recipe."""
    if env_id not in QA_START_ENVS:
        raise ValueError(f"model: {WARM_START_MODEL} is the warm start of {', '.join(QA_START_ENVS)}; {env_id} has "
                         f"none: pass a --model")


def qa_warm_start(env_id: str, data_dir: str | os.PathLike | None = None,
                  cache_dir: str | os.PathLike | None = None) -> Path:
    """The model directory of ``env_id``'s warm start, built the first time (about ``build_minutes()`` on 2 cores,
    said before it starts) and cached after."""
    check_has_warm_start(env_id)
    source = QASource.of(env_id, data_dir)
    if not (warm_start_dir(source, QA_START_RECIPE, topk=QA_START_TOPK, cache_dir=cache_dir) / "config.json").exists():
        print(f"warm start: {env_id} has no cached start yet: fine-tuning {QA_START_BASE_MODEL} on the retrieval "
              f"oracle's trajectories of its train split ({source.data_dir}), about {build_minutes()} minutes on 2 "
              f"cores of this CPU, once (killed, it resumes); training starts after it", flush=True)
    return cached_warm_start(source, QA_START_RECIPE, topk=QA_START_TOPK, cache_dir=cache_dir)


def warm_start_model(model: str, env_id: str, data_dir: str | os.PathLike | None = None) -> str:
    """``model`` as ``load_model`` takes it: ``warm-start`` becomes the directory of the env's cached start (built by
    ``qa_warm_start`` before a run starts; nothing is built here)."""
    if model != WARM_START_MODEL:
        return model
    check_has_warm_start(env_id)
    return str(warm_start_dir(QASource.of(env_id, data_dir), QA_START_RECIPE, topk=QA_START_TOPK))


def evaluate_start(model_dir: Path, env_id: str, data_dir: str | os.PathLike | None, output: Path) -> dict:
    """Greedy EM and answer rate of the start on the env's whole evaluation split with the CPU runs' observations and
    step cap, with 95% intervals over the questions (``evaluate.py``'s files in ``output``)."""
    from experiments.confidence import mean_interval
    from experiments.evaluate import main as evaluate

    evaluate(["--model", str(model_dir), "--envs", env_id, *CPU_OBSERVATION_OPTIONS, "--output", str(output),
              "--batch-size", "32", "--quiet", *(["--data-dir", str(data_dir)] if data_dir else [])])
    rows = json.loads((output / "eval.json").read_text(encoding="utf-8"))["questions"][env_id]
    summary = {name: asdict(mean_interval([row[name] for row in rows])) for name in ("em", "answered")}
    for name, interval in summary.items():
        print(f"start, {env_id} {name}: {interval['mean']:.3f} [{interval['low']:.3f}, {interval['high']:.3f}] "
              f"over {len(rows)} questions")
    return summary


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--env", choices=QA_START_ENVS, default=QA_START_ENVS[0])
    parser.add_argument("--data-dir", default=None, help="default: $TREEGRPO_DATA_DIR, else ./data")
    parser.add_argument("--evaluate", default=None, metavar="DIR",
                        help="also evaluate the start greedily on the env's evaluation split (eval.md, eval.json)")
    args = parser.parse_args(argv)
    try:
        model = qa_warm_start(args.env, args.data_dir)
    except MissingDataError as error:  # a wrong folder or a missing train file: one line naming it
        parser.exit(2, f"qa_start.py: error: {error}\n")
    print(f"model: {model} (run.py --model {WARM_START_MODEL} on {args.env} trains from it)")
    if args.evaluate:
        evaluate_start(model, args.env, args.data_dir, Path(args.evaluate))


if __name__ == "__main__":
    main()
