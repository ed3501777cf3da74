"""Two DDP learners equal one: two processes (gloo, world 2, on the CPU), each a Tree-GRPO learner on the shard of
one batch that RLlib's learner group hands it, against one learner on the whole batch in this process.

The batch goes through what the algorithm does with it (``learner_shards``, then RLlib's own
``ShardBatchIterator``, as ``LearnerGroup.update`` shards a batch by rows). Compared: the logged metrics (the loss
and its terms, the gradient norm), each optimizer step's gradient norm and the weights after the update's two
optimizer steps. Cases: shards of equal rows but not of equal tokens, with micro-batches of one row so that DDP's
``no_sync`` branch runs; shards of unequal rows; a learner without rows in one mini-batch; a learner without any
row (fewer rows than learners).
"""

from __future__ import annotations

import gc
import math
import traceback
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from ray.rllib.core import DEFAULT_MODULE_ID
from ray.rllib.policy.sample_batch import MultiAgentBatch, SampleBatch
from ray.rllib.utils.metrics import NUM_ENV_STEPS_SAMPLED_LIFETIME
from ray.rllib.utils.minibatch_utils import ShardBatchIterator

import algos.tree_grpo.learner as learner_module
from algos.batch import INPUT_IDS, MINI_BATCH, LeafRecord, learner_shards, pad_batch
from algos.tree_grpo import TreeGRPOConfig
from algos.tree_grpo import metrics as metric_keys
from envs.search_qa import UnicodeText
from policies.fsdp import full_state, trained_state_bytes
from policies.logprobs import GENERATED_MASK
from policies.trajectory import TokenTrajectory

WORLD = 2
LR = 1e-4
BASE = {"lr": LR, "ppo_mini_batches": 2, "old_logprobs": "recompute", "tis_cap": 2.0, "kl_coef": 0.1,
        "entropy_coef": 0.01}
# name: (rows of each prompt group, training settings). Two optimizer steps (two mini-batches) per update.
CASES = {
    # 4 | 4 rows, not of equal tokens; micro-batches of one row: no_sync on all but a mini-batch's last
    "even_rows": ((3, 2, 3), {"micro_batch_size": 1, "prefix_sharing": False}),
    # 4 | 3 rows; shared-prefix micro-batches of whole (here: cut by the shards) prompt groups
    "uneven_rows": ((2, 3, 2), {"micro_batch_size": 2, "prefix_sharing": True}),
    # 2 | 1 rows: the second learner has no row in one of the two mini-batches
    "empty_mini_batch": ((1, 2), {"micro_batch_size": 1, "prefix_sharing": False}),
    # 1 | 0 rows: the second learner gets an empty shard (one mini-batch: there is one row)
    "empty_shard": ((1,), {"micro_batch_size": 1, "prefix_sharing": False, "ppo_mini_batches": 1}),
}
COMPARED = ("total_loss", metric_keys.POLICY_LOSS, metric_keys.KL, metric_keys.ENTROPY, metric_keys.GRAD_NORM,
            metric_keys.CLIP_FRACTION, metric_keys.RATIO_MEAN, metric_keys.RATIO_MAX, metric_keys.RATIO_MIN,
            metric_keys.SAMPLER_LOGPROB_GAP, metric_keys.TIS_WEIGHT_MEAN, metric_keys.SAMPLER_RATIO_MEAN,
            metric_keys.SAMPLER_RATIO_OUTSIDE, metric_keys.TRAINED_TOKENS, metric_keys.OPTIMIZER_STEPS)
RELATIVE = 1e-6  # float32: the learners' sums in another order (measured: up to 2.6e-7)
# After the first step, float32 noise grows: Adam's first step is lr * g / (|g| + eps), and where |g| is near eps
# the noise of g (sums in another order) moves a weight by a good part of lr (see test_learner.py); the second
# step's gradient, which depends on that move, then differs by up to 1.7e-5 (measured; one learner on the same
# batch with other micro-batches: 4.7e-6). Unnormalised across learners, the gradient norm was 50% off.
LATER_STEPS = 1e-4


