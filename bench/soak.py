"""A soak: mixed load for ``--minutes`` (60 for the real one), sampled, with a pass/fail verdict (issue 21, item 4).

Run from the repository root::

    .venv/bin/python -m bench.soak --minutes 60 --plot docs/soak.png
    .venv/bin/python -m bench.soak --replot bench/results/soak.json --plot docs/soak.png

In a namespace of its own on the machine's Redis and RabbitMQ (deleted afterwards), with a short
``RUNBRAKE_RETENTION_S`` and a 1 s ``RUNBRAKE_DRAIN_S``, it starts the example toolbox MCP server, two
worker processes (``python -m runbrake.worker``: a *steady* one that lives the whole soak and a *rolling*
one restarted by SIGTERM every sixth of the soak by default, 10 minutes in the hour (``--restarts``), so
its runs in flight are handed over, docs/leases.md, "Drain and hand-over"), and ``runbrake serve``
with one events client reading ``GET /v1/events``. It enqueues ``--rate`` runs a second (5) in a fixed
cycle of twelve shapes:

- ``quick`` ×4: get-sum, echo, answer (completed);
- ``long`` ×2: an 8 s ``slow`` call (completed; handed over when its worker restarts);
- ``cancel`` ×2: a 60 s ``slow`` call, cancelled once the server has started it (cancelled);
- ``approve`` / ``deny`` ×1 each: get-sum needs an approval, given or refused (completed / failed);
- ``steered`` ×1: a 60 s ``slow`` call, steered once the server has started it: the call is cut off, the
  run goes on with the new message to its answer (completed);
- ``budgeted`` ×1: a 60 s ``slow`` call under a 2 s ``budget.deadline_s``: stopped by the deadline
  (cancelled, ``deadline_exceeded``).

Every ``--sample-s`` (30 s in the hour, 10 s below 30 minutes) it samples each process's RSS, open file
descriptors and CPU time (/proc), Redis (``INFO memory`` used_memory: the whole server, which other users
share; the namespace's own key count and summed ``MEMORY USAGE``, by kind; and the same without the runs the
sweepers are about to delete: :func:`redis_sample`), the queue depths (passive ``queue_declare``:
RabbitMQ's management plugin is not assumed), and each worker's event-loop lag as its
``/healthz`` reports it (how long a no-op scheduled on the loop took to run, worker/health.py).

Pass when every criterion holds (the JSON summary names each, and the exit code is 1 when one fails):
every run ended terminal (none stuck) with its shape's expected status; every restart handed over at
least one run and exited 0; no process died; no run message dead-lettered; the growth after the first
sixth of the soak (at least 90 s: ``Plan.warmup_s``) — the rise of a least-squares line through the
samples from then to the end, over its value at the start — is at most 5 % of RSS for each process that
lives the whole soak, and at most 10 % of the namespace's Redis memory and key count without the runs being
swept (the steady figures: the whole namespace saws with the sweeps, which a sample every 30 s aliases); and
the open file descriptors left once every run has ended are at most 3 or 10 % (the larger) above the most seen
during the warm-up (they follow the calls in flight, which follow the machine's load).

``--memory-dir DIR`` runs each worker under bench/_memtrace.py, which writes at every sample what its heap
holds (glibc's ``mallinfo2``: bytes in use and freed-but-held, its arenas; pymalloc's blocks handed out; the
objects the collector tracks) to ``DIR/<pid>.jsonl``: a leak grows the memory in use, the allocator holding
freed memory does not (docs/benchmarks.md, "Soak: the RSS growth"). It costs milliseconds a sample, so the
hour runs with it. ``--tracemalloc`` adds tracemalloc's top growing tracebacks, for short runs only (it
slows a worker severalfold); ``--garbage`` the types of the cyclic garbage (what a full collection at the
sample frees).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx2
import pika
import pika.exceptions

from bench._harness import (
    RESULTS_DIR,
    SERVER_NAME,
    Bench,
    BenchError,
    JsonLines,
    ManagedProcess,
    Worker,
    free_port,
    machine,
    percentile,
    print_machine,
)
from bench.api import start_api
from runbrake.shared import operations
from runbrake.shared.errors import RunbrakeError, TransitionRefused
from runbrake.shared.logging import configure_logging
from runbrake.shared.messaging.cancel import CancelPublisher
from runbrake.shared.messaging.producer import Producer
from runbrake.shared.messaging.rabbitmq import build_broker
from runbrake.shared.messaging.wire import Topology
from runbrake.shared.spec import RunSpec
from runbrake.shared.status import RunStatus
from runbrake.worker.retention import sweep_interval_s

CYCLE = ("quick", "long", "quick", "cancel", "approve", "steered", "quick", "long", "quick", "cancel", "deny",
         "budgeted")
"""The shapes, in the order they are sent; run *i* has shape ``CYCLE[i % 12]``."""
EXPECTED = {"quick": RunStatus.COMPLETED, "long": RunStatus.COMPLETED, "cancel": RunStatus.CANCELLED,
            "approve": RunStatus.COMPLETED, "deny": RunStatus.FAILED, "steered": RunStatus.COMPLETED,
            "budgeted": RunStatus.CANCELLED}
LONG_S = 8.0
CANCEL_CALL_S = 60.0
"""The ``slow`` call of the shapes a cancel, a steer or a deadline ends."""
DEADLINE_S = 2.0
"""The ``budgeted`` shape's ``budget.deadline_s``."""
SLOW_SHAPES = ("long", "cancel", "steered", "budgeted")
WORKER_CONCURRENCY = 32
DRAIN_S = 1
WORKER_START_TIMEOUT_S = 120.0
"""A worker's start (imports, connections, its first log line) took over 30 s on a 2-core machine shared by
several test runs."""
POLL_S = 1.0
"""How often the run statuses are read (well under the retention, so no finished run is swept unseen)."""
SETTLE_TIMEOUT_S = 120.0
"""After the last run is sent, how long the runs still live may take before they count as stuck."""
RSS_GROWTH_MAX = 0.05
FD_RISE_MAX = 3.0
FD_GROWTH_MAX = 0.10
"""Open descriptors follow the calls in flight (an MCP session each), and those follow the machine's load, so
"flat" compares what is left open once every run has ended (the last sample) with the most seen during the
warm-up: at most 3 or 10 % more, the larger. A leak is what stays after the calls end."""
REDIS_GROWTH_MAX = 0.10
LIFELONG = ("toolbox", "serve", "worker_steady")
"""The processes that live the whole soak: the growth criteria are theirs (the rolling worker restarts)."""
LOOP_ANSWER = re.compile(r"answered in ([0-9.]+) ms")
"""The detail of /healthz's event_loop check (worker/health.py, ``event_loop_check``)."""
WORKERS = ("worker_steady", "worker_rolling")


