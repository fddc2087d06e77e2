"""Chaos tests start their own services (never the machine's shared ones) and break them on purpose.

``private_redis``: a redis-server with AOF on, in the test's temporary folder, that the test may
stop, pause or restart. ``private_rabbitmq``: a RabbitMQ node of the test's own (its own node name,
ports, data and log folders, config file and Erlang cookie) that the test may kill -9 and start
again on the same port with the same data. The machine's shared Redis (6379) and RabbitMQ (5672)
are never touched.
"""

from __future__ import annotations

import contextlib
import os
import random
import secrets
import shutil
import signal
import subprocess
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import pika
import pika.exceptions
import pytest
import redis

from runbrake.shared import RunStore, Settings
from runbrake.shared.catalog import Admission
from runbrake.shared.messaging.producer import Producer
from runbrake.shared.messaging.rabbitmq import RunbrakeBroker, build_broker
from tests.cluster_helpers import RedisCluster, redis_answers
from tests.mcp_helpers import Toolbox, wait_for_event
from tests.polling import poll_until
from tests.ports import free_port, port_is_free
from tests.worker_helpers import WorkerProcess, call, spec

REDIS_START_TIMEOUT_S = 10.0
RABBITMQ_START_TIMEOUT_S = 60.0
"""A node boots in about 3 s on an idle 2-core machine; generous for a loaded CI runner."""


@dataclass
class PrivateRedis:
    """A redis-server of this test's own, with AOF on (``appendfsync everysec``) in a temporary folder."""

    process: subprocess.Popen[bytes]
    port: int
    command: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def answers(self) -> bool:
        return redis_answers(self.port)

    def stop(self) -> None:
        """A clean shutdown: SIGTERM makes redis-server fsync its AOF and exit (a SHUTDOWN, not a crash)."""
        if self.process.poll() is None:
            self.process.terminate()
        self.process.wait(timeout=10)

    def start(self) -> None:
        """Start redis-server (again) on the same port and folder; returns once it answers PING."""
        self.process = _spawn_redis(self.command)
        self.wait_until_answering()

    def wait_until_answering(self) -> None:
        poll_until(self.answers, timeout=REDIS_START_TIMEOUT_S,
                   failure=lambda: f"redis-server on {self.port} did not answer",
                   give_up=lambda: self.process.poll() is not None)

    def restart(self) -> None:
        self.stop()
        self.start()


