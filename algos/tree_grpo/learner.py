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
   the mini-batch's last micro-batch only); then the gradient norm, the clipping (``grad_clip`` /
   ``grad_clip_by``, RLlib's modes, with the norms taken once: :func:`clip_gradients`), the scheduled learning rate
   (``algos.lr_schedule``) and the AdamW step, which is skipped when the gradient norm is NaN or infinite
   (``skip_nonfinite_grad``, as verl). From the second
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

With ``learner_sharding="fsdp"`` the learners hold the policy sharded (:mod:`policies.fsdp`) instead of as DDP
replicas: the same steps (FSDP averages the gradients as DDP does, so the loss scale is the same), the passes run
through the shards' root, every micro-batch's gradients are reduce-scattered into the shards (no whole-model
gradient is kept), the gradient norm and its clipping are over the whole sharded gradient (one all-reduce per
step, whatever the number of parameters), AdamW steps on the shards. In bf16 the units gather their parameters in
bf16 (FSDP's mixed precision) and the passes run without autocast. The policy is built on the host and sharded unit
by unit onto the device, and the KL reference made from its shards (its shards in host memory when offloaded), so
that no learner ever holds the whole model on its device; LoRA adapters are sharded with the layers that hold them.
The weights and the optimizer state are then shards (``algos/tree_grpo/learner_state.py``: how they are saved and
gathered).

The schedule position (``OPTIMIZER_STEPS``, optimizer steps taken) is part of the learner's state next to
the optimizer state, so a resumed run continues its warm-up and decay instead of restarting them.
"""

from __future__ import annotations

import contextlib
import functools
import math
import sys
import time

import torch
import torch.distributed as dist
from ray.rllib.core import DEFAULT_MODULE_ID
from ray.rllib.core.learner.learner import Learner
from ray.rllib.core.learner.torch.torch_learner import TorchLearner
from ray.rllib.utils.annotations import override

from algos.batch import (
    ADVANTAGES,
    ATTENTION_MASK,
    INPUT_IDS,
    PROMPT_INDEX,
    SAMPLING_LOGPROBS,
    micro_batch_slices,
)
from algos.losses import (
    clipped_policy_loss,
    k3_kl,
    masked_mean,
    truncated_importance_weights,
)
from algos.lr_schedule import scheduled_lr
from algos.tree_grpo import metrics as metric_keys
from algos.tree_grpo.learner_metrics import EXTREMES, LOSS, across_learners, mismatch_sums, update_metrics
from algos.tree_grpo.learner_rows import OLD, REF, ROWS, TIS, micro_batch, mini_batch_rows, stand_in
from algos.tree_grpo.learner_state import OPTIMIZER_STEPS as OPTIMIZER_STEPS  # re-exported: the learner's state key
from algos.tree_grpo.learner_state import LearnerState
from algos.tree_grpo.settings import check_learner_sharding
from policies.frozen_bottom import FrozenBottom, frozen_bottom_depth
from policies.fsdp import broadcast_from_rank0, run_pass, squared_norms, world_size
from policies.logprobs import (
    ENTROPY,
    GENERATED_MASK,
    LOGPROBS,
    PACKED_TOKENS,
    REAL_TOKENS,
    UNIQUE_TOKENS,
    PackedRows,
    pack_rows,
)
from policies.memory import peak_memory_gib, release_cached_memory, reset_peak_memory
from policies.reference_model import ReferenceModel, shard_policy_and_reference

MISMATCH = "mismatch"  # a step's sampler mismatch metrics (the first step's, when the old log-probs are the sampler's)
def old_logprobs_source(choice: str, compute_dtype: torch.dtype, generator: str = "hf", stale: bool = False) -> str:
    """``sampler`` or ``recompute``: ``auto`` takes the sampler's when the HF generator computes in float32 (it
    then computes what the learner would, up to KV-cache rounding), and recomputes otherwise (bf16 compute, or
    another engine such as vLLM, whose kernels differ, or ``stale``: batches sampled by weights an update behind
    the learner's, ``max_staleness`` 1)."""
    if choice != "auto":
        return choice
    return "sampler" if generator == "hf" and compute_dtype == torch.float32 and not stale else "recompute"


def clip_gradients(gradients: list[torch.Tensor], squares: list[float], clip: float | None, by: str) -> None:
    """Clip ``gradients`` in place as RLlib's ``clip_gradients`` does (``global_norm``: all scaled by clip /
    max(their norm + 1e-6, clip); ``norm``: each tensor whose norm exceeds clip scaled down to it; ``value``: each
    entry into [-clip, clip]), from each gradient's squared norm taken before (``squares``: of the whole gradient
    when it is a shard, :func:`policies.fsdp.squared_norms`), so that no norm is taken here: RLlib takes one per
    tensor, under FSDP a reduction and a host sync each."""
    if clip is None:
        return
    if by == "value":
        for gradient in gradients:
            gradient.clamp_(-clip, clip)
    elif by == "norm":
        for gradient, square in zip(gradients, squares, strict=True):
            if math.sqrt(square) > clip:
                gradient.mul_(clip / math.sqrt(square))
    else:
        scale = clip / max(math.sqrt(sum(squares)) + 1e-6, clip)
        if scale < 1:
            for gradient in gradients:
                gradient.mul_(scale)


class TreeGRPOTorchLearner(LearnerState, TorchLearner):
    @override(TorchLearner)
    def build(self) -> None:
        self._gathering = False  # True while every learner gathers the full state together (gathered_state)
        super().build()
        module = self.module[DEFAULT_MODULE_ID].unwrapped()
        model = module.model
        self._optimizer_steps = 0
        # the learners' world (RLlib wraps the module in DDP when num_learners > 1; Ray Train set up the process
        # group, for any number of remote learners)
        self._world = world_size() if self._policy_root is not None or self.config.num_learners > 1 else 1
        settings = self.config.settings
        self._mini_batches, self._epochs = settings.mini_batches, settings.ppo_epochs
        self._warmup_steps, self._total_steps = settings.warmup_optimizer_steps, settings.total_optimizer_steps
        self._old_source = old_logprobs_source(self.config.old_logprobs, module.precision.compute,
                                               settings.generator_backend, stale=settings.max_staleness > 0)
        if not dist.is_initialized() or dist.get_rank() == 0:  # where the update runs, as RLlib placed it
            print(f"learner: {self._device}, {self._world} learner(s) ({self.config.learner_sharding}), "
                  f"{module.precision.compute} compute over {module.precision.master} weights", file=sys.stderr)
        if settings.learner_attention is not None:  # this learner's copy only: the env runners keep theirs
            base = model.get_base_model() if self._uses_lora else model
            base.set_attn_implementation(settings.learner_attention)

    @override(TorchLearner)
    def _make_module(self):
        """RLlib's module and the KL reference (in the compute dtype: the passes run in it anyway) copied from its
        initial weights, before RLlib builds the optimizer. Unsharded: both on the learner's device (RLlib moves the
        module there). Sharded (fsdp): the module stays on the host where RLlib builds it (not TorchLearner's move of
        the whole model), then the policy is sharded unit by unit onto the device and the reference made from its
        shards (``shard_policy_and_reference``): no learner ever holds the whole model on its device, and the
        optimizer holds the shards. Then the device's cached memory is released (the startup's transients)."""
        sharded, offload = self.config.learner_sharding == "fsdp", self.config.reference_offload
        if sharded:
            check_learner_sharding(self.config.learner_sharding, self.config.num_learners)
        modules = Learner._make_module(self) if sharded else super()._make_module()
        module = modules[DEFAULT_MODULE_ID]
        self._uses_lora = hasattr(module.model, "disable_adapter")
        reference = not self._uses_lora and self.config.kl_coef > 0
        self._reference = self._policy_root = self._reference_root = None  # FSDP's roots: passes over shards use one
        if sharded:
            broadcast_from_rank0(module.model, self._device)  # before sharding: every rank's shards are rank 0's
            self._policy_root, self._reference_root = shard_policy_and_reference(
                module.model, module.precision, reference=reference, offload=offload)
            module.autocast_passes = False  # FSDP gathers the parameters in the compute dtype (policies/fsdp.py)
        elif reference:
            self._reference = ReferenceModel(module.model, dtype=module.precision.compute, device=self._device,
                                             offload=offload)
        base = module.model.get_base_model() if self._uses_lora else module.model
        replay = self.config.frozen_bottom_replay and not sharded and frozen_bottom_depth(base) > 0
        self._frozen_bottom = FrozenBottom(base) if replay else None
        release_cached_memory(self._device)
        return modules

    @override(TorchLearner)
    def _make_modules_ddp_if_necessary(self) -> None:
        """DDP replicas as RLlib makes them, unless the module is sharded (``_make_module``)."""
        if self._policy_root is None:
            super()._make_modules_ddp_if_necessary()

    @override(TorchLearner)
    def configure_optimizers_for_module(self, module_id, config=None) -> None:
        params = [p for p in self.get_parameters(self._module[module_id]) if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=config.lr, betas=(0.9, 0.999), weight_decay=config.weight_decay)
        # No RLlib lr schedule: the update sets the warmed-up rate itself; RLlib's schedule would reset the optimizer
        # to config.lr after every update (and its logged learning rate would hide the warm-up).
        self.register_optimizer(module_id=module_id, optimizer=optimizer, params=params)

    def _forward(self, module, part: dict[str, torch.Tensor], root, **kwargs) -> dict[str, torch.Tensor]:
        """The module's log-probs of ``part`` as the config says: at the sampling temperature (the distribution
        the rollouts sampled from), each unique token once with prefix sharing; through FSDP's ``root`` when the
        module's model is sharded (``_policy_root`` or ``_reference_root``; None when not sharded)."""
        call = functools.partial(module.forward_train, part, share_prefixes=self.config.prefix_sharing,
                                 temperature=self.config.temperature, **kwargs)
        if root is not None:
            return run_pass(root, call)
        if self._frozen_bottom is None or ROWS not in part:  # a stand-in has no rows
            return call()
        with self._frozen_bottom.over(part[ROWS]):
            return call()

    def _reference_logprobs(self, part: dict[str, torch.Tensor]) -> torch.Tensor:
        module = self.module[DEFAULT_MODULE_ID].unwrapped()
        if self._uses_lora:
            with module.model.disable_adapter():
                return self._forward(module, part, self._policy_root)[LOGPROBS]
        live = module.model
        # the same log-prob code path, on the frozen weights (sharded: the reference root's model)
        module.model = self._reference.model if self._reference_root is None else self._reference_root.model
        try:
            return self._forward(module, part, self._reference_root)[LOGPROBS]
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
        if self._frozen_bottom is not None:
            self._frozen_bottom.clear()  # an update that failed part-way may have left its micro-batches' outputs
        reset_peak_memory(device)
        minis = mini_batch_rows(data, self._mini_batches, self._world)
        pieces = [self._micro_slices(data, rows) if rows.stop > rows.start else [] for rows in minis]
        in_order = [piece for mini in pieces for piece in mini]  # the same micro-batches in every pass
        step_passes, scoring_passes = self._pass_counts(pieces)
        packings = self._packings(data, in_order)
        scoring_start = time.perf_counter()
        mismatch = self._fix_old_logprobs(data, in_order, packings, scoring_passes)
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the passes' kernels, not their launches
        scoring_s = time.perf_counter() - scoring_start
        steps = [self._optimizer_step({k: v[rows] for k, v in data.items()},
                                      [micro_batch(data, piece, packings) for piece in mini_pieces], passes,
                                      measure_mismatch=not i and not mismatch)
                 for i, (rows, mini_pieces, passes)
                 in enumerate(list(zip(minis, pieces, step_passes, strict=True)) * self._epochs)]
        if self._frozen_bottom is not None:
            self._frozen_bottom.clear()  # this batch's micro-batches are not the next one's
        mismatch = mismatch or steps[0].pop(MISMATCH)
        peak_memory = peak_memory_gib(device)
        steps, mismatch, trained_tokens, peak_memory = across_learners(
            steps, mismatch, float(data[GENERATED_MASK].sum()), peak_memory, self._all_reduce)
        loss = sum(step.pop(LOSS) for step in steps) / len(steps)
        metrics = {**mismatch, **update_metrics(steps)}
        metrics.update({metric_keys.TRAINED_TOKENS: trained_tokens, metric_keys.OPTIMIZER_STEPS: self._optimizer_steps,
                        metric_keys.OLD_LOGPROBS_RECOMPUTED: float(self._old_source == "recompute"),
                        metric_keys.LEARNER_PEAK_MEMORY_GIB: peak_memory, metric_keys.SCORING_TIME_S: scoring_s})
        for key, value in metrics.items():
            self.metrics.log_value((DEFAULT_MODULE_ID, key), value, window=1)
        return {}, {DEFAULT_MODULE_ID: torch.tensor(loss)}, {}  # logged by RLlib as total_loss (mean over steps)

    def _all_reduce(self, values: list[float], op: dist.ReduceOp) -> list[float]:
        """``values`` reduced over the learners (float64, on the learner's device); as they are with one."""
        if self._world == 1:
            return values
        tensor = torch.tensor(values, dtype=torch.float64, device=self._device)
        dist.all_reduce(tensor, op=op)
        return tensor.tolist()

    def _pass_counts(self, pieces: list[list[slice]]) -> tuple[list[int], int]:
        """The forward passes this learner runs: per mini-batch (its micro-batches, at least one: a learner without
        rows runs a stand-in) and over all micro-batches without gradients. Sharded, the largest counts over the
        learners (one all-reduce), since every pass gathers each layer's shards from every learner; the passes a
        learner runs beyond its micro-batches are stand-ins (``stand_in``)."""
        counts = [len(mini) for mini in pieces] + [sum(len(mini) for mini in pieces)]
        if self._policy_root is not None:
            counts = [int(count) for count in self._all_reduce(counts, dist.ReduceOp.MAX)]
        return [max(1, count) for count in counts[:-1]], counts[-1]

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

    def _fix_old_logprobs(self, data: dict[str, torch.Tensor], pieces: list[slice],
                          packings: dict[tuple[int, int], PackedRows], passes: int) -> dict[str, float] | None:
        """Add the old (``OLD``) and reference (``REF``) log-probs and the truncated importance weights (``TIS``)
        to ``data``, without gradients, before the first step, micro-batch by micro-batch (``pieces``, in row
        order; then stand-ins up to ``passes``, see ``_pass_counts``). Returns the sampler mismatch's sums over this
        learner's tokens (``mismatch_sums``) when the old log-probs were recomputed (None when they are the
        sampler's: the first step measures it then)."""
        cfg, module = self.config, self.module[DEFAULT_MODULE_ID].unwrapped()
        olds, refs = [], []
        # an offloaded unsharded reference comes in once for all the micro-batches (sharded: FSDP brings its units in)
        reference = self._reference.on_device() if self._reference is not None else contextlib.nullcontext()
        with torch.no_grad(), reference:
            for i in range(max(passes, len(pieces))):
                part = micro_batch(data, pieces[i], packings) if i < len(pieces) else stand_in(data)
                old = (self._forward(module, part, self._policy_root)[LOGPROBS] if self._old_source == "recompute"
                       else part[SAMPLING_LOGPROBS])
                ref = self._reference_logprobs(part) if cfg.kl_coef > 0 else old
                if i < len(pieces):
                    olds.append(old)
                    refs.append(ref)
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
        return mismatch_sums(data[OLD], data[SAMPLING_LOGPROBS], data[TIS], data[GENERATED_MASK])

    def _optimizer_step(self, data: dict[str, torch.Tensor], parts: list[dict], passes: int,
                        measure_mismatch: bool) -> dict:
        """One optimizer step on a mini-batch (``data``: this learner's rows of it, ``parts``: their micro-batches,
        none when it has no rows here, then stand-ins up to ``passes``, see ``_pass_counts``): accumulated
        micro-batch gradients of the token-mean over the mini-batch's tokens on all learners (module docstring),
        the clipping (:meth:`_step`), the scheduled learning rate, AdamW. Returns this learner's
        partial sums of the step's metrics, token-weighted (``value * tokens / the mini-batch's tokens on all
        learners``; ``across_learners`` adds them up), the ratio bounds as extremes (infinite without tokens), the
        gradient norm (the same on every learner); with ``measure_mismatch`` also the sampler mismatch of the
        weights before the step (``MISMATCH``, sums)."""
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
        for i, part in enumerate(parts + [stand_in(data)] * (passes - len(parts))):
            real, last = i < len(parts), i == passes - 1
            # DDP replicas all-reduce once per step (no_sync before the last micro-batch); FSDP reduce-scatters
            # every micro-batch's gradients into the shards (policies/fsdp.py says why)
            replicas = self._policy_root is None and cfg.num_learners > 1
            sync = module.no_sync() if replicas and not last else contextlib.nullcontext()
            with sync:
                out = self._forward(module, part, self._policy_root, return_entropy=cfg.entropy_coef > 0)
                loss, stats = self.loss_and_stats(part, out)
                tokens = float(part[GENERATED_MASK].sum()) if real else 0.0  # a stand-in: no gradient, metrics
                (loss * (tokens * scale)).backward()
            for key in (UNIQUE_TOKENS, PACKED_TOKENS, REAL_TOKENS):  # counts, summed (shared-prefix forward only)
                totals[key] = totals.get(key, 0) + (out.get(key, 0) if real else 0)
            weight = tokens / total_tokens
            totals[LOSS] = totals.get(LOSS, 0.0) + loss.item() * weight
            if measure_mismatch and real:
                current.append(out[LOGPROBS].detach())
            for key, value in stats.items():  # token-weighted sums, extremes for the ratio bounds
                if key in EXTREMES:
                    if tokens:
                        totals[key] = (max if key == metric_keys.RATIO_MAX else min)(totals[key], value)
                else:
                    totals[key] = totals.get(key, 0.0) + value * weight
        grads = [p.grad for p in params if p.grad is not None]
        squares = squared_norms(grads)  # every gradient's norm in one reduction: the metric's and the clipping's
        grad_norm = math.sqrt(sum(squares))  # before clipping, whatever grad_clip_by says
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
            self._step(grads, squares)
        totals.update({metric_keys.GRAD_NORM: grad_norm, metric_keys.NONFINITE_GRAD_SHARE: float(nonfinite),
                       metric_keys.LEARNING_RATE: lr})
        if measure_mismatch:  # the weights before this first step are the sampler's: their log-probs are the old
            totals[MISMATCH] = mismatch_sums(torch.cat(current) if current else data[SAMPLING_LOGPROBS],
                                             data[SAMPLING_LOGPROBS], data[TIS], data[GENERATED_MASK])
        return totals

    def _step(self, grads: list[torch.Tensor], squares: list[float]) -> None:
        """Clip the parameters' gradients ``grads`` in place (:func:`clip_gradients`, with their squared norms
        ``squares``) and step the optimizers: RLlib's ``postprocess_gradients`` and ``apply_gradients`` would take a
        norm, and check finiteness, per parameter (under FSDP a reduction and a host sync each). Non-finite entries
        (a step taken with ``skip_nonfinite_grad`` off) are zeroed, as RLlib zeroes them, and the norms taken
        again."""
        if not math.isfinite(sum(squares)):
            for grad in grads:
                torch.nan_to_num_(grad, nan=0.0, posinf=0.0, neginf=0.0)
            squares = squared_norms(grads)
        clip_gradients(grads, squares, self.config.grad_clip, self.config.grad_clip_by)
        for _, optimizer in self.get_optimizers_for_module(DEFAULT_MODULE_ID):
            optimizer.step()

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
