"""The Tree-GRPO learner: one optimizer step per update, gradient accumulation over micro-batches.

Per update (one iteration's batch, or this learner's shard of it):
1. recompute, without gradients, the old log-probs (current weights, which generated the samples) and the
   reference log-probs (the frozen initial policy; with LoRA, the base model with adapters off);
2. for each micro-batch: the clipped policy loss + k3 KL - entropy bonus, token-mean over the generated
   tokens of the WHOLE update (micro-batch losses are weighted by their token share), backward (DDP syncs
   gradients on the last micro-batch only);
3. clip the global gradient norm, set the warmed-up learning rate, AdamW step.
Observation and prompt tokens never enter the loss (``generated_mask``).
"""

from __future__ import annotations

import contextlib
import copy

import torch
from ray.rllib.core import DEFAULT_MODULE_ID
from ray.rllib.core.learner.torch.torch_learner import TorchLearner
from ray.rllib.utils.annotations import override

from algos.batch import ADVANTAGES, ATTENTION_MASK, GENERATED_MASK, INPUT_IDS, SAMPLING_LOGPROBS
from algos.losses import clipped_policy_loss, k3_kl, masked_mean
from algos.tree_grpo import metrics as M
from policies.rl_module import ENTROPY, LOGPROBS


class TreeGRPOTorchLearner(TorchLearner):
    @override(TorchLearner)
    def build(self) -> None:
        super().build()
        model = self.module[DEFAULT_MODULE_ID].unwrapped().model
        self._uses_lora = hasattr(model, "disable_adapter")
        self._reference = None
        if not self._uses_lora and self.config.kl_coef > 0:
            self._reference = copy.deepcopy(model).eval().requires_grad_(False)
        self._optimizer_steps = 0

    @override(TorchLearner)
    def configure_optimizers_for_module(self, module_id, config=None) -> None:
        params = [p for p in self.get_parameters(self._module[module_id]) if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=config.lr, betas=(0.9, 0.999), weight_decay=config.weight_decay)
        self.register_optimizer(module_id=module_id, optimizer=optimizer, params=params, lr_or_lr_schedule=config.lr)

    def _reference_logprobs(self, part: dict[str, torch.Tensor]) -> torch.Tensor:
        module = self.module[DEFAULT_MODULE_ID].unwrapped()
        if self._uses_lora:
            with module.model.disable_adapter():
                return module.forward_train(part)[LOGPROBS]
        live = module.model
        module.model = self._reference  # the same log-prob code path, on the frozen weights
        try:
            return module.forward_train(part)[LOGPROBS]
        finally:
            module.model = live

    @override(TorchLearner)
    def _uncompiled_update(self, batch: dict, **kwargs):
        cfg, module = self.config, self.module[DEFAULT_MODULE_ID]
        data = batch[DEFAULT_MODULE_ID]
        rows = data[INPUT_IDS].shape[0]
        parts = [{k: data[k][s : s + cfg.micro_batch_size] for k in (INPUT_IDS, ATTENTION_MASK, GENERATED_MASK,
                                                                   SAMPLING_LOGPROBS, ADVANTAGES)}
                 for s in range(0, rows, cfg.micro_batch_size)]
        total_tokens = data[GENERATED_MASK].sum().clamp(min=1.0)
        with torch.no_grad():
            for part in parts:
                part["old"] = module.unwrapped().forward_train(part)[LOGPROBS]
                part["ref"] = self._reference_logprobs(part) if cfg.kl_coef > 0 else part["old"]
        params = [p for p in module.parameters() if p.requires_grad]
        for p in params:
            p.grad = None
        totals: dict[str, float] = {}
        total_loss = 0.0
        for i, part in enumerate(parts):
            sync = contextlib.nullcontext() if i == len(parts) - 1 or cfg.num_learners <= 1 else module.no_sync()
            with sync:
                out = module.forward_train(part, return_entropy=cfg.entropy_coef > 0)
                loss, stats = self.loss_and_stats(part, out)
                share = part[GENERATED_MASK].sum() / total_tokens
                (loss * share).backward()
                total_loss += loss.item() * float(share)
            for key, value in stats.items():  # token-weighted means, extremes for the ratio bounds
                if key in (M.RATIO_MAX, M.RATIO_MIN):
                    pick = max if key == M.RATIO_MAX else min
                    totals[key] = pick(totals.get(key, value), value)
                else:
                    totals[key] = totals.get(key, 0.0) + value * float(share)
        grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip) if cfg.grad_clip else torch.tensor(0.0)
        lr = cfg.lr * min(1.0, (self._optimizer_steps + 1) / cfg.warmup_steps) if cfg.warmup_steps else cfg.lr
        for optimizer in self._named_optimizers.values():
            self._set_optimizer_lr(optimizer, lr)
        self.apply_gradients({self.get_param_ref(p): p.grad for p in params if p.grad is not None})
        self._optimizer_steps += 1
        totals.update({M.GRAD_NORM: float(grad_norm), M.LEARNING_RATE: lr, M.TRAINED_TOKENS: float(total_tokens)})
        for key, value in totals.items():
            self.metrics.log_value((DEFAULT_MODULE_ID, key), value, window=1)
        return {}, {DEFAULT_MODULE_ID: torch.tensor(total_loss)}, {}  # logged by RLlib as total_loss

    @override(TorchLearner)
    def compute_loss_for_module(self, *, module_id, config, batch: dict, fwd_out: dict) -> torch.Tensor:
        """The loss of one micro-batch whose ``old`` and ``ref`` log-probs are filled in (see the module doc)."""
        return self.loss_and_stats(batch, fwd_out)[0]

    def loss_and_stats(self, part: dict[str, torch.Tensor], out: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict]:
        """Token-mean loss of a micro-batch: clipped policy loss + kl_coef * k3 KL - entropy_coef * entropy."""
        cfg, mask = self.config, part[GENERATED_MASK]
        logprobs = out[LOGPROBS]
        policy_loss, stats = clipped_policy_loss(logprobs, part["old"], part[ADVANTAGES][:, None], mask,
                                                 clip=cfg.clip_eps, dual_clip=cfg.dual_clip)
        kl = masked_mean(k3_kl(logprobs, part["ref"]), mask)
        entropy = masked_mean(out[ENTROPY], mask) if ENTROPY in out else torch.zeros(())
        loss = policy_loss + cfg.kl_coef * kl - cfg.entropy_coef * entropy
        gap = masked_mean((part[SAMPLING_LOGPROBS] - part["old"]).abs(), mask)
        return loss, {
            M.POLICY_LOSS: policy_loss.item(), M.KL: kl.item(), M.ENTROPY: entropy.item(),
            M.CLIP_FRACTION: stats.clip_fraction, M.DUAL_CLIP_FRACTION: stats.dual_clip_fraction,
            M.RATIO_MEAN: stats.ratio_mean, M.RATIO_MAX: stats.ratio_max, M.RATIO_MIN: stats.ratio_min,
            M.SAMPLER_LOGPROB_GAP: gap.item(),
        }
