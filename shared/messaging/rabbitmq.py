"""Dramatiq's RabbitMQ broker, configured for long agent runs (docs/pitfalls.md, "Pitfalls").

- Publisher confirms on: ``enqueue`` returns only once RabbitMQ has the message.
- Queue names come from ``shared/messaging/wire.py``: ``<ns>.runs`` (plus Dramatiq's ``.DQ``/``.XQ`` twins).
- RabbitMQ's consumer timeout: a run's message is acked once its claim is decided
  (``worker/intake.py``), so it no longer stays unacked while the run executes. The
  run queue still raises ``x-consumer-timeout`` (RabbitMQ 3.12+) to the run's time
  limit; where a channel is closed anyway, a run's durability lives in Redis and not
  in the message: a redelivered message finds the run no longer queued and is acked
  as a no-op.
- The middleware is chosen, not inherited: ``Retries`` with ``max_retries=0`` by default
  (Dramatiq's default is 20 with backoff); the run actor retries only store outages
  (``worker/actors.py``), and a cancelled run is never retried. ``TimeLimit`` set per
  actor, ``AsyncIO`` for the async actor.
- ``RUNBRAKE_QUEUE_TYPE=quorum`` declares the run queue and its ``.DQ``/``.XQ`` twins as quorum
  queues (replicated across the RabbitMQ cluster's nodes). Dramatiq declares the ``.XQ`` twin with
  arguments of its own, so that declaration is overridden too. Quorum queues refuse
  ``x-max-priority`` on RabbitMQ before 3.12; this broker never sets it.
- The ``.XQ`` dead-letter twins are bounded in length, bytes and age (``wire.dead_letter_arguments``); a
  twin declared before the bounds existed is kept as it is, with a warning (docs/messages.md,
  "Dead-letter queues: upgrading").
- A consumed envelope is checked before Dramatiq reads it (:class:`CheckedConsumer`): anything the worker
  does not accept is dead-lettered once, with the reason, and acked.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from typing import Any

import pika
import pika.exceptions
import structlog
from dramatiq.asyncio import get_event_loop_thread
from dramatiq.broker import Consumer
from dramatiq.brokers.rabbitmq import RabbitmqBroker, _RabbitmqConsumer
from dramatiq.common import q_name, xq_name
from dramatiq.errors import ConnectionClosed
from dramatiq.middleware import (
    AgeLimit,
    AsyncIO,
    CurrentMessage,
    Middleware,
    Retries,
    ShutdownNotifications,
    TimeLimit,
)

from runbrake.shared.messaging.wire import (
    DEAD_REASON_HEADER,
    DEAD_SIZE_HEADER,
    MAX_RUN_MESSAGE_BYTES,
    MalformedRunMessage,
    check_run_message,
    declare_dead_letter_queue,
    keep_alive,
    keep_alive_interval,
    queue_type_arguments,
)
from runbrake.shared.settings import Settings

log = structlog.get_logger(__name__)

DRAMATIQ_CONSUMER_LOGGER = "dramatiq.brokers.rabbitmq.CheckedConsumer"
"""Where Dramatiq's consumer logs a lost ack (dramatiq/brokers/rabbitmq.py names the logger for the class:
:class:`CheckedConsumer`); each consumer thread logs to ``dramatiq.worker.ConsumerThread(<queue>)``
(:meth:`BrokerOutage.watch`)."""

_LOST = "Consumer encountered a connection error"
_NOISE = ("Restarting consumer in",)
_ACK_LOST = ("Failed to post_process_message(", "Failed to ack message: not in known tags",
             "Failed to nack message: not in known tags")


class BrokerOutage(logging.Filter):
    """One log line when this process's run consumers lose RabbitMQ, one when they are back.

    On every attempt to reconnect, each of Dramatiq's consumer threads says CRITICAL "Consumer encountered a
    connection error" and INFO "Restarting consumer in 3.00 seconds", and each message whose ack went with
    the connection says WARNING "Failed to post_process_message(…)" every 5 s until it is back, then "Failed
    to ack message: not in known tags" (dramatiq/worker.py, ``_ConsumerThread``): with pika's own errors, a
    20 s outage logged some 190 lines per worker (issue 21). Installed on Dramatiq's loggers, this filter
    drops those records and logs ``broker_connection_lost`` for the first; :meth:`back`, called when a
    consumer connected again, logs ``broker_connection_restored`` once, with the acks lost so far (those
    messages come back from RabbitMQ; the run's claim finds them claimed and acks them as no-ops:
    docs/operating.md, "A RabbitMQ cluster").
    """

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self._lost = False
        self._acks_lost = 0

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message.startswith(_LOST):
            with self._lock:
                first, self._lost = not self._lost, True
            if first:
                log.warning("broker_connection_lost", error=message.partition(": ")[2][:300])
            return False
        if message.startswith(_ACK_LOST):
            if not message.startswith(_ACK_LOST[0]):  # counted once per message: by its last word
                with self._lock:
                    self._acks_lost += 1
            return False
        return not message.startswith(_NOISE)

    def back(self, queue: str) -> None:
        with self._lock:
            lost, self._lost = self._lost, False
            acks_lost = self._acks_lost
        if lost:
            log.info("broker_connection_restored", queue=queue, acks_lost_so_far=acks_lost)


    def watch(self, queue: str) -> None:
        """Filter the log of the consumer thread of ``queue`` (a logger each: dramatiq/worker.py,
        ``ConsumerThread.__init__``), once."""
        logger = logging.getLogger(f"dramatiq.worker.ConsumerThread({queue})")
        if self not in logger.filters:
            logger.addFilter(self)


def broker_outage() -> BrokerOutage:
    """This process's :class:`BrokerOutage` filter, installed on Dramatiq's consumer logger once."""
    logger = logging.getLogger(DRAMATIQ_CONSUMER_LOGGER)
    for existing in logger.filters:
        if isinstance(existing, BrokerOutage):
            return existing
    installed = BrokerOutage()
    logger.addFilter(installed)
    return installed


class RunbrakeBroker(RabbitmqBroker):
    """A RabbitMQ broker whose run queue tolerates long-held messages."""

    def __init__(self, settings: Settings, *, middleware: list[Middleware] | None = None) -> None:
        super().__init__(
            # Every node of a cluster, tried in order by each connection (docs/operating.md, "A RabbitMQ cluster").
            url=list(settings.rabbitmq_urls),
            confirm_delivery=True,
            middleware=middleware if middleware is not None else default_middleware(),
        )
        self._consumer_timeout_ms = (settings.run_time_limit_s + 300) * 1000
        self._queue_type = settings.queue_type
        self._type_arguments = queue_type_arguments(settings.queue_type)
        self.outage = broker_outage()
        self._consuming: dict[str, threading.Event] = {}
        self._consuming_lock = threading.Lock()

    def consuming(self, queue_name: str) -> threading.Event:
        """Set once a consumer of ``queue_name`` in this process is bound to it (its declaration done): a
        message published to the queue from then on is routed."""
        with self._consuming_lock:
            return self._consuming.setdefault(queue_name, threading.Event())

    def keep_alive(self) -> float:
        """Service this thread's connection, if it has one, while the thread is idle (heartbeats: issue 30); a
        lost one is dropped, and the next enqueue opens another. Returns how long until the next call."""
        connection = getattr(self.state, "connection", None)
        if connection is not None and not keep_alive(connection):
            with contextlib.suppress(pika.exceptions.AMQPError):
                del self.connection  # Dramatiq's deleter forgets the channel and the connection, closing what is open
            connection = None
        return keep_alive_interval(connection)

    @property
    def consumer_class(self) -> type[CheckedConsumer]:
        return CheckedConsumer

    def consume(self, queue_name: str, prefetch: int = 1, timeout: int = 5000) -> Consumer:
        """Dramatiq's consume, the consumer thread's log filtered first (:class:`BrokerOutage`): a consumer
        thread calls this on every (re)connect."""
        self.outage.watch(queue_name)
        return super().consume(queue_name, prefetch, timeout)

    def actors_on(self, queue_name: str) -> frozenset[str]:
        """The names of the actors declared on ``queue_name`` (or on the queue whose delay twin it is)."""
        queue = q_name(queue_name)
        return frozenset(name for name, actor in self.actors.items() if actor.queue_name == queue)

    def _build_queue_arguments(self, queue_name: str) -> dict[str, Any]:
        arguments: dict[str, Any] = super()._build_queue_arguments(queue_name)  # type: ignore[no-untyped-call]
        arguments["x-consumer-timeout"] = self._consumer_timeout_ms
        arguments.update(self._type_arguments)
        return arguments

    def _declare_xq_queue(self, queue_name: str) -> Any:
        # Dramatiq's declaration carries only a TTL: the dead-letter twin gets the bounds and the queue type.
        return declare_dead_letter_queue(self.connection, xq_name(queue_name), queue_type=self._queue_type)


class CheckedConsumer(_RabbitmqConsumer):
    """Dramatiq's RabbitMQ consumer, refusing every envelope the worker does not accept before Dramatiq
    reads it (``wire.check_run_message``; docs/messages.md, "Run queue: what a worker accepts").

    A refused message is republished, persistent, to the queue's ``.XQ`` twin with the header
    ``x-runbrake-dead-reason``, and then acked: it never reaches a worker thread and is never delivered
    again. When that republish is refused, the message is rejected without requeue instead, which the
    queue's ``x-dead-letter-*`` arguments route to the same twin. Both happen on the consumer's own thread,
    the one its connection belongs to (pika is not thread-safe).
    """

    broker: RunbrakeBroker
    queue_name: str
    channel: Any
    iterator: Iterator[tuple[Any, Any, bytes]]

    def __init__(self, broker: RunbrakeBroker, queue_name: str, prefetch: int, timeout: int) -> None:
        super().__init__(broker, queue_name, prefetch, timeout)  # type: ignore[no-untyped-call]
        self._actors = broker.actors_on(queue_name)
        self._dead_letters = xq_name(queue_name)
        try:
            self.channel.confirm_delivery()  # a dead letter is acked only once RabbitMQ has its copy
        except (pika.exceptions.AMQPConnectionError, pika.exceptions.AMQPChannelError) as exc:
            raise ConnectionClosed(exc) from None  # type: ignore[no-untyped-call] # as Dramatiq's own constructor does: the consumer restarts
        self.iterator = self._checked(self.iterator)
        broker.outage.back(queue_name)
        broker.consuming(queue_name).set()

    @property
    def consuming(self) -> bool:
        """Its channel is open: it is bound to the queue and takes deliveries."""
        return bool(self.connection.is_open and self.channel.is_open)

    def _checked(self, deliveries: Iterator[tuple[Any, Any, bytes]]) -> Iterator[tuple[Any, Any, bytes]]:
        """Pass on what the worker accepts; dead-letter the rest and pass on an idle tick instead."""
        for method, properties, body in deliveries:
            if method is None:
                yield method, properties, body
                continue
            try:
                check_run_message(body, queue=self.queue_name, actors=self._actors)
            except MalformedRunMessage as exc:
                reason = str(exc)
            except Exception as exc:
                # A bug in the check must not loop the consumer on one message (Dramatiq restarts a consumer
                # that raises, and the message comes back): the message is refused.
                log.exception("run_message_check_failed", queue=self.queue_name)
                reason = f"could not be checked: {exc!r}"[:300]
            else:
                yield method, properties, body
                continue
            self._dead_letter(method, body, reason)
            yield None, None, b""

    def _dead_letter(self, method: Any, body: bytes, reason: str) -> None:
        log.warning("run_message_malformed", queue=self.queue_name, reason=reason, size=len(body),
                    redelivered=method.redelivered)
        # None of the message's own properties are copied: a hostile header may not survive re-encoding.
        headers: dict[str, Any] = {DEAD_REASON_HEADER: reason}
        if len(body) > MAX_RUN_MESSAGE_BYTES:
            headers[DEAD_SIZE_HEADER] = len(body)
            body = body[:MAX_RUN_MESSAGE_BYTES]
        try:
            self.channel.basic_publish(
                exchange="", routing_key=self._dead_letters, body=body, mandatory=True,
                properties=pika.BasicProperties(delivery_mode=2, headers=headers),
            )
        except (pika.exceptions.UnroutableError, pika.exceptions.NackError) as exc:
            log.warning("run_message_dead_letter_failed", queue=self.queue_name, error=repr(exc)[:300])
            self.channel.basic_reject(method.delivery_tag, requeue=False)
            return
        self.channel.basic_ack(method.delivery_tag)


INTERRUPT_CHECK_S = 1.0
"""How often a worker thread waiting on its run's coroutine wakes to look for Dramatiq's Interrupt."""


class RunbrakeAsyncIO(AsyncIO):
    """Dramatiq's AsyncIO middleware, its worker threads waking once a second instead of ten times.

    A worker thread running an async actor waits on its coroutine in slices, to notice Dramatiq's
    Interrupt (shutdown, time limit). When each run held such a thread, hundreds of them waking ten times
    a second contended for the GIL with the event loop and the cancel listener. The run actor no longer
    waits that way (worker/intake.py); the middleware still runs the process's event loop
    (docs/pitfalls.md, "Pitfalls: the AsyncIO middleware").
    """

    def before_worker_boot(self, broker: Any, worker: Any) -> None:
        super().before_worker_boot(broker, worker)  # type: ignore[no-untyped-call]
        loop_thread = get_event_loop_thread()
        if loop_thread is not None:
            loop_thread.interrupt_check_ival = INTERRUPT_CHECK_S


def default_middleware() -> list[Middleware]:
    """AgeLimit and TimeLimit (used per actor), shutdown notices, no retries, AsyncIO for the run actor, and the
    current message (the run actor reads its ``traceparent`` option: worker/actors.py)."""
    return [AgeLimit(), TimeLimit(), ShutdownNotifications(), Retries(max_retries=0), RunbrakeAsyncIO(),
            CurrentMessage()]


def build_broker(settings: Settings) -> RunbrakeBroker:
    """The broker for this namespace. Connects lazily, on first use."""
    return RunbrakeBroker(settings)
