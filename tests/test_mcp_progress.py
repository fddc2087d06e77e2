"""MCP progress handled at the transport boundary (worker/mcp_progress.py), against real toolbox servers over
streamable HTTP and stdio, and the worker's ``RUNBRAKE_MCP_PROGRESS``.

The adapter relies on the MCP SDK's public surface only (``Transport``, ``SessionMessage``, the JSON-RPC
types, ``Client.call_tool(meta=…)``): these tests fail when any of it changes under it — a call whose
server is not asked for progress, or whose progress never arrives, or arrives at the SDK instead.
"""

from __future__ import annotations

import gc
from typing import Any

import anyio
import pytest
from mcp.shared.message import SessionMessage
from mcp_types import JSONRPCNotification, JSONRPCResponse

from runbrake.shared import RunStore
from runbrake.shared.errors import ToolCallCancelled
from runbrake.shared.messaging.producer import Producer
from runbrake.worker.mcp_progress import ProgressRoutes
from runbrake.worker.mcp_transport import McpConnection
from tests.mcp_helpers import Toolbox, matching_events, wait_for_event, wait_for_event_async
from tests.worker_helpers import WorkerProcess, call, spec

pytestmark = [pytest.mark.integration]

BOUND_S = 30.0
Report = tuple[float, float | None, str | None]


def _progress(token: object, progress: object = 1.0, **more: object) -> SessionMessage:
    params: dict[str, Any] = {"progressToken": token, "progress": progress, **more}
    return SessionMessage(JSONRPCNotification(jsonrpc="2.0", method="notifications/progress", params=params))


@pytest.mark.anyio
async def test_only_progress_naming_a_routed_token_is_taken_out_of_the_stream_and_reaches_its_callback() -> None:
    routes = ProgressRoutes()
    got: list[Report] = []

    async def callback(progress: float, total: float | None, message: str | None) -> None:
        got.append((progress, total, message))

    async with anyio.create_task_group() as tasks:
        with routes.route(callback, tasks) as meta:
            token = meta["progress_token"]
            ours = routes.take(_progress(token, 2, total=4, message="half"))
            foreign = routes.take(_progress("someone-else"))
            not_progress = routes.take(SessionMessage(JSONRPCResponse(jsonrpc="2.0", id=1, result={})))
            malformed = routes.take(_progress(token, progress=True))  # a bool is no number (MCP: a number)
            with anyio.fail_after(BOUND_S):
                while not got:
                    await anyio.sleep(0)
        after_the_call = routes.take(_progress(token))

    assert (ours, foreign, not_progress, malformed, after_the_call) == (True, False, False, True, False)
    assert got == [(2.0, 4.0, "half")]


@pytest.mark.anyio
async def test_a_calls_progress_reaches_its_callback_in_order_and_the_server_was_asked_for_it(
    toolbox: Toolbox,
) -> None:
    got: list[Report] = []

    async def callback(progress: float, total: float | None, message: str | None) -> None:
        got.append((progress, total, message))

    async with McpConnection.open(toolbox.spec) as connection:
        result = await connection.call("slow", {"seconds": 2.5}, timeout_s=BOUND_S, interrupt=anyio.CancelScope(),
                                       progress=callback)

    assert not result.is_error
    [started] = matching_events(toolbox.events, "started", tool="slow")
    assert started["args"]["progress_asked"] is True
    # A report the deliverer had not handed over yet is superseded by the next one, never reordered.
    assert got, "no progress reached the callback"
    assert got[-1] == (2.0, 2.5, "2 of 2.5 s")
    assert [p for p, _, _ in got] == sorted({p for p, _, _ in got})


@pytest.mark.anyio
async def test_a_call_without_a_progress_callback_does_not_ask_its_server_for_progress(toolbox: Toolbox) -> None:
    async with McpConnection.open(toolbox.spec) as connection:
        result = await connection.call("slow", {"seconds": 0.1}, timeout_s=BOUND_S, interrupt=anyio.CancelScope())

    assert not result.is_error
    [started] = matching_events(toolbox.events, "started", tool="slow")
    assert started["args"]["progress_asked"] is False


