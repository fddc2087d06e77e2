"""Tracing's cost: a worker's CPU per run with ``RUNBRAKE_OTEL`` off and on, in alternating rounds, one run at a time.

Run from the repository root::

    .venv/bin/python -m bench.tracing [--runs 100] [--rounds 3] [--warmup 10]

What it does, in its own namespace (``bench-<hex>``), on loopback only:

1. starts the example toolbox MCP server over HTTP and an OTLP/HTTP receiver in this process (it answers every
   ``POST /v1/traces`` and counts the spans, decoded with ``opentelemetry-proto``);
2. alternates rounds, off first: per round it starts a worker (``python -m runbrake.worker --concurrency 8``;
   on: ``RUNBRAKE_OTEL=true``, ``OTEL_EXPORTER_OTLP_ENDPOINT`` the receiver, the SDK's default batching), warms it
   up with ``--warmup`` runs (not counted), then runs ``--runs`` runs **one at a time** (each enqueued once the
   last one completed: what one run costs, not a backlog's throughput), each a scripted model with two quick
   MCP calls (get-sum, echo, then the answer: 3 model calls, 2 tool calls, so 6 runbrake spans and the MCP SDK's
   client spans), enqueued through :class:`Producer` with tracing on or off in this process too;
3. per round: the worker's CPU time (``/proc/<pid>/stat`` utime + stime) from just before the first counted
   enqueue to the last completion, over the runs; this process's CPU for the enqueues (thread time); and
   correctness: every run ``completed``, and with tracing on, spans received for every run;
4. prints a table, the medians per side and the ratio on/off of the worker's CPU per run, with the machine's
   load average, writes ``bench/results/tracing.json``, and cleans up.

Before the rounds, it measures tracing's own CPU per run alone (:func:`isolated_cost`: the same spans through
the same code, without the services), which a busy machine does not blur the way it blurs two rounds' totals;
it prints that as a share of a run's CPU (worker + enqueue) with tracing off.

The worker's own periodic parts (the cancel backstop, the lease keeper) run in both sides alike and are counted
in both: the figure is what a run costs a worker that does nothing else.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, cast

from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

from bench._harness import (
    Bench,
    BenchError,
    background_load,
    cpu_seconds,
    quick_run_spec,
    wait_until,
)
from runbrake.shared import tracing
from runbrake.shared._otel import OtelTracing
from runbrake.shared.catalog import AdmittedRun
from runbrake.shared.messaging.producer import Producer
from runbrake.shared.messaging.rabbitmq import build_broker
from runbrake.shared.spec import ScriptedModel, ScriptedTurn
from runbrake.shared.status import RunStatus, TerminationReason
from runbrake.shared.steps import RunStep, StepKind
from runbrake.shared.tool_result import ToolResult
from runbrake.worker.conversation import ToolCall
from runbrake.worker.tracing import TracingSubscriber
from tests.otlp_receiver import Receiver


@contextmanager
def traced_producer(on: bool, endpoint: str) -> Iterator[TracerProvider | None]:
    """This process's tracing for the round: on, a provider of its own exporting to the receiver."""
    if not on:
        yield None
        return
    provider = TracerProvider(resource=Resource.create({"service.name": "bench-producer"}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=f"{endpoint}/v1/traces")))
    previous = tracing._current
    tracing._current = OtelTracing(provider)
    try:
        yield provider
    finally:
        tracing._current = previous
        provider.shutdown()


