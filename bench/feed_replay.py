"""Feed replay: what one tenant's ``GET /v1/events`` replay reads while another tenant has a backlog.

Run from the repository root::

    .venv/bin/python -m bench.feed_replay [--steps 0,500,2000] [--step-chars 4000] [--rounds 3]

For each backlog size, in its own namespace (``bench-<hex>``) on the local Redis: tenant beta's run is
created, then tenant alpha's run with ``--steps`` steps of ``--step-chars`` characters (each through
:meth:`RunStore.append_step`, as a worker writes them), then beta's run is cancelled. Beta's replay from the
event before all of it is then read two ways, best of ``--rounds``:

- **all**: the outbox in pages of 32, every entry brought to the reader and filtered there (how ``serve``
  replayed before issue 27);
- **scan**: the pages of ``broker/events.py`` (``FEED_SCAN`` keeps beta's status changes in Redis).

It prints, per way, the bytes the reader received (events and labels), the status changes kept, and the wall
time, with the load average (the machine may be shared); writes ``bench/results/feed_replay.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from bench._harness import Bench, machine, print_machine
from runbrake.broker.events import FEED_PAGE
from runbrake.shared import RunStep, RunStore, StepKind
from runbrake.shared import _store_core as core
from runbrake.shared.logging import configure_logging

RESULTS = Path(__file__).parent / "results" / "feed_replay.json"
SPEC = {"input": "feed bench", "model": {"provider": "scripted", "turns": [{"content": "hi"}]}}


def read_all(store: RunStore, after: str) -> tuple[int, int]:
    """Every entry after ``after`` to the reader, filtered there: (bytes received, beta's status changes)."""
    received = kept = 0
    while True:
        entries, _oldest = store.execute(core.outbox_after(store.keys, after, count=32))
        received += sum(len(e.event) + len(e.labels) for e in entries)
        kept += sum(1 for e in entries if e.tenant == "beta" and e.event.startswith('{"event":"status"'))
        if len(entries) < 32:
            return received, kept
        after = entries[-1].stream_id


def read_scanned(store: RunStore, after: str) -> tuple[int, int]:
    """The pages of the feed's replay: (bytes received, beta's status changes)."""
    received = kept = 0
    while True:
        page = store.execute(core.feed_page(store.keys, after, tenant="beta", count=FEED_PAGE))
        received += sum(len(e.event) + len(e.labels) for e in page.entries)
        kept += len(page.entries)
        if page.last_read is None or page.read < FEED_PAGE:
            return received, kept
        after = page.last_read


def one_backlog(steps: int, step_chars: int, rounds: int) -> dict[str, Any]:
    with Bench("feed_replay") as bench:
        store = bench.store
        beta = store.create(SPEC, tenant="beta").run_id
        [(first, _fields)] = store.redis.xrange(f"{bench.namespace}:outbox", count=1)
        alpha = store.create(SPEC, tenant="alpha").run_id
        for n in range(steps):
            store.append_step(alpha, RunStep(kind=StepKind.MODEL, round=n, content="a" * step_chars))
        store.cancel(beta, reason="bench", requested_by="bench")
        result: dict[str, Any] = {"alpha_steps": steps, "step_chars": step_chars, "loadavg_1m": os.getloadavg()[0]}
        for name, read in (("all", read_all), ("scan", read_scanned)):
            best = None
            for _ in range(rounds):
                started = time.perf_counter()
                received, kept = read(store, first)
                took = time.perf_counter() - started
                best = took if best is None else min(best, took)
            result[name] = {"bytes": received, "kept": kept, "ms": round((best or 0.0) * 1000, 1)}
        return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", default="0,500,2000", help="alpha's backlogs, steps, comma-separated")
    parser.add_argument("--step-chars", type=int, default=4000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    configure_logging("WARNING")
    info = machine()
    print_machine(info)
    results = [one_backlog(int(n), args.step_chars, args.rounds) for n in args.steps.split(",")]
    print(f"{'alpha steps':>11} {'all: bytes':>12} {'ms':>8} {'scan: bytes':>12} {'ms':>8} {'kept':>5} {'load 1m':>8}")
    for r in results:
        print(f"{r['alpha_steps']:>11} {r['all']['bytes']:>12,} {r['all']['ms']:>8} {r['scan']['bytes']:>12,} "
              f"{r['scan']['ms']:>8} {r['scan']['kept']:>5} {r['loadavg_1m']:>8.2f}")
    wrong = [r for r in results if r["all"]["kept"] != r["scan"]["kept"]]
    if wrong:
        print(f"FAILED: the two reads kept different status changes: {wrong}", file=sys.stderr)
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps({"machine": info, "results": results}, indent=2) + "\n")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
