"""The Tree-GRPO learner, built directly in this process (no Ray actors): gradient accumulation over
micro-batches, PPO mini-batches and epochs, old log-probs from the sampler or recomputed, truncated importance
sampling, the learning-rate schedule and its resumption from learner state, gradient clipping modes, metrics."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ray.rllib.core import DEFAULT_MODULE_ID
from ray.rllib.policy.sample_batch import MultiAgentBatch, SampleBatch
from ray.rllib.utils.metrics import NUM_ENV_STEPS_SAMPLED_LIFETIME

import policies.logprobs as logprobs
from algos.batch import ADVANTAGES as ADVANTAGES_KEY
from algos.batch import INPUT_IDS, PROMPT_INDEX, SAMPLING_LOGPROBS, LeafRecord, micro_batch_slices, pad_batch
from algos.losses import masked_mean
from algos.tree_grpo import TreeGRPOConfig
from algos.tree_grpo import metrics as metric_keys
from algos.tree_grpo.learner import OPTIMIZER_STEPS, TreeGRPOTorchLearner
from envs.search_qa import UnicodeText
from policies.logprobs import GENERATED_MASK, LOGPROBS
from policies.prefix_packing import build_prefix_trie
from policies.trajectory import TokenTrajectory

LR = 1e-3
ADAM_EPS = 1e-8  # torch's AdamW default, which the learner uses
ADVANTAGES = (1.0, -1.0, 0.5, -0.5, 0.25)


ONE_STEP = {"ppo_mini_batches": 1, "old_logprobs": "recompute", "tis_cap": None}  # one on-policy step per update


def build_learner(dtype: str = "float32", *, model_config: dict | None = None, **training) -> TreeGRPOTorchLearner:
    """A learner over a fresh tiny-random model (seeded: every learner starts from the same weights); one
    on-policy optimizer step per update unless ``training`` says otherwise; ``model_config`` adds module keys."""
    config = (TreeGRPOConfig().rl_module(model_config={"model": "tiny-random", "dtype": dtype, **(model_config or {})})
              .training(**{"lr": LR, **ONE_STEP, **training}))
    text = UnicodeText(100)
    return config.build_learner(spaces={DEFAULT_MODULE_ID: (text, text)})


def synthetic_records(seed: int = 0) -> list[LeafRecord]:
    """Five trajectories of different lengths: a prompt, then sampled steps and observations in turn."""
    rng = np.random.default_rng(seed)
    records = []
    for row, advantage in enumerate(ADVANTAGES):
        trajectory = TokenTrajectory.from_prompt(tuple(int(t) for t in rng.integers(5, 200, 4)))
        for _ in range(1 + row % 2):
            trajectory = trajectory.with_observation(tuple(int(t) for t in rng.integers(5, 200, 2)))
            step = tuple(int(t) for t in rng.integers(5, 200, 3 + row))
            trajectory = TokenTrajectory(trajectory.token_ids + step, trajectory.generated_mask + (True,) * len(step),
                                         trajectory.sampling_logprobs + tuple(rng.uniform(-6.0, -1.0, len(step))))
        records.append(LeafRecord(prompt_index=0, tree_id=row % 2, depth=1, trajectory=trajectory, reward=advantage))
    return records


def synthetic_arrays(seed: int = 0) -> dict[str, np.ndarray]:
    """The synthetic records as the learner's padded batch."""
    return pad_batch(synthetic_records(seed), np.asarray(ADVANTAGES), pad_id=0)


@pytest.fixture(scope="module")
def arrays() -> dict[str, np.ndarray]:
    return synthetic_arrays()


def update(learner: TreeGRPOTorchLearner, arrays: dict[str, np.ndarray]) -> dict[str, float]:
    """One learner update on the whole batch; this module's logged metrics as plain floats."""
    batch = MultiAgentBatch({DEFAULT_MODULE_ID: SampleBatch({k: v.copy() for k, v in arrays.items()})},
                            env_steps=len(arrays[INPUT_IDS]))
    results = learner.update(batch=batch, timesteps={NUM_ENV_STEPS_SAMPLED_LIFETIME: len(arrays[INPUT_IDS])})
    return {key: float(stats.peek()) for key, stats in results[DEFAULT_MODULE_ID].items()}


