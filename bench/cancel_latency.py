"""Cancel latency: from the cancel call to the MCP server's handler seeing the cancellation, and to the
cancelled tool step being persisted; through the cancel message, through the backstop alone, with 250 runs
in flight on one worker, and for 200 cancels at once.

Run from the repository root::

    .venv/bin/python -m bench.cancel_latency [--cancels 200] [--concurrency 4] [--poll-ms 250]
        [--phases message,backstop,in-flight,burst] [--in-flight 250] [--in-flight-cancels 200]
        [--burst 200] [--burst-threads 32] [--many-threads 256] [--slow-s 120]

A short sanity run: ``--phases in-flight,burst --in-flight 20 --in-flight-cancels 20 --burst 20
--many-threads 32`` (``--phase burst`` works too: argparse takes the unambiguous prefix).

What it does, in its own namespace (``bench-<hex>``), on loopback only:

1. starts the example toolbox MCP server over HTTP (writing its events file) and one worker process
   at a time (``python -m runbrake.worker --threads 8``, ``RUNBRAKE_CANCEL_POLL_MS=250``, its JSON log to
   a file; the in-flight and burst phases each get a fresh one, see 5-7);
2. per phase, in batches of ``--concurrency`` runs: enqueues runs whose first turn calls
   ``slow(seconds=30 + a unique fraction)`` (the fraction tells the server's events apart), waits
   until the server has written "started" for every one of them (the calls are in flight), then
   cancels them one at a time; each cancel waits for the server's "cancelled" event, the cancelled
   tool step in the store and the run's ``run_segment_ended`` log line before the next begins, so
   one cancel never overlaps another or a run's start;
3. phase **message**: ``cancel_run(store, publisher, run_id, …)`` (fence + cancel message);
   phase **backstop**: ``cancel_run(store, None, run_id, …)`` (fence only: the worker's backstop,
   one MGET every poll interval, has to find it; it acts on the second poll that sees the cancel, leaving
   a message on its way one interval to arrive, so its bound is two intervals);
4. t0 = ``time.time()`` right before ``cancel_run``; measured: the server's "cancelled" event
   (its ``t``) and the tool step's ``recorded_at``; the worker's log lines
   (``cancel_message_delivered`` / ``cancel_found_by_backstop``, ``call_interrupted``) give the
   steps in between;
5. phase **in-flight** (a fresh worker with ``--many-threads`` threads): ``--in-flight`` runs (250) each in
   a ``slow(--slow-s)`` call (120 s) at once; once the server has "started" all of them, the worker's RSS is
   read, then ``--in-flight-cancels`` (200) cancels through the message, one at a time as above, oldest
   run first; after each, a new run is started and awaited (unless ``--no-top-up``), so every cancel finds
   the worker with the full count in flight;
6. phase **burst** (another fresh worker): ``--burst`` runs (200) in slow calls, then all of them cancelled
   at once from a thread pool of ``--burst-threads`` (each thread with its own :class:`CancelPublisher`,
   connected beforehand: pika is not thread-safe); per run, which path reached it (the worker's
   ``cancel_message_delivered`` or ``cancel_found_by_backstop`` line) and the same times;
7. the runs a phase leaves in flight are cancelled (not measured) and their segments awaited before the next
   phase; a worker is stopped before the next one starts (two would share the run queue); per phase, the
   worker's error lines, the messages Dramatiq retried and any log line holding two entries are counted;
8. prints the table (with the bounds of the alternatives beside it), writes
   ``bench/results/cancel_latency.json``, and cleans up.
"""

from __future__ import annotations

import argparse
import random
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from bench._harness import (
    Bench,
    BenchError,
    JsonLines,
    ToolboxServer,
    Worker,
    log_time,
    machine,
    print_machine,
    quick_run_spec,
    slow_run_spec,
    summary_ms,
    wait_until,
)
from runbrake.shared.logging import configure_logging
from runbrake.shared.messaging.cancel import CancelPublisher, CancelResult, cancel_run
from runbrake.shared.messaging.producer import Producer
from runbrake.shared.spec import RunSpec
from runbrake.shared.status import RunStatus
from runbrake.shared.steps import RunStep, StepKind

SLOW_SECONDS = 30.0
"""The slow call of the message and backstop phases; the in-flight and burst phases take ``--slow-s``."""
STEP_TIMEOUT_S = 10.0
"""Bound on each wait of one cancel (the call itself would run 30 s)."""
START_TIMEOUT_S = 30.0
START_TIMEOUT_PER_RUN_S = 0.5
"""Added to START_TIMEOUT_S per run started at once (250 runs connecting on one event loop take a while)."""
SERVER_GRACE_S = 3.0
"""How long after the run's segment ended the server still gets to write its end event of the call."""
CLASSIC_PHASES = ("message", "backstop")
"""The phases on the ``--threads`` worker, a few runs in flight at a time."""
FRESH_WORKER_PHASES = ("in-flight", "burst")
"""The phases that each start a worker of their own with ``--many-threads`` threads."""

