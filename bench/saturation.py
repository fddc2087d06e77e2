"""Saturation: one worker process offered more runs than it can serve, against the npm reference MCP server.

Run from the repository root::

    .venv/bin/python -m bench.saturation [--offered 250,1000,2000,4000] [--call-s 120] [--cancels 20]
        [--concurrency N] [--memory-dir DIR]

A short sanity run: ``--offered 50 --call-s 20 --cancels 5``. What a held run keeps (bench/_memtrace.py's
dumps, idle and with the runs held): ``--offered 200 --call-s 120 --cancels 0 --memory-dir DIR``.

What it does, in its own namespace, on loopback only, for each offered load N (a fresh worker each):

1. starts the npm ``@modelcontextprotocol/server-everything`` over streamable HTTP (installed once into
   ``.venv/node`` with npm) and names it ``everything`` in the catalog;
2. starts one ``python -m runbrake.worker --concurrency N`` (``--concurrency`` given: that many) with its
   metrics port, admission by health at its defaults (docs/leases.md, "Capacity: runs in flight");
3. enqueues N runs whose first turn calls ``trigger-long-running-operation`` for ``--call-s`` seconds with a
   progress notification every second; waits until the count of runs ``running`` stopped growing for 10 s
   (``held``: what the process took; the rest waits ``queued``);
4. over a 10 s hold: the CPU of the worker, the node server, Redis and RabbitMQ; the worker's event-loop lag
   (``runbrake_event_loop_lag_seconds``, read each second) and RSS per run held;
5. cancels ``--cancels`` held runs (of the half started last) one at a time: from just before ``cancel_run``
   to the cancelled tool step's ``recorded_at`` (``missed``: not recorded within 10 s; ``ended_first``: the
   run ended before the cancel, so there is nothing to time);
6. waits until every held run not cancelled has ended: **calls broken** are those whose tool step is not
   ``ok`` or whose run did not complete; **leases lapsed** are the worker's ``lease_not_renewed`` lines;
7. stops the worker (SIGTERM), prints the table and writes ``bench/results/saturation.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import re
import signal
import sys
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from bench._harness import (
    Bench,
    BenchError,
    ManagedProcess,
    Worker,
    cpu_seconds,
    free_port,
    machine,
    print_machine,
    summary_ms,
    wait_until,
)
from bench.scale import enqueue_all, status_kib
from runbrake.shared.logging import configure_logging
from runbrake.shared.messaging.cancel import CancelPublisher, cancel_run
from runbrake.shared.outcome import ToolOutcome
from runbrake.shared.spec import RunSpec
from runbrake.shared.status import RunStatus
from runbrake.shared.steps import StepKind

SERVER = "everything"
TOOL = "trigger-long-running-operation"
PLATEAU_S = 10.0
"""The runs held are counted once the count of ``running`` runs has not grown for this long."""
HOLD_S = 10.0
"""How long CPU and loop lag are measured while the runs are held."""
CANCEL_TIMEOUT_S = 10.0


def long_call_spec(seconds: float) -> RunSpec:
    """A run whose first turn calls the reference server's long operation, one progress report a second."""
    return RunSpec.parse({
        "input": "saturation",
        "model": {"provider": "scripted", "turns": [
            {"tool_calls": [{"server": SERVER, "tool": TOOL,
                             "arguments": {"duration": seconds, "steps": max(1, int(seconds))}}]},
            {"content": "done"},
        ]},
        "mcp_servers": [SERVER],
        "tool_timeout_s": seconds + 600.0,
    })