def weights(learner: TreeGRPOTorchLearner) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in learner.module[DEFAULT_MODULE_ID].model.state_dict().items()}


def gradients(learner: TreeGRPOTorchLearner) -> dict[str, torch.Tensor]:
    """The gradients the last optimizer step applied (after clipping)."""
    model = learner.module[DEFAULT_MODULE_ID].model
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def adam_state(learner: TreeGRPOTorchLearner) -> dict:
    """A copy of the AdamW per-parameter state (the optimizer updates its tensors in place)."""
    state = learner.get_optimizer(DEFAULT_MODULE_ID).state_dict()["state"]
    return {index: {k: torch.as_tensor(v).clone() for k, v in per_param.items()} for index, per_param in state.items()}


def assert_same_adam_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and a
    for index in a:
        assert a[index].keys() == b[index].keys()
        for key in a[index]:  # step, exp_avg, exp_avg_sq
            assert torch.equal(a[index][key], b[index][key]), (index, key)


# --- resuming: the warm-up position and the AdamW moments are part of the learner's state -----------------

def restore_by_state(old: TreeGRPOTorchLearner, new: TreeGRPOTorchLearner, tmp_path) -> None:
    new.set_state(old.get_state())


def restore_by_checkpoint(old: TreeGRPOTorchLearner, new: TreeGRPOTorchLearner, tmp_path) -> None:
    old.save_to_path(tmp_path / "learner")
    new.restore_from_path(tmp_path / "learner")


@pytest.mark.parametrize("restore", [restore_by_state, restore_by_checkpoint])
def test_resuming_continues_the_warm_up_and_the_optimizer_bit_for_bit(arrays, restore, tmp_path):
    straight = build_learner(warmup_steps=4)
    straight_lrs = [update(straight, arrays)[metric_keys.LEARNING_RATE] for _ in range(3)]

    first = build_learner(warmup_steps=4)
    resumed_lrs = [update(first, arrays)[metric_keys.LEARNING_RATE]]
    resumed = build_learner(warmup_steps=4)
    restore(first, resumed, tmp_path)
    restored_adam = adam_state(resumed)
    resumed_lrs += [update(resumed, arrays)[metric_keys.LEARNING_RATE] for _ in range(2)]

    assert resumed_lrs == straight_lrs == [LR / 4, LR * 2 / 4, LR * 3 / 4]
    final, expected = weights(resumed), weights(straight)
    assert final.keys() == expected.keys()
    assert all(torch.equal(final[k], expected[k]) for k in expected)
    assert_same_adam_state(restored_adam, adam_state(first))
    assert_same_adam_state(adam_state(resumed), adam_state(straight))
    assert first.get_state()[OPTIMIZER_STEPS] == 1 and resumed.get_state()[OPTIMIZER_STEPS] == 3


@pytest.mark.filterwarnings("ignore:pure_bf16")
def test_a_bfloat16_learner_checkpoints_its_optimizer(arrays, tmp_path):
    pure = {"pure_bf16": True}  # bf16 AdamW moments (mixed precision keeps them float32)
    learner = build_learner(dtype="bfloat16", model_config=pure)
    update(learner, arrays)
    learner.save_to_path(tmp_path / "learner")  # numpy has no bfloat16: RLlib's own optimizer state fails here
    restored = build_learner(dtype="bfloat16", model_config=pure)
    restored.restore_from_path(tmp_path / "learner")
    state = adam_state(restored)
    assert state[0]["exp_avg"].dtype == torch.bfloat16
    assert_same_adam_state(state, adam_state(learner))


