"""Decode passes in static shapes (CUDA graphs on a GPU): the same tokens and log-probs as the ragged passes."""

from __future__ import annotations

import pytest
import torch

from policies.generation import Branch, SamplingSettings, observation_ids, prompt_ids
from policies.hf_generation import HFStepGenerator
from policies.kv_cache import KVPool
from policies.models import load_model
from policies.static_decode import StaticDecode

QUESTIONS = ("Who wrote Hamlet?", "Capital of France?", "Why?", "A much longer question about many things, really?",
             "Ok")
OBSERVATION = "\n\n<information>Doc 1(Title: Hamlet) Hamlet is a tragedy by William Shakespeare.</information>\n\n"


@pytest.fixture(scope="module")
def tiny():
    model, tokenizer = load_model("tiny-random", seed=0)
    return model.eval(), tokenizer


def two_rounds(generator: HFStepGenerator, tokenizer, settings: SamplingSettings) -> list:
    """Five prompts (bucket 8: three padding rows), then three forks of each of their steps from its cache (15
    rows, bucket 16), a long observation making the pool grow between the rounds."""
    prompts = [prompt_ids(tokenizer, q) for q in QUESTIONS]
    first = generator.generate_step([Branch(p, stream=i) for i, p in enumerate(prompts)])
    obs = observation_ids(tokenizer, OBSERVATION * 3)
    forks = [Branch(p + out.token_ids + obs, out.cache, stream=10 * i + k)
             for i, (p, out) in enumerate(zip(prompts, first, strict=True)) for k in range(3)]
    return first + generator.generate_step(forks)


@pytest.mark.parametrize("greedy", [False, True])
def test_static_decode_gives_the_ragged_passes_tokens_and_logprobs(tiny, greedy):
    model, tokenizer = tiny
    settings = SamplingSettings(greedy=greedy, max_step_tokens=12, stop_strings=())
    ragged = HFStepGenerator(model, tokenizer, settings, static_decode=False)
    static = HFStepGenerator(model, tokenizer, settings, static_decode=True)
    expected, got = two_rounds(ragged, tokenizer, settings), two_rounds(static, tokenizer, settings)
    assert ragged.static_decode is None
    assert static.static_decode.passes > 0 and static.static_decode.captures == 0  # no graphs on the CPU
    assert static.pool.allocations > 1  # the pool grew after shapes existed: they were rebuilt on the new buffers
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert [o.finish_reason for o in got] == [o.finish_reason for o in expected]
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)
        assert a.cache.length == b.cache.length
    assert static.counters.tokens_prefilled == ragged.counters.tokens_prefilled
    assert static.counters.forward_passes == ragged.counters.forward_passes


def test_static_decode_serves_only_passes_without_prefill(tiny):
    model, tokenizer = tiny
    generator = HFStepGenerator(model, tokenizer, SamplingSettings(max_step_tokens=6, stop_strings=()),
                                static_decode=True)
    generator.generate_step([Branch(prompt_ids(tokenizer, "Who wrote Hamlet?"), stream=0)])
    # six tokens: the first comes from the prefill pass, the other five from decode-only passes
    assert generator.counters.forward_passes == 6 and generator.static_decode.passes == 5


def test_buckets_end_at_the_row_limit(tiny):
    model, _ = tiny
    pool = KVPool(1, 1, 8, torch.float32, torch.device("cpu"))
    static = StaticDecode(model, pool, 10, capture=False)
    assert static.buckets == (1, 2, 4, 8, 10)
    assert [static.bucket(n) for n in (1, 3, 8, 9, 10)] == [1, 4, 8, 10, 10]
    assert StaticDecode(model, pool, 256, capture=False).buckets[-2:] == (128, 256)


def test_default_is_static_only_on_a_gpu(tiny):
    model, tokenizer = tiny
    assert HFStepGenerator(model, tokenizer).static_decode is None  # the CPU model: ragged passes


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graphs_replay_the_eager_passes(tiny):
    model, tokenizer = tiny
    model = model.to("cuda")
    settings = SamplingSettings(max_step_tokens=12, stop_strings=())
    eager = HFStepGenerator(model, tokenizer, settings, static_decode=False)
    graphs = HFStepGenerator(model, tokenizer, settings)
    expected, got = two_rounds(eager, tokenizer, settings), two_rounds(graphs, tokenizer, settings)
    model.to("cpu")
    assert graphs.static_decode.captures > 0 and graphs.static_decode.capture  # captured, not fallen back
    # the pool grew after the first round's captures: the second round's shapes were captured again, into a new
    # graph pool (reusing the old one fails torch's allocator assert, which once made every GPU run fall back)
    assert graphs.pool.allocations > 1
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=0)
