"""Live events for the HTTP API: one Redis subscription per process, fanned out to every client
(docs/http-api.md, "Events").

The run store's scripts PUBLISH every status change, every appended step and every progress report
on ``<ns>:events`` (shared/_scripts.py, shared/_api_scripts.py). An :class:`EventHub` holds the one
subscription of its API process and hands each message, encoded once as an SSE frame, to the
clients that watch its run: one bounded asyncio queue per client. A client that falls
:data:`QUEUE_SIZE` events behind is dropped (its stream ends; it reconnects with ``Last-Event-ID``),
never allowed to grow the process's memory. When the subscription breaks, the hub reconnects with
backoff and tells every client to re-read its run from the store (a *resync*), because messages
published meanwhile are lost: pub/sub is a wake-up, Redis's data is the authority.

:func:`run_events` is one client's stream: subscribe first, then read the run, replay its steps,
then forward live events, dropping live steps whose sequence is at most the last replayed one (this
closes the race between the replay and the first live event).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Final

import redis
import redis.asyncio
import structlog

from runbrake.broker.render import current_progress, step_json
from runbrake.shared.async_store import AsyncRunStore
from runbrake.shared.records import RunRecord, read_step
from runbrake.shared.settings import Settings
from runbrake.shared.status import RunStatus

log = structlog.get_logger(__name__)

QUEUE_SIZE: Final = 256
"""Events a client may fall behind before it is dropped."""
KEEPALIVE_S: Final = 15.0
"""A comment line this often keeps proxies from closing an idle stream and finds clients that left."""
TERMINAL_GRACE_S: Final = 3.0
"""How long a stream goes on after its run's terminal status: the worker records the call a cancel cut
off just after the cancel itself (docs/architecture.md, "Cancellation: the interrupt")."""
RETRY_MS: Final = 1000
_MAX_BACKOFF_S: Final = 5.0


@dataclass(frozen=True, slots=True)
class Event:
    """One event as the hub hands it out: its kind, run, step sequence (0 for others), SSE frame."""

    kind: str
    run_id: str
    sequence: int
    frame: bytes
    status: str = ""


RESYNC: Final = Event("resync", "", 0, b"")
"""Put into every queue after the subscription was re-established: events may have been lost."""


def frame(event: str, data: Any, *, event_id: int | None = None) -> bytes:
    """One SSE event: ``id`` (steps only), ``event`` and one ``data`` line of compact JSON."""
    head = f"id: {event_id}\n" if event_id is not None else ""
    body = json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    return f"{head}event: {event}\ndata: {body}\n\n".encode()


def status_data(run_id: str, status: str, reason: str) -> dict[str, str]:
    return {"run_id": run_id, "status": status, "termination_reason": reason}


@dataclass(eq=False)
class Subscriber:
    """One client: the run it watches (None: every run's status), its queue, whether it was dropped."""

    run_id: str | None
    queue: asyncio.Queue[Event] = field(default_factory=lambda: asyncio.Queue(QUEUE_SIZE))
    dropped: bool = False


class EventHub:
    """The process's one subscription to ``<ns>:events`` and its clients."""

    def __init__(self, settings: Settings, *, on_drop: Callable[[], None] = lambda: None) -> None:
        self._settings = settings
        self._channel = f"{settings.namespace}:events"
        self._by_run: dict[str, set[Subscriber]] = {}
        self._everything: set[Subscriber] = set()
        self._task: asyncio.Task[None] | None = None
        self._ready = asyncio.Event()
        self._on_drop = on_drop

    @property
    def clients(self) -> int:
        return sum(len(s) for s in self._by_run.values()) + len(self._everything)

    @property
    def ready(self) -> bool:
        """Subscribed right now."""
        return self._ready.is_set()

    async def start(self, timeout_s: float = 10.0) -> None:
        """Subscribe, and return once Redis confirmed the subscription (or after ``timeout_s``; the hub keeps
        trying in the background and readiness says so)."""
        self._task = asyncio.create_task(self._run(), name="runbrake-event-hub")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._ready.wait(), timeout_s)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def wait_ready(self, timeout_s: float = 5.0) -> bool:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._ready.wait(), timeout_s)
        return self._ready.is_set()

    def subscribe(self, run_id: str | None) -> Subscriber:
        subscriber = Subscriber(run_id)
        if run_id is None:
            self._everything.add(subscriber)
        else:
            self._by_run.setdefault(run_id, set()).add(subscriber)
        return subscriber

    def unsubscribe(self, subscriber: Subscriber) -> None:
        if subscriber.run_id is None:
            self._everything.discard(subscriber)
            return
        watchers = self._by_run.get(subscriber.run_id)
        if watchers is not None:
            watchers.discard(subscriber)
            if not watchers:
                del self._by_run[subscriber.run_id]

    async def _run(self) -> None:
        backoff = 0.2
        while True:
            # A plain connection on a Redis Cluster too (to the URL's seed node): a cluster delivers every
            # PUBLISH to the subscribers of every node (docs/architecture.md, "The run store on a Redis Cluster").
            client = redis.asyncio.Redis.from_url(
                self._settings.redis_url, decode_responses=True,
                socket_connect_timeout=min(self._settings.redis_timeout_s, 1.0), health_check_interval=30,
                client_name=f"runbrake-api-events-{self._settings.namespace}",  # findable in CLIENT LIST
            )
            pubsub = client.pubsub()
            try:
                await pubsub.subscribe(self._channel)
                async for message in pubsub.listen():
                    if message["type"] == "subscribe":
                        backoff = 0.2
                        self._ready.set()
                        log.info("event_hub_subscribed", channel=self._channel)
                        self._broadcast(RESYNC)
                    elif message["type"] == "message":
                        self.dispatch(message["data"])
            except (redis.RedisError, OSError) as exc:
                self._ready.clear()
                log.warning("event_hub_disconnected", error=str(exc), retry_in_s=backoff)
            else:
                log.warning("event_hub_subscription_ended", retry_in_s=backoff)
            finally:
                self._ready.clear()
                with contextlib.suppress(redis.RedisError, OSError):
                    await pubsub.aclose()  # type: ignore[no-untyped-call]
                with contextlib.suppress(redis.RedisError, OSError):
                    await client.aclose()
            await asyncio.sleep(backoff)  # backoff before reconnecting, not a synchronisation
            backoff = min(backoff * 2, _MAX_BACKOFF_S)

    def dispatch(self, raw: str) -> None:
        """Hand one published message to the clients that want it; the frame is encoded once for all."""
        try:
            message = json.loads(raw)
            kind, run_id = message["event"], message["run_id"]
        except (ValueError, KeyError, TypeError):
            log.warning("event_unreadable", message=raw[:200])
            return
        watchers = self._by_run.get(run_id, ())
        if kind == "status":
            status, reason = message.get("status", ""), message.get("termination_reason", "")
            event = Event("status", run_id, 0, frame("status", status_data(run_id, status, reason)), status)
            for subscriber in (*watchers, *self._everything):
                self._offer(subscriber, event)
            return
        if not watchers:
            return
        if kind == "step":
            step = read_step(run_id, json.dumps(message.get("step")))
            event = Event("step", run_id, step.sequence, frame("step", step_json(step), event_id=step.sequence))
        elif kind == "progress" and isinstance(message.get("progress"), dict):
            event = Event("progress", run_id, 0, frame("progress", message["progress"]))
        else:
            return
        for subscriber in tuple(watchers):
            self._offer(subscriber, event)

    def _broadcast(self, event: Event) -> None:
        for subscriber in (*(s for watchers in self._by_run.values() for s in watchers), *self._everything):
            self._offer(subscriber, event)

    def _offer(self, subscriber: Subscriber, event: Event) -> None:
        try:
            subscriber.queue.put_nowait(event)
        except asyncio.QueueFull:
            # A slow client: drop it rather than let its queue grow; its stream ends at its next read.
            subscriber.dropped = True
            self.unsubscribe(subscriber)
            self._on_drop()
            log.info("event_client_dropped", run_id=subscriber.run_id)


