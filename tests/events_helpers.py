"""Run events as a consumer sees them: a durable queue bound to ``<ns>.events`` and a bounded take of its
messages (docs/messages.md, "Run events")."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pika
import pika.exceptions

from runbrake.shared import RunRecord, Settings
from runbrake.shared.messaging.wire import Topology
from tests.polling import poll_until


@dataclass(frozen=True)
class Received:
    """One event message as it arrived."""

    routing_key: str
    message_id: str
    headers: dict[str, Any]
    body: dict[str, Any]
    persistent: bool


@contextlib.contextmanager
def events_queue(settings: Settings, binding: str = "#") -> Iterator[str]:
    """A durable queue of this test's bound to the events exchange (declared here if it is not yet): it
    survives a RabbitMQ restart, as a consumer's would. Deleted afterwards."""
    topology = Topology.of(settings)
    queue = f"{settings.namespace}.test-events"
    connection = pika.BlockingConnection(pika.URLParameters(settings.rabbitmq_url))
    try:
        channel = connection.channel()
        topology.declare_events_exchange(channel)
        channel.queue_declare(queue=queue, durable=True)
        channel.queue_bind(queue=queue, exchange=topology.events_exchange, routing_key=binding)
    finally:
        connection.close()
    try:
        yield queue
    finally:
        with contextlib.suppress(pika.exceptions.AMQPError):
            connection = pika.BlockingConnection(pika.URLParameters(settings.rabbitmq_url))
            connection.channel().queue_delete(queue=queue)
            connection.close()


def take_events(settings: Settings, queue: str, count: int, *, timeout: float = 30) -> list[Received]:
    """Take ``count`` messages off ``queue`` (a bounded wait), then check that no more are there."""
    connection = pika.BlockingConnection(pika.URLParameters(settings.rabbitmq_url))
    taken: list[Received] = []
    try:
        channel = connection.channel()

        def take() -> bool:
            while len(taken) < count:
                method, properties, body = channel.basic_get(queue=queue, auto_ack=True)
                if method is None:
                    return False
                taken.append(Received(method.routing_key, properties.message_id, dict(properties.headers or {}),
                                      json.loads(body), properties.delivery_mode == 2))
            return True

        poll_until(take, timeout=timeout,
                   failure=lambda: f"only {len(taken)} of {count} events on {queue}: "
                                   f"{[(e.routing_key, e.message_id) for e in taken][-20:]}")
    finally:
        connection.close()
    return taken


def expected_keys(record: RunRecord) -> list[str]:
    """The routing keys of a run that was queued once, ran once and ended: its status changes and steps."""
    return ["run.queued", "run.running", *(f"step.{step.kind.value}" for step in record.steps),
            f"run.{record.status.value}"]


def position(event_id: str) -> tuple[int, int]:
    """An event id (a stream id, ``<ms>-<seq>``) as the pair it orders by."""
    ms, seq = event_id.split("-")
    return int(ms), int(seq)
