"""The vLLM generator (needs vLLM: `make test-vllm` runs these in .venv-vllm with the CPU build): token ids and
log-probs against the learner's, stops and caps as the HF backend has them, trees, weight sync (engine, env
runner, remote runner), and one Tree-GRPO iteration and an evaluation through the command line."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import gymnasium as gym
import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (make test-vllm sets up .venv-vllm)")

import envs  # noqa: F401  (registers the env ids)
from algos.rollout import TreeRollout, TreeShape
from policies.generation import Branch, SamplingSettings, observation_ids, prompt_ids
from policies.models import LoraSettings, apply_lora, load_model
from policies.vllm_generation import CPU_BLOCK_SIZE, VLLMEngine, VLLMSettings, VLLMStepGenerator

pytestmark = pytest.mark.vllm
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OBSERVATION = "\n\n<information>Doc 1(Title: Hamlet) Hamlet is a tragedy by William Shakespeare.</information>\n\n"
SAMPLING = SamplingSettings(max_step_tokens=12, max_context_tokens=1024)
ATOL = 1e-4  # float32, another attention kernel: the gap measured is ~1e-6
# On a GPU each engine takes this share of its memory at start, and vLLM refuses to start one when less is free: a
# fifth each leaves room for the engines the runner and the command-line tests start beside an open one (the CPU
# build takes no share).
SETTINGS = VLLMSettings(gpu_memory_utilization=0.2)


@pytest.fixture(scope="module")
def tiny():
    model, tokenizer = load_model("tiny-random", seed=0)
    return model.eval(), tokenizer


def close_open_engine() -> None:
    if VLLMEngine._open is not None:
        VLLMEngine._open.close()


class Engines:
    """At most one open engine (one per process at a time), reopened when a test asks for other settings."""

    def __init__(self):
        self.current: VLLMEngine | None = None
        self.sampling: SamplingSettings | None = None

    def get(self, model, tokenizer, sampling: SamplingSettings = SAMPLING) -> VLLMEngine:
        """An engine for ``sampling`` serving ``model`` (a test may have loaded other weights into it)."""
        if self.sampling != sampling or VLLMEngine._open is not self.current:
            close_open_engine()
            self.current, self.sampling = VLLMEngine(model, tokenizer, sampling, SETTINGS), sampling
        else:
            self.current.load_weights(model)
        return self.current


@pytest.fixture(scope="module")
def engines():
    yield Engines()
    close_open_engine()


@pytest.fixture
def engine(tiny, engines):
    return engines.get(*tiny)


def reference_logprobs(model, context: tuple[int, ...], new: tuple[int, ...], temperature: float = 1.0):
    """Log-probs of ``new`` after ``context`` under ``model`` at ``temperature``, recomputed from scratch."""
    with torch.no_grad():
        logits = model(torch.tensor([context + new])).logits[0, len(context) - 1 : -1].float()
    return torch.log_softmax(logits / temperature, dim=-1).gather(-1, torch.tensor(new)[:, None]).squeeze(-1)


def assert_learner_logprobs(model, branches, outputs, temperature: float = 1.0) -> None:
    for branch, out in zip(branches, outputs, strict=True):
        assert len(out.token_ids) == len(out.logprobs) > 0 and out.cache is None
        expected = reference_logprobs(model, branch.token_ids, out.token_ids, temperature)
        torch.testing.assert_close(torch.tensor(out.logprobs), expected, atol=ATOL, rtol=0)


def test_steps_carry_the_learners_logprobs(tiny, engine):
    model, tokenizer = tiny
    generator = VLLMStepGenerator(engine, tokenizer, model, SAMPLING)
    prompts = [Branch(prompt_ids(tokenizer, q)) for q in ("Who wrote Hamlet?", "Capital of France?")]
    first = generator.generate_step(prompts)
    obs = observation_ids(tokenizer, OBSERVATION)
    children = [Branch(p.token_ids + out.token_ids + obs) for p, out in zip(prompts, first, strict=True)] * 2
    second = generator.generate_step(children)
    assert_learner_logprobs(model, prompts + children, first + second)
    assert generator.counters.llm_calls == 6
    assert generator.counters.tokens_generated == sum(len(o.token_ids) for o in first + second)


def test_tempered_steps_carry_the_tempered_softmax(tiny, engines):
    # temperature 0.7 with top_p 1: vLLM's processed log-probs are the full softmax at 0.7, what the learner uses
    model, tokenizer = tiny
    sampling = dataclasses.replace(SAMPLING, temperature=0.7, top_p=1.0)
    generator = VLLMStepGenerator(engines.get(model, tokenizer, sampling), tokenizer, model, sampling)
    branches = [Branch(prompt_ids(tokenizer, "Who wrote Hamlet?"))] * 2
    assert_learner_logprobs(model, branches, generator.generate_step(branches), temperature=0.7)


def test_one_engine_per_process_and_no_logprobs_mode_for_tempered_nucleus_sampling(tiny, engine):
    with pytest.raises(RuntimeError, match="already open"):
        VLLMEngine(*tiny, SAMPLING, SETTINGS)
    close_open_engine()
    with pytest.raises(ValueError, match="temperature 1 or top_p 1"):
        VLLMEngine(*tiny, dataclasses.replace(SAMPLING, temperature=0.7, top_p=0.9), SETTINGS)
    assert VLLMEngine._open is None


class AllowedTokens(VLLMStepGenerator):
    """Samples only from ``allowed`` token ids (vLLM's ``allowed_token_ids``): a script the stop rules can see."""

    def __init__(self, *args, allowed: list[int], **kwargs):
        super().__init__(*args, **kwargs)
        self.allowed = allowed

    def sampling_params(self, max_tokens: int, n: int = 1):
        params = super().sampling_params(max_tokens, n)
        params.allowed_token_ids = self.allowed
        return params


def ids_of(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def allowed_step(tiny, engine, allowed: list[int], max_step_tokens: int = 200):
    model, tokenizer = tiny
    settings = dataclasses.replace(SAMPLING, max_step_tokens=max_step_tokens)
    generator = AllowedTokens(engine, tokenizer, model, settings, allowed=allowed)
    branch = Branch(prompt_ids(tokenizer, "Q?"))
    (out,) = generator.generate_step([branch])
    assert_learner_logprobs(model, [branch], [out])  # allowed_token_ids masks sampling, not the recorded softmax
    return out


def test_stops_at_the_first_closing_search_tag(tiny, engine):
    _, tokenizer = tiny
    out = allowed_step(tiny, engine, sorted(set(ids_of(tokenizer, "</search>"))))
    text = tokenizer.decode(out.token_ids)
    assert out.finish_reason == "stop" and text.endswith("</search>") and text.count("</search>") == 1


def count_requests(engine, monkeypatch) -> list[int]:
    """The ``n`` of every request added to ``engine`` from now on."""
    added, add_request = [], engine.llm.llm_engine.add_request

    def counted(request_id, prompt, params, *args, **kwargs):
        added.append(params.n)
        return add_request(request_id, prompt, params, *args, **kwargs)

    monkeypatch.setattr(engine.llm.llm_engine, "add_request", counted)
    return added


def test_answer_step_keeps_the_next_token_from_the_same_request(tiny, engine, monkeypatch):
    _, tokenizer = tiny
    requests = count_requests(engine, monkeypatch)
    closing = sorted(set(ids_of(tokenizer, "</answer>")))
    out = allowed_step(tiny, engine, closing)  # the one more token comes from the same pieces
    text = tokenizer.decode(out.token_ids[:-1])
    assert out.finish_reason == "stop" and text.endswith("</answer>") and text.count("</answer>") == 1
    assert requests == [1]  # the closing tag is found while streaming; the request is aborted after one token
    assert engine.llm.llm_engine.get_num_unfinished_requests() == 0


def test_steps_from_one_context_are_one_request_with_n_samples(tiny, engine, monkeypatch):
    model, tokenizer = tiny
    requests = count_requests(engine, monkeypatch)
    generator = VLLMStepGenerator(engine, tokenizer, model, SAMPLING)
    engine.llm.reset_prefix_cache()
    root, other = Branch(prompt_ids(tokenizer, "Who wrote Hamlet?")), Branch(prompt_ids(tokenizer, "Capital?"))
    outputs = generator.generate_step([root, other, root, root])
    assert sorted(requests) == [1, 3]
    assert len({out.token_ids for out in (outputs[0], *outputs[2:])}) == 3  # three samples, not one thrice
    assert_learner_logprobs(model, [root, other, root, root], outputs)
    assert generator.counters.llm_calls == 4
    # the samples share the prompt's whole KV blocks; each computes only its last, partial block (CPU_BLOCK_SIZE on
    # the CPU build, vLLM's own default on a GPU)
    block_size = engine.llm.llm_engine.vllm_config.cache_config.block_size
    assert torch.cuda.is_available() or block_size == CPU_BLOCK_SIZE
    partial = len(root.token_ids) % block_size
    assert generator.counters.tokens_prefilled == len(root.token_ids) + 2 * partial + len(other.token_ids)


def test_stops_at_end_of_turn_and_keeps_it(tiny, engine):
    _, tokenizer = tiny
    out = allowed_step(tiny, engine, [tokenizer.convert_tokens_to_ids("a"), tokenizer.eos_token_id])
    assert out.finish_reason == "eos" and out.token_ids[-1] == tokenizer.eos_token_id
    assert tokenizer.eos_token_id not in out.token_ids[:-1]


def test_step_and_context_caps(tiny, engine):
    model, tokenizer = tiny
    prompt = prompt_ids(tokenizer, "Q?")
    settings = dataclasses.replace(SAMPLING, max_step_tokens=5, max_context_tokens=len(prompt) + 3)
    generator = VLLMStepGenerator(engine, tokenizer, model, settings)
    short, long_, full = generator.generate_step([Branch(prompt), Branch(prompt[:-4]), Branch((*prompt, 7, 8, 9))])
    assert (len(short.token_ids), short.finish_reason) == (3, "length")  # the context cap
    assert (len(long_.token_ids), long_.finish_reason) == (5, "length")  # the step cap
    assert (full.token_ids, full.finish_reason) == ((), "length")  # no room left: no request


def test_trees_are_token_exact_and_reuse_prefixes(tiny, engine, data_dir):
    model, tokenizer = tiny
    generator = VLLMStepGenerator(engine, tokenizer, model, SAMPLING)
    env = gym.make("HotpotQA-v0", split="dev")
    trees = TreeRollout(env, generator, tokenizer, seed=0).grow([0, 1], TreeShape(2, 2, 1))
    fresh = gym.make("HotpotQA-v0", split="dev").unwrapped
    context_tokens = 0
    for tree in trees:
        prompt, _ = fresh.reset(options={"index": tree.prompt_index})
        assert tree.root.trajectory.token_ids == prompt_ids(tokenizer, prompt)
        assert len(tree.leaves()) == 3
        for node in tree.nodes()[1:]:
            parent = node.parent.trajectory
            context_tokens += len(parent)
            step = node.trajectory.token_ids[len(parent):]
            n_generated = sum(node.trajectory.generated_mask[len(parent):])
            assert node.trajectory.token_ids[: len(parent)] == parent.token_ids  # children continue exact ids
            assert step[n_generated:] == observation_ids(tokenizer, node.observation)
            expected = reference_logprobs(model, parent.token_ids, step[:n_generated])
            got = node.trajectory.sampling_logprobs[len(parent) : len(parent) + n_generated]
            torch.testing.assert_close(torch.tensor(got), expected, atol=ATOL, rtol=0)
    # the M trees of a prompt and every child share prefixes: vLLM's prefix cache computes far less than all
    assert 0 < generator.counters.tokens_prefilled < 0.6 * context_tokens


def perturbed(model) -> None:
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))