@dataclass(frozen=True)
class Plan:
    """The soak's length and the intervals derived from it."""

    minutes: float
    rate: float
    sample_s: float
    retention_s: int
    restarts: int = 5

    @classmethod
    def of(cls, minutes: float, rate: float, sample_s: float | None, restarts: int = 5) -> Plan:
        # The retention must end well inside the first sixth, so the namespace's memory has levelled off
        # by the time the growth is measured: a third of the sixth, from 5 s to 60 s.
        retention = int(min(60.0, max(5.0, minutes * 60 / 18)))
        return cls(minutes, rate, sample_s or (30.0 if minutes >= 30 else 10.0), retention, restarts)

    @property
    def duration_s(self) -> float:
        return self.minutes * 60

    @property
    def sixth_s(self) -> float:
        return self.duration_s / 6

    @property
    def warmup_s(self) -> float:
        """Where the growth is measured from: the first sixth, but at least 90 s (at most half the soak).

        A worker's RSS rises over its first minute or two as its pools and caches fill, the more so when it
        takes the rolling worker's share during a restart (a 3-minute soak: 112 MB at 30 s, 120 MB from
        100 s on, flat after); the first sixth of a short soak is inside that rise."""
        return max(self.sixth_s, min(self.duration_s / 2, 90.0))

    @property
    def total_runs(self) -> int:
        return int(self.duration_s * self.rate)

    @property
    def restart_every_s(self) -> float:
        return self.duration_s / (self.restarts + 1)

    @property
    def restarts_at(self) -> list[float]:
        """Seconds into the soak of each restart of the rolling worker: evenly spaced (by default every
        sixth), the last before the end. One that comes due while the previous is still going waits for it."""
        return [self.restart_every_s * k for k in range(1, self.restarts + 1)]


# -- the runs ------------------------------------------------------------------------------------


def slow_seconds(shape: str, index: int) -> float:
    """The length of run ``index``'s ``slow`` call, unique to the run: the toolbox server's events name a call by
    its arguments, and a micro-second per index tells the runs apart."""
    return (LONG_S if shape == "long" else CANCEL_CALL_S) + index / 1e6


def spec_for(shape: str, index: int) -> RunSpec:
    """The run spec of run ``index``.

    A ``cancel`` run calls ``slow`` twice: a run handed over before its cancel came resumes with the second
    call, which is then cancelled (with one call it would go on to its answer and complete). So does a
    ``budgeted`` one: handed over before its deadline, it resumes with a call the deadline cuts off."""
    if shape in SLOW_SHAPES:
        call = {"server": SERVER_NAME, "tool": "slow", "arguments": {"seconds": slow_seconds(shape, index)}}
        turns: list[dict[str, Any]] = [{"tool_calls": [call]}, {"content": "done"}]
        if shape in ("cancel", "budgeted"):
            turns.insert(0, {"tool_calls": [call]})
        elif shape == "steered":
            turns.append({"content": "done"})  # steered in its answer's round (just handed over), it answers again
    else:
        turns = [{"tool_calls": [{"server": SERVER_NAME, "tool": "get-sum", "arguments": {"a": index, "b": 1}}]},
                 {"tool_calls": [{"server": SERVER_NAME, "tool": "echo", "arguments": {"text": f"soak {index}"}}]},
                 {"content": "done"}]
    raw: dict[str, Any] = {"input": f"soak {shape} {index}", "model": {"provider": "scripted", "turns": turns},
                           "mcp_servers": [SERVER_NAME]}
    if shape in ("approve", "deny"):
        raw["approval_required"] = [f"{SERVER_NAME}.get-sum"]
    if shape == "budgeted":
        raw["budget"] = {"deadline_s": DEADLINE_S}
    return RunSpec.parse(raw)


