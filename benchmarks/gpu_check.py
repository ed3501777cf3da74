"""The precision and memory checks that need a GPU, without Ray (the lent machine has none): one report.

    python benchmarks/gpu_check.py --output OUT.md                     # on a GPU: Qwen2.5-1.5B's shape
    python benchmarks/gpu_check.py --shape tiny-random --tokens 512    # a CPU rehearsal in seconds

1. **A learner step in bf16 compute over float32 masters** on a random model of ``--shape`` (a preset of
   ``policies.memory_plan``), with activation checkpointing: the old and reference log-probs without gradients
   (the reference a bf16 copy), then the clipped loss + k3 KL - entropy bonus over ``--tokens`` tokens in
   ``--rows`` rows, backward and AdamW, as the learner runs them (``policies.logprobs``, ``torch.autocast``).
   Step 1 is at lr 1e-6: the share of the master weights it changed (with bf16 weights almost none would change).
   Step 2 measures the peak (``torch.cuda.max_memory_allocated``, AdamW's state present) against the memory plan
   of the same options (no CUDA context in either).
2. **Checkpointing under the shared-prefix forward** (sdpa, and flex_attention where it backpropagates: on a GPU)
   on a small random model in float32: loss and gradients with and without recomputation.
3. **The offloaded reference** on the device: its log-probs equal a resident reference's, and its weights are in
   host memory again after the pass.
4. **Learning on a fixed batch** in the same precision (bf16 compute over float32 masters, checkpointing): the old
   log-probs fixed once, then ``--learn-steps`` AdamW steps at the paper's lr 1e-6 (no weight decay, no KL) on the
   clipped policy loss: the loss per step (it must fall), and how far step 1 moved the master weights in units of
   the lr (AdamW's first step moves each weight with a gradient by about lr).
"""

from __future__ import annotations

import argparse
import itertools
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from algos.losses import clipped_policy_loss, k3_kl, masked_mean
from policies.activation_checkpointing import enable_gradient_checkpointing
from policies.logprobs import ENTROPY, FLEX_ATTENTION, GENERATED_MASK, LOGPROBS, pack_rows, sequence_logprobs
from policies.memory import GIB, peak_memory_gib, reset_peak_memory
from policies.memory_plan import MemoryOptions, plan_memory
from policies.model_shape import PRESETS, ModelShape
from policies.precision import precision_of
from policies.reference_model import ReferenceModel

PROMPT_SHARE = 4  # a quarter of each row is its prompt, shared by every row (a prompt group's rows share it)


def random_model(shape: ModelShape, device: str, attention: str = "sdpa") -> torch.nn.Module:
    """A float32 model of ``shape`` with random weights, built on ``device``."""
    common = dict(vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                  num_hidden_layers=shape.layers, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
                  tie_word_embeddings=shape.tied_embeddings, max_position_embeddings=32768,
                  attn_implementation=attention)
    config, cls = ((Qwen2Config(**common), Qwen2ForCausalLM) if shape.qkv_bias
                   else (LlamaConfig(**common, head_dim=shape.head_dim), LlamaForCausalLM))
    torch.manual_seed(0)
    with torch.device(device):
        return cls(config).train()


def token_batch(vocab: int, rows: int, tokens: int, device: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """``rows`` rows of ``tokens // rows`` tokens sharing a prompt, the rest generated (scored)."""
    width = tokens // rows
    prompt = width // PROMPT_SHARE
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, vocab, (rows, width), generator=generator)
    ids[:, :prompt] = ids[0, :prompt]
    generated = torch.zeros(rows, width)
    generated[:, prompt:] = 1
    return {"input_ids": ids.to(device), "attention_mask": torch.ones(rows, width, dtype=torch.long, device=device),
            GENERATED_MASK: generated.to(device), "advantages": torch.linspace(-1, 1, rows, device=device)}


