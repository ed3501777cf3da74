"""Tree-GRPO as an RLlib Algorithm: sample trees -> advantages per prompt -> one learner update -> weight sync."""

from __future__ import annotations

import json
import time
from pathlib import Path

import gymnasium as gym
import numpy as np
from ray.rllib.algorithms.algorithm import Algorithm
from ray.rllib.core import DEFAULT_MODULE_ID
from ray.rllib.policy.sample_batch import MultiAgentBatch, SampleBatch
from ray.rllib.utils.annotations import override
from ray.rllib.utils.metrics import (
    ENV_RUNNER_RESULTS,
    ENV_RUNNER_SAMPLING_TIMER,
    LEARNER_RESULTS,
    LEARNER_UPDATE_TIMER,
    NUM_ENV_STEPS_SAMPLED_LIFETIME,
    SYNCH_WORKER_WEIGHTS_TIMER,
    TIMERS,
)

import envs
from algos.batch import pad_batch, prompt_advantages
from algos.evaluation import mean_results
from algos.tree_grpo.config import GRPOConfig, TreeGRPOConfig
from algos.tree_view import trees_html, with_advantages

ITERATION_TIME_S = "iteration_time_s"
PROMPTS = "prompts"
DEV_PREFIX = "dev_"  # greedy evaluation results: dev_em, dev_f1, dev_reward, dev_tool_calls, dev_turns, ...


class TreeGRPO(Algorithm):
    """Tree-GRPO (arXiv 2509.21240) on RLlib's new API stack; see ``TreeGRPOConfig`` for the settings."""

    @classmethod
    @override(Algorithm)
    def get_default_config(cls) -> TreeGRPOConfig:
        return TreeGRPOConfig()

    @override(Algorithm)
    def setup(self, config: TreeGRPOConfig) -> None:
        super().setup(config)
        env = gym.make(self.config.env, **dict(self.config.env_config))
        records = len(env.unwrapped.records)
        self._num_questions = min(records, self.config.train_questions or records)
        env.close()
        self.tree_files: list[Path] = []  # the tree renderings written by the last iteration, if any

    def _prompts_of(self, iteration: int) -> list[int]:
        """An iteration's prompts: a draw without replacement from the training split (its first
        ``train_questions`` when set), seeded by (seed, iteration) so that a run resumed from a checkpoint
        continues exactly as the uninterrupted run."""
        rng = np.random.default_rng([self.config.seed or 0, iteration])
        n = min(self.config.prompts_per_iteration, self._num_questions)
        return sorted(rng.choice(self._num_questions, size=n, replace=False).tolist())

    @override(Algorithm)
    def training_step(self) -> None:
        start = time.perf_counter()
        iteration = self.iteration
        self.tree_files = []
        prompts = self._prompts_of(iteration)
        remote = self.env_runner_group.num_remote_env_runners()
        shards = np.array_split(np.asarray(prompts), max(remote, 1))

        export = self.config.trees_every and (iteration + 1) % self.config.trees_every == 0
        per_runner = -(-self.config.trees_count // max(remote, 1)) if export else 0

        def sample(runner):
            shard = shards[runner.worker_index - 1] if remote else shards[0]
            records = runner.sample(prompt_indices=shard.tolist(), iteration=iteration)
            return records, runner.get_metrics(), runner.export_trees(per_runner) if per_runner else []

        with self.metrics.log_time((TIMERS, ENV_RUNNER_SAMPLING_TIMER)):
            results = self.env_runner_group.foreach_env_runner(sample, local_env_runner=remote == 0)
        records = [record for part, _, _ in results for record in part]
        self.metrics.aggregate([m for _, m, _ in results], key=ENV_RUNNER_RESULTS)
        self.metrics.log_value(NUM_ENV_STEPS_SAMPLED_LIFETIME, len(records), reduce="sum")

        advantages = prompt_advantages(records, mode=self.config.advantage_mode)
        if export:
            self._write_trees(results, advantages, iteration + 1)
        batch = MultiAgentBatch({DEFAULT_MODULE_ID: SampleBatch(pad_batch(records, advantages, pad_id=0))},
                                env_steps=len(records))
        with self.metrics.log_time((TIMERS, LEARNER_UPDATE_TIMER)):
            learner_results = self.learner_group.update(
                batch=batch, timesteps={NUM_ENV_STEPS_SAMPLED_LIFETIME: self.metrics.peek(
                    NUM_ENV_STEPS_SAMPLED_LIFETIME, default=0)}, num_epochs=1, minibatch_size=None)
        self.metrics.aggregate(learner_results, key=LEARNER_RESULTS)
        with self.metrics.log_time((TIMERS, SYNCH_WORKER_WEIGHTS_TIMER)):
            self.env_runner_group.sync_weights(from_worker_or_learner_group=self.learner_group, inference_only=True)
        self.metrics.log_value(PROMPTS, len(prompts), reduce="sum")
        self.metrics.log_value(ITERATION_TIME_S, time.perf_counter() - start, window=1)  # evaluation not included
        if self.config.dev_eval_every and (iteration + 1) % self.config.dev_eval_every == 0:
            means = self.greedy_eval(envs.eval_split(self.config.env), self.config.dev_eval_questions)
            for key, value in means.items():  # top-level result keys dev_em, dev_f1, ... (this iteration only)
                self.metrics.log_value(f"{DEV_PREFIX}{key}", value, reduce="sum")

    def _write_trees(self, results: list, advantages: np.ndarray, iteration: int) -> None:
        """``trees_count`` of this iteration's trees, with the advantages the learner gets, as
        ``TREES_DIR/iter_NNNNN.json`` and ``.html``; their paths go to ``self.tree_files``."""
        trees, offset = [], 0
        for part, _, exported in results:  # a runner's leaf indices count over its own records
            trees.extend(with_advantages(tree, advantages, offset) for tree in exported)
            offset += len(part)
        trees = trees[: self.config.trees_count]
        directory = Path(self.config.trees_dir or Path(self.logdir) / "trees")
        directory.mkdir(parents=True, exist_ok=True)
        stem = directory / f"iter_{iteration:05d}"
        stem.with_suffix(".json").write_text(json.dumps(trees, indent=1), encoding="utf-8")
        stem.with_suffix(".html").write_text(trees_html(trees, f"{type(self).__name__}, iteration {iteration}"),
                                             encoding="utf-8")
        self.tree_files = [stem.with_suffix(".json"), stem.with_suffix(".html")]

    def greedy_eval(self, split: str, num_questions: int, env_id: str | None = None) -> dict[str, float]:
        """Greedy single-chain evaluation on the first ``num_questions`` of ``split`` of ``env_id`` (default: the
        training env), spread over the runners: the means of ``algos.evaluation.EVAL_COLUMNS`` and
        ``questions``, the number evaluated."""
        remote = self.env_runner_group.num_remote_env_runners()
        shards = np.array_split(np.arange(num_questions), max(remote, 1))

        def evaluate(runner):
            shard = shards[runner.worker_index - 1] if remote else shards[0]
            return runner.greedy_eval(shard.tolist(), env_id or self.config.env, split)

        rows = [row for part in self.env_runner_group.foreach_env_runner(evaluate, local_env_runner=remote == 0)
                for row in part]
        return {**mean_results(rows), "questions": len(rows)}


class GRPO(TreeGRPO):
    """Chain GRPO through the same classes: ``group_size`` chains per prompt, advantages over the group."""

    @classmethod
    @override(TreeGRPO)
    def get_default_config(cls) -> GRPOConfig:
        return GRPOConfig()
