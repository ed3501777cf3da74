"""Decode passes in static shapes (CUDA graphs on a GPU): the same tokens and log-probs as the ragged passes."""

from __future__ import annotations

import contextlib

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


# -- the graph bookkeeping on the CPU: torch.cuda's graph API faked ------------------------------------------------


class FakeStream:
    def wait_stream(self, other) -> None:
        pass


class FakeGraph:
    """A "captured" pass: the static pass run during the capture, and the tensor it wrote; a replay runs that pass
    again into the same tensor (as a CUDA graph rewrites its static output buffers)."""

    def __init__(self):
        self.pool, self.recorded, self.replays = None, None, 0

    def replay(self) -> None:
        static, shape, out = self.recorded
        out.copy_(EAGER_RUN(static, shape))
        self.replays += 1


EAGER_RUN = StaticDecode._run


class FakeCuda:
    """torch.cuda's graph API as StaticDecode calls it, on the CPU: numbered pool handles, captures that record
    their pass and pool (every one raising as an uncapturable op does while ``fail`` is set)."""

    def __init__(self, monkeypatch):
        self.pools: list[int] = []  # every graph pool handle asked for, in order
        self.graphs: list[FakeGraph] = []  # every graph captured, in order
        self.attempts = 0
        self.fail = False
        self._capturing: FakeGraph | None = None
        fake = self

        def recording_run(static, shape):
            out = EAGER_RUN(static, shape)
            if fake._capturing is not None:
                fake._capturing.recorded = (static, shape, out)
            return out

        @contextlib.contextmanager
        def graph(cuda_graph: FakeGraph, pool=None):
            fake.attempts += 1
            fake._capturing = cuda_graph
            try:
                yield
            finally:
                fake._capturing = None
            if fake.fail:
                raise RuntimeError("operation not permitted when stream is capturing")
            cuda_graph.pool = pool
            fake.graphs.append(cuda_graph)

        monkeypatch.setattr(StaticDecode, "_run", recording_run)
        monkeypatch.setattr(torch.cuda, "graph_pool_handle", self._pool_handle)
        monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
        monkeypatch.setattr(torch.cuda, "graph", graph)
        monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
        monkeypatch.setattr(torch.cuda, "current_stream", FakeStream)
        monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())

    def _pool_handle(self) -> int:
        self.pools.append(len(self.pools))
        return self.pools[-1]

    def replays(self) -> list[int]:
        return [g.replays for g in self.graphs]


@pytest.fixture
def fake_cuda(monkeypatch) -> FakeCuda:
    return FakeCuda(monkeypatch)


def pool_for(model) -> KVPool:
    config = model.config.get_text_config()
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    pool = KVPool(config.num_hidden_layers, config.num_key_value_heads, head_dim, torch.float32, torch.device("cpu"))
    pool.ensure(rows=4, capacity=32, used_rows=0)
    return pool


def decode_inputs(tokens: list[int], position: int) -> torch.Tensor:
    """[3, D]: each row's pending token, its position, and the row's length once fed."""
    return torch.tensor([tokens, [position] * len(tokens), [position + 1] * len(tokens)])


def test_a_shape_captured_once_is_replayed_with_the_eager_passes_logits(tiny, fake_cuda):
    model, _ = tiny
    graphs = StaticDecode(model, pool_for(model), 8, capture=True)
    eager = StaticDecode(model, pool_for(model), 8, capture=False)
    passes = [decode_inputs([5, 6, 7], 0), decode_inputs([8, 9, 10], 1), decode_inputs([11, 12, 13], 2)]
    for inputs in passes:  # the same bucket (4) each time; each pass reads the keys and values of the ones before
        got, expected = graphs.logits(inputs).clone(), eager.logits(inputs).clone()
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    assert fake_cuda.attempts == graphs.captures == 1 and fake_cuda.pools == [0]  # captured once, in the first pool
    assert fake_cuda.replays() == [3] and fake_cuda.graphs[0].pool == 0  # then replayed: no capture per pass
    graphs.logits(decode_inputs([14], 3))  # another bucket (1): its own graph
    assert graphs.captures == 2 and fake_cuda.replays() == [3, 1] and graphs.passes == 4