def one_round(bench: Bench, server: Any, receiver: Receiver, *, on: bool, runs: int, warmup: int,
              index: int) -> dict[str, Any]:
    side = {"RUNBRAKE_OTEL": "true", "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint} if on else {
        "RUNBRAKE_OTEL": "false"}
    bench.env.update(side)
    worker = bench.start_worker(concurrency=8)
    broker = build_broker(bench.settings)
    producer = Producer(bench.store, broker, bench.admission())
    try:
        with traced_producer(on, receiver.endpoint) as provider:

            def run(i: int) -> tuple[str, float]:
                started = time.thread_time()
                run_id = producer.enqueue(quick_run_spec(server, i)).run_id
                enqueue_cpu = time.thread_time() - started
                wait_until(lambda: bench.store.status(run_id).is_terminal, timeout=60, what=f"run {run_id}",
                           interval=0.002, alive=[worker.process])
                return run_id, enqueue_cpu

            for i in range(warmup):
                run(index * 100_000 + i)
            spans_before = receiver.count()
            cpu_before = cpu_seconds(worker.pid) or 0.0
            wall_before = time.monotonic()
            done = [run(index * 100_000 + warmup + i) for i in range(runs)]
            wall = time.monotonic() - wall_before
            cpu = (cpu_seconds(worker.pid) or 0.0) - cpu_before
            if provider is not None:
                provider.force_flush()
        statuses = [bench.store.status(run_id) for run_id, _ in done]
        if any(status is not RunStatus.COMPLETED for status in statuses):
            raise BenchError(f"not every run completed: {sorted({s.value for s in statuses})}")
        worker.process.stop()  # flushes the worker's spans at exit
        spans = receiver.count() - spans_before
        if on and spans < runs * 6:
            raise BenchError(f"tracing on, but only {spans} spans arrived for {runs} runs")
        return {
            "side": "on" if on else "off", "runs": runs, "wall_s": round(wall, 3),
            "worker_cpu_ms_per_run": round(1000 * cpu / runs, 3),
            "enqueue_cpu_ms_per_run": round(1000 * statistics.fmean(c for _, c in done), 3),
            "spans_received": spans,
        }
    finally:
        broker.close()
        if worker.process.popen.poll() is None:
            worker.process.stop()


class _Encoding(SpanExporter):
    """What the OTLP/HTTP exporter does to a batch but the POST: encode it to protobuf bytes."""

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        encode_spans(spans).SerializeToString()
        return SpanExportResult.SUCCESS