AIM: dict[str, dict[str, float]] = {"message": {"p50": 10.0, "p99": 50.0}, "in-flight": {"p50": 10.0, "p99": 50.0},
                                    "burst": {}}
AIM_BURST_BY_MESSAGE_PCT = 99.0
"""In a burst, the share of cancels the message should deliver (the rest fall to the backstop)."""
ALTERNATIVES = (
    ("dramatiq-abort", "its watcher BLPOPs the abort keys of the messages running when a cycle starts, 1 s per "
                       "cycle (wait_timeout=1000 ms): a message that started since waits up to 1 s; abort key "
                       "TTL 90 s; the abort is an exception raised in the worker thread, which cannot interrupt "
                       "a blocking system call"),
    ("PHP system runbrake comes from", "polls for the cancel once a second: up to ~1000 ms"),
    ("Celery revoke()", "without terminate=True never stops a task that is already running"),
    ("Temporal", "an activity learns of the cancel at its next heartbeat: up to the heartbeat interval"),
)


@dataclass
class Observations:
    """What the server's events file and the worker's log have said so far, indexed for matching."""

    events: JsonLines
    log: JsonLines
    started: dict[float, dict[str, Any]] = field(default_factory=dict)
    """The "started" event of each slow call, by its (unique) seconds argument."""
    ended: dict[int, dict[str, Any]] = field(default_factory=dict)
    """The end event ("cancelled", "finished", "failed") of each call, by call number."""
    by_run: dict[str, dict[str, dict[str, Any]]] = field(default_factory=lambda: defaultdict(dict))
    """The first log line of each event name, by run id."""

    def refresh(self) -> None:
        for event in self.events.read_new():
            if event.get("tool") != "slow":
                continue
            if event["event"] == "started":
                self.started[_key(event["args"]["seconds"])] = event
            else:
                self.ended.setdefault(event["call"], event)
        for line in self.log.read_new():
            run_id = line.get("run_id")
            if isinstance(run_id, str):
                self.by_run[run_id].setdefault(str(line.get("event")), line)


def _key(seconds: float) -> float:
    return round(float(seconds), 6)


def slow_spec(_server: ToolboxServer, seconds: float) -> RunSpec:
    """A run whose first turn calls slow(seconds); it is cancelled long before a second turn."""
    return slow_run_spec(seconds, input_text="cancel latency")


@dataclass(frozen=True, slots=True)
class InFlight:
    """A run whose slow call the server has started: its id, the call's unique seconds and its call number."""

    run_id: str
    seconds: float
    call: int


