"""The event relay: publishes the outbox on the topic exchange ``<ns>.events`` (docs/messaging.md, "The
relay"; docs/messages.md, "Run events").

The store writes every status change and every step to the outbox (a Redis stream, ``<ns>:outbox``) in the
script that makes the change (shared/_scripts.py, ``outbox``). One :class:`EventRelay` per worker process
reads it through one consumer group (``relay``), publishes each entry persistent with publisher confirms,
and acknowledges (XACK) the entries only once RabbitMQ confirmed them. Nothing is deleted on publication:
the outbox is trimmed by age alone, so ``GET /v1/events`` replays the same events.

Order per run: of all the relays of a namespace, one publishes at a time, the holder of a lease in Redis
(renewed every third of it; a relay that stops gives it up, one that dies loses it after :data:`LEASE_S`).
After each renewal it first takes over every entry handed out and not acknowledged (its own after RabbitMQ
refused a batch, or a dead relay's), oldest first, then reads new ones: entries go out in the outbox's order.
A round between renewals costs Redis the read and the acknowledgement alone. RabbitMQ down:
nothing is acknowledged, the relay reconnects with backoff and publishes what waited, in order. At least
once: an entry published but not acknowledged (the relay died between the confirm and the XACK, or a stalled
relay lost its lease mid-batch) is published again, with the same ``message_id``.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Final

import pika
import pika.exceptions
import structlog
from pika.spec import Basic

from runbrake.shared.errors import PublishError, StoreError
from runbrake.shared.logging import silenced
from runbrake.shared.messaging.wire import (
    RunEventMessage,
    Topology,
    connection_parameters,
    encode_run_event,
    keep_alive,
)
from runbrake.shared.records import OutboxEntry, stream_position
from runbrake.shared.settings import Settings
from runbrake.shared.store import RunStore
from runbrake.worker.outbox_reader import LEASE_S, OutboxReader
from runbrake.worker.parts import Health

log = structlog.get_logger(__name__)

BATCH: Final = 500
"""Entries read (per shard) and published per round: their confirms are awaited together."""
CONFIRM_TIMEOUT_S: Final = 30.0
"""How long a batch's confirms are awaited before the connection is given up (the entries stay pending)."""
BLOCK_MS: Final = 500
"""How long one read waits for a new entry on a single Redis (below the store's socket timeout)."""
POLL_S: Final = 0.1
"""How long a relay on a Redis Cluster (which polls its shards) waits after a round that found nothing."""


