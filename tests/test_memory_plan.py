"""The memory plan (policies/model_shape.py, policies/memory_plan.py, policies/memory_report.py,
experiments/plan_memory.py): shapes and parameter counts, the parts by hand, the sizes it promises (a 3B model
fits one 80 GB GPU, a 7B one does not without sharding), and the errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from experiments.plan_memory import main as plan_main
from policies.memory_fit import fitting_change
from policies.memory_plan import (
    GIB,
    MemoryOptions,
    layer_activation_bytes,
    plan_memory,
    startup_parts,
    sync_bytes,
)
from policies.memory_report import plan_line
from policies.model_shape import PRESETS, ModelShape, ModelShapeError, model_shape

ROOT = Path(__file__).resolve().parents[1]
SMALL = ModelShape(name="small", vocab=10, hidden=4, intermediate=6, layers=2, heads=2, kv_heads=1, head_dim=2,
                   tied_embeddings=False, qkv_bias=True)
QWEN3B = PRESETS["qwen2.5-3b-instruct"]


def test_parameter_count_by_hand():
    # embeddings 10*4, untied head 10*4; per layer: q 4*4, k 4*2, v 4*2, o 4*4, q/k/v biases 4+2+2, MLP 3*4*6, two
    # norms 2*4; the final norm 4
    per_layer = 16 + 8 + 8 + 16 + 8 + 72 + 8
    assert SMALL.layer_parameters == per_layer == 136
    assert SMALL.parameters == 40 + 40 + 2 * 136 + 4 == 356
    # LoRA rank 3 on q (4 -> 4), k, v (4 -> 2) and o (4 -> 4): r * (in + out) each, per layer
    assert SMALL.lora_parameters(3) == 2 * 3 * ((4 + 4) + 2 * (4 + 2) + (4 + 4))


def hf_parameters(shape: ModelShape) -> int:
    """The parameters of the transformers model of ``shape``, built on the meta device (no memory)."""
    qwen2 = shape.qkv_bias
    config_cls, model_cls = (Qwen2Config, Qwen2ForCausalLM) if qwen2 else (LlamaConfig, LlamaForCausalLM)
    config = config_cls(vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                        num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                        num_key_value_heads=shape.kv_heads, tie_word_embeddings=shape.tied_embeddings)
    with torch.device("meta"):
        model = model_cls(config)
    return sum(p.numel() for p in model.parameters())  # tied weights are one parameter


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_count_what_transformers_builds(name):
    assert PRESETS[name].parameters == hf_parameters(PRESETS[name])


def test_presets_hold_the_published_sizes():
    billions = {name: PRESETS[name].parameters / 1e9 for name in PRESETS}
    assert round(billions["qwen2.5-1.5b-instruct"], 2) == 1.54
    assert round(billions["qwen2.5-3b-instruct"], 2) == 3.09
    assert round(billions["qwen2.5-7b-instruct"], 2) == 7.62
    assert round(billions["llama-3.2-3b-instruct"], 2) == 3.21
    assert round(billions["smollm2-135m"] * 1000) == 135


def test_tiny_random_is_what_the_project_builds():
    from policies.models import load_model

    model, tokenizer = load_model("tiny-random")
    shape = model_shape("tiny-random")
    assert shape.vocab == len(tokenizer) == 49152
    assert shape.parameters == sum(p.numel() for p in model.parameters())


def test_vllm_default_share_is_the_project_default():
    from policies.vllm_generation import VLLMSettings
    plan = plan_memory(QWEN3B, MemoryOptions(generator="vllm", colocated=True, gpu_memory_gib=80))
    assert plan.parts["rollout_engine"] == pytest.approx(VLLMSettings().gpu_memory_utilization * 80)


CONFIG = {"model_type": "qwen2", "vocab_size": 10, "hidden_size": 4, "intermediate_size": 6, "num_hidden_layers": 2,
          "num_attention_heads": 2, "num_key_value_heads": 1, "tie_word_embeddings": False}


def test_shape_from_a_model_directory(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    shape = model_shape(str(tmp_path))
    assert shape.parameters == SMALL.parameters and shape.qkv_bias and not shape.o_bias


def test_shape_from_the_hub_cache_without_network(tmp_path):
    # the hub cache's layout: models--ORG--NAME/refs/main holds the commit, snapshots/COMMIT/ the files
    repo = tmp_path / "models--org--small"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("abc123")
    (repo / "snapshots" / "abc123").mkdir(parents=True)
    (repo / "snapshots" / "abc123" / "config.json").write_text(json.dumps(CONFIG))
    assert model_shape("org/small", hub_cache_dir=tmp_path).parameters == SMALL.parameters
    with pytest.raises(ModelShapeError, match="org/other"):
        model_shape("org/other", hub_cache_dir=tmp_path)


def test_a_missing_model_names_where_it_looked(tmp_path):
    with pytest.raises(ModelShapeError) as error:
        model_shape("org/not-cached", hub_cache_dir=tmp_path)
    message = str(error.value)
    assert "\n" not in message
    for expected in ("'org/not-cached'", "model directory", str(tmp_path), "qwen2.5-7b-instruct", "tiny-random"):
        assert expected in message
    with pytest.raises(ModelShapeError, match=r"without config\.json"):
        model_shape(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(ModelShapeError, match="no vocab_size, hidden_size"):
        model_shape(str(tmp_path))


def test_mixed_precision_parts_by_hand():
    p = QWEN3B.parameters
    plan = plan_memory(QWEN3B, MemoryOptions(gpu_memory_gib=80))
    # float32 master + autocast's bf16 copies; float32 gradients; two float32 AdamW moments; a bf16 reference
    assert plan.parts["weights"] == pytest.approx((4 + 2) * p / GIB)
    assert plan.parts["gradients"] == pytest.approx(4 * p / GIB)
    assert plan.parts["optimizer"] == pytest.approx(8 * p / GIB)
    assert plan.parts["reference"] == pytest.approx(2 * p / GIB)
    assert plan.parts["rollout_engine"] == 0 and plan.parts["overhead"] == 1.0
    assert plan.per_gpu_gib == pytest.approx(sum(plan.parts.values()))
    pure = plan_memory(QWEN3B, MemoryOptions(pure_bf16=True))
    assert [pure.parts[k] * GIB / p for k in ("weights", "gradients", "optimizer")] == pytest.approx([2, 2, 4])
    fp32 = plan_memory(QWEN3B, MemoryOptions(dtype="float32"))
    assert [fp32.parts[k] * GIB / p for k in ("weights", "gradients", "optimizer", "reference")] == pytest.approx(
        [4, 4, 8, 4])


def test_the_optimizer_step_can_peak():
    # a small micro-batch: foreach AdamW's temporary copy of the trained parameters outweighs the activations
    p = QWEN3B.parameters
    plan = plan_memory(QWEN3B, MemoryOptions(dtype="float32", micro_batch_tokens=16, gradient_checkpointing=True))
    assert plan.phase == "optimizer step" and plan.parts["activations"] == 0
    assert plan.parts["optimizer"] == pytest.approx((8 + 4) * p / GIB)
    assert plan.per_gpu_gib == pytest.approx((4 + 4 + 12 + 4) * p / GIB + 1)


def test_layer_activations_by_hand():
    # float32, flex_attention (no mask, grouped heads kept): per token, 3 norm tensors x 2 norms, q and the
    # attention output (hidden each), k and v (kv_dim each), 4 MLP tensors, log-sum-exp per head, 2 inverse RMS
    options = MemoryOptions(dtype="float32", learner_attention="flex_attention")
    floats = 6 * 4 + 2 * 4 + 2 * 2 + 4 * 6 + 2 + 2
    assert layer_activation_bytes(SMALL, options) == 4 * floats
    # sdpa with a tree mask: k and v repeated to every head, the mask kept as floats (sequence_tokens per token)
    sdpa = MemoryOptions(dtype="float32", micro_batch_tokens=100, sequence_tokens=50)
    assert layer_activation_bytes(SMALL, sdpa) == 4 * (floats + 2 * (4 - 2) + 50)
    # LoRA rank 3, float32: the frozen projections keep no inputs: each norm its input only, the q/k/v adapters
    # the first norm's output (shared), four rank-3 intermediates, the MLP gate, up and activation
    lora = MemoryOptions(dtype="float32", learner_attention="flex_attention", lora_rank=3)
    lora_floats = 2 * 4 + 4 + 4 * 3 + 2 * 4 + 2 * 2 + 3 * 6 + 2 + 2
    assert layer_activation_bytes(SMALL, lora) == 4 * lora_floats


def test_checkpointing_and_offload_shrink_the_plan():
    base = plan_memory(QWEN3B, MemoryOptions())
    checkpointed = plan_memory(QWEN3B, MemoryOptions(gradient_checkpointing=True))
    assert checkpointed.parts["activations"] < base.parts["activations"] / 3
    offloaded = plan_memory(QWEN3B, MemoryOptions(gradient_checkpointing=True, reference_offload=True))
    assert offloaded.phase == "update" and offloaded.parts["reference"] == 0
    assert offloaded.per_gpu_gib == pytest.approx(checkpointed.per_gpu_gib - 2 * QWEN3B.parameters / GIB)
    # the offloaded reference is on the GPU in the no-gradient passes, while no gradients exist
    assert offloaded.phases["no-grad passes"] == pytest.approx(checkpointed.phases["no-grad passes"])


def test_fsdp_divides_the_state_by_the_learners():
    ddp = plan_memory(QWEN3B, MemoryOptions(dtype="float32", learners=1))
    fsdp = plan_memory(QWEN3B, MemoryOptions(dtype="float32", learners=2, sharding="fsdp"))
    layer, root = QWEN3B.layer_parameters, QWEN3B.embedding_parameters
    for part in ("optimizer", "reference"):
        assert fsdp.parts[part] == pytest.approx(ddp.parts[part] / 2)
    # plus, in the backward, the root's and one layer's full-size gradients before their reduce-scatter (float32)
    assert fsdp.parts["gradients"] == pytest.approx(ddp.parts["gradients"] / 2 + 4 * (root + layer) / GIB)
    # plus the gathered parameters: two decoder layers and the root unit (embeddings, LM head) in the compute dtype
    assert fsdp.parts["weights"] == pytest.approx(ddp.parts["weights"] / 2 + 4 * (2 * layer + root) / GIB)
    # DDP over several learners: each holds everything, plus the reducer's copy of the gradients
    ddp2 = plan_memory(QWEN3B, MemoryOptions(dtype="float32", learners=2))
    assert ddp2.parts["gradients"] == pytest.approx(2 * ddp.parts["gradients"])


def test_fsdp_in_bf16_gathers_bf16_without_autocast_copies_and_keeps_an_offloaded_reference_on_the_host():
    layer, root, p = QWEN3B.layer_parameters, QWEN3B.embedding_parameters, QWEN3B.parameters
    ddp = plan_memory(QWEN3B, MemoryOptions(learners=1))
    fsdp = plan_memory(QWEN3B, MemoryOptions(learners=4, sharding="fsdp"))
    assert ddp.parts["weights"] == pytest.approx((4 + 2) * p / GIB)  # float32 masters + autocast's bf16 copies
    assert fsdp.parts["weights"] == pytest.approx((4 * p / 4 + 2 * (2 * layer + root)) / GIB)  # bf16 gathers
    # bf16 full-size gradients (root and a layer) and the layer's float32 cast for the float32 reduce-scatter
    assert fsdp.parts["gradients"] == pytest.approx((4 * p / 4 + 2 * (root + layer) + 4 * layer) / GIB)
    # FSDP's activations are bf16 weights' (no autocast): less than autocast's float32 residual stream
    assert fsdp.parts["activations"] < ddp.parts["activations"]
    resident = plan_memory(QWEN3B, MemoryOptions(learners=4, sharding="fsdp", gradient_checkpointing=True))
    offloaded = plan_memory(QWEN3B, MemoryOptions(learners=4, sharding="fsdp", gradient_checkpointing=True,
                                                  reference_offload=True))
    assert resident.phases["no-grad passes"] - offloaded.phases["no-grad passes"] == pytest.approx(2 * p / 4 / GIB)


def test_the_startup_holds_one_learner_whole_and_a_sharded_one_its_shards_and_one_unit():
    qwen7b = PRESETS["qwen2.5-7b-instruct"]
    p, root = qwen7b.parameters, qwen7b.embedding_parameters  # the root (untied embeddings, LM head): the largest
    one = startup_parts(qwen7b, MemoryOptions())
    assert sum(one.values()) / GIB == pytest.approx(42.6, abs=0.05)  # float32 policy + bf16 reference, whole
    assert one["gradients"] == one["optimizer"] == one["activations"] == 0
    assert sum(startup_parts(qwen7b, MemoryOptions(reference_offload=True)).values()) == 4 * p
    eight = startup_parts(qwen7b, MemoryOptions(learners=8, sharding="fsdp"))
    assert eight == {**one, "weights": 4 * p / 8 + 4 * root, "reference": 0.0}  # the root cut while whole
    plan = plan_memory(qwen7b, MemoryOptions(learners=8, sharding="fsdp", gpu_memory_gib=80))
    assert plan.phases["startup"] == pytest.approx((sum(eight.values()) + GIB) / GIB)  # plus the CUDA overhead
    # when the reference's shards outweigh the largest unit, they set the peak after the cutting
    two = startup_parts(QWEN3B, MemoryOptions(learners=2, sharding="fsdp", dtype="float32"))
    assert QWEN3B.parameters * 4 / 2 > 4 * QWEN3B.embedding_parameters
    assert two["weights"] == two["reference"] == 4 * QWEN3B.parameters / 2
    # on the CPU the host is the device: the whole module as built, and the first layer's shard as it is cut
    cpu = startup_parts(QWEN3B, MemoryOptions(learners=2, sharding="fsdp", dtype="float32"), host_is_device=True)
    assert sum(cpu.values()) == pytest.approx(4 * QWEN3B.parameters + 4 * QWEN3B.layer_parameters / 2)


def test_the_weight_sync_is_the_compute_dtype_weights():
    assert sync_bytes(QWEN3B, MemoryOptions()) == 2 * QWEN3B.parameters
    assert sync_bytes(QWEN3B, MemoryOptions(dtype="float32")) == 4 * QWEN3B.parameters


def test_lora_trains_adapters_only():
    p, adapters = QWEN3B.parameters, QWEN3B.lora_parameters(16)
    plan = plan_memory(QWEN3B, MemoryOptions(lora_rank=16))
    assert plan.parts["weights"] == pytest.approx((2 * p + 4 * adapters) / GIB)
    assert plan.parts["gradients"] == pytest.approx(4 * adapters / GIB)
    assert plan.parts["optimizer"] == pytest.approx(8 * adapters / GIB)
    assert plan.parts["reference"] == 0


def test_colocated_engines():
    hf = plan_memory(QWEN3B, MemoryOptions(colocated=True))
    kv_cache = 2 * QWEN3B.layers * QWEN3B.kv_dim * 2 * 128 * 4096  # 32 prompts x M = 2 x N = 2 branches
    assert hf.parts["rollout_engine"] == pytest.approx((2 * QWEN3B.parameters + kv_cache) / GIB)
    awake = plan_memory(QWEN3B, MemoryOptions(generator="vllm", colocated=True, gpu_memory_gib=80))
    asleep = plan_memory(QWEN3B, MemoryOptions(generator="vllm", colocated=True, vllm_sleep=True, gpu_memory_gib=80))
    assert asleep.phases["update"] == pytest.approx(awake.phases["update"] - 40)
    assert asleep.phases["rollout"] < asleep.phases["update"]


def run_cli(tmp_path: Path, *args: str) -> dict:
    out = tmp_path / "plan.json"
    plan_main([*args, "--json", str(out)])
    return json.loads(out.read_text())


def test_contract_3b_fits_one_80gb_gpu(tmp_path, capsys):
    plan = run_cli(tmp_path, "--model", "qwen2.5-3b-instruct", "--learners", "1", "--gradient-checkpointing",
                   "--reference-offload", "--gpu-memory-gib", "80")
    assert plan["fits"] is True and plan["per_gpu_gib"] <= 80
    assert set(plan["parts"]) >= {"weights", "gradients", "optimizer", "reference", "activations", "rollout_engine"}
    assert plan["per_gpu_gib"] == pytest.approx(sum(plan["parts"].values()), abs=0.01)
    table = capsys.readouterr().out
    assert "fits a 80 GiB GPU (72.0 GiB usable, the rest headroom): yes" in table and "activations" in table


def test_contract_7b_does_not_fit_one_gpu_without_sharding(tmp_path):
    plan = run_cli(tmp_path, "--model", "qwen2.5-7b-instruct", "--learners", "1", "--gpu-memory-gib", "80")
    assert plan["fits"] is False and plan["per_gpu_gib"] > 80


def test_contract_7b_fsdp_fits_eight_80gb_gpus_with_room_and_not_two(tmp_path, capsys):
    common = ["--model", "qwen2.5-7b-instruct", "--learner-sharding", "fsdp", "--gradient-checkpointing",
              "--gpu-memory-gib", "80"]
    eight = run_cli(tmp_path, *common, "--learners", "8")
    assert eight["fits"] is True and eight["per_gpu_gib"] <= 65
    capsys.readouterr()
    two = run_cli(tmp_path, *common, "--learners", "2")
    assert two["fits"] is False and two["per_gpu_gib"] > two["usable_gib"] == 72
    assert "it would fit with: --reference-offload" in capsys.readouterr().out  # what it needs, said


def test_a_plan_that_does_not_fit_says_which_change_would_fit():
    def plan(**options):
        return plan_memory(QWEN3B, MemoryOptions(gpu_memory_gib=80, **options))

    assert fitting_change(plan(gradient_checkpointing=True)) is None  # it fits: nothing to say
    change = fitting_change(plan())  # full fine-tuning of 3B in bf16: 125 GiB
    assert change.startswith("--gradient-checkpointing (") and plan(gradient_checkpointing=True).fits
    # where no memory option is enough, a layout: FSDP over more learners
    big = plan_memory(PRESETS["qwen2.5-7b-instruct"], MemoryOptions(gpu_memory_gib=80))
    assert fitting_change(big).startswith("--num-learners 2 --learner-sharding fsdp --gradient-checkpointing")
    assert fitting_change(plan_memory(QWEN3B, MemoryOptions(gpu_memory_gib=4))) is None  # nothing fits 4 GiB


def test_cli_errors_are_one_line(capsys):
    with pytest.raises(SystemExit) as exit_:
        plan_main(["--model", "qwen2.5-3b-instruct", "--lora-rank", "8", "--reference-offload",
                   "--gpu-memory-gib", "80"])
    assert exit_.value.code == 2
    message = capsys.readouterr().err
    assert message.count("\n") == 1 and "with LoRA the reference is the base model" in message
    with pytest.raises(SystemExit):
        plan_main(["--model", "./no/such/model", "--gpu-memory-gib", "80"])
    message = capsys.readouterr().err
    assert message.count("\n") == 1 and "no config for model './no/such/model'" in message


@pytest.mark.parametrize(("option", "value", "message"), [
    ("--gpu-memory-gib", "-5", "must be a finite number > 0"), ("--gpu-memory-gib", "nan", "must be a finite number"),
    ("--gpu-memory-gib", "0", "must be a finite number > 0"), ("--M", "0", "must be >= 1"), ("--M", "-1", ">= 1"),
    ("--N", "-3", "must be >= 0"), ("--L", "-1", "must be >= 0"), ("--prompts-per-iteration", "-32", ">= 1"),
    ("--micro-batch-tokens", "0", ">= 1"), ("--lora-rank", "0", ">= 1"), ("--kl-coef", "-1", ">= 0"),
    ("--learners", "0", ">= 1"), ("--vllm-gpu-memory-utilization", "1.5", "must be in (0, 1]"),
    ("--max-context-tokens", "0", ">= 1")])
def test_an_option_out_of_its_range_is_refused_naming_it(capsys, option, value, message):
    """Refused as run.py refuses the same value (a negative M with negative prompts planned, and 'fit', before)."""
    with pytest.raises(SystemExit) as exit_:
        plan_main(["--model", "qwen2.5-3b-instruct", "--gpu-memory-gib", "80", "--colocated", option, value])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and f"argument {option}: must be" in err and message in err


def test_a_json_path_or_a_config_that_cannot_be_used_is_one_error_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        plan_main(["--model", "qwen2.5-1.5b-instruct", "--gpu-memory-gib", "80", "--json",
                   str(tmp_path / "no" / "plan.json")])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and f"--json {tmp_path / 'no' / 'plan.json'}: " in err
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{'hidden_size': 8}")
    with pytest.raises(SystemExit):
        plan_main(["--model", str(model), "--gpu-memory-gib", "80"])
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{model / 'config.json'}: not valid JSON" in err


def test_plan_line_is_one_line():
    fits = plan_memory(QWEN3B, MemoryOptions(gradient_checkpointing=True, reference_offload=True, gpu_memory_gib=80))
    line = plan_line(fits)
    assert "\n" not in line and "fits" in line and "qwen2.5-3b-instruct" in line and "reference offloaded" in line
    too_big = plan_memory(PRESETS["qwen2.5-7b-instruct"], MemoryOptions(gpu_memory_gib=80))
    assert "DOES NOT FIT" in plan_line(too_big)


@pytest.mark.parametrize("entry", [["experiments/plan_memory.py"], ["-m", "experiments.plan_memory"]])
def test_runs_as_a_script_and_as_a_module(entry, tmp_path):
    out = tmp_path / "plan.json"
    done = subprocess.run([sys.executable, *entry, "--model", "qwen2.5-1.5b-instruct", "--gpu-memory-gib", "80",
                           "--json", str(out)], cwd=ROOT, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert json.loads(out.read_text())["fits"] is True


def test_a_paper_models_hub_id_is_planned_before_its_first_download(tmp_path):
    shape = model_shape("Qwen/Qwen2.5-1.5B-Instruct", hub_cache_dir=tmp_path)  # an empty cache: nothing downloaded
    assert shape.name == "Qwen/Qwen2.5-1.5B-Instruct"
    assert shape.parameters == PRESETS["qwen2.5-1.5b-instruct"].parameters
    assert model_shape("meta-llama/Llama-3.2-3B-Instruct", hub_cache_dir=tmp_path).layers == 28
