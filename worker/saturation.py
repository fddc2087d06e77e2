"""Admission by health: a worker process takes a new run only while it can serve the runs it holds
(docs/leases.md, "Capacity: runs in flight").

``--concurrency`` bounds the runs in flight by count, but what a run costs the process depends on what its
calls send back: 2,000 runs waiting on silent calls cost the loop nothing, 2,000 whose calls report progress
every second keep it half busy, and past that a cancel waits behind the notifications. So the intake also
asks a :class:`LoopWatch` before it takes a run: the event loop's lag (how late a callback scheduled from
another thread runs) over the last second, and the process's resident memory, each against a bound. Past a
bound the consumer thread holds its message for a while and then hands it back to the queue (the run stays
``queued`` for a worker with room), exactly as a full worker does. A process with fewer than
``RUNBRAKE_ADMIT_MIN_RUNS`` runs in flight always takes one: a lag it did not cause (a collection, a
neighbour on the machine) must not starve it.
"""

from __future__ import annotations

import asyncio
import collections
import os
import threading
import time
from collections.abc import Callable
from typing import Final

import structlog
from dramatiq.asyncio import get_event_loop_thread

from runbrake.worker import metrics
from runbrake.worker.parts import Periodic

log = structlog.get_logger(__name__)

INTERVAL_S: Final = 0.1
"""How often the watch schedules a probe on the loop."""
WINDOW: Final = 10
"""Probes kept: the lag is judged over the last second."""
_PAGE_BYTES: Final = os.sysconf("SC_PAGE_SIZE")


def running_loop() -> asyncio.AbstractEventLoop | None:
    """The process's event loop (the AsyncIO middleware's), None before it runs."""
    thread = get_event_loop_thread()
    return None if thread is None else thread.loop


def resident_bytes() -> int:
    """This process's resident set, in bytes (``/proc/self/statm``); 0 where there is no such file."""
    try:
        with open("/proc/self/statm", encoding="ascii") as statm:
            return int(statm.read().split()[1]) * _PAGE_BYTES
    except (OSError, ValueError, IndexError):
        return 0


class LoopWatch(Periodic):
    """Measures the event loop's lag every :data:`INTERVAL_S` and the process's RSS, and says whether the
    process may take another run (:meth:`admits`).

    A probe is a callback scheduled with ``call_soon_threadsafe`` that notes when it ran: its lag is that
    moment minus the moment it was scheduled, taken on the loop, so this thread's own scheduling does not
    count. A probe not run yet by the next tick counts as late by the time waited so far. The lag judged is
    the 90th percentile of the last :data:`WINDOW` probes: one slow callback does not close the gate, a
    loop that stays busy does.
    """

    def __init__(self, loop_getter: Callable[[], asyncio.AbstractEventLoop | None], *, concurrency: int,
                 max_lag_ms: float, max_rss_mb: int, min_runs: int) -> None:
        super().__init__("runbrake-loop-watch", interval_s=INTERVAL_S, enabled=max_lag_ms > 0 or max_rss_mb > 0)
        self._loop_getter = loop_getter
        self.concurrency = concurrency
        self.max_lag_s = max_lag_ms / 1000
        self.max_rss = max_rss_mb * 1024 * 1024
        self.min_runs = min_runs
        self._lags: collections.deque[float] = collections.deque(maxlen=WINDOW)
        self._pending: float | None = None
        """When the probe not yet run was scheduled (monotonic); None when it ran."""
        self._lock = threading.Lock()
        self._lag_s = 0.0
        self._rss = 0
        self._closed_by: str | None = None

    # -- the watch's thread --

    def tick(self) -> None:
        now = time.monotonic()
        with self._lock:
            pending = self._pending
        if pending is not None:  # the last probe has not run: the loop is at least this late
            self._lags.append(now - pending)
        else:
            loop = self._loop_getter()
            if loop is not None:
                with self._lock:
                    self._pending = now
                try:
                    loop.call_soon_threadsafe(self._ran, now)
                except RuntimeError:  # the loop closed: the process is stopping
                    with self._lock:
                        self._pending = None
        self._judge()

    def _ran(self, scheduled: float) -> None:
        """On the loop: the probe scheduled at ``scheduled`` ran now."""
        lag = time.monotonic() - scheduled
        with self._lock:
            self._pending = None
            self._lags.append(lag)

    def _judge(self) -> None:
        with self._lock:
            lags = sorted(self._lags)
        lag = lags[int(0.9 * (len(lags) - 1))] if lags else 0.0
        rss = resident_bytes() if self.max_rss else 0
        reason = None
        if self.max_lag_s and lag > self.max_lag_s:
            reason = f"event loop lag {lag * 1000:.1f} ms over {self.max_lag_s * 1000:g} ms"
        elif self.max_rss and rss > self.max_rss:
            reason = f"resident memory {rss / 2**20:.0f} MiB over {self.max_rss / 2**20:g} MiB"
        with self._lock:
            self._lag_s, self._rss = lag, rss
            opened, closed = self._closed_by is not None and reason is None, self._closed_by is None and reason
            self._closed_by = reason
        metrics.EVENT_LOOP_LAG.set(lag)
        if closed:
            log.warning("admission_paused", reason=reason)
        elif opened:
            log.info("admission_resumed", lag_ms=round(lag * 1000, 1))

    # -- any thread --

    def admits(self, in_flight: int) -> bool:
        """Whether a process with ``in_flight`` runs may take one more (below the floor, always)."""
        if in_flight < self.min_runs:
            return True
        with self._lock:
            return self._closed_by is None

    def saturation(self, in_flight: int) -> float:
        """How saturated the process is: 1.0 at a bound, the largest of its runs against ``--concurrency``,
        the loop's lag against its bound and the RSS against its bound (``runbrake_worker_saturation``)."""
        with self._lock:
            lag, rss = self._lag_s, self._rss
        parts = [in_flight / self.concurrency]
        if self.max_lag_s:
            parts.append(lag / self.max_lag_s)
        if self.max_rss:
            parts.append(rss / self.max_rss)
        return max(parts)

    def refusal(self) -> str:
        """Why the gate is closed, for the hand-back's message ("" when it is open)."""
        with self._lock:
            return self._closed_by or ""
