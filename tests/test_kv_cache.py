"""The KV pool and segments: in-place rows that keep their contents when buffers grow, segments that hold only
their own step and load back as the whole context."""

from __future__ import annotations

import torch

from policies.kv_cache import KVPool, KVSegment

KEYS, VALUES = 0, 1


def pool() -> KVPool:
    return KVPool(num_layers=2, kv_heads=2, head_dim=2, dtype=torch.float32, device=torch.device("cpu"))


def content(kind: int, layer: int, start: int, end: int, value: float) -> torch.Tensor:
    """What :func:`fill` writes at positions ``start`` to ``end`` of one buffer, [kv_heads, end - start, head_dim]:
    distinct for keys and values, per layer, head, position and dim, so a copy from the wrong one shows."""
    heads, dims = torch.arange(2.0)[:, None, None], torch.arange(2.0)
    positions = torch.arange(start, end)[None, :, None]
    return value + 10000.0 * kind + 1000.0 * layer + 100.0 * heads + positions + 0.5 * dims


def fill(p: KVPool, row: int, start: int, end: int, value: float) -> None:
    for kind, buffers in ((KEYS, p.keys), (VALUES, p.values)):
        for layer, buffer in enumerate(buffers):
            buffer[row, :, start:end] = content(kind, layer, start, end, value)


def assert_row_holds(p: KVPool, row: int, start: int, end: int, value: float) -> None:
    """Every layer's keys and values of ``row`` at ``start`` to ``end`` are what :func:`fill` wrote with ``value``."""
    for kind, buffers in ((KEYS, p.keys), (VALUES, p.values)):
        for layer, buffer in enumerate(buffers):
            assert torch.equal(buffer[row, :, start:end], content(kind, layer, start, end, value)), \
                f"row {row}: {('keys', 'values')[kind]} of layer {layer} at {start}-{end}"


def test_growth_keeps_used_rows_and_allocates_rarely():
    p = pool()
    p.ensure(rows=2, capacity=10, used_rows=0)
    assert (p.rows, p.capacity, p.allocations) == (2, 64, 1)  # capacity rounded up to 64
    fill(p, 1, 0, 10, 100.0)
    p.ensure(rows=2, capacity=50, used_rows=2)
    assert p.allocations == 1  # fits: no new buffers
    p.ensure(rows=3, capacity=70, used_rows=2)
    assert p.rows == 4 and p.capacity == 128 and p.allocations == 2  # grown by half again at least
    assert_row_holds(p, 1, 0, 10, 100.0)
    assert p.keys[0][1, :, 10:].abs().sum() == 0 and p.values[1][1, :, 10:].abs().sum() == 0
    assert p.peak_bytes == p.buffer_bytes == 2 * 2 * 4 * 2 * 128 * 2 * 4


def test_segments_hold_their_own_step_and_load_the_whole_context():
    p = pool()
    p.ensure(rows=2, capacity=20, used_rows=0)
    fill(p, 0, 0, 5, 0.0)  # prompt: positions 0-4
    root = p.segment(0, 0, 5, None)
    fill(p, 0, 5, 9, 50.0)  # a step: positions 5-8
    child = p.segment(0, 5, 9, root)
    assert child.kv[KEYS, 0].shape == (2, 4, 2) and child.length == 9  # only its own 4 tokens
    for layer, (k, v) in enumerate(zip(child.kv[KEYS], child.kv[VALUES], strict=True)):
        assert torch.equal(k, content(KEYS, layer, 5, 9, 50.0)) and torch.equal(v, content(VALUES, layer, 5, 9, 50.0))
    assert [(s.start, n) for s, n in child.pieces()] == [(0, 5), (5, 4)]
    assert p.load(1, child) == 9
    assert_row_holds(p, 1, 0, 5, 0.0)  # the root's segment, in every layer's keys and values
    assert_row_holds(p, 1, 5, 9, 50.0)  # the child's own
    assert all(buffer[1, :, 9:].abs().sum() == 0 for buffer in p.keys + p.values)  # nothing past the context
    cropped = child.crop(7)
    assert cropped.length == 7 and [(s.start, n) for s, n in cropped.pieces()] == [(0, 5), (5, 2)]
    assert child.crop(3).length == 3 and child.crop(3).parent is None and child.crop(0) is None
    assert isinstance(root.crop(10), KVSegment) and root.crop(10).length == 5


def test_move_copies_a_row():
    p = pool()
    p.ensure(rows=3, capacity=8, used_rows=0)
    fill(p, 2, 0, 6, 7.0)
    p.move(2, 0, 6)
    assert_row_holds(p, 0, 0, 6, 7.0)
    assert_row_holds(p, 2, 0, 6, 7.0)
