"""How a worker process takes runs: a few Dramatiq consumer threads feeding many runs on the one event loop
(docs/architecture.md, "Capacity: runs in flight").

A run spends nearly all its life awaiting a model or an MCP server, so holding a thread for each run
in flight (each blocked on its coroutine) buys nothing and costs a stack, a wake-up a second and a share
of the GIL. Instead a message goes through three steps on one of a handful of consumer threads:

1. take a **slot** (:class:`Slots`): block while ``--concurrency`` runs are in flight. A consumer thread
   waiting here holds its message unacked, so RabbitMQ's prefetch (one message per consumer thread)
   bounds what a full worker holds back from the queue;
2. start the run's segment on the loop and wait only until its **claim is decided**: a store outage at
   claim raises here, on the thread, so Dramatiq retries the message (``worker/actors.py``,
   ``retry_store_outages``); a refused claim (a duplicate, a cancelled or unknown run) is a no-op;
3. return: Dramatiq acks the message while the segment goes on on the loop. The slot is given back
   when the segment ends.

Acking early changes nothing a run relies on: its durability lives in Redis, a claimed run is never run
again (the claim guard refuses a second message), a killed worker's run is failed ``lease_lost`` by
another worker's lease keeper, and the runtime's own time limit (``RUNBRAKE_RUN_TIME_LIMIT_S``) bounds a
segment, since Dramatiq's time limit and shutdown notices only reach a thread that still runs the actor.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Iterable

import structlog
from dramatiq import Broker, Worker
from dramatiq.asyncio import get_event_loop_thread
from dramatiq.middleware import Interrupt

from runbrake.shared.errors import RunbrakeError
from runbrake.worker.runtime import Runtime

log = structlog.get_logger(__name__)

CONSUMER_THREADS = 4
"""Dramatiq worker threads per process: each only waits for a slot and a claim (milliseconds), so a few
keep the loop fed (bench/throughput.py) whatever ``--concurrency`` is."""
WAIT_SLICE_S = 1.0
"""A consumer thread blocked on a slot or a claim wakes this often, so Dramatiq's Interrupt reaches it."""
WORKER_TIMEOUT_MS = 200
"""How often idle Dramatiq threads wake up; 200 ms makes a stop take a fraction of a second."""


class CapacityClosed(RunbrakeError):
    """The worker stopped taking runs while this message waited for a slot; retried, so another worker
    (or this one, started again) runs it (``worker/actors.py``, ``retry_store_outages``)."""


class Slots:
    """A counter of runs in flight, at most ``capacity``; taken on a consumer thread, given back on the loop.

    Not a ``threading.Semaphore``: a closed gate must wake its waiters, and :meth:`wait_idle` must see zero.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._taken = 0
        self._closed = False
        self._changed = threading.Condition()

    def acquire(self) -> None:
        """Block until a slot is free and take it.

        Raises:
            CapacityClosed: the gate closed (the worker is stopping) before a slot came free.
        """
        with self._changed:
            while not self._closed and self._taken >= self.capacity:
                # In slices: Dramatiq delivers its Interrupt (a time limit) only between Python bytecodes.
                self._changed.wait(WAIT_SLICE_S)
            if self._closed:
                raise CapacityClosed("the worker stopped taking runs")
            self._taken += 1

    def release(self) -> None:
        with self._changed:
            self._taken -= 1
            self._changed.notify_all()

    def close(self) -> None:
        """Take no more runs: every waiter (and every later :meth:`acquire`) raises :class:`CapacityClosed`."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()

    @property
    def in_flight(self) -> int:
        with self._changed:
            return self._taken

    def wait_idle(self, timeout: float) -> bool:
        """Block until no slot is taken, at most ``timeout`` seconds; True when idle."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while self._taken:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(min(left, WAIT_SLICE_S))
            return True


class Intake:
    """The runs one worker process takes: ``concurrency`` in flight on the loop, fed by a few consumer
    threads. :meth:`take` is the run actor's body; the rest is for starting and stopping the process."""

    def __init__(self, runtime: Runtime, *, concurrency: int) -> None:
        self.concurrency = concurrency
        self.consumer_threads = min(concurrency, CONSUMER_THREADS)
        self._runtime = runtime
        self._slots = Slots(concurrency)
        self._lock = threading.Lock()
        self._segments: set[concurrent.futures.Future[None]] = set()
        self._worker: Worker | None = None

    # -- the run actor's body, on a consumer thread --

    def take(self, run_id: str, *, resume: bool) -> None:
        """Take a slot, start the run's segment on the loop, return once its claim is decided.

        Raises:
            CapacityClosed: the worker stopped before a slot came free (the message is retried).
            StoreError: Redis could not be reached at claim (the message is retried).
        """
        try:
            self._slots.acquire()
        except Interrupt as exc:  # Dramatiq's time limit ran out while the worker was full: give the message back
            raise CapacityClosed("no slot came free within the message's time limit") from exc
        try:
            loop = _loop()
            decided: concurrent.futures.Future[bool] = concurrent.futures.Future()
            segment = asyncio.run_coroutine_threadsafe(self._segment(run_id, resume, decided), loop)
        except BaseException:
            self._slots.release()
            raise
        with self._lock:
            self._segments.add(segment)
        segment.add_done_callback(self._ended)
        while True:
            try:
                decided.result(WAIT_SLICE_S)  # re-raises what the claim raised
            except concurrent.futures.TimeoutError:
                continue
            return

    async def _segment(self, run_id: str, resume: bool, decided: concurrent.futures.Future[bool]) -> None:
        """The segment on the loop; tells ``decided`` how the claim went, whatever happens."""
        try:
            await self._runtime.execute(run_id, resume=resume, on_claim=decided.set_result)
        except BaseException as exc:
            if isinstance(exc, asyncio.CancelledError) and not decided.done():
                # Stopped before the claim was decided: the message is sent again (a claimed run refuses it).
                decided.set_exception(CapacityClosed("the worker stopped while claiming the run"))
            elif not decided.done():
                decided.set_exception(exc)  # a store outage is retried, anything else dead-letters the message
            elif not isinstance(exc, asyncio.CancelledError):
                log.exception("run_segment_crashed", run_id=run_id)
            raise
        finally:
            if not decided.done():
                decided.set_result(False)

    def _ended(self, segment: concurrent.futures.Future[None]) -> None:
        with self._lock:
            self._segments.discard(segment)
        self._slots.release()

    # -- starting and stopping the process (worker/process.py) --

    def start_consuming(self, broker: Broker, queues: Iterable[str]) -> None:
        """Start Dramatiq's consumers and threads on ``queues``."""
        worker = Worker(broker, queues=set(queues), worker_threads=self.consumer_threads,
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
            self._worker.pause()

    @property
    def in_flight(self) -> int:
        """Runs whose segment is in flight here (or whose claim is being decided)."""
        return self._slots.in_flight

    def wait_idle(self, timeout: float) -> bool:
        """Block until every segment in flight ended, at most ``timeout`` seconds; True when they all did."""
        return self._slots.wait_idle(timeout)

    def interrupt_all(self) -> int:
        """Cancel every segment in flight; each records ``worker_shutdown`` on its way out (the ladder's
        last arm, ``worker/runtime.py``). Returns how many were asked; from any thread."""
        with self._lock:
            segments = list(self._segments)
        for segment in segments:
            segment.cancel()  # thread-safe: hops onto the loop and cancels the task there
        return len(segments)

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