def test_the_step_counter_travels_with_the_optimizer_state(arrays):
    learner = build_learner(warmup_steps=4)
    update(learner, arrays)
    assert learner.get_state(not_components="optimizer").keys().isdisjoint({OPTIMIZER_STEPS})
    fresh = build_learner(warmup_steps=4)
    fresh.set_state(learner.get_state(components="rl_module"))  # weights only: a fresh optimizer warms up again
    assert fresh._optimizer_steps == 0


# --- warm-up --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("warmup_steps", "expected"), [(3, [LR / 3, LR * 2 / 3, LR, LR, LR]), (0, [LR] * 5)])
def test_warm_up_is_linear_then_constant(arrays, warmup_steps, expected):
    learner = build_learner(warmup_steps=warmup_steps)
    logged = [update(learner, arrays) for _ in expected]
    assert [m[metric_keys.LEARNING_RATE] for m in logged] == pytest.approx(expected, rel=1e-12)
    # RLlib's own learning-rate metric reads the optimizer: it must show the warmed-up rate, not config.lr
    assert [m["default_optimizer_learning_rate"] for m in logged] == pytest.approx(expected, rel=1e-12)


# --- micro-batches: the loss is a token-mean over the whole update ------------------------------------------

TWO_PROMPTS = np.array([3, 3, 8, 8, 8])  # rows of 9 and 16 tokens; 11, 20 and 13 (no two rows share a token)


@pytest.fixture(scope="module")
def whole_batch_update(arrays):
    """The metrics, applied gradients and weights of one update on the whole batch at once."""
    learner = build_learner(micro_batch_size=len(arrays[INPUT_IDS]), prefix_sharing=False)
    return update(learner, {**arrays, PROMPT_INDEX: TWO_PROMPTS}), gradients(learner), weights(learner)


@pytest.mark.parametrize("training, micro_batches", [
    ({"micro_batch_size": 1, "prefix_sharing": False}, 5),
    # a last micro-batch of one row: shares must weigh by tokens, not rows
    ({"micro_batch_size": 2, "prefix_sharing": False}, 3),
    ({"micro_batch_tokens": 25, "prefix_sharing": False}, 4),  # 9 + 16 | 11 | 20 | 13
    ({"micro_batch_tokens": 1, "prefix_sharing": False}, 5),
    ({"micro_batch_tokens": 25, "prefix_sharing": True}, 2),  # whole prompt groups: 25 | 44
])
def test_micro_batches_give_the_loss_gradients_and_step_of_the_whole_batch(arrays, whole_batch_update, training,
                                                                            micro_batches):
    batch = {**arrays, PROMPT_INDEX: TWO_PROMPTS}
    settings = {"micro_batch_size": 4, "micro_batch_tokens": None, **training}
    assert len(micro_batch_slices(batch, share_prefixes=settings.pop("prefix_sharing"), max_rows=settings[
        "micro_batch_size"], max_tokens=settings["micro_batch_tokens"])) == micro_batches
    metrics, grads, final = whole_batch_update
    scale = max(g.abs().max().item() for g in grads.values())
    assert metrics[metric_keys.GRAD_NORM] > 0
    initial = weights(build_learner())
    assert max((final[k] - initial[k]).abs().max().item() for k in final) > LR / 2  # the step moved the weights
    learner = build_learner(**training)
    other_metrics, other_grads, other_final = update(learner, batch), gradients(learner), weights(learner)
    for key in ("total_loss", metric_keys.POLICY_LOSS, metric_keys.KL, metric_keys.ENTROPY, metric_keys.GRAD_NORM,
                metric_keys.TRAINED_TOKENS):
        assert other_metrics[key] == pytest.approx(metrics[key], rel=1e-5, abs=1e-7), key
    assert other_grads.keys() == grads.keys()
    for name in grads:  # fp32 summation noise is relative to the largest gradients, not to each element
        torch.testing.assert_close(other_grads[name], grads[name], rtol=1e-4, atol=1e-5 * scale)
    # Adam's first step is lr * g / (|g| + eps): where |g| is near eps (1e-8) the fp32 noise of g moves it by a
    # good part of lr, so the weights are compared where |g| is well above eps (about half of them here); a
    # wrongly weighted gradient flips signs there, which moves a weight by 2 lr
    for name, grad in grads.items():
        steady = grad.abs() > 100 * ADAM_EPS
        torch.testing.assert_close(other_final[name][steady], final[name][steady], rtol=0, atol=LR / 100)


