"""Sharded (FSDP2) learners take the steps DDP learners and one learner take: processes on a gloo process group (the
CPU), each a Tree-GRPO learner with ``learner_sharding="fsdp"`` on the shard of one batch that RLlib's learner group
hands it, as in tests/test_learner_ddp.py.

Compared on the same batch: FSDP at world 2 against DDP at world 2 (the same process group, one after the other)
and against one unsharded learner: the logged metrics (loss and its terms, gradient norm), each optimizer step's
gradient norm and the weights after the update's two optimizer steps; the bytes of parameters, gradients and AdamW
state each rank holds. FSDP at world 1 (one process) and the other cases of the DDP test are the slow tier.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ray.rllib.core import DEFAULT_MODULE_ID

from algos.tree_grpo import metrics as metric_keys
from tests.test_learner_ddp import (
    CASES,
    COMPARED,
    WORLD,
    assert_equal_to_one_learner,
    build,
    case_batch,
    relative,
    run_update,
    spawn,
)

CORE_CASE = "even_rows"  # one-row micro-batches: several per optimizer step (K >= 2)
SHARDED_EQUALS_DDP = 1e-5  # float32: the same sums reduced in another order (the target)
# bf16: FSDP gathers bf16 weights and runs without autocast (a bf16 residual stream), DDP runs float32 masters under
# autocast (a float32 one), so they agree to bf16's precision (2**-8 = 4e-3 a rounding), not to float32's
SHARDED_BF16_EQUALS_DDP = 3e-2
BF16_KL_NOISE = 1e-5  # the KL of policy and reference after a step at lr 1e-6 is bf16 noise (measured 1.8e-6, 2.5e-6)
BYTES_RATIO = 0.55  # per-rank parameters + gradients + AdamW state at world 2 against world 1 (the target)
# the learner's other paths under sharding: name -> (model_config, training) over the core case's
VARIANTS: dict[str, tuple[dict, dict]] = {
    "plain": ({}, {}),
    # adapters sharded with their layers over a frozen bf16 base, bf16 compute, recomputed activations
    "lora_bf16_checkpointing": ({"dtype": "bfloat16", "lora": {"rank": 4, "alpha": 8},
                                 "gradient_checkpointing": True}, {}),
    # the KL reference's shards kept in host memory
    "offloaded_reference_bf16": ({"dtype": "bfloat16", "gradient_checkpointing": True}, {"reference_offload": True}),
    # bf16 compute over float32 masters (on FIRST_STEP_CASE: its one optimizer step's KL is the first step's)
    "bf16": ({"dtype": "bfloat16"}, {}),
}
FIRST_STEP_CASE = "empty_shard"  # one mini-batch: one optimizer step, on the policy's initial weights
FIRST_STEP_KL = 1e-6  # the bound; FSDP's policy and reference gather the same bf16 values and compute alike


def spawn_plan(out: Path, world: int, plan: list[tuple[str, str, str]]) -> dict[tuple[str, str, str], list[dict]]:
    """(case, sharding, variant) triples on ``world`` spawned ranks; per triple, the ranks' results."""
    entries = [(name, sharding, dict(zip(("model_config", "training"), VARIANTS[variant], strict=True)))
               for name, sharding, variant in plan]
    return dict(zip(plan, spawn(out, world, entries), strict=True))


