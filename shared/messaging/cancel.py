"""The cancel: win the fence in Redis, then wake the worker that holds the run
(docs/cancellation.md, "Cancellation")."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import pika
import pika.exceptions
import structlog

from runbrake.shared import redaction, tracing
from runbrake.shared.messaging.wire import (
    Topology,
    cancel_properties,
    connection_parameters,
    encode_cancel,
    encode_steer_wakeup,
    keep_alive,
    keep_alive_interval,
)
from runbrake.shared.settings import Settings
from runbrake.shared.status import RunStatus
from runbrake.shared.store import RunStore

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class CancelResult:
    """What a cancel came to: whether it won the fence (and the status it found), and whether the
    wake-up message was confirmed by RabbitMQ (None when nothing was published)."""

    run_id: str
    won: bool
    found: RunStatus
    exists: bool
    message_confirmed: bool | None = None
    message_error: str | None = None


class CancelPublisher:
    """Publishes ``{"run_id": …}`` on the ``<namespace>.cancel`` fanout exchange with publisher confirms.

    Used from one thread only (pika is not thread-safe). A long-lived owner calls :meth:`keep_alive` every
    :meth:`keep_alive_interval` while idle, so that RabbitMQ does not drop the connection for missed heartbeats
    (issue 30); a connection lost anyway is noticed and opened again before the next publish.
    """

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._topology = Topology.of(settings)
        self._connection: pika.BlockingConnection | None = None
        self._channel: pika.adapters.blocking_connection.BlockingChannel | None = None

    def publish(self, run_id: str, *, steer: bool = False) -> None:
        """Publish one cancel message (with ``steer``, a steer's wake-up) and wait for the broker's confirm.

        A connection found lost (RabbitMQ closed it, or it broke during the publish) is opened again and the
        message published once more on the new one: a wake-up received twice wakes the worker once.

        Raises:
            pika.exceptions.AMQPError: when RabbitMQ cannot be reached or refuses the message.
        """
        body = encode_steer_wakeup(run_id) if steer else encode_cancel(run_id)
        properties = cancel_properties(tracing.current().traceparent())
        reopened = False
        while True:
            channel = self._ensure_channel()
            try:
                channel.basic_publish(exchange=self._topology.cancel_exchange, routing_key="", body=body,
                                      properties=properties)
            except (pika.exceptions.NackError, pika.exceptions.UnroutableError):
                raise  # RabbitMQ answered: a second try would be answered the same
            except pika.exceptions.AMQPError as exc:
                self.close()
                if reopened:
                    raise
                log.info("cancel_publisher_reconnecting", run_id=run_id, error=repr(exc)[:300])
                reopened = True
            else:
                return

    def keep_alive(self) -> None:
        """Service the idle connection, if any (heartbeats); a lost one is closed, to be opened at the next
        publish."""
        if self._connection is not None and not keep_alive(self._connection):
            self.close()

    def keep_alive_interval(self) -> float:
        """How long this publisher may go between two :meth:`keep_alive` calls."""
        return keep_alive_interval(self._connection)

    def close(self) -> None:
        connection, self._connection, self._channel = self._connection, None, None
        if connection is not None and connection.is_open:
            with contextlib.suppress(pika.exceptions.AMQPError):
                connection.close()

    def _ensure_channel(self) -> pika.adapters.blocking_connection.BlockingChannel:
        # Checked before use: a connection RabbitMQ closed while it sat idle is noticed here, not by a publish
        # that fails half-way.
        if self._channel is not None and self._channel.is_open and keep_alive(self._connection):
            return self._channel
        self.close()
        # A name operators (and tests) can find in `rabbitmqctl list_connections client_properties`.
        self._connection = pika.BlockingConnection(connection_parameters(
            self._settings, name=f"runbrake-cancel-publisher {self._settings.namespace} pid={os.getpid()}"))
        channel = self._connection.channel()
        channel.confirm_delivery()
        self._topology.declare_cancel_exchange(channel)
        self._channel = channel
        return channel


def cancel_run(
    store: RunStore, publisher: CancelPublisher | None, run_id: str, *, reason: str, requested_by: str
) -> CancelResult:
    """Win the terminal transition, then publish the wake-up.

    A failed publish does not undo the fence: the worker's backstop still finds the cancel key
    within its poll interval. Pass ``publisher=None`` to write the fence alone.

    Raises:
        StoreError: when Redis cannot be reached (nothing changed, nothing published); its subclass
            NotReplicated when the primary has the fence but too few replicas acknowledged it
            (``RUNBRAKE_REDIS_MIN_REPLICAS_ACK``): nothing published, and asking again is safe.
    """
    with tracing.current().span("runbrake.cancel", {"runbrake.run_id": run_id}, kind="producer") as span:
        result = _cancel_run(store, publisher, run_id, reason=reason, requested_by=requested_by)
        span.set({"runbrake.cancel.won": result.won, "runbrake.cancel.found": result.found.value})
        return result


def _cancel_run(
    store: RunStore, publisher: CancelPublisher | None, run_id: str, *, reason: str, requested_by: str
) -> CancelResult:
    with redaction.submitted(redaction.Submitted(reason, requested_by)):  # the caller's words, kept as written
        fence, first = store.cancel_reading_children(run_id, reason=reason, requested_by=requested_by)
        # Every unfinished run below it in its agent tree is fenced too, naming the run the cancel came from
        # (docs/usage.md, "Agent trees"); the level below was read with the fence: a run that started no agent
        # costs one round trip.
        below = store.cancel_below(run_id, reason=f"{reason} (cancelled with run {run_id})",
                                   requested_by=requested_by, first=first) if fence.won and first else []
    result = CancelResult(run_id=run_id, won=fence.won, found=fence.found, exists=fence.exists)
    if not fence.won:
        return result
    log.info("run_cancelled", run_id=run_id, reason=reason, requested_by=requested_by, was=fence.found.value)
    if below:
        log.info("run_tree_cancelled", run_id=run_id, below=len(below))
    if publisher is None:
        return result
    try:
        # One wake-up for the whole tree: each worker's listener interrupts the run and the runs below it that it
        # executes (worker/cancel_listener.py), so the last leaf is not woken 30 confirms after the first.
        publisher.publish(run_id)
    except pika.exceptions.AMQPError as exc:
        publisher.close()
        log.warning("cancel_message_not_confirmed", run_id=run_id, error=repr(exc))
        return CancelResult(run_id, True, fence.found, True, message_confirmed=False, message_error=repr(exc))
    return CancelResult(run_id, True, fence.found, True, message_confirmed=True)
