"""experiments/export.py: a run's policy as a Hugging Face model directory (LoRA merged) that from_pretrained and
evaluate.py load, with the policy's exact outputs; clear errors for a missing checkpoint and an occupied OUT."""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from experiments import evaluate
from experiments.checkpoints import CheckpointError, resolve_checkpoint
from experiments.export import ExportError, check_output, main, merged
from experiments.run import main as train
from policies.models import load_model
from tests.test_resume import FAST

PROMPT = [{"role": "user", "content": "Who directed the film? Search first."}]


@pytest.fixture(scope="module", params=[[], ["--lora-rank", "4"]], ids=["full", "lora"])
def run(request, ray_session, data_dir, tmp_path_factory) -> Path:
    output = tmp_path_factory.mktemp("run") / "run"
    train([*FAST, "--iterations", "1", "--no-mlflow", "--output", str(output), *request.param])
    return output


def logits(model, tokenizer) -> torch.Tensor:
    ids = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        return model.eval()(**ids).logits


def test_export_loads_with_from_pretrained_and_gives_the_policys_logits(run, tmp_path, capsys):
    out = main([str(run), str(tmp_path / "model")])
    assert str(out) in capsys.readouterr().out
    assert (out / "model.safetensors").is_file() and not list(out.glob("*.pkl")) and not list(out.glob("adapter*"))
    modes = {path.name: oct(stat.S_IMODE(path.stat().st_mode)) for path in out.iterdir()}
    assert len(set(modes.values())) == 1, modes  # the weights readable like the other files (not 0600)
    model, tokenizer = AutoModelForCausalLM.from_pretrained(out), AutoTokenizer.from_pretrained(out)
    assert type(model).__name__ == "LlamaForCausalLM"  # a plain model: LoRA merged, no peft needed

    policy, policy_tokenizer = evaluate.load_policy(str(resolve_checkpoint(run)))
    assert tokenizer.chat_template == policy_tokenizer.chat_template
    exported = logits(model, tokenizer)
    torch.testing.assert_close(exported, logits(policy, policy_tokenizer), rtol=0, atol=1e-5)
    untrained, _ = load_model("tiny-random")
    assert not torch.allclose(exported, logits(untrained, tokenizer), atol=1e-5)  # the trained weights came out


def test_evaluate_takes_the_exported_directory(run, tmp_path):
    out = main([str(run / "checkpoints" / "latest"), str(tmp_path / "model")])
    evaluate.main(["--model", str(out), "--envs", "HotpotQA-v0", "--limit", "2", "--max-step-tokens", "8",
                   "--output", str(tmp_path / "eval"), "--quiet"])
    assert json.loads((tmp_path / "eval" / "eval.json").read_text())["datasets"]["HotpotQA-v0"]["questions"] == 2


def test_an_occupied_output_is_refused_unless_overwrite(run, tmp_path, capsys):
    out = tmp_path / "model"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit) as exit_:
        main([str(run), str(out)])
    assert exit_.value.code == 2 and "is not empty" in capsys.readouterr().err and (out / "notes.txt").exists()
    with pytest.raises(SystemExit):
        main([str(run), str(run), "--overwrite"])  # even --overwrite never deletes the run it exports
    assert "holds the checkpoint" in capsys.readouterr().err
    main([str(run), str(out), "--overwrite"])
    assert (out / "model.safetensors").is_file() and not (out / "notes.txt").exists()


def test_a_missing_checkpoint_gives_the_checkpoint_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([str(tmp_path / "no-run"), str(tmp_path / "model")])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and f"{tmp_path / 'no-run'} does not exist" in err and "checkpoints/" in err
    assert not (tmp_path / "model").exists()


def test_a_truncated_checkpoint_file_is_named(run, tmp_path):
    checkpoint = shutil.copytree(resolve_checkpoint(run), tmp_path / "iter_000001")
    state = checkpoint / "learner_group" / "learner" / "rl_module" / "default_policy" / "module_state.pkl"
    state.write_bytes(state.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=f"{state.relative_to(checkpoint)} is missing or truncated"):
        evaluate.load_policy(str(checkpoint))
    (checkpoint / "manifest.json").unlink()  # an RLlib checkpoint without manifest: the unpickling error is named
    with pytest.raises(CheckpointError, match=f"cannot restore checkpoint {checkpoint}"):
        evaluate.load_policy(str(checkpoint))


