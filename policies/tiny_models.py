"""Tiny random models of the paper's architectures, built in-process, so the Qwen2 and Llama-3 code paths (attention
biases, tied and untied embeddings, grouped-query attention, their chat formats and end-of-turn tokens) run in tests
and on a CPU without downloading anything.

The paper trains Qwen2.5-1.5B/3B/7B-Instruct and Llama-3.2-3B-Instruct. Their shapes differ from the default
``tiny-random`` (a Llama with SmolLM2's ChatML template) in what can break a training path that only ever saw
SmolLM2: Qwen2 has biases on q/k/v; embeddings are tied in some of these models and not in others; Llama-3 marks
turns with header tokens, ends them with ``<|eot_id|>`` and writes today's date into the system header. Each tiny
model keeps SmolLM2's vocabulary (already on the machine) and takes the real model's chat format, special tokens and
end-of-turn ids, so the stops the project derives from a tokenizer and a ``generation_config`` are the ones the
real model would get:

- ``tiny-random-qwen2``: ``Qwen2ForCausalLM``, q/k/v biases, 4 query heads on 2 key/value heads, tied embeddings
  (as Qwen2.5-1.5B/3B), Qwen2.5's ChatML format with its default system prompt; a turn ends with ``<|im_end|>``
  (EOS), and generation also stops on ``<|endoftext|>`` (Qwen2.5-Instruct's generation_config: [151645, 151643]).
- ``tiny-random-llama3``: ``LlamaForCausalLM``, 4 query heads on 2 key/value heads, untied embeddings (as
  Llama-3.1-8B and Qwen2.5-7B; Llama-3.2-3B ties them, which ``tiny-random`` already covers), Llama-3's rope
  scaling, Llama-3.2's header format; a turn ends with ``<|eot_id|>`` (EOS), and generation also stops on
  ``<|end_of_text|>`` and ``<|eom_id|>`` (Llama-3.2-Instruct's generation_config: [128001, 128008, 128009]).
  The header tokens are added to the vocabulary and the embeddings sized to it.

The chat templates are written here in the documented formats (tools are left out: the agent's tools are tags in the
text). Like the real one, the Llama-3.2 template writes today's date unless the caller passes ``date_string``, which
:func:`policies.generation.prompt_ids` does.
"""

from __future__ import annotations

import copy

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen2Config,
    Qwen2ForCausalLM,
)

TINY_QWEN2 = "tiny-random-qwen2"
TINY_LLAMA3 = "tiny-random-llama3"
TINY_MODELS = {TINY_QWEN2: "a tiny random Qwen2 (q/k/v biases, tied embeddings, GQA, Qwen2.5's chat format)",
               TINY_LLAMA3: "a tiny random Llama (untied embeddings, GQA, Llama-3.2's chat format)"}

QWEN_SYSTEM_PROMPT = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
# Qwen2.5-Instruct: a system turn first (the default one when the conversation has none), then every turn as
# <|im_start|>role\ncontent<|im_end|>\n.
QWEN25_CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{%- set system = messages[0]['content'] %}{%- set messages = messages[1:] %}"
    "{%- else %}{%- set system = '" + QWEN_SYSTEM_PROMPT + "' %}{%- endif %}"
    "{{- '<|im_start|>system\\n' + system + '<|im_end|>\\n' }}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
QWEN25_END_OF_TURN = ("<|im_end|>", "<|endoftext|>")  # generation_config's eos ids, EOS first

LLAMA3_SPECIAL_TOKENS = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                         "<|eom_id|>", "<|eot_id|>")
# Llama-3.2-Instruct: BOS, a system header with the knowledge cutoff and the date (``date_string``, else today's),
# then every turn as <|start_header_id|>role<|end_header_id|>\n\ncontent<|eot_id|>, contents trimmed.
LLAMA32_CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if date_string is not defined %}{%- set date_string = strftime_now('%d %b %Y') %}{%- endif %}"
    "{%- if messages[0]['role'] == 'system' %}"
    "{%- set system = messages[0]['content'] | trim %}{%- set messages = messages[1:] %}"
    "{%- else %}{%- set system = '' %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{{- 'Cutting Knowledge Date: December 2023\\nToday Date: ' + date_string + '\\n\\n' }}"
    "{{- system + '<|eot_id|>' }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{{- (message['content'] | trim) + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
