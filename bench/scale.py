"""Scale: 1, 2 and 4 worker processes; short-run throughput, 2,000 runs in flight spread over them (RSS per
process, memory per run in flight), and cancel latency while they are held.

Run from the repository root::

    .venv/bin/python -m bench.scale [--processes 1,2,4] [--in-flight 2000] [--cancels 100]
        [--short-runs 400] [--servers 2] [--slow-s 900] [--progress-s 1] [--redis-cluster redis://SEED:PORT/0]

A short sanity run: ``--processes 1 --in-flight 50 --cancels 10 --short-runs 20``.

What it does, in its own namespace (``bench-<hex>``), on loopback only:

1. starts ``--servers`` example toolbox MCP servers over HTTP (catalog names ``toolbox``, ``toolbox-1``, …),
   whose ``slow`` tool reports progress every ``--progress-s`` seconds:
   2,000 ``slow`` calls each sending MCP progress every second cost one server process a core by
   themselves on this machine, so they are spread over several; the servers share the machine's cores
   with the workers, which the CPU figures show;
2. per process count P: ``runbrake worker --processes P --concurrency ⌈in-flight / P⌉`` (the supervisor),
   waits for every child's ``worker_started`` line, and warms up with a few runs (not counted);
3. **(a) throughput**: ``--short-runs`` runs (three rounds, two quick MCP calls each) enqueued at once from
   four producer threads, timed from the first enqueue until every run is terminal in the store;
4. **(b) in flight**: each child's RSS is read idle, then ``--in-flight`` runs whose first turn calls
   ``slow(--slow-s)`` are enqueued (round-robin over the servers) and the bench waits until the servers have
   *started* every call (or their count stopped growing for 20 s: ``held`` says how many were); then
   each child's RSS (``VmRSS``) and peak (``VmHWM``), memory per run in flight
   (the children's RSS growth over the runs they hold), and the CPU the workers and servers use over a
   five-second hold, and each worker's loop busy share (its busiest thread's CPU over the hold);
5. **(c) cancel latency** while (b) holds: ``--cancels`` runs picked at random are cancelled one at a time
   (fence + message, :func:`runbrake.shared.messaging.cancel.cancel_run`) after a random pause of up to 100 ms; a
   sample is from just before ``cancel_run`` to the ``recorded_at`` of the run's cancelled tool step;
   ``by_backstop`` counts those the backstop found (``cancel_found_by_backstop``), not the message;
6. SIGTERM to the supervisor (``RUNBRAKE_DRAIN_S=1``: the held runs are handed over at once): how long
   the stop took, and that no run was left ``running``;
7. prints the table, writes ``bench/results/scale.json``, and cleans up.

``--redis-cluster URL`` points the workers and this script at a Redis Cluster (``RUNBRAKE_REDIS_URL=URL``,
``RUNBRAKE_REDIS_CLUSTER=true``), for a build that supports it.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench._harness import (
    Bench,
    BenchError,
    JsonLines,
    ToolboxServer,
    Worker,
    all_terminal,
    cpu_seconds,
    in_threads,
    machine,
    print_machine,
    quick_run_spec,
    slow_run_spec,
    summary_ms,
    thread_cpu_seconds,
    wait_until,
)
from runbrake.shared.logging import configure_logging
from runbrake.shared.messaging.cancel import CancelPublisher, cancel_run
from runbrake.shared.messaging.producer import Producer
from runbrake.shared.messaging.rabbitmq import build_broker
from runbrake.shared.spec import RunSpec
from runbrake.shared.status import RunStatus
from runbrake.shared.steps import StepKind

RUNBRAKE = Path(sys.executable).parent / "runbrake"
PRODUCERS = 4
WARMUP_RUNS = 8
HOLD_S = 5.0
"""How long the CPU of workers and servers is measured while the runs are held."""
CANCEL_TIMEOUT_S = 10.0
PLATEAU_S = 20.0
"""Starting runs gives up once the count of calls in flight has not grown for this long."""
START_TIMEOUT_S = 60.0
START_TIMEOUT_PER_RUN_S = 0.12
RUN_TIMEOUT_PER_RUN_S = 0.25


def server_name(index: int) -> str:
    return "toolbox" if index == 0 else f"toolbox-{index}"


def children_of(pid: int) -> list[int]:
    """The child processes of ``pid`` (the supervisor's worker processes), from /proc."""
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def status_kib(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{key}:"):
            return int(line.split()[1])
    raise BenchError(f"no {key} for process {pid}")


def enqueue_all(bench: Bench, specs: Sequence[RunSpec]) -> list[str]:
    """Enqueue ``specs`` from :data:`PRODUCERS` threads (a broker each); the run ids, in order."""
    ids: list[str] = [""] * len(specs)
    brokers = [build_broker(bench.settings) for _ in range(PRODUCERS)]
    producers = [Producer(bench.store, broker, bench.admission()) for broker in brokers]

    def work(i: int) -> None:
        ids[i] = producers[i % PRODUCERS].enqueue(specs[i]).run_id  # thread k takes every i with i % PRODUCERS == k

    try:
        in_threads(PRODUCERS, len(specs), work)
    finally:
        for broker in brokers:
            broker.close()
    return ids


def running_count(bench: Bench, run_ids: Sequence[str]) -> int:
    with bench.store.redis.pipeline(transaction=False) as pipe:
        for run_id in run_ids:
            pipe.hget(bench.store.run_key(run_id), "status")
        statuses = pipe.execute()
    return sum(1 for s in statuses if RunStatus.parse(s) is RunStatus.RUNNING)


class Config:
    """One process count: its supervisor, its children, its figures."""

    def __init__(self, bench: Bench, servers: Sequence[ToolboxServer], events: JsonLines, processes: int,
                 args: argparse.Namespace) -> None:
        self.bench = bench
        self.servers = servers
        self.events = events
        self.processes = processes
        self.args = args
        self.concurrency = math.ceil(args.in_flight / processes)
        self.results: dict[str, Any] = {"processes": processes, "concurrency": self.concurrency}

    def run(self) -> dict[str, Any]:
        supervisor = self.bench.start_logging_process(
            f"workers-{self.processes}",
            [str(RUNBRAKE), "worker", "--processes", str(self.processes), "--concurrency", str(self.concurrency)])

        def all_started() -> bool:
            supervisor.log.read_new()
            return sum(1 for e in supervisor.log.entries if e.get("event") == "worker_started") >= self.processes

        wait_until(all_started, timeout=START_TIMEOUT_S, what=f"{self.processes} worker_started lines",
                   alive=[supervisor.process])
        children = children_of(supervisor.pid) if self.processes > 1 else [supervisor.pid]
        self._short_runs(WARMUP_RUNS, supervisor)
        self.results["throughput"] = self._short_runs(self.args.short_runs, supervisor)
        self._in_flight(supervisor, children)
        return self.results

    def _short_runs(self, count: int, supervisor: Worker) -> dict[str, Any]:
        specs = [quick_run_spec(self.servers[0], i) for i in range(count)]
        started = time.perf_counter()
        ids = enqueue_all(self.bench, specs)
        wait_until(all_terminal(self.bench.store, ids), timeout=START_TIMEOUT_S + RUN_TIMEOUT_PER_RUN_S * count,
                   what=f"{count} short runs to finish", interval=0.02, alive=[supervisor.process])
        seconds = time.perf_counter() - started
        completed = sum(1 for r in ids if self.bench.store.get(r).status is RunStatus.COMPLETED)
        return {"runs": count, "completed": completed, "seconds": round(seconds, 2),
                "runs_per_s": round(count / seconds, 1)}

    def _in_flight(self, supervisor: Worker, children: list[int]) -> None:
        idle = {pid: status_kib(pid, "VmRSS") for pid in children}
        count, servers = self.args.in_flight, len(self.servers)
        started_before = self._started_calls()
        specs = [slow_run_spec(self.args.slow_s, server=server_name(i % servers), input_text="scale")
                 for i in range(count)]
        t0 = time.perf_counter()
        ids = enqueue_all(self.bench, specs)
        enqueued_s = time.perf_counter() - t0
        self._wait_for_starts(started_before + count, supervisor)
        held = self._started_calls() - started_before
        ramp_s = time.perf_counter() - t0
        rss = {pid: status_kib(pid, "VmRSS") for pid in children}
        peak = {pid: status_kib(pid, "VmHWM") for pid in children}
        growth_kib = sum(rss[pid] - idle[pid] for pid in children)
        cpu = self._hold_cpu(children)
        self.results["in_flight"] = {
            "runs": count, "held": held, "enqueue_s": round(enqueued_s, 1), "all_started_s": round(ramp_s, 1),
            "rss_idle_mib": [round(idle[p] / 1024, 1) for p in children],
            "rss_mib": [round(rss[p] / 1024, 1) for p in children],
            "peak_rss_mib": [round(peak[p] / 1024, 1) for p in children],
            "kib_per_run_in_flight": round(growth_kib / max(held, 1), 1),
            **cpu,
        }
        self.results["cancel"] = self._cancels(self._running(ids), supervisor)
        stop_started = time.perf_counter()
        code = supervisor.process.stop()
        self.results["stop"] = {"exit_code": code, "seconds": round(time.perf_counter() - stop_started, 1),
                                "runs_left_running": running_count(self.bench, ids)}

    def _wait_for_starts(self, target: int, supervisor: Worker) -> None:
        """Until the servers have started ``target`` slow calls in all, or the count stopped growing for
        :data:`PLATEAU_S` (the processes hold no more: the figures are then for as many as they hold)."""
        last, grew_at = -1, time.monotonic()

        def done() -> bool:
            nonlocal last, grew_at
            started = self._started_calls()
            if started > last:
                last, grew_at = started, time.monotonic()
            return started >= target or time.monotonic() - grew_at > PLATEAU_S

        try:
            wait_until(done, timeout=START_TIMEOUT_S + START_TIMEOUT_PER_RUN_S * self.args.in_flight,
                       what=f"{self.args.in_flight} slow calls to start", interval=0.05, alive=[supervisor.process])
        except BenchError:
            if supervisor.process.popen.poll() is not None:
                raise  # the workers died; otherwise go on with as many as started in the time given

    def _running(self, ids: list[str]) -> list[str]:
        """The runs whose slow call is in flight: running, no tool step yet."""
        return [r for r in ids if (record := self.bench.store.get(r)).status is RunStatus.RUNNING
                and not any(s.kind is StepKind.TOOL for s in record.steps)]

    def _started_calls(self) -> int:
        self.events.read_new()
        return sum(1 for e in self.events.entries if e.get("event") == "started" and e.get("tool") == "slow")

    def _hold_cpu(self, children: list[int]) -> dict[str, Any]:
        pids = {"workers": children, "servers": [s.process.pid for s in self.servers]}
        before = {k: [cpu_seconds(p) or 0.0 for p in v] for k, v in pids.items()}
        threads_before = {pid: thread_cpu_seconds(pid) for pid in children}
        time.sleep(HOLD_S)  # measuring an interval
        after = {k: [cpu_seconds(p) or 0.0 for p in v] for k, v in pids.items()}
        threads_after = {pid: thread_cpu_seconds(pid) for pid in children}
        # The event loop is each worker's busiest thread by far while it holds talking runs.
        loop_busy = [
            round(100 * max((used - threads_before[pid].get(tid, 0.0) for tid, used in threads_after[pid].items()),
                            default=0.0) / HOLD_S)
            for pid in children
        ]
        return {**{f"{k}_cpu_pct": [round(100 * (a - b) / HOLD_S) for a, b in zip(after[k], before[k], strict=True)]
                   for k in pids},
                "loop_busy_pct": loop_busy}

    def _cancels(self, ids: list[str], supervisor: Worker) -> dict[str, Any]:
        publisher = CancelPublisher(self.bench.settings)
        rng = random.Random(self.processes)
        picked = rng.sample(ids, min(self.args.cancels, len(ids)))
        samples, missed = [], 0
        try:
            for run_id in picked:
                time.sleep(rng.uniform(0, 0.1))  # cancels must not fall in step with the backstop's timer
                t0 = time.time()
                result = cancel_run(self.bench.store, publisher, run_id, reason="benchmark",
                                    requested_by="bench.scale")
                if not result.won:
                    raise BenchError(f"the cancel of run {run_id} found {result.found.value}")
                try:
                    step = wait_until(lambda run_id=run_id: self._cancelled_step(run_id), timeout=CANCEL_TIMEOUT_S,
                                      what=f"the cancelled step of {run_id}", interval=0.003,
                                      alive=[supervisor.process])
                except BenchError:
                    if supervisor.process.popen.poll() is not None:
                        raise
                    missed += 1
                    continue
                samples.append(step - t0)
        finally:
            publisher.close()
        supervisor.log.read_new()
        by_backstop = sum(1 for e in supervisor.log.entries
                          if e.get("event") == "cancel_found_by_backstop" and e.get("run_id") in set(picked))
        return {**summary_ms(samples), "missed": missed, "by_backstop": by_backstop}

    def _cancelled_step(self, run_id: str) -> float | None:
        for step in self.bench.store.get(run_id).steps:
            if step.kind is StepKind.TOOL:
                return step.recorded_at
        return None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--processes", default="1,2,4", help="process counts to run, comma-separated (1,2,4)")
    parser.add_argument("--in-flight", type=int, default=2000, help="runs held in flight over all processes")
    parser.add_argument("--cancels", type=int, default=100, help="cancels measured while they are held")
    parser.add_argument("--short-runs", type=int, default=400, help="short runs for the throughput figure")
    parser.add_argument("--servers", type=int, default=2, help="toolbox MCP server processes (2)")
    parser.add_argument("--progress-s", type=float, default=1.0,
                        help="how often each slow call reports MCP progress, seconds (1)")
    parser.add_argument("--slow-s", type=float, default=900.0, help="length of each slow call, seconds (900)")
    parser.add_argument("--redis-cluster", metavar="URL", help="a Redis Cluster seed URL (RUNBRAKE_REDIS_CLUSTER)")
    parser.add_argument("--keep", action="store_true", help="keep the logs (printed path)")
    args = parser.parse_args(argv)
    configure_logging("WARNING")
    env = {"RUNBRAKE_REDIS_URL": args.redis_cluster, "RUNBRAKE_REDIS_CLUSTER": "true"} if args.redis_cluster else {}
    # The stop hands the held runs over at once instead of draining 30 s for runs that never end.
    env["RUNBRAKE_DRAIN_S"] = "1"
    info = machine()
    print_machine(info)
    results: dict[str, Any] = {"machine": info, "options": vars(args), "configs": []}
    with Bench("scale", env=env, keep=args.keep) as bench:
        servers = [bench.start_toolbox("--progress-s", str(args.progress_s)) for _ in range(args.servers)]
        bench.catalog.write_text("".join(f'[mcp_servers.{server_name(i)}]\nurl = "{s.url}"\n'
                                         for i, s in enumerate(servers)), encoding="utf-8")
        events = servers[0].events  # every server appends to the same events file
        for processes in (int(p) for p in args.processes.split(",")):
            config = Config(bench, servers, events, processes, args).run()
            results["configs"].append(config)
            print(json.dumps(config))
        path = bench.write_results(results)
    print_table(results["configs"])
    print(f"results: {path}")
    return 0


def print_table(configs: Sequence[dict[str, Any]]) -> None:
    print(f"{'procs':>5} {'conc':>5} {'runs/s':>7} {'in flight':>9} {'KiB/run':>8} {'peak RSS MiB':>16} "
          f"{'cancel p50':>10} {'p99':>7} {'max':>7} {'missed':>6} {'backstop':>8} {'worker CPU %':>14} "
          f"{'loop busy %':>12} {'server CPU %':>13}")
    for c in configs:
        flight, cancel = c["in_flight"], c["cancel"]
        print(f"{c['processes']:>5} {c['concurrency']:>5} {c['throughput']['runs_per_s']:>7} {flight['held']:>9} "
              f"{flight['kib_per_run_in_flight']:>8} {_joined(flight['peak_rss_mib']):>16} "
              f"{cancel.get('p50', '-'):>10} {cancel.get('p99', '-'):>7} {cancel.get('max', '-'):>7} "
              f"{cancel['missed']:>6} {cancel['by_backstop']:>8} {_joined(flight['workers_cpu_pct']):>14} "
              f"{_joined(flight['loop_busy_pct']):>12} {_joined(flight['servers_cpu_pct']):>13}")


def _joined(values: Sequence[object]) -> str:
    return ",".join(map(str, values))


if __name__ == "__main__":
    sys.exit(main())
