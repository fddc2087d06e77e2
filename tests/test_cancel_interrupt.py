"""Cancelling a run interrupts the call in flight: fence, message, listener, registry, transport
(docs/cancellation.md, "Cancellation").

Real worker processes, real MCP servers (HTTP and stdio), real Redis and RabbitMQ. A test
learns that a call is in flight from the server's events file ("started"), that a worker
acted from its JSON log, and what the run came to from the store. Workers whose test asserts
that the *message* delivered a cancel run with the backstop slowed to ten minutes, so the
backstop cannot deliver it first and hide a broken listener.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from structlog.testing import capture_logs

from runbrake.shared import (
    RunRecord,
    RunStatus,
    RunStore,
    Settings,
    StepKind,
    TerminationReason,
    ToolOutcome,
    _scripts,
    step_outcome,
)
from runbrake.shared.messaging.cancel import CancelPublisher, cancel_run
from runbrake.shared.messaging.producer import Producer
from runbrake.worker.cancel_listener import Backstop
from runbrake.worker.registry import ActiveRuns
from tests.mcp_helpers import (
    Toolbox,
    free_port,
    http_toolbox,
    matching_events,
    wait_for_event,
)
from tests.polling import poll_until, poll_until_async
from tests.worker_helpers import WorkerProcess, call, redis_monitor, scrape_metrics, spec, wait_for_run

pytestmark = pytest.mark.integration

BACKSTOP_OFF = {"RUNBRAKE_CANCEL_POLL_MS": "600000"}
"""Ten minutes between backstop polls: within a test only the cancel message can interrupt a call."""
REASON = "operator stop"
REQUESTED_BY = "ops@example.test"
WAIT_S = 15.0

SLOW_THEN_MORE = [
    {"tool_calls": [call("slow", seconds=30)]},
    {"tool_calls": [call("get-sum", a=1, b=2)]},
    {"content": "never reached"},
]
"""A run whose first call takes 30 s, with a second turn and its call that must never start (the calls of one
turn run at once: tests/test_concurrent_tools.py)."""


@pytest.fixture(name="publisher")
def publisher_fixture(rabbitmq: Settings) -> Iterator[CancelPublisher]:
    publisher = CancelPublisher(rabbitmq)
    yield publisher
    publisher.close()


def _cancel(store: RunStore, publisher: CancelPublisher | None, run_id: str) -> None:
    result = cancel_run(store, publisher, run_id, reason=REASON, requested_by=REQUESTED_BY)
    assert result.won, result
    assert result.message_confirmed is (None if publisher is None else True), result


def _segment_ended(worker: WorkerProcess, run_id: str) -> str:
    """Wait until the worker ended the run's segment; its outcome (completed, cancelled…)."""
    outcome: str = worker.wait_for_log("run_segment_ended", run_id=run_id, timeout=WAIT_S)[0]["outcome"]
    return outcome


def _tools(record: RunRecord) -> list[tuple[str | None, ToolOutcome | None, bool | None, str]]:
    return [(s.tool_name, s.tool_outcome, s.tool_is_error, step_outcome(s)) for s in record.steps
            if s.kind is StepKind.TOOL]


def _cancel_mid_slow(
    toolbox: Toolbox, worker: WorkerProcess, producer: Producer, store: RunStore, publisher: CancelPublisher | None
) -> RunRecord:
    """Enqueue a run in ``slow(30)``, cancel it once the server started the call; the run after its segment."""
    run = producer.enqueue(spec({"toolbox": toolbox.spec}, SLOW_THEN_MORE))
    wait_for_event(toolbox.events, "started", tool="slow", timeout=WAIT_S)
    _cancel(store, publisher, run.run_id)
    assert _segment_ended(worker, run.run_id) == "cancelled"
    return store.get(run.run_id)


