"""The cancel-requests consumer: cancels that ops tooling publishes on RabbitMQ alone
(docs/messages.md, "Cancel requests").

One :class:`CancelRequestConsumer` per worker process consumes the durable queue
``<ns>.cancel-requests`` (pika, on its own thread and connection: pika is not thread-safe), with
manual acks and a small prefetch. Each request is applied like ``runbrake cancel``: the fence in
Redis (:func:`runbrake.shared.messaging.cancel.cancel_run`), then the wake-up on ``<ns>.cancel``. The queue is
shared by every worker, so each request is applied by one of them; a redelivered or repeated request
finds the run already cancelled and is acked with a log line (at-least-once, idempotent).

A request that cannot be read (not JSON, too long, wrong types, not a run id) is never retried and
never stops the consumer: it is republished on ``<ns>.cancel-requests.dead`` with a header saying
why, then acked; if even that fails it is rejected without requeue, which the queue's dead-letter
arguments route to the same place. When Redis cannot be reached, the request is requeued after a
backoff: it is not malformed, and the cancel must not be lost.
"""

from __future__ import annotations

from typing import Any

import pika
import pika.data
import pika.exceptions
import structlog
from pika.adapters.blocking_connection import BlockingChannel

from runbrake.shared import tracing
from runbrake.shared.catalog import Admission
from runbrake.shared.errors import StoreError
from runbrake.shared.logging import silenced
from runbrake.shared.messaging.cancel import CancelPublisher, cancel_run
from runbrake.shared.messaging.wire import (
    DEAD_REASON_HEADER,
    MalformedCancelRequest,
    Topology,
    cancel_traceparent,
    decode_cancel_request,
)
from runbrake.shared.settings import Settings
from runbrake.shared.store import RunStore
from runbrake.worker._consumer import ConsumerThread

log = structlog.get_logger(__name__)

PREFETCH = 4
"""Unacked requests one consumer holds at most: a cancel takes milliseconds, so a few keep it busy."""
DEFAULT_REASON = "cancelled by a cancel request"
_STORE_RETRY_S = 1.0


class CancelRequestConsumer(ConsumerThread):
    """Consumes ``<ns>.cancel-requests`` and applies each request. Reconnects with backoff."""

    role = "cancel_requests"

    def __init__(self, settings: Settings, store: RunStore, admission: Admission) -> None:
        super().__init__(settings)
        self._store = store
        self._admission = admission
        """Its catalog's [rabbitmq_users] says whose tenant a request's user_id is."""
        self._topology = Topology.of(settings)
        self._publisher = CancelPublisher(settings)
        """The wake-up's own connection, used from this thread only."""

    def _consume(self, channel: BlockingChannel) -> str:
        self._topology.declare_cancel_requests(channel, queue_type=self._settings.queue_type)
        channel.basic_qos(prefetch_count=PREFETCH)
        channel.basic_consume(queue=self._topology.cancel_requests_queue, on_message_callback=self._on_message)
        return self._topology.cancel_requests_queue

    def _keep_alive(self) -> float:
        self._publisher.keep_alive()
        return self._publisher.keep_alive_interval()

    def _stopped(self) -> None:
        with silenced("pika"):  # a connection RabbitMQ dropped anyway (an outage) closes with a traceback
            self._publisher.close()

    def _on_message(self, channel: BlockingChannel, method: Any, properties: pika.BasicProperties,
                    body: bytes) -> None:
        try:
            request = decode_cancel_request(body)
        except MalformedCancelRequest as exc:
            self._dead_letter(channel, method, properties, body, str(exc))
            return
        # RabbitMQ checks a user_id property against the publishing connection's user: when set, it names
        # who published, whatever the body says.
        verified = getattr(properties, "user_id", None)
        requested_by = request.requested_by or (f"amqp:{verified}" if verified else "amqp")
        if verified and request.requested_by:
            requested_by = f"{request.requested_by} (amqp:{verified})"
        tenant, refused = self._admission.catalog.requester(
            verified if isinstance(verified, str) and verified else None,
            allow_untenanted=self._settings.rabbitmq_allow_untenanted)
        if refused is not None:
            self._dead_letter(channel, method, properties, body, refused)
            return
        try:
            if tenant is not None and self._store.tenant_of(request.run_id) != tenant:
                # Another tenant's run is answered as a missing one: the requester learns nothing of it.
                log.warning("cancel_request_unknown_run", run_id=request.run_id, tenant=tenant)
                channel.basic_ack(delivery_tag=method.delivery_tag)
                return
            # A traced publisher's trace goes on through the fence and the wake-up (docs/operating.md, "Traces").
            with tracing.current().span("runbrake.cancel_request", {"runbrake.run_id": request.run_id},
                                        parent=cancel_traceparent(properties), kind="consumer"):
                result = cancel_run(self._store, self._publisher, request.run_id,
                                    reason=request.reason or DEFAULT_REASON, requested_by=requested_by)
        except StoreError as exc:
            # Not the request's fault: keep it, and try again after a pause (the connection stays serviced).
            log.warning("cancel_request_store_unavailable", run_id=request.run_id, error=str(exc),
                        retry_in_s=_STORE_RETRY_S)
            if self._connection is not None:
                self._connection.sleep(_STORE_RETRY_S)
            channel.basic_nack(delivery_tag=method.delivery_tag, requeue=True)
            return
        if result.won:
            log.info("cancel_request_applied", run_id=request.run_id, requested_by=requested_by,
                     was=result.found.value, message_confirmed=result.message_confirmed)
        elif result.exists:
            log.info("cancel_request_refused", run_id=request.run_id, found=result.found.value)
        else:
            log.warning("cancel_request_unknown_run", run_id=request.run_id)
        channel.basic_ack(delivery_tag=method.delivery_tag)

    def _dead_letter(self, channel: BlockingChannel, method: Any, properties: pika.BasicProperties, body: bytes,
                     reason: str) -> None:
        log.warning("cancel_request_malformed", reason=reason, size=len(body))
        headers = _copyable(getattr(properties, "headers", None) or {})
        headers[DEAD_REASON_HEADER] = reason
        dead = pika.BasicProperties(content_type=properties.content_type, delivery_mode=2, headers=headers)
        try:
            channel.basic_publish(exchange="", routing_key=self._topology.cancel_requests_dead_queue, body=body,
                                  properties=dead)
        except pika.exceptions.AMQPError as exc:
            log.warning("cancel_request_dead_letter_failed", error=repr(exc))
            if channel.is_open:
                # The queue's x-dead-letter-* arguments route it to the same queue, without the reason header.
                channel.basic_reject(delivery_tag=method.delivery_tag, requeue=False)
            return
        channel.basic_ack(delivery_tag=method.delivery_tag)


def _copyable(headers: dict[str, Any]) -> dict[str, Any]:
    """The request's headers when pika can encode them again, else none: a hostile header that decoded (a
    timestamp kept as its integer seconds, shared/messaging/_amqp_tables.py) but does not encode must not make the
    republish raise, which would restart the consumer on the same message for ever."""
    try:
        pika.data.encode_table([], headers)
    except Exception:  # noqa: BLE001 - whatever pika raises for a value it cannot write (struct.error, its own)
        log.warning("cancel_request_headers_dropped", headers=sorted(map(str, headers))[:20])
        return {}
    return dict(headers)