def test_each_micro_batch_is_packed_once_per_update(arrays, monkeypatch):
    """Old and reference log-probs, and two epochs of two mini-batches: one trie per micro-batch."""
    built = []
    monkeypatch.setattr(logprobs, "build_prefix_trie", lambda *args: built.append(1) or build_prefix_trie(*args))
    learner = build_learner(ppo_mini_batches=2, ppo_epochs=2, kl_coef=0.1, prefix_sharing=True)
    metrics = update(learner, {**arrays, PROMPT_INDEX: TWO_PROMPTS})
    assert metrics[metric_keys.OPTIMIZER_STEPS] == 4 and len(built) == 2


# --- gradient clipping ----------------------------------------------------------------------------------------

CLIP = 1e-3


@pytest.fixture(scope="module")
def clipped(arrays) -> dict[str, tuple[dict[str, float], dict[str, torch.Tensor]]]:
    """Per grad_clip_by mode: the metrics and the applied gradients of one update with a tight clip."""
    out = {}
    for mode in ("global_norm", "norm", "value"):
        learner = build_learner(grad_clip=CLIP, grad_clip_by=mode)
        out[mode] = update(learner, arrays), gradients(learner)
    return out


def global_norm(grads: dict[str, torch.Tensor]) -> float:
    return float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads.values()])))


def test_grad_norm_is_the_norm_before_clipping_whatever_the_mode(clipped):
    norms = [metrics[metric_keys.GRAD_NORM] for metrics, _ in clipped.values()]
    assert norms[0] > 100 * CLIP and norms == pytest.approx([norms[0]] * 3, rel=1e-6)


def test_clip_by_global_norm(clipped):
    assert global_norm(clipped["global_norm"][1]) == pytest.approx(CLIP, rel=1e-4)


def test_clip_by_norm_clips_each_tensor(clipped):
    grads = clipped["norm"][1]
    norms = torch.stack([g.norm() for g in grads.values()])
    assert norms.max().item() == pytest.approx(CLIP, rel=1e-4)
    assert global_norm(grads) > 2 * CLIP  # not one global scaling


def test_clip_by_value_clips_each_element(clipped):
    grads = clipped["value"][1]
    assert max(g.abs().max().item() for g in grads.values()) == pytest.approx(CLIP, rel=1e-6)
    assert global_norm(grads) > 2 * CLIP


# --- a non-finite gradient norm: the step is skipped (verl), or RLlib zeroes the bad entries and steps ------------

