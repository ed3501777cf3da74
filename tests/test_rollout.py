"""Tree rollouts over env snapshots: shapes, exact env clones, token trajectories,
prefix reuse and what a tree costs per leaf against chains."""

from __future__ import annotations

from dataclasses import replace

import gymnasium as gym
import numpy as np
import pytest
import torch

import envs  # noqa: F401  (registers the env ids)
from algos.batch import leaf_records
from algos.branching import ENTROPY_TOKENS
from algos.evaluation import ANSWER, QUERIES, greedy_chains
from algos.rollout import CONTEXT_FULL, TreeRollout, TreeShape, names_any
from algos.tree import Node
from envs.datasets import QARecord
from envs.retrieval import Retriever, get_retriever
from policies.generation import (
    GenerationCounters,
    SamplingSettings,
    StepOutput,
    observation_ids,
    prompt_ids,
)
from policies.hf_generation import EngineLimits, HFStepGenerator
from policies.models import load_model
from policies.trajectory import TokenTrajectory


@pytest.fixture(scope="module")
def tiny():
    model, tokenizer = load_model("tiny-random", seed=0)
    return model.eval(), tokenizer


def grow(tiny, shape: TreeShape, prompts=(0, 1), seed: int = 0, keep_cache: bool = True,
         limits: EngineLimits | None = None):
    model, tokenizer = tiny
    env = gym.make("HotpotQA-v0", split="dev")
    generator = HFStepGenerator(model, tokenizer, SamplingSettings(max_step_tokens=12), keep_cache=keep_cache,
                               limits=limits)
    rollout = TreeRollout(env, generator, tokenizer, seed=seed)
    return rollout.grow(list(prompts), shape), rollout, generator


@pytest.fixture(scope="module")
def grown(tiny, data_dir):
    return grow(tiny, TreeShape(2, 2, 1))


def test_leaves_per_prompt(grown):
    trees, rollout, generator = grown
    assert len(trees) == 4 and [t.prompt_index for t in trees] == [0, 0, 1, 1]
    assert [t.tree_id for t in trees] == [0, 1, 0, 1]
    leaves = [leaf for tree in trees for leaf in tree.leaves()]
    assert len(leaves) == 2 * TreeShape(2, 2, 1).leaves_per_prompt == 12
    assert rollout.counters.leaves == 12 and rollout.counters.trees == 4
    assert generator.counters.llm_calls == rollout.counters.env_steps == sum(len(t.nodes()) - 1 for t in trees)
    assert all(node.cache is None for tree in trees for node in tree.nodes())  # freed after growing


def full_forward_logprobs(model, token_ids: tuple[int, ...]) -> torch.Tensor:
    """log p(token t | tokens < t) for t >= 1, from one plain forward of the whole sequence (no cache, no engine):
    at temperature 1 the distribution the sampler records its log-probs from."""
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([token_ids])).logits[0, :-1].float(), dim=-1)
    return logp.gather(-1, torch.tensor(token_ids[1:])[:, None]).squeeze(-1)


def test_leaf_trajectories_are_token_exact(grown, tiny):
    model, tokenizer = tiny
    trees, _, _ = grown
    env = gym.make("HotpotQA-v0", split="dev").unwrapped
    for tree in trees:
        prompt, _ = env.reset(options={"index": tree.prompt_index})
        for leaf in tree.leaves():
            expected = TokenTrajectory.from_prompt(prompt_ids(tokenizer, prompt))
            for node in leaf.path()[1:]:
                start = len(node.parent.trajectory)
                step = node.trajectory.token_ids[start:]
                generated = node.trajectory.generated_mask[start:]
                n_gen = sum(generated)
                assert n_gen > 0 and all(generated[:n_gen]) and not any(generated[n_gen:])  # step, then observation
                assert step[n_gen:] == observation_ids(tokenizer, node.observation)
                expected = TokenTrajectory(expected.token_ids + step, expected.generated_mask + generated, ())
            trajectory = leaf.trajectory
            assert trajectory.token_ids == expected.token_ids
            assert trajectory.generated_mask == expected.generated_mask
            # the sampling log-probs, recomputed independently: one full forward of the leaf's tokens
            sampled = torch.tensor(trajectory.sampling_logprobs, dtype=torch.float32)
            mask = torch.tensor(trajectory.generated_mask)
            assert len(sampled) == len(mask) and mask[0].item() is False  # the prompt's first token is never sampled
            reference = full_forward_logprobs(model, trajectory.token_ids)
            torch.testing.assert_close(sampled[1:][mask[1:]], reference[mask[1:]], atol=1e-4, rtol=0)
            assert sampled[~mask].abs().sum() == 0  # prompt and observation tokens carry none


