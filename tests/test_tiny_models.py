"""The paper's model families offline: tiny random Qwen2 and Llama-3 models (policies.tiny_models) have the real
architectures' traits, render the real chat formats, stop where the real models stop, write a fixed date, and each
run an iteration of run.py."""

from __future__ import annotations

import datetime as dt
import json

import numpy as np
import pytest
import torch
import transformers.utils.chat_template_utils as chat_template_utils

import algos.tree_grpo.tree_grpo as algorithm_module
from experiments.run import main
from policies.generation import CHAT_TEMPLATE_DATE, Branch, SamplingSettings, end_of_turn_ids, prompt_ids
from policies.hf_generation import HFStepGenerator
from policies.model_runner import ModelRunner, Sampled
from policies.models import ALIASES, load_model
from policies.tiny_models import TINY_LLAMA3, TINY_MODELS, TINY_QWEN2

QWEN_PROMPT = ("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
               "<|im_start|>user\nWho wrote Hamlet?<|im_end|>\n<|im_start|>assistant\n")
LLAMA_PROMPT = ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\n"
                "Today Date: 26 Jul 2024\n\n<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nWho wrote Hamlet?"
                "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
PROMPTS = {TINY_QWEN2: QWEN_PROMPT, TINY_LLAMA3: LLAMA_PROMPT}  # prompt_ids of "Who wrote Hamlet?", decoded
# what the real models' tokenizer (EOS) and generation_config.json (eos_token_id) make the generator stop on
END_OF_TURN = {TINY_QWEN2: {"<|im_end|>", "<|endoftext|>"},  # Qwen2.5-Instruct: [151645, 151643]
               TINY_LLAMA3: {"<|eot_id|>", "<|end_of_text|>", "<|eom_id|>"}}  # Llama-3.2: [128001, 128008, 128009]
EOS = {TINY_QWEN2: "<|im_end|>", TINY_LLAMA3: "<|eot_id|>"}  # the real Instruct tokenizers' eos_token
# a special token in the vocabulary that must not end a turn (for the Llama, SmolLM2's ChatML end of turn)
FOREIGN = {TINY_QWEN2: "<|im_start|>", TINY_LLAMA3: "<|im_end|>"}


@pytest.fixture(scope="module")
def models() -> dict:
    return {name: load_model(name) for name in TINY_MODELS}


def attention(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [layer.self_attn for layer in model.model.layers]


def test_the_names_are_known_to_load_model():
    assert {TINY_QWEN2, TINY_LLAMA3} <= set(ALIASES)


def test_qwen2_has_qkv_biases_tied_embeddings_and_gqa(models):
    model, tokenizer = models[TINY_QWEN2]
    assert type(model).__name__ == "Qwen2ForCausalLM"
    for attn in attention(model):
        assert all(getattr(attn, p).bias is not None for p in ("q_proj", "k_proj", "v_proj"))
        assert attn.o_proj.bias is None
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    assert attention(model)[0].k_proj.out_features < attention(model)[0].q_proj.out_features
    assert model.config.vocab_size == len(tokenizer) and tokenizer.bos_token is None


def test_llama3_has_untied_embeddings_gqa_and_its_header_tokens(models):
    model, tokenizer = models[TINY_LLAMA3]
    assert type(model).__name__ == "LlamaForCausalLM"
    assert all(getattr(attn, p).bias is None for attn in attention(model) for p in ("q_proj", "k_proj", "v_proj"))
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    assert model.config.rope_parameters["rope_type"] == "llama3"
    # the added header tokens are single special tokens, and both embedding matrices cover them
    for token in ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"):
        assert tokenizer(token, add_special_tokens=False)["input_ids"] == [tokenizer.convert_tokens_to_ids(token)]
    assert model.model.embed_tokens.num_embeddings == model.lm_head.out_features == len(tokenizer) > 49152


def test_seeded_and_the_base_tokenizer_untouched(models):
    again, _ = load_model(TINY_LLAMA3)
    other, _ = load_model(TINY_LLAMA3, seed=1)
    weights = models[TINY_LLAMA3][0].lm_head.weight
    assert torch.equal(again.lm_head.weight, weights) and not torch.equal(other.lm_head.weight, weights)
    _, smollm2 = load_model("tiny-random")
    assert smollm2.eos_token == "<|im_end|>" and "<|eot_id|>" not in smollm2.get_vocab()


@pytest.mark.parametrize("name", TINY_MODELS)
def test_the_prompt_is_the_real_chat_format(models, name):
    _, tokenizer = models[name]
    ids = prompt_ids(tokenizer, "Who wrote Hamlet?")
    assert tokenizer.decode(ids) == PROMPTS[name]
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>" if name == TINY_QWEN2 else "<|begin_of_text|>")


def test_a_conversation_with_a_system_turn_renders_as_the_real_templates(models):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}]
    render = {name: models[name][1].apply_chat_template(messages, tokenize=False, add_generation_prompt=False,
                                                        date_string="01 Mar 2025") for name in TINY_MODELS}
    assert render[TINY_QWEN2] == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                                  "<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n")
    assert render[TINY_LLAMA3] == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\n"
        "Today Date: 01 Mar 2025\n\nBe brief.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nHello.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nBye<|eot_id|>")


