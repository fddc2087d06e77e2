"""Live events for the HTTP API: one Redis subscription per process, fanned out to every client
(docs/http-api.md, "Events").

The run store's scripts PUBLISH every status change, every appended step and every progress report
on ``<ns>:events`` (shared/_scripts.py, shared/_api_scripts.py). An :class:`EventHub` holds the one
subscription of its API process and hands each message, encoded once as an SSE frame, to the
clients that watch its run: one bounded asyncio queue per client. A client that falls
:data:`QUEUE_SIZE` events behind is dropped (its stream ends; it reconnects with ``Last-Event-ID``),
never allowed to grow the process's memory. When the subscription breaks, the hub reconnects with
backoff and tells every client to re-read its run from the store (a *resync*), because messages
published meanwhile are lost: pub/sub is a wake-up, Redis's data is the authority. Anyone who can
PUBLISH on the channel can send anything: a message the hub cannot read is skipped and counted, and a
hub that fails anyway is restarted and counted (docs/http-api.md, "Events: limits").

:func:`run_events` is one client's stream: subscribe first, then read the run, replay its steps a page
at a time, then forward live events, dropping live steps whose sequence is at most the last replayed one
(this closes the race between the replay and the first live event). :class:`EventStreamResponse` sends
a stream in pieces and drops a client that does not take the next piece within
``RUNBRAKE_API_SEND_TIMEOUT_S``, so a stream holds about one page of steps and one piece in flight,
whatever the run holds and whether or not the client reads.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
import re
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any, Final

import redis
import redis.asyncio
import structlog
from starlette.responses import StreamingResponse

from runbrake.broker.render import current_progress, step_json
from runbrake.shared.async_store import AsyncRunStore, plain_client
from runbrake.shared.errors import RunbrakeError
from runbrake.shared.records import OutboxEntry, RunRecord, stream_position
from runbrake.shared.run_end import read_run_end, run_end
from runbrake.shared.settings import Settings
from runbrake.shared.status import RunStatus
from runbrake.shared.steps import RunStep, StepKind
from runbrake.shared.stream_events import StreamEvent

log = structlog.get_logger(__name__)

QUEUE_SIZE: Final = 256
"""Events a client may fall behind before it is dropped."""
KEEPALIVE_S: Final = 15.0
"""A comment line this often keeps proxies from closing an idle stream and finds clients that left."""
CUT_OFF_WAIT_S: Final = 3.0
"""How long a stream holds back the terminal status of a run cancelled while running, for the steps its worker
records just after the cancel (the calls it cut off: docs/cancellation.md, "Cancellation: the interrupt"),
which are sent before the status; the status and ``end`` then close the stream."""
RETRY_MS: Final = 1000
PAGE_BYTES: Final = 256 * 1024
"""About how many bytes of frames one page of replayed steps comes to: the next page asks for as many
steps as the last ones' average size fits in this (at least one, at most :data:`PAGE_STEPS`)."""
FIRST_PAGE: Final = 8
"""Steps in a replay's first page, before their size is known."""
PAGE_STEPS: Final = 128
PIECE_BYTES: Final = 64 * 1024
"""A frame goes out in pieces of at most this size. uvicorn's ``send`` waits, before it writes, until the
transport's buffer is below its high-water mark (64 KiB; uvicorn/protocols/http/flow_control.py): a client
that stops reading then holds at most that and one piece in the server's buffers."""
UNREADABLE_LOG_S: Final = 60.0
"""An unreadable message on the channel is logged at most once per this many seconds (all are counted)."""
_MIN_BACKOFF_S: Final = 0.2
_MAX_BACKOFF_S: Final = 5.0
_RUN_ID: Final = re.compile(r"[0-9a-f]{32}")
_EXCERPT_CHARS: Final = 200


