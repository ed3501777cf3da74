"""A frozen bottom's output, computed once per micro-batch and replayed by the update's later passes over it.

With LoRA on the top k decoder layers (``--lora-layers``), the layers below them hold no trainable weight and no
adapter: their output on a micro-batch is the same in every pass of an update (the old and reference log-probs, with
the adapters on or off, and every optimizer step's forward: the optimizer never touches them). ``FrozenBottom``
records it in the first pass over a micro-batch and, in the later ones, skips those layers: each returns its input
untouched but the top frozen one, which returns the recorded output. The log-probs and gradients are the same
floats as without it; the saving is the bottom's forward in every pass but the first (on SmolLM2-135M with
adapters on its top 10 of 30 layers, 20 layers of every optimizer step's forward after the reference pass has
recorded them). The price is the recorded hidden states, one [tokens, hidden] tensor per micro-batch, held until the
update ends.
"""

from __future__ import annotations

import contextlib
from collections.abc import Hashable, Iterator

import torch


def frozen_bottom_depth(base: torch.nn.Module) -> int:
    """How many of ``base``'s (a causal LM's) bottom decoder layers hold no trainable parameter, counted from the
    first while the input embeddings hold none either (else 0): the layers whose output no update changes. 0 too
    for a model with dropout in its layers (attention's, or a dropout module), whose output differs every pass."""
    if any(p.requires_grad for p in base.get_input_embeddings().parameters()):
        return 0
    if getattr(base.config, "attention_dropout", 0.0) or any(
            isinstance(m, torch.nn.Dropout) and m.p > 0 for m in base.get_decoder().layers.modules()):
        return 0
    depth = 0
    for layer in base.get_decoder().layers:
        if any(p.requires_grad for p in layer.parameters()):
            break
        depth += 1
    return depth


def _passing(hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    return hidden_states


class FrozenBottom:
    """The output of ``base``'s frozen bottom (``frozen_bottom_depth`` layers) per micro-batch key, recorded by
    the first pass over the micro-batch and replayed by the later ones (``over``); ``clear`` drops them (at the end
    of an update: its micro-batches are not the next one's). ``recording`` and ``replaying`` are the two kinds of
    pass, for a caller that keeps the outputs itself (the warm start's epochs, row by row)."""

    def __init__(self, base: torch.nn.Module):
        self.depth = frozen_bottom_depth(base)
        if not self.depth:
            raise ValueError("no frozen bottom: the input embeddings or the first decoder layer hold trainable "
                             "weights, or the layers have dropout (an output that differs every pass)")
        self._layers = list(base.get_decoder().layers)[:self.depth]
        self._outputs: dict[Hashable, torch.Tensor] = {}

    def __len__(self) -> int:
        return len(self._outputs)

    @contextlib.contextmanager
    def recording(self) -> Iterator[list[torch.Tensor]]:
        """A pass that runs every layer; the bottom's output (detached, [rows, positions, hidden]) is appended to the
        list it yields."""
        recorded: list[torch.Tensor] = []
        handle = self._layers[-1].register_forward_hook(lambda module, args, output: recorded.append(output.detach()))
        try:
            yield recorded
        finally:
            handle.remove()

    @contextlib.contextmanager
    def replaying(self, states: torch.Tensor, key: Hashable = "this pass") -> Iterator[None]:
        """A pass that skips the bottom's layers, ``states`` standing for their output (its shape checked against the
        pass's; ``key`` names the rows in the error)."""
        top = self._layers[-1]
        for layer in self._layers[:-1]:
            layer.forward = _passing

        def replay(hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
            if hidden_states.shape != states.shape:
                raise ValueError(f"micro-batch {key!r}: the frozen bottom recorded hidden states of shape "
                                 f"{tuple(states.shape)}, this pass has {tuple(hidden_states.shape)}: a key must "
                                 f"name the same rows in every pass")
            return states

        top.forward = replay
        try:
            yield
        finally:
            for layer in self._layers:
                del layer.forward  # the class's forward again

    @contextlib.contextmanager
    def over(self, key: Hashable) -> Iterator[None]:
        """A pass over the micro-batch ``key`` (the same rows in every pass): records the bottom's output when
        none is held for ``key``, else replays it."""
        if key in self._outputs:
            with self.replaying(self._outputs[key], key):
                yield
            return
        with self.recording() as recorded:
            yield
        if recorded:  # a pass that stopped before the bottom's top layer leaves nothing to replay
            self._outputs[key] = recorded[-1]

    def clear(self) -> None:
        self._outputs.clear()