@dataclass
class Run:
    index: int
    shape: str
    run_id: str
    status: RunStatus = RunStatus.QUEUED
    reason: str = ""
    segments: int = 1
    decided: bool = False
    cancel_sent: bool = False
    steered: bool = False


@dataclass
class Tracker:
    """Every run sent, read back from Redis every poll until terminal; decides approvals, cancels started calls."""

    bench: Bench
    producer: Producer
    publisher: CancelPublisher
    server_events: JsonLines
    runs: dict[str, Run] = field(default_factory=dict)
    live: set[str] = field(default_factory=set)
    by_seconds: dict[float, Run] = field(default_factory=dict)
    slow_started: dict[str, float] = field(default_factory=dict)
    """When the server started each run's ``slow`` call (epoch s), by run id."""
    vanished: list[str] = field(default_factory=list)
    """Runs whose record was gone before a terminal status was read (swept by retention unseen)."""
    refused: Counter[str] = field(default_factory=Counter)
    steers_refused: Counter[str] = field(default_factory=Counter)
    """Steers refused by the status the run was found in (handed over between the call's start and the steer:
    such a run resumes with its answer)."""
    lock: threading.Lock = field(default_factory=threading.Lock)
    """Held by each method: the restart thread reads what the producer loop writes."""

    def add(self, index: int, shape: str, run_id: str) -> None:
        run = Run(index, shape, run_id)
        with self.lock:
            self.runs[run_id] = run
            self.live.add(run_id)
            if shape in SLOW_SHAPES:
                self.by_seconds[slow_seconds(shape, index)] = run

    def poll(self) -> None:
        """Cancel the calls the server started, read every live run's status, decide the approvals."""
        with self.lock:
            self._cancel_started()
            self._read_statuses()

    def long_run_in_flight(self, owner_prefix: str, *, min_left_s: float) -> bool:
        """Whether a ``long`` run owned by ``owner_prefix`` is in its ``slow`` call with ``min_left_s`` to go."""
        with self.lock:
            self._cancel_started()
            candidates = [run_id for run_id, started in self.slow_started.items()
                          if self.runs[run_id].shape == "long" and run_id in self.live
                          and time.time() - started < LONG_S - min_left_s]
            with self.bench.store.redis.pipeline(transaction=False) as pipe:
                for run_id in candidates:
                    pipe.hget(self.bench.store.run_key(run_id), "owner")
                owners = pipe.execute()
        return any(str(owner or "").startswith(owner_prefix) for owner in owners)

    def _cancel_started(self) -> None:
        for event in self.server_events.read_new():
            run = self.by_seconds.get(event.get("args", {}).get("seconds"))
            if run is not None and event.get("event") == "started":
                self.slow_started[run.run_id] = float(event["t"])
                if run.shape == "cancel":
                    self._cancel(run)
                elif run.shape == "steered":
                    self._steer(run)

    def _read_statuses(self) -> None:
        ids = sorted(self.live)
        store = self.bench.store
        with store.redis.pipeline(transaction=False) as pipe:
            for run_id in ids:
                pipe.hmget(store.run_key(run_id), ["status", "termination_reason", "segments"])
            answers = pipe.execute()
        for run_id, (status, reason, segments) in zip(ids, answers, strict=True):
            run = self.runs[run_id]
            if status is None:
                self.live.discard(run_id)
                self.vanished.append(run_id)
                continue
            run.status, run.reason, run.segments = RunStatus.parse(status), reason or "", int(segments or 1)
            if run.status.is_terminal:
                self.live.discard(run_id)
            elif run.status is RunStatus.WAITING_FOR_APPROVAL and not run.decided:
                self._decide(run)

    def _decide(self, run: Run) -> None:
        run.decided = True
        store = self.bench.store
        try:
            if run.shape == "approve":
                operations.approve(store, self.producer, run.run_id, decided_by="soak")
            else:
                operations.deny(store, run.run_id, decided_by="soak", reason="the soak denies it")
        except RunbrakeError as exc:
            self.refused[f"{run.shape}: {type(exc).__name__}"] += 1

    def _steer(self, run: Run) -> None:
        if run.steered:
            return
        try:
            operations.steer(self.bench.store, self.publisher, self.producer, run.run_id, text="answer now",
                             reason="soak", requested_by="soak", max_input_chars=self.bench.settings.max_input_chars)
        except TransitionRefused as exc:
            self.steers_refused[exc.found.value] += 1
        except RunbrakeError as exc:
            self.refused[f"steer: {type(exc).__name__}"] += 1
        else:
            run.steered = True

    def _cancel(self, run: Run) -> None:
        if run.cancel_sent:
            return
        run.cancel_sent = True
        try:
            operations.cancel(self.bench.store, self.publisher, run.run_id, reason="soak", requested_by="soak")
        except RunbrakeError as exc:
            self.refused[f"cancel: {type(exc).__name__}"] += 1


