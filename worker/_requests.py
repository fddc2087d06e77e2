"""What the consumers of requests on RabbitMQ alone share (docs/messages.md, "Run requests", "Steer requests",
"Continue requests"): one durable queue each, consumed by every worker process with manual acks; the request's
properties checked, its ``reply_to`` answered only on RabbitMQ's direct reply-to or a server-named queue
(``reply_to_problem`` in shared/messaging/wire.py), its tenant taken from the
``user_id`` RabbitMQ checked; each request acked once its outcome is settled, answered, or dead-lettered with
the reason when nobody can be answered.

A subclass says which queue it consumes (``door``), what its log events are called (``kind``) and what a
request comes to (:meth:`RequestConsumer._admit`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import pika
import pika.exceptions
import structlog
from pika.adapters.blocking_connection import BlockingChannel

from runbrake.shared.errors import FieldProblem, StoreError
from runbrake.shared.messaging.producer import Producer
from runbrake.shared.messaging.wire import (
    DEAD_REASON_HEADER,
    DEAD_SIZE_HEADER,
    RequestQueue,
    encode_run_request_refusal,
    reply_to_problem,
)
from runbrake.shared.settings import Settings
from runbrake.worker._consumer import ConsumerThread

log = structlog.get_logger(__name__)

PREFETCH = 4
"""Unacked requests one consumer holds at most: each is a body of at most RUNBRAKE_MAX_SPEC_BYTES."""
_STORE_RETRY_S = 1.0
MAX_DEAD_REASON_CHARS = 500


@dataclass(frozen=True, slots=True)
class Answer:
    """What a request came to: the reply's body, and why it was refused (None: it was applied)."""

    body: bytes
    refused: str | None = None


def refusal(error: str, problems: Iterable[FieldProblem], *, run_id: str | None = None) -> Answer:
    """The reply's body, ``{"error", "errors": [{"loc", "msg", "field"}]}`` (the HTTP API's 422), and the same in
    one line for a dead letter's reason header."""
    found = tuple(problems)
    reason = f"{error}: " + "; ".join(f"{p.field}: {p.msg}" for p in found)
    return Answer(encode_run_request_refusal(error, found, run_id=run_id), refused=reason[:MAX_DEAD_REASON_CHARS])


class RequestConsumer(ConsumerThread):
    """Consumes one request queue (``door``) and answers each request. Reconnects with backoff."""

    kind: str
    """Names the log events: ``<kind>_request_dead_lettered`` and the like."""

    def __init__(self, settings: Settings, producer: Producer, door: RequestQueue) -> None:
        super().__init__(settings)
        self._producer = producer
        self._door = door

    def _admit(self, body: bytes, *, message_id: str | None, user: str | None) -> Answer:
        """Apply the request; every refusal is an answer.

        Raises:
            StoreError: Redis could not be reached (nothing decided: the request is tried again).
        """
        raise NotImplementedError

    def _requester(self, user: str | None) -> tuple[str | None, Answer | None]:
        """The tenant whose request this is, from the catalog's ``[rabbitmq_users]``, or the refusal of a user
        that may not ask (``RUNBRAKE_RABBITMQ_ALLOW_UNTENANTED``)."""
        tenant, refused = self._producer.catalog.requester(
            user, allow_untenanted=self._settings.rabbitmq_allow_untenanted)
        if refused is not None:
            log.info(f"{self.kind}_request_untenanted", by=f"amqp:{user}" if user else "amqp")
            return None, refusal("request refused", [FieldProblem(loc=("properties", "user_id"), msg=refused)])
        return tenant, None

    def _keep_alive(self) -> float:
        return self._producer.keep_alive()  # the run messages' connection, idle between requests

    def _consume(self, channel: BlockingChannel) -> str:
        self._door.declare(channel, queue_type=self._settings.queue_type)
        channel.confirm_delivery()  # a reply or a dead letter is acked only once RabbitMQ has it
        channel.basic_qos(prefetch_count=PREFETCH)
        channel.basic_consume(queue=self._door.queue, on_message_callback=self._on_message)
        return self._door.queue

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
        # published, and the catalog's [rabbitmq_users] says whose tenant's runs that user asks for.
        user: str | None = texts["user_id"] or None
        try:
            answer = self._admit(body, message_id=texts["message_id"] or None, user=user)
        except StoreError as exc:
            # Not the request's fault: keep it, and try again after a pause (the connection stays serviced).
            log.warning(f"{self.kind}_request_store_unavailable", error=str(exc), retry_in_s=_STORE_RETRY_S)
            if self._connection is not None:
                self._connection.sleep(_STORE_RETRY_S)
            channel.basic_nack(delivery_tag=method.delivery_tag, requeue=True)
            return
        except pika.exceptions.AMQPError:
            raise  # the reconnecting loop (worker/_consumer.py) starts over; the request is delivered again
        except Exception as exc:
            # A bug must not loop the consumer on one message (it would come back after every restart).
            log.exception(f"{self.kind}_request_failed")
            self._dead_letter(channel, method, properties, body, f"could not be handled: {exc!r}"[:300])
            return
        if reply_to is None:
            if answer.refused is not None:
                self._dead_letter(channel, method, properties, body, answer.refused)
                return
        else:
            self._reply(channel, reply_to, texts["correlation_id"], answer.body)
        channel.basic_ack(delivery_tag=method.delivery_tag)

    def _reply(self, channel: BlockingChannel, reply_to: str, correlation_id: str | None, body: bytes) -> None:
        """Publish the answer on the default exchange to ``reply_to``, confirmed. A requester that is gone
        loses its answer, not what the request did: asking again with the same key answers the same."""
        try:
            channel.basic_publish(exchange="", routing_key=reply_to, body=body, mandatory=True,
                                  properties=pika.BasicProperties(content_type="application/json", delivery_mode=1,
                                                                  correlation_id=correlation_id))
        except (pika.exceptions.UnroutableError, pika.exceptions.NackError) as exc:
            log.warning(f"{self.kind}_request_reply_lost", reply_to=reply_to, correlation_id=correlation_id,
                        error=repr(exc)[:300])

    def _dead_letter(self, channel: BlockingChannel, method: Any, properties: pika.BasicProperties, body: bytes,
                     reason: str) -> None:
        log.warning(f"{self.kind}_request_dead_lettered", reason=reason, size=len(body))
        # None of the message's headers are copied: a hostile header may not survive re-encoding.
        headers: dict[str, Any] = {DEAD_REASON_HEADER: reason}
        limit = self._settings.max_spec_bytes
        if len(body) > limit:
            headers[DEAD_SIZE_HEADER] = len(body)
            body = body[:limit]
        copied = {name: value for name in ("content_type", "correlation_id", "message_id")
                  if isinstance(value := getattr(properties, name, None), str)}
        try:
            channel.basic_publish(exchange="", routing_key=self._door.dead_queue, body=body,
                                  mandatory=True, properties=pika.BasicProperties(delivery_mode=2, headers=headers,
                                                                                  **copied))
        except (pika.exceptions.UnroutableError, pika.exceptions.NackError) as exc:
            log.warning(f"{self.kind}_request_dead_letter_failed", error=repr(exc)[:300])
            # The queue's x-dead-letter-* arguments route it to the same queue, without the reason header.
            channel.basic_reject(delivery_tag=method.delivery_tag, requeue=False)
            return
        channel.basic_ack(delivery_tag=method.delivery_tag)