@pytest.mark.parametrize("settings", ["single", "cluster"], indirect=True)  # tests/cluster_helpers.py
def test_a_cancel_interrupts_the_tool_call_in_flight_and_records_it_cancelled_not_failed(
    toolbox: Toolbox, start_worker: Callable[..., WorkerProcess], producer: Producer, store: RunStore,
    publisher: CancelPublisher,
) -> None:
    worker = start_worker(**BACKSTOP_OFF)

    record = _cancel_mid_slow(toolbox, worker, producer, store, publisher)

    assert (record.status, record.termination_reason) == (RunStatus.CANCELLED, TerminationReason.CANCELLED)
    assert [s.kind for s in record.steps] == [StepKind.MODEL, StepKind.TOOL]
    tool = record.steps[1]
    assert (tool.tool_name, tool.tool_outcome, tool.tool_is_error) == ("slow", ToolOutcome.CANCELLED, True)
    assert step_outcome(tool) == ToolOutcome.CANCELLED.value == "cancelled"
    assert record.cancel is not None
    assert (record.cancel.reason, record.cancel.requested_by) == (REASON, REQUESTED_BY)
    worker.wait_for_log("cancel_message_delivered", run_id=record.run_id)
    worker.wait_for_log("call_interrupted", run_id=record.run_id)
    # The server's handler saw the cancellation; the call it was in is the only one that started.
    cancelled = wait_for_event(toolbox.events, "cancelled", tool="slow", timeout=WAIT_S)
    started_events = matching_events(toolbox.events, "started")
    assert [(e["tool"], e["call"]) for e in started_events] == [("slow", cancelled[0]["call"])]
    assert matching_events(toolbox.events, "finished") == []


def test_the_same_server_serves_the_next_call_normally_after_a_cancelled_one(
    toolbox_http: Toolbox, start_worker: Callable[..., WorkerProcess], producer: Producer, store: RunStore,
    publisher: CancelPublisher,
) -> None:
    worker = start_worker(**BACKSTOP_OFF)
    _cancel_mid_slow(toolbox_http, worker, producer, store, publisher)
    wait_for_event(toolbox_http.events, "cancelled", tool="slow", timeout=WAIT_S)

    second = producer.enqueue(spec({"toolbox": toolbox_http.spec},
                                   [{"tool_calls": [call("get-sum", a=2, b=3)]}, {"content": "5"}]))
    record = wait_for_run(store, second.run_id, timeout=WAIT_S)

    assert (record.status, record.cancel) == (RunStatus.COMPLETED, None)
    assert _tools(record) == [("get-sum", ToolOutcome.OK, False, "ok")]
    assert record.steps[1].content == "5"
    assert len(matching_events(toolbox_http.events, "finished", tool="get-sum")) == 1


def test_a_cancel_during_a_slow_model_call_interrupts_it_and_no_tool_call_starts(
    toolbox_http: Toolbox, start_worker: Callable[..., WorkerProcess], producer: Producer, store: RunStore,
    publisher: CancelPublisher,
) -> None:
    worker = start_worker(**BACKSTOP_OFF)
    turns = [{"delay_ms": 30000, "tool_calls": [call("slow", seconds=30)]}, {"content": "never reached"}]
    # The model call starts right after its mark (docs/leases.md, "Lost workers"), the script that probes the
    # boundary before it. Redis's MONITOR shows that script, so the cancel lands while the model call is in
    # flight (a cancel before the mark stops the run before the call: nothing would be in flight).
    with redis_monitor(Settings.from_env()) as monitor:
        run = producer.enqueue(spec({"toolbox": toolbox_http.spec}, turns))
        _wait_for_command(monitor, "EVALSHA", _scripts.MARK_SENT.sha, "2", store.run_key(run.run_id), prefix=True)

    _cancel(store, publisher, run.run_id)

    assert _segment_ended(worker, run.run_id) == "cancelled"
    record = store.get(run.run_id)
    assert record.status is RunStatus.CANCELLED
    assert [(s.kind, s.interrupted, s.error, step_outcome(s)) for s in record.steps] == [
        (StepKind.MODEL, True, None, "cancelled"),
    ]
    worker.wait_for_log("cancel_message_delivered", run_id=run.run_id)
    assert matching_events(toolbox_http.events, "started") == []


