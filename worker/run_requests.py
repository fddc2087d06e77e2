"""The run-requests consumer: runs that backends request on RabbitMQ alone (docs/messages.md, "Run requests").

One :class:`RunRequestConsumer` per worker process consumes the durable queue ``<ns>.run-requests`` (pika, on
its own thread and connection), with manual acks and a small prefetch. Each body is a run spec, the same JSON
as ``POST /v1/runs``, admitted and enqueued through the same call every entry point uses
(:func:`runbrake.shared.operations.enqueue`: the catalog, the bounds, idempotency). When the message names a
``reply_to``, the answer goes there with the message's ``correlation_id``: ``{"run_id", "status", "created"}``
or ``{"error", "errors": [{"loc", "msg", "field"}]}``, the HTTP API's 422 body.

A request is acked only once its outcome is settled: the run written and its message confirmed, or the
refusal answered (or, with nobody to answer, republished on ``<ns>.run-requests.dead`` with the reason). When
Redis cannot be reached, nothing was decided: the request is requeued after a pause, so it is delivered at
least once. A redelivered request that was already written finds its idempotency key (the body's, or else the
message's ``message_id``) and answers the same run.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import pika
import pika.exceptions
import structlog
from pika.adapters.blocking_connection import BlockingChannel

from runbrake.shared import operations
from runbrake.shared.errors import (
    FieldProblem,
    IdempotencyConflict,
    PublishError,
    QuotaExceeded,
    SpecError,
    StoreError,
)
from runbrake.shared.messaging.producer import Producer
from runbrake.shared.messaging.wire import (
    DEAD_REASON_HEADER,
    DEAD_SIZE_HEADER,
    Topology,
    decode_run_request,
    encode_run_request_answer,
    encode_run_request_refusal,
    reply_to_problem,
)
from runbrake.shared.settings import Settings
from runbrake.worker._consumer import ConsumerThread

log = structlog.get_logger(__name__)

PREFETCH = 4
"""Unacked requests one consumer holds at most: each is a spec of at most RUNBRAKE_MAX_SPEC_BYTES."""
_STORE_RETRY_S = 1.0
MESSAGE_ID_KEY_PREFIX = "message-id:"
"""A request without ``idempotency_key`` is keyed by its ``message_id`` property, under this prefix."""


@dataclass(frozen=True, slots=True)
class Answer:
    """What a request came to: the reply's body, and why it was refused (None: a run was enqueued)."""

    body: bytes
    refused: str | None = None