def one_learner(name: str) -> dict:
    """One unsharded learner (no process group) on the whole batch, one thread as each rank."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return run_update(build(name, 0), case_batch(name, 1))
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def world_two(tmp_path_factory) -> dict[tuple[str, str, str], list[dict]]:
    plan = [(CORE_CASE, "ddp", "plain"), (CORE_CASE, "fsdp", "plain"), (FIRST_STEP_CASE, "fsdp", "bf16")]
    return spawn_plan(tmp_path_factory.mktemp("fsdp2"), WORLD, plan)


@pytest.fixture(scope="module")
def initial_weights() -> dict[str, torch.Tensor]:
    learner = build(CORE_CASE, 0)
    return {k: v.detach().clone() for k, v in learner.module[DEFAULT_MODULE_ID].model.state_dict().items()}


def assert_same_steps(ranks: list[dict], others: list[dict], tolerance: float, absolute: float = 1e-9) -> None:
    """Every logged metric, each step's gradient norm and the weights of ``ranks`` equal ``others``' to
    ``tolerance`` (relative; metrics near 0, such as a first step's KL, to ``absolute``)."""
    for rank, other in zip(ranks, others, strict=True):
        assert "error" not in rank, rank["error"]
        assert "error" not in other, other["error"]
        for key in COMPARED:
            assert rank["metrics"][key] == pytest.approx(other["metrics"][key], rel=tolerance, abs=absolute), key
        assert rank["step_grad_norms"] == pytest.approx(other["step_grad_norms"], rel=tolerance)
        assert relative(rank["weights"], other["weights"]) < tolerance


def test_sharded_learners_take_the_steps_of_ddp_and_of_one_learner(world_two, initial_weights):
    fsdp, ddp = world_two[CORE_CASE, "fsdp", "plain"], world_two[CORE_CASE, "ddp", "plain"]
    assert_same_steps(fsdp, ddp, SHARDED_EQUALS_DDP)
    assert_equal_to_one_learner(fsdp, one_learner(CORE_CASE), initial_weights)
    assert all(rank["metrics"][metric_keys.OPTIMIZER_STEPS] == 2 for rank in fsdp)
    # one-row micro-batches: FSDP reduce-scattered every one (no unreduced whole-model gradient), DDP all but the last
    # of a step skipped their all-reduce
    assert all(rank["no_sync_entered"] == 0 for rank in fsdp)
    assert all(rank["no_sync_entered"] >= 2 for rank in ddp)


def test_first_step_kl_in_bf16_is_zero_under_fsdp(world_two):
    """The policy gathers its float32 master shards cast to bf16 and the reference its bf16 shards, the same values,
    and both passes run without autocast: the KL of the first step (policy = reference) is 0, not bf16 noise."""
    for rank in world_two[FIRST_STEP_CASE, "fsdp", "bf16"]:
        assert "error" not in rank, rank["error"]
        assert rank["metrics"][metric_keys.OPTIMIZER_STEPS] == 1
        assert rank["metrics"][metric_keys.KL] < FIRST_STEP_KL


def test_a_bf16_run_under_fsdp_computes_in_bf16(world_two):
    """The units gather the float32 master shards cast to bf16, and the layers compute in bf16 (a mixed precision
    policy without ``param_dtype`` would gather and compute in float32; the comparisons above would not see it)."""
    for rank in world_two[FIRST_STEP_CASE, "fsdp", "bf16"]:
        assert rank["compute_dtypes"] == {(torch.bfloat16, torch.bfloat16)}
    for rank in world_two[CORE_CASE, "fsdp", "plain"]:
        assert rank["compute_dtypes"] == {(torch.float32, torch.float32)}


def test_clipping_takes_one_reduction_per_optimizer_step(world_two):
    """The gradient norm (before clipping, and the clip's scale) is one all-reduce of every sharded gradient's
    partial norm; no reduction per parameter (RLlib's clipping and its finiteness checks take one each)."""
    for rank in world_two[CORE_CASE, "fsdp", "plain"] + world_two[FIRST_STEP_CASE, "fsdp", "bf16"]:
        assert rank["gradient_reductions"] == [1] * int(rank["metrics"][metric_keys.OPTIMIZER_STEPS])


def test_each_rank_holds_about_half_of_the_trained_state(world_two):
    one = one_learner(CORE_CASE)["trained_bytes"]
    fsdp, ddp = world_two[CORE_CASE, "fsdp", "plain"], world_two[CORE_CASE, "ddp", "plain"]
    assert all(rank["trained_bytes"] == one for rank in ddp)  # a replica holds it all
    for rank in fsdp:
        assert rank["trained_bytes"] <= BYTES_RATIO * one, (rank["trained_bytes"], one)


@pytest.mark.slow
def test_one_sharded_learner_and_every_uneven_case_equal_one_learner(tmp_path, initial_weights):
    """FSDP at world 1 (sharding trivial, the whole path run), and at world 2 the cases with uneven shards, a
    learner without rows in a mini-batch and a learner without any row."""
    alone = spawn_plan(tmp_path / "one", 1, [(CORE_CASE, "fsdp", "plain")])[CORE_CASE, "fsdp", "plain"]
    reference = one_learner(CORE_CASE)
    assert_equal_to_one_learner(alone, reference, initial_weights)
    assert alone[0]["trained_bytes"] == reference["trained_bytes"]
    others = [name for name in CASES if name != CORE_CASE]
    results = spawn_plan(tmp_path / "two", WORLD, [(name, "fsdp", "plain") for name in others])
    for name in others:
        learner = build(name, 0)
        initial = {k: v.detach().clone() for k, v in learner.module[DEFAULT_MODULE_ID].model.state_dict().items()}
        assert_equal_to_one_learner(results[name, "fsdp", "plain"], one_learner(name), initial)


@pytest.mark.slow
def test_lora_mixed_precision_checkpointing_and_an_offloaded_reference_shard_as_ddp_replicates(tmp_path):
    """LoRA adapters (sharded with their layers) over a frozen bf16 base, bf16 compute, activation checkpointing,
    and an offloaded KL reference (its shards in host memory): the same steps as DDP's to bf16's precision, and half
    the trained state per rank."""
    variants = ["lora_bf16_checkpointing", "offloaded_reference_bf16"]
    results = spawn_plan(tmp_path, WORLD, [(CORE_CASE, sharding, variant) for variant in variants
                                      for sharding in ("ddp", "fsdp")])
    for variant in variants:
        fsdp, ddp = results[CORE_CASE, "fsdp", variant], results[CORE_CASE, "ddp", variant]
        assert_same_steps(fsdp, ddp, SHARDED_BF16_EQUALS_DDP, absolute=BF16_KL_NOISE)
        assert all(rank["trained_bytes"] <= BYTES_RATIO * ddp[0]["trained_bytes"] for rank in fsdp)


def test_fsdp_without_remote_learners_is_refused():
    """Before Ray starts (the config's validation, run.py's preflight), and by a learner built without it."""
    from algos.tree_grpo import TreeGRPOConfig

    expected = r"learner_sharding: fsdp .* num_learners is 0.*set num_learners \(--num-learners\) 1"
    with pytest.raises(ValueError, match=expected):
        TreeGRPOConfig().training(learner_sharding="fsdp").validate()
    TreeGRPOConfig().training(learner_sharding="fsdp").learners(num_learners=1).validate()
    with pytest.raises(ValueError, match=expected):
        build(CORE_CASE, 0, "fsdp")


def test_a_model_without_findable_layers_is_named():
    from policies.fsdp import shard_model

    class Flat(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)

    with pytest.raises(ValueError, match=r"cannot find the decoder layers of Flat"):
        shard_model(Flat())


# run.py end to end: two remote learners beside the driver's env runner on the test session's 2 Ray CPUs
CONTRACT = ["--model", "tiny-random", "--seed", "5", "--prompts-per-iter", "4", "--max-step-tokens", "8",
            "--checkpoint-every", "0", "--num-cpus-per-learner", "0.5", "--no-mlflow", "--quiet"]
TWO_LEARNERS = ["--num-learners", "2"]
FSDP = [*TWO_LEARNERS, "--learner-sharding", "fsdp"]


def run(output: Path, *options: str, contract: bool = True) -> list[dict]:
    """``run.py`` in a new process, as the contract runs it, with the contract's options (``contract``) and
    ``options``; its metrics rows."""
    from experiments.tracking import read_rows

    command = [*CONTRACT, "--output", str(output)] if contract else []
    subprocess.run([sys.executable, "experiments/run.py", *command, *options], check=True, capture_output=True,
                   cwd=Path(__file__).resolve().parent.parent, timeout=900)
    return read_rows(output / "metrics.jsonl")


def exported(run_dir: Path, out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    from experiments.export import export_policy

    return load_file(export_policy(run_dir, out) / "model.safetensors")


@pytest.mark.slow
def test_the_contract_sharded_and_ddp_runs_agree_and_begin_as_one_learner(data_dir, tmp_path):
    """The issue's contract. The one-learner run has as many iterations as the others: the warm-up is a share of
    the run's optimizer steps, and an iteration's logged gradient norm is the mean over its steps."""
    fsdp = run(tmp_path / "fsdp", *FSDP, "--iterations", "2")
    ddp = run(tmp_path / "ddp", *TWO_LEARNERS, "--iterations", "2")
    one = run(tmp_path / "one", "--num-learners", "0", "--iterations", "2")
    assert len(fsdp) == len(ddp) == 2
    for sharded, replicated in zip(fsdp, ddp, strict=True):
        assert sharded["grad_norm"] > 0
        assert sharded["grad_norm"] == pytest.approx(replicated["grad_norm"], rel=1e-5)
    for two in (fsdp, ddp):
        assert two[0]["grad_norm"] == pytest.approx(one[0]["grad_norm"], rel=1e-6)
    # the export gathers the sharded checkpoint into the weights DDP's checkpoint holds
    a, b = exported(tmp_path / "fsdp", tmp_path / "fsdp-model"), exported(tmp_path / "ddp", tmp_path / "ddp-model")
    assert a.keys() == b.keys()
    assert relative(a, b) < SHARDED_EQUALS_DDP


@pytest.mark.slow
def test_a_sharded_run_resumes_exactly_and_only_at_its_world_size(ray_session, data_dir, tmp_path):
    from experiments.run import main
    from tests.test_resume import without_times

    warmup = ["--warmup-steps", "4"]  # not a share of the run's steps, which --iterations sets
    straight = run(tmp_path / "straight", *FSDP, *warmup, "--iterations", "2")
    run(tmp_path / "resumed", *FSDP, *warmup, "--iterations", "1")
    resumed = run(tmp_path / "resumed", "--resume", str(tmp_path / "resumed"), "--iterations", "1", contract=False)
    assert [row["iteration"] for row in resumed] == [1, 2]
    assert without_times(resumed) == without_times(straight)
    a = exported(tmp_path / "straight", tmp_path / "straight-model")
    b = exported(tmp_path / "resumed", tmp_path / "resumed-model")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    with pytest.raises(ValueError, match=r"sharded \(fsdp\) checkpoint of 2 learner\(s\) cannot be resumed by 1"):
        main(["--resume", str(tmp_path / "resumed"), "--iterations", "1", "--allow-changes", "--num-learners", "1"])
    with pytest.raises(ValueError, match=r"cannot be resumed with --learner-sharding ddp"):
        main(["--resume", str(tmp_path / "resumed"), "--iterations", "1", "--allow-changes",
              "--learner-sharding", "ddp"])


@pytest.mark.slow
def test_a_signal_to_a_sharded_run_saves_every_rank_once_and_the_run_resumes(data_dir, tmp_path):
    """Ctrl-C during a 2-learner FSDP run: the run writes one checkpoint holding every rank's shards, exits 130, and
    resumes from it (a shard missing would fail the resume)."""
    from experiments.checkpoints import verify_checkpoint
    from experiments.tracking import read_rows
    from tests.test_resume import wait_for_rows

    command = [sys.executable, "experiments/run.py", *CONTRACT, *FSDP, "--iterations", "50", "--output", str(tmp_path)]
    log = tmp_path / "run.log"  # a file, not a pipe: the learners' logs would fill a pipe nobody reads
    with open(log, "wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                   cwd=Path(__file__).resolve().parent.parent)
        try:
            wait_for_rows(tmp_path / "metrics.jsonl", 1, process, timeout=600)
            process.send_signal(signal.SIGINT)
            status = process.wait(timeout=300)
        finally:
            process.kill()
    assert status == 130, log.read_text()[-3000:]
    latest = (tmp_path / "checkpoints" / "latest").resolve()
    verify_checkpoint(latest)
    done = len(read_rows(tmp_path / "metrics.jsonl"))
    assert latest.name == f"iter_{done:06d}" and len(list((tmp_path / "checkpoints").glob("iter_*"))) == 1
    resumed = run(tmp_path, "--resume", str(tmp_path), "--iterations", "1", contract=False)
    assert [row["iteration"] for row in resumed] == list(range(1, done + 2))


def test_a_checkpoint_is_resumed_only_by_the_sharding_and_world_size_that_wrote_it(tmp_path):
    from algos.tree_grpo.learner_group import check_checkpoint_sharding, shards_directory, write_shards_info

    group = tmp_path / "iter_000001" / "learner_group"
    group.mkdir(parents=True)
    check_checkpoint_sharding(group, sharded=False, world_size=2)  # DDP's checkpoint, a DDP run
    with pytest.raises(ValueError, match=r"iter_000001: a checkpoint of unsharded \(ddp\) learners cannot be resumed "
                                         r"with --learner-sharding fsdp"):
        check_checkpoint_sharding(group, sharded=True, world_size=2)
    shards = shards_directory(group)
    shards.mkdir(parents=True)
    write_shards_info(shards, 2)
    check_checkpoint_sharding(group, sharded=True, world_size=2)
    with pytest.raises(ValueError, match=r"of 2 learner\(s\) cannot be resumed by 1: resume with --num-learners 2"):
        check_checkpoint_sharding(group, sharded=True, world_size=1)
    with pytest.raises(ValueError, match=r"sharded \(fsdp\) learners cannot be resumed with --learner-sharding ddp"):
        check_checkpoint_sharding(group, sharded=False, world_size=2)
