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
prompts). Writes OUTPUT/start-signal.md and .json.
"""

from __future__ import annotations

import argparse
import json
import shlex
import time
from collections.abc import Sequence
from pathlib import Path

import gymnasium as gym
import numpy as np

import envs  # noqa: F401  (registers the env ids)
from algos.evaluation import answered
from algos.tree import Tree
from benchmarks.decision_draws import arm_settings, grow_arm
from envs.rewards import REWARDS
from experiments.confidence import bootstrap_interval, paired_bootstrap_interval
from experiments.settings import WARM_START_MODEL, RunSettings, env_config

ENV = "HotpotQA-v0"


def leaf_rewards(trees: Sequence[Tree], answers: Sequence[Sequence[str]], prompts: Sequence[int],
                 reward: str) -> list[list[float]]:
    """Per prompt of ``prompts`` (in order), the rewards under ``reward`` of its trees' leaves; ``answers[i]``: train
    question i's gold answers. A leaf that never answered (its step cap reached) scores as no answer."""
    score = REWARDS[reward]
    by_prompt: dict[int, list[float]] = {prompt: [] for prompt in prompts}
    for tree in trees:
        for leaf in tree.leaves():
            by_prompt[tree.prompt_index].append(score(leaf.info.get("answer"), answers[tree.prompt_index],
                                                      bool(leaf.info.get("format_valid"))))
    return [by_prompt[prompt] for prompt in prompts]


def mixed(rewards: Sequence[Sequence[float]]) -> np.ndarray:
    """Per prompt: 1.0 where its leaves' rewards differ (some leaf's advantage is not 0), else 0.0."""
    return np.array([float(len(set(group)) > 1) for group in rewards])


def grow(run: RunSettings, env: gym.Env, model, tokenizer, prompts: list[int], seed: int) -> dict:
    """``run``'s trees for ``prompts``, scored: its per-prompt mixed indicators per reward and its figures."""
    answers = [record.answers for record in env.unwrapped.records]
    began = time.perf_counter()
    trees, counters = grow_arm(env, model, tokenizer, run, prompts, seed)
    seconds = time.perf_counter() - began
    leaves = [leaf for tree in trees for leaf in tree.leaves()]
    return {"seconds": seconds, "tokens": counters.total_tokens, "leaves": len(leaves),
            "answered": float(np.mean([answered(leaf) for leaf in leaves])),
            "em": float(np.mean([leaf.info.get("em", 0.0) for leaf in leaves])),
            "f1": float(np.mean([leaf.info.get("f1", 0.0) for leaf in leaves])),
            "mixed": {reward: mixed(leaf_rewards(trees, answers, prompts, reward)).tolist() for reward in REWARDS}}


def mixed_cell(arm: dict, base: dict, reward: str) -> str:
    """An arm's mixed share under ``reward`` and, for an arm other than ``base``, its paired difference from it."""
    indicators = np.asarray(arm["mixed"][reward])[None]
    cell = str(bootstrap_interval(indicators))
    if arm is not base:
        cell += f"; vs first {paired_bootstrap_interval(indicators, np.asarray(base['mixed'][reward])[None])}"
    return cell


def table(arms: list[dict]) -> str:
    """The markdown table of the grown arms, the first arm the base of the differences."""
    rewards = list(REWARDS)
    lines = ["| arm (run.py options) | prompts | leaves / prompt | tokens / prompt | s / prompt | answer rate "
             "| leaf EM | leaf F1 | " + " | ".join(f"mixed ({reward})" for reward in rewards) + " |",
             "|" + "---|" * (8 + len(rewards))]
    for arm in arms:
        prompts = len(arm["mixed"][rewards[0]])
        lines.append(f"| `{arm['options'] or '(defaults)'}` | {prompts} | {arm['leaves'] / prompts:.1f} | "
                     f"{arm['tokens'] / prompts:.0f} | {arm['seconds'] / prompts:.1f} | {arm['answered']:.3f} | "
                     f"{arm['em']:.3f} | {arm['f1']:.3f} | "
                     + " | ".join(mixed_cell(arm, arms[0], reward) for reward in rewards) + " |")
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
