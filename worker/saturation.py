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

A lag bound alone reacts late: the loop's lag stays near zero until the loop is nearly always busy, and then it
grows by hundreds of milliseconds within seconds (docs/benchmarks.md, "Saturation (`bench/saturation.py`)":
1,257 runs admitted at 2,000 offered before a 50 ms bound closed the gate, and the cancels amid them took
0.4-0.9 s). So two things act before the lag shows. The process's **CPU** (the share of one core it used over
the last second, plus the time its threads waited for a core the machine gave to others: :func:`cpu_demand_s`;
it grows in proportion to the runs held) is projected to one run more, and a run that would take it past
``RUNBRAKE_ADMIT_MAX_CPU_PCT`` is refused. And new runs are taken at a **rate** (:class:`Ramp`) that grows like
TCP's slow start while the loop answers promptly and is halved, with a second without admissions, as soon as the
lag rises past a quarter of its bound, before it reaches it.

A collection holds every thread of the process, the cancel listener's with the loop's, and its pause grows with the
runs held: while one of the last :data:`PAUSE_WINDOW_S` passed ``RUNBRAKE_ADMIT_MAX_PAUSE_MS`` (:class:`Pauses`,
noted by worker/intake.py) no run is taken either.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
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


def cpu_demand_s() -> float:
    """The CPU time this process's threads have used so far, plus the time they waited, runnable, for a CPU
    the machine gave to others, in seconds (``/proc/self/task/*/schedstat``: run and run-queue wait, in ns).
    On a quiet machine the wait is nil and this is the CPU used; on a busy one it is what the process asked
    for, which its CPU alone understates. Where there is no such file: the CPU used (``time.process_time``)."""
    total_ns = 0
    try:
        for task in os.scandir("/proc/self/task"):
            with contextlib.suppress(OSError, ValueError, IndexError):  # a thread that ended meanwhile
                with open(f"{task.path}/schedstat", encoding="ascii") as stat:
                    run_ns, wait_ns = stat.read().split()[:2]
                total_ns += int(run_ns) + int(wait_ns)
    except OSError:
        return time.process_time()
    return total_ns / 1e9 if total_ns else time.process_time()


PAUSE_WINDOW_S: Final = 5.0
"""The collections whose longest pause admission judges: those of the last 5 s (ten of the timer's)."""


class Pauses:
    """The collector's recent pauses (worker/intake.py notes each one, from whichever thread collected), for
    admission: a collection holds every thread of the process, the cancel listener's and the loop's."""

    def __init__(self) -> None:
        self._pauses: collections.deque[tuple[float, float]] = collections.deque(maxlen=1_000)
        """(when it ended, monotonic; how long it held the process, s)."""

    def note(self, pause_s: float) -> None:
        self._pauses.append((time.monotonic(), pause_s))

    def longest(self, window_s: float = PAUSE_WINDOW_S) -> float:
        """The longest pause of the last ``window_s`` seconds, 0 without one."""
        since = time.monotonic() - window_s
        return max((pause for ended, pause in list(self._pauses) if ended >= since), default=0.0)


PAUSES: Final = Pauses()
"""This process's collections' pauses."""


ROUND: Final = 10
"""Ticks per round: the admission rate and the CPU are judged once a second."""
FIRST_RATE: Final = 8
"""Runs a second a process may take at first (past the floor) and by which the rate grows past its threshold."""
MOST_RATE: Final = 1_024
"""The fastest the rate grows: far above what the consumer threads claim in a second (bench/throughput.py)."""
SOFT_LAG_SHARE: Final = 0.25
"""A lag past this share of ``RUNBRAKE_ADMIT_MAX_LAG_MS`` that grew since the last round halves the rate."""


