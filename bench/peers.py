"""The alternatives, measured: runbrake against Dramatiq + dramatiq-abort, arq, Celery and DBOS doing the same run
and the same cancel, in alternating rounds of one run.

Run from the repository root, with the peers installed (``make bench-peers`` does both)::

    .venv/bin/python -m bench.peers [--runs 200] [--rounds 5] [--cancels 20] [--peers dramatiq-abort,arq,celery,dbos]

What it does, in its own namespace (``bench-<hex>``), on loopback only:

1. starts the example toolbox MCP server over HTTP (writing its events file), then each contestant's worker in
   processes of its own, each with 8 runs at once: runbrake (``python -m runbrake.worker`` with its default
   process count, one per CPU, and ``--concurrency`` 8 ÷ processes, so 8 in all), Dramatiq with dramatiq-abort
   (``bench/_peer_abort.py``: one process, 8 threads), arq (``bench/_peer_arq.py``: ``max_jobs=8``), Celery on
   RabbitMQ (``bench/_peer_celery.py``: prefork, 8 children) and DBOS (``bench/_peer_dbos.py``: a queue with
   ``worker_concurrency=8``, on a PostgreSQL this benchmark starts on a free port and stops at the end); every
   peer as its documentation sets it up, with its defaults otherwise, and every one through the same MCP client
   (``mcp.Client`` on one ``httpx2.AsyncClient``, ``bench/_peer.py``). A peer that cannot start (not installed, no
   PostgreSQL) is skipped with the reason;
2. **throughput**: after a warm-up, ``--rounds`` rounds of ``--runs`` runs per contestant, alternating (the order
   rotates each round); a run opens an MCP session, lists the tools, calls ``get-sum``, then ``echo`` (runbrake:
   three scripted model turns around those calls, every step in Redis; a peer counts the run in Redis when it
   is done). Per round: wall time from the first enqueue to the last completion, the CPU time of the worker's
   whole process tree and of the server meanwhile, the load average it started at;
3. **cancel**: per contestant and way of cancelling (Celery: ``revoke(terminate=True)`` and ``revoke()``; DBOS:
   a preemptible step and a default one), ``--cancels`` times, one at a time: a run whose call is
   ``slow(60 s + a unique fraction)`` and whose next tool call would be echo ``after cancel <marker>``; 1 s after
   the server started the call, the cancel (t0); measured: the server's handler seeing the call stop (its
   "cancelled" event, as in ``bench/cancel_latency.py``) and the run recorded as stopped (runbrake: the
   cancelled tool step; Dramatiq: the message's end, written by a middleware; arq: the job's result; Celery:
   the result backend's ``REVOKED``/``date_done``; DBOS: the workflow's status), each bounded by 5 s; a way
   that leaves the call running 3 times is not sampled further;
4. **after the cancel**: once every slow call has ended (or run its 60 s), whether the server saw the run's next
   tool call (something ran after the cancel), and whether the peer's own ``finally`` ran (cleanup);
5. each phase starts once the 1-minute load average is at most ``--quiet-load`` (bounded by ``--quiet-wait``; the
   load it started at is recorded); prints the table with runbrake's ratios and the aims, writes
   ``bench/results/peers.json``, and cleans up (processes, PostgreSQL, Redis keys, queues, exchanges).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.metadata
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final, Protocol

import anyio
import anyio.from_thread
import pika

from bench._harness import (
    SERVER_NAME,
    Bench,
    BenchError,
    JsonLines,
    ToolboxServer,
    Worker,
    free_port,
    in_threads,
    machine,
    machine_busy_seconds,
    print_machine,
    quick_run_arguments,
    summary_ms,
    tree_cpu_seconds,
    wait_until,
)
from bench._peer import PeerKeys, delete_peer_queues, end_key
from bench.overhead import Endpoint, PeerSide, RoundOutcome, RunbrakeSide
from runbrake.shared.logging import configure_logging
from runbrake.shared.messaging.cancel import CancelPublisher, cancel_run
from runbrake.shared.messaging.producer import Producer
from runbrake.shared.messaging.rabbitmq import build_broker
from runbrake.shared.messaging.wire import Topology
from runbrake.shared.spec import RunSpec
from runbrake.shared.steps import StepKind

# The peers' own modules (bench/_peer_abort.py, _peer_arq.py, _peer_celery.py, _peer_dbos.py) and their libraries
# are imported where a contestant starts: without the peers extra installed, this module still imports, and the
# peer that cannot start is skipped with the reason.

PEERS: Final = ("dramatiq-abort", "arq", "celery", "dbos")
DISTRIBUTIONS: Final = {
    "runbrake": ("runbrake", "dramatiq", "mcp", "redis"),
    "dramatiq-abort": ("dramatiq", "dramatiq-abort"),
    "arq": ("arq",),
    "celery": ("celery", "kombu", "billiard"),
    "dbos": ("dbos", "psycopg", "sqlalchemy"),
}
SLOW_S: Final = 60.0
CANCEL_AFTER_S: Final = 1.0
"""How long after the server started the slow call the cancel is sent."""
STOP_BOUND_S: Final = 5.0
"""How long a cancel's server stop and recorded stop are waited for (the slowest peer that stops takes ~1 s)."""
STILL_RUNNING_LIMIT: Final = 3
"""A way of cancelling that leaves the call running this many times is not sampled further (each costs 60 s)."""
AFTER_WINDOW_S: Final = 3.0
"""How long after the last slow call ended the server is watched for a run's next tool call."""
START_BOUND_S: Final = 60.0
ECHO = "text"
"""The toolbox server's echo parameter."""
POLL_S: Final = 0.002
RUNBRAKE_CLI: Final = "import sys; from runbrake.broker.cli import main; sys.exit(main())"
"""``runbrake`` itself (the console script's entry point), run with this benchmark's interpreter."""


