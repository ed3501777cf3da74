"""The HF engine's model runner: one forward pass over rows of the KV pool, and each row's next token.

The scheduler (:class:`~policies.hf_generation.HFStepGenerator`) decides which rows a pass carries; the runner
runs it. A pass feeds every decoding row's one pending token (pool rows ``0 .. D-1``) and every prefilling row's
uncached tokens (the rows after them), laid out without padding (:mod:`policies.ragged_attention`), with the
linears on packed weights on the CPU (:mod:`policies.packed_linear`) and the prefilling rows' attention in one
variable-length flash call on a GPU; a pass that only decodes runs in static
shapes when :class:`~policies.static_decode.StaticDecode` is on (CUDA graphs on a GPU). Everything the pass needs
from the host goes to the device in one transfer.

Sampling stays on the device (:mod:`policies.sampling`: top-k candidates, top-p inside them, the exponential race
from the row's own random stream; no sort of the vocabulary, no sync), then one transfer brings the sampled ids
and log-probs (and with ``entropy_tokens``, each row's entropy) to the host. Rows whose candidates held less than
``top_p`` of the mass are redrawn with more candidates, then over the sorted vocabulary, from the same random
numbers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from policies.generation import SamplingSettings
from policies.kv_cache import KVPool
from policies.packed_linear import packed_linears_for, packing_applies
from policies.ragged_attention import (
    PrefillRow,
    RaggedPlan,
    flash_varlen,
    flash_varlen_applies,
    packed_prefill,
    prefill_cumulative,
    ragged_attention_for,
)
from policies.sampling import CANDIDATES, sample_tokens, sample_tokens_exact
from policies.static_decode import StaticDecode


@dataclass(frozen=True)
class DecodeInput:
    """A decoding row: its pending ``token`` goes in at ``position`` (the row's length before the pass)."""

    token: int
    position: int
    stream: int


@dataclass(frozen=True)
class PrefillInput:
    """A prefilling row: its uncached ``tokens`` go in from ``position`` on (the tokens its pool row holds)."""

    tokens: tuple[int, ...]
    position: int
    stream: int


@dataclass(frozen=True)
class Sampled:
    """Each row's next token and its log-prob under the recorded distribution; the rows' entropies when measured."""

    tokens: list[int]
    logprobs: list[float]
    entropies: list[float] | None


class ModelRunner:
    """Forward passes and sampling for the HF engine (see the module docstring)."""

    def __init__(self, model: PreTrainedModel, pool: KVPool, settings: SamplingSettings, *, max_rows: int,
                 static_decode: bool | None = None, packed_linears: bool | None = None):
        self.model, self.pool, self.settings = model, pool, settings
        # the distribution the recorded log-probs are of: the tempered softmax (greedy decoding: the model's own)
        self._logprob_temperature = 1.0 if settings.greedy else settings.temperature
        # decode-only passes in static shapes, replayed as CUDA graphs on a GPU (default: on a GPU only)
        on_gpu = model.device.type == "cuda"
        self.static_decode = (StaticDecode(model, pool, max_rows, capture=on_gpu)
                              if (on_gpu if static_decode is None else static_decode) else None)
        # linear layers through oneDNN with packed weights (policies.packed_linear; default: float32 on the CPU)
        self.packed_linears = packing_applies(model) if packed_linears is None else packed_linears
        if self.packed_linears and not packing_applies(model):
            raise ValueError("packed_linears needs float32 weights on the CPU with oneDNN available")
        # the prefilling rows' attention as one variable-length call (None: one masked call per row)
        self.prefill_kernel = flash_varlen if flash_varlen_applies(model, pool.head_dim) else None

    @torch.inference_mode()  # the pool's buffers are written in place: no pass may record them for autograd
    def run(self, decoding: Sequence[DecodeInput], prefilling: Sequence[PrefillInput], *,
            first_slot: int | None = None, sample: bool = True) -> Sampled | None:
        """One pass: ``decoding`` on pool rows ``0 .. D-1``, ``prefilling`` on the rows from ``first_slot``
        (default D); their keys and values are written into the pool. With ``sample``, each row's next token
        (decoding rows first), drawn at the position after its new tokens."""
        if self.static_decode is not None and not prefilling:
            logits, streams, positions = self._decode_static(decoding)
        else:
            logits, streams, positions = self._forward(decoding, prefilling, first_slot)
        return self._sample(logits, streams, positions) if sample else None

    def _forward(self, decoding: Sequence[DecodeInput], prefilling: Sequence[PrefillInput],
                 first_slot: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The ragged pass; the kept logits, the rows' streams and their sampling positions, on the device."""
        tokens = [d.token for d in decoding]
        positions = [d.position for d in decoding]
        write_rows = list(range(len(decoding)))
        prefill, offset = [], len(decoding)
        first_slot = len(decoding) if first_slot is None else first_slot
        for slot, p in enumerate(prefilling, start=first_slot):
            prefill.append(PrefillRow(slot, offset, len(p.tokens), p.position))
            tokens += p.tokens
            positions += range(p.position, p.position + len(p.tokens))
            write_rows += [slot] * len(p.tokens)
            offset += len(p.tokens)
        lengths = [d.position + 1 for d in decoding]  # after this pass
        ends = lengths + [p.position + len(p.tokens) for p in prefilling]
        keep = list(range(len(decoding))) + [p.offset + p.count - 1 for p in prefill]
        view = -(-max(lengths, default=0) // 16) * 16
        prefill = tuple(prefill)
        packed = self.prefill_kernel is not None and bool(prefill)
        cumulative = prefill_cumulative(prefill) if packed else []
        # everything the pass needs from the host, in one transfer
        host = torch.tensor([*tokens, *positions, *write_rows, *keep, *lengths,
                             *(d.stream for d in decoding), *(p.stream for p in prefilling), *ends, *cumulative],
                            dtype=torch.long)
        device = self.model.device
        rows = len(decoding) + len(prefilling)
        ids, pos, write, kept, decode_lengths, streams, at, cumulative_on_device = host.to(device).split(
            [len(tokens)] * 3 + [len(keep), len(decoding), rows, rows, len(cumulative)])
        decode_mask = None
        if decoding:
            view = min(view, self.pool.capacity)
            decode_mask = (torch.arange(view, device=device)[None] < decode_lengths[:, None])[:, None, None, :]
        plan = RaggedPlan(self.pool, len(decoding), write, pos, decode_mask, prefill,
                          packed_prefill(prefill, cumulative_on_device, self.prefill_kernel) if packed else None)
        with ragged_attention_for(self.model), (packed_linears_for(self.model) if self.packed_linears
                                                 else contextlib.nullcontext()):
            logits = self.model(input_ids=ids[None], position_ids=pos[None], logits_to_keep=kept, use_cache=False,
                                ragged_plan=plan).logits[0]
        return logits, streams, at

    def _decode_static(self, decoding: Sequence[DecodeInput]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The pass of :meth:`_forward` when every row only decodes, in :attr:`static_decode`'s static shapes."""
        host = torch.tensor([*(d.token for d in decoding), *(d.position for d in decoding),
                             *(d.position + 1 for d in decoding), *(d.stream for d in decoding)], dtype=torch.long)
        inputs = host.to(self.model.device).view(4, len(decoding))
        return self.static_decode.logits(inputs[:3]), inputs[3], inputs[2]

    def _sample(self, logits: torch.Tensor, streams: torch.Tensor, positions: torch.Tensor) -> Sampled:
        """Each row's next token and its log-prob under the recorded distribution, on the host; with
        ``entropy_tokens``, also the entropy of each row's distribution."""
        logprobs = torch.log_softmax(logits.float() / self._logprob_temperature, dim=-1)
        if self.settings.greedy:
            drawn, redraw = logits.argmax(dim=-1), torch.zeros_like(streams, dtype=torch.bool)
        else:
            drawn, redraw = sample_tokens(logprobs, self.settings.top_p, streams, positions)
        chosen = logprobs.gather(-1, drawn[:, None]).squeeze(-1)
        measured = [drawn.double(), chosen.double(), redraw.double()]
        if self.settings.entropy_tokens:  # -sum p log p; entr(0) = 0 where a token is impossible
            measured.append(torch.special.entr(logprobs.exp()).sum(dim=-1).double())
        host = torch.stack(measured).cpu()
        tokens, values, flags = host[0].long().tolist(), host[1].tolist(), host[2].bool()
        entropies = host[3].tolist() if self.settings.entropy_tokens else None
        stages = [*CANDIDATES[1:], None]  # more candidates, then the exact draw over the sorted vocabulary
        while flags.any():  # rows whose candidates held less than top_p (the same random numbers: still exact)
            rows = flags.nonzero().squeeze(-1).to(logits.device)
            stage = stages.pop(0)
            args = (logprobs[rows], self.settings.top_p, streams[rows], positions[rows])
            if stage is None:
                redrawn, short = sample_tokens_exact(*args), torch.zeros(len(rows), dtype=torch.bool)
            else:
                redrawn, short = sample_tokens(*args, candidates=stage)
            chosen = logprobs[rows].gather(-1, redrawn[:, None]).squeeze(-1)
            for row, token, value in zip(rows.tolist(), redrawn.tolist(), chosen.tolist(), strict=True):
                tokens[row], values[row] = token, value
            flags = torch.zeros_like(flags)
            flags[rows.cpu()] = short.cpu()
        return Sampled(tokens, values, entropies)
