"""The LLM RLModule: exact per-token log-probs and entropies on padded batches, gradients, bf16 state, LoRA."""

from __future__ import annotations

import gc
from datetime import timedelta

import pytest
import torch
from ray.rllib.core.rl_module.rl_module import RLModuleSpec

from envs.search_qa import UnicodeText
from policies.generation import Branch, SamplingSettings, prompt_ids
from policies.logprobs import ENTROPY, GENERATED_MASK, LOGPROBS
from policies.rl_module import LLMRLModule


def build(**model_config) -> LLMRLModule:
    spec = RLModuleSpec(module_class=LLMRLModule, observation_space=UnicodeText(100), action_space=UnicodeText(100),
                        model_config={"model": "tiny-random", **model_config})
    return spec.build()


@pytest.fixture(scope="module")
def module() -> LLMRLModule:
    return build(logprob_chunk=5)  # small chunks: the chunked path must equal the full computation


def padded_batch(sequences: list[list[int]], pad: int, *, left: bool = False) -> dict[str, torch.Tensor]:
    width = max(map(len, sequences))
    ids = torch.full((len(sequences), width), pad)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for b, seq in enumerate(sequences):
        span = slice(width - len(seq), width) if left else slice(0, len(seq))
        ids[b, span], mask[b, span] = torch.tensor(seq), 1
    return {"input_ids": ids, "attention_mask": mask}


