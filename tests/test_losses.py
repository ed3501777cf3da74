"""The policy loss pieces against values computed by hand."""

from __future__ import annotations

import math

import pytest
import torch

from algos.losses import clipped_policy_loss, k3_kl, masked_mean, sampler_mismatch, truncated_importance_weights


def test_masked_mean_ignores_masked_tokens():
    values = torch.tensor([[1.0, 2.0, 100.0], [3.0, 100.0, 100.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert masked_mean(values, mask).item() == pytest.approx(2.0)  # (1 + 2 + 3) / 3: token-mean
    assert masked_mean(values, torch.zeros_like(mask)).item() == 0.0


def test_k3_kl_by_hand():
    logp = torch.tensor([math.log(0.5), math.log(0.2), math.log(0.2)])
    ref = torch.tensor([math.log(0.5), math.log(0.4), math.log(0.1)])
    # d = ref - logp: 0, ln 2, -ln 2 -> e^d - d - 1: 0, 2 - ln2 - 1, 0.5 + ln2 - 1
    expected = torch.tensor([0.0, 1 - math.log(2), math.log(2) - 0.5])
    torch.testing.assert_close(k3_kl(logp, ref), expected, atol=1e-6, rtol=0)
    assert k3_kl(torch.tensor([0.0]), torch.tensor([30.0])).item() == 10.0  # clamped


@pytest.mark.parametrize("log_ratio", [94.0, -94.0, 1e4, -1e4])
def test_k3_kl_of_an_extreme_log_ratio_has_finite_loss_and_gradients(log_ratio):
    logp = torch.tensor([[-100.0, -1.0]], requires_grad=True)
    ref = torch.tensor([[-100.0 + log_ratio, -1.5]])
    loss = masked_mean(k3_kl(logp, ref), torch.ones(1, 2))
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()
    assert loss.item() == pytest.approx((10.0 + math.exp(-0.5) + 0.5 - 1.0) / 2, rel=1e-6)  # extreme token: at the cap
    assert logp.grad[0, 0] == 0.0 and logp.grad[0, 1] != 0.0  # the capped token gives no gradient, the other does


def loss_of(ratio: float, advantage: float, **kw) -> float:
    logp = torch.tensor([[math.log(ratio)]])
    loss, _ = clipped_policy_loss(logp, torch.zeros(1, 1), torch.tensor([[advantage]]), torch.ones(1, 1), **kw)
    return loss.item()


@pytest.mark.parametrize(
    ("ratio", "advantage", "expected"),
    [
        (1.0, 2.0, -2.0),  # on-policy: -A
        (1.5, 1.0, -1.2),  # A > 0, ratio above 1 + eps: clipped to 1.2
        (0.5, 1.0, -0.5),  # A > 0, ratio below 1 - eps: the unclipped (larger) loss wins
        (0.5, -1.0, 0.8),  # A < 0, ratio below 1 - eps: clipped to 0.8
        (2.0, -1.0, 2.0),  # A < 0, ratio 2 < c: max(2, 1.2) = 2
        (5.0, -1.0, 3.0),  # A < 0, ratio 5 > c = 3: dual clip caps the loss at -A c = 3
    ],
)
def test_clipped_policy_loss_by_hand(ratio, advantage, expected):
    assert loss_of(ratio, advantage) == pytest.approx(expected, rel=1e-6)


def test_dual_clip_can_be_switched_off():
    assert loss_of(5.0, -1.0, dual_clip=None) == pytest.approx(5.0, rel=1e-6)


def test_stats_and_masking():
    logp = torch.log(torch.tensor([[1.5, 1.0, 5.0], [1.0, 1.0, 1.0]]))
    adv = torch.tensor([[1.0], [-1.0]])  # one advantage per trajectory, broadcast over its tokens
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    loss, stats = clipped_policy_loss(logp, torch.zeros_like(logp), adv, mask)
    # tokens: (1.5, A=1) -> -1.2 ; (1.0, A=1) -> -1 ; (5.0, A=1) -> -1.2 ; (1.0, A=-1) -> 1
    assert loss.item() == pytest.approx((-1.2 - 1.0 - 1.2 + 1.0) / 4, rel=1e-6)
    assert stats.clip_fraction == pytest.approx(2 / 4) and stats.dual_clip_fraction == 0.0
    assert (stats.ratio_min, stats.ratio_max) == pytest.approx((1.0, 5.0))
    assert stats.ratio_mean == pytest.approx((1.5 + 1 + 5 + 1) / 4)


def test_gradient_of_the_on_policy_loss_is_minus_advantage():
    logp = torch.zeros(1, 2, requires_grad=True)
    loss, _ = clipped_policy_loss(logp, torch.zeros(1, 2), torch.tensor([[3.0]]), torch.ones(1, 2))
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.5, -1.5]]))  # d(-A r)/dlogp = -A r / n_tokens


