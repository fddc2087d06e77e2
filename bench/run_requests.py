"""Run requests on RabbitMQ (docs/messages.md, "Run requests"): how long a backend waits for its answer, and
how many requests one worker process answers per second.

One worker (``--concurrency`` runs in flight), the example MCP server over HTTP, on loopback under a namespace
of its own (bench/_harness.py). Phases:

1. latency: ``--latency`` requests one at a time, each awaited on RabbitMQ's direct reply-to; the time from
   the publish to the answer, p50/p99. The runs execute meanwhile, as they would in production.
2. throughput: ``--requests`` requests published at once (answers to one server-named queue); answers per
   second from the first publish to the last answer, then the time until every run is terminal.

    .venv/bin/python -m bench.run_requests [--latency 200] [--requests 1000] [--concurrency 8]
"""

from __future__ import annotations

import argparse
import json
import time
import uuid
from typing import Any

import pika

from bench._harness import (
    Bench,
    BenchError,
    all_terminal,
    machine,
    print_machine,
    quick_run_spec,
    summary_ms,
    wait_until,
)
from runbrake.shared.messaging.wire import Topology

ANSWER_TIMEOUT_S = 120.0


def latency(bench: Bench, server: Any, count: int) -> list[float]:
    """Seconds from each publish to its answer, one request at a time."""
    exchange = Topology.of(bench.settings).run_requests_exchange
    connection = pika.BlockingConnection(pika.URLParameters(bench.settings.rabbitmq_url))
    try:
        channel = connection.channel()
        answers: dict[str, float] = {}

        def on_answer(_channel: Any, _method: Any, properties: pika.BasicProperties, _body: bytes) -> None:
            answers[str(properties.correlation_id)] = time.perf_counter()

        channel.basic_consume("amq.rabbitmq.reply-to", on_answer, auto_ack=True)
        waits = []
        for index in range(count):
            correlation_id = uuid.uuid4().hex
            body = json.dumps(quick_run_spec(server, index).raw).encode()
            sent = time.perf_counter()
            channel.basic_publish(exchange, exchange, body, pika.BasicProperties(
                content_type="application/json", delivery_mode=2, reply_to="amq.rabbitmq.reply-to",
                correlation_id=correlation_id))
            deadline = sent + ANSWER_TIMEOUT_S
            while correlation_id not in answers:
                if time.perf_counter() > deadline:
                    raise BenchError(f"request {index} was not answered within {ANSWER_TIMEOUT_S:g} s")
                connection.process_data_events(time_limit=0.05)
            waits.append(answers[correlation_id] - sent)
        return waits
    finally:
        connection.close()


def throughput(bench: Bench, server: Any, count: int) -> tuple[float, list[str]]:
    """Requests published at once; returns the seconds until the last answer, and the run ids answered."""
    exchange = Topology.of(bench.settings).run_requests_exchange
    bodies = [json.dumps(quick_run_spec(server, 100_000 + index).raw).encode() for index in range(count)]
    connection = pika.BlockingConnection(pika.URLParameters(bench.settings.rabbitmq_url))
    try:
        channel = connection.channel()
        run_ids: list[str] = []

        def on_answer(_channel: Any, _method: Any, _properties: pika.BasicProperties, answer: bytes) -> None:
            run_ids.append(json.loads(answer)["run_id"])

        # Direct reply-to: the only reply_to a worker answers (docs/messages.md, "Run requests: trust").
        channel.basic_consume("amq.rabbitmq.reply-to", on_answer, auto_ack=True)
        started = time.perf_counter()
        for body in bodies:
            channel.basic_publish(exchange, exchange, body, pika.BasicProperties(
                content_type="application/json", delivery_mode=2, reply_to="amq.rabbitmq.reply-to"))
        deadline = started + ANSWER_TIMEOUT_S
        while len(run_ids) < count:
            if time.perf_counter() > deadline:
                raise BenchError(f"only {len(run_ids)} of {count} requests answered")
            connection.process_data_events(time_limit=0.05)
        return time.perf_counter() - started, run_ids
    finally:
        connection.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--latency", type=int, default=200, help="requests awaited one at a time")
    parser.add_argument("--requests", type=int, default=1000, help="requests published at once")
    parser.add_argument("--concurrency", type=int, default=8, help="the worker's runs in flight")
    args = parser.parse_args()
    info = machine()
    print_machine(info)
    with Bench("run_requests") as bench:
        server = bench.start_toolbox()
        bench.start_worker(concurrency=args.concurrency)
        waits = latency(bench, server, args.latency)
        answered_s, run_ids = throughput(bench, server, args.requests)
        finished = time.perf_counter()
        wait_until(all_terminal(bench.store, run_ids), timeout=600, what="every run terminal", interval=0.2)
        results = {
            "machine": info,
            "latency_ms": summary_ms(waits),
            "throughput": {"requests": args.requests, "answered_s": round(answered_s, 3),
                           "answers_per_s": round(args.requests / answered_s, 1),
                           "runs_terminal_after_s": round(time.perf_counter() - finished + answered_s, 3)},
            "concurrency": args.concurrency,
        }
        path = bench.write_results(results)
    print(json.dumps({k: v for k, v in results.items() if k != "machine"}, indent=2))
    print(f"results: {path}")


if __name__ == "__main__":
    main()
