"""A real worker process for integration tests, and bounded waits on what it does.

The worker runs as ``python -m runbrake.worker`` in the test's namespace and writes its structlog
events as JSON lines to a file; :meth:`WorkerProcess.wait_for_log` waits on them (a
"worker_started" line, a "run_message_skipped" line), bounded. Runs are watched in the
store with :func:`wait_for_run`.

    from tests.worker_helpers import worker_fixture  # noqa: F401 - registers the `worker` fixture
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pika
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from runbrake.shared import RunRecord, RunSpec, RunStore, Settings
from runbrake.shared.catalog import Admission
from runbrake.shared.messaging.producer import Producer
from runbrake.shared.messaging.rabbitmq import build_broker
from tests.catalog_helpers import add_to_catalog
from tests.polling import poll_until

STARTUP_TIMEOUT_S = 30.0


class WorkerProcess:
    """One ``python -m runbrake.worker`` process with its log file."""

    def __init__(
        self, log_path: Path, env: Mapping[str, str], *, concurrency: int = 4, noop: bool = False,
        command: list[str] | None = None, started: int = 1,
    ) -> None:
        """Start ``python -m runbrake.worker`` (or ``command``, e.g. ``runbrake worker``) and wait until ``started``
        worker processes logged ``worker_started``."""
        self.log_path = log_path
        if command is None:
            command = [sys.executable, "-m", "runbrake.worker", "--concurrency", str(concurrency)]
            if noop:
                command.append("--noop")
        with log_path.open("wb") as log:
            self.process = subprocess.Popen(
                command, env=dict(env), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
            )
        self.wait_for_log("worker_started", count=started, timeout=STARTUP_TIMEOUT_S)

    @property
    def pid(self) -> int:
        return self.process.pid

    def events(self) -> list[dict[str, Any]]:
        """Every JSON log line so far (other lines, e.g. a traceback, are skipped)."""
        entries = []
        for line in self.log_path.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True):
            if line.startswith("{") and line.endswith("\n"):
                try:
                    entries.append(json.loads(line))
                except ValueError:
                    continue
        return entries

    def logged(self, event: str, **fields: Any) -> list[dict[str, Any]]:
        return [e for e in self.events() if e.get("event") == event and all(e.get(k) == v for k, v in fields.items())]

    def wait_for_log(self, event: str, *, count: int = 1, timeout: float = 15.0, **fields: Any) -> list[dict[str, Any]]:
        """Block until the worker logged ``event`` (with these fields) ``count`` times; fail after ``timeout`` s
        (at once when the worker has exited and never logged it)."""

        def failure() -> str:
            tail = self.log_path.read_text(errors="replace")[-3000:]
            state = f"exited {self.process.returncode}" if self.process.poll() is not None else "running"
            return f"worker ({state}) did not log {event} {fields} x{count} within {timeout:g} s:\n{tail}"

        def found() -> list[dict[str, Any]] | None:
            entries = self.logged(event, **fields)
            return entries if len(entries) >= count else None

        return poll_until(found, timeout=timeout, failure=failure, give_up=lambda: self.process.poll() is not None)

    def stop(self) -> int:
        """SIGTERM, then wait (kill after 20 s); returns the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
        return self.process.wait()


def worker_env(**overrides: str) -> dict[str, str]:
    """The test process's environment (it carries RUNBRAKE_NAMESPACE) with overrides."""
    return {**os.environ, **overrides}


@pytest.fixture(name="start_worker")
def start_worker_fixture(store: RunStore, rabbitmq: Settings, tmp_path: Path) -> Iterator[Callable[..., WorkerProcess]]:
    """A factory: ``start_worker(concurrency=4, **env)`` starts a worker; all are stopped at teardown."""
    started: list[WorkerProcess] = []

    def start(*, concurrency: int = 4, noop: bool = False, **env: str) -> WorkerProcess:
        worker = WorkerProcess(tmp_path / f"worker-{len(started)}.log", worker_env(**env), concurrency=concurrency,
                               noop=noop)
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.stop()


@pytest.fixture(name="worker")
def worker_fixture(start_worker: Callable[..., WorkerProcess]) -> WorkerProcess:
    """One running worker in this test's namespace."""
    return start_worker()