def test_truncated_importance_weights_by_hand():
    old = torch.tensor([[0.0, -1.0, -2.0], [-1.0, -1.0, 0.0]])
    sampler = torch.tensor([[-1.0, -1.0, -1.0], [-1.0, -3.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    # token: exp(old - sampler) capped at 2 (masked tokens: exp(0) = 1)
    token = truncated_importance_weights(old, sampler, mask, cap=2.0)
    torch.testing.assert_close(token, torch.tensor([[2.0, 1.0, 1.0], [1.0, 2.0, 1.0]]))
    # sequence: exp of the row's sum over generated tokens: row 0 exp(1) = 2.718 -> 2.5; row 1 exp(2) -> 2.5
    sequence = truncated_importance_weights(old, sampler, mask, cap=2.5, level="sequence")
    torch.testing.assert_close(sequence, torch.full((2, 3), 2.5))
    low = truncated_importance_weights(old - 1.0, sampler, mask, cap=2.5, level="sequence")
    torch.testing.assert_close(low[0], torch.full((3,), math.exp(-1.0)))  # 1 - 2 = -1 over row 0's two tokens
    with pytest.raises(ValueError, match="token or sequence"):
        truncated_importance_weights(old, sampler, mask, cap=2.0, level="row")


def test_truncated_importance_weights_do_not_overflow():
    weights = truncated_importance_weights(torch.tensor([[500.0]]), torch.tensor([[-500.0]]), torch.ones(1, 1),
                                           cap=2.0, level="sequence")
    assert weights.item() == pytest.approx(2.0)


def test_sampler_mismatch_by_hand():
    learner = torch.log(torch.tensor([[1.0, 2.0, 1.05, 0.5], [1.0, 1.0, 1.0, 9.0]]))
    stats = sampler_mismatch(learner, torch.zeros(2, 4), torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0]]))
    ratios = torch.tensor([1.0, 2.0, 1.05, 0.5, 1.0], dtype=torch.float64)  # the masked 9.0 is left out
    assert stats.ratio_mean == pytest.approx(5.55 / 5)
    assert stats.ratio_p99 == pytest.approx(torch.quantile(ratios, 0.99).item())
    assert stats.outside == pytest.approx(2 / 5)  # 2.0 and 0.5
    assert sampler_mismatch(learner, learner, torch.zeros(2, 4)).ratio_mean == 1.0  # no generated token


def test_policy_loss_weights_scale_each_token():
    logprobs = torch.zeros(1, 2, requires_grad=True)
    loss, _ = clipped_policy_loss(logprobs, torch.zeros(1, 2), torch.tensor([[1.0]]), torch.ones(1, 2),
                                  weights=torch.tensor([[2.0, 0.5]]))
    assert loss.item() == pytest.approx(-(2.0 + 0.5) / 2)  # ratio 1: -A w per token, token-mean
    loss.backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-1.0, -0.25]]))
