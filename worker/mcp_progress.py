"""MCP progress notifications of this worker's calls, handled where they come in: at the transport boundary,
before the MCP SDK's dispatcher sees them (issue 20; docs/messaging.md, "MCP progress at the transport").

Why: for every ``notifications/progress`` the SDK's ``JSONRPCDispatcher`` spawns two anyio tasks (the
progress callback, and its own notification handler, which validates the notification with pydantic only
to hand it to a no-op message handler). With hundreds of calls each reporting every second that was most
of a worker's event loop (bench/notifications.py; docs/benchmarks.md, "Notifications per process").
The SDK has no supported hook that takes a progress notification inline (its
``on_notify_intercept`` runs only after the progress task is spawned, and only the client's own), so:

- :class:`ProgressRoutes` gives each call its own progress token (``_meta.progressToken`` of the request,
  as MCP's progress utility specifies; the call is made without the SDK's ``progress_callback``, so the
  SDK asks for no progress of its own);
- :class:`ProgressTap` wraps the transport's read stream: a progress notification naming one of those
  tokens is taken out of the stream and handed to its route; every other message passes unchanged;
- a route keeps the latest report and wakes one task per call (not per notification), which awaits the
  callback: the read path never waits on a callback, and a callback slower than the reports sees the
  latest (progress is "how far along now", docs/http-api.md, "Events").

What it relies on in the SDK is only public: the ``Transport`` protocol (an async context manager of a
read and a write stream), ``SessionMessage`` and the JSON-RPC types, and ``Client.call_tool(meta=…)``.
tests/test_mcp_progress.py fails when any of these changes under it. One thing it does because of how the SDK is
built, not what it promises: the SDK's dispatcher keeps the last message it read until the next one, so the tap
empties a ``tools/list`` answer once it has been read (:meth:`ProgressRoutes.drop_tools`); were that no longer
so, emptying it would change nothing.
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from types import TracebackType
from typing import Any, Final, Self, cast

import anyio
import structlog
from anyio.abc import TaskGroup
from mcp.client import Transport
from mcp.client._transport import TransportStreams
from mcp.shared.dispatcher import ProgressFnT
from mcp.shared.message import SessionMessage
from mcp_types import JSONRPCNotification, JSONRPCResponse, RequestParamsMeta

__all__ = ["ProgressRoutes", "ProgressTap"]

log = structlog.get_logger(__name__)

_PROGRESS: Final = "notifications/progress"
_tokens = itertools.count(1)
_PREFIX: Final = f"runbrake-{os.getpid()}-"


class _Route:
    """One call's progress: the latest report, and the task that hands it to the callback."""

    def __init__(self, callback: ProgressFnT) -> None:
        self._callback = callback
        self._latest: tuple[float, float | None, str | None] | None = None
        self._wake = anyio.Event()
        self._ended = False

    def post(self, progress: float, total: float | None, message: str | None) -> None:
        """The read path's part: keep the report, wake the deliverer; never blocks."""
        self._latest = (progress, total, message)
        self._wake.set()

    def end(self) -> None:
        """The call ended: the deliverer hands over the last report it was given, if it has not yet, and stops."""
        self._ended = True
        self._wake.set()

    async def deliver(self) -> None:
        """Hand each latest report to the callback until the call ended; a callback that raises is logged."""
        while True:
            await self._wake.wait()
            self._wake = anyio.Event()
            report, self._latest = self._latest, None
            if report is not None:
                try:
                    await self._callback(*report)
                except Exception:
                    log.exception("progress_callback_failed")
            if self._ended:
                return


class ProgressRoutes:
    """The progress tokens of one connection's calls in flight, and what each one's reports go to."""

    def __init__(self) -> None:
        self._routes: dict[str, _Route] = {}
        self._last_answer: JSONRPCResponse | None = None
        """The last answer the tap passed on: the SDK's dispatcher keeps it as its loop's variable until the next
        message comes, and a run in a long call gets none but its progress, taken out here (:meth:`drop_tools`)."""

    def passed(self, item: SessionMessage | Exception) -> None:
        """The tap passed ``item`` on to the SDK."""
        if isinstance(item, SessionMessage) and isinstance(item.message, JSONRPCResponse):
            self._last_answer = item.message

    def drop_tools(self) -> None:
        """Empty the last answer passed on if it is a ``tools/list`` answer, once its caller has what it answered
        (the SDK validated it into a result of its own): the dispatcher would otherwise keep the whole listing
        for as long as the run's first call lasts, about 40 KiB a run of the npm reference server's
        (docs/benchmarks.md, "Saturation: memory per run")."""
        answer, self._last_answer = self._last_answer, None
        if answer is not None and "tools" in answer.result:
            answer.result = {}

    @contextmanager
    def route(self, callback: ProgressFnT, tasks: TaskGroup) -> Iterator[RequestParamsMeta]:
        """A token for one call while the block runs; yields the request ``_meta`` that asks for its progress.

        The task handing ``callback`` the reports runs in ``tasks`` (the connection's, outside the call's
        cancel scopes, as the SDK's own progress tasks are): an interrupted call never cuts a report's
        write off halfway. Every report that came before the call's end reaches ``callback`` or is
        superseded by a later one; the task ends after the last.
        """
        token = f"{_PREFIX}{next(_tokens)}"
        route = self._routes[token] = _Route(callback)
        tasks.start_soon(route.deliver)
        try:
            yield {"progress_token": token}  # progressToken on the wire (RequestParams' alias)
        finally:
            del self._routes[token]
            route.end()

    def take(self, item: SessionMessage | Exception) -> bool:
        """Whether ``item`` is a progress notification of one of these calls (then its route has it)."""
        if not isinstance(item, SessionMessage):
            return False
        message = item.message
        if not isinstance(message, JSONRPCNotification) or message.method != _PROGRESS:
            return False
        params = message.params
        if params is None:
            return False
        token = params.get("progressToken")
        route = self._routes.get(token) if isinstance(token, str) else None
        if route is None:
            return False  # not ours: the SDK handles it as before
        progress = params.get("progress")
        if not _finite(progress):
            return True  # ours, and malformed: dropped here, as the SDK drops it
        total, text = params.get("total"), params.get("message")
        route.post(float(cast("float", progress)), float(cast("float", total)) if _finite(total) else None,
                   text if isinstance(text, str) else None)
        return True


def _finite(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


class _TappedReadStream:
    """The transport's read stream with this connection's progress notifications taken out."""

    def __init__(self, inner: Any, routes: ProgressRoutes) -> None:
        self._inner = inner
        self._routes = routes

    @property
    def last_context(self) -> Any:
        # The dispatcher reads the sender's contextvars snapshot from the stream, duck-typed.
        return getattr(self._inner, "last_context", None)

    async def receive(self) -> SessionMessage | Exception:
        while True:
            item: SessionMessage | Exception = await self._inner.receive()
            if not self._routes.take(item):
                self._routes.passed(item)
                return item

    async def aclose(self) -> None:
        await self._inner.aclose()

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> SessionMessage | Exception:
        try:
            return await self.receive()
        except anyio.EndOfStream:
            raise StopAsyncIteration from None

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()


class ProgressTap:
    """A ``Transport`` that is ``inner`` with its progress notifications for ``routes`` taken out."""

    def __init__(self, inner: Transport, routes: ProgressRoutes) -> None:
        self._inner = inner
        self._routes = routes

    async def __aenter__(self) -> TransportStreams:
        read, write = await self._inner.__aenter__()
        tapped: Any = _TappedReadStream(read, self._routes)
        return tapped, write

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        return await self._inner.__aexit__(exc_type, exc, tb)
