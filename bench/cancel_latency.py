"""Cancel latency: from the cancel call to the MCP server's handler seeing the cancellation, and to the
cancelled tool step being persisted; through the cancel message, and through the backstop alone.

Run from the repository root::

    .venv/bin/python -m bench.cancel_latency [--cancels 200] [--concurrency 4] [--poll-ms 250]

What it does, in its own namespace (``bench-<hex>``), on loopback only:

1. starts the example toolbox MCP server over HTTP (writing its events file) and one worker process
   (``python -m runbrake.worker --threads 8``, ``RUNBRAKE_CANCEL_POLL_MS=250``, its JSON log to a file);
2. per phase, in batches of ``--concurrency`` runs: enqueues runs whose first turn calls
   ``slow(seconds=30 + a unique fraction)`` (the fraction tells the server's events apart), waits
   until the server has written "started" for every one of them (the calls are in flight), then
   cancels them one at a time; each cancel waits for the server's "cancelled" event, the cancelled
   tool step in the store and the run's ``run_segment_ended`` log line before the next begins, so
   one cancel never overlaps another or a run's start;
3. phase **message**: ``cancel_run(store, publisher, run_id, …)`` (fence + cancel message);
   phase **backstop**: ``cancel_run(store, None, run_id, …)`` (fence only: the worker's backstop,
   one MGET every poll interval, has to find it);
4. t0 = ``time.time()`` right before ``cancel_run``; measured: the server's "cancelled" event
   (its ``t``) and the tool step's ``recorded_at``; the worker's log lines
   (``cancel_message_delivered`` / ``cancel_found_by_backstop``, ``call_interrupted``) give the
   steps in between;
5. prints the table (with the bounds of the alternatives beside it), writes
   ``bench/results/cancel_latency.json``, and cleans up.
"""

from __future__ import annotations

import argparse
import random
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from bench._harness import (
    SERVER_NAME,
    Bench,
    BenchError,
    JsonLines,
    ToolboxServer,
    Worker,
    log_time,
    machine,
    print_machine,
    quick_run_spec,
    summary_ms,
    wait_until,
)
from runbrake.broker.cancel import CancelPublisher, cancel_run
from runbrake.broker.producer import Producer
from runbrake.broker.rabbitmq import build_broker
from runbrake.shared.logging import configure_logging
from runbrake.shared.spec import RunSpec
from runbrake.shared.status import RunStatus
from runbrake.shared.steps import RunStep, StepKind

SLOW_SECONDS = 30.0
STEP_TIMEOUT_S = 10.0
"""Bound on each wait of one cancel (the call itself would run 30 s)."""
START_TIMEOUT_S = 30.0
SERVER_GRACE_S = 3.0
"""How long after the run's segment ended the server still gets to write its end event of the call."""

