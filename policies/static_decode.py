"""Decode passes in static shapes, captured once per shape as CUDA graphs and replayed.

Most of a rollout's forward passes only decode (every row feeds its one pending token, nothing is prefilled), and
on a GPU a small model's decode pass is bound by the host: launching its few hundred kernels takes longer than
running them. :class:`StaticDecode` runs such a pass in a fixed shape instead of the ragged one: the batch padded
to the next bucket of :data:`BUCKETS` (up to the engine's row limit), attention over the pool's whole capacity
with each row's mask computed on the device from its length, and the inputs copied into buffers that live as long
as the shape. On CUDA each bucket's pass is captured once as a CUDA graph and then replayed with one launch;
elsewhere (or with ``capture=False``) the same static pass runs eagerly, so the CPU tests cover everything but the
capture itself.

Padding rows feed token 0 at position 0 of their own pool rows, the rows past the batch, which hold nothing in a
decode-only pass; their logits are dropped. A graph reads the pool's buffers at fixed addresses, so a pool
reallocation (buffers grow by half again: a few times in a rollout whose branches multiply, as a tree's do) discards
every captured graph, and the shapes are captured again on the new buffers.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from policies.kv_cache import KVPool
from policies.ragged_attention import RaggedPlan, ragged_attention_for

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # batch sizes a decode pass is padded to (then the row limit)


@dataclass
class _Shape:
    """One bucket's static buffers: ``inputs`` [3, rows] (token ids, positions, lengths), the constant pool rows
    written (``arange(rows)``) and padding column (token 0, position 0, length 1), the output logits once
    computed, and its graph once captured."""

    inputs: torch.Tensor
    rows: torch.Tensor
    padding: torch.Tensor
    logits: torch.Tensor | None = None
    graph: torch.cuda.CUDAGraph | None = None


class StaticDecode:
    """Decode-only forward passes of the HF engine in bucketed static shapes (see the module docstring)."""

    def __init__(self, model: PreTrainedModel, pool: KVPool, max_rows: int, *, capture: bool):
        self.model, self.pool = model, pool
        self.buckets = (*(b for b in BUCKETS if b < max_rows), max_rows)
        self.capture = capture
        self.passes = self.captures = 0  # passes run in a static shape; graphs captured
        self._shapes: dict[int, _Shape] = {}
        self._allocation = pool.allocations
        self._graph_pool = torch.cuda.graph_pool_handle() if capture else None

    def bucket(self, rows: int) -> int:
        """The static batch size a pass of ``rows`` decoding rows is padded to."""
        return next(b for b in self.buckets if b >= rows)

    @torch.inference_mode()
    def logits(self, inputs: torch.Tensor) -> torch.Tensor:
        """[D, vocab] next-token logits of the D decoding rows (pool rows ``0 .. D-1``); ``inputs`` [3, D] on the
        model's device holds each row's pending token, its position, and the row's length once it is fed. Their
        keys and values are written into the pool."""
        count = inputs.shape[1]
        size = self.bucket(count)
        self.pool.ensure(size, self.pool.capacity, used_rows=count)
        if self.pool.allocations != self._allocation:  # the buffers moved: graphs would write to freed memory
            self._discard_graphs()
        shape = self._shapes.get(size) or self._new_shape(size)
        shape.inputs[:, :count] = inputs
        shape.inputs[:, count:] = shape.padding
        if shape.graph is not None:
            shape.graph.replay()
        elif self.capture:
            self._capture(shape)
        else:
            shape.logits = self._run(shape)
        self.passes += 1
        return shape.logits[:count]

    def _discard_graphs(self) -> None:
        """Forget every shape and its graph. Later captures go to a new graph pool: by our reading of torch's
        caching allocator, it refuses a capture into a pool whose graphs are all gone while blocks of it are still
        cached (an internal assert, ``use_count > 0``, on the first capture after the KV pool grows)."""
        self._shapes.clear()
        self._allocation = self.pool.allocations
        if self.capture:
            self._graph_pool = torch.cuda.graph_pool_handle()

    def _new_shape(self, size: int) -> _Shape:
        device = self.model.device
        shape = _Shape(torch.zeros(3, size, dtype=torch.long, device=device), torch.arange(size, device=device),
                       torch.tensor([[0], [0], [1]], device=device))
        self._shapes[size] = shape
        return shape

    def _run(self, shape: _Shape) -> torch.Tensor:
        """The static pass itself: every tensor it reads lives in ``shape`` or the pool, so it can be captured."""
        ids, positions, lengths = shape.inputs
        keys = torch.arange(self.pool.capacity, device=ids.device)
        mask = (keys[None] < lengths[:, None])[:, None, None, :]
        plan = RaggedPlan(self.pool, len(ids), shape.rows, positions, mask, ())
        with ragged_attention_for(self.model):
            return self.model(input_ids=ids[None], position_ids=positions[None], use_cache=False,
                              ragged_plan=plan).logits[0]

    def _capture(self, shape: _Shape) -> None:
        """Capture ``shape``'s pass as a CUDA graph and replay it; on failure, warn and run eagerly from now on.
        The warm-up and the capture write the same keys and values the replay writes (same inputs), so running
        them is harmless."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # kernels chosen and workspaces allocated outside the capture
            self._run(shape)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self._graph_pool):
                shape.logits = self._run(shape)
        except RuntimeError as error:  # an op that syncs with the host cannot be captured
            warnings.warn(f"decode passes could not be captured as CUDA graphs ({error}); running them eagerly",
                          stacklevel=3)
            self.capture = False
            shape.logits = self._run(shape)
            return
        shape.graph = graph
        self.captures += 1
        graph.replay()
