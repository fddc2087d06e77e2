"""MCP progress notifications of the call in flight, kept for the API, the page and ``runbrake show``
(docs/http-api.md, "Events").

A :class:`ProgressReporter` belongs to one segment of one run, on the worker's event loop. For each
tool call it hands the MCP SDK a progress callback (:meth:`ProgressReporter.for_call`) that stores
the latest report in the run's ``progress`` field and announces it on ``<ns>:events``
(``AsyncRunStore.set_progress``), at most one write per call per :data:`MIN_INTERVAL_S`: a report
inside the window is superseded by the next one after it. When the call ends, :meth:`ProgressReporter.
call_ended` forgets the report (one HDEL, only for calls that reported), before the call's step is
recorded. A lock orders the writes: a report still being written when the call ends lands before the
clear, and none is written after it. Progress is a courtesy: a failed write is logged, never a reason
to fail the call. :class:`ProgressSubscriber` is how the worker's subscriber list (worker/subscribers.py)
reaches a reporter per call.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any, Final

import anyio
import structlog
from mcp.shared.dispatcher import ProgressFnT

from runbrake.shared.async_store import AsyncRunStore
from runbrake.worker.conversation import ToolCall
from runbrake.worker.subscribers import Subscriber

log = structlog.get_logger(__name__)

MIN_INTERVAL_S: Final = 2.0
MAX_MESSAGE_CHARS: Final = 500

def _number(value: float | None) -> float | None:
    return value if isinstance(value, int | float) and math.isfinite(value) else None


class ProgressReporter:
    """The progress of one tool call of a segment (:class:`ProgressSubscriber` makes one per call)."""

    def __init__(self, store: AsyncRunStore, run_id: str, *, min_interval_s: float = MIN_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._store = store
        self._run_id = run_id
        self._min_interval_s = min_interval_s
        self._clock = clock
        self._lock = anyio.Lock()
        self._open: str | None = None
        """The call whose reports are written; None once it ended."""
        self._written = False
        self._last_write = -math.inf

    def for_call(self, call: ToolCall) -> ProgressFnT:
        """The callback for ``call``'s reports; the call is in flight from now until :meth:`call_ended`."""
        self._open, self._written, self._last_write = call.id, False, -math.inf
        started_at = time.time()

        async def report(progress: float, total: float | None, message: str | None) -> None:
            now = self._clock()
            if self._open != call.id or now - self._last_write < self._min_interval_s:
                return
            self._last_write = now
            body: dict[str, Any] = {
                "tool_server": call.server, "tool_name": call.tool, "tool_call_id": call.id,
                "progress": _number(progress), "total": _number(total),
                "message": None if message is None else str(message)[:MAX_MESSAGE_CHARS],
                "started_at": started_at, "updated_at": time.time(),
            }
            async with self._lock:
                if self._open != call.id:
                    return
                try:
                    written = await self._store.set_progress(self._run_id, body)
                except Exception as exc:  # noqa: BLE001 - a report must never fail the call it reports on
                    log.warning("progress_write_failed", error=repr(exc))
                    return
                self._written = self._written or written

        return report

    async def call_ended(self) -> None:
        """The call in flight ended: no more reports for it, and the one stored is forgotten."""
        async with self._lock:
            self._open = None
            if self._written:
                self._written = False
                await self._store.clear_progress(self._run_id)


class ProgressSubscriber(Subscriber):
    """Keeps the progress of each run's call in flight (a :class:`ProgressReporter` per call), as a
    subscriber of the worker's list (worker/subscribers.py)."""

    def __init__(self, store: AsyncRunStore) -> None:
        self._store = store
        self._open: dict[tuple[str, str], tuple[ProgressReporter, ProgressFnT]] = {}
        """(run id, call id) → the reporter of that call in flight and its callback. The calls of a turn run
        at once: the run's ``progress`` field holds the latest report of any of them."""

    def before_tool_call(self, run_id: str, call: ToolCall) -> None:
        reporter = ProgressReporter(self._store, run_id)
        self._open[run_id, call.id] = (reporter, reporter.for_call(call))

    async def on_tool_progress(
        self, run_id: str, call: ToolCall, progress: float, total: float | None, message: str | None
    ) -> None:
        opened = self._open.get((run_id, call.id))
        if opened is not None:
            await opened[1](progress, total, message)

    async def after_tool_call(self, run_id: str, call: ToolCall) -> None:
        opened = self._open.pop((run_id, call.id), None)
        if opened is not None:
            await opened[0].call_ended()
