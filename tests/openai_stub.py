"""A local server speaking the OpenAI chat-completions API, for tests (docs/development.md, "Development").

Tests may not call a real LLM, so ``OpenAIProvider`` talks to this: a small Starlette app
served by uvicorn on a free 127.0.0.1 port in a background thread. It answers
``POST /v1/chat/completions`` from a queue of scripted replies and records every request
body it received.

Use it from any test module through the ``openai_stub`` fixture. Import the fixture
object (pytest registers it under its ``name``; the different Python name keeps ruff's
F811 quiet when a test takes ``openai_stub`` as an argument)::

    from tests.openai_stub import OpenAIStub, openai_stub_fixture  # noqa: F401 - registers the fixture

    async def test_something(openai_stub: OpenAIStub) -> None:
        openai_stub.reply(content="Hello")
        spec = OpenAIModel(base_url=openai_stub.base_url, model="stub")
        ...
        assert openai_stub.requests[0]["messages"][0]["role"] == "user"

(``pytest_plugins = ["tests.openai_stub"]`` in the top-level ``tests/conftest.py`` would make
it available everywhere instead.)

A reply can carry ``delay_s`` (the stand-in for a slow model). The delay ends early when
the client disconnects (as a cancelled request does) or the stub stops, so a cancelled
test never waits it out and stopping never hangs. ``await stub.wait_for_requests(n)``
waits (bounded) until ``n`` requests have arrived, e.g. before cancelling a slow one.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import json
import socket
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.to_thread
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

_START_TIMEOUT_S = 10.0
_STOP_TIMEOUT_S = 10.0


@dataclass(frozen=True, slots=True)
class StubToolCall:
    """A tool call the stub answers with; ``arguments`` as a string is sent verbatim (e.g. broken JSON)."""

    name: str
    arguments: Mapping[str, Any] | str = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class StubReply:
    """One scripted answer: content and/or tool calls, or an HTTP error ``status`` (with ``headers``, e.g. a
    ``Retry-After``, which llm-mock-api's error replies cannot carry)."""

    content: str | None = None
    tool_calls: tuple[StubToolCall, ...] = ()
    delay_s: float = 0.0
    status: int = 200
    error_message: str = "stub error"
    headers: Mapping[str, str] = field(default_factory=dict)


class OpenAIStub:
    """The running stub: enqueue replies with :meth:`reply`, read what arrived in :attr:`requests`."""

    def __init__(self) -> None:
        self._replies: deque[StubReply] = deque()
        self._requests: list[dict[str, Any]] = []
        self._headers: list[dict[str, str]] = []
        self._arrived = threading.Condition()
        self._ids = itertools.count(1)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closing: anyio.Event | None = None
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.bind(("127.0.0.1", 0))
        self.port: int = self._socket.getsockname()[1]
        self._server = _Server(
            uvicorn.Config(
                self._app(),
                lifespan="on",
                http="h11",
                # No websockets: nothing here needs them, and importing them warns on some versions.
                ws="none",
                # Leave the test process's logging configuration alone.
                log_config=None,
                access_log=False,
            )
        )
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._socket]}, name="openai-stub", daemon=True
        )

    @property
    def base_url(self) -> str:
        """The ``base_url`` to put in an ``openai`` model spec."""
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def requests(self) -> list[dict[str, Any]]:
        """The JSON bodies received so far, oldest first (a copy)."""
        with self._arrived:
            return list(self._requests)

    @property
    def headers(self) -> list[dict[str, str]]:
        """The headers of each request received, in the order of :attr:`requests` (a copy)."""
        with self._arrived:
            return list(self._headers)

    def reply(
        self,
        content: str | None = None,
        *,
        tool_calls: tuple[StubToolCall, ...] | list[StubToolCall] = (),
        delay_s: float = 0.0,
        status: int = 200,
        error_message: str = "stub error",
        headers: Mapping[str, str] | None = None,
    ) -> None:
        """Queue the answer to the next request that finds the queue non-empty."""
        with self._arrived:
            self._replies.append(StubReply(content, tuple(tool_calls), delay_s, status, error_message,
                                           dict(headers or {})))

    def wait_for_requests_blocking(self, count: int = 1, timeout: float = 10.0) -> None:
        """Block until ``count`` requests have arrived.

        Raises:
            TimeoutError: when they have not within ``timeout`` seconds.
        """
        with self._arrived:
            if not self._arrived.wait_for(lambda: len(self._requests) >= count, timeout):
                raise TimeoutError(f"{len(self._requests)} of {count} requests arrived in {timeout}s")

    async def wait_for_requests(self, count: int = 1, timeout: float = 10.0) -> None:
        """Wait, without blocking the event loop, until ``count`` requests have arrived."""
        await anyio.to_thread.run_sync(self.wait_for_requests_blocking, count, timeout, abandon_on_cancel=True)

    def start(self) -> None:
        """Start serving; returns once uvicorn reports it started (bounded).

        Raises:
            RuntimeError: when uvicorn did not start within the bound.
        """
        self._thread.start()
        if not self._server.startup_done.wait(_START_TIMEOUT_S) or not self._server.started:
            raise RuntimeError("the OpenAI stub did not start")

    def stop(self) -> None:
        """Release delayed replies, stop uvicorn and join its thread (bounded); idempotent."""
        if self._thread.is_alive() and self._loop is not None and self._closing is not None:
            self._loop.call_soon_threadsafe(self._closing.set)
        self._server.should_exit = True
        self._thread.join(_STOP_TIMEOUT_S)
        self._socket.close()
        if self._thread.is_alive():
            raise RuntimeError("the OpenAI stub did not stop")

    def _app(self) -> Starlette:
        @contextlib.asynccontextmanager
        async def lifespan(_: Starlette) -> AsyncIterator[None]:
            self._loop = asyncio.get_running_loop()
            self._closing = anyio.Event()
            yield

        return Starlette(
            routes=[Route("/v1/chat/completions", self._chat_completions, methods=["POST"])],
            lifespan=lifespan,
        )

    async def _chat_completions(self, request: Request) -> JSONResponse:
        body = await request.json()
        with self._arrived:
            self._requests.append(body)
            self._headers.append(dict(request.headers))
            self._arrived.notify_all()
            reply = self._replies.popleft() if self._replies else None
        if reply is None:
            return _error(500, "the OpenAI stub has no scripted reply left")
        if reply.delay_s:
            await self._delay(request, reply.delay_s)
        if reply.status != 200:
            return _error(reply.status, reply.error_message, reply.headers)
        return JSONResponse(self._completion(body, reply))

    async def _delay(self, request: Request, seconds: float) -> None:
        """Sleep ``seconds``, or less if the client disconnects or the stub stops."""
        assert self._closing is not None

        async def disconnected() -> None:
            # The body is read, so the next ASGI message is http.disconnect: the client gave up.
            while (await request.receive())["type"] != "http.disconnect":
                pass

        async with anyio.create_task_group() as tg:

            async def then_stop(wait: Callable[[], Awaitable[object]]) -> None:
                await wait()
                tg.cancel_scope.cancel()

            tg.start_soon(then_stop, functools.partial(anyio.sleep, seconds))
            tg.start_soon(then_stop, disconnected)
            tg.start_soon(then_stop, self._closing.wait)

    def _completion(self, body: Mapping[str, Any], reply: StubReply) -> dict[str, Any]:
        number = next(self._ids)
        calls = [
            {
                "id": f"call_stub_{number}_{n}",
                "type": "function",
                "function": {
                    "name": call.name,
                    "arguments": call.arguments
                    if isinstance(call.arguments, str)
                    else json.dumps(dict(call.arguments)),
                },
            }
            for n, call in enumerate(reply.tool_calls)
        ]
        message: dict[str, Any] = {"role": "assistant", "content": reply.content}
        if calls:
            message["tool_calls"] = calls
        return {
            "id": f"chatcmpl-stub-{number}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model", "stub"),
            "choices": [{"index": 0, "message": message, "finish_reason": "tool_calls" if calls else "stop"}],
            "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
        }


class _Server(uvicorn.Server):
    """uvicorn's server with an event for "startup finished", which uvicorn only offers as a flag."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.startup_done = threading.Event()

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        try:
            await super().startup(sockets)
        finally:
            # Also on failure (uvicorn then exits the thread), so start() stops waiting at once.
            self.startup_done.set()


def _error(status: int, message: str, headers: Mapping[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "stub_error", "code": None}}, status_code=status,
                        headers=dict(headers or {}))


@pytest.fixture(name="openai_stub")
def openai_stub_fixture() -> Iterator[OpenAIStub]:
    """A started :class:`OpenAIStub`, stopped after the test."""
    stub = OpenAIStub()
    stub.start()
    try:
        yield stub
    finally:
        stub.stop()
