"""The frozen bottom (LoRA on the top layers only) run once per micro-batch: the same log-probs and gradients, and
the bottom's layers skipped in every later pass; in the learner, the same update."""

from __future__ import annotations

import pytest
import torch
from ray.rllib.core import DEFAULT_MODULE_ID
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from algos.tree_grpo import metrics as metric_keys
from policies.frozen_bottom import FrozenBottom, frozen_bottom_depth
from policies.logprobs import GENERATED_MASK, LOGPROBS, sequence_logprobs
from policies.models import LoraSettings, apply_lora
from tests.test_learner import build_learner, synthetic_arrays, update, weights

pytest.importorskip("peft")

SHAPE = {"vocab_size": 97, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 2}


def model_of(family: str, adapted_layers: int | None) -> torch.nn.Module:
    torch.manual_seed(0)
    config_class, model_class = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "llama": (LlamaConfig, LlamaForCausalLM)}[
        family]
    model = model_class(config_class(**SHAPE, attn_implementation="sdpa"))
    model = apply_lora(model, LoraSettings(rank=4, alpha=8, layers=adapted_layers))
    for name, param in model.named_parameters():  # LoRA's B starts at 0: give the adapters a gradient to differ by
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.1)
    return model


def batch() -> dict[str, torch.Tensor]:
    """Three rows, two sharing a prefix; the rows' last tokens are generated."""
    ids = torch.tensor([[5, 6, 7, 8, 9, 10], [5, 6, 7, 8, 11, 12], [13, 14, 15, 16, 0, 0]])
    mask = torch.tensor([[1] * 6, [1] * 6, [1, 1, 1, 1, 0, 0]])
    generated = torch.zeros_like(mask, dtype=torch.bool)
    generated[:2, 4:], generated[2, 2:4] = True, True
    return {"input_ids": ids, "attention_mask": mask, GENERATED_MASK: generated}


def test_the_depth_is_the_layers_below_the_lowest_adapter():
    assert frozen_bottom_depth(model_of("llama", 1).get_base_model()) == 3
    assert frozen_bottom_depth(model_of("llama", 3).get_base_model()) == 1
    assert frozen_bottom_depth(model_of("llama", None).get_base_model()) == 0  # adapters on every layer
    full = LlamaForCausalLM(LlamaConfig(**SHAPE))
    assert frozen_bottom_depth(full) == 0  # full fine-tuning
    for param in full.model.layers[0].parameters():
        param.requires_grad_(False)
    assert frozen_bottom_depth(full) == 0  # the embeddings train
    full.get_input_embeddings().weight.requires_grad_(False)
    assert frozen_bottom_depth(full) == 1
    with pytest.raises(ValueError, match="no frozen bottom"):
        FrozenBottom(model_of("llama", None).get_base_model())
    dropping = model_of("llama", 1).get_base_model()
    dropping.config.attention_dropout = 0.1  # each pass draws its own dropout: no output to replay
    assert frozen_bottom_depth(dropping) == 0


