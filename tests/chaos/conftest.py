"""Chaos tests start their own services (never the machine's shared ones) and break them on purpose."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from tests.cluster_helpers import RedisCluster
from tests.mcp_helpers import free_port
from tests.polling import poll_until


@dataclass
class PrivateRedis:
    """A redis-server of this test's own, with AOF on in a temporary folder."""

    process: subprocess.Popen[bytes]
    port: int

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[PrivateRedis]:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed here")
    port = free_port()
    process = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--dir", str(tmp_path), "--appendonly", "yes",
         "--appendfsync", "everysec", "--save", ""],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    client = redis.Redis(port=port, socket_connect_timeout=0.2)

    def answers() -> bool:
        try:
            return bool(client.ping())
        except redis.RedisError:
            return False

    try:
        poll_until(answers, timeout=10, failure=lambda: f"redis-server on {port} did not answer")
        yield PrivateRedis(process, port)
    finally:
        client.close()
        process.terminate()
        process.wait(timeout=10)


@dataclass
class Outage:
    """A Redis the test may stop (SIGSTOP) and start again: a private single one, or every node of the
    session's cluster (tests/cluster_helpers.py; stopped together, the nodes see no failure of each other)."""

    pids: list[int]
    env: dict[str, str]


@pytest.fixture(params=["single", "cluster"])
def stoppable_redis(request: pytest.FixtureRequest) -> Outage:
    if request.param == "cluster":
        cluster: RedisCluster = request.getfixturevalue("redis_cluster")
        return Outage([p.pid for p in cluster.processes], cluster.env())
    single: PrivateRedis = request.getfixturevalue("private_redis")
    return Outage([single.process.pid], {"RUNBRAKE_REDIS_URL": single.url})
