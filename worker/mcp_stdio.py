"""The ``stdio`` MCP transport with a bound on each line the server writes (docs/security.md, "Bounds").

The MCP SDK's ``stdio_client`` joins the server's stdout into lines without a bound: a server that writes a
100 MB line has it held whole (and joined again with every chunk). :func:`bounded_stdio_client` is that client
with one change, the reader: it keeps a line's pieces counted, and a line past :data:`MAX_LINE_BYTES` ends the
connection (logged ``mcp_line_too_long``): the pending calls fail as on any lost connection, and nothing more
of the line is held. Spawning, writing and the shutdown ladder are the SDK's own (its module's helpers, so
that the process's kill scope and its escalation stay exactly the SDK's).
"""

from __future__ import annotations

import sys
from collections.abc import AsyncGenerator
from contextlib import asynccontextmanager
from typing import Final, TextIO

import anyio
import anyio.lowlevel
import structlog
from mcp.client import stdio as sdk
from mcp.client._transport import TransportStreams
from mcp.client.stdio import StdioServerParameters, get_default_environment
from mcp.shared.message import SessionMessage

__all__ = ["MAX_LINE_BYTES", "bounded_stdio_client"]

log = structlog.get_logger(__name__)

MAX_LINE_BYTES: Final = 4 * 1024 * 1024
"""The longest line (one JSON-RPC message) a stdio server may write, as over HTTP (worker/mcp_transport.py)."""


@asynccontextmanager
async def bounded_stdio_client(
    server: StdioServerParameters, errlog: TextIO = sys.stderr, *, max_line_bytes: int = MAX_LINE_BYTES,
) -> AsyncGenerator[TransportStreams]:
    """The SDK's ``stdio_client`` (mcp/client/stdio.py), each line of the server's stdout within
    ``max_line_bytes``.

    Raises:
        OSError: the server process cannot be spawned.
    """
    command = await sdk._get_executable_command(server.command)
    process = await sdk._create_platform_compatible_process(
        command=command, args=server.args, env=get_default_environment() | (server.env or {}), errlog=errlog,
        cwd=server.cwd,
    )
    # As the SDK: no awaits until the task group is entered, or a cancellation would leak the process.
    read_stream_writer, read_stream = anyio.create_memory_object_stream[SessionMessage | Exception](0)
    write_stream, write_stream_reader = anyio.create_memory_object_stream[SessionMessage](0)
    writer_done = anyio.Event()
    shutting_down = False

    async def stdout_reader() -> None:
        assert process.stdout, "Opened process is missing stdout"
        try:
            async with read_stream_writer:
                try:
                    pending: list[bytes] = []  # the line being read, in the pieces it came in
                    pending_bytes = 0
                    async for chunk in process.stdout:
                        *ended, rest = chunk.split(b"\n")
                        if ended:
                            ended[0] = b"".join((*pending, ended[0]))
                            pending, pending_bytes = [], 0
                        pending.append(rest)
                        pending_bytes += len(rest)
                        if pending_bytes > max_line_bytes or any(len(line) > max_line_bytes for line in ended):
                            log.warning("mcp_line_too_long", command=server.command, max_bytes=max_line_bytes)
                            # The connection ends now (the session fails what it waits for), not after the
                            # drain below, which discards the rest of the output until the shutdown.
                            await read_stream_writer.aclose()
                            return
                        for line in ended:
                            text = line.decode(server.encoding, errors=server.encoding_error_handler)
                            try:
                                await read_stream_writer.send(sdk._parse_line(text))
                            except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                                return
                finally:
                    await sdk._drain_stdout(process)
        except anyio.ClosedResourceError:
            pass  # our own shutdown closed the stdout stream under the read
        except (anyio.BrokenResourceError, ConnectionError, UnicodeDecodeError) as exc:
            if not shutting_down:
                log.warning("mcp_stdout_failed", command=server.command, error=f"{type(exc).__name__}: {exc}")

    async def stdin_writer() -> None:
        assert process.stdin, "Opened process is missing stdin"
        try:
            async with write_stream_reader:
                async for session_message in write_stream_reader:
                    json = session_message.message.model_dump_json(by_alias=True, exclude_unset=True)
                    await process.stdin.send((json + "\n").encode(server.encoding, server.encoding_error_handler))
        except (anyio.ClosedResourceError, anyio.BrokenResourceError, OSError):
            await read_stream_writer.aclose()
        finally:
            writer_done.set()

    async def shutdown() -> None:
        read_stream.close()
        write_stream.close()
        with anyio.move_on_after(sdk._WRITER_FLUSH_TIMEOUT):
            await writer_done.wait()
        await sdk._stop_server_process(process)
        await sdk._aclose_all(read_stream, write_stream, read_stream_writer, write_stream_reader)
        await anyio.lowlevel.checkpoint()

    async with anyio.create_task_group() as tg:
        tg.start_soon(stdout_reader)
        tg.start_soon(stdin_writer)
        try:
            yield read_stream, write_stream
        finally:
            shutting_down = True
            with anyio.CancelScope(shield=True):
                await shutdown()
            tg.cancel_scope.cancel()
