"""Tree-GRPO on RLlib: the config (settings in ``settings.py``) and the algorithm (sample trees -> advantages per
prompt -> one learner update -> weight sync), in one module as RLlib keeps ``PPOConfig`` and ``PPO``."""

from __future__ import annotations

import sys
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from ray.rllib.algorithms.algorithm import Algorithm
from ray.rllib.algorithms.algorithm_config import AlgorithmConfig, NotProvided
from ray.rllib.callbacks.utils import make_callback
from ray.rllib.core import DEFAULT_MODULE_ID
from ray.rllib.core.rl_module.rl_module import RLModuleSpec
from ray.rllib.env.env_runner_group import EnvRunnerGroup
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
from ray.util import log_once

import envs
from algos.batch import learner_shards, pad_batch, prompt_advantages
from algos.evaluation import QUESTIONS, mean_results
from algos.rollout import TreeShape
from algos.tree_grpo import metrics as metric_keys
from algos.tree_grpo.config_checks import (
    check_env_and_model,
    check_evaluation_settings,
    check_prompts_drawn,
    check_unused_rllib_options,
    is_search_space,
)
from algos.tree_grpo.env_runner import RunnerResult, TreeSearchEnvRunner
from algos.tree_grpo.learner import TreeGRPOTorchLearner
from algos.tree_grpo.learner_group import TreeGRPOLearnerGroup
from algos.tree_grpo.sampling_ahead import SamplingAhead
from algos.tree_grpo.settings import (
    ALGORITHM_FIELDS,
    CHAIN_GRPO_DERIVED,
    TreeGRPOSettings,
    check_learner_attention,
    check_learner_sharding,
    check_learner_threads,
    check_staleness,
    gpu_visible,
    validated,
)
from algos.tree_grpo.sharding import Started, answering_errors, run_sharded
from algos.tree_grpo.weight_transport import (
    colocated,
    deliver_weights,
    learner_seq_no,
    published_weights,
    sync_env_runners,
)
from algos.tree_view import with_advantages
from policies.generation import SamplingSettings
from policies.rl_module import LLMRLModule

RESTORE_POLL_S = 1.0  # between probes while waiting for a restarted env runner


