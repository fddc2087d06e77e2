"""The npm ``@modelcontextprotocol/server-everything`` (it serves 2025-11-25 MCP tasks: its tool
``simulate-research-query`` requires one) behind a counting TCP proxy: a real proxy in a thread of the test
process that forwards every byte both ways and counts the JSON-RPC methods the workers send (``tools/call``,
``tasks/get``, ``tasks/cancel``…), so a test can say the server saw one ``tools/call``.

The server keeps its tasks in memory per MCP session; :meth:`Everything.restart` starts it again on the same port
(behind the same proxy), having forgotten every session and task. Its research task lasts ~4 s; a test that needs
it to stand still while workers come and go pauses the server (SIGSTOP) rather than racing it.

:class:`ExtensionServer` is the same for the 2026-07-28 tasks extension (SEP-2663): tests/tasks_extension_server.py
on PyPI's ``fastmcp-tasks``, no MCP session, its tasks in its memory. The proxy also counts the ``Mcp-Name`` headers.
"""

from __future__ import annotations

import asyncio
import collections
import re
import signal
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from bench._harness import EVERYTHING, TASKS_SERVER, npm_package, python_package
from tests.mcp_helpers import _stop, _wait_until_listening
from tests.ports import free_port

RESEARCH = "simulate-research-query"
_METHOD = re.compile(rb'"method"\s*:\s*"([a-z/_]+)"')
_NAME_HEADER = re.compile(rb"(?im)^mcp-name:[ \t]*([^\r\n]+)")
_SESSION_ENDED = re.compile(rb"(?is)DELETE /[^\r\n]*\r\n(?:[^\r\n]+\r\n)*?mcp-session-id:[ \t]*([^\r\n]+)")
EXTENSION_RESEARCH = "research"


@dataclass
class CountingProxy:
    """A TCP proxy from ``port`` to ``target``; ``methods`` counts the JSON-RPC methods of the requests through it."""

    target: int
    port: int = 0
    methods: collections.Counter[str] = field(default_factory=collections.Counter)
    names: collections.Counter[str] = field(default_factory=collections.Counter)
    """The ``Mcp-Name`` headers of the requests (SEP-2663: a task's id on ``tasks/*``), counted by value."""
    ended: collections.Counter[str] = field(default_factory=collections.Counter)
    """The MCP sessions ended (``DELETE`` with their ``Mcp-Session-Id``), counted by id."""
    _loop: asyncio.AbstractEventLoop | None = None
    _ready: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _writers: set[asyncio.StreamWriter] = field(default_factory=set)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, daemon=True, name="counting-proxy")
        self._thread.start()
        assert self._ready.wait(10), "the counting proxy did not start"

    def stop(self) -> None:
        if self._loop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)

    def _run(self) -> None:
        loop = self._loop = asyncio.new_event_loop()
        server = loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", 0))
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            server.close()
            for writer in self._writers:
                writer.close()
            loop.run_until_complete(_cancel_all(server))
            loop.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection("127.0.0.1", self.target)
        except OSError:
            writer.close()
            return
        self._writers.update((writer, upstream_writer))
        await asyncio.gather(self._pipe(reader, upstream_writer, count=True),
                             self._pipe(upstream_reader, writer, count=False))

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, count: bool) -> None:
        tail = b""
        try:
            while data := await reader.read(65536):
                if count:
                    seen = tail + data
                    for pattern, counter in ((_METHOD, self.methods), (_NAME_HEADER, self.names),
                                             (_SESSION_ENDED, self.ended)):
                        for match in pattern.finditer(seen):
                            if match.end() > len(tail):  # not counted with the previous chunk
                                counter[match.group(1).decode().strip()] += 1
                    tail = seen[-512:]
                writer.write(data)
                await writer.drain()
        except OSError:
            pass
        finally:
            writer.close()
            self._writers.discard(writer)


async def _cancel_all(server: asyncio.Server) -> None:
    tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await server.wait_closed()


@dataclass
class Everything:
    """The server-everything process on ``server_port``, reached through ``proxy``; its URL is the proxy's."""

    proxy: CountingProxy
    server_port: int
    log: Path
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.proxy.port}/mcp"

    def command(self) -> list[str]:
        return ["node", str(npm_package(EVERYTHING) / "dist" / "index.js"), "streamableHttp"]

    def start(self) -> None:
        command = self.command()
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(command, stdout=out, stderr=out, stdin=subprocess.DEVNULL,
                                            env={"PATH": "/usr/local/bin:/usr/bin:/bin", "PORT": str(self.server_port)})
        if not _wait_until_listening(self.process, self.server_port):
            pytest.fail(f"server-everything did not start; its log:\n{self.log.read_text()[-2000:]}")

    def stop(self) -> None:
        if self.process is not None:
            self.resume()
            _stop(self.process)

    def pause(self) -> None:
        """SIGSTOP: the server's tasks stand still (its timers too) and its requests wait, until :meth:`resume`."""
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)

    def restart(self) -> None:
        """Stopped and started again on the same port: every session and task forgotten."""
        self.stop()
        self.start()


class ExtensionServer(Everything):
    """tests/tasks_extension_server.py (the 2026-07-28 tasks extension, on PyPI ``fastmcp-tasks``) in its own venv,
    reached through the counting proxy as :class:`Everything` is; its tasks are kept in its memory."""

    def command(self) -> list[str]:
        return [str(python_package(TASKS_SERVER)), str(Path(__file__).with_name("tasks_extension_server.py")),
                str(self.server_port)]


def _behind_proxy(kind: type[Everything], log: Path) -> Iterator[Everything]:
    """A server of ``kind`` on a free port behind its counting proxy, for the test; stopped after."""
    server_port = free_port()
    proxy = CountingProxy(target=server_port)
    proxy.start()
    server = kind(proxy, server_port, log)
    server.start()
    yield server
    server.stop()
    proxy.stop()


@pytest.fixture(name="tasks_extension")
def tasks_extension_fixture(tmp_path: Path) -> Iterator[Everything]:
    yield from _behind_proxy(ExtensionServer, tmp_path / "tasks-extension.log")


@pytest.fixture(name="everything")
def everything_fixture(tmp_path: Path) -> Iterator[Everything]:
    yield from _behind_proxy(Everything, tmp_path / "everything.log")
