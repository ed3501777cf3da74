"""The settings of a training run, declared once: the algorithm's (``TreeGRPOSettings``) plus the environment,
the model, the resources, the run's lifecycle and its tracking.

The command line (``--kebab-case`` flags), YAML files (``snake_case`` keys), ``OUTPUT/config.yaml``, MLflow
params, ``tune.py`` and the benchmark scripts all derive from :class:`RunSettings`; ``build_config`` turns one
into the RLlib config. Validation is strict and happens before Ray starts (see ``experiments/cli.py``).
"""

from __future__ import annotations

import dataclasses
import math
import urllib.parse
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

import envs
from algos.tree_grpo import TreeGRPOConfig
from algos.tree_grpo import settings as algorithm_settings
from algos.tree_grpo.settings import ALGORITHM_FIELDS, TreeGRPOSettings, check_training_split, per_device
from envs.datasets import resolve_data_dir
from envs.retrieval import check_retriever_spec
from envs.rewards import REWARDS
from experiments.cli import SettingsError, default_of
from experiments.plot import SQLITE_PREFIX  # declared beside its Ray-free reader
from experiments.qa_start import (
    BUILD_MINUTES,
    CPU_QA_DEFAULTS,
    CPU_QA_LORA_OPTIONS,
    QA_START_ENVS,
    WARM_START_MODEL,
    warm_start_model,
)
from policies.logprobs import FLEX_ATTENTION
from policies.memory_plan import CUDA_OVERHEAD_GIB, MemoryOptions, rollout_sequences
from policies.models import LORA_TARGETS, LoraSettings

EnvId = Literal[tuple(envs.ENV_IDS)]  # type: ignore[valid-type]
GPU_DEFAULT_MODEL = "Qwen/Qwen2.5-1.5B-Instruct"  # the paper's smallest model: SmolLM2 earns nothing on HotpotQA
# The options whose defaults follow whether this process sees a GPU (decided when the settings are built, before
# Ray starts): a cluster joined with other devices than this process's refuses them unless given
# (experiments.preflight.check_device_defaults)
# (A real QA env's CPU defaults, CPU_QA_DEFAULTS, follow the device too, but only with the default model: giving
# --model, which this list asks for, leaves them at their generic defaults.)
DEVICE_DEFAULTS = ("model", "dtype", "gradient_checkpointing", "num_gpus_per_learner", "prompts_per_iteration",
                   "max_step_tokens", "skip_uniform_rewards", "frozen_bottom_replay")


def cpu_qa_profile(data: Any, default_env: str) -> dict[str, Any]:
    """The CPU defaults of a real QA env trained from its warm start that the options ``data`` do not give (see
    ``RunSettings._cpu_defaults_of_real_questions``); empty where they do not apply."""
    if not isinstance(data, dict) or algorithm_settings.gpu_visible():  # looked up: tests stand in for it
        return {}
    if data.get("env", default_env) not in QA_START_ENVS or data.get("model", WARM_START_MODEL) != WARM_START_MODEL:
        return {}
    # full fine-tuning (a given lora_rank of None, or an offloaded reference, which only it has) keeps the LoRA
    # options and their lr at their own defaults; a given rank is still LoRA, and keeps the profile's others
    full_fine_tuning = ("lora_rank" in data and data["lora_rank"] is None) or data.get("reference_offload", False)
    return {name: value for name, value in CPU_QA_DEFAULTS.items()
            if name not in data and not (full_fine_tuning and name in CPU_QA_LORA_OPTIONS)}


def cpu_qa_help() -> dict[str, str]:
    """``--help``'s word on ``CPU_QA_DEFAULTS``: each option's value there, shown beside its own default where the two
    differ (--model's description names the profile, which it starts)."""
    where = f"on a CPU for {', '.join(QA_START_ENVS)} from its warm start"
    return {name: f"{value} {where}" for name, value in CPU_QA_DEFAULTS.items()
            if name != "model" and value != RunSettings.model_fields[name].default}


def device_following(settings: RunSettings) -> tuple[str, ...]:
    """The options whose defaults follow the device this process sees: ``DEVICE_DEFAULTS``, and where a real QA env
    trains from its warm start, the CPU profile's options too (a GPU run keeps the paper's)."""
    if settings.env in QA_START_ENVS and settings.model == WARM_START_MODEL:
        return DEVICE_DEFAULTS + tuple(name for name in CPU_QA_DEFAULTS if name not in DEVICE_DEFAULTS)
    return DEVICE_DEFAULTS