def reference(model, seq: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropies of one unpadded sequence, from the full [T, V] logits."""
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([seq])).logits[0, :-1].float(), dim=-1)
    return logp.gather(-1, torch.tensor(seq[1:])[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("left", [False, True])
def test_forward_train_matches_full_logits(module, left):
    sequences = [list(range(10, 33)), list(range(50, 57)), list(range(100, 114))]
    batch = padded_batch(sequences, module.tokenizer.pad_token_id, left=left)
    with torch.no_grad():
        out = module.forward_train(batch, return_entropy=True)
    assert out[LOGPROBS].shape == batch["input_ids"].shape
    for b, seq in enumerate(sequences):
        lp, ent = reference(module.model, seq)
        real = batch["attention_mask"][b].bool()
        torch.testing.assert_close(out[LOGPROBS][b, real][1:], lp, atol=1e-5, rtol=0)
        torch.testing.assert_close(out[ENTROPY][b, real][1:], ent, atol=1e-4, rtol=0)
        assert out[LOGPROBS][b, ~real].abs().sum() == 0 and out[LOGPROBS][b, real][0] == 0


def test_a_generated_mask_scores_only_its_positions(module):
    sequences = [list(range(10, 33)), list(range(50, 57))]
    batch = padded_batch(sequences, module.tokenizer.pad_token_id)
    generated = torch.zeros_like(batch["attention_mask"])
    generated[0, 5:9], generated[0, 15:20], generated[1, 3:7] = 1, 1, 1
    with torch.no_grad():
        full = module.forward_train(batch, return_entropy=True)
        masked = module.forward_train({**batch, GENERATED_MASK: generated}, return_entropy=True)
    keep = generated.bool()
    for key in (LOGPROBS, ENTROPY):
        torch.testing.assert_close(masked[key][keep], full[key][keep], atol=1e-5, rtol=0)
        assert masked[key][~keep].abs().sum() == 0


def test_gradients_flow_through_the_chunks(module):
    batch = padded_batch([list(range(10, 30)), list(range(40, 52))], module.tokenizer.pad_token_id)
    module.model.zero_grad()
    out = module.forward_train(batch, return_entropy=True)
    (out[LOGPROBS].sum() + out[ENTROPY].sum()).backward()
    grads = [p.grad for p in module.model.parameters() if p.requires_grad]
    assert all(g is not None for g in grads) and sum(g.abs().sum() for g in grads) > 0
    module.model.zero_grad()


def test_generator_uses_the_module_weights(module):
    gen = module.generator(SamplingSettings(max_step_tokens=20))
    (out,) = gen.generate_step([Branch(prompt_ids(module.tokenizer, "Who wrote Hamlet?"))], seed=0)
    assert len(out.token_ids) > 0 and len(out.logprobs) == len(out.token_ids)
    assert gen.model is module.model


@pytest.mark.parametrize("temperature", [0.6, 1.0, 1.7])
def test_sampler_logprobs_are_the_learners_at_the_sampling_temperature(module, temperature):
    # top-p 0.8 cuts the tail: the recorded log-probs are still of the full tempered softmax, not renormalised
    gen = module.generator(SamplingSettings(temperature=temperature, top_p=0.8, max_step_tokens=12))
    prompt = prompt_ids(module.tokenizer, "Who wrote Hamlet?")
    (out,) = gen.generate_step([Branch(prompt)], seed=3)
    sequence = list(prompt) + list(out.token_ids)
    batch = padded_batch([sequence], module.tokenizer.pad_token_id)
    with torch.no_grad():
        learner = module.forward_train(batch, temperature=temperature)[LOGPROBS][0, len(prompt):]
        untempered = module.forward_train(batch)[LOGPROBS][0, len(prompt):]
    torch.testing.assert_close(learner, torch.tensor(out.logprobs), rtol=0, atol=1e-4)
    if temperature != 1.0:  # the temperature matters: the untempered log-probs are another distribution's
        assert (untempered - learner).abs().max() > 1e-2


def test_bf16_state_round_trip():
    source, target = build(dtype="bfloat16", seed=1), build(dtype="bfloat16", seed=2)
    state = source.get_state(inference_only=True)  # the weight sync's: the rollout engines' bf16
    assert all(isinstance(t, torch.Tensor) and t.device.type == "cpu" for t in state.values())
    assert {t.dtype for t in state.values()} == {torch.bfloat16}
    target.set_state(state)
    for name, tensor in target.get_state(inference_only=True).items():
        assert torch.equal(tensor, state[name]), name
    with pytest.raises(ValueError, match="missing"):
        target.set_state({"model.lm_head.weight": state["model.lm_head.weight"]} | {"extra": torch.zeros(1)})


def test_lora_on_and_off():
    pytest.importorskip("peft")
    with_lora = build(lora={"rank": 4, "alpha": 8})
    trainable = {n for n, p in with_lora.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    without = build()
    assert all(p.requires_grad for p in without.parameters())
    batch = padded_batch([list(range(10, 20))], with_lora.tokenizer.pad_token_id)
    out = with_lora.forward_train(batch)
    out[LOGPROBS].sum().backward()
    assert all(p.grad is not None for n, p in with_lora.named_parameters() if n in trainable)


def test_unknown_model_config_key_is_named():
    with pytest.raises(ValueError, match="lora_rank"):
        build(lora_rank=4)


def test_ddp_wrapped_module_reaches_custom_methods(tmp_path):
    import torch.distributed as dist
    from ray.rllib.core.rl_module.torch.torch_rl_module import TorchDDPRLModule

    # A file store, not a TCP port: a fixed port can be taken on a shared machine, and a stuck rendezvous would
    # wait out gloo's 30-minute default; the short timeout bounds any collective too.
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'ddp_store'}", rank=0, world_size=1,
                            timeout=timedelta(seconds=60))
    wrapped = out = None
    try:
        module = build()
        wrapped = TorchDDPRLModule(module)
        assert wrapped.unwrapped() is module and wrapped.unwrapped().generator().model is module.model
        batch = padded_batch([list(range(10, 20))], module.tokenizer.pad_token_id)
        out = wrapped.forward_train(batch)
        out[LOGPROBS].sum().backward()
    finally:
        # DDP's reducer holds the process group: free it first. Freed after the group's destruction (when the test
        # returned), gloo's destructor once hung joining its threads in a full run of the suite.
        wrapped = out = None
        gc.collect()
        dist.destroy_process_group()
