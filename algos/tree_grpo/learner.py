"""The Tree-GRPO learner: PPO mini-batches over an iteration's batch, gradient accumulation over micro-batches.

Per update (one iteration's batch, or this learner's shard of it):
1. fix the old log-probs once, before the first step: the sampler's own (``old_logprobs="sampler"``) or the
   current weights' (``"recompute"``, one forward pass without gradients); with recomputed old log-probs, the
   truncated importance weights ``min(exp(old - sampler), tis_cap)`` (per token or per trajectory) correct
   for a sampler whose numerics differ from the learner's (another engine, bf16). Also without gradients: the
   reference log-probs (the frozen initial policy; with LoRA, the base model with adapters off);
2. ``ppo_epochs`` passes over ``ppo_mini_batches`` mini-batches of whole prompt groups, one optimizer step
   each: for each micro-batch the clipped policy loss + k3 KL - entropy bonus, token-mean over the generated
   tokens of the mini-batch (micro-batch losses weighted by their token share), backward (DDP syncs gradients on
   the mini-batch's last micro-batch only); then RLlib's gradient postprocessing (``grad_clip`` /
   ``grad_clip_by``), the scheduled learning rate (``algos.lr_schedule``) and the AdamW step, which is skipped
   when the gradient norm is NaN or infinite (``skip_nonfinite_grad``, as verl). From the second
   step on, the policy has moved away from the old log-probs: the ratio and its clipping act.
Observation and prompt tokens never enter the loss (``generated_mask``).

Several learners (``num_learners`` > 1, DDP) take the steps one learner would take on the whole batch. The
algorithm lays the batch out with :func:`learner_shards`: the mini-batches are cut from the whole batch (whole prompt
groups), and each learner's shard (RLlib's learner group hands learner i the i-th block of rows) holds a part of
every mini-batch, tagged ``MINI_BATCH``, so step k of every learner is on its rows of mini-batch k. The token-mean
is over the mini-batch's generated tokens on all learners (their count all-reduced once per step), and each
learner's loss is scaled by world size / that count, so that DDP's average of the learners' gradients is the
gradient of the whole mini-batch's token-mean. A learner without rows in a mini-batch (or without any row) still
runs a forward and backward pass, on a stand-in row whose loss counts 0, so that it joins the DDP collectives
the others wait for; every learner takes the same steps.

The schedule position (``OPTIMIZER_STEPS``, optimizer steps taken) is part of the learner's state next to
the optimizer state, so a resumed run continues its warm-up and decay instead of restarting them.
"""

from __future__ import annotations

import contextlib
import itertools
import math

import numpy as np
import torch
import torch.distributed as dist
from ray.rllib.core import COMPONENT_OPTIMIZER, DEFAULT_MODULE_ID
from ray.rllib.core.learner.torch.torch_learner import TorchLearner
from ray.rllib.utils.annotations import override
from ray.rllib.utils.typing import StateDict

from algos.batch import (
    ADVANTAGES,
    ATTENTION_MASK,
    INPUT_IDS,
    MINI_BATCH,
    PROMPT_INDEX,
    SAMPLING_LOGPROBS,
    micro_batch_slices,
    minibatch_slices,
)
from algos.losses import (
    MismatchStats,
    clipped_policy_loss,
    k3_kl,
    masked_mean,
    sampler_mismatch,
    truncated_importance_weights,
)
from algos.lr_schedule import scheduled_lr
from algos.tree_grpo import metrics as metric_keys
from policies.logprobs import (
    ENTROPY,
    GENERATED_MASK,
    LOGPROBS,
    PACKED_TOKENS,
    PACKING,
    REAL_TOKENS,
    UNIQUE_TOKENS,
    PackedRows,
    pack_rows,
)
from policies.memory import peak_memory_gib, reset_peak_memory
from policies.reference_model import ReferenceModel

