"""The worker's spans: each model call and each tool call of a run, as children of its segment's span
(docs/operating.md, "Traces").

A subscriber (worker/subscribers.py), imported only with ``RUNBRAKE_OTEL=true`` (worker/runtime.py,
``default_subscribers``). The segment's span is the runtime's (``runbrake.run.segment``, current for the whole
segment); everything here happens on the segment's own task, or for a tool call on the task the turn runs it
in (worker/loop.py: the calls of a turn run at once, each task with a copy of the segment's context), so what a
run has open is kept in context variables of that task, never in a map keyed by run that a segment ending
early would leave behind.

- A model call becomes a span when its step is recorded, timed from the step (``recorded_at`` less its
  ``duration_ms``), with the GenAI semantic conventions' attributes (``gen_ai.operation.name = chat``,
  ``gen_ai.system``, ``gen_ai.request.model``, ``gen_ai.usage.input_tokens`` and ``…output_tokens`` when the
  step's ``detail.usage`` has them).
- A tool call's span (``execute_tool <tool>``) starts with the call and is current while it is on its MCP
  server, so the HTTP request's ``traceparent`` (worker/mcp_transport.py) and the MCP SDK's ``params._meta``
  name it; it ends when its step is recorded, with the outcome.
- A cancelled call's span gets the event ``runbrake.cancel`` with the latency from the cancel request to the
  step (the same figure as ``runbrake_cancel_latency_seconds``).
"""

from __future__ import annotations

import contextvars
from collections.abc import Mapping
from typing import Any, Final

from opentelemetry import context, trace

from runbrake.shared import tracing
from runbrake.shared.async_store import AsyncRunStore
from runbrake.shared.catalog import AdmittedRun
from runbrake.shared.outcome import ToolOutcome
from runbrake.shared.status import RunStatus, TerminationReason
from runbrake.shared.steps import RunStep, StepKind
from runbrake.worker.conversation import ToolCall
from runbrake.worker.subscribers import Subscriber

TRACER_NAME: Final = "runbrake.worker"

_model: contextvars.ContextVar[Mapping[str, str] | None] = contextvars.ContextVar("runbrake_traced_model",
                                                                                   default=None)
"""The segment's model, as GenAI attributes (set at admission)."""
_tool: contextvars.ContextVar[trace.Span | None] = contextvars.ContextVar("runbrake_traced_tool", default=None)
"""The segment's tool call whose step is not recorded yet."""
_attached: contextvars.ContextVar[object | None] = contextvars.ContextVar("runbrake_traced_tool_token",
                                                                          default=None)
"""The token that made the tool call's span current, while the call is on its server."""


def model_attributes(admitted: AdmittedRun) -> dict[str, str]:
    """``gen_ai.system`` (the provider) and ``gen_ai.request.model`` (the model's name; the provider's for
    ``scripted``)."""
    model = admitted.model
    return {"gen_ai.system": model.provider, "gen_ai.request.model": str(getattr(model, "model", model.provider))}


def _ns(seconds: float) -> int:
    return int(seconds * 1_000_000_000)


class TracingSubscriber(Subscriber):
    """Spans for a run's model calls and tool calls (module docstring)."""

    def __init__(self, store: AsyncRunStore, tracer: trace.Tracer | None = None) -> None:
        """``tracer``: on the process's provider (shared/tracing.py, ``current``) unless given."""
        self._store = store
        """Read for a cancelled call's cancel request: its latency runs from the request to the step."""
        self._tracer: trace.Tracer = tracing.current().tracer(TRACER_NAME) if tracer is None else tracer

    def after_admit(self, run_id: str, admitted: AdmittedRun) -> None:
        attributes = model_attributes(admitted)
        _model.set(attributes)
        trace.get_current_span().set_attributes(attributes)

    def before_tool_call(self, run_id: str, call: ToolCall) -> None:
        span = self._tracer.start_span(f"execute_tool {call.tool}", attributes={
            "gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": call.tool,
            "gen_ai.tool.call.id": call.id, "runbrake.run_id": run_id, "runbrake.tool.server": call.server,
        })
        _tool.set(span)
        _attached.set(context.attach(trace.set_span_in_context(span)))

    async def after_tool_call(self, run_id: str, call: ToolCall) -> None:
        token = _attached.get()
        if token is not None:
            _attached.set(None)
            context.detach(token)  # type: ignore[arg-type]

    async def after_step(self, run_id: str, step: RunStep) -> None:
        if step.kind is StepKind.MODEL:
            await self._model_span(run_id, step)
        elif step.kind is StepKind.TOOL:
            await self._end_tool_span(run_id, step)

    def after_settle(self, run_id: str, status: RunStatus, reason: TerminationReason | None) -> None:
        attributes: dict[str, Any] = {"runbrake.run.status": status.value}
        if reason is not None:
            attributes["runbrake.run.termination_reason"] = reason.value
        trace.get_current_span().set_attributes(attributes)

    async def _model_span(self, run_id: str, step: RunStep) -> None:
        attributes: dict[str, Any] = {"gen_ai.operation.name": "chat", "runbrake.run_id": run_id,
                                      "runbrake.round": step.round, "runbrake.step.sequence": step.sequence,
                                      **(_model.get() or {})}
        usage = step.detail.get("usage")
        if isinstance(usage, Mapping):
            for key in ("input_tokens", "output_tokens"):
                if type(usage.get(key)) is int:
                    attributes[f"gen_ai.usage.{key}"] = usage[key]
        if step.interrupted:
            attributes["runbrake.interrupted"] = True
        end = _ns(step.recorded_at)
        span = self._tracer.start_span(f"chat {attributes.get('gen_ai.request.model', '')}".strip(),
                                       attributes=attributes, start_time=end - step.duration_ms * 1_000_000,
                                       kind=trace.SpanKind.CLIENT)
        if step.error is not None:
            span.set_attribute("error.type", "provider_failed")
            span.set_status(trace.StatusCode.ERROR, step.error[:200])
        if step.interrupted:
            await self._cancel_event(run_id, span, step)
        span.end(end_time=end)

    async def _cancel_event(self, run_id: str, span: trace.Span, step: RunStep) -> None:
        """The event ``runbrake.cancel`` on the span of the call a cancel interrupted: who, why, and the latency
        from the cancel request to the call's step (nothing when the run was handed over, not cancelled)."""
        request = await self._store.cancel_request(run_id)
        if request is None:
            return
        latency_ms = max(0.0, step.recorded_at - request.requested_at) * 1000
        span.add_event("runbrake.cancel", {"runbrake.cancel.latency_ms": round(latency_ms, 3),
                                           "runbrake.cancel.requested_by": request.requested_by[:200],
                                           "runbrake.cancel.reason": request.reason[:200]},
                       timestamp=_ns(step.recorded_at))

    async def _end_tool_span(self, run_id: str, step: RunStep) -> None:
        span = _tool.get()
        if span is None:
            return
        _tool.set(None)
        outcome = step.tool_outcome
        span.set_attributes({"runbrake.tool.outcome": outcome.value if outcome is not None else "",
                             "runbrake.step.sequence": step.sequence})
        if outcome is ToolOutcome.FAILED:
            span.set_attribute("error.type", "tool_failed")
            span.set_status(trace.StatusCode.ERROR, step.content[:200])
        elif outcome is ToolOutcome.CANCELLED:
            await self._cancel_event(run_id, span, step)
        span.end(end_time=_ns(step.recorded_at))
