"""A model endpoint nobody here wrote: PyPI ``llm-mock-api``, served on loopback for a test.

It speaks OpenAI chat completions (``/v1/chat/completions``), the Responses API and Anthropic Messages
(``/v1/messages``), streaming or not, with scripted replies, tool calls, usage and error replies, and it
records every request it received. The server runs its own asyncio loop (uvicorn) in a thread of the test
process, so a test registers rules and reads the history directly, while workers reach it over real HTTP.

    def test_x(llm_mock: LlmMock) -> None:
        llm_mock.server.when("weather").reply(reply(tools=[("srv__get_weather", {"city": "Oslo"})]))
        llm_mock.server.when_tool_result("call_1").reply(reply("Sunny.", usage=(200, 30)))
        llm_mock.server.next_error(429, "slow down")       # the next request only
        ...                                                # point a catalog model at llm_mock.openai_url
        assert llm_mock.requests()[0].system_message == "Be brief."

Rules are matched in order (``first()`` moves one to the front); a string rule matches the last user
message, case-insensitively — and the last user message is the same in every round of a run, so limit such
a rule with ``.times(1)`` or answer a tool result with ``when_tool_result(call_id)``. The Python API takes
reply objects, not dicts: :func:`reply` builds one. Read ``llm_mock_api/types`` in site-packages for the full
rule and reply shapes.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Iterator, Sequence
from concurrent.futures import Future
from typing import Any

import pytest
from llm_mock_api import MockServer, MockServerOptions
from llm_mock_api.types.reply import ErrorReply, Reply, ReplyObject
from llm_mock_api.types.reply import ToolCall as MockToolCall
from llm_mock_api.types.reply import Usage as MockUsage
from llm_mock_api.types.request import MockRequest

_START_TIMEOUT_S = 10.0


class LlmMock:
    """One running ``llm-mock-api`` server and what it received.

    Attributes:
        server: the library's ``MockServer``: ``when``, ``when_tool``, ``when_tool_result``, ``next_error``,
            ``fallback``, ``history``.
        url: its base URL, ``http://127.0.0.1:PORT``.
    """

    def __init__(self, server: MockServer, url: str, *, thread: threading.Thread, stop: threading.Event) -> None:
        self.server = server
        self.url = url
        self._thread = thread
        self._stop = stop

    def close(self) -> None:
        """Stop the server and wait for its thread."""
        self._stop.set()
        self._thread.join(timeout=_START_TIMEOUT_S)

    @property
    def openai_url(self) -> str:
        """The ``base_url`` of an ``openai`` model (chat completions under it)."""
        return f"{self.url}/v1"

    @property
    def anthropic_url(self) -> str:
        """The ``base_url`` of an ``anthropic`` model (the SDK adds ``/v1/messages``)."""
        return self.url

    def requests(self) -> list[MockRequest]:
        """Every request received so far, oldest first, normalised across formats."""
        return [entry.request for entry in self.server.history.all]

    def bodies(self) -> list[dict[str, Any]]:
        """The raw JSON bodies of every request received so far, oldest first."""
        return [entry.request.raw or {} for entry in self.server.history.all]


_Call = tuple[str, dict[str, Any]] | tuple[str, dict[str, Any], str]


def reply(text: str | None = None, *, tools: Sequence[_Call] = (),
          usage: tuple[int, int] | None = None, error: tuple[int, str] | None = None) -> ReplyObject:
    """A reply: ``text``, tool calls as ``(name, arguments)`` or ``(name, arguments, call_id)``, ``usage`` as
    ``(input_tokens, output_tokens)``, or an ``error`` as ``(status, message)``."""
    calls = [MockToolCall(name=t[0], args=t[1], id=t[2] if len(t) > 2 else None) for t in tools]  # type: ignore[misc]
    return ReplyObject(
        text=text,
        tools=calls or None,
        usage=MockUsage(input=usage[0], output=usage[1]) if usage is not None else None,
        error=ErrorReply(status=error[0], message=error[1]) if error is not None else None,
    )


def held_reply(arrived: threading.Event, release: threading.Event, text: str = "too late") -> Callable[
        [MockRequest], Awaitable[Reply]]:
    """A reply that sets ``arrived`` when its request comes and answers ``text`` only once ``release`` is set: a
    model call in flight for as long as the test wants (set ``release`` when the test ends)."""

    async def reply_when_released(_request: MockRequest) -> Reply:
        arrived.set()
        while not release.is_set():  # the server's own loop: let it stop the reply when the test ends
            await asyncio.sleep(0.05)
        return reply(text)

    return reply_when_released


def start_llm_mock(**options: Any) -> LlmMock:
    """Start a server on a free loopback port in a thread of its own (stop it with :meth:`LlmMock.close`).

    ``options`` go to ``MockServerOptions`` (``default_latency`` and ``default_chunk_size`` default to 0 here:
    streamed replies arrive at once unless a rule says otherwise).
    """
    options = {"default_latency": 0, "default_chunk_size": 0, **options}
    server = MockServer(MockServerOptions(host="127.0.0.1", port=0, **options))
    started: Future[str] = Future()
    stop = threading.Event()

    async def serve() -> None:
        try:
            await server.start()
        except BaseException as exc:
            started.set_exception(exc)
            raise
        started.set_result(server.url)
        try:
            while not stop.is_set():
                await asyncio.sleep(0.05)  # the loop's own wake-up to see the stop flag, not a synchronisation
        finally:
            await server.stop()

    thread = threading.Thread(target=asyncio.run, args=(serve(),), name="llm-mock-api", daemon=True)
    thread.start()
    return LlmMock(server, started.result(timeout=_START_TIMEOUT_S), thread=thread, stop=stop)


@pytest.fixture
def llm_mock() -> Iterator[LlmMock]:
    """A fresh ``llm-mock-api`` server for this test (no rules: its fallback answers everything)."""
    mock = start_llm_mock()
    try:
        yield mock
    finally:
        mock.close()
