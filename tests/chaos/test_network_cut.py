"""A worker cut off from the network while its process keeps running (issue 21, item 3).

The worker runs in a network namespace of the test's own (``ip netns``), joined to the host by two veth
pairs: one to a Redis of the test's own, one to a RabbitMQ node of the test's own, each listening on
loopback (for the test and the other worker) and on its veth address (for the cut-off worker). Taking a
pair's host end down cuts the worker off from that service alone; its process, and the MCP server it
started over stdio, run on.

- Cut off from both for longer than the lease, in three tool calls: another worker reaps the runs
  ``lease_lost``. The cut-off worker cannot tell until it reaches Redis again; then its lease renewal is
  refused, it interrupts the three calls and makes no further call, and nothing it writes lands (the
  owner is a fencing token: docs/leases.md, "Leases").
- Cut off from RabbitMQ only: a cancel's wake-up cannot reach it, and the backstop, which polls Redis,
  interrupts the call within two polls (docs/cancellation.md, "Cancellation: the backstop").

Skipped, saying why, where network namespaces cannot be made (not root, no ``ip``, a sandbox without them).
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from runbrake.shared import RunStatus, TerminationReason
from runbrake.shared.outcome import ToolOutcome
from tests.chaos.conftest import RABBITMQ_SERVER, Client, PrivateRabbitMQ, PrivateRedis, _spawn_redis
from tests.mcp_helpers import matching_events, stdio_toolbox, wait_for_event
from tests.ports import free_port
from tests.worker_helpers import WorkerProcess, call, spec, wait_for_run, worker_env

LEASE_S = 5
"""The shortest lease there is (RUNBRAKE_LEASE_S' minimum): the cut lasts a little longer than one."""


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


@dataclass
class Netns:
    """A network namespace with two links to the host: ``redis`` and ``rabbitmq``, each a veth pair."""

    name: str
    subnet: int
    """10.201.<subnet>.0/30 is the Redis link, 10.202.<subnet>.0/30 the RabbitMQ link."""

    def host_ip(self, link: str) -> str:
        return f"10.{201 if link == 'redis' else 202}.{self.subnet}.1"

    @staticmethod
    def _letter(link: str) -> str:
        return {"redis": "d", "rabbitmq": "q"}[link]

    def _host_end(self, link: str) -> str:
        return f"rb{self._letter(link)}{self.subnet}h"

    def command(self, *argv: str) -> list[str]:
        """``argv`` run inside the namespace."""
        return ["ip", "netns", "exec", self.name, *argv]

    def create(self) -> None:
        _ip("-n", self.name, "link", "set", "lo", "up")
        for link in ("redis", "rabbitmq"):
            host, inner = self._host_end(link), f"rb{self._letter(link)}{self.subnet}n"
            _ip("link", "add", host, "type", "veth", "peer", "name", inner, "netns", self.name)
            prefix = self.host_ip(link).rsplit(".", 1)[0]
            _ip("addr", "add", f"{prefix}.1/30", "dev", host)
            _ip("-n", self.name, "addr", "add", f"{prefix}.2/30", "dev", inner)
            _ip("link", "set", host, "up")
            _ip("-n", self.name, "link", "set", inner, "up")

    def cut(self, *links: str) -> None:
        for link in links:
            _ip("link", "set", self._host_end(link), "down")

    def restore(self, *links: str) -> None:
        for link in links:
            _ip("link", "set", self._host_end(link), "up")

    def delete(self) -> None:
        # Deleting the namespace deletes the inner ends, and with them the host ends of the pairs.
        subprocess.run(["ip", "netns", "delete", self.name], capture_output=True, timeout=10, check=False)


@pytest.fixture
def netns() -> Iterator[Netns]:
    if shutil.which("ip") is None:
        pytest.skip("network namespaces: the ip command (iproute2) is not installed here")
    if os.geteuid() != 0:
        pytest.skip("network namespaces: ip netns needs root (CAP_SYS_ADMIN and CAP_NET_ADMIN)")
    used = subprocess.run(["ip", "-4", "addr"], capture_output=True, text=True, timeout=10, check=False).stdout
    subnet = random.choice([n for n in range(1, 255) if f"10.201.{n}." not in used and f"10.202.{n}." not in used])
    space = Netns(f"rb-{uuid.uuid4().hex[:8]}", subnet)
    try:
        _ip("netns", "add", space.name)
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"network namespaces are not permitted here: {exc.stderr.decode(errors='replace').strip()}")
    try:
        space.create()
        yield space
    finally:
        space.delete()


@dataclass
class Services:
    redis: PrivateRedis
    rabbitmq: PrivateRabbitMQ
    inside: dict[str, str]
    """The environment of a worker inside the namespace: the services at their veth addresses."""


@pytest.fixture
def services(netns: Netns, tmp_path: Path) -> Iterator[Services]:
    """A Redis and a RabbitMQ node of the test's own, on loopback and on the namespace's links."""
    if shutil.which("redis-server") is None or not os.access(RABBITMQ_SERVER, os.X_OK):
        pytest.skip("redis-server or rabbitmq-server is not installed here")
    redis_port = free_port()
    command = ["redis-server", "--port", str(redis_port), "--bind", "127.0.0.1", netns.host_ip("redis"),
               "--dir", str(tmp_path), "--appendonly", "yes", "--save", "",
               "--protected-mode", "no"]  # bound to loopback and the test's own link only
    redis = PrivateRedis(_spawn_redis(command), redis_port, command)
    rabbitmq = PrivateRabbitMQ(tmp_path / "rabbitmq", free_port(), free_port())
    rabbitmq.prepare()
    with (rabbitmq.base / "rabbitmq.conf").open("a") as conf:
        conf.write(f"listeners.tcp.netns = {netns.host_ip('rabbitmq')}:{rabbitmq.port}\n")
    try:
        redis.wait_until_answering()
        rabbitmq.start()
        yield Services(redis, rabbitmq, {
            "RUNBRAKE_REDIS_URL": f"redis://{netns.host_ip('redis')}:{redis_port}/0",
            "RUNBRAKE_RABBITMQ_URL": f"amqp://guest:guest@{netns.host_ip('rabbitmq')}:{rabbitmq.port}/",
        })
    finally:
        rabbitmq.kill()
        redis.stop()


