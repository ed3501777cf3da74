"""Where a run's parts land and what they ask Ray for (experiments/preflight.py, experiments/settings.py): two parts
that would share a GPU unplanned are refused, naming both; the resources counted are the resources RLlib asks for;
no message suggests a share of a GPU per learner; and joining a cluster whose GPUs this process does not see
refuses the defaults that followed this process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import algos.tree_grpo.settings as algorithm_settings
from experiments.cli import SettingsError
from experiments.preflight import actor_demands, check_before_ray, check_resources
from experiments.run import plan
from experiments.settings import build_config, memory_options

SMALL = ("--model", "smollm2-135m")


def settings_of(*argv: str, tmp_path: Path):
    return plan([*SMALL, *argv, "--output", str(tmp_path / "run")]).settings


@pytest.fixture
def gpu_driver(monkeypatch):
    """This process sees a GPU (the defaults and the learner-device check follow it; nothing loads)."""
    monkeypatch.setattr(algorithm_settings, "gpu_visible", lambda: True)


def test_a_local_learner_and_a_whole_gpu_env_runner_are_refused_naming_both(tmp_path, gpu_driver, capsys):
    settings = settings_of("--num-gpus-per-learner", "1", "--num-env-runners", "1", "--num-gpus-per-env-runner", "1",
                           "--no-memory-check", tmp_path=tmp_path)
    with pytest.raises(SettingsError, match=r"the learner in this process \(--num-learners 0\).*GPU 0.*1 env "
                                            r"runner\(s\) .*--num-gpus-per-env-runner 1.*--num-learners 1"):
        check_before_ray(settings)


def test_env_runners_that_would_pack_beside_the_local_learner_are_refused(tmp_path, gpu_driver):
    packed = settings_of("--num-gpus-per-learner", "1", "--num-env-runners", "2", "--num-gpus-per-env-runner",
                         "0.5", "--no-memory-check", tmp_path=tmp_path)
    with pytest.raises(SettingsError, match=r"2 env runner\(s\).*learner in this process.*one engine"):
        check_before_ray(packed)
    one = settings_of("--num-gpus-per-learner", "1", "--num-env-runners", "1", "--num-gpus-per-env-runner", "0.5",
                      "--no-memory-check", tmp_path=tmp_path)
    check_before_ray(one)  # one engine beside the learner: planned as colocated
    assert memory_options(one, 80.0).colocated


def test_env_runners_beside_whole_gpu_remote_learners_are_not_planned_as_colocated(tmp_path):
    remote = settings_of("--num-learners", "1", "--num-gpus-per-learner", "1", "--num-env-runners", "2",
                         "--num-gpus-per-env-runner", "0.5", tmp_path=tmp_path)  # Ray keeps them off its GPU
    assert not memory_options(remote, 80.0).colocated
    driver = settings_of("--num-learners", "1", "--num-gpus-per-learner", "1", tmp_path=tmp_path)
    assert memory_options(driver, 80.0).colocated  # the driver's engine on GPU 0, where Ray puts the first learner


def test_learners_sharing_a_gpu_are_refused(tmp_path, gpu_driver):
    settings = settings_of("--num-learners", "2", "--num-gpus-per-learner", "0.5", "--no-memory-check",
                           tmp_path=tmp_path)
    with pytest.raises(SettingsError, match=r"--num-gpus-per-learner 0\.5 with --num-learners 2.*NCCL"):
        check_before_ray(settings)


def test_a_gpu_learners_cpu_is_counted_as_rllib_asks_for_it(tmp_path):
    settings = settings_of("--num-learners", "2", "--num-gpus-per-learner", "1", tmp_path=tmp_path)
    config = build_config(settings)
    (demand,) = [demand for kind, _, demand, _ in actor_demands(settings) if kind == "learner"]
    # RLlib's LearnerGroup asks for num_cpus_per_learner CPUs (given, so not "auto") and the GPUs, per learner
    assert demand == {"CPU": config.num_cpus_per_learner, "GPU": config.num_gpus_per_learner} == {"CPU": 1, "GPU": 1}
    with pytest.raises(SettingsError, match="need 2 CPUs and 2 GPUs"):
        check_resources(settings, {"CPU": 1.0, "GPU": 2.0})


def test_the_resources_message_never_suggests_a_share_of_a_gpu_per_learner(tmp_path):
    settings = settings_of("--num-learners", "2", "--num-gpus-per-learner", "1", tmp_path=tmp_path)
    with pytest.raises(SettingsError) as refused:
        check_resources(settings, {"CPU": 8.0, "GPU": 1.0})
    message = str(refused.value)
    assert "fractions are fine" not in message and "--num-gpus-per-learner 0." not in message
    assert "a learner takes a whole GPU" in message


def test_a_cluster_with_gpus_refuses_the_defaults_a_gpu_less_driver_chose(tmp_path, monkeypatch):
    monkeypatch.setattr(algorithm_settings, "gpu_visible", lambda: False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    joined = settings_of("--ray-address", "10.0.0.1:6379", "--num-learners", "1", tmp_path=tmp_path)
    with pytest.raises(SettingsError, match=r"--ray-address 10\.0\.0\.1:6379: the cluster has 8 GPUs but this "
                                            r"process sees none.*--dtype.*--num-gpus-per-learner.*explicitly"):
        check_resources(joined, {"CPU": 64.0, "GPU": 8.0})
    check_resources(joined, {"CPU": 64.0})  # a CPU cluster: the defaults were right
    chosen = settings_of("--ray-address", "10.0.0.1:6379", "--num-learners", "1", "--dtype", "bfloat16",
                         "--model", "Qwen/Qwen2.5-1.5B-Instruct",
                         "--gradient-checkpointing", "--num-gpus-per-learner", "1", "--prompts-per-iteration", "32",
                         "--max-step-tokens", "500", "--skip-uniform-rewards", "--no-frozen-bottom-replay",
                         tmp_path=tmp_path)
    check_resources(chosen, {"CPU": 64.0, "GPU": 8.0})  # every device default given: nothing was guessed
    check_resources(settings_of("--num-learners", "1", tmp_path=tmp_path), {"CPU": 64.0, "GPU": 8.0})  # local Ray


def test_a_gpu_cluster_refuses_the_real_qa_cpu_profile_until_each_of_its_options_is_given(tmp_path, monkeypatch):
    from experiments.qa_start import CPU_QA_DEFAULTS

    monkeypatch.setattr(algorithm_settings, "gpu_visible", lambda: False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    device = ("--dtype", "bfloat16", "--gradient-checkpointing", "--num-gpus-per-learner", "1",
              "--prompts-per-iteration", "32", "--max-step-tokens", "500", "--skip-uniform-rewards",
              "--no-frozen-bottom-replay")
    joined = ("--ray-address", "10.0.0.1:6379", "--num-learners", "1", "--output", str(tmp_path / "run"))
    cpu_profile = plan([*device, *joined]).settings  # HotpotQA-v0 from its warm start, chosen for this CPU
    with pytest.raises(SettingsError, match=r"sees none.*--model.*--topk.*--lr.*explicitly"):
        check_resources(cpu_profile, {"CPU": 64.0, "GPU": 8.0})
    profile = [part for name, value in CPU_QA_DEFAULTS.items() if name not in ("model", "max_step_tokens")
               for part in (f"--{name.replace('_', '-')}", str(value))]
    chosen = plan([*device, *joined, "--model", "warm-start", *profile]).settings
    check_resources(chosen, {"CPU": 64.0, "GPU": 8.0})  # every option of the profile given: nothing was guessed


def test_the_device_defaults_are_every_default_that_follows_the_driver(tmp_path, monkeypatch):
    from experiments.settings import DEVICE_DEFAULTS

    built = {}
    for gpu in (True, False):
        monkeypatch.setattr(algorithm_settings, "gpu_visible", lambda gpu=gpu: gpu)
        monkeypatch.setattr(torch.cuda, "is_available", lambda gpu=gpu: gpu)
        # SynthHop-v0: HotpotQA-v0's CPU defaults (its warm start's) go with the default model, which the list holds
        built[gpu] = plan(["--env", "SynthHop-v0", "--output", str(tmp_path / "run")]).settings
    differ = {name for name in type(built[True]).model_fields
              if getattr(built[True], name) != getattr(built[False], name)}
    assert differ == set(DEVICE_DEFAULTS)
