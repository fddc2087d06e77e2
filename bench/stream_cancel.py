"""Cancel latency of a model call: with ``--runs`` runs streaming their answers at once, against the same runs
waiting on a whole answer (a catalog model's ``stream = false``), from the cancel call to the cancelled model
step persisted (docs/benchmarks.md, "Cancel latency while streaming").

Run from the repository root::

    .venv/bin/python -m bench.stream_cancel [--runs 50] [--cancels 50] [--modes stream,whole]

What it does, in its own namespace (``bench-<hex>``), on loopback only:

1. serves ``llm-mock-api`` in a process of its own (counting in Redis the requests it began): streamed,
   each answer is 2,000 chunks of 5 characters 100 ms apart (some 200 s: a run is always mid-stream when it
   is cancelled); whole, the answer comes after 600 s (the request is in flight, nothing streams);
2. per mode, a fresh worker (``--concurrency`` = ``--runs`` + 8) and ``--runs`` runs whose one model call is
   in flight (the endpoint has seen every request); then ``--cancels`` cancels, one at a time, each of the
   oldest run: t0 = ``time.time()`` right before ``cancel_run`` (fence + cancel message), measured until the
   run's model step (interrupted, ``cancelled``) is in the store, its ``recorded_at``; after each, a new run
   is started and awaited in its model call, so every cancel finds ``--runs`` calls in flight;
3. prints p50/p99 per mode, the worker's CPU seconds per second while the cancels ran, and the difference of
   the p99s (the aim: within 2 ms), and writes
   ``bench/results/stream_cancel.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

import httpx2
import redis
from llm_mock_api import MockServer, MockServerOptions
from llm_mock_api.types.reply import ReplyObject, ReplyOptions
from llm_mock_api.types.request import MockRequest

from bench._harness import Bench, BenchError, cpu_seconds, free_port, machine, print_machine, summary_ms, wait_until
from runbrake.shared.logging import configure_logging
from runbrake.shared.messaging.cancel import CancelPublisher, cancel_run
from runbrake.shared.messaging.producer import Producer
from runbrake.shared.messaging.rabbitmq import build_broker
from runbrake.shared.settings import Settings
from runbrake.shared.spec import RunSpec
from runbrake.shared.steps import RunStep, StepKind

AIM_P99_DIFFERENCE_MS = 2.0
CHUNKS, CHUNK_CHARS, CHUNK_MS = 2000, 5, 100
WHOLE_AFTER_S = 600.0
WAIT_S = 120.0


class Endpoint:
    """llm-mock-api in a process of its own (``python -m bench.stream_cancel --serve PORT KEY``): streaming
    50 answers must not take the GIL from the cancels this process times. It counts the requests it began to
    answer in the Redis key ``KEY``."""

    def __init__(self, bench: Bench) -> None:
        port = free_port()
        self.key = f"{bench.namespace}:bench-asked"
        self._redis = bench.store.redis
        self.process = subprocess.Popen(
            [sys.executable, "-m", "bench.stream_cancel", "--serve", str(port), self.key],
            env=bench.env, stdout=subprocess.DEVNULL, stderr=(bench.workdir / "endpoint.log").open("wb"))
        bench.on_close(self.close)
        self.url = f"http://127.0.0.1:{port}"
        wait_until(lambda: _answers(self.url), timeout=30, what="llm-mock-api to listen")

    @property
    def asked(self) -> int:
        return int(self._redis.get(self.key) or 0)

    def close(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=10)


def _answers(url: str) -> bool:
    try:
        httpx2.get(url, timeout=1)
    except httpx2.HTTPError:
        return False
    return True


def serve(port: int, key: str) -> None:
    """The endpoint's process: streamed, 2,000 chunks 100 ms apart; whole, the answer after 600 s."""
    counter = redis.Redis.from_url(Settings.from_env().redis_url)

    async def answer(request: MockRequest) -> ReplyObject:
        counter.incr(key)
        if not request.streaming:
            await asyncio.sleep(WHOLE_AFTER_S)  # a whole answer that takes its time: the call is in flight
        return ReplyObject(text="words" * CHUNKS)

    async def main() -> None:
        server = MockServer(MockServerOptions(host="127.0.0.1", port=port, default_latency=0, default_chunk_size=0))
        server.when("bench").reply(answer, ReplyOptions(latency=CHUNK_MS, chunk_size=CHUNK_CHARS))
        await server.start()
        await asyncio.Event().wait()  # until the benchmark terminates the process

    asyncio.run(main())


def model_step(bench: Bench, run_id: str) -> RunStep | None:
    return next((s for s in bench.store.get(run_id).steps if s.kind is StepKind.MODEL), None)


