"""Token-exact, batched, branching generation of agent steps.

A *branch* is a token-id context (prompt, then generated steps and tokenized observations) and, optionally,
the KV cache of a prefix of it. ``generate_step`` advances every branch by one agent step in the same
batched forward passes: it prefills only what no cache covers, samples until each branch closes its first
``</search>`` or ``</answer>`` (or emits an end-of-turn token, or hits its token cap), and returns per branch
the sampled ids, their log-probs under the sampling distribution before top-p (the full softmax at the
sampling temperature, what the learner computes; top-p's renormalisation over the survivors would bias the
PPO ratio), and a cache handle
for the new context, so a child branch forked from it prefills only its observation.

Token ids are the truth: generated ids are never decoded and re-encoded; only observations are tokenized,
once (``observation_ids``), and appended.

This module holds what every backend shares: the sampling settings, branches and step outputs, the
:class:`StepGenerator` protocol (the extension point), and the conversation in token space. The backends:
``policies.hf_generation.HFStepGenerator`` (transformers, CPU or GPU, KV caches reused across branches); a vLLM
backend implements the same calls with its own prefix caching in place of cache handles.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

STOP_STRINGS = ("</search>", "</answer>")
GENERATORS = ("auto", "hf", "vllm")  # the rollout engines (auto: vllm when installed and a GPU is visible)
# The date a chat template writes into a prompt (Llama-3.x's system header says "Today Date: ...", today's date
# unless given one): fixed, so a prompt's token ids do not change with the day and a resumed run replays exactly.
# Meta's template falls back to this date where it cannot read the clock.
CHAT_TEMPLATE_DATE = "26 Jul 2024"


def default_max_step_tokens() -> int:
    """The token cap of one agent step: 500 (the paper's) with a GPU; 128 on CPU, where an untrained model rarely
    closes a tag and every step runs to the cap."""
    return 500 if torch.cuda.is_available() else 128


@dataclass(frozen=True)
class SamplingSettings:
    """How a step is sampled: temperature and top-p (1.0 / 0.95 as in the paper), or greedy."""

    temperature: float = 1.0
    top_p: float = 0.95
    greedy: bool = False
    max_step_tokens: int = field(default_factory=default_max_step_tokens)
    max_context_tokens: int = 4096
    stop_strings: tuple[str, ...] = STOP_STRINGS
    # After these stop strings one more token is sampled, normally the end-of-turn token: the model must learn to
    # stop after its final answer (the official code strips it).
    end_turn_after: tuple[str, ...] = ("</answer>",)
    # Measure the mean entropy of the distributions of each step's first k sampled tokens (StepOutput.entropy),
    # e.g. to branch where the policy is uncertain; 0: not measured.
    entropy_tokens: int = 0

    def __post_init__(self) -> None:
        if self.temperature <= 0 and not self.greedy:
            raise ValueError(f"temperature must be > 0 (or greedy=True), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_step_tokens < 1 or self.max_context_tokens < 2:
            raise ValueError("max_step_tokens must be >= 1 and max_context_tokens >= 2")
        if self.entropy_tokens < 0:
            raise ValueError(f"entropy_tokens must be >= 0 (0: not measured), got {self.entropy_tokens}")

    def step_cap(self, context_tokens: int) -> int:
        """Tokens a step may sample after ``context_tokens``: the step cap, or what the context cap leaves."""
        return min(self.max_step_tokens, self.max_context_tokens - context_tokens)


class CacheHandle(Protocol):
    """A backend's handle on the computed context of a sequence's first ``length`` tokens. The tree stores
    handles without looking inside; only the backend that made one reads it (the HF backend's ``KVCache`` holds
    keys and values; a backend with its own prefix cache, such as vLLM's, hands out none)."""

    length: int


@dataclass(frozen=True)
class Branch:
    """A context to continue: its token ids, optionally the cache of a prefix of them, and the random stream its
    tokens are drawn from (any integer below 2**62; :func:`branch_stream`). A branch draws the same tokens from
    the same stream whichever branches share its batch."""

    token_ids: tuple[int, ...]
    cache: CacheHandle | None = None
    stream: int | None = None


def branch_stream(*entropy: int) -> int:
    """A random stream (62 bits) determined by ``entropy`` (a seed and, say, a tree and a branch index)."""
    words = np.random.SeedSequence(list(entropy)).generate_state(2, dtype=np.uint32)
    return (int(words[0]) << 30) ^ int(words[1])


@dataclass(frozen=True)
class StepOutput:
    """One branch's new step: sampled ids, their log-probs, why it stopped, and the new context's cache.

    ``finish_reason``: ``stop`` (a stop string closed; after ``</answer>`` one more token, normally the
    end-of-turn token, is included), ``eos`` (an end-of-turn token, included in ``token_ids``), ``length``
    (the step or context cap). ``cache`` covers ``branch.token_ids + token_ids[:-1]``
    (the last sampled token was never fed to the model). ``entropy``: the mean entropy (nats) of the
    distributions the step's first ``SamplingSettings.entropy_tokens`` tokens were drawn from (the tempered
    softmax, before top-p, as the log-probs); None where not measured (``entropy_tokens`` 0, no token sampled, or a
    backend that does not measure it).
    """

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str
    cache: CacheHandle | None
    entropy: float | None = None


@dataclass
class GenerationCounters:
    """What generation cost: tokens sampled, tokens prefilled (computed without a cache), LLM calls (steps),
    forward passes of the model (engine iterations; tokens per pass = tokens_generated / forward_passes), and the
    most bytes of keys and values the engine held at once (0 where the backend manages its own cache)."""

    tokens_generated: int = 0
    tokens_prefilled: int = 0
    llm_calls: int = 0
    forward_passes: int = 0
    kv_peak_bytes: int = 0

    def as_dict(self) -> dict[str, int]:
        return {"tokens_generated": self.tokens_generated, "tokens_prefilled": self.tokens_prefilled,
                "llm_calls": self.llm_calls, "forward_passes": self.forward_passes,
                "kv_peak_bytes": self.kv_peak_bytes}


class StepGenerator(Protocol):
    """Advances branches by one agent step each (the contract every generation backend implements).

    Steps are requests: :meth:`submit` queues one, :meth:`poll` advances the engine (one forward pass, or one
    engine iteration) and returns the steps that finished, each under the tag it was submitted with; a step
    submitted while others run joins them at the next pass. :meth:`generate_step` is the batch form (submit
    all, poll until all are back)."""

    counters: GenerationCounters
    settings: SamplingSettings

    def submit(self, branch: Branch, tag: Hashable) -> None: ...

    def poll(self) -> list[tuple[Hashable, StepOutput]]: ...

    @property
    def pending(self) -> int:
        """Steps submitted and not yet returned by :meth:`poll`."""

    def generate_step(self, branches: Sequence[Branch], *, seed: int | None = None) -> list[StepOutput]: ...

    def prefix_cache(self, token_ids: tuple[int, ...]) -> CacheHandle | None:
        """A cache handle for a context many branches will start from (None where the backend caches itself)."""


def generate_steps(generator: StepGenerator, branches: Sequence[Branch], seed: int | None) -> list[StepOutput]:
    """One step of every branch, in order (:meth:`StepGenerator.generate_step`): branches without a stream get
    one from ``seed`` (random when None) and their position in ``branches``."""
    base = seed if seed is not None else int(np.random.SeedSequence().generate_state(1)[0])
    for i, branch in enumerate(branches):
        stream = branch.stream if branch.stream is not None else branch_stream(base, i)
        generator.submit(Branch(branch.token_ids, branch.cache, stream), i)
    outputs: dict[Hashable, StepOutput] = {}
    while len(outputs) < len(branches):
        finished = generator.poll()
        if not finished and not generator.pending:
            raise RuntimeError("the step generator stopped with steps outstanding")
        outputs.update(finished)
    return [outputs[i] for i in range(len(branches))]


# -- conversation in token space ---------------------------------------------------------------------------


def prompt_ids(tokenizer: PreTrainedTokenizerBase, prompt: str) -> tuple[int, ...]:
    """The env's prompt as one user message through the chat template, ready for the assistant's reply (with
    :data:`CHAT_TEMPLATE_DATE` for templates that write a date)."""
    if tokenizer.chat_template:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            tokenize=True, return_dict=True,
                                            date_string=CHAT_TEMPLATE_DATE)["input_ids"]
    else:
        ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
    return tuple(int(i) for i in ids)


def observation_ids(tokenizer: PreTrainedTokenizerBase, observation: str) -> tuple[int, ...]:
    """An observation's ids, tokenized once and appended as is (no special tokens)."""
    return tuple(tokenizer(observation, add_special_tokens=False)["input_ids"])


def end_of_turn_ids(tokenizer: PreTrainedTokenizerBase, model: PreTrainedModel) -> frozenset[int]:
    """Token ids that end the assistant's turn: the tokenizer's EOS and the model's generation EOS ids."""
    ids = {tokenizer.eos_token_id}
    eos = getattr(model.generation_config, "eos_token_id", None)
    ids.update(eos if isinstance(eos, list) else [eos])
    return frozenset(i for i in ids if i is not None)
