"""How much learning signal the HotpotQA start's trees hold, by arm, before any training run (minutes, not hours).

    python benchmarks/hotpotqa_start_signal.py                      # the CPU defaults at T 1.0 and 0.7, 32 prompts
    python benchmarks/hotpotqa_start_signal.py --arms "" "--temperature 0.5" "--N 5" --prompts 48

Each arm is run.py's options for HotpotQA-v0 (its CPU defaults where not given: the warm start, the tree, the
sampling). Its trees are grown from the start policy as a first iteration would grow them, on the same --prompts
train questions for every arm (drawn with --seed), with no update. Every leaf is scored under each training reward
(``envs.rewards.REWARDS``: format, em, f1) from what it answered, so one growth serves the three. Per arm: the share
of prompts whose leaves were rewarded differently under each reward (the prompts whose group has a non-zero
advantage: GRPO's signal), the leaves' answer rate, EM and F1 (as sampled, not greedy), and the growth's tokens and
seconds; per arm after the first, the paired difference of each mixed share from the first arm's (bootstrap over the
prompts). Beside them, where the leaves' evidence stood: the share of leaves that read a gold answer (an
observation on the leaf's path named it; a comparison's yes / no is never read), the leaves' EM among those that read
it and those that did not, and the share of prompts whose leaves differ in having read it. Writes
OUTPUT/start-signal.md and .json.
"""

from __future__ import annotations

import argparse
import json
import shlex
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import gymnasium as gym
import numpy as np

import envs  # noqa: F401  (registers the env ids)
from algos.evaluation import answered
from algos.rollout import names_any
from algos.tree import Node, Tree
from benchmarks.decision_draws import arm_settings, grow_arm
from envs.rewards import REWARDS
from experiments.confidence import bootstrap_interval, paired_bootstrap_interval
from experiments.settings import WARM_START_MODEL, RunSettings, env_config

ENV = "HotpotQA-v0"
READ = "read"  # beside the rewards: whether a leaf read a gold answer


def by_prompt(trees: Sequence[Tree], prompts: Sequence[int], value: Callable[[Node, int], float]) -> list[list[float]]:
    """Per prompt of ``prompts`` (in order), ``value(leaf, prompt)`` of each of its trees' leaves."""
    values: dict[int, list[float]] = {prompt: [] for prompt in prompts}
    for tree in trees:
        values[tree.prompt_index].extend(value(leaf, tree.prompt_index) for leaf in tree.leaves())
    return [values[prompt] for prompt in prompts]


def leaf_rewards(trees: Sequence[Tree], answers: Sequence[Sequence[str]], prompts: Sequence[int],
                 reward: str) -> list[list[float]]:
    """Per prompt of ``prompts`` (in order), the rewards under ``reward`` of its trees' leaves; ``answers[i]``: train
    question i's gold answers. A leaf that never answered (its step cap reached) scores as no answer."""
    score = REWARDS[reward]
    return by_prompt(trees, prompts, lambda leaf, prompt: score(leaf.info.get("answer"), answers[prompt],
                                                                bool(leaf.info.get("format_valid"))))


def answer_read(trees: Sequence[Tree], named_answers: Sequence[Sequence[str]],
                prompts: Sequence[int]) -> list[list[float]]:
    """Per prompt of ``prompts`` (in order), 1.0 for each leaf whose path's observations named one of
    ``named_answers[prompt]`` (the gold answers a passage can name), else 0.0."""
    return by_prompt(trees, prompts, lambda leaf, prompt: float(
        names_any([node.observation for node in leaf.path()], named_answers[prompt])))


def em_by_reading(em: Sequence[Sequence[float]], read: Sequence[Sequence[float]]) -> dict[str, float | None]:
    """The leaves' mean EM among those that read a gold answer and among those that did not (None where no leaf
    falls in a group), with the share that read it."""
    pairs = [(e, r) for ems, reads in zip(em, read, strict=True) for e, r in zip(ems, reads, strict=True)]

    def mean_em(was_read: float) -> float | None:
        ems = [e for e, r in pairs if r == was_read]
        return float(np.mean(ems)) if ems else None

    return {"read": float(np.mean([r for _, r in pairs])) if pairs else 0.0, "em_read": mean_em(1.0),
            "em_unread": mean_em(0.0)}


def mixed(rewards: Sequence[Sequence[float]]) -> np.ndarray:
    """Per prompt: 1.0 where its leaves' rewards differ (some leaf's advantage is not 0), else 0.0."""
    return np.array([float(len(set(group)) > 1) for group in rewards])


