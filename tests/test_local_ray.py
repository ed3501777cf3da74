"""run.py's Ray is local unless asked to join a cluster: every Ray server listens on loopback only, there is no
dashboard, a stale ``ray start`` leaves no trace, and ``--ray-address`` joins with the cluster's resources; on a
two-node cluster (slow) the env runners go to the node offering ``--env-runner-resources``, a runner killed there
mid-iteration is restarted and counted, and the run resumes from its checkpoint."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import ray
from ray._private import ray_constants

from algos.tree_grpo import metrics as metric_keys
from experiments.cli import SettingsError
from experiments.preflight import start_ray
from experiments.run import RunPlan, plan, train
from experiments.settings import RunSettings
from experiments.tracking import read_rows
from tests.ports import free_port
from tests.test_resume import FAST, wait_for_rows


def listening_addresses(pids: set[int]) -> list[str]:
    return [c.laddr.ip for c in psutil.net_connections("tcp")
            if c.status == psutil.CONN_LISTEN and c.pid in pids]


def this_sessions_processes() -> set[int]:
    """This process and everything it started (GCS, raylet, and the workers the raylet starts)."""
    me = psutil.Process()
    return {me.pid} | {child.pid for child in me.children(recursive=True)}


def test_start_ray_listens_on_loopback_only_without_a_dashboard(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv(ray_constants.RAY_WORKER_NICENESS, raising=False)
    ray.shutdown()
    try:
        start_ray(RunSettings(log_rollout_steps=False))
        # a worker process too, at the driver's priority (Ray's default would be 15 above it)
        assert ray.get(ray.remote(lambda: os.nice(0)).remote()) == os.nice(0)
        assert [node["NodeManagerAddress"] for node in ray.nodes()] == ["127.0.0.1"]
        addresses = listening_addresses(this_sessions_processes())
        assert addresses and all(ip in ("127.0.0.1", "::ffff:127.0.0.1") for ip in addresses), addresses
        with socket.socket() as probe:  # the dashboard's default port stays closed
            assert probe.connect_ex(("127.0.0.1", 8265)) != 0
    finally:
        ray.shutdown()


@pytest.fixture
def ray_temp_dir(monkeypatch) -> Iterator[Path]:
    """A private Ray temp dir (short: Ray's socket paths live under it) as Ray's default; every process whose
    command line names it, and everything those started (Ray's workers rename themselves ``ray::...``), is
    stopped by pid afterwards."""
    path = Path(tempfile.mkdtemp(prefix="rt", dir="/tmp"))
    monkeypatch.setenv("RAY_TMPDIR", str(path))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    # start_ray switches clusters off in this process's environment, which ray start --address would inherit
    monkeypatch.delenv(ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR, raising=False)
    ray.shutdown()
    yield path
    ray.shutdown()
    started = [proc for proc in psutil.process_iter(["pid", "cmdline"])
               if str(path) in " ".join(proc.info["cmdline"] or []) and proc.pid != os.getpid()]
    stop_processes(started + [child for proc in started for child in children(proc)])
    shutil.rmtree(path, ignore_errors=True)


def children(process: psutil.Process) -> list[psutil.Process]:
    try:
        return process.children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def stop_processes(processes: list[psutil.Process]) -> None:
    """Kill each process by pid and wait until it is gone."""
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    psutil.wait_procs(processes, timeout=30)


def ray_start(*options: str) -> None:
    """``ray start`` (this environment's) with ``options``: a small node."""
    ray_cli = Path(sys.executable).parent / "ray"
    done = subprocess.run([str(ray_cli), "start", "--num-cpus=1", "--object-store-memory=200000000",
                           "--disable-usage-stats", *options], capture_output=True,
                          env={**os.environ, "RAY_AUTH_MODE": "disabled"}, timeout=120)
    assert done.returncode == 0, done.stderr.decode()[-3000:]


def start_head(temp_dir: Path, *options: str) -> str:
    """A head node on this machine without a dashboard, in ``temp_dir`` (the other nodes use the head's); its
    address."""
    port = free_port()
    ray_start("--head", f"--port={port}", "--node-ip-address=127.0.0.1", f"--temp-dir={temp_dir}",
              "--include-dashboard=false", *options)
    return f"127.0.0.1:{port}"


def test_a_stale_ray_current_cluster_file_does_not_make_a_local_run_join_it(ray_temp_dir):
    (ray_temp_dir / "ray").mkdir()
    (ray_temp_dir / "ray" / "ray_current_cluster").write_text("127.0.0.1:1")  # left by a head long gone
    start_ray(RunSettings(log_rollout_steps=False))
    assert len(ray.nodes()) == 1 and ray.cluster_resources()["CPU"] == os.cpu_count()  # its own local Ray


@pytest.mark.slow
def test_ray_address_joins_a_cluster_with_its_own_resources(ray_temp_dir, data_dir, tmp_path):
    address = start_head(ray_temp_dir, '--resources={"joined_node": 1}')
    start_ray(RunSettings(ray_address=address, log_rollout_steps=False))
    resources = ray.cluster_resources()
    assert resources["CPU"] == 1 and resources["joined_node"] == 1  # the cluster's, none passed by run.py
    # runners the cluster cannot place are refused, by its resources, before anything is built or written
    output = tmp_path / "run"
    settings = plan(["--ray-address", address, "--num-env-runners", "2", "--num-cpus-per-env-runner", "0.5",
                     "--env-runner-resources", "joined_node=1", "--output", str(output)]).settings
    with pytest.raises(SettingsError, match=r"2 env runner\(s\) need 2 joined_node but Ray has 1"):
        train(RunPlan(settings))
    assert not output.exists()


# -- two nodes: the env runners on the second ------------------------------------------------------------------

RUNNER_TITLE = "ray::TreeSearchEnvRunner"  # an env runner's process title (``...RUNNER_TITLE.apply`` while called)


def raylet_offering(temp_dir: Path, resource: str) -> psutil.Process:
    """The raylet (a node's process, the parent of its workers) of the cluster in ``temp_dir`` that offers
    ``resource``."""
    (raylet,) = [proc for proc in psutil.process_iter(["name", "cmdline"]) if proc.info["name"] == "raylet"
                 and str(temp_dir) in " ".join(cmdline := proc.info["cmdline"] or [])
                 and any(arg.startswith("--static_resource_list=") and f"{resource}," in arg for arg in cmdline)]
    return raylet


def env_runners(temp_dir: Path) -> list[psutil.Process]:
    """The env runner processes of the cluster in ``temp_dir`` (workers of its raylets)."""
    raylets = [proc for proc in psutil.process_iter(["name", "cmdline"])
               if proc.info["name"] == "raylet" and str(temp_dir) in " ".join(proc.info["cmdline"] or [])]
    return [worker for raylet in raylets for worker in children(raylet)
            if title(worker).startswith(RUNNER_TITLE)]


def title(process: psutil.Process) -> str:
    try:
        return " ".join(process.cmdline())
    except psutil.NoSuchProcess:
        return ""


def busy_env_runner(temp_dir: Path, run: subprocess.Popen, timeout_s: float = 300) -> psutil.Process:
    """The first env runner found executing a call of the driver (sampling, or the probes before it)."""
    deadline = time.monotonic() + timeout_s
    while True:
        busy = [runner for runner in env_runners(temp_dir) if title(runner).startswith(f"{RUNNER_TITLE}.apply")]
        if busy:
            return busy[0]
        assert run.poll() is None, run.stderr.read().decode()[-3000:]
        assert time.monotonic() < deadline, "no env runner got a call"
        time.sleep(0.05)


def finish(run: subprocess.Popen, timeout_s: float = 600) -> None:
    assert run.wait(timeout=timeout_s) == 0, run.stderr.read().decode()[-3000:]


@pytest.mark.slow
def test_env_runners_on_a_second_node_survive_a_kill_and_the_run_resumes(ray_temp_dir, data_dir, tmp_path):
    address = start_head(ray_temp_dir)
    ray_start(f"--address={address}", '--resources={"rollout_node": 1}')
    rollout_node = raylet_offering(ray_temp_dir, "rollout_node")
    output = tmp_path / "run"
    run_py = [sys.executable, "experiments/run.py"]
    runs = [subprocess.Popen([*run_py, *FAST, "--iterations", "2", "--output", str(output), "--no-mlflow",
                              "--num-env-runners", "1", "--env-runner-resources", "rollout_node=1",
                              "--ray-address", address], stdout=subprocess.PIPE, stderr=subprocess.PIPE)]
    try:
        wait_for_rows(output / "metrics.jsonl", 1, runs[0])
        runner = busy_env_runner(ray_temp_dir, runs[0])  # in iteration 2
        assert runner.ppid() == rollout_node.pid  # a worker of the node offering rollout_node
        runner.kill()
        finish(runs[0])
        rows = read_rows(output / "metrics.jsonl")
        assert [row["iteration"] for row in rows] == [1, 2]
        # restarted, counted, iteration complete
        assert [row[metric_keys.ENV_RUNNER_RESTARTS] for row in rows] == [0, 1]
        assert [row[metric_keys.LEAVES] for row in rows] == [12, 12]
        assert (output / "checkpoints" / "latest").resolve().name == "iter_000002"

        # the resumed run joins the same cluster (--ray-address is in its saved settings) from iteration 3
        runs.append(subprocess.Popen([*run_py, "--resume", str(output), "--iterations", "1"],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE))
        assert busy_env_runner(ray_temp_dir, runs[1]).ppid() == rollout_node.pid
        finish(runs[1])
        rows = read_rows(output / "metrics.jsonl")
        assert [row["iteration"] for row in rows] == [1, 2, 3] and rows[2][metric_keys.ENV_RUNNER_RESTARTS] == 0
        assert (output / "resumes" / "iter_000003.yaml").is_file()
    finally:
        for run in runs:  # by pid, whatever state it is in (a no-op for one that has exited)
            run.kill()
            run.wait()