def learner_step(model, reference: ReferenceModel, batch: dict, optimizer, precision, share_prefixes: bool) -> float:
    """One update as the learner runs it: no-gradient old and reference passes, then the loss, backward, AdamW."""
    device = batch["input_ids"].device
    kwargs = dict(share_prefixes=share_prefixes)
    with torch.no_grad(), precision.autocast(device):
        old = sequence_logprobs(model, batch, **kwargs)[LOGPROBS]
        with reference.on_device() as frozen:
            ref = sequence_logprobs(frozen, batch, **kwargs)[LOGPROBS]
    with precision.autocast(device):
        out = sequence_logprobs(model, batch, return_entropy=True, **kwargs)
    mask = batch[GENERATED_MASK]
    policy_loss, _ = clipped_policy_loss(out[LOGPROBS], old, batch["advantages"][:, None], mask, clip=0.2,
                                         dual_clip=3.0)
    loss = policy_loss + 1e-3 * masked_mean(k3_kl(out[LOGPROBS], ref), mask) - 1e-3 * masked_mean(out[ENTROPY], mask)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def precision_and_memory(args: argparse.Namespace) -> list[str]:
    """Check 1 (see the module docstring): the master weights a bf16 step at lr 1e-6 moves, and step 2's peak
    against the plan."""
    device, shape = args.device, PRESETS[args.shape]
    precision = precision_of("bfloat16")
    reset_peak_memory(device)
    start = time.perf_counter()
    model = random_model(shape, device)
    if args.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    reference = ReferenceModel(model, dtype=precision.compute, device=device, offload=args.reference_offload)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-6, weight_decay=0.01)
    batch = token_batch(shape.vocab, args.rows, args.tokens, device)
    before = {name: p.detach().to("cpu", copy=True) for name, p in model.named_parameters()}
    learner_step(model, reference, batch, optimizer, precision, share_prefixes=False)
    changed = sum(int((p.detach().cpu() != before[name]).sum()) for name, p in model.named_parameters())
    share = changed / sum(t.numel() for t in before.values())
    del before
    reset_peak_memory(device)
    step_start = time.perf_counter()
    learner_step(model, reference, batch, optimizer, precision, share_prefixes=False)
    step_s = time.perf_counter() - step_start
    measured = peak_memory_gib(device)
    options = MemoryOptions(dtype="bfloat16", gradient_checkpointing=args.gradient_checkpointing,
                            reference_offload=args.reference_offload,
                            micro_batch_tokens=args.tokens, sequence_tokens=args.tokens // args.rows,
                            overhead_gib=0.0)
    plan = plan_memory(shape, options)
    return [
        f"## 1. A learner step of {shape.name} ({shape.parameters / 1e9:.2f}B), bf16 compute over float32 masters, "
        f"{'' if args.gradient_checkpointing else 'no '}checkpointing, reference "
        f"{'offloaded' if args.reference_offload else 'resident'}",
        "",
        f"- device: {describe_device(device)}; {args.rows} rows x {args.tokens // args.rows} tokens (per row)",
        f"- master weights changed by step 1 at lr 1e-6: **{share:.4f}** of the elements of its "
        f"{sum(1 for _ in model.parameters())} tensors (target > 0.5)",
        f"- step 2: {step_s:.2f} s; peak {measured:.2f} GiB measured, {plan.per_gpu_gib:.2f} GiB planned "
        f"(peak phase: {plan.phase}): measured / planned **{measured / plan.per_gpu_gib:.3f}** (target within 15%)",
        "- planned parts (GiB): " + ", ".join(f"{k} {v:.2f}" for k, v in plan.parts.items() if v),
        f"- whole check: {time.perf_counter() - start:.1f} s",
    ]