def test_env_clones_see_what_the_path_saw(grown):
    # Replaying a leaf's step texts in a fresh env reproduces every observation, the reward and the info.
    trees, _, _ = grown
    env = gym.make("HotpotQA-v0", split="dev").unwrapped
    for tree in trees:
        for leaf in tree.leaves():
            env.reset(options={"index": tree.prompt_index})
            for node in leaf.path()[1:]:
                observation, reward, terminated, truncated, info = env.step(node.text)
                assert (observation, reward, info) == (node.observation, node.reward, node.info)
            assert terminated or truncated


def test_expansions_share_prefixes(grown):
    trees, _, generator = grown
    for tree in trees:
        assert len(tree.leaves()) == 3
        forks = [node for node in tree.nodes() if len(node.children) > 1]
        assert forks and sum(len(node.children) - 1 for node in forks) == 2  # N x L expansions, one branch each
        for node in tree.nodes()[1:]:  # a child continues its parent's exact tokens, masks and log-probs
            parent, n = node.parent.trajectory, len(node.parent.trajectory)
            assert len(node.trajectory) > n
            assert node.trajectory.token_ids[:n] == parent.token_ids
            assert node.trajectory.generated_mask[:n] == parent.generated_mask
            assert node.trajectory.sampling_logprobs[:n] == parent.sampling_logprobs
    # Every branch hits its node's cache: the prompt is prefilled once for the M trees that share it (all but its
    # last token), and a step from a node prefills only what the node's cache lacks: the node's last sampled token
    # and its observation. Without reuse, every step would prefill its node's whole context.
    steps = [node for tree in trees for node in tree.nodes()[1:]]
    prompts = sum(len(tree.root.trajectory) - 1 for tree in trees if tree.tree_id == 0)
    uncached = sum(1 + observation_length(node.parent) for node in steps)
    assert generator.counters.tokens_prefilled == prompts + uncached
    assert prompts + uncached < 0.5 * sum(len(node.parent.trajectory) for node in steps)


def observation_length(node: Node) -> int:
    """How many observation tokens ``node``'s step appended after its generated ones (0 for the root)."""
    if node.parent is None:
        return 0
    step = node.trajectory.generated_mask[len(node.parent.trajectory):]
    return len(step) - sum(step)


def test_no_leaf_outgrows_the_context_cap(tiny, data_dir):
    model, tokenizer = tiny
    env = gym.make("HotpotQA-v0", split="dev")
    prompt = max(len(prompt_ids(tokenizer, env.reset(options={"index": i})[0])) for i in (0, 1))
    cap = prompt + 12 + 4  # a first step, then room for no observation (the invalid-action message is longer)
    generator = HFStepGenerator(model, tokenizer, SamplingSettings(max_step_tokens=12, max_context_tokens=cap))
    trees = TreeRollout(env, generator, tokenizer, seed=0).grow([0, 1], TreeShape(2, 2, 1))
    leaves = [leaf for tree in trees for leaf in tree.leaves()]
    assert all(len(leaf.trajectory) <= cap for leaf in leaves)
    cut = [leaf for leaf in leaves if leaf.info.get(CONTEXT_FULL)]
    assert cut and all(leaf.reward == 0.0 and not leaf.observation and observation_length(leaf) == 0 for leaf in cut)
    # without the cap the same trees read observations: it is the cap that cut them
    free = HFStepGenerator(model, tokenizer, SamplingSettings(max_step_tokens=12))
    uncut = TreeRollout(env, free, tokenizer, seed=0).grow([0, 1], TreeShape(2, 2, 1))
    assert not any(leaf.info.get(CONTEXT_FULL) for tree in uncut for leaf in tree.leaves())
    assert max(len(leaf.trajectory) for tree in uncut for leaf in tree.leaves()) > cap


def test_chain_shape_and_cost(tiny, data_dir):
    trees, rollout, _ = grow(tiny, TreeShape(3, 0, 0), prompts=(0,))
    assert len(trees) == 3 and all(len(t.leaves()) == 1 and len(t.expansion_candidates()) == len(t.nodes()) - 1
                                   for t in trees)
    assert rollout.counters.leaves == 3


def test_prefix_reuse_saves_prefill(tiny, data_dir):
    _, _, with_cache = grow(tiny, TreeShape(2, 2, 1), prompts=(0,), seed=3)
    _, _, without = grow(tiny, TreeShape(2, 2, 1), prompts=(0,), seed=3, keep_cache=False)
    assert with_cache.counters.tokens_prefilled < 0.5 * without.counters.tokens_prefilled


