"""Baseline agents in plain Gymnasium loops: the envs need nothing from our RL code to be used.

    python experiments/baselines.py                       # every env's evaluation split, all agents
    python experiments/baselines.py --envs HotpotQA-v0 --limit 100 --agents oracle

Agents:
- ``random``: each step, at random, searches a few words of the question, answers a few, or writes noise.
- ``no_search``: answers at once, always "yes" (the prior of HotpotQA's comparison questions).
- ``oracle``: searches the gold supporting titles (the question itself when a dataset has none), then answers
  the gold answer in the agent format. Its EM must be 1.0 and its reward 1.0: a check of the env's plumbing;
  its "gold hit" column is the share of its title searches whose gold passage came back.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import gymnasium as gym
from tqdm import tqdm

import envs
from envs.datasets import QARecord


class Agent(Protocol):
    """A text agent: told the prompt and (for oracles) the record at the start, then acts on observations."""

    def start(self, prompt: str, record: QARecord) -> None: ...

    def act(self, observation: str) -> str: ...


# With ``cite``, the words each thought of the oracle opens with: its decision, before the quote it cites.
SEARCH_DECISION = "I need to search"
ANSWER_DECISION = "I can answer"


def in_format(thought: str, action: str, argument: str) -> str:
    return f"<think>{thought}</think>\n<{action}> {argument} </{action}>"


# A retrieved passage's header; its title may hold a parenthetical ("Doc 1(Title: Fire (1996 film)) ...").
PASSAGE_HEADER = r"Doc \d+\(Title: (?:[^()]|\([^()]*\))*\) "


def passage_sentences(observation: str) -> list[str]:
    """The sentences of the retrieved passages in ``observation``, in order (the "Doc k(Title: ...)" headers left
    out)."""
    texts = re.findall(rf"{PASSAGE_HEADER}(.*?)(?=\n{PASSAGE_HEADER}|</information>|$)", observation, flags=re.S)
    return [part for text in texts for part in re.split(r"(?<=\.) ", text.strip())]


def sentence_ending_with(observation: str, words: str) -> str | None:
    """The last sentence of the retrieved passages in ``observation`` that ends with ``words`` (without its full
    stop), or None."""
    sentences = passage_sentences(observation)
    return next((part[:-1] for part in reversed(sentences) if part == f"{words}." or part.endswith(f" {words}.")),
                None)


def mention(text: str, words: str) -> re.Match | None:
    """Where ``text`` names ``words`` as whole words (case-insensitive: "no" is not named by "known"), or None."""
    return re.search(rf"(?<!\w){re.escape(words)}(?!\w)", text, flags=re.IGNORECASE)


def sentence_naming(observations: Sequence[str], words: str, max_words: int = 30) -> str | None:
    """The first sentence of the retrieved passages that names ``words`` (``mention``), the latest observation
    first, without its full stop; a longer one than ``max_words`` words cut to that many around the first mention.
    None when no passage names them."""
    for observation in reversed(observations):
        for sentence in passage_sentences(observation):
            named = mention(sentence, words)
            if named is None:
                continue
            at = named.start()
            tokens = sentence.rstrip(".").split()
            if len(tokens) <= max_words:
                return " ".join(tokens)
            first = len(sentence[:at].split())
            start = max(0, min(first - max_words // 2, len(tokens) - max_words))
            return " ".join(tokens[start:start + max_words])
    return None


def without_qualifier(title: str) -> str:
    """A Wikipedia title without its closing parenthetical ("Fire (film)" -> "Fire"): how a passage names it."""
    return re.sub(r"\s*\([^)]*\)$", "", title).strip() or title


def named_form(title: str, texts: Sequence[str]) -> str | None:
    """How ``texts`` name ``title`` (``mention``): the title, else the title without its qualifier; None when they
    name neither."""
    read = " ".join(texts)
    return next((form for form in (title, without_qualifier(title)) if mention(read, form)), None)


def reading_order(question: str, titles: Sequence[str]) -> list[str]:
    """``titles`` with those the question names first (stably): a reader can search those before reading anything."""
    return sorted(titles, key=lambda title: named_form(title, [question]) is None)


class RandomAgent:
    def __init__(self, seed: int):
        self.rng = random.Random(seed)

    def start(self, prompt: str, record: QARecord) -> None:
        self.words = record.question.rstrip("?").split() or ["nothing"]

    def act(self, observation: str) -> str:
        words = self.rng.sample(self.words, k=min(len(self.words), self.rng.randint(1, 4)))
        choice = self.rng.random()
        if choice < 0.45:
            return in_format("let me look this up", "search", " ".join(words))
        if choice < 0.8:
            return in_format("I will guess", "answer", " ".join(words))
        return " ".join(words)


class NoSearchAgent:
    def start(self, prompt: str, record: QARecord) -> None:
        pass

    def act(self, observation: str) -> str:
        return in_format("I answer from memory", "answer", "yes")


class OracleAgent:
    """Searches the gold supporting titles in turn, then answers the gold answer. With ``restate``, the thought
    before each search restates the sentence of the last observation that ends with the query, where one does
    ("The chair of Tosafen Works is Jose" before searching Jose): a policy trained on it writes the role it
    follows and then copies the passage's own continuation of those words (SynthBranch's ``passages="roles"``).
    ``goals`` maps k to words the thought before the k-th search (from 0) states, after its restated sentence where
    it has one ("I need the chair of Tosafen Works": a plan that later thoughts can copy). With ``cite`` (real
    questions), the thought before each later search and before the answer quotes the passage sentence that names
    the next query or the answer, as the passage states it ("Modern Men's pilot featured Wendie Malick as the life
    coach" before searching Wendie Malick): what the next action copies is written down first. Each of its thoughts
    opens with the decision (``SEARCH_DECISION`` or ``ANSWER_DECISION``), the quote after it: a small model copies a
    quote poorly and falls back on the commonest opening, so the choice between searching and answering is written
    first, in words that do not depend on the quote. With ``read`` (real
    questions), it searches first the titles the question names and writes each query as the question or a passage
    read before names it (``named_form``); ``unread`` counts the queries and answers named nowhere before them (a
    policy could not have read them: a trajectory to skip)."""

    def __init__(self, max_searches: int, restate: bool = False, goals: Mapping[int, str] | None = None,
                 cite: bool = False, read: bool = False):
        self.max_searches = max_searches
        self.restate = restate
        self.cite = cite
        self.read = read
        self.goals = dict(goals or {})
        self.searched = self.found = self.unread = 0

    def start(self, prompt: str, record: QARecord) -> None:
        self.record = record
        titles = list(record.supporting_titles[: self.max_searches])
        self.queries = (reading_order(record.question, titles) if self.read else titles) or [record.question]
        self.issued = 0  # searches written so far: the next one's index in ``goals``
        self.pending: str | None = None
        self.observations: list[str] = []

    def act(self, observation: str) -> str:
        if self.pending is not None:
            self.observations.append(observation)
            if self.record.supporting_titles:
                self.searched += 1
                self.found += f"(Title: {self.pending})" in observation
        if self.queries:
            self.pending = self.queries.pop(0)
            query = self.pending
            if self.read:
                named = named_form(self.pending, [self.record.question, *self.observations])
                self.unread += named is None
                query = named or self.pending
            sentence = (sentence_ending_with(observation, query) if self.restate else
                        sentence_naming(self.observations, query) if self.cite else None)
            goal = self.goals.get(self.issued)
            self.issued += 1
            parts = (SEARCH_DECISION if self.cite else None, sentence, goal)
            thought = ". ".join(part for part in parts if part) or "I need this passage"
            return in_format(thought, "search", query)
        answer = self.record.answers[0]
        if self.read and answer in self.record.named_answers:
            self.unread += named_form(answer, self.observations) is None
        if self.cite:  # a comparison's verdict (yes / no) is named by no passage: nothing to quote
            sentence = sentence_naming(self.observations, answer) if answer in self.record.named_answers else None
            return in_format(". ".join(part for part in (ANSWER_DECISION, sentence) if part), "answer", answer)
        return in_format("I have what I need", "answer", answer)


@dataclass
class Summary:
    env_id: str
    split: str
    agent: str
    episodes: int = 0
    em: float = 0.0
    f1: float = 0.0
    reward: float = 0.0
    tool_calls: float = 0.0
    turns: float = 0.0
    gold_hit: float | None = None

    def add(self, info: dict, reward: float) -> None:
        self.episodes += 1
        for key, value in (("em", info["em"]), ("f1", info["f1"]), ("reward", reward),
                           ("tool_calls", info["tool_calls"]), ("turns", info["turn"])):
            setattr(self, key, getattr(self, key) + value)

    def means(self) -> dict:
        n = max(self.episodes, 1)
        row = {"env": self.env_id, "split": self.split, "agent": self.agent, "n": self.episodes}
        row.update({key: getattr(self, key) / n for key in ("em", "f1", "reward", "tool_calls", "turns")})
        row["gold_hit"] = self.gold_hit
        return row


def run_episode(env: gym.Env, agent: Agent, index: int) -> tuple[dict, float]:
    observation, _ = env.reset(options={"index": index})
    agent.start(observation, env.unwrapped.record)
    while True:
        observation, reward, terminated, truncated, info = env.step(agent.act(observation))
        if terminated or truncated:
            return info, reward


def evaluate(env_ids: list[str], agents: dict[str, Callable[[], Agent]], limit: int | None, **env_kwargs) -> list[dict]:
    jobs = []
    for env_id in env_ids:
        env = gym.make(env_id, split=envs.eval_split(env_id), **env_kwargs)
        jobs.append((env_id, env, min(len(env.unwrapped.records), limit or len(env.unwrapped.records))))
    rows = []
    with tqdm(total=sum(n for *_, n in jobs) * len(agents), desc="episodes", unit="ep", file=sys.stderr) as bar:
        for env_id, env, n in jobs:
            for name, make_agent in agents.items():
                agent, summary = make_agent(), Summary(env_id, envs.eval_split(env_id), name)
                for index in range(n):
                    summary.add(*run_episode(env, agent, index))
                    bar.update()
                if isinstance(agent, OracleAgent) and agent.searched:
                    summary.gold_hit = agent.found / agent.searched
                rows.append(summary.means())
    return rows


def markdown_table(rows: list[dict]) -> str:
    lines = ["| env | split | agent | n | EM | F1 | reward | tool calls | turns | gold hit |", "|" + "---|" * 10]
    for r in rows:
        hit = "" if r["gold_hit"] is None else f"{r['gold_hit']:.3f}"
        lines.append(f"| {r['env']} | {r['split']} | {r['agent']} | {r['n']} | {r['em']:.3f} | {r['f1']:.3f} | "
                     f"{r['reward']:.3f} | {r['tool_calls']:.2f} | {r['turns']:.2f} | {hit} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--envs", nargs="+", default=list(envs.ENV_IDS), choices=list(envs.ENV_IDS))
    parser.add_argument("--agents", nargs="+", default=["random", "no_search", "oracle"],
                        choices=["random", "no_search", "oracle"])
    parser.add_argument("--limit", type=int, default=None, help="questions per env (default: all)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random agent")
    parser.add_argument("--max-turns", type=int, default=3)
    parser.add_argument("--topk", type=int, default=3)
    parser.add_argument("--retriever", default="bm25",
                        help="retrieval backend: bm25, rank_bm25, dense, or a retrieval server's URL")
    parser.add_argument("--data-dir", default=None, help="default: $TREEGRPO_DATA_DIR, else ./data")
    parser.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = parser.parse_args(argv)

    factories: dict[str, Callable[[], Agent]] = {
        "random": lambda: RandomAgent(args.seed),
        "no_search": NoSearchAgent,
        "oracle": lambda: OracleAgent(args.max_turns),
    }
    rows = evaluate(args.envs, {name: factories[name] for name in args.agents}, args.limit,
                    max_turns=args.max_turns, topk=args.topk, retriever=args.retriever, data_dir=args.data_dir)
    print(markdown_table(rows))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
