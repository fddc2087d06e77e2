"""Overhead: runbrake against a hand-written peer doing the same MCP work, in alternating rounds of one run.

Run from the repository root::

    .venv/bin/python -m bench.overhead [--runs 120] [--rounds 3] [--threads 8] [--server URL]

What it does, in its own namespace (``bench-<hex>``), on loopback only:

1. starts the example toolbox MCP server over HTTP (or, with ``--server URL``, uses that MCP server, e.g. the
   npm reference server, which must offer ``get-sum`` and ``echo``; echo's text parameter is read from its
   schema: ``text`` on the toolbox, ``message`` on the reference server);
2. starts both workers, which run for the whole benchmark, each one process with ``--threads`` threads and
   prefetch = threads: runbrake's (``python -m runbrake.worker``) and the peer (``python -m bench._peer``: a
   plain Dramatiq actor with the AsyncIO middleware on its own queue ``<ns>.peer``, which per message opens
   an MCP client the way runbrake's worker does, lists the tools, calls get-sum, then echo, and counts the
   message in Redis);
3. warms both up (``--warmup`` each, not counted), then alternates rounds, peer first: per round one side gets
   a backlog of N (``--runs``) enqueued by ``--producers`` threads: runbrake runs through
   :meth:`Producer.enqueue` (a scripted model: get-sum, then echo, then the answer; 3 model calls, 2 tool
   calls), peer messages through the same kind of broker (publisher confirms);
4. per round: wall time from just before the first enqueue to the last completion (runbrake: the latest
   ``finished_at`` once every run is terminal; peer: the time of the latest completion the peer recorded
   once its counter reached N), the CPU time (``/proc/<pid>/stat`` utime + stime) each worker and the
   MCP server used meanwhile; and correctness: every runbrake run ``completed`` with two ``ok`` tool steps,
   the peer's counter equal to N with no failures;
5. prints a table, the totals per side and the ratios runbrake/peer (worker CPU per run; runs/s), writes
   ``bench/results/overhead.json``, and cleans up (processes, Redis keys, queues, exchange).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from dramatiq.brokers.rabbitmq import RabbitmqBroker

from bench import _profile
from bench._harness import (
    Bench,
    BenchError,
    Worker,
    all_terminal,
    cpu_seconds,
    in_threads,
    machine,
    machine_busy_seconds,
    print_machine,
    quick_run_arguments,
    quick_run_spec,
    wait_until,
)
from bench._peer import PeerKeys, build_peer_broker, delete_peer_queues, peer_message, peer_queue, probe
from runbrake.shared.logging import configure_logging
from runbrake.shared.messaging.producer import Producer
from runbrake.shared.messaging.rabbitmq import build_broker
from runbrake.shared.messaging.wire import Topology
from runbrake.shared.outcome import ToolOutcome
from runbrake.shared.status import RunStatus
from runbrake.shared.steps import StepKind
from runbrake.shared.store import RunRecord

SIDES = ("peer", "runbrake")
POLL_S = 0.02
"""How often a round's completion is polled (the times themselves come from Redis, not from the poll)."""


@dataclass
class Endpoint:
    """The MCP server both sides call, and the name of echo's text parameter on it."""

    url: str
    echo_argument: str
    external: bool
    pid: int | None
    """The server's process id when this benchmark started it (its CPU time is then reported too)."""


@dataclass
class RoundOutcome:
    """What one side's round came to: when it started and ended (epoch seconds), and how many were right."""

    started: float
    finished: float
    ok: int
    problems: dict[str, int] = field(default_factory=dict)
    """What was wrong with the others, counted by description."""


class Side(Protocol):
    """One of the two contestants: a worker process and a way to give it N runs and wait for them."""

    name: str
    worker: Worker

    def run_round(self, count: int, tag: str, *, timeout: float) -> RoundOutcome: ...


