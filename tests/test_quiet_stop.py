"""A clean stop is quiet: a worker that ran runs and is then stopped logs nothing at error level
(docs/architecture.md, "The worker's parts"), and the MCP SDK's normal close of an HTTP stream is DEBUG."""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from runbrake.broker.producer import Producer
from runbrake.shared import RunStatus, RunStore, Settings
from tests.mcp_helpers import Toolbox, http_toolbox
from tests.polling import poll_until
from tests.ports import free_port
from tests.worker_helpers import WorkerProcess, call, spec, wait_for_run

pytestmark = pytest.mark.integration

_LOUD = {"error", "critical", "exception"}


def _loud(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in events if str(e.get("level", "")).lower() in _LOUD]


def _stream_closes_above_debug(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in events if "GET stream disconnected" in str(e.get("event", ""))
            and str(e.get("level", "")).lower() != "debug"]


def _lines_that_are_not_json(worker: WorkerProcess) -> list[str]:
    """A traceback printed past the logging (a thread's excepthook, an atexit handler) is not a JSON line."""
    text = worker.log_path.read_text(encoding="utf-8", errors="replace")
    return [line for line in text.splitlines() if line.strip() and not line.startswith("{")]


@pytest.fixture(name="legacy_toolbox")
def legacy_toolbox_fixture(tmp_path: Path) -> Iterator[Toolbox]:
    """The toolbox over HTTP as a server from before protocol 2026-07-28 answers: the client falls back to a
    session, whose GET stream the server closes when the client ends it (the SDK logged that at INFO)."""
    with http_toolbox(tmp_path / "toolbox-events.jsonl", args=("--legacy",)) as server:
        yield server


@pytest.mark.parametrize("server", ["toolbox_http", "legacy_toolbox"])
def test_a_worker_that_ran_a_run_over_http_mcp_stops_on_sigterm_without_an_error_line(
    server: str, request: pytest.FixtureRequest, start_worker: Callable[..., WorkerProcess], producer: Producer,
    store: RunStore,
) -> None:
    toolbox: Toolbox = request.getfixturevalue(server)
    # Health and metrics on: their threads and connections are part of what stops.
    worker = start_worker(RUNBRAKE_HEALTH_PORT=str(free_port()), RUNBRAKE_METRICS_PORT=str(free_port()))
    run = producer.enqueue(spec({"toolbox": toolbox.spec}, [
        {"tool_calls": [call("get-sum", a=2, b=3), call("echo", text="hi")]},
        {"content": "It is 5."},
    ]))
    assert wait_for_run(store, run.run_id).status is RunStatus.COMPLETED

    assert worker.stop() == 0

    events = worker.events()
    assert [e["event"] for e in events][-1] == "worker_stopped"
    assert _loud(events) == []
    assert _stream_closes_above_debug(events) == []
    assert _lines_that_are_not_json(worker) == []



def test_a_worker_whose_idle_broker_connections_rabbitmq_dropped_stops_without_an_error_line(
    start_worker: Callable[..., WorkerProcess], rabbitmq: Settings,
) -> None:
    # One-second heartbeats: RabbitMQ drops the connections Dramatiq's broker holds idle (one per consumer thread
    # that declared its queue) within seconds instead of minutes.
    url = rabbitmq.rabbitmq_url.rstrip("/") + "/%2F?heartbeat=1"
    worker = start_worker(RUNBRAKE_RABBITMQ_URL=url)
    seen: set[str] = set()

    def dropped() -> int:
        """Connections of the worker to RabbitMQ seen on an earlier poll and gone since (RabbitMQ closed them)."""
        now = _amqp_connections(worker.pid)
        seen.update(now)
        return len(seen - now)

    poll_until(lambda: dropped() >= 2, timeout=30,
               failure=lambda: f"RabbitMQ dropped {dropped()} of the worker's {len(seen)} connections")

    assert worker.stop() == 0

    events = worker.events()
    assert [e["event"] for e in events][-1] == "worker_stopped"
    assert _loud(events) == []
    assert _lines_that_are_not_json(worker) == []


def _amqp_connections(pid: int) -> set[str]:
    """The local addresses of the process's TCP connections to RabbitMQ's port."""
    listed = subprocess.run(["ss", "-Htnp", "( dport = :5672 )"], capture_output=True, text=True, timeout=10,
                            check=False)
    if listed.returncode != 0:
        pytest.skip(f"ss cannot list connections here: {listed.stderr.strip()}")
    return {line.split()[3] for line in listed.stdout.splitlines() if f"pid={pid}," in line}