class RunRequestConsumer(ConsumerThread):
    """Consumes ``<ns>.run-requests``, enqueues each run and answers. Reconnects with backoff."""

    role = "run_requests"

    def __init__(self, settings: Settings, producer: Producer) -> None:
        super().__init__(settings)
        self._producer = producer
        self._topology = Topology.of(settings)

    def _consume(self, channel: BlockingChannel) -> str:
        self._topology.declare_run_requests(channel, queue_type=self._settings.queue_type)
        channel.confirm_delivery()  # a reply or a dead letter is acked only once RabbitMQ has it
        channel.basic_qos(prefetch_count=PREFETCH)
        channel.basic_consume(queue=self._topology.run_requests_queue, on_message_callback=self._on_message)
        return self._topology.run_requests_queue

    def _on_message(self, channel: BlockingChannel, method: Any, properties: pika.BasicProperties,
                    body: bytes) -> None:
        texts = {name: getattr(properties, name, None) for name in ("reply_to", "correlation_id", "message_id",
                                                                    "user_id")}
        not_text = [name for name, value in texts.items() if value is not None and not isinstance(value, str)]
        if not_text:  # pika keeps a short string that is not UTF-8 as bytes
            self._dead_letter(channel, method, properties, body, f"{not_text[0]} is not UTF-8")
            return
        reply_to: str | None = texts["reply_to"] or None
        problem = reply_to_problem(reply_to) if reply_to else None
        if problem:
            self._dead_letter(channel, method, properties, body, problem)
            return
        # RabbitMQ checks a user_id property against the publishing connection's user: when set, it names who
        # published, and the catalog's [rabbitmq_users] says whose tenant's runs that user creates.
        user: str | None = texts["user_id"] or None
        try:
            answer = self._admit(body, message_id=texts["message_id"] or None, user=user)
        except StoreError as exc:
            # Not the request's fault: keep it, and try again after a pause (the connection stays serviced).
            log.warning("run_request_store_unavailable", error=str(exc), retry_in_s=_STORE_RETRY_S)
            if self._connection is not None:
                self._connection.sleep(_STORE_RETRY_S)
            channel.basic_nack(delivery_tag=method.delivery_tag, requeue=True)
            return
        except pika.exceptions.AMQPError:
            raise  # the reconnecting loop (worker/_consumer.py) starts over; the request is delivered again
        except Exception as exc:
            # A bug must not loop the consumer on one message (it would come back after every restart).
            log.exception("run_request_failed")
            self._dead_letter(channel, method, properties, body, f"could not be handled: {exc!r}"[:300])
            return
        if reply_to is None:
            if answer.refused is not None:
                self._dead_letter(channel, method, properties, body, answer.refused)
                return
        else:
            self._reply(channel, reply_to, texts["correlation_id"], answer.body)
        channel.basic_ack(delivery_tag=method.delivery_tag)

    def _admit(self, body: bytes, *, message_id: str | None, user: str | None) -> Answer:
        """Enqueue the run the body asks for; every refusal is an answer.

        Raises:
            StoreError: Redis could not be reached (nothing decided).
        """
        try:
            spec = decode_run_request(body, max_bytes=self._settings.max_spec_bytes)
        except SpecError as exc:
            log.info("run_request_invalid", problems=[p.field for p in exc.problems][:20], size=len(body))
            return _refusal("invalid run spec", exc.problems)
        keyed_by_message = spec.idempotency_key is None and message_id is not None
        if keyed_by_message:
            # At least once: a request redelivered after its run was written (a worker that died before the
            # ack) must not create a second run. The stored request stays the body as it came.
            spec = spec.model_copy(update={"idempotency_key": MESSAGE_ID_KEY_PREFIX + str(message_id)})
        who = f"amqp:{user}" if user else "amqp"
        tenant, refused = self._producer.catalog.requester(
            user, allow_untenanted=self._settings.rabbitmq_allow_untenanted)
        if refused is not None:
            log.info("run_request_untenanted", by=who)
            return _refusal("request refused", [FieldProblem(loc=("properties", "user_id"), msg=refused)])
        try:
            enqueued = operations.enqueue(self._producer, spec, scope=idempotency_scope(user), tenant=tenant)
        except SpecError as exc:  # the admission policy: the catalog, inline definitions, the bounds
            log.info("run_request_refused", by=who, problems=[p.field for p in exc.problems][:20])
            return _refusal("run spec refused", exc.problems)
        except QuotaExceeded as exc:
            log.info("run_request_over_quota", by=who, tenant=tenant, quota=exc.quota)
            retry = (f"; ask again in {exc.retry_after_s} s" if exc.retry_after_s
                     else "; ask again once one of its runs ends")
            return _refusal(str(exc), [FieldProblem(loc=("tenant",), msg=f"{exc.quota} is {exc.limit}{retry}")])
        except IdempotencyConflict as exc:
            loc: tuple[str, ...] = ("properties", "message_id") if keyed_by_message else ("idempotency_key",)
            log.info("run_request_conflict", by=who, run_id=exc.run_id)
            return _refusal(str(exc), [FieldProblem(loc=loc, msg="already names a run created from a different "
                                                                 "spec")], run_id=exc.run_id)
        except PublishError as exc:
            log.warning("run_request_publish_failed", by=who, error=str(exc))
            return _refusal("RabbitMQ did not take the run's message; the run is failed (enqueue_failed)",
                            [FieldProblem(loc=("spec",), msg="the run's message was not confirmed by RabbitMQ")])
        log.info("run_request_enqueued" if enqueued.created else "run_request_deduplicated", run_id=enqueued.run_id,
                 by=who, status=enqueued.status.value)
        return Answer(encode_run_request_answer(enqueued.run_id, enqueued.status.value, created=enqueued.created))

    def _reply(self, channel: BlockingChannel, reply_to: str, correlation_id: str | None, body: bytes) -> None:
        """Publish the answer on the default exchange to ``reply_to``, confirmed. A requester that is gone
        loses its answer, not its run: the run stands, and asking again with the same key answers it."""
        try:
            channel.basic_publish(exchange="", routing_key=reply_to, body=body, mandatory=True,
                                  properties=pika.BasicProperties(content_type="application/json", delivery_mode=1,
                                                                  correlation_id=correlation_id))
        except (pika.exceptions.UnroutableError, pika.exceptions.NackError) as exc:
            log.warning("run_request_reply_lost", reply_to=reply_to, correlation_id=correlation_id,
                        error=repr(exc)[:300])

    def _dead_letter(self, channel: BlockingChannel, method: Any, properties: pika.BasicProperties, body: bytes,
                     reason: str) -> None:
        log.warning("run_request_dead_lettered", reason=reason, size=len(body))
        # None of the message's headers are copied: a hostile header may not survive re-encoding.
        headers: dict[str, Any] = {DEAD_REASON_HEADER: reason}
        limit = self._settings.max_spec_bytes
        if len(body) > limit:
            headers[DEAD_SIZE_HEADER] = len(body)
            body = body[:limit]
        copied = {name: value for name in ("content_type", "correlation_id", "message_id")
                  if isinstance(value := getattr(properties, name, None), str)}
        try:
            channel.basic_publish(exchange="", routing_key=self._topology.run_requests_dead_queue, body=body,
                                  mandatory=True, properties=pika.BasicProperties(delivery_mode=2, headers=headers,
                                                                                  **copied))
        except (pika.exceptions.UnroutableError, pika.exceptions.NackError) as exc:
            log.warning("run_request_dead_letter_failed", error=repr(exc)[:300])
            # The queue's x-dead-letter-* arguments route it to the same queue, without the reason header.
            channel.basic_reject(delivery_tag=method.delivery_tag, requeue=False)
            return
        channel.basic_ack(delivery_tag=method.delivery_tag)


def idempotency_scope(user: str | None) -> str:
    """The idempotency keys of requests from RabbitMQ user ``user`` (or from no named user): a scope of their
    own, apart from each HTTP token's and the CLI's (a token name has no ``/``; the user is quoted, so no ``:``
    of a user's name can make two users' keys meet)."""
    return "amqp/" + quote(user or "", safe="")


MAX_DEAD_REASON_CHARS = 500


def _refusal(error: str, problems: Iterable[FieldProblem], *, run_id: str | None = None) -> Answer:
    """The reply's body, and the same in one line for a dead letter's reason header."""
    found = tuple(problems)
    reason = f"{error}: " + "; ".join(f"{p.field}: {p.msg}" for p in found)
    return Answer(encode_run_request_refusal(error, found, run_id=run_id), refused=reason[:MAX_DEAD_REASON_CHARS])