@pytest.mark.parametrize("family", ["qwen2", "llama"])
@pytest.mark.parametrize("share_prefixes", [False, True])
def test_replayed_passes_give_the_same_logprobs_and_gradients_without_running_the_bottom(family, share_prefixes):
    model = model_of(family, 1)
    base = model.get_base_model()
    trainable = [p for p in model.parameters() if p.requires_grad]

    def logprobs_and_grads(bottom: FrozenBottom | None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        for param in trainable:
            param.grad = None
        with bottom.over("rows") if bottom else torch.enable_grad():
            out = sequence_logprobs(model, batch(), share_prefixes=share_prefixes)[LOGPROBS]
        out.sum().backward()
        return out.detach(), [p.grad.clone() for p in trainable]

    plain, plain_grads = logprobs_and_grads(None)
    bottom = FrozenBottom(base)
    calls = []
    hooks = [layer.mlp.register_forward_hook(lambda *_, i=i: calls.append(i))
             for i, layer in enumerate(base.model.layers)]
    with torch.no_grad(), bottom.over("rows"):  # the first pass (e.g. the reference's) records
        recorded = sequence_logprobs(model, batch(), share_prefixes=share_prefixes)[LOGPROBS]
    assert calls == [0, 1, 2, 3] and len(bottom) == 1
    calls.clear()
    replayed, replayed_grads = logprobs_and_grads(bottom)
    assert calls == [3]  # only the adapted top layer ran
    for hook in hooks:
        hook.remove()
    assert torch.equal(recorded, plain) and torch.equal(replayed, plain)
    assert all(torch.equal(a, b) for a, b in zip(replayed_grads, plain_grads, strict=True))
    assert all(g.abs().sum() > 0 for g in plain_grads)
    calls.clear()
    assert torch.equal(sequence_logprobs(model, batch(), share_prefixes=share_prefixes)[LOGPROBS].detach(), plain)
    bottom.clear()
    assert len(bottom) == 0


def test_a_key_replayed_over_other_rows_is_refused():
    model = model_of("qwen2", 1)
    bottom = FrozenBottom(model.get_base_model())
    with torch.no_grad(), bottom.over((0, 3)):
        sequence_logprobs(model, batch())
    other = {k: v[:2] for k, v in batch().items()}
    refused = pytest.raises(ValueError, match=r"micro-batch \(0, 3\).*a key must name the same rows")
    with torch.no_grad(), refused, bottom.over((0, 3)):
        sequence_logprobs(model, other)
    assert torch.equal(sequence_logprobs(model, other)[LOGPROBS], sequence_logprobs(model, other)[LOGPROBS])


def test_the_learner_update_is_the_same_with_the_bottom_run_once_per_micro_batch():
    """Old and reference log-probs, then two epochs of two mini-batches, in two updates: the same weights and loss,
    and the bottom layer run once per micro-batch instead of once per pass (4 passes over each)."""
    results = {}
    for replay in (False, True):
        torch.manual_seed(0)  # peft draws LoRA's A from the global generator
        learner = build_learner(model_config={"lora": {"rank": 4, "alpha": 8, "layers": 1}},
                                frozen_bottom_replay=replay, kl_coef=0.1, ppo_epochs=2, ppo_mini_batches=2,
                                micro_batch_size=2, old_logprobs="recompute")
        model = learner.module[DEFAULT_MODULE_ID].model
        for name, param in model.named_parameters():  # LoRA's B starts at 0: the KL term would start at 0 too
            if "lora_B" in name:
                torch.nn.init.normal_(param, std=0.1)
        initial = weights(learner)
        runs: list[int] = []  # the bottom layer's MLP (a replayed layer is called, but skips its forward)
        model.get_base_model().model.layers[0].mlp.register_forward_hook(lambda *_, runs=runs: runs.append(1))
        metrics = update(learner, synthetic_arrays())
        update(learner, synthetic_arrays(seed=1))  # other rows under the same micro-batch keys
        results[replay] = (metrics, initial, weights(learner), len(runs))
    (plain_metrics, plain_initial, plain_final, plain_runs), (metrics, initial, final, runs) = results.values()
    assert runs >= 2 and plain_runs == 4 * runs
    assert all(torch.equal(initial[name], plain_initial[name]) for name in final)
    assert metrics["total_loss"] == plain_metrics["total_loss"] and metrics[metric_keys.KL] > 0
    assert all(torch.equal(final[name], plain_final[name]) for name in final)
    assert any(not torch.equal(final[name], initial[name]) for name in final)  # the update moved the adapters


def sft_rows() -> list[tuple[list[int], list[int]]]:
    """Five trajectories of different lengths (token ids, 1 on the generated tokens)."""
    generator = torch.Generator().manual_seed(1)
    rows = []
    for length in (7, 12, 5, 9, 12):
        ids = torch.randint(1, SHAPE["vocab_size"], (length,), generator=generator).tolist()
        rows.append((ids, [0] * 3 + [1] * (length - 3)))
    return rows


def trained(batch_size: int, replay: bool, epochs: int = 3) -> tuple[list[float], list[torch.Tensor], list[int]]:
    """The SFT loss curve and trained weights of a LoRA model (adapters on its top layer), and which layers' forward
    ran (the bottom layer 0's calls counted)."""
    from experiments.sft import train

    model = model_of("llama", 1)
    calls = []
    model.get_base_model().model.layers[0].mlp.register_forward_hook(lambda *_: calls.append(0))
    curve = train(model, sft_rows(), epochs=epochs, lr=1e-2, batch_size=batch_size, seed=0, pad_id=0,
                  replay_bottom=replay, log=lambda _: None)
    return curve["loss"], [p.detach().clone() for p in model.parameters() if p.requires_grad], calls


def test_sft_epochs_replay_each_rows_bottom_in_any_batch_and_train_the_same():
    """Rows one a batch: the replay is the recomputation to the bit, and the bottom runs in the first epoch only.
    Rows shuffled into new batches each epoch (padded to other widths): the same training to float tolerance."""
    losses, weights, calls = trained(batch_size=1, replay=True)
    plain_losses, plain_weights, plain_calls = trained(batch_size=1, replay=False)
    assert losses == plain_losses and all(torch.equal(a, b) for a, b in zip(weights, plain_weights, strict=True))
    assert (len(calls), len(plain_calls)) == (5, 15)
    losses, weights, calls = trained(batch_size=2, replay=True)
    plain_losses, plain_weights, plain_calls = trained(batch_size=2, replay=False)
    assert losses == pytest.approx(plain_losses, rel=1e-5)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(weights, plain_weights, strict=True))
    assert (len(calls), len(plain_calls)) == (3, 9)  # 3 batches an epoch
    assert losses[-1] < losses[0]  # it learns


