"""Dramatiq's RabbitMQ broker, configured for long agent runs (docs/architecture.md, "Pitfalls").

- Publisher confirms on: ``enqueue`` returns only once RabbitMQ has the message.
- Queue names come from ``broker/wire.py``: ``<ns>.runs`` (plus Dramatiq's ``.DQ``/``.XQ`` twins).
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
"""

from __future__ import annotations

from typing import Any

from dramatiq.asyncio import get_event_loop_thread
from dramatiq.brokers.rabbitmq import DEAD_MESSAGE_TTL, RabbitmqBroker
from dramatiq.common import xq_name
from dramatiq.middleware import AgeLimit, AsyncIO, Middleware, Retries, ShutdownNotifications, TimeLimit

from runbrake.broker.wire import queue_type_arguments
from runbrake.shared.settings import Settings


class RunbrakeBroker(RabbitmqBroker):
    """A RabbitMQ broker whose run queue tolerates long-held messages."""

    def __init__(self, settings: Settings, *, middleware: list[Middleware] | None = None) -> None:
        super().__init__(
            url=settings.rabbitmq_url,
            confirm_delivery=True,
            middleware=middleware if middleware is not None else default_middleware(),
        )
        self._consumer_timeout_ms = (settings.run_time_limit_s + 300) * 1000
        self._type_arguments = queue_type_arguments(settings.queue_type)

    def _build_queue_arguments(self, queue_name: str) -> dict[str, Any]:
        arguments: dict[str, Any] = super()._build_queue_arguments(queue_name)  # type: ignore[no-untyped-call]
        arguments["x-consumer-timeout"] = self._consumer_timeout_ms
        arguments.update(self._type_arguments)
        return arguments

    def _declare_xq_queue(self, queue_name: str) -> Any:
        if not self._type_arguments:
            return super()._declare_xq_queue(queue_name)  # type: ignore[no-untyped-call]
        # Dramatiq's own declaration of the dead-letter twin, plus the queue type.
        return self.channel.queue_declare(
            queue=xq_name(queue_name), durable=True,
            arguments={"x-message-ttl": DEAD_MESSAGE_TTL, **self._type_arguments},
        )


INTERRUPT_CHECK_S = 1.0
"""How often a worker thread waiting on its run's coroutine wakes to look for Dramatiq's Interrupt."""


class RunbrakeAsyncIO(AsyncIO):
    """Dramatiq's AsyncIO middleware, its worker threads waking once a second instead of ten times.

    A worker thread running an async actor waits on its coroutine in slices, to notice Dramatiq's
    Interrupt (shutdown, time limit). When each run held such a thread, hundreds of them waking ten times
    a second contended for the GIL with the event loop and the cancel listener. The run actor no longer
    waits that way (worker/intake.py); the middleware still runs the process's event loop
    (docs/architecture.md, "Pitfalls: the AsyncIO middleware").
    """

    def before_worker_boot(self, broker: Any, worker: Any) -> None:
        super().before_worker_boot(broker, worker)  # type: ignore[no-untyped-call]
        loop_thread = get_event_loop_thread()
        if loop_thread is not None:
            loop_thread.interrupt_check_ival = INTERRUPT_CHECK_S


def default_middleware() -> list[Middleware]:
    """AgeLimit and TimeLimit (used per actor), shutdown notices, no retries, AsyncIO for the run actor."""
    return [AgeLimit(), TimeLimit(), ShutdownNotifications(), Retries(max_retries=0), RunbrakeAsyncIO()]


def build_broker(settings: Settings) -> RunbrakeBroker:
    """The broker for this namespace. Connects lazily, on first use."""
    return RunbrakeBroker(settings)
