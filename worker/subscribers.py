"""What happens to the runs a worker executes, told to one list of subscribers (docs/architecture.md, "The
subscriber list").

Modelled on Dramatiq's middleware (dramatiq/middleware/middleware.py): a :class:`Subscriber` has one method
per event, each a no-op unless a subclass overrides it, and :class:`Subscribers` tells every subscriber of
the list, in order. The runtime says each event once, here; it knows nothing of who listens. The metrics
(``worker/metrics.py``, ``MetricsSubscriber``) and the progress of the call in flight (``worker/progress.py``,
``ProgressSubscriber``) are subscribers, and so are traces (``worker/tracing.py``, ``TracingSubscriber``, with
``RUNBRAKE_OTEL=true``); events on RabbitMQ and webhooks can be more.

Everything here runs on the worker's event loop. A subscriber that raises is logged and skipped: it never
fails a run (a ``BaseException``, the loop's cancellation above all, still passes).
"""

from __future__ import annotations

from collections.abc import Sequence

import structlog
from mcp.shared.dispatcher import ProgressFnT

from runbrake.shared.catalog import AdmittedRun
from runbrake.shared.status import RunStatus, TerminationReason
from runbrake.shared.steps import RunStep
from runbrake.worker.conversation import ToolCall

log = structlog.get_logger(__name__)


class Subscriber:
    """A listener to the runs of one worker process. Override the hooks you need; the others do nothing."""

    def after_skip(self, run_id: str, found: RunStatus | None) -> None:
        """A run message was acked as a no-op: its run was ``found`` in a status it may not claim (None:
        no such run)."""

    def after_admit(self, run_id: str, admitted: AdmittedRun) -> None:
        """The claimed run's spec was admitted: its model and servers are resolved (the segment runs next)."""

    def after_status(self, run_id: str, status: RunStatus) -> None:
        """This worker moved the run to a status that is not terminal: ``running`` (claimed, or resumed),
        ``waiting_for_approval`` (suspended), ``queued`` (handed over at shutdown)."""

    def before_step(self, run_id: str, step: RunStep) -> RunStep:
        """A step of the run is about to be recorded; answers it as it should be (a subscriber may add to its
        ``detail``: the progress history of a tool step, worker/progress.py)."""
        return step

    async def after_step(self, run_id: str, step: RunStep) -> None:
        """A step of the run was recorded (``step`` as stored: with its ``sequence`` and ``recorded_at``)."""

    def after_settle(self, run_id: str, status: RunStatus, reason: TerminationReason | None) -> None:
        """The run ended during this worker's segment, in ``status``: settled here, or cancelled by its
        operator (``reason`` None when another writer ended it and its reason is not known here)."""

    def before_tool_call(self, run_id: str, call: ToolCall) -> None:
        """A tool call starts on its MCP server."""

    async def on_tool_progress(
        self, run_id: str, call: ToolCall, progress: float, total: float | None, message: str | None
    ) -> None:
        """The MCP server reported progress of ``call`` (a notification, as the server sent it)."""

    async def after_tool_call(self, run_id: str, call: ToolCall) -> None:
        """``call`` ended, however it did; its step is recorded after this."""


_HOOKS = ("after_skip", "after_admit", "after_status", "before_step", "after_step", "after_settle", "before_tool_call",
          "on_tool_progress", "after_tool_call")


def _listeners(subscribers: Sequence[Subscriber], hook: str) -> tuple[Subscriber, ...]:
    """The subscribers that override ``hook``: an event nobody hears costs no call."""
    default = getattr(Subscriber, hook)
    return tuple(s for s in subscribers if getattr(type(s), hook) is not default)