def test_same_seed_same_trees(tiny, data_dir):
    def signature(trees):
        return [(leaf.trajectory.token_ids, leaf.reward) for tree in trees for leaf in tree.leaves()]

    first, _, _ = grow(tiny, TreeShape(2, 1, 1), prompts=(2,), seed=5)
    again, _, _ = grow(tiny, TreeShape(2, 1, 1), prompts=(2,), seed=5)
    other, _, _ = grow(tiny, TreeShape(2, 1, 1), prompts=(2,), seed=6)
    assert signature(first) == signature(again) != signature(other)


def test_trees_do_not_depend_on_how_steps_were_batched(tiny, data_dir):
    # one row at a time (no batching at all), or without cache reuse: the same trees, children in the same order
    def signature(trees):
        return [(node.trajectory.token_ids, node.reward, node.lineage) for tree in trees for node in tree.nodes()]

    batched, _, generator = grow(tiny, TreeShape(2, 1, 2), prompts=(4,), seed=1)
    serial, _, serial_generator = grow(tiny, TreeShape(2, 1, 2), prompts=(4,), seed=1, limits=EngineLimits(max_rows=1))
    uncached, _, _ = grow(tiny, TreeShape(2, 1, 2), prompts=(4,), seed=1, keep_cache=False)
    assert signature(batched) == signature(serial) == signature(uncached)
    assert generator.counters.forward_passes < serial_generator.counters.forward_passes


def test_budget_counters(grown):
    _, rollout, generator = grown
    counters = rollout.counters
    assert counters.prompts == 2 and counters.total_tokens == generator.counters.tokens_generated
    chain = counters.chain_tokens / 4  # 4 initial chains
    assert counters.budget_measured == pytest.approx(counters.total_tokens / chain / 2)
    assert 2 <= counters.budget_measured <= 6  # between the M chains alone and 6 full chains
    assert TreeShape(2, 2, 1).budget_estimate == 4.0 and TreeShape(4, 5, 1).budget_estimate == 14.0


def test_tree_shape_validates():
    assert TreeShape(2, 2, 1).leaves_per_prompt == 6 and TreeShape(4, 5, 1).leaves_per_prompt == 24
    with pytest.raises(ValueError, match="tree shape"):
        TreeShape(0, 2, 1)
    with pytest.raises(ValueError, match="tree shape"):
        TreeShape(2, 0, 1)


# -- rollout accounting with a scripted policy (searches, then answers) ---------------------------------------


