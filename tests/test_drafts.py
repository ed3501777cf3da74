"""Prompt lookup: which tokens it proposes, by hand."""

from __future__ import annotations

import pytest

from policies.drafts import PromptLookup


def test_proposes_what_followed_the_latest_earlier_trigram():
    # ... 1 2 3 [9 8] ... 1 2 3 [4 5 6] ... 1 2 3: the latest earlier "1 2 3" was followed by 4 5 6
    lookup = PromptLookup([1, 2, 3, 9, 8, 1, 2, 3, 4, 5, 6, 7, 1, 2, 3])
    assert lookup.propose(3) == (4, 5, 6)
    assert lookup.propose(1) == (4,)
    assert lookup.propose(0) == ()


def test_falls_back_to_a_bigram_and_stops_at_the_sequence_end():
    lookup = PromptLookup([7, 1, 2, 5, 0, 1, 2])  # "0 1 2" never occurred before; "1 2" did, followed by 5 0 1 2
    assert lookup.propose(10) == (5, 0, 1, 2)
    lookup.append(5)  # now "1 2 5" occurred before: followed by 0 1 2 5
    assert lookup.propose(3) == (0, 1, 2)


def test_no_proposal_without_an_earlier_occurrence():
    assert PromptLookup([1, 2, 3, 4]).propose(4) == ()
    assert PromptLookup([]).propose(4) == ()
    assert PromptLookup([3, 3]).propose(2) == ()  # a single repeated token is not enough (n >= 2)
    assert PromptLookup([3, 3, 3]).propose(2) == (3,)  # "3 3" occurred at the start, followed by one 3


def test_extending_equals_building_from_the_whole_sequence():
    tokens = [5, 1, 2, 3, 5, 1, 2, 8, 5, 1, 2]
    grown = PromptLookup(tokens[:3])
    for token in tokens[3:]:
        grown.append(token)
    assert grown.propose(4) == PromptLookup(tokens).propose(4) == (8, 5, 1, 2)


def test_ngram_lengths_are_validated():
    with pytest.raises(ValueError, match="n-gram lengths must be >= 1"):
        PromptLookup([1], ngrams=(0,))
    assert PromptLookup([4, 9, 4], ngrams=(1,)).propose(2) == (9, 4)
