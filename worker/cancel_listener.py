"""The cancel listener and the backstop: how a cancel reaches the call in flight
(docs/cancellation.md, "Cancellation: the interrupt").

One :class:`CancelListener` per worker process consumes the cancel fanout exchange
through an exclusive, server-named queue (pika, on its own thread and connection:
pika is not thread-safe). A message is only a wake-up; Redis is the authority, so the
listener acts only when the run's cancel key is set. The :class:`Backstop` reads the
cancel keys of all active runs in one MGET every poll interval and interrupts a run
whose cancel it has seen on two polls in a row: a message that is merely on its way is
given one interval to arrive, and a lost one delays a cancel by at most two intervals.
"""

from __future__ import annotations

import threading

import pika
import structlog
from pika.adapters.blocking_connection import BlockingChannel

from runbrake.shared import tracing
from runbrake.shared.messaging.wire import Topology, cancel_traceparent, decode_cancel, is_steer_wakeup
from runbrake.shared.settings import Settings
from runbrake.shared.store import RunStore
from runbrake.worker._consumer import ConsumerThread
from runbrake.worker.parts import Part, Periodic
from runbrake.worker.registry import ActiveRuns

log = structlog.get_logger(__name__)


class CancelListener(ConsumerThread):
    """Consumes cancel messages and interrupts the runs this process executes. Reconnects with backoff."""

    role = "cancel_listener"

    def __init__(
        self, settings: Settings, store: RunStore, registry: ActiveRuns, *, ready: threading.Event | None = None
    ) -> None:
        super().__init__(settings, ready=ready)
        self._store = store
        self._registry = registry

    def _consume(self, channel: BlockingChannel) -> str:
        queue = Topology.of(self._settings).bind_cancel_listener(channel)
        channel.basic_consume(queue=queue, on_message_callback=self._on_message, auto_ack=True)
        return queue

    def _on_message(self, _channel: object, _method: object, properties: pika.BasicProperties, body: bytes) -> None:
        run_id = decode_cancel(body)
        if run_id is None:
            log.warning("cancel_message_malformed", size=len(body), body=body[:200].decode(errors="replace"))
            return
        if is_steer_wakeup(body):
            if run_id in self._registry:
                self._steer(run_id)
            return
        # A run's wake-up reaches the runs below it in its agent tree too: a cancel fences the whole tree below
        # the run at once (shared/messaging/cancel.py), and one message wakes every worker holding a part of it.
        reached = self._registry.with_below(run_id)
        if not reached:
            return
        # The interrupt continues the canceller's trace (docs/operating.md, "Traces"); off, a no-op.
        with tracing.current().span("runbrake.cancel.interrupt", {"runbrake.run_id": run_id},
                                    parent=cancel_traceparent(properties), kind="consumer") as span:
            fenced = self._fenced(reached)
            if run_id in reached and run_id not in fenced:
                log.warning("cancel_message_without_fence", run_id=run_id)
                span.fail("no cancel key: a forged or stale wake-up")
            interrupted = self._registry.interrupt_tree([i for i in reached if i in fenced])
            span.set({"runbrake.cancel.interrupted": run_id in interrupted, "runbrake.cancel.below": len(reached) - 1})
        # One line for the runs below (a tree's wake-up reaches dozens): rendering each on this thread holds the
        # interpreter from the loop that records them.
        below = len(interrupted) - (run_id in interrupted)
        if run_id in interrupted:
            log.info("cancel_message_delivered", run_id=run_id, **({"below": below} if below else {}))
        elif below:
            log.info("cancel_message_delivered_below", run_id=run_id, below=below)

    def _fenced(self, run_ids: list[str]) -> set[str]:
        """Which of ``run_ids`` have their cancel key set: one read for the run alone, one MGET for a tree's."""
        if len(run_ids) == 1:
            return set(run_ids) if self._store.cancel_requested(run_ids[0]) else set()
        return self._store.wakeups_among(run_ids)[0]

    def _steer(self, run_id: str) -> None:
        """A steer's wake-up: deliver the run's stored steer (Redis is the authority, as for a cancel)."""
        steer = self._store.pending_steer(run_id)
        if steer is None:
            log.info("steer_message_without_steer", run_id=run_id)  # applied already, or forged
            return
        if self._registry.steer(run_id, steer):
            log.info("steer_message_delivered", run_id=run_id, steer_id=steer.id)

    def replacement(self) -> Part:
        """A new listener on the same ``ready`` event (readiness and the metrics gauge read that one)."""
        return CancelListener(self._settings, self._store, self._registry, ready=self.ready)


class Backstop(Periodic):
    """Every poll interval, one MGET over the active runs' cancel and steer keys; interrupts a run whose cancel
    it sees on two polls in a row (the first sighting leaves the message its chance to arrive), and delivers a
    steer it sees twice the same way."""

    def __init__(self, settings: Settings, store: RunStore, registry: ActiveRuns) -> None:
        super().__init__("runbrake-cancel-backstop", interval_s=settings.cancel_poll_ms / 1000)
        self._store = store
        self._registry = registry
        self._seen: set[str] = set()
        self._steers_seen: set[tuple[str, str]] = set()
        """(run id, steer id) of the steers pending at the last poll."""

    def tick(self) -> None:
        self.poll()

    def poll(self) -> None:
        """One MGET over this process's active runs; interrupt those cancelled since the last poll too."""
        run_ids = self._registry.run_ids()
        cancelled, steers = self._store.wakeups_among(run_ids)
        for run_id in cancelled & self._seen:
            if self._registry.interrupt(run_id):
                log.info("cancel_found_by_backstop", run_id=run_id)
        self._seen = cancelled
        pending = {(run_id, steer.id) for run_id, steer in steers.items()}
        for run_id, steer_id in pending & self._steers_seen:
            # Delivered again on every poll it stays pending: the registry ignores a steer already delivered.
            if self._registry.steer(run_id, steers[run_id]):
                log.info("steer_found_by_backstop", run_id=run_id, steer_id=steer_id)
        self._steers_seen = pending