def test_a_checkpoint_given_by_a_relative_path_loads(run, monkeypatch):
    # RLlib reads a checkpoint by URI; a relative path has no scheme (pyarrow: "URI has empty scheme")
    monkeypatch.chdir(run)
    policy, _ = evaluate.load_policy(os.path.join("checkpoints", "latest"))
    absolute, _ = evaluate.load_policy(str(run / "checkpoints" / "latest"))
    for (name, a), (_, b) in zip(policy.state_dict().items(), absolute.state_dict().items(), strict=True):
        torch.testing.assert_close(a, b, msg=name)


def exported_weights(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(directory / "model.safetensors")


def test_a_bf16_run_at_the_papers_lr_exports_float32_masters_that_moved(ray_session, data_dir, tmp_path):
    """The contract: bf16 compute over float32 masters, lr 1e-6 against 1e-12 (same seed): most weights differ in
    the export (with bf16 weights, 0.03% of them did)."""
    exports = {}
    for lr in ("1e-6", "1e-12"):
        output = tmp_path / f"run-{lr}"
        options = [*FAST, "--dtype", "bfloat16", "--lr", lr, "--warmup-steps", "0", "--iterations", "1"]
        train([*options, "--no-mlflow", "--output", str(output)])
        exports[lr] = exported_weights(main([str(output), str(tmp_path / f"model-{lr}")]))
    moved, still = exports["1e-6"], exports["1e-12"]
    assert {tensor.dtype for tensor in moved.values()} == {torch.float32}
    changed = sum(int((moved[name] != still[name]).sum()) for name in moved)
    assert changed / sum(tensor.numel() for tensor in moved.values()) > 0.5
    half = exported_weights(main([str(tmp_path / "run-1e-6"), str(tmp_path / "model-bf16"), "--dtype", "bfloat16"]))
    assert {tensor.dtype for tensor in half.values()} == {torch.bfloat16}
    name = next(iter(half))
    assert torch.equal(half[name], moved[name].to(torch.bfloat16))


@pytest.mark.parametrize("inside", ["model", "checkpoints/model", "checkpoints/iter_000002/model", "checkpoints"])
def test_an_output_inside_the_run_is_refused(tmp_path, inside):
    """A save's pruning deletes an old checkpoint with whatever is in it, and a replaced run goes whole."""
    run = tmp_path / "run"
    with pytest.raises(ExportError, match=r"inside the run|holds the checkpoint"):
        check_output(run / inside, run / "checkpoints" / "iter_000002", overwrite=False)
    check_output(tmp_path / "model", run / "checkpoints" / "iter_000002", overwrite=False)  # beside it: fine


def test_lora_adapters_merge_in_float32_over_a_bf16_base():
    """A LoRA base is held in the compute dtype (bf16 on a GPU); an adapter's delta far below bf16's step at the
    weights' scale must survive into the float32 export, as the unmerged policy applies it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from policies.models import LoraSettings, apply_lora

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2)
    base = LlamaForCausalLM(config).to(torch.bfloat16)
    policy = apply_lora(base, LoraSettings(rank=2, alpha=2, target_modules=("q_proj",)))
    layer = policy.base_model.model.model.layers[0].self_attn.q_proj
    layer.lora_A["default"].weight.data = torch.full((2, 16), 1e-2)
    layer.lora_B["default"].weight.data = torch.full((16, 2), 1e-2)  # delta 2e-4 per weight, below bf16's step
    expected = layer.base_layer.weight.float() + 2e-4
    plain = merged(policy)
    weight = plain.model.layers[0].self_attn.q_proj.weight
    assert weight.dtype == torch.float32 and not hasattr(plain, "merge_and_unload")
    torch.testing.assert_close(weight, expected, rtol=0, atol=1e-6)
