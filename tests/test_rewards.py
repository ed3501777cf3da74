"""Answer scoring: normalisation, EM, token F1, the format check and the reward table.

Every expected value is computed by hand (in the comments), never copied from a run of the code.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from envs.rewards import (
    REWARDS,
    FormatRewardTable,
    exact_match,
    get_reward_fn,
    is_valid_format,
    normalize_answer,
    token_f1,
)

# ---------------------------------------------------------------------------------------------------------
# normalize_answer


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # punctuation is deleted (not replaced by a space)
        ("Hello, World!", "hello world"),
        ("U.S.A.", "usa"),
        ("a-ha", "aha"),
        ("Rock 'n' Roll", "rock n roll"),
        # articles a / an / the are dropped as whole words only
        ("The Beatles", "beatles"),
        ("An apple a day", "apple day"),
        ("theater and anthem", "theater and anthem"),
        ("THE END", "end"),
        # case
        ("PaRiS", "paris"),
        # whitespace collapses, including tabs and newlines, and is trimmed
        ("  multiple   spaces\n\tand tabs  ", "multiple spaces and tabs"),
        # punctuation goes first, so "the," is still an article; only articles -> empty
        ("The, a. An!", ""),
        ("", ""),
    ],
)
def test_normalize_answer(text: str, expected: str) -> None:
    assert normalize_answer(text) == expected


@given(st.text())
def test_normalize_answer_is_idempotent(text: str) -> None:
    once = normalize_answer(text)
    assert normalize_answer(once) == once


# ---------------------------------------------------------------------------------------------------------
# exact_match


@pytest.mark.parametrize(
    ("prediction", "answers", "expected"),
    [
        ("The  Eiffel Tower!", ["eiffel tower"], 1.0),
        ("paris", ["London", "Paris"], 1.0),  # any of several golds
        ("Paris", ["London", "Lyon"], 0.0),
        ("Paris France", ["Paris"], 0.0),  # a superset is not an exact match
        ("Paris", [], 0.0),  # no gold answers: nothing to match
        ("1,000", ["1000"], 1.0),  # the comma is punctuation
    ],
)
def test_exact_match(prediction: str, answers: list[str], expected: float) -> None:
    assert exact_match(prediction, answers) == expected


# ---------------------------------------------------------------------------------------------------------
# token_f1


@pytest.mark.parametrize(
    ("prediction", "answers", "expected"),
    [
        # pred {red, car}, gold {red, big, truck}: common 1 -> P = 1/2, R = 1/3, F1 = 2PR/(P+R) = (1/3)/(5/6) = 0.4
        ("red car", ["red big truck"], 0.4),
        # pred "cat sat" (article dropped), gold "cat": common 1 -> P = 1/2, R = 1 -> F1 = 1/(3/2) = 2/3
        ("the cat sat", ["a cat"], 2 / 3),
        # counts are clipped: pred {go:2, stop:1}, gold {go:1, stop:2} -> common = 1 + 1 = 2, P = R = 2/3, F1 = 2/3
        ("go go stop", ["go stop stop"], 2 / 3),
        # no common token -> 0
        ("blue", ["red car"], 0.0),
        # the best over the golds: 0 against the first, 1 against the second
        ("red car", ["blue truck", "Red car."], 1.0),
        # best of 0.4 (above) and pred {red, car} vs gold {car}: P = 1/2, R = 1 -> 2/3
        ("red car", ["red big truck", "car"], 2 / 3),
        # empty cases: both empty after normalisation -> 1, one side empty -> 0
        ("", [""], 1.0),
        ("the", ["a"], 1.0),
        ("", ["Paris"], 0.0),
        ("Paris", [""], 0.0),
        ("Paris", [], 0.0),
    ],
)
def test_token_f1(prediction: str, answers: list[str], expected: float) -> None:
    assert token_f1(prediction, answers) == pytest.approx(expected)


@given(st.text(max_size=30), st.lists(st.text(max_size=30), max_size=3))
def test_token_f1_is_bounded_and_exact_match_gives_one(prediction: str, answers: list[str]) -> None:
    f1 = token_f1(prediction, answers)
    assert 0.0 <= f1 <= 1.0 + 1e-12
    if exact_match(prediction, answers):
        assert f1 == pytest.approx(1.0)


# ---------------------------------------------------------------------------------------------------------
# is_valid_format

ROUND = "<search>who wrote it</search>\n\n<information>Doc 1 (Title: X) text</information>\n\n"


@pytest.mark.parametrize(
    "response",
    [
        "<think>easy</think>\n<answer>Paris</answer>",
        f"<think>need to search</think>\n{ROUND}<think>found it</think>\n<answer>Paris</answer>",
        f"<think>a</think>{ROUND}<think>b</think>{ROUND}<think>c</think><answer>Paris</answer>",  # two rounds
        "  <think>a</think>  <answer>Paris</answer>\n\n",  # whitespace around the tags is fine
        # an observation that quotes agent tags: inside <information> only </information> counts
        "<think>a</think><search>q</search><information>the page says <answer>Rome</answer> and <think>"
        "</information><think>b</think><answer>Paris</answer>",
        # multi-line free text inside the tags
        "<think>line 1\nline 2</think>\n<answer>Paris,\nFrance</answer>",
    ],
)
def test_valid_format(response: str) -> None:
    assert is_valid_format(response)


@pytest.mark.parametrize(
    "response",
    [
        "",
        "<think>a</think> so the answer is <answer>Paris</answer>",  # text between tags
        f"<think>a</think>{ROUND}I see. <think>b</think><answer>Paris</answer>",  # text between tags
        "Sure! <think>a</think><answer>Paris</answer>",  # text before the first tag
        "<answer>Paris</answer>",  # answer without think
        f"{ROUND}<think>b</think><answer>Paris</answer>",  # missing the first think
        f"<think>a</think>{ROUND}<answer>Paris</answer>",  # no think after the information
        "<think>a</think><search>q</search><think>b</think><answer>Paris</answer>",  # search without information
        "<think>a</think><answer>Paris</answer> Hope this helps!",  # trailing text after </answer>
        "<think>a</think><answer>Paris</answer><answer>Rome</answer>",  # a second answer
        "<think>a</think><answer>Paris",  # unclosed answer
        "<think>a<answer>Paris</answer>",  # unclosed think
        "<think>a</think><search>q</search><information>doc",  # unclosed information, no answer
        "<think>a</think>",  # no answer at all
        "<think>a</think></answer>",  # a closing tag that closes nothing
    ],
)
def test_invalid_format(response: str) -> None:
    assert not is_valid_format(response)


# ---------------------------------------------------------------------------------------------------------
# The reward table and the reward registry


@pytest.mark.parametrize(
    ("answer", "format_valid", "expected"),
    [
        ("Paris", True, 1.0),  # correct, valid format
        ("paris!", False, 0.8),  # correct (after normalisation), invalid format
        ("London", True, 0.2),  # wrong, valid format
        ("London", False, 0.1),  # wrong, invalid format
        (None, True, 0.0),  # no answer at all
        (None, False, 0.0),
    ],
)
def test_format_reward_table(answer: str | None, format_valid: bool, expected: float) -> None:
    assert FormatRewardTable()(answer, ["Paris", "City of Light"], format_valid) == expected


def test_format_reward_table_custom_values() -> None:
    table = FormatRewardTable(correct_valid=5.0, correct_invalid=4.0, wrong_valid=3.0, wrong_invalid=2.0,
                              no_answer=-1.0)
    golds = ["Paris"]
    assert [table("Paris", golds, True), table("Paris", golds, False), table("Rome", golds, True),
            table("Rome", golds, False), table(None, golds, True)] == [5.0, 4.0, 3.0, 2.0, -1.0]


def test_format_reward_matches_any_gold() -> None:
    assert FormatRewardTable()("the city of light", ["Paris", "City of Light"], True) == 1.0


@pytest.mark.parametrize(
    ("name", "answer", "answers", "format_valid", "expected"),
    [
        ("format", "Paris", ["Paris"], True, 1.0),
        ("format", "Rome", ["Paris"], False, 0.1),
        ("em", "The Paris", ["paris"], False, 1.0),  # pure EM ignores the format
        ("em", "Rome", ["paris"], True, 0.0),
        ("em", None, ["paris"], True, 0.0),
        ("f1", "red car", ["red big truck"], False, 0.4),  # P 1/2, R 1/3 -> 0.4, format ignored
        ("f1", None, ["red big truck"], True, 0.0),
    ],
)
def test_get_reward_fn_by_name(
    name: str, answer: str | None, answers: list[str], format_valid: bool, expected: float
) -> None:
    fn = get_reward_fn(name)
    assert fn is REWARDS[name]
    assert fn(answer, answers, format_valid) == pytest.approx(expected)


def test_get_reward_fn_passes_a_callable_through() -> None:
    def custom(answer, answers, format_valid):
        return 42.0

    assert get_reward_fn(custom) is custom
    table = FormatRewardTable(no_answer=-0.5)
    assert get_reward_fn(table) is table


def test_get_reward_fn_unknown_name_lists_the_valid_names() -> None:
    with pytest.raises(ValueError, match="nope") as err:
        get_reward_fn("nope")
    for name in ("format", "em", "f1"):
        assert name in str(err.value)
