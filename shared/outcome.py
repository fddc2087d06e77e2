"""What a tool call came to (docs/architecture.md, "Tool outcomes")."""

from __future__ import annotations

from enum import StrEnum


class ToolOutcome(StrEnum):
    """The outcome of one tool call.

    The value is the one string that travels end to end: the stored step field,
    the timeline's outcome and the label key (``outcome.cancelled``).
    """

    OK = "ok"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def is_error(self) -> bool:
        """True for both non-ok outcomes; a cancelled call is an error, but not a failure."""
        return self is not ToolOutcome.OK
