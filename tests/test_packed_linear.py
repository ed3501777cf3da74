"""Linear layers through oneDNN with packed weights (policies/packed_linear.py) and the HF engine's use of them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from policies.packed_linear import _PACKED, packed_linear, packed_linears_for, packing_applies

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="oneDNN is not available")


def test_a_packed_linear_computes_the_layer_and_follows_its_weight_updates():
    torch.manual_seed(0)
    layer = nn.Linear(16, 8)
    x = torch.randn(2, 3, 16)  # any leading shape
    torch.testing.assert_close(packed_linear(layer, x), layer(x).detach(), atol=1e-5, rtol=1e-5)
    packed = _PACKED[layer][2]
    packed_linear(layer, x)
    assert _PACKED[layer][2] is packed  # packed once, reused
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.5)
    layer(x).sum().backward()
    optimizer.step()  # an in-place update: the next call packs the new weight
    torch.testing.assert_close(packed_linear(layer, x), layer(x).detach(), atol=1e-5, rtol=1e-5)
    assert _PACKED[layer][2] is not packed
    with torch.no_grad():
        layer.weight.copy_(torch.zeros_like(layer.weight))  # as load_state_dict does
    torch.testing.assert_close(packed_linear(layer, x), layer.bias.detach().expand(2, 3, 8), atol=0, rtol=0)
    no_bias = nn.Linear(16, 4, bias=False)
    torch.testing.assert_close(packed_linear(no_bias, x), no_bias(x).detach(), atol=1e-5, rtol=1e-5)


def test_a_model_runs_packed_inside_the_block_only_and_only_in_float32_on_the_cpu():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    x = torch.randn(4, 8)
    expected = model(x).detach()
    with packed_linears_for(model):
        assert all("forward" in vars(m) for m in model if isinstance(m, nn.Linear))
        torch.testing.assert_close(model(x), expected, atol=1e-5, rtol=1e-5)
        assert not torch.is_grad_enabled()
    assert not any("forward" in vars(m) for m in model)  # the class's forward again, gradients too
    assert model(x).requires_grad and model[0] in _PACKED
    bf16 = nn.Sequential(nn.Linear(8, 2)).to(torch.bfloat16)
    assert packing_applies(model) and not packing_applies(bf16)
    with packed_linears_for(bf16):
        assert "forward" not in vars(bf16[0])  # left as it is


def test_the_hf_engine_packs_by_default_on_the_cpu_and_gives_the_same_steps_either_way():
    from policies.generation import Branch, SamplingSettings
    from policies.hf_generation import HFStepGenerator
    from policies.models import load_model

    model, tokenizer = load_model("tiny-random", seed=0)
    model.eval()
    assert HFStepGenerator(model, tokenizer).packed_linears
    with pytest.raises(ValueError, match="packed_linears needs float32"):
        HFStepGenerator(model.to(torch.bfloat16), tokenizer, packed_linears=True)
    model.float()
    prompt = tuple(tokenizer("Who wrote Hamlet?")["input_ids"])
    steps = {}
    for packed in (True, False):
        generator = HFStepGenerator(model, tokenizer, SamplingSettings(max_step_tokens=12), packed_linears=packed)
        steps[packed] = generator.generate_step([Branch(prompt)] * 3, seed=0)
    for a, b in zip(steps[True], steps[False], strict=True):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)