def learns_on_a_fixed_batch(args: argparse.Namespace) -> list[str]:
    """Check 4 (see the module docstring)."""
    device, shape, lr = args.device, PRESETS[args.shape], 1e-6
    precision = precision_of("bfloat16")
    model = random_model(shape, device)
    enable_gradient_checkpointing(model)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    batch = token_batch(shape.vocab, args.rows, args.tokens // 2, device, seed=1)
    kwargs = dict(share_prefixes=False)
    with torch.no_grad(), precision.autocast(device):
        old = sequence_logprobs(model, batch, **kwargs)[LOGPROBS]
    mask, losses, moved = batch[GENERATED_MASK], [], None
    for step in range(args.learn_steps):
        before = [p.detach().clone() for p in params] if step == 0 else None
        with precision.autocast(device):
            logprobs = sequence_logprobs(model, batch, **kwargs)[LOGPROBS]
        loss, _ = clipped_policy_loss(logprobs, old, batch["advantages"][:, None], mask, clip=0.2, dual_clip=3.0)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if before is not None:  # |change| of the moved weights in units of lr, from a sample of 2**22 elements
            steps = torch.cat([(p.detach() - b).abs().flatten() for p, b in zip(params, before, strict=True)])
            share = int(torch.count_nonzero(steps)) / steps.numel()
            sample = steps[torch.randint(steps.numel(), (1 << 22,), device=steps.device)]
            moved = sample[sample > 0].double() / lr
            del before, steps
    falls = all(b < a for a, b in itertools.pairwise(losses))
    low, median, high = torch.quantile(moved, torch.tensor([0.05, 0.5, 0.95], dtype=moved.dtype,
                                                           device=moved.device)).tolist()
    return [
        f"## 4. Learning on a fixed batch: {shape.name}, bf16 compute over float32 masters, checkpointing, lr {lr:g}",
        "",
        f"- {args.rows} rows x {args.tokens // 2 // args.rows} tokens; the clipped policy loss per step (old "
        f"log-probs fixed before step 1): {', '.join(f'{v:.6f}' for v in losses)}: "
        f"**{'falls at every step' if falls else 'does NOT fall at every step'}**",
        f"- step 1 moved {share:.4f} of the master weights; of those, |change| / lr: median **{median:.3f}**, "
        f"5th-95th percentile {low:.3f}-{high:.3f} (AdamW's first step: about 1)",
    ]


def checkpointing_matches(args: argparse.Namespace) -> list[str]:
    """Check 2: shared-prefix loss and gradients with and without recomputation, per attention kernel."""
    device, shape = args.device, PRESETS["smollm2-135m"] if args.device != "cpu" else PRESETS["tiny-random"]
    kernels = ["sdpa"] + ([FLEX_ATTENTION] if device != "cpu" else [])
    lines = ["## 2. Activation checkpointing under the shared-prefix forward (float32)", "",
             "| kernel | loss rel. diff | max grad diff / max grad |", "|---|---|---|"]
    batch = token_batch(shape.vocab, 6, 3000, device, seed=1)
    for kernel in kernels:
        results = []
        for checkpointing in (False, True):
            model = random_model(shape, device, attention=kernel)
            if checkpointing:
                enable_gradient_checkpointing(model)
            part = {**batch, "prefix_packing": pack_rows(model, batch)}
            out = sequence_logprobs(model, part, return_entropy=True, share_prefixes=True)
            loss = (out[LOGPROBS].sum() + out[ENTROPY].sum()) / batch[GENERATED_MASK].sum()
            loss.backward()
            results.append((loss.item(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
        (plain, plain_grads), (loss, grads) = results
        scale = max(g.abs().max().item() for g in plain_grads.values())
        worst = max((grads[n] - g).abs().max().item() for n, g in plain_grads.items()) / scale
        lines.append(f"| {kernel} | {abs(loss - plain) / abs(plain):.2e} | {worst:.2e} |")
    return lines


def offloaded_reference(args: argparse.Namespace) -> list[str]:
    """Check 3: an offloaded reference gives the resident one's log-probs and goes back to host memory."""
    device, shape = args.device, PRESETS["tiny-random"]
    model = random_model(shape, device)
    batch = token_batch(shape.vocab, 4, 1024, device, seed=2)
    got = {}
    for offload in (False, True):
        reference = ReferenceModel(model, dtype=torch.bfloat16, device=device, offload=offload)
        with torch.no_grad(), reference.on_device() as frozen, precision_of("bfloat16").autocast(device):
            got[offload] = sequence_logprobs(frozen, batch)[LOGPROBS]
        after = sorted(str(d) for d in reference.parameter_devices())
    same = torch.equal(got[False], got[True])
    return ["## 3. The offloaded reference", "",
            f"- log-probs equal to the resident reference's: **{same}**; its weights after the pass: {after}"]


def describe_device(device: str) -> str:
    if device == "cpu":
        return "CPU"
    props = torch.cuda.get_device_properties(device)
    return f"{props.name} ({props.total_memory / GIB:.0f} GiB), torch {torch.__version__}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--shape", default="qwen2.5-1.5b-instruct", choices=sorted(PRESETS))
    p.add_argument("--tokens", type=int, default=8192, help="tokens of the micro-batch (check 1)")
    p.add_argument("--rows", type=int, default=4, help="rows they are spread over (check 1)")
    p.add_argument("--reference-offload", action="store_true", help="offload the reference (check 1)")
    p.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=True,
                   help="recompute the decoder layers' activations (check 1)")
    p.add_argument("--learn-steps", type=int, default=5, help="optimizer steps on the fixed batch (check 4)")
    p.add_argument("--checks", nargs="+", choices=tuple(CHECKS), default=list(CHECKS), help="which checks to run")
    p.add_argument("--output", default=None, help="also write the report (markdown) here")
    return p.parse_args(argv)


CHECKS = {"step": precision_and_memory, "checkpointing": checkpointing_matches, "offload": offloaded_reference,
          "learn": learns_on_a_fixed_batch}


def main(argv: list[str] | None = None) -> str:
    args = parse_args(argv)
    sections = []
    for check in (CHECKS[name] for name in args.checks):
        try:
            sections.append("\n".join(check(args)))
        except Exception as error:  # a failed check is reported; the others still run
            sections.append(f"## {check.__name__}: FAILED\n\n```\n{type(error).__name__}: {error}\n```")
        print(sections[-1], flush=True)
        if args.device != "cpu":
            torch.cuda.empty_cache()
    report = f"`python benchmarks/gpu_check.py` on {describe_device(args.device)}\n\n" + "\n\n".join(sections) + "\n"
    if args.output:
        Path(args.output).write_text(report, encoding="utf-8")
    return report


if __name__ == "__main__":
    main()