class ScriptedGenerator:
    """A policy stand-in: each step searches a random word until its third step, then answers; every poll
    returns the steps submitted since the last one."""

    def __init__(self, tokenizer, seed: int):
        self.tokenizer, self.rng = tokenizer, np.random.default_rng(seed)
        self.counters = GenerationCounters()
        self.settings = SamplingSettings()
        self.words = ["album", "rapper", "film", "river", "novel", "king", "city", "band"]
        self.queue = []
        self.answer = "x"

    def prefix_cache(self, token_ids):
        return None

    @property
    def pending(self):
        return len(self.queue)

    def submit(self, branch, tag):
        self.queue.append((branch, tag))

    def poll(self):
        outputs, self.queue = [(tag, self._step(branch)) for branch, tag in self.queue], []
        return outputs

    def _step(self, branch):
        steps_so_far = self.tokenizer.decode(branch.token_ids).count("<think>go</think>")
        word = self.words[self.rng.integers(len(self.words))]
        text = f"<think>go</think><search>{word}</search>" if steps_so_far < 2 else f"<answer>{self.answer}</answer>"
        ids = tuple(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        self.counters.tokens_generated += len(ids)
        self.counters.llm_calls += 1
        return StepOutput(ids, (0.0,) * len(ids), "stop", None)


class UncertainAfterFirstSearch(ScriptedGenerator):
    """The scripted policy, measuring step entropies: the step after the first search is the uncertain one (2.0,
    every other 0.1)."""

    def __init__(self, tokenizer, seed: int, entropy_tokens: int = ENTROPY_TOKENS):
        super().__init__(tokenizer, seed)
        self.settings = SamplingSettings(entropy_tokens=entropy_tokens)

    def _step(self, branch):
        after_first_search = self.tokenizer.decode(branch.token_ids).count("<think>go</think>") == 1
        return replace(super()._step(branch), entropy=2.0 if after_first_search else 0.1)


def test_an_entropy_rollout_expands_after_the_uncertain_tool_call(tiny, data_dir):
    _, tokenizer = tiny
    env = gym.make("HotpotQA-v0", split="dev")
    trees = TreeRollout(env, UncertainAfterFirstSearch(tokenizer, 0), tokenizer, seed=0, branching="entropy").grow(
        [0, 1], TreeShape(2, 1, 1))
    for tree in trees:
        first_search = tree.root.children[0]
        assert [child.entropy for child in first_search.children] == [2.0, 2.0]  # the expansion grew from here
        assert len(tree.root.children) == 1 and len(tree.leaves()) == 2
    with pytest.raises(ValueError, match="branching 'entropy' needs the entropy of each step's first 20 tokens"):
        TreeRollout(env, UncertainAfterFirstSearch(tokenizer, 0, entropy_tokens=0), tokenizer, branching="entropy")


def test_an_at_depth_rollout_expands_the_step_after_the_first_search(tiny, data_dir):
    _, tokenizer = tiny
    env = gym.make("HotpotQA-v0", split="dev")
    trees = TreeRollout(env, ScriptedGenerator(tokenizer, 0), tokenizer, seed=0, branching="at_depth_1").grow(
        [0, 1], TreeShape(1, 2, 1))
    for tree in trees:  # the chain searched twice, then answered: both expansions re-draw its second step
        (first_search,) = tree.root.children
        assert len(first_search.children) == 3 and len(tree.leaves()) == 3
        assert sum(node.depth == 2 for node in tree.nodes()) == 3


class SearchesFirst(ScriptedGenerator):
    """The scripted policy, whose first search is ``query``."""

    def __init__(self, tokenizer, seed: int, query: str):
        super().__init__(tokenizer, seed)
        self.query = query

    def _step(self, branch):
        if "<think>go</think>" in self.tokenizer.decode(branch.token_ids):  # searched already
            return super()._step(branch)
        ids = tuple(self.tokenizer(f"<think>go</think><search>{self.query}</search>", add_special_tokens=False)[
            "input_ids"])
        return StepOutput(ids, (0.0,) * len(ids), "stop", None)


def test_expansions_are_counted_with_those_made_before_an_observation_named_the_answer(tiny, data_dir):
    """Dev question 2's answer is Art Bell: a first search for him reads it before the expansion after it; one for
    an unrelated word does not. A yes / no answer (question 5 is not one) is named by no passage: not counted."""
    _, tokenizer = tiny
    env = gym.make("HotpotQA-v0", split="dev")
    for query, before in (("Art Bell", 0), ("zebra quartz violin", 2)):
        rollout = TreeRollout(env, SearchesFirst(tokenizer, 0, query), tokenizer, seed=0, branching="at_depth_1")
        rollout.grow([2], TreeShape(1, 2, 1))
        assert (rollout.counters.expansions, rollout.counters.expansions_before_answer_read) == (2, before)
    verdict_and_name = QARecord("q", "Who?", ("Yes", "Art Bell"))
    assert verdict_and_name.named_answers == ("Art Bell",) and QARecord("q", "Who?", ("no",)).named_answers == ()
    assert names_any(["x", "met ART BELL"], ["Art Bell"]) and not names_any(["x"], ["Art Bell"])


class SlowPromptGenerator(ScriptedGenerator):
    """The scripted policy, but a step of prompt 1's trees takes 6 polls (prompt 0's: one); records when each
    step was submitted."""

    def __init__(self, tokenizer, seed: int, slow_prompt: tuple[int, ...]):
        super().__init__(tokenizer, seed)
        self.slow_prompt, self.polls, self.log = slow_prompt, 0, []

    def submit(self, branch, tag):
        slow = branch.token_ids[: len(self.slow_prompt)] == self.slow_prompt
        self.log.append((self.polls, slow))
        self.queue.append((branch, tag, self.polls + (6 if slow else 1)))

    def poll(self):
        self.polls += 1
        ready = [(tag, self._step(branch)) for branch, tag, due in self.queue if due <= self.polls]
        self.queue = [item for item in self.queue if item[2] > self.polls]
        return ready


def test_a_tree_expands_as_soon_as_its_own_chains_end(tiny, data_dir):
    _, tokenizer = tiny
    env = gym.make("HotpotQA-v0", split="dev")
    slow_prompt = prompt_ids(tokenizer, env.unwrapped.reset(options={"index": 1})[0])
    generator = SlowPromptGenerator(tokenizer, 0, slow_prompt)
    trees = TreeRollout(env, generator, tokenizer, seed=0).grow([0, 1], TreeShape(2, 2, 1))
    assert all(len(tree.leaves()) == 3 for tree in trees)
    # prompt 0's chains are 3 steps of one poll each: its expansions start at poll 3, while prompt 1's chains
    # (6 polls a step) run until poll 18; with a barrier per round they would wait for those
    fast = [when for when, slow in generator.log if not slow]
    assert generator.log[:4] == [(0, False), (0, False), (0, True), (0, True)]
    assert fast[:6] == [0, 0, 1, 1, 2, 2]  # the chains' steps
    assert fast[6:10] == [3, 3, 3, 3] and generator.polls > 18  # the expansions, at poll 3


def test_tree_costs_less_per_leaf_than_chains(tiny, data_dir):
    _, tokenizer = tiny

    def per_leaf(shape: TreeShape) -> tuple[float, float]:
        generator = ScriptedGenerator(tokenizer, seed=0)
        rollout = TreeRollout(gym.make("HotpotQA-v0", split="dev"), generator, tokenizer, seed=0)
        rollout.grow([0, 1, 2], shape)
        leaves = rollout.counters.leaves
        return generator.counters.tokens_generated / leaves, rollout.counters.tool_calls / leaves

    tree_tokens, tree_tools = per_leaf(TreeShape(2, 2, 1))
    chain_tokens, chain_tools = per_leaf(TreeShape(6, 0, 0))
    assert chain_tools == 2.0  # every chain searches twice, then answers
    assert tree_tokens < chain_tokens and tree_tools < chain_tools


def test_a_greedy_chain_keeps_its_search_queries_in_order(tiny, data_dir):
    # what the routing check reads: the queries the chain searched, one per tool call, as its steps wrote them
    _, tokenizer = tiny
    generator = ScriptedGenerator(tokenizer, seed=0)
    rows = greedy_chains(gym.make("HotpotQA-v0", split="dev"), generator, tokenizer, [0, 1, 2])
    generator.rng = np.random.default_rng(0)  # the same draws again: the words the three chains searched
    drawn = [generator.words[generator.rng.integers(len(generator.words))] for _ in range(6)]
    # the chains advance together: step 1 of chains 0, 1, 2, then step 2 of each
    assert [row[QUERIES] for row in rows] == [[drawn[i], drawn[3 + i]] for i in range(3)]
    assert [row["tool_calls"] for row in rows] == [2.0] * 3


@pytest.mark.parametrize(("answer", "answered"), [("x", 1.0), (" ", 0.0), ("", 0.0)])
def test_a_greedy_chain_keeps_its_answer_and_an_empty_one_is_no_answer(tiny, data_dir, answer, answered):
    # the answer rate counts answers: an empty <answer></answer> ends the episode but answers nothing
    _, tokenizer = tiny
    generator = ScriptedGenerator(tokenizer, seed=0)
    generator.answer = answer
    rows = greedy_chains(gym.make("HotpotQA-v0", split="dev"), generator, tokenizer, [0, 1])
    assert [row["answered"] for row in rows] == [answered] * 2
    assert [row[ANSWER] for row in rows] == [answer.strip()] * 2


class CountingRetriever(Retriever):
    """The shared BM25 index, recording every batch it is asked; each batch also counts one retry (as a flaky
    retrieval server's would)."""

    def __init__(self, inner: Retriever):
        self.inner, self.batches, self.retries = inner, [], 0

    def _search_hits(self, queries, k):
        self.batches.append(queries)
        self.retries += 1
        return self.inner.search(queries, k)


def test_an_agent_step_searches_in_one_batch_and_its_retries_are_counted(tiny, data_dir):
    _, tokenizer = tiny

    def grow_with(retriever):
        generator = ScriptedGenerator(tokenizer, seed=0)
        steps = []  # one entry per forward pass (poll): the steps it finished are searched together
        poll = generator.poll
        generator.poll = lambda: steps.append(1) or poll()
        rollout = TreeRollout(gym.make("HotpotQA-v0", split="dev", retriever=retriever), generator, tokenizer, seed=0)
        return leaf_records(rollout.grow([0, 1], TreeShape(2, 2, 1))), rollout, steps

    counting = CountingRetriever(get_retriever("bm25"))
    records, rollout, steps = grow_with(counting)
    reference, reference_rollout, _ = grow_with("bm25")
    # the same trees as searching one by one
    assert [r.trajectory.token_ids for r in records] == [r.trajectory.token_ids for r in reference]
    assert rollout.counters.tool_calls == reference_rollout.counters.tool_calls > 2 * len(counting.batches)
    assert 0 < len(counting.batches) <= len(steps)  # at most one batch per pass, however many branches
    assert all(len(set(batch)) == len(batch) for batch in counting.batches)  # a query repeated is searched once
    assert rollout.counters.retrieval_retries == counting.retries == len(counting.batches)
