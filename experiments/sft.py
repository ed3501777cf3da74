"""Supervised fine-tuning on weighted tokens, the warm start's training (``experiments/warmstart.py``): the
per-token loss weights of a trajectory, the weighted cross-entropy (its softmax over the whole vocabulary or over
the tokens the data holds), right-padding, and the training loop (AdamW, warm-up then cosine decay, then more
epochs while a check of the model fails) whose state is checkpointed after every epoch and resumed exactly; and,
asked for (``replay_bottom``), each row's frozen-bottom output computed in the first epoch only (``BottomReplay``)."""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from envs.retrieval.corpus import replace_atomically
from policies.frozen_bottom import FrozenBottom, frozen_bottom_depth

# The most bytes of frozen-bottom outputs ``BottomReplay`` keeps (rows past it are computed every epoch): the
# HotpotQA start's 265k tokens at SmolLM2-135M's width in float32 take 0.6 GB.
BOTTOM_REPLAY_BYTES = 4 << 30


def loss_weights(generated: Sequence[int], observation_weight: float) -> list[float]:
    """Per-token weights of the SFT loss: 1 on the generated tokens, ``observation_weight`` on the observations
    (every token after the first generated one that the policy did not generate), 0 on the prompt."""
    first = next((t for t, g in enumerate(generated) if g), len(generated))
    return [1.0 if g else observation_weight if t > first else 0.0 for t, g in enumerate(generated)]


@dataclass(frozen=True)
class TokenWeights:
    """How a trajectory's tokens weigh in the loss: the generated ones 1, the observations ``observation`` (0: not
    trained). With ``observation_share`` below 1 each epoch trains a fresh random draw of that share of the
    observation tokens at ``observation / observation_share``: the same expected gradient for a fraction of the LM
    head's cost, which the observations dominate."""

    observation: float = 0.0
    observation_share: float = 1.0

    def draw(self, generated: Sequence[int], rng: np.random.Generator) -> list[float]:
        """The weights of a trajectory whose generated tokens ``generated`` marks (1) for one epoch."""
        weights = loss_weights(generated, self.observation)
        if self.observation == 0.0 or self.observation_share >= 1.0:
            return weights
        kept = rng.random(len(weights)) < self.observation_share
        return [w if g else w / self.observation_share if keep else 0.0
                for w, g, keep in zip(weights, generated, kept, strict=True)]


