"""A multi-turn search-QA environment: the agent thinks, searches a corpus and answers, in text."""

from __future__ import annotations

import multiprocessing
import numbers
import os
import re
import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import gymnasium as gym
import numpy as np
from gymnasium import spaces
from gymnasium.vector import utils as vector_utils

from envs.datasets import DATASETS, QARecord, load_dataset, load_records, records_digest
from envs.datasets import corpus_path as data_dir_corpus
from envs.retrieval import BACKENDS, DEFAULT_BACKEND, Retriever, SearchHit, get_retriever, is_url
from envs.rewards import RewardFn, exact_match, get_reward_fn, is_valid_format, token_f1

DEFAULT_PROMPT = (
    "Answer the question below. Reason inside <think> and </think> first, and again every time you receive "
    "new information. When you lack some knowledge, call the search engine by writing <search> query "
    "</search>; its top results come back between <information> and </information>. You may search as many "
    "times as you need. Once you know the answer, write it inside <answer> and </answer>, with no "
    "explanation, for example <answer> Beijing </answer>.\nQuestion: {question}\n"
)
INVALID_ACTION = (
    "\n\nInvalid action: {reason}. End each step with exactly one action: <search> query </search> to "
    "search, or <answer> final answer </answer> to answer.\n\n"
)
NO_RESULTS = "No passage matches this query."
MAX_ACTION_CHARS = 1 << 16
MAX_OBSERVATION_CHARS = 1 << 20  # the observation space's floor: prompts and messages fit in it
INFORMATION_TAGS = ("\n\n<information>", "</information>\n\n")  # around a search's passages
RESET_OPTIONS = ("index",)  # the keys reset(options=...) takes

# The first closing action tag ends a step: a generator with stop strings stops exactly there.
_CLOSING_TAG = re.compile(r"</(search|answer)>")


@dataclass(frozen=True)
class ParsedAction:
    """A step's action: ``kind`` is search, answer or invalid; ``step_text`` is the text up to its end."""

    kind: str
    argument: str
    step_text: str
    reason: str = ""


def parse_action(text: str) -> ParsedAction:
    """The first complete ``<search>q</search>`` or ``<answer>a</answer>`` in ``text`` (by its closing tag).

    Text after that closing tag is not part of the step (generation stops there). Anything without a complete
    action, a step longer than the action space's ``MAX_ACTION_CHARS``, or a search with an empty query, is invalid.
    """
    closing = _CLOSING_TAG.search(text)
    step_text = text if closing is None else text[: closing.end()]
    if len(step_text) > MAX_ACTION_CHARS:
        return ParsedAction("invalid", "", step_text, reason=f"the step is longer than {MAX_ACTION_CHARS:,} characters")
    if closing is None:
        return ParsedAction("invalid", "", text, reason="it holds no complete <search> or <answer> tag")
    kind = closing.group(1)
    opening = text.rfind(f"<{kind}>", 0, closing.start())
    if opening < 0:
        return ParsedAction("invalid", "", step_text, reason=f"</{kind}> has no opening <{kind}>")
    argument = text[opening + len(kind) + 2 : closing.start()].strip()
    if kind == "search" and not argument:
        return ParsedAction("invalid", "", step_text, reason="the search query is empty")
    return ParsedAction(kind, argument, step_text)


def first_words(text: str, limit: int | None) -> str:
    """``text`` cut after its first ``limit`` whitespace-separated words (all of it when None), " ..." marking a cut."""
    if limit is None:
        return text
    words = text.split()
    return text if len(words) <= limit else " ".join(words[:limit]) + " ..."


def format_passages(hits: Sequence[SearchHit], max_chars: int, passage_words: int | None = None) -> str:
    """Search results as the observation block: each passage's text cut to its first ``passage_words`` words (None:
    whole), then the block to ``max_chars`` characters in all."""
    body = "\n".join(f"Doc {i}(Title: {hit.title}) {first_words(hit.text, passage_words)}"
                     for i, hit in enumerate(hits, start=1))
    body = body[:max_chars] if body else NO_RESULTS
    return body.join(INFORMATION_TAGS)