# -- the events client ---------------------------------------------------------------------------


class EventsClient(threading.Thread):
    """Reads ``GET /v1/events`` (server-sent status events of every run) until stopped; reconnects."""

    def __init__(self, url: str) -> None:
        super().__init__(name="soak-events-client", daemon=True)
        self._url = f"{url}/v1/events"
        self._stopping = threading.Event()
        self.status_events = 0
        self.terminal: dict[str, str] = {}
        self.reconnects = 0
        self.errors: Counter[str] = Counter()

    def run(self) -> None:
        timeout = httpx2.Timeout(5.0, read=2.0)
        with httpx2.Client(timeout=timeout) as client:
            while not self._stopping.is_set():
                try:
                    with client.stream("GET", self._url) as response:
                        response.raise_for_status()
                        self._read(response.iter_lines())
                except httpx2.ReadTimeout:
                    continue  # no event for a while; the stop flag is looked at, the stream opened again
                except httpx2.HTTPError as exc:
                    self.errors[type(exc).__name__] += 1
                    self._stopping.wait(1.0)
                if not self._stopping.is_set():
                    self.reconnects += 1

    def _read(self, lines: Any) -> None:
        for line in lines:
            if self._stopping.is_set():
                return
            if not line.startswith("data:"):
                continue
            try:
                data = json.loads(line[5:])
            except ValueError:
                self.errors["unreadable data line"] += 1
                continue
            self.status_events += 1
            if RunStatus.parse(data.get("status")).is_terminal:
                self.terminal[str(data.get("run_id"))] = str(data.get("status"))

    def stop(self) -> None:
        self._stopping.set()
        self.join(timeout=10)


# -- samples -------------------------------------------------------------------------------------


def process_sample(pid: int) -> dict[str, Any]:
    """RSS (KiB), open file descriptors and CPU seconds of a process, from /proc; ``None`` where it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return {"pid": pid, "rss_kib": None, "fds": None, "cpu_s": None}
    # An exited process not yet reaped (a worker being restarted) has no VmRSS line.
    rss = next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")), None)
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime
    return {"pid": pid, "rss_kib": rss, "fds": fds, "cpu_s": round(cpu, 2)}


def redis_sample(bench: Bench, *, sweep_s: float) -> dict[str, Any]:
    """The server's used_memory; the namespace's key count and summed MEMORY USAGE, and its keys by kind; and
    the same without the runs the sweepers are about to delete (``steady_keys``, ``steady_bytes``).

    The sweepers delete what is due every ``sweep_s`` (worker/retention.py), so the namespace saws between
    its runs within their retention and that plus one interval of runs: at 5 runs a second and a 60 s
    retention, 310 and 445 runs, 30 s apart. A sample every 30 s reads one point of that saw, and the point
    moves when a sweeper's ticks shift (a restart, a slow tick): a step in the count that is no growth (the
    hour of 2026-12-04, docs/benchmarks.md, "Soak: Redis's saw"). The steady figures leave out the runs due for
    at most two intervals, which the next tick deletes; a run due for longer (``overdue_runs``: the sweepers
    fell behind) stays in them, so what the sweepers leave behind still shows as growth.
    """
    client, keys_of = bench.store.redis, bench.store.keys
    now = time.time()  # the scores are the ends of the runs' retention (shared/_scripts.py, ``retain``)
    due: list[tuple[str, float]] = []
    for shard in keys_of.shards:  # read before the keys: a run swept in between is in neither count
        due += [(_text(run_id), score) for run_id, score in
                client.zrangebyscore(keys_of.finished(shard), "-inf", now, withscores=True)]
    names = [_text(key) for key in client.scan_iter(match=f"{bench.namespace}:*", count=1000)]
    with client.pipeline(transaction=False) as pipe:
        for name in names:
            pipe.memory_usage(name, samples=0)
        usage = dict(zip(names, (int(u or 0) for u in pipe.execute()), strict=True))
    sweeping = [run_id for run_id, score in due if now - score <= 2 * sweep_s]
    leaving = {key for run_id in sweeping
               for key in (keys_of.run(run_id), keys_of.steps(run_id), keys_of.cancel(run_id), keys_of.steer(run_id))
               if key in usage}
    # By kind (the key's part after the namespace: run, steps, idem, …): which kind a growth is made of.
    kinds = Counter(name[len(bench.namespace) + 1:].split(":")[0] for name in names)
    total = sum(usage.values())
    return {"used_memory": int(client.info("memory")["used_memory"]), "namespace_keys": len(names),
            "namespace_bytes": total, "namespace_key_kinds": dict(kinds),
            "due_runs": len(sweeping), "overdue_runs": len(due) - len(sweeping),
            "steady_keys": len(names) - len(leaving), "steady_bytes": total - sum(usage[k] for k in leaving)}


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def queue_depths(bench: Bench) -> dict[str, int | None]:
    """Messages ready in each of the namespace's queues (passive declare; ``None`` for one not declared)."""
    topology = Topology.of(bench.settings)
    names = [topology.run_queue, f"{topology.run_queue}.DQ", f"{topology.run_queue}.XQ",
             topology.cancel_requests_queue, topology.cancel_requests_dead_queue]
    depths: dict[str, int | None] = {}
    connection = pika.BlockingConnection(pika.URLParameters(bench.settings.rabbitmq_url))
    try:
        channel = connection.channel()
        for name in names:
            try:
                depths[name] = channel.queue_declare(name, passive=True).method.message_count
            except pika.exceptions.ChannelClosedByBroker:
                depths[name] = None  # 404: not declared (yet); the passive declare closed the channel
                channel = connection.channel()
    finally:
        connection.close()
    return depths