# a learner state key too: optimizer steps taken so far (the schedule position)
OPTIMIZER_STEPS = metric_keys.OPTIMIZER_STEPS
OLD, REF, TIS = "old_logprobs", "ref_logprobs", "tis_weights"  # columns the update adds to its batch
MISMATCH = "mismatch"  # a step's sampler mismatch metrics (the first step's, when the old log-probs are the sampler's)
LOSS = "loss"  # a step's total loss (policy + KL - entropy terms), returned to RLlib as total_loss
TOKENS = "tokens"  # the generated tokens a step's (or the mismatch's) partial sums are over, on this learner
# per-step metrics that combine as extremes, not as token-weighted means
EXTREMES = (metric_keys.RATIO_MAX, metric_keys.RATIO_MIN)
# per-step metrics equal on every learner (after DDP's gradient all-reduce)
SAME_ON_EVERY_LEARNER = (metric_keys.GRAD_NORM, metric_keys.NONFINITE_GRAD_SHARE, metric_keys.LEARNING_RATE)


def mismatch_metrics(stats: MismatchStats) -> dict[str, float]:
    return {metric_keys.SAMPLER_RATIO_MEAN: stats.ratio_mean, metric_keys.SAMPLER_RATIO_P99: stats.ratio_p99,
            metric_keys.SAMPLER_RATIO_OUTSIDE: stats.outside}


def _mismatch_sums(learner_logprobs: torch.Tensor, data: dict[str, torch.Tensor]) -> dict[str, float]:
    """The sampler mismatch of ``data``'s rows as sums over its generated tokens (``TOKENS`` of them; the 99th
    percentile as it is, -inf without tokens), to be added up over the learners (``_across_learners``)."""
    mask = data[GENERATED_MASK]
    tokens = float(mask.sum())
    stats = sampler_mismatch(learner_logprobs, data[SAMPLING_LOGPROBS], mask)
    return {metric_keys.SAMPLER_RATIO_MEAN: stats.ratio_mean * tokens,
            metric_keys.SAMPLER_RATIO_OUTSIDE: stats.outside * tokens,
            metric_keys.SAMPLER_RATIO_P99: stats.ratio_p99 if tokens else -math.inf,
            metric_keys.TIS_WEIGHT_MEAN: float((data[TIS] * mask).sum()), TOKENS: tokens}


def old_logprobs_source(choice: str, compute_dtype: torch.dtype, generator: str = "hf") -> str:
    """``sampler`` or ``recompute``: ``auto`` takes the sampler's when the HF generator computes in float32 (it
    then computes what the learner would, up to KV-cache rounding), and recomputes otherwise (bf16 compute, or
    another engine such as vLLM, whose kernels differ)."""
    if choice != "auto":
        return choice
    return "sampler" if generator == "hf" and compute_dtype == torch.float32 else "recompute"


def gradient_norm(gradients: list[torch.Tensor]) -> float:
    """The global L2 norm of ``gradients``, NaN or inf when one of them is (RLlib's ``compute_global_norm``
    replaces those by 0 and 1e9, which would hide them)."""
    if not gradients:
        return 0.0
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.detach()) for g in gradients])))


def _cpu_copy(optimizer_state: dict) -> dict:
    """A torch optimizer's ``state_dict()`` with every per-parameter tensor copied to the CPU."""
    return {**optimizer_state, "state": {
        index: {key: value.detach().to("cpu", copy=True) if torch.is_tensor(value) else value
                for key, value in per_param.items()}
        for index, per_param in optimizer_state["state"].items()}}