@dataclass(frozen=True, slots=True)
class Event:
    """One event as the hub hands it out: its kind, run, step sequence (0 for others), SSE frame."""

    kind: StreamEvent
    run_id: str
    sequence: int
    frame: bytes
    status: str = ""
    event_id: str = ""
    """The outbox's id of the event (a stream id), "" where the message had none."""
    feed_frame: bytes = b""
    """A status event's frame on ``GET /v1/events``: with its ``id`` (the event id), which the per-run
    stream's frames do not carry (their ids are step sequences)."""
    tenant: str = ""
    """The run's tenant ("" for none): a tenant's ``GET /v1/events`` hears only its own."""
    calls: tuple[tuple[str, ...], str] = ((), "")
    """A step's tool calls: the ids a model step asks for, and the id a tool step answers (:func:`step_calls`)."""


def step_calls(step: RunStep) -> tuple[tuple[str, ...], str]:
    """The tool call ids ``step`` opens (a model step's ``detail.tool_calls``) and the one it closes (a tool
    step's ``tool_call_id``): the calls in flight are those opened and not yet closed."""
    if step.kind is StepKind.TOOL:
        return (), step.tool_call_id or ""
    asked = step.detail.get("tool_calls") if step.kind is StepKind.MODEL else None
    ids = [c.get("id") for c in asked if isinstance(c, dict)] if isinstance(asked, list) else []
    return tuple(i for i in ids if isinstance(i, str) and i), ""


RESYNC: Final = Event(StreamEvent.RESYNC, "", 0, b"")
"""Put into every queue after the subscription was re-established: events may have been lost."""


