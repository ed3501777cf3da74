"""The transformers backend of :class:`~policies.generation.StepGenerator`: a continuous-batching engine over a
causal LM (CPU or GPU), in two parts: this scheduler, and the model runner (:mod:`policies.model_runner`) that runs
each forward pass and samples.

Steps are submitted as requests (:meth:`HFStepGenerator.submit`) and advanced by :meth:`HFStepGenerator.poll`,
one forward pass per call: every row being decoded feeds its last token, and waiting requests join in the same
pass with their uncached tokens (admission is bounded by :class:`EngineLimits`). A row whose step ends leaves the
batch at once and its place is taken by whatever is waiting, so a branch back from its tool call does not wait for
the longest branch of the others. After each pass the scheduler records each row's sampled token and checks its
stops, decoding text only for rows whose new token can end a stop string. Keys and values live in a
:class:`~policies.kv_cache.KVPool` written in place; a finished step hands back a
:class:`~policies.kv_cache.KVSegment` holding only its own tokens and a link to its parent, so a branch forked
from it prefills only its observation.
"""

from __future__ import annotations

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
from policies.model_runner import DecodeInput, ModelRunner, PrefillInput, Sampled
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
        self.eot_ids = end_of_turn_ids(tokenizer, model)
        self.counters = GenerationCounters()
        self._stops = StopStrings(tokenizer, self.settings.stop_strings)
        config = model.config.get_text_config()
        self.max_positions = getattr(config, "max_position_embeddings", None)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.pool = KVPool(config.num_hidden_layers, config.num_key_value_heads, head_dim,
                           next(model.parameters()).dtype, model.device)
        self.runner = ModelRunner(model, self.pool, self.settings, max_rows=self.limits.max_rows,
                                  static_decode=static_decode, packed_linears=packed_linears)
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

    @property
    def static_decode(self) -> StaticDecode | None:
        """The runner's decode passes in static shapes (None when off)."""
        return self.runner.static_decode

    @property
    def packed_linears(self) -> bool:
        """Whether the runner's linears run on packed weights."""
        return self.runner.packed_linears

    @torch.inference_mode()
    def poll(self) -> list[tuple[Hashable, StepOutput]]:
        """One forward pass over the rows being decoded and the requests admitted now; the steps it finished."""
        done: list[tuple[Hashable, StepOutput]] = []
        admitted = self._admit(done)
        if self._rows or admitted:
            self._pass(self._rows, admitted)
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
        self._pass([], [row], first_slot=slot, sample=False)
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

    def _pass(self, decoding: list[_Row], prefilling: list[_Row], *, first_slot: int | None = None,
              sample: bool = True) -> None:
        """One forward pass (:meth:`ModelRunner.run`) feeding every decoding row's pending token and every
        prefilling row's suffix (rows from ``first_slot``, default right after the decoding ones); with ``sample``,
        each row's next token is drawn and recorded."""
        sampled = self.runner.run([DecodeInput(r.pending, r.length, r.stream) for r in decoding],
                                  [PrefillInput(r.suffix, r.length, r.stream) for r in prefilling],
                                  first_slot=first_slot, sample=sample)
        self.counters.forward_passes += 1
        for r in decoding:
            r.length += 1
        for r in prefilling:
            self.counters.tokens_prefilled += len(r.suffix)
            r.length, r.suffix = r.length + len(r.suffix), ()
        if sampled is not None:
            self._record(decoding + prefilling, sampled)

    def _record(self, rows: list[_Row], sampled: Sampled) -> None:
        """Each row's sampled token and log-prob appended; its step ends on an end-of-turn id, a completed stop
        string (or the token after one that keeps it, ``end_turn_after``) or its cap."""
        for i, (r, token, logprob) in enumerate(zip(rows, sampled.tokens, sampled.logprobs, strict=True)):
            if sampled.entropies is not None and len(r.generated) < self.settings.entropy_tokens:
                r.entropy += sampled.entropies[i]
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