def loop_lag_ms(port: int) -> float | None:
    """The worker's event-loop lag as its ``/healthz`` reports it, in ms; ``None`` when it does not answer."""
    try:
        body = httpx2.get(f"http://127.0.0.1:{port}/healthz", timeout=5).json()
        match = LOOP_ANSWER.search(str(body["checks"]["event_loop"]["detail"]))
    except (httpx2.HTTPError, ValueError, KeyError, TypeError):
        return None
    return float(match.group(1)) if match else None


def growth(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """The rise of the least-squares line through ``points`` (t, value) over their span, and its value at
    the start of the span."""
    if len(points) < 2:
        return 0.0, points[0][1] if points else 0.0
    n = len(points)
    mean_t = sum(t for t, _ in points) / n
    mean_v = sum(v for _, v in points) / n
    spread = sum((t - mean_t) ** 2 for t, _ in points)
    slope = sum((t - mean_t) * (v - mean_v) for t, v in points) / spread if spread else 0.0
    start, end = points[0][0], points[-1][0]
    return slope * (end - start), mean_v + slope * (start - mean_t)


# -- the soak ------------------------------------------------------------------------------------


@dataclass
class Restart:
    at_s: float
    exit_code: int | None = None
    handed_over: int = 0
    long_run_in_flight: bool = False


class Soak:
    """The processes, the producer loop, the samples and the verdict."""

    def __init__(self, bench: Bench, plan: Plan, memory_dir: Path | None = None,
                 memory_options: Sequence[str] = ()) -> None:
        self.bench = bench
        self.plan = plan
        self.memory_dir = memory_dir
        """``--memory-dir``: the workers run under bench/_memtrace.py, which writes their heap here at each sample."""
        self.memory_options = list(memory_options)
        """bench/_memtrace.py's options (``--trace``, ``--garbage``)."""
        self.server = bench.start_toolbox()
        self.url = start_api(bench)
        self.start_failures = 0
        """Worker starts that failed and were tried again."""
        self.health_ports: dict[str, int] = {}
        """Where each worker's /healthz (and so its loop lag) is read."""
        self.steady = self._start_worker("worker_steady")
        self.rolling = self._start_worker("worker_rolling")
        self.rolling_log_lines: list[dict[str, Any]] = []
        broker = build_broker(bench.settings)
        bench.on_close(broker.close)
        self.producer = Producer(bench.store, broker, bench.admission())
        publisher = CancelPublisher(bench.settings)
        bench.on_close(publisher.close)
        self.tracker = Tracker(bench, self.producer, publisher, self.server.events)
        self.events = EventsClient(self.url)
        self.samples: list[dict[str, Any]] = []
        self.restarts: list[Restart] = []
        self._restarting: threading.Thread | None = None
        self._started = 0.0

    def _start_worker(self, name: str) -> Worker:
        """A worker process with its ``/healthz`` on a free port of its own; tried three times, since another
        process may take the port between the probe and the worker's bind (which ends the worker)."""
        for attempt in range(3):
            self.health_ports[name] = free_port()
            self.bench.env["RUNBRAKE_HEALTH_PORT"] = str(self.health_ports[name])
            try:
                module = ["-m", "runbrake.worker"] if self.memory_dir is None else [
                    "-m", "bench._memtrace", *self.memory_options, str(self.memory_dir), "runbrake.worker"]
                return self.bench.start_logging_process(
                    name.replace("_", " "), [*module, "--concurrency", str(WORKER_CONCURRENCY)],
                    timeout=WORKER_START_TIMEOUT_S)
            except BenchError:
                self.start_failures += 1
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def processes(self) -> dict[str, ManagedProcess]:
        api = next(p for p in self.bench._processes if p.name == "runbrake serve")
        return {"toolbox": self.server.process, "serve": api, "worker_steady": self.steady.process,
                "worker_rolling": self.rolling.process}

    def run(self) -> None:
        self.events.start()
        self.bench.on_close(self.events.stop)
        plan = self.plan
        self._started = time.monotonic()
        next_sample = 0.0
        next_poll = 0.0
        restarts = list(plan.restarts_at)
        sent = 0
        while sent < plan.total_runs:
            now = time.monotonic() - self._started
            while sent < plan.total_runs and sent / plan.rate <= now:
                shape = CYCLE[sent % len(CYCLE)]
                self.tracker.add(sent, shape, self.producer.enqueue(spec_for(shape, sent)).run_id)
                sent += 1
            if now >= next_poll:
                self.tracker.poll()
                next_poll = now + POLL_S
            if now >= next_sample:
                self.sample(now)
                next_sample += plan.sample_s
            if restarts and now >= restarts[0] and self._restarting is None:
                self._restarting = threading.Thread(target=self.restart, args=(restarts.pop(0),),
                                                    name="soak-restart")
                self._restarting.start()
            elif self._restarting is not None and not self._restarting.is_alive():
                self._restarting.join()
                self._restarting = None
            due = min(sent / plan.rate, next_poll, next_sample)
            time.sleep(max(0.0, min(0.2, due - (time.monotonic() - self._started))))  # pacing the producer
        while self._restarting is not None and self._restarting.is_alive():
            self._restarting.join(timeout=POLL_S)
            self.tracker.poll()
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        while self.tracker.live and time.monotonic() < deadline:
            time.sleep(POLL_S)  # pacing the status reads; bounded by the deadline
            self.tracker.poll()
        self.sample(time.monotonic() - self._started)

    def sample(self, at_s: float) -> None:
        if self.memory_dir is not None:
            for worker in (self.steady, self.rolling):
                if worker.process.popen.poll() is None:
                    os.kill(worker.pid, signal.SIGUSR2)  # bench/_memtrace.py writes the heap it traces
        self.samples.append({
            "t_s": round(at_s, 1),
            "processes": {name: process_sample(p.pid) for name, p in self.processes().items()},
            "redis": redis_sample(self.bench, sweep_s=sweep_interval_s(self.plan.retention_s)),
            "queues": queue_depths(self.bench),
            "loop_lag_ms": {name: loop_lag_ms(self.health_ports[name]) for name in WORKERS},
            "live_runs": len(self.tracker.live),
        })

    def restart(self, at_s: float) -> None:
        """SIGTERM the rolling worker once it holds a long run in its slow call (bounded), start a new one."""
        restart = Restart(at_s)
        self.restarts.append(restart)
        old = self.rolling
        prefix = f"{os.uname().nodename}:{old.pid}:"
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and not restart.long_run_in_flight:
            restart.long_run_in_flight = self.tracker.long_run_in_flight(prefix, min_left_s=4 * DRAIN_S)
            if not restart.long_run_in_flight:
                time.sleep(0.2)  # polling the owners, bounded by the deadline
        restart.exit_code = old.process.stop()
        old.log.read_new()
        restart.handed_over = sum(1 for e in old.log.entries if e.get("event") == "run_handed_over")
        self.rolling = self._start_worker("worker_rolling")

    def summary(self) -> dict[str, Any]:
        plan, tracker = self.plan, self.tracker
        by_shape: dict[str, Counter[str]] = {shape: Counter() for shape in EXPECTED}
        for run in tracker.runs.values():
            by_shape[run.shape][f"{run.status.value}/{run.reason}" if run.reason else run.status.value] += 1
        stuck = [r.run_id for r in tracker.runs.values() if not r.status.is_terminal and r.run_id in tracker.live]
        unexpected = [r.run_id for r in tracker.runs.values()
                      if r.status.is_terminal and r.status is not EXPECTED[r.shape]]
        handed_over_runs = sum(1 for r in tracker.runs.values() if r.segments > 1)
        window = [s for s in self.samples if s["t_s"] >= plan.warmup_s]
        trends = self._trends(window)
        final = self.samples[-1] if self.samples else {}
        alive = {name: p.popen.poll() is None for name, p in self.processes().items()}
        dead_letters = (final.get("queues") or {}).get(f"{Topology.of(self.bench.settings).run_queue}.XQ") or 0
        criteria = {
            "every_run_terminal": not stuck and not tracker.vanished,
            "expected_outcomes": not unexpected,
            "restarts_handed_over": len(self.restarts) == len(plan.restarts_at)
            and all(r.exit_code == 0 and r.handed_over >= 1 for r in self.restarts),
            "processes_alive": all(alive.values()),
            "no_dead_letters": dead_letters == 0,
            "rss_growth": all(trends[name]["rss_growth"] <= RSS_GROWTH_MAX for name in LIFELONG),
            "fds_flat": all(trends[name]["fds_at_end"] - trends[name]["fds_warmup_max"]
                            <= max(FD_RISE_MAX, FD_GROWTH_MAX * trends[name]["fds_warmup_max"]) for name in LIFELONG),
            "redis_flat": trends["redis"]["bytes_growth"] <= REDIS_GROWTH_MAX
            and trends["redis"]["keys_growth"] <= REDIS_GROWTH_MAX,
        }
        failed = [name for name, ok in criteria.items() if not ok]
        return {
            "benchmark": "soak",
            "verdict": "fail" if failed else "pass",
            "failed": failed,
            "criteria": criteria,
            "plan": {"minutes": plan.minutes, "rate_per_s": plan.rate, "sample_s": plan.sample_s,
                     "retention_s": plan.retention_s, "drain_s": DRAIN_S, "restarts_planned": plan.restarts,
                     "restart_every_s": round(plan.restart_every_s, 1),
                     "growth_measured_from_s": plan.warmup_s,
                     "long_call_s": LONG_S, "worker_concurrency": WORKER_CONCURRENCY},
            "runs": {"sent": len(tracker.runs), "terminal": sum(r.status.is_terminal for r in tracker.runs.values()),
                     "stuck": stuck[:20], "stuck_count": len(stuck), "vanished": tracker.vanished[:20],
                     "unexpected": unexpected[:20], "by_shape": {k: dict(v) for k, v in by_shape.items()},
                     "handed_over": handed_over_runs, "cancelled_in_flight": sum(
                         1 for r in tracker.runs.values() if r.shape == "cancel" and r.run_id in tracker.slow_started),
                     "steered_in_flight": sum(1 for r in tracker.runs.values() if r.steered),
                     "steers_refused": dict(tracker.steers_refused),
                     "refused_decisions": dict(tracker.refused)},
            "restarts": [vars(r) for r in self.restarts],
            "worker_start_failures": self.start_failures,
            "events_client": {"status_events": self.events.status_events,
                              "terminal_runs_seen": sum(1 for r in tracker.runs if r in self.events.terminal),
                              "reconnects": self.events.reconnects, "errors": dict(self.events.errors)},
            "growth_after_warmup": trends,
            "loop_lag_ms": self._loop_lag(),
            "processes_alive_at_end": alive,
            "samples": self.samples,
        }

    def _loop_lag(self) -> dict[str, dict[str, float | int]]:
        """Each worker's loop lag over the samples: p50, p95, max, and how many samples had none."""
        lags: dict[str, dict[str, float | int]] = {}
        for name in WORKERS:
            values = sorted(v for s in self.samples if (v := s["loop_lag_ms"][name]) is not None)
            missing = sum(1 for s in self.samples if s["loop_lag_ms"][name] is None)
            lags[name] = {"samples": len(values), "unanswered": missing} | (
                {"p50": percentile(values, 50), "p95": percentile(values, 95), "max": values[-1]} if values else {})
        return lags

    def _trends(self, window: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
        trends: dict[str, dict[str, float]] = {}
        for name in ("toolbox", "serve", "worker_steady", "worker_rolling"):
            rows = [(s["t_s"], s["processes"][name]) for s in window]
            if name == "worker_rolling":  # restarted: only the last incarnation's samples are comparable
                last_pid = rows[-1][1]["pid"] if rows else None
                rows = [(t, p) for t, p in rows if p["pid"] == last_pid]
            rss = [(t, float(p["rss_kib"])) for t, p in rows if p["rss_kib"] is not None]
            fds = [(t, float(p["fds"])) for t, p in rows if p["fds"] is not None]
            rise, start = growth(rss)
            fd_rise, _ = growth(fds)
            warmup_fds = [p["fds"] for s in self.samples if s["t_s"] < self.plan.warmup_s
                          if (p := s["processes"][name])["fds"] is not None]
            trends[name] = {"rss_growth": round(rise / start, 4) if start else 0.0,
                            "rss_start_kib": round(start), "fd_trend_rise": round(fd_rise, 2),
                            "fds_warmup_max": max(warmup_fds, default=0), "fds_at_end": int(fds[-1][1]) if fds else 0,
                            "samples": len(rss)}
        # The criterion's: the namespace without the runs the sweepers are about to delete (redis_sample);
        # beside it, the whole namespace as sampled, saw and all.
        trends["redis"] = _growths(window, {"bytes": "steady_bytes", "keys": "steady_keys",
                                            "raw_bytes": "namespace_bytes", "raw_keys": "namespace_keys"})
        return trends


def _growths(window: list[dict[str, Any]], fields: Mapping[str, str]) -> dict[str, float]:
    """For each name, the growth of a Redis sample's field over the window (the rise of its least-squares
    line over its start) and where that line starts."""
    trends: dict[str, float] = {}
    for name, field_name in fields.items():
        rise, start = growth([(s["t_s"], float(s["redis"][field_name])) for s in window])
        trends[f"{name}_growth"] = round(rise / start, 4) if start else 0.0
        trends[f"{name}_start"] = round(start)
    return trends


# -- the plot ------------------------------------------------------------------------------------


def plot(results: Mapping[str, Any], path: Path) -> None:
    """RSS of each process and the namespace's Redis memory over time, as a PNG (matplotlib: ``.[bench]``)."""
    try:
        import matplotlib as mpl
    except ImportError:
        raise SystemExit("--plot needs matplotlib: .venv/bin/pip install -e '.[bench]'") from None
    mpl.use("Agg")
    import matplotlib.pyplot as plt

    samples = results["samples"]
    minutes = [s["t_s"] / 60 for s in samples]
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6.5), sharex=True)
    for name in samples[0]["processes"]:
        rss = [(s["processes"][name]["rss_kib"] or float("nan")) / 1024 for s in samples]
        top.plot(minutes, rss, label=name.replace("_", " "), marker=".")
    top.set_ylabel("RSS (MiB)")
    top.legend(loc="lower right", fontsize="small")
    top.grid(alpha=0.3)
    bottom.plot(minutes, [s["redis"]["namespace_bytes"] / 1024 for s in samples], label="namespace (MEMORY USAGE)",
                marker=".")
    if "steady_bytes" in samples[0]["redis"]:  # results of a soak from before 2026-12-05 have no steady figures
        bottom.plot(minutes, [s["redis"]["steady_bytes"] / 1024 for s in samples],
                    label="without the runs being swept", marker=".")
    bottom.set_ylabel("Redis (KiB)")
    twin = bottom.twinx()
    twin.plot(minutes, [s["redis"]["namespace_keys"] for s in samples], color="grey", linestyle="--",
              label="namespace keys")
    twin.set_ylabel("keys")
    bottom.legend(loc="upper left", fontsize="small")
    twin.legend(loc="upper right", fontsize="small")
    bottom.set_xlabel("minutes")
    bottom.grid(alpha=0.3)
    for restart in results.get("restarts", []):
        for axis in (top, bottom):
            axis.axvline(restart["at_s"] / 60, color="red", alpha=0.25)
    plan = results["plan"]
    figure.suptitle(f"runbrake soak: {plan['minutes']:g} min at {plan['rate_per_s']:g} runs/s, "
                    f"retention {plan['retention_s']} s (red: rolling worker restarts) — {results['verdict']}")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


