"""A small MCP server for the demo, the tests and the benchmarks.

Run it over streamable HTTP (served at ``/mcp``) or over stdio::

    python -m runbrake.broker.toolbox_server --transport http --port 8765
    python -m runbrake.broker.toolbox_server --transport stdio --events /tmp/toolbox.jsonl

It ships inside the package (not beside it) so that ``runbrake demo`` works from a plain
install of the wheel.

Every tool is ``async def``: a sync tool runs in a worker thread and cannot be
interrupted (docs/pitfalls.md, "Pitfalls: mcp 2.x cancellation"), which would defeat the point of the server.

With ``--events FILE`` each tool call appends JSON lines to FILE, flushed at
once, so another process can count calls and see that a handler observed its
cancellation::

    {"event": "started" | "finished" | "failed" | "cancelled", "tool": "slow",
     "call": 3, "args": {"seconds": 30.0}, "t": 1767225600.123, "pid": 4242}

``call`` numbers the calls this process has received, starting at 1; the events
of one call share it. ``pid`` is the server's process id, so a test can kill the
server in the middle of a call. Over HTTP, a request with a W3C ``traceparent`` header
(a traced worker's: docs/operating.md, "Traces") adds ``{"event": "traceparent", "tool": "",
"call": 0, "args": {"traceparent": …, "method": "POST"}, …}``.

On stdio, stdout is the protocol channel: nothing here prints, and the SDK logs
to stderr.
"""

from __future__ import annotations

import argparse
import hmac
import itertools
import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import anyio
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.shared.exceptions import MCPError
from mcp.types import METHOD_NOT_FOUND, RequestParams
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.types import ASGIApp, Receive, Scope, Send


class _ToolboxServer(MCPServer):
    """The MCP server, with an optional bearer-token check in front of its HTTP app (``--bearer-env``):
    what an internal tool server looks like to a catalog entry with ``headers``."""

    bearer: str | None = None

    def streamable_http_app(self, **kwargs: Any) -> Starlette:
        app = super().streamable_http_app(**kwargs)
        if self.bearer is not None:
            app.add_middleware(_RequireBearer, token=self.bearer)
        app.add_middleware(_RecordTraceparent)
        return app


class _RecordTraceparent:
    """Record the W3C ``traceparent`` of each HTTP request that carries one (event ``traceparent``, the value in
    ``args``): how a test sees that a traced worker's MCP requests continue the run's trace."""

    def __init__(self, app: ASGIApp) -> None:
        self._app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            traceparent = dict(scope["headers"]).get(b"traceparent")
            if traceparent is not None:
                _record("traceparent", "", 0, {"traceparent": traceparent[:100].decode(errors="replace"),
                                               "method": scope.get("method", "")})
        await self._app(scope, receive, send)


class _RequireBearer:
    """Refuse (401) every HTTP request without ``Authorization: Bearer <token>``; compared in constant time."""

    def __init__(self, app: ASGIApp, token: str) -> None:
        self._app = app
        self._expected = f"Bearer {token}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self._expected):
                await PlainTextResponse("missing or wrong bearer token", status_code=401)(scope, receive, send)
                return
        await self._app(scope, receive, send)


mcp = _ToolboxServer("toolbox", log_level="WARNING")

_call_numbers = itertools.count(1)
_events_path: Path | None = None


def _record(event: str, tool: str, call: int, args: dict[str, Any]) -> None:
    if _events_path is None:
        return
    line = json.dumps(
        {"event": event, "tool": tool, "call": call, "args": args, "t": time.time(), "pid": os.getpid()}
    )
    # One short append per event, opened and closed each time: the line is visible to
    # other processes before the handler goes on, which is what a watcher needs.
    with _events_path.open("a", encoding="utf-8") as events:
        events.write(line + "\n")


