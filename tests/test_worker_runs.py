"""Queued runs end to end: enqueue → RabbitMQ → a real worker process → tools on a real MCP server.

Each test gets its own namespace; the toolbox server writes an events file, which is how
a test counts calls on the server's side.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pika
import pytest

from runbrake.shared import (
    PublishError,
    RunStatus,
    RunStore,
    Settings,
    StepKind,
    TerminationReason,
    ToolOutcome,
    _scripts,
    step_outcome,
)
from runbrake.shared.catalog import Admission
from runbrake.shared.messaging.producer import Producer
from runbrake.shared.messaging.rabbitmq import build_broker
from runbrake.shared.messaging.wire import Topology
from tests.mcp_helpers import Toolbox, matching_events, wait_for_event
from tests.ports import free_port
from tests.worker_helpers import (
    WorkerProcess,
    call,
    commands_until_marker,
    has_step,
    redis_monitor,
    spec,
    wait_for_run,
    worker_env,
)

pytestmark = pytest.mark.integration


def test_a_run_completes_with_the_right_outcome_on_every_tool_step(
    toolbox: Toolbox, worker: WorkerProcess, producer: Producer, store: RunStore
) -> None:
    run = producer.enqueue(spec({"toolbox": toolbox.spec}, [
        {"tool_calls": [call("get-sum", a=2, b=3), call("fail", message="nope"), call("echo", text="hi")]},
        {"content": "It is 5."},
    ]))

    record = wait_for_run(store, run.run_id)

    assert (record.status, record.termination_reason) == (RunStatus.COMPLETED, TerminationReason.COMPLETED)
    # The calls of a turn run at once, each recorded as it completes (tests/test_concurrent_tools.py).
    tools = sorted((s for s in record.steps if s.kind is StepKind.TOOL), key=lambda s: s.tool_call_id or "")
    assert [(s.tool_name, s.tool_outcome, s.tool_is_error) for s in tools] == [
        ("get-sum", ToolOutcome.OK, False), ("fail", ToolOutcome.FAILED, True), ("echo", ToolOutcome.OK, False),
    ]
    assert tools[0].content == "5"
    assert [s.sequence for s in record.steps] == [1, 2, 3, 4, 5]
    assert record.steps[-1].content == "It is 5."


def test_the_probe_stops_a_run_at_the_next_boundary_and_keeps_the_boundary_step(
    toolbox_http: Toolbox, start_worker: Callable[..., WorkerProcess], producer: Producer, store: RunStore
) -> None:
    # No cancel message and a backstop that never fires in this test: only the probe can stop the run.
    start_worker(RUNBRAKE_CANCEL_POLL_MS="600000")
    run = producer.enqueue(spec({"toolbox": toolbox_http.spec}, [
        {"tool_calls": [call("slow", seconds=0.5)]},
        {"tool_calls": [call("get-sum", a=2, b=2)]},
        {"content": "never"},
    ]))
    wait_for_event(toolbox_http.events, "started", tool="slow")

    assert store.cancel(run.run_id, reason="probe test", requested_by="test").won

    record = wait_for_run(store, run.run_id, has_step("tool"))
    wait_for_event(toolbox_http.events, "finished", tool="slow")
    assert record.status is RunStatus.CANCELLED
    # The slow call ran to its boundary and was recorded; nothing started after it.
    assert [(s.kind, s.tool_name, step_outcome(s)) for s in record.steps] == [
        (StepKind.MODEL, None, ""), (StepKind.TOOL, "slow", "ok"),
    ]
    assert matching_events(toolbox_http.events, "started", tool="get-sum") == []


def test_a_cancelled_queued_run_is_never_claimed(
    toolbox_http: Toolbox, start_worker: Callable[..., WorkerProcess], producer: Producer, store: RunStore
) -> None:
    run = producer.enqueue(spec({"toolbox": toolbox_http.spec}, [{"tool_calls": [call("get-sum", a=1, b=2)]},
                                                                   {"content": "x"}]))
    assert store.cancel(run.run_id, reason="not needed", requested_by="test").won

    worker = start_worker()
    worker.wait_for_log("run_message_skipped", run_id=run.run_id)

    record = store.get(run.run_id)
    assert (record.status, record.started_at, record.steps) == (RunStatus.CANCELLED, None, ())
    assert matching_events(toolbox_http.events, "started") == []


def test_a_duplicate_message_is_acked_as_a_no_op(
    toolbox_http: Toolbox, worker: WorkerProcess, producer: Producer, store: RunStore
) -> None:
    run = producer.enqueue(spec({"toolbox": toolbox_http.spec}, [{"tool_calls": [call("get-sum", a=1, b=2)]},
                                                                   {"content": "3"}]))
    before = wait_for_run(store, run.run_id)

    producer.send(run.run_id)
    skipped = worker.wait_for_log("run_message_skipped", run_id=run.run_id)

    assert skipped[0]["found"] == "completed"
    assert store.get(run.run_id) == before
    assert len(matching_events(toolbox_http.events, "started", tool="get-sum")) == 1


def test_the_probe_costs_exactly_one_redis_read_per_boundary_and_a_step_one_round_trip(
    toolbox_http: Toolbox, worker: WorkerProcess, producer: Producer, store: RunStore, settings: Settings
) -> None:
    with redis_monitor(settings) as monitor:
        run = producer.enqueue(spec({"toolbox": toolbox_http.spec}, [
            {"tool_calls": [call("get-sum", a=1, b=2), call("echo", text="x")]},
            {"tool_calls": [call("get-sum", a=3, b=4)]},
            {"content": "done"},
        ]))
        # Wait on the worker's log, not on Redis: polling the run would read its cancel key too.
        worker.wait_for_log("run_segment_ended", run_id=run.run_id)
        seen = commands_until_marker(monitor, store)

    record = store.get(run.run_id)
    run_key, cancel_key = store.run_key(run.run_id), store.cancel_key(run.run_id)
    probes = Counter(
        (e["client_type"], e["command"].split()[0].upper()) for e in seen
        if cancel_key in e["command"] and e["command"].split()[0].upper() in {"EXISTS", "GET", "MGET"}
    )
    assert record.status is RunStatus.COMPLETED
    assert len(record.steps) == 6
    # Each recorded step is a boundary, probed inside the script that appends it; the moment before
    # the first model call is one more, probed inside the script that marks that call. Every later model
    # call directly follows a recorded step, whose probe stands for that boundary: nothing ran in between.
    assert probes[("lua", "EXISTS")] == len(record.steps) + 1
    assert probes[("tcp", "EXISTS")] + probes[("unix", "EXISTS")] == 0
    # The only other read of the cancel key: the backstop's poll, one MGET for all active runs.
    assert {command for _client, command in probes} <= {"EXISTS", "MGET"}
    # The worker's scripts for the segment: one claim (the request read in the same pipeline), one
    # per step, one settle, and the mark of the first model call (its probe too); every later call's mark
    # rides on the append just before it (a lost worker's calls are then recorded, docs/leases.md, "Lost
    # workers"); lease renewals (every third of a lease) are not the segment's.
    worker_scripts = Counter(
        e["command"].split()[1] for e in seen
        if e["client_type"] != "lua" and e["command"].upper().startswith("EVALSHA") and run_key in e["command"]
    )
    worker_scripts.pop(_scripts.CREATE.sha)
    worker_scripts.pop(_scripts.RENEW_LEASE.sha, None)
    steps = len(record.steps)
    assert worker_scripts == {_scripts.CLAIM.sha: 1, _scripts.APPEND_STEP.sha: steps, _scripts.SETTLE.sha: 1,
                              _scripts.MARK_SENT.sha: 1}


def test_max_rounds_ends_the_run_failed_with_reason_max_rounds(
    toolbox_http: Toolbox, worker: WorkerProcess, producer: Producer, store: RunStore
) -> None:
    loop_turn = {"tool_calls": [call("get-sum", a=1, b=1)]}
    run = producer.enqueue(spec({"toolbox": toolbox_http.spec}, [loop_turn, loop_turn, loop_turn], max_rounds=2))

    record = wait_for_run(store, run.run_id)

    assert (record.status, record.termination_reason) == (RunStatus.FAILED, TerminationReason.MAX_ROUNDS)
    assert sum(1 for s in record.steps if s.kind is StepKind.MODEL) == 2


def test_a_provider_failure_is_recorded_and_fails_the_run(
    toolbox_http: Toolbox, worker: WorkerProcess, producer: Producer, store: RunStore
) -> None:
    run = producer.enqueue(spec({"toolbox": toolbox_http.spec}, [{"fail": "rate limited"}]))

    record = wait_for_run(store, run.run_id)

    assert (record.status, record.termination_reason) == (RunStatus.FAILED, TerminationReason.PROVIDER_FAILED)
    assert [(s.kind, s.error, step_outcome(s)) for s in record.steps] == [(StepKind.MODEL, "rate limited", "failed")]


def test_a_server_that_cannot_be_reached_gives_failed_tool_steps_and_the_run_goes_on(
    worker: WorkerProcess, producer: Producer, store: RunStore
) -> None:
    dead = {"url": "http://127.0.0.1:9/mcp"}
    run = producer.enqueue(spec({"dead": dead}, [{"tool_calls": [call("get-sum", server="dead", a=1, b=1)]},
                                                 {"content": "the server was down"}]))

    record = wait_for_run(store, run.run_id)

    tool = next(s for s in record.steps if s.kind is StepKind.TOOL)
    assert (tool.tool_outcome, tool.tool_is_error) == (ToolOutcome.FAILED, True)
    # The step says why: the connection error is carried into it, not only into the worker's log.
    assert "could not connect to MCP server 'dead'" in tool.content
    assert record.status is RunStatus.COMPLETED


@pytest.mark.parametrize("processes", [1, 2])
def test_runbrake_worker_runs_runs_logs_what_it_does_and_stops_cleanly_on_sigterm(
    processes: int, toolbox_http: Toolbox, producer: Producer, store: RunStore, tmp_path: Path
) -> None:
    command = [str(Path(sys.executable).parent / "runbrake"), "worker", "--processes", str(processes),
               "--threads", "2"]
    supervisor = WorkerProcess(tmp_path / "supervisor.log", worker_env(), command=command, started=processes)
    try:
        assert {e["worker"] for e in supervisor.logged("worker_started")} == set(range(processes))
        runs = [producer.enqueue(spec({"toolbox": toolbox_http.spec}, [
            {"tool_calls": [call("get-sum", a=i, b=1)]}, {"content": "done"}])) for i in range(4)]
        records = [wait_for_run(store, run.run_id) for run in runs]
        assert {r.status for r in records} == {RunStatus.COMPLETED}
    finally:
        code = supervisor.stop()
    assert code == 0
    assert {e["worker"] for e in supervisor.logged("worker_stopped")} == set(range(processes))


def test_enqueue_is_fail_closed_when_rabbitmq_does_not_take_the_message(store: RunStore, settings: Settings) -> None:
    dead_port = free_port()
    broker = build_broker(settings.with_changes(rabbitmq_url=f"amqp://guest:guest@127.0.0.1:{dead_port}/"))
    run_spec = spec({"toolbox": {"url": "http://127.0.0.1:9/mcp"}}, [{"content": "never"}])

    with pytest.raises(PublishError, match="RabbitMQ did not take the message"):
        Producer(store, broker, Admission.from_settings(settings)).enqueue(run_spec)

    # The run exists, and says why it will never run, instead of waiting for a message that was never sent.
    [record] = store.recent()
    assert (record.status, record.termination_reason) == (RunStatus.FAILED, TerminationReason.ENQUEUE_FAILED)
    assert "RabbitMQ" in record.error


def test_runs_whose_messages_were_lost_are_redriven_and_complete(
    toolbox_http: Toolbox, producer: Producer, store: RunStore, start_worker: Callable[..., WorkerProcess],
    settings: Settings,
) -> None:
    runs = [producer.enqueue(spec({"toolbox": toolbox_http.spec}, [{"content": f"run {i}"}])).run_id
            for i in range(10)]
    connection = pika.BlockingConnection(pika.URLParameters(settings.rabbitmq_url))
    try:
        purged = connection.channel().queue_purge(Topology.of(settings).run_queue).method.message_count
    finally:
        connection.close()
    assert purged == 10  # every message is gone: only Redis still knows these runs wait

    worker = start_worker(RUNBRAKE_REDRIVE_S="2")
    records = [wait_for_run(store, run_id, timeout=30) for run_id in runs]

    assert [r.status for r in records] == [RunStatus.COMPLETED] * 10
    assert {e["run_id"] for e in worker.logged("run_redriven")} == set(runs)
