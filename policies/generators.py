"""Choosing a generation backend: ``hf`` (transformers, :mod:`policies.hf_generation`) or ``vllm``
(:mod:`policies.vllm_generation`), and ``auto``: vllm when it is installed and a GPU is visible; on a CPU the
HF backend is as fast and simpler, and vLLM's CPU build is a test vehicle."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from policies.generation import GENERATORS, SamplingSettings, StepGenerator
from policies.hf_generation import HFStepGenerator
from policies.vllm_generation import VLLMEngine, VLLMStepGenerator, vllm_installed


def resolve_generator(choice: str) -> str:
    """``hf`` or ``vllm`` for a ``--generator`` choice (``auto`` resolved in this process)."""
    if choice not in GENERATORS:
        raise ValueError(f"generator must be one of {GENERATORS}, got {choice!r}")
    if choice != "auto":
        return choice
    return "vllm" if vllm_installed() and torch.cuda.is_available() else "hf"


def step_generator(backend: str, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                   sampling: SamplingSettings) -> StepGenerator:
    """A step generator of ``backend`` (``hf`` or ``vllm``) over ``model``'s current weights; with vllm, an
    engine of its own (for one-off use such as evaluation: a trainer keeps one engine and syncs it)."""
    if backend == "vllm":
        return VLLMStepGenerator(VLLMEngine(model, tokenizer, sampling), tokenizer, model, sampling)
    return HFStepGenerator(model.eval(), tokenizer, sampling)
