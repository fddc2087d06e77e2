"""How a worker process takes runs: a few Dramatiq consumer threads feeding many runs on the one event loop
(docs/leases.md, "Capacity: runs in flight").

A run spends nearly all its life awaiting a model or an MCP server, so holding a thread for each run
in flight (each blocked on its coroutine) buys nothing and costs a stack, a wake-up a second and a share
of the GIL. Instead a message goes through three steps on one of a handful of consumer threads:

1. take a **slot** (:class:`Slots`): wait while ``--concurrency`` runs are in flight. A consumer thread
   waiting here holds its message unacked, so RabbitMQ's prefetch (one message per consumer thread)
   bounds what a full worker holds back from the queue; and it holds it for :data:`SLOT_WAIT_S` at most,
   then hands it back (:class:`HandBack`, through Dramatiq's delay queue) for a worker with room;
2. start the run's segment on the loop and wait only until its **claim is decided**: a store outage at
   claim raises here, on the thread, so Dramatiq retries the message (``worker/actors.py``,
   ``retry_store_outages``); a refused claim (a duplicate, a cancelled or unknown run) is a no-op;
3. return: Dramatiq acks the message while the segment goes on on the loop. The slot is given back
   when the segment ends.

Dramatiq's threads are watched (:class:`_WatchedWorker`): one that dies, whatever killed it, is replaced and
counted (``runbrake_consumer_restarts_total``), and :meth:`Intake.consumer_status` tells readiness whether
the process still takes messages (worker/health.py). What a message may say is checked before any of this,
in the broker's consumer (``shared/messaging/rabbitmq.py``, ``CheckedConsumer``).

Acking early changes nothing a run relies on: its durability lives in Redis, a claimed run is never run
again (the claim guard refuses a second message), a killed worker's run is failed ``lease_lost`` by
another worker's lease keeper, and the runtime's own time limit (``RUNBRAKE_RUN_TIME_LIMIT_S``) bounds a
segment, since Dramatiq's time limit and shutdown notices only reach a thread that still runs the actor.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import gc
import sys
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import structlog
from dramatiq import Broker, Retry, Worker
from dramatiq.asyncio import get_event_loop_thread
from dramatiq.common import q_name
from dramatiq.worker import ConsumerThread, WorkerThread

from runbrake.shared.errors import RunbrakeError
from runbrake.worker import metrics
from runbrake.worker.parts import Periodic
from runbrake.worker.runtime import Runtime
from runbrake.worker.saturation import PAUSES, LoopWatch

log = structlog.get_logger(__name__)

CONSUMER_THREADS = 4
"""Dramatiq worker threads per process: each only waits for a slot and a claim (milliseconds), so a few
keep the loop fed (bench/throughput.py) whatever ``--concurrency`` is."""
SLOT_WAIT_S = 2.0
"""How long a consumer thread of a full worker holds a message before handing it back to the queue."""
HAND_BACK_DELAY_MS = 1_000
"""A handed-back message waits this long in Dramatiq's delay queue: a full worker does not take it straight back."""
WAIT_SLICE_S = 1.0
"""A consumer thread blocked on a slot or a claim wakes this often, so Dramatiq's Interrupt reaches it."""
HEALTH_SLICE_S = 0.1
"""A consumer thread held back by the process's health looks at it again this often (worker/saturation.py)."""
WORKER_TIMEOUT_MS = 200
"""How often idle Dramatiq threads wake up; 200 ms makes a stop take a fraction of a second."""


GC_THRESHOLDS = (2_000, 10, 100)
"""Python's defaults are (700, 10, 10). A young collection walks the young objects and reads every object they
point at, most of them old and spread over a heap of hundreds of megabytes: about 1-2 µs an object at a few hundred
runs held (loaded), so its pause grows with the first threshold (up to 108 ms at 50,000, the threshold before;
docs/benchmarks.md, "Saturation: the collector's pause"), while the collector's time per allocation hardly
depends on it. 50,000 was set when the automatic full collections walked every run's objects (two thirds of the
loop at 2,000 runs in flight with the defaults); :class:`Collector` now freezes what survives and collects what
is not frozen twice a second, so the oldest generation's automatic collections hardly come and are short."""


