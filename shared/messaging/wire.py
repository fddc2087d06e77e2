"""The wire: every RabbitMQ queue and exchange runbrake uses, and every message body on them.

This module is their one owner (docs/messages.md describes them for other languages).
The producer, the cancel publisher, the worker's cancel listener, the demo, the tests and
the benchmarks name, declare, encode, decode and delete through it; nothing else spells
a queue name or builds a body.

Per namespace ``<ns>`` (``RUNBRAKE_NAMESPACE``):

    <ns>.runs            durable queue   run messages (a Dramatiq envelope carrying the run id)
    <ns>.runs.DQ         durable queue   Dramatiq's delay queue for retried run messages
    <ns>.runs.XQ         durable queue   Dramatiq's dead letters
    <ns>.cancel          durable fanout  cancel wake-ups {"run_id": …}; each worker process binds
                                         an exclusive, server-named, auto-delete queue to it
    <ns>.noop[.DQ|.XQ]   durable queue   the benchmarks' no-op actor (a broker ceiling)

The durable queues are classic, or quorum queues with ``RUNBRAKE_QUEUE_TYPE=quorum``.
    <ns>.cancel-requests durable direct  cancel requests from ops tooling {"run_id", "reason", "requested_by"},
                         + durable queue bound to it (routing key: the queue's name); any worker applies
                                         the fence and then wakes <ns>.cancel
    <ns>.cancel-requests.dead  durable queue  cancel requests that could not be read, with the reason why
    <ns>.events          durable topic   run events from the outbox (worker/relay.py): routing keys
                                         ``run.<status>`` and ``step.<kind>``, the run's labels as headers
    <ns>.run-requests    durable direct  run requests from backends: a run spec, answered on reply_to
                         + durable queue bound to it (routing key: the queue's name); any worker admits
                                         and enqueues the run (shared/operations.py, ``enqueue``)
    <ns>.run-requests.dead  durable queue  run requests refused with nobody to answer, with the reason why
    <ns>.steer-requests, <ns>.continue-requests  the same shape as run requests: steers {"run_id", "input",
                         "reason"} and continuations {"run_id", "input", …}, answered on reply_to, each with its
                         .dead queue

The dead-letter queues (``<ns>.runs.XQ``, ``<ns>.noop.XQ``, ``<ns>.cancel-requests.dead``,
``<ns>.run-requests.dead`` and the steer and continue requests') are bounded:
:func:`dead_letter_arguments` (docs/messages.md, "Dead-letter queues: bounds").
"""

from __future__ import annotations

import contextlib
import json
import re
import secrets
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

import pika
import pika.exceptions
import structlog
from pika.adapters.blocking_connection import BlockingChannel, BlockingConnection

from runbrake.shared.errors import FieldProblem, MalformedMessage, SpecError
from runbrake.shared.run_end import read_run_end
from runbrake.shared.settings import Settings
from runbrake.shared.tracing import TRACEPARENT, is_traceparent

if TYPE_CHECKING:
    from dramatiq import Message

    from runbrake.shared.spec import RunSpec

RUN_ACTOR: Final = "execute_run"
"""The Dramatiq actor that executes run messages."""
NOOP_ACTOR: Final = "noop"
"""The benchmarks' no-op actor."""

MAX_CANCEL_BODY_BYTES: Final = 1024
"""A cancel body is ``{"run_id": …}``: anything longer is refused before it is parsed, so a huge or
deeply nested body cannot cost the listener more than a length check."""
MAX_RUN_ID_CHARS: Final = 100

_DRAMATIQ_TWINS: Final = ("", ".DQ", ".XQ")

MAX_CANCEL_REQUEST_BYTES: Final = 4096
"""A cancel request is three short strings: anything longer is dead-lettered before it is parsed."""
MAX_CANCEL_REASON_CHARS: Final = 1000
MAX_REQUESTED_BY_CHARS: Final = 200
DEAD_REASON_HEADER: Final = "x-runbrake-dead-reason"
"""The header a dead-lettered cancel request or run message carries: why it was refused (docs/messages.md)."""
DEAD_SIZE_HEADER: Final = "x-runbrake-dead-size"
"""The header a dead letter cut to its first bytes carries: the body's size, in bytes, as it arrived."""

DEAD_LETTER_MAX_LENGTH: Final = 10_000
"""Messages a dead-letter queue keeps at most; past it the oldest is dropped (``x-overflow: drop-head``)."""
DEAD_LETTER_MAX_BYTES: Final = 64 * 1024 * 1024
"""Body bytes a dead-letter queue keeps at most (64 MiB), the oldest dropped first."""
DEAD_LETTER_TTL_MS: Final = 7 * 24 * 3600 * 1000
"""How long a dead letter is kept: 7 days, Dramatiq's own default for its ``.XQ`` queues."""

