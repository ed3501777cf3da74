"""The LLM policy as an RLlib ``TorchRLModule``.

Inference side: ``generator()`` hands the env runner a :class:`~policies.hf_generation.HFStepGenerator` over this
module's model (text does not pass through RLlib's connectors; see notes on RLlib and text spaces).
Train side: ``forward_train`` takes padded ``input_ids`` / ``attention_mask`` and returns per-token log-probs
(and entropies when asked), as :func:`policies.logprobs.sequence_logprobs` computes them (``share_prefixes=True``:
each unique token of the rows once).

``model_config`` keys: ``model`` (a ``--model`` name, default ``tiny-random``), ``dtype`` (the compute dtype,
``float32`` or ``bfloat16``: see :mod:`policies.precision`), ``pure_bf16`` (bfloat16 master weights too),
``gradient_checkpointing`` (recompute each decoder layer's activations in the backward pass), ``lora`` (None, or a
dict of :class:`~policies.models.LoraSettings` fields), ``seed``, ``logprob_chunk`` (scored positions per LM-head
chunk, default ``policies.memory_plan.HEAD_CHUNK_POSITIONS``), ``sync_bucket_mib`` (the bound on one bucket of the
weight sync, :mod:`policies.weight_sync`).

Precision: a trained module (the learner's) holds its weights in the master dtype (float32 unless ``pure_bf16``)
and runs ``forward_train`` under autocast to the compute dtype; an inference-only module (an env runner's) holds
its weights in the compute dtype. The weight sync (``sync_specs`` / ``sync_buckets`` on the learner's module,
``load_synced`` on the engine's) sends them in that dtype, in buckets, each tensor once; ``get_state`` /
``set_state`` are the whole state dict (checkpoints; ``get_state(inference_only=True)``: cast to the compute
dtype). A LoRA base is frozen: it is loaded in the compute dtype, its adapters in float32.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator
from contextlib import nullcontext
from typing import Any

import numpy as np
import torch
from ray.rllib.core.rl_module.torch import TorchRLModule
from ray.rllib.utils.annotations import override

from policies.activation_checkpointing import enable_gradient_checkpointing
from policies.generation import SamplingSettings
from policies.hf_generation import HFStepGenerator
from policies.logprobs import sequence_logprobs
from policies.memory_plan import HEAD_CHUNK_POSITIONS
from policies.models import LoraSettings, load_model
from policies.precision import cast_floating, precision_of, weights_dtype
from policies.weight_sync import (
    DEFAULT_BUCKET_MIB,
    Bucket,
    TensorSpec,
    bucket_bytes,
    engine_tensors,
    load_buckets,
    pack_buckets,
    tensor_specs,
)

DEFAULT_MODEL_CONFIG: dict[str, Any] = {
    "model": "tiny-random", "dtype": "float32", "pure_bf16": False, "gradient_checkpointing": False, "lora": None,
    "seed": 0, "logprob_chunk": HEAD_CHUNK_POSITIONS, "sync_bucket_mib": DEFAULT_BUCKET_MIB,
}


def check_model_config(model_config: dict[str, Any] | None) -> dict[str, Any]:
    """``model_config`` over ``DEFAULT_MODEL_CONFIG``; a ``ValueError`` naming an unknown key, a dtype or precision
    ``precision_of`` refuses, or LoRA settings ``LoraSettings`` refuses."""
    unknown = set(model_config or {}) - set(DEFAULT_MODEL_CONFIG)
    if unknown:
        raise ValueError(f"unknown model_config keys {sorted(unknown)}; known: {sorted(DEFAULT_MODEL_CONFIG)}")
    cfg = {**DEFAULT_MODEL_CONFIG, **(model_config or {})}
    with warnings.catch_warnings():  # pure bf16's warning is the module's to give, once
        warnings.simplefilter("ignore")
        precision_of(cfg["dtype"], pure_bf16=cfg["pure_bf16"])
    if cfg["lora"]:
        try:
            LoraSettings(**cfg["lora"])
        except TypeError as error:
            raise ValueError(f"model_config lora: {error}") from None
    return cfg


class LLMRLModule(TorchRLModule):
    """A Hugging Face causal LM as an RLlib RLModule (see the module docstring)."""

    @override(TorchRLModule)
    def setup(self) -> None:
        cfg = check_model_config(self.model_config)
        lora = LoraSettings(**cfg["lora"]) if cfg["lora"] else None
        self.precision = precision_of(cfg["dtype"], pure_bf16=cfg["pure_bf16"])
        dtype = weights_dtype(self.precision, inference_only=self.inference_only, lora=lora is not None)
        self.model, self.tokenizer = load_model(cfg["model"], dtype=dtype, lora=lora, seed=cfg["seed"])
        if cfg["gradient_checkpointing"] and not self.inference_only:
            enable_gradient_checkpointing(self.model)
        self.logprob_chunk = int(cfg["logprob_chunk"])
        # False when the parameters arrive in the compute dtype already (FSDP's mixed precision, set by the learner)
        self.autocast_passes = True
        self.sync_bucket_bytes = bucket_bytes(cfg["sync_bucket_mib"])

    def generator(self, settings: SamplingSettings | None = None, *, keep_cache: bool = True) -> HFStepGenerator:
        """A step generator over this module's (current) weights, in eval mode."""
        self.model.eval()
        return HFStepGenerator(self.model, self.tokenizer, settings, keep_cache=keep_cache)

    @override(TorchRLModule)
    def _forward(self, batch: dict[str, Any], **kwargs) -> dict[str, Any]:
        raise NotImplementedError(
            "LLMRLModule acts on text through generator(); RLlib's default forward/connector path cannot "
            "tensorize text observations. Use forward_train for log-probs of token batches."
        )

    @override(TorchRLModule)
    def _forward_train(self, batch: dict[str, Any], *, return_entropy: bool = False, share_prefixes: bool = False,
                       temperature: float = 1.0, **kwargs) -> dict[str, Any]:
        """:func:`policies.logprobs.sequence_logprobs` of this module's model: per-token log-probs [B, T] (and
        entropies) of the softmax at ``temperature``, each unique token of the rows computed once with
        ``share_prefixes``; under autocast to the compute dtype when the weights are wider (mixed precision), unless
        FSDP gathers them in the compute dtype (``autocast_passes`` False)."""
        autocast = self.precision.autocast(batch["input_ids"].device) if self.autocast_passes else nullcontext()
        with autocast:
            return sequence_logprobs(self.model, batch, return_entropy=return_entropy, share_prefixes=share_prefixes,
                                     chunk_positions=self.logprob_chunk, temperature=temperature)

    def sync_specs(self) -> tuple[TensorSpec, ...]:
        """The weight sync's tensors (:func:`policies.weight_sync.tensor_specs`) in the compute dtype."""
        return tensor_specs(self.model, self.precision.compute)

    def sync_buckets(self) -> Iterator[Bucket]:
        """The weight sync's buckets of at most ``sync_bucket_mib`` MiB, made one at a time (sharded parameters
        gathered one at a time: every rank must consume the iterator); page-locked when the weights are on a GPU."""
        compute = self.precision.compute
        on_gpu = next(self.model.parameters()).is_cuda
        return pack_buckets(engine_tensors(self.model, compute), compute, self.sync_bucket_bytes, pin_memory=on_gpu)

    def load_synced(self, specs: Iterable[TensorSpec], buckets: Iterable[Bucket]) -> None:
        """Copy a weight sync's buckets into this module's weights in place (a ``ValueError`` when ``specs`` do
        not match the module)."""
        load_buckets(self.model, specs, buckets)

    @override(TorchRLModule)
    def get_state(self, components=None, *, not_components=None, inference_only: bool = False, **kwargs) -> dict:
        """CPU torch tensors, not numpy: RLlib's numpy conversion fails for bfloat16. ``inference_only`` (the
        weight sync to the rollout engines): cast to the compute dtype, the dtype the engines hold."""
        state = {name: tensor.detach().cpu() for name, tensor in self.state_dict().items()}
        return cast_floating(state, self.precision.compute) if inference_only else state

    @override(TorchRLModule)
    def set_state(self, state: dict) -> None:
        tensors = {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in state.items()}
        missing, unexpected = self.load_state_dict(tensors, strict=False)
        if missing or unexpected:
            raise ValueError(f"state does not match the module: missing {missing[:5]}, unexpected {unexpected[:5]}")