def test_sft_replay_keeps_rows_up_to_its_budget_and_recomputes_the_others():
    from experiments.sft import BottomReplay, pad

    model = model_of("llama", 1)
    replay = BottomReplay.of(model, epochs=2)
    row_bytes = 7 * SHAPE["hidden_size"] * 4  # the first row's bottom output in float32
    replay.budget = row_bytes
    rows = sft_rows()
    for indices in ([0, 1], [0], [1]):
        ids, attention, _ = pad([(rows[i][0], rows[i][1]) for i in indices], 0)
        with replay.over(indices, attention):
            model(input_ids=ids, attention_mask=attention)
    assert list(replay.rows) == [0] and replay.held == row_bytes
    assert replay.rows[0].shape == (7, SHAPE["hidden_size"])
    assert BottomReplay.of(model, epochs=1) is None and BottomReplay.of(model_of("llama", None), epochs=2) is None


def test_by_default_a_lora_sft_resumed_after_an_epoch_ends_as_the_uninterrupted_one_to_the_bit(tmp_path):
    """The replay is opt-in: a cached recipe's build, killed and resumed, is the uninterrupted build to the bit."""
    from experiments.sft import train

    settings = {"epochs": 2, "lr": 1e-2, "batch_size": 2, "seed": 0, "pad_id": 0, "log": lambda _: None}
    whole = model_of("llama", 1)
    curve = train(whole, sft_rows(), **settings)
    checkpoint = tmp_path / "checkpoint.pt"
    assert len(train(model_of("llama", 1), sft_rows(), **settings, max_minutes=0, checkpoint=checkpoint)["loss"]) == 1
    resumed = model_of("llama", 1)
    assert train(resumed, sft_rows(), **settings, checkpoint=checkpoint) == curve
    assert all(torch.equal(a, b) for a, b in zip(whole.parameters(), resumed.parameters(), strict=True))
