"""The LLM policy as an RLlib ``TorchRLModule``.

Inference side: ``generator()`` hands the env runner a :class:`~policies.generation.HFStepGenerator` over this
module's model (text does not pass through RLlib's connectors; see notes on RLlib and text spaces).
Train side: ``forward_train`` takes padded ``input_ids`` / ``attention_mask`` and returns per-token log-probs
(and entropies when asked), computed chunk by chunk over the sequence so that no [B, T, V] logits tensor is
ever alive (each chunk's logits are recomputed in the backward pass).

``model_config`` keys: ``model`` (a ``--model`` name, default ``tiny-random``), ``dtype`` (``float32`` or
``bfloat16``), ``lora`` (None, or a dict of :class:`~policies.models.LoraSettings` fields), ``seed``,
``logprob_chunk`` (positions per chunk, default 256).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from ray.rllib.core.rl_module.torch import TorchRLModule
from ray.rllib.utils.annotations import override
from torch.utils.checkpoint import checkpoint

from policies.generation import HFStepGenerator, SamplingSettings
from policies.models import LoraSettings, load_model

DEFAULT_MODEL_CONFIG: dict[str, Any] = {
    "model": "tiny-random", "dtype": "float32", "lora": None, "seed": 0, "logprob_chunk": 256,
}
LOGPROBS, ENTROPY = "logprobs", "entropy"
GENERATED_MASK = "generated_mask"  # optional batch key: the positions to score


def _scatter(chunks: list[torch.Tensor], rows: torch.Tensor, cols: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Per-position values of the next-token predictions back into a [B, T] tensor (0 elsewhere; position t + 1
    holds the prediction made at t)."""
    values = torch.cat(chunks) if chunks else torch.zeros(0, device=rows.device)
    out = torch.zeros(shape, dtype=torch.float32, device=rows.device)
    return out.index_put((rows, cols + 1), values.to(torch.float32))


def token_logprobs_and_entropy(
    hidden: torch.Tensor, head: torch.nn.Module, targets: torch.Tensor, *, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of each target under ``head(hidden)`` (and the distribution's entropy), in float32.

    hidden: [B, C, H]; targets: [B, C]. Returns ([B, C], [B, C] or None).
    """
    logits = head(hidden).float()
    logp = torch.log_softmax(logits, dim=-1)
    chosen = logp.gather(-1, targets[..., None]).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1) if with_entropy else None
    return chosen, entropy


class LLMRLModule(TorchRLModule):
    """A Hugging Face causal LM as an RLlib RLModule (see the module docstring)."""

    @override(TorchRLModule)
    def setup(self) -> None:
        unknown = set(self.model_config or {}) - set(DEFAULT_MODEL_CONFIG)
        if unknown:
            raise ValueError(f"unknown model_config keys {sorted(unknown)}; known: {sorted(DEFAULT_MODEL_CONFIG)}")
        cfg = {**DEFAULT_MODEL_CONFIG, **(self.model_config or {})}
        lora = LoraSettings(**cfg["lora"]) if cfg["lora"] else None
        self.model, self.tokenizer = load_model(cfg["model"], dtype=cfg["dtype"], lora=lora, seed=cfg["seed"])
        self.logprob_chunk = int(cfg["logprob_chunk"])

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
    def _forward_train(self, batch: dict[str, Any], *, return_entropy: bool = False, **kwargs) -> dict[str, Any]:
        """Per-token log-probs: ``logprobs[b, t] = log p(input_ids[b, t] | input_ids[b, :t])`` ([B, T], 0 at t=0
        and at padding), and ``entropy`` [B, T] of the same next-token distributions when asked. With a
        ``generated_mask`` [B, T] in the batch only its positions are scored (the others are 0): the LM head,
        which dominates small models, then runs on the generated tokens alone."""
        input_ids, mask = batch["input_ids"], batch["attention_mask"]
        base = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        positions = (mask.long().cumsum(-1) - 1).clamp(min=0)  # right or left padding alike
        hidden = base.get_decoder()(input_ids=input_ids, attention_mask=mask, position_ids=positions).last_hidden_state
        # position t's hidden state predicts token t + 1
        scored = (mask[:, 1:] * mask[:, :-1]).bool()
        if GENERATED_MASK in batch:
            scored &= batch[GENERATED_MASK][:, 1:].bool()
        rows, cols = scored.nonzero(as_tuple=True)
        hidden, head, targets = hidden[:, :-1][rows, cols], base.get_output_embeddings(), input_ids[:, 1:][rows, cols]
        chunks_lp, chunks_ent = [], []
        chunk = self.logprob_chunk * input_ids.shape[0]  # as many logits at a time as logprob_chunk positions per row
        for start in range(0, len(targets), chunk):
            args = (hidden[start:start + chunk], head, targets[start:start + chunk])
            if torch.is_grad_enabled():  # recompute the chunk's logits in backward instead of keeping them
                lp, ent = checkpoint(token_logprobs_and_entropy, *args, with_entropy=return_entropy,
                                     use_reentrant=False)
            else:
                lp, ent = token_logprobs_and_entropy(*args, with_entropy=return_entropy)
            chunks_lp.append(lp)
            chunks_ent.append(ent)
        out = {LOGPROBS: _scatter(chunks_lp, rows, cols, input_ids.shape)}
        if return_entropy:
            out[ENTROPY] = _scatter(chunks_ent, rows, cols, input_ids.shape)
        return out

    @override(TorchRLModule)
    def get_state(self, components=None, *, not_components=None, inference_only: bool = False, **kwargs) -> dict:
        """CPU torch tensors, not numpy: RLlib's numpy conversion fails for bfloat16."""
        return {name: tensor.detach().cpu() for name, tensor in self.state_dict().items()}

    @override(TorchRLModule)
    def set_state(self, state: dict) -> None:
        tensors = {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in state.items()}
        missing, unexpected = self.load_state_dict(tensors, strict=False)
        if missing or unexpected:
            raise ValueError(f"state does not match the module: missing {missing[:5]}, unexpected {unexpected[:5]}")