@dataclass(frozen=True, slots=True)
class Recorded:
    """How a contestant recorded a cancelled run: its status in the contestant's own words, and when."""

    status: str
    t: float | None


class Contestant(Protocol):
    """One system under measurement: its worker, a round of quick runs, and a slow run to cancel."""

    name: str
    worker: Worker
    ways: tuple[str, ...]
    """The ways of cancelling it offers; the first is its recommended one."""

    def run_round(self, count: int, tag: str, *, timeout: float) -> RoundOutcome: ...

    def start_slow(self, way: str, marker: str, seconds: float, after: dict[str, Any]) -> str: ...

    def cancel(self, way: str, ident: str) -> None: ...

    def recorded(self, ident: str) -> Recorded | None:
        """How the run is recorded once it is recorded as ended; None while it is not."""

    def cleanup(self, marker: str, ident: str) -> str | None:
        """What the run's own cleanup said when it ran (None: it did not run)."""


class PeerCleanup:
    """A peer's cleanup: what its task's ``finally`` noted in Redis (:func:`bench._peer.end_key`)."""

    _bench: Bench

    def cleanup(self, marker: str, ident: str) -> str | None:
        note = self._bench.store.redis.hgetall(end_key(self._bench.namespace, marker))
        return f"finally ran ({note['outcome']})" if note else None


def sent_round(bench: Bench, worker: Worker, tag: str, count: int, send: Callable[[int], None], *, producers: int,
               timeout: float) -> RoundOutcome:
    """``send(i)`` for each of ``count`` runs from ``producers`` threads, then :func:`wait_counted`."""
    started = time.time()
    in_threads(producers, count, send)
    return wait_counted(bench, tag, count, worker, started, timeout=timeout)


def wait_counted(bench: Bench, tag: str, count: int, worker: Worker, started: float, *, timeout: float) -> RoundOutcome:
    """Wait until a peer has counted ``count`` runs of ``tag`` (done or failed) in Redis (``bench/_peer.py``)."""

    keys = PeerKeys(bench.namespace, tag)
    redis = bench.store.redis

    def settled() -> bool:
        done, failed = redis.mget(keys.done, keys.failed)
        return int(done or 0) + int(failed or 0) >= count

    wait_until(settled, timeout=timeout, what=f"{count} runs ({tag})", interval=0.02, alive=[worker.process])
    done, failed, last_done = redis.mget(keys.done, keys.failed, keys.last_done)
    problems: dict[str, int] = {}
    for error in redis.lrange(keys.errors, 0, -1) if int(failed or 0) else ():
        problems[f"failed: {error!s}"] = problems.get(f"failed: {error!s}", 0) + 1
    if int(done or 0) != count:
        problems[f"counter {int(done or 0)} + failed {int(failed or 0)} for {count} runs"] = 1
    return RoundOutcome(started, float(last_done) if last_done else time.time(), int(done or 0), problems)


# -- the contestants ---------------------------------------------------------------------------------------


