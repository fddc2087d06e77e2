"""The steps of a run: recorded in order, never rewritten (docs/store.md, "Tool outcomes: steps")."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

import structlog

from runbrake.shared.errors import RunbrakeError
from runbrake.shared.outcome import ToolOutcome
from runbrake.shared.tool_result import Failure, ToolResult

log = structlog.get_logger(__name__)


class StepKind(StrEnum):
    """What a step records."""

    MODEL = "model"
    TOOL = "tool"
    APPROVAL = "approval"
    HANDOFF = "handoff"
    """The worker executing the run shut down and handed it back to the queue (docs/leases.md,
    "Drain and hand-over"); another worker continues from the saved conversation."""
    STEER = "steer"
    """An operator steered the run: its turn was cut off and the run went on with a new user message
    (``detail``: ``input``, ``reason``, ``requested_by``, ``requested_at``; docs/cancellation.md, "Steer")."""
    UNKNOWN = "unknown"


class StepReason(StrEnum):
    """Why a tool step came out as it did, in its ``detail.reason``, where that is no termination reason (a
    call cut off by a hand-over says ``worker_shutdown``, the run's reason when a worker stops)."""

    INVALID_CALL = "invalid_call"
    """The model asked for a call the run cannot make (a tool it does not have, one outside the catalog's
    allowlist, arguments that are not a JSON object): never executed, the step ``failed`` and its content
    handed back to the model (docs/cancellation.md, "Invalid calls go back to the model")."""
    STEERED = "steered"
    """A steer cut the call off (or answered it before it started) to go on with a new message: recorded
    ``cancelled``, but the run goes on (docs/cancellation.md, "Steer")."""
    WORKER_LOST = "worker_lost"
    """The worker process executing the run was lost (killed, out of memory, its host gone) while the call was
    in flight or waiting to start: recorded ``cancelled`` by the worker that took the run up (its
    ``side_effects`` say whether the request had gone out); a model call, ``interrupted`` and made again; the
    ``handoff`` step that marks the gap says it too (docs/leases.md, "Lost workers")."""


class StepError(RunbrakeError, ValueError):
    """Raised when a step would disagree with itself (an outcome that contradicts its error flag, or
    an outcome on a step that is not a tool step). A ``ValueError`` too, as it was before it joined the
    tree (shared/errors.py)."""


@dataclass(frozen=True, slots=True)
class RunStep:
    """One recorded event of a run.

    A tool step states its outcome through ``tool_outcome``; ``tool_is_error`` is
    derived from it by :meth:`tool` and checked on every construction, so the pair
    cannot disagree. ``sequence`` is assigned by the run store when the step is
    appended (0 until then).
    """

    kind: StepKind
    round: int
    sequence: int = 0
    duration_ms: int = 0
    recorded_at: float = 0.0
    content: str = ""
    """Model text, tool result text, or the approval decision's note."""
    tool_server: str | None = None
    tool_name: str | None = None
    tool_call_id: str | None = None
    tool_is_error: bool | None = None
    tool_outcome: ToolOutcome | None = None
    interrupted: bool = False
    """A model step whose call was cut off by a cancel."""
    error: str | None = None
    """A model step whose call failed: the provider's message."""
    detail: Mapping[str, Any] = field(default_factory=dict)
    """Kind-specific data: a model step's tool calls (with their arguments: stored once, there), an
    approval's decision."""

    def __post_init__(self) -> None:
        if self.kind is StepKind.TOOL:
            if self.tool_outcome is not None and self.tool_is_error is not self.tool_outcome.is_error:
                raise StepError(
                    f"tool step says tool_is_error={self.tool_is_error} but tool_outcome="
                    f"{self.tool_outcome.value}"
                )
            if self.tool_outcome is None and self.tool_is_error is not None:
                raise StepError("tool step has tool_is_error but no tool_outcome; use RunStep.from_dict")
        elif self.tool_outcome is not None or self.tool_is_error is not None:
            raise StepError(f"a {self.kind.value} step states no tool outcome")
        if self.interrupted and self.kind is not StepKind.MODEL:
            raise StepError("only a model step can be interrupted")

    @classmethod
    def tool(
        cls,
        *,
        round: int,
        server: str,
        name: str,
        result: ToolResult,
        call_id: str | None = None,
        arguments: Mapping[str, Any] | None = None,
        duration_ms: int = 0,
        recorded_at: float = 0.0,
    ) -> RunStep:
        """The one builder of tool steps: ``tool_is_error`` is derived from the result's outcome."""
        return cls._tool_step(
            round=round,
            server=server,
            name=name,
            outcome=result.outcome,
            content=result.content,
            call_id=call_id,
            detail=({} if arguments is None else {"arguments": dict(arguments)})
            | ({"failure": result.failure.value} if result.failure is Failure.ARGUMENTS else {})
            | ({"side_effects": result.side_effects.value} if result.side_effects is not None else {})
            | ({} if result.task is None else {"task_id": result.task[0], "task_status": result.task[1]})
            | ({"child_run_id": result.child_run_id} if result.child_run_id is not None else {}),
            duration_ms=duration_ms,
            recorded_at=recorded_at,
        )

    @classmethod
    def _tool_step(
        cls,
        *,
        round: int,
        server: str,
        name: str,
        outcome: ToolOutcome,
        content: str,
        call_id: str | None,
        detail: Mapping[str, Any],
        duration_ms: int,
        recorded_at: float,
    ) -> RunStep:
        return cls(
            kind=StepKind.TOOL,
            round=round,
            duration_ms=duration_ms,
            recorded_at=recorded_at,
            content=content,
            tool_server=server,
            tool_name=name,
            tool_call_id=call_id,
            tool_is_error=outcome.is_error,
            tool_outcome=outcome,
            detail=detail,
        )

    def with_sequence(self, sequence: int, recorded_at: float) -> RunStep:
        """The step as the store records it."""
        return replace(self, sequence=sequence, recorded_at=recorded_at)

    def to_dict(self) -> dict[str, Any]:
        """The stored form. Tool fields appear only on tool steps."""
        data: dict[str, Any] = {
            "sequence": self.sequence,
            "kind": self.kind.value,
            "round": self.round,
            "duration_ms": self.duration_ms,
            "recorded_at": self.recorded_at,
            "content": self.content,
            "detail": dict(self.detail),
        }
        if self.kind is StepKind.TOOL:
            data.update(
                tool_server=self.tool_server,
                tool_name=self.tool_name,
                tool_call_id=self.tool_call_id,
                tool_is_error=self.tool_is_error,
                tool_outcome=None if self.tool_outcome is None else self.tool_outcome.value,
            )
        if self.interrupted:
            data["interrupted"] = True
        if self.error is not None:
            data["error"] = self.error
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RunStep:
        """Load a stored step.

        An older tool step without ``tool_outcome`` keeps the meaning it had:
        ``tool_is_error`` decides *whether* the step states an outcome, and
        ``tool_outcome`` decides *which* (docs/store.md, "Tool outcomes: old rows").

        Raises:
            StepError: when the stored step disagrees with itself.
        """
        try:
            kind = StepKind(data.get("kind", ""))
        except ValueError:
            log.warning("step_kind_unknown", stored=data.get("kind"), sequence=data.get("sequence"))
            kind = StepKind.UNKNOWN
        common: dict[str, Any] = {
            "round": int(data.get("round", 0)),
            "sequence": int(data.get("sequence", 0)),
            "duration_ms": int(data.get("duration_ms", 0)),
            "recorded_at": float(data.get("recorded_at", 0.0)),
            "content": str(data.get("content", "")),
            "detail": dict(data.get("detail") or {}),
        }
        if kind is StepKind.TOOL:
            is_error = data.get("tool_is_error")
            stored = data.get("tool_outcome")
            outcome: ToolOutcome | None
            if is_error is None:
                if stored is not None:
                    raise StepError("stored tool step has tool_outcome but no tool_is_error")
                outcome = None
            elif stored is None:
                outcome = ToolOutcome.FAILED if is_error else ToolOutcome.OK
            else:
                outcome = _parse_outcome(stored)
            return cls(
                kind=kind,
                tool_server=data.get("tool_server"),
                tool_name=data.get("tool_name"),
                tool_call_id=data.get("tool_call_id"),
                tool_is_error=None if is_error is None else bool(is_error),
                tool_outcome=outcome,
                **common,
            )
        if data.get("tool_outcome") is not None or data.get("tool_is_error") is not None:
            raise StepError(f"stored {kind.value} step states a tool outcome")
        return cls(
            kind=kind,
            interrupted=bool(data.get("interrupted", False)),
            error=data.get("error"),
            **common,
        )


def _parse_outcome(value: object) -> ToolOutcome:
    try:
        return ToolOutcome(str(value))
    except ValueError as exc:
        raise StepError(f"stored tool_outcome {value!r} is not one of ok, failed, cancelled") from exc
