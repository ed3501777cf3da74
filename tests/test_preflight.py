"""The memory plan before a run (experiments/preflight.py): printed first, and a run planned above its GPU's memory
refused before any weights load, unless --no-memory-check."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from experiments.cli import SettingsError
from experiments.preflight import check_memory, check_model
from experiments.qa_start import QA_START_BASE_MODEL
from experiments.run import plan
from experiments.settings import memory_options
from policies.memory import GIB


def settings_of(*argv: str, tmp_path):
    return plan([*argv, "--output", str(tmp_path / "run")]).settings


@pytest.fixture
def gpu_of(monkeypatch):
    """Pretend this process sees one GPU of ``gib`` GiB."""
    def pretend(gib: float) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_properties",
                            lambda index: SimpleNamespace(total_memory=int(gib * GIB)))
    return pretend


def test_a_cpu_run_prints_its_plan_without_a_verdict(tmp_path, capsys):
    check_memory(settings_of("--model", "smollm2-135m", tmp_path=tmp_path))
    line = capsys.readouterr().err
    assert line.startswith("memory plan: smollm2-135m (0.13B)") and "GiB per GPU" in line and "fits" not in line
    assert line.rstrip().endswith("the learner is on the CPU, so nothing here is judged against this machine")


def test_a_run_planned_above_the_gpu_is_refused_before_anything_loads(tmp_path, capsys, gpu_of):
    gpu_of(20.0)
    settings = settings_of("--model", "smollm2-135m", "--dtype", "bfloat16", "--num-gpus-per-learner", "1",
                           tmp_path=tmp_path)
    with pytest.raises(SettingsError, match=r"over the 18\.0 GiB usable of the GPU's 20\.0 GiB \(activations the "
                                            r"largest part.*it would fit with --gradient-checkpointing \(.*"
                                            r"--no-memory-check goes on"):
        check_memory(settings)
    assert "DOES NOT FIT" in capsys.readouterr().err
    gpu_of(80.0)
    check_memory(settings)  # the same run on an 80 GB GPU goes on
    assert "of 80 GiB (72 usable): fits" in capsys.readouterr().err


def test_the_plan_follows_the_runs_options(tmp_path):
    settings = settings_of("--model", "smollm2-135m", "--dtype", "bfloat16", "--gradient-checkpointing",
                           "--reference-offload", "--micro-batch-tokens", "2048", "--num-learners", "2",
                           "--num-gpus-per-learner", "1", tmp_path=tmp_path)  # the driver's engine beside a learner
    options = memory_options(settings, gpu_memory_gib=80.0)
    assert (options.learners, options.dtype, options.gradient_checkpointing, options.reference_offload,
            options.micro_batch_tokens, options.colocated) == (2, "bfloat16", True, True, 2048, True)
    assert not memory_options(settings, gpu_memory_gib=None).colocated  # no GPU: nothing shares one
    remote = settings_of("--model", "smollm2-135m", "--num-env-runners", "1", "--num-gpus-per-env-runner", "1",
                         tmp_path=tmp_path)
    assert not memory_options(remote, gpu_memory_gib=80.0).colocated  # the runner has a GPU of its own


def test_a_model_without_a_known_shape_is_planned_later(tmp_path, capsys, gpu_of):
    gpu_of(80.0)
    check_memory(settings_of("--model", "nobody/not-downloaded-model", tmp_path=tmp_path))
    assert capsys.readouterr().err.startswith("memory plan: not made (no config for model 'nobody/not-downloaded")


def test_the_warm_start_is_planned_before_it_is_built_with_its_base_models_shape(tmp_path, capsys, gpu_of):
    gpu_of(80.0)
    check_memory(settings_of("--env", "HotpotQA-v0", "--model", "warm-start", tmp_path=tmp_path))
    line = capsys.readouterr().err
    plan = line.split("; the learner is on the CPU")[0]  # the planned part, whichever device the learner is on
    assert plan.startswith(f"memory plan: {QA_START_BASE_MODEL} (0.13B)") and plan.rstrip().endswith(")"), line


def test_the_object_store_holds_one_weight_sync(tmp_path):
    from experiments.preflight import MIN_OBJECT_STORE_BYTES, object_store_bytes

    def settings(*argv: str):
        return settings_of("--model", "qwen2.5-7b-instruct", "--dtype", "bfloat16", *argv, tmp_path=tmp_path)

    parameters = 7_615_616_512
    remote = settings("--num-env-runners", "1")
    assert object_store_bytes(remote, host_bytes=256 * GIB) == int(1.25 * 2 * parameters)  # bf16 weights + room
    assert object_store_bytes(settings("--num-learners", "1"), host_bytes=256 * GIB) == int(1.25 * 2 * parameters)
    # the driver's runner and learner copy tensor to tensor: no weights in the store
    assert object_store_bytes(settings(), host_bytes=256 * GIB) == MIN_OBJECT_STORE_BYTES
    small = settings_of("--model", "tiny-random", "--num-env-runners", "1", tmp_path=tmp_path)
    assert object_store_bytes(small, host_bytes=256 * GIB) == MIN_OBJECT_STORE_BYTES
    with pytest.raises(SettingsError, match=r"weight sync of qwen2.5-7b-instruct needs 17\.7 GiB of Ray's object "
                                            r"store, over half of this host's 24\.0 GiB"):
        object_store_bytes(remote, host_bytes=24 * GIB)


def test_a_learner_asked_onto_the_cpu_is_not_judged_against_the_gpu(tmp_path, capsys, gpu_of):
    gpu_of(20.0)  # the plan above the GPU's memory, but the learner does not train there
    check_memory(settings_of("--model", "smollm2-135m", "--dtype", "bfloat16", "--num-gpus-per-learner", "0",
                             tmp_path=tmp_path))
    line = capsys.readouterr().err
    assert line.startswith("memory plan:") and "fits" not in line and "DOES NOT FIT" not in line


def test_a_model_path_that_names_no_model_is_refused_before_ray(tmp_path):
    """A typo in --model is one line naming the option, not a traceback from the actors once Ray is up."""
    (tmp_path / "weights.bin").write_bytes(b"")
    (tmp_path / "empty").mkdir()
    for given, refusal in ((str(tmp_path / "typo"), "no such model directory"),
                           (str(tmp_path / "weights.bin"), "is a file, not a model directory"),
                           (str(tmp_path / "empty"), "has no config.json")):
        with pytest.raises(SettingsError, match=rf"^--model: .*{refusal}"):
            check_model(settings_of("--model", given, tmp_path=tmp_path))
    for name in ("tiny-random", "smollm2-135m", "Qwen/Qwen2.5-1.5B-Instruct"):  # an alias, a hub id: found later
        check_model(settings_of("--model", name, tmp_path=tmp_path))


def test_a_wrong_split_output_or_warm_start_env_is_named_before_ray(tmp_path):
    """Each one line naming the setting, found before Ray starts (and before a warm start would be built): a split
    the dataset lacks, an --output that is a file, and the warm start asked of an env that has none (named as such,
    not as that env's missing files)."""
    from experiments.preflight import check_data

    with pytest.raises(SettingsError, match=r"^split: dataset 'hotpotqa' has no split 'nosuch'; its splits: .* "
                                            r"\(--split\)$"):
        check_data(settings_of("--split", "nosuch", "--model", "tiny-random", tmp_path=tmp_path))
    (tmp_path / "file").write_text("")
    with pytest.raises(SettingsError, match=rf"^--output {tmp_path / 'file'}: a file is there, not a directory$"):
        plan(["--output", str(tmp_path / "file")])
    with pytest.raises(SettingsError, match=rf"^--output {tmp_path / 'file' / 'run'}: {tmp_path / 'file'} is a file"):
        plan(["--output", str(tmp_path / "file" / "run")])
    with pytest.raises(SettingsError, match=r"^model: warm-start is the warm start of HotpotQA-v0; SynthHop-v0 has "
                                            r"none: pass a --model$"):
        check_data(settings_of("--env", "SynthHop-v0", "--model", "warm-start", "--data-dir", str(tmp_path),
                               tmp_path=tmp_path))
