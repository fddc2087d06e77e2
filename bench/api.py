"""The HTTP API's throughput, its event fan-out, and cancel latency through the API and through a cancel
request on RabbitMQ (docs/http-api.md).

One ``runbrake serve`` process, one worker, the example MCP server over HTTP, all on loopback under a
namespace of its own (bench/_harness.py). Phases:

1. enqueue: POST /v1/runs from ``--concurrency`` connections (no worker runs yet, so the server has
   the CPU the clients leave it); requests per second.
2. read: GET /v1/runs/{id} likewise.
3. fan-out: ``--clients`` clients on one run's events (raw sockets, in this process); steps are
   appended to the run one at a time; for each step, the time from just before the append until the
   last client has it (and the median client), p50/p99 over the steps.
4. cancel through the API and through a cancel request published on ``<ns>.cancel-requests``: a run
   whose slow MCP call the server has started, cancelled; time to the cancelled step's ``recorded_at``.

    .venv/bin/python -m bench.api [--requests 1500] [--clients 200] [--cancels 30]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx2
import pika

from bench._harness import (
    REPO,
    Bench,
    BenchError,
    ManagedProcess,
    ToolboxServer,
    background_load,
    free_port,
    summary_ms,
    wait_until,
)
from runbrake.shared.messaging.wire import Topology, encode_cancel_request
from runbrake.shared.outcome import ToolOutcome
from runbrake.shared.steps import RunStep, StepKind

QUICK_SPEC = {"input": "bench", "model": {"provider": "scripted", "turns": [{"content": "hi"}]}}


def start_api(bench: Bench) -> str:
    port = free_port()
    log_path = bench.workdir / "api.log"
    popen = bench._spawn([str(Path(sys.executable).parent / "runbrake"), "serve", "--port", str(port)], log_path)
    process = ManagedProcess("runbrake serve", popen, log_path)
    bench._processes.append(process)
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        try:
            return httpx2.get(f"{url}/healthz", timeout=1).status_code == 200
        except httpx2.TransportError:
            return False

    wait_until(healthy, timeout=30, what="runbrake serve's /healthz", interval=0.05, alive=[process])
    return url


async def hammer(url: str, count: int, concurrency: int,
                 request: Callable[[httpx2.AsyncClient, int], Any]) -> dict[str, Any]:
    """``count`` requests from ``concurrency`` workers; requests per second and latency."""
    latencies: list[float] = []
    statuses: dict[int, int] = {}
    next_index = iter(range(count))
    limits = httpx2.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx2.AsyncClient(base_url=url, limits=limits, timeout=30) as client:

        async def work() -> None:
            for index in next_index:
                started = time.perf_counter()
                response = await request(client, index)
                latencies.append(time.perf_counter() - started)
                statuses[response.status_code] = statuses.get(response.status_code, 0) + 1

        began = time.perf_counter()
        await asyncio.gather(*(work() for _ in range(concurrency)))
        elapsed = time.perf_counter() - began
    return {"requests": count, "concurrency": concurrency, "seconds": round(elapsed, 3),
            "per_second": round(count / elapsed, 1), "statuses": statuses, "latency_ms": summary_ms(latencies)}


async def fan_out(url: str, bench: Bench, run_id: str, clients: int, steps: int) -> dict[str, Any]:
    """``clients`` raw-socket SSE clients on one run; per step, when each client had it."""
    host, port = url.removeprefix("http://").split(":")
    received: dict[int, list[float]] = {}
    connected = 0
    all_connected = asyncio.Event()

    async def client() -> None:
        nonlocal connected
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(f"GET /v1/runs/{run_id}/events HTTP/1.1\r\nHost: {host}\r\nAccept: text/event-stream\r\n\r\n"
                     .encode())
        await writer.drain()
        seen_status = False
        try:
            while True:
                line = await reader.readline()
                if not line:
                    return
                if line.startswith(b"event: status") and not seen_status:
                    seen_status = True
                    connected += 1
                    if connected == clients:
                        all_connected.set()
                elif line.startswith(b"id: "):
                    received.setdefault(int(line[4:]), []).append(time.time())
                elif line.startswith(b"event: end"):
                    return
        finally:
            writer.close()

    tasks = [asyncio.create_task(client()) for _ in range(clients)]
    await asyncio.wait_for(all_connected.wait(), 60)
    sent: dict[int, float] = {}

    def append_all() -> None:
        for index in range(steps):
            before = time.time()
            step = bench.store.append_step(run_id, RunStep(kind=StepKind.MODEL, round=index, content="x" * 200))
            sent[step.sequence] = before
            time.sleep(0.05)  # pacing between samples, not synchronisation
        bench.store.cancel(run_id, reason="bench done", requested_by="bench")

    appender = threading.Thread(target=append_all)
    appender.start()
    await asyncio.get_running_loop().run_in_executor(None, appender.join)
    await asyncio.wait_for(asyncio.gather(*tasks), 60)
    last, median = [], []
    complete = 0
    for sequence, before in sent.items():
        times = sorted(received.get(sequence, []))
        if len(times) == clients:
            complete += 1
        if times:
            last.append(times[-1] - before)
            median.append(times[len(times) // 2] - before)
    return {"clients": clients, "steps": steps, "steps_every_client_got": complete,
            "last_client_ms": summary_ms(last), "median_client_ms": summary_ms(median)}


def cancel_phase(bench: Bench, url: str, server: ToolboxServer, count: int, how: str) -> dict[str, Any]:
    """``count`` runs whose slow call has started, cancelled one at a time through ``how``."""
    latencies = []
    topology = Topology.of(bench.settings)
    connection = pika.BlockingConnection(pika.URLParameters(bench.settings.rabbitmq_url))
    channel = connection.channel()
    channel.confirm_delivery()
    spec = {"input": "cancel me", "mcp_servers": {"toolbox": server.server_spec()}, "model": {
        "provider": "scripted", "turns": [
            {"tool_calls": [{"server": "toolbox", "tool": "slow", "arguments": {"seconds": 60}}]}, {"content": "x"}]}}
    with httpx2.Client(base_url=url, timeout=30) as http:
        for _ in range(count):
            started = sum(1 for e in server.events.entries if e.get("event") == "started")
            run_id = http.post("/v1/runs", json=spec).json()["run_id"]
            wait_until(lambda n=started: (server.events.read_new() or True) and sum(
                1 for e in server.events.entries if e.get("event") == "started") > n,
                timeout=30, what="the slow call to start")
            before = time.time()
            if how == "api":
                assert http.post(f"/v1/runs/{run_id}/cancel", json={"reason": "bench"}).status_code == 202
            else:
                channel.basic_publish(topology.cancel_requests_exchange, topology.cancel_requests_routing_key,
                                      encode_cancel_request(run_id, reason="bench", requested_by="bench"),
                                      pika.BasicProperties(content_type="application/json", delivery_mode=2))

            def cancelled_step(run_id: str = run_id) -> RunStep | None:
                return next((s for s in bench.store.get(run_id).steps
                             if s.kind is StepKind.TOOL and s.tool_outcome is ToolOutcome.CANCELLED), None)

            step = wait_until(cancelled_step, timeout=30, what="the cancelled step", interval=0.002)
            latencies.append(step.recorded_at - before)
    connection.close()
    return {"path": how, "cancels": count, "to_cancelled_step_ms": summary_ms(latencies)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--requests", type=int, default=1500)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--clients", type=int, default=200)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--cancels", type=int, default=30)
    options = parser.parse_args()
    results: dict[str, Any] = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version()}}
    with Bench("api") as bench:
        results["load_before"] = background_load()
        url = start_api(bench)
        server = bench.start_toolbox()
        body = json.dumps(QUICK_SPEC).encode()
        results["enqueue"] = asyncio.run(hammer(url, options.requests, options.concurrency, lambda client, _i: (
            client.post("/v1/runs", content=body, headers={"Content-Type": "application/json"}))))
        print("enqueue", json.dumps(results["enqueue"]))
        run_id = bench.store.create(QUICK_SPEC).run_id
        results["get"] = asyncio.run(hammer(url, options.requests * 2, options.concurrency, lambda client, _i: (
            client.get(f"/v1/runs/{run_id}"))))
        print("get", json.dumps(results["get"]))
        fan_run = bench.store.create(QUICK_SPEC).run_id
        bench.store.claim(fan_run, "bench", lease_s=600)
        results["fan_out"] = asyncio.run(fan_out(url, bench, fan_run, options.clients, options.steps))
        print("fan_out", json.dumps(results["fan_out"]))
        # The queued runs of the enqueue phase are not for executing: drop them before a worker starts.
        connection = pika.BlockingConnection(pika.URLParameters(bench.settings.rabbitmq_url))
        connection.channel().queue_purge(Topology.of(bench.settings).run_queue)
        connection.close()
        bench.start_worker(concurrency=8)
        results["cancel_api"] = cancel_phase(bench, url, server, options.cancels, "api")
        print("cancel_api", json.dumps(results["cancel_api"]))
        results["cancel_request"] = cancel_phase(bench, url, server, options.cancels, "amqp")
        print("cancel_request", json.dumps(results["cancel_request"]))
        results["load_after"] = background_load()
        path = bench.write_results(results)
    print(f"results: {path.relative_to(REPO)}")


if __name__ == "__main__":
    try:
        main()
    except BenchError as exc:
        print(f"bench.api: {exc}", file=sys.stderr)
        sys.exit(1)
