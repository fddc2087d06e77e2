"""Cancel requests on RabbitMQ alone (docs/messages.md, "Cancel requests"), from clients that do not import
runbrake: a plain-pika script in a subprocess, and a Node script with amqplib when npm can install it.

A real worker consumes ``<ns>.cancel-requests``, applies the fence and wakes the call in flight, which a
real MCP server sees cancelled. Malformed requests land in ``<ns>.cancel-requests.dead`` with a header
saying why, and the consumer goes on.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest

from runbrake.shared import RunStatus, RunStore, Settings, StepKind, ToolOutcome
from runbrake.shared.messaging.producer import Producer
from runbrake.shared.messaging.wire import DEAD_REASON_HEADER, Topology
from tests.amqp_clients import CLIENTS, node_client, queue_types
from tests.mcp_helpers import Toolbox, wait_for_event
from tests.worker_helpers import WorkerProcess, call, spec, take_messages, wait_for_run

pytestmark = pytest.mark.integration



def publish(settings: Settings, body: str) -> subprocess.CompletedProcess[str]:
    """Publish ``body`` with the plain-pika script, in a process of its own."""
    return subprocess.run(
        [sys.executable, str(CLIENTS / "publish_cancel_request.py"), settings.rabbitmq_url, settings.namespace, body],
        capture_output=True, text=True, timeout=30, check=False,
    )


def slow_run(producer: Producer, toolbox: Toolbox) -> str:
    return producer.enqueue(spec({"toolbox": toolbox.spec},
                                 [{"tool_calls": [call("slow", seconds=30)]}, {"content": "never"}])).run_id


def cancelled_call(record: Any) -> bool:
    return any(s.kind is StepKind.TOOL and s.tool_outcome is ToolOutcome.CANCELLED for s in record.steps)


def dead_letters(settings: Settings, count: int) -> list[tuple[bytes, dict[str, Any]]]:
    """Take ``count`` messages off the dead-letter queue (bounded wait), with their headers."""
    return take_messages(settings, Topology.of(settings).cancel_requests_dead_queue, count, timeout=15)


def test_a_cancel_request_from_plain_pika_cancels_the_run_and_interrupts_its_call(
    worker: WorkerProcess, toolbox_http: Toolbox, producer: Producer, store: RunStore, rabbitmq: Settings
) -> None:
    run_id = slow_run(producer, toolbox_http)
    wait_for_event(toolbox_http.events, "started", tool="slow", timeout=20)

    sent = publish(rabbitmq, json.dumps({"run_id": run_id, "reason": "runaway", "requested_by": "ops-cron"}))

    assert sent.returncode == 0, sent.stderr
    record = wait_for_run(store, run_id, cancelled_call)
    assert (record.status, record.cancel.reason, record.cancel.requested_by) == (  # type: ignore[union-attr]
        RunStatus.CANCELLED, "runaway", "ops-cron")
    wait_for_event(toolbox_http.events, "cancelled", tool="slow")
    worker.wait_for_log("cancel_request_applied", run_id=run_id)

    # At least once, idempotent: the same request again is acked with a log line and changes nothing.
    again = publish(rabbitmq, json.dumps({"run_id": run_id}))
    assert again.returncode == 0, again.stderr
    worker.wait_for_log("cancel_request_refused", run_id=run_id, found="cancelled")
    assert store.get(run_id) == record


@pytest.mark.parametrize("body", [
    "not json at all",
    json.dumps({"run_id": "x" * 32}),
    json.dumps({"run_id": 42}),
    json.dumps({"run_id": "0" * 32, "reason": {"nested": ["x"]}}),
    json.dumps({"run_id": "0" * 32, "requested_by": "x" * 201}),
    "[" * 5000,
    json.dumps([{"run_id": "0" * 32}]),
], ids=["not-json", "bad-run-id", "run-id-number", "nested-reason", "long-requested-by", "huge-nested", "array"])
def test_a_malformed_request_is_dead_lettered_with_the_reason_and_the_consumer_goes_on(
    body: str, worker: WorkerProcess, store: RunStore, rabbitmq: Settings
) -> None:
    assert publish(rabbitmq, body).returncode == 0
    [(dead_body, headers)] = dead_letters(rabbitmq, 1)

    assert dead_body == body.encode()
    assert headers[DEAD_REASON_HEADER]
    worker.wait_for_log("cancel_request_malformed")
    # The consumer is still there: a valid request for a queued run is applied.
    run_id = store.create({"input": "x"}).run_id
    assert publish(rabbitmq, json.dumps({"run_id": run_id})).returncode == 0
    wait_for_run(store, run_id, lambda r: r.status is RunStatus.CANCELLED)
    assert store.get(run_id).cancel.requested_by == "amqp"  # type: ignore[union-attr]


def test_a_request_for_an_unknown_run_is_acked_and_logged(worker: WorkerProcess, rabbitmq: Settings) -> None:
    assert publish(rabbitmq, json.dumps({"run_id": "e" * 32})).returncode == 0

    worker.wait_for_log("cancel_request_unknown_run", run_id="e" * 32)


def test_the_queue_is_a_quorum_queue_when_asked(
    start_worker: Callable[..., WorkerProcess], rabbitmq: Settings
) -> None:
    start_worker(RUNBRAKE_QUEUE_TYPE="quorum")
    topology = Topology.of(rabbitmq)

    types = queue_types()

    assert types[topology.cancel_requests_queue] == "quorum"
    assert types[topology.cancel_requests_dead_queue] == "quorum"


def test_a_cancel_request_from_node_with_amqplib_cancels_the_run(
    worker: WorkerProcess, toolbox_http: Toolbox, producer: Producer, store: RunStore, rabbitmq: Settings
) -> None:
    script = node_client("publish_cancel_request.mjs")
    run_id = slow_run(producer, toolbox_http)
    wait_for_event(toolbox_http.events, "started", tool="slow", timeout=20)

    sent = subprocess.run(["node", str(script), rabbitmq.rabbitmq_url, rabbitmq.namespace, run_id, "from node",
                           "node-ops"], capture_output=True, text=True, timeout=60, check=False)

    assert sent.returncode == 0, sent.stderr
    record = wait_for_run(store, run_id, cancelled_call)
    assert (record.status, record.cancel.requested_by) == (RunStatus.CANCELLED, "node-ops")  # type: ignore[union-attr]
    wait_for_event(toolbox_http.events, "cancelled", tool="slow")