@pytest.mark.anyio
async def test_a_progress_callback_that_blocks_never_holds_up_its_call_or_a_cancel(toolbox_http: Toolbox) -> None:
    released = anyio.Event()
    calls = 0

    async def stuck(progress: float, total: float | None, message: str | None) -> None:
        nonlocal calls
        calls += 1
        await released.wait()

    async with McpConnection.open(toolbox_http.spec) as connection:
        with anyio.fail_after(BOUND_S):
            finished = await connection.call("slow", {"seconds": 2.5}, timeout_s=BOUND_S,
                                             interrupt=anyio.CancelScope(), progress=stuck)
        interrupt = anyio.CancelScope()
        async with anyio.create_task_group() as group:
            async def cancel_once_started() -> None:
                await wait_for_event_async(toolbox_http.events, "started", tool="slow", count=2, timeout=BOUND_S)
                interrupt.cancel()
            group.start_soon(cancel_once_started)
            with anyio.fail_after(BOUND_S), pytest.raises(Exception, match="cancel") as cancelled:
                await connection.call("slow", {"seconds": 60}, timeout_s=BOUND_S * 2, interrupt=interrupt,
                                      progress=stuck)
        released.set()  # the stuck callbacks return; the connection then closes

    assert not finished.is_error
    assert type(cancelled.value).__name__ == "ToolCallCancelled"
    assert calls >= 1


def _listings_kept() -> int:
    """The ``tools/list`` answers alive in this process, as the SDK's JSON-RPC layer got them."""
    gc.collect()
    return sum(1 for o in gc.get_objects() if isinstance(o, JSONRPCResponse) and "tools" in o.result)


@pytest.mark.anyio
async def test_a_connection_in_a_call_keeps_no_copy_of_the_tools_answer_it_listed(toolbox: Toolbox) -> None:
    """The SDK's dispatcher keeps the last answer it got until the next message; in a call whose messages are
    only progress, taken out before it, that was the whole ``tools/list`` answer for as long as the call."""
    started = anyio.Event()

    async def callback(progress: float, total: float | None, message: str | None) -> None:
        started.set()

    before = _listings_kept()
    async with McpConnection.open(toolbox.spec) as connection:
        tools = await connection.list_tools()
        async with anyio.create_task_group() as group:
            async def in_a_call() -> None:
                with pytest.raises(ToolCallCancelled):
                    await connection.call("slow", {"seconds": 60}, timeout_s=BOUND_S * 2, interrupt=interrupt,
                                          progress=callback)
            interrupt = anyio.CancelScope()
            group.start_soon(in_a_call)
            with anyio.fail_after(BOUND_S):
                await started.wait()  # the call is in flight, its progress coming
            kept = _listings_kept()
            interrupt.cancel()

    assert {tool.name for tool in tools} >= {"slow"}
    assert kept == before


@pytest.mark.parametrize(("setting", "asked"), [("always", True), ("off", False)])
def test_the_worker_asks_for_progress_unless_runbrake_mcp_progress_is_off(
    start_worker: Any, toolbox_http: Toolbox, producer: Producer, store: RunStore, setting: str, asked: bool
) -> None:
    worker: WorkerProcess = start_worker(RUNBRAKE_MCP_PROGRESS=setting)
    run_id = producer.enqueue(spec({"toolbox": toolbox_http.spec},
                                   [{"tool_calls": [call("slow", seconds=60)]}, {"content": "x"}])).run_id
    [started] = wait_for_event(toolbox_http.events, "started", tool="slow", timeout=BOUND_S)
    assert store.cancel(run_id, reason="enough", requested_by="t").won
    wait_for_event(toolbox_http.events, "cancelled", tool="slow", timeout=BOUND_S)

    assert started["args"]["progress_asked"] is asked
    assert worker.process.poll() is None
