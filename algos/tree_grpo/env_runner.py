"""The env runner: grows Tree-GRPO trees for its share of an iteration's prompts and returns leaf records.

It replaces RLlib's stock runner, which cannot carry text (gymnasium batches ``Text`` spaces as tuples of
characters and the default connectors cannot tensorize strings): one plain env, restored from node snapshots,
and a step generator over the module's weights (the HF module itself, or a vLLM engine that the runner starts on
first use and loads every weight sync into); token ids travel in the records.
"""

from __future__ import annotations

import dataclasses
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import gymnasium as gym
import numpy as np
import ray
import torch
from ray.rllib.core import COMPONENT_RL_MODULE, DEFAULT_MODULE_ID
from ray.rllib.env import INPUT_ENV_SINGLE_SPACES, INPUT_ENV_SPACES
from ray.rllib.env.env_runner import EnvRunner
from ray.rllib.utils.annotations import override
from ray.rllib.utils.checkpoints import Checkpointable
from ray.rllib.utils.metrics import NUM_ENV_STEPS_SAMPLED_LIFETIME, WEIGHTS_SEQ_NO

import envs  # noqa: F401  (registers the env ids in this process, also in Ray workers)
from algos.batch import LeafRecord, leaf_records
from algos.evaluation import greedy_chains
from algos.rollout import TreeRollout
from algos.tree import Tree
from algos.tree_grpo import metrics as metric_keys
from algos.tree_grpo.weight_transport import SyncedWeights, receive_weights
from algos.tree_view import trees_to_dicts
from policies.generation import SamplingSettings, StepGenerator
from policies.rl_module import LLMRLModule
from policies.vllm_generation import VLLMEngine, VLLMStepGenerator
from policies.weight_sync import sync_in_process


@dataclass
class RunnerResult:
    """What one env runner returns for its share of an iteration's prompts."""

    worker_index: int  # 0: the local runner
    prompt_indices: list[int]
    records: list[LeafRecord]  # one per leaf, in tree order
    metrics: dict[str, Any]  # the runner's reduced metrics (``get_metrics``)
    trees: list[dict[str, Any]] = field(default_factory=list)  # exported trees; leaf indices count over ``records``
    weights_seq_no: int = 0  # the sequence number of the weights that sampled it (the learner's at their sync)
    iteration: int | None = None  # the iteration it was sampled for (None in results saved before it was recorded)


def module_device(generator_backend: str, cuda_available: bool) -> str:
    """Where a runner's module lives. Ray hides the GPUs an actor was not given, so a visible GPU is the runner's
    (or the driver's, in-process): the HF generator runs the module there. A vLLM engine holds the GPU's copy
    itself, so the module stays in host memory, what each weight sync loads into the engine from."""
    return "cuda" if cuda_available and generator_backend == "hf" else "cpu"