def _spawn_redis(command: list[str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[PrivateRedis]:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed here")
    port = free_port()
    command = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--dir", str(tmp_path),
               "--appendonly", "yes", "--appendfsync", "everysec", "--save", ""]
    server = PrivateRedis(_spawn_redis(command), port, command)
    try:
        server.wait_until_answering()
        yield server
    finally:
        server.stop()


LOUD = frozenset({"warning", "error", "critical", "exception"})
MAX_LINES_PER_OUTAGE = 8
"""Lines at warning level or above one worker may log for a RabbitMQ outage: one when each of its connections
(the run consumers, the cancel listener, the cancel-, run-, steer- and continue-request consumers, the event
relay) is lost, one to spare, and nothing per reconnect attempt (issue 21: a 20 s outage used to log about
190)."""


def logged_since(entry: Mapping[str, object], since: float) -> bool:
    """Was this JSON log line written at or after ``since`` (epoch seconds)?"""
    return datetime.fromisoformat(str(entry["timestamp"])).timestamp() >= since


def loud_lines(worker: WorkerProcess, since: float) -> list[str]:
    """The events a worker logged at warning level or above since ``since`` (epoch seconds), and every line
    of its log that is not JSON (a traceback, a library's own output)."""
    lines = worker.log_path.read_text(errors="replace").splitlines()
    return [*(str(e["event"]) for e in worker.events() if e.get("level") in LOUD and logged_since(e, since)),
            *(line[:200] for line in lines if not line.startswith("{"))]


def enqueue_call(producer: Producer, toolbox: Toolbox, seconds: float) -> str:
    """Enqueue a run of one ``slow`` call of ``seconds`` on ``toolbox``: the call's length names the run in
    the server's events."""
    return producer.enqueue(spec({"toolbox": toolbox.spec}, [
        {"tool_calls": [call("slow", seconds=seconds)]}, {"content": "done"}])).run_id


def start_batch(producer: Producer, toolbox: Toolbox, *, runs: int, long: int,
                finished: int) -> tuple[list[str], dict[str, float]]:
    """``long`` runs in a call of 600 s or more (only a cancel ends them), each started; then the rest of
    ``runs``, each a call of about 0.2 s, until ``finished`` of them are done. Returns the long runs and the
    short ones with their call's length."""
    long_runs = [enqueue_call(producer, toolbox, 600 + i) for i in range(long)]
    wait_for_event(toolbox.events, "started", tool="slow", count=long, timeout=30)
    short = {enqueue_call(producer, toolbox, 0.2 + i / 10_000): 0.2 + i / 10_000 for i in range(runs - long)}
    wait_for_event(toolbox.events, "finished", tool="slow", count=finished, timeout=30)
    return long_runs, short


@dataclass
class Client:
    """What a test needs to enqueue runs and read them on a Redis of its own."""

    settings: Settings
    store: RunStore
    producer: Producer


@pytest.fixture
def point_at(monkeypatch: pytest.MonkeyPatch, rabbitmq: Settings) -> Iterator[Callable[..., Client]]:
    """``point_at(env, lease_s=…)``: this test, and the workers it starts from now on, use the Redis that
    ``env`` names (``RUNBRAKE_REDIS_URL``…), with this lease and a short socket timeout (half a second:
    a paused Redis is noticed at once). The namespace is
    deleted there at the end."""
    opened: list[tuple[RunStore, RunbrakeBroker]] = []

    def point(env: Mapping[str, str], *, lease_s: int, redis_timeout_s: float = 0.5) -> Client:
        for name, value in {**env, "RUNBRAKE_REDIS_TIMEOUT_S": str(redis_timeout_s),
                            "RUNBRAKE_LEASE_S": str(lease_s)}.items():
            monkeypatch.setenv(name, value)
        settings = Settings.from_env()
        store, broker = RunStore.connect(settings), build_broker(settings)
        opened.append((store, broker))
        return Client(settings, store, Producer(store, broker, Admission.from_settings(settings)))

    yield point
    for store, broker in opened:
        broker.close()
        store.delete_namespace()
        store.close()


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


RABBITMQ_SERVER = "/usr/lib/rabbitmq/bin/rabbitmq-server"
"""The server script itself: Debian's /usr/sbin wrapper would switch to the rabbitmq user (whose home holds
the shared node's cookie) and send the output to /var/log/rabbitmq."""
RABBITMQCTL = "/usr/lib/rabbitmq/bin/rabbitmqctl"


@dataclass
class PrivateRabbitMQ:
    """A RabbitMQ node of this test's own. ``kill()`` is a kill -9 of the whole node (its process group:
    the start script, beam.smp and its port programs); ``start()`` boots it again on the same port and
    data folder, so durable queues and the persistent messages in them survive."""

    base: Path
    port: int
    dist_port: int
    process: subprocess.Popen[bytes] | None = None
    starts: int = 0

    @property
    def nodename(self) -> str:
        return f"chaos-{self.port}@localhost"

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port}/"

    def env(self) -> dict[str, str]:
        return {
            **os.environ,
            "HOME": str(self.base / "home"),  # the Erlang cookie of this node and its rabbitmqctl
            "RABBITMQ_CONF_ENV_FILE": str(self.base / "rabbitmq-env.conf"),  # not /etc's (NODENAME=rabbit@…)
            "RABBITMQ_NODENAME": self.nodename,
            "RABBITMQ_NODE_PORT": str(self.port),
            "RABBITMQ_DIST_PORT": str(self.dist_port),
            "RABBITMQ_MNESIA_BASE": str(self.base / "mnesia"),
            "RABBITMQ_LOG_BASE": str(self.base / "log"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(self.base / "enabled_plugins"),
            # RabbitMQ 3.10 takes the .conf path with its extension (checked: "Config file(s): …/rabbitmq.conf").
            "RABBITMQ_CONFIG_FILE": str(self.base / "rabbitmq.conf"),
        }

    def prepare(self, cookie: str = "") -> None:
        """Write the node's folders and files; ``cookie``: its Erlang cookie (nodes of one cluster share one)."""
        for folder in ("home", "mnesia", "log"):
            (self.base / folder).mkdir(parents=True, exist_ok=True)
        if cookie:
            path = self.base / "home" / ".erlang.cookie"
            path.write_text(cookie)
            path.chmod(0o400)
        (self.base / "rabbitmq-env.conf").write_text("")
        (self.base / "enabled_plugins").write_text("[].\n")
        # /etc/rabbitmq/rabbitmq.conf pins the listener to 5672: this node has a file of its own.
        (self.base / "rabbitmq.conf").write_text(
            f"listeners.tcp.local = 127.0.0.1:{self.port}\nloopback_users = none\n")

    def answers(self) -> bool:
        parameters = pika.URLParameters(self.url)
        parameters.connection_attempts = 1
        parameters.socket_timeout = 1
        parameters.blocked_connection_timeout = 1
        try:
            pika.BlockingConnection(parameters).close()
        except pika.exceptions.AMQPError:
            return False
        return True

    def start(self) -> float:
        """Boot the node and return once it accepts an AMQP connection; returns how long that took (s)."""
        began = time.monotonic()
        self.spawn()
        self.wait_until_answering()
        return time.monotonic() - began

    def spawn(self) -> None:
        """Start booting the node (:meth:`wait_until_answering` waits for it): several boot at once."""
        assert self.process is None or self.process.poll() is not None, "the node is running"
        self.starts += 1
        with (self.base / f"server-{self.starts}.out").open("wb") as out:
            self.process = subprocess.Popen(
                [RABBITMQ_SERVER], env=self.env(), cwd=self.base, stdin=subprocess.DEVNULL, stdout=out,
                stderr=subprocess.STDOUT, start_new_session=True,  # its own process group, for kill()
            )

    def wait_until_answering(self) -> None:
        process = self.process
        assert process is not None, "the node was never started"
        poll_until(self.answers, timeout=RABBITMQ_START_TIMEOUT_S, interval=0.2,
                   give_up=lambda: process.poll() is not None, failure=self._failure)

    def ctl(self, *args: str, timeout: float = RABBITMQ_START_TIMEOUT_S) -> str:
        """``rabbitmqctl -n <this node> ARGS`` (with this node's cookie); returns its output."""
        done = subprocess.run([RABBITMQCTL, "-n", self.nodename, *args], env=self.env(), cwd=self.base,
                              capture_output=True, text=True, timeout=timeout, check=False)
        assert done.returncode == 0, f"rabbitmqctl {' '.join(args)} on {self.nodename}: {done.stderr[-2000:]}"
        return done.stdout

    def kill(self) -> None:
        """kill -9 of the node's process group; returns once the node no longer accepts connections."""
        if self.process is None or self.process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=10)
        poll_until(lambda: not self.answers(), timeout=10, failure=lambda: f"{self.nodename} still answers")

    def _failure(self) -> str:
        state = "exited" if self.process is not None and self.process.poll() is not None else "running"
        out = (self.base / f"server-{self.starts}.out").read_text(errors="replace")[-3000:]
        return (f"RabbitMQ node {self.nodename} ({state}) did not accept AMQP within "
                f"{RABBITMQ_START_TIMEOUT_S:g} s:\n{out}")


