"""Leases: a claim on a run is good for ``RUNBRAKE_LEASE_S`` unless the worker holding it renews it.

One :class:`LeaseKeeper` thread per worker process, every third of a lease, renews the
leases of the runs this process executes (one round trip for all of them) and reaps the
runs whose lease expired: their worker stopped without a word (an OOM kill, SIGKILL, a
lost host), and any worker fails them with reason ``lease_lost``. Each reap is one
guarded script, so concurrent reapers never both win; expiry is decided on Redis's clock, and a
keeper that lost Redis reaps nothing until Redis has answered it for a lease again
(docs/leases.md, "Leases").
"""

from __future__ import annotations

import time
from collections.abc import Callable

import structlog

from runbrake.shared.errors import StoreError
from runbrake.shared.settings import Settings
from runbrake.shared.store import RunStore
from runbrake.worker.parts import Periodic
from runbrake.worker.registry import ActiveRuns

log = structlog.get_logger(__name__)


class LeaseKeeper(Periodic):
    """Renews this process's leases and reaps expired ones, every third of a lease.

    After Redis failed it, the keeper renews as usual but does not reap until Redis has answered it for
    a whole lease again (docs/leases.md, "Leases"): during an outage nobody could renew, so a
    lease that ran out then says nothing about its worker, and every worker still alive renews within a
    third of a lease of reaching Redis again. ``clock`` is monotonic seconds (tests pass their own).
    """

    def __init__(self, settings: Settings, store: RunStore, registry: ActiveRuns,
                 *, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__("runbrake-lease-keeper", interval_s=settings.lease_s / 3, tick_first=True)
        self._lease_s = settings.lease_s
        self._store = store
        self._registry = registry
        self._clock = clock
        self._outage = False
        """The last round trip failed: reaping waits for Redis to answer again."""
        self._reap_from: float | None = None
        """While set, no reaping before this ``clock`` time (a lease after Redis answered again)."""

    def tick(self) -> None:
        self.tend()

    @property
    def reaping(self) -> bool:
        """Whether this keeper reaps now (False during an outage and for a lease after it)."""
        if self._outage:
            return False
        if self._reap_from is not None and self._clock() >= self._reap_from:
            self._reap_from = None
            log.info("lease_reaping_resumed")
        return self._reap_from is None

    def tend(self) -> None:
        """Renew, then reap unless paused, once. A store outage is logged and tried again next time."""
        try:
            lost = self._renew()
            self._regained()
            if self.reaping:
                self._store.reap_expired()
        except StoreError as exc:
            log.warning("lease_upkeep_failed", error=str(exc))
            self._outage = True
            return
        lost = {run_id for run_id in lost if run_id in self._registry}
        if not lost:
            return
        owners = self._registry.owners()
        try:
            # A renewal is refused for a run that is no longer running: reaped or taken over, cancelled, or ended
            # by this very process between its read of the registry and the renewal. A cancelled one is
            # interrupted as a cancel, as its wake-up or the backstop would have; one still held under this
            # process's owner is left alone: only a run taken from it is cut off (issue 29: a live process never
            # interrupts its own runs for want of a renewal).
            cancelled = self._store.cancelled_among(lost)
            held = self._store.owners_of(lost)
        except StoreError:
            return
        for run_id in sorted(lost):
            if run_id in cancelled:
                if self._registry.interrupt(run_id):
                    log.info("cancel_found_by_lease_keeper", run_id=run_id)
                continue
            if held.get(run_id) == owners.get(run_id):
                continue
            # Reaped (this process looked dead) or taken over: the call in flight stops now and the run
            # makes no further call.
            log.warning("lease_not_renewed", run_id=run_id, action="interrupting the run")
            self._registry.interrupt(run_id, lost=True, owner=owners.get(run_id))

    def _renew(self) -> set[str]:
        """Renew this process's leases; with none, PING: either round trip tells whether Redis answers,
        which is what ends a pause (a keeper that skipped Redis could not see an outage)."""
        owners = self._registry.owners()
        if not owners:
            self._store.ping()
            return set()
        return self._store.renew_leases(owners, lease_s=self._lease_s)

    def _regained(self) -> None:
        """Redis answered: after an outage, grant every lease a full lease before reaping again."""
        if self._outage:
            self._outage = False
            self._reap_from = self._clock() + self._lease_s
            log.warning("lease_reaping_paused", for_s=self._lease_s,
                        why="Redis answered again after an outage: nobody could renew during it")
