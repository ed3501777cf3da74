"""The weight sync's buckets (no Ray): exact round trips in each dtype for tied and untied models, the bucket bound,
a tensor split over buckets, a refused mismatch, the LoRA scope, a sharded (DTensor) parameter gathered, and the
module's sync methods."""

from __future__ import annotations

import itertools
from datetime import timedelta

import numpy as np
import pytest
import torch
from ray.rllib.core.rl_module.rl_module import RLModuleSpec
from torch.distributed.tensor import DTensor

from envs.search_qa import UnicodeText
from policies.generation import Branch, SamplingSettings, prompt_ids
from policies.models import LoraSettings, load_model
from policies.rl_module import LLMRLModule
from policies.tiny_models import TINY_LLAMA3, TINY_QWEN2
from policies.weight_sync import (
    ALIGNMENT,
    Bucket,
    Piece,
    bucket_bytes,
    check_specs,
    copy_weights,
    engine_tensors,
    load_buckets,
    pack_buckets,
    share_weights,
    shareable,
    tensor_specs,
)

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class Small(torch.nn.Module):
    """A parameter of 100 float32 (400 bytes), a tied pair, and a persistent integer buffer."""

    def __init__(self, seed: int):
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.big = torch.nn.Parameter(torch.randn(10, 10, generator=generator))
        self.embed = torch.nn.Embedding(3, 4)
        self.embed.weight.data = torch.randn(3, 4, generator=generator)
        self.head = torch.nn.Linear(4, 3, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.register_buffer("steps", torch.tensor([seed, 2 * seed], dtype=torch.int64))
        self.register_buffer("scratch", torch.zeros(2), persistent=False)


def round_trip(source: torch.nn.Module, target: torch.nn.Module, dtype: torch.dtype, max_bytes: int) -> list[Bucket]:
    buckets = list(pack_buckets(engine_tensors(source), dtype, max_bytes))
    load_buckets(target, tensor_specs(source, dtype), buckets)
    return buckets


def test_specs_list_each_tensor_once_in_its_travel_dtype():
    specs = tensor_specs(Small(1), torch.bfloat16)
    assert [(s.name, s.shape, s.dtype) for s in specs] == [
        ("big", (10, 10), torch.bfloat16), ("embed.weight", (3, 4), torch.bfloat16),
        ("steps", (2,), torch.int64)]  # the tied head and the non-persistent buffer left out


def test_a_tensor_larger_than_a_bucket_is_split_over_buckets_in_order():
    buckets = list(pack_buckets([("big", torch.arange(100.0))], torch.float32, 128))
    # 128 bytes hold 32 float32: 32 + 32 + 32 + 4 elements
    assert [b.pieces for b in buckets] == [(Piece("big", torch.float32, start, count, 0),)
                                           for start, count in ((0, 32), (32, 32), (64, 32), (96, 4))]
    assert [b.data.nbytes for b in buckets] == [128, 128, 128, 16]
    assert np.concatenate([b.data.view(np.float32) for b in buckets]).tolist() == list(range(100))


def test_pieces_start_aligned_and_share_a_bucket_until_it_is_full():
    tensors = [("a", torch.ones(3)), ("b", torch.full((5,), 2.0)), ("c", torch.full((40,), 3.0))]
    buckets = list(pack_buckets(tensors, torch.bfloat16, 128))
    first, second = buckets
    # a: 6 bytes at 0; b: 10 bytes at the next 64-byte boundary, whose next boundary is the bucket's end: c starts
    # the second bucket
    assert [(p.name, p.start, p.count, p.offset) for p in first.pieces] == [("a", 0, 3, 0), ("b", 0, 5, 64)]
    assert [(p.name, p.start, p.count, p.offset) for p in second.pieces] == [("c", 0, 40, 0)]
    assert first.data.nbytes == 64 + 10 and second.data.nbytes == 80  # up to the last piece's end


@pytest.mark.parametrize("max_bytes", [ALIGNMENT, 1000, 2**20])
def test_buckets_respect_the_bound_and_do_not_overlap(max_bytes):
    model = load_model(TINY_QWEN2, seed=1)[0]
    for bucket in pack_buckets(engine_tensors(model), torch.bfloat16, max_bytes):
        assert bucket.data.dtype == np.uint8 and bucket.data.nbytes <= max_bytes
        ends = [(p.offset, p.offset + p.nbytes) for p in bucket.pieces]
        assert all(start % ALIGNMENT == 0 for start, _ in ends) and ends[-1][1] <= bucket.data.nbytes
        assert all(end <= next_start for (_, end), (next_start, _) in itertools.pairwise(ends))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", [TINY_QWEN2, TINY_LLAMA3])
def test_round_trip_is_exact_in_the_engine_dtype(name, dtype):
    source, target = load_model(name, seed=1)[0], load_model(name, seed=2)[0].to(dtype)
    buckets = round_trip(source, target, dtype, max_bytes=300_000)  # the embedding spans several buckets
    assert len(buckets) > 1
    expected = source.state_dict()
    for key, tensor in target.state_dict().items():
        assert tensor.dtype == dtype and torch.equal(tensor, expected[key].to(dtype)), key
    names = {spec.name for spec in tensor_specs(source)}
    tied = source.config.tie_word_embeddings
    assert ("lm_head.weight" in names) is not tied  # a tied head travels once, as the embedding
    assert (target.lm_head.weight is target.model.embed_tokens.weight) is tied


def test_integer_buffers_travel_in_their_own_dtype_and_the_tied_pair_stays_tied():
    source, target = Small(3), Small(4)
    round_trip(source, target, torch.bfloat16, max_bytes=128)
    assert target.steps.tolist() == [3, 6]
    assert torch.equal(target.big, source.big.to(torch.bfloat16).float())
    assert target.head.weight is target.embed.weight and torch.equal(target.head.weight,
                                                                     source.embed.weight.bfloat16().float())


def test_a_mismatched_manifest_is_refused_before_anything_is_written():
    qwen, llama = load_model(TINY_QWEN2, seed=1)[0], load_model(TINY_LLAMA3, seed=1)[0]
    before = {k: v.clone() for k, v in qwen.state_dict().items()}
    buckets = list(pack_buckets(engine_tensors(llama), torch.float32, 2**20))
    with pytest.raises(ValueError, match=r"do not match the Qwen2ForCausalLM: missing \['model.layers.0.self_attn."
                                         r"k_proj.bias'.*unexpected \['lm_head.weight'\]"):
        load_buckets(qwen, tensor_specs(llama), buckets)
    assert all(torch.equal(before[k], v) for k, v in qwen.state_dict().items())
    small = Small(1)
    wrong = tuple(spec if spec.name != "big" else type(spec)("big", (5, 20), spec.dtype) for spec in
                  tensor_specs(small))
    with pytest.raises(ValueError, match=r"other shapes \['big \(10, 10\) != sent \(5, 20\)'\]"):
        check_specs(small, wrong)


def test_a_missing_bucket_or_a_stray_piece_is_an_error():
    source, target = Small(1), Small(2)
    buckets = list(pack_buckets(engine_tensors(source), torch.float32, 128))
    with pytest.raises(ValueError, match=r"left 1 tensor\(s\) incomplete: \['big'\]"):
        load_buckets(target, tensor_specs(source), buckets[1:])
    stray = Bucket((Piece("other", torch.float32, 0, 1, 0),), np.zeros(4, dtype=np.uint8))
    with pytest.raises(ValueError, match="holds 'other'"):
        load_buckets(target, tensor_specs(source), [stray])


def test_read_only_arrays_load_without_a_copy_or_a_warning(recwarn):
    source, target = Small(1), Small(2)
    buckets = list(pack_buckets(engine_tensors(source), torch.float32, 2**20))
    for bucket in buckets:
        bucket.data.flags.writeable = False  # what Ray's get of a numpy array hands over
    load_buckets(target, tensor_specs(source), buckets)
    assert torch.equal(target.big, source.big) and not recwarn.list


def test_copy_weights_casts_into_the_target_in_place():
    source, target = load_model(TINY_QWEN2, seed=1)[0], load_model(TINY_QWEN2, seed=2)[0].to(torch.bfloat16)
    embedding = target.model.embed_tokens.weight
    copy_weights(source, target)
    assert target.model.embed_tokens.weight is embedding  # written in place
    for key, tensor in target.state_dict().items():
        assert torch.equal(tensor, source.state_dict()[key].bfloat16()), key
    with pytest.raises(ValueError, match="do not match"):
        copy_weights(load_model(TINY_LLAMA3, seed=1)[0], target)


def test_a_lora_model_syncs_its_adapters_only():
    pytest.importorskip("peft")
    lora = LoraSettings(rank=4, alpha=8)
    source, target = load_model(TINY_QWEN2, seed=1, lora=lora)[0], load_model(TINY_QWEN2, seed=1, lora=lora)[0]
    with torch.no_grad():
        for name, parameter in source.named_parameters():
            if "lora_" in name:
                parameter.add_(0.5)
    specs = tensor_specs(source)
    assert specs and all("lora_" in spec.name for spec in specs)
    round_trip(source, target, torch.float32, max_bytes=2**20)
    for key, tensor in target.state_dict().items():
        assert torch.equal(tensor, source.state_dict()[key]), key


def test_a_sharded_parameter_is_gathered_whole(tmp_path):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1,
                            timeout=timedelta(seconds=60))
    try:
        source, target = Small(1), Small(2)
        mesh = init_device_mesh("cpu", (1,))
        source.big = torch.nn.Parameter(distribute_tensor(source.big.detach(), mesh, [Shard(0)]))
        (name, gathered), *_ = engine_tensors(source, torch.bfloat16)  # cast shard by shard, then gathered
        assert name == "big" and type(gathered) is torch.Tensor and gathered.shape == (10, 10)
        assert gathered.dtype == torch.bfloat16 and torch.equal(gathered, source.big.full_tensor().bfloat16())
        round_trip(source, target, torch.float32, max_bytes=128)
        assert torch.equal(target.big, source.big.full_tensor())
    finally:
        dist.destroy_process_group()