PRECONDITION_FAILED: Final = 406
"""AMQP's reply code for a declaration whose arguments differ from the existing queue's."""

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class RequestQueue:
    """A door for requests on RabbitMQ alone (run, steer and continue requests): a durable direct exchange, a
    durable queue of the same name bound to it (binding key: that name), consumed by every worker process,
    and the dead-letter queue ``<name>.dead`` (docs/messages.md, "Run requests: declaration")."""

    name: str

    @property
    def exchange(self) -> str:
        return self.name

    @property
    def queue(self) -> str:
        return self.name

    @property
    def routing_key(self) -> str:
        return self.name

    @property
    def dead_queue(self) -> str:
        """Requests refused with nobody to answer (no usable ``reply_to``), each with a header saying why."""
        return f"{self.name}.dead"

    def declare(self, channel: BlockingChannel, *, queue_type: str = "classic") -> None:
        """Declare the exchange, the queue and the dead-letter queue, and bind them: the same shape and rules
        as :meth:`Topology.declare_cancel_requests`."""
        _declare_request_queue(channel, self.exchange, self.queue, self.dead_queue, queue_type=queue_type)


@dataclass(frozen=True, slots=True)
class Topology:
    """The names of one namespace's queues and exchanges, and how to declare them."""

    namespace: str

    @classmethod
    def of(cls, settings: Settings) -> Topology:
        return cls(settings.namespace)

    @property
    def run_queue(self) -> str:
        """The Dramatiq queue of run messages."""
        return f"{self.namespace}.runs"

    @property
    def noop_queue(self) -> str:
        """The benchmarks' no-op queue."""
        return f"{self.namespace}.noop"

    @property
    def cancel_exchange(self) -> str:
        """The fanout exchange of cancel wake-ups."""
        return f"{self.namespace}.cancel"

    @property
    def cancel_requests_exchange(self) -> str:
        """The direct exchange ops tooling publishes cancel requests on (docs/messages.md)."""
        return f"{self.namespace}.cancel-requests"

    @property
    def cancel_requests_queue(self) -> str:
        """The durable queue bound to it (binding key: its own name), consumed by every worker process."""
        return f"{self.namespace}.cancel-requests"

    @property
    def cancel_requests_routing_key(self) -> str:
        return self.cancel_requests_queue

    @property
    def cancel_requests_dead_queue(self) -> str:
        """Cancel requests that could not be read, each with a header saying why."""
        return f"{self.namespace}.cancel-requests.dead"

    @property
    def events_exchange(self) -> str:
        """The topic exchange run events are published on (docs/messages.md, "Run events")."""
        return f"{self.namespace}.events"

    def declare_events_exchange(self, channel: BlockingChannel) -> None:
        """Declare the events exchange (idempotent; the relay and ``runbrake serve`` call it at start)."""
        channel.exchange_declare(exchange=self.events_exchange, exchange_type="topic", durable=True)

    @property
    def run_requests_exchange(self) -> str:
        """The direct exchange backends publish run requests on (docs/messages.md, "Run requests")."""
        return f"{self.namespace}.run-requests"

    @property
    def run_requests_queue(self) -> str:
        """The durable queue bound to it (binding key: its own name), consumed by every worker process."""
        return f"{self.namespace}.run-requests"

    @property
    def run_requests_routing_key(self) -> str:
        return self.run_requests_queue

    @property
    def run_requests_dead_queue(self) -> str:
        """Run requests refused with nobody to answer (no usable ``reply_to``), each with a header saying why."""
        return f"{self.namespace}.run-requests.dead"

    @property
    def run_requests(self) -> RequestQueue:
        return RequestQueue(self.run_requests_queue)

    @property
    def steer_requests(self) -> RequestQueue:
        """Steers of running runs from backends: ``{"run_id", "input", "reason"}`` (docs/messages.md, "Steer
        requests")."""
        return RequestQueue(f"{self.namespace}.steer-requests")

    @property
    def continue_requests(self) -> RequestQueue:
        """Continuations of finished runs from backends: ``{"run_id", "input", …}`` (docs/messages.md,
        "Continue requests")."""
        return RequestQueue(f"{self.namespace}.continue-requests")

    def queues(self) -> tuple[str, ...]:
        """Every durable queue of the namespace, with Dramatiq's delay and dead-letter twins."""
        return tuple(base + twin for base in (self.run_queue, self.noop_queue) for twin in _DRAMATIQ_TWINS)

    def declare_cancel_requests(self, channel: BlockingChannel, *, queue_type: str = "classic") -> None:
        """Declare the cancel-requests exchange, its queue and the dead-letter queue, and bind them.

        Idempotent for the same ``queue_type``; RabbitMQ refuses (PRECONDITION_FAILED) a queue declared
        again with another type, so every process of a namespace must use the same ``RUNBRAKE_QUEUE_TYPE``.
        A message the consumer rejects without requeue goes to the dead-letter queue through the
        default exchange.
        """
        _declare_request_queue(channel, self.cancel_requests_exchange, self.cancel_requests_queue,
                               self.cancel_requests_dead_queue, queue_type=queue_type)

    def declare_run_requests(self, channel: BlockingChannel, *, queue_type: str = "classic") -> None:
        """Declare the run-requests exchange, its queue and the dead-letter queue, and bind them: the same
        shape and rules as :meth:`declare_cancel_requests` (docs/messages.md, "Run requests: declaration")."""
        self.run_requests.declare(channel, queue_type=queue_type)

    def declare_cancel_exchange(self, channel: BlockingChannel) -> None:
        """Declare the cancel fanout (idempotent; publishers and listeners both call it)."""
        channel.exchange_declare(exchange=self.cancel_exchange, exchange_type="fanout", durable=True)

    def bind_cancel_listener(self, channel: BlockingChannel) -> str:
        """Declare the cancel fanout and a queue of this listener's own bound to it; returns the queue's name.

        The queue is exclusive and auto-deleted: a listener that goes away takes it along, so no cancel piles
        up for a process that no longer exists. It is named ``<ns>.cancel.listener.<random>``, never by the
        server: a server-named queue (``amq.gen-…``) is one a requester may have its answers sent to
        (:func:`reply_to_problem`), and none of runbrake's own may be one.
        """
        self.declare_cancel_exchange(channel)
        queue: str = channel.queue_declare(queue=f"{self.cancel_exchange}.listener.{secrets.token_hex(8)}",
                                           exclusive=True, auto_delete=True).method.queue
        channel.queue_bind(queue=queue, exchange=self.cancel_exchange)
        return queue


