"""Deadline latency: how late a run's ``budget.deadline_s`` stops it, and how soon after its fence the call in
flight is recorded cancelled (docs/cancellation.md, "Budgets").

Run from the repository root::

    .venv/bin/python -m bench.budget_deadline [--runs 20] [--deadline-s 3]

What it does, in its own namespace (``bench-<hex>``), on loopback only: starts the example toolbox MCP
server over HTTP and one worker; then, one run at a time, enqueues a run whose first turn calls
``slow(120)`` with ``budget = {"deadline_s": D}``, waits for the server's "started" (the call is in flight)
and for the run to end. Per run, from the store: **lateness** = the fence's ``cancel.requested_at`` minus
the deadline (``created_at + D``; the timer on the worker's loop against the producer's clock, same
host), and **cut-off** = the cancelled tool step's ``recorded_at`` minus ``cancel.requested_at`` (the
local interrupt, the transport's cut-off and the append). Prints both and writes
``bench/results/budget_deadline.json``.
"""

from __future__ import annotations

import argparse
import time

from bench._harness import (
    Bench,
    BenchError,
    background_load,
    machine,
    print_machine,
    slow_run_spec,
    summary_ms,
    wait_until,
)
from runbrake.shared.messaging.producer import Producer
from runbrake.shared.messaging.rabbitmq import build_broker
from runbrake.shared.records import RunRecord
from runbrake.shared.spec import RunSpec
from runbrake.shared.status import RunStatus, TerminationReason
from runbrake.shared.steps import StepKind

_WAIT_S = 60.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--deadline-s", type=float, default=3.0)
    args = parser.parse_args()
    info = {**machine(), "background": background_load()}
    lateness: list[float] = []
    cut_off: list[float] = []
    with Bench("budget_deadline") as bench:
        toolbox = bench.start_toolbox()
        bench.start_worker(concurrency=4)
        broker = build_broker(bench.settings)
        bench.on_close(broker.close)
        producer = Producer(bench.store, broker, bench.admission())
        for index in range(args.runs):
            raw = slow_run_spec(120.0 + index / 1000, input_text=f"deadline run {index}").raw
            run = producer.enqueue(RunSpec.parse({**raw, "budget": {"deadline_s": args.deadline_s}}))
            wait_until(lambda: any(e.get("event") == "started" for e in toolbox.events.read_new()),
                       timeout=_WAIT_S, what=f"the slow call of run {index}")
            record = wait_until(lambda run_id=run.run_id: _ended(bench.store.get(run_id)),
                                timeout=_WAIT_S + args.deadline_s, what=f"the end of run {index}")
            if record.termination_reason is not TerminationReason.DEADLINE_EXCEEDED or record.cancel is None:
                raise BenchError(f"run {index} ended {record.status.value}/{record.termination_reason.value}")
            tool = next(s for s in record.steps if s.kind is StepKind.TOOL)
            lateness.append(record.cancel.requested_at - (record.created_at + args.deadline_s))
            cut_off.append((tool.recorded_at or 0.0) - record.cancel.requested_at)
        results = {"machine": info, "runs": args.runs, "deadline_s": args.deadline_s,
                   "lateness_ms": summary_ms(lateness), "cut_off_ms": summary_ms(cut_off)}
        path = bench.write_results(results)
    print_machine(info)
    print(f"deadline {args.deadline_s:g} s, {args.runs} runs, each in a slow tool call when its deadline passed")
    for name in ("lateness_ms", "cut_off_ms"):
        row = results[name]
        print(f"  {name:12} p50 {row['p50']:8.2f}  p95 {row['p95']:8.2f}  p99 {row['p99']:8.2f}  "
              f"max {row['max']:8.2f}")
    print(f"results: {path}")


def _ended(record: RunRecord) -> RunRecord | None:
    """The run once it ended and, when cancelled, once its cut-off tool step is recorded too."""
    if record.status is RunStatus.CANCELLED:
        return record if any(s.kind is StepKind.TOOL for s in record.steps) else None
    return record if record.status.is_terminal else None


if __name__ == "__main__":
    started = time.monotonic()
    main()
    print(f"took {time.monotonic() - started:.0f} s")
