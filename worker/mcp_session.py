"""Streamable HTTP with its MCP session in view: the SDK's ``streamable_http_client``, but the connection knows its
``Mcp-Session-Id`` and decides when it closes whether the session is ended (a ``DELETE``) or kept.

A server such as the npm ``server-everything`` keeps its MCP tasks per session: a task a hand-over leaves running
is polled by the next worker under the same session id, so that session must outlive this connection
(worker/mcp_tasks.py; docs/usage.md, "Long tool calls as MCP tasks"). The SDK's client ends the session on close
unless told at the start not to, and never says its id; this is its transport with both in view.
"""

from __future__ import annotations

import contextlib
from types import TracebackType

import anyio
import httpx2
from mcp.client._transport import TransportStreams
from mcp.client.streamable_http import StreamableHTTPTransport
from mcp.shared._compat import resync_tracer
from mcp.shared._context_streams import create_context_streams
from mcp.shared.message import SessionMessage

__all__ = ["SessionHttp"]


class SessionHttp:
    """A ``Transport``: one streamable HTTP connection to ``url`` over ``http_client`` (left open)."""

    def __init__(self, url: str, http_client: httpx2.AsyncClient, *, max_sse_event_size: int) -> None:
        self.url = url
        self.http_client = http_client
        self._transport = StreamableHTTPTransport(url, max_sse_event_size=max_sse_event_size)
        self._stack = contextlib.AsyncExitStack()
        self.keep = False
        """Set, the session is not ended when the connection closes: a task of it is still to be polled."""

    @property
    def session_id(self) -> str | None:
        """The server's ``Mcp-Session-Id``, once it gave one."""
        return self._transport.session_id

    async def __aenter__(self) -> TransportStreams:
        # As the SDK's streamable_http_client does (mcp/client/streamable_http.py), entered by hand.
        stack = self._stack
        stack.push_async_callback(resync_tracer)
        read_writer, read_stream = create_context_streams[SessionMessage | Exception](0)
        write_stream, write_reader = create_context_streams[SessionMessage](0)
        for stream in (read_writer, read_stream, write_stream, write_reader):
            await stack.enter_async_context(stream)
        group = await stack.enter_async_context(anyio.create_task_group())
        stack.callback(group.cancel_scope.cancel)

        def start_get_stream() -> None:
            group.start_soon(self._transport.handle_get_stream, self.http_client, read_writer)

        group.start_soon(self._transport.post_writer, self.http_client, write_reader, read_writer, write_stream,
                         start_get_stream, group)
        return read_stream, write_stream

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> bool | None:
        try:
            if self.session_id and not self.keep:
                await self._transport.terminate_session(self.http_client)
        finally:
            await self._stack.aclose()
        return None