class TreeGRPOTorchLearner(TorchLearner):
    @override(TorchLearner)
    def build(self) -> None:
        super().build()
        module = self.module[DEFAULT_MODULE_ID].unwrapped()
        model = module.model
        self._uses_lora = hasattr(model, "disable_adapter")
        self._reference = None
        if not self._uses_lora and self.config.kl_coef > 0:  # in the compute dtype: the passes run in it anyway
            self._reference = ReferenceModel(model, dtype=module.precision.compute, device=self._device,
                                             offload=self.config.reference_offload)
        self._optimizer_steps = 0
        # DDP's world (RLlib wraps the module in DDP when num_learners > 1; Ray Train set up the process group)
        self._world = dist.get_world_size() if self.config.num_learners > 1 else 1
        settings = self.config.settings
        self._mini_batches, self._epochs = settings.mini_batches, settings.ppo_epochs
        self._warmup_steps, self._total_steps = settings.warmup_optimizer_steps, settings.total_optimizer_steps
        self._old_source = old_logprobs_source(self.config.old_logprobs, module.precision.compute,
                                               settings.generator_backend)
        if settings.learner_attention is not None:  # this learner's copy only: the env runners keep theirs
            base = model.get_base_model() if self._uses_lora else model
            base.set_attn_implementation(settings.learner_attention)

    @override(TorchLearner)
    def configure_optimizers_for_module(self, module_id, config=None) -> None:
        params = [p for p in self.get_parameters(self._module[module_id]) if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=config.lr, betas=(0.9, 0.999), weight_decay=config.weight_decay)
        # No RLlib lr schedule: the update sets the warmed-up rate itself; RLlib's schedule would reset the optimizer
        # to config.lr after every update (and its logged learning rate would hide the warm-up).
        self.register_optimizer(module_id=module_id, optimizer=optimizer, params=params)

    @override(TorchLearner)
    def get_state(self, components=None, *, not_components=None, **kwargs) -> StateDict:
        """RLlib's learner state plus ``OPTIMIZER_STEPS``, which travels with the optimizer component: restoring
        weights alone gives a fresh optimizer, whose warm-up starts again."""
        state = super().get_state(components, not_components=not_components, **kwargs)
        if self._check_component(COMPONENT_OPTIMIZER, components, not_components):
            state[OPTIMIZER_STEPS] = self._optimizer_steps
        return state

    @override(TorchLearner)
    def set_state(self, state: StateDict) -> None:
        super().set_state(state)
        if OPTIMIZER_STEPS in state:
            self._optimizer_steps = int(state[OPTIMIZER_STEPS])

    @override(TorchLearner)
    def _get_optimizer_state(self) -> StateDict:
        """RLlib's optimizer state with CPU torch tensors instead of numpy arrays: numpy has no bfloat16, so
        RLlib's conversion fails for the AdamW moments of a bf16 model. Copies, so the state is a snapshot.
        (RLlib's ``_set_optimizer_state`` takes tensors as they are; AdamW casts them back to the parameters'
        dtype.)"""
        return {name: {"module_id": self._optimizer_name_to_module[name], "state": _cpu_copy(optimizer.state_dict())}
                for name, optimizer in self._named_optimizers.items()}

    def _forward(self, module, part: dict[str, torch.Tensor], **kwargs) -> dict[str, torch.Tensor]:
        """The module's log-probs of ``part`` as the config says: at the sampling temperature (the distribution
        the rollouts sampled from), each unique token once with prefix sharing."""
        return module.forward_train(part, share_prefixes=self.config.prefix_sharing,
                                    temperature=self.config.temperature, **kwargs)

    def _reference_logprobs(self, part: dict[str, torch.Tensor]) -> torch.Tensor:
        module = self.module[DEFAULT_MODULE_ID].unwrapped()
        if self._uses_lora:
            with module.model.disable_adapter():
                return self._forward(module, part)[LOGPROBS]
        live = module.model
        module.model = self._reference.model  # the same log-prob code path, on the frozen weights
        try:
            return self._forward(module, part)[LOGPROBS]
        finally:
            module.model = live

    @override(TorchLearner)
    def _uncompiled_update(self, batch: dict, **kwargs):
        """One update on this learner's shard; see the module docstring. The metrics it logs (RLlib takes the mean
        over the learners of each) are the same on every learner, the whole batch's: the loss, its terms and the
        other per-token statistics are token-means over the generated tokens of a mini-batch on all learners,
        averaged over the steps; the ratio's maximum and minimum are over all learners' tokens and steps; the
        sampler mismatch is over all learners' tokens, its 99th percentile the largest learner's (a bound on the
        batch's); the token counts (``trained_tokens``, the shares) the batch's; the peak memory the largest
        learner's."""
        # Not RLlib's Learner.update loop: it splits a batch by rows and makes one optimizer step per piece, without
        # gradient accumulation; the mini-batches here keep prompt groups whole and accumulate micro-batches.
        data = dict(batch[DEFAULT_MODULE_ID])
        device = data[INPUT_IDS].device
        for param in self.module[DEFAULT_MODULE_ID].parameters():
            param.grad = None  # the last update's: not held through this update's no-gradient passes
        reset_peak_memory(device)
        minis = self._mini_batch_rows(data)
        pieces = [self._micro_slices(data, rows) if rows.stop > rows.start else [] for rows in minis]
        in_order = [piece for mini in pieces for piece in mini]  # the same micro-batches in every pass
        packings = self._packings(data, in_order)
        mismatch = self._fix_old_logprobs(data, in_order, packings)
        steps = [self._optimizer_step({k: v[rows] for k, v in data.items()},
                                      [self._part(data, piece, packings) for piece in mini_pieces],
                                      measure_mismatch=not i and not mismatch)
                 for i, (rows, mini_pieces) in enumerate(list(zip(minis, pieces, strict=True)) * self._epochs)]
        mismatch = mismatch or steps[0].pop(MISMATCH)
        peak_memory = peak_memory_gib(device)
        steps, mismatch, trained_tokens, peak_memory = self._across_learners(
            steps, mismatch, float(data[GENERATED_MASK].sum()), peak_memory)
        loss = sum(step.pop(LOSS) for step in steps) / len(steps)
        metrics = mismatch
        counts = {key: sum(step.pop(key) for step in steps) for key in (UNIQUE_TOKENS, PACKED_TOKENS, REAL_TOKENS)}
        if counts[REAL_TOKENS]:
            metrics[metric_keys.UNIQUE_TOKEN_SHARE] = counts[UNIQUE_TOKENS] / counts[REAL_TOKENS]
            metrics[metric_keys.FORWARDED_TOKEN_SHARE] = counts[PACKED_TOKENS] / counts[REAL_TOKENS]
        for key in steps[0]:
            values = [step[key] for step in steps]
            metrics[key] = (max(values) if key == metric_keys.RATIO_MAX else min(values) if key == metric_keys.RATIO_MIN
                            else values[-1] if key == metric_keys.LEARNING_RATE else sum(values) / len(values))
        metrics.update({metric_keys.TRAINED_TOKENS: trained_tokens, metric_keys.OPTIMIZER_STEPS: self._optimizer_steps,
                        metric_keys.OLD_LOGPROBS_RECOMPUTED: float(self._old_source == "recompute"),
                        metric_keys.LEARNER_PEAK_MEMORY_GIB: peak_memory})
        for key, value in metrics.items():
            self.metrics.log_value((DEFAULT_MODULE_ID, key), value, window=1)
        return {}, {DEFAULT_MODULE_ID: torch.tensor(loss)}, {}  # logged by RLlib as total_loss (mean over steps)

    def _mini_batch_rows(self, data: dict[str, torch.Tensor]) -> list[slice]:
        """The rows of each of the ``ppo_mini_batches`` mini-batches in ``data``: from its ``MINI_BATCH`` column
        (:func:`learner_shards`; a mini-batch can have no rows here), else cut from ``data`` itself (one learner
        only: the learners' cuts of their shards would not make the whole batch's mini-batches)."""
        if MINI_BATCH not in data:
            if self._world > 1:
                raise ValueError(f"{self._world} learners need the batch laid out by learner_shards (its "
                                 f"{MINI_BATCH!r} column), so that their mini-batches make the whole batch's")
            return minibatch_slices(data[PROMPT_INDEX].cpu().numpy(), self._mini_batches)
        tags = data[MINI_BATCH].cpu().numpy()
        if len(tags) and not (np.all(np.diff(tags) >= 0) and tags[0] >= 0 and tags[-1] < self._mini_batches):
            raise ValueError(f"the {MINI_BATCH!r} column must not decrease and lie in 0..ppo_mini_batches - 1 "
                             f"({self._mini_batches - 1}), as learner_shards lays out a batch for this learner "
                             f"count; got {tags.tolist()}")
        bounds = np.searchsorted(tags, np.arange(self._mini_batches + 1))
        return [slice(int(a), int(b)) for a, b in itertools.pairwise(bounds)]

    def _all_reduce(self, values: list[float], op: dist.ReduceOp) -> list[float]:
        """``values`` reduced over the learners (float64, on the learner's device); as they are with one."""
        if self._world == 1:
            return values
        tensor = torch.tensor(values, dtype=torch.float64, device=self._device)
        dist.all_reduce(tensor, op=op)
        return tensor.tolist()

    def _across_learners(self, steps: list[dict], mismatch: dict, trained_tokens: float,
                         peak_memory: float) -> tuple[list[dict], dict[str, float], float, float]:
        """The steps' metrics and the mismatch of the whole batch (all learners, two all-reduces) from this
        learner's partial sums (``_optimizer_step``, ``_mismatch_sums``), and the batch's trained tokens and largest
        peak memory."""
        summed = sorted(key for key in steps[0] if key not in EXTREMES + SAME_ON_EVERY_LEARNER)
        mismatch_keys = sorted(key for key in mismatch if key != metric_keys.SAMPLER_RATIO_P99)
        sums = self._all_reduce([step[key] for step in steps for key in summed]
                                + [mismatch[key] for key in mismatch_keys] + [trained_tokens], dist.ReduceOp.SUM)
        bounds = [value for step in steps for value in (step[metric_keys.RATIO_MAX], -step[metric_keys.RATIO_MIN])]
        highs = self._all_reduce([*bounds, mismatch[metric_keys.SAMPLER_RATIO_P99], peak_memory], dist.ReduceOp.MAX)
        out = []
        for i, step in enumerate(steps):
            high, low = highs[2 * i], -highs[2 * i + 1]
            out.append({**step, **dict(zip(summed, sums[i * len(summed):(i + 1) * len(summed)], strict=True)),
                        # no generated token in the step on any learner: ratio 1, as clipped_policy_loss says then
                        metric_keys.RATIO_MAX: high if math.isfinite(high) else 1.0,
                        metric_keys.RATIO_MIN: low if math.isfinite(low) else 1.0})
        totals = dict(zip(mismatch_keys, sums[len(steps) * len(summed):-1], strict=True))
        tokens, p99 = totals.pop(TOKENS), highs[-2]
        if tokens:
            reduced = {key: value / tokens for key, value in totals.items()}
            reduced[metric_keys.SAMPLER_RATIO_P99] = p99
        else:  # as sampler_mismatch says for no tokens; importance weights of 1
            reduced = {**mismatch_metrics(MismatchStats(1.0, 1.0, 0.0)), metric_keys.TIS_WEIGHT_MEAN: 1.0}
        return out, reduced, sums[-1], highs[-1]

    def _micro_slices(self, data: dict[str, torch.Tensor], rows: slice) -> list[slice]:
        """The micro-batches of the mini-batch ``rows`` as row ranges of ``data``: ``micro_batch_tokens`` decoder
        tokens or ``micro_batch_size`` rows each; with prefix sharing, of whole prompt groups (the rows that share
        a prompt meet in one forward) unless one group alone is larger (see ``algos.batch.micro_batch_slices``)."""
        cfg = self.config
        columns = {key: data[key][rows].cpu().numpy() for key in (INPUT_IDS, ATTENTION_MASK, PROMPT_INDEX)}
        return [slice(rows.start + piece.start, rows.start + piece.stop)
                for piece in micro_batch_slices(columns, share_prefixes=cfg.prefix_sharing,
                                                max_rows=cfg.micro_batch_size, max_tokens=cfg.micro_batch_tokens)]

    def _packings(self, data: dict[str, torch.Tensor], pieces: list[slice]) -> dict[tuple[int, int], PackedRows]:
        """With prefix sharing, each micro-batch's packing (trie, segments and tree mask; flex_attention's block
        mask), built once per update for all its passes: old and reference log-probs, every epoch."""
        if not self.config.prefix_sharing:
            return {}
        model = self.module[DEFAULT_MODULE_ID].unwrapped().model
        return {(piece.start, piece.stop): pack_rows(model, {k: v[piece] for k, v in data.items()})
                for piece in pieces}

    @staticmethod
    def _part(data: dict[str, torch.Tensor], piece: slice, packings: dict[tuple[int, int], PackedRows]) -> dict:
        """The micro-batch ``piece`` of ``data``, with its packing when there is one."""
        part = {k: v[piece] for k, v in data.items()}
        if (piece.start, piece.stop) in packings:
            part[PACKING] = packings[piece.start, piece.stop]
        return part

    def _fix_old_logprobs(self, data: dict[str, torch.Tensor], pieces: list[slice],
                          packings: dict[tuple[int, int], PackedRows]) -> dict[str, float] | None:
        """Add the old (``OLD``) and reference (``REF``) log-probs and the truncated importance weights (``TIS``)
        to ``data``, without gradients, before the first step, micro-batch by micro-batch (``pieces``, in row
        order). Returns the sampler mismatch's sums over this learner's tokens (``_mismatch_sums``) when the old
        log-probs were recomputed (None when they are the sampler's: the first step measures it then)."""
        cfg, module = self.config, self.module[DEFAULT_MODULE_ID].unwrapped()
        olds, refs = [], []
        reference = self._reference.on_device() if self._reference is not None else contextlib.nullcontext()
        with torch.no_grad(), reference:  # an offloaded reference comes in once for all the micro-batches
            for piece in pieces:
                part = self._part(data, piece, packings)
                old = (self._forward(module, part)[LOGPROBS] if self._old_source == "recompute"
                       else part[SAMPLING_LOGPROBS])
                olds.append(old)
                refs.append(self._reference_logprobs(part) if cfg.kl_coef > 0 else old)
        empty = data[SAMPLING_LOGPROBS][:0]  # a learner without rows (more learners than rows)
        data[OLD], data[REF] = (torch.cat(olds), torch.cat(refs)) if pieces else (empty, empty)
        mask = data[GENERATED_MASK]
        if self._old_source == "recompute" and cfg.tis_cap is not None:
            data[TIS] = truncated_importance_weights(data[OLD], data[SAMPLING_LOGPROBS], mask, cap=cfg.tis_cap,
                                                     level=cfg.tis_level)
        else:
            data[TIS] = torch.ones_like(data[OLD])
        if self._old_source != "recompute":
            return None
        return _mismatch_sums(data[OLD], data)

    def _optimizer_step(self, data: dict[str, torch.Tensor], parts: list[dict], measure_mismatch: bool) -> dict:
        """One optimizer step on a mini-batch (``data``: this learner's rows of it, ``parts``: their micro-batches,
        none when it has no rows here): accumulated micro-batch gradients of the token-mean over the mini-batch's
        tokens on all learners (module docstring), RLlib's gradient postprocessing (clipping), the scheduled
        learning rate, AdamW. Returns this learner's partial sums of the step's metrics, token-weighted
        (``value * tokens / the mini-batch's tokens on all learners``; ``_across_learners`` adds them up), the
        ratio bounds as extremes (infinite without tokens), the gradient norm (the same on every learner); with
        ``measure_mismatch`` also the sampler mismatch of the weights before the step (``MISMATCH``, sums)."""
        cfg, module = self.config, self.module[DEFAULT_MODULE_ID]
        local_tokens = float(data[GENERATED_MASK].sum())
        total_tokens = max(self._all_reduce([local_tokens], dist.ReduceOp.SUM)[0], 1.0)
        # DDP averages the learners' gradients: each learner's loss is world / total tokens times its token sum
        scale = self._world / total_tokens
        params = [p for p in module.parameters() if p.requires_grad]
        for p in params:
            p.grad = None
        totals: dict[str, float] = {metric_keys.RATIO_MAX: -math.inf, metric_keys.RATIO_MIN: math.inf}
        current = []
        for i, part in enumerate(parts or [self._idle_part(data)]):
            last = i == len(parts) - 1 or not parts
            sync = contextlib.nullcontext() if last or cfg.num_learners <= 1 else module.no_sync()
            with sync:
                out = self._forward(module, part, return_entropy=cfg.entropy_coef > 0)
                loss, stats = self.loss_and_stats(part, out)
                tokens = float(part[GENERATED_MASK].sum()) if parts else 0.0  # the stand-in: no gradient, metrics
                (loss * (tokens * scale)).backward()
            for key in (UNIQUE_TOKENS, PACKED_TOKENS, REAL_TOKENS):  # counts, summed (shared-prefix forward only)
                totals[key] = totals.get(key, 0) + (out.get(key, 0) if parts else 0)
            weight = tokens / total_tokens
            totals[LOSS] = totals.get(LOSS, 0.0) + loss.item() * weight
            if measure_mismatch and parts:
                current.append(out[LOGPROBS].detach())
            for key, value in stats.items():  # token-weighted sums, extremes for the ratio bounds
                if key in EXTREMES:
                    if tokens:
                        totals[key] = (max if key == metric_keys.RATIO_MAX else min)(totals[key], value)
                else:
                    totals[key] = totals.get(key, 0.0) + value * weight
        grads = {self.get_param_ref(p): p.grad for p in params if p.grad is not None}
        grad_norm = gradient_norm(list(grads.values()))  # before clipping, whatever grad_clip_by says
        self._optimizer_steps += 1  # the schedule position advances on a skipped step too (verl's does)
        lr = scheduled_lr(cfg.lr, self._optimizer_steps, warmup_steps=self._warmup_steps,
                          total_steps=self._total_steps, schedule=cfg.lr_schedule)
        nonfinite = not math.isfinite(grad_norm)  # the same on every DDP learner: the gradients are all-reduced
        if nonfinite and cfg.skip_nonfinite_grad:  # verl: no step (the weights and AdamW's moments stay)
            for p in params:
                p.grad = None
        else:
            # RLlib's public lr path is its scheduler, stepped per update in env steps; ours counts optimizer steps,
            # so the rate is set through the learner's own setter on each optimizer (``get_optimizers_for_module``).
            for _, optimizer in self.get_optimizers_for_module(DEFAULT_MODULE_ID):
                self._set_optimizer_lr(optimizer, lr)
            self.apply_gradients(self.postprocess_gradients(grads))  # clips by grad_clip_by
        totals.update({metric_keys.GRAD_NORM: grad_norm, metric_keys.NONFINITE_GRAD_SHARE: float(nonfinite),
                       metric_keys.LEARNING_RATE: lr})
        if measure_mismatch:  # the weights before this first step are the sampler's: their log-probs are the old
            totals[MISMATCH] = _mismatch_sums(torch.cat(current) if current else data[SAMPLING_LOGPROBS], data)
        return totals

    @staticmethod
    def _idle_part(data: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A stand-in micro-batch for a learner without rows in a mini-batch, with ``data``'s columns: one row of two
        tokens, the second counted as generated so that the loss has a graph through every weight (the step
        multiplies it by 0). Its forward and backward passes are the DDP collectives (buffer broadcast, gradient
        all-reduce) the other learners wait for."""
        part = {key: torch.zeros((1, 2) if value.dim() == 2 else (1, *value.shape[1:]), dtype=value.dtype,
                                 device=value.device) for key, value in data.items()}
        part[ATTENTION_MASK] = torch.ones_like(part[ATTENTION_MASK])
        part[GENERATED_MASK][0, 1] = 1
        part[TIS] = torch.ones_like(part[TIS])
        return part

    @override(TorchLearner)
    def compute_loss_for_module(self, *, module_id, config, batch: dict, fwd_out: dict) -> torch.Tensor:
        """The loss of one micro-batch whose old and reference log-probs are filled in (see the module doc)."""
        return self.loss_and_stats(batch, fwd_out)[0]

    def loss_and_stats(self, part: dict[str, torch.Tensor], out: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict]:
        """Token-mean loss of a micro-batch: clipped policy loss + kl_coef * k3 KL - entropy_coef * entropy."""
        cfg, mask = self.config, part[GENERATED_MASK]
        logprobs = out[LOGPROBS]
        policy_loss, stats = clipped_policy_loss(logprobs, part[OLD], part[ADVANTAGES][:, None], mask,
                                                 clip=cfg.clip_eps, dual_clip=cfg.dual_clip, weights=part[TIS])
        kl = masked_mean(k3_kl(logprobs, part[REF]), mask)
        entropy = masked_mean(out[ENTROPY], mask) if ENTROPY in out else torch.zeros(())
        loss = policy_loss + cfg.kl_coef * kl - cfg.entropy_coef * entropy
        gap = masked_mean((part[SAMPLING_LOGPROBS] - part[OLD]).abs(), mask)
        return loss, {
            metric_keys.POLICY_LOSS: policy_loss.item(), metric_keys.KL: kl.item(), metric_keys.ENTROPY: entropy.item(),
            metric_keys.CLIP_FRACTION: stats.clip_fraction, metric_keys.DUAL_CLIP_FRACTION: stats.dual_clip_fraction,
            metric_keys.RATIO_MEAN: stats.ratio_mean, metric_keys.RATIO_MAX: stats.ratio_max,
            metric_keys.RATIO_MIN: stats.ratio_min,
            metric_keys.SAMPLER_LOGPROB_GAP: gap.item(),
        }