def grow(run: RunSettings, env: gym.Env, model, tokenizer, prompts: list[int], seed: int) -> dict:
    """``run``'s trees for ``prompts``, scored: its per-prompt mixed indicators per reward and its figures."""
    records = env.unwrapped.records
    began = time.perf_counter()
    trees, counters = grow_arm(env, model, tokenizer, run, prompts, seed)
    seconds = time.perf_counter() - began
    leaves = [leaf for tree in trees for leaf in tree.leaves()]
    answers = [record.answers for record in records]
    scored = {reward: leaf_rewards(trees, answers, prompts, reward) for reward in REWARDS}
    scored[READ] = answer_read(trees, [record.named_answers for record in records], prompts)
    return {"seconds": seconds, "tokens": counters.total_tokens, "leaves": len(leaves),
            "answered": float(np.mean([answered(leaf) for leaf in leaves])),
            "em": float(np.mean([leaf.info.get("em", 0.0) for leaf in leaves])),
            "f1": float(np.mean([leaf.info.get("f1", 0.0) for leaf in leaves])),
            **em_by_reading(scored["em"], scored[READ]),
            "mixed": {signal: mixed(values).tolist() for signal, values in scored.items()}}


def mixed_cell(arm: dict, base: dict, signal: str) -> str:
    """An arm's mixed share under ``signal`` (a reward, or READ) and, for an arm other than ``base``, its paired
    difference from it."""
    indicators = np.asarray(arm["mixed"][signal])[None]
    cell = str(bootstrap_interval(indicators))
    if arm is not base:
        cell += f"; vs first {paired_bootstrap_interval(indicators, np.asarray(base['mixed'][signal])[None])}"
    return cell


def table(arms: list[dict]) -> str:
    """The markdown table of the grown arms, the first arm the base of the differences."""
    signals = [*REWARDS, READ]
    lines = ["| arm (run.py options) | prompts | leaves / prompt | tokens / prompt | s / prompt | answer rate "
             "| leaf EM | leaf F1 | answer read | leaf EM, read / unread | "
             + " | ".join(f"mixed ({signal})" for signal in signals) + " |",
             "|" + "---|" * (10 + len(signals))]
    for arm in arms:
        prompts = len(arm["mixed"][signals[0]])
        by_reading = " / ".join("-" if arm[key] is None else f"{arm[key]:.3f}" for key in ("em_read", "em_unread"))
        lines.append(f"| `{arm['options'] or '(defaults)'}` | {prompts} | {arm['leaves'] / prompts:.1f} | "
                     f"{arm['tokens'] / prompts:.0f} | {arm['seconds'] / prompts:.1f} | {arm['answered']:.3f} | "
                     f"{arm['em']:.3f} | {arm['f1']:.3f} | {arm['read']:.3f} | {by_reading} | "
                     + " | ".join(mixed_cell(arm, arms[0], signal) for signal in signals) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arms", nargs="+", default=["", "--temperature 0.7"],
                        help="each arm's run.py options, one quoted string an arm ('' for the defaults)")
    parser.add_argument("--prompts", type=int, default=32, help="train questions, the same for every arm")
    parser.add_argument("--seed", type=int, default=0, help="draws the prompts and seeds the sampling")
    parser.add_argument("--output", type=Path, default=Path("outputs/hotpotqa_start_signal"))
    args = parser.parse_args(argv)
    if args.prompts < 1:
        parser.error(f"--prompts must be >= 1, got {args.prompts}")
    from experiments.evaluate import load_policy
    from experiments.qa_start import qa_warm_start

    runs = [arm_settings(["--env", ENV, *shlex.split(options)]) for options in args.arms]
    if moved := [options for options, run in zip(args.arms, runs, strict=True) if run.env != ENV]:
        parser.error(f"--arms: every arm grows {ENV}'s trees (its prompts are shared); drop --env from {moved}")
    envs_by_config, policies = {}, {}
    arms = []
    for options, run in zip(args.arms, runs, strict=True):
        config = env_config(run)
        key = json.dumps(config, sort_keys=True)
        if key not in envs_by_config:
            envs_by_config[key] = gym.make(ENV, **config)
        env = envs_by_config[key]
        if not arms:  # the prompts: the same train questions for every arm
            size = len(env.unwrapped.records)
            prompts = sorted(np.random.default_rng(args.seed).choice(size, min(args.prompts, size), replace=False)
                             .tolist())
        model = str(qa_warm_start(ENV)) if run.model == WARM_START_MODEL else run.model
        if model not in policies:
            policies[model] = load_policy(model)
        arms.append({"options": options, **grow(run, env, *policies[model], prompts, args.seed)})
        print(f"`{options or '(defaults)'}`: grown ({time.strftime('%H:%M:%S')})", flush=True)
    args.output.mkdir(parents=True, exist_ok=True)
    header = (f"Start-policy signal on {ENV}: {len(prompts)} train questions (seed {args.seed}), trees grown as a "
              f"first iteration grows them, no update; 95% bootstrap intervals over the prompts.\n\n")
    (args.output / "start-signal.md").write_text(header + table(arms), encoding="utf-8")
    (args.output / "start-signal.json").write_text(json.dumps({"prompts": prompts, "arms": arms}, indent=1),
                                                   encoding="utf-8")
    print(header + table(arms))
    return arms


if __name__ == "__main__":
    main()
