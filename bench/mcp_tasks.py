"""MCP tasks (issue 31; docs/usage.md, "Long tool calls as MCP tasks"): how fast a cancel reaches a task, beside
today's cancel of a plain call, and what polling costs per task in flight, in both revisions.

Run from the repository root::

    .venv/bin/python -m bench.mcp_tasks [--rounds 30] [--in-flight 100 1000] [--servers everything extension]

In one process, as a worker's event loop holds them, over streamable HTTP on loopback (one MCP connection, as one
segment has per server), against the npm ``server-everything`` (2025-11-25 tasks, ``everything``) and against
tests/tasks_extension_server.py (the 2026-07-28 tasks extension on PyPI ``fastmcp-tasks``, ``extension``):

1. cancel, ``--rounds`` times each: a task (``simulate-research-query``; ``research``) (worker/mcp_tasks.py),
   interrupted once its task id is recorded; measured from the interrupt to the call's result, which comes once the
   server answered ``tasks/cancel`` (2025-11-25: its task ``cancelled``) or, on the extension, once the
   ``tasks/get`` after the acknowledged cancel said ``cancelled``. Beside it, on server-everything, a plain call of
   ``trigger-long-running-operation`` (worker/mcp_tool.py), interrupted at its first progress notification;
   measured from the interrupt to its ``cancelled`` result (the SDK sends ``notifications/cancelled`` and does not
   wait);
2. polling: ``--in-flight`` tasks started at once (each lasts ~4 s on the server, polled every ``pollInterval`` =
   1 s on server-everything, ``pollIntervalMs`` = 200 on the extension server), waited for to the end: requests to
   the server per second (``tools/call``, ``tasks/get``, and ``tasks/result`` on 2025-11-25) and this process's CPU
   (user + system) per second and per task.

The run's record is kept in memory here (the worker writes it to Redis: one owner-guarded HSET per task, not per
poll). Prints the figures, writes ``bench/results/mcp_tasks.json``.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from typing import Any

import anyio

from bench._harness import Bench, machine, print_machine, summary_ms
from runbrake.shared.logging import configure_logging
from runbrake.shared.spec import HttpServerSpec, OnWorkerLost
from runbrake.shared.tool_result import ToolResult
from runbrake.worker import mcp_tasks, mcp_tool
from runbrake.worker.conversation import ToolCall
from runbrake.worker.mcp_transport import McpConnection

RESEARCH = "simulate-research-query"


class _Records:
    """The run's record of its tasks, in memory; ``recorded`` is set when a task is."""

    def __init__(self) -> None:
        self.tasks: dict[str, str | None] = {}
        self.recorded: dict[str, anyio.Event] = {}
        self.leaves_tasks_running = False
        self.last_recorded = 0.0
        """When the last task was recorded (``time.perf_counter``)."""

    def event(self, call_id: str) -> anyio.Event:
        return self.recorded.setdefault(call_id, anyio.Event())

    async def keep_task(self, call_id: str, task: str | None) -> None:
        self.tasks[call_id] = task
        if task is not None:
            self.last_recorded = time.perf_counter()
            self.event(call_id).set()

    async def task_of(self, call_id: str) -> str | None:
        return self.tasks.get(call_id)


def _call(index: int, tool: str, **arguments: Any) -> ToolCall:
    return ToolCall(id=f"bench_{tool}_{index}", server="everything", tool=tool, arguments=arguments)


async def _as_task(connection: McpConnection, call: ToolCall, records: _Records, interrupt: anyio.CancelScope,
                   results: list[ToolResult]) -> None:
    results.append(await mcp_tasks.call_as_task(
        connection, call, records, timeout_s=600, interrupt=interrupt, progress=None,
        lost=lambda _call: OnWorkerLost.REPORT, answer=mcp_tool.from_answer))


async def task_cancels(connection: McpConnection, rounds: int, tool: str, **arguments: Any) -> tuple[
        list[float], list[str]]:
    """Seconds from each interrupt of a task of ``tool`` to its result, and the statuses the server answered."""
    records = _Records()
    latencies: list[float] = []
    statuses: list[str] = []
    for i in range(rounds):
        call, interrupt = _call(i, tool, topic=f"bench {i}", **arguments), anyio.CancelScope()
        results: list[ToolResult] = []
        async with anyio.create_task_group() as group:
            group.start_soon(_as_task, connection, call, records, interrupt, results)
            await records.event(call.id).wait()
            started = time.perf_counter()
            interrupt.cancel()
        latencies.append(time.perf_counter() - started)
        statuses.append(results[0].task[1] if results[0].task else "none")
    return latencies, statuses


async def plain_cancels(connection: McpConnection, rounds: int) -> list[float]:
    """Seconds from each interrupt of a plain call (at its first progress) to its cancelled result."""
    latencies: list[float] = []
    for i in range(rounds):
        progressed, interrupt = anyio.Event(), anyio.CancelScope()

        async def on_progress(progress: float, total: float | None, message: str | None) -> None:
            progressed.set()  # noqa: B023 - awaited within this iteration

        async def plain(i: int = i, interrupt: anyio.CancelScope = interrupt) -> None:
            await mcp_tool.execute(connection, _call(i, "trigger-long-running-operation", duration=30, steps=30),
                                   timeout_s=60, interrupt=interrupt, max_chars=10_000, progress=on_progress)

        async with anyio.create_task_group() as group:
            group.start_soon(plain)
            await progressed.wait()
            started = time.perf_counter()
            interrupt.cancel()
        latencies.append(time.perf_counter() - started)
    return latencies