def test_weight_sync_serves_the_new_weights(engine):
    model, tokenizer = load_model("tiny-random", seed=1)  # the engine served another model until now
    engine.load_weights(model.eval())
    tokens = prompt_ids(tokenizer, "Who wrote Hamlet?") + tuple(ids_of(tokenizer, " William Shakespeare"))
    start = len(tokens) - 3
    before = torch.tensor(engine.score(tokens, start))
    torch.testing.assert_close(before, reference_logprobs(model, tokens[:start], tokens[start:]), atol=ATOL, rtol=0)
    torch.manual_seed(0)
    perturbed(model)
    engine.load_weights(model)
    after = torch.tensor(engine.score(tokens, start))
    torch.testing.assert_close(after, reference_logprobs(model, tokens[:start], tokens[start:]), atol=ATOL, rtol=0)
    assert (after - before).abs().max() > 1e-2


def test_lora_adapters_are_served_merged(engine):
    model, tokenizer = load_model("tiny-random", seed=2)
    model = apply_lora(model, LoraSettings(rank=4, alpha=8))
    with torch.no_grad():  # peft starts its B matrices at 0: give the adapters an effect
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.5)
    engine.load_weights(model.eval())
    tokens = prompt_ids(tokenizer, "Capital of France?") + tuple(ids_of(tokenizer, " Paris"))
    start = len(tokens) - 2
    expected = reference_logprobs(model, tokens[:start], tokens[start:])
    torch.testing.assert_close(torch.tensor(engine.score(tokens, start)), expected, atol=ATOL, rtol=0)
    with model.disable_adapter():
        base = reference_logprobs(model, tokens[:start], tokens[start:])
    assert (expected - base).abs().max() > 1e-2  # the adapters matter, and they reached the engine
    assert any("lora_" in name for name, _ in model.named_parameters())  # merged for vLLM, not in the model