@dataclass(frozen=True)
class SoftmaxVocabulary:
    """The tokens the loss's softmax runs over: the data's tokens ``ids`` (sorted; ``index`` gives each token of
    the model's vocabulary its place among them, -1 for a token outside) and, per step, ``negatives`` tokens drawn
    from the others (``outside``), each standing for ``len(outside) / negatives`` of them in the normaliser: a
    sampled softmax, whose draws keep pushing down the logits of tokens the data never asks for (without them a
    model samples such tokens, whose logits nothing trains)."""

    ids: torch.Tensor
    index: torch.Tensor
    outside: torch.Tensor
    negatives: int = 0

    @classmethod
    def of(cls, data: Sequence[tuple[Sequence[int], Sequence[int]]], vocab_size: int,
           negatives: int = 0) -> SoftmaxVocabulary:
        """Every token that ``data`` (trajectories of token ids) holds: any token a trajectory predicts is in it."""
        ids = torch.tensor(sorted({token for row, _ in data for token in row}), dtype=torch.long)
        index = torch.full((vocab_size,), -1, dtype=torch.long)
        index[ids] = torch.arange(len(ids))
        return cls(ids, index, (index < 0).nonzero().squeeze(-1), negatives)

    def columns(self, generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The head's rows of one step's softmax (the data's tokens, then the drawn negatives) and the log-count
        each column stands for (0 for the data's tokens)."""
        if not self.negatives or not len(self.outside):
            return self.ids, torch.zeros(len(self.ids))
        drawn = self.outside[torch.randint(len(self.outside), (self.negatives,), generator=generator)]
        log_counts = torch.zeros(len(self.ids) + self.negatives)
        log_counts[len(self.ids):] = float(np.log(len(self.outside) / self.negatives))
        return torch.cat([self.ids, drawn]), log_counts


def sft_loss(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, weights: torch.Tensor,
             vocabulary: SoftmaxVocabulary | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """Cross-entropy of the tokens with a positive weight, their weighted mean; the LM head runs on their
    positions only (the head of a small model with a 49k vocabulary costs more than the rest of it). With 0/1
    weights (the generated-token mask), the mean cross-entropy of the generated tokens. With ``vocabulary``, the
    softmax runs over its columns (its negatives drawn from ``generator``)."""
    hidden = model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    target_weights = weights[:, 1:].float()  # position t predicts token t + 1
    select = target_weights > 0
    head, targets = model.get_output_embeddings(), input_ids[:, 1:][select]
    if vocabulary is None:
        logits = head(hidden[:, :-1][select]).float()
    else:
        columns, log_counts = vocabulary.columns(generator)
        bias = None if head.bias is None else head.bias[columns]
        logits = torch.nn.functional.linear(hidden[:, :-1][select], head.weight[columns], bias).float() + log_counts
        targets = vocabulary.index[targets]
    losses = torch.nn.functional.cross_entropy(logits, targets, reduction="none")
    return (losses * target_weights[select]).sum() / target_weights[select].sum()


class BottomReplay:
    """Each row's frozen-bottom output ([its tokens, hidden], held on the CPU), recorded by the first epoch that
    passes over the row and replayed by the later ones in whatever batch the shuffle puts it: a batch whose rows are
    all held skips the bottom's layers (``FrozenBottom``). Right-padded, a row's tokens never attend to the padding,
    so the padded positions' states (zeros here) change nothing the loss reads. Rows past ``budget`` bytes are not
    kept; a resumed run records again."""

    def __init__(self, bottom: FrozenBottom, budget: int = BOTTOM_REPLAY_BYTES):
        self.bottom, self.budget = bottom, budget
        self.rows: dict[int, torch.Tensor] = {}
        self.held = 0

    @classmethod
    def of(cls, model, epochs: int) -> BottomReplay | None:
        """The replay for ``model`` (a causal LM, or a PEFT model around one) over ``epochs`` epochs; None where it
        saves nothing (one epoch) or there is no frozen bottom (full fine-tuning, adapters on every layer)."""
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        return cls(FrozenBottom(base)) if epochs > 1 and frozen_bottom_depth(base) else None

    @contextlib.contextmanager
    def over(self, batch: Sequence[int], attention: torch.Tensor) -> Iterator[None]:
        """A forward pass over the rows ``batch`` of the data (``attention``: their right-padded attention mask)."""
        lengths = attention.sum(dim=1).tolist()
        if all(i in self.rows for i in batch):
            first = self.rows[batch[0]]
            states = first.new_zeros((*attention.shape, first.shape[-1]))
            for r, i in enumerate(batch):
                states[r, :lengths[r]] = self.rows[i]
            with self.bottom.replaying(states.to(attention.device), tuple(batch)):
                yield
            return
        with self.bottom.recording() as recorded:
            yield
        for r, i in enumerate(batch if recorded else ()):
            row = recorded[-1][r, :lengths[r]]
            if i not in self.rows and self.held + row.nbytes <= self.budget:
                self.rows[i] = row.to("cpu", copy=True)  # a copy: the batch's tensor is freed
                self.held += row.nbytes


def pad(rows: Sequence[tuple[list[int], Sequence[float]]], pad_id: int) -> tuple[torch.Tensor, ...]:
    """(ids, attention mask, loss weights) of ``rows`` of (ids, per-token weights), right-padded."""
    width = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    weights = torch.zeros((len(rows), width), dtype=torch.float)
    for i, (row_ids, row_weights) in enumerate(rows):
        ids[i, :len(row_ids)] = torch.tensor(row_ids)
        attention[i, :len(row_ids)] = 1
        weights[i, :len(row_ids)] = torch.tensor(row_weights, dtype=torch.float)
    return ids, attention, weights


def learning_rate_factor(step: int, steps: int, warmup: int, floor: float, extra: float | None = None) -> float:
    """The schedule's multiplier of the peak learning rate at optimizer step ``step``: a linear warm-up over
    ``warmup`` steps, then a cosine from 1 down to ``floor`` at step ``steps``; after it (the extra epochs a failed
    check adds) ``extra``, the floor when None."""
    if step >= steps and extra is not None:
        return extra
    cosine = 0.5 * (1 + np.cos(np.pi * min(step, steps) / steps))
    return min(1.0, (step + 1) / warmup) * (floor + (1 - floor) * cosine)


def train(model, data: list[tuple[list[int], Sequence[int]]], *, epochs: int, lr: float, batch_size: int, seed: int,
          pad_id: int, token_weights: TokenWeights = TokenWeights(), max_minutes: float | None = None,
          checkpoint: Path | None = None, lr_floor: float = 0.0, check: Callable[[], float] | None = None,
          check_min: float = 0.0, extra_epochs: int = 0, extra_lr: float | None = None,
          vocabulary: SoftmaxVocabulary | None = None, checkpoint_minutes: float | None = None,
          replay_bottom: bool = False, log=print) -> dict[str, list[float]]:
    """AdamW over shuffled batches of ``data`` (token ids, 1 on the generated ones) weighted by ``token_weights``,
    linear warm-up then cosine decay to ``lr_floor`` times ``lr`` over ``epochs``; then, with ``check`` (a score of
    the model, e.g. greedy exact match on questions it does not train on), up to ``extra_epochs`` more epochs at the
    learning rate ``extra_lr`` times ``lr`` (default: the floor) while the score after the last epoch is below
    ``check_min``. ``vocabulary``: the tokens the loss's softmax runs over (default: all). ``replay_bottom``: a
    frozen bottom's output computed in the first epoch only (``BottomReplay``): faster with LoRA on the top layers,
    the same training to float rounding but not to the bit (a replayed row was recorded in a batch of another
    width), so it is off by default and no cached recipe uses it (their builds stay bit-reproducible); a resumed run
    records again, so it too matches the uninterrupted one to rounding only. Returns
    ``{"loss": the mean loss of each epoch, "check": the score after each checked epoch}``.

    With ``checkpoint``, the whole training state (weights, optimizer, schedule, random generators, loss
    curve and checks) is written there after every epoch, and within an epoch every ``checkpoint_minutes`` (a long
    epoch of a pretrained model); when the file exists, training resumes where it was written: a killed run continues
    where it stopped and ends as an uninterrupted one would. ``max_minutes`` counts this process's time only."""
    rng = np.random.default_rng(seed)
    draws = np.random.default_rng([seed, 1])  # the observations each epoch trains, apart from the shuffling
    negatives = torch.Generator().manual_seed(seed)  # the softmax's sampled negatives
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    steps = epochs * -(-len(data) // batch_size)
    warmup = max(1, steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, functools.partial(learning_rate_factor, steps=steps, warmup=warmup, floor=lr_floor, extra=extra_lr))
    curve: dict[str, list[float]] = {"loss": [], "check": []}
    replay = BottomReplay.of(model, epochs + extra_epochs) if replay_bottom else None
    position: dict = {}  # within an epoch: the shuffle's state at its start, the batches done, their losses
    if checkpoint is not None and checkpoint.exists():
        state = torch.load(checkpoint, weights_only=False)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        schedule.load_state_dict(state["schedule"])
        rng.bit_generator.state = state["shuffle_rng"]
        draws.bit_generator.state = state["draw_rng"]
        negatives.set_state(state["negatives_rng"])
        torch.set_rng_state(state["torch_rng"])
        curve = state["curve"]
        position = state.get("position", {})
        where = (f"batch {position['batches']} of epoch {len(curve['loss']) + 1}" if position
                 else f"epoch {len(curve['loss'])}/{epochs}")
        log(f"resuming after {where} from {checkpoint}")

    def save(position: dict) -> None:
        if checkpoint is None:
            return
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "schedule": schedule.state_dict(),
                 "shuffle_rng": rng.bit_generator.state, "draw_rng": draws.bit_generator.state,
                 "negatives_rng": negatives.get_state(), "torch_rng": torch.get_rng_state(), "curve": curve,
                 "position": position}
        replace_atomically(checkpoint, functools.partial(torch.save, state))  # a kill mid-write keeps the last

    start = saved_at = time.perf_counter()
    for epoch in range(len(curve["loss"]), epochs + extra_epochs):
        if epoch >= epochs and (check is None or curve["check"][-1] >= check_min):
            break
        model.train()
        if position:  # resumed within this epoch: its order again from the shuffle's state at its start
            rng.bit_generator.state = position["shuffle_rng"]
        epoch_start_rng = rng.bit_generator.state
        order = rng.permutation(len(data))
        batches = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
        losses = list(position.get("losses", []))
        for done, batch in enumerate(batches[len(losses):], start=len(losses)):
            ids, attention, weights = pad([(data[i][0], token_weights.draw(data[i][1], draws)) for i in batch], pad_id)
            with replay.over(batch.tolist(), attention) if replay else contextlib.nullcontext():
                loss = sft_loss(model, ids, attention, weights, vocabulary, negatives)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            losses.append(loss.item())
            if (checkpoint_minutes is not None and done + 1 < len(batches)
                    and time.perf_counter() - saved_at > 60 * checkpoint_minutes):
                save({"shuffle_rng": epoch_start_rng, "batches": done + 1, "losses": losses})
                saved_at = time.perf_counter()
        position = {}
        curve["loss"].append(float(np.mean(losses)))
        message = f"epoch {epoch + 1}/{epochs}: loss {curve['loss'][-1]:.4f}"
        if check is not None and epoch + 1 >= epochs:
            model.eval()
            curve["check"].append(check())
            message += f", check {curve['check'][-1]:.3f} (wanted >= {check_min})"
        log(f"{message}  ({time.perf_counter() - start:.0f} s)")
        save({})
        saved_at = time.perf_counter()
        if max_minutes is not None and time.perf_counter() - start > 60 * max_minutes:
            log(f"stopping: --max-minutes {max_minutes} reached")
            break
    model.eval()
    return curve