def test_failed_steps_stay_failed_when_a_cancel_arrives_after_them(
    toolbox_http: Toolbox, worker: WorkerProcess, producer: Producer, store: RunStore,
    publisher: CancelPublisher,
) -> None:
    with http_toolbox(toolbox_http.events.with_name("doomed-events.jsonl"), name="doomed") as doomed:
        run = producer.enqueue(spec(
            {"doomed": doomed.spec, "toolbox": toolbox_http.spec, "dead": {"url": "http://127.0.0.1:9/mcp"}},
            [{"tool_calls": [
                call("slow", server="doomed", seconds=30),  # its server dies in the middle of the call
                call("fail", message="boom"),  # the tool reports an error
                call("get-sum", server="dead", a=1, b=1),  # the server was never reachable
                call("slow", seconds=30),  # cancelled
            ]}, {"content": "never reached"}],
        ))
        killed = wait_for_event(doomed.events, "started", tool="slow", timeout=WAIT_S)[0]
        os.kill(killed["pid"], signal.SIGKILL)
        wait_for_event(toolbox_http.events, "started", tool="slow", timeout=WAIT_S)
        # The calls of the turn run at once: the three that fail are recorded while the last still runs.
        wait_for_run(store, run.run_id, lambda r: len(_tools(r)) == 3, timeout=WAIT_S)

        _cancel(store, publisher, run.run_id)

        assert _segment_ended(worker, run.run_id) == "cancelled"
    record = store.get(run.run_id)
    assert record.status is RunStatus.CANCELLED
    in_call_order = sorted((s for s in record.steps if s.kind is StepKind.TOOL), key=lambda s: s.tool_call_id or "")
    assert [(s.tool_server, s.tool_name, s.tool_outcome, step_outcome(s)) for s in in_call_order] == [
        ("doomed", "slow", ToolOutcome.FAILED, "failed"),
        ("toolbox", "fail", ToolOutcome.FAILED, "failed"),
        ("dead", "get-sum", ToolOutcome.FAILED, "failed"),
        ("toolbox", "slow", ToolOutcome.CANCELLED, "cancelled"),
    ]
    assert step_outcome(record.steps[-1]) == "cancelled"  # the last recorded: after the three failures


def test_a_cancel_message_without_the_fence_changes_nothing(
    toolbox_http: Toolbox, worker: WorkerProcess, producer: Producer, store: RunStore, publisher: CancelPublisher,
) -> None:
    run = producer.enqueue(spec({"toolbox": toolbox_http.spec},
                                [{"tool_calls": [call("slow", seconds=1.5)]}, {"content": "done"}]))
    wait_for_event(toolbox_http.events, "started", tool="slow", timeout=WAIT_S)

    publisher.publish(run.run_id)  # a forged or stale wake-up: no cancel key in Redis

    worker.wait_for_log("cancel_message_without_fence", run_id=run.run_id)
    record = wait_for_run(store, run.run_id, timeout=WAIT_S)
    assert (record.status, record.cancel) == (RunStatus.COMPLETED, None)
    assert _tools(record) == [("slow", ToolOutcome.OK, False, "ok")]
    assert record.steps[-1].content == "done"
    assert worker.logged("call_interrupted", run_id=run.run_id) == []
    assert matching_events(toolbox_http.events, "cancelled") == []


@pytest.mark.parametrize("settings", ["single", "cluster"], indirect=True)  # tests/cluster_helpers.py
def test_the_backstop_interrupts_a_call_whose_cancel_message_was_lost(
    toolbox_http: Toolbox, start_worker: Callable[..., WorkerProcess], producer: Producer, store: RunStore,
) -> None:
    worker = start_worker(RUNBRAKE_CANCEL_POLL_MS="100")

    record = _cancel_mid_slow(toolbox_http, worker, producer, store, publisher=None)  # the fence alone

    assert record.status is RunStatus.CANCELLED
    assert _tools(record) == [("slow", ToolOutcome.CANCELLED, True, "cancelled")]
    worker.wait_for_log("cancel_found_by_backstop", run_id=record.run_id)
    assert worker.logged("cancel_message_delivered", run_id=record.run_id) == []
    wait_for_event(toolbox_http.events, "cancelled", tool="slow", timeout=WAIT_S)


