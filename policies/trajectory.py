"""A conversation in token space: prompt ids, then sampled step ids and tokenized observations, in order.

Only the sampled ids are trainable (``generated_mask``); their sampling log-probs ride along. Immutable, so
the nodes of a tree can share the prefixes they have in common.
"""

from __future__ import annotations

from dataclasses import dataclass

from policies.generation import Branch, CacheHandle, StepOutput


@dataclass(frozen=True)
class TokenTrajectory:
    """Token ids of a whole path, which of them were sampled, and their sampling log-probs (0 elsewhere)."""

    token_ids: tuple[int, ...]
    generated_mask: tuple[bool, ...]
    sampling_logprobs: tuple[float, ...]

    @classmethod
    def from_prompt(cls, prompt_ids: tuple[int, ...]) -> TokenTrajectory:
        n = len(prompt_ids)
        return cls(tuple(prompt_ids), (False,) * n, (0.0,) * n)

    def with_step(self, step: StepOutput) -> TokenTrajectory:
        """Append a sampled step exactly as sampled (never decoded and re-encoded)."""
        n = len(step.token_ids)
        return TokenTrajectory(self.token_ids + step.token_ids, self.generated_mask + (True,) * n,
                               self.sampling_logprobs + step.logprobs)

    def with_observation(self, ids: tuple[int, ...]) -> TokenTrajectory:
        """Append an observation's ids (tokenized once); they are masked out of the loss."""
        n = len(ids)
        return TokenTrajectory(self.token_ids + tuple(ids), self.generated_mask + (False,) * n,
                               self.sampling_logprobs + (0.0,) * n)

    def branch(self, cache: CacheHandle | None = None, stream: int | None = None) -> Branch:
        """This context as a branch to continue, reusing ``cache`` for the prefix it covers, drawing from
        ``stream``."""
        return Branch(self.token_ids, cache, stream)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated(self) -> int:
        return sum(self.generated_mask)