def frame(event: StreamEvent, data: Any, *, event_id: int | str | None = None) -> bytes:
    """One SSE event: ``id`` (a step's sequence; on the feed, an event id), ``event`` and one ``data`` line of
    compact JSON.

    A non-finite number (``NaN`` is not JSON, and browsers' ``JSON.parse`` refuses it) goes out as ``null``.
    """
    head = f"id: {event_id}\n" if event_id is not None else ""
    try:
        body = json.dumps(data, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except ValueError:
        body = json.dumps(_finite(data), separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    return f"{head}event: {event}\ndata: {body}\n\n".encode()


def _finite(data: Any) -> Any:
    if isinstance(data, float) and not math.isfinite(data):
        return None
    if isinstance(data, dict):
        return {key: _finite(value) for key, value in data.items()}
    if isinstance(data, list | tuple):
        return [_finite(value) for value in data]
    return data


def status_data(run_id: str, status: str, reason: str) -> dict[str, Any]:
    return {"run_id": run_id, "status": status, "termination_reason": reason}


def step_frame(run_id: str, step: RunStep) -> bytes:
    """A step's frame; a step that cannot be encoded (nested past the encoder's depth) says so instead."""
    try:
        return frame(StreamEvent.STEP, step_json(step), event_id=step.sequence)
    except (ValueError, TypeError, RecursionError) as exc:
        log.warning("step_unencodable", run_id=run_id, sequence=step.sequence, error=type(exc).__name__)
        stand_in = RunStep(kind=StepKind.UNKNOWN, round=step.round, sequence=step.sequence,
                           recorded_at=step.recorded_at, content=f"unencodable step: {type(exc).__name__}")
        return frame(StreamEvent.STEP, step_json(stand_in), event_id=step.sequence)


@dataclass(eq=False)
class Subscriber:
    """One client: the run it watches (None: every run's status), its queue, whether it was dropped, and,
    for every run's status, the tenant whose runs alone it hears (None: all, an operator's)."""

    run_id: str | None
    tenant: str | None = None
    queue: asyncio.Queue[Event] = field(default_factory=lambda: asyncio.Queue(QUEUE_SIZE))
    dropped: bool = False


class Unreadable(RunbrakeError, ValueError):
    """Raised when a message on ``<ns>:events`` is not one the store's scripts publish (a ``ValueError`` too,
    as it was before it joined the tree, shared/errors.py)."""


class EventHub:
    """The process's one subscription to ``<ns>:events`` and its clients."""

    def __init__(self, settings: Settings, *, on_drop: Callable[[], None] = lambda: None,
                 on_unreadable: Callable[[], None] = lambda: None,
                 on_restart: Callable[[], None] = lambda: None) -> None:
        self._settings = settings
        self._channel = f"{settings.namespace}:events"
        self._by_run: dict[str, set[Subscriber]] = {}
        self._everything: set[Subscriber] = set()
        self._task: asyncio.Task[None] | None = None
        self._ready = asyncio.Event()
        self._on_drop = on_drop
        self._on_unreadable = on_unreadable
        self._on_restart = on_restart
        self._unreadable = 0
        """Unreadable messages skipped since the last one logged."""
        self._unreadable_logged_at = -math.inf
        self._backoff = _MIN_BACKOFF_S

    @property
    def clients(self) -> int:
        return sum(len(s) for s in self._by_run.values()) + len(self._everything)

    @property
    def ready(self) -> bool:
        """Subscribed right now (and so, its task alive)."""
        return self._ready.is_set() and self._task is not None and not self._task.done()

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
        return self.ready

    def subscribe(self, run_id: str | None, *, tenant: str | None = None) -> Subscriber:
        subscriber = Subscriber(run_id, tenant=tenant)
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
        while True:
            try:
                await self._listen()
            except (redis.RedisError, OSError) as exc:
                log.warning("event_hub_disconnected", error=str(exc), retry_in_s=self._backoff)
            except Exception as exc:
                # The hub outlives anything (a bug too): a dead hub would silence every stream of the process.
                self._on_restart()
                log.exception("event_hub_failed", error=repr(exc), retry_in_s=self._backoff)
            else:
                log.warning("event_hub_subscription_ended", retry_in_s=self._backoff)
            await asyncio.sleep(self._backoff)  # backoff before reconnecting, not a synchronisation
            self._backoff = min(self._backoff * 2, _MAX_BACKOFF_S)

    async def _listen(self) -> None:
        """One connection and subscription, until it breaks."""
        # A plain connection on a Redis Cluster too (to the URL's seed node): a cluster delivers every
        # PUBLISH to the subscribers of every node (docs/store.md, "The run store on a Redis Cluster").
        # Bytes, not decoded text: a message that is not UTF-8 must be one bad message, not a broken connection.
        client = plain_client(
            self._settings, decode_responses=False,
            socket_connect_timeout=min(self._settings.redis_timeout_s, 1.0), health_check_interval=30,
            client_name=f"runbrake-api-events-{self._settings.namespace}",  # findable in CLIENT LIST
        )
        pubsub = client.pubsub()
        try:
            await pubsub.subscribe(self._channel)
            async for message in pubsub.listen():
                if message["type"] == "subscribe":
                    self._backoff = _MIN_BACKOFF_S
                    self._ready.set()
                    log.info("event_hub_subscribed", channel=self._channel)
                    self._broadcast(RESYNC)
                elif message["type"] == "message":
                    self.dispatch(message["data"])
        finally:
            self._ready.clear()
            with contextlib.suppress(redis.RedisError, OSError):
                await pubsub.aclose()  # type: ignore[no-untyped-call]
            with contextlib.suppress(redis.RedisError, OSError):
                await client.aclose()

    def dispatch(self, raw: bytes | str) -> None:
        """Hand one published message to the clients that want it; the frame is encoded once for all.

        Any message may be hostile: one the hub cannot read or encode is skipped and counted, never raised.
        """
        try:
            event = _event(raw, wanted=lambda run_id: run_id in self._by_run)
        except Exception as exc:  # noqa: BLE001 - whatever is published, the hub reads the next message
            self._skip(raw, exc)
            return
        if event is None:
            return
        watchers = tuple(self._by_run.get(event.run_id, ()))
        if event.kind is StreamEvent.STATUS:
            watchers += tuple(s for s in self._everything if s.tenant is None or s.tenant == event.tenant)
        for subscriber in watchers:
            self._offer(subscriber, event)

    def _skip(self, raw: bytes | str, exc: Exception) -> None:
        self._on_unreadable()
        self._unreadable += 1
        now = time.monotonic()
        if now - self._unreadable_logged_at >= UNREADABLE_LOG_S:
            log.warning("event_unreadable", error=f"{type(exc).__name__}: {str(exc)[:_EXCERPT_CHARS]}",
                        message=repr(raw[:_EXCERPT_CHARS]), size=len(raw), skipped=self._unreadable,
                        next_log_in_s=UNREADABLE_LOG_S)
            self._unreadable, self._unreadable_logged_at = 0, now

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


def _event(raw: bytes | str, *, wanted: Callable[[str], bool], event_id: str = "") -> Event | None:
    """The event a published message stands for; None for one no client wants (a step or progress of a run
    nobody watches, an event kind this version does not forward). ``event_id``: the event's id when the
    message does not carry it (an outbox entry, whose id is where it is kept).

    Raises:
        Unreadable: (or any error of decoding and encoding) when it is not a message the scripts publish.
    """
    message = json.loads(raw)
    if not isinstance(message, dict):
        raise Unreadable("not a JSON object")
    kind, run_id = message.get("event"), message.get("run_id")
    if not isinstance(kind, str) or not isinstance(run_id, str) or not _RUN_ID.fullmatch(run_id):
        raise Unreadable("event and run_id must be strings, run_id 32 lowercase hex characters")
    if kind == StreamEvent.STATUS:
        status, reason = message.get("status"), message.get("termination_reason", "")
        tenant = message.get("tenant", "")
        if not isinstance(status, str) or not isinstance(reason, str) or not isinstance(tenant, str):
            raise Unreadable("status, termination_reason and tenant must be strings")
        parsed = RunStatus(status)  # ValueError for a status that is none
        if parsed is RunStatus.UNKNOWN:
            raise Unreadable("unknown is no status a run is ever in")
        data = {**status_data(run_id, parsed.value, reason), **read_run_end(message)}  # ValueError: unreadable
        event_id = message.get("id", event_id)
        if not isinstance(event_id, str) or (event_id and stream_position(event_id) is None):
            raise Unreadable("id must be a stream id")
        plain = frame(StreamEvent.STATUS, data)
        return Event(StreamEvent.STATUS, run_id, 0, plain, parsed.value, event_id,
                     frame(StreamEvent.STATUS, data, event_id=event_id) if event_id else plain, tenant)
    if not wanted(run_id):
        return None
    if kind == StreamEvent.STEP:
        body = message.get("step")
        if not isinstance(body, dict):
            raise Unreadable("step must be an object")
        step = RunStep.from_dict(body)
        if step.sequence < 1:
            raise Unreadable("a step's sequence is a positive integer")
        step_data = frame(StreamEvent.STEP, step_json(step), event_id=step.sequence)
        return Event(StreamEvent.STEP, run_id, step.sequence, step_data, calls=step_calls(step))
    if kind == StreamEvent.PROGRESS:
        progress = message.get("progress")
        if not isinstance(progress, dict):
            raise Unreadable("progress must be an object")
        return Event(StreamEvent.PROGRESS, run_id, 0, frame(StreamEvent.PROGRESS, progress))
    if kind == StreamEvent.DELTA:
        return Event(StreamEvent.DELTA, run_id, 0, frame(StreamEvent.DELTA, _delta(message.get("delta"))))
    return None


def _delta(delta: object) -> dict[str, Any]:
    """A ``delta`` event's data as the worker publishes it (worker/deltas.py): its round and text, nothing else."""
    if not isinstance(delta, dict):
        raise Unreadable("delta must be an object")
    round_number, text = delta.get("round"), delta.get("text")
    if not isinstance(round_number, int) or isinstance(round_number, bool) or round_number < 1:
        raise Unreadable("a delta's round is a positive integer")
    if not isinstance(text, str):
        raise Unreadable("a delta's text is a string")
    return {"round": round_number, "text": text}


class _RunStream:
    """The position of one client's stream of one run: the last step sent and the status last sent."""

    def __init__(self, store: AsyncRunStore, run_id: str, last: int) -> None:
        self.store = store
        self.run_id = run_id
        self.last = last
        self.in_flight: set[str] = set()
        """The tool calls of the steps sent that no step sent answers yet."""
        self.status: RunStatus | None = None
        """The status last sent: a live status event that repeats it, or comes after a terminal one, is
        stale (its PUBLISH reached this process after the replay read the run) and is not sent."""

    def fresh(self, status: str) -> bool:
        """Whether a live status event says something new; if so, it becomes the status last sent."""
        found = RunStatus.parse(status, run_id=self.run_id)
        if found is self.status or (self.status is not None and self.status.is_terminal):
            return False  # terminal is terminal: nothing after it is news
        self.status = found
        return True

    def sent(self, sequence: int, calls: tuple[tuple[str, ...], str]) -> None:
        """A step went out: it is the last one, and it opens or closes tool calls."""
        self.last = sequence
        self.track(calls)

    def track(self, calls: tuple[tuple[str, ...], str]) -> None:
        opened, closed = calls
        self.in_flight.update(opened)
        self.in_flight.discard(closed)

    async def cut_off(self, queue: asyncio.Queue[Event]) -> AsyncIterator[bytes]:
        """The steps the worker of a run cancelled while running records just after the cancel: each call in
        flight, or else the one model call, cut off. Sent as they come, until none is in flight any more after
        at least one, or :data:`CUT_OFF_WAIT_S` passed (nothing was in flight, or a ``finish`` tool goes on
        within its grace: the step is then in ``GET /v1/runs/{id}`` only)."""
        deadline = asyncio.get_running_loop().time() + CUT_OFF_WAIT_S
        came = False
        while not (came and not self.in_flight):
            try:
                async with asyncio.timeout_at(deadline):
                    event = await queue.get()
            except TimeoutError:
                return
            if event.kind is StreamEvent.STEP and event.sequence > self.last:
                self.sent(event.sequence, event.calls)
                came = True
                yield event.frame

    @property
    def ended(self) -> bool:
        """The run's terminal status was sent: the stream ends right after it (docs/http-api.md, "Events")."""
        return self.status is not None and self.status.is_terminal

    async def replay(self, head: tuple[RunRecord, int] | None = None) -> AsyncIterator[bytes]:
        """The steps after :attr:`last`, one page at a time, then the run's status and its call in flight.

        ``head`` is the run without its steps and its number of steps, when the caller read it already.
        """
        record, count = head if head is not None else await self.store.head(self.run_id)
        resumed_at = position = min(max(self.last, 0), count)  # position i holds sequence i + 1
        size = FIRST_PAGE
        calls: set[str] = set()  # the calls whose step was sent: their progress is over
        while position < count:
            page = await self.store.steps(self.run_id, position, min(size, count - position))
            if not page:
                break  # the run's record went (retention) while it was read
            position += len(page)
            sent = 0
            for step in page:
                if step.kind is StepKind.TOOL and step.tool_call_id:
                    calls.add(step.tool_call_id)
                if step.sequence > self.last:
                    chunk = step_frame(self.run_id, step)
                    sent += len(chunk)
                    self.sent(step.sequence, step_calls(step))
                    yield chunk
                else:
                    self.track(step_calls(step))  # sent on an earlier connection: its calls count all the same
            size = max(1, min(PAGE_STEPS, PAGE_BYTES * len(page) // max(sent, 1)))
        status = status_data(record.run_id, record.status.value, record.termination_reason.value)
        if record.status.is_terminal:
            status.update(run_end(await self._answered(record, count)))
        self.status = record.status
        yield frame(StreamEvent.STATUS, status)
        progress = current_progress(record)  # a record without steps: its status and report only
        if progress is not None and resumed_at > 0 and progress.get("tool_call_id") not in calls:
            # A resumed stream did not read the steps the client had: look at the last ones before them.
            start = max(0, resumed_at - FIRST_PAGE)
            calls.update(s.tool_call_id for s in await self.store.steps(self.run_id, start, resumed_at - start)
                         if s.kind is StepKind.TOOL and s.tool_call_id)
        if progress is not None and progress.get("tool_call_id") not in calls:
            yield frame(StreamEvent.PROGRESS, progress)

    async def _answered(self, record: RunRecord, count: int) -> RunRecord:
        """``record`` (read without its steps) with its last steps, among which a completed run's final one
        (the completion appends it last: shared/_store_core.py, ``complete``)."""
        if record.status is not RunStatus.COMPLETED or not count:
            return record
        start = max(0, count - FIRST_PAGE)
        return dataclasses.replace(record, steps=await self.store.steps(self.run_id, start, count - start))


async def run_events(store: AsyncRunStore, subscriber: Subscriber, head: tuple[RunRecord, int],
                     *, last_event_id: int) -> AsyncGenerator[bytes, None]:
    """One client's stream of one run. ``subscriber`` was subscribed before ``head`` (the run without its
    steps, and its number of steps: :meth:`AsyncRunStore.head`) was read; whoever subscribed it
    unsubscribes it when the stream is over (:class:`EventStreamResponse`)."""
    stream = _RunStream(store, head[0].run_id, last_event_id)
    yield f"retry: {RETRY_MS}\n\n".encode()
    async for chunk in stream.replay(head):
        yield chunk
    while not stream.ended:
        try:
            event = await asyncio.wait_for(subscriber.queue.get(), KEEPALIVE_S)
        except TimeoutError:
            yield b": keepalive\n\n"
            continue
        if event is RESYNC:
            # Events may have been lost while the hub reconnected: read the run again.
            async for chunk in stream.replay():
                yield chunk
        elif event.kind is StreamEvent.STEP:
            if event.sequence > stream.last:
                stream.sent(event.sequence, event.calls)
                yield event.frame
        elif event.kind is StreamEvent.STATUS:
            before = stream.status
            if stream.fresh(event.status):
                if before is RunStatus.RUNNING and stream.status is RunStatus.CANCELLED:
                    # The steps of what the cancel cut off come before the status that ends the stream.
                    async for chunk in stream.cut_off(subscriber.queue):
                        yield chunk
                yield event.frame
        else:
            yield event.frame
        if subscriber.dropped and subscriber.queue.empty():
            behind = {"reason": "too far behind; reconnect with Last-Event-ID", "last": stream.last}
            yield frame(StreamEvent.DROPPED, behind)
            return
    yield frame(StreamEvent.END, {"run_id": stream.run_id, "last": stream.last})


FEED_PAGE: Final = 64
"""Outbox entries one replay read of the feed scans in Redis; only the status changes the client may see
among them are sent on to ``serve`` (shared/_api_scripts.py, ``FEED_SCAN``)."""
FEED_REPLAY_MAX_SCAN: Final = 10_000
"""The most outbox entries (every run's events and steps) one replay scans (docs/http-api.md, "Events:
resuming"): past it, the client gets ``resync`` and reads the list again. So a tenant's reconnect costs Redis
at most this much, however much other tenants did meanwhile."""


async def status_events(store: AsyncRunStore, subscriber: Subscriber, *,
                        last_event_id: str | None = None) -> AsyncGenerator[bytes, None]:
    """Every run's status changes (the runs page's list), until the client goes away.

    With ``last_event_id`` (an event id the feed sent), first the status changes after it, replayed from the
    outbox (docs/http-api.md, "Events: resuming"), then live ones: a live event at or before the last one
    sent is not sent again. An id older than the oldest event kept (retention) is answered with ``resync``
    (its data says why) before the replay of what is kept: the client reads the list again. When the hub's
    subscription broke, the feed replays from its last event instead of asking for a resync. ``subscriber``
    was subscribed before the replay began, so nothing falls between the two.
    """
    yield f"retry: {RETRY_MS}\n\n".encode()
    last = last_event_id
    if last is not None:
        async for chunk in _replay_feed(store, last, first=True, tenant=subscriber.tenant):
            if isinstance(chunk, str):
                last = chunk
            else:
                yield chunk
    while True:
        try:
            event = await asyncio.wait_for(subscriber.queue.get(), KEEPALIVE_S)
        except TimeoutError:
            yield b": keepalive\n\n"
            continue
        if event is RESYNC:
            if last is None or store.cluster:
                yield frame(StreamEvent.RESYNC, {})
            else:
                async for chunk in _replay_feed(store, last, first=False, tenant=subscriber.tenant):
                    if isinstance(chunk, str):
                        last = chunk
                    else:
                        yield chunk
        elif event.event_id and last is not None and _not_after(event.event_id, last):
            pass  # replayed already
        else:
            if event.event_id:
                last = event.event_id
            yield event.feed_frame or event.frame
        if subscriber.dropped and subscriber.queue.empty():
            yield frame(StreamEvent.DROPPED, {"reason": "too far behind; reconnect with Last-Event-ID"})
            return


def _not_after(event_id: str, last: str) -> bool:
    here, there = stream_position(event_id), stream_position(last)
    return here is not None and there is not None and here <= there


async def _replay_feed(store: AsyncRunStore, after: str, *, first: bool,
                       tenant: str | None = None) -> AsyncGenerator[bytes | str, None]:
    """The status frames after the event id ``after``, a page at a time; each page's last id (a ``str``) after
    its frames, for the caller's position. A ``resync`` first when events after ``after`` may be gone, and last
    when :data:`FEED_REPLAY_MAX_SCAN` entries were scanned before the end. With ``tenant``, only the events of
    that tenant's runs (the label ``tenant`` the entry carries), chosen in Redis: what ``serve`` reads does not
    grow with other tenants' events. Logs what it scanned (``feed_replayed``)."""
    if store.cluster:
        # Each shard's outbox numbers its own events: one id cannot say where to resume in all of them.
        yield frame(StreamEvent.RESYNC, {"reason": "a feed on a Redis Cluster does not replay"})
        return
    position, scanned, read, sent, bounded = after, 0, 0, 0, False
    while True:
        count = min(FEED_PAGE, FEED_REPLAY_MAX_SCAN - scanned)
        page = await store.feed_page(position, tenant=tenant, count=count)
        if first:
            first = False
            oldest = page.oldest
            if oldest is None or (_not_after(position, oldest) and position != oldest):
                yield frame(StreamEvent.RESYNC, {"reason": "older than the oldest event kept", "oldest": oldest})
        scanned, read = scanned + page.read, read + len(page.entries)
        for entry in page.entries:
            event = _feed_event(entry)
            if event is not None:
                sent += 1
                yield event
        if page.last_read is None:
            break
        position = page.last_read
        yield position
        if page.read < count:
            break
        if scanned >= FEED_REPLAY_MAX_SCAN:
            bounded = True
            yield frame(StreamEvent.RESYNC, {"reason": f"more than {FEED_REPLAY_MAX_SCAN} events to replay; read "
                                                       "the list again"})
            break
    log.info("feed_replayed", tenant=tenant, scanned=scanned, read=read, sent=sent, bounded=bounded)


def _feed_event(entry: OutboxEntry) -> bytes | None:
    """The feed's frame of one outbox entry: a status change (a step, or an entry the store did not write:
    None)."""
    try:
        event = _event(entry.event, wanted=lambda _run_id: False, event_id=entry.stream_id)
    except Exception:  # noqa: BLE001 - whatever is in the stream, the feed goes on
        return None
    return event.feed_frame if event is not None and event.kind is StreamEvent.STATUS else None


class StreamSlots:
    """Event streams open per token on this process, at most ``per_token`` each
    (``RUNBRAKE_API_MAX_STREAMS_PER_TOKEN``; docs/http-api.md, "Events: limits")."""

    def __init__(self, per_token: int) -> None:
        self.per_token = per_token
        self._open: dict[str, int] = {}

    def take(self, who: str) -> Callable[[], None] | None:
        """A slot for ``who``: the callable that gives it back (once, however often it is called), or None
        when all of ``who``'s slots are taken."""
        if self._open.get(who, 0) >= self.per_token:
            return None
        self._open[who] = self._open.get(who, 0) + 1
        given_back = False

        def give_back() -> None:
            nonlocal given_back
            if not given_back:
                given_back = True
                self._open[who] -= 1
                if not self._open[who]:
                    del self._open[who]

        return give_back

    def held(self, who: str) -> int:
        return self._open.get(who, 0)


# -- sending ---------------------------------------------------------------------------------------

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]


class _Stalled(Exception):
    """Raised by a send that did not complete within the send timeout."""


class EventStreamResponse(StreamingResponse):
    """A ``text/event-stream`` response that drops a client that does not read.

    Every send must complete within ``send_timeout_s``. uvicorn's send waits while the transport's
    buffer is full, that is while the client does not read (uvicorn/protocols/http/flow_control.py);
    when one does not complete in time, the stream stops, the client's connection is aborted (``abort``,
    from broker/connections.py; without one the server closes it as it can) and ``on_stall`` is told.
    ``on_close`` runs exactly once when the response is over, however it ends, even when its stream never
    started: it releases what the route took for the stream (its subscriber, its slot).
    """

    def __init__(self, frames: AsyncGenerator[bytes, None], *, send_timeout_s: float, headers: dict[str, str],
                 on_close: Callable[[], None], on_stall: Callable[[], None] = lambda: None,
                 abort: Callable[[Scope], Callable[[], None] | None] = lambda _scope: None) -> None:
        self._pieces = _pieces(frames)
        super().__init__(self._pieces, media_type="text/event-stream", headers=headers)
        self._frames = frames
        self._send_timeout_s = send_timeout_s
        self._on_close = on_close
        self._on_stall = on_stall
        self._abort = abort

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        async def bounded_send(message: Message) -> None:
            try:
                async with asyncio.timeout(self._send_timeout_s):
                    await send(message)
            except TimeoutError:
                raise _Stalled from None

        try:
            await super().__call__(scope, receive, bounded_send)
        except _Stalled:
            abort = self._abort(scope)
            log.info("event_client_stalled", path=scope.get("path"), send_timeout_s=self._send_timeout_s,
                     aborted=abort is not None)
            self._on_stall()
            if abort is not None:
                abort()
                await _disconnected(receive)
        finally:
            try:
                await self._pieces.aclose()
                await self._frames.aclose()  # a stream that never started has nothing to close: on_close does
            finally:
                self._on_close()


async def _pieces(frames: AsyncIterator[bytes]) -> AsyncGenerator[bytes | memoryview, None]:
    async for chunk in frames:
        if len(chunk) <= PIECE_BYTES:
            yield chunk
            continue
        view = memoryview(chunk)
        for start in range(0, len(chunk), PIECE_BYTES):
            yield view[start:start + PIECE_BYTES]


async def _disconnected(receive: Any) -> None:
    """Wait (bounded) until the server saw the aborted connection go, so that it does not log the response
    as left incomplete by the application."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(1.0):
            while (await receive())["type"] != "http.disconnect":
                pass
