"""The MCP servers of one segment: connected at its start, discovered, closed at its end."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Final

import anyio
import structlog

from runbrake.shared.errors import ToolTransportError
from runbrake.shared.spec import McpServerSpec
from runbrake.shared.tool_result import Failure, ToolResult
from runbrake.worker import mcp_tasks, mcp_tool
from runbrake.worker.conversation import ToolCall, ToolInfo
from runbrake.worker.mcp_transport import McpConnection
from runbrake.worker.subscribers import ToolCallEvents

log = structlog.get_logger(__name__)


DEFAULT_TIMEOUT_S: Final = 60.0

_limiters: dict[str, anyio.CapacityLimiter] = {}
"""Per worker process (one event loop): calls in flight per catalog server, for its max_concurrency."""


def _limiter(server: McpServerSpec) -> anyio.CapacityLimiter | None:
    if server.max_concurrency is None:
        return None
    limiter = _limiters.get(server.name)
    if limiter is None or limiter.total_tokens != server.max_concurrency:
        limiter = _limiters[server.name] = anyio.CapacityLimiter(server.max_concurrency)
    return limiter


class Toolbox:
    """Runs tool calls on the segment's connections. A server that could not be reached
    stays in the toolbox as unavailable: its calls are recorded failed and the run goes on.

    What the operator's catalog says of a server applies here: only its allowed ``tools`` are
    shown to the model and may be called, at most ``max_concurrency`` calls are in flight per
    process, and its ``timeout_s`` is a call's default and upper bound.
    """

    def __init__(
        self, servers: Mapping[str, McpServerSpec], *, timeout_s: float | None, max_chars: int,
        calls: ToolCallEvents | None = None, tasks: mcp_tasks.TaskRecords | None = None,
    ) -> None:
        self._servers = servers
        self._tasks = tasks
        self._connections: dict[str, McpConnection] = {}
        self._unavailable: dict[str, str] = {}
        self._tools: list[ToolInfo] = []
        self._offered: set[tuple[str, str]] = set()
        self._timeout_s = timeout_s
        self._max_chars = max_chars
        self._calls = calls

    @classmethod
    @asynccontextmanager
    async def open(
        cls, servers: Mapping[str, McpServerSpec], *, timeout_s: float | None, max_chars: int,
        calls: ToolCallEvents | None = None, tasks: mcp_tasks.TaskRecords | None = None,
    ) -> AsyncIterator[Toolbox]:
        """Connect to every server and list its tools; closes them all on exit, in this task.

        Args:
            servers: the servers by name.
            timeout_s: the run's own limit for one call, if it set one (capped by a server's timeout_s).
            max_chars: the bound on each content channel of a result.
            calls: told when each call starts and ends and what progress its server reports (the worker's
                subscribers, worker/subscribers.py; the progress of the call in flight is one).
            tasks: where the run records the MCP tasks of its calls (worker/mcp_tasks.py); without it no call is
                made as a task.
        """
        toolbox = cls(servers, timeout_s=timeout_s, max_chars=max_chars, calls=calls, tasks=tasks)
        async with AsyncExitStack() as stack:
            for name, spec in servers.items():
                try:
                    connection = await stack.enter_async_context(McpConnection.open(spec))
                    tools = await connection.list_tools()
                except ToolTransportError as exc:
                    log.warning("mcp_server_unavailable", server=name, error=str(exc))
                    toolbox._unavailable[name] = str(exc)
                    continue
                toolbox._connections[name] = connection
                toolbox._tools.extend(t for t in tools if spec.tools is None or t.name in spec.tools)
                toolbox._offered.update((name, t.name) for t in tools)
            yield toolbox

    @property
    def tools(self) -> Sequence[ToolInfo]:
        return self._tools

    def problem(self, call: ToolCall) -> str | None:
        """What makes ``call`` one this run cannot make, in words for the model (None: it can be made): no such
        server in the run, a tool the catalog does not allow, a tool its server did not list. A server that
        did not connect is no mistake of the call's: :meth:`execute` records it failed, the server's fault."""
        server = self._servers.get(call.server)
        if server is None:
            return f"there is no MCP server named {call.server!r} in this run"
        if server.tools is not None and call.tool not in server.tools:
            return f"{call.server} does not allow the tool {call.tool!r}"
        if call.server in self._connections and (call.server, call.tool) not in self._offered:
            return f"{call.server} offers no tool {call.tool!r}"
        if self._as_task(call) is None:
            return (f"{call.server}.{call.tool} runs only as an MCP task, which this server's catalog entry turns "
                    'off (tasks = "off")')
        return None

    def _as_task(self, call: ToolCall) -> bool | None:
        """Whether ``call`` is made as an MCP task (its server's ``tasks`` and the tool's ``taskSupport``); None: it
        cannot be made at all."""
        connection = self._connections.get(call.server)
        if connection is None:
            return False
        return self._servers[call.server].tasks.as_task(connection.task_support.get(call.tool))

    def _waits_for_tasks(self, connection: McpConnection, call: ToolCall) -> bool:
        """Whether ``call`` goes through worker/mcp_tasks.py: made as a 2025-11-25 task, or to a server of the
        2026-07-28 tasks extension, which decides itself which calls it answers with a task (SEP-2663)."""
        return connection.offers_task_extension or (bool(self._as_task(call)) and connection.offers_tasks)

    def cancel_grace(self, call: ToolCall) -> float | None:
        """How long a cancel lets ``call`` go on: its server's or tool's ``on_cancel = "finish"`` grace."""
        server = self._servers.get(call.server)
        return None if server is None else server.cancel_grace(call.tool)

    async def execute(self, call: ToolCall, *, interrupt: anyio.CancelScope) -> ToolResult:
        problem = self.problem(call)
        if problem is not None:  # the loop hands such a call back before it gets here; never sent
            return ToolResult.error(f"{problem}; it was not called", failure=Failure.ARGUMENTS)
        connection = self._connections.get(call.server)
        if connection is None:
            return mcp_tool.not_connected(call, max_chars=self._max_chars, reason=self._unavailable.get(call.server))
        server = self._servers[call.server]
        limiter = _limiter(server)
        if limiter is None:
            return await self._call(connection, server, call, interrupt)
        async with limiter:
            return await self._call(connection, server, call, interrupt)

    async def _call(
        self, connection: McpConnection, server: McpServerSpec, call: ToolCall, interrupt: anyio.CancelScope
    ) -> ToolResult:
        limits = [t for t in (self._timeout_s, server.timeout_s) if t is not None]
        timeout_s = min(limits) if limits else DEFAULT_TIMEOUT_S
        progress = None if self._calls is None else self._calls.for_call(call)
        try:
            if self._tasks is not None and self._waits_for_tasks(connection, call):
                result = await mcp_tasks.call_as_task(connection, call, self._tasks, timeout_s=timeout_s,
                                                      interrupt=interrupt, progress=progress,
                                                      lost=lambda c: server.worker_lost_policy(c.tool),
                                                      answer=mcp_tool.from_answer)
                return mcp_tool.finished(result, call, self._max_chars)
            return await mcp_tool.execute(connection, call, timeout_s=timeout_s, interrupt=interrupt,
                                          max_chars=self._max_chars, progress=progress)
        finally:
            if self._calls is not None:
                with anyio.CancelScope(shield=True):
                    await self._calls.call_ended(call)
