"""Keys and values of the HF engine: rows written in place in buffers allocated once, and node caches that hold
only their own step.

:class:`KVPool` keeps, per layer, a key and a value buffer ``[rows, kv_heads, capacity, head_dim]``, all views of
one tensor, so that a copy into or out of a row is one operation for every layer. A branch
being decoded owns one row and a length (its tokens so far); each forward pass writes the new tokens' keys and
values at their positions in place, and attention reads each row up to its own length, so no branch is padded to
another's length and nothing is concatenated per step. Buffers grow (by half again, at least) only when a
branch needs more rows or positions than any before it; :attr:`KVPool.peak_bytes` reports the most it held.

:class:`KVSegment` is the cache handle a step hands back to the tree: the keys and values of the tokens that step
fed (its observation prefix and its generated ids) and a link to the segment it continued, so a tree stores each
token's keys and values once however many branches share it. A branch forked from a node is loaded by copying
the chain of segments from the root into its row.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

GROWTH = 1.5  # a buffer that must grow takes at least this factor, so growth is rare
ALIGN = 64  # capacities are rounded up to this many positions


@dataclass(frozen=True, eq=False)
class KVSegment:
    """Cache handle of a context's first ``length`` tokens: this segment holds positions ``start`` to
    ``start + n`` (``kv`` [2 (keys, values), layers, kv_heads, n, head_dim]); ``parent`` holds those before
    ``start``."""

    kv: torch.Tensor
    start: int
    parent: KVSegment | None
    length: int

    def crop(self, length: int) -> KVSegment | None:
        """The handle of the first ``length`` tokens (shares the tensors; None for no tokens)."""
        if length <= 0:
            return None
        if length <= self.start:
            return self.parent.crop(length) if self.parent is not None else None
        return KVSegment(self.kv, self.start, self.parent, min(length, self.length))

    def pieces(self) -> Iterator[tuple[KVSegment, int]]:
        """(segment, tokens of it to use) from the root's segment to this one."""
        chain, segment, end = [], self, self.length
        while segment is not None:
            chain.append((segment, end - segment.start))
            end, segment = segment.start, segment.parent
        return reversed(chain)

    @property
    def own_bytes(self) -> int:
        """Bytes of this segment's own tensors (its ancestors not counted)."""
        return self.kv.numel() * self.kv.element_size()


class KVPool:
    """Per-layer key/value buffers with one row per branch being decoded (see the module docstring)."""

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device):
        self.num_layers, self.kv_heads, self.head_dim = num_layers, kv_heads, head_dim
        self.dtype, self.device = dtype, device
        self.buffer = torch.zeros(2, num_layers, 0, kv_heads, 0, head_dim, dtype=dtype, device=device)
        self.keys: list[torch.Tensor] = []  # per layer, a view of the buffer
        self.values: list[torch.Tensor] = []
        self.rows = self.capacity = 0
        self.allocations = 0  # how many times the buffers were (re)allocated
        self.segment_bytes = 0  # bytes of every segment handed out (an upper bound of those still alive)
        self.peak_bytes = 0  # buffers plus segments, at most

    @property
    def buffer_bytes(self) -> int:
        return 2 * self.num_layers * self.rows * self.kv_heads * self.capacity * self.head_dim * self.dtype.itemsize

    def ensure(self, rows: int, capacity: int, used_rows: int) -> None:
        """Room for ``rows`` rows of ``capacity`` positions; the first ``used_rows`` rows keep their contents."""
        if rows <= self.rows and capacity <= self.capacity:
            return
        new_rows = max(rows, self.rows if rows <= self.rows else int(self.rows * GROWTH) + 1)
        new_capacity = max(capacity, self.capacity if capacity <= self.capacity else int(self.capacity * GROWTH))
        new_capacity = -(-new_capacity // ALIGN) * ALIGN
        shape = (2, self.num_layers, new_rows, self.kv_heads, new_capacity, self.head_dim)
        # zeros, not empty: attention weighs masked positions by 0, and 0 * NaN garbage would still be NaN
        buffer = torch.zeros(shape, dtype=self.dtype, device=self.device)
        buffer[:, :, :used_rows, :, : self.capacity] = self.buffer[:, :, :used_rows]
        self.buffer = buffer
        # one select per layer (not unbind: autograd forbids writing in place into unbind's views)
        self.keys = [buffer[0, layer] for layer in range(self.num_layers)]
        self.values = [buffer[1, layer] for layer in range(self.num_layers)]
        self.rows, self.capacity = new_rows, new_capacity
        self.allocations += 1
        self._note_peak()

    def load(self, row: int, handle: KVSegment | None) -> int:
        """Copy the context of ``handle`` into ``row``; returns its length (0 without a handle)."""
        if handle is None:
            return 0
        for segment, count in handle.pieces():
            self.buffer[:, :, row, :, segment.start : segment.start + count] = segment.kv[:, :, :, :count]
        return handle.length

    def segment(self, row: int, start: int, end: int, parent: KVSegment | None) -> KVSegment:
        """A handle of ``row``'s first ``end`` tokens owning a copy of positions ``start`` to ``end``."""
        segment = KVSegment(self.buffer[:, :, row, :, start:end].clone(), start, parent, end)
        self.segment_bytes += segment.own_bytes
        self._note_peak()
        return segment

    def move(self, source: int, target: int, length: int) -> None:
        """Copy ``source``'s first ``length`` positions into row ``target`` (compaction after a row finishes)."""
        self.buffer[:, :, target, :, :length] = self.buffer[:, :, source, :, :length]

    def _note_peak(self) -> None:
        self.peak_bytes = max(self.peak_bytes, self.buffer_bytes + self.segment_bytes)