@pytest.fixture
def private_rabbitmq(tmp_path: Path) -> Iterator[PrivateRabbitMQ]:
    if not os.access(RABBITMQ_SERVER, os.X_OK):
        pytest.skip(f"{RABBITMQ_SERVER} is not installed here")
    port = free_port()
    dist_port = free_port()
    node = PrivateRabbitMQ(tmp_path / "rabbitmq", port, dist_port)
    node.prepare()
    try:
        node.start()
        yield node
    finally:
        node.kill()


SENTINEL_MASTER = "chaos"
SENTINELS = 3
SENTINEL_DOWN_AFTER_MS = 3000
"""How long a Sentinel waits for an answer before it takes a node for down. At 1000 ms (its ping period) a
Sentinel took the replica it had just promoted for down a second later, on a quiet 2-core machine with 50
runs' writes arriving, and failed over again."""
FAILOVER_TIMEOUT_S = 30.0
"""Sentinels declare the primary down after 3 s and elect a leader within a few: generous for a loaded runner."""


@dataclass
class RedisFailover:
    """A Redis primary and its replica (AOF on, each in a folder of its own) watched by three Sentinels
    (quorum 2, a primary is down after 3 s without an answer), all of this test's own. ``nodes`` by port:
    which one is the primary changes with a failover (:meth:`primary_port`)."""

    nodes: dict[int, PrivateRedis]
    sentinels: list[subprocess.Popen[bytes]]
    sentinel_ports: list[int]
    sentinel_logs: list[Path] = field(default_factory=list)

    def sentinels_said(self) -> str:
        """What the Sentinels logged of their view (``+sdown``, ``+switch-master``, …), for a failure."""
        lines = [line for log in self.sentinel_logs if log.exists()
                 for line in log.read_text(errors="replace").splitlines() if " # " in line or " * +" in line]
        return "\n".join(sorted(lines, key=lambda line: line.split(" ", 2)[-1])[-40:])

    def env(self) -> dict[str, str]:
        """What a store (and a worker) needs to find the primary through the Sentinels; the URL says only the
        database."""
        return {"RUNBRAKE_REDIS_SENTINELS": ",".join(f"127.0.0.1:{port}" for port in self.sentinel_ports),
                "RUNBRAKE_REDIS_SENTINEL_MASTER": SENTINEL_MASTER, "RUNBRAKE_REDIS_URL": "redis://127.0.0.1/0"}

    def _ask(self, port: int, *command: str) -> Any:
        client = redis.Redis(port=port, socket_connect_timeout=0.5, socket_timeout=1, decode_responses=True)
        try:
            return client.execute_command(*command)  # type: ignore[no-untyped-call]
        finally:
            client.close()

    def primary_port(self) -> int | None:
        """The primary's port, as a majority of the Sentinels name it (None while they disagree)."""
        named = []
        for port in self.sentinel_ports:
            try:
                address = self._ask(port, "SENTINEL", "GET-MASTER-ADDR-BY-NAME", SENTINEL_MASTER)
            except redis.RedisError:
                continue
            if address:
                named.append(int(address[1]))
        counts = Counter(named)
        port, votes = counts.most_common(1)[0] if counts else (None, 0)
        return port if votes >= 2 else None

    def replicating(self, port: int) -> bool:
        """Is the node on ``port`` a replica with its link to the primary up?"""
        try:
            info = self._ask(port, "INFO", "replication")
        except redis.RedisError:
            return False
        text = info if isinstance(info, str) else "\n".join(f"{k}:{v}" for k, v in info.items())
        return "role:slave" in text and "master_link_status:up" in text

    def watched(self) -> bool:
        """Every Sentinel knows the primary, its replica and the other two Sentinels (ready for a failover)."""
        for port in self.sentinel_ports:
            try:
                state = self._ask(port, "SENTINEL", "MASTER", SENTINEL_MASTER)
            except redis.RedisError:
                return False
            fields = state if isinstance(state, dict) else dict(zip(state[::2], state[1::2], strict=True))
            if int(fields.get("num-other-sentinels", 0)) < SENTINELS - 1 or int(fields.get("num-slaves", 0)) < 1:
                return False
        return True

    def kill_primary(self) -> int:
        """kill -9 of the primary; returns its port."""
        port = self.primary_port()
        assert port is not None, "the Sentinels name no primary"
        process = self.nodes[port].process
        process.kill()
        process.wait(timeout=10)
        return port

    def wait_for_failover(self, old: int) -> tuple[int, float]:
        """Block until the Sentinels name another primary; returns it and how long that took (s)."""
        began = time.monotonic()
        def promoted() -> int | None:
            port = self.primary_port()
            return port if port not in (None, old) else None

        port = poll_until(promoted, timeout=FAILOVER_TIMEOUT_S, interval=0.1,
                          failure=lambda: f"the Sentinels did not promote the replica within {FAILOVER_TIMEOUT_S:g} s; "
                                          f"they logged:\n{self.sentinels_said()}")
        return port, time.monotonic() - began

    def rejoin(self, port: int) -> float:
        """Start the node on ``port`` again (its folder and AOF) as a replica of the primary the Sentinels now
        name, as a node's start script asks them before it starts. Started as a primary instead, it would
        serve its stale data as one until the Sentinels reconfigure it (8-10 s), and a second failover
        meanwhile can promote it: seen once here, when a Sentinel took the just-promoted replica for down.
        Returns once its link is up, and how long that took (s)."""
        began = time.monotonic()
        primary = self.primary_port()
        assert primary is not None, "the Sentinels name no primary"
        assert primary != port, "the Sentinels still name the killed node"
        node = self.nodes[port]
        node.command = [*node.command, "--replicaof", "127.0.0.1", str(primary)]
        node.start()
        poll_until(lambda: self.replicating(port), timeout=FAILOVER_TIMEOUT_S, interval=0.1,
                   failure=lambda: f"redis-server on {port} did not become a replica of {primary}; the Sentinels "
                                   f"logged:\n{self.sentinels_said()}")
        return time.monotonic() - began