async def polling(connection: McpConnection, in_flight: int, tool: str, **arguments: Any) -> dict[str, Any]:
    """``in_flight`` tasks of ``tool`` started at once and waited for to the end: requests to the server per second
    (each task's ``tools/call``, its polls and, on 2025-11-25, its ``tasks/result``; ``tasks/get`` alone beside them)
    and this process's CPU per second over that time (every call's own requests and parsing included)."""
    records = _Records()
    polls = 0
    request = mcp_tasks.TaskRpc.request

    async def counted(self: mcp_tasks.TaskRpc, method: str, params: Any) -> dict[str, Any]:
        nonlocal polls
        polls += method == "tasks/get"
        return await request(self, method, params)

    mcp_tasks.TaskRpc.request = counted  # type: ignore[method-assign]
    results: list[ToolResult] = []
    cpu, wall = time.process_time(), time.perf_counter()
    try:
        async with anyio.create_task_group() as group:
            for i in range(in_flight):
                group.start_soon(_as_task, connection, _call(i, tool, **arguments), records, anyio.CancelScope(),
                                 results)
    finally:
        mcp_tasks.TaskRpc.request = request  # type: ignore[method-assign]
    recorded_s = records.last_recorded - wall
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    completed = sum(1 for r in results if r.task and r.task[1] == "completed")
    fetched = 0 if connection.offers_task_extension else completed  # the extension inlines the result
    requests = in_flight + polls + fetched
    return {"in_flight": in_flight, "seconds": round(wall, 2), "all_recorded_s": round(recorded_s, 2),
            "completed": completed, "tasks_get": polls, "requests_per_s": round(requests / wall, 1),
            "tasks_get_per_s": round(polls / wall, 1), "cpu_per_s": round(cpu / wall, 3),
            "cpu_ms_per_task": round(cpu * 1000 / in_flight, 2)}


async def measure(url: str, rounds: int, in_flight: Sequence[int]) -> dict[str, Any]:
    """Against server-everything (2025-11-25 tasks): cancels of tasks and of plain calls, then polling."""
    async with McpConnection.open(HttpServerSpec(name="everything", url=url)) as connection:
        await connection.list_tools()
        task_latencies, statuses = await task_cancels(connection, rounds, RESEARCH)
        plain = await plain_cancels(connection, rounds)
        polls = [await polling(connection, n, RESEARCH, topic="poll") for n in in_flight]
    return {"task_cancel_ms": summary_ms(task_latencies), "task_statuses": sorted(set(statuses)),
            "plain_cancel_ms": summary_ms(plain), "polling": polls}


async def measure_extension(url: str, rounds: int, in_flight: Sequence[int]) -> dict[str, Any]:
    """Against the 2026-07-28 tasks extension (tests/tasks_extension_server.py: its ``research`` tasks last 4 s,
    ``pollIntervalMs`` 200): cancels of tasks, then polling."""
    async with McpConnection.open(HttpServerSpec(name="everything", url=url)) as connection:
        await connection.list_tools()
        if not connection.offers_task_extension:
            raise RuntimeError("the tasks extension server did not offer the extension")
        task_latencies, statuses = await task_cancels(connection, rounds, "research", seconds=300)
        polls = [await polling(connection, n, "research", topic="poll", seconds=4) for n in in_flight]
    return {"task_cancel_ms": summary_ms(task_latencies), "task_statuses": sorted(set(statuses)), "polling": polls}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--in-flight", type=int, nargs="+", default=[100])
    parser.add_argument("--servers", nargs="+", choices=["everything", "extension"],
                        default=["everything", "extension"])
    args = parser.parse_args(argv)
    configure_logging("WARNING")
    info = machine()
    print_machine(info)
    results: dict[str, Any] = {}
    with Bench("mcp_tasks") as bench:
        for server in args.servers:
            if server == "everything":
                bench.start_everything("everything")
                results[server] = anyio.run(measure, _url(bench), args.rounds, args.in_flight)
            else:
                bench.start_tasks_extension("extension", concurrency=max(args.in_flight))
                results[server] = anyio.run(measure_extension, _url(bench), args.rounds, args.in_flight)
        path = bench.write_results({"machine": info, **results})
    for server, figures in results.items():
        task = figures["task_cancel_ms"]
        print(f"{server}: cancel → task cancelled (statuses {figures['task_statuses']}): p50 {task['p50']} ms, "
              f"p99 {task['p99']} ms")
        if "plain_cancel_ms" in figures:
            plain = figures["plain_cancel_ms"]
            print(f"{server}: plain call cancelled: p50 {plain['p50']} ms, p99 {plain['p99']} ms")
        for row in figures["polling"]:
            print(f"{server}: {row['in_flight']} tasks in flight ({row['completed']} completed in {row['seconds']} s, "
                  f"the last recorded after {row['all_recorded_s']} s): {row['requests_per_s']} requests per s "
                  f"({row['tasks_get_per_s']} tasks/get), {row['cpu_per_s'] * 100:.1f} % of a core, "
                  f"{row['cpu_ms_per_task']} ms CPU per task")
    print(f"results: {path}")


def _url(bench: Bench) -> str:
    """The URL of the server the benchmark's catalog names last."""
    return bench.catalog.read_text().split('"')[1]


if __name__ == "__main__":
    main()
