"""Throughput: completed runs per second on one worker process, against a no-op Dramatiq actor on the same broker.

Run from the repository root::

    .venv/bin/python -m bench.throughput [--noop 2000] [--runs 400] [--threads 8] [--producers 4] [--profile]

What it does, in its own namespace (``bench-<hex>``), on loopback only:

1. starts the example toolbox MCP server over HTTP;
2. **no-op ceiling**: sends N messages for the ``noop`` actor through ``broker.enqueue`` (publisher
   confirms, built as :meth:`broker.producer.Producer.send` builds a run's), *then* starts one worker
   (``python -m runbrake.worker --threads 8 --noop``) and samples the ``<ns>.noop`` queue's ready count (passive
   ``queue_declare``, every 5 ms) while it drains the backlog. The rate is taken between 90 % and 10 % of
   the backlog (steady state). Why a backlog: sending with confirms (~500 msg/s per sending thread here)
   is slower than the worker consumes, so "send, then wait until consumed" times the sender; that figure
   is reported too ("live", after the run phase);
3. warms up with a few runs (not counted);
4. **runs**: enqueues M runs through :meth:`Producer.enqueue`, each three rounds with two quick MCP tool
   calls (``get-sum``, then ``echo``, then a final answer), and times from the first enqueue to the last
   run's ``finished_at`` in the store; meanwhile it reads the CPU time each process used (worker, MCP
   server, RabbitMQ, Redis, this script) and the worker's busiest threads;
5. prints both rates, their ratio and the worker's peak RSS (``VmHWM`` from /proc), writes
   ``bench/results/throughput.json``, and cleans up (processes, Redis keys, queues, exchange).

``--profile`` attaches ``py-spy record`` to the worker for the run phase (install it into the venv
first: ``.venv/bin/pip install py-spy``), writes the raw stacks to ``bench/results/throughput-profile.txt``
and prints the hottest frames of the busiest thread (the event loop's).
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any, TypeVar

import pika
from dramatiq import Message

from bench._harness import (
    RESULTS_DIR,
    Bench,
    BenchError,
    ToolboxServer,
    all_terminal,
    cpu_seconds,
    in_threads,
    machine,
    machine_busy_seconds,
    pids_named,
    print_machine,
    quick_run_spec,
    thread_cpu_seconds,
    wait_until,
)
from runbrake.shared.logging import configure_logging
from runbrake.shared.messaging.producer import Producer
from runbrake.shared.messaging.rabbitmq import RunbrakeBroker, build_broker
from runbrake.shared.messaging.wire import NOOP_ACTOR, Topology
from runbrake.shared.status import RunStatus

AIM_RATIO = 0.2
AIM_RSS_MB = 200
WARMUP_RUNS = 8

T = TypeVar("T")
R = TypeVar("R")


class QueueDepth:
    """Ready messages in a queue, read with a passive queue_declare on a connection of its own.

    Used from one thread at a time (pika is not thread-safe)."""

    def __init__(self, bench: Bench, queue: str) -> None:
        self._connection = pika.BlockingConnection(pika.URLParameters(bench.settings.rabbitmq_url))
        self._channel = self._connection.channel()
        self._queue = queue
        bench.on_close(self.close)

    def ready(self) -> int:
        count: int = self._channel.queue_declare(queue=self._queue, passive=True).method.message_count
        return count

    def close(self) -> None:
        if self._connection.is_open:
            self._connection.close()


class DrainWatch(threading.Thread):
    """Samples a queue's ready count every ``interval`` s until it reaches 0 (bounded by ``timeout``)."""

    def __init__(self, depth: QueueDepth, *, timeout: float, interval: float = 0.005) -> None:
        super().__init__(name="drain-watch", daemon=True)
        self._depth = depth
        self._timeout = timeout
        self._interval = interval
        self.samples: list[tuple[float, int]] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            deadline = time.monotonic() + self._timeout
            while time.monotonic() < deadline:
                ready = self._depth.ready()
                self.samples.append((time.time(), ready))
                if ready == 0:
                    return
                time.sleep(self._interval)  # sampling, bounded by the deadline
        except BaseException as exc:
            self.error = exc