class PeerSide:
    """The hand-written peer (``bench/_peer.py``): N messages on its queue, done when its counter says so."""

    name = "peer"

    def __init__(self, bench: Bench, worker: Worker, broker: RabbitmqBroker, endpoint: Endpoint, *,
                 producers: int) -> None:
        self.worker = worker
        self._bench = bench
        self._broker = broker
        self._endpoint = endpoint
        self._producers = producers
        self._topology = Topology(bench.namespace)
        broker.declare_queue(peer_queue(self._topology))

    def run_round(self, count: int, tag: str, *, timeout: float) -> RoundOutcome:
        keys = PeerKeys(self._bench.namespace, tag)
        redis = self._bench.store.redis
        url, echo_argument = self._endpoint.url, self._endpoint.echo_argument

        def send(i: int) -> None:
            get_sum, echo = quick_run_arguments(i, echo_argument=echo_argument)
            self._broker.enqueue(peer_message(self._topology, tag, url, get_sum, echo))

        def settled() -> bool:
            done, failed = redis.mget(keys.done, keys.failed)
            return int(done or 0) + int(failed or 0) >= count

        started = time.time()
        in_threads(self._producers, count, send)
        wait_until(settled, timeout=timeout, what=f"the peer's {count} messages ({tag})", interval=POLL_S,
                   alive=[self.worker.process])
        done, failed, last_done = redis.mget(keys.done, keys.failed, keys.last_done)
        problems: Counter[str] = Counter()
        if int(failed or 0):
            for error in redis.lrange(keys.errors, 0, -1):  # str: the store's client decodes responses
                problems[f"failed: {error!s}"] += 1
        if int(done or 0) != count:
            problems[f"counter {int(done or 0)} + failed {int(failed or 0)} for {count} messages"] += 1
        return RoundOutcome(started, float(last_done) if last_done else time.time(), int(done or 0),
                            dict(problems))


class RunbrakeSide:
    """runbrake: N runs through the producer, done when every one is terminal."""

    name = "runbrake"

    def __init__(self, bench: Bench, worker: Worker, producer: Producer, endpoint: Endpoint, *,
                 producers: int) -> None:
        self.worker = worker
        self._bench = bench
        self._producer = producer
        self._endpoint = endpoint
        self._producers = producers

    def run_round(self, count: int, tag: str, *, timeout: float) -> RoundOutcome:
        store = self._bench.store
        run_ids = [""] * count

        def enqueue(i: int) -> None:
            spec = quick_run_spec(self._endpoint.url, i, echo_argument=self._endpoint.echo_argument)
            run_ids[i] = self._producer.enqueue(spec).run_id

        started = time.time()
        in_threads(self._producers, count, enqueue)
        wait_until(all_terminal(store, run_ids), timeout=timeout, what=f"{count} runs ({tag})", interval=POLL_S,
                   alive=[self.worker.process])
        records = [store.get(run_id) for run_id in run_ids]
        problems = Counter(problem for problem in map(run_problem, records) if problem)
        finished = max(r.finished_at or time.time() for r in records)
        return RoundOutcome(started, finished, count - problems.total(), dict(problems))


def run_problem(record: RunRecord) -> str | None:
    """What is wrong with a quick run's record, or None: it must be ``completed`` with two ``ok`` tool steps."""
    if record.status is not RunStatus.COMPLETED:
        return f"status {record.status.value} ({record.termination_reason.value}): {record.error[:200]}"
    outcomes = [s.tool_outcome for s in record.steps if s.kind is StepKind.TOOL]
    if outcomes != [ToolOutcome.OK, ToolOutcome.OK]:
        return f"tool outcomes {[None if o is None else o.value for o in outcomes]}"
    return None