def records(group_rows: tuple[int, ...], seed: int = 3) -> list[LeafRecord]:
    """Prompt groups of ``group_rows`` rows: a shared prompt, then one to three steps of varied lengths with
    observations between them; distinct rewards."""
    rng = np.random.default_rng(seed)
    out = []
    for prompt, rows in enumerate(group_rows):
        root = TokenTrajectory.from_prompt(tuple(int(t) for t in rng.integers(5, 200, 5)))
        for row in range(rows):
            trajectory = root
            for depth in range(1 + (prompt + row) % 3):
                if depth:
                    trajectory = trajectory.with_observation(tuple(int(t) for t in rng.integers(5, 200, 2)))
                length = int(rng.integers(2, 9))
                trajectory = TokenTrajectory(
                    trajectory.token_ids + tuple(int(t) for t in rng.integers(5, 200, length)),
                    trajectory.generated_mask + (True,) * length,
                    trajectory.sampling_logprobs + tuple(rng.uniform(-6.0, -1.0, length)))
            out.append(LeafRecord(prompt, row % 2, 1, trajectory, reward=float(rng.normal())))
    return out


def case_batch(name: str, learners: int) -> dict[str, np.ndarray]:
    """The case's batch as the algorithm lays it out for ``learners`` learners."""
    group_rows, training = CASES[name]
    leaves = records(group_rows)
    arrays = pad_batch(leaves, np.array([leaf.reward for leaf in leaves]), pad_id=0)
    return learner_shards(arrays, {**BASE, **training}["ppo_mini_batches"], learners)


def build(name: str, num_learners: int, sharding: str = "ddp", model_config: dict | None = None,
          training: dict | None = None):
    """The case's learner; ``model_config`` and ``training`` update the case's own."""
    model = {"model": "tiny-random", "dtype": "float32", **(model_config or {})}
    config = (TreeGRPOConfig().rl_module(model_config=model)
              .training(**{**BASE, **CASES[name][1], **(training or {})}, learner_sharding=sharding)
              .learners(num_learners=num_learners))
    text = UnicodeText(100)
    return config.build_learner(spaces={DEFAULT_MODULE_ID: (text, text)})


def run_update(learner, arrays: dict[str, np.ndarray]) -> dict:
    """One update; its logged metrics, each optimizer step's gradient norm and the weights after it."""
    norms = []
    measure = learner_module.squared_norms

    def spy(gradients):  # the step's gradient norm, before clipping
        squares = measure(gradients)
        norms.append(math.sqrt(sum(squares)))
        return squares

    learner_module.squared_norms = spy
    try:
        batch = MultiAgentBatch({DEFAULT_MODULE_ID: SampleBatch({k: v.copy() for k, v in arrays.items()})},
                                env_steps=len(arrays[INPUT_IDS]))
        results = learner.update(batch=batch, timesteps={NUM_ENV_STEPS_SAMPLED_LIFETIME: len(arrays[INPUT_IDS])})
    finally:
        learner_module.squared_norms = measure
    model = learner.module[DEFAULT_MODULE_ID].unwrapped().model
    return {"metrics": {key: float(stats.peek()) for key, stats in results[DEFAULT_MODULE_ID].items()},
            "step_grad_norms": norms,
            "weights": {k: v.clone() for k, v in full_state(model)},  # sharded: gathered by every rank
            "trained_bytes": trained_state_bytes(model, learner._the_optimizer())}


def run_rank(name: str, rank: int, world: int = WORLD, sharding: str = "ddp", **options) -> dict:
    """The case ``name`` on this rank of ``world``: a DDP (or FSDP) learner (``options``: ``build``'s) on the shard
    RLlib would hand it, one update; how often the micro-batches skipped the gradient reduction (DDP's
    ``no_sync``, FSDP's ``set_requires_gradient_sync(False)``)."""
    arrays = case_batch(name, world)
    whole = MultiAgentBatch({DEFAULT_MODULE_ID: SampleBatch(arrays)}, env_steps=len(arrays[INPUT_IDS]))
    shard = list(ShardBatchIterator(whole, num_shards=world))[rank].policy_batches[DEFAULT_MODULE_ID]
    # LoRA's adapters are initialised from the global generator: another on each rank, so that DDP (its broadcast)
    # and FSDP (shard_model's) must both start every rank from rank 0's
    torch.manual_seed(rank)
    learner = build(name, world, sharding, **options)
    spied, name_of_switch = ((learner._policy_root, "set_requires_gradient_sync") if sharding == "fsdp"
                             else (learner.module[DEFAULT_MODULE_ID], "no_sync"))
    switch, entered = getattr(spied, name_of_switch), []

    def spy(*args, **kwargs):
        if name_of_switch == "no_sync" or not args[0]:
            entered.append(1)
        return switch(*args, **kwargs)

    setattr(spied, name_of_switch, spy)
    reductions = count_gradient_reductions(learner) if sharding == "fsdp" else []
    compute = learner.module[DEFAULT_MODULE_ID].unwrapped().model
    compute = compute.get_base_model() if hasattr(compute, "get_base_model") else compute
    dtypes = set()  # (weight, input) dtypes of a decoder layer's projection in the update's passes
    hook = compute.model.layers[0].mlp.down_proj.register_forward_pre_hook(
        lambda mod, args: dtypes.add((mod.weight.dtype, args[0].dtype)))
    try:
        result = run_update(learner, {k: np.asarray(v) for k, v in shard.items()})
    finally:
        delattr(spied, name_of_switch)
        hook.remove()
    return {**result, "no_sync_entered": len(entered), "rows": len(shard), "gradient_reductions": reductions,
            "compute_dtypes": dtypes, "tokens": float(shard[GENERATED_MASK].sum())}


