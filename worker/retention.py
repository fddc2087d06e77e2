"""Retention: a finished run's record is kept ``RUNBRAKE_RETENTION_S`` (7 days by default; 0 keeps it
forever), then deleted whole (docs/security.md, "How long records are kept").

The scripts that end a run (settle, cancel, reap) enter it into ``<ns>:finished`` at the time its
retention ends, and set the run's own keys to expire a little later. One :class:`Sweeper` thread per
worker process deletes what is due: the run's keys, its idempotency key and its entry in the index of
runs, together, so ``runbrake runs`` never lists a run whose record is gone; and the outbox's entries older than
the retention (docs/messaging.md, "The outbox"), exactly. Sweepers of several processes may delete the same
run: deleting is idempotent.
"""

from __future__ import annotations

import structlog

from runbrake.shared.errors import StoreError
from runbrake.shared.settings import Settings
from runbrake.shared.store import RunStore
from runbrake.worker.parts import Periodic

log = structlog.get_logger(__name__)

MAX_SWEEP_INTERVAL_S = 30.0


def sweep_interval_s(retention_s: float) -> float:
    """How often a sweeper deletes what is due: every half retention, from 0.5 s to 30 s. A finished run's
    record is therefore kept its retention and at most one interval more (each tick waits its interval after
    the one before, so the ticks of a process drift by their own duration)."""
    return min(MAX_SWEEP_INTERVAL_S, max(0.5, retention_s / 2))


class Sweeper(Periodic):
    """Deletes the finished runs whose retention ended, every few seconds (:func:`sweep_interval_s`)."""

    def __init__(self, settings: Settings, store: RunStore) -> None:
        super().__init__("runbrake-retention-sweeper", interval_s=sweep_interval_s(settings.retention_s),
                         enabled=settings.retention_s > 0)
        self._store = store
        self._retention_s = settings.retention_s

    def tick(self) -> None:
        self.sweep()

    def sweep(self) -> int:
        """Delete what is due now; a store outage is logged and tried again next time. Returns the count."""
        try:
            deleted = self._store.sweep_expired()
            # The outbox's entries of the same window, exactly: a run's events go with its record.
            self._store.trim_outbox(retention_s=self._retention_s)
        except StoreError as exc:
            log.warning("retention_sweep_failed", error=str(exc))
            return 0
        if deleted:
            log.info("runs_expired", count=len(deleted))
        return len(deleted)