def measure_round(
    side: Side, other: Side, count: int, tag: str, *, server_pid: int | None, timeout: float
) -> dict[str, Any]:
    """One round of ``side``'s, with the CPU time each process used meanwhile."""
    pids = {"worker": side.worker.pid, "other_worker": other.worker.pid}
    if server_pid is not None:
        pids["server"] = server_pid
    before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    busy_before, total_before = machine_busy_seconds()
    outcome = side.run_round(count, tag, timeout=timeout)
    busy, total = machine_busy_seconds()
    used: dict[str, float | None] = {}
    for name, pid in pids.items():
        after, start = cpu_seconds(pid), before[name]
        used[name] = None if after is None or start is None else after - start
    elapsed = outcome.finished - outcome.started
    return {
        "side": side.name,
        "tag": tag,
        "runs": count,
        "ok": outcome.ok,
        "problems": outcome.problems,
        "elapsed_s": round(elapsed, 3),
        "per_s": round(count / elapsed, 2),
        "cpu_s": {name: None if value is None else round(value, 3) for name, value in used.items()},
        "cpu_ms_per_run": {name: None if value is None else round(1000 * value / count, 2)
                           for name, value in used.items()},
        "machine_busy_pct": round(100 * (busy - busy_before) / (total - total_before), 1)
        if total > total_before else None,
    }


