"""Leases: a claim on a run is good for ``RUNBRAKE_LEASE_S`` unless the worker holding it renews it.

One :class:`LeaseKeeper` thread per worker process, every third of a lease, renews the
leases of the runs this process executes (one round trip for all of them) and reaps the
runs whose lease expired: their worker stopped without a word (an OOM kill, SIGKILL, a
lost host), and any worker fails them with reason ``lease_lost``. Each reap is one
guarded script, so concurrent reapers never both win (docs/architecture.md, "Leases").
"""

from __future__ import annotations

import threading

import structlog

from runbrake.shared.errors import StoreError
from runbrake.shared.settings import Settings
from runbrake.shared.store import RunStore
from runbrake.worker.registry import ActiveRuns

log = structlog.get_logger(__name__)


class LeaseKeeper(threading.Thread):
    """Renews this process's leases and reaps expired ones, every third of a lease."""

    def __init__(self, settings: Settings, store: RunStore, registry: ActiveRuns) -> None:
        super().__init__(name="runbrake-lease-keeper", daemon=True)
        self._lease_s = settings.lease_s
        self._store = store
        self._registry = registry
        self._stopping = threading.Event()

    def run(self) -> None:
        while True:
            self.tend()
            if self._stopping.wait(self._lease_s / 3):
                return

    def tend(self) -> None:
        """Renew, then reap, once. A store outage is logged and tried again next time."""
        try:
            lost = self._store.renew_leases(self._registry.owners(), lease_s=self._lease_s)
            self._store.reap_expired()
        except StoreError as exc:
            log.warning("lease_upkeep_failed", error=str(exc))
            return
        for run_id in lost:
            if run_id in self._registry:
                # Reaped (this process looked dead) or taken over: the call in flight stops now and the run
                # makes no further call. (A cancelled run is interrupted by its cancel; if this comes
                # first, the cancelled call's step is still recorded: its owner is unchanged.)
                log.warning("lease_not_renewed", run_id=run_id, action="interrupting the run")
                self._registry.interrupt(run_id, lost=True)

    def stop(self) -> None:
        self._stopping.set()