def sync_from_fully_sharded(rank: int, store: str, received: str) -> None:
    """One rank of a world of 2 holding ``Small(1)`` under ``fully_shard``: both gather, rank 0 packs and loads the
    buckets into an unsharded ``Small(2)`` and saves its state to ``received``."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    try:
        model = Small(1)
        fully_shard(model)
        assert isinstance(model.big, DTensor) and model.big.to_local().shape == (5, 10)  # half the rows each
        tensors = engine_tensors(model, torch.bfloat16)
        if rank == 0:
            target = Small(2)
            load_buckets(target, tensor_specs(model, torch.bfloat16), pack_buckets(tensors, torch.bfloat16, 128))
            torch.save(target.state_dict(), received)
        else:
            for _ in tensors:  # the gathers are collectives: every rank takes part, in order
                pass
    finally:
        dist.destroy_process_group()


def test_a_fully_sharded_model_is_gathered_tensor_by_tensor_across_ranks(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(sync_from_fully_sharded, args=(str(tmp_path / "store"), str(tmp_path / "received.pt")), nprocs=2)
    received, expected = torch.load(tmp_path / "received.pt"), Small(1).state_dict()
    for key in ("big", "embed.weight", "head.weight"):
        assert torch.equal(received[key], expected[key].bfloat16().float()), key
    assert received["steps"].tolist() == [1, 2]


def module(*, inference_only: bool = False, **model_config) -> LLMRLModule:
    spec = RLModuleSpec(module_class=LLMRLModule, observation_space=UnicodeText(100), action_space=UnicodeText(100),
                        inference_only=inference_only, model_config={"model": "tiny-random", **model_config})
    return spec.build()


def test_the_modules_sync_in_the_compute_dtype_within_the_configured_bucket_size():
    learner = module(dtype="bfloat16", seed=1, sync_bucket_mib=0.25)
    engine = module(dtype="bfloat16", seed=2, inference_only=True)
    assert {p.dtype for p in learner.parameters()} == {torch.float32}  # float32 master weights
    buckets = list(learner.sync_buckets())
    assert len(buckets) > 1 and max(b.data.nbytes for b in buckets) <= 2**18
    engine.load_synced(learner.sync_specs(), buckets)
    for key, tensor in engine.model.state_dict().items():
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, learner.model.state_dict()[key].bfloat16()), key
    with pytest.raises(ValueError, match="sync_bucket_mib must be a positive number of MiB, got 0"):
        bucket_bytes(0)


def test_the_benchmark_counts_every_host_write_of_each_path():
    from benchmarks.bench_weight_sync import bytes_moved

    sizes = {"state": 10, "unique": 8}  # a tied tensor of 2 bytes listed twice in the state dict
    # buckets: the cast into them, the put, each of the 2 runners' copy into its parameters
    assert sum(bytes_moved("buckets", "local learner, 2 runners", sizes, cast=True).values()) == 8 + 8 + 2 * 8
    # state dict: the cast, 3 writes of the put, per runner 2 of the unpickling and the load
    assert sum(bytes_moved("state dict", "local learner, 2 runners", sizes, cast=True).values()) == 10 + 30 + 40 + 20
    assert sum(bytes_moved("state dict", "local learner, 2 runners", sizes, cast=False).values()) == 90
    # a remote learner's state is pickled to the driver and unpickled there first
    assert sum(bytes_moved("state dict", "remote learner, 2 runners", sizes, cast=False).values()) == 90 + 50
    assert sum(bytes_moved("buckets", "remote learner, 2 runners", sizes, cast=False).values()) == 32
    assert bytes_moved("buckets", "colocated", sizes, cast=True) == {
        "copy into the engine's parameters (cast fused)": 8}
    assert sum(bytes_moved("state dict", "colocated", sizes, cast=True).values()) == 20
    assert sum(bytes_moved("buckets", "colocated", sizes, cast=False).values()) == 0  # the learner's own tensors


def test_an_engine_serves_the_synced_weights_after_it_has_run():
    source, engine = module(seed=1), module(seed=2, inference_only=True)
    prompt = [Branch(prompt_ids(engine.tokenizer, "Who wrote Hamlet?"))]
    settings = SamplingSettings(max_step_tokens=6)
    before = engine.generator(settings).generate_step(prompt, seed=0)  # its linears packed for the CPU
    engine.load_synced(source.sync_specs(), source.sync_buckets())
    (after,), (expected,) = (m.generator(settings).generate_step(prompt, seed=0) for m in (engine, source))
    assert after.token_ids == expected.token_ids and before[0].logprobs != expected.logprobs
    torch.testing.assert_close(torch.tensor(after.logprobs), torch.tensor(expected.logprobs), atol=1e-5, rtol=0)


def test_a_cpu_engine_of_the_same_dtype_shares_the_learner_parameters_and_sees_each_step():
    source, engine = module(seed=1), module(seed=2, inference_only=True)
    assert shareable(source.model, engine.model)
    prompt = [Branch(prompt_ids(engine.tokenizer, "Who wrote Hamlet?"))]
    settings = SamplingSettings(max_step_tokens=6)
    engine.generator(settings).generate_step(prompt, seed=0)  # its linears packed from its own weights
    share_weights(source.model, engine.model)
    theirs = dict(source.model.named_parameters(remove_duplicate=False))
    assert all(p is theirs[name] for name, p in engine.model.named_parameters(remove_duplicate=False))
    optimizer = torch.optim.SGD(source.model.parameters(), lr=0.1)
    for _ in range(2):  # an optimizer step in place, then the engine samples what the learner now holds
        source.model(torch.tensor([[1, 2, 3]])).logits.sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        (after,), (expected,) = (m.generator(settings).generate_step(prompt, seed=0) for m in (engine, source))
        assert after.token_ids == expected.token_ids
        torch.testing.assert_close(torch.tensor(after.logprobs), torch.tensor(expected.logprobs), atol=1e-5, rtol=0)


def test_an_engine_in_another_dtype_or_with_adapters_keeps_its_copy():
    source = load_model(TINY_QWEN2, seed=1)[0]
    assert shareable(source, load_model(TINY_QWEN2, seed=2)[0])
    assert not shareable(source, load_model(TINY_QWEN2, seed=2)[0].to(torch.bfloat16))
    assert not shareable(source, load_model(TINY_LLAMA3, seed=2)[0])
    pytest.importorskip("peft")
    lora = LoraSettings(rank=4, alpha=8)
    assert not shareable(load_model(TINY_QWEN2, seed=1, lora=lora)[0], load_model(TINY_QWEN2, seed=1, lora=lora)[0])
