"""MCP progress notifications of the calls in flight, kept for the API, the page and ``runbrake show``
(docs/http-api.md, "Events"), coalesced so that they never stand in a cancel's way (issue 29;
docs/messaging.md, "MCP progress at the transport").

One :class:`ProgressWriter` per worker process's event loop keeps the latest report of each run (a dict
entry: no round trip, no await) and writes what it holds every :data:`FLUSH_INTERVAL_S`, the reports of up to
:data:`BATCH_RUNS` runs in one round trip (``AsyncRunStore.set_progress``), each run's at most once a flush
and each announced on ``<ns>:events``. A call's end awaits nothing: its report still held is dropped, and the
append of its step forgets the stored one and closes the call to a write still on its way (APPEND_STEP and
SET_PROGRESS in shared/), so a cancelled call's step never waits behind a progress write, the per-report
lock or the connection pool it used to share with them (docs/benchmarks.md, "Saturation: where a cancel's time
went").
Progress is a courtesy: a failed write is logged, never a reason to fail the call.
:class:`ProgressSubscriber` is how the worker's subscriber list (worker/subscribers.py) reaches the writer; it
also keeps each call's last :data:`HISTORY_REPORTS` reports and puts them in the call's tool step
(``detail.progress_history``), so the history rides the step's own append: no round trip of its own.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import math
import time
from typing import Any, Final

import structlog

from runbrake.shared.async_store import AsyncRunStore
from runbrake.shared.steps import RunStep, StepKind
from runbrake.worker.conversation import ToolCall
from runbrake.worker.subscribers import Subscriber

log = structlog.get_logger(__name__)

FLUSH_INTERVAL_S: Final = 1.0
"""How often the reports held are written: a run's progress is at most this old, and written at most this often."""
BATCH_RUNS: Final = 25
"""The most runs' reports one round trip writes: a flush of thousands is several round trips, and the loop runs
other callbacks (a cancel's) between them instead of encoding every report at once. Encoding and sending a report
costs the loop about 70 µs (docs/benchmarks.md, "Saturation: where the loop's time went"): 100 a round trip held
it 7 ms at a time, 25 under 2."""
MAX_MESSAGE_CHARS: Final = 500
HISTORY_REPORTS: Final = 50
"""The reports of a call its step keeps (the latest ones)."""
HISTORY_MESSAGE_CHARS: Final = 100
"""A message as the history keeps it: 50 reports stay within about 10 KB of the step."""
ENDED_KEPT: Final = 4096
"""Histories of ended calls held for their steps at most (:class:`ProgressSubscriber`)."""


def _number(value: float | None) -> float | None:
    return value if isinstance(value, int | float) and math.isfinite(value) else None


class ProgressWriter:
    """The latest progress report of each run of one event loop, written in batches (module docstring)."""

    def __init__(self, store: AsyncRunStore, *, interval_s: float = FLUSH_INTERVAL_S) -> None:
        self._store = store
        self._interval_s = interval_s
        self._held: dict[str, dict[str, Any]] = {}
        """Run id → its latest report not written yet."""
        self._flush: asyncio.TimerHandle | asyncio.Task[None] | None = None
        """The flush to come (a timer) or under way (a task); None while nothing is held."""

    def post(self, run_id: str, report: dict[str, Any]) -> None:
        """Keep ``report`` as ``run_id``'s latest (it supersedes one held); written at the next flush. On the loop."""
        self._held[run_id] = report
        if self._flush is None:
            self._flush = asyncio.get_running_loop().call_later(self._interval_s, self._start)

    def call_ended(self, run_id: str, call_id: str) -> None:
        """``call_id`` ended: its report still held is not written (the step's append forgets a stored one)."""
        held = self._held.get(run_id)
        if held is not None and held["tool_call_id"] == call_id:
            del self._held[run_id]

    def _start(self) -> None:
        self._flush = asyncio.get_running_loop().create_task(self._write_held())

    async def _write_held(self) -> None:
        """Write the reports held now, :data:`BATCH_RUNS` runs a round trip; those that come meanwhile wait for
        the next flush. A report of a call that ended meanwhile is refused by its step's append (module docstring)."""
        held, self._held = list(self._held.items()), {}
        try:
            for start in range(0, len(held), BATCH_RUNS):
                batch = dict(held[start:start + BATCH_RUNS])
                try:
                    await self._store.set_progress(batch)
                except Exception as exc:  # noqa: BLE001 - a report must never fail the call it reports on
                    log.warning("progress_write_failed", runs=len(batch), error=repr(exc))
        finally:
            self._flush = None
            if self._held:  # reports that came during the round trips
                self._flush = asyncio.get_running_loop().call_later(self._interval_s, self._start)


class ProgressSubscriber(Subscriber):
    """Hands each run's progress reports to the process's :class:`ProgressWriter`, and each call's history to its
    step, as a subscriber of the worker's list (worker/subscribers.py). The calls of a turn run at once: the
    run's ``progress`` field holds the latest report of any of them."""

    def __init__(self, store: AsyncRunStore) -> None:
        self._writer = ProgressWriter(store)
        self._started: dict[tuple[str, str], float] = {}
        """(run id, call id) → when that call in flight started (epoch seconds)."""
        self._history: dict[tuple[str, str], collections.deque[dict[str, Any]]] = {}
        """(run id, call id) → the last reports of that call in flight."""
        self._ended: collections.OrderedDict[tuple[str, str], collections.deque[dict[str, Any]]] = (
            collections.OrderedDict())
        """The histories of calls that ended, until their steps take them (the next boundary); at most
        :data:`ENDED_KEPT`, the oldest dropped: a call whose run ended otherwise (a bound, a lost lease) has none."""

    def before_tool_call(self, run_id: str, call: ToolCall) -> None:
        self._started[run_id, call.id] = time.time()

    async def on_tool_progress(
        self, run_id: str, call: ToolCall, progress: float, total: float | None, message: str | None
    ) -> None:
        started_at = self._started.get((run_id, call.id))
        if started_at is None:  # the call ended: a report delivered after its end is not written
            return
        now, text = time.time(), None if message is None else str(message)
        self._writer.post(run_id, {
            "tool_server": call.server, "tool_name": call.tool, "tool_call_id": call.id,
            "progress": _number(progress), "total": _number(total),
            "message": None if text is None else text[:MAX_MESSAGE_CHARS],
            "started_at": started_at, "updated_at": now,
        })
        history = self._history.setdefault((run_id, call.id), collections.deque(maxlen=HISTORY_REPORTS))
        history.append({"at": now, "progress": _number(progress), "total": _number(total),
                        "message": None if text is None else text[:HISTORY_MESSAGE_CHARS]})

    async def after_tool_call(self, run_id: str, call: ToolCall) -> None:
        self._started.pop((run_id, call.id), None)
        self._writer.call_ended(run_id, call.id)
        history = self._history.pop((run_id, call.id), None)
        if history:
            self._ended[run_id, call.id] = history
            while len(self._ended) > ENDED_KEPT:
                self._ended.popitem(last=False)

    def before_step(self, run_id: str, step: RunStep) -> RunStep:
        """A call's tool step carries the call's history (``detail.progress_history``), when it reported any."""
        if step.kind is not StepKind.TOOL or step.tool_call_id is None:
            return step
        history = self._ended.pop((run_id, step.tool_call_id), None)
        if not history:
            return step
        return dataclasses.replace(step, detail={**step.detail, "progress_history": list(history)})
