"""The word tokenizer shared by the sparse retrievers (so that bm25 and rank_bm25 score the same terms)."""

from __future__ import annotations

import re

TOKENIZER_VERSION = 1  # part of every sparse index's cache key: bump when tokenization changes

_WORD = re.compile(r"\w+", re.UNICODE)

# Function words that carry no retrieval signal; kept short so that short titles ("The Who") still match.
STOPWORDS = frozenset(
    "a an and are as at be been but by did do does for from had has have he her his how i if in into is it its "
    "of on or she so than that the their them then there these they this to was we were what when where which "
    "who whom whose why will with would you".split(" ")
)


def tokenize(text: str) -> list[str]:
    """Lowercased word tokens without stopwords; a text of only stopwords keeps them (never empty by choice)."""
    words = _WORD.findall(text.lower())
    content = [w for w in words if w not in STOPWORDS]
    return content or words