class Phase:
    """One phase: batches of runs in flight, cancelled one at a time; one sample per cancel.

    Also the toolkit of the in-flight and burst phases: start slow runs and wait until the server has them
    (:meth:`start`), cancel one (:meth:`cancel`), observe what a cancel came to (:meth:`observe`)."""

    def __init__(
        self, name: str, bench: Bench, producer: Producer, publisher: CancelPublisher | None,
        server: ToolboxServer, worker: Worker, observations: Observations, *, jitter_s: float,
        slow_s: float = SLOW_SECONDS,
    ) -> None:
        self.name = name
        self._jitter_s = jitter_s
        self._random = random.Random(name)
        self._bench = bench
        self._producer = producer
        self._publisher = publisher
        self._server = server
        self.worker = worker
        self._seen = observations
        self._slow_s = slow_s
        self.samples: list[dict[str, Any]] = []

    def run(self, count: int, *, concurrency: int, first_fraction: int) -> int:
        """Take ``count`` samples; returns the next unused fraction number."""
        fraction = first_fraction
        while len(self.samples) < count:
            batch_size = min(concurrency, count - len(self.samples))
            batch = self.start(batch_size, first_fraction=fraction)
            fraction += batch_size
            for run in batch:
                self.samples.append(self.cancel(run))
        return fraction

    def start(self, count: int, *, first_fraction: int) -> list[InFlight]:
        """Enqueue ``count`` runs calling slow(slow_s + a unique fraction) and wait until the server has
        started every call (they are in flight); the fractions used are ``first_fraction`` onwards."""
        enqueued = []
        for fraction in range(first_fraction, first_fraction + count):
            seconds = self._slow_s + fraction / 10_000
            enqueued.append((self._producer.enqueue(slow_spec(self._server, seconds)).run_id, seconds))
        self._wait(lambda: all(_key(s) in self._seen.started for _, s in enqueued),
                   START_TIMEOUT_S + START_TIMEOUT_PER_RUN_S * count, f"{count} slow calls to start on the server")
        return [InFlight(run_id, seconds, self._seen.started[_key(seconds)]["call"]) for run_id, seconds in enqueued]

    def _wait(self, condition: Callable[[], Any], timeout: float, what: str) -> Any:
        def check() -> Any:
            self._seen.refresh()
            return condition()

        return wait_until(check, timeout=timeout, what=what, interval=0.002, alive=[self.worker.process])

    def _wait_or_none(self, condition: Callable[[], Any], timeout: float, what: str) -> Any:
        """:meth:`_wait`, but None when the time runs out (still BenchError when the worker has died)."""
        try:
            return self._wait(condition, timeout, what)
        except BenchError:
            if self.worker.process.popen.poll() is not None:
                raise
            return None

    def cancel(self, run: InFlight) -> dict[str, Any]:
        """Cancel one run in flight (after a random pause within one poll interval) and observe it."""
        # A random moment within one poll interval: the cancels must not fall in step with the backstop's
        # timer (back to back, each would come just after a poll and wait nearly a whole interval).
        time.sleep(self._random.uniform(0, self._jitter_s))
        t0 = time.time()
        result = cancel_run(self._bench.store, self._publisher, run.run_id, reason="benchmark",
                            requested_by="bench.cancel_latency")
        returned = time.time()
        return self.observe(run, t0, returned, result)

    def observe(self, run: InFlight, t0: float, returned: float, result: CancelResult, *,
                timeout: float = STEP_TIMEOUT_S) -> dict[str, Any]:
        """Wait for what the cancel of ``run`` (made at ``t0``, returned at ``returned``) came to: the
        cancelled tool step, the end of the run's segment, the server's end event of the call; one sample.

        A step that is not persisted or a segment that does not end within ``timeout`` is runbrake's fault,
        not the benchmark's: it is recorded in the sample (``step_persisted`` / ``segment_ended``), counted
        in the phase's summary, and the benchmark goes on (it still stops when the worker has died)."""
        store = self._bench.store
        run_id, call = run.run_id, run.call
        if not result.won:
            raise BenchError(f"the cancel of run {run_id} did not win the fence: found {result.found.value}")

        def tool_step() -> RunStep | None:
            return next((s for s in store.get(run_id).steps if s.kind is StepKind.TOOL), None)

        step: RunStep | None = self._wait_or_none(tool_step, timeout, f"the tool step of run {run_id}")
        segment_ended = self._wait_or_none(lambda: "run_segment_ended" in self._seen.by_run[run_id], timeout,
                                           f"the end of run {run_id}'s segment")
        try:
            ended = self._wait(lambda: self._seen.ended.get(call), SERVER_GRACE_S,
                               f"the server's end event of call {call}")
        except BenchError:
            ended = None  # the server's handler never learned of the cancel: counted, not fatal
        lines = self._seen.by_run[run_id]
        listener = lines.get("cancel_message_delivered") or lines.get("cancel_found_by_backstop")
        interrupted = lines.get("call_interrupted")
        return {
            "run_id": run_id,
            "call": call,
            "server_event": None if ended is None else ended["event"],
            "tool_outcome": None if step is None or step.tool_outcome is None else step.tool_outcome.value,
            "segment_ended": bool(segment_ended),
            "found_by": None if listener is None else listener["event"],
            "message_confirmed": result.message_confirmed,
            "t0": t0,
            # seconds after t0:
            "cancel_run_returned": returned - t0,
            "listener_acted": None if listener is None else log_time(listener) - t0,
            "call_interrupted": None if interrupted is None else log_time(interrupted) - t0,
            "server_saw_cancel": None if ended is None or ended["event"] != "cancelled" else ended["t"] - t0,
            "step_persisted": None if step is None else step.recorded_at - t0,
        }

    def cancel_rest(self, runs: Sequence[InFlight]) -> None:
        """Cancel runs the phase leaves in flight (fence + message, not measured) and wait for their segments
        to end, so that the next phase starts on an idle worker."""
        for run in runs:
            cancel_run(self._bench.store, self._publisher, run.run_id, reason="benchmark cleanup",
                       requested_by="bench.cancel_latency")
        self._wait(lambda: all("run_segment_ended" in self._seen.by_run[r.run_id] for r in runs),
                   STEP_TIMEOUT_S + 0.1 * len(runs), f"the segments of {len(runs)} cancelled runs to end")


