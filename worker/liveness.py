"""Liveness: each worker process says it is alive, and any other takes up the runs of one that stopped saying so
(docs/leases.md, "Lost workers").

One :class:`Liveness` thread per worker process, every ``RUNBRAKE_WORKER_BEAT_S``:

1. **beats**: one round trip (``BEAT``) pushes the process's entry in ``<ns>:workers`` to
   ``RUNBRAKE_WORKER_LOST_S`` after now, on Redis's clock. A plain thread with its own connection, off the event
   loop: a loop busy with thousands of runs cannot delay it, and it costs one round trip per process, not one per
   run. A beat refused means this process was taken as lost (it was paused, or cut off, past the bound): its runs
   are someone else's now, so it cuts off their calls (their writes are refused by the owner guard anyway) and
   goes on under a new id;
2. **sweeps**: ``LAPSE`` takes the processes whose entry expired (one taker each), and each of their running
   runs is taken up: the calls it had in flight recorded, back to ``queued`` and its message sent
   (worker/reclaim.py).

A sweeper that Redis failed takes nobody as lost until Redis has answered it for ``RUNBRAKE_WORKER_LOST_S``
again: during an outage no process could beat, so an entry that expired then says nothing about its process.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid
from collections.abc import Callable

import structlog

from runbrake.shared.catalog import Admission
from runbrake.shared.errors import PublishError, SpecError, StoreError
from runbrake.shared.settings import Settings
from runbrake.shared.spec import AGENT_SERVER, OnWorkerLost, RunSpec
from runbrake.shared.store import RunStore
from runbrake.worker import metrics
from runbrake.worker.conversation import ToolCall
from runbrake.worker.parts import Periodic
from runbrake.worker.reclaim import plan
from runbrake.worker.redrive import Sender
from runbrake.worker.registry import ActiveRuns

log = structlog.get_logger(__name__)

RECLAIM_TRIES = 3
"""How often a reclaim is read and tried again when the run moved between the read and the script."""


class WorkerIdentity:
    """This process's liveness id (``<host>:<pid>:<8 hex>``), stamped on each run it claims; a new one once the
    process was taken as lost."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._id = _new_id()

    @property
    def id(self) -> str:
        with self._lock:
            return self._id

    def renew(self) -> str:
        with self._lock:
            self._id = _new_id()
            return self._id