def _sentinel_command(config: Path) -> list[str]:
    """Debian's ``redis-sentinel`` where installed; else ``redis-server --sentinel``, the same program."""
    if shutil.which("redis-sentinel") is not None:
        return ["redis-sentinel", str(config)]
    return ["redis-server", str(config), "--sentinel"]


@pytest.fixture
def redis_failover(tmp_path: Path) -> Iterator[RedisFailover]:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed here")
    primary_port, replica_port = free_port(), free_port()
    nodes: dict[int, PrivateRedis] = {}
    sentinels: list[subprocess.Popen[bytes]] = []
    sentinel_ports = [free_port() for _ in range(SENTINELS)]
    try:
        for port, extra in ((primary_port, []), (replica_port, ["--replicaof", "127.0.0.1", str(primary_port)])):
            folder = tmp_path / f"redis-{port}"
            folder.mkdir()
            command = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--dir", str(folder),
                       "--appendonly", "yes", "--appendfsync", "everysec", "--save", "",
                       "--repl-diskless-sync-delay", "0", "--logfile", str(folder / "redis.log"), *extra]
            nodes[port] = PrivateRedis(_spawn_redis(command), port, command)
            nodes[port].wait_until_answering()
        for port in sentinel_ports:
            config = tmp_path / f"sentinel-{port}.conf"  # a Sentinel rewrites its file: one each
            config.write_text(
                f"port {port}\nbind 127.0.0.1\ndir {tmp_path}\n"
                f"sentinel monitor {SENTINEL_MASTER} 127.0.0.1 {primary_port} 2\n"
                f"sentinel down-after-milliseconds {SENTINEL_MASTER} {SENTINEL_DOWN_AFTER_MS}\n"
                f"sentinel failover-timeout {SENTINEL_MASTER} 10000\n"
                f"logfile {tmp_path / f'sentinel-{port}.log'}\n")
            sentinels.append(subprocess.Popen(_sentinel_command(config), stdout=subprocess.DEVNULL,
                                              stderr=subprocess.DEVNULL))
        failover = RedisFailover(nodes, sentinels, sentinel_ports,
                                 [tmp_path / f"sentinel-{port}.log" for port in sentinel_ports])
        poll_until(lambda: failover.replicating(replica_port), timeout=REDIS_START_TIMEOUT_S,
                   failure=lambda: "the replica did not connect to the primary")
        poll_until(failover.watched, timeout=FAILOVER_TIMEOUT_S, interval=0.2,
                   failure=lambda: "the Sentinels did not find each other and the replica")
        yield failover
    finally:
        for sentinel in sentinels:
            sentinel.terminate()
        for node in nodes.values():
            node.stop()
        for sentinel in sentinels:
            sentinel.wait(timeout=10)