class InFlightPhase(Phase):
    """Phase in-flight: many runs in slow calls on one worker, cancelled one at a time, topped up after each."""

    def run_in_flight(self, in_flight: int, cancels: int, *, warmup: int, top_up: bool,
                      first_fraction: int) -> tuple[int, dict[str, Any]]:
        """Start ``in_flight`` runs, then take ``warmup + cancels`` samples (the first ``warmup`` are dropped
        by the caller), oldest run first. Returns the next unused fraction number and what was seen of the
        worker meanwhile (its RSS with all runs in flight; the count in flight at each cancel)."""
        fraction = first_fraction
        live = self.start(in_flight, first_fraction=fraction)
        fraction += in_flight
        seen: dict[str, Any] = {"rss_kib_all_in_flight": self.worker.rss_kib(),
                                "peak_rss_kib_all_in_flight": self.worker.peak_rss_kib()}
        in_flight_at_cancel = []
        for _ in range(warmup + cancels):
            if not live:
                break
            in_flight_at_cancel.append(len(live))
            self.samples.append(self.cancel(live.pop(0)))
            if top_up:
                live.extend(self.start(1, first_fraction=fraction))
                fraction += 1
        seen["peak_rss_kib_after_cancels"] = self.worker.peak_rss_kib()
        seen["in_flight_at_cancel"] = {"min": min(in_flight_at_cancel, default=0),
                                       "max": max(in_flight_at_cancel, default=0)}
        self.cancel_rest(live)
        return fraction, seen


class BurstPhase(Phase):
    """Phase burst: many runs in slow calls on one worker, all cancelled at once from a pool of threads."""

    def run_burst(self, count: int, *, threads: int, first_fraction: int) -> tuple[int, dict[str, Any]]:
        """Start ``count`` runs, cancel them all at once from ``threads`` threads (each with a publisher of its
        own), then observe every cancel. Returns the next unused fraction number and the burst's own figures."""
        runs = self.start(count, first_fraction=first_fraction)
        seen: dict[str, Any] = {"rss_kib_all_in_flight": self.worker.rss_kib()}
        local = threading.local()
        publishers: list[CancelPublisher] = []
        ready = threading.Barrier(threads, timeout=STEP_TIMEOUT_S)

        def connect() -> None:
            # One task per pool thread (the barrier holds each thread until all have one): each connects a
            # publisher of its own before the burst, so the burst times cancels, not connections.
            publisher = CancelPublisher(self._bench.settings)
            publishers.append(publisher)
            local.publisher = publisher
            publisher.publish("bench-warm-up")  # no run has this id
            ready.wait()

        def fire(run: InFlight) -> tuple[InFlight, float, float, CancelResult]:
            t0 = time.time()
            result = cancel_run(self._bench.store, local.publisher, run.run_id, reason="benchmark",
                                requested_by="bench.cancel_latency")
            return run, t0, time.time(), result

        pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="bench-cancel")
        try:
            for connected in [pool.submit(connect) for _ in range(threads)]:
                connected.result()
            fired = list(pool.map(fire, runs))
        finally:
            pool.shutdown(wait=True)
            for publisher in publishers:
                publisher.close()  # the threads are done: no publisher is in use any more
        # One bounded wait for all the segments to end; then each run's step is there, or never will be.
        self._wait_or_none(lambda: all("run_segment_ended" in self._seen.by_run[r.run_id] for r in runs),
                           STEP_TIMEOUT_S + 0.05 * count, f"the segments of {count} cancelled runs to end")
        for run, t0, returned, result in fired:
            self.samples.append(self.observe(run, t0, returned, result, timeout=0.5))
        first = min(t0 for _, t0, _, _ in fired)
        seen["burst_s"] = round(max(returned for _, _, returned, _ in fired) - first, 4)
        persisted = [s["t0"] + s["step_persisted"] for s in self.samples if s["step_persisted"] is not None]
        seen["last_step_persisted_s"] = round(max(persisted) - first, 4) if persisted else None
        seen["peak_rss_kib"] = self.worker.peak_rss_kib()
        return first_fraction + count, seen


class Load(threading.Thread):
    """Keeps ``outstanding`` quick runs (get-sum, echo, answer) queued or running while the cancels are
    measured, so the worker's event loop is busy the way a production worker's is. Off by default."""

    def __init__(self, bench: Bench, producer: Producer, server: ToolboxServer, outstanding: int) -> None:
        super().__init__(name="bench-load", daemon=True)
        self._bench = bench
        self._producer = producer
        self._server = server
        self._outstanding = outstanding
        self._stopping = threading.Event()
        self.completed = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        live: list[str] = []
        index = 0
        redis = self._bench.store.redis
        try:
            while not self._stopping.is_set():
                with redis.pipeline(transaction=False) as pipe:
                    for run_id in live:
                        pipe.hget(self._bench.store.run_key(run_id), "status")
                    statuses = pipe.execute()
                still = [r for r, s in zip(live, statuses, strict=True) if not RunStatus.parse(s).is_terminal]
                self.completed += len(live) - len(still)
                live = still
                while len(live) < self._outstanding:
                    live.append(self._producer.enqueue(quick_run_spec(self._server, index)).run_id)
                    index += 1
                self._stopping.wait(0.02)  # topping up, until stopped
        except BaseException as exc:
            self.error = exc

    def stop(self) -> None:
        self._stopping.set()
        if self.is_alive():
            self.join(10)