def send_noops(broker: RunbrakeBroker, queue: str, count: int, producers: int) -> float:
    """Send ``count`` messages for the no-op actor, each confirmed by RabbitMQ; the seconds it took."""

    def send(_: int) -> None:
        broker.enqueue(Message(queue_name=queue, actor_name=NOOP_ACTOR, args=(), kwargs={}, options={}))

    started = time.time()
    in_threads(producers, count, send)
    return time.time() - started


def noop_backlog_phase(
    bench: Bench, broker: RunbrakeBroker, count: int, *, producers: int, timeout: float, start_worker: Callable[[], T]
) -> tuple[dict[str, Any], T]:
    """The no-op ceiling: fill the queue first, then start the worker and time how fast it drains the backlog.

    Sending with publisher confirms is slower than the worker consumes, so timing "send, then wait"
    measures the sender. The rate is read between the samples that first saw the backlog at or below
    90 % and at or below 10 %; at most ``threads`` prefetched messages are unacked at either point."""
    queue = Topology(bench.namespace).noop_queue
    broker.declare_queue(queue)
    depth = QueueDepth(bench, queue)
    send_s = send_noops(broker, queue, count, producers)
    if depth.ready() != count:
        raise BenchError(f"the no-op queue holds {depth.ready()} messages after sending {count}")
    watch = DrainWatch(depth, timeout=timeout)
    watch.start()
    worker = start_worker()
    watch.join(timeout + 5)
    if watch.error is not None:
        raise watch.error
    if not watch.samples or watch.samples[-1][1] != 0:
        raise BenchError(f"the worker did not drain {count} no-op messages within {timeout:g} s")
    first = next((t, n) for t, n in watch.samples if n < count)
    last = watch.samples[-1]
    # Steady state: from the first sample at or below 90 % of the backlog to the first at or below 10 %,
    # which leaves out the worker's first moments (connections, the listener starting) and the tail.
    upper = next((t, n) for t, n in watch.samples if n <= 0.9 * count)
    lower = next((t, n) for t, n in watch.samples if n <= 0.1 * count)
    steady = (upper[1] - lower[1]) / (lower[0] - upper[0]) if lower[0] > upper[0] else math.nan
    whole = first[1] / (last[0] - first[0])
    return {
        "messages": count,
        "send_s": round(send_s, 3),
        "send_per_s": round(count / send_s, 1),
        "drain_s": round(last[0] - first[0], 3),
        "per_s_whole_drain": round(whole, 1),
        "per_s": round(steady, 1),
        "samples": len(watch.samples),
        "note": "backlog drain, ready count sampled every 5 ms; per_s is the steady state between 90 % and "
                "10 % of the backlog; per_s_whole_drain from the first shrink to empty",
    }, worker


def noop_live_phase(
    bench: Bench, broker: RunbrakeBroker, count: int, *, producers: int, timeout: float
) -> dict[str, Any]:
    """For comparison: send with confirms while the warm worker consumes; time until the queue is empty."""
    queue = Topology(bench.namespace).noop_queue
    depth = QueueDepth(bench, queue)
    started = time.time()
    send_s = send_noops(broker, queue, count, producers)
    wait_until(lambda: depth.ready() == 0, timeout=timeout, what=f"{count} no-op messages", interval=0.005)
    elapsed = time.time() - started
    return {"messages": count, "send_s": round(send_s, 3), "elapsed_s": round(elapsed, 3),
            "per_s": round(count / elapsed, 1)}


