"""The KV pool and segments: in-place rows that keep their contents when buffers grow, segments that hold only
their own step and load back as the whole context."""

from __future__ import annotations

import torch

from policies.kv_cache import KVPool, KVSegment


def pool() -> KVPool:
    return KVPool(num_layers=2, kv_heads=1, head_dim=2, dtype=torch.float32, device=torch.device("cpu"))


def fill(p: KVPool, row: int, start: int, end: int, value: float) -> None:
    for buffer in p.keys + p.values:
        buffer[row, :, start:end] = value + torch.arange(start, end, dtype=torch.float32)[:, None]


def test_growth_keeps_used_rows_and_allocates_rarely():
    p = pool()
    p.ensure(rows=2, capacity=10, used_rows=0)
    assert (p.rows, p.capacity, p.allocations) == (2, 64, 1)  # capacity rounded up to 64
    fill(p, 1, 0, 10, 100.0)
    p.ensure(rows=2, capacity=50, used_rows=2)
    assert p.allocations == 1  # fits: no new buffers
    p.ensure(rows=3, capacity=70, used_rows=2)
    assert p.rows == 4 and p.capacity == 128 and p.allocations == 2  # grown by half again at least
    assert torch.equal(p.keys[1][1, 0, :10, 0], 100.0 + torch.arange(10.0))
    assert p.peak_bytes == p.buffer_bytes == 2 * 2 * 4 * 1 * 128 * 2 * 4


def test_segments_hold_their_own_step_and_load_the_whole_context():
    p = pool()
    p.ensure(rows=2, capacity=20, used_rows=0)
    fill(p, 0, 0, 5, 0.0)  # prompt: positions 0-4
    root = p.segment(0, 0, 5, None)
    fill(p, 0, 5, 9, 50.0)  # a step: positions 5-8
    child = p.segment(0, 5, 9, root)
    assert child.layers[0][0].shape == (1, 4, 2) and child.length == 9  # only its own 4 tokens
    assert [(s.start, n) for s, n in child.pieces()] == [(0, 5), (5, 4)]
    p.load(1, child)
    assert torch.equal(p.keys[0][1, :, :9], p.keys[0][0, :, :9])
    cropped = child.crop(7)
    assert cropped.length == 7 and [(s.start, n) for s, n in cropped.pieces()] == [(0, 5), (5, 2)]
    assert child.crop(3).length == 3 and child.crop(3).parent is None and child.crop(0) is None
    assert isinstance(root.crop(10), KVSegment) and root.crop(10).length == 5


def test_move_copies_a_row():
    p = pool()
    p.ensure(rows=3, capacity=8, used_rows=0)
    fill(p, 2, 0, 6, 7.0)
    p.move(2, 0, 6)
    assert torch.equal(p.values[1][0, :, :6], p.values[1][2, :, :6])