class ConfirmedPublisher:
    """A channel on ``<ns>.events`` that publishes a batch and then awaits all its confirms at once.

    pika's ``BlockingChannel.confirm_delivery`` makes each ``basic_publish`` wait for its own confirm
    (about 1,700 messages/s here, one round trip each). Confirm mode is turned on, instead, on the channel
    underneath (``BlockingChannel._impl``, pika's ``Channel``) with a callback of our own: a batch is
    written, then the connection is serviced until every delivery tag of it was acknowledged (RabbitMQ acks
    several at once with ``multiple``). Used from one thread only (pika is not thread-safe).
    """

    def __init__(self, settings: Settings, stopping: threading.Event) -> None:
        self._settings = settings
        self._stopping = stopping
        """Set when the relay stops: a wait for confirms gives up (the entries stay pending: at least once)."""
        self._topology = Topology.of(settings)
        self._connection: pika.BlockingConnection | None = None
        self._channel: Any = None
        self._tag = 0
        self._unconfirmed: set[int] = set()
        self._refused = 0
        self._selected = False

    @property
    def connected(self) -> bool:
        return self._connection is not None and self._connection.is_open

    def connect(self) -> None:
        """Connect, declare the exchange and turn confirms on.

        Raises:
            pika.exceptions.AMQPError: when RabbitMQ cannot be reached.
            PublishError: when RabbitMQ did not turn confirms on in time.
        """
        # A broker alarm must not hang the relay: a blocked connection is given up after the confirm timeout.
        parameters = connection_parameters(
            self._settings, name=f"runbrake-event-relay {self._settings.namespace} pid={os.getpid()}",
            blocked_connection_timeout=CONFIRM_TIMEOUT_S)
        with silenced("pika"):
            self._connection = pika.BlockingConnection(parameters)
        channel = self._connection.channel()
        self._topology.declare_events_exchange(channel)
        self._tag, self._unconfirmed, self._refused, self._selected = 0, set(), 0, False
        channel._impl.confirm_delivery(ack_nack_callback=self._on_confirm, callback=self._on_select)
        self._channel = channel
        self._service(lambda: self._selected, "confirm mode")

    def publish(self, messages: Sequence[RunEventMessage], *, still_leading: Callable[[], bool]) -> None:
        """Publish these messages and return once RabbitMQ confirmed every one. ``still_leading`` renews the
        relay's lease while the confirms are awaited (every third of a lease): a slow broker must not let
        another relay take over a batch this one is still publishing.

        Raises:
            pika.exceptions.AMQPError: when the connection or channel broke.
            PublishError: when RabbitMQ refused one (nack) or did not confirm in time, or the lease was lost.
        """
        exchange = self._topology.events_exchange
        for message in messages:
            # Written to the connection's buffer only (the channel underneath: ``BlockingChannel.basic_publish``
            # would service the connection until each message is sent, a poll per message); the whole batch goes
            # out as the confirms are awaited. Counted as it is buffered, before any confirm can come.
            self._tag += 1
            self._unconfirmed.add(self._tag)
            self._channel._impl.basic_publish(exchange, message.routing_key, message.body, message.properties)
        self._service(lambda: not self._unconfirmed, "confirms", still_leading)
        if self._refused:
            refused, self._refused = self._refused, 0
            raise PublishError(f"RabbitMQ refused {refused} of {len(messages)} events (nack)")

    def keep_alive(self) -> None:
        """Service the connection between batches (heartbeats: issue 30).

        Raises:
            PublishError: when RabbitMQ dropped it (the relay reconnects, as after any failed round).
        """
        if not keep_alive(self._connection):
            raise PublishError("the connection to RabbitMQ was lost while the relay was idle")

    def close(self) -> None:
        connection, self._connection, self._channel = self._connection, None, None
        if connection is not None and connection.is_open:
            with silenced("pika"), contextlib.suppress(pika.exceptions.AMQPError):
                connection.close()

    def _service(self, done: Callable[[], bool], what: str,
                 still_leading: Callable[[], bool] = lambda: True) -> None:
        assert self._connection is not None  # connect() made it
        deadline = time.monotonic() + CONFIRM_TIMEOUT_S
        renew_at = time.monotonic() + LEASE_S / 3
        while not done():
            if time.monotonic() > renew_at:
                renew_at = time.monotonic() + LEASE_S / 3
                if not still_leading():
                    raise PublishError(f"the relay lost its lease while it waited for {what}")
            if self._stopping.is_set():
                raise PublishError(f"the relay stopped while it waited for {what}")
            if time.monotonic() > deadline:
                raise PublishError(f"RabbitMQ did not answer ({what}) within {CONFIRM_TIMEOUT_S:.0f} s"
                                   f" ({len(self._unconfirmed)} messages unconfirmed)")
            self._connection.process_data_events(time_limit=0.05)

    def _on_select(self, _frame: Any) -> None:
        self._selected = True

    def _on_confirm(self, frame: Any) -> None:
        method = frame.method
        tag = method.delivery_tag
        confirmed = {t for t in self._unconfirmed if t <= tag} if method.multiple else {tag}
        self._unconfirmed -= confirmed
        if isinstance(method, Basic.Nack):
            self._refused += len(confirmed)


class EventRelay(OutboxReader):
    """Publishes the outbox on ``<ns>.events`` while it holds the relay's lease; stands by otherwise."""

    role = "event_relay"
    event = "event_relay"
    working = "leading"
    unread = "unpublished"
    outages = (pika.exceptions.AMQPError, PublishError, StoreError)

    def __init__(self, settings: Settings, store: RunStore) -> None:
        super().__init__("runbrake-event-relay", store.relay_cursor())
        self._cluster = store.cluster
        self._publisher = ConfirmedPublisher(settings, self._stopping)
        self.published = 0
        """Events this relay published (and acknowledged) since it started."""

    def health(self) -> Health:
        if not self.is_alive():
            return Health(False, "not running")
        return Health(True, "publishing" if self.leading else "standing by")

    def _work(self) -> None:
        """Publish the next batch."""
        if not self._publisher.connected:
            self._publisher.connect()
        entries = self._next_entries(count=BATCH, block_ms=None if self._cluster else BLOCK_MS)
        if not entries:
            self._publisher.keep_alive()
            if self._cluster:
                self._stopping.wait(POLL_S)
            return
        messages = []
        for entry in entries:
            message = event_message(entry, cluster=self._cluster)
            if message is None:
                log.warning("event_relay_entry_unreadable", stream_id=entry.stream_id, shard=entry.shard)
            else:
                messages.append(message)
        self._publisher.publish(messages, still_leading=self._renew)
        self.done += entries
        self.published += len(messages)

    def _interrupted(self) -> None:
        self._publisher.close()

    def _totals(self) -> dict[str, Any]:
        return {"published": self.published}


def event_message(entry: OutboxEntry, *, cluster: bool) -> RunEventMessage | None:
    """The message of one outbox entry; None for an entry the store did not write. Its event id is the stream
    id (on a Redis Cluster, ``<stream id>.<shard>``: each shard's outbox numbers its own)."""
    position = stream_position(entry.stream_id)
    if position is None:
        return None
    event_id = f"{entry.stream_id}.{entry.shard:x}" if cluster else entry.stream_id
    return encode_run_event(event_id, entry.run_id, entry.event, entry.labels, occurred_at=position[0] / 1000)
