"""A RabbitMQ consumer on a thread and connection of its own (pika is not thread-safe), that connects,
consumes, and starts over with backoff whatever happens, until it is stopped.

The cancel listener (``worker/cancel_listener.py``) and the cancel-request consumer
(``worker/cancel_requests.py``) are both this loop with their own queue and message handler.
"""

from __future__ import annotations

import contextlib
import os
import threading

import pika
import pika.exceptions
import structlog
from pika.adapters.blocking_connection import BlockingChannel

from runbrake.shared.messaging.wire import connection_parameters
from runbrake.shared.settings import Settings
from runbrake.worker.parts import Health, PartThread

log = structlog.get_logger(__name__)

_FIRST_BACKOFF_S = 0.2
_MAX_BACKOFF_S = 10.0


class ConsumerThread(PartThread):
    """Subclasses say what to consume (:meth:`_consume`) and what they are called (``role``)."""

    role: str
    """Names the thread, the connection and the log events: ``<role>_connected`` and the like."""

    def __init__(self, settings: Settings, *, ready: threading.Event | None = None) -> None:
        super().__init__(f"runbrake-{self.role.replace('_', '-')}")
        self._settings = settings
        self._connection: pika.BlockingConnection | None = None
        self._channel: BlockingChannel | None = None
        self.ready = threading.Event() if ready is None else ready
        """Set while the queue is bound and consumed."""

    def _consume(self, channel: BlockingChannel) -> str:
        """Declare and bind what this consumer reads, start consuming it; returns the queue's name."""
        raise NotImplementedError

    def _stopped(self) -> None:
        """Called once, on this thread, after the last connection closed."""

    def _keep_alive(self) -> float | None:
        """Service the other connections this thread publishes on, while it waits for messages (their
        heartbeats: issue 30); returns how long until the next call, or None when there are none. The consumed
        connection itself is serviced by ``start_consuming``."""
        return None

    def _schedule_keep_alive(self) -> None:
        connection = self._connection
        if connection is None or not connection.is_open:
            return
        interval = self._keep_alive()
        if interval is not None:
            connection.call_later(interval, self._schedule_keep_alive)  # runs on this thread, in start_consuming

    def run(self) -> None:
        backoff = _FIRST_BACKOFF_S
        connected = True  # until the first attempt says otherwise: a failed first connect is reported too
        while not self._stopping.is_set():
            try:
                self._connection = pika.BlockingConnection(self._parameters())
                channel = self._channel = self._connection.channel()
                queue = self._consume(channel)
                log.info(f"{self.role}_connected", queue=queue, node=_node(self._connection))
                backoff, connected = _FIRST_BACKOFF_S, True
                self.ready.set()
                self._schedule_keep_alive()
                channel.start_consuming()
            except pika.exceptions.AMQPError as exc:
                self.ready.clear()
                if self._stopping.is_set():
                    break
                # One line when the connection is lost, one (``_connected``) when it is back: not one per
                # attempt in between (issue 21; docs/operating.md, "A RabbitMQ cluster").
                report = log.warning if connected else log.debug
                report(f"{self.role}_disconnected", error=repr(exc)[:300], retry_in_s=backoff)
                connected = False
                self._stopping.wait(backoff)
                backoff = min(backoff * 2, _MAX_BACKOFF_S)
            except Exception:
                # Nothing a message carries should get here (bodies are bounded and decoded defensively);
                # if something does, the consumer starts over rather than stop for good.
                log.exception(f"{self.role}_crashed", retry_in_s=backoff)
                self._stopping.wait(backoff)
                backoff = min(backoff * 2, _MAX_BACKOFF_S)
            finally:
                self.ready.clear()
                self._close()
        self._stopped()
        log.info(f"{self.role}_stopped")

    def _parameters(self) -> list[pika.URLParameters]:
        # A name operators (and tests) can find in `rabbitmqctl list_connections client_properties`.
        return connection_parameters(
            self._settings, name=f"runbrake-{self.role.replace('_', '-')} {self._settings.namespace} pid={os.getpid()}")

    def stop(self) -> None:
        """Stop consuming and close the connection; safe from any thread."""
        super().stop()
        connection = self._connection
        if connection is not None and connection.is_open:
            with contextlib.suppress(pika.exceptions.AMQPError):  # the only pika call that may cross threads
                connection.add_callback_threadsafe(self._stop_consuming)

    def health(self) -> Health:
        if not self.is_alive():
            return Health(False, "not running")
        return Health(True, "bound and consuming" if self.ready.is_set() else "connecting or reconnecting")

    def _stop_consuming(self) -> None:
        if self._channel is not None and self._channel.is_open:
            self._channel.stop_consuming()

    def _close(self) -> None:
        connection, self._connection, self._channel = self._connection, None, None
        if connection is not None and connection.is_open:
            with contextlib.suppress(pika.exceptions.AMQPError):
                connection.close()


def _node(connection: pika.BlockingConnection) -> str:
    """``host:port`` of the node a connection reached (of the several ``RUNBRAKE_RABBITMQ_URL`` may name)."""
    parameters = getattr(getattr(connection, "_impl", None), "params", None)
    return f"{getattr(parameters, 'host', '?')}:{getattr(parameters, 'port', '?')}"
