"""Activation checkpointing of a causal LM's decoder layers: each layer's activations are recomputed in the backward
pass instead of kept, so a micro-batch's activations cost its layers' inputs plus one layer's worth (same loss and
gradients, about a third more compute). Ray-free, so that the GPU checks run it without RLlib."""

from __future__ import annotations

import torch


def enable_gradient_checkpointing(model: torch.nn.Module) -> None:
    """Recompute each decoder layer's activations in the backward pass (non-reentrant checkpoints: any inputs,
    the tree mask and flex_attention's block mask included, and frozen inputs under LoRA). A ``ValueError`` names
    the model class when transformers has no checkpointing for it."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not getattr(base, "supports_gradient_checkpointing", False):
        raise ValueError(f"gradient_checkpointing: {type(base).__name__} does not support activation checkpointing "
                         f"in transformers; run without --gradient-checkpointing")
    kwargs = {"use_reentrant": False}
    if hasattr(base, "activation_checkpointing_enable"):  # transformers >= 5.20's name; the old one warns there
        base.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
