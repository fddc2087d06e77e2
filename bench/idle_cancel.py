"""Cancel and steer after idle spells: through ``runbrake serve``, from the HTTP call to the in-flight tool call's
cancelled step, warm (right after another) and after an idle spell longer than RabbitMQ lets an unserviced
connection live (issue 30, item 1; docs/messages.md, "Idle connections").

Run from the repository root::

    .venv/bin/python -m bench.idle_cancel [--rounds 5] [--heartbeat 2]

What it does, in its own namespace (``bench-<hex>``), on loopback only:

1. ``RUNBRAKE_RABBITMQ_URL`` with ``heartbeat=<--heartbeat>`` for every process, so that "idle long enough"
   takes seconds, not minutes; starts the example toolbox MCP server, one worker and ``runbrake serve``;
2. per round, for a cancel and then a steer: a warm sample (a run in a slow call; the call made through serve;
   t0 right before the HTTP request; measured: the cancelled tool step's ``recorded_at`` minus t0), then an
   idle spell: a twin connection opened and never serviced, waited for until RabbitMQ dropped it (every
   connection idle as long and not kept alive is dropped by then), then a cold sample the same way;
3. prints p50 and max of each (ms) and whether every answer said ``message_confirmed: true``, writes
   ``bench/results/idle_cancel.json``, and cleans up.
"""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

import httpx2
import pika
import pika.exceptions

from bench._harness import Bench, BenchError, ToolboxServer, machine, print_machine, summary_ms, wait_until
from bench.api import start_api
from bench.steer_latency import _cut_off_at, _spec
from runbrake.shared.logging import configure_logging, silenced
from runbrake.shared.messaging.wire import connection_parameters
from runbrake.shared.settings import Settings

WAIT_S = 60.0
KINDS = ("cancel", "steer")


def _connection_names() -> str:
    listed = subprocess.run(["rabbitmqctl", "list_connections", "-q", "client_properties"], capture_output=True,
                            text=True, timeout=60, check=False)
    if listed.returncode != 0:
        raise BenchError(f"rabbitmqctl cannot list connections: {listed.stderr.strip()}")
    return listed.stdout


def idle_spell(settings: Settings) -> float:
    """Wait until RabbitMQ dropped a connection opened now and never serviced; returns the seconds it took."""
    name = f"idle-twin {settings.namespace}"
    started = time.monotonic()
    twin = pika.BlockingConnection(connection_parameters(settings, name=name))
    wait_until(lambda: name not in _connection_names(), timeout=120, what="RabbitMQ to drop the idle twin",
               interval=0.5)
    with silenced("pika"), contextlib.suppress(pika.exceptions.AMQPError):
        twin.close()
    return time.monotonic() - started


def sample(bench: Bench, url: str, server: ToolboxServer, kind: str, index: int, started: set[float]) -> dict[str, Any]:
    """One run in a slow call, cancelled or steered through serve; the time to its cut-off step."""
    seconds = round(60 + (index + 1) / 10_000, 6)
    answer = httpx2.post(f"{url}/v1/runs", json=_spec(seconds).raw, timeout=WAIT_S)
    run_id = answer.json()["run_id"]

    def call_started() -> bool:
        started.update(round(float(e["args"]["seconds"]), 6) for e in server.events.read_new()
                       if e.get("tool") == "slow" and e.get("event") == "started")
        return seconds in started

    wait_until(call_started, timeout=WAIT_S, what=f"slow({seconds}) to start", interval=0.005)
    t0 = time.time()
    if kind == "cancel":
        reply = httpx2.post(f"{url}/v1/runs/{run_id}/cancel", json={"reason": "bench"}, timeout=WAIT_S)
    else:
        reply = httpx2.post(f"{url}/v1/runs/{run_id}/steer", json={"input": "go on", "reason": "bench"},
                            timeout=WAIT_S)
    cut: list[float] = []

    def cut_off() -> bool:
        at = _cut_off_at(bench.store, run_id)
        if at is not None:
            cut.append(at)
        return at is not None

    wait_until(cut_off, timeout=WAIT_S, what=f"the {kind} of {run_id} to cut its call off", interval=0.005)
    wait_until(lambda: bench.store.status(run_id).is_terminal, timeout=WAIT_S, what=f"run {run_id} to end",
               interval=0.01)
    return {"ms": (cut[0] - t0) * 1000, "confirmed": reply.json().get("message_confirmed") is True}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.idle_cancel", description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="warm and cold samples of each kind (default 5)")
    parser.add_argument("--heartbeat", type=int, default=2, help="the negotiated heartbeat, seconds (default 2)")
    args = parser.parse_args(argv)

    configure_logging("WARNING")
    info = machine()
    base = Settings.from_env()
    url_list = ",".join(f"{u}{'&' if '?' in u else '?'}heartbeat={args.heartbeat}" for u in base.rabbitmq_urls)
    samples: dict[str, list[dict[str, Any]]] = {f"{kind}_{state}": [] for kind in KINDS for state in ("warm", "cold")}
    idle_s: list[float] = []
    with Bench("idle_cancel", env={"RUNBRAKE_RABBITMQ_URL": url_list}) as bench:
        print(f"namespace {bench.namespace}; heartbeat {args.heartbeat} s; starting the toolbox, a worker, serve…")
        server = bench.start_toolbox()
        bench.start_worker(concurrency=4)
        api = start_api(bench)
        started: set[float] = set()
        index = 0
        for _round in range(args.rounds):
            for kind in KINDS:
                samples[f"{kind}_warm"].append(sample(bench, api, server, kind, index, started))
                idle_s.append(idle_spell(bench.settings))
                samples[f"{kind}_cold"].append(sample(bench, api, server, kind, index + 1, started))
                index += 2
        results: dict[str, Any] = {
            "benchmark": "idle_cancel",
            "machine": info,
            "command": " ".join(["python -m bench.idle_cancel", *(argv if argv is not None else sys.argv[1:])]),
            "heartbeat_s": args.heartbeat,
            "idle_spell_s": summary_ms(idle_s),
            "to_cut_off_step_ms": {name: summary_ms([s["ms"] / 1000 for s in values])
                                   for name, values in samples.items()},
            "all_confirmed": {name: all(s["confirmed"] for s in values) for name, values in samples.items()},
        }
        path = bench.write_results(results)
    print_machine(info)
    print(f"idle spells: p50 {results['idle_spell_s']['p50'] / 1000:.1f} s (RabbitMQ dropped the unserviced twin)")
    print("from the HTTP call to the in-flight call's cancelled step (ms):")
    for name, summary in results["to_cut_off_step_ms"].items():
        print(f"  {name:12} n={summary['n']}  p50={summary['p50']}  max={summary['max']}  "
              f"confirmed={results['all_confirmed'][name]}")
    print(f"results in {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