@contextmanager
def _recorded(tool: str, **args: Any) -> Iterator[None]:
    """Record "started", then "finished", "failed" or "cancelled"; exceptions pass through."""
    call = next(_call_numbers)
    _record("started", tool, call, args)
    try:
        yield
    except anyio.get_cancelled_exc_class():
        _record("cancelled", tool, call, args)
        raise
    except Exception:
        _record("failed", tool, call, args)
        raise
    _record("finished", tool, call, args)


@mcp.tool(name="get-sum", description="Add two integers.")
async def get_sum(a: int, b: int) -> int:
    with _recorded("get-sum", a=a, b=b):
        return a + b


@mcp.tool(description="Always fail with the given message (the result has isError set).")
async def fail(message: str = "the tool failed on purpose") -> str:
    with _recorded("fail", message=message):
        raise ToolError(message)


_progress_s = 1.0
"""How often ``slow`` reports progress (``--progress-s``)."""


@mcp.tool(description="Wait the given number of seconds, then say so. Cancellable. Reports MCP progress "
                      "every second (when the client asked for progress), its message ending with the note.")
async def slow(ctx: Context, seconds: float = 30, note: str = "") -> str:
    # Recorded so a test can tell whether the client asked for progress (RUNBRAKE_MCP_PROGRESS).
    asked = "progress_token" in (ctx.request_context.meta or {})
    with _recorded("slow", seconds=seconds, progress_asked=asked):
        deadline = anyio.current_time() + seconds
        done = 0.0
        while (left := deadline - anyio.current_time()) > 0:
            await anyio.sleep(min(_progress_s, left))
            done += _progress_s
            if done < seconds:
                await ctx.report_progress(done, seconds, f"{done:g} of {seconds:g} s" + (f" {note}" if note else ""))
        return f"slept {seconds} s"


@mcp.tool(description="Return the text unchanged.")
async def echo(text: str) -> str:
    with _recorded("echo", text=text):
        return text


async def headers(ctx: Context) -> str:
    """The HTTP headers of the request that called it, one ``name: value`` a line (nothing over stdio)."""
    with _recorded("headers"):
        return "\n".join(f"{name}: {value}" for name, value in (ctx.headers or {}).items())


async def _no_discover(_ctx: Any, _params: RequestParams | None) -> Any:
    """What a server from before protocol 2026-07-28 answers to ``server/discover``."""
    raise MCPError(code=METHOD_NOT_FOUND, message="Method not found", data="server/discover")


def main() -> None:
    """Parse the command line and serve until killed."""
    global _events_path, _progress_s  # set once, before the server starts
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--transport", choices=["http", "stdio"], default="http",
                        help="streamable HTTP at http://HOST:PORT/mcp, or stdio (default: http)")
    parser.add_argument("--host", default="127.0.0.1", help="HTTP only (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8765, help="HTTP only (default: 8765)")
    parser.add_argument("--events", type=Path, help="append one JSON line per tool event to this file")
    parser.add_argument("--bearer-env", metavar="VAR",
                        help="HTTP only: refuse requests without 'Authorization: Bearer <the value of VAR>'")
    parser.add_argument("--legacy", action="store_true",
                        help="answer as a server from before protocol 2026-07-28: no server/discover, so a client "
                             "falls back to the initialize handshake and a session with its GET stream")
    parser.add_argument("--echo-headers", action="store_true",
                        help="add a tool 'headers' that answers with the HTTP headers of its request, credentials "
                             "included: a server that echoes what the worker sent it (docs/security.md)")
    parser.add_argument("--progress-s", type=float, default=1.0,
                        help="how often the slow tool reports progress, in seconds (default: 1)")
    options = parser.parse_args()
    _events_path, _progress_s = options.events, options.progress_s
    if options.bearer_env:
        mcp.bearer = os.environ[options.bearer_env]
    if options.echo_headers:
        mcp.add_tool(headers, name="headers", description="Return the HTTP headers of this call's request.")
    if options.legacy:
        mcp._lowlevel_server.add_request_handler("server/discover", RequestParams, _no_discover)
    if options.transport == "stdio":
        mcp.run()
    else:
        mcp.run("streamable-http", host=options.host, port=options.port)


if __name__ == "__main__":
    main()
