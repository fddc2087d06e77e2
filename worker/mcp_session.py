"""Streamable HTTP with its MCP session in view: the SDK's ``streamable_http_client``, but the connection knows its
``Mcp-Session-Id`` and decides when it closes whether the session is ended (a ``DELETE``) or kept.

A server such as the npm ``server-everything`` keeps its MCP tasks per session: a task a hand-over leaves running
is polled by the next worker under the same session id, so that session must outlive this connection
(worker/mcp_tasks.py; docs/usage.md, "Long tool calls as MCP tasks"). The next worker *adopts* it, and ends it
(``DELETE``) when it closes its own connection, unless a task of it was handed over again: no session outlives
the tasks it was kept for.

Why the SDK's private modules (``mcp.client._transport``, ``mcp.shared._compat``, ``mcp.shared._context_streams``):
the public ``mcp.client.streamable_http.streamable_http_client`` of mcp 2.3.0 neither says the session's id nor
lets the close decide whether to end it (``terminate_on_close`` is fixed at the start, before a hand-over is
known), and nothing public gives the id instead (the ``Client`` and its session do not know it). So this enters
the SDK's own ``StreamableHTTPTransport`` as ``streamable_http_client`` does, with the same private helpers; the
pins in deploy/constraints.txt hold them still, and tests/test_mcp_tasks.py breaks first when they move.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from types import TracebackType
from typing import Final

import anyio
import httpx2
import structlog
from mcp.client._transport import TransportStreams
from mcp.client.streamable_http import StreamableHTTPTransport
from mcp.shared._compat import resync_tracer
from mcp.shared._context_streams import create_context_streams
from mcp.shared.message import SessionMessage

__all__ = ["SessionHttp"]

log = structlog.get_logger(__name__)

_END_WITHIN_S: Final = 5.0
"""How long ending an adopted session may hold up the close of the connection."""


class SessionHttp:
    """A ``Transport``: one streamable HTTP connection to ``url`` over an HTTP client ``lend`` lends it while it is
    open (worker/mcp_transport.py, ``ClientShare``)."""

    def __init__(self, url: str, lend: Callable[[], AbstractAsyncContextManager[httpx2.AsyncClient]], *,
                 max_sse_event_size: int) -> None:
        self.url = url
        self._lend = lend
        self.http_client: httpx2.AsyncClient | None = None
        """The client lent, while the connection is open."""
        self._transport = StreamableHTTPTransport(url, max_sse_event_size=max_sse_event_size)
        self._stack = contextlib.AsyncExitStack()
        self._kept: set[str] = set()
        self._adopted: set[str] = set()

    @property
    def session_id(self) -> str | None:
        """The server's ``Mcp-Session-Id``, once it gave one."""
        return self._transport.session_id

    def keep(self, session_id: str) -> None:
        """Not end ``session_id`` (this connection's, or one it adopted) when the connection closes: a task of it
        is still to be polled, by the next worker."""
        self._kept.add(session_id)

    def adopt(self, session_id: str) -> None:
        """End ``session_id``, another worker's session whose task this connection polls, when the connection
        closes (unless it is kept again)."""
        self._adopted.add(session_id)

    async def __aenter__(self) -> TransportStreams:
        # As the SDK's streamable_http_client does (mcp/client/streamable_http.py), entered by hand.
        stack = self._stack
        http_client = self.http_client = await stack.enter_async_context(self._lend())
        stack.push_async_callback(resync_tracer)
        read_writer, read_stream = create_context_streams[SessionMessage | Exception](0)
        write_stream, write_reader = create_context_streams[SessionMessage](0)
        for stream in (read_writer, read_stream, write_stream, write_reader):
            await stack.enter_async_context(stream)
        group = await stack.enter_async_context(anyio.create_task_group())
        stack.callback(group.cancel_scope.cancel)

        def start_get_stream() -> None:
            group.start_soon(self._transport.handle_get_stream, http_client, read_writer)

        group.start_soon(self._transport.post_writer, http_client, write_reader, read_writer, write_stream,
                         start_get_stream, group)
        return read_stream, write_stream

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> bool | None:
        try:
            client = self.http_client
            if client is not None:  # None: the connection never opened
                if self.session_id and self.session_id not in self._kept:
                    await self._transport.terminate_session(client)
                for session_id in sorted(self._adopted - self._kept - {self.session_id}):
                    await self._end(client, session_id)
        finally:
            try:
                await self._stack.aclose()
            finally:
                self.http_client = None
        return None

    async def _end(self, client: httpx2.AsyncClient, session_id: str) -> None:
        """``DELETE`` the adopted ``session_id``, within :data:`_END_WITHIN_S`; a failure is logged, not raised (the
        server ends it at its own timeout)."""
        with anyio.move_on_after(_END_WITHIN_S) as late:
            try:
                response = await client.delete(self.url, headers={"mcp-session-id": session_id})
            except httpx2.HTTPError as exc:
                log.info("mcp_session_end_failed", session_id=session_id, error=str(exc))
                return
            log.info("mcp_session_ended", session_id=session_id, status=response.status_code)
        if late.cancelled_caught:
            log.info("mcp_session_end_failed", session_id=session_id, error=f"no answer within {_END_WITHIN_S:g} s")
