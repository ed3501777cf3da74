"""End to end, learning happens: warm start on oracle trajectories, then Tree-GRPO raises held-out reward.

Slow (a few CPU minutes): ``make test-slow`` or ``pytest -m slow tests/test_learning.py``.
"""

from __future__ import annotations

import json

import pytest
import ray

from envs.synthetic import WorldSpec, write_world
from experiments.run import main as run
from experiments.warmstart import main as warmstart

WORLD = WorldSpec(seed=0, people=60, companies=30, cities=12, countries=5, train_questions=160, dev_questions=60)


@pytest.mark.slow
def test_warm_start_then_tree_grpo_raises_held_out_reward(tmp_path):
    data = write_world(WORLD, tmp_path / "world")
    common = ["--env", "SynthHop-v0", "--data-dir", str(data), "--max-step-tokens", "48", "--seed", "0"]
    model = warmstart([*common, "--epochs", "2", "--dev-questions", "60", "--output", str(tmp_path / "warm")])
    before = json.loads((tmp_path / "warm" / "warmstart.json").read_text())["dev_after"]
    ray.init(num_cpus=2, object_store_memory=400_000_000, include_dashboard=False, log_to_driver=False)
    try:
        run([*common, "--model", str(model), "--iterations", "8", "--prompts-per-iter", "8", "--lr", "3e-4",
             "--micro-batch-size", "16", "--eval-every", "8", "--eval-questions", "60", "--checkpoint-every", "0",
             "--trees-every", "0", "--no-mlflow", "--quiet", "--output", str(tmp_path / "rl")])
    finally:
        ray.shutdown()
    rows = [json.loads(line) for line in (tmp_path / "rl" / "metrics.jsonl").read_text().splitlines()]
    after = rows[-1]
    # greedy held-out reward of the same 60 dev questions, before and after 8 Tree-GRPO iterations
    assert after["dev_reward"] >= before["reward"] + 0.1, (before, after)