def test_only_the_worker_holding_the_run_interrupts_it(
    toolbox_http: Toolbox, start_worker: Callable[..., WorkerProcess], producer: Producer, store: RunStore,
    publisher: CancelPublisher,
) -> None:
    workers = [start_worker(**BACKSTOP_OFF), start_worker(**BACKSTOP_OFF)]
    assert all(w.logged("worker_started", listener_ready=True) for w in workers)
    run = producer.enqueue(spec({"toolbox": toolbox_http.spec}, SLOW_THEN_MORE))
    wait_for_event(toolbox_http.events, "started", tool="slow", timeout=WAIT_S)
    holders = [w for w in workers if w.logged("run_claimed", run_id=run.run_id)]
    assert len(holders) == 1, "exactly one worker claims the run"
    holder, other = holders[0], next(w for w in workers if w is not holders[0])

    _cancel(store, publisher, run.run_id)

    holder.wait_for_log("call_interrupted", run_id=run.run_id)
    holder.wait_for_log("cancel_message_delivered", run_id=run.run_id)
    assert _segment_ended(holder, run.run_id) == "cancelled"
    assert _tools(store.get(run.run_id)) == [("slow", ToolOutcome.CANCELLED, True, "cancelled")]
    assert other.logged("call_interrupted", run_id=run.run_id) == []
    assert other.logged("cancel_message_delivered", run_id=run.run_id) == []
    assert other.logged("cancel_message_without_fence", run_id=run.run_id) == []


def test_the_cancel_listener_reconnects_after_rabbitmq_drops_its_connection(
    toolbox_http: Toolbox, start_worker: Callable[..., WorkerProcess], producer: Producer, store: RunStore,
    publisher: CancelPublisher,
) -> None:
    worker = start_worker(**BACKSTOP_OFF)
    worker.wait_for_log("cancel_listener_connected")
    connection = _listener_connection(f"runbrake-cancel-listener {store.namespace} pid={worker.pid}")

    _rabbitmqctl("close_connection", connection, "test drop")

    worker.wait_for_log("cancel_listener_disconnected", timeout=WAIT_S)
    worker.wait_for_log("cancel_listener_connected", count=2, timeout=WAIT_S)
    record = _cancel_mid_slow(toolbox_http, worker, producer, store, publisher)
    assert _tools(record) == [("slow", ToolOutcome.CANCELLED, True, "cancelled")]
    worker.wait_for_log("cancel_message_delivered", run_id=record.run_id)


def test_the_cancel_latency_and_the_cancelled_tool_call_are_counted_in_the_metrics(
    toolbox_http: Toolbox, start_worker: Callable[..., WorkerProcess], producer: Producer, store: RunStore,
    publisher: CancelPublisher,
) -> None:
    port = free_port()
    worker = start_worker(RUNBRAKE_METRICS_PORT=str(port))
    _cancel_mid_slow(toolbox_http, worker, producer, store, publisher)

    samples = scrape_metrics(port)

    assert samples[("runbrake_cancel_latency_seconds_count", ())] >= 1
    assert samples[("runbrake_tool_calls_total", (("outcome", "cancelled"), ("server", "toolbox")))] == 1.0
    assert ("runbrake_tool_calls_total", (("outcome", "failed"), ("server", "toolbox"))) not in samples
    assert samples[("runbrake_runs_finished_total", (("reason", "cancelled"), ("status", "cancelled")))] == 1.0


def test_server_health_counts_cancelled_calls_and_argument_errors_apart_from_failures(
    toolbox_http: Toolbox, worker: WorkerProcess, producer: Producer, store: RunStore, publisher: CancelPublisher,
) -> None:
    run = producer.enqueue(spec({"toolbox": toolbox_http.spec}, [
        {"tool_calls": [call("get-sum", a=1, b=2), call("fail", message="boom"), call("no-such-tool"),
                        call("slow", seconds=30)]},
        {"content": "never reached"},
    ]))
    wait_for_event(toolbox_http.events, "started", tool="slow", timeout=WAIT_S)
    # The calls of the turn run at once: the three quick ones are recorded while slow still runs.
    wait_for_run(store, run.run_id, lambda r: len(_tools(r)) == 3, timeout=WAIT_S)
    _cancel(store, publisher, run.run_id)
    assert _segment_ended(worker, run.run_id) == "cancelled"

    shown, recent = (subprocess.run(
        [sys.executable, "-c", "from runbrake.broker.cli import main; main()", "servers", "--json", *window],
        capture_output=True, text=True, timeout=30, check=False,
    ) for window in ([], ["--since", "1h"]))

    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout) == [
        {"server": "toolbox", "ok": 1, "failed": 1, "argument_errors": 1, "cancelled": 1,
         "side_effects_unknown": 1, "worker_lost": 0, "failure_rate": 0.5},
    ]
    assert json.loads(recent.stdout) == json.loads(shown.stdout)
    tools = {s.tool_name: (s.tool_outcome, s.detail.get("failure"), s.detail.get("reason"))
             for s in store.get(run.run_id).steps if s.kind is StepKind.TOOL}
    # Refused before any call was sent, and handed back to the model.
    assert tools["no-such-tool"] == (ToolOutcome.FAILED, "arguments", "invalid_call")


