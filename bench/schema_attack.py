"""An innocent run's latency beside answers that are costly to validate (issue 27), against the same worker
without them.

Run from the repository root::

    .venv/bin/python -m bench.schema_attack [--samples 20]

What it does, in its own namespace (``bench-<hex>``), on loopback only:

1. starts one worker (``--concurrency 4``, ``RUNBRAKE_SCHEMA_CHECK_S=120``, so that the attack lasts the whole
   measurement);
2. quiet: enqueues ``--samples`` scripted runs one at a time, each answering at once, and measures each from
   the enqueue call to ``completed`` as the store says it (polled every 5 ms);
3. attack: enqueues two runs whose answers are costly to validate, ``"aaa…a!"`` (41 characters) against
   ``{"pattern": "^(a+)+$"}`` and 8,000 distinct objects against ``{"uniqueItems": true}``, waits until both
   are claimed, then measures ``--samples`` runs as in 2 while they are validated (it checks that they still
   are at the end);
4. prints p50/p95/max of both phases and writes ``bench/results/schema_attack.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

from bench._harness import Bench, machine, print_machine, summary_ms, wait_until
from runbrake.shared.logging import configure_logging
from runbrake.shared.messaging.producer import Producer
from runbrake.shared.spec import RunSpec
from runbrake.shared.status import RunStatus
from runbrake.shared.store import RunStore

WAIT_S = 30.0
ATTACKS = (
    ({"type": "string", "pattern": "^(a+)+$"}, json.dumps("a" * 40 + "!")),
    ({"type": "array", "uniqueItems": True}, json.dumps([{"k": i} for i in range(8000)], separators=(",", ":"))),
)


def _scripted(content: str, **extra: Any) -> RunSpec:
    return RunSpec.parse({"input": "schema attack", "model": {"provider": "scripted", "turns": [{"content": content}]},
                          **extra})


def _latencies(store: RunStore, producer: Producer, samples: int) -> list[float]:
    """From the enqueue call to ``completed``, one run at a time."""
    measured = []
    for _ in range(samples):
        t0 = time.monotonic()
        run_id = producer.enqueue(_scripted("done")).run_id
        wait_until(lambda run_id=run_id: store.status(run_id) is RunStatus.COMPLETED, timeout=WAIT_S,
                   what=f"run {run_id} to complete", interval=0.005)
        measured.append(time.monotonic() - t0)
    return measured


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.schema_attack", description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=20, help="innocent runs per phase (default 20)")
    args = parser.parse_args(argv)
    if args.samples < 1:
        parser.error("--samples must be at least 1")

    configure_logging("WARNING")
    info = machine()
    with Bench("schema_attack", env={"RUNBRAKE_SCHEMA_CHECK_S": "120"}) as bench:
        print(f"namespace {bench.namespace}; starting a worker…")
        producer, _ = bench.producer_and_publisher()
        bench.start_worker(concurrency=4)
        _latencies(bench.store, producer, 2)  # warm-up: the first run pays for imports
        quiet = _latencies(bench.store, producer, args.samples)
        attacks = [producer.enqueue(_scripted(answer, output_schema=schema, max_rounds=1)).run_id
                   for schema, answer in ATTACKS]
        for run_id in attacks:
            wait_until(lambda run_id=run_id: bench.store.status(run_id) is RunStatus.RUNNING, timeout=WAIT_S,
                       what=f"attack {run_id} to be claimed")
        beside = _latencies(bench.store, producer, args.samples)
        still_validating = all(not bench.store.get(run_id).steps for run_id in attacks)
        results: dict[str, Any] = {
            "benchmark": "schema_attack",
            "machine": info,
            "command": " ".join(["python -m bench.schema_attack", *(argv if argv is not None else sys.argv[1:])]),
            "to_completed_ms": {"quiet": summary_ms(quiet), "beside_the_attack": summary_ms(beside)},
            "attacks_still_validating_at_the_end": still_validating,
        }
        path = bench.write_results(results)
    print_machine(info)
    print("an innocent run, from the enqueue call to completed (ms):")
    for phase, summary in results["to_completed_ms"].items():
        print(f"  {phase:18}  n={summary['n']}  p50={summary['p50']}  p95={summary['p95']}  max={summary['max']}")
    print(f"the attacks' answers were still being validated at the end: {still_validating}")
    print(f"results in {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
