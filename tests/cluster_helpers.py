"""A real three-master Redis Cluster for the tests, started once per session (per xdist worker) on free ports.

Three ``redis-server --cluster-enabled yes`` (append-only file on, in a temporary folder), joined by
``redis-cli --cluster create``; the fixture waits until every node says ``cluster_state:ok`` and
stops them at the end. A test runs on the cluster when its ``settings`` fixture is parametrized
indirectly with ``"cluster"`` (tests/conftest.py): ``store`` and the worker processes it starts then
use the cluster too. Nothing here stands in for Redis.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from runbrake.shared import Settings
from tests.polling import poll_until
from tests.ports import free_port

MASTERS = 3


@dataclass
class RedisCluster:
    """The session's cluster: its nodes' processes and ports."""

    processes: list[subprocess.Popen[bytes]]
    ports: list[int]

    @property
    def url(self) -> str:
        """A seed node's URL, as ``RUNBRAKE_REDIS_URL`` takes it."""
        return f"redis://127.0.0.1:{self.ports[0]}/0"

    def env(self) -> dict[str, str]:
        """What a worker process needs to use the cluster."""
        return {"RUNBRAKE_REDIS_URL": self.url, "RUNBRAKE_REDIS_CLUSTER": "true"}


def _cluster_ok(port: int) -> bool:
    client = redis.Redis(port=port, socket_connect_timeout=0.2, socket_timeout=1, decode_responses=True)
    try:
        info = client.execute_command("CLUSTER INFO")  # type: ignore[no-untyped-call]
    except redis.RedisError:
        return False
    finally:
        client.close()
    if isinstance(info, dict):  # redis-py parses the answer
        return info.get("cluster_state") == "ok"
    return "cluster_state:ok" in str(info)



def redis_answers(port: int) -> bool:
    """Does the redis-server on this loopback port answer a PING (within a fraction of a second)?"""
    client = redis.Redis(port=port, socket_connect_timeout=0.2, socket_timeout=0.5)
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False
    finally:
        client.close()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster]:
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        pytest.skip("redis-server and redis-cli are not installed here")
    folder: Path = tmp_path_factory.mktemp("redis-cluster")
    # Each node's cluster bus on a port of its own (not its port + 10000, which may be anyone's): tests/ports.py.
    ports = [free_port() for _ in range(MASTERS)]
    buses = [free_port() for _ in range(MASTERS)]
    processes = [subprocess.Popen(
        ["redis-server", "--port", str(port), "--cluster-port", str(bus), "--bind", "127.0.0.1",
         "--cluster-enabled", "yes",
         "--cluster-config-file", str(folder / f"nodes-{port}.conf"), "--cluster-node-timeout", "2000",
         "--dir", str(folder), "--appendonly", "yes", "--appendfilename", f"appendonly-{port}.aof",
         "--appenddirname", f"aof-{port}", "--save", ""],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    ) for port, bus in zip(ports, buses, strict=True)]
    try:
        for port in ports:
            poll_until(lambda port=port: redis_answers(port), timeout=10,  # type: ignore[misc]
                       failure=lambda port=port: f"redis-server on {port} did not answer")  # type: ignore[misc]
        subprocess.run(
            ["redis-cli", "--cluster", "create", *(f"127.0.0.1:{port}" for port in ports),
             "--cluster-replicas", "0", "--cluster-yes"],
            check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=30,
        )
        for port in ports:
            poll_until(lambda port=port: _cluster_ok(port), timeout=20,  # type: ignore[misc]
                       failure=lambda port=port: f"cluster node {port} never said cluster_state:ok")  # type: ignore[misc]
        yield RedisCluster(processes, ports)
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            process.wait(timeout=10)


@pytest.fixture
def cluster_settings(redis_cluster: RedisCluster, namespace: str, monkeypatch: pytest.MonkeyPatch) -> Settings:
    """This test's settings on the cluster, also set for worker processes it starts."""
    for name, value in redis_cluster.env().items():
        monkeypatch.setenv(name, value)
    return Settings.from_env()
