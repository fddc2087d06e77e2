"""A run outlives its worker: time from ``kill -9`` of the worker holding runs to each run claimed again by
another worker, and to its next step (docs/benchmarks.md, "Lost workers").

Run from the repository root::

    .venv/bin/python -m bench.worker_loss [--kills 50] [--runs 20]
    .venv/bin/python -m bench.worker_loss --saturation 2000 [--call-s 1500] [--window-s 30]

What it does, in its own namespace (``bench-<hex>``), on loopback only, with the default settings
(``RUNBRAKE_WORKER_BEAT_S`` 1 s, ``RUNBRAKE_WORKER_LOST_S`` 6 s):

1. starts the toolbox MCP server and a survivor worker (``--concurrency`` 4 × ``--runs``);
2. per kill: starts a doomed worker, enqueues ``--runs`` runs whose first turn is a 600 s ``slow`` call, waits
   until every one is in its call, and sends SIGKILL to the doomed worker (t0 = ``time.time()`` just before);
3. for each run the doomed worker held (its ``run_claimed`` lines), measures t0 → the ``handoff`` step the
   sweeper recorded (``recorded_at``: the run taken up), t0 → claimed again (the survivor's ``run_claimed``
   line) and t0 → the run's next step (its final model step, ``recorded_at``), then cancels what is left;
4. prints p50/p99/max of each and writes ``bench/results/worker_loss.json``.

With ``--saturation N``, false detections and what the liveness costs instead, against a private
``redis-server`` on a free port (only this benchmark's processes talk to it):

1. starts the npm ``@modelcontextprotocol/server-everything`` over HTTP and one worker process with admission
   by loop lag off (``RUNBRAKE_ADMIT_MAX_LAG_MS=0``: it takes all N), enqueues N runs each in a ``--call-s``
   call of the server's long operation with a progress report every second (bench/saturation.py), and waits
   until the process claimed all N (a run whose server did not answer its handshake ends at once, its call
   failed: counted apart); then starts a second, idle worker process, whose sweeps watch the first;
2. over ``--window-s`` seconds, Redis's MONITOR counts the liveness's round trips (``EVALSHA`` of ``BEAT`` and
   ``LAPSE``) and the commands they ran on the liveness keys, per process and second;
3. cancels every run (``--call-s`` must outlast the ramp and the window) and waits until each ended: **false
   detections** are the ``workers_lost``, ``worker_taken_as_lost`` and ``run_worker_lost`` lines of both
   processes and the runs with a ``worker_lost`` step.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime
from typing import Any

import redis

from bench._harness import (
    Bench,
    ToolboxServer,
    free_port,
    in_threads,
    machine,
    print_machine,
    slow_run_spec,
    summary_ms,
    wait_until,
)
from bench.saturation import long_call_spec
from bench.scale import enqueue_all, running_count
from runbrake.shared import _scripts
from runbrake.shared.logging import configure_logging
from runbrake.shared.messaging.cancel import cancel_run
from runbrake.shared.steps import StepKind, StepReason

WAIT_S = 120.0
AIM_P99_S = 10.0
CALL_S = 600.0
"""Each run's call: far longer than a round, so that every run is in it when its worker is killed."""
LIVENESS = {_scripts.BEAT.sha: "BEAT", _scripts.LAPSE.sha: "LAPSE"}
FALSE_DETECTIONS = ("workers_lost", "worker_taken_as_lost", "run_worker_lost")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=50)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--saturation", type=int, default=0, metavar="N",
                        help="measure false detections and the liveness's Redis operations at N talking runs instead")
    parser.add_argument("--call-s", type=float, default=1500.0, help="with --saturation: each run's call, seconds")
    parser.add_argument("--window-s", type=float, default=30.0, help="with --saturation: the MONITOR window")
    parser.add_argument("--keep-logs", action="store_true", help="keep the scratch directory with the logs")
    args = parser.parse_args(argv)
    configure_logging()
    info = machine()
    print_machine(info)
    if args.saturation:
        return _saturation(args, info)
    taken: list[float] = []
    claimed: list[float] = []
    next_step: list[float] = []
    with Bench("worker_loss", keep=args.keep_logs) as bench:
        server = bench.start_toolbox()
        bench.use_server(server.url)
        producer, _publisher = bench.producer_and_publisher()
        survivor = bench.start_worker(concurrency=4 * args.runs)
        for kill in range(args.kills):
            doomed = bench.start_worker(concurrency=4 * args.runs)
            run_ids = [producer.enqueue(slow_run_spec(CALL_S, input_text=f"kill {kill} run {i}")).run_id
                       for i in range(args.runs)]
            calls = (kill + 1) * args.runs  # each run makes its one call once, whichever worker runs it
            wait_until(lambda n=calls: _started(server) >= n, timeout=WAIT_S, what="every run in its call")
            held = {e["run_id"] for e in doomed.log.read_new() if e.get("event") == "run_claimed"}
            killed_at = time.time()
            doomed.process.popen.send_signal(signal.SIGKILL)
            doomed.process.popen.wait()
            for run_id in sorted(held):
                record = wait_until(lambda r=run_id: _finished_after_loss(bench, r), timeout=WAIT_S,
                                    what=f"run {run_id} taken up and answered")
                handoff = next(s for s in record.steps if s.kind is StepKind.HANDOFF)
                taken.append(handoff.recorded_at - killed_at)
                next_step.append(record.steps[-1].recorded_at - killed_at)
                survivor.log.read_new()
                line = wait_until(lambda r=run_id: [e for e in survivor.log.entries
                                                    if e.get("event") == "run_claimed" and e.get("run_id") == r],
                                  timeout=WAIT_S, what=f"the survivor's claim of {run_id}")
                claimed.append(_epoch(line[-1]) - killed_at)
            for run_id in run_ids:
                cancel_run(bench.store, None, run_id, reason="bench round over", requested_by="bench")
            print(f"kill {kill + 1}/{args.kills}: {len(held)} runs held; taken up "
                  f"{min(taken[-len(held):]) if held else 0:.2f}-{max(taken[-len(held):]) if held else 0:.2f} s")
        results: dict[str, Any] = {
            "machine": info, "kills": args.kills, "runs_per_kill": args.runs, "runs_lost": len(taken),
            "kill_to_taken_up_ms": summary_ms(taken), "kill_to_claimed_ms": summary_ms(claimed),
            "kill_to_next_step_ms": summary_ms(next_step), "aim_p99_s": AIM_P99_S,
        }
        path = bench.write_results(results)
    for name in ("kill_to_taken_up_ms", "kill_to_claimed_ms", "kill_to_next_step_ms"):
        print(f"{name}: {results[name]}")
    print(f"results in {path}")
    return 0