def count_gradient_reductions(learner) -> list[int]:
    """A list that gets, per optimizer step of ``learner``, the all-reduces it issued (c10d's and the functional
    ones of DTensor) besides the learner's own of host values (``_all_reduce``: the step's token count)."""
    from tests.test_fsdp import all_reduces, communication

    step, own_reduce, counts = learner._optimizer_step, learner._all_reduce, []
    own = []

    def counted_own(*args, **kwargs):
        own.append(1)
        return own_reduce(*args, **kwargs)

    def counted_step(*args, **kwargs):
        own.clear()
        out = []
        total = all_reduces(communication(lambda: out.append(step(*args, **kwargs))))
        counts.append(total - len(own))
        return out[0]

    learner._optimizer_step, learner._all_reduce = counted_step, counted_own
    return counts


def rank_main(rank: int, world: int, out: str, plan: list[tuple[str, str, dict]]) -> None:
    """Each (case, sharding, ``build`` options) of ``plan`` on this rank of ``world``, in one process group; the
    i-th result (or error) to ``out/<i>-<rank>.pt``."""
    torch.set_num_threads(1)
    # a file store (no port to collide on a shared machine); the timeout bounds a collective left waiting, and is
    # long enough for a rank starved of CPU on a loaded machine to catch up (a minute was not, at load 10 on 2 cores)
    dist.init_process_group("gloo", init_method=f"file://{Path(out) / 'store'}", rank=rank, world_size=world,
                            timeout=timedelta(minutes=5))
    try:
        for i, (name, sharding, options) in enumerate(plan):
            try:
                result = run_rank(name, rank, world, sharding, **options)
            except Exception:
                result = {"error": traceback.format_exc()}
            torch.save(result, Path(out) / f"{i}-{rank}.pt")
            gc.collect()  # DDP's reducer holds the process group: free the case's learner before the group
            if "error" in result:
                break  # the other rank may wait in a collective this one left: stop here
    finally:
        gc.collect()
        dist.destroy_process_group()


def spawn(out: Path, world: int, plan: list[tuple[str, str, dict]]) -> list[list[dict]]:
    """``plan`` (see ``rank_main``) on ``world`` spawned ranks; per entry, the ranks' results (the spawn's failure,
    if any, as each missing result's error)."""
    out.mkdir(parents=True, exist_ok=True)
    failure = None
    try:
        mp.spawn(rank_main, args=(world, str(out), plan), nprocs=world, join=True)
    except Exception as error:  # a rank that died: its cases report it
        failure = f"spawned learners failed: {error}"
    files = [[out / f"{i}-{rank}.pt" for rank in range(world)] for i in range(len(plan))]
    return [[torch.load(f, weights_only=False) if f.exists() else {"error": failure or "no result"} for f in ranks]
            for ranks in files]


@pytest.fixture(scope="module")
def two_learners(tmp_path_factory) -> dict[str, list[dict]]:
    """Per case, the results of the two ranks."""
    results = spawn(tmp_path_factory.mktemp("ddp"), WORLD, [(name, "ddp", {}) for name in CASES])
    return dict(zip(CASES, results, strict=True))


@pytest.fixture(scope="module")
def one_learner() -> dict[str, dict]:
    """Per case, one learner (no DDP) on the whole batch, laid out for one learner; one thread, as each rank (a
    matrix product splits its sums by thread)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return {name: run_update(build(name, 0), case_batch(name, 1)) for name in CASES}
    finally:
        torch.set_num_threads(threads)


def relative(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest relative difference of two state dicts, tensor by tensor (by the L2 norm)."""
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).norm() / b[k].norm().clamp(min=1e-30)) for k in b)


