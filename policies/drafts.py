"""Draft tokens for speculative decoding by prompt lookup: a sequence's next tokens guessed from its own past.

A search agent repeats what it has seen: queries name entities from the question or a passage, answers copy a
name, tags come back every step. :class:`PromptLookup` keeps an index of the n-grams of one sequence (context and
generated ids) and proposes, after the sequence's last n tokens, the tokens that followed their latest earlier
occurrence (the longest n tried first). The engine feeds the drafts with the row's pending token in one pass and
keeps those that match what it samples there (:mod:`policies.hf_generation`), so a draft changes how many passes
a step takes, never which tokens it samples.
"""

from __future__ import annotations

from collections.abc import Iterable

NGRAMS = (3, 2)  # n-gram lengths looked up, longest first: a single repeated token predicts too little


class PromptLookup:
    """The n-gram index of one growing token sequence (see the module docstring)."""

    def __init__(self, tokens: Iterable[int], ngrams: tuple[int, ...] = NGRAMS):
        if not ngrams or min(ngrams) < 1:
            raise ValueError(f"n-gram lengths must be >= 1, got {ngrams}")
        self.ngrams = tuple(sorted(ngrams, reverse=True))
        self.tokens: list[int] = []
        # n-gram -> index of the token that followed its latest occurrence; an n-gram enters only once a token
        # follows it, so the sequence's own last n-gram never points at itself
        self._follows: dict[tuple[int, ...], int] = {}
        for token in tokens:
            self.append(token)

    def append(self, token: int) -> None:
        end = len(self.tokens)
        for n in self.ngrams:
            if end >= n:
                self._follows[tuple(self.tokens[end - n : end])] = end
        self.tokens.append(token)

    def propose(self, count: int) -> tuple[int, ...]:
        """Up to ``count`` tokens that followed the latest earlier occurrence of the sequence's last n tokens
        (empty when none of its n-grams occurred before, or ``count`` is 0)."""
        if count <= 0:
            return ()
        for n in self.ngrams:
            if len(self.tokens) < n:
                continue
            follow = self._follows.get(tuple(self.tokens[-n:]))
            if follow is not None:
                return tuple(self.tokens[follow : follow + count])
        return ()