@pytest.fixture(name="producer")
def producer_fixture(store: RunStore, rabbitmq: Settings) -> Iterator[Producer]:
    broker = build_broker(rabbitmq)
    yield Producer(store, broker, Admission.from_settings(rabbitmq))
    broker.close()


def spec(servers: Mapping[str, Any], turns: list[dict[str, Any]], **extra: Any) -> RunSpec:
    """A scripted run spec over these MCP servers (name → McpServerSpec or its dict), which are written into
    the test's catalog; the spec names them."""
    add_to_catalog(servers)
    return RunSpec.parse({"input": "test run", "model": {"provider": "scripted", "turns": turns},
                          "mcp_servers": list(servers), **extra})


def call(tool: str, server: str = "toolbox", **arguments: Any) -> dict[str, Any]:
    return {"server": server, "tool": tool, "arguments": arguments}


Metrics = dict[tuple[str, tuple[tuple[str, str], ...]], float]
"""A scrape of /metrics: (sample name, its labels sorted) → value."""


def scrape_metrics(port: int) -> Metrics:
    """What a worker's /metrics (``RUNBRAKE_METRICS_PORT``) serves now."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return {
            (sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(response.read().decode())
            for sample in family.samples
        }


def wait_for_run(
    store: RunStore, run_id: str, done: Callable[[RunRecord], bool] = lambda r: r.status.is_terminal,
    *, timeout: float = 20.0,
) -> RunRecord:
    """Block until the stored run satisfies ``done``; fail the test after ``timeout`` s."""
    def reached() -> RunRecord | None:
        record = store.get(run_id)
        return record if done(record) else None

    def failure() -> str:
        record = store.get(run_id)
        steps = [(s.kind.value, s.tool_name, s.tool_outcome) for s in record.steps]
        return f"run {run_id} did not get there within {timeout:g} s: {record.status.value}, steps {steps}"

    return poll_until(reached, timeout=timeout, failure=failure)


def has_step(kind: str, count: int = 1) -> Callable[[RunRecord], bool]:
    return lambda record: sum(1 for s in record.steps if s.kind.value == kind) >= count


@contextmanager
def redis_monitor(settings: Settings, *, timeout: float = 15.0) -> Iterator[redis.client.Monitor]:
    """Redis's MONITOR on a connection of its own: every command the server executes, in order.

    Deterministic where ``INFO commandstats`` is not: other clients of the same Redis can be told apart.
    A read that waits longer than ``timeout`` raises ``redis.TimeoutError``.
    """
    client = redis.Redis.from_url(settings.redis_url, decode_responses=True, socket_timeout=timeout)
    try:
        with client.monitor() as monitor:
            yield monitor
    finally:
        client.close()


def commands_until_marker(monitor: redis.client.Monitor, store: RunStore) -> list[dict[str, Any]]:
    """Every command MONITOR saw from now back to when it started, up to an ECHO marker sent here."""
    marker = f"end-of-window-{uuid.uuid4().hex}"
    store.redis.echo(marker)
    seen = []
    for entry in monitor.listen():
        if marker in entry["command"]:
            return seen
        seen.append(entry)
    return seen


def take_messages(settings: Settings, queue: str, count: int, *,
                  timeout: float = 20) -> list[tuple[bytes, dict[str, Any]]]:
    """Take ``count`` messages off ``queue`` (a bounded wait), each with its headers."""
    connection = pika.BlockingConnection(pika.URLParameters(settings.rabbitmq_url))
    taken: list[tuple[bytes, dict[str, Any]]] = []
    try:
        channel = connection.channel()

        def take() -> bool:
            method, properties, body = channel.basic_get(queue=queue, auto_ack=True)
            if method is not None:
                taken.append((body, dict(properties.headers or {})))
            return len(taken) >= count

        poll_until(take, timeout=timeout, failure=lambda: f"only {len(taken)} of {count} messages on {queue}: {taken}")
    finally:
        connection.close()
    return taken


def servers_json() -> list[dict[str, Any]]:
    """What ``runbrake servers --json`` prints in this test's environment (its namespace)."""
    shown = subprocess.run([sys.executable, "-c", "from runbrake.broker.cli import main; main()", "servers", "--json"],
                           env=dict(os.environ), capture_output=True, text=True, timeout=30, check=False)
    assert shown.returncode == 0, shown.stderr
    health: list[dict[str, Any]] = json.loads(shown.stdout)
    return health