CLUSTER_NODES = 3


def _quiet_ports(count: int) -> list[int]:
    """Free ports below Linux's ephemeral range (32768-60999): a node binds its distribution port seconds after
    it starts, by when a port picked from that range may have become some client socket's (a node failed to
    boot with ``dist_port_already_used … not_erlang``). Below 25000, so that the CLI's own distribution ports
    (the node's + 10000…10010) stay below it too."""
    ports: list[int] = []
    while len(ports) < count:
        port = random.randint(15_000, 24_990)  # not a secret: any free port will do
        if port not in ports and port_is_free(port):
            ports.append(port)
    return ports


@dataclass
class RabbitMQCluster:
    """Three RabbitMQ nodes of this test's own, joined into one cluster (``rabbitmqctl join_cluster``)."""

    nodes: list[PrivateRabbitMQ]
    boot_s: float
    """From the first node's start to the cluster of three answering."""

    @property
    def url(self) -> str:
        """``RUNBRAKE_RABBITMQ_URL`` naming every node, in order."""
        return ",".join(node.url for node in self.nodes)


@pytest.fixture
def rabbitmq_cluster(tmp_path: Path) -> Iterator[RabbitMQCluster]:
    if not os.access(RABBITMQ_SERVER, os.X_OK):
        pytest.skip(f"{RABBITMQ_SERVER} is not installed here")
    cookie = secrets.token_hex(16).upper()
    ports = _quiet_ports(2 * CLUSTER_NODES)
    nodes = [PrivateRabbitMQ(tmp_path / f"rabbitmq-{i}", ports[2 * i], ports[2 * i + 1]) for i in range(CLUSTER_NODES)]
    began = time.monotonic()
    try:
        for node in nodes:
            node.prepare(cookie)
            node.spawn()  # the three boot at once: one after another would take three times as long
        for node in nodes:
            node.wait_until_answering()
        first = nodes[0]
        for node in nodes[1:]:
            node.ctl("stop_app")
            node.ctl("join_cluster", first.nodename)
            node.ctl("start_app")
            node.wait_until_answering()
        running = first.ctl("cluster_status", "--formatter", "json")
        assert all(node.nodename in running for node in nodes), running
        yield RabbitMQCluster(nodes, time.monotonic() - began)
    finally:
        for node in nodes:
            node.kill()
