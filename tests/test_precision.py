"""Mixed precision (float32 master weights, bf16 compute), activation checkpointing and the offloaded reference
model: the learner's numerics and memory options, each against the plain float32 path it must equal or beat."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from ray.rllib.core import DEFAULT_MODULE_ID
from ray.rllib.core.rl_module.rl_module import RLModuleSpec
from test_learner import ADVANTAGES, build_learner, synthetic_records, tree_records, update, weights

from algos.batch import pad_batch, prompt_advantages
from algos.tree_grpo import metrics as metric_keys
from algos.tree_grpo.tree_grpo import nonzero_advantage_share, rewarded_alike
from envs.search_qa import UnicodeText
from policies.activation_checkpointing import enable_gradient_checkpointing
from policies.logprobs import ENTROPY, GENERATED_MASK, LOGPROBS
from policies.models import build_tiny_random, model_cache_dir, smollm2_tokenizer
from policies.precision import PURE_BF16_WARNING, Precision, cast_floating, precision_of, weights_dtype
from policies.reference_model import ReferenceModel, frozen_copy
from policies.rl_module import LLMRLModule


@pytest.fixture(scope="module")
def arrays() -> dict[str, np.ndarray]:
    return pad_batch(synthetic_records(), np.asarray(ADVANTAGES), pad_id=0)


def module(inference_only: bool = False, **model_config) -> LLMRLModule:
    spec = RLModuleSpec(module_class=LLMRLModule, observation_space=UnicodeText(100), action_space=UnicodeText(100),
                        inference_only=inference_only, model_config={"model": "tiny-random", **model_config})
    return spec.build()


def trained_share(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor], names: set[str]) -> float:
    """The share of the elements of the parameters ``names`` that an update changed."""
    changed = sum(int((before[name] != after[name]).sum()) for name in names)
    return changed / sum(before[name].numel() for name in names)


def names_with_gradients(learner) -> set[str]:
    model = learner.module[DEFAULT_MODULE_ID].model
    return {name for name, param in model.named_parameters() if param.grad is not None}


# -- precision ------------------------------------------------------------------------------------------------


def test_precision_of_the_dtype_option():
    assert precision_of("float32") == Precision(compute=torch.float32, master=torch.float32)
    mixed = precision_of("bfloat16")
    assert mixed == Precision(compute=torch.bfloat16, master=torch.float32) and mixed.mixed
    assert weights_dtype(mixed, inference_only=True, lora=False) == torch.bfloat16  # a rollout engine's copy
    assert weights_dtype(mixed, inference_only=False, lora=True) == torch.bfloat16  # a frozen LoRA base
    assert weights_dtype(mixed, inference_only=False, lora=False) == torch.float32  # the trained master
    with pytest.warns(UserWarning, match="no float32 master copy"):
        pure = precision_of("bfloat16", pure_bf16=True)
    assert pure == Precision(compute=torch.bfloat16, master=torch.bfloat16) and not pure.mixed
    assert "round away" in PURE_BF16_WARNING
    with pytest.raises(ValueError, match="pure_bf16 needs dtype bfloat16"):
        precision_of("float32", pure_bf16=True)
    with pytest.raises(ValueError, match="dtype must be one of"):
        precision_of("float8")
    state = cast_floating({"w": torch.ones(2), "ids": torch.arange(2)}, torch.bfloat16)
    assert state["w"].dtype == torch.bfloat16 and state["ids"].dtype == torch.int64


def test_a_bf16_step_at_the_papers_lr_moves_the_float32_master_weights(arrays):
    learner = build_learner("bfloat16", lr=1e-6, warmup_steps=0)
    model = learner.module[DEFAULT_MODULE_ID].model
    assert {param.dtype for param in model.parameters()} == {torch.float32}
    before = weights(learner)
    metrics = update(learner, arrays)
    trained = names_with_gradients(learner)
    # an Adam step is about lr in size: bf16 weights would keep almost all of them (0.03% moved, measured)
    assert trained and trained_share(before, weights(learner), trained) > 0.5
    optimizer_state = next(iter(learner.get_optimizers_for_module(DEFAULT_MODULE_ID)))[1].state
    assert {state["exp_avg"].dtype for state in optimizer_state.values()} == {torch.float32}
    assert metrics[metric_keys.OLD_LOGPROBS_RECOMPUTED] == 1.0  # the bf16 sampler's numerics are not the learner's


@pytest.mark.filterwarnings("ignore:pure_bf16")
def test_pure_bf16_keeps_bf16_weights_and_loses_the_small_steps(arrays):
    learner = build_learner("bfloat16", model_config={"pure_bf16": True}, lr=1e-6, warmup_steps=0)
    assert {p.dtype for p in learner.module[DEFAULT_MODULE_ID].model.parameters()} == {torch.bfloat16}
    before = weights(learner)
    update(learner, arrays)
    assert trained_share(before, weights(learner), names_with_gradients(learner)) < 0.05  # why it is not the default


def test_mixed_precision_computes_in_bf16_and_gives_the_float32_log_probs_closely():
    mixed, exact = module(dtype="bfloat16"), module()
    assert {p.dtype for p in mixed.model.parameters()} == {torch.float32}
    outputs = []
    hook = mixed.model.model.layers[0].self_attn.q_proj.register_forward_hook(
        lambda _module, _inputs, output: outputs.append(output.dtype))
    batch = {"input_ids": torch.arange(10, 40).reshape(2, 15), "attention_mask": torch.ones(2, 15, dtype=torch.long)}
    batch[GENERATED_MASK] = torch.ones(2, 15)
    got = mixed.forward_train(batch, return_entropy=True)
    hook.remove()
    want = exact.forward_train(batch, return_entropy=True)
    assert outputs == [torch.bfloat16]  # autocast: the projections run in bf16 over float32 weights
    assert got[LOGPROBS].dtype == torch.float32
    torch.testing.assert_close(got[LOGPROBS], want[LOGPROBS], atol=0.05, rtol=0)
    assert not torch.equal(got[LOGPROBS], want[LOGPROBS])
    got[LOGPROBS].sum().backward()
    assert all(p.grad.dtype == torch.float32 for p in mixed.model.parameters() if p.grad is not None)


def test_rollout_modules_hold_the_compute_dtype_and_the_sync_sends_it():
    learner_module = module(dtype="bfloat16")
    runner_module = module(inference_only=True, dtype="bfloat16")
    assert {p.dtype for p in runner_module.model.parameters()} == {torch.bfloat16}
    master = learner_module.get_state()
    synced = learner_module.get_state(inference_only=True)
    assert {t.dtype for t in master.values() if t.is_floating_point()} == {torch.float32}
    assert {t.dtype for t in synced.values() if t.is_floating_point()} == {torch.bfloat16}
    with torch.no_grad():
        next(learner_module.model.parameters()).add_(0.5)
    runner_module.set_state(learner_module.get_state(inference_only=True))
    name, param = next(iter(runner_module.model.named_parameters()))
    assert torch.equal(param, learner_module.model.get_parameter(name).detach().to(torch.bfloat16))


# -- activation checkpointing ---------------------------------------------------------------------------------


def loss_and_gradients(checkpointing: bool, share_prefixes: bool) -> tuple[float, dict[str, torch.Tensor], int]:
    """A loss over the log-probs and entropies of a tree-shaped batch, its gradients, and how often the first
    decoder layer's query projection ran (twice when the layer's activations are recomputed)."""
    policy = module(gradient_checkpointing=checkpointing)
    records = tree_records()
    arrays = pad_batch(records, np.zeros(len(records)), pad_id=0)
    batch = {key: torch.from_numpy(arrays[key]) for key in ("input_ids", "attention_mask", GENERATED_MASK)}
    calls = []
    policy.model.model.layers[0].self_attn.q_proj.register_forward_hook(lambda *_: calls.append(1))
    out = policy.forward_train(batch, return_entropy=True, share_prefixes=share_prefixes)
    loss = (out[LOGPROBS] * torch.linspace(-1, 1, out[LOGPROBS].shape[1])).sum() + out[ENTROPY].sum()
    loss.backward()
    grads = {name: p.grad for name, p in policy.model.named_parameters() if p.grad is not None}
    return loss.item(), grads, len(calls)


@pytest.mark.parametrize("share_prefixes", [False, True], ids=["per-row", "shared-prefix"])
def test_gradient_checkpointing_gives_the_same_loss_and_gradients(share_prefixes):
    plain_loss, plain_grads, plain_calls = loss_and_gradients(False, share_prefixes)
    loss, grads, calls = loss_and_gradients(True, share_prefixes)
    assert (plain_calls, calls) == (1, 2)  # the layer ran again in the backward pass: its activations were dropped
    assert loss == pytest.approx(plain_loss, rel=1e-6)
    assert grads.keys() == plain_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, plain_grads[name], rtol=1e-5, atol=1e-5 * plain_grads[name].abs().max())


def test_checkpointing_is_the_learners_alone():
    assert module(gradient_checkpointing=True).model.is_activation_checkpointing
    assert not module(inference_only=True, gradient_checkpointing=True).model.is_activation_checkpointing


def test_a_model_without_checkpointing_is_named():
    class NoCheckpoints(torch.nn.Module):
        supports_gradient_checkpointing = False

    with pytest.raises(ValueError, match="NoCheckpoints does not support activation checkpointing"):
        enable_gradient_checkpointing(NoCheckpoints())


# -- the reference model --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny() -> torch.nn.Module:
    return build_tiny_random(smollm2_tokenizer(model_cache_dir()), seed=3)


def test_the_frozen_copy_is_cast_tied_and_detached(tiny):
    copy = frozen_copy(tiny, torch.bfloat16, "cpu")
    assert copy.lm_head.weight is copy.model.embed_tokens.weight  # tied weights stay one tensor
    assert {p.dtype for p in copy.parameters()} == {torch.bfloat16}
    assert not any(p.requires_grad for p in copy.parameters()) and not copy.training
    assert copy.model.rotary_emb.inv_freq.dtype == torch.float32  # buffers keep their precision
    weight = tiny.model.layers[0].mlp.up_proj.weight
    assert weight.dtype == torch.float32 and weight.requires_grad  # the original is untouched
    assert torch.equal(copy.model.layers[0].mlp.up_proj.weight, weight.detach().to(torch.bfloat16))


def test_an_offloaded_reference_is_on_the_device_only_inside_its_pass(tiny):
    # the meta device stands in for an accelerator: the bookkeeping is the same, no CUDA needed
    reference = ReferenceModel(tiny, dtype=torch.bfloat16, device="meta", offload=True)
    host = [p.data.data_ptr() for p in reference.model.parameters()]
    assert reference.parameter_devices() == {torch.device("cpu")}
    with reference.on_device() as model:
        assert {p.device for p in model.parameters()} == {torch.device("meta")}
    assert reference.parameter_devices() == {torch.device("cpu")}
    assert [p.data.data_ptr() for p in reference.model.parameters()] == host  # the same host copies, not new ones
    resident = ReferenceModel(tiny, dtype=torch.bfloat16, device="meta", offload=False)
    assert resident.parameter_devices() == {torch.device("meta")}


def test_an_offloaded_reference_gives_the_same_update(arrays):
    results = [update(build_learner(kl_coef=0.1, ppo_epochs=2, reference_offload=offload), arrays)  # 2nd step: KL > 0
               for offload in (False, True)]
    assert results[0][metric_keys.KL] > 0
    for key in (metric_keys.KL, metric_keys.POLICY_LOSS, metric_keys.GRAD_NORM):
        assert results[1][key] == results[0][key], key


# -- skipping updates that cannot learn -----------------------------------------------------------------------


def test_rewarded_alike_means_every_prompts_leaves_share_one_reward():
    records = synthetic_records()  # rewards 1, -1, 0.5, -0.5, 0.25 on prompt 0
    assert not rewarded_alike(records)
    zero = [dataclasses.replace(record, reward=0.0) for record in records]
    one = [dataclasses.replace(record, prompt_index=1, reward=1.0) for record in records]
    assert rewarded_alike(zero) and rewarded_alike(zero + one)  # alike within each prompt, whatever across prompts
    assert not rewarded_alike(zero + one[:-1] + [dataclasses.replace(one[-1], reward=0.0)])


def test_nonzero_advantage_share_counts_the_prompts_the_update_learns_from():
    records = synthetic_records()  # 5 leaves of prompt 0
    mixed = [dataclasses.replace(record, prompt_index=1) for record in records]
    alike = [dataclasses.replace(record, prompt_index=2, reward=1.0) for record in records]
    batch = records + mixed + alike
    # prompts 0 and 1 have mixed rewards (non-zero advantages), prompt 2 all 1.0 (every advantage 0): 2 of 3
    assert nonzero_advantage_share(batch, prompt_advantages(batch)) == pytest.approx(2 / 3)
    assert nonzero_advantage_share(alike, prompt_advantages(alike)) == 0.0
    # one non-zero leaf is enough for its prompt; the advantages are read as given, one per record
    assert nonzero_advantage_share(alike, np.array([0, 0, 0, 0, 0.5])) == 1.0
    assert nonzero_advantage_share([], np.zeros(0)) == 0.0