def tune_gc() -> None:
    """Freeze what the process built to start (imports, settings, threads) out of the collector's sight,
    and set the collector's thresholds (:data:`GC_THRESHOLDS`). Called once, before the process takes runs."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)
    gc.callbacks.append(_CollectionTimer())


LONG_PAUSE_S = 0.1
"""A collection that held the interpreter this long or longer is logged (``gc_long_pause``)."""


class _CollectionTimer:
    """A ``gc.callbacks`` entry timing each collection (``runbrake_gc_pause_seconds{generation}``): a
    collection holds the interpreter, so a cancel that comes during one waits for it. Collections never
    overlap (the interpreter runs one at a time), so one start time is enough."""

    def __init__(self) -> None:
        self._started = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        pause = time.perf_counter() - self._started
        PAUSES.note(pause)
        metrics.GC_PAUSE.labels(generation=str(info["generation"])).observe(pause)
        if pause >= LONG_PAUSE_S:
            log.info("gc_long_pause", generation=info["generation"], pause_ms=round(pause * 1000, 1),
                     collected=info["collected"])


THAW_GROWTH = 2.0
"""The frozen heap thaws for one whole collection once the interpreter's allocated blocks per run in flight have
grown this many times over the fewest seen since the last thaw."""


class Collector(Periodic):
    """Every ``RUNBRAKE_GC_INTERVAL_S`` (0.5 s; 0: never, Python's thresholds alone), a collection of what the
    process allocated since the last one, and the survivors frozen.

    A collection on a timer bounds how long garbage waits, whatever the allocation rate: a run's cycles (its
    anyio cancel scopes, its exceptions with their tracebacks and frames) that were alive at a young collection
    otherwise wait in an older generation, and a worker's RSS rose with them for a whole 30-minute soak
    (docs/benchmarks.md, "Soak: the RSS growth").

    A full collection walks every object not frozen: with the runs it holds alive it took 0.45-1.03 s to
    find 140-185 objects of garbage at 500-650 runs held (docs/benchmarks.md, "Saturation: the collector's
    pause"), the interpreter held all along. So after each collection the survivors are frozen
    (``gc.freeze``), and the next walks only what came since: the objects of the runs taken since, which at
    about 1,000 runs held and 10 s apart took 108-198 ms; 1 s apart 34-38 ms and 0.5 s apart 15 ms on average at
    300-450 runs held (loaded). A cycle frozen
    while alive is not found once it dies (a run's, as it ends): the frozen heap grows with them. The
    interpreter's allocated blocks per run in flight (``sys.getallocatedblocks``: live objects and the garbage
    frozen cycles keep) stay level while runs come and go with nothing leaked, and grow with the garbage; once
    they have grown :data:`THAW_GROWTH` times over the fewest seen since the last thaw, the heap is thawed for
    one whole collection (logged ``gc_thawed``); both read only at a tick when the runs in flight have not grown
    since the last. Blocks, not the frozen objects: ``gc.get_freeze_count`` walks
    the frozen list with the interpreter held, about 0.1 µs an object, 0.2 s at the 2 million objects of 1,000
    runs held, where the blocks are counted pool by pool (0.5 ms for 4.6 million); and not the RSS, which freed
    memory reused hides. Garbage stays below the live heap's size, and the long pause comes once the garbage has
    grown that large (or as runs end, when the process holds fewer), not every interval and not while the runs
    held grow."""

    def __init__(self, interval_s: float, *, in_flight: Callable[[], int]) -> None:
        super().__init__("runbrake-gc", interval_s=interval_s, enabled=interval_s > 0)
        self._in_flight = in_flight
        self._boot: int | None = None
        """The fewest allocated blocks after a collection with no run in flight (the process built to start): no
        run's. Read before the collection, the start's garbage made it too large, the blocks per run read too few
        while the process held few runs, and taking more runs thawed the heap (docs/benchmarks.md, "Saturation:
        the collector's pause")."""
        self._fewest: float | None = None
        """The fewest allocated blocks per run in flight seen since the last thaw at a tick when the runs in flight had
        not grown (None: none seen yet)."""
        self._runs_last = 0
        """The runs in flight at the last tick."""

    def _per_run(self) -> float | None:
        """Allocated blocks, the boot's aside, per run in flight; None with no run in flight."""
        runs = self._in_flight()
        return max(sys.getallocatedblocks() - (self._boot or 0), 0) / runs if runs else None

    def tick(self) -> None:
        # Runs taken since the last tick have built little yet: blocks per run read then are too few, and a thaw
        # judged against them came as the runs were taken, with nothing to find (docs/benchmarks.md, "Saturation:
        # the collector's pause"). Garbage comes as runs end, when the runs in flight do not grow.
        runs = self._in_flight()
        settled, self._runs_last = runs <= self._runs_last, runs
        per_run = self._per_run()
        if settled and per_run is not None and self._fewest is not None and per_run > THAW_GROWTH * self._fewest:
            self.thaw()
            return
        gc.collect()
        gc.freeze()
        if runs == 0:  # after the collection: the garbage of the process's start is no part of it
            blocks = sys.getallocatedblocks()
            self._boot = blocks if self._boot is None else min(self._boot, blocks)
        per_run = self._per_run()
        if settled and per_run is not None:
            self._fewest = per_run if self._fewest is None else min(self._fewest, per_run)

    def thaw(self) -> None:
        """One whole collection, every object in sight, then the survivors frozen again."""
        blocks = sys.getallocatedblocks()  # not gc.get_freeze_count(): it walks the frozen heap (the class says)
        started = time.perf_counter()
        gc.unfreeze()
        collected = gc.collect()
        gc.freeze()
        self._fewest = self._per_run()
        log.info("gc_thawed", blocks_before=blocks, collected=collected, blocks_after=sys.getallocatedblocks(),
                 runs_in_flight=self._in_flight(), pause_ms=round((time.perf_counter() - started) * 1000, 1))


class HandBack(RunbrakeError, Retry):
    """Raised when the message goes back to the queue, after :data:`HAND_BACK_DELAY_MS` in Dramatiq's delay
    queue, for any worker to take; the run was not claimed. A Dramatiq ``Retry`` too, so Dramatiq logs it as a
    retry, not an error (``worker/actors.py``, ``retry_store_outages``, retries it however often it happened)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, delay=HAND_BACK_DELAY_MS)


class WorkerFull(HandBack):
    """Raised when no slot came free, or the process's health admitted no run (worker/saturation.py), within
    :data:`SLOT_WAIT_S`."""


class CapacityClosed(HandBack):
    """Raised when the worker stopped taking runs while this message waited for a slot, or before its run started."""


class Slots:
    """A counter of runs in flight, at most ``capacity`` running; taken on a consumer thread, given back on the loop.

    A run waiting for an agent run it called lends its slot (:meth:`lend`) and takes one again before its turn goes
    on (:meth:`take_back`): it stays in flight, but not running. Not a ``threading.Semaphore``: a closed gate must
    wake its waiters, :meth:`wait_idle` must see zero, and a slot given back goes to a run taking its own back before
    any consumer thread.
    """

    def __init__(self, capacity: int, admits: Callable[[int], bool] | None = None) -> None:
        self.capacity = capacity
        self._admits = admits
        """Whether the process's health and its admission rate let it take one more run, given the runs running
        (worker/saturation.py); a yes counts against the rate, so it is asked only with a slot free. None: only
        the count decides."""
        self._taken = 0
        """Runs holding a slot: running."""
        self._lent = 0
        """Runs in flight that lent their slot (waiting for an agent run) and have not taken one back."""
        self._returning: collections.deque[asyncio.Future[None]] = collections.deque()
        """The runs waiting on the loop to take a slot back, first come first: a slot given back goes to them."""
        self._closed = False
        self._changed = threading.Condition()

    def acquire(self, timeout: float) -> bool:
        """Take a slot, waiting up to ``timeout`` seconds for one to come free and for the process's health to
        admit a run; False when neither came.

        Raises:
            CapacityClosed: the gate closed (the worker is stopping) before a slot came free.
        """
        deadline = time.monotonic() + timeout
        with self._changed:
            while not self._closed and (self._full() or not self._admitted()):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                # In slices: Dramatiq delivers its Interrupt (a time limit) only between Python bytecodes. A
                # slot given back notifies; a health that recovers does not, so it is looked at more often.
                self._changed.wait(min(left, WAIT_SLICE_S if self._full() else HEALTH_SLICE_S))
            if self._closed:
                raise CapacityClosed("the worker stopped taking runs")
            self._taken += 1
            return True

    def _full(self) -> bool:
        return self._taken >= self.capacity or bool(self._returning)

    def _admitted(self) -> bool:
        return self._admits is None or self._admits(self._taken)

    def release(self) -> None:
        """A segment that holds a slot ended."""
        with self._changed:
            self._give_back()

    def lend(self) -> None:
        """A run that holds a slot waits for an agent run it called (worker/agents.py): the slot goes to a run taking
        its own back, else to the next message; the run stays in flight. On the loop."""
        with self._changed:
            self._lent += 1
            self._give_back()

    async def take_back(self, *, now: bool = False) -> None:
        """Take a slot again for a run that lent its own (:meth:`lend`): at once when one is free, else the next one
        given back, before any consumer thread; awaited on the loop, never blocking it. ``now``, or cancelled while
        waiting: at once all the same, past ``capacity`` if need be (a run cut off records how it ended without
        waiting for another to end)."""
        with self._changed:
            if now or not self._full():
                self._lent -= 1
                self._taken += 1
                return
            waiter = asyncio.get_running_loop().create_future()
            self._returning.append(waiter)
        try:
            await waiter
        except BaseException:
            with self._changed:
                if waiter in self._returning:  # not handed a slot yet: take one past capacity, then go
                    self._returning.remove(waiter)
                    self._lent -= 1
                    self._taken += 1
            raise

    def _give_back(self) -> None:
        """One slot freed (under the lock): to the first run taking its own back, else to the consumer threads. A
        slot taken past capacity (:meth:`take_back` ``now``) just ends."""
        while self._returning and self._taken <= self.capacity:
            waiter = self._returning.popleft()
            try:
                waiter.get_loop().call_soon_threadsafe(_hand_slot, waiter)
            except RuntimeError:
                continue  # its loop closed, and its run with it
            self._lent -= 1  # the slot passes to it: it runs again, the count of slots taken is unchanged
            return
        self._taken -= 1
        self._changed.notify_all()

    def leave_lent(self) -> None:
        """A segment whose slot was still lent ended."""
        with self._changed:
            self._lent -= 1
            self._changed.notify_all()

    def close(self) -> None:
        """Take no more runs: every waiter (and every later :meth:`acquire`) raises :class:`CapacityClosed`. Runs taking
        a slot back still get one as others end."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()

    @property
    def in_flight(self) -> int:
        """Runs in flight: running, or waiting with their slot lent."""
        with self._changed:
            return self._taken + self._lent

    @property
    def running(self) -> int:
        """Runs holding a slot (and those taking one back past capacity)."""
        with self._changed:
            return self._taken

    @property
    def lent(self) -> int:
        """Runs in flight whose slot is lent (``runbrake_slots_lent``)."""
        with self._changed:
            return self._lent

    def wait_idle(self, timeout: float, *, unless: threading.Event | None = None) -> bool:
        """Block until no run is in flight (none holds a slot, none lent one), at most ``timeout`` seconds or until
        ``unless`` is set; True when idle."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while self._taken or self._lent:
                left = deadline - time.monotonic()
                if left <= 0 or (unless is not None and unless.is_set()):
                    return False
                self._changed.wait(min(left, WAIT_SLICE_S))
            return True


def _hand_slot(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():  # cancelled meanwhile: the slot is its all the same (Slots.take_back)
        waiter.set_result(None)


class Seat:
    """One segment's slot, as its agent calls lend it (worker/agents.py, ``Slot``): the run's calls waiting at
    once lend one slot, the first to wait lends it and the last to stop takes it back."""

    def __init__(self, slots: Slots) -> None:
        self._slots = slots
        self._waiting = 0

    def lend(self) -> None:
        self._waiting += 1
        if self._waiting == 1:
            self._slots.lend()

    async def take_back(self, *, now: bool) -> None:
        self._waiting -= 1
        if self._waiting == 0:
            await self._slots.take_back(now=now)

    def leave(self) -> None:
        """The segment ended: its slot is given back (or, were it still lent, its place in flight)."""
        if self._waiting:
            self._slots.leave_lent()
        else:
            self._slots.release()


RESTART_DELAY_S = 0.5
"""A thread that died is replaced after this pause, so that whatever keeps killing threads cannot spin."""


class _Watched:
    """A Dramatiq thread that reports its own death: an exit while it was still meant to run, whatever
    raised. Dramatiq catches errors around a message and around a consumer's connection, but not everything
    (a ``queue_name`` naming another queue raised ``KeyError`` out of a worker thread's ``finally``; an
    exception injected between two messages is not caught either), and a dead thread is not replaced."""

    running: bool
    name: str
    on_death: Callable[[_Watched, BaseException | None], None]

    def run(self) -> None:
        error: BaseException | None = None
        try:
            super().run()  # type: ignore[misc]
        except BaseException as exc:  # noqa: BLE001 - reported and replaced, never swallowed silently
            error = exc
        if self.running:
            self.on_death(self, error)


class _WatchedWorkerThread(_Watched, WorkerThread):
    """Dramatiq's worker thread (what this module calls a consumer thread), replaced when it dies."""


class _WatchedConsumerThread(_Watched, ConsumerThread):
    """Dramatiq's thread that reads one queue off RabbitMQ, replaced when it dies."""


class _WatchedWorker(Worker):
    """Dramatiq's worker whose threads are replaced when they die, each replacement counted
    (``runbrake_consumer_restarts_total{kind}``) and logged (``consumer_thread_died``)."""

    def __init__(self, broker: Broker, **options: Any) -> None:
        super().__init__(broker, **options)
        self._replacing = threading.Lock()
        self._stopped = False

    def _add_worker(self) -> None:
        thread = self._worker_thread()
        thread.start()
        self.workers.append(thread)

    def _worker_thread(self) -> _WatchedWorkerThread:
        thread = _WatchedWorkerThread(broker=self.broker, consumers=self.consumers, work_queue=self.work_queue,
                                      worker_timeout=self.worker_timeout)
        thread.on_death = self._worker_died
        return thread

    def _add_consumer(self, queue_name: str, *, delay: bool = False) -> None:
        # Dramatiq's own, building a watched thread (dramatiq/worker.py, Worker._add_consumer).
        if queue_name in self.consumers:
            return
        if self.consumer_whitelist and q_name(queue_name) not in self.consumer_whitelist:
            return
        self.consumers[queue_name] = self._consumer_thread(queue_name, delay=delay)
        self.consumers[queue_name].start()

    def _consumer_thread(self, queue_name: str, *, delay: bool) -> _WatchedConsumerThread:
        thread = _WatchedConsumerThread(
            broker=self.broker, queue_name=queue_name, prefetch=self.delay_prefetch if delay else self.queue_prefetch,
            work_queue=self.work_queue, worker_timeout=self.worker_timeout,
        )
        thread.on_death = self._consumer_died
        return thread

    def stop(self, timeout: int = 600_000) -> None:
        with self._replacing:
            self._stopped = True
        super().stop(timeout)

    def _worker_died(self, dead: _Watched, error: BaseException | None) -> None:
        assert isinstance(dead, WorkerThread)
        if not self._before_replacing(dead, error, kind="worker_thread"):
            return
        with self._replacing:
            if self._stopped:
                return
            thread = self._worker_thread()
            if dead.paused:  # the intake paused it to drain: the replacement takes no message either
                thread.pause()
            self.workers[self.workers.index(dead)] = thread
            thread.start()
        self._replaced(dead, thread, kind="worker_thread")

    def _consumer_died(self, dead: _Watched, error: BaseException | None) -> None:
        assert isinstance(dead, ConsumerThread)
        with contextlib.suppress(Exception):  # its connection is this thread's own: close it, so RabbitMQ
            dead.close()                      # requeues what it held
        if not self._before_replacing(dead, error, kind="queue_consumer"):
            return
        with self._replacing:
            if self._stopped:
                return
            thread = self._consumer_thread(dead.queue_name, delay=dead.queue_name.endswith(".DQ"))
            self.consumers[dead.queue_name] = thread
            thread.start()
        self._replaced(dead, thread, kind="queue_consumer")

    def _before_replacing(self, dead: _Watched, error: BaseException | None, *, kind: str) -> bool:
        """Log the death, wait :data:`RESTART_DELAY_S`; False when the worker stopped meanwhile."""
        log.error("consumer_thread_died", kind=kind, thread=dead.name, error=repr(error)[:300], exc_info=error or False)
        time.sleep(RESTART_DELAY_S)
        return not self._stopped

    def _replaced(self, dead: _Watched, thread: threading.Thread, *, kind: str) -> None:
        metrics.CONSUMER_RESTARTS.labels(kind=kind).inc()
        log.warning("consumer_thread_restarted", kind=kind, thread=thread.name, replaces=dead.name)

    def consumer_status(self, queue: str) -> tuple[bool, str]:
        """Whether this worker takes messages off ``queue``: a live worker thread and a consumer of the
        queue bound to it. From any thread (it reads, never calls, pika objects)."""
        alive = sum(1 for thread in list(self.workers) if thread.is_alive())
        reader = self.consumers.get(queue)
        consumer = getattr(reader, "consumer", None)
        consuming = bool(reader is not None and reader.is_alive() and getattr(consumer, "consuming", False))
        threads = f"{alive} of {self.worker_threads} consumer threads alive"
        if not alive:
            return False, f"{threads}: nothing takes messages"
        if not consuming:
            return False, f"{threads}, not consuming {queue} (connecting, or the queue's declaration refused)"
        return True, f"{threads}, consuming {queue}"


class Intake:
    """The runs one worker process takes: ``concurrency`` in flight on the loop, fed by a few consumer
    threads. :meth:`take` is the run actor's body; the rest is for starting and stopping the process."""

    def __init__(self, runtime: Runtime, *, concurrency: int, watch: LoopWatch | None = None) -> None:
        self.concurrency = concurrency
        self.consumer_threads = min(concurrency, CONSUMER_THREADS)
        self._runtime = runtime
        self._watch = watch
        self._slots = Slots(concurrency, None if watch is None else watch.admits)
        self._tasks: set[asyncio.Task[None]] = set()
        """The segments' tasks; touched on the loop only."""
        self._interrupted = False
        self._worker: _WatchedWorker | None = None

    # -- the run actor's body, on a consumer thread --

    def take(self, run_id: str, *, resume: bool, traceparent: str | None = None) -> None:
        """Take a slot, start the run's segment on the loop, return once its claim is decided. ``traceparent``
        (the message's, with tracing on) is the segment span's parent.

        Raises:
            HandBack: the worker is full or stopping; the message goes back to the queue.
            StoreError: Redis could not be reached at claim (the message is retried).
        """
        if not self._slots.acquire(SLOT_WAIT_S):
            why = self._why_full()
            log.info("run_handed_back", run_id=run_id, reason=why)
            raise WorkerFull(why)
        try:
            decided: concurrent.futures.Future[bool] = concurrent.futures.Future()
            asyncio.run_coroutine_threadsafe(self._segment(run_id, resume, decided, traceparent, Seat(self._slots)),
                                             _loop())
        except BaseException:
            self._slots.release()
            raise
        while True:
            try:
                decided.result(WAIT_SLICE_S)  # re-raises what the claim raised
            except concurrent.futures.TimeoutError:
                continue
            return

    def _why_full(self) -> str:
        running, lent = self._slots.running, self._slots.lent
        refusal = self._watch.refusal() if self._watch is not None and running < self.concurrency else ""
        return (f"{running} runs in flight here" + (f", {lent} more waiting for agent runs" if lent else "")
                + (f" ({refusal})" if refusal else ""))

    async def _segment(self, run_id: str, resume: bool, decided: concurrent.futures.Future[bool],
                       traceparent: str | None, seat: Seat) -> None:
        """The segment on the loop, in ``seat`` (its slot, which its agent calls lend while they wait); tells
        ``decided`` how the claim went, and gives the slot back, whatever happens. Its task is known to
        :meth:`interrupt_all` for as long as it runs."""
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            if self._interrupted:  # started after interrupt_all: claim nothing, send the message again
                decided.set_exception(CapacityClosed("the worker stopped before the run started"))
            else:
                await self._runtime.execute(run_id, resume=resume, on_claim=decided.set_result,
                                            traceparent=traceparent, slot=seat)
        except asyncio.CancelledError:
            if not decided.done():
                # Stopped before the claim was decided: the message is sent again (a claimed run refuses it).
                decided.set_exception(CapacityClosed("the worker stopped while claiming the run"))
            raise
        except BaseException as exc:
            if not decided.done():
                decided.set_exception(exc)  # a store outage is retried, anything else dead-letters the message
            else:
                log.exception("run_segment_crashed", run_id=run_id)
            raise
        finally:
            self._tasks.discard(task)
            if not decided.done():
                decided.set_result(False)
            seat.leave()

    # -- starting and stopping the process (worker/process.py) --

    def start_consuming(self, broker: Broker, queues: Iterable[str]) -> None:
        """Start Dramatiq's consumers and threads on ``queues``."""
        worker = _WatchedWorker(broker, queues=set(queues), worker_threads=self.consumer_threads,
                                worker_timeout=WORKER_TIMEOUT_MS)
        # A prefetched message waits for a thread, a thread with a message waits for a slot: one per
        # thread keeps what a full worker holds back from other workers to its few threads.
        worker.queue_prefetch = self.consumer_threads
        worker.start()
        self._worker = worker

    def stop_consuming(self) -> None:
        """Take no new runs; the runs in flight go on. Consumer threads waiting for a slot give their
        message back (retried: another worker runs it); messages prefetched but not taken stay unacked
        until :meth:`stop`, which closes the channel and RabbitMQ requeues them."""
        self._slots.close()
        if self._worker is not None:
            # Only the worker threads, and not Worker.pause(): a paused consumer closes its channel and
            # sleeps Dramatiq's consumer restart delay (3 s), which the stop would then wait out.
            for thread in self._worker.workers:
                thread.pause()

    def consumer_status(self, queue: str) -> tuple[bool, str]:
        """Whether this process takes messages off ``queue`` (readiness, worker/health.py), and why not."""
        if self._worker is None:
            return False, "not consuming yet"
        return self._worker.consumer_status(queue)

    @property
    def in_flight(self) -> int:
        """Runs whose segment is in flight here (or whose claim is being decided), their slot lent or not."""
        return self._slots.in_flight

    @property
    def running(self) -> int:
        """Runs in flight holding a slot: at most ``concurrency`` (but for a run cut off while it waited)."""
        return self._slots.running

    @property
    def lent(self) -> int:
        """Runs in flight waiting for an agent run they called, their slot lent (``runbrake_slots_lent``)."""
        return self._slots.lent

    def wait_idle(self, timeout: float, *, unless: threading.Event | None = None) -> bool:
        """Block until every segment in flight ended, at most ``timeout`` seconds or until ``unless`` is set
        (a second SIGTERM); True when they all did."""
        return self._slots.wait_idle(timeout, unless=unless)

    def interrupt_all(self) -> int:
        """Cancel every segment in flight, and any submitted but not started yet; each records
        ``worker_shutdown`` on its way out (``worker/runtime.py``, ``ending_of``). From any thread;
        returns how many runs were in flight. The cancel happens on the loop: a task is not thread-safe."""
        self._interrupted = True
        with contextlib.suppress(RuntimeError):  # the loop is gone: nothing runs on it any more
            _loop().call_soon_threadsafe(self._cancel_tasks)
        return self.in_flight

    def _cancel_tasks(self) -> None:
        for task in list(self._tasks):
            task.cancel()

    def stop(self, *, grace_s: float) -> None:
        """Stop taking runs, interrupt what is still in flight, wait up to ``grace_s`` for those segments
        to record how they ended, then stop Dramatiq (which stops the event loop)."""
        self.stop_consuming()
        interrupted = self.interrupt_all()
        if not self.wait_idle(grace_s):
            log.warning("segments_still_in_flight", count=self.in_flight, interrupted=interrupted)
        if self._worker is not None:
            self._worker.stop(timeout=int(grace_s * 1000))


def _loop() -> asyncio.AbstractEventLoop:
    """The process's one event loop, which Dramatiq's AsyncIO middleware runs on a thread of its own."""
    loop_thread = get_event_loop_thread()
    if loop_thread is None:
        raise RuntimeError("the AsyncIO middleware's event loop is not running")
    return loop_thread.loop