class TreeSearchEnvRunner(EnvRunner, Checkpointable):
    """Samples trees (or chains) of agent steps with the current policy."""

    def __init__(self, *, config, **kwargs):
        super().__init__(config=config, **kwargs)
        self.worker_index = self.worker_index or 0
        # new with every process: the algorithm tells a runner that Ray restarted, also one restarted between two
        # calls (RLlib never sees that one fail, and it would sample with its initial weights)
        self.incarnation = uuid.uuid4().hex
        self._weights_seq_no = 0
        self._eval_envs: dict[tuple[str, str], gym.Env] = {}
        self._last_trees: list[Tree] = []
        self._sampled_iteration: int | None = None  # the iteration of the last sample call
        self._vllm: VLLMEngine | None = None  # started on first use with the vllm generator
        self.make_env()
        self.make_module()

    @override(EnvRunner)
    def make_env(self) -> None:
        self.env = gym.make(self.config.env, **dict(self.config.env_config))

    @override(EnvRunner)
    def make_module(self) -> None:
        spec = self.config.get_rl_module_spec(spaces=self.get_spaces(), inference_only=True)
        self.module = spec.build()
        device = module_device(self.config.settings.generator_backend, torch.cuda.is_available())
        if device != "cpu":
            self.module.to(device)

    @override(EnvRunner)
    def get_spaces(self) -> dict[str, tuple[gym.Space, gym.Space]]:
        spaces = (self.env.observation_space, self.env.action_space)
        return {INPUT_ENV_SPACES: spaces, INPUT_ENV_SINGLE_SPACES: spaces, DEFAULT_MODULE_ID: spaces}

    @override(EnvRunner)
    def assert_healthy(self) -> None:
        assert self.env is not None and self.module is not None, "the env runner has no env or no module"

    @override(EnvRunner)
    def sample(self, *, prompt_indices: list[int] | None = None, iteration: int = 0, **kwargs) -> list[LeafRecord]:
        """Grow the configured trees for ``prompt_indices`` (dataset positions) and return one record per leaf;
        the sampling seed follows from (seed, runner, iteration), so a resumed run samples as the original and a
        restarted runner draws what the runner it replaces would have; a second call in one iteration (prompts
        taken over from a failed runner) adds the prompts to the seed, so that it does not replay this runner's
        own draws."""
        if not prompt_indices:
            return []
        start = time.perf_counter()
        entropy = [self.config.seed or 0, self.worker_index, iteration]
        if self._sampled_iteration == iteration:
            entropy += prompt_indices
        self._sampled_iteration = iteration
        seed = int(np.random.SeedSequence(entropy).generate_state(1)[0])
        generator = self.step_generator(self.config.sampling)
        on_step = self._print_step if self.config.log_rollout_steps else None
        rollout = TreeRollout(self.env, generator, self.module.tokenizer, seed=seed, branching=self.config.branching,
                              on_step=on_step)
        trees = rollout.grow(list(prompt_indices), self.config.tree_shape)
        self._last_trees = trees
        records = leaf_records(trees)
        self._log(records, rollout, generator.counters.as_dict(), time.perf_counter() - start)
        return records

    def sample_prompts(self, prompt_indices: list[int], *, iteration: int, export_trees: int = 0) -> RunnerResult:
        """``sample`` for ``prompt_indices``, with this call's metrics and its first ``export_trees`` trees."""
        records = self.sample(prompt_indices=prompt_indices, iteration=iteration)
        trees = self.export_trees(export_trees) if export_trees else []
        return RunnerResult(self.worker_index, list(prompt_indices), records, self.get_metrics(), trees,
                            self._weights_seq_no, iteration)

    def step_generator(self, sampling: SamplingSettings) -> StepGenerator:
        """The configured backend's step generator over the module's current weights."""
        settings = self.config.settings
        if settings.generator_backend == "hf":
            return self.module.generator(sampling)
        if self._vllm is None:
            seed = int(np.random.SeedSequence([self.config.seed or 0, self.worker_index]).generate_state(1)[0])
            self._vllm = VLLMEngine(self.module.model, self.module.tokenizer, settings.sampling,
                                    dataclasses.replace(settings.vllm, seed=seed % 2**31))
        return VLLMStepGenerator(self._vllm, self.module.tokenizer, self.module.model, sampling)

    def sleep_generator(self) -> None:
        """Free the vLLM engine's GPU memory for the learner's update (``vllm_sleep``; no-op without an engine)."""
        if self._vllm is not None:
            self._vllm.sleep()

    def wake_generator(self) -> None:
        """Bring a sleeping vLLM engine back before the weight sync (no-op without an engine)."""
        if self._vllm is not None:
            self._vllm.wake_up()

    def _print_step(self, line: str) -> None:
        print(f"  [runner {self.worker_index}] {line}", file=sys.stderr, flush=True)

    def greedy_eval(self, prompt_indices: list[int], env_id: str, split: str) -> list[dict[str, float]]:
        """One greedy chain per question (as the paper evaluates) of ``env_id``'s ``split``, built with this
        runner's env settings; per question the ``algos.evaluation.EVAL_COLUMNS``. Positions past the end of
        the split are ignored."""
        if (env_id, split) not in self._eval_envs:
            settings = {**dict(self.config.env_config), "split": split}
            self._eval_envs[env_id, split] = gym.make(env_id, **settings)
        env = self._eval_envs[env_id, split]
        indices = [i for i in prompt_indices if i < len(env.unwrapped.records)]
        # greedy chains are never branched: no entropy to measure
        generator = self.step_generator(dataclasses.replace(self.config.sampling, greedy=True, entropy_tokens=0))
        return greedy_chains(env, generator, self.module.tokenizer, indices) if indices else []

    def export_trees(self, limit: int) -> list[dict[str, Any]]:
        """The first ``limit`` trees of the last ``sample`` call as dicts (``algos.tree_view``); their leaf
        indices count over ALL of that call's records."""
        records = self.env.unwrapped.records
        questions = {tree.prompt_index: records[tree.prompt_index].question for tree in self._last_trees}
        return trees_to_dicts(self._last_trees[:limit], questions)

    def _log(self, records: list[LeafRecord], rollout: TreeRollout, generation: dict[str, int], seconds: float):
        sums = {metric_keys.TOKENS_GENERATED: generation["tokens_generated"],
                metric_keys.TOKENS_PREFILLED: generation["tokens_prefilled"],
                metric_keys.LLM_CALLS: generation["llm_calls"],
                metric_keys.FORWARD_PASSES: generation["forward_passes"],
                metric_keys.TOOL_CALLS: rollout.counters.tool_calls,
                metric_keys.LEAVES: len(records), metric_keys.TREES: rollout.counters.trees,
                metric_keys.SAMPLE_TIME_S: seconds,
                metric_keys.GENERATION_TIME_S: rollout.counters.generation_s,
                metric_keys.ENV_TIME_S: rollout.counters.env_s,
                metric_keys.RETRIEVAL_RETRIES: rollout.counters.retrieval_retries,
                metric_keys.EXPANSIONS: rollout.counters.expansions,
                metric_keys.EXPANSIONS_BEFORE_ANSWER_READ: rollout.counters.expansions_before_answer_read}
        for key, value in sums.items():
            self.metrics.log_value(key, value, reduce="sum")
        self.metrics.log_value(metric_keys.KV_PEAK_MIB, generation["kv_peak_bytes"] / 2**20, reduce="max", window=1)
        self.metrics.log_value(metric_keys.BUDGET_ESTIMATE, self.config.tree_shape.budget_estimate, window=1)
        self.metrics.log_value(metric_keys.BUDGET_MEASURED, rollout.counters.budget_measured, window=1)
        self.num_env_steps_sampled_lifetime += len(records)

    @override(EnvRunner)
    def get_metrics(self) -> dict[str, Any]:
        return self.metrics.reduce()

    @override(Checkpointable)
    def get_state(self, components=None, *, not_components=None, **kwargs) -> dict[str, Any]:
        state = {NUM_ENV_STEPS_SAMPLED_LIFETIME: self.num_env_steps_sampled_lifetime}
        if self._check_component(COMPONENT_RL_MODULE, components, not_components):
            state[COMPONENT_RL_MODULE] = self.module.get_state()
            state[WEIGHTS_SEQ_NO] = self._weights_seq_no
        return state

    @override(Checkpointable)
    def set_state(self, state: dict[str, Any]) -> None:
        if COMPONENT_RL_MODULE in state:
            seq_no = state.get(WEIGHTS_SEQ_NO, 0)
            if seq_no == 0 or self._weights_seq_no < seq_no:  # skip stale weights; 0 forces the update
                module_state = state[COMPONENT_RL_MODULE]
                if isinstance(module_state, ray.ObjectRef):
                    module_state = ray.get(module_state)
                if isinstance(module_state, SyncedWeights):  # the weight sync's buckets
                    receive_weights(self.module, module_state)
                else:  # a whole state dict (RLlib's restore of a failed runner, a checkpoint)
                    if isinstance(module_state, dict) and DEFAULT_MODULE_ID in module_state:
                        module_state = module_state[DEFAULT_MODULE_ID]
                    self.module.set_state(module_state)
                self._weights_loaded()
            self._weights_seq_no = max(self._weights_seq_no, seq_no)
        self.num_env_steps_sampled_lifetime = state.get(NUM_ENV_STEPS_SAMPLED_LIFETIME,
                                                        self.num_env_steps_sampled_lifetime)

    def copy_weights_from(self, module: LLMRLModule, seq_no: int) -> None:
        """A learner's weights in this process (``seq_no``: their sequence number) into this runner's module unless
        it has them already: the learner's own parameters where they can be shared (the CPU, one dtype), else copied
        tensor to tensor (cast to this module's dtype)."""
        if seq_no == 0 or self._weights_seq_no < seq_no:
            sync_in_process(module.model, self.module.model)
            self._weights_loaded()
        self._weights_seq_no = max(self._weights_seq_no, seq_no)

    def _weights_loaded(self) -> None:
        """The module has new weights: a running vLLM engine serves them from now on."""
        if self._vllm is not None:
            self._vllm.load_weights(self.module.model)

    @override(Checkpointable)
    def get_ctor_args_and_kwargs(self):
        return (), {"config": self.config}

    @override(Checkpointable)
    def get_checkpointable_components(self) -> list:
        return []

    @override(EnvRunner)
    def stop(self) -> None:
        if self.env is not None:
            self.env.close()
        if self._vllm is not None:
            self._vllm.close()
            self._vllm = None