async def run_events(hub: EventHub, store: AsyncRunStore, subscriber: Subscriber, record: RunRecord,
                     *, last_event_id: int) -> AsyncIterator[bytes]:
    """One client's stream of one run. ``subscriber`` was subscribed before ``record`` was read."""
    last = last_event_id
    loop = asyncio.get_running_loop()
    deadline: float | None = None
    try:
        yield f"retry: {RETRY_MS}\n\n".encode()
        replay, last, deadline = _replay(record, last)
        for chunk in replay:
            yield chunk
        while True:
            timeout = KEEPALIVE_S if deadline is None else min(KEEPALIVE_S, max(0.0, deadline - loop.time()))
            try:
                event = await asyncio.wait_for(subscriber.queue.get(), timeout)
            except TimeoutError:
                if deadline is not None and loop.time() >= deadline:
                    break
                yield b": keepalive\n\n"
                continue
            if event is RESYNC:
                # Events may have been lost while the hub reconnected: read the run again.
                replay, last, resynced = _replay(await store.get(record.run_id), last)
                deadline = deadline if resynced is None or deadline is not None else resynced
                for chunk in replay:
                    yield chunk
            elif event.kind == "step":
                if event.sequence > last:
                    last = event.sequence
                    yield event.frame
            else:
                yield event.frame
                if event.kind == "status" and RunStatus.parse(event.status).is_terminal and deadline is None:
                    deadline = loop.time() + TERMINAL_GRACE_S
            if subscriber.dropped and subscriber.queue.empty():
                yield frame("dropped", {"reason": "too far behind; reconnect with Last-Event-ID", "last": last})
                return
        yield frame("end", {"run_id": record.run_id, "last": last})
    finally:
        hub.unsubscribe(subscriber)


def _replay(record: RunRecord, last: int) -> tuple[list[bytes], int, float | None]:
    """The frames of the steps after ``last``, the run's status and its call in flight; the new last
    sequence; and, for a finished run, when (on the loop's clock) its stream may end."""
    chunks = []
    for step in record.steps:
        if step.sequence > last:
            chunks.append(frame("step", step_json(step), event_id=step.sequence))
            last = step.sequence
    chunks.append(frame("status", status_data(record.run_id, record.status.value,
                                              record.termination_reason.value)))
    progress = current_progress(record)
    if progress is not None:
        chunks.append(frame("progress", progress))
    deadline = None
    if record.status.is_terminal:
        finished = record.finished_at or time.time()
        deadline = asyncio.get_running_loop().time() + max(0.0, finished + TERMINAL_GRACE_S - time.time())
    return chunks, last, deadline


async def status_events(hub: EventHub, subscriber: Subscriber) -> AsyncIterator[bytes]:
    """Every run's status changes (the runs page's list), until the client goes away."""
    try:
        yield f"retry: {RETRY_MS}\n\n".encode()
        while True:
            try:
                event = await asyncio.wait_for(subscriber.queue.get(), KEEPALIVE_S)
            except TimeoutError:
                yield b": keepalive\n\n"
                continue
            if event is RESYNC:
                yield frame("resync", {})
            else:
                yield event.frame
            if subscriber.dropped and subscriber.queue.empty():
                yield frame("dropped", {"reason": "too far behind; reconnect"})
                return
    finally:
        hub.unsubscribe(subscriber)