def runs_phase(
    bench: Bench, producer: Producer, server: ToolboxServer, count: int, *, producers: int, timeout: float,
    label: str = "runs",
) -> dict[str, Any]:
    run_ids: list[str] = [""] * count

    def enqueue(i: int) -> None:
        run_ids[i] = producer.enqueue(quick_run_spec(server, i)).run_id

    started = time.time()
    in_threads(producers, count, enqueue)
    sent = time.time()
    wait_until(all_terminal(bench.store, run_ids), timeout=timeout, what=f"{count} {label} to finish", interval=0.05)
    records = [bench.store.get(run_id) for run_id in run_ids]
    statuses = Counter(r.status.value for r in records)
    finished = max(r.finished_at or 0.0 for r in records)
    first_claim = min(r.started_at or finished for r in records)
    elapsed = finished - started
    steps = Counter(len(r.steps) for r in records)
    return {
        "runs": count,
        "statuses": dict(statuses),
        "steps_per_run": {str(k): v for k, v in steps.items()},
        "send_s": round(sent - started, 3),
        "elapsed_s": round(elapsed, 3),
        "per_s": round(count / elapsed, 1),
        "per_s_from_first_claim": round(count / (finished - first_claim), 1),
        "send_per_s": round(count / (sent - started), 1),
    }


