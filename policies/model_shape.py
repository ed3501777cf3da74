"""The shape of a decoder-only transformer, from its ``config.json`` alone (no weights are read, no torch): what
the memory plan (``policies/memory_plan.py``) and the benchmarks' cost models depend on. ``model_shape(name)``
reads it for a ``--model`` name: a preset (:data:`PRESETS`, the paper's models and the project's two), a model
directory, or a hub id whose ``config.json`` is in the Hugging Face cache.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

TINY_RANDOM, SMOLLM2 = "tiny-random", "smollm2-135m"


class ModelShapeError(LookupError):
    """A model whose config shape cannot be found; the message names every place that was looked at."""


@dataclass(frozen=True)
class ModelShape:
    """The shape of a decoder-only transformer (Llama/Qwen2 family): what memory depends on.

    ``qkv_bias``: biases on the q, k and v projections (Qwen2); ``o_bias``: on the output projection (Llama's
    ``attention_bias`` puts both); ``mlp_bias``: on the gate, up and down projections."""

    name: str
    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    tied_embeddings: bool
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def layer_parameters(self) -> int:
        """One decoder layer: the q, k, v, o projections, the gated MLP, two RMSNorm weights, and the biases."""
        h = self.hidden
        attention = h * self.q_dim + 2 * h * self.kv_dim + self.q_dim * h
        attention += (self.q_dim + 2 * self.kv_dim) * self.qkv_bias + h * self.o_bias
        mlp = 3 * h * self.intermediate + (2 * self.intermediate + h) * self.mlp_bias
        return attention + mlp + 2 * h

    @property
    def embedding_parameters(self) -> int:
        """The input embedding, plus the LM head when it is not tied to it."""
        return self.vocab * self.hidden * (1 if self.tied_embeddings else 2)

    @property
    def parameters(self) -> int:
        """All parameters: embeddings, decoder layers and the final norm."""
        return self.embedding_parameters + self.layers * self.layer_parameters + self.hidden

    def lora_parameters(self, rank: int) -> int:
        """LoRA adapters of ``rank`` on q, k, v and o (``policies.models.LoraSettings``'s targets): A [r, in] and
        B [out, r] per projection and layer."""
        h = self.hidden
        per_layer = rank * ((h + self.q_dim) + 2 * (h + self.kv_dim) + (self.q_dim + h))
        return self.layers * per_layer


def _llama(name: str, vocab: int, hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int,
           tied: bool, qkv_bias: bool = False) -> ModelShape:
    return ModelShape(name=name, vocab=vocab, hidden=hidden, intermediate=intermediate, layers=layers, heads=heads,
                      kv_heads=kv_heads, head_dim=hidden // heads, tied_embeddings=tied, qkv_bias=qkv_bias)


# The config.json shapes of the paper's models (shapes only, no weights), and the project's own two names:
# tiny-random is policies.models.build_tiny_random's default (SmolLM2's vocabulary: len(tokenizer) = 49152).
PRESETS: dict[str, ModelShape] = {
    "qwen2.5-1.5b-instruct": _llama("qwen2.5-1.5b-instruct", 151936, 1536, 8960, 28, 12, 2, True, qkv_bias=True),
    "qwen2.5-3b-instruct": _llama("qwen2.5-3b-instruct", 151936, 2048, 11008, 36, 16, 2, True, qkv_bias=True),
    "qwen2.5-7b-instruct": _llama("qwen2.5-7b-instruct", 152064, 3584, 18944, 28, 28, 4, False, qkv_bias=True),
    "llama-3.2-3b-instruct": _llama("llama-3.2-3b-instruct", 128256, 3072, 8192, 28, 24, 8, True),
    SMOLLM2: _llama(SMOLLM2, 49152, 576, 1536, 30, 9, 3, True),
    TINY_RANDOM: _llama(TINY_RANDOM, 49152, 64, 128, 2, 2, 1, True),
}


def shape_from_config(config: dict[str, Any], name: str) -> ModelShape:
    """The shape in a Hugging Face ``config.json`` (Llama, Qwen2 and the configs that share their keys). Missing
    ``num_key_value_heads``, ``head_dim`` and ``tie_word_embeddings`` take Llama's and Qwen2's defaults (no GQA,
    hidden / heads, untied); Qwen2 models have q, k, v biases."""
    config = config.get("text_config", config)  # a multimodal wrapper holds the language model's config
    required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    missing = [key for key in required if not config.get(key)]
    if missing:
        raise ModelShapeError(f"{name}: its config.json has no {', '.join(missing)}; the memory plan reads "
                              "decoder-only transformer configs (Llama, Qwen2)")
    heads = int(config["num_attention_heads"])
    qwen2 = str(config.get("model_type", "")).startswith("qwen2")
    attention_bias = bool(config.get("attention_bias", False))
    return ModelShape(
        name=name, vocab=int(config["vocab_size"]), hidden=int(config["hidden_size"]),
        intermediate=int(config["intermediate_size"]), layers=int(config["num_hidden_layers"]), heads=heads,
        kv_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=int(config.get("head_dim") or config["hidden_size"] // heads),
        tied_embeddings=bool(config.get("tie_word_embeddings", False)),
        qkv_bias=qwen2 or attention_bias, o_bias=attention_bias and not qwen2,
        mlp_bias=bool(config.get("mlp_bias", False)))


def _cached_hub_config(repo_id: str, cache_dir: str | Path | None) -> Path | None:
    """The cached ``config.json`` of hub id ``repo_id`` (no network), or None."""
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(repo_id, "config.json", cache_dir=cache_dir)
    except ValueError:  # not a valid hub id (HFValidationError)
        return None
    return Path(found) if isinstance(found, str) else None


def _hub_cache(cache_dir: str | Path | None) -> str:
    if cache_dir is not None:
        return str(cache_dir)
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def model_shape(name: str, *, hub_cache_dir: str | Path | None = None) -> ModelShape:
    """The shape of ``--model NAME``: a preset (:data:`PRESETS`, case-insensitive, including the project's
    ``tiny-random`` and ``smollm2-135m``), a model directory holding ``config.json``, a hub id whose
    ``config.json`` is in the Hugging Face cache (``hub_cache_dir``, default the hub's; never the network), or the
    hub id of a preset not yet downloaded (``Qwen/Qwen2.5-1.5B-Instruct``: the preset's shape).
    :class:`ModelShapeError` names what was looked for when none holds it."""
    if name.lower() in PRESETS:
        return PRESETS[name.lower()]
    path = Path(name).expanduser()
    if path.is_dir():
        config = path / "config.json"
        if not config.is_file():
            raise ModelShapeError(f"{path} is a directory without config.json: not a model directory")
        return shape_from_config(_read_config(config), name)
    cached = _cached_hub_config(name, hub_cache_dir)
    if cached is not None:
        return shape_from_config(_read_config(cached), name)
    preset = name.rsplit("/", 1)[-1].lower()  # a paper model's hub id before its first download
    if preset in PRESETS:
        return replace(PRESETS[preset], name=name)
    raise ModelShapeError(
        f"no config for model {name!r}: not a model directory with config.json, not a hub id whose config.json is "
        f"in the Hugging Face cache ({_hub_cache(hub_cache_dir)}), not a preset ({', '.join(PRESETS)})")


def _read_config(path: Path) -> dict[str, Any]:
    """A config.json's fields; a ``ModelShapeError`` naming the file where it is not a JSON object."""
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ModelShapeError(f"{path}: not valid JSON ({error})") from None
    if not isinstance(config, dict):
        raise ModelShapeError(f"{path}: not a JSON object, as a model's config.json is")
    return config