def dashboard_dependency_error() -> ImportError | None:
    """Why Ray's dashboard cannot start here (the import error of its packages, which ``ray[rllib]`` does not
    bring), or None."""
    from ray._private.utils import get_dashboard_dependency_error

    return get_dashboard_dependency_error()


RESOURCE_FORM = "NAME=AMOUNT[,NAME=AMOUNT] (e.g. rollout_node=1)"
# Ray's own resources, asked for through their own options (Ray refuses them among the custom ones)
BUILTIN_RESOURCES = {"CPU": "--num-cpus-per-env-runner", "GPU": "--num-gpus-per-env-runner",
                     "memory": None, "object_store_memory": None}


def parse_resources(text: str) -> dict[str, float]:
    """``NAME=AMOUNT[,NAME=AMOUNT]`` as ``{NAME: AMOUNT}``; a ValueError showing the expected form otherwise."""
    resources: dict[str, float] = {}
    for item in (part.strip() for part in text.split(",")):
        name, equals, amount = (part.strip() for part in item.partition("="))
        try:
            value = float(amount)
        except ValueError:
            value = None
        if not name or not equals or value is None:
            raise ValueError(f"expected {RESOURCE_FORM}, got {item!r} in {text!r}")
        if name in resources:
            raise ValueError(f"{name} is given twice in {text!r}")
        resources[name] = value
    return resources


def check_custom_resources(resources: dict[str, float] | None) -> dict[str, float] | None:
    """``resources`` if every amount is positive and no name is one of Ray's own resources; else a ValueError."""
    for name, amount in (resources or {}).items():
        if name in BUILTIN_RESOURCES:
            option = BUILTIN_RESOURCES[name]
            raise ValueError(f"{name} is one of Ray's own resources, not a custom one"
                             + (f"; use {option}" if option else ""))
        if not amount > 0:
            raise ValueError(f"{name}={amount:g}: an amount must be positive")
    return resources


# Tracking URIs MLflow reads without a scheme (its own names for Databricks' stores)
SCHEMELESS_STORES = ("databricks", "databricks-uc", "uc")


def check_tracking_uri(uri: str | None) -> str | None:
    """``uri`` if MLflow 3 can track into it: a URI with a scheme (``sqlite:///``, ``http(s)://``, ``postgresql://``,
    ``databricks``, ...), a relative SQLite path made absolute (from this directory, once: a Tune trial runs in its
    own directory, where ``sqlite:///mlflow.db`` would be a store of its own); a ValueError naming a sqlite URI to
    use instead where it is a plain path or a ``file:`` URI, MLflow's file store, which MLflow 3 refuses (run.py
    would train untracked, tune.py fail after Ray started)."""
    if uri is None or uri in SCHEMELESS_STORES:
        return uri
    scheme = urllib.parse.urlparse(uri).scheme
    relative = uri.removeprefix(SQLITE_PREFIX)
    if uri.startswith(SQLITE_PREFIX) and relative and not relative.startswith(("/", ":memory:")):
        return f"{SQLITE_PREFIX}{Path(relative).resolve()}"
    if len(scheme) > 1 and scheme != "file":  # one letter: a Windows drive, a path to MLflow too
        return uri
    directory = Path(urllib.parse.urlparse(uri).path if scheme == "file" else uri).resolve()
    raise ValueError(f"{uri!r} is a directory for MLflow's file store, which MLflow 3 refuses; give a store's URI, "
                     f"e.g. sqlite:///{directory / 'mlflow.db'} (a SQLite file; four slashes before an absolute "
                     f"path) or http://HOST:PORT (a tracking server)")