def _declare_request_queue(channel: BlockingChannel, exchange: str, queue: str, dead_queue: str, *,
                           queue_type: str) -> None:
    """A durable direct exchange, a durable queue of the same name bound to it (binding key: that name), whose
    rejected messages go to ``dead_queue`` (bounded: :func:`dead_letter_arguments`)."""
    channel.exchange_declare(exchange=exchange, exchange_type="direct", durable=True)
    declare_dead_letter_queue(channel.connection, dead_queue, queue_type=queue_type)
    channel.queue_declare(queue=queue, durable=True, arguments={
        **queue_type_arguments(queue_type),
        "x-dead-letter-exchange": "",
        "x-dead-letter-routing-key": dead_queue,
    })
    channel.queue_bind(queue=queue, exchange=exchange, routing_key=queue)


def queue_type_arguments(queue_type: str) -> dict[str, str]:
    """The declaration arguments ``RUNBRAKE_QUEUE_TYPE`` adds to the namespace's durable queues.

    ``classic`` adds none, so a queue declared before the setting existed stays equivalent.
    ``quorum`` asks for a replicated quorum queue. RabbitMQ refuses to redeclare an existing queue
    with another type (``PRECONDITION_FAILED``): switching needs the old queues deleted first
    (docs/operating.md, "Operating"). A listener's exclusive cancel queue is always classic.
    """
    return {"x-queue-type": "quorum"} if queue_type == "quorum" else {}


def dead_letter_arguments(queue_type: str) -> dict[str, Any]:
    """The arguments of every dead-letter queue: at most :data:`DEAD_LETTER_MAX_LENGTH` messages and
    :data:`DEAD_LETTER_MAX_BYTES`, each kept :data:`DEAD_LETTER_TTL_MS`, the oldest dropped first, so that
    whoever can publish malformed messages cannot fill the broker's disk (docs/messages.md, "Dead-letter
    queues: bounds")."""
    return {
        "x-message-ttl": DEAD_LETTER_TTL_MS,
        "x-max-length": DEAD_LETTER_MAX_LENGTH,
        "x-max-length-bytes": DEAD_LETTER_MAX_BYTES,
        "x-overflow": "drop-head",
        **queue_type_arguments(queue_type),
    }


def declare_dead_letter_queue(connection: BlockingConnection, queue: str, *, queue_type: str) -> Any:
    """Declare a dead-letter queue with its bounds, on a channel of its own; returns the declare's answer.

    A queue declared before the bounds existed has other arguments, and RabbitMQ refuses to redeclare it
    (``PRECONDITION_FAILED``, which closes the channel). Such a queue is kept as it is (a passive declare),
    with a warning naming the fix: a policy, or deleting the queue (docs/messages.md, "Dead-letter queues:
    upgrading"). A worker of an existing deployment therefore starts as before.
    """
    channel = connection.channel()
    try:
        return channel.queue_declare(queue=queue, durable=True, arguments=dead_letter_arguments(queue_type))
    except pika.exceptions.ChannelClosedByBroker as exc:
        if exc.reply_code != PRECONDITION_FAILED:
            raise
        log.warning("dead_letter_queue_unbounded", queue=queue, refused=exc.reply_text[:300],
                    fix="apply the runbrake-dead-letters policy or delete the queue (docs/messages.md, "
                        "'Dead-letter queues: upgrading')")
        channel = connection.channel()
        return channel.queue_declare(queue=queue, passive=True)
    finally:
        if channel.is_open:
            with contextlib.suppress(pika.exceptions.AMQPError):
                channel.close()


# -- run messages --------------------------------------------------------------------------------


def run_message(topology: Topology, run_id: str, *, resume: bool = False,
                traceparent: str | None = None) -> Message[Any]:
    """The Dramatiq message for a run: its id and whether it starts or resumes the run, and, with tracing on,
    the ``traceparent`` of the span that sent it (option ``traceparent``: docs/messages.md, "Run queue: what
    a worker accepts").

    The run's request lives in Redis; a message is only a pointer to it.
    """
    from dramatiq import Message  # noqa: PLC0415 - a cancel (runbrake cancel) publishes no run message

    return Message(
        queue_name=topology.run_queue,
        actor_name=RUN_ACTOR,
        args=(run_id,),
        kwargs={"resume": resume},
        options={TRACEPARENT: traceparent} if traceparent is not None else {},
    )


