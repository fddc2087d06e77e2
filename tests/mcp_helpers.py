"""The example toolbox MCP server (``runbrake.broker.toolbox_server``) as test fixtures.

Real servers in real processes (docs/development.md, "Development"): over streamable HTTP on a free
loopback port, or over stdio, started by the SDK itself. The server writes one JSON line
per tool event to an events file, which is how a test learns that a call has started on
the server or that its handler saw the cancellation: :func:`wait_for_event` (blocking) and
:func:`wait_for_event_async` (inside an event loop) poll it, bounded.

Import a fixture into a test module to use it; pytest registers it under its ``name=``
(``toolbox``, ``toolbox_http``, ``toolbox_stdio``)::

    from tests.mcp_helpers import toolbox_fixture  # noqa: F401 - registers the `toolbox` fixture
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from runbrake.shared.spec import HttpServerSpec, McpServerSpec, StdioServerSpec
from tests.polling import poll_until, poll_until_async
from tests.ports import free_port

TOOLBOX_SERVER = ("-m", "runbrake.broker.toolbox_server")
SERVER_NAME = "toolbox"
STARTUP_TIMEOUT_S = 20.0
"""Generous: importing the MCP SDK alone takes about a second on an idle machine."""
_POLL_INTERVAL_S = 0.02


class Toolbox(NamedTuple):
    """A running toolbox server: how to reach it, and where it writes its events."""

    spec: McpServerSpec
    events: Path


def stdio_toolbox(events: Path, *, name: str = SERVER_NAME) -> Toolbox:
    """The spec of a toolbox server over stdio; the SDK starts (and stops) it with each connection."""
    args = (*TOOLBOX_SERVER, "--transport", "stdio", "--events", str(events))
    return Toolbox(StdioServerSpec(name=name, command=sys.executable, args=args), events)


@contextmanager
def http_toolbox(
    events: Path, *, name: str = SERVER_NAME, args: tuple[str, ...] = (), env: dict[str, str] | None = None
) -> Iterator[Toolbox]:
    """Start a toolbox server over streamable HTTP (with extra ``args``, in ``env``), wait until it accepts
    connections, stop it afterwards."""
    stderr_path = events.with_suffix(".stderr")
    for _ in range(3):  # another process may take the free port between probe and bind
        port = free_port()
        with stderr_path.open("wb") as stderr:
            process = subprocess.Popen(
                [sys.executable, *TOOLBOX_SERVER, "--transport", "http", "--port", str(port),
                 "--events", str(events), *args],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=stderr,
            )
        try:
            if _wait_until_listening(process, port):
                yield Toolbox(HttpServerSpec(name=name, url=f"http://127.0.0.1:{port}/mcp"), events)
                return
        finally:
            _stop(process)
    pytest.fail(f"the toolbox server did not start over HTTP; its stderr:\n{stderr_path.read_text()}")


def _wait_until_listening(process: subprocess.Popen[bytes], port: int) -> bool:
    """True once the port accepts a connection; False when the process exits first."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            return False
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=_POLL_INTERVAL_S * 10):
                return True
        except OSError:
            time.sleep(_POLL_INTERVAL_S)  # polling, bounded by the deadline
    pytest.fail(f"the toolbox server did not listen on 127.0.0.1:{port} within {STARTUP_TIMEOUT_S:g} s")


def _stop(process: subprocess.Popen[bytes]) -> None:
    """Terminate, then kill if it lingers; always reap."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
    process.wait()


def read_events(events: Path) -> list[dict[str, Any]]:
    """Every event the server has written so far (a partly written last line is left for later)."""
    try:
        text = events.read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in text.splitlines(keepends=True) if line.endswith("\n")]


def matching_events(
    events: Path, event: str, *, tool: str | None = None, call: int | None = None
) -> list[dict[str, Any]]:
    """The events named ``event``, optionally only those of ``tool`` or of one ``call`` number."""
    return [
        entry
        for entry in read_events(events)
        if entry["event"] == event
        and (tool is None or entry["tool"] == tool)
        and (call is None or entry["call"] == call)
    ]


def _timed_out(events: Path, event: str, tool: str | None, count: int, timeout: float) -> str:
    seen = [f"{e['event']} {e['tool']} #{e['call']}" for e in read_events(events)]
    of_tool = f" of tool {tool!r}" if tool else ""
    return f"waited {timeout:g} s for {count} {event!r} event(s){of_tool} in {events}; the server wrote: {seen}"


def wait_for_event(
    events: Path, event: str, *, tool: str | None = None, count: int = 1, timeout: float = 10.0
) -> list[dict[str, Any]]:
    """Block until the server has written ``count`` ``event`` events (of ``tool``); fail the test after ``timeout`` s.

    For benchmarks and threads; inside an event loop use :func:`wait_for_event_async`.
    """
    return poll_until(
        lambda: _at_least(matching_events(events, event, tool=tool), count),
        timeout=timeout, failure=lambda: _timed_out(events, event, tool, count, timeout),
    )


async def wait_for_event_async(
    events: Path, event: str, *, tool: str | None = None, count: int = 1, timeout: float = 10.0
) -> list[dict[str, Any]]:
    """:func:`wait_for_event` without blocking the event loop (the call being watched runs on it)."""
    return await poll_until_async(
        lambda: _at_least(matching_events(events, event, tool=tool), count),
        timeout=timeout, failure=lambda: _timed_out(events, event, tool, count, timeout),
    )


def _at_least(found: list[dict[str, Any]], count: int) -> list[dict[str, Any]] | None:
    return found if len(found) >= count else None


# Each fixture is registered under its ``name=`` and defined under another, so a test
# module can import it without its parameter shadowing the import (ruff F811).


@pytest.fixture(name="toolbox_http")
def toolbox_http_fixture(tmp_path: Path) -> Iterator[Toolbox]:
    """A toolbox server over streamable HTTP, for this test only."""
    with http_toolbox(tmp_path / "toolbox-events.jsonl") as server:
        yield server


@pytest.fixture(name="toolbox_stdio")
def toolbox_stdio_fixture(tmp_path: Path) -> Toolbox:
    """A toolbox server over stdio: each connection starts its own server process."""
    return stdio_toolbox(tmp_path / "toolbox-events.jsonl")


@pytest.fixture(name="toolbox", params=["http", "stdio"])
def toolbox_fixture(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Toolbox]:
    """A toolbox server over each transport in turn."""
    events = tmp_path / "toolbox-events.jsonl"
    if request.param == "stdio":
        yield stdio_toolbox(events)
        return
    with http_toolbox(events) as server:
        yield server