AIM = {"message": {"p50": 10.0, "p99": 50.0}}
ALTERNATIVES = (
    ("dramatiq-abort", "its watcher BLPOPs the abort keys of the messages running when a cycle starts, 1 s per "
                       "cycle (wait_timeout=1000 ms): a message that started since waits up to 1 s; abort key "
                       "TTL 90 s; the abort is an exception raised in the worker thread, which cannot interrupt "
                       "a blocking system call"),
    ("PHP system (seeds)", "polls for the cancel once a second: up to ~1000 ms"),
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


def slow_spec(server: ToolboxServer, seconds: float) -> RunSpec:
    """A run whose first turn calls slow(seconds); it is cancelled long before a second turn."""
    return RunSpec.parse({
        "input": "cancel latency",
        "model": {"provider": "scripted", "turns": [
            {"tool_calls": [{"server": SERVER_NAME, "tool": "slow", "arguments": {"seconds": seconds}}]},
            {"content": "not reached"},
        ]},
        "mcp_servers": {SERVER_NAME: server.server_spec()},
        "tool_timeout_s": 120,
    })


class Phase:
    """One phase: batches of runs in flight, cancelled one at a time; one sample per cancel."""

    def __init__(
        self, name: str, bench: Bench, producer: Producer, publisher: CancelPublisher | None,
        server: ToolboxServer, worker: Worker, observations: Observations, *, jitter_s: float,
    ) -> None:
        self.name = name
        self._jitter_s = jitter_s
        self._random = random.Random(name)
        self._bench = bench
        self._producer = producer
        self._publisher = publisher
        self._server = server
        self._worker = worker
        self._seen = observations
        self.samples: list[dict[str, Any]] = []

    def run(self, count: int, *, concurrency: int, first_fraction: int) -> int:
        """Take ``count`` samples; returns the next unused fraction number."""
        fraction = first_fraction
        while len(self.samples) < count:
            batch = []
            for _ in range(min(concurrency, count - len(self.samples))):
                seconds = SLOW_SECONDS + fraction / 10_000
                fraction += 1
                run_id = self._producer.enqueue(slow_spec(self._server, seconds)).run_id
                batch.append((run_id, seconds))
            self._wait(lambda batch=batch: all(_key(s) in self._seen.started for _, s in batch),
                       START_TIMEOUT_S, f"{len(batch)} slow calls to start on the server")
            for run_id, seconds in batch:
                self.samples.append(self._cancel(run_id, seconds))
        return fraction

    def _wait(self, condition: Any, timeout: float, what: str) -> Any:
        def check() -> Any:
            self._seen.refresh()
            return condition()

        return wait_until(check, timeout=timeout, what=what, interval=0.002, alive=[self._worker.process])

    def _cancel(self, run_id: str, seconds: float) -> dict[str, Any]:
        store = self._bench.store
        call = self._seen.started[_key(seconds)]["call"]
        # A random moment within one poll interval: the cancels must not fall in step with the backstop's
        # timer (back to back, each would come just after a poll and wait nearly a whole interval).
        time.sleep(self._random.uniform(0, self._jitter_s))
        t0 = time.time()
        result = cancel_run(store, self._publisher, run_id, reason="benchmark", requested_by="bench.cancel_latency")
        returned = time.time()
        if not result.won:
            raise BenchError(f"the cancel of run {run_id} did not win the fence: found {result.found.value}")

        def tool_step() -> RunStep | None:
            return next((s for s in store.get(run_id).steps if s.kind is StepKind.TOOL), None)

        step: RunStep = self._wait(tool_step, STEP_TIMEOUT_S, f"the tool step of run {run_id}")
        self._wait(lambda: "run_segment_ended" in self._seen.by_run[run_id], STEP_TIMEOUT_S,
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
            "tool_outcome": None if step.tool_outcome is None else step.tool_outcome.value,
            "found_by": None if listener is None else listener["event"],
            "message_confirmed": result.message_confirmed,
            "t0": t0,
            # seconds after t0:
            "cancel_run_returned": returned - t0,
            "listener_acted": None if listener is None else log_time(listener) - t0,
            "call_interrupted": None if interrupted is None else log_time(interrupted) - t0,
            "server_saw_cancel": None if ended is None or ended["event"] != "cancelled" else ended["t"] - t0,
            "step_persisted": step.recorded_at - t0,
        }


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
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.cancel_latency", description=__doc__.splitlines()[0])
    parser.add_argument("--cancels", type=int, default=200, help="measured cancels per phase (default 200)")
    parser.add_argument("--warmup", type=int, default=4, help="cancels per phase not counted (default 4)")
    parser.add_argument("--concurrency", type=int, default=4, help="runs in flight per batch (default 4)")
    parser.add_argument("--threads", type=int, default=8, help="worker threads (default 8)")
    parser.add_argument("--poll-ms", type=int, default=250, help="RUNBRAKE_CANCEL_POLL_MS (default 250)")
    parser.add_argument("--phases", default="message,backstop", help="which phases, in order (default both)")
    parser.add_argument("--load", type=int, default=0,
                        help="quick runs kept queued or running during the cancels, to measure under load "
                             "(default 0: the clean measurement)")
    parser.add_argument("--keep-logs", action="store_true", help="keep the worker's log and the server's events")
    args = parser.parse_args(argv)
    phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    if not phases or set(phases) - {"message", "backstop"}:
        parser.error("--phases takes message and/or backstop")
    if args.concurrency + min(args.load, 1) > args.threads:
        parser.error("--concurrency (plus one thread for --load) cannot exceed --threads: a run waiting for a "
                     "thread is not in flight")

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
        print(f"namespace {bench.namespace}; starting the toolbox server and a worker "
              f"(--threads {args.threads}, RUNBRAKE_CANCEL_POLL_MS={args.poll_ms})…")
        server = bench.start_toolbox()
        worker = bench.start_worker(threads=args.threads)
        broker = build_broker(bench.settings)
        bench.on_close(broker.close)
        producer = Producer(bench.store, broker)
        publisher = CancelPublisher(bench.settings)
        bench.on_close(publisher.close)
        publisher.publish("bench-warm-up")  # connects and declares the exchange; no run has this id
        observations = Observations(server.events, worker.log)
        fraction = 1
        load = Load(bench, producer, server, args.load) if args.load else None
        if load is not None:
            load.start()
            bench.on_close(load.stop)
        for name in phases:
            print(f"phase {name}: {args.warmup} + {args.cancels} cancels, {args.concurrency} runs in flight…")
            phase = Phase(name, bench, producer, publisher if name == "message" else None, server, worker,
                          observations, jitter_s=args.poll_ms / 1000)
            started = time.monotonic()
            fraction = phase.run(args.warmup + args.cancels, concurrency=args.concurrency, first_fraction=fraction)
            measured = phase.samples[args.warmup:]
            results["phases"][name] = {
                "cancel": "cancel_run(store, publisher, …)" if name == "message" else "cancel_run(store, None, …)",
                "wall_s": round(time.monotonic() - started, 1),
                **summarize(measured),
                "samples": measured,
            }
        if load is not None:
            load.stop()
            if load.error is not None:
                raise load.error
            results["load_runs_completed"] = load.completed
        worker.log.read_new()
        results["worker_errors_logged"] = sum(1 for e in worker.log.entries if e.get("level") in {"error", "critical"})
        results["worker_peak_rss_mb"] = round((worker.peak_rss_kib() or 0) / 1024, 1)
    results["aim"] = {"message": AIM["message"], "backstop": {"p99": args.poll_ms + 50.0}}
    results["aim_met"] = aims_met(results)
    path = bench.write_results(results)
    print_results(results, str(path))
    return 0


def aims_met(results: Mapping[str, Any]) -> dict[str, dict[str, bool]]:
    met: dict[str, dict[str, bool]] = {}
    for name, phase in results["phases"].items():
        met[name] = {}
        for measure in MEASURES:
            summary = phase[measure]
            for stat, bound in results["aim"][name].items():
                met[name][f"{measure}.{stat}"] = summary.get(stat, float("inf")) <= bound
    return met


def print_results(results: Mapping[str, Any], path: str) -> None:
    poll = results["cancel_poll_ms"]
    print()
    print("== runbrake cancel latency ==")
    print_machine(results["machine"])
    print(f"worker: 1 process, {results['worker_threads']} threads, RUNBRAKE_CANCEL_POLL_MS={poll}; toolbox MCP "
          f"server over streamable HTTP on loopback; slow(30 s) in flight; {results['concurrency']} runs in flight, "
          "cancelled one at a time")
    if results["load_outstanding_runs"]:
        print(f"UNDER LOAD: {results['load_outstanding_runs']} quick runs (get-sum, echo) kept queued or running "
              f"meanwhile; {results.get('load_runs_completed')} completed")
    print("times in ms from t0 (time.time() just before cancel_run) to:")
    print(f"  {'phase':<9} {'measure':<36} {'n':>4} {'p50':>8} {'p95':>8} {'p99':>8} {'max':>8}   aim")
    labels = {"server_saw_cancel": "server handler saw the cancellation", "step_persisted": "cancelled step persisted"}
    for name, phase in results["phases"].items():
        for measure in MEASURES:
            s = phase[measure]
            aims = results["aim"][name]
            aim = ", ".join(
                f"{stat} ≤ {bound:g} {'met' if results['aim_met'][name][f'{measure}.{stat}'] else 'NOT met'}"
                for stat, bound in aims.items()
            )
            print(f"  {name:<9} {labels[measure]:<36} {s['n']:>4} {s['p50']:>8.1f} {s['p95']:>8.1f} "
                  f"{s['p99']:>8.1f} {s['max']:>8.1f}   {aim}")
    print("where the time goes, per cancel (ms; the interval between two of the cancel's own times):")
    print(f"  {'phase':<9} {'stage':<38} {'p50':>8} {'p95':>8} {'p99':>8} {'max':>8}")
    for name, phase in results["phases"].items():
        for label, stage in phase["stages"].items():
            if stage.get("n"):
                print(f"  {name:<9} {label:<38} {stage['p50']:>8.2f} {stage['p95']:>8.2f} {stage['p99']:>8.2f} "
                      f"{stage['max']:>8.2f}")
        print(f"  {name:<9} found by {phase['found_by']}; tool outcomes {phase['tool_outcomes']}; "
              f"server events {phase['server_events']}")
    print(f"the alternatives (their documented mechanisms, not measured here; this run's backstop polls every "
          f"{poll} ms):")
    for name, bound in ALTERNATIVES:
        print(f"  {name:<18} {bound}")
    if results.get("worker_errors_logged"):
        print(f"worker logged {results['worker_errors_logged']} error line(s); rerun with --keep-logs to read them")
    print(f"results: {path}")


if __name__ == "__main__":
    sys.exit(main())