def test_the_llama_date_is_fixed_whatever_the_clock_says(models, monkeypatch):
    _, tokenizer = models[TINY_LLAMA3]
    seen = []
    for day in (dt.datetime(2031, 3, 5), dt.datetime(2031, 3, 6)):  # a run, and its resume the next day
        monkeypatch.setattr(chat_template_utils, "datetime", type("Clock", (), {"now": staticmethod(lambda d=day: d)}))
        raw = tokenizer.apply_chat_template([{"role": "user", "content": "Q"}], tokenize=False)
        assert f"Today Date: {day:%d %b %Y}\n" in raw  # like Meta's template: today's date unless given one
        seen.append(prompt_ids(tokenizer, "Q"))
    assert seen[0] == seen[1] and f"Today Date: {CHAT_TEMPLATE_DATE}\n" in tokenizer.decode(seen[0])


@pytest.mark.parametrize("name", TINY_MODELS)
def test_the_generator_stops_on_the_real_models_end_of_turn_ids(models, name):
    model, tokenizer = models[name]
    assert set(tokenizer.convert_ids_to_tokens(sorted(end_of_turn_ids(tokenizer, model)))) == END_OF_TURN[name]
    assert tokenizer.eos_token == EOS[name]


@pytest.mark.parametrize("name", TINY_MODELS)
def test_an_end_of_turn_token_ends_a_step_and_a_foreign_one_does_not(models, name, monkeypatch):
    model, tokenizer = models[name]
    words = tokenizer("<think>so</think> Paris", add_special_tokens=False)["input_ids"]
    assert FOREIGN[name] in tokenizer.get_vocab()
    for token, reason in [*((token, "eos") for token in END_OF_TURN[name]), (FOREIGN[name], "length")]:
        script = iter([*words, tokenizer.convert_tokens_to_ids(token), *words])
        monkeypatch.setattr(ModelRunner, "_sample",
                            lambda self, logits, streams, positions, s=script: Sampled([next(s)] * logits.shape[0],
                                                                                       [0.0] * logits.shape[0], None))
        generator = HFStepGenerator(model, tokenizer, SamplingSettings(max_step_tokens=len(words) + 2))
        (out,) = generator.generate_step([Branch(prompt_ids(tokenizer, "Q?"))], seed=0)
        assert out.finish_reason == reason, token
        if reason == "eos":
            assert out.token_ids == (*words, tokenizer.convert_tokens_to_ids(token))


@pytest.mark.parametrize("name", TINY_MODELS)
def test_a_saved_copy_loads_with_the_same_stops_prompt_and_shape(models, name, tmp_path):
    # the way a real hub model or an export comes in: from_pretrained reads generation_config.json and the tokenizer
    model, tokenizer = models[name]
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    loaded, loaded_tokenizer = load_model(str(tmp_path))
    assert end_of_turn_ids(loaded_tokenizer, loaded) == end_of_turn_ids(tokenizer, model)
    assert prompt_ids(loaded_tokenizer, "Q?") == prompt_ids(tokenizer, "Q?")
    assert type(loaded) is type(model) and loaded.config.tie_word_embeddings == model.config.tie_word_embeddings
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), model.state_dict().values(),
                                                  strict=True))


@pytest.mark.parametrize("name", TINY_MODELS)
def test_one_iteration_of_run_py(ray_session, data_dir, tmp_path, monkeypatch, models, name):
    _, tokenizer = models[name]
    records, generators = [], []
    real_pad_batch, real_init = algorithm_module.pad_batch, HFStepGenerator.__init__

    def spy_batch(batch_records, advantages, pad_id):
        records.extend(batch_records)
        return real_pad_batch(batch_records, advantages, pad_id)

    def spy_init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        generators.append(self)

    monkeypatch.setattr(algorithm_module, "pad_batch", spy_batch)
    monkeypatch.setattr(HFStepGenerator, "__init__", spy_init)
    # a random model earns no reward, so every real advantage is 0: fixed ones make the update a real gradient step
    monkeypatch.setattr(algorithm_module, "prompt_advantages", lambda records, mode: np.resize([1.0, -1.0],
                                                                                              len(records)))
    main(["--model", name, "--iterations", "1", "--prompts-per-iter", "2", "--max-step-tokens", "8",
          "--micro-batch-size", "6", "--no-skip-uniform-rewards", "--checkpoint-every", "0", "--no-mlflow",
          "--output", str(tmp_path)])
    (row,) = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert row["iteration"] == 1 and row["leaves"] == len(records) > 0
    assert row["optimizer_steps"] >= 1 and row["grad_norm"] > 1e-2  # zero advantages: about 4e-6
    ends = {tokenizer.convert_tokens_to_ids(token) for token in END_OF_TURN[name]}
    assert generators and all(g.eot_ids == ends for g in generators)
    head, tail = PROMPTS[name].split("Who wrote Hamlet?")  # the chat format around the env's question
    for record in records:
        trajectory = record.trajectory
        prompt = tokenizer.decode(trajectory.token_ids[:trajectory.generated_mask.index(True)])
        assert prompt.startswith(head) and prompt.endswith(tail)
        # an end-of-turn token only ever closes a step: nothing is sampled after it in the same step
        steps, current = [], []
        for token, generated in zip(trajectory.token_ids, trajectory.generated_mask, strict=True):
            if generated:
                current.append(token)
            elif current:
                steps.append(current)
                current = []
        steps.append(current)
        assert all(token not in ends for step in steps for token in step[:-1])
