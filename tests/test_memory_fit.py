"""What would make a plan fit (policies/memory_fit.py), the rollout engine's part of the plan and its memory around
sleep and wake: a colocated vLLM engine's options are offered before more GPUs, the KV cache is counted at the
branches the rollout decodes at once, and plan_memory.py spells its options as run.py does."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from experiments.plan_memory import main as plan_main
from policies.memory_plan import GIB, MemoryOptions, plan_memory
from policies.model_shape import PRESETS

QWEN15B = PRESETS["qwen2.5-1.5b-instruct"]
# the default one-GPU command with vLLM installed (issue 71's contract)
CONTRACT = ["--model", "qwen2.5-1.5b-instruct", "--learners", "1", "--generator", "vllm", "--colocated",
            "--gradient-checkpointing", "--gpu-memory-gib", "80"]


def kv_bytes_per_token(shape) -> int:
    return 2 * shape.layers * shape.kv_dim * 2  # keys and values, every layer, bf16


def would_fit_with(capsys) -> str:
    (line,) = [row for row in capsys.readouterr().out.splitlines() if row.startswith("it would fit with: ")]
    return line.removeprefix("it would fit with: ")


def test_the_default_one_gpu_vllm_command_is_offered_the_engines_options_not_a_second_gpu(capsys, tmp_path):
    out = tmp_path / "plan.json"
    plan_main([*CONTRACT, "--json", str(out)])
    assert json.loads(out.read_text())["fits"] is False  # 40 GiB of the GPU to the engine, as vLLM's default
    change = would_fit_with(capsys)
    assert "--num-learners" not in change and "fsdp" not in change  # no second GPU
    assert "--vllm-sleep (" in change
    share = float(re.search(r"--vllm-gpu-memory-utilization ([0-9.]+) \(", change).group(1))
    options = MemoryOptions(generator="vllm", colocated=True, gradient_checkpointing=True, gpu_memory_gib=80)

    def fits(value: float) -> bool:
        return plan_memory(QWEN15B, MemoryOptions(**{**options.__dict__, "vllm_gpu_memory_utilization": value})).fits

    assert fits(share) and not fits(round(share + 0.05, 2))  # computed so it fits: the largest step that does
    assert plan_memory(QWEN15B, MemoryOptions(**{**options.__dict__, "vllm_sleep": True})).fits


def test_a_share_too_small_for_the_engines_weights_and_kv_cache_is_not_offered():
    from policies.memory_fit import engine_share_that_fits

    options = MemoryOptions(generator="vllm", colocated=True, gradient_checkpointing=True, gpu_memory_gib=80)
    share = engine_share_that_fits(QWEN15B, options)
    floor = 2 * QWEN15B.parameters + kv_bytes_per_token(QWEN15B) * options.rollout_sequences * 4096
    assert share is not None and share * 80 * GIB >= floor
    # the learner alone leaves less than the engine's weights and KV cache of its 128 concurrent branches
    tight = MemoryOptions(**{**options.__dict__, "gpu_memory_gib": 52})
    assert plan_memory(QWEN15B, MemoryOptions(**{**tight.__dict__, "vllm_gpu_memory_utilization": 0.1})).fits
    assert engine_share_that_fits(QWEN15B, tight) is None


def test_an_hf_plan_is_offered_what_it_was_before():
    from policies.memory_fit import fitting_change

    plan = plan_memory(PRESETS["qwen2.5-3b-instruct"], MemoryOptions(gpu_memory_gib=80))
    assert fitting_change(plan).startswith("--gradient-checkpointing (")


def settings_of(*argv: str, tmp_path: Path):
    from experiments.run import plan

    return plan([*argv, "--output", str(tmp_path / "run")]).settings


def test_the_kv_cache_is_planned_at_the_branches_decoded_at_once(tmp_path):
    from experiments.settings import memory_options

    gpu_run = ("--model", "smollm2-135m", "--num-gpus-per-learner", "1", "--prompts-per-iteration", "32")
    trees = memory_options(settings_of(*gpu_run, "--M", "2", "--N", "3", "--L", "1", tmp_path=tmp_path), 80.0)
    assert (trees.rollout_sequences, trees.rollout_context) == (32 * 2 * 3, 4096)  # an expansion round: M x N
    chains = memory_options(settings_of(*gpu_run, "--algo", "grpo", "--group-size", "5", "--max-context-tokens",
                                        "2048", tmp_path=tmp_path), 80.0)
    assert (chains.rollout_sequences, chains.rollout_context) == (32 * 5, 2048)  # the first chains: M
    no_expansion = memory_options(settings_of(*gpu_run, "--M", "3", "--N", "4", "--L", "0", tmp_path=tmp_path), 80.0)
    assert no_expansion.rollout_sequences == 32 * 3
    shared = settings_of("--model", "smollm2-135m", "--num-learners", "1", "--num-gpus-per-learner", "0.5",
                         "--num-env-runners", "2", "--num-gpus-per-env-runner", "0.5", "--prompts-per-iteration",
                         "32", tmp_path=tmp_path)  # one runner's engine beside the learner: its 16 prompts
    assert memory_options(shared, 80.0).rollout_sequences == 16 * 2 * 2


def test_the_hf_engines_kv_cache_is_its_rows_at_the_context_cap():
    def engine_gib(sequences: int) -> float:
        return plan_memory(QWEN15B, MemoryOptions(colocated=True, rollout_sequences=sequences)).parts["rollout_engine"]

    weights = 2 * QWEN15B.parameters
    assert engine_gib(128) == pytest.approx((weights + kv_bytes_per_token(QWEN15B) * 128 * 4096) / GIB)
    assert engine_gib(1000) == engine_gib(256)  # the engine decodes at most 256 rows; the rest wait


def test_the_plans_rollout_defaults_are_the_gpu_runs(monkeypatch):
    import algos.tree_grpo.settings as algorithm_settings
    from policies.generation import SamplingSettings
    from policies.hf_generation import EngineLimits
    from policies.memory_plan import HF_MAX_ROWS

    monkeypatch.setattr(algorithm_settings, "gpu_visible", lambda: True)
    gpu = algorithm_settings.TreeGRPOSettings()
    assert MemoryOptions().rollout_sequences == gpu.prompts_per_iteration * gpu.M * gpu.N
    assert MemoryOptions().rollout_context == SamplingSettings().max_context_tokens
    assert EngineLimits().max_rows == HF_MAX_ROWS


def test_plan_memory_spells_learner_sharding_as_run_py(capsys, tmp_path):
    out = tmp_path / "plan.json"
    plan_main(["--model", "qwen2.5-7b-instruct", "--learners", "8", "--learner-sharding", "fsdp",
               "--gradient-checkpointing", "--gpu-memory-gib", "80", "--json", str(out)])
    assert json.loads(out.read_text())["options"]["sharding"] == "fsdp"
    with pytest.raises(SystemExit) as exit_:
        plan_main(["--model", "qwen2.5-7b-instruct", "--learners", "8", "--sharding", "fsdp", "--gpu-memory-gib", "80"])
    assert exit_.value.code == 2
    message = capsys.readouterr().err
    assert "--sharding" in message and "--learner-sharding" in message and message.count("\n") == 1


class FakeLLM:
    """vLLM's ``LLM`` as far as the engine's sleep and wake go: the calls, in order, in ``calls``."""

    def __init__(self, calls: list[str]):
        self.calls = calls

    def sleep(self, level: int) -> None:
        self.calls.append(f"sleep {level}")

    def wake_up(self) -> None:
        self.calls.append("wake_up")


def engine_with(monkeypatch, *, gpu: bool) -> tuple[object, list[str]]:
    from policies.vllm_generation import VLLMEngine

    calls: list[str] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    engine = object.__new__(VLLMEngine)  # no vLLM here: only the calls around sleep and wake
    engine.llm = FakeLLM(calls)
    return engine, calls


def test_the_cached_memory_is_released_around_the_engines_sleep_and_wake(monkeypatch):
    engine, calls = engine_with(monkeypatch, gpu=True)
    engine.sleep()
    assert calls == ["sleep 2", "empty_cache"]  # what the engine let go goes back to the GPU
    calls.clear()
    engine.wake_up()
    assert calls == ["empty_cache", "wake_up"]  # the learner's cached blocks released before the engine maps its own


def test_the_cpu_engines_sleep_and_wake_touch_no_cuda(monkeypatch):
    engine, calls = engine_with(monkeypatch, gpu=False)
    engine.sleep()
    engine.wake_up()
    assert calls == ["sleep 2", "wake_up"]
