"""The wire: every RabbitMQ queue and exchange runbrake uses, and every message body on them.

This module is their one owner (docs/messages.md describes them for other languages).
The producer, the cancel publisher, the worker's cancel listener, the demo, the tests and
the benchmarks name, declare, encode, decode and delete through it; nothing else spells
a queue name or builds a body.

Per namespace ``<ns>`` (``RUNBRAKE_NAMESPACE``):

    <ns>.runs            durable queue   run messages (a Dramatiq envelope carrying the run id)
    <ns>.runs.DQ         durable queue   Dramatiq's delay queue for retried run messages
    <ns>.runs.XQ         durable queue   Dramatiq's dead letters
    <ns>.cancel          durable fanout  cancel wake-ups {"run_id": …}; each worker process binds
                                         an exclusive, server-named, auto-delete queue to it
    <ns>.noop[.DQ|.XQ]   durable queue   the benchmarks' no-op actor (a broker ceiling)

The durable queues are classic, or quorum queues with ``RUNBRAKE_QUEUE_TYPE=quorum``.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from typing import Any, Final

import pika
import pika.exceptions
from dramatiq import Message
from pika.adapters.blocking_connection import BlockingChannel

from runbrake.shared.settings import Settings

RUN_ACTOR: Final = "execute_run"
"""The Dramatiq actor that executes run messages."""
NOOP_ACTOR: Final = "noop"
"""The benchmarks' no-op actor."""

MAX_CANCEL_BODY_BYTES: Final = 1024
"""A cancel body is ``{"run_id": …}``: anything longer is refused before it is parsed, so a huge or
deeply nested body cannot cost the listener more than a length check."""
MAX_RUN_ID_CHARS: Final = 100

_DRAMATIQ_TWINS: Final = ("", ".DQ", ".XQ")


@dataclass(frozen=True, slots=True)
class Topology:
    """The names of one namespace's queues and exchanges, and how to declare them."""

    namespace: str

    @classmethod
    def of(cls, settings: Settings) -> Topology:
        return cls(settings.namespace)

    @property
    def run_queue(self) -> str:
        """The Dramatiq queue of run messages."""
        return f"{self.namespace}.runs"

    @property
    def noop_queue(self) -> str:
        """The benchmarks' no-op queue."""
        return f"{self.namespace}.noop"

    @property
    def cancel_exchange(self) -> str:
        """The fanout exchange of cancel wake-ups."""
        return f"{self.namespace}.cancel"

    def queues(self) -> tuple[str, ...]:
        """Every durable queue of the namespace, with Dramatiq's delay and dead-letter twins."""
        return tuple(base + twin for base in (self.run_queue, self.noop_queue) for twin in _DRAMATIQ_TWINS)

    def declare_cancel_exchange(self, channel: BlockingChannel) -> None:
        """Declare the cancel fanout (idempotent; publishers and listeners both call it)."""
        channel.exchange_declare(exchange=self.cancel_exchange, exchange_type="fanout", durable=True)

    def bind_cancel_listener(self, channel: BlockingChannel) -> str:
        """Declare the cancel fanout and a queue of this listener's own bound to it; returns the queue's name.

        The queue is exclusive, server-named and auto-deleted: a listener that goes away takes it
        along, so no cancel piles up for a process that no longer exists.
        """
        self.declare_cancel_exchange(channel)
        queue: str = channel.queue_declare(queue="", exclusive=True, auto_delete=True).method.queue
        channel.queue_bind(queue=queue, exchange=self.cancel_exchange)
        return queue


def queue_type_arguments(queue_type: str) -> dict[str, str]:
    """The declaration arguments ``RUNBRAKE_QUEUE_TYPE`` adds to the namespace's durable queues.

    ``classic`` adds none, so a queue declared before the setting existed stays equivalent.
    ``quorum`` asks for a replicated quorum queue. RabbitMQ refuses to redeclare an existing queue
    with another type (``PRECONDITION_FAILED``): switching needs the old queues deleted first
    (README.md, "Operating"). A listener's exclusive cancel queue is always classic.
    """
    return {"x-queue-type": "quorum"} if queue_type == "quorum" else {}


# -- run messages --------------------------------------------------------------------------------


def run_message(topology: Topology, run_id: str, *, resume: bool = False) -> Message[Any]:
    """The Dramatiq message for a run: its id and whether it starts or resumes the run, nothing more.

    The run's request lives in Redis; a message is only a pointer to it.
    """
    return Message(
        queue_name=topology.run_queue,
        actor_name=RUN_ACTOR,
        args=(run_id,),
        kwargs={"resume": resume},
        options={},
    )


# -- cancel messages -----------------------------------------------------------------------------

CANCEL_PROPERTIES: Final = pika.BasicProperties(content_type="application/json", delivery_mode=1)
"""Transient: a cancel message is a wake-up, the cancel itself is durable in Redis."""


def encode_cancel(run_id: str) -> bytes:
    """The body of a cancel wake-up."""
    return json.dumps({"run_id": run_id}, separators=(",", ":")).encode()


def decode_cancel(body: bytes) -> str | None:
    """The run id a cancel body names, or None for anything malformed: too long, not UTF-8 JSON,
    not an object, no string ``run_id`` of 1 to 100 characters. Never raises."""
    if len(body) > MAX_CANCEL_BODY_BYTES:
        return None
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        return None
    run_id = data.get("run_id") if isinstance(data, dict) else None
    if not isinstance(run_id, str) or not 0 < len(run_id) <= MAX_RUN_ID_CHARS:
        return None
    return run_id


# -- the whole topology --------------------------------------------------------------------------


def delete_topology(settings: Settings) -> None:
    """Delete every queue and exchange of ``settings.namespace`` (tests, the demo and the benchmarks
    clean up with this). Missing ones are fine.

    Raises:
        pika.exceptions.AMQPError: when RabbitMQ cannot be reached.
    """
    topology = Topology.of(settings)
    connection = pika.BlockingConnection(pika.URLParameters(settings.rabbitmq_url))
    try:
        channel = connection.channel()
        for queue in topology.queues():
            channel.queue_delete(queue=queue)
        channel.exchange_delete(exchange=topology.cancel_exchange)
    finally:
        with contextlib.suppress(pika.exceptions.AMQPError):
            connection.close()
