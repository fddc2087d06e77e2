"""The names of the events the HTTP API's streams send (docs/http-api.md; labels in docs/labels.md)."""

from __future__ import annotations

from enum import StrEnum

__all__ = ["StreamEvent"]


class StreamEvent(StrEnum):
    """The ``event:`` of one server-sent event on ``GET /v1/runs/{id}/events`` or the runs list's stream."""

    STEP = "step"
    """A step was recorded; its ``id`` is the step's sequence (``Last-Event-ID`` resumes after it)."""
    PROGRESS = "progress"
    """A tool in flight reported progress."""
    DELTA = "delta"
    """The text a model call streamed since the last one (``{"round", "text"}``); never stored, never replayed."""
    STATUS = "status"
    """The run's status (and termination reason) as it is now, or as it just changed."""
    END = "end"
    """The run is over and its stream closes."""
    DROPPED = "dropped"
    """The client read too slowly and was dropped; it reconnects (with ``Last-Event-ID``)."""
    RESYNC = "resync"
    """The runs list's stream may have missed changes: the client reads the list again."""
