"""run.py's Ray is local: every Ray server listens on loopback only, and there is no dashboard."""

from __future__ import annotations

import socket

import psutil
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