MAX_RUN_MESSAGE_BYTES: Final = 65_536
"""A run message is a Dramatiq envelope naming one run id (plus, once retried, Dramatiq's traceback): a
longer body is refused before it is parsed."""
MAX_MESSAGE_ID_CHARS: Final = 100
MAX_ENVELOPE_INT: Final = 10**15
"""The largest integer the envelope may carry (a timestamp of the year 33,658): far beyond any real one."""
_ENVELOPE_FIELDS: Final = ("queue_name", "actor_name", "args", "kwargs", "options", "message_id",
                           "message_timestamp")
_RETRY_OPTIONS: Final = {"retries": int, "traceback": str, "requeue_timestamp": int}
"""What Dramatiq's Retries middleware writes into a message it retries; a producer sends no other option than
``traceparent``."""


class MalformedRunMessage(MalformedMessage, ValueError):
    """Raised when a Dramatiq envelope is not one a worker accepts; the message says why (it goes into the dead
    letter). A ``ValueError`` too, as it was before it joined the tree (shared/errors.py)."""


def check_run_message(body: bytes, *, queue: str, actors: Collection[str]) -> None:
    """Check a Dramatiq envelope consumed from ``queue`` before Dramatiq reads it (docs/messages.md,
    "Run queue: what a worker accepts").

    ``actors`` names the actors declared on the queue: the message must be for one of them, published on
    the queue it names, with the arguments that actor takes (``execute_run(run_id, resume=False)``,
    ``noop()``). Dramatiq itself trusts the envelope: a ``queue_name`` naming another queue made a worker
    thread die (``dramatiq/worker.py`` looks the consumer up by it), a delayed one was moved to the queue
    it names, and options such as ``time_limit``, ``max_retries`` or ``on_retry_exhausted`` override the
    actor's.

    Raises:
        MalformedRunMessage: naming the first field that is not accepted. Never anything else.
    """
    if len(body) > MAX_RUN_MESSAGE_BYTES:
        raise MalformedRunMessage(f"body is {len(body)} bytes, more than {MAX_RUN_MESSAGE_BYTES}")
    try:
        data = json.loads(body.decode(), parse_constant=_refuse_constant)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise MalformedRunMessage(f"not UTF-8 JSON: {exc}"[:300]) from None
    if not isinstance(data, dict):
        raise MalformedRunMessage(f"not a JSON object but {type(data).__name__}")
    unknown = sorted(set(data) - set(_ENVELOPE_FIELDS))
    if unknown:
        raise MalformedRunMessage(f"unknown field {unknown[0][:100]!r}")
    missing = [name for name in _ENVELOPE_FIELDS if name not in data]
    if missing:
        raise MalformedRunMessage(f"{missing[0]} is missing")
    if data["queue_name"] != queue:
        raise MalformedRunMessage(f"queue_name must be {queue!r}, the queue it was published to")
    actor = data["actor_name"]
    if not isinstance(actor, str) or actor not in actors:
        raise MalformedRunMessage(f"actor_name must be one of {sorted(actors)}")
    _check_arguments(actor, data["args"], data["kwargs"])
    from dramatiq.common import q_name  # noqa: PLC0415 - as in run_message

    _check_options(data["options"], delayed=queue != q_name(queue))
    message_id = data["message_id"]
    if not isinstance(message_id, str) or not 0 < len(message_id) <= MAX_MESSAGE_ID_CHARS:
        raise MalformedRunMessage(f"message_id must be a string of 1 to {MAX_MESSAGE_ID_CHARS} characters")
    if not _natural(data["message_timestamp"]):
        raise MalformedRunMessage("message_timestamp must be milliseconds since the epoch (an integer)")


def _refuse_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def _natural(value: object) -> bool:
    """An integer (not a bool, not a float) from 0 to :data:`MAX_ENVELOPE_INT`."""
    return type(value) is int and 0 <= value <= MAX_ENVELOPE_INT


def _check_arguments(actor: str, args: object, kwargs: object) -> None:
    if not isinstance(args, list):
        raise MalformedRunMessage("args must be a list")
    if not isinstance(kwargs, dict):
        raise MalformedRunMessage("kwargs must be an object")
    if actor == RUN_ACTOR:
        if len(args) != 1 or not is_run_id(args[0]):
            raise MalformedRunMessage("args must be one run id: 32 lowercase hex characters")
        if set(kwargs) - {"resume"}:
            raise MalformedRunMessage("kwargs may only hold resume")
        if not isinstance(kwargs.get("resume", False), bool):
            raise MalformedRunMessage("kwargs.resume must be true or false")
    elif args or kwargs:
        raise MalformedRunMessage(f"{actor} takes no arguments")


def _check_options(options: object, *, delayed: bool) -> None:
    if not isinstance(options, dict):
        raise MalformedRunMessage("options must be an object")
    for name, value in options.items():
        if name == "eta" and delayed:
            if not _natural(value):
                raise MalformedRunMessage("options.eta must be milliseconds since the epoch (an integer)")
            continue
        if name == TRACEPARENT:
            # The producer's trace (shared/tracing.py): a W3C version-00 value, or the message is refused.
            if not is_traceparent(value):
                raise MalformedRunMessage("options.traceparent must be a W3C traceparent: 00-<32 hex>-<16 hex>-<2 hex>")
            continue
        kind = _RETRY_OPTIONS.get(name)
        if kind is None:
            raise MalformedRunMessage(f"option {name[:100]!r} is not accepted")
        if type(value) is not kind or (kind is int and not _natural(value)):
            raise MalformedRunMessage(f"options.{name} must be {'a string' if kind is str else 'an integer'}")
    if delayed and "eta" not in options:
        raise MalformedRunMessage("a message on a delay queue must carry options.eta")