class UnicodeText(spaces.Text):
    """Any ``str`` up to ``max_length`` characters (gymnasium's ``Text`` only accepts its charset, by default
    alphanumerics); ``sample()`` draws from a mix of ASCII, accented, CJK and symbol characters."""

    SAMPLE_CHARSET = (
        "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,;:!?'\"()<>/\n\t-_&$%"
        "éèüößçñøåłœ北京東京русскийعربي–—…€£¥©®™🙂"
    )

    def __init__(self, max_length: int, *, min_length: int = 0, seed: int | None = None):
        charset = "".join(dict.fromkeys(self.SAMPLE_CHARSET))  # Text.sample needs distinct characters
        super().__init__(max_length, min_length=min_length, charset=charset, seed=seed)

    def contains(self, x: Any) -> bool:
        return isinstance(x, str) and self.min_length <= len(x) <= self.max_length

    def __repr__(self) -> str:
        return f"UnicodeText({self.max_length}, min_length={self.min_length})"


def _no_vector_form(space: UnicodeText, *args: Any) -> Any:
    raise NotImplementedError(f"{space!r} (free text, any character) has no fixed-size vector form: tokenize the "
                              f"observations (e.g. with the policy's tokenizer) instead of flattening them")


# Gymnasium's Text flattening indexes the sampling charset, which real text leaves (KeyError mid-episode): refused
# up front instead (FlattenObservation calls flatten_space when it is built)
for _flattening in (spaces.utils.flatten_space, spaces.utils.flatdim, spaces.utils.flatten, spaces.utils.unflatten):
    _flattening.register(UnicodeText)(_no_vector_form)


# Async vector envs pass observations through shared memory, which Gymnasium's Text writes by flattening (refused
# above). Per env: one int32 slot for the length, then the code points (any character, NUL and lone surrogates
# included, round-trips).
_CODEC = ("utf-32-le", "surrogatepass")


class SharedTexts(Sequence[str]):
    """The batch of observations in an async vector env's shared memory, decoded when read: the vector env reads
    the memory once when it is built and returns a copy of this view after each reset and step (a tuple of str)."""

    def __init__(self, space: UnicodeText, memory: Any, n: int):
        self.slots = np.frombuffer(memory.get_obj(), dtype=np.int32).reshape(n, space.max_length + 1)

    def __len__(self) -> int:
        return len(self.slots)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return tuple(self[i] for i in range(len(self))[index])
        row = self.slots[index]
        return row[1 : 1 + row[0]].tobytes().decode(*_CODEC)

    def __deepcopy__(self, memo: dict) -> tuple[str, ...]:
        return tuple(self)

    def __repr__(self) -> str:
        return f"SharedTexts({tuple(self)!r})"


@vector_utils.create_shared_memory.register(UnicodeText)
def _create_text_memory(space: UnicodeText, n: int = 1, ctx: Any = multiprocessing) -> Any:
    return ctx.Array(np.dtype(np.int32).char, n * (space.max_length + 1))


@vector_utils.read_from_shared_memory.register(UnicodeText)
def _read_text_memory(space: UnicodeText, shared_memory: Any, n: int = 1) -> SharedTexts:
    return SharedTexts(space, shared_memory, n)


@vector_utils.write_to_shared_memory.register(UnicodeText)
def _write_text_memory(space: UnicodeText, index: int, value: str, shared_memory: Any) -> None:
    if not space.contains(value):
        raise ValueError(f"the observation must be a str of at most {space.max_length:,} characters (the "
                         f"observation space's max_length), got {value!r:.80}")
    width = space.max_length + 1
    row = np.frombuffer(shared_memory.get_obj(), dtype=np.int32)[index * width : (index + 1) * width]
    row[0] = len(value)
    row[1 : 1 + len(value)] = np.frombuffer(value.encode(*_CODEC), dtype=np.int32)


@dataclass(frozen=True)
class SearchQAState:
    """A snapshot of an episode: which question, how far, and the steps so far (immutable, so snapshots
    share their strings; pickled it is a few kB). ``source`` names the questions it indexes: the dataset, the split
    (or data file) and the records' count and digest (``SearchQAEnv.source``)."""

    source: tuple[str, str, str]
    index: int
    turn: int = 0
    tool_calls: int = 0
    done: bool = False
    steps: tuple[tuple[str, str], ...] = field(default=())  # (step text, observation) per step