class Ramp:
    """How many runs the process may take in the current round (one second), grown and cut as TCP grows and
    cuts its congestion window (RFC 5681): doubled each healthy round below a threshold (slow start), by
    :data:`FIRST_RATE` a round above it; halved, the threshold with it, when the loop's lag rises. A round
    that used less than half its allowance does not grow it (RFC 7661): a rate nobody used says nothing about
    what the loop can take. Touched under :class:`LoopWatch`'s lock."""

    def __init__(self) -> None:
        self.rate = FIRST_RATE
        self.threshold = MOST_RATE
        self.left = FIRST_RATE
        self.taken = 0
        """Runs taken this round."""

    def next_round(self, *, grow: bool, cut: bool) -> None:
        """Start a round: cut (and take nothing this round), grow when the last round used its rate, or keep."""
        used, self.taken = self.taken, 0
        if cut:
            self.threshold = max(self.rate // 2, FIRST_RATE)
            self.rate = self.threshold
            self.left = 0
            return
        if grow and 2 * used >= self.rate:
            self.rate = min(self.rate * 2 if self.rate < self.threshold else self.rate + FIRST_RATE, MOST_RATE)
        self.left = self.rate

    def take(self) -> bool:
        """Count one run taken; False when this round's allowance is spent."""
        if self.left <= 0:
            return False
        self.left -= 1
        self.taken += 1
        return True


class LoopWatch(Periodic):
    """Measures the event loop's lag every :data:`INTERVAL_S`, and the process's CPU and RSS, and says
    whether the process may take another run (:meth:`admits`).

    A probe is a callback scheduled with ``call_soon_threadsafe`` that notes when it ran: its lag is that
    moment minus the moment it was scheduled, taken on the loop, so this thread's own scheduling does not
    count. A probe not run yet by the next tick counts as late by the time waited so far. The lag judged is
    the 90th percentile of the last :data:`WINDOW` probes: one slow callback does not close the gate, a
    loop that stays busy does. Every :data:`ROUND` ticks the rate (:class:`Ramp`) and the CPU per run in
    flight are judged again.
    """

    def __init__(self, loop_getter: Callable[[], asyncio.AbstractEventLoop | None], *, concurrency: int,
                 max_lag_ms: float, max_rss_mb: int, min_runs: int, max_cpu_pct: float,
                 in_flight: Callable[[], int], max_pause_ms: float = 0.0, pauses: Pauses = PAUSES) -> None:
        self.watching = max_lag_ms > 0 or max_rss_mb > 0 or max_cpu_pct > 0 or max_pause_ms > 0
        """False: no bound is set, this thread never runs, and every run is admitted."""
        super().__init__("runbrake-loop-watch", interval_s=INTERVAL_S, enabled=self.watching)
        self._loop_getter = loop_getter
        self._in_flight = in_flight
        self.concurrency = concurrency
        self.max_lag_s = max_lag_ms / 1000
        self.max_rss = max_rss_mb * 1024 * 1024
        self.max_cpu = max_cpu_pct / 100
        self.max_pause_s = max_pause_ms / 1000
        self._pauses = pauses
        self._pause_s = 0.0
        """The longest collection's pause of the last :data:`PAUSE_WINDOW_S`, as last judged."""
        self.min_runs = min_runs
        self._lags: collections.deque[float] = collections.deque(maxlen=WINDOW)
        self._pending: float | None = None
        """When the probe not yet run was scheduled (monotonic); None when it ran."""
        self._lock = threading.Lock()
        self._lag_s = 0.0
        self._rss = 0
        self._closed_by: str | None = None
        self._refused = ""
        """Why :meth:`admits` last said no, for the hand-back's message."""
        self._ramp = Ramp()
        self._ticks = 0
        self._round_lag_s = 0.0
        self._round_at = (time.monotonic(), cpu_demand_s())
        self._cpu = 0.0
        """The share of one core the process used, or waited for, over the last round (:func:`cpu_demand_s`)."""
        self._cpu_per_run = 1.0
        """What one run more is expected to cost: that share divided by the runs in flight at the round's end
        (a whole core until the first round)."""

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
        self._ticks += 1
        if self._ticks % ROUND == 0:
            self._next_round()

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
        pause = self._pauses.longest() if self.max_pause_s else 0.0
        reason = None
        if self.max_lag_s and lag > self.max_lag_s:
            reason = f"event loop lag {lag * 1000:.1f} ms over {self.max_lag_s * 1000:g} ms"
        elif self.max_rss and rss > self.max_rss:
            reason = f"resident memory {rss / 2**20:.0f} MiB over {self.max_rss / 2**20:g} MiB"
        elif self.max_pause_s and pause > self.max_pause_s:
            reason = (f"a collection paused the process {pause * 1000:.1f} ms within {PAUSE_WINDOW_S:g} s, over "
                      f"{self.max_pause_s * 1000:g} ms")
        with self._lock:
            self._lag_s, self._rss, self._pause_s = lag, rss, pause
            opened, closed = self._closed_by is not None and reason is None, self._closed_by is None and reason
            self._closed_by = reason
        metrics.EVENT_LOOP_LAG.set(lag)
        if closed:
            log.info("admission_paused", reason=reason)  # the bound doing its work, as at every saturation
        elif opened:
            log.info("admission_resumed", lag_ms=round(lag * 1000, 1))

    def _next_round(self) -> None:
        """Once a second: the CPU used since the last round and the rate for the next."""
        now, cpu_now = time.monotonic(), cpu_demand_s()
        in_flight = self._in_flight()
        with self._lock:
            then, cpu_then = self._round_at
            self._round_at = (now, cpu_now)
            self._cpu = max(cpu_now - cpu_then, 0.0) / max(now - then, 1e-3)  # < 0: a busy thread ended
            # With no run in flight the whole process's CPU is one run's: an estimate too high, never too low.
            self._cpu_per_run = self._cpu / max(in_flight, 1)
            lag, last = self._lag_s, self._round_lag_s
            self._round_lag_s = lag
            soft = self.max_lag_s * SOFT_LAG_SHARE
            rising = bool(self.max_lag_s) and lag > soft and lag > last
            self._ramp.next_round(cut=self._closed_by is not None or rising, grow=not self.max_lag_s or lag <= soft)
            rate = self._ramp.rate
        metrics.ADMISSION_RATE.set(rate)
        if rising:
            log.info("admission_rate_cut", lag_ms=round(lag * 1000, 1), rate=rate)

    # -- any thread --

    def admits(self, in_flight: int) -> bool:
        """Whether a process with ``in_flight`` runs may take one more (below the floor, always); a yes counts
        against this round's rate, so ask only to take the run."""
        if in_flight < self.min_runs or not self.watching:
            return True
        with self._lock:
            self._refused = self._refusal(in_flight)
            return not self._refused and self._ramp.take()

    def _refusal(self, in_flight: int) -> str:
        if self._closed_by is not None:
            return self._closed_by
        projected = (in_flight + 1) * self._cpu_per_run
        if self.max_cpu and projected > self.max_cpu:
            return (f"CPU {self._cpu:.0%} of a core used or waited for, {projected:.0%} projected with one run "
                    f"more, over {self.max_cpu:.0%}")
        if self._ramp.left <= 0:
            return f"admission rate: {self._ramp.rate} runs this second taken"
        return ""

    def saturation(self) -> float:
        """How saturated the process is: 1.0 at a bound, the largest of its runs against ``--concurrency``,
        the loop's lag against its bound, its CPU, RSS and collections' pauses against theirs
        (``runbrake_worker_saturation``)."""
        in_flight = self._in_flight()
        with self._lock:
            lag, rss, cpu, pause = self._lag_s, self._rss, self._cpu, self._pause_s
        parts = [in_flight / self.concurrency]
        if self.max_pause_s:
            parts.append(pause / self.max_pause_s)
        if self.max_lag_s:
            parts.append(lag / self.max_lag_s)
        if self.max_rss:
            parts.append(rss / self.max_rss)
        if self.max_cpu:
            parts.append(cpu / self.max_cpu)
        return max(parts)

    def refusal(self) -> str:
        """Why the last run was refused, for the hand-back's message ("" when it was admitted)."""
        with self._lock:
            return self._refused
