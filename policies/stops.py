"""Stop strings found on token ids: a step ends on the token that completes a stop string, and only a token whose
text holds a stop string's last character can do that, so most tokens are never decoded."""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

from transformers import PreTrainedTokenizerBase


@lru_cache(maxsize=8)
def stop_enders(tokenizer: PreTrainedTokenizerBase, stop_strings: tuple[str, ...]) -> frozenset[int]:
    """Token ids whose text holds the last character of a stop string: only such a token can complete one."""
    last = {stop[-1] for stop in stop_strings}
    texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
    return frozenset(i for i, text in enumerate(texts) if any(c in text for c in last))


class StopStrings:
    """Which of ``strings`` the last token of a step completes. Asked after every token of the step, so a string
    found in the decoded tail is the step's first (the tail is a few tokens longer than the longest string)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, strings: tuple[str, ...]):
        self.tokenizer, self.strings = tokenizer, strings
        self.enders = stop_enders(tokenizer, strings) if strings else frozenset()
        self.window = max((len(s) for s in strings), default=0) + 2  # tokens decoded per check

    def completed_by_last(self, generated: Sequence[int]) -> str | None:
        """The stop string that ``generated[-1]`` completes, or None."""
        if not generated or generated[-1] not in self.enders:
            return None
        tail = self.tokenizer.decode(list(generated[-self.window :]))
        return next((stop for stop in self.strings if stop in tail), None)
