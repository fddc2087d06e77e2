"""What the event relay (worker/relay.py) and the webhook dispatcher (worker/webhooks.py) share: a part thread
that reads the outbox through a consumer group of its own (docs/messaging.md, "The outbox") while it holds
that group's lease, so that one reader of all a namespace's processes works at a time and entries go out in the
outbox's order; the others stand by. An outage (Redis, or what the reader feeds) is logged once at warning,
its retries at debug with a doubling backoff, until ``<event>_resumed``.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
import uuid
from typing import Any, ClassVar, Final

import structlog

from runbrake.shared.errors import StoreError
from runbrake.shared.records import OutboxEntry
from runbrake.shared.store import OutboxCursor
from runbrake.worker.parts import PartThread

log = structlog.get_logger(__name__)

LEASE_S: Final = 10.0
"""How long the working reader's lease lasts unrenewed: a reader that died is replaced after this."""
RENEW_S: Final = LEASE_S / 3
"""How often the working reader renews its lease and looks for entries handed out and never acknowledged:
between renewals it holds the lease for sure, and a round costs the read and the acknowledgement alone."""
_FIRST_BACKOFF_S: Final = 0.2
_MAX_BACKOFF_S: Final = 5.0


def consumer_name() -> str:
    """A name for one part of one process in an outbox's consumer group and in its lease: the host, the pid
    and a random suffix (a restarted process is a new consumer)."""
    host = "".join(c if c.isalnum() or c in "-." else "-" for c in socket.gethostname())[:60]
    return f"{host}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


class OutboxReader(PartThread):
    """Runs :meth:`_work` round after round while this reader holds its group's lease.

    Subclasses name their log events (``event``: ``<event>_interrupted``, ``_resumed``, ``_crashed``,
    ``_stopped``, and ``<event>_<working>`` / ``<event>_standing_by`` when the lease changes hands) and the
    exceptions that stand for an outage rather than a fault (``outages``).
    """

    event: ClassVar[str]
    working: ClassVar[str]
    """The word of the lease's holder in its log event (``leading``, ``delivering``)."""
    unread: ClassVar[str]
    """What entries trimmed before this reader took them missed (``<event>_events_trimmed_<unread>``)."""
    outages: ClassVar[tuple[type[Exception], ...]] = (StoreError,)

    def __init__(self, thread_name: str, cursor: OutboxCursor) -> None:
        super().__init__(thread_name)
        self._cursor = cursor
        self.name_in_group = consumer_name()
        """This reader's consumer name in the group, and its name in the lease."""
        self.leading = False
        """Whether this reader held the lease at its last round (it works)."""
        self._renewed_at = 0.0
        """When the lease was last renewed (monotonic; taken before the renewal was sent)."""
        self._take_over = True
        """Whether the next round looks for entries handed out and not acknowledged (after the lease was taken
        or renewed, and while such entries remain)."""
        self.done: list[OutboxEntry] = []
        """Entries this reader is done with (published, queued), acknowledged with the next round's read in one
        round trip, or at once when the lease is lost or the reader stops (:meth:`_acknowledge_done`)."""

    def run(self) -> None:
        backoff = _FIRST_BACKOFF_S
        groups_made = False
        try:
            self._open()
            while not self._stopping.is_set():
                try:
                    if not groups_made:
                        self._cursor.make_groups()
                        groups_made = True
                    if self._holds_lease():
                        self._work()
                    else:
                        self._stopping.wait(RENEW_S)
                    if backoff > _FIRST_BACKOFF_S:
                        log.info(f"{self.event}_resumed")
                    backoff = _FIRST_BACKOFF_S
                except Exception as exc:
                    self.leading = False
                    self._interrupted()
                    if self._stopping.is_set():
                        break
                    if isinstance(exc, self.outages):
                        # Once per outage at warning (docs/operating.md, "A RabbitMQ cluster": a few lines, not one
                        # per attempt); the attempts after it at debug, until <event>_resumed.
                        (log.warning if backoff == _FIRST_BACKOFF_S else log.debug)(
                            f"{self.event}_interrupted", error=str(exc) or repr(exc), retry_in_s=backoff)
                    else:
                        # Nothing an entry holds should get here (entries are decoded defensively); if something
                        # does, the reader starts over rather than stop for good.
                        log.exception(f"{self.event}_crashed", retry_in_s=backoff)
                    self._stopping.wait(backoff)
                    backoff = min(backoff * 2, _MAX_BACKOFF_S)
        finally:
            self._interrupted()
            self._close()
            with contextlib.suppress(StoreError):
                self._acknowledge_done()
                self._cursor.release(self.name_in_group)
            log.info(f"{self.event}_stopped", **self._totals())

    def _holds_lease(self) -> bool:
        """Whether this reader works this round: renewed every :data:`RENEW_S` only."""
        if self.leading and time.monotonic() < self._renewed_at + RENEW_S:
            return True
        return self._renew()

    def _renew(self) -> bool:
        """Take or renew the lease; answers whether this reader works (and logs when that changed)."""
        asked_at = time.monotonic()
        leading = self._cursor.lease(self.name_in_group, lease_s=LEASE_S)
        if leading:
            self._renewed_at, self._take_over = asked_at, True
        if not leading:
            # What this reader published is acknowledged now, not left for the next holder to publish again.
            self._acknowledge_done()
        if leading != self.leading:
            log.info(f"{self.event}_{self.working}" if leading else f"{self.event}_standing_by",
                     reader=self.name_in_group)
            self.leading = leading
        return leading

    def _next_entries(self, *, count: int, block_ms: int | None) -> list[OutboxEntry]:
        """The group's entries handed out and never acknowledged (a dead reader's, or this one's before a
        failure), oldest first, looked for after each renewal of the lease until none is left; else the next
        new ones, waiting up to ``block_ms`` on a single Redis."""
        if self._take_over:
            self._acknowledge_done()
            entries, trimmed = self._cursor.pending(self.name_in_group, count=count)
            if trimmed:
                log.error(f"{self.event}_events_trimmed_{self.unread}", events=trimmed,
                          cause="older than RUNBRAKE_RETENTION_S before the reader took them")
            if entries:
                return entries
            self._take_over = False
        entries = self._cursor.new(self.name_in_group, count=count, block_ms=block_ms, done=self.done)
        self.done = []
        return entries

    def _acknowledge_done(self) -> None:
        """Acknowledge :attr:`done` now (a failure leaves it for the next try: acknowledging is idempotent)."""
        if self.done:
            self._cursor.ack(self.done)
            self.done = []

    def _work(self) -> None:
        """One round of work, while this reader holds the lease."""
        raise NotImplementedError

    def _open(self) -> None:
        """Before the first round (in the thread)."""

    def _interrupted(self) -> None:
        """After a round failed, and when the reader stops: drop what the failure may have broken."""

    def _close(self) -> None:
        """When the reader stops (in the thread)."""

    def _totals(self) -> dict[str, Any]:
        """What ``<event>_stopped`` logs."""
        return {}
