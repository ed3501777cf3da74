"""run.py's Ray is local unless asked to join a cluster: every Ray server listens on loopback only, there is no
dashboard, a stale ``ray start`` leaves no trace, and ``--ray-address`` joins with the cluster's resources."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import ray

from experiments.run import start_ray
from experiments.settings import RunSettings


def listening_addresses(pids: set[int]) -> list[str]:
    return [c.laddr.ip for c in psutil.net_connections("tcp")
            if c.status == psutil.CONN_LISTEN and c.pid in pids]


def this_sessions_processes() -> set[int]:
    """This process and everything it started (GCS, raylet, and the workers the raylet starts)."""
    me = psutil.Process()
    return {me.pid} | {child.pid for child in me.children(recursive=True)}


def test_start_ray_listens_on_loopback_only_without_a_dashboard(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    ray.shutdown()
    try:
        start_ray(RunSettings(log_rollout_steps=False))
        ray.get(ray.remote(lambda: 1).remote())  # a worker process too
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
    command line names it is stopped by pid afterwards."""
    path = Path(tempfile.mkdtemp(prefix="rt", dir="/tmp"))
    monkeypatch.setenv("RAY_TMPDIR", str(path))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    ray.shutdown()
    yield path
    ray.shutdown()
    for proc in psutil.process_iter(["pid", "cmdline"]):
        if str(path) in " ".join(proc.info["cmdline"] or []) and proc.pid != os.getpid():
            proc.kill()
    shutil.rmtree(path, ignore_errors=True)


def test_a_stale_ray_current_cluster_file_does_not_make_a_local_run_join_it(ray_temp_dir):
    (ray_temp_dir / "ray").mkdir()
    (ray_temp_dir / "ray" / "ray_current_cluster").write_text("127.0.0.1:1")  # left by a head long gone
    start_ray(RunSettings(log_rollout_steps=False))
    assert len(ray.nodes()) == 1 and ray.cluster_resources()["CPU"] == os.cpu_count()  # its own local Ray


@pytest.mark.slow
def test_ray_address_joins_a_cluster_with_its_own_resources(ray_temp_dir):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ray_cli = Path(sys.executable).parent / "ray"
    subprocess.run([str(ray_cli), "start", "--head", f"--port={port}", "--node-ip-address=127.0.0.1",
                    f"--temp-dir={ray_temp_dir}", "--num-cpus=1", '--resources={"joined_node": 1}',
                    "--include-dashboard=false", "--disable-usage-stats"], check=True, capture_output=True,
                   env={**os.environ, "RAY_AUTH_MODE": "disabled"}, timeout=120)
    start_ray(RunSettings(ray_address=f"127.0.0.1:{port}", log_rollout_steps=False))
    resources = ray.cluster_resources()
    assert resources["CPU"] == 1 and resources["joined_node"] == 1  # the cluster's, none passed by run.py
