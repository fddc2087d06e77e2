"""What a tool call came to (docs/store.md, "Tool outcomes")."""

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


class DeliveryStatus(StrEnum):
    """Where one webhook delivery stands (docs/webhooks.md, "Watching deliveries"); the stored ``status``."""

    PENDING = "pending"
    """Queued behind the run's earlier deliveries to the webhook, or not yet tried."""
    RETRYING = "retrying"
    """Tried and failed; tried again at ``next_attempt_at``."""
    DELIVERED = "delivered"
    """The receiver answered 2xx."""
    GAVE_UP = "gave_up"
    """Still failing ``RUNBRAKE_WEBHOOK_RETRY_S`` after its event: not tried again."""
