"""A model call's text as it streams in: kept for the step a cut-off call still records, and announced as
``delta`` events at most :data:`MIN_INTERVAL_S` apart per run (docs/cancellation.md, "Streaming").

A provider that streams appends each piece of text to the call's :class:`StreamedText` (synchronously: the
read loop never waits on Redis). The run's :class:`DeltaPublisher` keeps one asyncio task while a call's
text is open: woken by an append, it publishes the text since the last delta on ``<ns>:events``
(``AsyncRunStore.publish_delta``), then waits out the interval before it publishes again. What is published is
scrubbed over all the text so far, never piece by piece (``shared/redaction.py`` :class:`StreamScrub`): a tail
that could still become a secret is held back, so a secret the stream splits is never rebuilt by joining deltas.
A delta carries all the text since the one before, so however fast the model streams, a run makes at most ten a
second.
The task lives outside the call's in-flight scope: a cancel cuts off the read, never a PUBLISH halfway.
When the call ends, its text is closed and the task ends: what was not yet announced is left to the model
step, which carries the whole answer (or, cut off, the partial one). Deltas are a courtesy, like progress:
never stored, never replayed; a publish that fails is logged and skipped.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Final

import structlog

from runbrake.shared.redaction import StreamScrub

__all__ = ["MIN_INTERVAL_S", "DeltaPublisher", "StreamedText"]

log = structlog.get_logger(__name__)

MIN_INTERVAL_S: Final = 0.1
"""The least time between two deltas of one run: at most ten a second."""

Publish = Callable[[str, Mapping[str, Any]], Awaitable[bool]]
"""``publish(run_id, {"round", "text"})``: ``AsyncRunStore.publish_delta``."""


class StreamedText:
    """The text one model call streamed so far, up to ``max_chars`` (``RUNBRAKE_MAX_MODEL_CONTENT_CHARS``:
    what the step keeps of a longer answer comes from the whole one, cut by the loop).

    Args:
        round_number: the model call's round (1-based, as its step's ``round``).
        max_chars: the most text kept and announced.
        wake: told after each append (the publisher); None: kept only.
    """

    def __init__(self, round_number: int, *, max_chars: int, wake: Callable[[], None] | None = None) -> None:
        self.round = round_number
        self._max_chars = max_chars
        self._parts: list[str] = []
        self._chars = 0
        self._wake = wake
        self._announced = StreamScrub()
        self.closed = False

    def append(self, piece: str) -> None:
        """A piece of the answer arrived (beyond ``max_chars``, it is not kept)."""
        if self.closed or not piece or self._chars >= self._max_chars:
            return
        piece = piece[:self._max_chars - self._chars]
        self._parts.append(piece)
        self._chars += len(piece)
        if self._wake is not None:
            self._wake()

    @property
    def text(self) -> str:
        """All the text so far."""
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    @property
    def chars(self) -> int:
        return self._chars

    def close(self) -> None:
        """The call ended: nothing more is appended or announced (the publisher is told, and stops)."""
        if not self.closed:
            self.closed = True
            if self._wake is not None and self._chars:
                self._wake()

    def unsent(self) -> str:
        """The scrubbed text since the last delta, now marked as sent; a tail that could still become a secret
        is kept for a later one (or for the step)."""
        return self._announced.advance(self.text)


class DeltaPublisher:
    """The ``delta`` events of one run's model calls, at most one per :data:`MIN_INTERVAL_S`."""

    def __init__(self, run_id: str, publish: Publish, *, min_interval_s: float = MIN_INTERVAL_S) -> None:
        self._run_id = run_id
        self._publish = publish
        self._min_interval_s = min_interval_s
        self._current: StreamedText | None = None
        self._pending = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def text(self, round_number: int, *, max_chars: int) -> StreamedText:
        """A new call's text, announced from now on (the previous call's is closed)."""
        if self._current is not None:
            self._current.close()
        self._current = StreamedText(round_number, max_chars=max_chars, wake=self._wake)
        return self._current

    def _wake(self) -> None:
        self._pending.set()
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name=f"runbrake-deltas-{self._run_id}")

    async def _run(self) -> None:
        """Publish while a call's text is open; the task ends once it finds none (the next append starts one)."""
        while True:
            await self._pending.wait()
            self._pending.clear()
            text = self._current
            if text is None or text.closed:
                return
            piece = text.unsent()
            if not piece:
                continue
            try:
                await self._publish(self._run_id, {"round": text.round, "text": piece})
            except Exception as exc:  # noqa: BLE001 - a delta must never fail the call it previews
                log.warning("delta_publish_failed", run_id=self._run_id, error=repr(exc))
            # A rate limit, not a synchronisation: text arriving meanwhile goes out in the next delta.
            await asyncio.sleep(self._min_interval_s)