# -- cancel messages -----------------------------------------------------------------------------

CANCEL_PROPERTIES: Final = pika.BasicProperties(content_type="application/json", delivery_mode=1)
"""Transient: a cancel message is a wake-up, the cancel itself is durable in Redis."""


def cancel_properties(traceparent: str | None) -> pika.BasicProperties:
    """The cancel wake-up's properties: :data:`CANCEL_PROPERTIES`, plus the canceller's ``traceparent`` as an
    AMQP header when it is traced (docs/messages.md, "Cancel exchange: `<ns>.cancel`")."""
    if traceparent is None:
        return CANCEL_PROPERTIES
    return pika.BasicProperties(content_type="application/json", delivery_mode=1, headers={TRACEPARENT: traceparent})


def cancel_traceparent(properties: pika.BasicProperties) -> str | None:
    """The ``traceparent`` header of a cancel message, or None: absent, or anything but a W3C version-00 value
    (whoever can publish on the fanout can write any header). Never raises."""
    headers = properties.headers
    value = headers.get(TRACEPARENT) if isinstance(headers, dict) else None
    if isinstance(value, bytes):
        value = value.decode(errors="replace")
    return value if is_traceparent(value) else None


def encode_cancel(run_id: str) -> bytes:
    """The body of a cancel wake-up."""
    return json.dumps({"run_id": run_id}, separators=(",", ":")).encode()


def encode_steer_wakeup(run_id: str) -> bytes:
    """The body of a steer wake-up on the cancel exchange (docs/messages.md, "Cancel exchange: `<ns>.cancel`"): a
    listener that knows steers reads the run's steer key; an older one finds no cancel key and interrupts nothing."""
    return json.dumps({"run_id": run_id, "steer": True}, separators=(",", ":")).encode()


def is_steer_wakeup(body: bytes) -> bool:
    """Whether a wake-up (already read by :func:`decode_cancel`) says ``"steer": true``. Never raises."""
    try:
        data = json.loads(body) if len(body) <= MAX_CANCEL_BODY_BYTES else None
    except (ValueError, RecursionError):
        return False
    return isinstance(data, dict) and data.get("steer") is True


def decode_cancel(body: bytes) -> str | None:
    """The run id a cancel body names, or None for anything malformed: too long, not UTF-8 JSON,
    not an object, no string ``run_id`` of 1 to 100 characters. Never raises."""
    if len(body) > MAX_CANCEL_BODY_BYTES:
        return None
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        return None
    run_id = data.get("run_id") if isinstance(data, dict) else None
    if not isinstance(run_id, str) or not 0 < len(run_id) <= MAX_RUN_ID_CHARS:
        return None
    return run_id


# -- cancel requests -----------------------------------------------------------------------------

_RUN_ID_CHARS: Final = frozenset("0123456789abcdef")


@dataclass(frozen=True, slots=True)
class CancelRequestBody:
    """A cancel request as ops tooling publishes it (docs/messages.md, "Cancel requests: the body")."""

    run_id: str
    reason: str | None = None
    requested_by: str | None = None


class MalformedCancelRequest(MalformedMessage, ValueError):
    """Raised when a cancel request body cannot be applied; the message says why (it goes into the dead
    letter). A ``ValueError`` too, as it was before it joined the tree (shared/errors.py)."""


def is_run_id(value: object) -> bool:
    """32 lowercase hex characters: the ids the run store creates."""
    return isinstance(value, str) and len(value) == 32 and set(value) <= _RUN_ID_CHARS


def encode_cancel_request(run_id: str, *, reason: str | None = None, requested_by: str | None = None) -> bytes:
    """The body of a cancel request (for tests and Python tooling; other languages write the same JSON)."""
    body: dict[str, str] = {"run_id": run_id}
    if reason is not None:
        body["reason"] = reason
    if requested_by is not None:
        body["requested_by"] = requested_by
    return json.dumps(body, separators=(",", ":")).encode()


def decode_cancel_request(body: bytes) -> CancelRequestBody:
    """Read a cancel request; members other than the three below are ignored.

    Raises:
        MalformedCancelRequest: too long, not UTF-8 JSON, not an object, ``run_id`` not 32 lowercase hex
            characters, ``reason`` or ``requested_by`` not a string or too long. Never anything else.
    """
    if len(body) > MAX_CANCEL_REQUEST_BYTES:
        raise MalformedCancelRequest(f"body is {len(body)} bytes, more than {MAX_CANCEL_REQUEST_BYTES}")
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise MalformedCancelRequest(f"not UTF-8 JSON: {exc}"[:300]) from None
    if not isinstance(data, dict):
        raise MalformedCancelRequest(f"not a JSON object but {type(data).__name__}")
    run_id = data.get("run_id")
    if not is_run_id(run_id):
        raise MalformedCancelRequest("run_id must be a run id: 32 lowercase hex characters")
    fields: dict[str, str | None] = {}
    for name, limit in (("reason", MAX_CANCEL_REASON_CHARS), ("requested_by", MAX_REQUESTED_BY_CHARS)):
        value = data.get(name)
        if value is not None and not isinstance(value, str):
            raise MalformedCancelRequest(f"{name} must be a string, not {type(value).__name__}")
        if value is not None and len(value) > limit:
            raise MalformedCancelRequest(f"{name} is longer than {limit} characters")
        fields[name] = value or None
    return CancelRequestBody(run_id=str(run_id), reason=fields["reason"], requested_by=fields["requested_by"])