def assert_equal_to_one_learner(ranks: list[dict], one: dict, initial: dict[str, torch.Tensor]) -> None:
    for rank in ranks:
        assert "error" not in rank, rank["error"]
    for key in COMPARED:
        tolerance = LATER_STEPS if key == metric_keys.GRAD_NORM else RELATIVE  # the mean over the steps
        for rank in ranks:  # every learner logs the batch's value: RLlib's mean over them is it
            assert rank["metrics"][key] == pytest.approx(one["metrics"][key], rel=tolerance, abs=1e-9), key
    assert one["metrics"][metric_keys.GRAD_NORM] > 0
    for rank in ranks:
        first, *later = rank["step_grad_norms"]
        assert len(later) == len(one["step_grad_norms"]) - 1
        assert first == pytest.approx(one["step_grad_norms"][0], rel=RELATIVE)
        assert later == pytest.approx(one["step_grad_norms"][1:], rel=LATER_STEPS)
        assert relative(rank["weights"], one["weights"]) < RELATIVE
        # the steps themselves (Adam moves a weight by about lr per step), not only the weights they moved
        steps = {k: rank["weights"][k] - initial[k] for k in initial}
        one_steps = {k: one["weights"][k] - initial[k] for k in initial}
        assert max(float(s.abs().max()) for s in one_steps.values()) > LR / 2
        assert relative(steps, one_steps) < 1e-3


@pytest.fixture(scope="module")
def initial_weights() -> dict[str, torch.Tensor]:
    learner = build("even_rows", 0)
    return {k: v.detach().clone() for k, v in learner.module[DEFAULT_MODULE_ID].model.state_dict().items()}


def test_two_learners_equal_one_and_reach_no_sync(two_learners, one_learner, initial_weights):
    ranks = two_learners["even_rows"]
    assert_equal_to_one_learner(ranks, one_learner["even_rows"], initial_weights)
    assert [rank["rows"] for rank in ranks] == [4, 4]
    assert ranks[0]["tokens"] != ranks[1]["tokens"]  # equal rows, unequal tokens: a mean of shard means differs
    # one-row micro-batches: each learner's mini-batches have 2 rows here, so no_sync ran once per step or more
    assert all(rank["no_sync_entered"] >= 2 for rank in ranks)


def test_two_learners_equal_one_on_uneven_shards(two_learners, one_learner, initial_weights):
    ranks = two_learners["uneven_rows"]
    assert_equal_to_one_learner(ranks, one_learner["uneven_rows"], initial_weights)
    assert [rank["rows"] for rank in ranks] == [4, 3]


def test_a_learner_without_rows_in_a_mini_batch_still_steps_with_the_others(two_learners, one_learner,
                                                                              initial_weights):
    ranks = two_learners["empty_mini_batch"]
    assert_equal_to_one_learner(ranks, one_learner["empty_mini_batch"], initial_weights)
    assert [rank["rows"] for rank in ranks] == [2, 1]
    assert all(rank["metrics"][metric_keys.OPTIMIZER_STEPS] == 2 for rank in ranks)


def test_a_learner_with_an_empty_shard_still_steps_with_the_others(two_learners, one_learner, initial_weights):
    ranks = two_learners["empty_shard"]
    assert_equal_to_one_learner(ranks, one_learner["empty_shard"], initial_weights)
    assert [rank["rows"] for rank in ranks] == [1, 0]


def test_the_layout_keeps_each_mini_batch_and_spreads_it_over_the_learners():
    """``learner_shards`` reorders rows: every learner's block (as RLlib cuts it) holds a part of each mini-batch,
    in order, and mini-batch k over all blocks is the whole batch's mini-batch k (its rows, each once)."""
    name = "even_rows"
    one, two = case_batch(name, 1), case_batch(name, WORLD)
    assert one[MINI_BATCH].tolist() == [0, 0, 0, 0, 0, 1, 1, 1]  # whole prompt groups: 3 + 2 | 3
    block = -(-len(two[INPUT_IDS]) // WORLD)
    for start in range(0, len(two[INPUT_IDS]), block):
        tags = two[MINI_BATCH][start:start + block]
        assert sorted(set(tags.tolist())) == [0, 1] and np.all(np.diff(tags) >= 0)
    for k in (0, 1):
        rows = {tuple(r) for r in one[INPUT_IDS][one[MINI_BATCH] == k]}
        assert rows == {tuple(r) for r in two[INPUT_IDS][two[MINI_BATCH] == k]}