def test_a_pool_growth_drops_the_graphs_and_captures_again_into_a_new_graph_pool(tiny, fake_cuda):
    model, _ = tiny
    pool = pool_for(model)
    static = StaticDecode(model, pool, 8, capture=True)
    static.logits(decode_inputs([5, 6, 7], 0))  # bucket 4
    static.logits(decode_inputs([8], 1))  # bucket 1
    assert fake_cuda.pools == [0] and [g.pool for g in fake_cuda.graphs] == [0, 0]
    pool.ensure(rows=4, capacity=pool.capacity + 1, used_rows=3)  # the buffers move (as an admission grows them)
    assert pool.allocations == 2
    static.logits(decode_inputs([9, 10, 11], 1))  # bucket 4 again, on the new buffers
    # the old graphs (they read the freed buffers) are never replayed again; the shape is captured anew, and into a
    # new graph pool: torch's allocator refuses a capture into a pool whose graphs are all gone
    assert fake_cuda.pools == [0, 1], "after a pool growth the graphs must be captured into a new graph pool"
    assert static.captures == 3 and [g.pool for g in fake_cuda.graphs] == [0, 0, 1]
    assert fake_cuda.replays() == [1, 1, 1]
    static.logits(decode_inputs([12], 2))  # bucket 1: its old graph is gone too, captured again into the new pool
    static.logits(decode_inputs([13, 14, 15], 2))  # bucket 4, no growth since: replayed
    assert fake_cuda.pools == [0, 1] and [g.pool for g in fake_cuda.graphs] == [0, 0, 1, 1]
    assert fake_cuda.replays() == [1, 1, 2, 1] and static.capture


def test_a_failed_capture_warns_and_runs_eagerly_from_then_on(tiny, fake_cuda):
    model, _ = tiny
    pool = pool_for(model)
    static, eager = StaticDecode(model, pool, 8, capture=True), StaticDecode(model, pool_for(model), 8, capture=False)
    fake_cuda.fail = True
    inputs = decode_inputs([5, 6, 7], 0)
    with pytest.warns(UserWarning, match="decode passes could not be captured as CUDA graphs .*operation not "
                                         "permitted when stream is capturing.*running them eagerly"):
        got = static.logits(inputs).clone()
    torch.testing.assert_close(got, eager.logits(inputs), atol=1e-5, rtol=0)  # the pass still gave its logits
    assert not static.capture and static.captures == 0 and fake_cuda.graphs == [] and fake_cuda.attempts == 1
    fake_cuda.fail = False
    pool.ensure(rows=4, capacity=pool.capacity + 1, used_rows=3)
    for step, tokens in enumerate(([8, 9, 10], [11]), start=1):  # the same bucket, a growth, another bucket
        torch.testing.assert_close(static.logits(decode_inputs(tokens, step)).clone(),
                                   eager.logits(decode_inputs(tokens, step)), atol=1e-5, rtol=0)
    # no capture tried again, no new graph pool: eager from the failure on
    assert fake_cuda.attempts == 1 and fake_cuda.pools == [0] and static.passes == 3


def test_the_engine_with_captured_graphs_gives_the_ragged_passes_tokens(tiny, fake_cuda):
    model, tokenizer = tiny
    settings = SamplingSettings(max_step_tokens=12, stop_strings=())
    ragged = HFStepGenerator(model, tokenizer, settings, static_decode=False)
    graphs = HFStepGenerator(model, tokenizer, settings, static_decode=True)
    graphs.runner.static_decode = StaticDecode(model, graphs.pool, graphs.limits.max_rows, capture=True)
    expected, got = two_rounds(ragged, tokenizer, settings), two_rounds(graphs, tokenizer, settings)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)
    static = graphs.static_decode
    assert static.capture and static.captures == len(fake_cuda.graphs) >= 2
    assert sum(fake_cuda.replays()) == static.passes  # every static pass ran as a graph's replay
    assert graphs.pool.allocations > 1 and len(fake_cuda.pools) >= 2  # the growth between the rounds: a new pool
    assert fake_cuda.graphs[-1].pool == fake_cuda.pools[-1] != fake_cuda.graphs[0].pool
