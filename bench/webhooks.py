"""Webhooks: a receiver down for a while under a steady stream of runs gets every delivery after it comes back.

Run from the repository root::

    .venv/bin/python -m bench.webhooks [--rate 10] [--down 600] [--bound 120]

The issue's figure is a receiver down 10 minutes (``--down 600``) under 10 runs/s, every delivery within 2
minutes of its coming back (``--bound 120``). What it does, in its own namespace, on the local Redis:

1. starts a receiver (tests/webhook_helpers.py: it verifies every signature with the PyPI
   ``standardwebhooks`` package) and takes it down at once (its port refuses connections), and a
   :class:`WebhookDispatcher` in this process with the default settings (backoff 1 s doubling to 60 s);
2. for ``--down`` seconds, finishes ``--rate`` runs a second through the store as a worker does (create,
   claim, a model step, settle), each naming the webhook, which wants ``run.*``: three deliveries a run;
3. brings the receiver back and measures how long until it accepted every delivery (each once at least),
   checks every run's arrived in order, prints the figures with the load average, writes
   ``bench/results/webhooks.json``, and exits 1 when the wait passed ``--bound``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from bench._harness import Bench, machine, print_machine, wait_until
from runbrake.shared import RunStatus, RunStep, StepKind, TerminationReason
from runbrake.shared.catalog import Catalog
from runbrake.shared.logging import configure_logging
from runbrake.shared.records import stream_position
from runbrake.worker.webhooks import WebhookDispatcher
from tests.mcp_helpers import free_port
from tests.webhook_helpers import Receiver, new_secret

RESULTS = Path(__file__).parent / "results" / "webhooks.json"
SECRET_ENV = "RUNBRAKE_BENCH_WEBHOOK_SECRET"  # noqa: S105 - the name of a variable, not a secret


def measure(rate: float, down_s: float, bound_s: float) -> dict[str, Any]:
    secret = new_secret()
    receiver = Receiver(secret, free_port())
    with Bench("webhooks", env={SECRET_ENV: secret}) as bench:
        os.environ[SECRET_ENV] = secret  # the dispatcher runs in this process: it reads this environment
        catalog = Catalog.parse({"webhooks": {"orders": {"url": receiver.url, "secret_env": SECRET_ENV,
                                                         "events": ["run.*"]}}})
        store = bench.store
        dispatcher = WebhookDispatcher(bench.settings, type(store).connect(bench.settings), catalog)
        dispatcher.start()
        bench.on_close(lambda: (dispatcher.stop(), dispatcher.join(15)))
        run_ids: list[str] = []
        started = time.monotonic()
        while time.monotonic() - started < down_s:
            due = started + len(run_ids) / rate
            if time.monotonic() < due:
                time.sleep(due - time.monotonic())  # pacing the producer, not synchronising
            run_id = store.create({"input": "bench", "notify": ["orders"]}).run_id
            owner = f"bench-{uuid.uuid4().hex[:8]}"
            store.claim(run_id, owner, lease_s=3600)
            store.append_step(run_id, RunStep(kind=StepKind.MODEL, round=1, content="done"))
            store.settle(run_id, RunStatus.COMPLETED, TerminationReason.COMPLETED, owner=owner)
            run_ids.append(run_id)
        produced_s = time.monotonic() - started
        expected = 3 * len(run_ids)
        failing = len(store.webhook_deliveries(failing=True, count=1000))
        receiver.start()
        back = time.monotonic()
        wait_until(lambda: len(set(receiver.ids())) >= expected, timeout=max(bound_s * 3, 600),
                   what=f"{expected} deliveries", interval=0.05)
        caught_up_s = time.monotonic() - back
        receiver.stop()
        by_run: dict[str, list[str]] = {}
        for delivery in receiver.accepted:
            ids = by_run.setdefault(delivery.body["run_id"], [])
            if delivery.webhook_id not in ids:
                ids.append(delivery.webhook_id)
        in_order = all(ids == sorted(ids, key=lambda i: stream_position(i) or (0, 0)) and len(ids) == 3
                       for ids in by_run.values())
        return {
            "rate_runs_per_s": rate, "down_s": down_s, "produced_s": round(produced_s, 1), "runs": len(run_ids),
            "deliveries": expected, "accepted_with_copies": len(receiver.accepted),
            "failing_when_it_came_back_first_1000": failing, "caught_up_s": round(caught_up_s, 1),
            "bound_s": bound_s, "within_bound": caught_up_s <= bound_s, "in_order_per_run": in_order,
            "signatures_refused": len(receiver.refused),
            "backoff_s": bench.settings.webhook_backoff_s, "backoff_max_s": bench.settings.webhook_backoff_max_s,
        }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=10.0, help="runs finished per second while it is down")
    parser.add_argument("--down", type=float, default=600.0, help="seconds the receiver is down")
    parser.add_argument("--bound", type=float, default=120.0, help="seconds allowed to catch up after")
    args = parser.parse_args()
    configure_logging(level="WARNING")
    info = machine()
    result = measure(args.rate, args.down, args.bound)
    print_machine(info)
    for name, value in result.items():
        print(f"{name:40} {value}")
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps({"machine": info, "result": result}, indent=2) + "\n")
    return 0 if result["within_bound"] and result["in_order_per_run"] and not result["signatures_refused"] else 1


if __name__ == "__main__":
    sys.exit(main())
