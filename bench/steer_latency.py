"""Steer latency beside cancel latency: from the call (``steer_run`` / ``cancel_run``) to the in-flight tool
call's ``cancelled`` step being persisted, in the same benchmark run, on the same worker, alternating.

Run from the repository root::

    .venv/bin/python -m bench.steer_latency [--samples 100] [--warmup 4] [--poll-ms 250]

What it does, in its own namespace (``bench-<hex>``), on loopback only:

1. starts the example toolbox MCP server over HTTP and one worker (``--concurrency 4``,
   ``RUNBRAKE_CANCEL_POLL_MS=250``);
2. per sample, one run at a time: enqueues a run whose first turn calls ``slow(seconds=30 + a unique
   fraction)`` and whose second answers, waits until the server has written "started" for that call, then
   t0 = ``time.time()`` and either ``steer_run`` (the steer stored, then its wake-up on ``<ns>.cancel``) or
   ``cancel_run`` (the fence, then the wake-up), alternating, so both see the same machine at the same time;
3. measured: the cancelled tool step's ``recorded_at`` minus t0 (for a steer the step says ``detail.reason =
   "steered"``); then the run is awaited to its end (a steered run completes with its second turn, a
   cancelled one ends cancelled) before the next sample;
4. prints p50/p95/p99 of both, writes ``bench/results/steer_latency.json``, and cleans up.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from typing import Any

from bench._harness import Bench, machine, print_machine, summary_ms, wait_until
from runbrake.shared.logging import configure_logging
from runbrake.shared.messaging.cancel import cancel_run
from runbrake.shared.messaging.steer import check_steer, steer_run
from runbrake.shared.outcome import ToolOutcome
from runbrake.shared.spec import RunSpec
from runbrake.shared.steps import StepKind
from runbrake.shared.store import RunStore

SLOW_SECONDS = 30.0
WAIT_S = 30.0
KINDS = ("steer", "cancel")


def _spec(seconds: float) -> RunSpec:
    return RunSpec.parse({
        "input": "steer latency",
        "model": {"provider": "scripted", "turns": [
            {"tool_calls": [{"server": "toolbox", "tool": "slow", "arguments": {"seconds": seconds}}]},
            {"content": "steered"},
        ]},
        "mcp_servers": ["toolbox"],
    })


def _cut_off_at(store: RunStore, run_id: str) -> float | None:
    """When the run's cancelled tool step was recorded, or None while there is none."""
    step = next((s for s in store.get(run_id).steps
                 if s.kind is StepKind.TOOL and s.tool_outcome is ToolOutcome.CANCELLED), None)
    return None if step is None else step.recorded_at


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.steer_latency", description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=100, help="measured steers and cancels each (default 100)")
    parser.add_argument("--warmup", type=int, default=4, help="samples of each not counted (default 4)")
    parser.add_argument("--poll-ms", type=int, default=250, help="RUNBRAKE_CANCEL_POLL_MS (default 250)")
    args = parser.parse_args(argv)
    if args.samples < 1 or args.warmup < 0:
        parser.error("--samples must be at least 1 and --warmup at least 0")

    configure_logging("WARNING")
    info = machine()
    latencies: dict[str, list[float]] = {kind: [] for kind in KINDS}
    with Bench("steer_latency", env={"RUNBRAKE_CANCEL_POLL_MS": str(args.poll_ms)}) as bench:
        print(f"namespace {bench.namespace}; starting the toolbox server and a worker…")
        server = bench.start_toolbox()
        producer, publisher = bench.producer_and_publisher()
        bench.start_worker(concurrency=4)
        started: set[float] = set()
        for index in range(2 * (args.samples + args.warmup)):
            kind = KINDS[index % 2]
            seconds = round(SLOW_SECONDS + (index + 1) / 10_000, 6)
            run_id = producer.enqueue(_spec(seconds)).run_id

            def call_started(seconds: float = seconds) -> bool:
                started.update(round(float(e["args"]["seconds"]), 6) for e in server.events.read_new()
                               if e.get("tool") == "slow" and e.get("event") == "started")
                return seconds in started

            wait_until(call_started, timeout=WAIT_S, what=f"slow({seconds}) to start", interval=0.005)
            t0 = time.time()
            if kind == "steer":
                steer_run(bench.store, publisher, producer, run_id,
                          check_steer("go on without it", "bench", max_input_chars=100_000), requested_by="bench")
            else:
                cancel_run(bench.store, publisher, run_id, reason="bench", requested_by="bench")
            recorded: list[float] = []

            def cut_off(run_id: str = run_id, recorded: list[float] = recorded) -> bool:
                at = _cut_off_at(bench.store, run_id)
                if at is not None:
                    recorded.append(at)
                return at is not None

            wait_until(cut_off, timeout=WAIT_S, what=f"the {kind} of run {run_id} to cut its call off", interval=0.005)
            wait_until(lambda run_id=run_id: bench.store.status(run_id).is_terminal, timeout=WAIT_S,
                       what=f"run {run_id} to end", interval=0.01)
            if index >= 2 * args.warmup:
                latencies[kind].append(recorded[0] - t0)
        results: dict[str, Any] = {
            "benchmark": "steer_latency",
            "machine": info,
            "command": " ".join(["python -m bench.steer_latency", *(argv if argv is not None else sys.argv[1:])]),
            "cancel_poll_ms": args.poll_ms,
            "to_cut_off_step_ms": {kind: summary_ms(values) for kind, values in latencies.items()},
        }
        path = bench.write_results(results)
    print_machine(info)
    print("from the call to the in-flight call's cancelled step, persisted (ms):")
    for kind in KINDS:
        summary = results["to_cut_off_step_ms"][kind]
        print(f"  {kind:6}  n={summary['n']}  p50={summary['p50']}  p95={summary['p95']}  p99={summary['p99']}  "
              f"max={summary['max']}")
    print(f"results in {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
