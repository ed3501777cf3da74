"""Answer scoring: SQuAD normalisation, exact match, token F1, and Search-R1's format-aware training reward.

The training reward (Jin et al., 2025, Search-R1; used by Tree-GRPO, arXiv 2509.21240) shapes exact match
by whether the response follows the agent format::

    answer correct, format valid    1.0        answer wrong, format valid            0.2
    answer correct, format invalid  0.8        answer wrong, format invalid          0.1
    no answer at all                0.0

"Valid format" means the response is ``<think>..</think>`` then any number of ``<search>..</search>
<information>..</information> <think>..</think>`` rounds, then ``<answer>..</answer>``, with nothing but
whitespace between the tags. It is checked on the tag structure of the steps, not on any chat-template marker,
so it holds for every model family.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

# ---------------------------------------------------------------------------------------------------------
# Normalisation and the two evaluation metrics

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lowercase, drop punctuation, drop articles, collapse whitespace."""
    text = text.lower().translate(_PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(prediction: str, answers: Sequence[str]) -> float:
    """1.0 if the normalised prediction equals any normalised gold answer, else 0.0."""
    pred = normalize_answer(prediction)
    return float(any(pred == normalize_answer(gold) for gold in answers))


def token_f1(prediction: str, answers: Sequence[str]) -> float:
    """The best SQuAD token F1 of the prediction against the gold answers."""
    pred_tokens = normalize_answer(prediction).split()
    best = 0.0
    for gold in answers:
        gold_tokens = normalize_answer(gold).split()
        common = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
        if not pred_tokens or not gold_tokens:
            best = max(best, float(pred_tokens == gold_tokens))
        elif common:
            precision, recall = common / len(pred_tokens), common / len(gold_tokens)
            best = max(best, 2 * precision * recall / (precision + recall))
    return best


# ---------------------------------------------------------------------------------------------------------
# Parsing the response

_TAG = re.compile(r"</?(?:think|search|information|answer)>")

# The format as a state machine over tags: (state, tag) -> next state. Inside a tag only its closing tag
# counts, so a passage that happens to contain "<answer>" does not break the structure.
_TRANSITIONS = {
    ("start", "<think>"): "in_think",
    ("in_think", "</think>"): "thought",
    ("thought", "<search>"): "in_search",
    ("in_search", "</search>"): "searched",
    ("searched", "<information>"): "in_information",
    ("in_information", "</information>"): "informed",
    ("informed", "<think>"): "in_think",
    ("thought", "<answer>"): "in_answer",
    ("in_answer", "</answer>"): "end",
}
_CLOSING = {"in_think": "</think>", "in_search": "</search>", "in_information": "</information>",
            "in_answer": "</answer>"}


def is_valid_format(response: str) -> bool:
    """Whether a response (generated steps interleaved with observations) follows the agent format."""
    state, position = "start", 0
    for match in _TAG.finditer(response):
        tag = match.group()
        if state in _CLOSING and tag != _CLOSING[state]:
            continue  # free text inside a tag
        if state not in _CLOSING and response[position : match.start()].strip():
            return False  # text between tags
        if (state, tag) not in _TRANSITIONS:
            return False
        state, position = _TRANSITIONS[state, tag], match.end()
    return state == "end" and not response[position:].strip()


# ---------------------------------------------------------------------------------------------------------
# Rewards: (answer or None, gold answers, format valid) -> float


@dataclass(frozen=True)
class FormatRewardTable:
    """The values of the format-aware reward (Search-R1 defaults)."""

    correct_valid: float = 1.0
    correct_invalid: float = 0.8
    wrong_valid: float = 0.2
    wrong_invalid: float = 0.1
    no_answer: float = 0.0

    def __call__(self, answer: str | None, answers: Sequence[str], format_valid: bool) -> float:
        if answer is None:
            return self.no_answer
        if exact_match(answer, answers):
            return self.correct_valid if format_valid else self.correct_invalid
        return self.wrong_valid if format_valid else self.wrong_invalid


RewardFn = Callable[[str | None, Sequence[str], bool], float]
"""A reward: (the parsed answer or None, the gold answers, whether the format is valid) -> float."""


def _em_reward(answer: str | None, answers: Sequence[str], format_valid: bool) -> float:
    return 0.0 if answer is None else exact_match(answer, answers)


def _f1_reward(answer: str | None, answers: Sequence[str], format_valid: bool) -> float:
    return 0.0 if answer is None else token_f1(answer, answers)


REWARDS: dict[str, RewardFn] = {"format": FormatRewardTable(), "em": _em_reward, "f1": _f1_reward}


def get_reward_fn(reward: str | RewardFn) -> RewardFn:
    """A reward by name (``format``, ``em``, ``f1``) or a callable with the ``RewardFn`` signature."""
    if callable(reward):
        return reward
    if reward not in REWARDS:
        raise ValueError(f"unknown reward {reward!r}; choose one of: {', '.join(REWARDS)} (or pass a callable)")
    return REWARDS[reward]
