"""The learner's startup: how much memory a learner holds while it builds its policy and KL reference.

Sharded (``learner_sharding="fsdp"``) at world 2 on gloo (two spawned processes, as tests/test_learner_ddp.py),
each rank must stay well under one unsharded learner's startup (the whole float32 policy and the whole reference):
the policy is sharded unit by unit from the host copy the module was built in, never moved to the learner's device
whole, and the reference is made from the policy's shards, never whole. Measured as the process's peak resident set
above its level before the build (glibc's mmap threshold at 1 MiB, so that freed tensors leave the resident set,
as in benchmarks/bench_memory.py), for a model of 300 MB whose decoder layers, not its embeddings, hold
most of the weights (as in real models: the tiny test models are nearly all embeddings). On the CPU the host is the
device, so the bound here also holds the host's copy: a GPU run's device holds less (the shards, one unit whole).
"""

from __future__ import annotations

import functools
import gc
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.bench_memory import MMAP_THRESHOLD, resident_gib

WORLD = 2
STARTUP_RATIO = 0.6  # each sharded rank's startup peak against one learner's (the target)
TRAINING = {"kl_coef": 0.1}  # a KL reference to build


def layered_llama(name: str, *, dtype: torch.dtype | str, layers: int = 24, **_):
    """A random Llama of about 76M parameters, its 24 decoder layers (``layers``) holding 99% of them, with SmolLM2's
    tokenizer: what ``load_model`` returns in the spawned learners, so that the layers and not the embeddings set the
    sizes, and the model and not what a build loads besides it (the tokenizer, RLlib's objects: 30 MB) the peak."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from policies.models import model_cache_dir, smollm2_tokenizer
    from policies.precision import DTYPES

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1024, hidden_size=512, intermediate_size=1536, num_hidden_layers=layers,
                         num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=True)
    model = LlamaForCausalLM(config).to(DTYPES.get(dtype, dtype))
    return model, smollm2_tokenizer(model_cache_dir())


def startup_peak(world: int, sharding: str) -> dict:
    """Build one learner over ``layered_llama``; its peak resident set during the build above the level before it
    (GiB), and its parameters' bytes. A learner over a one-layer model is built and dropped first, so that what the
    first build of a process loads once (modules imported on first use, FSDP's and DTensor's lazy setup) is out of
    the measurement."""
    from ray.rllib.core import DEFAULT_MODULE_ID

    import policies.rl_module
    from policies.memory import reset_peak_memory
    from tests.test_learner_ddp import build

    learners = world if sharding == "fsdp" else 0
    policies.rl_module.load_model = functools.partial(layered_llama, layers=1)
    build("even_rows", learners, sharding, training=TRAINING)
    gc.collect()
    policies.rl_module.load_model = layered_llama
    before = resident_gib("VmRSS")
    reset_peak_memory("cpu")
    learner = build("even_rows", learners, sharding, training=TRAINING)
    peak = resident_gib("VmHWM") - before
    model = learner.module[DEFAULT_MODULE_ID].unwrapped().model
    return {"peak_gib": peak, "parameters": sum(p.numel() for p in model.parameters())}


def rank_main(rank: int, world: int, out: str, sharding: str) -> None:
    torch.set_num_threads(1)
    if sharding == "fsdp":
        dist.init_process_group("gloo", init_method=f"file://{Path(out) / 'store'}", rank=rank, world_size=world,
                                timeout=timedelta(minutes=5))
    try:
        result = startup_peak(world, sharding)
    except Exception:
        result = {"error": traceback.format_exc()}
    finally:
        torch.save(result, Path(out) / f"{sharding}-{rank}.pt")
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn_startup(out: Path, world: int, sharding: str) -> list[dict]:
    mp.spawn(rank_main, args=(world, str(out), sharding), nprocs=world, join=True)
    return [torch.load(out / f"{sharding}-{rank}.pt", weights_only=False) for rank in range(world)]


@pytest.fixture(scope="module")
def peaks(tmp_path_factory, monkeypatch_module) -> dict[str, list[dict]]:
    monkeypatch_module.setenv(MMAP_THRESHOLD, str(2**20))  # read by glibc as each spawned process starts
    out = tmp_path_factory.mktemp("startup")
    return {"whole": spawn_startup(out, 1, "ddp"), "fsdp": spawn_startup(out, WORLD, "fsdp")}


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def test_no_sharded_rank_holds_the_whole_model_at_startup(peaks):
    for result in peaks["whole"] + peaks["fsdp"]:
        assert "error" not in result, result["error"]
    (whole,) = peaks["whole"]
    # float32: the policy and its reference, whole (a little less: the warm-up left heap room the small tensors reuse)
    assert whole["peak_gib"] * 2**30 > 0.9 * 8 * whole["parameters"]
    for rank in peaks["fsdp"]:
        assert rank["peak_gib"] <= STARTUP_RATIO * whole["peak_gib"], (rank["peak_gib"], whole["peak_gib"])


def test_the_learner_returns_its_cached_device_memory_after_building(monkeypatch):
    """On a GPU the startup's transients (each unit's full parameters before its shard is kept) would stay reserved
    by torch's caching allocator, out of reach of a colocated engine that starts later; the learner hands them back
    once built (``torch.cuda.empty_cache``, CUDA only)."""
    import algos.tree_grpo.learner as learner_module
    from tests.test_learner_ddp import build

    released = []
    monkeypatch.setattr(learner_module, "release_cached_memory", released.append)
    learner = build("even_rows", 0, training=TRAINING)
    assert released == [learner._device]


def test_cached_memory_is_released_on_cuda_only(monkeypatch):
    from policies.memory import release_cached_memory

    calls = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append(1))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    release_cached_memory(torch.device("cpu"))
    assert calls == []
    release_cached_memory(torch.device("cuda", 0))
    assert calls == [1]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a CPU-only vLLM engine's sleep and wake
    release_cached_memory("cuda")
    assert calls == [1]