LLAMA32_END_OF_TURN = ("<|eot_id|>", "<|end_of_text|>", "<|eom_id|>")  # generation_config's eos ids, EOS first
# Llama-3.1/3.2's rope scaling (the real models' values): rope frequencies are rescaled by wavelength.
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

# the shape both tiny models share (GQA: 4 query heads on 2 key/value heads); with SmolLM2's vocabulary about 3.2M
# parameters tied (Qwen2), 6.4M untied (Llama)
SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2}


def build_tiny_model(name: str, base_tokenizer: PreTrainedTokenizerBase, *,
                     seed: int = 0) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The float32 model and tokenizer for a name of :data:`TINY_MODELS`; ``base_tokenizer`` (SmolLM2's) gives the
    vocabulary and is not changed. The weights depend on ``seed`` only, so every copy a run builds (env runners,
    learners, the reference model) starts from the same ones."""
    if name not in TINY_MODELS:
        raise ValueError(f"not a tiny model: {name!r} (known: {', '.join(TINY_MODELS)})")
    make_tokenizer, make_model, end_of_turn = _FAMILIES[name]
    tokenizer = make_tokenizer(base_tokenizer)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = make_model(tokenizer)
    # the real models' generation_config.json: where generation stops (policies.generation.end_of_turn_ids)
    model.generation_config.eos_token_id = [tokenizer.convert_tokens_to_ids(token) for token in end_of_turn]
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


def qwen25_tokenizer(base: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    """A copy of ``base`` set up as Qwen2.5-Instruct's: ChatML template with Qwen's default system prompt, EOS
    ``<|im_end|>``, padding ``<|endoftext|>``, no BOS (SmolLM2's vocabulary already holds these tokens)."""
    tokenizer = copy.deepcopy(base)
    tokenizer.chat_template = QWEN25_CHAT_TEMPLATE
    tokenizer.add_special_tokens({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"})
    tokenizer.bos_token = None
    return tokenizer


def llama32_tokenizer(base: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    """A copy of ``base`` set up as Llama-3.2-Instruct's: the header tokens added where missing, Llama-3.2's
    template, BOS ``<|begin_of_text|>``, EOS ``<|eot_id|>``, no padding token (``load_model`` pads with EOS, as
    for the real model)."""
    tokenizer = copy.deepcopy(base)
    missing = [token for token in LLAMA3_SPECIAL_TOKENS if token not in tokenizer.get_vocab()]
    tokenizer.add_tokens(missing, special_tokens=True)
    tokenizer.chat_template = LLAMA32_CHAT_TEMPLATE
    tokenizer.add_special_tokens({"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"})
    tokenizer.pad_token = None
    return tokenizer


def _special_ids(tokenizer: PreTrainedTokenizerBase) -> dict[str, int | None]:
    return {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id}


def _qwen2(tokenizer: PreTrainedTokenizerBase) -> Qwen2ForCausalLM:
    config = Qwen2Config(vocab_size=len(tokenizer), tie_word_embeddings=True, max_position_embeddings=32768,
                         rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, **SHAPE,
                         **_special_ids(tokenizer))
    return Qwen2ForCausalLM(config)


def _llama3(tokenizer: PreTrainedTokenizerBase) -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=len(tokenizer), tie_word_embeddings=False, max_position_embeddings=131072,
                         rope_parameters=dict(LLAMA3_ROPE), **SHAPE, **_special_ids(tokenizer))
    return LlamaForCausalLM(config)


_FAMILIES = {TINY_QWEN2: (qwen25_tokenizer, _qwen2, QWEN25_END_OF_TURN),
             TINY_LLAMA3: (llama32_tokenizer, _llama3, LLAMA32_END_OF_TURN)}
