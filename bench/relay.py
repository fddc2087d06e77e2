"""Event relay: how fast the outbox is published on ``<ns>.events``, and what each event costs.

Run from the repository root::

    .venv/bin/python -m bench.relay [--events 20000] [--rounds 3] [--batch-steps 1]

What it does, per round, in its own namespace (``bench-<hex>``), on the local Redis and RabbitMQ:

1. writes ``--events`` events into the outbox the way a worker does: one run, claimed, then its steps
   appended through :meth:`RunStore.append_step` (each append is the script that also ``XADD``s the event);
   Redis's ``INFO commandstats`` says what the ``XADD`` inside those scripts cost Redis (µs per call);
2. binds a durable queue to the events exchange (as a consumer would: RabbitMQ routes and persists every
   message) and starts one :class:`EventRelay` in this process, with a store of its own;
3. measures the wall time from the relay's start until it published (and acknowledged) every event, and the
   CPU time of the relay's thread meanwhile (``/proc/self/task/<tid>/stat``): events/s and CPU per event,
   the share of a worker process's CPU each recorded step costs for its event to be published;
4. checks that every event reached the queue (copies are counted: delivery is at least once), prints a
   table with the load average (the machine is shared), writes ``bench/results/relay.json``,
   and cleans up (keys, queue, exchange).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import pika

from bench._harness import Bench, machine, print_machine, thread_cpu_seconds, wait_until
from runbrake.shared import RunStep, RunStore, StepKind
from runbrake.shared.logging import configure_logging
from runbrake.shared.messaging.wire import Topology, connection_parameters
from runbrake.worker.relay import EventRelay

RESULTS = Path(__file__).parent / "results" / "relay.json"


def _xadd_usec(store: RunStore) -> tuple[int, float]:
    """Redis's count of XADD calls and the microseconds they took, so far."""
    stats = store.redis.info("commandstats").get("cmdstat_xadd", {})
    return int(stats.get("calls", 0)), float(stats.get("usec", 0.0))


def one_round(events: int) -> dict[str, Any]:
    with Bench("relay") as bench:
        store = bench.store
        outbox = f"{bench.namespace}:outbox"
        run_id = store.create({"input": "relay bench"}).run_id
        assert store.claim(run_id, "bench", lease_s=3600).won
        calls_before, usec_before = _xadd_usec(store)
        step = RunStep(kind=StepKind.TOOL, round=1, content="a tool's answer of a few words",
                       tool_server="toolbox", tool_name="echo")
        started = time.perf_counter()
        for _ in range(events - 2):  # the create and the claim wrote two events already
            store.append_step(run_id, step)
        write_s = time.perf_counter() - started
        calls_after, usec_after = _xadd_usec(store)
        total = int(store.redis.xlen(outbox))

        topology = Topology.of(bench.settings)
        queue = f"{bench.namespace}.bench-events"
        connection = pika.BlockingConnection(connection_parameters(bench.settings))
        channel = connection.channel()
        topology.declare_events_exchange(channel)
        channel.queue_declare(queue=queue, durable=True)
        channel.queue_bind(queue=queue, exchange=topology.events_exchange, routing_key="#")
        bench.on_close(lambda: (channel.queue_delete(queue=queue), connection.close()))

        relay_store = RunStore.connect(bench.settings)
        bench.on_close(relay_store.close)
        relay = EventRelay(bench.settings, relay_store)
        began = time.perf_counter()
        relay.start()
        tid = relay.native_id
        assert tid is not None
        wait_until(lambda: relay.published >= total, timeout=600, what=f"the relay publishing {total} events",
                   interval=0.01)
        elapsed = time.perf_counter() - began
        cpu = thread_cpu_seconds(os.getpid()).get(tid, 0.0)
        relay.stop()
        relay.join(30)
        queued = channel.queue_declare(queue=queue, durable=True, passive=True).method.message_count
        load = os.getloadavg()
    xadds = calls_after - calls_before
    return {
        "events": total, "published": relay.published, "on_the_queue": queued,
        "publish_s": round(elapsed, 3), "events_per_s": round(total / elapsed),
        "relay_cpu_us_per_event": round(cpu / total * 1e6, 1),
        "redis_xadd_us_per_event": round((usec_after - usec_before) / max(xadds, 1), 2),
        "append_ms_per_step_client": round(write_s / (events - 2) * 1000, 3),
        "loadavg_1m": round(load[0], 2),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.relay", description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=20_000, help="events per round (default 20000)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds (default 3)")
    args = parser.parse_args(argv)
    configure_logging(level="warning")
    info = machine()
    print_machine(info)
    rounds = [one_round(args.events) for _ in range(args.rounds)]
    print(f"{'round':>5} {'events':>7} {'s':>7} {'events/s':>9} {'relay CPU µs/event':>19} "
          f"{'XADD µs (Redis)':>16} {'load 1m':>8}")
    for i, r in enumerate(rounds, 1):
        print(f"{i:>5} {r['events']:>7} {r['publish_s']:>7} {r['events_per_s']:>9} "
              f"{r['relay_cpu_us_per_event']:>19} {r['redis_xadd_us_per_event']:>16} {r['loadavg_1m']:>8}")
    summary = {
        "events_per_s_median": statistics.median(r["events_per_s"] for r in rounds),
        "relay_cpu_us_per_event_median": statistics.median(r["relay_cpu_us_per_event"] for r in rounds),
        "redis_xadd_us_per_event_median": statistics.median(r["redis_xadd_us_per_event"] for r in rounds),
    }
    print(f"median: {summary['events_per_s_median']} events/s, relay CPU "
          f"{summary['relay_cpu_us_per_event_median']} µs per event (per recorded step), XADD "
          f"{summary['redis_xadd_us_per_event_median']} µs of Redis per event")
    for i, r in enumerate(rounds, 1):
        if r["on_the_queue"] > r["events"]:
            print(f"round {i}: {r['on_the_queue'] - r['events']} copies on the queue (at least once: a batch whose "
                  "confirms did not come within 30 s was published again)")
    bad = [r for r in rounds if r["published"] < r["events"] or r["on_the_queue"] < r["events"]]
    if bad:
        print(f"FAILED: a round did not publish every event: {bad}", file=sys.stderr)
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps({"machine": info, "rounds": rounds, "summary": summary}, indent=2) + "\n")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