# -- helpers ------------------------------------------------------------------------------------


def _wait_for_command(monitor: redis.client.Monitor, *command: str, timeout: float = WAIT_S,
                      prefix: bool = False) -> None:
    """Block until a client (not a Lua script) ran exactly ``command`` (with ``prefix``: a command that begins
    with those words); fail the test after ``timeout`` s."""
    wanted = [part.lower() for part in command]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            seen: dict[str, Any] = monitor.next_command()
        except redis.TimeoutError:
            break
        words = seen["command"].lower().split()
        if seen["client_type"] != "lua" and (words[:len(wanted)] if prefix else words) == wanted:
            return
    pytest.fail(f"Redis did not see {' '.join(command)!r} within {timeout:g} s")


def _rabbitmqctl(*args: str) -> str:
    done = subprocess.run(["rabbitmqctl", *args], capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode == 0, f"rabbitmqctl {' '.join(args)} failed: {done.stderr}"
    return done.stdout


def _listener_connection(name: str, timeout: float = WAIT_S) -> str:
    """The Erlang pid of the RabbitMQ connection whose client calls itself ``name``."""
    def named() -> list[str]:
        listing = _rabbitmqctl("list_connections", "-q", "--no-table-headers", "pid", "client_properties")
        return [line.split("\t", 1)[0] for line in listing.splitlines() if f'"{name}"' in line]

    pids = poll_until(named, timeout=timeout, interval=0.1,
                      failure=lambda: f"no RabbitMQ connection named {name!r} within {timeout:g} s")
    assert len(pids) == 1, f"more than one connection is named {name!r}: {pids}"
    return pids[0]


@pytest.mark.integration
@pytest.mark.anyio
async def test_the_backstop_gives_a_message_one_poll_to_arrive_then_interrupts(
    store: RunStore, settings: Settings
) -> None:
    registry = ActiveRuns()
    backstop = Backstop(settings, store, registry)
    run_id = store.create({"input": "x"}).run_id
    handle = registry.register(run_id, "owner-1")
    store.cancel(run_id, reason="stop", requested_by="ops")

    with capture_logs() as logs:
        backstop.poll()
        first = handle.interrupt_requested
        backstop.poll()
        # The interrupt hops onto this loop with call_soon_threadsafe: wait for it to land, bounded.
        await poll_until_async(lambda: handle.cancel_seen or None, timeout=WAIT_S,
                               failure=lambda: "the backstop's interrupt never reached the run's loop")

    assert (first, handle.interrupt_requested, handle.cancel_seen) == (False, True, True)
    assert [e["run_id"] for e in logs if e["event"] == "cancel_found_by_backstop"] == [run_id]


@pytest.mark.integration
@pytest.mark.anyio
async def test_the_backstop_leaves_a_cancel_the_message_delivered_alone(store: RunStore, settings: Settings) -> None:
    registry = ActiveRuns()
    run_id = store.create({"input": "x"}).run_id
    handle = registry.register(run_id, "owner-1")
    backstop = Backstop(settings, store, registry)
    store.cancel(run_id, reason="stop", requested_by="ops")

    with capture_logs() as logs:
        backstop.poll()
        assert registry.interrupt(run_id)  # what the listener does when the message arrives
        backstop.poll()
        await poll_until_async(lambda: handle.cancel_seen or None, timeout=WAIT_S,
                               failure=lambda: "the listener's interrupt never reached the run's loop")

    assert handle.cancel_seen
    assert [e for e in logs if e["event"] == "cancel_found_by_backstop"] == []