def measure(bench: Bench, endpoint: Endpoint, mode: str, runs: int, cancels: int) -> dict[str, Any]:
    bench.catalog.write_text(
        f'[models.{mode}]\nprovider = "openai"\nbase_url = "{endpoint.url}/v1"\nmodel = "m"\n'
        f"stream = {'true' if mode == 'stream' else 'false'}\n", encoding="utf-8")
    broker = build_broker(bench.settings)
    producer = Producer(bench.store, broker, bench.admission())
    publisher = CancelPublisher(bench.settings)
    worker = bench.start_worker(concurrency=runs + 8)
    spec = RunSpec.parse({"input": "bench", "model": mode})
    in_flight: list[str] = []
    samples: list[float] = []
    try:
        def start_one() -> None:
            asked = endpoint.asked
            in_flight.append(producer.enqueue(spec).run_id)
            wait_until(lambda: endpoint.asked > asked, timeout=WAIT_S, what="the model call to reach the endpoint")

        for _ in range(runs):
            start_one()
        cpu_before, wall_before = cpu_seconds(worker.pid), time.monotonic()
        for _ in range(cancels):
            run_id = in_flight.pop(0)
            t0 = time.time()
            if not cancel_run(bench.store, publisher, run_id, reason="benchmark", requested_by="bench").won:
                raise BenchError(f"the cancel of run {run_id} did not win the fence")
            step = wait_until(functools.partial(model_step, bench, run_id), timeout=WAIT_S,
                              what=f"the model step of run {run_id}")
            if not step.interrupted:
                raise BenchError(f"run {run_id}'s model step was not interrupted")
            if mode == "stream" and not step.content:
                raise BenchError(f"run {run_id} was cancelled before it streamed any text")
            samples.append(step.recorded_at - t0)
            start_one()
        cpu_after, wall = cpu_seconds(worker.pid), time.monotonic() - wall_before
        for run_id in in_flight:
            cancel_run(bench.store, publisher, run_id, reason="benchmark done", requested_by="bench")
    finally:
        publisher.close()
        broker.close()
        worker.process.stop()
    # How busy the worker was meanwhile: with 50 answers streaming, it reads their chunks and publishes deltas.
    busy = None if cpu_before is None or cpu_after is None else round((cpu_after - cpu_before) / wall, 3)
    return {"runs_in_flight": runs, "worker_cpu_s_per_s": busy, **summary_ms(samples),
            "samples_s": [round(s, 6) for s in samples]}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.stream_cancel", description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=50, help="model calls in flight at every cancel (default 50)")
    parser.add_argument("--cancels", type=int, default=50, help="cancels measured per mode (default 50)")
    parser.add_argument("--modes", default="stream,whole", help="stream and/or whole (default both)")
    parser.add_argument("--serve", nargs=2, metavar=("PORT", "KEY"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        serve(int(args.serve[0]), args.serve[1])
        return 0
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or set(modes) - {"stream", "whole"} or min(args.runs, args.cancels) < 1:
        parser.error("--modes takes stream and/or whole; --runs and --cancels must be at least 1")
    configure_logging("WARNING")
    info = machine()
    results: dict[str, Any] = {"benchmark": "stream_cancel", "machine": info,
                               "command": " ".join(["python -m bench.stream_cancel",
                                                    *(argv if argv is not None else sys.argv[1:])]),
                               "modes": {}}
    with Bench("stream_cancel") as bench:
        endpoint = Endpoint(bench)
        for mode in modes:
            print(f"{mode}: {args.runs} runs in their model call, {args.cancels} cancels…", flush=True)
            results["modes"][mode] = measure(bench, endpoint, mode, args.runs, args.cancels)
        if set(modes) == {"stream", "whole"}:
            difference = results["modes"]["stream"]["p99"] - results["modes"]["whole"]["p99"]
            results["p99_difference_ms"] = round(difference, 2)
            results["aim_met"] = difference <= AIM_P99_DIFFERENCE_MS
        path = bench.write_results(results)
    print_machine(info)
    print(f"{'mode':8} {'n':>4} {'p50 ms':>8} {'p95 ms':>8} {'p99 ms':>8} {'max ms':>8} {'worker cpu':>10}")
    for mode, figures in results["modes"].items():
        print(f"{mode:8} {figures['n']:>4} {figures['p50']:>8} {figures['p95']:>8} {figures['p99']:>8} "
              f"{figures['max']:>8} {figures['worker_cpu_s_per_s']!s:>10}")
    if "p99_difference_ms" in results:
        print(f"p99 stream - whole: {results['p99_difference_ms']} ms (aim: within {AIM_P99_DIFFERENCE_MS} ms)")
    print(f"written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
