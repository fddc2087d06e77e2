"""The event relay: publishes the outbox on the topic exchange ``<ns>.events`` (docs/architecture.md, "The
relay"; docs/messages.md, "Run events").

The store writes every status change and every step to the outbox (a Redis stream, ``<ns>:outbox``) in the
script that makes the change (shared/_scripts.py, ``outbox``). One :class:`EventRelay` per worker process
reads it through one consumer group (``relay``), publishes each entry persistent with publisher confirms,
and acknowledges (XACK) the entries only once RabbitMQ confirmed them. Nothing is deleted on publication:
the outbox is trimmed by age alone, so ``GET /v1/events`` replays the same events.

Order per run: of all the relays of a namespace, one publishes at a time, the holder of a lease in Redis
(renewed every round; a relay that stops gives it up, one that dies loses it after :data:`LEASE_S`). Each
round first takes over every entry handed out and not acknowledged (its own after RabbitMQ refused a batch,
or a dead relay's), oldest first, then reads new ones: entries go out in the outbox's order. RabbitMQ down:
nothing is acknowledged, the relay reconnects with backoff and publishes what waited, in order. At least
once: an entry published but not acknowledged (the relay died between the confirm and the XACK, or a stalled
relay lost its lease mid-batch) is published again, with the same ``message_id``.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, Final

import pika
import pika.exceptions
import structlog
from pika.spec import Basic

from runbrake.shared.errors import PublishError, StoreError
from runbrake.shared.logging import silenced
from runbrake.shared.messaging.wire import RunEventMessage, Topology, connection_parameters, encode_run_event
from runbrake.shared.records import OutboxEntry, stream_position
from runbrake.shared.settings import Settings
from runbrake.shared.store import RunStore
from runbrake.worker.parts import Health, PartThread

log = structlog.get_logger(__name__)

BATCH: Final = 500
"""Entries read (per shard) and published per round: their confirms are awaited together."""
LEASE_S: Final = 10.0
"""How long the publishing relay's lease lasts unrenewed: a relay that died is replaced after this."""
CONFIRM_TIMEOUT_S: Final = 30.0
"""How long a batch's confirms are awaited before the connection is given up (the entries stay pending)."""
BLOCK_MS: Final = 500
"""How long one read waits for a new entry on a single Redis (below the store's socket timeout)."""
POLL_S: Final = 0.1
"""How long a relay on a Redis Cluster (which polls its shards) waits after a round that found nothing."""
_FIRST_BACKOFF_S: Final = 0.2
_MAX_BACKOFF_S: Final = 5.0


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
            self._channel.basic_publish(exchange, message.routing_key, message.body, message.properties)
            self._tag += 1
            self._unconfirmed.add(self._tag)
        self._service(lambda: not self._unconfirmed, "confirms", still_leading)
        if self._refused:
            refused, self._refused = self._refused, 0
            raise PublishError(f"RabbitMQ refused {refused} of {len(messages)} events (nack)")

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


def consumer_name() -> str:
    """A name for one part of one process in an outbox's consumer group and in its lease: the host, the pid
    and a random suffix (a restarted process is a new consumer)."""
    host = "".join(c if c.isalnum() or c in "-." else "-" for c in socket.gethostname())[:60]
    return f"{host}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


class EventRelay(PartThread):
    """Publishes the outbox on ``<ns>.events`` while it holds the relay's lease; stands by otherwise."""

    role = "event_relay"

    def __init__(self, settings: Settings, store: RunStore) -> None:
        super().__init__("runbrake-event-relay")
        self._store = store
        self._publisher = ConfirmedPublisher(settings, self._stopping)
        self.name_in_group = consumer_name()
        """This relay's consumer name in the group, and its name in the lease."""
        self.leading = False
        """Whether this relay held the lease at its last round (it publishes)."""
        self.published = 0
        """Events this relay published (and acknowledged) since it started."""

    def health(self) -> Health:
        if not self.is_alive():
            return Health(False, "not running")
        return Health(True, "publishing" if self.leading else "standing by")

    def run(self) -> None:
        backoff = _FIRST_BACKOFF_S
        groups_made = False
        while not self._stopping.is_set():
            try:
                if not groups_made:
                    self._store.outbox_groups()
                    groups_made = True
                self._round()
                if backoff > _FIRST_BACKOFF_S:
                    log.info("event_relay_resumed")
                backoff = _FIRST_BACKOFF_S
            except (pika.exceptions.AMQPError, PublishError, StoreError) as exc:
                self.leading = False
                self._publisher.close()
                if self._stopping.is_set():
                    break
                # Once per outage at warning (docs/operating.md, "A RabbitMQ cluster": a few lines, not one per
                # attempt); the attempts after it at debug, until event_relay_resumed.
                (log.warning if backoff == _FIRST_BACKOFF_S else log.debug)(
                    "event_relay_interrupted", error=str(exc) or repr(exc), retry_in_s=backoff)
                self._stopping.wait(backoff)
                backoff = min(backoff * 2, _MAX_BACKOFF_S)
            except Exception:
                # Nothing an entry holds should get here (entries are decoded defensively); if something does,
                # the relay starts over rather than stop publishing for good.
                self.leading = False
                self._publisher.close()
                log.exception("event_relay_crashed", retry_in_s=backoff)
                self._stopping.wait(backoff)
                backoff = min(backoff * 2, _MAX_BACKOFF_S)
        self._publisher.close()
        with contextlib.suppress(StoreError):
            self._store.relay_release(self.name_in_group)
        log.info("event_relay_stopped", published=self.published)

    def _renew(self) -> bool:
        self.leading = self._store.relay_lease(self.name_in_group, lease_s=LEASE_S)
        return self.leading

    def _round(self) -> None:
        """Publish the next batch, if this relay holds the lease."""
        if not self._publisher.connected:
            self._publisher.connect()
        leading = self._store.relay_lease(self.name_in_group, lease_s=LEASE_S)
        if leading != self.leading:
            log.info("event_relay_leading" if leading else "event_relay_standing_by", relay=self.name_in_group)
            self.leading = leading
        if not leading:
            self._stopping.wait(LEASE_S / 3)
            return
        entries, trimmed = self._store.outbox_pending(self.name_in_group, count=BATCH)
        if trimmed:
            log.error("event_relay_events_trimmed_unpublished", events=trimmed,
                      cause="older than RUNBRAKE_RETENTION_S before RabbitMQ took them")
        if not entries:
            block = None if self._store.cluster else BLOCK_MS
            entries = self._store.outbox_new(self.name_in_group, count=BATCH, block_ms=block)
        if not entries:
            if self._store.cluster:
                self._stopping.wait(POLL_S)
            return
        messages = []
        for entry in entries:
            message = event_message(entry, cluster=self._store.cluster)
            if message is None:
                log.warning("event_relay_entry_unreadable", stream_id=entry.stream_id, shard=entry.shard)
            else:
                messages.append(message)
        self._publisher.publish(messages, still_leading=self._renew)
        self._store.outbox_ack(entries)
        self.published += len(messages)


def event_message(entry: OutboxEntry, *, cluster: bool) -> RunEventMessage | None:
    """The message of one outbox entry; None for an entry the store did not write. Its event id is the stream
    id (on a Redis Cluster, ``<stream id>.<shard>``: each shard's outbox numbers its own)."""
    position = stream_position(entry.stream_id)
    if position is None:
        return None
    event_id = f"{entry.stream_id}.{entry.shard:x}" if cluster else entry.stream_id
    return encode_run_event(event_id, entry.run_id, entry.event, entry.labels, occurred_at=position[0] / 1000)