def searched_corpus(retriever: str | Retriever, corpus_path: str | os.PathLike | None,
                    data_dir: str | os.PathLike | None) -> str | os.PathLike | None:
    """The corpus file a retriever searches: ``corpus_path``, else, for a backend named by ``retriever``, the data
    directory's (a ``MissingDataError`` naming the expected layout where it has none); a retrieval server's URL or a
    ``Retriever`` built already needs none. A ``retriever`` of another type is a ``TypeError``, and a
    ``corpus_path`` with a URL or a ``Retriever`` (which search their own corpus) a ``ValueError``."""
    if not isinstance(retriever, str | Retriever):
        raise TypeError(f"retriever must be a backend name ({', '.join(BACKENDS)}), a retrieval server URL "
                        f"(http://HOST:PORT/retrieve) or an envs.retrieval.Retriever instance (subclass "
                        f"envs.retrieval.base.Retriever for your own), got {type(retriever).__name__}")
    backend = isinstance(retriever, str) and not is_url(retriever)
    if corpus_path is not None and not backend:
        given = f"retriever {retriever!r}" if isinstance(retriever, str) else f"a {type(retriever).__name__}"
        raise ValueError(f"corpus_path must be None with {given}, which searches its own corpus (corpus_path is for "
                         f"the backends {', '.join(BACKENDS)}), got {corpus_path!r}")
    if corpus_path is None and backend:
        return data_dir_corpus(data_dir)
    return corpus_path