def with_nan_advantage(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    advantages = arrays[ADVANTAGES_KEY].copy()
    advantages[0] = np.nan
    return {**arrays, ADVANTAGES_KEY: advantages}


@pytest.mark.parametrize("skip", [True, False])
def test_a_non_finite_gradient_norm_skips_the_step_unless_switched_off(arrays, skip):
    learner = build_learner(skip_nonfinite_grad=skip)
    before = weights(learner)
    metrics = update(learner, with_nan_advantage(arrays))
    # the NaN norm is reported, not hidden as 0
    assert np.isnan(metrics[metric_keys.GRAD_NORM]) and metrics[metric_keys.NONFINITE_GRAD_SHARE] == 1.0
    after = weights(learner)
    moved = any(not torch.equal(before[k], after[k]) for k in before)
    assert moved is not skip  # skipped: the weights and AdamW's moments stay; off: a (decayed) step is taken
    assert (adam_state(learner) == {}) is skip
    assert all(torch.isfinite(w).all() for w in after.values())
    assert update(learner, arrays)[metric_keys.NONFINITE_GRAD_SHARE] == 0.0  # the next finite batch trains as usual


# --- dual clip, acting in the learner's update ------------------------------------------------------------------

@pytest.mark.parametrize("dual_clip", [3.0, None])
def test_dual_clip_caps_negative_advantage_tokens_in_the_update(arrays, dual_clip):
    """Every advantage negative and every ratio exp(4) > 3: with dual clip the policy loss is the constant
    -A * 3 on every token, so no gradient flows (KL and entropy off); without it, -A * ratio has one."""
    learner = build_learner(dual_clip=dual_clip, old_logprobs="sampler", kl_coef=0.0, entropy_coef=0.0)
    current = initial_logprobs(arrays).numpy()
    old = np.where(arrays[GENERATED_MASK] > 0, current - 4.0, arrays[SAMPLING_LOGPROBS]).astype(np.float32)
    negative = {**arrays, SAMPLING_LOGPROBS: old, ADVANTAGES_KEY: -np.abs(arrays[ADVANTAGES_KEY])}
    metrics = update(learner, negative)
    assert metrics[metric_keys.RATIO_MIN] == pytest.approx(np.exp(4.0), rel=1e-4)
    if dual_clip is None:
        assert metrics[metric_keys.DUAL_CLIP_FRACTION] == 0.0 and metrics[metric_keys.GRAD_NORM] > 1e-3
    else:
        assert metrics[metric_keys.DUAL_CLIP_FRACTION] == 1.0 and metrics[metric_keys.GRAD_NORM] == 0.0
        weighted = (-negative[ADVANTAGES_KEY] * arrays[GENERATED_MASK].sum(1)).sum() / arrays[GENERATED_MASK].sum()
        assert metrics[metric_keys.POLICY_LOSS] == pytest.approx(dual_clip * weighted, rel=1e-5)


# --- metrics of one update --------------------------------------------------------------------------------------

def test_metrics_of_a_first_update(arrays):
    learner = build_learner(micro_batch_size=2)
    module = learner.module[DEFAULT_MODULE_ID]
    tensors = {k: torch.from_numpy(v) for k, v in arrays.items()}
    with torch.no_grad():
        initial = module.forward_train(tensors)[LOGPROBS]
    metrics = update(learner, arrays)
    mask = tensors[GENERATED_MASK]
    assert metrics[metric_keys.TRAINED_TOKENS] == mask.sum().item()
    # the old log-probs are recomputed from the current weights: the first step is exactly on-policy
    for key in (metric_keys.RATIO_MEAN, metric_keys.RATIO_MAX, metric_keys.RATIO_MIN):
        assert metrics[key] == pytest.approx(1.0, abs=1e-6), key
    assert metrics[metric_keys.CLIP_FRACTION] == 0.0 and metrics[metric_keys.DUAL_CLIP_FRACTION] == 0.0
    # ratio 1: the policy loss is minus the token-weighted mean advantage; the reference is the current policy
    tokens_per_row = mask.sum(1)
    expected_policy_loss = -(tensors["advantages"] * tokens_per_row).sum() / tokens_per_row.sum()
    assert metrics[metric_keys.POLICY_LOSS] == pytest.approx(expected_policy_loss.item(), rel=1e-5)
    assert metrics[metric_keys.KL] == pytest.approx(0.0, abs=1e-7)
    assert metrics[metric_keys.ENTROPY] > 0
    cfg = learner.config
    assert metrics["total_loss"] == pytest.approx(
        metrics[metric_keys.POLICY_LOSS] + cfg.kl_coef * metrics[metric_keys.KL]
        - cfg.entropy_coef * metrics[metric_keys.ENTROPY], rel=1e-5)
    gap = masked_mean((tensors["sampling_logprobs"] - initial).abs(), mask)
    assert metrics[metric_keys.SAMPLER_LOGPROB_GAP] == pytest.approx(gap.item(), rel=1e-5)
    assert metrics[metric_keys.GRAD_NORM] > 0 and np.isfinite(metrics[metric_keys.GRAD_NORM])
    assert metrics[metric_keys.LEARNING_RATE] == LR
    assert 0.05 < metrics[metric_keys.LEARNER_PEAK_MEMORY_GIB] < 1024  # CPU: the process's peak resident set


# --- PPO mini-batches, epochs, the old log-probs, truncated importance sampling, the schedule --------------------

def two_prompts(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {**arrays, PROMPT_INDEX: np.array([3, 3, 8, 8, 8])}


def initial_logprobs(arrays: dict[str, np.ndarray]) -> torch.Tensor:
    module = build_learner().module[DEFAULT_MODULE_ID]
    with torch.no_grad():
        return module.forward_train({k: torch.from_numpy(v) for k, v in arrays.items()})[LOGPROBS]


def test_the_second_mini_batch_step_sees_a_moved_policy_and_clips(arrays):
    learner = build_learner(ppo_mini_batches=2, clip_eps=0.01, lr=1e-2)
    metrics = update(learner, two_prompts(arrays))
    assert metrics[metric_keys.OPTIMIZER_STEPS] == 2 and learner._optimizer_steps == 2
    # no longer exactly 1
    assert metrics[metric_keys.RATIO_MAX] > 1.0 + 1e-3 or metrics[metric_keys.RATIO_MIN] < 1.0 - 1e-3
    assert metrics[metric_keys.CLIP_FRACTION] > 0  # a mean over both steps: the first (on-policy) one clips nothing


def test_epochs_repeat_the_mini_batches(arrays):
    learner = build_learner(ppo_mini_batches=2, ppo_epochs=3)
    assert update(learner, two_prompts(arrays))[metric_keys.OPTIMIZER_STEPS] == 6


def test_sampler_old_logprobs_skip_the_extra_forward_and_measure_the_mismatch_on_the_first_step(arrays):
    learner = build_learner(old_logprobs="auto")  # float32: the sampler's
    metrics = update(learner, arrays)
    mask = torch.from_numpy(arrays[GENERATED_MASK]).bool()
    ratio = torch.exp(initial_logprobs(arrays) - torch.from_numpy(arrays[SAMPLING_LOGPROBS]))[mask].double()
    assert metrics[metric_keys.OLD_LOGPROBS_RECOMPUTED] == 0.0
    assert metrics[metric_keys.SAMPLER_RATIO_MEAN] == pytest.approx(ratio.mean().item(), rel=1e-5)
    assert metrics[metric_keys.SAMPLER_RATIO_P99] == pytest.approx(torch.quantile(ratio, 0.99).item(), rel=1e-5)
    outside = ((ratio < 0.9) | (ratio > 1.1)).double().mean().item()
    assert metrics[metric_keys.SAMPLER_RATIO_OUTSIDE] == pytest.approx(outside)
    # the synthetic sampler's log-probs are far from the model's: the ratio is not 1 on the very first step
    assert not 0.9 < metrics[metric_keys.RATIO_MIN] <= metrics[metric_keys.RATIO_MAX] < 1.1
    assert metrics[metric_keys.TIS_WEIGHT_MEAN] == 1.0
    assert build_learner(dtype="bfloat16", old_logprobs="auto")._old_source == "recompute"


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_recomputed_old_logprobs_carry_truncated_importance_weights(arrays, level):
    cap = 2.0
    metrics = update(build_learner(tis_cap=cap, tis_level=level), arrays)
    mask = torch.from_numpy(arrays[GENERATED_MASK])
    log_ratio = (initial_logprobs(arrays) - torch.from_numpy(arrays[SAMPLING_LOGPROBS])) * mask
    if level == "sequence":
        log_ratio = log_ratio.sum(1, keepdim=True).expand_as(mask)
    weights = torch.exp(log_ratio).clamp(max=cap)
    assert metrics[metric_keys.OLD_LOGPROBS_RECOMPUTED] == 1.0
    assert metrics[metric_keys.TIS_WEIGHT_MEAN] == pytest.approx(masked_mean(weights, mask).item(), rel=1e-5)
    # the first step is on-policy (ratio 1): the policy loss is minus the weighted token-mean advantage
    advantages = torch.from_numpy(arrays[ADVANTAGES_KEY])[:, None]
    assert metrics[metric_keys.POLICY_LOSS] == pytest.approx(masked_mean(-advantages * weights, mask).item(), rel=1e-5)


def test_warmup_ratio_and_cosine_span_the_run(arrays):
    # 2 iterations x 2 mini-batches = 4 steps; warm-up 2 (ratio 0.5); then cosine: lr/2 at step 3, 0 at step 4
    learner = build_learner(ppo_mini_batches=2, total_iterations=2, warmup_ratio=0.5, lr_schedule="cosine")
    lrs = [update(learner, two_prompts(arrays))[metric_keys.LEARNING_RATE] for _ in range(2)]  # each update's last step
    assert lrs == pytest.approx([LR, 0.0], abs=1e-12)
    assert build_learner(total_iterations=10)._warmup_steps == 3  # the paper's 0.285 of 10 tree steps
    assert build_learner(algo="grpo", group_size=2, total_iterations=10)._warmup_steps == 5  # chains: half


# --- shared-prefix training: the same update as the per-row one ----------------------------------------------

def tree_records(seed: int = 1) -> list[LeafRecord]:
    """Two prompts, each with two trees of three leaves: the chain, a branch after its first step and
    observation, and a branch from the prompt; the rows of a prompt share its tokens, those of a tree its
    steps above the branch point (with the same sampling log-probs, as a copied parent's)."""
    rng = np.random.default_rng(seed)

    def step(trajectory: TokenTrajectory, length: int) -> TokenTrajectory:
        ids = tuple(int(t) for t in rng.integers(5, 200, length))
        return TokenTrajectory(trajectory.token_ids + ids, trajectory.generated_mask + (True,) * length,
                               trajectory.sampling_logprobs + tuple(rng.uniform(-6.0, -1.0, length)))

    records = []
    for prompt in range(2):
        root = TokenTrajectory.from_prompt(tuple(int(t) for t in rng.integers(5, 200, 7)))
        for tree in range(2):
            first = step(root, 4)
            after_obs = first.with_observation(tuple(int(t) for t in rng.integers(5, 200, 3)))
            leaves = [step(after_obs, 5), step(after_obs, 2 + tree), step(root, 6)]
            for depth, trajectory in zip((2, 2, 1), leaves, strict=True):
                records.append(LeafRecord(prompt, tree, depth, trajectory, reward=float(rng.integers(0, 2))))
    return records


# (dtype, sampling temperature, relative tolerance, absolute tolerance of the metrics). float32 sums in another
# order differ by ~1e-6 (relative). bfloat16 keeps 8 bits of mantissa: the shared forward sums in another order and
# pads otherwise, which moves the metrics by up to ~3e-2 (relative; the KL, a small difference of log-probs) and the
# gradients by ~1.5e-2 of their largest entry (measured on this batch): stated as 5e-2.
PREFIX_SHARING_CASES = [("float32", 1.0, 1e-5, 1e-7), ("float32", 0.7, 1e-5, 1e-7), ("bfloat16", 0.7, 5e-2, 1e-6)]


@pytest.mark.parametrize(("dtype", "temperature", "tolerance", "metric_atol"), PREFIX_SHARING_CASES,
                         ids=[f"{dtype}-T{temperature}" for dtype, temperature, *_ in PREFIX_SHARING_CASES])
def test_prefix_sharing_gives_the_per_row_update(dtype, temperature, tolerance, metric_atol):
    records = tree_records()
    batch = pad_batch(records, np.random.default_rng(2).normal(size=len(records)), pad_id=0)  # distinct advantages
    training = {"ppo_mini_batches": 2, "micro_batch_size": 2, "old_logprobs": "recompute", "tis_cap": 2.0,
                "temperature": temperature}
    runs = {}
    for sharing in (False, True):
        learner = build_learner(dtype, prefix_sharing=sharing, **training)
        runs[sharing] = update(learner, batch), gradients(learner)
    (plain, plain_grads), (shared, shared_grads) = runs[False], runs[True]
    assert shared[metric_keys.UNIQUE_TOKEN_SHARE] < 0.8 and metric_keys.UNIQUE_TOKEN_SHARE not in plain
    for key in plain:
        # the peak memory (RSS on a CPU) and the seconds: facts about the machine, not about the update
        if key not in ("default_optimizer_learning_rate", metric_keys.OPTIMIZER_STEPS,
                       metric_keys.LEARNER_PEAK_MEMORY_GIB, metric_keys.SCORING_TIME_S):
            assert shared[key] == pytest.approx(plain[key], rel=tolerance, abs=metric_atol), key
    scale = max(g.float().abs().max().item() for g in plain_grads.values())
    assert shared_grads.keys() == plain_grads.keys()
    for name in plain_grads:  # the last step's gradients; sums in another order: relative to the largest
        torch.testing.assert_close(shared_grads[name].float(), plain_grads[name].float(), rtol=tolerance,
                                   atol=tolerance * scale)


def test_flex_attention_is_the_learners_own_and_stops_with_a_clear_error_on_the_cpu(arrays):
    learner = build_learner(learner_attention="flex_attention", old_logprobs="sampler", kl_coef=0.0)
    assert learner.module[DEFAULT_MODULE_ID].model.config._attn_implementation == "flex_attention"
    assert build_learner().module[DEFAULT_MODULE_ID].model.config._attn_implementation == "sdpa"
    with pytest.raises(ValueError, match=r"learner_attention setting.*cannot backpropagate on the CPU"):
        update(learner, arrays)


def test_the_kl_term_pulls_a_moved_policy_back_to_the_reference(arrays):
    """A policy moved away from its reference, on a batch whose advantages are all 0 and without an entropy bonus:
    the KL term alone is the loss, so the logged loss is kl_coef x KL, the gradient points back to the reference, and
    the step shrinks the KL on the same batch. Dropped from the loss (a mutation once survived every learner test,
    since the first step's KL and its gradient are 0), the policy would not move at all."""
    kl_coef = 0.5
    learner = build_learner(kl_coef=kl_coef, entropy_coef=0.0, weight_decay=0.0, lr=1e-4, grad_clip=None)
    model = learner.module[DEFAULT_MODULE_ID].model
    reference = {name: p.detach().clone() for name, p in learner._reference.model.named_parameters()}
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator))
    flat = {**arrays, ADVANTAGES_KEY: np.zeros_like(arrays[ADVANTAGES_KEY])}

    def distance() -> float:
        return sum(float((p.detach() - reference[name]).square().sum()) for name, p in model.named_parameters())

    before = distance()
    first = update(learner, flat)
    assert first[metric_keys.KL] > 1e-3 and first[metric_keys.POLICY_LOSS] == pytest.approx(0.0, abs=1e-7)
    assert first["total_loss"] == pytest.approx(kl_coef * first[metric_keys.KL], rel=1e-5)
    assert distance() < before  # the step moved the weights toward the reference
    assert update(learner, flat)[metric_keys.KL] < first[metric_keys.KL]


def test_first_step_kl_in_bf16_without_sharding_has_a_measured_floor(arrays):
    """One learner in bf16: the policy runs its float32 masters under autocast (a float32 residual stream), the
    reference holds bf16 weights (a bf16 residual stream), so their log-probs differ by bf16 rounding and the first
    step's KL is not 0 (docs/training.md gives the floor; under FSDP both gather bf16 and it is 0,
    tests/test_learner_fsdp.py). The floor is bf16 noise: far below a moved policy's KL, far above float32's."""
    bf16 = update(build_learner("bfloat16", kl_coef=0.1), arrays)[metric_keys.KL]
    float32 = update(build_learner("float32", kl_coef=0.1), arrays)[metric_keys.KL]
    assert float32 < 1e-9
    assert 0 < bf16 < 1e-3
    print(f"first-step KL, one learner: bf16 {bf16:.3g}, float32 {float32:.3g}")
