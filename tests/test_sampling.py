"""Sampling on the device: hashed per-branch streams, the exponential race, top-p inside candidates with its
exact fallback (hand-built distributions)."""

from __future__ import annotations

import torch

from policies.sampling import (
    _MASK32,
    _mix32,
    nucleus_mask,
    race,
    sample_tokens,
    sample_tokens_exact,
    stream_uniforms,
)


def draw(logprobs: torch.Tensor, top_p: float, rows: int, candidates: int = 256):
    """``rows`` draws of one distribution, one stream per row."""
    logprobs = logprobs.expand(rows, -1)
    streams, positions = torch.arange(rows), torch.full((rows,), 7)
    return sample_tokens(logprobs, top_p, streams, positions, candidates)


def test_uniforms_are_in_the_open_interval_and_depend_on_every_input():
    ids = torch.arange(1000)[None]
    u = stream_uniforms(torch.tensor([3]), torch.tensor([5]), ids, 1000)
    assert u.dtype == torch.float64 and u.min() > 0 and u.max() < 1
    assert 0.45 < u.mean() < 0.55 and u.unique().numel() == 1000
    for streams, positions in (([4], [5]), ([3], [6]), ([3 + 2**40], [5])):
        other = stream_uniforms(torch.tensor(streams), torch.tensor(positions), ids, 1000)
        assert (other != u).float().mean() > 0.99
    # a pure function: the same inputs in another batch give the same numbers
    batch = stream_uniforms(torch.tensor([9, 3]), torch.tensor([1, 5]), ids.expand(2, -1), 1000)
    assert torch.equal(batch[1:], u)


def test_the_looked_up_token_round_equals_hashing_the_token_in_place():
    # the table of token_hashes only caches the first round over the token id: the numbers a seeded run draws
    streams, positions, ids = torch.tensor([5, 2**40 + 1]), torch.tensor([0, 77]), torch.tensor([[0, 9, 999]] * 2)
    key = _mix32(_mix32(_mix32(positions & _MASK32) ^ (streams & _MASK32)) ^ ((streams >> 32) & _MASK32))
    direct = (_mix32(_mix32((ids + 0x9E3779B9) & _MASK32) ^ key[:, None]).double() + 0.5) / 2.0**32
    assert torch.equal(stream_uniforms(streams, positions, ids, 1000), direct)


def test_race_draws_in_proportion():
    # probs 0.5, 0.3, 0.2: frequencies over 20000 streams within 4 standard deviations
    logprobs = torch.log(torch.tensor([[0.5, 0.3, 0.2]])).expand(20_000, -1)
    u = stream_uniforms(torch.arange(20_000), torch.zeros(20_000, dtype=torch.long),
                        torch.arange(3).expand(20_000, -1), 3)
    counts = torch.bincount(race(logprobs, u), minlength=3).double() / 20_000
    assert torch.allclose(counts, torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64), atol=4 * (0.25 / 20_000) ** 0.5)


def test_nucleus_mask_is_the_smallest_prefix_reaching_top_p():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    assert nucleus_mask(probs, 0.7).tolist() == [[True, True, False, False]]  # 0.5 < 0.7 <= 0.8
    assert nucleus_mask(probs, 0.8).tolist() == [[True, True, False, False]]  # reached exactly at 0.8
    assert nucleus_mask(probs, 0.81).tolist() == [[True, True, True, False]]
    assert nucleus_mask(probs, 0.1).tolist() == [[True, False, False, False]]  # the first token always stays


def test_top_p_keeps_the_nucleus():
    # probs 0.5, 0.3, 0.15, 0.05: top_p 0.7 keeps {0, 1}, never 2 or 3; 0 drawn 0.5 / 0.8 = 0.625 of the time
    tokens, short = draw(torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])), 0.7, 4000)
    counts = torch.bincount(tokens, minlength=4)
    assert not short.any() and counts[2] == counts[3] == 0 and 0.59 < counts[0] / 4000 < 0.66


def test_candidates_short_of_top_p_are_flagged_and_the_exact_path_agrees():
    # 1000 tokens: a peaked head of 10 (0.5 of the mass) and a long, slowly falling tail (no ties, which either
    # path may order differently); 256 candidates hold < 0.95
    tail = torch.arange(990, 0, -1, dtype=torch.float64)
    probs = torch.cat([torch.linspace(0.06, 0.04, 10, dtype=torch.float64), 0.5 * tail / tail.sum()]).float()
    logprobs = probs.log()[None]
    _, short = draw(logprobs, 0.95, 300)
    assert short.all()
    exact = sample_tokens_exact(logprobs.expand(300, -1), 0.95, torch.arange(300), torch.full((300,), 7))
    more, short_more = draw(logprobs, 0.95, 300, candidates=1000)
    assert not short_more.any() and torch.equal(more, exact)  # same numbers, same draws on both paths
    # with top_p 0.5 the 10-token head is the nucleus: every path draws only from it, with the same tokens
    head, head_short = draw(logprobs, 0.5, 300, candidates=256)
    head_exact = sample_tokens_exact(logprobs.expand(300, -1), 0.5, torch.arange(300), torch.full((300,), 7))
    assert not head_short.any() and head.max() < 10 and torch.equal(head, head_exact)


def test_top_p_one_samples_the_whole_distribution():
    tokens, short = draw(torch.log(torch.tensor([[0.6, 0.4]])), 1.0, 4000)
    assert not short.any() and 0.57 < (tokens == 0).float().mean() < 0.63