# -- through RLlib: the env runner's engine follows weight syncs ---------------------------------------------


def vllm_config(**training):
    from algos.tree_grpo import TreeGRPOConfig

    return (TreeGRPOConfig().environment("HotpotQA-v0", env_config={"split": "train"})
            .training(generator="vllm", prompts_per_iteration=2, M=2, N=1, L=1, max_step_tokens=8,
                      max_context_tokens=1024, log_rollout_steps=False, lr=1e-3, **training)
            .rl_module(model_config={"model": "tiny-random"}))


def engine_gap(runner, tokens: tuple[int, ...], start: int) -> float:
    """The largest gap between the runner's engine and its module's log-probs of ``tokens[start:]``."""
    served = torch.tensor(runner._vllm.score(tokens, start))
    with torch.no_grad():
        logits = runner.module.model(torch.tensor([tokens])).logits[0, start - 1 : -1].float()
    expected = torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(tokens[start:])[:, None]).squeeze(-1)
    return float((served - expected).abs().max())


def test_env_runner_engine_follows_set_state(data_dir):
    pytest.importorskip("ray", reason="Ray is not installed")
    from ray.rllib.core import COMPONENT_RL_MODULE

    from algos.tree_grpo.env_runner import TreeSearchEnvRunner

    close_open_engine()  # the runner opens its own
    runner = TreeSearchEnvRunner(config=vllm_config())
    records = runner.sample(prompt_indices=[0], iteration=0)
    assert len(records) == 4 and runner._vllm is not None  # (2, 1, 1): two leaves per tree
    tokens = records[0].trajectory.token_ids[:40]
    before = runner._vllm.score(tokens, 30)
    state = runner.get_state()[COMPONENT_RL_MODULE]
    state = {name: tensor + 0.05 * torch.randn_like(tensor) for name, tensor in state.items()}
    runner.set_state({COMPONENT_RL_MODULE: state})
    assert engine_gap(runner, tokens, 30) < ATOL
    assert max(abs(a - b) for a, b in zip(before, runner._vllm.score(tokens, 30), strict=True)) > 1e-2
    runner.stop()


