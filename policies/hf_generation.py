"""The transformers backend of :class:`~policies.generation.StepGenerator`: a continuous-batching engine over a
causal LM (CPU or GPU).

Steps are submitted as requests (:meth:`HFStepGenerator.submit`) and advanced by :meth:`HFStepGenerator.poll`,
one forward pass per call: every row being decoded feeds its last token, and waiting requests join in the same
pass with their uncached tokens (:mod:`policies.ragged_attention` lays them out without padding). A row whose step
ends leaves the batch at once and its place is taken by whatever is waiting, so a branch back from its tool call
does not wait for the longest branch of the others.

Per forward pass: sampling on the device (:mod:`policies.sampling`: top-k candidates, top-p inside them, the
exponential race from the branch's own random stream; no sort of the vocabulary, no sync), one transfer of the
sampled ids and log-probs (with ``entropy_tokens``, each row's entropy too) to the host, and a stop check that
decodes text only for rows whose new token can end a stop string. Keys and values live in a
:class:`~policies.kv_cache.KVPool` written in place; a finished step hands back a
:class:`~policies.kv_cache.KVSegment` holding only its own tokens and a link to its parent, so a branch forked
from it prefills only its observation.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from policies.generation import (
    Branch,
    GenerationCounters,
    SamplingSettings,
    StepOutput,
    end_of_turn_ids,
    generate_steps,
)
from policies.kv_cache import KVPool, KVSegment
from policies.packed_linear import packed_linears_for, packing_applies
from policies.ragged_attention import PrefillRow, RaggedPlan, prefill_mask, ragged_attention_for
from policies.sampling import CANDIDATES, sample_tokens, sample_tokens_exact
from policies.static_decode import StaticDecode
from policies.stops import StopStrings


@dataclass(frozen=True)
class EngineLimits:
    """How much one forward pass may take on: rows decoded together, and uncached tokens of requests admitted in
    one pass (a long prefill delays every row's next token; at least one request is admitted per pass)."""

    max_rows: int = 256
    max_prefill_tokens: int = 4096

    def __post_init__(self) -> None:
        if self.max_rows < 1 or self.max_prefill_tokens < 1:
            raise ValueError(f"engine limits must be >= 1, got max_rows={self.max_rows}, "
                             f"max_prefill_tokens={self.max_prefill_tokens}")


@dataclass
class _Row:
    """A step being generated: its pool row holds ``length`` tokens; ``pending`` is sampled but not yet fed."""

    tag: Hashable
    stream: int
    cap: int
    parent: KVSegment | None
    start: int  # tokens loaded from ``parent`` (this step's segment starts here)
    length: int
    suffix: tuple[int, ...] = ()  # uncached context tokens, fed by the first forward pass
    pending: int = -1
    generated: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    entropy: float = 0.0  # summed over the first SamplingSettings.entropy_tokens sampled tokens
    closing: bool = False
    finish: str | None = None


class HFStepGenerator:
    """A :class:`~policies.generation.StepGenerator` on a transformers causal LM (see the module docstring)."""

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                 settings: SamplingSettings | None = None, *, keep_cache: bool = True,
                 limits: EngineLimits | None = None, static_decode: bool | None = None,
                 packed_linears: bool | None = None):
        self.model, self.tokenizer = model, tokenizer
        self.settings = settings or SamplingSettings()
        self.keep_cache = keep_cache
        self.limits = limits or EngineLimits()
        # the distribution the recorded log-probs are of: the tempered softmax (greedy decoding: the model's own)
        self._logprob_temperature = 1.0 if self.settings.greedy else self.settings.temperature
        self.eot_ids = end_of_turn_ids(tokenizer, model)
        self.counters = GenerationCounters()
        self._stops = StopStrings(tokenizer, self.settings.stop_strings)
        config = model.config.get_text_config()
        self.max_positions = getattr(config, "max_position_embeddings", None)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.pool = KVPool(config.num_hidden_layers, config.num_key_value_heads, head_dim,
                           next(model.parameters()).dtype, model.device)
        # decode-only passes in static shapes, replayed as CUDA graphs on a GPU (default: on a GPU only)
        on_gpu = model.device.type == "cuda"
        self.static_decode = (StaticDecode(model, self.pool, self.limits.max_rows, capture=on_gpu)
                              if (on_gpu if static_decode is None else static_decode) else None)
        # linear layers through oneDNN with packed weights (policies.packed_linear; default: float32 on the CPU)
        self.packed_linears = packing_applies(model) if packed_linears is None else packed_linears
        if self.packed_linears and not packing_applies(model):
            raise ValueError("packed_linears needs float32 weights on the CPU with oneDNN available")
        self._waiting: deque[tuple[Branch, Hashable]] = deque()
        self._rows: list[_Row] = []

    # -- the StepGenerator calls ------------------------------------------------------------------------------

    def submit(self, branch: Branch, tag: Hashable) -> None:
        """Queue one step of ``branch`` (its ``stream`` must be set); :meth:`poll` returns it under ``tag``."""
        if branch.stream is None:
            raise ValueError("a submitted branch needs its random stream (Branch.stream)")
        if self.max_positions is not None and len(branch.token_ids) >= self.max_positions:
            raise ValueError(f"a context of {len(branch.token_ids)} tokens does not fit the model's "
                             f"{self.max_positions} positions")
        self._waiting.append((branch, tag))

    @property
    def pending(self) -> int:
        """Steps submitted and not yet returned."""
        return len(self._waiting) + len(self._rows)

    @torch.inference_mode()
    def poll(self) -> list[tuple[Hashable, StepOutput]]:
        """One forward pass over the rows being decoded and the requests admitted now; the steps it finished."""
        done: list[tuple[Hashable, StepOutput]] = []
        admitted = self._admit(done)
        if self._rows or admitted:
            if self.static_decode is not None and not admitted:
                self._decode_static(self._rows)
            else:
                self._forward(self._rows, admitted)
            self._rows += admitted
            done += self._retire()
        self.counters.kv_peak_bytes = self.pool.peak_bytes
        return done

    def generate_step(self, branches: Sequence[Branch], *, seed: int | None = None) -> list[StepOutput]:
        return generate_steps(self, branches, seed)

    @torch.inference_mode()
    def prefix_cache(self, token_ids: tuple[int, ...]) -> KVSegment | None:
        """The cache of ``token_ids[:-1]``: branches sharing this context (the M trees of a prompt) then prefill
        one token each instead of the whole prompt."""
        if not self.keep_cache or len(token_ids) < 2:
            return None
        row = _Row(tag=None, stream=0, cap=0, parent=None, start=0, length=0, suffix=tuple(token_ids[:-1]))
        slot = len(self._rows)  # a row past the active ones; they do not advance in this pass
        self.pool.ensure(slot + 1, len(row.suffix), used_rows=slot)
        self._forward([], [row], first_slot=slot, sample=False)
        segment = self.pool.segment(slot, 0, row.length, None)
        self.counters.kv_peak_bytes = self.pool.peak_bytes
        return segment

    # -- admission, the forward pass, retirement ---------------------------------------------------------------

    def _admit(self, done: list[tuple[Hashable, StepOutput]]) -> list[_Row]:
        """Waiting requests that join this pass, loaded into rows after the active ones; requests with no room
        left in the context cap finish at once (no tokens, ``length``)."""
        admitted: list[_Row] = []
        budget = self.limits.max_prefill_tokens
        while self._waiting and len(self._rows) + len(admitted) < self.limits.max_rows:
            branch, tag = self._waiting[0]
            context = branch.token_ids
            cap = self.settings.step_cap(len(context))
            handle = _usable_cache(branch) if self.keep_cache else None
            cached = handle.length if handle is not None else 0
            if admitted and len(context) - cached > budget:
                break
            self._waiting.popleft()
            if cap <= 0:
                done.append((tag, StepOutput((), (), "length", handle)))
                continue
            budget -= len(context) - cached
            slot = len(self._rows) + len(admitted)
            self.pool.ensure(slot + 1, len(context) + cap, used_rows=slot)
            self.pool.load(slot, handle)
            admitted.append(_Row(tag, branch.stream, cap, handle, cached, cached, tuple(context[cached:])))
        return admitted

    def _forward(self, decoding: list[_Row], prefilling: list[_Row], *, first_slot: int | None = None,
                 sample: bool = True) -> None:
        """Feed every decoding row's pending token (pool rows 0, 1, ...) and every prefilling row's suffix (rows
        from ``first_slot``, default right after the decoding ones) in one pass; with ``sample``, each row's next
        token is drawn and recorded."""
        rows = decoding + prefilling
        tokens = [r.pending for r in decoding]
        positions = [r.length for r in decoding]
        write_rows = list(range(len(decoding)))
        prefill, offset = [], len(decoding)
        first_slot = len(decoding) if first_slot is None else first_slot
        for slot, r in enumerate(prefilling, start=first_slot):
            prefill.append(PrefillRow(slot, offset, len(r.suffix), r.length))
            tokens += r.suffix
            positions += range(r.length, r.length + len(r.suffix))
            write_rows += [slot] * len(r.suffix)
            offset += len(r.suffix)
            self.counters.tokens_prefilled += len(r.suffix)
        for r in decoding:
            r.length += 1
        for r in prefilling:
            r.length, r.suffix = r.length + len(r.suffix), ()
        keep = list(range(len(decoding))) + [p.offset + p.count - 1 for p in prefill]
        view = -(-max((r.length for r in decoding), default=0) // 16) * 16
        # everything the pass needs from the host, in one transfer
        host = torch.tensor([*tokens, *positions, *write_rows, *keep, *(r.length for r in decoding),
                             *(r.stream for r in rows), *(r.length for r in rows)], dtype=torch.long)
        device = self.model.device
        ids, pos, write, kept, lengths, streams, at = host.to(device).split(
            [len(tokens)] * 3 + [len(keep), len(decoding), len(rows), len(rows)])
        decode_mask = None
        if decoding:
            view = min(view, self.pool.capacity)
            decode_mask = (torch.arange(view, device=device)[None] < lengths[:, None])[:, None, None, :]
        plan = RaggedPlan(self.pool, len(decoding), write, pos, decode_mask, tuple(prefill),
                          tuple(prefill_mask(p.start, p.count, device) for p in prefill))
        with ragged_attention_for(self.model), (packed_linears_for(self.model) if self.packed_linears
                                                 else contextlib.nullcontext()):
            logits = self.model(input_ids=ids[None], position_ids=pos[None], logits_to_keep=kept, use_cache=False,
                                ragged_plan=plan).logits[0]
        self.counters.forward_passes += 1
        if sample:
            self._record(rows, *self._sample(logits, streams, at))

    def _decode_static(self, rows: list[_Row]) -> None:
        """The pass of :meth:`_forward` when every row only decodes, in :attr:`static_decode`'s static shapes."""
        host = torch.tensor([*(r.pending for r in rows), *(r.length for r in rows), *(r.length + 1 for r in rows),
                             *(r.stream for r in rows)], dtype=torch.long)
        for r in rows:
            r.length += 1
        inputs = host.to(self.model.device).view(4, len(rows))
        logits = self.static_decode.logits(inputs[:3])
        self.counters.forward_passes += 1
        self._record(rows, *self._sample(logits, inputs[3], inputs[2]))

    def _sample(self, logits: torch.Tensor, streams: torch.Tensor,
                positions: torch.Tensor) -> tuple[list[int], list[float], list[float] | None]:
        """Each row's next token and its log-prob under the recorded distribution, on the host; with
        ``entropy_tokens``, also the entropy of each row's distribution (None without)."""
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
        return tokens, values, entropies

    def _record(self, rows: list[_Row], tokens: list[int], logprobs: list[float],
                entropies: list[float] | None) -> None:
        for i, (r, token, logprob) in enumerate(zip(rows, tokens, logprobs, strict=True)):
            if entropies is not None and len(r.generated) < self.settings.entropy_tokens:
                r.entropy += entropies[i]
            r.generated.append(token)
            r.logprobs.append(logprob)
            r.pending = token
            if r.closing:
                r.finish = "stop"
            elif token in self.eot_ids:
                r.finish = "eos"
            elif stop := self._stops.completed_by_last(r.generated):
                end_turn = stop in self.settings.end_turn_after and len(r.generated) < r.cap
                r.closing = end_turn
                r.finish = None if end_turn else "stop"
            elif len(r.generated) >= r.cap:
                r.finish = "length"

    def _mean_entropy(self, row: _Row) -> float | None:
        """The mean entropy of the row's first ``entropy_tokens`` tokens (None when not measured)."""
        measured = min(len(row.generated), self.settings.entropy_tokens)
        return row.entropy / measured if measured else None

    def _retire(self) -> list[tuple[Hashable, StepOutput]]:
        """Finished rows leave the batch (the last active rows move into their places); their steps."""
        done = []
        finished = [i for i, r in enumerate(self._rows) if r.finish is not None]
        for i in finished:
            r = self._rows[i]
            # the pool row holds the context and every sampled token but the last (never fed)
            cache = self.pool.segment(i, r.start, r.length, r.parent) if self.keep_cache else None
            done.append((r.tag, StepOutput(tuple(r.generated), tuple(r.logprobs), r.finish, cache,
                                           self._mean_entropy(r))))
            self.counters.llm_calls += 1
            self.counters.tokens_generated += len(r.generated)
        survivors = [i for i, r in enumerate(self._rows) if r.finish is None]
        kept = len(survivors)
        movers = iter(i for i in survivors if i >= kept)
        for hole in (i for i in finished if i < kept):
            source = next(movers)
            self.pool.move(source, hole, self._rows[source].length)
            self._rows[hole] = self._rows[source]
        del self._rows[kept:]
        return done


def _usable_cache(branch: Branch) -> KVSegment | None:
    """The branch's cache, cropped to leave at least one token to prefill (the next-token logits need it)."""
    cache = branch.cache
    if cache is None or cache.length == 0:
        return None
    return cache if cache.length < len(branch.token_ids) else cache.crop(len(branch.token_ids) - 1)
