"""A run outlives its worker: time from ``kill -9`` of the worker holding runs to each run claimed again by
another worker, and to its next step (docs/benchmarks.md, "Lost workers").

Run from the repository root::

    .venv/bin/python -m bench.worker_loss [--kills 10] [--runs 20]

What it does, in its own namespace (``bench-<hex>``), on loopback only, with the default settings
(``RUNBRAKE_WORKER_BEAT_S`` 1 s, ``RUNBRAKE_WORKER_LOST_S`` 6 s):

1. starts the toolbox MCP server and a survivor worker (``--concurrency`` 4 × ``--runs``);
2. per kill: starts a doomed worker, enqueues ``--runs`` runs whose first turn is a 600 s ``slow`` call, waits
   until every one is in its call, and sends SIGKILL to the doomed worker (t0 = ``time.time()`` just before);
3. for each run the doomed worker held (its ``run_claimed`` lines), measures t0 → the ``handoff`` step the
   sweeper recorded (``recorded_at``: the run taken up), t0 → claimed again (the survivor's ``run_claimed``
   line) and t0 → the run's next step (its final model step, ``recorded_at``), then cancels what is left;
4. prints p50/p99/max of each and writes ``bench/results/worker_loss.json``.

The liveness costs two round trips per process per beat, whatever the runs (``BEAT`` and the sweep's
``LAPSE``, each one script): two Redis operations a second per process with the defaults, by construction (the
Redis here is shared with other work, so its command counts cannot single them out).
"""

from __future__ import annotations

import argparse
import signal
import time
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from bench._harness import Bench, ToolboxServer, machine, print_machine, slow_run_spec, summary_ms, wait_until
from runbrake.shared.logging import configure_logging
from runbrake.shared.messaging.cancel import cancel_run
from runbrake.shared.steps import StepKind

WAIT_S = 120.0
AIM_P99_S = 10.0
CALL_S = 600.0
"""Each run's call: far longer than a round, so that every run is in it when its worker is killed."""
LIVENESS_OPS_PER_S = 2.0
"""BEAT and LAPSE, once a beat (RUNBRAKE_WORKER_BEAT_S, 1 s) each."""


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--keep-logs", action="store_true", help="keep the scratch directory with the logs")
    args = parser.parse_args(argv)
    configure_logging()
    info = machine()
    print_machine(info)
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
            "kill_to_next_step_ms": summary_ms(next_step), "liveness_redis_ops_per_s_per_process": LIVENESS_OPS_PER_S,
            "aim_p99_s": AIM_P99_S,
        }
        path = bench.write_results(results)
    for name in ("kill_to_taken_up_ms", "kill_to_claimed_ms", "kill_to_next_step_ms"):
        print(f"{name}: {results[name]}")
    print(f"liveness: {LIVENESS_OPS_PER_S:g} Redis ops/s per process (by construction); results in {path}")
    return 0


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