class RunSettings(TreeGRPOSettings):
    """Everything ``experiments/run.py`` takes (see ``--help``)."""

    # environment
    env: EnvId = Field("HotpotQA-v0", description="search-QA environment id")
    split: str | None = Field(None, description="training split (default: the env id's training split)")
    data_dir: str | None = Field(None, description="data directory (default: $TREEGRPO_DATA_DIR, else ./data)")
    max_turns: int = Field(default_of(envs.SearchQAEnv, "max_turns"), ge=1,
                           description="search-capable steps before the final answer-only step")
    topk: int = Field(default_of(envs.SearchQAEnv, "topk"), ge=1, description="passages per search")
    passage_words: int | None = Field(default_of(envs.SearchQAEnv, "passage_words"), ge=1,
                                      description="each retrieved passage cut to its first k words (default: whole)")
    reward: Literal[tuple(REWARDS)] = Field(  # type: ignore[valid-type]
        default_of(envs.SearchQAEnv, "reward"),
        description="the episode's outcome reward: format (Search-R1's format-aware exact match: 1.0 right, 0.2 a "
                    "wrong answer in the agent format, 0 no answer), em (exact match alone: a wrong answer earns what "
                    "no answer does) or f1 (token F1); evaluation scores exact match whatever the reward")
    retriever: str = Field(default_of(envs.SearchQAEnv, "retriever"),
                           description="retrieval backend (bm25, rank_bm25, dense) or the URL of a retrieval server "
                                       "in Search-R1's protocol (http://HOST:PORT/retrieve; python -m "
                                       "envs.retrieval.serve starts one)")
    # model
    model: str = Field(
        default_factory=per_device(cpu="smollm2-135m", gpu=GPU_DEFAULT_MODEL),
        description=f"tiny-random (tiny-random-qwen2, tiny-random-llama3: the same in the paper's Qwen2.5 / "
                    f"Llama-3.2 architectures and chat formats), smollm2-135m, a Hugging Face hub id, a model "
                    f"directory (e.g. one written by experiments/export.py), or {WARM_START_MODEL} (the env's "
                    f"oracle warm start: SmolLM2-135M-Instruct fine-tuned on the retrieval oracle's search "
                    f"trajectories of the env's train split, built once, about {BUILD_MINUTES['AVX512']} minutes on 2 "
                    f"cores with AVX-512, {BUILD_MINUTES['AVX2']} with AVX2 only, and "
                    f"cached; experiments/qa_start.py) (default: on CPU {WARM_START_MODEL} for "
                    f"{', '.join(QA_START_ENVS)} and smollm2-135m for the others; with a GPU the paper's smallest "
                    f"model, {GPU_DEFAULT_MODEL}, downloaded from the hub on first use, about 3 GB). On CPU "
                    f"{', '.join(QA_START_ENVS)} trained from {WARM_START_MODEL} also default to {CPU_QA_DEFAULTS}")
    dtype: Literal["float32", "bfloat16"] = Field(
        default_factory=per_device(cpu="float32", gpu="bfloat16"),
        description="compute dtype: bfloat16 runs the learner's passes under autocast over float32 master weights, "
                    "gradients and AdamW state, and the rollout engines in bf16 weights cast from the master at each "
                    "sync; export writes float32 (default: float32 on CPU, bfloat16 with a GPU)")
    pure_bf16: bool = Field(False, description="with --dtype bfloat16: bf16 master weights and optimizer state too "
                                               "(half the learner's static memory; updates below half a bf16 ulp "
                                               "round away, so small learning rates do not learn; warns)")
    gradient_checkpointing: bool = Field(
        default_factory=per_device(cpu=False, gpu=True),
        description="recompute each decoder layer's activations in the backward pass instead of keeping them (same "
                    "loss and gradients; a fraction of the activations' memory for about a third more compute) "
                    "(default: on with a GPU, where the default model's plan needs it to fit 80 GB; off on CPU)")
    lora_rank: int | None = Field(None, ge=1, description="train LoRA adapters of this rank (default: full "
                                                          "fine-tuning)")
    lora_alpha: int = Field(LoraSettings.alpha, ge=1, description="LoRA alpha (with --lora-rank)")
    lora_layers: int | None = Field(None, ge=1, description="with --lora-rank: adapters on the top k decoder layers "
                                                             "only (default: all); the backward pass stops below them")
    lora_targets: Literal[tuple(LORA_TARGETS)] = Field(  # type: ignore[valid-type]
        "attention", description="with --lora-rank: the projections that get adapters: attention (q, k, v, o) or "
                                 "all (with the MLP's)")
    # resources
    seed: int = Field(0, ge=0, description="seed of prompts, sampling and model initialisation")
    num_env_runners: int = Field(0, ge=0, description="remote Ray env runners (0: sample in this process)")
    num_learners: int = Field(0, ge=0, description="remote learners, data-parallel: DDP, or FSDP2 with "
                                                   "--learner-sharding fsdp (0: learn in this process)")
    num_gpus_per_learner: float = Field(
        default_factory=per_device(cpu=0.0, gpu=1.0), ge=0,
        description="GPUs per learner: the local learner (--num-learners 0) and each remote one train on a GPU when "
                    "this is above 0, else on the CPU (default: 1 with a GPU visible, so every learner updates on "
                    "its own GPU; 0 on CPU)")
    num_cpus_per_learner: float = Field(1.0, gt=0, description="CPUs per remote learner")
    num_cpus_per_env_runner: float = Field(1.0, gt=0, description="CPUs per remote env runner")
    num_gpus_per_env_runner: float = Field(0.0, ge=0, description="GPUs per remote env runner (its generator, HF "
                                                                  "or a vLLM engine, runs there)")
    env_runner_resources: dict[str, float] | None = Field(
        None, description="custom Ray resources per remote env runner, NAME=AMOUNT[,NAME=AMOUNT] (e.g. "
                          "rollout_node=1: the runners go to the nodes started with ray start --resources "
                          "'{\"rollout_node\": N}'; default: wherever their CPUs and GPUs fit)")
    ray_address: str | None = Field(None, description="join the Ray cluster at HOST:PORT (default: $RAY_ADDRESS; "
                                                      "without either, start a local Ray on loopback)")
    ray_dashboard: bool = Field(False, description="start Ray's dashboard (on 127.0.0.1:8265) with the local "
                                "Ray instance (needs pip install -e .[dashboard])")
    memory_check: bool = Field(
        True, description="print the run's memory plan per GPU (experiments/plan_memory.py) before anything loads, "
                          "and refuse a run planned above its GPU's memory (--no-memory-check: go on anyway)")
    # the run
    iterations: int = Field(20, ge=1, description="training iterations (of this invocation, also when resuming)")
    token_budget: int | None = Field(
        None, ge=1, description="stop the run once it has generated this many tokens (tokens_generated_total, its "
                                "earlier invocations included): the iteration that reaches it is finished, then the "
                                "run ends as after its last iteration (checkpoint, final evaluation); --iterations "
                                "still caps the invocation, and the lr warm-up's default share counts its steps: "
                                "with a budget, give --warmup-steps (default: no budget)")
    stop_after_uniform: int | None = Field(
        None, ge=1, description="end the run after this many iterations in a row in which every prompt's leaves were "
                                "rewarded alike (uniform_streak; its earlier invocations count): every advantage is "
                                "then 0, the KL and entropy terms alone move the weights, and a run that has solved "
                                "its prompts drifts (docs/training.md, \"A run that has solved its prompts\"); ends "
                                "as after its last iteration (checkpoint, final evaluation; default: never)")
    output: str = Field("outputs/run", description="the run's directory (must not hold another run)")
    checkpoint_every: int = Field(10, ge=0, description="checkpoint every k iterations (0: only at the end); "
                                                        "always at the end and on SIGINT / SIGTERM")
    keep_checkpoints: int = Field(2, ge=1, description="complete checkpoints kept (the newest)")
    eval_every: int = Field(0, ge=0, description="greedy evaluation on the evaluation split every k iterations "
                                                 "(0: never)")
    eval_questions: int = Field(50, ge=1, description="questions of each greedy evaluation (the first ones)")
    final_eval: bool = Field(False, description="greedy evaluation at the end: OUTPUT/eval/eval.md + .json")
    eval_envs: list[EnvId] | None = Field(None, min_length=1,
                                          description="envs of the final evaluation (default: the training env)")
    # tracking
    mlflow: bool = Field(True, description="track the run in MLflow")
    mlflow_uri: str | None = Field(None, description="MLflow tracking URI with a scheme: sqlite:///ABS/PATH/mlflow.db, "
                                                     "http://HOST:PORT, ... (a plain path, MLflow's file store, is "
                                                     "refused: MLflow 3 refuses it; default: "
                                                     "sqlite:///OUTPUT/mlflow.db)")
    experiment: str = Field("tree-grpo", description="MLflow experiment name")
    run_name: str | None = Field(None, description="MLflow run name (default: the output directory's name)")

    @model_validator(mode="wrap")
    @classmethod
    def _cpu_defaults_of_real_questions(cls, data: Any, handler: Any) -> RunSettings:
        """On a CPU, a real QA env with a warm start, trained from it (no --model, or --model warm-start), takes
        ``CPU_QA_DEFAULTS`` for every option not given. ``CPU_QA_LORA_OPTIONS`` go with the adapters: full
        fine-tuning (a given ``lora_rank`` of None, or an offloaded reference, which only full fine-tuning has) keeps
        them all at their own defaults; a given rank (still LoRA) keeps the profile's other LoRA options and its lr
        unless they are given too. Another --model keeps the generic defaults. They stay defaults, not choices:
        ``model_fields_set`` holds only what was given (``check_device_defaults`` reads it)."""
        profile = cpu_qa_profile(data, cls.model_fields["env"].default)  # only options the data does not give
        if not profile:
            return handler(data)
        settings = handler({**profile, **data})
        settings.model_fields_set.difference_update(profile)
        return settings

    @model_validator(mode="before")
    @classmethod
    def _schedule_spans_the_run(cls, data: Any) -> Any:
        """A run's learning-rate schedule spans its --iterations unless total_iterations says otherwise. An invalid
        --iterations is not copied: its error is reported once, under the option the user gave."""
        if isinstance(data, dict) and data.get("total_iterations") is None:
            iterations = data.get("iterations", cls.model_fields["iterations"].default)
            if isinstance(iterations, int) and iterations >= 1:
                data = {**data, "total_iterations": iterations}
        return data

    @field_validator("retriever")
    @classmethod
    def _known_retriever(cls, value: str) -> str:
        return check_retriever_spec(value)

    @field_validator("mlflow_uri")
    @classmethod
    def _tracking_store(cls, value: str | None) -> str | None:
        return check_tracking_uri(value)

    @field_validator("env_runner_resources", mode="before")
    @classmethod
    def _resources_from_text(cls, value: Any) -> Any:
        return parse_resources(value) if isinstance(value, str) else value

    @field_validator("env_runner_resources")
    @classmethod
    def _custom_resources_only(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        return check_custom_resources(value)

    @model_validator(mode="after")
    def _precision_and_reference(self) -> RunSettings:
        if self.pure_bf16 and self.dtype != "bfloat16":
            raise ValueError("pure_bf16: needs --dtype bfloat16 (bf16 master weights)")
        if self.lora_rank is None and (self.lora_layers is not None or self.lora_targets != "attention"):
            raise ValueError("lora_layers, lora_targets: place LoRA adapters, but lora_rank is None (full "
                             "fine-tuning); set --lora-rank, or drop them")
        if self.reference_offload and self.lora_rank is not None:
            raise ValueError("reference_offload: with LoRA the reference is the base model with its adapters off, "
                             "which the policy holds anyway: nothing to offload; drop --reference-offload")
        return self

    @model_validator(mode="after")
    def _resources_need_remote_runners(self) -> RunSettings:
        if self.env_runner_resources and not self.num_env_runners:
            raise ValueError("env_runner_resources: places remote env runners, but num_env_runners is 0 (the "
                             "driver samples); set --num-env-runners, or drop --env-runner-resources")
        return self

    @model_validator(mode="after")
    def _no_training_on_the_evaluation_split(self) -> RunSettings:
        check_training_split(self.env, self.split, self.allow_eval_split_training)
        return self

    @model_validator(mode="after")
    def _dashboard_needs_its_packages(self) -> RunSettings:
        missing = dashboard_dependency_error() if self.ray_dashboard else None
        if missing is not None:
            raise ValueError(f"ray_dashboard: Ray's dashboard needs ray[default], which is not installed here "
                             f"({missing}): pip install -e .[dashboard], or run without --ray-dashboard")
        return self

    @property
    def training_split(self) -> str:
        return self.split or envs.ENV_IDS[self.env][1]

    @property
    def contaminated(self) -> bool:
        """Whether the run trains on its evaluation split (only with ``allow_eval_split_training``)."""
        return self.training_split == envs.eval_split(self.env)


# --help's sections, in this order. A section runs from the field named here (in declaration order: the algorithm's
# fields, then RunSettings' own) to the next field named; a new field joins the section of the field above it.
HELP_SECTIONS = ("environment", "model", "shape", "update", "resources", "run", "tracking")
SECTION_STARTS = {"algo": "shape", "generator": "resources", "lr": "update", "log_rollout_steps": "tracking",
                  "allow_eval_split_training": "environment",
                  "env": "environment", "model": "model", "seed": "run", "num_env_runners": "resources",
                  "iterations": "run", "mlflow": "tracking"}


def help_sections() -> dict[str, str]:
    """Every field's ``--help`` section (``SECTION_STARTS``), the fields ordered by section (``HELP_SECTIONS``)
    and within one by declaration."""
    section, found = None, {}
    for name in RunSettings.model_fields:
        section = SECTION_STARTS.get(name, section)
        found[name] = section
    return dict(sorted(found.items(), key=lambda item: HELP_SECTIONS.index(item[1])))


# Options that may differ when a run is resumed: they change how long it runs, what it logs, how often it
# evaluates, where it is placed (a run resumed on another machine) and how fast it computes, never what it learns.
# Every other option is part of the experiment (see ``resume_conflicts``).
MAY_CHANGE_ON_RESUME = frozenset({
    "iterations", "token_budget", "stop_after_uniform", "checkpoint_every", "keep_checkpoints", "eval_every",
    "eval_questions", "final_eval",
    "eval_envs", "mlflow", "mlflow_uri", "experiment", "run_name", "log_rollout_steps", "trees_every", "trees_count",
    "data_dir", "ray_dashboard", "ray_address", "memory_check", "env_runner_resources", "num_cpus_per_env_runner",
    "num_gpus_per_env_runner", "num_cpus_per_learner", "num_gpus_per_learner", "learner_threads",
    "frozen_bottom_replay",  # the same log-probs and gradients either way (tests/test_frozen_bottom.py)
})


def resume_conflicts(saved: dict[str, Any], requested: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """The requested options that would change the resumed experiment: ``{name: (saved, requested)}``."""
    return {name: (saved.get(name), value) for name, value in requested.items()
            if name not in MAY_CHANGE_ON_RESUME and saved.get(name) != value}


def check_chain_shape(settings: RunSettings, typed: Mapping[str, Any]) -> None:
    """A ``SettingsError`` where ``typed`` (the options given on the command line) sets a tree shape that chain GRPO
    would replace: ``algo`` grpo grows ``group_size`` chains per prompt, the shape (group_size, 0, 0), whatever M, N
    and L say. A ``--config`` file's shape is replaced without a word: a chain's file may inherit a tree's from its
    base, as experiments/configs/budget/*_chain.yaml do, and a run's config.yaml holds the shape it normalised to."""
    if settings.algo != "grpo":
        return
    chain = {"M": settings.group_size, "N": 0, "L": 0}
    replaced = {name: typed[name] for name in chain if name in typed and typed[name] != chain[name]}
    if replaced:
        given = " ".join(f"--{name} {value}" for name, value in replaced.items())
        raise SettingsError(f"{', '.join(replaced)}: --algo grpo grows --group-size {settings.group_size} chains per "
                            f"prompt, the shape ({settings.group_size}, 0, 0), which would replace {given}: set the "
                            f"chains with --group-size and drop {given}, or grow trees of (M, N, L) with --algo "
                            f"tree_grpo")


def tracked_params(settings: RunSettings) -> dict[str, Any]:
    """A run's MLflow params (run.py and every Tune trial): every setting under its own name, and whether the run
    trains on its evaluation split."""
    return {**settings.model_dump(), "trained_on_eval_split": settings.contaminated}


def env_config(settings: RunSettings) -> dict[str, Any]:
    return {"data_dir": str(resolve_data_dir(settings.data_dir).resolve()), "split": settings.training_split,
            "max_turns": settings.max_turns, "topk": settings.topk, "passage_words": settings.passage_words,
            "retriever": settings.retriever, "reward": settings.reward}


def lora_settings(settings: RunSettings) -> LoraSettings | None:
    """The run's LoRA adapters, or None for full fine-tuning."""
    if settings.lora_rank is None:
        return None
    return LoraSettings(rank=settings.lora_rank, alpha=settings.lora_alpha,
                        target_modules=LORA_TARGETS[settings.lora_targets], layers=settings.lora_layers)


def model_config(settings: RunSettings) -> dict[str, Any]:
    lora = lora_settings(settings)
    lora = None if lora is None else dataclasses.asdict(lora)
    return {"model": warm_start_model(settings.model, settings.env, settings.data_dir), "dtype": settings.dtype,
            "pure_bf16": settings.pure_bf16, "gradient_checkpointing": settings.gradient_checkpointing,
            "seed": settings.seed, "lora": lora}


def engines_beside_a_learner(settings: RunSettings) -> int:
    """How many rollout engines can land on a learner's GPU: the driver's own when it samples (on GPU 0, where the
    local learner trains and Ray puts its first remote one); else as many remote env runners' shares of a GPU as
    fit beside a learner, which Ray decides: all of the local learner's GPU (Ray does not count it as taken), 1 -
    the share of a remote one. 0 with the learners on the CPU."""
    if not settings.num_gpus_per_learner:
        return 0
    if not settings.num_env_runners:
        return 1
    if not settings.num_gpus_per_env_runner:
        return 0
    free = max(0.0, 1.0 - (settings.num_gpus_per_learner if settings.num_learners else 0.0))
    return min(settings.num_env_runners, math.floor(round(free / settings.num_gpus_per_env_runner, 6)))


def memory_options(settings: RunSettings, gpu_memory_gib: float | None) -> MemoryOptions:
    """The memory plan's options of a run: its learners, precision and memory options; a colocated rollout engine
    when one can land on a learner's GPU (:func:`engines_beside_a_learner`; more than one is refused before Ray
    starts), its KV cache sized by the branches it decodes at once (its runner's prompts, M, N, L). Without
    ``--micro-batch-tokens`` the plan assumes its default micro-batch (a (2,2,1) prompt group at 500-token
    steps)."""
    colocated = gpu_memory_gib is not None and engines_beside_a_learner(settings) > 0
    prompts = math.ceil(settings.prompts_per_iteration / max(1, settings.num_env_runners))  # one runner's share
    tokens = {} if settings.micro_batch_tokens is None else {"micro_batch_tokens": settings.micro_batch_tokens}
    return MemoryOptions(
        learners=max(1, settings.num_learners), sharding=settings.learner_sharding, dtype=settings.dtype,
        pure_bf16=settings.pure_bf16,
        gradient_checkpointing=settings.gradient_checkpointing, reference=settings.kl_coef > 0,
        reference_offload=settings.reference_offload, lora_rank=settings.lora_rank,
        learner_attention="flex_attention" if settings.learner_attention == FLEX_ATTENTION else "sdpa",
        generator=settings.generator_backend, colocated=colocated,
        vllm_gpu_memory_utilization=settings.vllm_gpu_memory_utilization, vllm_sleep=settings.vllm_sleep,
        rollout_sequences=rollout_sequences(prompts, (settings.M, settings.N, settings.L)),
        rollout_context=settings.max_context_tokens,
        overhead_gib=CUDA_OVERHEAD_GIB if gpu_memory_gib is not None else 0.0, gpu_memory_gib=gpu_memory_gib,
        **tokens)


def build_config(settings: RunSettings) -> TreeGRPOConfig:
    """The RLlib algorithm config of ``settings`` (tracking callbacks are added by the caller)."""
    return (
        TreeGRPOConfig()
        .environment(settings.env, env_config=env_config(settings))
        .training(**{name: getattr(settings, name) for name in ALGORITHM_FIELDS})
        .rl_module(model_config=model_config(settings))
        .env_runners(num_env_runners=settings.num_env_runners,
                     num_cpus_per_env_runner=settings.num_cpus_per_env_runner,
                     num_gpus_per_env_runner=settings.num_gpus_per_env_runner,
                     custom_resources_per_env_runner=settings.env_runner_resources or {})
        .learners(num_learners=settings.num_learners, num_gpus_per_learner=settings.num_gpus_per_learner,
                  num_cpus_per_learner=settings.num_cpus_per_learner)
        .evaluation(evaluation_interval=settings.eval_every or None, evaluation_duration=settings.eval_questions,
                    evaluation_duration_unit="episodes")
        .debugging(seed=settings.seed)
    )


# Command-line spellings besides ``--field-name`` (the contract's short forms): flag -> (field, constant or None).
CLI_ALIASES: dict[str, tuple[str, Any]] = {
    "--prompts-per-iter": ("prompts_per_iteration", None),
    "--quiet": ("log_rollout_steps", False),
}