class Subscribers:
    """The subscriber list of one worker process, told each event in order."""

    def __init__(self, subscribers: Sequence[Subscriber] = ()) -> None:
        self.subscribers = tuple(subscribers)
        by_hook = {hook: _listeners(self.subscribers, hook) for hook in _HOOKS}
        self._skip = by_hook["after_skip"]
        self._admit = by_hook["after_admit"]
        self._status = by_hook["after_status"]
        self._before_step = by_hook["before_step"]
        self._step = by_hook["after_step"]
        self._settle = by_hook["after_settle"]
        self._call_started = by_hook["before_tool_call"]
        self._progress = by_hook["on_tool_progress"]
        self._call_ended = by_hook["after_tool_call"]

    def skip(self, run_id: str, found: RunStatus | None) -> None:
        for subscriber in self._skip:
            try:
                subscriber.after_skip(run_id, found)
            except Exception:  # noqa: BLE001 - a subscriber never fails a run
                _failed(subscriber, "after_skip")

    def admit(self, run_id: str, admitted: AdmittedRun) -> None:
        for subscriber in self._admit:
            try:
                subscriber.after_admit(run_id, admitted)
            except Exception:  # noqa: BLE001 - a subscriber never fails a run
                _failed(subscriber, "after_admit")

    def status(self, run_id: str, status: RunStatus) -> None:
        for subscriber in self._status:
            try:
                subscriber.after_status(run_id, status)
            except Exception:  # noqa: BLE001 - a subscriber never fails a run
                _failed(subscriber, "after_status")

    def before_step(self, run_id: str, step: RunStep) -> RunStep:
        for subscriber in self._before_step:
            try:
                step = subscriber.before_step(run_id, step)
            except Exception:  # noqa: BLE001 - a subscriber never fails a run
                _failed(subscriber, "before_step")
        return step

    async def step(self, run_id: str, step: RunStep) -> None:
        for subscriber in self._step:
            try:
                await subscriber.after_step(run_id, step)
            except Exception:  # noqa: BLE001 - a subscriber never fails a run
                _failed(subscriber, "after_step")

    def settle(self, run_id: str, status: RunStatus, reason: TerminationReason | None) -> None:
        for subscriber in self._settle:
            try:
                subscriber.after_settle(run_id, status, reason)
            except Exception:  # noqa: BLE001 - a subscriber never fails a run
                _failed(subscriber, "after_settle")

    def tool_calls(self, run_id: str) -> ToolCallEvents | None:
        """What the run's toolbox tells of each call; None when no subscriber hears tool calls."""
        if not (self._call_started or self._progress or self._call_ended):
            return None
        return ToolCallEvents(self, run_id)


class ToolCallEvents:
    """One run's tool-call events, as its toolbox (worker/toolbox.py) says them; the calls of a turn run at
    once, so each event names its call."""

    def __init__(self, subscribers: Subscribers, run_id: str) -> None:
        self._subscribers = subscribers
        self._run_id = run_id

    def for_call(self, call: ToolCall) -> ProgressFnT | None:
        """``call`` starts; returns the progress callback to hand the MCP SDK (None: nobody listens)."""
        run_id = self._run_id
        for subscriber in self._subscribers._call_started:
            try:
                subscriber.before_tool_call(run_id, call)
            except Exception:  # noqa: BLE001 - a subscriber never fails a run
                _failed(subscriber, "before_tool_call")
        listeners = self._subscribers._progress
        if not listeners:
            return None

        async def report(progress: float, total: float | None, message: str | None) -> None:
            for subscriber in listeners:
                try:
                    await subscriber.on_tool_progress(run_id, call, progress, total, message)
                except Exception:  # noqa: BLE001 - a report must never fail the call it reports on
                    _failed(subscriber, "on_tool_progress")

        return report

    async def call_ended(self, call: ToolCall) -> None:
        """``call`` (started by :meth:`for_call`) ended."""
        for subscriber in self._subscribers._call_ended:
            try:
                await subscriber.after_tool_call(self._run_id, call)
            except Exception:  # noqa: BLE001 - a subscriber never fails a run
                _failed(subscriber, "after_tool_call")


def _failed(subscriber: Subscriber, hook: str) -> None:
    log.exception("subscriber_failed", subscriber=type(subscriber).__name__, hook=hook)
