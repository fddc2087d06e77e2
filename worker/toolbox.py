"""The MCP servers of one segment: connected at its start, discovered, closed at its end."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import AsyncExitStack, asynccontextmanager

import anyio
import structlog

from runbrake.shared.errors import ToolTransportError
from runbrake.shared.spec import McpServerSpec
from runbrake.shared.tool_result import ToolResult
from runbrake.worker import mcp_tool
from runbrake.worker.conversation import ToolCall, ToolInfo
from runbrake.worker.mcp_transport import McpConnection
from runbrake.worker.progress import ProgressReporter

log = structlog.get_logger(__name__)


class Toolbox:
    """Runs tool calls on the segment's connections. A server that could not be reached
    stays in the toolbox as unavailable: its calls are recorded failed and the run goes on."""

    def __init__(self, *, timeout_s: float, max_chars: int, progress: ProgressReporter | None = None) -> None:
        self._connections: dict[str, McpConnection] = {}
        self._unavailable: dict[str, str] = {}
        self._tools: list[ToolInfo] = []
        self._timeout_s = timeout_s
        self._max_chars = max_chars
        self._progress = progress

    @classmethod
    @asynccontextmanager
    async def open(
        cls, servers: Mapping[str, McpServerSpec], *, timeout_s: float, max_chars: int,
        progress: ProgressReporter | None = None,
    ) -> AsyncIterator[Toolbox]:
        """Connect to every server and list its tools; closes them all on exit, in this task. ``progress``
        keeps each call's MCP progress notifications (worker/progress.py)."""
        toolbox = cls(timeout_s=timeout_s, max_chars=max_chars, progress=progress)
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
                toolbox._tools.extend(tools)
            yield toolbox

    @property
    def tools(self) -> Sequence[ToolInfo]:
        return self._tools

    async def execute(self, call: ToolCall, *, interrupt: anyio.CancelScope) -> ToolResult:
        connection = self._connections.get(call.server)
        if connection is None:
            return mcp_tool.not_connected(call, max_chars=self._max_chars, reason=self._unavailable.get(call.server))
        if self._progress is None:
            return await mcp_tool.execute(
                connection, call, timeout_s=self._timeout_s, interrupt=interrupt, max_chars=self._max_chars
            )
        try:
            return await mcp_tool.execute(connection, call, timeout_s=self._timeout_s, interrupt=interrupt,
                                          max_chars=self._max_chars, progress=self._progress.for_call(call))
        finally:
            with anyio.CancelScope(shield=True):
                await self._progress.call_ended()