@contextmanager
def _private_redis() -> Iterator[str]:
    """A ``redis-server`` of this benchmark's own on a free loopback port, nothing persisted; its URL."""
    port = free_port()
    workdir = tempfile.mkdtemp(prefix="runbrake-worker-loss-redis-")
    server = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                               "--appendonly", "no", "--dir", workdir], stdout=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url)
    try:
        wait_until(lambda: _answers(client), timeout=30, what=f"redis-server on port {port}", interval=0.05)
        yield url
    finally:
        client.close()
        server.terminate()
        server.wait(timeout=30)
        shutil.rmtree(workdir, ignore_errors=True)


def _answers(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.ConnectionError:
        return False


def _saturation(args: argparse.Namespace, info: dict[str, Any]) -> int:
    """False detections at ``--saturation`` talking runs on one process, and the liveness's Redis operations."""
    with _private_redis() as url, Bench("worker_loss_saturation", keep=args.keep_logs,
                                         env={"RUNBRAKE_REDIS_URL": url, "RUNBRAKE_ADMIT_MAX_LAG_MS": "0"}) as bench:
        bench.start_everything("everything")
        busy = bench.start_worker(concurrency=args.saturation)
        started = time.monotonic()
        ids = enqueue_all(bench, [long_call_spec(args.call_s) for _ in range(args.saturation)])
        wait_until(lambda: _queued(bench, ids) == 0, timeout=args.call_s - 2 * args.window_s,
                   what="every run claimed", interval=1.0, alive=[busy.process])
        ramp_s = time.monotonic() - started
        running_before = running_count(bench, ids)
        watcher = bench.start_worker(concurrency=1)
        counts = _monitor(url, args.window_s)
        in_flight = running_count(bench, ids)
        # Then every run is cancelled: what a detection would have done to them is on their record by now.
        def cancel(i: int) -> None:
            cancel_run(bench.store, None, ids[i], reason="bench over", requested_by="bench")

        in_threads(8, len(ids), cancel)
        wait_until(lambda: all(bench.store.get(r).status.is_terminal for r in ids), timeout=300,
                   what="every run to end", interval=1.0)
        records = [bench.store.get(r) for r in ids]
        lines: Counter[str] = Counter()
        for worker in (busy, watcher):
            worker.log.read_new()
            lines.update(str(e.get("event")) for e in worker.log.entries)
        results: dict[str, Any] = {
            "machine": info, "runs": len(ids), "call_s": args.call_s, "ramp_s": round(ramp_s, 1),
            "running_before_window": running_before, "running_after_window": in_flight,
            "false_detections": {event: lines[event] for event in FALSE_DETECTIONS},
            "runs_with_a_worker_lost_step": sum(
                any(s.detail.get("reason") == StepReason.WORKER_LOST.value for s in r.steps) for r in records),
            "leases_lapsed": lines["lease_not_renewed"], "window_s": args.window_s, "processes": 2,
            "liveness_round_trips_per_s_per_process": round(
                (counts["BEAT"] + counts["LAPSE"]) / args.window_s / 2, 2),
            "liveness_commands_per_s_per_process": round(counts["commands"] / args.window_s / 2, 2),
            "all_commands_per_s": round(counts["all"] / args.window_s),
            "monitor": dict(counts),
        }
        path = bench.write_results(results)
    for name, value in results.items():
        if name != "machine":
            print(f"{name}: {value}")
    print(f"results in {path}")
    return 0


def _queued(bench: Bench, run_ids: Sequence[str]) -> int:
    """How many of the runs are still waiting for a worker."""
    with bench.store.redis.pipeline(transaction=False) as pipe:
        for run_id in run_ids:
            pipe.hget(bench.store.run_key(run_id), "status")
        return sum(1 for status in pipe.execute() if status in (b"queued", "queued"))


def _monitor(url: str, window_s: float) -> Counter[str]:
    """Redis's MONITOR for ``window_s`` seconds: the liveness scripts' calls (``BEAT``, ``LAPSE``), the commands
    they ran on the liveness keys plus their clock read (``commands``), and every command (``all``)."""
    counts: Counter[str] = Counter()
    client = redis.Redis.from_url(url)
    done = threading.Event()

    def read() -> None:
        with client.monitor() as monitor:  # type: ignore[no-untyped-call]
            for entry in monitor.listen():
                command = str(entry.get("command", ""))
                counts["all"] += 1
                words = command.split()
                if words[:1] and words[0].upper() == "EVALSHA" and len(words) > 1 and words[1] in LIVENESS:
                    counts[LIVENESS[words[1]]] += 1
                    counts["commands"] += 1  # the script's TIME (Redis's clock)
                elif entry.get("client_type") == "lua" and (":workers" in command or ":lost-workers" in command):
                    counts["commands"] += 1
                if done.is_set():
                    return

    reader = threading.Thread(target=read, name="monitor", daemon=True)
    reader.start()
    time.sleep(window_s)  # the measuring window itself, not a synchronisation
    done.set()
    reader.join(timeout=30)
    client.close()
    return counts


def _started(server: ToolboxServer) -> int:
    """The calls the toolbox server started so far."""
    server.events.read_new()
    return sum(1 for e in server.events.entries if e.get("event") == "started")


def _finished_after_loss(bench: Bench, run_id: str) -> Any:
    record = bench.store.get(run_id)
    return record if record.status.is_terminal and any(s.kind is StepKind.HANDOFF for s in record.steps) else None


def _epoch(entry: dict[str, Any]) -> float:
    return datetime.fromisoformat(str(entry["timestamp"]).replace("Z", "+00:00")).timestamp()


if __name__ == "__main__":
    raise SystemExit(main())
