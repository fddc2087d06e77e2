"""Run status and termination reason (docs/store.md, "The run lifecycle"). Two fields, never merged."""

from __future__ import annotations

from enum import StrEnum
from typing import TypeVar


class RunStatus(StrEnum):
    """Where a run is in its lifecycle. ``UNKNOWN`` stands for a stored value this version cannot read."""

    QUEUED = "queued"
    RUNNING = "running"
    WAITING_FOR_APPROVAL = "waiting_for_approval"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"
    UNKNOWN = "unknown"

    @property
    def is_terminal(self) -> bool:
        """Terminal is terminal: no transition leaves these."""
        return self in _TERMINAL

    @classmethod
    def parse(cls, value: str | None, *, run_id: str = "") -> RunStatus:
        """Read a stored status; an unrecognised one reads as ``UNKNOWN`` and is logged, never a crash."""
        return _parse_stored(cls, value, cls.UNKNOWN, run_id, "run_status_unknown")


_TERMINAL = frozenset({RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.CANCELLED})
NON_TERMINAL = (RunStatus.QUEUED, RunStatus.RUNNING, RunStatus.WAITING_FOR_APPROVAL)


class TerminationReason(StrEnum):
    """Why a run reached its terminal status. ``NONE`` while it has not."""

    NONE = ""
    COMPLETED = "completed"
    MAX_ROUNDS = "max_rounds"
    PROVIDER_FAILED = "provider_failed"
    TOOL_LOOP_ERROR = "tool_loop_error"
    APPROVAL_DENIED = "approval_denied"
    CANCELLED = "cancelled"
    RETRIES_EXHAUSTED = "retries_exhausted"
    LEASE_LOST = "lease_lost"
    TIME_LIMIT = "time_limit"
    WORKER_SHUTDOWN = "worker_shutdown"
    ENQUEUE_FAILED = "enqueue_failed"
    SPEC_REFUSED = "spec_refused"
    MAX_STEPS = "max_steps"
    TOO_MANY_TOOL_CALLS = "too_many_tool_calls"
    BUDGET_EXCEEDED = "budget_exceeded"
    """Cancelled by its own budget: the tokens or the cost reached ``budget.max_total_tokens`` or
    ``budget.max_cost_usd``."""
    DEADLINE_EXCEEDED = "deadline_exceeded"
    """Cancelled by its own budget: ``budget.deadline_s`` passed since enqueue."""
    UNKNOWN = "unknown"

    @classmethod
    def parse(cls, value: str | None, *, run_id: str = "") -> TerminationReason:
        """Read a stored reason; an unrecognised one reads as ``UNKNOWN`` and is logged, never a crash."""
        return _parse_stored(cls, value, cls.UNKNOWN, run_id, "termination_reason_unknown")


_E = TypeVar("_E", RunStatus, TerminationReason)


def _parse_stored(enum: type[_E], value: str | None, unknown: _E, run_id: str, event: str) -> _E:
    try:
        return enum(value or "")
    except ValueError:
        import structlog  # noqa: PLC0415 - rare; the CLI's --help imports this module (docs/benchmarks.md)

        structlog.get_logger(__name__).warning(event, run_id=run_id, stored=value)
        return unknown