def test_remote_runner_engine_serves_the_learners_weights(ray_session, data_dir):
    import ray

    config = vllm_config().env_runners(num_env_runners=1).debugging(seed=0)
    algo = config.build_algo()
    try:
        result = algo.train()
        assert result["env_runners"]["tokens_generated"] > 0
        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # Ray's workers cannot import tests/
        gaps = algo.env_runner_group.foreach_env_runner(
            lambda runner: engine_gap(runner, tuple(range(100, 140)), 30), local_env_runner=False)
        assert gaps and max(gaps) < ATOL  # the remote engine serves the updated module's weights
        learner_state = algo.learner_group._learner.module["default_policy"].get_state()
        runner_state = algo.env_runner_group.foreach_env_runner(
            lambda runner: runner.module.get_state(), local_env_runner=False)[0]
        initial, _ = load_model("tiny-random", seed=0)
        for name, tensor in learner_state.items():
            torch.testing.assert_close(runner_state[name], tensor)
        moved = [name for name, tensor in initial.state_dict().items()
                 if not torch.equal(tensor, learner_state[f"model.{name}"])]
        assert moved  # the update changed the weights, and the engine serves the changed ones
    finally:
        algo.stop()


def test_one_tree_grpo_iteration_from_the_command_line(tmp_path, data_dir):
    pytest.importorskip("ray", reason="Ray is not installed")
    close_open_engine()  # the command starts its own engine (on a GPU, beside this one's memory)
    out = tmp_path / "run"
    command = [sys.executable, "experiments/run.py", "--algo", "tree_grpo", "--env", "HotpotQA-v0",
               "--generator", "vllm", "--model", "tiny-random", "--iterations", "1", "--prompts-per-iter", "2",
               "--max-step-tokens", "8", "--micro-batch-size", "6", "--checkpoint-every", "0", "--quiet",
               "--output", str(out)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (row,) = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert row["tokens_generated"] > 0 and row["leaves"] == 12  # 2 prompts x (2, 2, 1)
    # another engine sampled: the learner recomputed the old log-probs and logged the sampler's gap to them
    assert row["old_logprobs_recomputed"] == 1.0 and row["sampler_ratio_mean"] == pytest.approx(1.0, abs=1e-3)


def test_evaluate_with_the_vllm_generator(tmp_path, data_dir):
    close_open_engine()  # the command starts its own engine (on a GPU, beside this one's memory)
    command = [sys.executable, "experiments/evaluate.py", "--model", "tiny-random", "--envs", "HotpotQA-v0",
               "--limit", "3", "--max-step-tokens", "8", "--generator", "vllm", "--output", str(tmp_path), "--quiet"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((tmp_path / "eval.json").read_text())["datasets"]["HotpotQA-v0"]["questions"] == 3