class SearchQAEnv(gym.Env[str, str]):
    """Multi-turn question answering with a search tool, for LLM agents.

    ## Description
    Each episode poses one question of a QA dataset. The agent writes one step at a time: free reasoning
    (``<think>..</think>``) ending in an action. ``<search>query</search>`` returns the top-k passages of a
    corpus; ``<answer>text</answer>`` ends the episode. After ``max_turns`` steps one last step is allowed,
    in which search is disabled: an answer is scored, anything else ends the episode unanswered.

    ## Action Space
    ``UnicodeText(65536)``: the step's text. Only the text up to the first ``</search>`` or ``</answer>`` is
    the step; a step without a complete action tag, longer than 65,536 characters, or with an empty query, is an
    invalid action.

    ## Observation Space
    ``UnicodeText(max(1048576, max_obs_chars + 31))``: text to append to the conversation. ``reset`` returns the
    prompt (instructions and question). A search returns
    ``\\n\\n<information>Doc 1(Title: ..) ..\\nDoc 2..</information>\\n\\n`` with each passage's text cut to
    its first ``passage_words`` words (default: whole), then the block to ``max_obs_chars`` characters (default 2000,
    about 500 tokens; the tags add 31); an invalid action returns a message naming the allowed tags; the final step
    returns ``""``.

    ## Rewards
    0 until the last step, then ``reward`` of (answer, gold answers, format valid): by default Search-R1's
    format-aware exact match (1.0 / 0.8 / 0.2 / 0.1 / 0; see ``envs.rewards``); ``"em"``, ``"f1"`` or a
    callable instead.

    ## Episode End
    ``terminated`` when the agent answers; ``truncated`` when the final step (turn ``max_turns + 1``) holds no
    answer: the turn limit is a time limit, as Gymnasium's ``TimeLimit``, since the turn count is not in the
    observation. ``reset``'s ``info`` has ``index`` (the question's position in the split) and ``id`` (its dataset
    id); ``step``'s always has ``action`` (the kind of step the agent wrote: search / answer / invalid; a search
    on the final step runs no search, so count searches with ``tool_calls``), ``turn`` and ``tool_calls``; at the
    end also ``answer`` (None when unanswered), ``em``, ``f1`` and ``format_valid``.

    ## Arguments
    ``dataset`` (a name in ``envs.datasets.DATASETS``), ``split``, ``data_dir`` (default ``$TREEGRPO_DATA_DIR``
    else ``./data``), ``data_file`` (a file in the dataset's format, or a Search-R1 ``.parquet``, instead of the
    split's), ``retriever`` (a backend name, the URL of a retrieval server, or a ``Retriever``), ``corpus_path``
    (default: the data directory's corpus, ``wiki/wiki-18.jsonl`` or ``wiki/paragraphs.jsonl``; not with a URL or
    a ``Retriever``), ``topk`` (3), ``max_turns`` (3), ``reward`` (``"format"``), ``max_obs_chars`` (2000),
    ``passage_words`` (None: whole passages; a word cap per passage keeps a short context whole-passage truncation
    would spend on the first hit), ``prompt_template`` (``DEFAULT_PROMPT``: a ``str.format`` template with the one
    field ``{question}``, checked here), ``render_mode`` (None, or ``"ansi"``: ``render()`` returns the transcript).
    Defaults: ``dataset`` ``"hotpotqa"``, ``split`` ``"train"``, ``retriever`` ``envs.retrieval.DEFAULT_BACKEND``.
    Integer options take any integer (numpy's included), not a bool.

    ## Batched search
    ``prefetch([(state, text), ...])`` searches, in one batch, the queries that stepping each text from its state
    would search; the ``step`` calls that follow take those results from memory. A tree rollout calls it once per
    agent step, so a retrieval server gets one request per agent step rather than one per branch. A search that
    fails (e.g. the server is down after its retries) raises ``envs.retrieval.RetrievalError``: never an empty
    observation.

    ## Snapshots
    ``get_state()`` returns a small immutable :class:`SearchQAState`; ``set_state`` on any env serving the same
    questions (the same dataset and records, whether read from a split or a data file: another world's, or another
    file's, are refused, and so is a malformed snapshot, naming its field) restores the episode exactly: with the
    same settings (``topk``, ``max_turns``, ``max_obs_chars``, ``passage_words``, ``reward``, the corpus), the same
    actions then give the same observations and rewards; an env with other settings goes on under its own (e.g. a
    larger ``max_turns`` allows more steps). A snapshot does not hold the env's random generator: ``set_state``
    leaves it as it was, so the question a later ``reset()`` draws without an ``index`` follows the env's own seed.
    The retriever is shared by every env of a process, never copied.

    ## Version History
    * v0: initial version (``prefetch`` and retrieval servers added later change no observation or reward).
    """

    metadata: ClassVar[dict[str, Any]] = {"render_modes": ["ansi"], "render_fps": 1}

    def __init__(
        self,
        dataset: str = "hotpotqa",
        split: str = "train",
        *,
        data_dir: str | os.PathLike | None = None,
        data_file: str | os.PathLike | None = None,
        retriever: str | Retriever = DEFAULT_BACKEND,
        corpus_path: str | os.PathLike | None = None,
        topk: int = 3,
        max_turns: int = 3,
        reward: str | RewardFn = "format",
        max_obs_chars: int = 2000,
        passage_words: int | None = None,
        prompt_template: str = DEFAULT_PROMPT,
        render_mode: str | None = None,
    ):
        _check_positive(topk=topk, max_turns=max_turns, max_obs_chars=max_obs_chars)
        if passage_words is not None:
            _check_positive(passage_words=passage_words)
        if render_mode is not None and render_mode not in self.metadata["render_modes"]:
            raise ValueError(f"render_mode must be one of {self.metadata['render_modes']} or None, got {render_mode!r}")
        _check_template(prompt_template)
        if dataset not in DATASETS:
            raise ValueError(f"unknown dataset {dataset!r}; known datasets: {', '.join(sorted(DATASETS))}")
        if data_file is not None:
            self.records: Sequence[QARecord] = load_records(data_file, DATASETS[dataset][0])
        else:
            self.records = load_dataset(dataset, split, data_dir)
        corpus = searched_corpus(retriever, corpus_path, data_dir)  # checks the two together
        if isinstance(retriever, str):
            retriever = get_retriever(retriever, corpus)
        self.retriever = retriever
        self._prefetched: dict[str, list[SearchHit]] = {}  # query -> hits, from the last prefetch
        # what a snapshot's index points into, by content (computed once: clones copy it, set_state compares it)
        self.source = (dataset, split if data_file is None else os.fspath(data_file),
                       f"{len(self.records)} records {records_digest(self.records)}")
        self.topk, self.max_turns, self.max_obs_chars = int(topk), int(max_turns), int(max_obs_chars)
        self.passage_words = None if passage_words is None else int(passage_words)
        self.reward_fn = get_reward_fn(reward)
        self.prompt_template = prompt_template
        self.render_mode = render_mode
        # a search's observation is at most max_obs_chars of passages inside the information tags
        self.observation_space = UnicodeText(max(MAX_OBSERVATION_CHARS,
                                                 max_obs_chars + sum(map(len, INFORMATION_TAGS))))
        self.action_space = UnicodeText(MAX_ACTION_CHARS)
        self._state: SearchQAState | None = None

    # -- Gymnasium API ----------------------------------------------------------------------------------------

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict]:
        """Pose question ``options["index"]`` (any integer, numpy's included), or a random one drawn with the env's
        seeded generator; ``index`` is the only option, and any other key is refused by name (options that are not a
        mapping, with a ``TypeError``)."""
        super().reset(seed=seed)
        if options is None:
            options = {}
        elif not isinstance(options, Mapping):
            raise TypeError(f"options must be a dict (e.g. {{'index': 3}}) or None, got {type(options).__name__}")
        unknown = sorted(map(repr, set(options) - set(RESET_OPTIONS)))
        if unknown:
            raise ValueError(f"unknown reset option {', '.join(unknown)}; known: {', '.join(RESET_OPTIONS)}")
        if "index" in options:
            index = self._checked_index(options["index"], "options['index']")
        else:
            index = int(self.np_random.integers(len(self.records)))
        self._state = SearchQAState(source=self.source, index=index)
        return self.prompt, {"index": index, "id": self.record.id}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        state = self._require_state()
        if state.done:
            raise RuntimeError("the episode is over: call reset() before step()")
        if not isinstance(action, str):
            raise TypeError(f"the action must be a str (the step's text), got {type(action).__name__}")
        parsed = parse_action(action)
        turn = state.turn + 1
        final_turn = turn > self.max_turns
        tool_calls = state.tool_calls
        info: dict[str, Any] = {"action": parsed.kind, "turn": turn}
        if parsed.kind == "answer" or final_turn:
            observation, done = "", True
        elif parsed.kind == "search":
            hits = self._prefetched.get(parsed.argument)
            if hits is None:
                hits = self.retriever.search([parsed.argument], k=self.topk)[0]
            observation = format_passages(hits, self.max_obs_chars, self.passage_words)
            done, tool_calls = False, tool_calls + 1
        else:
            observation, done = INVALID_ACTION.format(reason=parsed.reason), False
        steps = (*state.steps, (parsed.step_text, observation))
        self._state = SearchQAState(state.source, state.index, turn, tool_calls, done, steps)
        info["tool_calls"] = tool_calls
        reward = 0.0
        if done:
            answer = parsed.argument if parsed.kind == "answer" else None
            reward = self._score(answer, steps, info)
        return observation, reward, done and parsed.kind == "answer", done and parsed.kind != "answer", info

    def render(self) -> str | None:
        """The transcript so far: prompt, then each step and its observation (``render_mode="ansi"``)."""
        if self.render_mode is None:
            gym.logger.warn("render() called without a render_mode; pass render_mode='ansi' to gym.make")
            return None
        state = self._require_state()
        return self.prompt + "".join(text + obs for text, obs in state.steps)

    def prefetch(self, steps: Sequence[tuple[SearchQAState, str]]) -> None:
        """Search, in one batch, the query of every (state, action text) whose ``step`` would search (see the class
        docstring); the results replace those of the previous prefetch."""
        queries = []
        for state, text in steps:
            action = parse_action(text)
            if action.kind == "search" and not state.done and state.turn < self.max_turns:
                queries.append(action.argument)
        unique = list(dict.fromkeys(queries))
        self._prefetched = dict(zip(unique, self.retriever.search(unique, k=self.topk), strict=True)) if unique else {}

    # -- Snapshots --------------------------------------------------------------------------------------------

    def get_state(self) -> SearchQAState:
        """A snapshot of the episode (question, turn, tool calls, steps), restorable with ``set_state`` on any env
        serving the same questions; not of the env's random generator, which ``set_state`` leaves as it was."""
        return self._require_state()

    def set_state(self, state: SearchQAState) -> None:
        """Restore the episode of ``state``: a ``TypeError`` unless it is a ``SearchQAState``, a ``ValueError``
        naming the field where it indexes other questions or is malformed (see ``_checked_state``)."""
        if not isinstance(state, SearchQAState):
            raise TypeError(f"set_state takes a SearchQAState, got {type(state).__name__}")
        self._state = self._checked_state(state)

    # -- Helpers ----------------------------------------------------------------------------------------------

    @property
    def record(self) -> QARecord:
        """The current question with its gold answers (for evaluation and oracles, not for the agent)."""
        return self.records[self._require_state().index]

    @property
    def prompt(self) -> str:
        question = self.record.question.strip()
        return self.prompt_template.format(question=question if question.endswith("?") else question + "?")

    def _checked_index(self, index: Any, name: str) -> int:
        """``index`` as an int when it is an integer (not a bool) of a question of this env, else a ValueError naming
        ``name``."""
        if isinstance(index, bool) or not isinstance(index, numbers.Integral) or not 0 <= index < len(self.records):
            raise ValueError(f"{name} must be an int in [0, {len(self.records)}), got {index!r}")
        return int(index)

    def _checked_state(self, state: SearchQAState) -> SearchQAState:
        """``state`` with Python ints, when it is one this env's ``step`` could have made from its questions: a
        ``source`` of three str naming the same dataset and records, an ``index`` of a question, ``turn`` and
        ``tool_calls`` non-negative ints with ``tool_calls <= turn``, ``turn`` (text, observation) str pairs as
        ``steps`` and a bool ``done``; else a ``ValueError`` naming the field. (A snapshot may be built by hand or
        unpickled from elsewhere: a malformed one would fail later, mid-episode.)"""
        source = state.source
        if not (isinstance(source, tuple) and len(source) == 3 and all(isinstance(part, str) for part in source)):
            raise ValueError(f"the state's source must be a tuple of 3 str (dataset, split or data file, records), "
                             f"got {source!r}")
        if (source[0], source[2]) != (self.source[0], self.source[2]):  # the split or file may differ
            raise ValueError(f"the state is from {source}, this env serves {self.source}: other questions")
        index = self._checked_index(state.index, "the state's index")
        for name in ("turn", "tool_calls"):
            value = getattr(state, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
                raise ValueError(f"the state's {name} must be a non-negative int, got {value!r}")
        if state.tool_calls > state.turn:
            raise ValueError(f"the state's tool_calls must be at most its turn ({state.turn}), got {state.tool_calls}")
        steps = state.steps
        if not (isinstance(steps, tuple) and all(isinstance(step, tuple) and len(step) == 2
                                                 and all(isinstance(text, str) for text in step) for step in steps)):
            raise ValueError(f"the state's steps must be a tuple of (step text, observation) str pairs, got "
                             f"{steps!r:.200}")
        if len(steps) != state.turn:
            raise ValueError(f"the state's steps must hold one (step text, observation) pair per turn ({state.turn}), "
                             f"got {len(steps)}")
        if not isinstance(state.done, bool):
            raise ValueError(f"the state's done must be a bool, got {state.done!r}")
        return SearchQAState(source, index, int(state.turn), int(state.tool_calls), state.done, steps)

    def _require_state(self) -> SearchQAState:
        if self._state is None:
            raise RuntimeError("call reset() before using the environment")
        return self._state

    def _score(self, answer: str | None, steps: tuple[tuple[str, str], ...], info: dict) -> float:
        golds = self.record.answers
        format_valid = is_valid_format("".join(text + obs for text, obs in steps))
        info.update(
            answer=answer,
            em=0.0 if answer is None else exact_match(answer, golds),
            f1=0.0 if answer is None else token_f1(answer, golds),
            format_valid=format_valid,
        )
        return float(self.reward_fn(answer, golds, format_valid))


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")


def _check_template(template: Any) -> None:
    """A ``TypeError`` unless ``template`` is a str, a ``ValueError`` unless it formats with the one field
    ``question`` (literal braces doubled), used as it is (no attribute or item of it)."""
    if not isinstance(template, str):
        raise TypeError(f"prompt_template must be a str (a str.format template whose one field is {{question}}), "
                        f"got {type(template).__name__}")
    try:
        template.format(question="")
        fields = {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
    except (KeyError, IndexError, ValueError, AttributeError) as error:
        raise ValueError(f"prompt_template must be a str.format template whose one field is {{question}} (write "
                         f"literal braces as {{{{ }}}}): {type(error).__name__}: {error}") from None
    if fields != {"question"}:
        raise ValueError(f"prompt_template must contain '{{question}}' and no other field, got fields "
                         f"{sorted(fields)}")