class Profiler:
    """``py-spy record --pid`` on the worker for the length of a ``with`` block (active samples of every
    thread, GIL held or not: OpenSSL's certificate loading, for one, runs with the GIL released).
    SIGINT makes py-spy write its output and exit."""

    def __init__(self, pid: int, output: Path, *, rate: int) -> None:
        py_spy = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or shutil.which("py-spy")
        if py_spy is None:
            raise BenchError("--profile needs py-spy: .venv/bin/pip install py-spy")
        self._command = [py_spy, "record", "--pid", str(pid), "--format", "raw", "--rate", str(rate),
                         "--threads", "--output", str(output)]
        self._log = output.with_suffix(".log")
        self._process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Profiler:
        with self._log.open("wb") as log:
            self._process = subprocess.Popen(self._command, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        time.sleep(0.5)  # let py-spy attach before the measured work starts
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._process is None:
            return
        self._process.send_signal(signal.SIGINT)
        try:
            self._process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()


_PLUMBING = ("threading.py", "asyncio/base_events.py", "asyncio/events.py", "dramatiq/asyncio.py:90",
             "anyio/_core/_tasks.py")
"""Frames that sit under nearly every sample (thread bootstrap, the event loop's dispatch): left out of the
inclusive list, where they would only push the informative frames down."""


def summarize_profile(raw: Path, top: int = 25) -> dict[str, Any]:
    """Sample shares from py-spy's raw (collapsed-stack) output: per thread, then, for the busiest thread
    (the event loop's), the hottest frames inclusive (a frame and what it calls) and self (the frame alone)."""
    stacks: list[tuple[list[str], int]] = []
    per_thread: Counter[str] = Counter()
    for line in raw.read_text(encoding="utf-8", errors="replace").splitlines():
        stack, _, count_text = line.rpartition(" ")
        if stack and count_text.isdigit():
            frames = stack.split(";")
            stacks.append((frames, int(count_text)))
            per_thread[frames[0]] += int(count_text)
    if not stacks:
        return {"samples": 0}
    busiest, busiest_samples = per_thread.most_common(1)[0]
    inclusive: Counter[str] = Counter()
    own: Counter[str] = Counter()
    for frames, samples in stacks:
        if frames[0] != busiest:
            continue
        own[frames[-1]] += samples
        for frame in dict.fromkeys(frames[1:]):
            if not any(part in frame for part in _PLUMBING):
                inclusive[frame] += samples
    total = sum(per_thread.values())

    def shares(counter: Counter[str], of: int, limit: int) -> list[tuple[str, float]]:
        return [(frame, round(100 * n / of, 1)) for frame, n in counter.most_common(limit)]

    return {"samples": total, "threads": shares(per_thread, total, 8), "busiest_thread": busiest,
            "busiest_thread_samples": busiest_samples, "inclusive": shares(inclusive, busiest_samples, top),
            "self": shares(own, busiest_samples, top)}


def cpu_during(work: Callable[[], R], pids: Mapping[str, int], *, threads_of: int) -> tuple[R, dict[str, Any]]:
    """Run ``work`` and say how much CPU each process (and the machine as a whole) used meanwhile,
    and the share of one core the busiest threads of process ``threads_of`` took."""
    before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    threads_before = thread_cpu_seconds(threads_of)
    busy_before, total_before = machine_busy_seconds()
    started = time.monotonic()
    result = work()
    elapsed = time.monotonic() - started
    busy, total = machine_busy_seconds()
    threads_used = sorted(
        (used - threads_before.get(tid, 0.0) for tid, used in thread_cpu_seconds(threads_of).items()), reverse=True
    )
    used = {}
    for name, pid in pids.items():
        after, start = cpu_seconds(pid), before[name]
        used[name] = None if after is None or start is None else round(after - start, 3)
    wall_cores = total - total_before
    return result, {
        "cpu_s": used,
        "machine_busy_pct": round(100 * (busy - busy_before) / wall_cores, 1) if wall_cores else None,
        "busiest_threads_pct_of_a_core": [round(100 * used / elapsed, 1) for used in threads_used[:3]],
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.throughput", description=__doc__.splitlines()[0])
    parser.add_argument("--noop", type=int, default=2000, help="no-op messages (default 2000)")
    parser.add_argument("--runs", type=int, default=400, help="runs (default 400)")
    parser.add_argument("--threads", type=int, default=8, help="worker threads (default 8)")
    parser.add_argument("--producers", type=int, default=4,
                        help="threads sending no-op messages and enqueueing runs (default 4)")
    parser.add_argument("--timeout", type=float, default=120.0, help="bound on each phase, in seconds")
    parser.add_argument("--profile", action="store_true", help="attach py-spy to the worker for the run phase")
    parser.add_argument("--profile-rate", type=int, default=100, help="py-spy samples per second (default 100)")
    parser.add_argument("--keep-logs", action="store_true", help="keep the worker's and server's logs")
    args = parser.parse_args(argv)

    configure_logging("WARNING")  # the producer's per-run info lines would drown the result
    info = machine()
    profile = RESULTS_DIR / "throughput-profile.txt"
    if args.profile:
        RESULTS_DIR.mkdir(parents=True, exist_ok=True)
        profile.unlink(missing_ok=True)
    with Bench("throughput", keep=args.keep_logs) as bench:
        print(f"namespace {bench.namespace}; starting the toolbox server…")
        server = bench.start_toolbox()
        broker = build_broker(bench.settings)
        bench.on_close(broker.close)
        producer = Producer(bench.store, broker, bench.admission())
        print(f"no-op ceiling: {args.noop} messages queued, then a worker (--threads {args.threads} --noop) "
              "drains them…")
        noop, worker = noop_backlog_phase(
            bench, broker, args.noop, producers=args.producers, timeout=args.timeout,
            start_worker=lambda: bench.start_worker(concurrency=args.threads, noop=True),
        )
        runs_phase(bench, producer, server, WARMUP_RUNS, producers=args.producers, timeout=args.timeout,
                   label="warm-up runs")
        print(f"runs: {args.runs} runs…")
        profiler: AbstractContextManager[object] = (
            Profiler(worker.pid, profile, rate=args.profile_rate) if args.profile else nullcontext()
        )
        with profiler:
            runs, cpu = cpu_during(
                lambda: runs_phase(bench, producer, server, args.runs, producers=args.producers,
                                   timeout=args.timeout),
                {"worker": worker.pid, "toolbox_server": server.process.pid, "bench": os.getpid(),
                 **{f"rabbitmq_{i}": pid for i, pid in enumerate(pids_named("beam.smp"))},
                 **{f"redis_{i}": pid for i, pid in enumerate(pids_named("redis-server"))}},
                threads_of=worker.pid,
            )
        print(f"no-op, live: {args.noop} messages sent while the worker consumes…")
        live = noop_live_phase(bench, broker, args.noop, producers=args.producers, timeout=args.timeout)
        peak_kib = worker.peak_rss_kib()
        rss_kib = worker.rss_kib()
        worker.log.read_new()
        errors = [e for e in worker.log.entries if e.get("level") in {"error", "critical"}]
    # Everything has stopped and been cleaned up; what follows only reports.
    ratio = runs["per_s"] / noop["per_s"]
    peak_mb = None if peak_kib is None else round(peak_kib / 1024, 1)
    cpu["cpu_ms_per_run"] = {name: None if used is None else round(1000 * used / args.runs, 2)
                             for name, used in cpu["cpu_s"].items()}
    results: dict[str, Any] = {
        "benchmark": "throughput",
        "machine": info,
        "command": " ".join(["python -m bench.throughput", *(argv if argv is not None else sys.argv[1:])]),
        "worker_threads": args.threads,
        "producers": args.producers,
        "noop": noop,
        "noop_live": live,
        "runs": runs,
        "runs_cpu": cpu,
        "ratio_runs_to_noop": round(ratio, 4),
        "ratio_runs_to_noop_live": round(runs["per_s"] / live["per_s"], 4),
        "worker_peak_rss_mb": peak_mb,
        "worker_rss_at_end_mb": None if rss_kib is None else round(rss_kib / 1024, 1),
        "worker_errors_logged": len(errors),
        "aim": {"ratio_at_least": AIM_RATIO, "peak_rss_mb_at_most": AIM_RSS_MB},
        "aim_met": {"ratio": ratio >= AIM_RATIO, "rss": peak_mb is not None and peak_mb <= AIM_RSS_MB},
    }
    if args.profile:
        results["profile"] = {"raw": str(profile), **summarize_profile(profile)} if profile.exists() else None
    path = bench.write_results(results)
    print_results(results, path)
    return 0 if runs["statuses"].get(RunStatus.COMPLETED.value) == args.runs else 1


def print_results(results: Mapping[str, Any], path: Path) -> None:
    noop, live, runs, cpu = results["noop"], results["noop_live"], results["runs"], results["runs_cpu"]
    ratio, met = results["ratio_runs_to_noop"], results["aim_met"]
    print()
    print("== runbrake throughput ==")
    print_machine(results["machine"])
    print(f"worker: 1 process, {results['worker_threads']} threads; {results['producers']} producer thread(s); "
          "RabbitMQ, Redis and the MCP server on loopback")
    print(f"no-op actor, backlog drain : {noop['messages']:>5} msgs in {noop['drain_s']:7.3f} s; steady state "
          f"{noop['per_s']:8.1f} msg/s (whole drain {noop['per_s_whole_drain']:.1f}/s)")
    print(f"no-op actor, live          : {live['messages']:>5} msgs in {live['elapsed_s']:7.3f} s = "
          f"{live['per_s']:8.1f} msg/s  (bound by sending with confirms: "
          f"{live['messages'] / live['send_s']:.0f}/s)")
    print(f"runs (3 model + 2 MCP calls): {runs['runs']:>4} runs in {runs['elapsed_s']:7.3f} s = "
          f"{runs['per_s']:8.1f} runs/s  (statuses {runs['statuses']})")
    per_run = ", ".join(f"{name} {ms}" for name, ms in cpu["cpu_ms_per_run"].items() if ms is not None)
    print(f"  CPU ms per run: {per_run}; whole machine busy (other processes too) {cpu['machine_busy_pct']} % of "
          f"{results['machine']['nproc']} cores; busiest worker threads "
          f"{cpu['busiest_threads_pct_of_a_core']} % of a core")
    print(f"ratio runs/s ÷ no-op msgs/s (backlog): {ratio:.4f}   aim ≥ {AIM_RATIO}: "
          f"{'met' if met['ratio'] else 'NOT met'}   (against the live no-op rate: "
          f"{results['ratio_runs_to_noop_live']:.4f})")
    print(f"worker peak RSS (VmHWM): {results['worker_peak_rss_mb']} MB   aim ≤ {AIM_RSS_MB} MB: "
          f"{'met' if met['rss'] else 'NOT met'}")
    if results["worker_errors_logged"]:
        print(f"worker logged {results['worker_errors_logged']} error line(s); rerun with --keep-logs to read them")
    if results.get("profile"):
        prof = results["profile"]
        print(f"profile of the run phase (py-spy, {prof['samples']} active samples):")
        print("  by thread: " + ", ".join(f"{name.split(': ')[-1]} {share} %" for name, share in prof["threads"][:4]))
        print(f"  {prof['busiest_thread']}, inclusive share of its top frames:")
        for frame, share in prof["inclusive"][:20]:
            print(f"    {share:5.1f} %  {frame}")
    print(f"results: {path}")


if __name__ == "__main__":
    sys.exit(main())
