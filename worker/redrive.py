"""Re-drive: a run is never left waiting for a message that was lost (docs/leases.md, "Re-drive").

A run message can be lost after the run was written: a purged queue, a broker that lost a
non-replicated queue, a publish that RabbitMQ confirmed and then dropped. The run's durability lives
in Redis, so Redis also says which runs nobody claimed: ``<ns>:unclaimed`` holds every queued run (and
every approved run waiting for its resume) with the time its message was sent. One :class:`Redriver`
per worker process re-sends the message of each run left unclaimed longer than
``RUNBRAKE_REDRIVE_S``; a script takes each re-drive, so one worker re-sends it once per interval, and
a duplicate message is harmless anyway because the claim is guarded.
"""

from __future__ import annotations

from typing import Protocol

import structlog

from runbrake.shared.errors import PublishError, StoreError
from runbrake.shared.settings import Settings
from runbrake.shared.store import RunStore
from runbrake.worker import metrics
from runbrake.worker.parts import Periodic

log = structlog.get_logger(__name__)


class Sender(Protocol):
    def send(self, run_id: str, *, resume: bool = False) -> None: ...


class Redriver(Periodic):
    """Every quarter of ``RUNBRAKE_REDRIVE_S`` (at least a second), re-sends the messages of runs nobody
    claimed within ``RUNBRAKE_REDRIVE_S``."""

    def __init__(self, settings: Settings, store: RunStore, sender: Sender) -> None:
        super().__init__("runbrake-redriver", interval_s=max(1.0, settings.redrive_s / 4))
        self._after_s = settings.redrive_s
        self._store = store
        self._sender = sender

    def tick(self) -> None:
        self.redrive()

    def redrive(self) -> int:
        """Re-send what is due now; returns how many. A store or broker outage is logged, tried again later."""
        try:
            due = self._store.redrive_due(older_than_s=self._after_s)
        except StoreError as exc:
            log.warning("redrive_failed", error=str(exc))
            return 0
        sent = 0
        for run_id, resume in due:
            try:
                self._sender.send(run_id, resume=resume)
            except PublishError as exc:
                log.warning("redrive_failed", run_id=run_id, error=str(exc))
                continue
            sent += 1
            metrics.RUNS_REDRIVEN.inc()
            log.warning("run_redriven", run_id=run_id, resume=resume, unclaimed_for_s=self._after_s)
        return sent