# -- the command ---------------------------------------------------------------------------------


def _positive(text: str) -> float:
    value = float(text)
    if not 0 < value <= 24 * 60:
        raise argparse.ArgumentTypeError(f"must be above 0 and at most 1440, not {text}")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.soak",
                                     description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--minutes", type=_positive, default=60.0, help="length of the soak (60)")
    parser.add_argument("--rate", type=_positive, default=5.0, help="runs sent per second (5)")
    parser.add_argument("--sample-s", type=_positive, default=None,
                        help="seconds between samples (30 from 30 minutes on, else 10)")
    parser.add_argument("--restarts", type=int, choices=range(1, 61), default=5, metavar="1..60",
                        help="restarts of the rolling worker, evenly spaced (5: every sixth of the soak)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "soak.json", help="the JSON results file")
    parser.add_argument("--plot", type=Path, default=None, help="also draw RSS and Redis memory to this PNG")
    parser.add_argument("--replot", type=Path, default=None, help="only draw --plot from this results file")
    parser.add_argument("--keep-logs", action="store_true", help="keep the processes' logs")
    parser.add_argument("--memory-dir", type=Path, default=None, metavar="DIR",
                        help="write each worker's malloc and Python heap figures to DIR at each sample "
                             "(bench/_memtrace.py: a few ms a sample)")
    parser.add_argument("--tracemalloc", action="store_true",
                        help="with --memory-dir: also run the workers under tracemalloc (slow; short runs only)")
    parser.add_argument("--garbage", action="store_true",
                        help="with --memory-dir: also count the cyclic garbage by type at each sample (a full "
                             "collection each time)")
    args = parser.parse_args(argv)
    if (args.tracemalloc or args.garbage) and args.memory_dir is None:
        parser.error("--tracemalloc and --garbage need --memory-dir DIR")
    if args.replot is not None:
        if args.plot is None:
            parser.error("--replot needs --plot FILE")
        plot(json.loads(args.replot.read_text(encoding="utf-8")), args.plot)
        return 0
    plan = Plan.of(args.minutes, args.rate, args.sample_s, args.restarts)
    configure_logging("WARNING")  # the producer's, the cancels' and the decisions' info lines would drown the result
    info = machine()
    print_machine(info)
    env = {"RUNBRAKE_RETENTION_S": str(plan.retention_s), "RUNBRAKE_DRAIN_S": str(DRAIN_S)}
    with Bench("soak", env=env, keep=args.keep_logs) as bench:
        print(f"namespace {bench.namespace}; {plan.minutes:g} min at {plan.rate:g} runs/s, "
              f"retention {plan.retention_s} s, a sample every {plan.sample_s:g} s", file=sys.stderr)
        options = [flag for flag, on in (("--trace", args.tracemalloc), ("--garbage", args.garbage)) if on]
        soak = Soak(bench, plan, args.memory_dir, options)
        soak.run()
        results = {**soak.summary(), "machine": info,
                   "load_at_end": {"loadavg": [round(v, 2) for v in os.getloadavg()]}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    if args.plot is not None:
        plot(results, args.plot)
    print(json.dumps({k: v for k, v in results.items() if k != "samples"}, indent=2))
    for name in results["failed"]:
        print(f"soak: criterion failed: {name}", file=sys.stderr)
    return 1 if results["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
