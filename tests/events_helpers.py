"""Run events as a consumer sees them: a durable queue bound to ``<ns>.events`` and a bounded take of its
messages (docs/messages.md, "Run events")."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx2
import jsonschema
import pika
import pika.exceptions

from runbrake.shared import RunRecord, RunStore, Settings
from runbrake.shared.messaging.wire import Topology, connection_parameters
from tests.api_helpers import ApiProcess
from tests.polling import poll_until


@dataclass(frozen=True)
class Received:
    """One event message as it arrived."""

    routing_key: str
    message_id: str
    headers: dict[str, Any]
    body: dict[str, Any]
    persistent: bool
    redelivered: bool
    """RabbitMQ delivered it before (to a consumer whose ack it lost, or before it crashed)."""


@contextlib.contextmanager
def events_queue(settings: Settings, binding: str = "#") -> Iterator[str]:
    """A durable queue of this test's bound to the events exchange (declared here if it is not yet): it
    survives a RabbitMQ restart, as a consumer's would. Deleted afterwards."""
    topology = Topology.of(settings)
    queue = f"{settings.namespace}.test-events"
    connection = pika.BlockingConnection(connection_parameters(settings))
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
            connection = pika.BlockingConnection(connection_parameters(settings))
            connection.channel().queue_delete(queue=queue)
            connection.close()


def take_events(settings: Settings, queue: str, count: int, *, timeout: float = 30,
                distinct: bool = False) -> list[Received]:
    """Take ``count`` messages off ``queue`` (a bounded wait); with ``distinct``, as many as it takes to have
    ``count`` distinct message ids (delivery is at least once: a copy may come too)."""
    connection = pika.BlockingConnection(connection_parameters(settings))
    taken: list[Received] = []
    try:
        channel = connection.channel()

        def enough() -> bool:
            return len({e.message_id for e in taken} if distinct else taken) >= count

        def take() -> bool:
            while not enough():
                method, properties, body = channel.basic_get(queue=queue, auto_ack=True)
                if method is None:
                    return False
                taken.append(_received(method, properties, body))
            return True

        poll_until(take, timeout=timeout,
                   failure=lambda: f"only {len(taken)} of {count} events on {queue}: "
                                   f"{[(e.routing_key, e.message_id) for e in taken][-20:]}")
    finally:
        connection.close()
    return taken


def drain_events(settings: Settings, queue: str) -> list[Received]:
    """Every message on ``queue`` right now, taken at once."""
    connection = pika.BlockingConnection(connection_parameters(settings))
    left = []
    try:
        channel = connection.channel()
        while True:
            method, properties, body = channel.basic_get(queue=queue, auto_ack=True)
            if method is None:
                return left
            left.append(_received(method, properties, body))
    finally:
        connection.close()


def _received(method: Any, properties: pika.BasicProperties, body: bytes) -> Received:
    return Received(method.routing_key, str(properties.message_id), dict(properties.headers or {}), json.loads(body),
                    properties.delivery_mode == pika.DeliveryMode.Persistent.value, bool(method.redelivered))


def event_schema() -> Any:
    """The run events' JSON Schema as docs/messages.md gives it ("Run events: JSON Schema")."""
    page = (Path(__file__).resolve().parent.parent / "docs" / "messages.md").read_text()
    section = page.split("## Run events: JSON Schema", 1)[1]
    return json.loads(section.split("```json", 1)[1].split("```", 1)[0])


def assert_valid_bodies(bodies: list[dict[str, Any]]) -> None:
    """Every body validates against the documented schema."""
    validator = jsonschema.Draft202012Validator(event_schema())
    for body in bodies:
        validator.validate(body)


def expected_keys(record: RunRecord) -> list[str]:
    """The routing keys of a run that was queued once, ran once and ended: its status changes and steps."""
    return ["run.queued", "run.running", *(f"step.{step.kind.value}" for step in record.steps),
            f"run.{record.status.value}"]


def position(event_id: str) -> tuple[int, int]:
    """An event id (a stream id, ``<ms>-<seq>``; on a cluster ``<ms>-<seq>.<shard>``) as the pair it orders by
    (within its shard, on a cluster)."""
    ms, seq = event_id.split(".", maxsplit=1)[0].split("-")
    return int(ms), int(seq)


@dataclass(frozen=True)
class Frame:
    id: str | None
    event: str
    data: dict[str, Any]


def frames(response: httpx2.Response) -> Iterator[Frame]:
    """The server-sent events of a response, as they come (comments and retry lines left out)."""
    event_id, event, data = None, "message", ""
    for line in response.iter_lines():
        if line.startswith("id: "):
            event_id = line.removeprefix("id: ")
        elif line.startswith("event: "):
            event = line.removeprefix("event: ")
        elif line.startswith("data: "):
            data = line.removeprefix("data: ")
        elif line == "" and data:
            yield Frame(event_id, event, json.loads(data))
            event_id, event, data = None, "message", ""


def feed(api: ApiProcess, last_event_id: str | None = None) -> Any:
    """``GET /v1/events`` as a stream (a context manager), resumed from ``last_event_id`` when given."""
    headers = {} if last_event_id is None else {"Last-Event-ID": last_event_id}
    return httpx2.stream("GET", f"{api.url}/v1/events", headers=headers, timeout=httpx2.Timeout(30.0))


def stored_statuses(store: RunStore, settings: Settings, after: str) -> list[tuple[str, str, str]]:
    """The status events the outbox holds after ``after``: (event id, run id, status)."""
    found = []
    for stream_id, fields in store.redis.xrange(f"{settings.namespace}:outbox", f"({after}", "+"):
        event = json.loads(fields["event"])
        if event["event"] == "status":
            found.append((stream_id, event["run_id"], event["status"]))
    return found