@pytest.fixture
def client(services: Services, point_at: Callable[..., Client]) -> Client:
    """The test (and every worker it starts outside the namespace) on the services' loopback addresses. The
    lost-worker sweep is held off (ten minutes): here the lease alone decides (docs/leases.md, "Leases")."""
    return point_at({"RUNBRAKE_REDIS_URL": services.redis.url, "RUNBRAKE_RABBITMQ_URL": services.rabbitmq.url,
                     "RUNBRAKE_WORKER_LOST_S": "600"}, lease_s=LEASE_S)


@pytest.fixture
def start_inside(netns: Netns, services: Services, client: Client,
                 tmp_path: Path) -> Iterator[Callable[[], WorkerProcess]]:
    workers: list[WorkerProcess] = []

    def start() -> WorkerProcess:
        argv = netns.command(sys.executable, "-m", "runbrake.worker", "--concurrency", "4")
        worker = WorkerProcess(tmp_path / f"inside-{len(workers)}.log", worker_env(**services.inside), command=argv)
        workers.append(worker)
        return worker

    yield start
    netns.restore("redis", "rabbitmq")
    for worker in workers:
        worker.stop()


@pytest.fixture
def start_outside(client: Client, tmp_path: Path) -> Iterator[Callable[[], WorkerProcess]]:
    workers: list[WorkerProcess] = []

    def start() -> WorkerProcess:
        worker = WorkerProcess(tmp_path / f"outside-{len(workers)}.log", worker_env())
        workers.append(worker)
        return worker

    yield start
    for worker in workers:
        worker.stop()


def test_a_worker_cut_off_past_its_lease_is_reaped_then_interrupts_its_calls_and_writes_nothing(
    netns: Netns, client: Client, start_inside: Callable[[], WorkerProcess],
    start_outside: Callable[[], WorkerProcess], tmp_path: Path,
) -> None:
    toolbox = stdio_toolbox(tmp_path / "toolbox-events.jsonl")
    cut_off = start_inside()
    runs = [client.producer.enqueue(spec({"toolbox": toolbox.spec}, [
        {"tool_calls": [call("slow", seconds=120)]}, {"tool_calls": [call("get-sum", a=1, b=2)]},
        {"content": "never"}])).run_id for _ in range(3)]
    wait_for_event(toolbox.events, "started", tool="slow", count=3, timeout=30)

    netns.cut("redis", "rabbitmq")
    try:
        start_outside()  # the reaper, started after the cut: the runs cannot end before it
        reaped = {run_id: wait_for_run(client.store, run_id, timeout=60) for run_id in runs}
    finally:
        netns.restore("redis", "rabbitmq")
    for run_id in runs:
        cut_off.wait_for_log("run_segment_ended", run_id=run_id, timeout=60)

    for run_id, record in reaped.items():
        assert (record.status, record.termination_reason) == (RunStatus.FAILED, TerminationReason.LEASE_LOST)
        after = client.store.get(run_id)
        assert (after.status, len(after.steps)) == (RunStatus.FAILED, len(record.steps))  # nothing it wrote landed
        assert cut_off.logged("run_segment_ended", run_id=run_id)[0]["outcome"] == "lost"
    # It could tell once it reached Redis again (a keeper round may come again before a run has stopped).
    assert {entry["run_id"] for entry in cut_off.logged("lease_not_renewed")} == set(runs)
    assert matching_events(toolbox.events, "finished", tool="slow") == []  # the three calls were interrupted
    assert matching_events(toolbox.events, "started", tool="get-sum") == []  # and no further call was made


def test_a_worker_cut_off_from_rabbitmq_only_still_gets_a_cancel_through_the_backstop(
    netns: Netns, client: Client, start_inside: Callable[[], WorkerProcess], tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("RUNBRAKE_LEASE_S", "60")  # the default: the lease keeper renews every 20 s
    toolbox = stdio_toolbox(tmp_path / "toolbox-events.jsonl")
    cut_off = start_inside()
    run_id = client.producer.enqueue(spec({"toolbox": toolbox.spec}, [
        {"tool_calls": [call("slow", seconds=120)]}, {"content": "never"}])).run_id
    wait_for_event(toolbox.events, "started", tool="slow", timeout=30)

    netns.cut("rabbitmq")
    cancelled = subprocess.run([str(Path(sys.executable).parent / "runbrake"), "cancel", run_id, "--json"],
                               capture_output=True, text=True, timeout=60, env=worker_env(), check=False)
    assert cancelled.returncode == 0, cancelled.stderr
    record = wait_for_run(client.store, run_id, lambda r: any(
        step.tool_outcome is ToolOutcome.CANCELLED for step in r.steps), timeout=30)

    assert record.status is RunStatus.CANCELLED
    # The backstop's two polls (250 ms apart) find it; the lease keeper, renewing every 20 s, may find the
    # renewal refused first and interrupt it as a cancel too.
    found = cut_off.logged("cancel_found_by_backstop", run_id=run_id) + cut_off.logged(
        "cancel_found_by_lease_keeper", run_id=run_id)
    assert len(found) == 1, found
    assert cut_off.logged("cancel_message_delivered", run_id=run_id) == []  # the wake-up never reached it
    assert matching_events(toolbox.events, "finished", tool="slow") == []