def isolated_cost(runs: int) -> float:
    """What tracing adds to one run, measured alone (no I/O, so no noise from the services): CPU ms per run of
    the spans a traced run makes, through the code the worker and the producer run: the enqueue span and its
    ``traceparent``, the segment span continuing it, the subscriber's hooks for 3 model steps and 2 tool calls,
    a ``traceparent`` for each of the run's 8 MCP HTTP requests, and the batch processor encoding it all."""
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(_Encoding()))
    traced = OtelTracing(provider)
    subscriber = TracingSubscriber(cast(Any, None), traced.tracer("runbrake.worker"))
    admitted = AdmittedRun(spec=quick_run_spec("http://127.0.0.1:1/mcp", 0), servers={},
                           model=ScriptedModel(turns=(ScriptedTurn(content="done"),)))
    calls = [ToolCall(id="c1", server="toolbox", tool="get-sum"), ToolCall(id="c2", server="toolbox", tool="echo")]

    async def one_run() -> None:
        with traced.span("runbrake.enqueue", kind="producer") as span:
            span.set({"runbrake.run_id": "a" * 32, "runbrake.run.created": True})
            parent = traced.traceparent()
        with traced.span("runbrake.run.segment", {"runbrake.run_id": "a" * 32, "runbrake.segment": "start"},
                         parent=parent, kind="consumer") as segment:
            subscriber.after_admit("a" * 32, admitted)
            for _ in range(3):  # connect: initialize, initialized, tools/list
                traced.traceparent()
            now = time.time()
            for index, call in enumerate(calls):
                model = RunStep(kind=StepKind.MODEL, round=index + 1, sequence=2 * index + 1, duration_ms=1,
                                recorded_at=now)
                await subscriber.after_step("a" * 32, model)
                subscriber.before_tool_call("a" * 32, call)
                for _ in range(2):  # the call's POST and its answer's stream
                    traced.traceparent()
                await subscriber.after_tool_call("a" * 32, call)
                step = RunStep.tool(round=index + 1, server=call.server, name=call.tool, result=ToolResult.ok("3"),
                                    call_id=call.id, recorded_at=now)
                await subscriber.after_step("a" * 32, replace(step, sequence=2 * index + 2))
            await subscriber.after_step("a" * 32, RunStep(kind=StepKind.MODEL, round=3, sequence=5, duration_ms=1,
                                                          recorded_at=now))
            subscriber.after_settle("a" * 32, RunStatus.COMPLETED, TerminationReason.COMPLETED)
            segment.set({"runbrake.segment.outcome": "completed"})

    async def all_runs() -> float:
        for _ in range(50):
            await one_run()
        provider.force_flush()
        started = time.process_time()  # the processor's thread included: it encodes in this process
        for _ in range(runs):
            await one_run()
        provider.force_flush()
        return (time.process_time() - started) / runs * 1000

    try:
        return asyncio.run(all_runs())
    finally:
        provider.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=100, help="counted runs per round (default 100)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per side, alternating (default 3)")
    parser.add_argument("--warmup", type=int, default=10, help="runs per round before counting (default 10)")
    args = parser.parse_args()
    load = background_load()
    print(f"machine before: {load}, {os.cpu_count()} CPUs")
    isolated = [isolated_cost(2000) for _ in range(3)]
    print(f"tracing's own CPU per run, alone: {', '.join(f'{v:.3f}' for v in isolated)} ms", flush=True)
    receiver = Receiver()
    rounds: list[dict[str, Any]] = []
    try:
        with Bench("tracing") as bench:
            server = bench.start_toolbox()
            for index in range(args.rounds * 2):
                result = one_round(bench, server, receiver, on=index % 2 == 1, runs=args.runs, warmup=args.warmup,
                                   index=index)
                rounds.append(result)
                print(f"round {index + 1}: tracing {result['side']:>3}: worker {result['worker_cpu_ms_per_run']:7.3f} "
                      f"ms CPU/run, enqueue {result['enqueue_cpu_ms_per_run']:6.3f} ms CPU/run, "
                      f"{result['wall_s']:6.2f} s, {result['spans_received']} spans", flush=True)
            median = {side: {key: statistics.median(r[key] for r in rounds if r["side"] == side)
                             for key in ("worker_cpu_ms_per_run", "enqueue_cpu_ms_per_run")}
                      for side in ("off", "on")}
            ratio = median["on"]["worker_cpu_ms_per_run"] / median["off"]["worker_cpu_ms_per_run"]
            enqueue_ratio = median["on"]["enqueue_cpu_ms_per_run"] / median["off"]["enqueue_cpu_ms_per_run"]
            after = os.getloadavg()
            alone = statistics.median(isolated)
            off_total = median["off"]["worker_cpu_ms_per_run"] + median["off"]["enqueue_cpu_ms_per_run"]
            print(f"tracing alone: {alone:.3f} ms CPU per run = {100 * alone / off_total:.1f} % of a run's "
                  f"{off_total:.3f} ms (worker + enqueue, off)")
            print(f"median worker CPU per run: off {median['off']['worker_cpu_ms_per_run']:.3f} ms, "
                  f"on {median['on']['worker_cpu_ms_per_run']:.3f} ms: on/off {ratio:.3f} "
                  f"({100 * (ratio - 1):+.1f} %)")
            print(f"median enqueue CPU per run: off {median['off']['enqueue_cpu_ms_per_run']:.3f} ms, "
                  f"on {median['on']['enqueue_cpu_ms_per_run']:.3f} ms: on/off {enqueue_ratio:.3f}")
            print(f"load average after: {after[0]:.2f} {after[1]:.2f} {after[2]:.2f}")
            path = bench.write_results({
                "machine_before": load, "loadavg_after": [round(v, 2) for v in after], "cpus": os.cpu_count(),
                "runs_per_round": args.runs, "rounds_per_side": args.rounds, "rounds": rounds, "median": median,
                "worker_cpu_on_over_off": round(ratio, 4), "enqueue_cpu_on_over_off": round(enqueue_ratio, 4),
                "tracing_alone_cpu_ms_per_run": [round(v, 4) for v in isolated],
                "tracing_alone_share_of_run": round(alone / off_total, 4),
            })
            print(f"wrote {path}")
    finally:
        receiver.close()


if __name__ == "__main__":
    main()