def summarize(rounds: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Per side: totals over its rounds (runs/s = all runs ÷ all wall time; CPU per run = all CPU ÷ all runs)
    and the spread of the rounds' rates."""
    sides: dict[str, Any] = {}
    for name in SIDES:
        mine = [r for r in rounds if r["side"] == name]
        if not mine:
            continue
        runs = sum(r["runs"] for r in mine)
        elapsed = sum(r["elapsed_s"] for r in mine)
        cpu = {key: sum(r["cpu_s"][key] or 0.0 for r in mine) for key in mine[0]["cpu_s"]}
        rates = [r["per_s"] for r in mine]
        sides[name] = {
            "rounds": len(mine),
            "runs": runs,
            "ok": sum(r["ok"] for r in mine),
            "elapsed_s": round(elapsed, 3),
            "per_s": round(runs / elapsed, 2),
            "per_s_rounds": {"min": min(rates), "median": statistics.median(rates), "max": max(rates)},
            "cpu_ms_per_run": {key: round(1000 * value / runs, 2) for key, value in cpu.items()},
        }
    return sides


def ratios(sides: Mapping[str, Any]) -> dict[str, float | None]:
    """runbrake ÷ peer: worker CPU per run (above 1: runbrake costs more) and runs/s (below 1: it is slower)."""
    peer, runbrake = sides.get("peer"), sides.get("runbrake")
    if not peer or not runbrake:
        return {"worker_cpu_per_run": None, "runs_per_s": None}
    peer_cpu = peer["cpu_ms_per_run"]["worker"]
    return {
        "worker_cpu_per_run": round(runbrake["cpu_ms_per_run"]["worker"] / peer_cpu, 3) if peer_cpu else None,
        "runs_per_s": round(runbrake["per_s"] / peer["per_s"], 3),
    }


def choose_echo_argument(url: str) -> str:
    """Echo's text parameter on the server at ``url``; BenchError when it lacks get-sum or echo."""
    tools = probe(url)
    missing = {"get-sum", "echo"} - set(tools)
    if missing:
        raise BenchError(f"the MCP server at {url} has no tool {', '.join(sorted(missing))} "
                         f"(it has {', '.join(sorted(tools)) or 'none'})")
    schema = tools["echo"].input_schema
    properties = schema.get("properties") or {}
    for name in ("text", "message"):
        if name in properties:
            return name
    required = schema.get("required") or []
    if required:
        return str(required[0])
    raise BenchError(f"cannot tell echo's text parameter on {url} from its schema {schema}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.overhead", description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=120, help="runs (or peer messages) per round (default 120)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per side, alternating (default 3)")
    parser.add_argument("--threads", type=int, default=8, help="worker threads of each side (default 8)")
    parser.add_argument("--producers", type=int, default=4, help="threads enqueueing a round (default 4)")
    parser.add_argument("--warmup", type=int, default=8, help="runs per side before the rounds, not counted")
    parser.add_argument("--server", metavar="URL",
                        help="an MCP server (streamable HTTP) with get-sum and echo, instead of the toolbox")
    parser.add_argument("--timeout", type=float, default=120.0, help="bound on each round, in seconds")
    parser.add_argument("--keep-logs", action="store_true", help="keep the workers' and the server's logs")
    parser.add_argument("--profile", action="store_true",
                        help="sample each side's worker with py-spy during its rounds and say where its CPU went")
    args = parser.parse_args(argv)
    if min(args.runs, args.rounds, args.threads, args.producers) < 1 or args.warmup < 0:
        parser.error("--runs, --rounds, --threads and --producers must be at least 1, --warmup at least 0")
    if args.profile and _profile.py_spy() is None:
        parser.error("--profile: py-spy is not installed (pip install -e '.[bench]')")

    configure_logging("WARNING")  # the producer's per-run info lines would drown the result
    info = machine()
    with Bench("overhead", keep=args.keep_logs) as bench:
        if args.server:
            print(f"namespace {bench.namespace}; MCP server {args.server}")
            url, server_pid = args.server, None
        else:
            print(f"namespace {bench.namespace}; starting the toolbox server…")
            toolbox = bench.start_toolbox()
            url, server_pid = toolbox.url, toolbox.process.pid
        endpoint = Endpoint(url, choose_echo_argument(url), external=bool(args.server), pid=server_pid)
        bench.use_server(url)
        print(f"starting the workers (runbrake and the peer, {args.threads} threads each)…")
        bench.on_close(lambda: delete_peer_queues(bench.settings), after_processes=True)
        runbrake_worker = bench.start_worker(concurrency=args.threads)
        peer_worker = bench.start_logging_process("peer worker", ["-m", "bench._peer", "--threads", str(args.threads)])
        runbrake_broker = build_broker(bench.settings)
        bench.on_close(runbrake_broker.close)
        peer_broker = build_peer_broker(bench.settings)
        bench.on_close(peer_broker.close)
        sides: dict[str, Side] = {
            "peer": PeerSide(bench, peer_worker, peer_broker, endpoint, producers=args.producers),
            "runbrake": RunbrakeSide(bench, runbrake_worker,
                                     Producer(bench.store, runbrake_broker, bench.admission()), endpoint,
                                     producers=args.producers),
        }
        if args.warmup:
            print(f"warm-up: {args.warmup} per side…")
            for name, side in sides.items():
                warm = side.run_round(args.warmup, "warmup", timeout=args.timeout)
                if warm.problems:
                    raise BenchError(f"{name}'s warm-up went wrong: {warm.problems}")
        rounds: list[dict[str, Any]] = []
        samples: dict[str, list[str]] = {name: [] for name in SIDES}
        for number in range(1, args.rounds + 1):
            for name in SIDES:
                other = sides[SIDES[1 - SIDES.index(name)]]
                print(f"round {number}: {name}, {args.runs}…")
                recording = (_profile.Recording(sides[name].worker.pid, bench.workdir / f"profile-{name}-{number}.txt")
                             if args.profile else None)
                rounds.append({"round": number, **measure_round(
                    sides[name], other, args.runs, f"round-{number}", server_pid=endpoint.pid, timeout=args.timeout,
                )})
                if recording is not None:
                    samples[name] += recording.stop()
        peak_kib = {name: side.worker.peak_rss_kib() for name, side in sides.items()}
        runbrake_log = runbrake_worker.log_counts()
    # Everything has stopped and been cleaned up; what follows only reports.
    summary = summarize(rounds)
    correct = all(not r["problems"] and r["ok"] == r["runs"] for r in rounds)
    results: dict[str, Any] = {
        "benchmark": "overhead",
        "machine": info,
        "command": " ".join(["python -m bench.overhead", *(argv if argv is not None else sys.argv[1:])]),
        "worker_threads": args.threads,
        "producers": args.producers,
        "runs_per_round": args.runs,
        "rounds_per_side": args.rounds,
        "warmup_per_side": args.warmup,
        "server": {"url": endpoint.url, "external": endpoint.external, "echo_argument": endpoint.echo_argument},
        "rounds": rounds,
        "sides": summary,
        "ratio_runbrake_to_peer": ratios(summary),
        "worker_peak_rss_mb": {name: None if kib is None else round(kib / 1024, 1) for name, kib in peak_kib.items()},
        "runbrake_worker_log": runbrake_log,
        "worker_cpu_shares": ({name: _profile.shares(lines) for name, lines in samples.items()}
                              if args.profile else None),
        "correct": correct,
    }
    path = bench.write_results(results)
    print_results(results, path)
    return 0 if correct else 1


def print_results(results: Mapping[str, Any], path: Path) -> None:
    server = results["server"]
    print()
    print("== runbrake against a hand-written peer ==")
    print_machine(results["machine"])
    print(f"each side: 1 worker process, {results['worker_threads']} threads, prefetch {results['worker_threads']}; "
          f"{results['producers']} producer thread(s); MCP server {server['url']}"
          f"{' (external)' if server['external'] else ' (toolbox, loopback)'}; per run: connect, list tools, "
          "get-sum, echo (runbrake: plus 3 scripted model calls and its steps in Redis)")
    print(f"  {'round':>5} {'side':<9} {'runs':>5} {'wall s':>8} {'runs/s':>8} {'worker CPU ms/run':>18} "
          f"{'idle other ms/run':>18} {'server ms/run':>14} {'busy %':>7}  ok")
    for r in results["rounds"]:
        cpu = r["cpu_ms_per_run"]
        print(f"  {r['round']:>5} {r['side']:<9} {r['runs']:>5} {r['elapsed_s']:>8.3f} {r['per_s']:>8.1f} "
              f"{_ms(cpu['worker']):>18} {_ms(cpu['other_worker']):>18} {_ms(cpu.get('server')):>14} "
              f"{_ms(r['machine_busy_pct']):>7}  {r['ok']}/{r['runs']}")
        for problem, count in r["problems"].items():
            print(f"        {count} × {problem}")
    print("totals per side (runs/s = all runs ÷ all wall time; CPU = all CPU ÷ all runs):")
    for name, side in results["sides"].items():
        spread = side["per_s_rounds"]
        print(f"  {name:<9} {side['runs']:>5} runs in {side['elapsed_s']:8.3f} s = {side['per_s']:7.1f} runs/s "
              f"(rounds {spread['min']:.1f}–{spread['max']:.1f}); worker CPU {side['cpu_ms_per_run']['worker']:.1f} "
              f"ms/run; server {_ms(side['cpu_ms_per_run'].get('server'))} ms/run; {side['ok']}/{side['runs']} ok")
    ratio = results["ratio_runbrake_to_peer"]
    print(f"runbrake ÷ peer: worker CPU per run {_ratio(ratio['worker_cpu_per_run'])}, "
          f"runs/s {_ratio(ratio['runs_per_s'])}")
    for name, shares in (results["worker_cpu_shares"] or {}).items():
        cpu_ms = results["sides"][name]["cpu_ms_per_run"]["worker"]
        print(f"where the {name}'s worker CPU went (py-spy, busy samples of its rounds):")
        for part, share in shares.items():
            print(f"  {share:6.1%} {share * cpu_ms:6.2f} ms/run  {part}")
    rss = results["worker_peak_rss_mb"]
    print(f"worker peak RSS (VmHWM): runbrake {rss.get('runbrake')} MB, peer {rss.get('peer')} MB")
    health = ", ".join(f"{count} {what.replace('_', ' ')}" for what, count in results["runbrake_worker_log"].items()
                       if count)
    if health:
        print(f"runbrake's worker log: {health}; rerun with --keep-logs to read it")
    print(f"correct: {'yes' if results['correct'] else 'NO (see the problems above)'}")
    print(f"results: {path}")


def _ms(value: float | None) -> str:
    return "–" if value is None else f"{value:.1f}"


def _ratio(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}"


if __name__ == "__main__":
    sys.exit(main())