def metric(port: int, name: str) -> float | None:
    """One sample of the worker's ``/metrics`` (``name`` with its labels, if any, as the text shows them)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
            text = answer.read().decode()
    except OSError:
        return None
    found = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else None


PAUSE_BOUNDS_S = (0.01, 0.025, 0.1)
"""The pauses counted apart in :func:`collections`: longer than each (buckets of ``runbrake_gc_pause_seconds``)."""


def collections(port: int) -> dict[str, dict[str, float | None]]:
    """The worker's garbage collections so far, by generation: how many, their mean pause and the longest bucket
    (ms), and how many paused longer than each of :data:`PAUSE_BOUNDS_S` (``over_10ms``…)."""
    found: dict[str, dict[str, float | None]] = {}
    for generation in ("0", "1", "2"):
        label = f'generation="{generation}"'
        count = metric(port, f"runbrake_gc_pause_seconds_count{{{label}}}")
        total = metric(port, f"runbrake_gc_pause_seconds_sum{{{label}}}")
        row: dict[str, float | None] = {
            "count": count, "mean_ms": round(1000 * total / count, 1) if count and total is not None else None}
        for bound in PAUSE_BOUNDS_S:
            within = metric(port, f'runbrake_gc_pause_seconds_bucket{{{label},le="{bound}"}}')
            row[f"over_{bound * 1000:g}ms"] = None if count is None or within is None else count - within
        found[generation] = row
    return found


def listening_pids(port: int) -> list[int]:
    """The processes with a socket listening on TCP ``port`` (Linux's /proc/net/tcp{,6}): the shared Redis and
    RabbitMQ, not the private instances other tests start beside them under the same command name."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                if int(fields[1].rpartition(":")[2], 16) == port and fields[3] == "0A":  # 0A: LISTEN
                    inodes.add(f"socket:[{fields[9]}]")
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if any(os.readlink(fd) in inodes for fd in (entry / "fd").iterdir()):
                    pids.append(int(entry.name))
    return pids


class Load:
    """One offered load: its worker, its runs, its figures."""

    def __init__(self, bench: Bench, server: ManagedProcess, offered: int, args: argparse.Namespace) -> None:
        self.bench = bench
        self.server = server
        self.offered = offered
        self.args = args
        self.metrics_port = free_port()

    def run(self) -> dict[str, Any]:
        self.bench.env["RUNBRAKE_METRICS_PORT"] = str(self.metrics_port)
        worker = self._start_worker()
        idle_kib = status_kib(worker.pid, "VmRSS")
        self._dump_heap(worker)
        ids = enqueue_all(self.bench, [long_call_spec(self.args.call_s) for _ in range(self.offered)])
        held = self._held(ids, worker)
        rss_kib = status_kib(worker.pid, "VmRSS")
        self._dump_heap(worker)
        hold = self._hold(worker)
        cancel = self._cancels(held, worker)
        collections_ = collections(self.metrics_port)
        broken = self._broken(held, set(cancel.pop("cancelled")), worker)
        worker.log.read_new()
        lapsed = sum(1 for e in worker.log.entries if e.get("event") == "lease_not_renewed")
        handed_back = sum(1 for e in worker.log.entries if e.get("event") == "run_handed_back")
        code = worker.process.stop()
        self.bench.store.delete_namespace()  # the runs still queued: the next load starts from nothing
        return {
            "offered": self.offered, "held": len(held), "calls_broken": broken, "leases_lapsed": lapsed,
            "handed_back": handed_back, "cancel": cancel,
            "kib_per_run_held": round((rss_kib - idle_kib) / max(len(held), 1), 1),
            "rss_mib": round(rss_kib / 1024, 1), **hold, "collections": collections_, "worker_exit": code,
        }

    def _start_worker(self) -> Worker:
        """The worker, under bench/_memtrace.py with ``--memory-dir``."""
        concurrency = str(self.args.concurrency or self.offered)
        if self.args.memory_dir is None:
            return self.bench.start_worker(concurrency=int(concurrency))
        return self.bench.start_logging_process("worker", [
            "-m", "bench._memtrace", "--trace", "--garbage", str(self.args.memory_dir), "runbrake.worker",
            "--concurrency", concurrency], timeout=300)

    def _dump_heap(self, worker: Worker) -> None:
        """With ``--memory-dir``: ask bench/_memtrace.py for a dump of the worker's heap, and wait for it."""
        if self.args.memory_dir is None:
            return
        path = self.args.memory_dir / f"{worker.pid}.jsonl"
        lines = len(path.read_text().splitlines()) if path.exists() else 0
        os.kill(worker.pid, signal.SIGUSR2)
        wait_until(lambda: path.exists() and len(path.read_text().splitlines()) > lines, timeout=300,
                   what="the worker's heap dump", interval=0.5, alive=[worker.process])

    def _held(self, ids: list[str], worker: Worker) -> list[str]:
        last, grew_at = -1, time.monotonic()

        def plateau() -> bool:
            nonlocal last, grew_at
            running = self._running(ids)
            if len(running) > last:
                last, grew_at = len(running), time.monotonic()
            return len(running) >= self.offered or time.monotonic() - grew_at > PLATEAU_S

        wait_until(plateau, timeout=60 + 0.2 * self.offered, what="the runs held to stop growing", interval=0.5,
                   alive=[worker.process])
        return self._running(ids)

    def _running(self, ids: list[str]) -> list[str]:
        return [r for r, s in zip(ids, self._statuses(ids), strict=True) if s is RunStatus.RUNNING]

    def _statuses(self, ids: list[str]) -> list[RunStatus]:
        """The statuses of ``ids``: one pipelined HGET each, not a whole record (read twice a second over
        thousands of runs, beside the worker measured)."""
        with self.bench.store.redis.pipeline(transaction=False) as pipe:
            for run_id in ids:
                pipe.hget(self.bench.store.run_key(run_id), "status")
            return [RunStatus.parse(s) for s in pipe.execute()]

    def _hold(self, worker: Worker) -> dict[str, Any]:
        settings = self.bench.settings
        pids = {"worker": [worker.pid], "server": [self.server.pid],
                "redis": listening_pids(urlsplit(settings.redis_url).port or 6379),
                "rabbitmq": listening_pids(urlsplit(settings.rabbitmq_url).port or 5672)}
        before = {k: sum(cpu_seconds(p) or 0.0 for p in v) for k, v in pids.items()}
        lags, rates = [], []
        for _ in range(int(HOLD_S)):
            time.sleep(1.0)  # sampling a gauge once a second over the hold
            lag = metric(self.metrics_port, "runbrake_event_loop_lag_seconds")
            if lag is not None:
                lags.append(lag)
            rates.append(metric(self.metrics_port, "runbrake_admission_rate"))
        after = {k: sum(cpu_seconds(p) or 0.0 for p in v) for k, v in pids.items()}
        return {**{f"{k}_cpu_pct": round(100 * (after[k] - before[k]) / HOLD_S) for k in pids},
                "loop_lag_ms": summary_ms(lags), "admission_rate": rates}

    def _cancels(self, held: list[str], worker: Worker) -> dict[str, Any]:
        publisher = CancelPublisher(self.bench.settings)
        rng = random.Random(self.offered)
        # From the half started last: the runs held first may be near their call's end (the ramp takes a while).
        started = {run_id: self.bench.store.get(run_id).started_at or 0.0 for run_id in held}
        late = sorted(held, key=started.__getitem__)[len(held) // 2:]
        picked = rng.sample(late, min(self.args.cancels, len(late)))
        samples, missed, ended = [], 0, 0
        try:
            for run_id in picked:
                time.sleep(rng.uniform(0, 0.1))  # not in step with the backstop's timer
                t0 = time.time()
                if not cancel_run(self.bench.store, publisher, run_id, reason="bench",
                                  requested_by="bench.saturation").won:
                    ended += 1  # its call ended first: no cancel to time
                    continue
                try:
                    samples.append(wait_until(lambda run_id=run_id: self._tool_step_at(run_id),
                                              timeout=CANCEL_TIMEOUT_S, what=f"the cancelled step of {run_id}",
                                              interval=0.003, alive=[worker.process]) - t0)
                except BenchError:
                    missed += 1
        finally:
            publisher.close()
        return {**summary_ms(samples), "missed": missed, "ended_first": ended, "cancelled": picked}

    def _tool_step_at(self, run_id: str) -> float | None:
        return next((s.recorded_at for s in self.bench.store.get(run_id).steps if s.kind is StepKind.TOOL), None)

    def _broken(self, held: list[str], cancelled: set[str], worker: Worker) -> int:
        """Held runs not cancelled here whose call did not come back ``ok`` or whose run did not complete."""
        rest = [r for r in held if r not in cancelled]
        wait_until(lambda: all(status.is_terminal for status in self._statuses(rest)),
                   timeout=self.args.call_s + 120, what="the held runs to end", interval=0.5, alive=[worker.process])
        broken = 0
        for run_id in rest:
            record = self.bench.store.get(run_id)
            outcomes = [s.tool_outcome for s in record.steps if s.kind is StepKind.TOOL]
            broken += record.status is not RunStatus.COMPLETED or outcomes != [ToolOutcome.OK]
        return broken


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--offered", default="250,1000,2000,4000", help="runs offered to the process, comma-separated")
    parser.add_argument("--call-s", type=float, default=120.0, help="length of each call, seconds (120)")
    parser.add_argument("--cancels", type=int, default=20, help="cancels amid the runs held (20)")
    parser.add_argument("--concurrency", type=int, default=0, help="--concurrency (default: the runs offered)")
    parser.add_argument("--keep", action="store_true", help="keep the logs (printed path)")
    parser.add_argument("--memory-dir", type=Path, default=None,
                        help="run the worker under bench/_memtrace.py --trace --garbage and dump its heap here idle "
                             "and with the runs held (slows the worker severalfold: for what a run keeps, not speed)")
    args = parser.parse_args(argv)
    configure_logging("WARNING")
    info = machine()
    print_machine(info)
    rows = []
    with Bench("saturation", keep=args.keep) as bench:
        server = bench.start_everything(SERVER)
        for offered in [int(n) for n in args.offered.split(",")]:
            row = Load(bench, server, offered, args).run()
            rows.append(row)
            cancel = row["cancel"]
            print(f"offered {row['offered']:>5}: held {row['held']:>5}, broken {row['calls_broken']}, "
                  f"lapsed {row['leases_lapsed']}, cancel p50 {cancel.get('p50', '-')} / p99 {cancel.get('p99', '-')} "
                  f"ms ({cancel['missed']} missed, {cancel['ended_first']} ended first), "
                  f"loop lag p50 {row['loop_lag_ms'].get('p50', '-')} ms, "
                  f"{row['kib_per_run_held']} KiB a run, CPU worker {row['worker_cpu_pct']} % server "
                  f"{row['server_cpu_pct']} % redis {row['redis_cpu_pct']} % rabbitmq {row['rabbitmq_cpu_pct']} %, "
                  f"collections by generation {row['collections']}",
                  flush=True)
        path = bench.write_results({"machine": info, "args": {k: str(v) if isinstance(v, Path) else v
                                                              for k, v in vars(args).items()}, "loads": rows})
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