class TreeGRPO(SamplingAhead, Algorithm):
    """Tree-GRPO (arXiv 2509.21240) on RLlib's new API stack; see ``TreeGRPOConfig`` for the settings.

    Besides RLlib's API: ``exported_trees`` (this iteration's trees for the trackers, with the learner's
    advantages), ``mid_update`` (True from the learner update until ``train()`` returns: weights changed, the
    iteration not yet counted) and ``greedy_eval`` (any env and split; ``evaluate()`` is the training env's
    evaluation split).

    An iteration's sample, with ``max_staleness`` 1 taken ahead during the previous update: ``SamplingAhead``
    (``algos/tree_grpo/sampling_ahead.py``).
    """

    @classmethod
    @override(Algorithm)
    def get_default_config(cls) -> TreeGRPOConfig:
        return TreeGRPOConfig(cls)

    @classmethod
    @override(Algorithm)
    def _should_create_evaluation_env_runners(cls, eval_config: AlgorithmConfig) -> bool:
        return False  # the greedy evaluation runs on the training runners: no second set of model copies

    @override(Algorithm)
    def setup(self, config: TreeGRPOConfig) -> None:
        self.mid_update = False
        self.exported_trees: list[dict[str, Any]] = []
        self._incarnations: dict[int, str] = {}  # remote runner -> the incarnation last seen (``_new_incarnations``)
        self._sampled_by: list[int] = []  # the runners that returned samples this iteration
        questions = envs.question_count(config.env, **dict(config.env_config))  # before the actors start
        check_prompts_drawn(config.settings.mini_batches, config.prompts_per_iteration, questions,
                            config.train_questions)
        self._num_questions = min(questions, config.train_questions or questions)
        super().setup(config)
        self._new_incarnations()

    @override(Algorithm)
    def step(self) -> dict:
        result = super().step()
        # here, not in train(): the callbacks see the result before it returns
        result[metric_keys.SAMPLED_BY] = self._sampled_by
        return result

    @override(Algorithm)
    def train(self) -> dict:
        result = super().train()
        self.mid_update = False  # only now is the update counted (iteration advanced)
        return result

    def _prompts_of(self, iteration: int) -> list[int]:
        """An iteration's prompts: a draw without replacement from the training split (its first
        ``train_questions`` when set), seeded by (seed, iteration) so that a run resumed from a checkpoint
        continues exactly as the uninterrupted run."""
        rng = np.random.default_rng([self.config.seed or 0, iteration])
        n = min(self.config.prompts_per_iteration, self._num_questions)
        return sorted(rng.choice(self._num_questions, size=n, replace=False).tolist())

    def _exports_trees(self, iteration: int) -> bool:
        """Whether ``iteration`` keeps sampled trees for the trackers (every ``trees_every`` iterations)."""
        return bool(self.config.trees_every) and (iteration + 1) % self.config.trees_every == 0

    @override(Algorithm)
    def training_step(self) -> None:
        start = time.perf_counter()
        iteration = self.iteration
        with self.metrics.log_time((TIMERS, ENV_RUNNER_SAMPLING_TIMER)):
            results = self._batch_of(iteration)
        ahead = self._start_ahead(iteration + 1)
        records = [record for result in results for record in result.records]
        self._sampled_by = sorted({result.worker_index for result in results})
        self.metrics.aggregate([result.metrics for result in results], key=ENV_RUNNER_RESULTS)
        # means over the leaves, logged here rather than by the runners: RLlib would average the runners' means,
        # and runners hold unequal shares of the prompts
        for key, values in ((metric_keys.REWARD, [record.reward for record in records]),
                            (metric_keys.EM, [record.info.get("em", 0.0) for record in records])):
            self.metrics.log_value((ENV_RUNNER_RESULTS, key), float(np.mean(values)), window=1)
        # the weights that sampled the batch (the oldest of its parts) and the updates since
        version = min(result.weights_seq_no for result in results)
        self.metrics.log_value(metric_keys.WEIGHTS_VERSION, version, window=1)
        self.metrics.log_value(metric_keys.STALENESS, learner_seq_no(self.learner_group) - version, window=1)
        # a lifetime sum: checkpointed with the algorithm's metrics, so a resumed run counts on from its checkpoint
        self.metrics.log_value(metric_keys.TOKENS_GENERATED_TOTAL, self.metrics.peek(
            (ENV_RUNNER_RESULTS, metric_keys.TOKENS_GENERATED), default=0), reduce="lifetime_sum")
        # where RLlib reads it (results, Tune's stop conditions, get_state): a lifetime sum of leaves, checkpointed
        self.metrics.log_value((ENV_RUNNER_RESULTS, NUM_ENV_STEPS_SAMPLED_LIFETIME), len(records),
                               reduce="lifetime_sum")

        advantages = prompt_advantages(records, mode=self.config.advantage_mode)
        export = self._exports_trees(iteration)
        self.exported_trees = annotated_trees(results, advantages, self.config.trees_count) if export else []
        self.metrics.log_value(metric_keys.NONZERO_ADVANTAGE_SHARE, nonzero_advantage_share(records, advantages),
                               window=1)
        alike = rewarded_alike(records)
        # kept as a lifetime sum of steps (+1, or back to 0), checkpointed with the algorithm's metrics, so that a
        # resumed run counts on (a window-1 value is cleared between iterations)
        self.metrics.log_value(metric_keys.UNIFORM_STREAK, 1 if alike else -self.uniform_streak,
                               reduce="lifetime_sum")
        skip = self.config.skip_uniform_rewards and alike
        self.metrics.log_value(metric_keys.UPDATE_SKIPPED, int(skip), window=1)
        self.metrics.log_value(metric_keys.UPDATES_SKIPPED_TOTAL, int(skip), reduce="lifetime_sum")
        self.metrics.log_value(metric_keys.PROMPTS, sum(len(result.prompt_indices) for result in results),
                               reduce="sum")
        if skip:  # every advantage is 0: no update, so the weights (and the runners' copies) stay as they are
            for key in (metric_keys.UPDATE_TIME_S, metric_keys.SYNC_TIME_S):
                self.metrics.log_value(key, 0.0, window=1)
            self._take_ahead(ahead)
            self.metrics.log_value(metric_keys.ITERATION_TIME_S, time.perf_counter() - start, window=1)
            return
        self.update_learners(records, advantages, ahead)
        # evaluation not included
        self.metrics.log_value(metric_keys.ITERATION_TIME_S, time.perf_counter() - start, window=1)

    def update_learners(self, records: Sequence, advantages: np.ndarray,
                        ahead: Callable[[], list[RunnerResult]] | None = None) -> None:
        """One learner update on the iteration's leaves, then the weight sync to the env runners. ``ahead``: the
        next iteration's sample, under way on the runners: the learners pack the new weights while it runs, and
        each runner loads them once it has returned it."""
        # mini-batches cut from the whole batch, each spread over the learners' shards (see learner_shards)
        arrays = learner_shards(pad_batch(records, advantages, pad_id=0), self.config.settings.mini_batches,
                                max(1, self.config.num_learners))
        batch = MultiAgentBatch({DEFAULT_MODULE_ID: SampleBatch(arrays)}, env_steps=len(records))
        self.mid_update = True  # from here until train() returns, the weights are ahead of the iteration count
        update_start = time.perf_counter()
        if self.config.vllm_sleep:  # one GPU for engine and learner: the engine steps aside during the update
            self.env_runner_group.foreach_env_runner(lambda runner: runner.sleep_generator())
        with self.metrics.log_time((TIMERS, LEARNER_UPDATE_TIMER)):
            learner_results = self.learner_group.update(
                batch=batch, timesteps={NUM_ENV_STEPS_SAMPLED_LIFETIME: self.metrics.peek(
                    (ENV_RUNNER_RESULTS, NUM_ENV_STEPS_SAMPLED_LIFETIME), default=0)}, num_epochs=1,
                minibatch_size=None)
        self.metrics.aggregate(learner_results, key=LEARNER_RESULTS)
        sync_start = time.perf_counter()
        if self.config.vllm_sleep:
            self.env_runner_group.foreach_env_runner(lambda runner: runner.wake_generator())
        with self.metrics.log_time((TIMERS, SYNCH_WORKER_WEIGHTS_TIMER)):
            in_process = colocated(self.learner_group, self.env_runner_group)
            weights = None if in_process else published_weights(self.learner_group)
            waited = self._take_ahead(ahead)
            if in_process:  # tensor to tensor
                sync_env_runners(self.learner_group, self.env_runner_group)
            else:
                deliver_weights(weights, self.env_runner_group)
        # this iteration's own times (RLlib's timers above are smoothed over iterations)
        self.metrics.log_value(metric_keys.UPDATE_TIME_S, sync_start - update_start, window=1)
        self.metrics.log_value(metric_keys.SYNC_TIME_S, time.perf_counter() - sync_start - waited, window=1)

    def on_env_runners(self, items: Sequence[int], call: Callable[[TreeSearchEnvRunner, list[int]], Any],
                       what: str, started: Started | None = None) -> list:
        """``call(runner, shard)`` on every healthy runner (the local one when there are no remote runners), the
        ``items`` split over them; the items of a runner that dies go to the runners healthy after a restore
        attempt (``algos.tree_grpo.sharding.run_sharded``). ``started``: the first round, already sent
        (``algos.tree_grpo.sampling_ahead.start_ahead``). ``call`` is shipped to the runners: it must not hold the
        algorithm."""
        group = self.env_runner_group
        remote = group.num_remote_env_runners() > 0

        def healthy() -> list[int]:
            return group.healthy_env_runner_ids() if remote else [0]

        def dispatch(shards: dict[int, list[int]]) -> dict[int, Any]:
            answers = group.foreach_env_runner(on_shards(call, shards), local_env_runner=not remote,
                                               remote_worker_ids=list(shards) if remote else None)
            return dict(answers)

        return run_sharded(items, healthy=healthy, dispatch=dispatch, recover=self._bring_runners_back, what=what,
                           started=started)

    def _bring_runners_back(self) -> None:
        """Restore the runners that are back after a failure. With no healthy runner left, wait for the restart
        (Ray fails calls to an actor that is still restarting), up to ``env_runner_restore_timeout_s``; with
        survivors, go on without waiting: they take over, and RLlib restores the restarted one before a later
        training step."""
        group = self.env_runner_group
        deadline = time.monotonic() + self.config.env_runner_restore_timeout_s
        self.restore_env_runners(group)
        while (self.config.restart_failed_env_runners and group.num_remote_env_runners() > 0
               and group.num_healthy_remote_env_runners() == 0 and time.monotonic() < deadline):
            time.sleep(RESTORE_POLL_S)
            self.restore_env_runners(group)

    @override(Algorithm)
    def restore_env_runners(self, env_runner_group: EnvRunnerGroup) -> list[int]:
        """The runners Ray restarted get the learner's current weights through the weight sync: those RLlib saw
        fail (its probe marks them healthy again) and those restarted unseen (killed between two calls: the next
        call reaches the new process, RLlib never hears of it), told by their new incarnation. All are counted as
        ``env_runner_restarts``. RLlib calls this before every training step, this class also after a runner
        failed mid-call. (RLlib's own restore would send the whole state dict, got from learner 0 alone.)"""
        restored = env_runner_group.probe_unhealthy_env_runners() if self.config.is_online else []
        unseen = ([index for index in self._new_incarnations() if index not in restored]
                  if env_runner_group is self.env_runner_group else [])
        if restored or unseen:
            sync_env_runners(self.learner_group, env_runner_group, to_worker_indices=restored + unseen)
        self.metrics.log_value(metric_keys.ENV_RUNNER_RESTARTS, len(restored) + len(unseen), reduce="sum")
        return restored + unseen

    def _new_incarnations(self) -> list[int]:
        """The healthy remote runners whose process changed since the last look (restarted by Ray)."""
        group = self.env_runner_group
        if group is None or group.num_remote_env_runners() == 0:
            return []
        seen = dict(group.foreach_env_runner(lambda runner: (runner.worker_index, runner.incarnation),
                                             local_env_runner=False))
        changed = sorted(index for index, incarnation in seen.items()
                         if self._incarnations.get(index, incarnation) != incarnation)
        self._incarnations.update(seen)
        return changed

    @override(Algorithm)
    def evaluate(self, parallel_train_future=None) -> dict[str, float]:
        """The greedy evaluation RLlib's settings ask for: ``evaluation_duration`` questions of the training env's
        evaluation split (``envs.eval_split``), on the training runners. ``train()`` calls it every
        ``evaluation_interval`` iterations and reports it under ``result["evaluation"]``: the means of
        ``algos.evaluation.EVAL_COLUMNS`` (em, f1, ...) and ``questions``, flat. The callbacks' ``on_evaluate_start``
        and ``on_evaluate_end`` (``evaluation_metrics``: those means) run around it, as RLlib's do."""
        make_callback("on_evaluate_start", callbacks_objects=self.callbacks,
                      callbacks_functions=self.config.callbacks_on_evaluate_start,
                      kwargs={"algorithm": self, "metrics_logger": self.metrics})
        results = self.greedy_eval(envs.eval_split(self.config.env), self.config.evaluation_duration)
        make_callback("on_evaluate_end", callbacks_objects=self.callbacks,
                      callbacks_functions=self.config.callbacks_on_evaluate_end,
                      kwargs={"algorithm": self, "metrics_logger": self.metrics, "evaluation_metrics": results})
        return results

    @property
    def tokens_generated_total(self) -> int:
        """Tokens the run has generated so far (its iterations before a resume included)."""
        return round(self.metrics.peek(metric_keys.TOKENS_GENERATED_TOTAL, default=0))

    @property
    def uniform_streak(self) -> int:
        """Iterations in a row, the last one last, in which every prompt's leaves were rewarded alike (every
        advantage 0): how long the run has had nothing to learn from the prompts it drew."""
        return round(self.metrics.peek(metric_keys.UNIFORM_STREAK, default=0))

    def greedy_eval(self, split: str, num_questions: int, env_id: str | None = None) -> dict[str, float]:
        """Greedy single-chain evaluation on the first ``num_questions`` of ``split`` of ``env_id`` (default: the
        training env), spread over the runners in rounds of ``prompts_per_iteration * M`` questions (the chains
        an iteration starts together, so a round fits where training fits): the means of
        ``algos.evaluation.EVAL_COLUMNS`` and ``questions``, the number evaluated."""
        env_id = env_id or self.config.env
        total = min(num_questions, envs.question_count(env_id, **{**dict(self.config.env_config), "split": split}))
        round_size = self.config.prompts_per_iteration * self.config.tree_shape.M
        start, rows = time.perf_counter(), []
        if self.config.log_rollout_steps:
            print(f"  [evaluation] {env_id} {split}: evaluating on {total} questions (greedy, one chain each) ...",
                  file=sys.stderr, flush=True)

        def evaluate(runner: TreeSearchEnvRunner, shard: list[int]) -> list[dict[str, float]]:
            return runner.greedy_eval(shard, env_id, split)

        for first in range(0, total, round_size):
            questions = range(first, min(first + round_size, total))
            parts = self.on_env_runners(questions, evaluate, f"greedy evaluation on {env_id} {split}")
            rows += [row for part in parts for row in part]
            if self.config.log_rollout_steps:
                print(f"  [evaluation] {env_id} {split}: {len(rows)}/{total} questions, "
                      f"{time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
        return {**mean_results(rows), QUESTIONS: len(rows)}


def on_shards(call: Callable[[TreeSearchEnvRunner, list[int]], Any],
              shards: dict[int, list[int]]) -> Callable[[TreeSearchEnvRunner], tuple[int, Any]]:
    """The function a runner runs: ``call`` on its own shard, answered with its index (an exception ``call`` raises
    is the answer: ``answering_errors``)."""
    guarded = answering_errors(call)

    def apply(runner: TreeSearchEnvRunner) -> tuple[int, Any]:
        return runner.worker_index, guarded(runner, shards[runner.worker_index])

    return apply


def annotated_trees(results: Sequence[RunnerResult], advantages: np.ndarray, limit: int) -> list[dict[str, Any]]:
    """The first ``limit`` exported trees of ``results`` with the advantages the learner gets (``advantages``
    holds one per record of all results, concatenated in order; a runner's leaf indices count over its own
    records, hence the offset)."""
    trees, offset = [], 0
    for result in results:
        trees.extend(with_advantages(tree, advantages, offset) for tree in result.trees)
        offset += len(result.records)
    return trees[:limit]


def rewarded_alike(records: Sequence) -> bool:
    """Whether every prompt's leaves in ``records`` got one reward (so every group-relative advantage is 0)."""
    rewards: dict[int, set[float]] = {}
    for record in records:
        rewards.setdefault(record.prompt_index, set()).add(float(record.reward))
    return all(len(seen) == 1 for seen in rewards.values())


def nonzero_advantage_share(records: Sequence, advantages: np.ndarray) -> float:
    """The share of the prompts in ``records`` with a non-zero advantage on at least one leaf (``advantages``: one
    per record): the prompts the update learns from (a group whose leaves were rewarded alike gives each 0)."""
    signal: dict[int, bool] = {}
    for record, advantage in zip(records, advantages, strict=True):
        signal[record.prompt_index] = signal.get(record.prompt_index, False) or bool(advantage != 0)
    return sum(signal.values()) / len(signal) if signal else 0.0


GRAD_CLIP_MODES = ("value", "norm", "global_norm")  # what RLlib's Learner.postprocess_gradients understands


class TreeGRPOConfig(AlgorithmConfig):
    """Tree-GRPO on RLlib's new API stack: ``TreeGRPOConfig().environment("HotpotQA-v0").training(M=2, N=2, L=1)``.

    The fields of :class:`~algos.tree_grpo.settings.TreeGRPOSettings` (declared and documented there) are set
    through ``.training(...)``, checked strictly when set; chain GRPO is ``.training(algo="grpo", group_size=G)``.
    The model is chosen through ``.rl_module(model_config={"model": ..., "dtype": ...})``; the greedy
    evaluation through RLlib's ``.evaluation(evaluation_interval=k, evaluation_duration=questions)``.
    """

    def __init__(self, algo_class: type | None = None):
        super().__init__(algo_class=algo_class or TreeGRPO)
        for name, value in TreeGRPOSettings().model_dump().items():
            setattr(self, name, value)
        self._derived_as_set = self._chain_fields()
        self.env_runner_cls = TreeSearchEnvRunner
        self.episodes_to_numpy = False  # ragged token lists; our runner returns leaf records
        self.num_env_runners = 0
        # RLlib sleeps this long before a failed remote runner's actor restarts (default 60 s)
        self.delay_between_env_runner_restarts_s = 5.0

    @override(AlgorithmConfig)
    def training(self, **kwargs) -> TreeGRPOConfig:
        """RLlib's ``training``, and the fields of :class:`~algos.tree_grpo.settings.TreeGRPOSettings` (``M``, ``N``,
        ``L``, ``algo``, ``group_size``, ``lr``, ``kl_coef``, ``temperature``, ``ppo_epochs``, ...; each documented
        there), checked where they are set: a wrong value, or a shape chain GRPO would replace, is a ``ValueError``
        naming the field. Numpy scalars (a Tune sample) are taken as the Python numbers they hold; a Ray Tune search
        space (``tune.grid_search([...])``, ``tune.choice``, ``tune.loguniform``, ...) is kept as it is, for Tune to
        resolve per trial, whose config is checked then."""
        ours = {k: kwargs.pop(k) for k in list(kwargs) if k in ALGORITHM_FIELDS and kwargs[k] is not NotProvided}
        ours = {k: v.item() if isinstance(v, np.generic) else v for k, v in ours.items()}
        super().training(**kwargs)
        if not ours:
            return self
        if ours.get("algo") == "tree_grpo" and self.algo == "grpo":  # the chain's shape was derived, not chosen
            defaults = TreeGRPOSettings().model_dump()
            ours = {**{name: defaults[name] for name in CHAIN_GRPO_DERIVED}, **ours}
        given = {**self.settings_dict(), **ours}
        searched = {name for name, value in given.items() if is_search_space(value)}
        for name in searched & ours.keys():
            setattr(self, name, ours.pop(name))
        values = validated(TreeGRPOSettings, {k: v for k, v in given.items() if k not in searched}).model_dump()
        replaced = [f"{name}={ours[name]!r}" for name in CHAIN_GRPO_DERIVED
                    if name in ours and values[name] != ours[name]]
        if replaced:
            raise ValueError(f"algo='grpo' is chain GRPO, whose {', '.join(CHAIN_GRPO_DERIVED)} follow from "
                             f"group_size (G chains, advantages over the group): {', '.join(replaced)} would be "
                             f"replaced; set group_size, or algo='tree_grpo' for a tree")
        for name, value in values.items():
            if name not in searched:
                setattr(self, name, value)
        self._derived_as_set = self._chain_fields()
        return self

    def _chain_fields(self) -> dict[str, Any]:
        """The fields chain GRPO derives from group_size (``CHAIN_GRPO_DERIVED``), as they are now. Kept as
        ``.training()`` left them: where they still are so when ``algo`` or ``group_size`` were assigned since (a
        Tune trial sets its sampled values as attributes), ``validate()`` derives them again instead of refusing."""
        return {name: getattr(self, name) for name in CHAIN_GRPO_DERIVED}

    def settings_dict(self) -> dict[str, Any]:
        """The current values of the settings fields."""
        return {name: getattr(self, name) for name in ALGORITHM_FIELDS}

    @property
    def settings(self) -> TreeGRPOSettings:
        """The settings fields, validated (a Ray Tune search space among them is named: Tune resolves it per trial,
        and the trial's config is the one to check)."""
        self._check_resolved()
        return validated(TreeGRPOSettings, self.settings_dict())

    def _check_resolved(self) -> None:
        searched = sorted(name for name, value in self.settings_dict().items() if is_search_space(value))
        if searched:
            raise ValueError(f"{', '.join(searched)}: a Ray Tune search space, resolved per trial when Tune builds "
                             f"the trial's config (tune.Tuner(TreeGRPO, param_space=config)); each trial's is checked")

    @property
    def tree_shape(self) -> TreeShape:
        return TreeShape(self.M, self.N, self.L)

    @property
    def sampling(self) -> SamplingSettings:
        return self.settings.sampling

    @override(AlgorithmConfig)
    def validate(self) -> None:
        # Tree-GRPO exists only on the new API stack: RLlib's once-per-process notice that it is on would be the
        # first line of every error found before Ray starts.
        log_once(f"{self.algo_class.__name__}_on_new_api_stack")
        self._check_resolved()  # before RLlib's own checks, which would name a search space as a bad value
        # the driver samples only without remote runners: beside them its runner would hold a model copy that no
        # weight sync reaches (``get_module()`` and checkpoints would show the start's weights)
        self.create_local_env_runner = self.num_env_runners == 0
        if not self.in_evaluation:  # RLlib's evaluation copy sets its own rollout_fragment_length
            check_unused_rllib_options(self)
            if gpu_visible() and not self.num_gpus_per_learner and log_once("tree_grpo_learner_on_cpu"):
                warnings.warn("a GPU is visible, so the rollouts' defaults are the GPU's, but the learner trains on "
                              "the CPU (RLlib's num_gpus_per_learner 0): set .learners(num_gpus_per_learner=1) "
                              "(run.py: --num-gpus-per-learner 1) to train on the GPU", stacklevel=2)
        super().validate()
        check_evaluation_settings(self)
        settings = self.settings.model_dump()
        changed = {k: v for k, v in settings.items() if v != getattr(self, k)}
        if changed and self._chain_fields() == getattr(self, "_derived_as_set", None):
            for name in changed:  # algo or group_size assigned after .training() (a Tune trial): derived again
                setattr(self, name, settings[name])
            self._derived_as_set = self._chain_fields()
        elif changed:  # only chain GRPO's normalisation changes values
            raise ValueError(f"algo='grpo' is chain GRPO whose shape follows from group_size: set it with "
                             f".training(algo='grpo', group_size=G), not {sorted(changed)} by hand")
        if self.num_env_runners > self.prompts_per_iteration:
            raise ValueError(f"num_env_runners ({self.num_env_runners}) must not exceed prompts_per_iteration "
                             f"({self.prompts_per_iteration}): every runner grows the trees of its own prompts")
        rows = self.prompts_per_iteration * self.tree_shape.leaves_per_prompt // max(1, self.num_learners)
        if self.settings.mini_batches > rows:
            raise ValueError(f"ppo_mini_batches ({self.settings.mini_batches}) exceeds the rows each of the "
                             f"{max(1, self.num_learners)} learner(s) gets ({rows})")
        check_learner_sharding(self.learner_sharding, self.num_learners)
        check_learner_threads(self.learner_threads, self.num_learners)
        check_learner_attention(self.learner_attention, self.num_gpus_per_learner)
        if not self.in_evaluation:  # RLlib's copy for the evaluation has its own runner count (0: it runs on ours)
            check_staleness(self.max_staleness, self.num_env_runners)
        if self.grad_clip_by not in GRAD_CLIP_MODES:  # .training() checks it, a plain assignment does not
            raise ValueError(f"grad_clip_by must be one of {GRAD_CLIP_MODES}, got {self.grad_clip_by!r}")
        check_env_and_model(self)

    @property
    @override(AlgorithmConfig)
    def _model_config_auto_includes(self) -> dict[str, Any]:
        # the module's initial weights (a model built in-process, LoRA's adapters) follow .debugging(seed=...) unless
        # model_config names its own seed (RLlib merges the user's model_config over these)
        return {**super()._model_config_auto_includes, **({} if self.seed is None else {"seed": self.seed})}

    @override(AlgorithmConfig)
    def get_default_rl_module_spec(self) -> RLModuleSpec:
        # No model_config here: RLlib merges the default spec's model_config OVER the user's
        # ``.rl_module(model_config=...)``; the module's own defaults (tiny-random) apply to missing keys.
        return RLModuleSpec(module_class=LLMRLModule)

    @override(AlgorithmConfig)
    def get_default_learner_class(self) -> type:
        return TreeGRPOTorchLearner

    @override(AlgorithmConfig)
    def build_learner_group(self, *, env=None, spaces=None, rl_module_spec=None,
                            placement_group=None) -> TreeGRPOLearnerGroup:
        """RLlib's learner group, as ``TreeGRPOLearnerGroup``: sharded learners gather, save and restore their
        state together (``algos/tree_grpo/learner_group.py``)."""
        if rl_module_spec is None:
            rl_module_spec = self.get_multi_rl_module_spec(env=env, spaces=spaces)
        return TreeGRPOLearnerGroup(config=self.copy(), module_spec=rl_module_spec, placement_group=placement_group)