def _new_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class Liveness(Periodic):
    """Beats for this process and sweeps for lost ones, every ``RUNBRAKE_WORKER_BEAT_S``."""

    def __init__(self, settings: Settings, store: RunStore, registry: ActiveRuns, identity: WorkerIdentity, *,
                 sender: Sender | None, admission: Admission, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__("runbrake-liveness", interval_s=settings.worker_beat_s, tick_first=True)
        self._lost_s = settings.worker_lost_s
        self._max_losses = settings.max_worker_losses
        self._store = store
        self._registry = registry
        self._identity = identity
        self._sender = sender
        self._admission = admission
        """The catalog: what becomes of each cut-off call (``on_worker_lost``)."""
        self._clock = clock
        self._outage = False
        self._sweep_from: float | None = None
        """While set, no sweeping before this ``clock`` time (``RUNBRAKE_WORKER_LOST_S`` after Redis answered)."""

    def tick(self) -> None:
        try:
            alive = self._store.beat(self._identity.id, lost_s=self._lost_s)
        except StoreError as exc:
            log.warning("worker_beat_failed", error=str(exc))
            self._outage = True
            return
        if self._outage:
            self._outage = False
            self._sweep_from = self._clock() + self._lost_s
            log.warning("worker_sweep_paused", for_s=self._lost_s,
                        why="Redis answered again after an outage: nobody could beat during it")
        if not alive:
            self._taken_as_lost()
        if self._sweep_from is not None:
            if self._clock() < self._sweep_from:
                return
            self._sweep_from = None
        try:
            self.sweep()
        except StoreError as exc:
            log.warning("worker_sweep_failed", error=str(exc))
            self._outage = True

    def _stopped(self) -> None:
        try:
            self._store.leave(self._identity.id)
        except StoreError as exc:
            log.warning("worker_leave_failed", error=str(exc))

    def _taken_as_lost(self) -> None:
        """This process was taken as lost while it lived (paused or cut off past the bound): it beats under a new
        id, stops the runs other workers took from it (their calls cut off; nothing they write lands: the owner
        guard) and stamps the new id on any it still holds (claimed after the sweep read its runs)."""
        lost, new = self._identity.id, self._identity.renew()
        self._store.beat(new, lost_s=self._lost_s)
        owners = self._registry.owners()
        taken = self._store.restamp(owners, new)
        log.error("worker_taken_as_lost", worker=lost, new_worker=new, runs_taken=len(taken),
                  action="stopping the runs taken from it; their calls are cut off and nothing they write lands")
        for run_id in sorted(taken):
            # Only the segment that was taken: the run's message may have reached this process again meanwhile.
            self._registry.interrupt(run_id, lost=True, owner=owners[run_id])

    def sweep(self) -> int:
        """Take up the runs of every worker that stopped beating; returns how many runs were taken up."""
        lost = self._store.lapse()
        if not lost:
            return 0
        runs = self._store.runs_of_workers(lost)
        log.warning("workers_lost", workers=lost, runs=len(runs))
        return sum(self._reclaim(run_id, worker) for run_id, worker in sorted(runs.items()))

    def _policy(self, request_json: str) -> Callable[[ToolCall], OnWorkerLost]:
        """Each call's ``on_worker_lost``, from the catalog the run's servers come from (``report`` for a call of
        no server the run has, or when the spec is no longer admitted)."""
        try:
            servers = self._admission.admit(RunSpec.from_json(request_json)).servers
        except SpecError:
            return lambda _call: OnWorkerLost.REPORT

        def policy(call: ToolCall) -> OnWorkerLost:
            if call.server == AGENT_SERVER:
                return OnWorkerLost.RETRY  # made again, it finds the child it started (worker/agents.py)
            server = servers.get(call.server)
            return OnWorkerLost.REPORT if server is None else server.worker_lost_policy(call.tool)

        return policy

    def _reclaim(self, run_id: str, worker: str) -> bool:
        """Take up one run of the lost ``worker``: record its cut-off calls, queue it and send its message."""
        with structlog.contextvars.bound_contextvars(run_id=run_id):
            for _ in range(RECLAIM_TRIES):
                fields, steps = self._store.lost_view(run_id)
                try:
                    planned = plan(fields, steps, worker=worker, max_losses=self._max_losses,
                                   policy=self._policy(fields.get("request") or "{}"))
                except SpecError:  # admitted once, so never expected; its lease runs out and it is reaped
                    log.exception("run_reclaim_unreadable")
                    return False
                reclaimed = self._store.reclaim(run_id, worker=worker, seq=planned.seq, steps=planned.steps,
                                                fail=planned.fail, running=planned.running,
                                                pending=planned.pending, error=planned.error)
                if reclaimed.why != "moved":
                    break
            else:
                log.warning("run_reclaim_gave_up", worker=worker, why="the run kept moving")
                return False
            if reclaimed.outcome == "refused":
                return False
            log.warning("run_worker_lost", worker=worker, outcome=reclaimed.outcome, losses=reclaimed.losses,
                        cut_off_calls=sum(1 for s in planned.steps if s.tool_outcome is not None))
            if reclaimed.outcome != "requeued":
                return True
            metrics.RUNS_RECLAIMED.inc()
            if self._sender is not None:
                try:
                    self._sender.send(run_id)
                except PublishError as exc:  # the run waits in the unclaimed set: the re-drive sends it
                    log.warning("run_reclaim_message_failed", error=str(exc))
            return True