class Runbrake:
    """runbrake's worker with its defaults; runs through the producer, cancels through ``cancel_run``."""

    name = "runbrake"
    ways = ("cancel_run",)

    def __init__(self, bench: Bench, endpoint: Endpoint, *, concurrency: int, producers: int,
                 processes: int | None = None) -> None:
        # `runbrake worker` with its default process count (one per CPU this process may use) unless told, the
        # runs at once shared out among them
        self.processes = processes or len(os.sched_getaffinity(0))
        per_process = max(1, concurrency // self.processes)
        self.worker = bench.start_logging_process(
            "runbrake worker", ["-c", RUNBRAKE_CLI, "worker", "--processes", str(self.processes),
                                "--concurrency", str(per_process)])
        broker = build_broker(bench.settings)
        bench.on_close(broker.close)
        self._publisher = CancelPublisher(bench.settings)
        bench.on_close(self._publisher.close)
        self._bench = bench
        self._endpoint = endpoint
        self._producer = Producer(bench.store, broker, bench.admission())
        self._side = RunbrakeSide(bench, self.worker, self._producer, endpoint, producers=producers)

    def run_round(self, count: int, tag: str, *, timeout: float) -> RoundOutcome:
        return self._side.run_round(count, tag, timeout=timeout)

    def start_slow(self, way: str, marker: str, seconds: float, after: dict[str, Any]) -> str:
        spec = RunSpec.parse({
            "input": f"slow run {marker}",
            "model": {"provider": "scripted", "turns": [
                {"tool_calls": [{"server": SERVER_NAME, "tool": "slow", "arguments": {"seconds": seconds}}]},
                {"tool_calls": [{"server": SERVER_NAME, "tool": "echo", "arguments": after}]},
                {"content": "done"},
            ]},
            "mcp_servers": [SERVER_NAME],
            "tool_timeout_s": seconds + 60.0,
        })
        return self._producer.enqueue(spec).run_id

    def cancel(self, way: str, ident: str) -> None:
        cancel_run(self._bench.store, self._publisher, ident, reason="benchmark", requested_by="bench.peers")

    def recorded(self, ident: str) -> Recorded | None:
        record = self._bench.store.get(ident)
        step = next((s for s in record.steps if s.kind is StepKind.TOOL), None)
        if step is None or step.tool_outcome is None:
            return None
        return Recorded(f"{record.status.value}, tool step {step.tool_outcome.value}", step.recorded_at)

    def cleanup(self, marker: str, ident: str) -> str | None:
        """The worker's end of the run's segment (its MCP session closed, the run settled)."""
        self.worker.log.read_new()
        ended = any(e.get("event") == "run_segment_ended" and e.get("run_id") == ident for e in self.worker.log.entries)
        return "run_segment_ended" if ended else None


class DramatiqAbort(PeerCleanup):
    """Dramatiq with dramatiq-abort (``bench/_peer_abort.py``); cancels with ``abort(message_id)``."""

    name = "dramatiq-abort"
    ways = ("abort",)

    def __init__(self, bench: Bench, endpoint: Endpoint, *, concurrency: int, producers: int) -> None:
        from bench._peer_abort import build_abort_broker

        bench.on_close(lambda: delete_peer_queues(bench.settings), after_processes=True)
        self.worker = bench.start_logging_process(
            "dramatiq-abort worker", ["-m", "bench._peer_abort", "--threads", str(concurrency)])
        self._broker = build_abort_broker(bench.settings)
        bench.on_close(self._broker.close)
        self._bench = bench
        self._endpoint = endpoint
        self._side = PeerSide(bench, self.worker, self._broker, endpoint, producers=producers)

    def run_round(self, count: int, tag: str, *, timeout: float) -> RoundOutcome:
        return self._side.run_round(count, f"{self.name}-{tag}", timeout=timeout)

    def start_slow(self, way: str, marker: str, seconds: float, after: dict[str, Any]) -> str:
        from bench._peer_abort import slow_message

        message = slow_message(Topology(self._bench.namespace), marker, self._endpoint.url, seconds, after)
        self._broker.enqueue(message)
        return message.message_id

    def cancel(self, way: str, ident: str) -> None:
        from bench._peer_abort import abort_message

        abort_message(self._broker, ident)

    def recorded(self, ident: str) -> Recorded | None:
        from bench._peer_abort import record_key

        verdict = self._bench.store.redis.hgetall(record_key(self._bench.namespace, ident))
        return Recorded(verdict["status"], float(verdict["t"])) if verdict else None


class Arq(PeerCleanup):
    """arq (``bench/_peer_arq.py``), driven through a blocking portal onto one event loop; cancels with
    ``Job.abort``."""

    name = "arq"
    ways = ("Job.abort",)

    def __init__(self, bench: Bench, endpoint: Endpoint, *, concurrency: int, producers: int) -> None:
        from arq import create_pool

        from bench._peer_arq import arq_queue, redis_settings

        self._bench = bench
        self._endpoint = endpoint
        self._producers = producers
        self._queue = arq_queue(bench.namespace)
        stack = contextlib.ExitStack()
        bench.on_close(stack.close)
        self._portal = stack.enter_context(anyio.from_thread.start_blocking_portal())
        self._pool = self._portal.call(create_pool, redis_settings(bench.settings))
        stack.callback(self._portal.call, self._pool.aclose)
        bench.on_close(self._delete_job_keys, after_processes=True)
        self.worker = bench.start_logging_process(
            "arq worker", ["-m", "bench._peer_arq", "--max-jobs", str(concurrency)])
        self._aborts: list[Any] = []

    def _job_id(self, kind: str, label: str) -> str:
        return f"{self._bench.namespace}-{kind}-{label}"

    def _delete_job_keys(self) -> None:
        """arq's job keys of this benchmark's jobs (their ids start with the namespace), and its abort set's."""
        from bench._peer_arq import ARQ_ABORT_SET, ARQ_PREFIXES

        redis = self._bench.store.redis
        ids = set()
        for prefix in ARQ_PREFIXES:
            for key in redis.scan_iter(match=f"{prefix}{self._bench.namespace}-*", count=500):
                redis.delete(key)
                ids.add(key.removeprefix(prefix))
        if ids:
            redis.zrem(ARQ_ABORT_SET, *ids)

    def run_round(self, count: int, tag: str, *, timeout: float) -> RoundOutcome:
        tag = f"{self.name}-{tag}"
        url = self._endpoint.url

        async def enqueue_part(start: int) -> None:
            for i in range(start, count, self._producers):
                get_sum, echo = quick_run_arguments(i, echo_argument=ECHO)
                await self._pool.enqueue_job("quick", tag, url, get_sum, echo, _job_id=self._job_id(tag, str(i)),
                                             _queue_name=self._queue)

        async def enqueue_all() -> None:
            # as many at once as the other contestants' producer threads (the pool's connections are bounded)
            async with anyio.create_task_group() as group:
                for start in range(self._producers):
                    group.start_soon(enqueue_part, start)

        started = time.time()
        self._portal.call(enqueue_all)
        return wait_counted(self._bench, tag, count, self.worker, started, timeout=timeout)

    def start_slow(self, way: str, marker: str, seconds: float, after: dict[str, Any]) -> str:
        job_id = self._job_id("slow", marker)
        self._portal.call(functools.partial(self._pool.enqueue_job, "slow", marker, self._endpoint.url, seconds,
                                            after, _job_id=job_id, _queue_name=self._queue))
        return job_id

    def cancel(self, way: str, ident: str) -> None:
        from arq.jobs import Job

        job = Job(ident, self._pool, _queue_name=self._queue)
        # Job.abort adds the id to arq's abort set, then waits for the result (polling every 0.5 s); it runs on
        # the portal's loop while the benchmark watches the server and the result itself.
        self._aborts.append(self._portal.start_task_soon(functools.partial(job.abort, timeout=STOP_BOUND_S)))

    def recorded(self, ident: str) -> Recorded | None:
        from arq.jobs import Job

        result = self._portal.call(Job(ident, self._pool, _queue_name=self._queue).result_info)
        if result is None:
            return None
        outcome = "success" if result.success else f"failed ({type(result.result).__name__})"
        return Recorded(outcome, result.finish_time.timestamp())


class CeleryPrefork(PeerCleanup):
    """Celery on RabbitMQ, prefork (``bench/_peer_celery.py``); cancels with ``revoke(terminate=True)`` (its way
    of stopping a running task) and plain ``revoke()``."""

    name = "celery"
    ways = ("revoke(terminate=True)", "revoke()")

    def __init__(self, bench: Bench, endpoint: Endpoint, *, concurrency: int, producers: int) -> None:
        from bench._peer_celery import build_app

        self._bench = bench
        self._endpoint = endpoint
        self._producers = producers
        self._app = build_app(bench.settings)
        bench.on_close(self._app.close)
        bench.on_close(self._delete_broker_objects, after_processes=True)
        self.worker = bench.start_logging_process(
            "celery worker", ["-m", "bench._peer_celery", "--concurrency", str(concurrency)], timeout=120.0)

    def _delete_broker_objects(self) -> None:
        from bench._peer_celery import celery_exchanges, celery_queue

        connection = pika.BlockingConnection(pika.URLParameters(self._bench.settings.rabbitmq_url))
        try:
            channel = connection.channel()
            channel.queue_delete(queue=celery_queue(self._bench.namespace))
            for exchange in celery_exchanges(self._bench.namespace):
                channel.exchange_delete(exchange=exchange)
        finally:
            if connection.is_open:
                connection.close()

    def run_round(self, count: int, tag: str, *, timeout: float) -> RoundOutcome:
        from bench._peer_celery import QUICK_TASK

        tag = f"{self.name}-{tag}"

        def send(i: int) -> None:
            get_sum, echo = quick_run_arguments(i, echo_argument=ECHO)
            self._app.send_task(QUICK_TASK, args=(tag, self._endpoint.url, get_sum, echo))

        return sent_round(self._bench, self.worker, tag, count, send, producers=self._producers, timeout=timeout)

    def start_slow(self, way: str, marker: str, seconds: float, after: dict[str, Any]) -> str:
        from bench._peer_celery import SLOW_TASK

        return str(self._app.send_task(SLOW_TASK, args=(marker, self._endpoint.url, seconds, after)).id)

    def cancel(self, way: str, ident: str) -> None:
        self._app.control.revoke(ident, terminate=way == "revoke(terminate=True)")

    def recorded(self, ident: str) -> Recorded | None:
        meta = self._app.backend.get_task_meta(ident)
        status = str(meta.get("status"))
        if status in {"PENDING", "STARTED", "RECEIVED"}:
            return None
        done = meta.get("date_done")
        if isinstance(done, str):
            done = datetime.fromisoformat(done)
        when = None if done is None else (done if done.tzinfo else done.replace(tzinfo=UTC)).timestamp()
        return Recorded(status, when)


class Dbos(PeerCleanup):
    """DBOS (``bench/_peer_dbos.py``) on a PostgreSQL of this benchmark's; cancels with ``cancel_workflow``, its
    slow step preemptible or (DBOS's default) not."""

    name = "dbos"
    ways = ("cancel_workflow, preemptible step", "cancel_workflow, default step")

    def __init__(self, bench: Bench, endpoint: Endpoint, *, concurrency: int, producers: int) -> None:
        from dbos import DBOSClient

        from bench._peer_dbos import PrivatePostgres

        self._bench = bench
        self._endpoint = endpoint
        self._producers = producers
        postgres = PrivatePostgres(free_port())
        bench.on_close(postgres.stop, after_processes=True)
        postgres.start()
        self.worker = bench.start_logging_process(
            "dbos worker", ["-m", "bench._peer_dbos", "--database-url", postgres.url, "--concurrency",
                            str(concurrency)], timeout=120.0)
        self._client = DBOSClient(system_database_url=postgres.url)
        bench.on_close(self._client.destroy)

    def run_round(self, count: int, tag: str, *, timeout: float) -> RoundOutcome:
        from bench._peer_dbos import QUEUE, QUICK_WORKFLOW

        tag = f"{self.name}-{tag}"

        def send(i: int) -> None:
            get_sum, echo = quick_run_arguments(i, echo_argument=ECHO)
            self._client.enqueue({"workflow_name": QUICK_WORKFLOW, "queue_name": QUEUE}, tag, self._endpoint.url,
                                 get_sum, echo)

        return sent_round(self._bench, self.worker, tag, count, send, producers=self._producers, timeout=timeout)

    def start_slow(self, way: str, marker: str, seconds: float, after: dict[str, Any]) -> str:
        from bench._peer_dbos import QUEUE, SLOW_PREEMPTIBLE_WORKFLOW, SLOW_WORKFLOW

        workflow = SLOW_PREEMPTIBLE_WORKFLOW if "preemptible" in way else SLOW_WORKFLOW
        handle = self._client.enqueue({"workflow_name": workflow, "queue_name": QUEUE}, marker, self._endpoint.url,
                                      seconds, after)
        return str(handle.get_workflow_id())

    def cancel(self, way: str, ident: str) -> None:
        self._client.cancel_workflow(ident)

    def recorded(self, ident: str) -> Recorded | None:
        status = self._client.retrieve_workflow(ident).get_status()
        if status.status in {"PENDING", "ENQUEUED", "DELAYED"}:
            return None
        return Recorded(str(status.status), None if status.updated_at is None else status.updated_at / 1000)


CONTESTANTS: Final[dict[str, Callable[..., Contestant]]] = {
    "runbrake": Runbrake, "dramatiq-abort": DramatiqAbort, "arq": Arq, "celery": CeleryPrefork, "dbos": Dbos,
}


# -- the server's view -------------------------------------------------------------------------------------


@dataclass
class ServerView:
    """What the toolbox server's events file has said: slow calls by their unique seconds, end events by call,
    echo texts."""

    events: JsonLines
    started: dict[float, dict[str, Any]] = field(default_factory=dict)
    ended: dict[int, dict[str, Any]] = field(default_factory=dict)
    echoed: set[str] = field(default_factory=set)

    def refresh(self) -> None:
        for event in self.events.read_new():
            tool, kind = event.get("tool"), event.get("event")
            if tool == "slow":
                if kind == "started":
                    self.started[round(float(event["args"]["seconds"]), 6)] = event
                else:
                    self.ended.setdefault(int(event["call"]), event)
            elif tool == "echo" and kind == "started":
                self.echoed.add(str(event["args"].get("text", "")))


# -- phases ------------------------------------------------------------------------------------------------


def wait_for_quiet(max_load: float, bound_s: float) -> dict[str, float]:
    """Wait (at most ``bound_s``) until the 1-minute load average is at most ``max_load``; what it was."""
    began = time.monotonic()
    while os.getloadavg()[0] > max_load and time.monotonic() - began < bound_s:
        time.sleep(1.0)  # waiting for other processes to calm down, bounded
    load1, load5, _ = os.getloadavg()
    return {"loadavg_1m": round(load1, 2), "loadavg_5m": round(load5, 2),
            "waited_s": round(time.monotonic() - began, 1), "quiet": load1 <= max_load}


def measure_round(contestant: Contestant, count: int, tag: str, *, server_pid: int,
                  timeout: float) -> dict[str, Any]:
    """One round of ``contestant``'s, with the CPU its worker's process tree and the server used meanwhile."""
    load = os.getloadavg()[0]
    worker_before, server_before = tree_cpu_seconds(contestant.worker.pid), tree_cpu_seconds(server_pid)
    busy_before, total_before = machine_busy_seconds()
    outcome = contestant.run_round(count, tag, timeout=timeout)
    busy, total = machine_busy_seconds()
    worker_after, server_after = tree_cpu_seconds(contestant.worker.pid), tree_cpu_seconds(server_pid)
    elapsed = outcome.finished - outcome.started

    def per_run(before: float | None, after: float | None) -> float | None:
        return None if before is None or after is None else round(1000 * (after - before) / count, 2)

    return {
        "side": contestant.name, "tag": tag, "runs": count, "ok": outcome.ok, "problems": outcome.problems,
        "elapsed_s": round(elapsed, 3), "per_s": round(count / elapsed, 2),
        "worker_cpu_ms_per_run": per_run(worker_before, worker_after),
        "server_cpu_ms_per_run": per_run(server_before, server_after),
        "machine_busy_pct": round(100 * (busy - busy_before) / (total - total_before), 1)
        if total > total_before else None,
        "loadavg_1m_at_start": round(load, 2),
    }


def summarize(rounds: Sequence[Mapping[str, Any]], names: Sequence[str]) -> dict[str, Any]:
    """Per contestant: all runs ÷ all wall time, all worker CPU ÷ all runs, the rounds' spread."""
    sides: dict[str, Any] = {}
    for name in names:
        mine = [r for r in rounds if r["side"] == name]
        if not mine:
            continue
        runs = sum(r["runs"] for r in mine)
        elapsed = sum(r["elapsed_s"] for r in mine)
        rates = [r["per_s"] for r in mine]
        sides[name] = {
            "runs": runs, "ok": sum(r["ok"] for r in mine), "per_s": round(runs / elapsed, 2),
            "per_s_rounds": {"min": min(rates), "median": statistics.median(rates), "max": max(rates)},
            "worker_cpu_ms_per_run": round(sum((r["worker_cpu_ms_per_run"] or 0) * r["runs"] for r in mine) / runs, 2),
            "server_cpu_ms_per_run": round(sum((r["server_cpu_ms_per_run"] or 0) * r["runs"] for r in mine) / runs, 2),
        }
    return sides


def cancel_samples(contestant: Contestant, way: str, view: ServerView, count: int, first: int) -> list[dict[str, Any]]:
    """``count`` cancels of a slow call, one at a time (fewer when the call keeps running); one sample each."""
    samples: list[dict[str, Any]] = []
    still_running = 0
    for k in range(count):
        seconds = round(SLOW_S + (first + k) / 10_000, 6)
        marker = f"{contestant.name}-{first + k}"
        ident = contestant.start_slow(way, marker, seconds, {ECHO: f"after cancel {marker}"})

        def started(seconds: float = seconds) -> dict[str, Any] | None:
            view.refresh()
            return view.started.get(seconds)

        began = wait_until(started, timeout=START_BOUND_S, what=f"{marker}'s slow call to start", interval=POLL_S,
                           alive=[contestant.worker.process])
        time.sleep(max(0.0, began["t"] + CANCEL_AFTER_S - time.time()))  # the scenario: cancel 1 s into the call
        t0 = time.time()
        contestant.cancel(way, ident)
        returned = time.time()
        call = int(began["call"])

        def ended(call: int = call) -> dict[str, Any] | None:
            view.refresh()
            return view.ended.get(call)

        end = _within(ended, STOP_BOUND_S, contestant)
        record = _within(functools.partial(contestant.recorded, ident), STOP_BOUND_S, contestant)
        stopped = end is not None
        samples.append({
            "marker": marker, "ident": ident, "call": call, "t0": t0,
            "cancel_returned": returned - t0,
            "server_event": None if end is None else end["event"],
            "server_saw_stop": end["t"] - t0 if stopped and end is not None else None,
            "recorded_status": None if record is None else record.status,
            "recorded_stop": None if record is None or record.t is None else record.t - t0,
        })
        if not stopped:
            still_running += 1
            if still_running >= STILL_RUNNING_LIMIT:
                break
    return samples


def _within(condition: Callable[[], Any], bound: float, contestant: Contestant) -> Any:
    """``condition``'s first truthy value within ``bound`` seconds, or None (BenchError if the worker died)."""
    try:
        return wait_until(condition, timeout=bound, what="a cancel's effect", interval=POLL_S,
                          alive=[contestant.worker.process])
    except BenchError:
        if contestant.worker.process.popen.poll() is not None:
            raise
        return None


def after_the_cancels(view: ServerView, contestants: Mapping[str, Contestant],
                      cancels: Mapping[str, list[dict[str, Any]]]) -> None:
    """Once every slow call has ended (at most its 60 s), note per sample whether the run's next tool call
    reached the server and whether the run's own cleanup ran."""
    samples = [s for group in cancels.values() for s in group]

    def all_ended() -> bool:
        view.refresh()
        return all(s["call"] in view.ended for s in samples)

    with contextlib.suppress(BenchError):  # a call that never ends is reported as such below
        wait_until(all_ended, timeout=SLOW_S + 30.0, what="every slow call to end", interval=0.05)
    time.sleep(AFTER_WINDOW_S)  # an observation window: a run's next call comes right after its slow call ended
    view.refresh()
    for label, group in cancels.items():
        contestant = contestants[label.partition(":")[0]]
        for sample in group:
            end = view.ended.get(sample["call"])
            sample["server_final_event"] = None if end is None else end["event"]
            sample["ran_after_cancel"] = f"after cancel {sample['marker']}" in view.echoed
            sample["cleanup"] = contestant.cleanup(sample["marker"], sample["ident"])


def summarize_cancels(samples: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Per way of cancelling: p50 and max of both measures, how runs were recorded, what happened after."""
    stopped = [s["server_saw_stop"] for s in samples if s["server_event"] == "cancelled"]
    recorded = [s["recorded_stop"] for s in samples if s["recorded_stop"] is not None]
    counted: dict[str, dict[str, int]] = {"server": {}, "recorded": {}, "cleanup": {}}
    for s in samples:
        for key, value in (("server", s.get("server_final_event") or "still running"),
                           ("recorded", s["recorded_status"] or "not recorded within 5 s"),
                           ("cleanup", s.get("cleanup") or "did not run")):
            counted[key][value] = counted[key].get(value, 0) + 1
    return {
        "cancels": len(samples),
        "server_saw_stop_ms": summary_ms(stopped),
        "stopped": len(stopped),
        "recorded_stop_ms": summary_ms(recorded),
        "server_final_events": counted["server"],
        "recorded_as": counted["recorded"],
        "cleanup": counted["cleanup"],
        "ran_after_cancel": sum(1 for s in samples if s.get("ran_after_cancel")),
    }


def versions(names: Sequence[str]) -> dict[str, str]:
    found = {}
    for name in names:
        for distribution in DISTRIBUTIONS.get(name, ()):
            with contextlib.suppress(importlib.metadata.PackageNotFoundError):
                found[distribution] = importlib.metadata.version(distribution)
    return found


def ratios(sides: Mapping[str, Any], cancels: Mapping[str, Any]) -> dict[str, Any]:
    """runbrake ÷ each peer (runs/s: above 1 is faster; worker CPU per run: above 1 costs more), and the aims:
    runs/s at least 1.0× every peer, worker CPU per run at most 1.1× the leanest peer's, and the server seeing
    the stop sooner than under Celery's ``revoke(terminate=True)`` at p50 and max."""
    mine = sides.get("runbrake")
    peers = {name: side for name, side in sides.items() if name != "runbrake"}
    out: dict[str, Any] = {}
    aims: dict[str, Any] = {}
    if mine and peers:
        cpu = mine["worker_cpu_ms_per_run"]
        for name, side in peers.items():
            out[name] = {"runs_per_s": round(mine["per_s"] / side["per_s"], 3),
                         "worker_cpu_per_run": round(cpu / side["worker_cpu_ms_per_run"], 3)
                         if side["worker_cpu_ms_per_run"] else None}
        leanest = min(peers, key=lambda name: peers[name]["worker_cpu_ms_per_run"])
        lean_cpu = peers[leanest]["worker_cpu_ms_per_run"]
        aims["runs_per_s_at_least_each"] = all(r["runs_per_s"] >= 1.0 for r in out.values())
        aims["cpu_within_1_1x_leanest"] = {"leanest": leanest, "met": cpu <= 1.1 * lean_cpu,
                                           "ratio": round(cpu / lean_cpu, 3) if lean_cpu else None}
    terminate = cancels.get("celery: revoke(terminate=True)", {}).get("server_saw_stop_ms", {})
    own = cancels.get("runbrake: cancel_run", {}).get("server_saw_stop_ms", {})
    if terminate.get("n") and own.get("n"):
        aims["cancel_below_celery_terminate"] = {
            "p50": own["p50"] < terminate["p50"], "max": own["max"] < terminate["max"],
            "ratio_p50": round(own["p50"] / terminate["p50"], 3), "ratio_max": round(own["max"] / terminate["max"], 3)}
    return {"runbrake_to": out, "aims": aims}


@contextlib.contextmanager
def _phase(name: str, args: argparse.Namespace, phases: dict[str, Any]) -> Iterator[None]:
    phases[name] = wait_for_quiet(args.quiet_load, args.quiet_wait)
    print(f"phase {name}: load average {phases[name]['loadavg_1m']} at start"
          f"{'' if phases[name]['quiet'] else f' (not below {args.quiet_load:g} after {args.quiet_wait:g} s)'}")
    yield


def parse_arguments(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.peers", description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=200, help="runs per round (default 200; at most 10000)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds per contestant, alternating (default 5)")
    parser.add_argument("--cancels", type=int, default=20, help="cancels per way of cancelling (default 20)")
    parser.add_argument("--concurrency", type=int, default=8, help="runs at once per contestant (default 8)")
    parser.add_argument("--runbrake-processes", type=int, metavar="N",
                        help="runbrake's worker processes (default: its own default, one per CPU), sharing "
                             "--concurrency among them")
    parser.add_argument("--producers", type=int, default=4, help="threads enqueueing a round (default 4)")
    parser.add_argument("--warmup", type=int, default=16, help="runs per contestant before the rounds")
    parser.add_argument("--peers", default=",".join(PEERS),
                        help=f"comma-separated peers to measure beside runbrake (default {','.join(PEERS)})")
    parser.add_argument("--quiet-load", type=float, default=1.5,
                        help="a phase starts once the 1-minute load average is at most this (default 1.5)")
    parser.add_argument("--quiet-wait", type=float, default=60.0,
                        help="the most a phase waits for that, in seconds (default 60)")
    parser.add_argument("--timeout", type=float, default=300.0, help="bound on each round, in seconds")
    parser.add_argument("--keep-logs", action="store_true", help="keep the workers' and the server's logs")
    args = parser.parse_args(argv)
    if not 1 <= args.runs <= 10_000 or not 1 <= args.rounds <= 100 or not 1 <= args.cancels <= 1000:
        parser.error("--runs must be 1-10000, --rounds 1-100, --cancels 1-1000")
    if not 1 <= args.concurrency <= 256 or not 1 <= args.producers <= 64 or not 0 <= args.warmup <= 10_000:
        parser.error("--concurrency must be 1-256, --producers 1-64, --warmup 0-10000")
    if args.runbrake_processes is not None and not 1 <= args.runbrake_processes <= args.concurrency:
        parser.error("--runbrake-processes must be 1 to --concurrency")
    if args.quiet_wait < 0 or args.quiet_load <= 0 or args.timeout <= 0:
        parser.error("--quiet-wait must be at least 0, --quiet-load and --timeout above 0")
    peers = [name.strip() for name in args.peers.split(",") if name.strip()]
    unknown = sorted(set(peers) - set(PEERS))
    if unknown:
        parser.error(f"--peers: unknown {', '.join(unknown)} (choose from {', '.join(PEERS)})")
    args.peers = [name for name in PEERS if name in peers]
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_arguments(argv)

    configure_logging("WARNING")
    info = machine()
    skipped: dict[str, str] = {}
    phases: dict[str, Any] = {}
    rounds: list[dict[str, Any]] = []
    cancels: dict[str, list[dict[str, Any]]] = {}
    with Bench("peers", keep=args.keep_logs) as bench:
        print(f"namespace {bench.namespace}; starting the toolbox server…")
        toolbox: ToolboxServer = bench.start_toolbox()
        endpoint = Endpoint(toolbox.url, ECHO, external=False, pid=toolbox.process.pid)
        view = ServerView(toolbox.events)
        contestants: dict[str, Contestant] = {}
        for name in ("runbrake", *args.peers):
            print(f"starting {name}…")
            options = {"processes": args.runbrake_processes} if name == "runbrake" else {}
            try:
                contestants[name] = CONTESTANTS[name](bench, endpoint, concurrency=args.concurrency,
                                                      producers=args.producers, **options)
            except (ImportError, BenchError, OSError, RuntimeError) as exc:
                if name == "runbrake":
                    raise
                skipped[name] = f"{type(exc).__name__}: {exc}"
                print(f"  skipped {name}: {skipped[name]}")
        for name, contestant in contestants.items():
            warm = contestant.run_round(args.warmup, "warmup", timeout=args.timeout) if args.warmup else None
            if warm is not None and warm.problems:
                raise BenchError(f"{name}'s warm-up went wrong: {warm.problems}")
        names = list(contestants)
        with _phase("throughput", args, phases):
            for number in range(1, args.rounds + 1):
                shift = (number - 1) % len(names)
                for name in names[shift:] + names[:shift]:
                    print(f"round {number}: {name}, {args.runs}…")
                    rounds.append({"round": number, **measure_round(
                        contestants[name], args.runs, f"round-{number}", server_pid=toolbox.process.pid,
                        timeout=args.timeout)})
        first = 0
        for name, contestant in contestants.items():
            for way in contestant.ways:
                label = f"{name}: {way}"
                with _phase(f"cancel {label}", args, phases):
                    print(f"  {args.cancels} cancels…")
                    cancels[label] = cancel_samples(contestant, way, view, args.cancels, first)
                    first += args.cancels
        print("waiting for every slow call to end, then watching for what runs after…")
        after_the_cancels(view, contestants, cancels)
        worker_logs = {name: c.worker.log_counts() for name, c in contestants.items()}
    sides = summarize(rounds, names)
    cancel_summary = {label: summarize_cancels(samples) for label, samples in cancels.items()}
    results: dict[str, Any] = {
        "benchmark": "peers",
        "machine": info,
        "command": " ".join(["python -m bench.peers", *(argv if argv is not None else sys.argv[1:])]),
        "versions": versions(names),
        "concurrency": args.concurrency,
        "runbrake_processes": getattr(contestants.get("runbrake"), "processes", None),
        "runs_per_round": args.runs, "rounds": args.rounds, "warmup": args.warmup,
        "skipped": skipped,
        "phases": phases,
        "throughput_rounds": rounds,
        "sides": sides,
        "cancels": cancel_summary,
        "cancel_samples": cancels,
        "comparison": ratios(sides, cancel_summary),
        "worker_logs": worker_logs,
        "correct": all(not r["problems"] and r["ok"] == r["runs"] for r in rounds),
    }
    path = bench.write_results(results)
    print_results(results, path)
    return 0 if results["correct"] else 1


def print_results(results: Mapping[str, Any], path: Path) -> None:
    print()
    print("== runbrake against the alternatives ==")
    print_machine(results["machine"])
    print("versions: " + ", ".join(f"{name} {version}" for name, version in results["versions"].items()))
    for name, reason in results["skipped"].items():
        print(f"skipped {name}: {reason}")
    print(f"{results['concurrency']} runs at once each (runbrake: {results['runbrake_processes']} processes); "
          f"{results['rounds']} alternating rounds of {results['runs_per_round']}")
    for name, phase in results["phases"].items():
        print(f"  {name}: load average {phase['loadavg_1m']} at start (waited {phase['waited_s']} s)")
    print(f"  {'side':<16} {'runs/s':>8} {'rounds':>17} {'worker CPU ms/run':>18} {'server ms/run':>14}  ok")
    for name, side in results["sides"].items():
        spread = side["per_s_rounds"]
        print(f"  {name:<16} {side['per_s']:>8.1f} {spread['min']:>8.1f}–{spread['max']:<8.1f} "
              f"{side['worker_cpu_ms_per_run']:>18.2f} {side['server_cpu_ms_per_run']:>14.2f}  "
              f"{side['ok']}/{side['runs']}")
    comparison = results["comparison"]
    for name, ratio in comparison["runbrake_to"].items():
        print(f"  runbrake ÷ {name}: runs/s {ratio['runs_per_s']:.2f}×, worker CPU per run "
              f"{ratio['worker_cpu_per_run']}×")
    print(f"  {'cancel':<42} {'server saw stop p50/max ms':>27} {'recorded p50/max ms':>21}  recorded as; after")
    for label, summary in results["cancels"].items():
        stop, rec = summary["server_saw_stop_ms"], summary["recorded_stop_ms"]
        print(f"  {label:<42} {_pair(stop):>27} {_pair(rec):>21}  {summary['recorded_as']}; "
              f"server {summary['server_final_events']}; ran after {summary['ran_after_cancel']}/"
              f"{summary['cancels']}; cleanup {summary['cleanup']}")
    print(f"aims: {comparison['aims']}")
    print(f"correct: {'yes' if results['correct'] else 'NO (see the rounds in the results file)'}")
    print(f"results: {path}")


def _pair(summary: Mapping[str, Any]) -> str:
    return f"{summary['p50']:.1f} / {summary['max']:.1f} (n={summary['n']})" if summary.get("n") else "never"


if __name__ == "__main__":
    sys.exit(main())
