"""Notifications: what each MCP progress notification costs one process's event loop, and how late it makes
a 10 ms timer.

Run from the repository root::

    .venv/bin/python -m bench.notifications [--calls 200,1000] [--rates 1,10] [--variants sdk,inline,uvloop]
        [--rounds 3] [--window-s 10] [--servers 2]

A short sanity run: ``--calls 20 --rates 1 --rounds 1 --window-s 3``.

What it does, on loopback only:

1. starts ``--servers`` example toolbox MCP servers over HTTP per rate, whose ``slow`` tool reports MCP
   progress ``rate`` times a second (``--progress-s 1/rate``);
2. per round, per calls × rate, per variant, in that order and alternating (so a change of the machine's
   load falls on every variant alike): a fresh child process (``--child``) with one asyncio event loop
   (as a worker's, ``worker/intake.py``'s ``tune_gc`` applied) opens ``calls`` MCP connections through the
   worker's own transport edge (``worker/mcp_transport.py``, ``McpConnection``), spread over the servers,
   and calls ``slow`` on each with a progress callback that counts. Once every call has reported, it
   measures over ``--window-s``: the loop thread's CPU time (``time.thread_time``) over the
   notifications received (**µs of loop CPU per notification**; the loop is the only busy thread) and the
   loop's busy share (that CPU over the window); then, over a second window, the lateness of a 10 ms
   ``asyncio.sleep`` timer (**loop lag**, p50/p99/max); then cancels every call and closes;
3. prints the table (medians over the rounds, and each variant's ratio to ``sdk`` per round), and writes
   ``bench/results/notifications.json``, the load average recorded with each measurement.

Variants: ``sdk`` — the MCP SDK handles each notification (its dispatcher spawns a task for the callback
and one for its own notification handler); ``inline`` — the worker's adapter at the transport boundary
handles the progress of its own calls inline (``worker/mcp_progress.py``); ``uvloop`` / ``inline+uvloop`` —
the same on uvloop's loop (uvloop must be installed: ``pip install -e ".[bench]"``); ``off`` — no progress
asked for (``RUNBRAKE_MCP_PROGRESS=off``): what the same calls cost the loop when the servers send nothing.
``--profile DIR`` records each child's measured CPU window with py-spy (``--native``, raw collapsed stacks;
py-spy must be installed and allowed to trace the child) into ``DIR/<variant>-<calls>x<rate>.txt``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio

from bench._harness import Bench, percentile
from bench._profile import py_spy

VARIANTS = ("sdk", "inline", "uvloop", "inline+uvloop", "off")
LAG_TIMER_S = 0.01
START_TIMEOUT_S = 600.0
SLOW_CALL_S = 3600.0


# -- the child: one event loop, N talking calls -------------------------------------------------------------


async def _measure(urls: list[str], calls: int, window_s: float, variant: str) -> dict[str, Any]:
    from mcp import Client

    from runbrake.shared.spec import HttpServerSpec
    from runbrake.worker.mcp_transport import McpConnection, http_target

    asks = variant != "off"
    received = 0
    reported: set[int] = set()
    everyone_reported = anyio.Event()
    opened: set[int] = set()
    everyone_opened = anyio.Event()
    interrupts = [anyio.CancelScope() for _ in range(calls)]
    connect_slots = anyio.Semaphore(64)

    def counter(index: int) -> Any:
        async def report(progress: float, total: float | None, message: str | None) -> None:
            nonlocal received
            received += 1
            if index not in reported:
                reported.add(index)
                if len(reported) == calls:
                    everyone_reported.set()
        return report

    failed: list[str] = []

    async def one_call(index: int) -> None:
        try:
            await call_once(index)
        except Exception as exc:  # a failed call is counted and reported, the others go on
            failed.append(repr(exc)[:300])
            reported.add(index)
            if len(reported) == calls:
                everyone_reported.set()
            opened_one(index)

    async def call_once(index: int) -> None:
        spec = HttpServerSpec(name=f"toolbox-{index % len(urls)}", url=urls[index % len(urls)])
        callback = counter(index) if asks else None
        if variant.startswith("sdk") or variant == "uvloop":
            await sdk_call(spec, index, callback)
            return
        async with connect_slots:
            connection_cm = McpConnection.open(spec, connect_timeout_s=60)
            connection = await connection_cm.__aenter__()
        try:
            opened_one(index)
            await connection.call("slow", {"seconds": SLOW_CALL_S}, timeout_s=SLOW_CALL_S + 60,
                                  interrupt=interrupts[index], progress=callback)
        finally:
            await connection_cm.__aexit__(None, None, None)

    async def sdk_call(spec: HttpServerSpec, index: int, callback: Any) -> None:
        # The SDK handling every notification, over the worker's shared HTTP client: what the worker did
        # before worker/mcp_progress.py.
        async with connect_slots:
            client_cm = Client(http_target(spec))
            client = await client_cm.__aenter__()
        try:
            opened_one(index)
            with interrupts[index]:
                await client.call_tool("slow", {"seconds": SLOW_CALL_S}, progress_callback=callback)
        finally:
            await client_cm.__aexit__(None, None, None)

    def opened_one(index: int) -> None:
        opened.add(index)
        if len(opened) == calls:
            everyone_opened.set()

    lateness: list[float] = []

    async def lag_timer() -> None:
        loop = asyncio.get_running_loop()
        while True:
            before = loop.time()
            await asyncio.sleep(LAG_TIMER_S)
            lateness.append(loop.time() - before - LAG_TIMER_S)

    async with anyio.create_task_group() as group:
        for index in range(calls):
            group.start_soon(one_call, index)
        with anyio.fail_after(START_TIMEOUT_S):
            await everyone_opened.wait()
            if asks:
                await everyone_reported.wait()
        await anyio.sleep(2.0)  # every call past its first report, the connects' garbage settled
        # First the loop's CPU, with nothing else on it; then, in a window of its own, the timer's lateness
        # (its 100 wake-ups a second would otherwise count as the notifications' CPU).
        print("window", flush=True)  # the parent's cue for --profile
        cpu_before, wall_before, count_before = time.thread_time(), time.monotonic(), received
        await anyio.sleep(window_s)
        cpu, wall, count = time.thread_time() - cpu_before, time.monotonic() - wall_before, received - count_before
        group.start_soon(lag_timer)
        await anyio.sleep(0.5)
        lateness.clear()
        await anyio.sleep(window_s)
        samples = sorted(lateness)
        for interrupt in interrupts:
            interrupt.cancel()
        group.cancel_scope.cancel()
    return {
        "variant": variant, "calls": calls, "window_s": round(wall, 3), "notifications": count,
        "notifications_per_s": round(count / wall, 1),
        "loop_cpu_us_per_notification": round(cpu / count * 1e6, 1) if count else None,
        "loop_busy": round(cpu / wall, 3),
        "lag_ms_p50": round(percentile(samples, 50) * 1e3, 2), "lag_ms_p99": round(percentile(samples, 99) * 1e3, 2),
        "lag_ms_max": round(samples[-1] * 1e3, 2), "lag_samples": len(samples),
        "rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
        "failed_calls": len(failed), "failures": sorted(set(failed))[:3],
    }


def child(arguments: dict[str, Any]) -> None:
    from runbrake.worker.intake import tune_gc

    variant: str = arguments["variant"]
    if variant.endswith("uvloop"):
        import uvloop

        loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    else:
        loop = asyncio.new_event_loop()
    tune_gc()
    try:
        result = loop.run_until_complete(
            _measure(arguments["urls"], arguments["calls"], arguments["window_s"], variant))
    finally:
        loop.close()
    print(json.dumps(result))


# -- the parent: servers, rounds, table ---------------------------------------------------------------------


def _run_child(arguments: dict[str, Any], profile: Path | None) -> dict[str, Any]:
    command = [sys.executable, "-m", "bench.notifications", "--child", json.dumps(arguments)]
    load = os.getloadavg()
    spy: subprocess.Popen[bytes] | None = None
    lines: list[str] = []
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as child_process:
        assert child_process.stdout is not None
        for line in child_process.stdout:
            if line.startswith("window") and profile is not None:
                # Only the measured window: the child's start (imports, connects) would drown it.
                name = f"{arguments['variant']}-{arguments['calls']}x{arguments['rate']:g}.txt"
                spy = subprocess.Popen([str(py_spy()), "record", "--native", "--format", "raw", "--rate", "250",
                                        "--duration", f"{arguments['window_s']:g}", "--output", str(profile / name),
                                        "--pid", str(child_process.pid)],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            lines.append(line)
        stderr = child_process.stderr.read() if child_process.stderr is not None else ""
        code = child_process.wait(timeout=START_TIMEOUT_S + 600)
    if spy is not None:
        spy.wait(timeout=60)
    results = [line for line in lines if line.startswith("{")]
    if code != 0 or not results:
        raise SystemExit(f"child {arguments['variant']} failed ({code}):\n{stderr[-3000:]}")
    result: dict[str, Any] = json.loads(results[-1])
    result |= {"rate": arguments["rate"], "loadavg_1m_before": round(load[0], 2)}
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--calls", default="200,1000", help="calls in flight in the one process, comma-separated")
    parser.add_argument("--rates", default="1,10", help="progress notifications per call per second, comma-separated")
    parser.add_argument("--variants", default="sdk,inline", help=f"comma-separated, of {', '.join(VARIANTS)}")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (3)")
    parser.add_argument("--window-s", type=float, default=10.0, help="measured window per child, seconds (10)")
    parser.add_argument("--servers", type=int, default=2, help="toolbox server processes per rate (2)")
    parser.add_argument("--profile", type=Path, metavar="DIR", help="record every child with py-spy into DIR")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(json.loads(args.child))
        return 0
    variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        parser.error(f"--variants: unknown {', '.join(unknown)} (one of {', '.join(VARIANTS)})")
    if any(v.endswith("uvloop") for v in variants):
        try:
            import uvloop  # noqa: F401 - only to say it is missing
        except ImportError:
            print("skipping the uvloop variants: uvloop is not installed (pip install -e '.[bench]')")
            variants = [v for v in variants if not v.endswith("uvloop")]
    if args.profile is not None:
        if py_spy() is None:
            parser.error("--profile: py-spy is not installed (pip install -e '.[bench]')")
        args.profile.mkdir(parents=True, exist_ok=True)
    calls = [int(c) for c in args.calls.split(",")]
    rates = [float(r) for r in args.rates.split(",")]
    results: list[dict[str, Any]] = []
    with Bench("notifications") as bench:
        urls = {rate: [bench.start_toolbox("--progress-s", f"{1 / rate:g}").url for _ in range(args.servers)]
                for rate in rates}
        for round_index in range(args.rounds):
            for count in calls:
                for rate in rates:
                    for variant in variants:
                        result = _run_child({"urls": urls[rate], "calls": count, "rate": rate, "variant": variant,
                                             "window_s": args.window_s}, args.profile)
                        result["round"] = round_index
                        results.append(result)
                        print(json.dumps(result), flush=True)
        bench_path = bench.write_results({"runs": results, "arguments": vars(args) | {"profile": str(args.profile)}})
    print_table(results)
    print(f"results: {bench_path}")
    return 0


def print_table(results: Sequence[dict[str, Any]]) -> None:
    print(f"\n{'calls × rate/s':>15} {'variant':>14} {'notif/s':>8} {'µs/notif':>9} {'busy':>6} "
          f"{'lag p50/p99/max ms':>20} {'µs ratio to sdk':>16}")
    keys = sorted({(r["calls"], r["rate"]) for r in results})
    for calls, rate in keys:
        rows = [r for r in results if (r["calls"], r["rate"]) == (calls, rate)]
        for variant in dict.fromkeys(r["variant"] for r in rows):
            mine = [r for r in rows if r["variant"] == variant]
            ratios = [
                m["loop_cpu_us_per_notification"] / s["loop_cpu_us_per_notification"]
                for m in mine for s in rows
                if s["variant"] == "sdk" and s["round"] == m["round"]
                and m["loop_cpu_us_per_notification"] and s["loop_cpu_us_per_notification"]
            ]
            us = [m["loop_cpu_us_per_notification"] for m in mine if m["loop_cpu_us_per_notification"]]
            print(f"{calls:>7} × {rate:<5g} {variant:>14} "
                  f"{statistics.median(m['notifications_per_s'] for m in mine):>8.0f} "
                  f"{(statistics.median(us) if us else float('nan')):>9.1f} "
                  f"{statistics.median(m['loop_busy'] for m in mine):>6.2f} "
                  f"{statistics.median(m['lag_ms_p50'] for m in mine):>6.2f}/"
                  f"{statistics.median(m['lag_ms_p99'] for m in mine):.2f}/"
                  f"{max(m['lag_ms_max'] for m in mine):.1f} "
                  f"{', '.join(f'{x:.2f}' for x in ratios):>16}")


if __name__ == "__main__":
    sys.exit(main())
