"""The result of one tool call (docs/store.md, "Tool outcomes: the result")."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import StrEnum

from runbrake.shared.outcome import ToolOutcome


class Failure(StrEnum):
    """Whose mistake a failed tool call was: per-server health counts argument errors apart."""

    SERVER = "server"
    """The server failed: it said so, died, timed out or broke the protocol."""
    ARGUMENTS = "arguments"
    """The call was wrong: arguments the server refused (JSON-RPC -32602), a tool it does not offer."""


class SideEffects(StrEnum):
    """What the server may have done for a call cut off (a cancelled tool step's ``detail.side_effects``)."""

    NONE = "none"
    """Cut off before its request was sent: the server never saw it."""
    UNKNOWN = "unknown"
    """Cut off after its request was sent: the server may have acted, in part or in full."""


class TaskStatus(StrEnum):
    """What became of a call's MCP task (a tool step's ``detail.task_status``): the server's last status (protocol
    2025-11-25 and the 2026-07-28 tasks extension name the same five), or ``lost`` (worker/mcp_tasks.py)."""

    WORKING = "working"
    INPUT_REQUIRED = "input_required"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"
    LOST = "lost"
    """The server no longer knows the task (it restarted, or its TTL passed)."""


_TRUNCATION_MARK = "\n…[truncated {dropped} chars]"


@dataclass(frozen=True, slots=True)
class ToolResult:
    """What a tool call came to.

    Build one with :meth:`ok`, :meth:`error` or :meth:`cancelled`. The two non-ok
    constructors are fail-closed: a call that failed or was cut off has no claim to
    artifacts or a write target. ``is_error`` is derived from ``outcome``, never
    stored beside it.
    """

    outcome: ToolOutcome
    content: str
    """Text for the model and the timeline (a content channel, bounded)."""
    structured: str | None = None
    """The structured result as JSON text, when the tool returned one (a content channel, bounded)."""
    artifacts: tuple[str, ...] = ()
    """References (URIs) to what the call produced; empty unless ok."""
    write_target: str | None = None
    """Where the call wrote, when it did; None unless ok."""
    failure: Failure | None = None
    """Whose mistake a failed call was (the server's, or the arguments'); None unless failed."""
    side_effects: SideEffects | None = None
    """What the server may have done, for a call cut off: None unless cancelled."""
    task: tuple[str, str] | None = None
    """For a call made as an MCP task: its task id and the last status the server gave it (``detail.task_id``,
    ``detail.task_status``; worker/mcp_tasks.py)."""
    child_run_id: str | None = None
    """The child run an agent call started (its step's ``detail.child_run_id``; docs/usage.md, "Agent trees")."""

    def __post_init__(self) -> None:
        if self.outcome is not ToolOutcome.OK and (self.artifacts or self.write_target is not None):
            raise ValueError(f"a {self.outcome.value} tool result carries no artifacts and no write target")
        if (self.failure is not None) != (self.outcome is ToolOutcome.FAILED):
            raise ValueError("a failed tool result says whose failure it was, and only a failed one does")
        if self.side_effects is not None and self.outcome is not ToolOutcome.CANCELLED:
            raise ValueError("only a cancelled tool result says what side effects it may have had")

    @classmethod
    def ok(
        cls,
        content: str,
        *,
        structured: str | None = None,
        artifacts: tuple[str, ...] = (),
        write_target: str | None = None,
    ) -> ToolResult:
        """A call that produced a result."""
        return cls(ToolOutcome.OK, content, structured, artifacts, write_target)

    @classmethod
    def error(cls, message: str, *, failure: Failure | None = None) -> ToolResult:
        """A call that failed: the tool said so, the protocol broke, the server died or timed out
        (``Failure.SERVER``, the default), or its arguments were refused (``Failure.ARGUMENTS``)."""
        return cls(ToolOutcome.FAILED, message, failure=failure or Failure.SERVER)

    @classmethod
    def cancelled(cls, message: str, *, sent: bool = True) -> ToolResult:
        """A call cut off because its run was cancelled. Not a failure. ``sent``: whether its request may have
        reached the server (side effects ``unknown``); False when it certainly did not (``none``)."""
        return cls(ToolOutcome.CANCELLED, message,
                   side_effects=SideEffects.UNKNOWN if sent else SideEffects.NONE)

    @property
    def is_error(self) -> bool:
        """True for both non-ok outcomes; ``outcome`` says which."""
        return self.outcome.is_error

    def with_bounded_channels(self, max_chars: int) -> ToolResult:
        """Bound each content channel to ``max_chars`` characters (a truncated one ends with a mark saying how
        much was dropped); every other field is carried unchanged.

        Transforms, never rebuilds: ``dataclasses.replace`` keeps the
        outcome, artifacts and write target exactly as they were.
        """
        if max_chars < 1:
            raise ValueError("max_chars must be at least 1")
        return dataclasses.replace(
            self,
            content=bound(self.content, max_chars),
            structured=None if self.structured is None else bound(self.structured, max_chars),
        )


def bound(text: str, max_chars: int) -> str:
    """At most ``max_chars`` characters, the truncation mark included (a hard bound): the one way a content
    channel is cut, for tool results and model content alike (``worker/loop.py``)."""
    if len(text) <= max_chars:
        return text
    keep = max_chars
    mark = ""
    # The mark's length depends on how much is dropped, which depends on the mark: settle it in two passes.
    for _ in range(2):
        mark = _TRUNCATION_MARK.format(dropped=len(text) - keep)
        keep = max(0, max_chars - len(mark))
    return (text[:keep] + mark)[:max_chars]