# -- run events (docs/messages.md, "Run events") -------------------------------------------------

EVENT_ID_HEADER: Final = "x-runbrake-event-id"
"""The header carrying an event's id (also its ``message_id``): the outbox's stream id, stable across
re-publications, which a consumer deduplicates by."""
RUN_ID_HEADER: Final = "x-runbrake-run-id"
"""The header carrying the run's id, for a headers-exchange binding or a consumer's filter."""
MAX_EVENT_LABELS: Final = 16
"""Labels copied into an event's headers at most (a run spec holds at most 16)."""
MAX_LABEL_CHARS: Final = 256
"""A label name or value longer than this is not copied into the headers (it stays in the body)."""
_EVENT_WORD: Final = re.compile(r"[a-z][a-z0-9_]{0,63}")


@dataclass(frozen=True, slots=True)
class RunEventMessage:
    """One run event as the relay publishes it on ``<ns>.events``: persistent, JSON, ``message_id`` = event id."""

    event_id: str
    routing_key: str
    body: bytes
    properties: pika.BasicProperties
    occurred_at: float
    """When the store wrote it (epoch seconds, from the stream id)."""


def encode_run_event(event_id: str, run_id: str, event: str, labels: str, *,
                     occurred_at: float) -> RunEventMessage | None:
    """The message of one outbox entry (``event``: the JSON the store wrote; ``labels``: the run's labels as
    JSON, or ""), or None when the entry is not an event the store writes (someone else wrote to the stream).

    The body is ``{"event_id", "type", "run_id", "occurred_at", "labels", …}`` with ``status`` and
    ``termination_reason`` for ``run.*`` (and, for a terminal one, ``output``, ``output_json``,
    ``output_truncated``, ``usage`` and ``error``: shared/run_end.py) and ``step`` for ``step.*``
    (docs/messages.md, "Run events: the body").
    Headers: the run's labels (string names and values, each at most :data:`MAX_LABEL_CHARS`, at most
    :data:`MAX_EVENT_LABELS`; none may take a ``x-runbrake-`` name), then ``x-runbrake-event-id`` and
    ``x-runbrake-run-id``.
    """
    try:
        stored = json.loads(event)
    except ValueError:
        return None
    if not isinstance(stored, dict) or stored.get("run_id") != run_id or not is_run_id(run_id):
        return None
    kind = stored.get("event")
    body: dict[str, Any] = {"event_id": event_id, "type": "", "run_id": run_id, "occurred_at": occurred_at,
                            "labels": _labels(labels)}
    if kind == "status":
        status, reason = stored.get("status"), stored.get("termination_reason", "")
        if not isinstance(status, str) or not _EVENT_WORD.fullmatch(status) or not isinstance(reason, str):
            return None
        try:
            end = read_run_end(stored)
        except ValueError:
            return None
        body.update(type=f"run.{status}", status=status, termination_reason=reason, **end)
    elif kind == "step":
        step = stored.get("step")
        step_kind = step.get("kind") if isinstance(step, dict) else None
        if not isinstance(step_kind, str) or not _EVENT_WORD.fullmatch(step_kind):
            return None
        body.update(type=f"step.{step_kind}", step=step)
    else:
        return None
    headers: dict[str, Any] = {name: value for name, value in body["labels"].items()
                               if not name.lower().startswith("x-runbrake-")}
    headers.update({EVENT_ID_HEADER: event_id, RUN_ID_HEADER: run_id})
    properties = pika.BasicProperties(
        content_type="application/json", delivery_mode=2, message_id=event_id, type=body["type"],
        timestamp=int(occurred_at), app_id="runbrake", headers=headers)
    encoded = json.dumps(body, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()
    return RunEventMessage(event_id, body["type"], encoded, properties, occurred_at)


def _labels(raw: str) -> dict[str, str]:
    """The run's labels as the relay copies them: string names and values within the bounds, at most
    :data:`MAX_EVENT_LABELS` (anything else in the field is left out, never raised)."""
    if not raw:
        return {}
    try:
        labels = json.loads(raw)
    except ValueError:
        return {}
    if not isinstance(labels, dict):
        return {}
    kept = {name: value for name, value in labels.items()
            if isinstance(value, str) and 0 < len(name) <= MAX_LABEL_CHARS and len(value) <= MAX_LABEL_CHARS}
    return dict(list(kept.items())[:MAX_EVENT_LABELS])
# -- run requests --------------------------------------------------------------------------------

DIRECT_REPLY_TO: Final = "amq.rabbitmq.reply-to"
"""RabbitMQ's direct reply-to: the consumer of a request published with this ``reply_to`` sees
``amq.rabbitmq.reply-to.<token>``, which routes to the publishing channel alone (issue 27, finding 8)."""
SERVER_NAMED: Final = "amq.gen-"
"""The prefix of a queue the server named: a requester's own exclusive reply queue (RabbitMQ's RPC tutorial).
runbrake names every queue of its own, its cancel listeners' included (:meth:`Topology.bind_cancel_listener`),
so none of them can be one."""


def reply_to_problem(reply_to: str) -> str | None:
    """Why a request's ``reply_to`` cannot be answered, or None when it can: RabbitMQ's direct reply-to, or a
    server-named queue (docs/messages.md, "Run requests: trust"). A named queue is refused: the worker's user
    may write to every queue, and ``<ns>.cancel-requests`` would read the answer ``{"run_id": …}`` as a cancel
    request, ``<ns>.runs`` or an application's queue would get an injected message."""
    if reply_to == DIRECT_REPLY_TO or reply_to.startswith((DIRECT_REPLY_TO + ".", SERVER_NAMED)):
        return None
    return ("reply_to must be RabbitMQ's direct reply-to (amq.rabbitmq.reply-to) or a server-named queue "
            "(amq.gen-…) of the requester's own: a named queue is never answered")


def decode_run_request(body: bytes, *, max_bytes: int) -> RunSpec:
    """The run spec a run request carries (docs/messages.md, "Run requests: the body"): the same JSON as
    ``POST /v1/runs``, read by the same parser.

    Raises:
        SpecError: longer than ``max_bytes`` (checked before parsing), not UTF-8 JSON, NaN or Infinity,
            nested too deep, not an object, or naming every invalid field. Never anything else.
    """
    if len(body) > max_bytes:
        raise SpecError("spec", f"is {len(body)} bytes; the limit is {max_bytes} (RUNBRAKE_MAX_SPEC_BYTES)")
    from runbrake.shared.spec import RunSpec  # noqa: PLC0415 - a cancel's publisher needs none of the spec's models

    return RunSpec.from_json(body)


def encode_run_request_answer(run_id: str, status: str, *, created: bool) -> bytes:
    """The reply to an admitted run request: ``{"run_id", "status", "created"}``, as ``POST /v1/runs`` answers."""
    return json.dumps({"run_id": run_id, "status": status, "created": created}, separators=(",", ":")).encode()


def encode_run_request_refusal(error: str, problems: Sequence[FieldProblem], *, run_id: str | None = None) -> bytes:
    """The reply to a refused run request: ``{"error", "errors": [{"loc", "msg", "field"}]}``, the body of the
    HTTP API's 422 (docs/http-api.md, "Errors"), with ``run_id`` when the refusal names a run."""
    answer: dict[str, Any] = {
        "error": error,
        "errors": [{"loc": list(p.loc), "msg": p.msg, "field": p.field} for p in problems],
    }
    if run_id is not None:
        answer["run_id"] = run_id
    return json.dumps(answer, separators=(",", ":")).encode()


# -- steer and continue requests (docs/messages.md, "Steer requests", "Continue requests") ----------


@dataclass(frozen=True, slots=True)
class SteerRequestBody:
    """A steer request as read: the run, the new user message and why (checked further by the steer)."""

    run_id: str
    input: object
    reason: object


STEER_REQUEST_FIELDS: Final = frozenset({"run_id", "input", "reason"})


def _request_object(body: bytes, *, max_bytes: int, what: str) -> dict[str, Any]:
    """A request's body as a JSON object, bounded before it is parsed.

    Raises:
        SpecError: longer than ``max_bytes``, not UTF-8 JSON, nested too deep, or not an object.
    """
    if len(body) > max_bytes:
        raise SpecError("body", f"is {len(body)} bytes; the limit is {max_bytes} (RUNBRAKE_MAX_SPEC_BYTES)")
    try:
        data = json.loads(body, parse_constant=_refuse_constant)
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        raise SpecError("body", f"must be UTF-8 JSON: {what}") from None
    if not isinstance(data, dict):
        raise SpecError("body", f"must be a JSON object: {what}")
    return data


def _run_id_problem(data: dict[str, Any]) -> FieldProblem | None:
    if is_run_id(data.get("run_id")):
        return None
    return FieldProblem(loc=("run_id",), msg="must be a run id: 32 lowercase hex characters")


def decode_steer_request(body: bytes, *, max_bytes: int) -> SteerRequestBody:
    """Read a steer request ``{"run_id", "input", "reason"?}``; the input's and the reason's bounds are the
    steer's own (:func:`runbrake.shared.messaging.steer.check_steer`).

    Raises:
        SpecError: naming every offending field (``body``, ``run_id``, an unknown field). Never anything else.
    """
    data = _request_object(body, max_bytes=max_bytes, what='{"run_id": "...", "input": "...", "reason": "..."}')
    problems = [FieldProblem(loc=(name,), msg="is not a field of a steer request (run_id, input, reason)")
                for name in sorted(set(data) - STEER_REQUEST_FIELDS)][:20]
    if (problem := _run_id_problem(data)) is not None:
        problems.insert(0, problem)
    if problems:
        raise SpecError.from_problems(problems)
    return SteerRequestBody(run_id=data["run_id"], input=data.get("input"), reason=data.get("reason", ""))


def decode_continue_request(body: bytes, *, max_bytes: int) -> tuple[str, dict[str, Any]]:
    """Read a continue request ``{"run_id", "input", …}``: the run to continue, and the rest, which is the body
    of ``POST /v1/runs/{id}/continue`` (checked as the spec it makes: shared/threads.py).

    Raises:
        SpecError: too long, not a JSON object, or no valid ``run_id``. Never anything else.
    """
    data = _request_object(body, max_bytes=max_bytes, what='{"run_id": "...", "input": "...", ...}')
    if (problem := _run_id_problem(data)) is not None:
        raise SpecError.from_problems([problem])
    run_id = data.pop("run_id")
    return run_id, data


def encode_steer_request_answer(run_id: str, found: str, *, message_confirmed: bool) -> bytes:
    """The reply to an applied steer request, as ``POST /v1/runs/{id}/steer`` answers."""
    return json.dumps({"run_id": run_id, "steered": True, "found": found, "message_confirmed": message_confirmed},
                      separators=(",", ":")).encode()


# -- the whole topology --------------------------------------------------------------------------


def declare_events(settings: Settings) -> None:
    """Declare ``<ns>.events`` on a connection of its own (``runbrake serve`` at start; the relay declares it
    on each of its connections), so that a consumer may bind to it before any worker ran.

    Raises:
        pika.exceptions.AMQPError: when RabbitMQ cannot be reached.
    """
    connection = pika.BlockingConnection(connection_parameters(settings, connection_attempts=1))
    try:
        Topology.of(settings).declare_events_exchange(connection.channel())
    finally:
        with contextlib.suppress(pika.exceptions.AMQPError):
            connection.close()
def connection_parameters(settings: Settings, *, name: str = "", **options: Any) -> list[pika.URLParameters]:
    """How a connection reaches RabbitMQ: one set of parameters per node of ``RUNBRAKE_RABBITMQ_URL``, in
    its order; ``pika.BlockingConnection`` tries them in turn and connects to the first that answers (a
    reconnect starts from the first again: docs/operating.md, "A RabbitMQ cluster"). ``name`` is the
    connection's name in ``rabbitmqctl list_connections client_properties``; ``options`` set parameters
    (``socket_timeout``, ``connection_attempts``…) on every node's."""
    nodes = []
    for url in settings.rabbitmq_urls:
        parameters = pika.URLParameters(url)
        if name:
            parameters.client_properties = {"connection_name": name}
        for option, value in options.items():
            setattr(parameters, option, value)
        nodes.append(parameters)
    return nodes


KEEP_ALIVE_MAX_S: Final = 5.0
"""The longest an idle connection goes unserviced, whatever heartbeat RabbitMQ proposed."""


def keep_alive_interval(connection: BlockingConnection | None) -> float:
    """How often the owner of an idle ``connection`` services it (:func:`keep_alive`): four times per
    negotiated heartbeat, since pika sends one every half heartbeat only while the connection is serviced and
    RabbitMQ drops a connection after two silent ones (issue 30; docs/messages.md, "Idle connections")."""
    parameters = getattr(getattr(connection, "_impl", None), "params", None)
    heartbeat = getattr(parameters, "heartbeat", None)
    if not isinstance(heartbeat, int | float) or heartbeat <= 0:
        return KEEP_ALIVE_MAX_S
    return max(0.1, min(KEEP_ALIVE_MAX_S, heartbeat / 4))


def keep_alive(connection: BlockingConnection | None) -> bool:
    """Service an idle ``connection`` on the thread that owns it: send the heartbeat that is due and read what
    RabbitMQ sent (a heartbeat, or the close of a connection it dropped). Answers whether it is still open; a
    lost one is to be closed and opened again before its next use.

    A ``BlockingConnection`` that nothing uses answers no heartbeats: RabbitMQ dropped serve's cancel publisher
    after a few idle minutes, and the next cancel was not confirmed (issue 30)."""
    if connection is None or not connection.is_open:
        return False
    try:
        connection.process_data_events(time_limit=0)
    except pika.exceptions.AMQPError as exc:
        log.info("rabbitmq_idle_connection_lost", error=repr(exc)[:300])
        return False
    return bool(connection.is_open)


def delete_topology(settings: Settings) -> None:
    """Delete every queue and exchange of ``settings.namespace`` (tests, the demo and the benchmarks
    clean up with this). Missing ones are fine.

    Raises:
        pika.exceptions.AMQPError: when RabbitMQ cannot be reached.
    """
    topology = Topology.of(settings)
    connection = pika.BlockingConnection(connection_parameters(settings))
    try:
        channel = connection.channel()
        requests = (topology.run_requests, topology.steer_requests, topology.continue_requests)
        for queue in (*topology.queues(), topology.cancel_requests_queue, topology.cancel_requests_dead_queue,
                      *(name for door in requests for name in (door.queue, door.dead_queue))):
            channel.queue_delete(queue=queue)
        channel.exchange_delete(exchange=topology.cancel_exchange)
        channel.exchange_delete(exchange=topology.cancel_requests_exchange)
        channel.exchange_delete(exchange=topology.events_exchange)
        for door in requests:
            channel.exchange_delete(exchange=door.exchange)
    finally:
        with contextlib.suppress(pika.exceptions.AMQPError):
            connection.close()
