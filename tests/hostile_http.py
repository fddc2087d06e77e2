"""A hostile HTTP/1.1 server on loopback, for the attacks no outside server makes (docs/security.md, "Tested
attacks"): an answer that floods (a body of any size, streamed, counting what it managed to send), one that
drips (a byte at a time, for longer than any test waits), a redirect elsewhere. A tiny asyncio server in a
thread of its own; each request is answered by ``respond(request)``, which says what to send.

    server = HostileServer(lambda request: Flood(100 * 1024 * 1024))
    with server:
        ...  # point a client at server.url
    assert server.sent < 100 * 1024 * 1024

It also speaks just enough of MCP's streamable HTTP (JSON answers, no sessions) to get a client through the
handshake and ``tools/list`` to a ``tools/call`` that floods or drips: :func:`mcp_responder`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Self

_START_TIMEOUT_S = 10.0
_MAX_HEAD_BYTES = 64 * 1024
_PIECE = 64 * 1024


@dataclass(frozen=True, slots=True)
class Request:
    """One request the server read: its method, path, headers (lower-case names) and body."""

    method: str
    path: str
    headers: Mapping[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass(frozen=True, slots=True)
class Whole:
    """An ordinary answer: ``status``, ``headers``, ``body`` (``content-length`` set)."""

    status: int = 200
    headers: Mapping[str, str] = field(default_factory=dict)
    body: bytes = b""


@dataclass(frozen=True, slots=True)
class Flood:
    """A body of ``size`` bytes (declared in ``content-length``): ``prefix``, filler ``x``, ``suffix``, written as
    fast as the client reads it; the server counts what it wrote (:attr:`HostileServer.sent`)."""

    size: int
    prefix: bytes = b""
    suffix: bytes = b""
    status: int = 200
    content_type: str = "application/json"


@dataclass(frozen=True, slots=True)
class Drip:
    """``body`` (declared in ``content-length``) one byte every ``every_s`` seconds, after the headers."""

    body: bytes
    every_s: float
    status: int = 200
    content_type: str = "application/json"


@dataclass(frozen=True, slots=True)
class Pieces:
    """Anything at all: ``head`` as raw bytes (any status line and headers, broken ones too), then each of
    ``pieces``, ``every_s`` apart; then the connection is closed (so a body without a length ends there)."""

    head: bytes
    pieces: tuple[bytes, ...]
    every_s: float = 0.0


Reply = Whole | Flood | Drip | Pieces


class HostileServer:
    """Answers every request on 127.0.0.1 (a free port) as ``respond`` says; keep-alive, one request at a time
    per connection."""

    def __init__(self, respond: Callable[[Request], Reply]) -> None:
        self.respond = respond
        """What answers each request; may be replaced between requests."""
        self.requests: list[Request] = []
        self.sent = 0
        """Body bytes written to clients (and taken by the kernel) so far, every answer together."""
        self.dripping = threading.Event()
        """Set once a drip has begun: its headers are out."""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="hostile-http", daemon=True)
        self._server: asyncio.Server | None = None
        self._lock = threading.Lock()
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> Self:
        self._thread.start()
        started = asyncio.run_coroutine_threadsafe(self._start(), self._loop)
        self.port = started.result(_START_TIMEOUT_S)
        return self

    def __exit__(self, *exc: object | TracebackType | None) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(_START_TIMEOUT_S)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(_START_TIMEOUT_S)
        self._loop.close()

    def received(self, path: str) -> list[Request]:
        with self._lock:
            return [r for r in self.requests if r.path == path]

    async def _start(self) -> int:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port: int = self._server.sockets[0].getsockname()[1]
        return port

    async def _stop(self) -> None:
        assert self._server is not None
        self._server.close()
        tasks = [t for t in asyncio.all_tasks(self._loop) if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            try:
                while (request := await _read_request(reader)) is not None:
                    with self._lock:
                        self.requests.append(request)
                    reply = self.respond(request)
                    await self._answer(writer, reply)
                    if isinstance(reply, Pieces):
                        return
            finally:
                writer.close()

    async def _answer(self, writer: asyncio.StreamWriter, reply: Reply) -> None:
        match reply:
            case Whole(status, headers, body):
                writer.write(_head(status, {"content-length": str(len(body)), **headers}) + body)
                await writer.drain()
                self.sent += len(body)
            case Flood(size, prefix, suffix, status, content_type):
                writer.write(_head(status, {"content-type": content_type, "content-length": str(size)}))
                remaining = size - len(prefix) - len(suffix)
                await self._write(writer, prefix)
                while remaining > 0:
                    piece = min(remaining, _PIECE)
                    await self._write(writer, b"x" * piece)
                    remaining -= piece
                await self._write(writer, suffix)
            case Pieces(head, pieces, every_s):
                await self._write(writer, head)
                for piece in pieces:
                    await asyncio.sleep(every_s)
                    await self._write(writer, piece)
            case Drip(body, every_s, status, content_type):
                writer.write(_head(status, {"content-type": content_type, "content-length": str(len(body))}))
                await writer.drain()
                self.dripping.set()
                for byte in body:
                    await self._write(writer, bytes([byte]))
                    await asyncio.sleep(every_s)

    async def _write(self, writer: asyncio.StreamWriter, data: bytes) -> None:
        writer.write(data)
        await writer.drain()
        self.sent += len(data)


def _head(status: int, headers: Mapping[str, str]) -> bytes:
    lines = [f"HTTP/1.1 {status} Hostile", *(f"{name}: {value}" for name, value in headers.items()), "", ""]
    return "\r\n".join(lines).encode()


async def _read_request(reader: asyncio.StreamReader) -> Request | None:
    head = await reader.readuntil(b"\r\n\r\n")
    if len(head) > _MAX_HEAD_BYTES:
        return None
    first, *lines = head.decode("latin-1").split("\r\n")
    method, path, _ = first.split(" ", 2)
    fields = (line.partition(":") for line in lines if line)
    headers = {name.strip().lower(): value.strip() for name, _, value in fields}
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    return Request(method, path, headers, body)


def mcp_responder(call: Callable[[Request], Reply], *, tool: str = "huge") -> Callable[[Request], Reply]:
    """Answers MCP's streamable HTTP as a server with one tool, ``tool``, whose every call ``call`` answers: the
    handshake and ``tools/list`` in JSON, notifications with 202, the listening GET with 405."""

    def respond(request: Request) -> Reply:
        if request.method != "POST":
            return Whole(405)
        message = request.json()
        method, ident = message.get("method"), message.get("id")
        if ident is None:
            return Whole(202)
        if method == "initialize":
            result: dict[str, Any] = {"protocolVersion": message["params"]["protocolVersion"],
                                      "capabilities": {"tools": {}}, "serverInfo": {"name": "hostile", "version": "1"}}
        elif method == "tools/list":
            result = {"tools": [{"name": tool, "description": "answers hostilely",
                                 "inputSchema": {"type": "object"}}]}
        elif method == "tools/call":
            return call(request)
        else:
            return Whole(200, {"content-type": "application/json"},
                         json.dumps({"jsonrpc": "2.0", "id": ident,
                                     "error": {"code": -32601, "message": "no such method"}}).encode())
        return Whole(200, {"content-type": "application/json"},
                     json.dumps({"jsonrpc": "2.0", "id": ident, "result": result}).encode())

    return respond


def tool_result_flood(size: int) -> Callable[[Request], Reply]:
    """A ``tools/call`` answered with a JSON-RPC result whose text content makes the body ``size`` bytes."""

    def call(request: Request) -> Reply:
        prefix = json.dumps({"jsonrpc": "2.0", "id": request.json()["id"]})[:-1].encode()
        return Flood(size, prefix=prefix + b', "result": {"content": [{"type": "text", "text": "',
                     suffix=b'"}]}}')

    return call
