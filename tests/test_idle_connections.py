"""Idle RabbitMQ connections stay open (issue 30; docs/messages.md, "Idle connections").

A pika ``BlockingConnection`` that nothing uses answers no heartbeats, and RabbitMQ drops it after two missed
ones: the first cancel through ``runbrake serve`` after a few idle minutes was not confirmed. These tests
negotiate a 2 s heartbeat (the ``heartbeat`` parameter of ``RUNBRAKE_RABBITMQ_URL``) and wait idle until
RabbitMQ itself dropped a twin connection that was opened later and never serviced: by the broker's own
measure, longer than it lets an unserviced connection live. The cancel after that is confirmed.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
from collections.abc import Callable

import httpx2
import pika
import pika.exceptions
import pytest

from runbrake.shared import RunStatus, RunStore, Settings
from runbrake.shared.logging import silenced
from runbrake.shared.messaging.producer import Producer
from runbrake.shared.messaging.wire import Topology, connection_parameters
from tests.api_helpers import ApiProcess
from tests.mcp_helpers import Toolbox, wait_for_event
from tests.polling import poll_until
from tests.worker_helpers import WorkerProcess, call, spec, take_messages, wait_for_run

pytestmark = pytest.mark.integration

HEARTBEAT_S = 2
IDLE_TIMEOUT_S = 90.0
"""The bound on the wait for RabbitMQ to drop the unserviced twin (some 4–8 s on a quiet machine)."""


@pytest.fixture
def settings(namespace: str, monkeypatch: pytest.MonkeyPatch) -> Settings:
    """This test's settings (and its subprocesses'), with a 2 s heartbeat on every node's URL."""
    urls = Settings.from_env().rabbitmq_urls
    short = ",".join(f"{url}{'&' if '?' in url else '?'}heartbeat={HEARTBEAT_S}" for url in urls)
    monkeypatch.setenv("RUNBRAKE_RABBITMQ_URL", short)
    return Settings.from_env()


def connection_names() -> str:
    listed = subprocess.run(["rabbitmqctl", "list_connections", "-q", "client_properties"], capture_output=True,
                            text=True, timeout=60, check=False)
    if listed.returncode != 0:
        pytest.skip(f"rabbitmqctl cannot list connections here: {listed.stderr.strip()}")
    return listed.stdout


def idle_past_heartbeats(settings: Settings) -> None:
    """Return once RabbitMQ dropped a connection opened now and never serviced: every connection idle since
    before this call, and not kept alive, is dropped by then too."""
    name = f"idle-twin {settings.namespace}"
    twin = pika.BlockingConnection(connection_parameters(settings, name=name))
    assert name in connection_names()
    poll_until(lambda: name not in connection_names(), timeout=IDLE_TIMEOUT_S, interval=0.5,
               failure=lambda: f"RabbitMQ did not drop the unserviced connection within {IDLE_TIMEOUT_S:g} s")
    with silenced("pika"), contextlib.suppress(pika.exceptions.AMQPError):
        twin.close()


@pytest.fixture
def queued(store: RunStore, producer: Producer) -> list[str]:
    """Two queued runs (no worker takes them): a cancel wins the fence and publishes the wake-up."""
    return [producer.enqueue(spec({}, [{"content": "never"}])).run_id for _ in range(2)]


def test_a_cancel_through_serve_after_an_idle_spell_longer_than_heartbeats_allow_is_confirmed(
    start_api: Callable[..., ApiProcess], store: RunStore, queued: list[str], rabbitmq: Settings
) -> None:
    api = start_api()
    warm = httpx2.post(f"{api.url}/v1/runs/{queued[0]}/cancel", json={"reason": "warm"}, timeout=30)
    assert warm.status_code == 202, warm.text
    assert warm.json()["message_confirmed"] is True

    idle_past_heartbeats(rabbitmq)

    cold = httpx2.post(f"{api.url}/v1/runs/{queued[1]}/cancel", json={"reason": "after idle"}, timeout=30)
    assert cold.status_code == 202, cold.text
    assert cold.json()["message_confirmed"] is True, api.log()[-3000:]
    assert store.get(queued[1]).status is RunStatus.CANCELLED
    # Kept alive, not dropped and opened again: the publisher's one connection is still there.
    assert "cancel_publisher_reconnecting" not in api.log()
    assert f"runbrake-cancel-publisher {rabbitmq.namespace}" in connection_names()


def test_a_cancel_request_after_an_idle_spell_wakes_the_worker_with_a_confirmed_message(
    worker: WorkerProcess, toolbox_http: Toolbox, producer: Producer, store: RunStore, rabbitmq: Settings
) -> None:
    runs = [producer.enqueue(spec({"toolbox": toolbox_http.spec},
                                  [{"tool_calls": [call("slow", seconds=60)]}, {"content": "never"}])).run_id
            for _ in range(2)]
    topology = Topology.of(rabbitmq)

    def request_cancel(run_id: str) -> None:
        connection = pika.BlockingConnection(connection_parameters(rabbitmq))
        try:
            channel = connection.channel()
            channel.confirm_delivery()
            channel.basic_publish(exchange=topology.cancel_requests_exchange,
                                  routing_key=topology.cancel_requests_routing_key,
                                  body=json.dumps({"run_id": run_id}).encode(), mandatory=True)
        finally:
            connection.close()

    wait_for_event(toolbox_http.events, "started", tool="slow", count=2, timeout=30)
    request_cancel(runs[0])
    worker.wait_for_log("cancel_request_applied", run_id=runs[0], message_confirmed=True, timeout=30)

    idle_past_heartbeats(rabbitmq)

    request_cancel(runs[1])
    applied = worker.wait_for_log("cancel_request_applied", run_id=runs[1], timeout=30)
    assert applied[0]["message_confirmed"] is True
    wait_for_event(toolbox_http.events, "cancelled", tool="slow", count=2, timeout=30)
    record = wait_for_run(store, runs[1], lambda r: r.status is RunStatus.CANCELLED)
    assert record.status is RunStatus.CANCELLED


def test_the_event_relay_publishes_the_first_events_after_an_idle_spell_on_the_connection_it_kept(
    worker: WorkerProcess, producer: Producer, store: RunStore, rabbitmq: Settings
) -> None:
    topology = Topology.of(rabbitmq)
    events = f"{rabbitmq.namespace}.test-run-completed"
    connection = pika.BlockingConnection(connection_parameters(rabbitmq))
    try:
        channel = connection.channel()
        topology.declare_events_exchange(channel)
        channel.queue_declare(events, durable=False)
        channel.queue_bind(events, topology.events_exchange, routing_key="run.completed")
    finally:
        connection.close()
    try:
        quick = spec({}, [{"content": "done"}])
        first = producer.enqueue(quick).run_id
        assert wait_for_run(store, first, timeout=30).status is RunStatus.COMPLETED
        [(body, _headers)] = take_messages(rabbitmq, events, 1, timeout=30)
        assert json.loads(body)["run_id"] == first

        idle_past_heartbeats(rabbitmq)

        second = producer.enqueue(quick).run_id
        assert wait_for_run(store, second, timeout=30).status is RunStatus.COMPLETED
        [(body, _headers)] = take_messages(rabbitmq, events, 1, timeout=30)
        assert json.loads(body)["run_id"] == second
        # Published on the connection it kept alive: it never lost it, so never had to start over.
        assert worker.logged("event_relay_interrupted") == []
    finally:
        connection = pika.BlockingConnection(connection_parameters(rabbitmq))
        try:
            connection.channel().queue_delete(events)
        finally:
            connection.close()