MEASURES = ("server_saw_cancel", "step_persisted")
BREAKDOWN = ("cancel_run_returned", "listener_acted", "call_interrupted", "server_saw_cancel", "step_persisted")
STAGES = (
    ("cancel_run returned (fence [+ confirm])", None, "cancel_run_returned"),
    ("→ listener/backstop acted", "cancel_run_returned", "listener_acted"),
    ("→ call interrupted on the loop", "listener_acted", "call_interrupted"),
    ("→ cancelled step persisted", "call_interrupted", "step_persisted"),
    ("→ server handler saw it", "call_interrupted", "server_saw_cancel"),
)
"""Per-cancel intervals (seconds between two of the sample's times; None = from t0)."""


def summarize(samples: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    found_by: dict[str, int] = defaultdict(int)
    outcomes: dict[str, int] = defaultdict(int)
    events: dict[str, int] = defaultdict(int)
    for sample in samples:
        found_by[str(sample["found_by"])] += 1
        outcomes[str(sample["tool_outcome"])] += 1
        events[str(sample["server_event"])] += 1
    stages = {}
    for label, start, end in STAGES:
        stages[label] = summary_ms(
            s[end] - (0.0 if start is None else s[start]) for s in samples
            if s[end] is not None and (start is None or s[start] is not None)
        )
    return {
        "n": len(samples),
        **{name: summary_ms(s[name] for s in samples if s[name] is not None) for name in BREAKDOWN},
        "stages": stages,
        "found_by": dict(found_by),
        "tool_outcomes": dict(outcomes),
        "server_events": dict(events),
        "steps_missing": sum(1 for s in samples if s["step_persisted"] is None),
        "segments_not_ended": sum(1 for s in samples if not s["segment_ended"]),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cancel_latency", description=__doc__.splitlines()[0])
    parser.add_argument("--cancels", type=int, default=200,
                        help="measured cancels per message/backstop phase (default 200)")
    parser.add_argument("--warmup", type=int, default=4,
                        help="cancels per message/backstop/in-flight phase not counted (default 4)")
    parser.add_argument("--concurrency", type=int, default=4, help="runs in flight per batch (default 4)")
    parser.add_argument("--threads", type=int, default=8, help="worker threads, message/backstop (default 8)")
    parser.add_argument("--poll-ms", type=int, default=250, help="RUNBRAKE_CANCEL_POLL_MS (default 250)")
    parser.add_argument("--phases", default=",".join(CLASSIC_PHASES + FRESH_WORKER_PHASES),
                        help="which phases, in order: message, backstop, in-flight, burst (default all four)")
    parser.add_argument("--load", type=int, default=0,
                        help="quick runs kept queued or running during the message/backstop cancels, to measure "
                             "under load (default 0: the clean measurement)")
    parser.add_argument("--many-threads", type=int, default=256,
                        help="worker threads of the in-flight and burst phases' workers (default 256)")
    parser.add_argument("--slow-s", type=float, default=120.0,
                        help="the slow call of the in-flight and burst phases, in seconds (default 120)")
    parser.add_argument("--in-flight", type=int, default=250, help="runs in flight in phase in-flight (default 250)")
    parser.add_argument("--in-flight-cancels", type=int, default=200,
                        help="measured cancels of phase in-flight, one at a time (default 200)")
    parser.add_argument("--no-top-up", dest="top_up", action="store_false",
                        help="phase in-flight: do not start a new run after each cancel (the count in flight "
                             "then shrinks by one per cancel)")
    parser.add_argument("--burst", type=int, default=200,
                        help="runs in flight in phase burst, all cancelled at once (default 200)")
    parser.add_argument("--burst-threads", type=int, default=32,
                        help="threads issuing the burst's cancels, each with its own publisher (default 32)")
    parser.add_argument("--keep-logs", action="store_true", help="keep the worker's log and the server's events")
    args = parser.parse_args(argv)
    phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    if not phases or set(phases) - set(CLASSIC_PHASES + FRESH_WORKER_PHASES) or len(set(phases)) != len(phases):
        parser.error("--phases takes message, backstop, in-flight and/or burst, each once")
    if args.concurrency + min(args.load, 1) > args.threads:
        parser.error("--concurrency (plus one thread for --load) cannot exceed --threads: a run waiting for a "
                     "thread is not in flight")
    if args.load and set(phases) & set(FRESH_WORKER_PHASES):
        parser.error("--load applies to the message and backstop phases only: leave in-flight and burst out")
    for phase, runs in (("in-flight", args.in_flight), ("burst", args.burst)):
        if phase in phases and runs > args.many_threads:
            parser.error(f"--{phase} cannot exceed --many-threads: a run waiting for a thread is not in flight")
    if not args.top_up and args.warmup + args.in_flight_cancels > args.in_flight:
        parser.error("with --no-top-up, --warmup + --in-flight-cancels cannot exceed --in-flight")
    if min(args.in_flight, args.in_flight_cancels, args.burst, args.burst_threads) < 1:
        parser.error("--in-flight, --in-flight-cancels, --burst and --burst-threads must be at least 1")

    configure_logging("WARNING")  # the producer's and the cancel's info lines would drown the result
    info = machine()
    env = {"RUNBRAKE_CANCEL_POLL_MS": str(args.poll_ms)}
    results: dict[str, Any] = {
        "benchmark": "cancel_latency",
        "machine": info,
        "command": " ".join(["python -m bench.cancel_latency", *(argv if argv is not None else sys.argv[1:])]),
        "worker_threads": args.threads,
        "cancel_poll_ms": args.poll_ms,
        "concurrency": args.concurrency,
        "warmup_per_phase": args.warmup,
        "load_outstanding_runs": args.load,
        "phases": {},
    }
    # Under --load the results go to their own file, beside the clean measurement's.
    with Bench("cancel_latency-load" if args.load else "cancel_latency", env=env, keep=args.keep_logs) as bench:
        print(f"namespace {bench.namespace}; starting the toolbox server…")
        server = bench.start_toolbox()
        producer, publisher = bench.producer_and_publisher()
        workers = Workers(bench, server, poll_ms=args.poll_ms)
        fraction = 1
        load: Load | None = None
        for name in phases:
            started = time.monotonic()
            if name in CLASSIC_PHASES:
                worker, observations = workers.get(args.threads, fresh=False)
                if args.load and load is None:
                    load = Load(bench, producer, server, args.load)
                    load.start()
                    bench.on_close(load.stop)
                before = worker.log_counts()
                record, measured, fraction = classic_phase(
                    Phase(name, bench, producer, publisher if name == "message" else None, server, worker,
                          observations, jitter_s=args.poll_ms / 1000), args, fraction)
            elif name == "in-flight":
                worker, observations = workers.get(args.many_threads, fresh=True)
                before = worker.log_counts()
                record, measured, fraction = in_flight_phase(
                    InFlightPhase(name, bench, producer, publisher, server, worker, observations,
                                  jitter_s=args.poll_ms / 1000, slow_s=args.slow_s), args, fraction)
            else:
                worker, observations = workers.get(args.many_threads, fresh=True)
                before = worker.log_counts()
                record, measured, fraction = burst_phase(
                    BurstPhase(name, bench, producer, publisher, server, worker, observations, jitter_s=0.0,
                               slow_s=args.slow_s), args, fraction)
            after = worker.log_counts()
            results["phases"][name] = {**record, "wall_s": round(time.monotonic() - started, 1),
                                       "worker_log": {key: after[key] - before[key] for key in after},
                                       **summarize(measured), "samples": measured}
        if load is not None:
            load.stop()
            if load.error is not None:
                raise load.error
            results["load_runs_completed"] = load.completed
        results["worker_peak_rss_mb"] = workers.peak_rss_mb()
        results["worker_log"] = workers.retire()
    results["worker_errors_logged"] = results["worker_log"]["errors"]
    # The backstop acts on the second poll that sees a cancel: at most two intervals, plus the interrupt itself.
    results["aim"] = {name: AIM.get(name, {"p99": 2 * args.poll_ms + 50.0}) for name in results["phases"]}
    results["aim_burst_delivered_by_message_pct"] = AIM_BURST_BY_MESSAGE_PCT
    results["aim_met"] = aims_met(results)
    results["correct"] = all(
        phase["tool_outcomes"] == {"cancelled": phase["n"]} and not phase["segments_not_ended"]
        for phase in results["phases"].values()
    )
    path = bench.write_results(results)
    print_results(results, str(path))
    return 0 if results["correct"] else 1


Measured = tuple[dict[str, Any], list[dict[str, Any]], int]
"""What a phase function returns: the phase's own figures, its measured samples, the next unused fraction."""


def classic_phase(phase: Phase, args: argparse.Namespace, fraction: int) -> Measured:
    """Phase message or backstop: batches of ``--concurrency`` runs, cancelled one at a time."""
    print(f"phase {phase.name}: {args.warmup} + {args.cancels} cancels, {args.concurrency} runs in flight…")
    fraction = phase.run(args.warmup + args.cancels, concurrency=args.concurrency, first_fraction=fraction)
    record = {"cancel": "cancel_run(store, publisher, …)" if phase.name == "message" else "cancel_run(store, None, …)",
              "worker_threads": args.threads, "runs_in_flight": args.concurrency,
              "worker_peak_rss_mb": _mb(phase.worker.peak_rss_kib())}
    return record, phase.samples[args.warmup:], fraction


def in_flight_phase(phase: InFlightPhase, args: argparse.Namespace, fraction: int) -> Measured:
    """Phase in-flight: ``--in-flight`` runs in slow calls, cancelled one at a time (topped up)."""
    print(f"phase in-flight: {args.in_flight} runs in slow({args.slow_s:g} s) on one worker, then {args.warmup} + "
          f"{args.in_flight_cancels} cancels one at a time{', topped up after each' if args.top_up else ''}…")
    fraction, seen = phase.run_in_flight(args.in_flight, args.in_flight_cancels, warmup=args.warmup,
                                         top_up=args.top_up, first_fraction=fraction)
    record = {"cancel": "cancel_run(store, publisher, …), one at a time", "worker_threads": args.many_threads,
              "runs_in_flight": args.in_flight, "slow_s": args.slow_s, "top_up": args.top_up,
              "in_flight_at_cancel": seen["in_flight_at_cancel"],
              "worker_rss_mb_all_in_flight": _mb(seen["rss_kib_all_in_flight"]),
              "worker_peak_rss_mb_all_in_flight": _mb(seen["peak_rss_kib_all_in_flight"]),
              "worker_peak_rss_mb": _mb(seen["peak_rss_kib_after_cancels"])}
    return record, phase.samples[args.warmup:], fraction


def burst_phase(phase: BurstPhase, args: argparse.Namespace, fraction: int) -> Measured:
    """Phase burst: ``--burst`` runs in slow calls, all cancelled at once from ``--burst-threads`` threads."""
    print(f"phase burst: {args.burst} runs in slow({args.slow_s:g} s) on one worker, then all cancelled at once "
          f"from {args.burst_threads} threads…")
    fraction, seen = phase.run_burst(args.burst, threads=args.burst_threads, first_fraction=fraction)
    measured = phase.samples
    by_message = sum(1 for s in measured if s["found_by"] == "cancel_message_delivered")
    record = {"cancel": f"cancel_run(store, publisher, …) from {args.burst_threads} threads at once",
              "worker_threads": args.many_threads, "runs_in_flight": args.burst, "slow_s": args.slow_s,
              "cancel_threads": args.burst_threads, "burst_s": seen["burst_s"],
              "last_step_persisted_s": seen["last_step_persisted_s"],
              "delivered_by_message": by_message,
              "delivered_by_message_pct": round(100 * by_message / len(measured), 2),
              "messages_unconfirmed": sum(1 for s in measured if s["message_confirmed"] is not True),
              "worker_rss_mb_all_in_flight": _mb(seen["rss_kib_all_in_flight"]),
              "worker_peak_rss_mb": _mb(seen["peak_rss_kib"])}
    return record, measured, fraction


class Workers:
    """The one worker process of the moment. Two would share the run queue, and each phase's numbers are one
    worker's: a phase that needs another thread count, or a fresh worker, gets the old one stopped first."""

    def __init__(self, bench: Bench, server: ToolboxServer, *, poll_ms: int) -> None:
        self._bench = bench
        self._server = server
        self._poll_ms = poll_ms
        self._current: tuple[Worker, Observations] | None = None
        self._threads = 0
        self._retired: dict[str, int] = {}

    def get(self, threads: int, *, fresh: bool) -> tuple[Worker, Observations]:
        """The worker with ``threads`` threads (and what its log and the server's events say); a new one when
        ``fresh``, when there is none, or when the current one has another thread count."""
        if self._current is not None and not fresh and self._threads == threads:
            return self._current
        self.retire()
        print(f"starting a worker (--threads {threads}, RUNBRAKE_CANCEL_POLL_MS={self._poll_ms})…")
        worker = self._bench.start_worker(concurrency=threads)
        self._current, self._threads = (worker, Observations(self._server.events, worker.log)), threads
        return self._current

    def peak_rss_mb(self) -> float | None:
        """The current worker's peak RSS (VmHWM)."""
        return None if self._current is None else _mb(self._current[0].peak_rss_kib())

    def retire(self) -> dict[str, int]:
        """Stop the current worker (SIGTERM: it interrupts what it still runs); the log counts of every worker
        retired so far."""
        if self._current is not None:
            worker = self._current[0]
            worker.process.stop()
            for key, value in worker.log_counts().items():
                self._retired[key] = self._retired.get(key, 0) + value
            self._current = None
        return dict(self._retired) or {"errors": 0}


def _mb(kib: int | None) -> float | None:
    return None if kib is None else round(kib / 1024, 1)


def aims_met(results: Mapping[str, Any]) -> dict[str, dict[str, bool]]:
    met: dict[str, dict[str, bool]] = {}
    for name, phase in results["phases"].items():
        met[name] = {}
        for measure in MEASURES:
            summary = phase[measure]
            for stat, bound in results["aim"][name].items():
                met[name][f"{measure}.{stat}"] = summary.get(stat, float("inf")) <= bound
        if "delivered_by_message_pct" in phase:
            met[name]["delivered_by_message_pct"] = (
                phase["delivered_by_message_pct"] >= results["aim_burst_delivered_by_message_pct"]
            )
    return met


def print_results(results: Mapping[str, Any], path: str) -> None:
    poll = results["cancel_poll_ms"]
    phases = results["phases"]
    print()
    print("== runbrake cancel latency ==")
    print_machine(results["machine"])
    print(f"one worker process at a time, RUNBRAKE_CANCEL_POLL_MS={poll}; toolbox MCP server over streamable HTTP on "
          "loopback; each run in one slow call when cancelled")
    for name, phase in phases.items():
        health = ", ".join(f"{count} {what.replace('_', ' ')}" for what, count in phase["worker_log"].items() if count)
        print(f"  {name:<9} worker {phase['worker_threads']} threads, {phase['runs_in_flight']} runs in flight: "
              f"{phase['cancel']}{f'; WORKER LOG: {health}' if health else ''}")
    if results["load_outstanding_runs"]:
        print(f"UNDER LOAD: {results['load_outstanding_runs']} quick runs (get-sum, echo) kept queued or running "
              f"meanwhile; {results.get('load_runs_completed')} completed")
    print("times in ms from t0 (time.time() just before cancel_run) to:")
    print(f"  {'phase':<9} {'measure':<36} {'n':>4} {'p50':>8} {'p95':>8} {'p99':>8} {'max':>8}   aim")
    labels = {"server_saw_cancel": "server handler saw the cancellation", "step_persisted": "cancelled step persisted"}
    for name, phase in phases.items():
        for measure in MEASURES:
            s = phase[measure]
            if not s.get("n"):
                print(f"  {name:<9} {labels[measure]:<36} {0:>4}")
                continue
            aims = results["aim"][name]
            aim = ", ".join(
                f"{stat} ≤ {bound:g} {'met' if results['aim_met'][name][f'{measure}.{stat}'] else 'NOT met'}"
                for stat, bound in aims.items()
            )
            print(f"  {name:<9} {labels[measure]:<36} {s['n']:>4} {s['p50']:>8.1f} {s['p95']:>8.1f} "
                  f"{s['p99']:>8.1f} {s['max']:>8.1f}   {aim}")
    print("where the time goes, per cancel (ms; the interval between two of the cancel's own times):")
    print(f"  {'phase':<9} {'stage':<38} {'p50':>8} {'p95':>8} {'p99':>8} {'max':>8}")
    for name, phase in phases.items():
        for label, stage in phase["stages"].items():
            if stage.get("n"):
                print(f"  {name:<9} {label:<38} {stage['p50']:>8.2f} {stage['p95']:>8.2f} {stage['p99']:>8.2f} "
                      f"{stage['max']:>8.2f}")
        print(f"  {name:<9} found by {phase['found_by']}; tool outcomes {phase['tool_outcomes']}; "
              f"server events {phase['server_events']}")
        if phase["steps_missing"] or phase["segments_not_ended"]:
            print(f"  {name:<9} NOT CORRECT: {phase['steps_missing']} cancelled step(s) never persisted, "
                  f"{phase['segments_not_ended']} segment(s) never ended (see the worker's log)")
    if "in-flight" in phases:
        phase = phases["in-flight"]
        at_cancel = phase["in_flight_at_cancel"]
        print(f"in-flight: {at_cancel['min']}–{at_cancel['max']} runs in flight at each cancel; worker RSS with all "
              f"{phase['runs_in_flight']} in flight {phase['worker_rss_mb_all_in_flight']} MB, peak (VmHWM) "
              f"{phase['worker_peak_rss_mb_all_in_flight']} MB then, {phase['worker_peak_rss_mb']} MB after the "
              "cancels")
    if "burst" in phases:
        phase = phases["burst"]
        met = results["aim_met"]["burst"]["delivered_by_message_pct"]
        last = phase["last_step_persisted_s"]
        print(f"burst: {phase['n']} cancels issued in {1000 * phase['burst_s']:.1f} ms from {phase['cancel_threads']} "
              f"threads, the last step persisted {'–' if last is None else f'{1000 * last:.1f}'} ms after the first "
              f"cancel; delivered by the message {phase['delivered_by_message']}/{phase['n']} = "
              f"{phase['delivered_by_message_pct']} % (aim ≥ {results['aim_burst_delivered_by_message_pct']:g} %: "
              f"{'met' if met else 'NOT met'}); {phase['messages_unconfirmed']} cancel message(s) not confirmed; "
              f"worker RSS with all in flight {phase['worker_rss_mb_all_in_flight']} "
              f"MB, peak {phase['worker_peak_rss_mb']} MB")
    print(f"the alternatives (their documented mechanisms, not measured here; this run's backstop polls every "
          f"{poll} ms):")
    for name, bound in ALTERNATIVES:
        print(f"  {name:<18} {bound}")
    if results.get("worker_errors_logged"):
        print(f"worker logged {results['worker_errors_logged']} error line(s); rerun with --keep-logs to read them")
    print(f"results: {path}")


if __name__ == "__main__":
    sys.exit(main())
