"""MCP tool calls against real toolbox servers, over streamable HTTP and over stdio.

What a call comes to is the behaviour under test: ok, failed (the tool said so, the
server died, the call timed out) or cancelled (an operator's cancel cut it off), and
that a cancel really reaches the server's handler. No mocks: the servers are real
processes; the events file they write is how a test sees the server side.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import sys
from collections.abc import Mapping
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import anyio
import pytest

from runbrake.shared.errors import CancelRequested, ToolCallCancelled, ToolTransportError
from runbrake.shared.outcome import ToolOutcome
from runbrake.shared.spec import HttpServerSpec, McpServerSpec, StdioServerSpec
from runbrake.shared.tool_result import ToolResult
from runbrake.worker import mcp_transport
from runbrake.worker.conversation import ToolCall
from runbrake.worker.mcp_tool import execute, not_connected
from runbrake.worker.mcp_transport import McpConnection
from tests.hostile_http import HostileServer, Reply, Request, Whole, mcp_responder
from tests.mcp_helpers import (
    Toolbox,
    free_port,
    matching_events,
    wait_for_event_async,
)

pytestmark = [pytest.mark.integration, pytest.mark.anyio]

BOUND_S = 30.0
"""No test waits longer than this for anything; pytest-timeout is the backstop behind it."""

_call_ids = itertools.count(1)


async def _execute(
    connection: McpConnection,
    tool: str,
    arguments: Mapping[str, Any] | None = None,
    *,
    interrupt: anyio.CancelScope | None = None,
    timeout_s: float = 20.0,
    max_chars: int = 10_000,
) -> ToolResult:
    call = ToolCall(id=f"call-{next(_call_ids)}", server=connection.server, tool=tool, arguments=arguments or {})
    return await execute(
        connection,
        call,
        timeout_s=timeout_s,
        interrupt=interrupt if interrupt is not None else anyio.CancelScope(),
        max_chars=max_chars,
    )


async def _cancel_a_slow_call_mid_flight(connection: McpConnection, events: Path) -> tuple[ToolResult, int]:
    """Start ``slow``, wait until the server has started it, cancel its interrupt scope from another task.

    Returns the result and the server's number for the call.
    """
    interrupt = anyio.CancelScope()
    results: list[ToolResult] = []

    async def run_call() -> None:
        results.append(await _execute(connection, "slow", {"seconds": 60}, interrupt=interrupt))

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(run_call)
        (started,) = await wait_for_event_async(events, "started", tool="slow")
        interrupt.cancel()
    return results[0], started["call"]


async def test_discovery_lists_every_tool_of_the_server_with_its_input_schema(toolbox: Toolbox) -> None:
    with anyio.fail_after(BOUND_S):
        async with McpConnection.open(toolbox.spec) as connection:
            tools = await connection.list_tools()

    assert sorted(tool.name for tool in tools) == ["echo", "fail", "get-sum", "slow"]
    assert {tool.server for tool in tools} == {toolbox.spec.name}
    get_sum = next(tool for tool in tools if tool.name == "get-sum")
    assert get_sum.model_name == "toolbox__get-sum"
    assert get_sum.description == "Add two integers."
    assert get_sum.input_schema["required"] == ["a", "b"]


async def test_runs_that_list_the_same_tools_keep_one_copy_and_a_changed_listing_is_seen(toolbox: Toolbox) -> None:
    """Each connection (a run's, at its start) lists the server's tools itself; what it got is kept once per
    process where it equals what another got (docs/benchmarks.md, "Saturation: memory per run")."""
    with anyio.fail_after(BOUND_S):
        async with McpConnection.open(toolbox.spec) as first, McpConnection.open(toolbox.spec) as second:
            tools = await first.list_tools()
            again = await second.list_tools()
    assert again == tools
    assert all(a is b for a, b in zip(again, tools, strict=True)), "the second run's listing is a copy of its own"

    description = ["answers"]

    def respond(request: Request) -> Reply:
        message = request.json() if request.method == "POST" else {}
        if message.get("method") != "tools/list":
            return mcp_responder(lambda _: Whole(500), tool="t")(request)
        result = {"tools": [{"name": "t", "description": description[0], "inputSchema": {"type": "object"}}]}
        return Whole(200, {"content-type": "application/json"},
                     json.dumps({"jsonrpc": "2.0", "id": message["id"], "result": result}).encode())

    with HostileServer(respond) as server, anyio.fail_after(BOUND_S):
        spec = HttpServerSpec(name="changing", url=f"{server.url}/mcp")
        async with McpConnection.open(spec) as connection:
            [before] = await connection.list_tools()
        description[0] = "answers otherwise"  # the server's listing changed between two runs' starts
        async with McpConnection.open(spec) as connection:
            [after] = await connection.list_tools()
    assert (before.description, after.description) == ("answers", "answers otherwise")


async def test_connections_to_one_server_share_a_few_http_clients_and_a_client_emptied_is_closed(
        toolbox_http: Toolbox, monkeypatch: pytest.MonkeyPatch) -> None:
    """httpcore's pool walks all its connections on every request: each client is lent to a few connections at
    once, the first with room taken, and one other than the first is closed when its last connection closes
    (worker/mcp_transport.py, ``ClientShare``)."""
    monkeypatch.setattr(mcp_transport, "SESSIONS_PER_CLIENT", 2)
    with anyio.fail_after(BOUND_S):
        async with AsyncExitStack() as stack:
            connections = [await stack.enter_async_context(McpConnection.open(toolbox_http.spec)) for _ in range(3)]
            for connection in connections:
                assert (await _execute(connection, "echo", {"text": "hi"})).outcome is ToolOutcome.OK
            first, second, third = (c.session.http_client if c.session else None for c in connections)
            assert first is not None
            assert third is not None
            assert second is first
            assert third is not first, "a third connection shares a client already lent to two"
            await stack.aclose()  # the third closes first
        assert third.is_closed, "the emptied second client stays open"
        assert not first.is_closed
        async with McpConnection.open(toolbox_http.spec) as again:
            assert again.session is not None
            assert again.session.http_client is first
            assert (await _execute(again, "echo", {"text": "again"})).outcome is ToolOutcome.OK
        assert again.session.http_client is None, "a closed connection still holds its client"


async def test_a_successful_call_is_ok_and_carries_the_text_and_the_structured_result(toolbox: Toolbox) -> None:
    with anyio.fail_after(BOUND_S):
        async with McpConnection.open(toolbox.spec) as connection:
            result = await _execute(connection, "get-sum", {"a": 2, "b": 3})

    assert result.outcome is ToolOutcome.OK
    assert not result.is_error
    assert result.content == "5"
    assert result.structured == '{"result": 5}'


async def test_a_tool_that_raises_is_failed_never_cancelled(toolbox: Toolbox) -> None:
    with anyio.fail_after(BOUND_S):
        async with McpConnection.open(toolbox.spec) as connection:
            result = await _execute(connection, "fail", {"message": "disk full"})

    assert result.outcome is ToolOutcome.FAILED
    assert result.is_error
    assert "disk full" in result.content


async def test_an_unknown_tool_is_failed(toolbox: Toolbox) -> None:
    with anyio.fail_after(BOUND_S):
        async with McpConnection.open(toolbox.spec) as connection:
            result = await _execute(connection, "no-such-tool")

    assert result.outcome is ToolOutcome.FAILED
    assert "no-such-tool" in result.content


async def test_a_call_cancelled_mid_flight_is_cancelled_and_its_server_handler_sees_the_cancel(
    toolbox: Toolbox,
) -> None:
    with anyio.fail_after(BOUND_S):
        async with McpConnection.open(toolbox.spec) as connection:
            result, call_number = await _cancel_a_slow_call_mid_flight(connection, toolbox.events)
            await wait_for_event_async(toolbox.events, "cancelled", tool="slow")

    assert result.outcome is ToolOutcome.CANCELLED
    assert result.is_error
    assert matching_events(toolbox.events, "cancelled", call=call_number)
    assert not matching_events(toolbox.events, "finished", call=call_number)


async def test_the_connection_serves_the_next_call_after_a_cancelled_one(toolbox: Toolbox) -> None:
    with anyio.fail_after(BOUND_S):
        async with McpConnection.open(toolbox.spec) as connection:
            cancelled, _ = await _cancel_a_slow_call_mid_flight(connection, toolbox.events)
            result = await _execute(connection, "echo", {"text": "still here"})

    assert cancelled.outcome is ToolOutcome.CANCELLED
    assert result.outcome is ToolOutcome.OK
    assert result.content == "still here"


async def test_an_interrupt_cancelled_before_the_call_starts_is_cancelled_and_never_reaches_the_server(
    toolbox: Toolbox,
) -> None:
    interrupt = anyio.CancelScope()
    interrupt.cancel()
    with anyio.fail_after(BOUND_S):
        async with McpConnection.open(toolbox.spec) as connection:
            result = await _execute(connection, "slow", {"seconds": 60}, interrupt=interrupt)
            # A later call that has finished on the server: anything sent before it has arrived.
            after = await _execute(connection, "echo", {"text": "after"})
            await wait_for_event_async(toolbox.events, "finished", tool="echo")

    assert result.outcome is ToolOutcome.CANCELLED
    assert after.outcome is ToolOutcome.OK
    assert not matching_events(toolbox.events, "started", tool="slow")


async def test_a_call_that_outlives_its_timeout_is_failed_not_cancelled_and_stopped_on_the_server(
    toolbox: Toolbox,
) -> None:
    with anyio.fail_after(BOUND_S):
        async with McpConnection.open(toolbox.spec) as connection:
            result = await _execute(connection, "slow", {"seconds": 60}, timeout_s=0.5)
            await wait_for_event_async(toolbox.events, "cancelled", tool="slow")

    assert result.outcome is ToolOutcome.FAILED
    assert "timed out after 0.5 s" in result.content


async def test_an_outer_cancellation_propagates_and_is_not_turned_into_a_result(toolbox: Toolbox) -> None:
    results: list[ToolResult] = []
    with anyio.fail_after(BOUND_S):
        async with McpConnection.open(toolbox.spec) as connection:
            with anyio.CancelScope() as outer:

                async def cancel_once_started() -> None:
                    await wait_for_event_async(toolbox.events, "started", tool="slow")
                    outer.cancel()

                async with anyio.create_task_group() as tasks:
                    tasks.start_soon(cancel_once_started)
                    results.append(await _execute(connection, "slow", {"seconds": 60}))
            await wait_for_event_async(toolbox.events, "cancelled", tool="slow")

    assert outer.cancelled_caught
    assert results == []


async def test_a_server_that_dies_mid_call_fails_the_call_and_the_calls_after_it(toolbox: Toolbox) -> None:
    with anyio.fail_after(BOUND_S):
        async with McpConnection.open(toolbox.spec) as connection:

            async def kill_server_once_started() -> None:
                (started,) = await wait_for_event_async(toolbox.events, "started", tool="slow")
                os.kill(started["pid"], signal.SIGKILL)

            async with anyio.create_task_group() as tasks:
                tasks.start_soon(kill_server_once_started)
                result = await _execute(connection, "slow", {"seconds": 60})
            after = await _execute(connection, "echo", {"text": "anyone?"})

    assert result.outcome is ToolOutcome.FAILED
    assert after.outcome is ToolOutcome.FAILED
    assert toolbox.spec.name in after.content


@pytest.mark.parametrize(
    "dead",
    [
        pytest.param(lambda: HttpServerSpec(name="gone", url=f"http://127.0.0.1:{free_port()}/mcp"), id="http"),
        pytest.param(lambda: StdioServerSpec(name="gone", command=sys.executable, args=("-c", "pass")), id="stdio"),
    ],
)
async def test_a_server_that_cannot_be_reached_fails_to_connect_naming_the_server(dead: Any) -> None:
    spec: McpServerSpec = dead()
    with anyio.fail_after(BOUND_S), pytest.raises(ToolTransportError, match="'gone'") as raised:
        async with McpConnection.open(spec, connect_timeout_s=5):
            pass

    assert not isinstance(raised.value, ToolCallCancelled)
    assert raised.value.server == "gone"


async def test_a_stdio_server_that_never_answers_fails_to_connect_after_the_connect_timeout() -> None:
    mute = StdioServerSpec(name="mute", command=sys.executable, args=("-c", "import time; time.sleep(60)"))
    with anyio.fail_after(BOUND_S), pytest.raises(ToolTransportError, match=r"'mute'.*within 0\.5 s"):
        async with McpConnection.open(mute, connect_timeout_s=0.5):
            pass


async def test_a_cancel_request_raised_in_the_block_passes_through_the_connection_unwrapped(
    toolbox: Toolbox,
) -> None:
    with anyio.fail_after(BOUND_S), pytest.raises(CancelRequested):
        async with McpConnection.open(toolbox.spec):
            raise CancelRequested("run-1")


async def test_a_call_after_the_connection_closed_is_failed(toolbox: Toolbox) -> None:
    with anyio.fail_after(BOUND_S):
        async with McpConnection.open(toolbox.spec) as connection:
            pass
        result = await _execute(connection, "echo", {"text": "too late"})

    assert result.outcome is ToolOutcome.FAILED
    assert "closed" in result.content


def test_a_call_to_a_server_that_is_not_connected_is_failed() -> None:
    call = ToolCall(id="c1", server="gone", tool="get-sum", arguments={"a": 1, "b": 2})

    result = not_connected(call, max_chars=1_000)

    assert result.outcome is ToolOutcome.FAILED
    assert "'gone'" in result.content
    assert not_connected(call, max_chars=1_000, reason="connection refused").content.endswith(": connection refused")


async def test_results_larger_than_max_chars_are_bounded_and_keep_their_outcome(toolbox: Toolbox) -> None:
    with anyio.fail_after(BOUND_S):
        async with McpConnection.open(toolbox.spec) as connection:
            ok = await _execute(connection, "echo", {"text": "x" * 500}, max_chars=100)
            failed = await _execute(connection, "fail", {"message": "y" * 500}, max_chars=100)
            interrupt = anyio.CancelScope()
            interrupt.cancel()
            cancelled = await _execute(connection, "slow", interrupt=interrupt, max_chars=30)

    assert ok.outcome is ToolOutcome.OK
    assert ok.structured is not None
    for channel in (ok.content, ok.structured, failed.content):
        assert len(channel) <= 100
        assert "truncated" in channel
    assert failed.outcome is ToolOutcome.FAILED
    assert cancelled.outcome is ToolOutcome.CANCELLED
    assert len(cancelled.content) <= 30
    assert "truncated" in cancelled.content
