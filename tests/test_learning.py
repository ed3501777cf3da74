"""End to end, learning happens: the CPU demo (``make run`` without a GPU) from a fresh cache.

The warm start trains on oracle trajectories of which 70% never answer (they repeat the last search until the
episode ends), so the greedy start policy never answers held-out questions. Answering earns the format-aware
reward, so sibling leaves that answer get positive advantages, and after 8 Tree-GRPO iterations with the
paper's update the greedy policy answers held-out questions. The change is measured per question on the same
held-out questions and must clear its 95% interval: if advantages, the loss, the update or the weight sync
were broken, the answer rate would stay at 0. Slow (about 10 CPU minutes): ``make test-slow``.
"""

from __future__ import annotations

import pytest
import ray

from experiments.demo import interval_of
from experiments.demo import main as demo


@pytest.mark.slow
def test_the_demo_raises_held_out_answer_rate_and_reward_beyond_their_intervals(tmp_path, monkeypatch):
    monkeypatch.setenv("TREEGRPO_CACHE_DIR", str(tmp_path / "cache"))  # the warm start is trained, not reused
    try:
        result = demo(["--output", str(tmp_path / "demo"), "--no-mlflow"])
    finally:
        ray.shutdown()
    for metric in ("answered", "reward"):
        change = interval_of(result, metric, "change")
        assert change.low > 0.0, (metric, change, result["before"], result["after"])
    assert interval_of(result, "answered", "change").mean >= 0.3
    assert (tmp_path / "demo" / "summary.md").read_text().count("| yes |") >= 2
    before = result["failures"]["before"]
    assert before.get("no answer", 0.0) > 0.9  # the start policy that the demo promises: it never answers
