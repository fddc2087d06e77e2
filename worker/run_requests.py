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

from collections.abc import Callable
from urllib.parse import quote

import structlog

from runbrake.shared import operations
from runbrake.shared.errors import (
    FieldProblem,
    IdempotencyConflict,
    PublishError,
    QuotaExceeded,
    SpecError,
)
from runbrake.shared.messaging.producer import Enqueued, Producer
from runbrake.shared.messaging.wire import Topology, decode_run_request, encode_run_request_answer
from runbrake.shared.settings import Settings
from runbrake.worker._requests import Answer, RequestConsumer, refusal

log = structlog.get_logger(__name__)

MESSAGE_ID_KEY_PREFIX = "message-id:"
"""A request without ``idempotency_key`` is keyed by its ``message_id`` property, under this prefix."""


class RunRequestConsumer(RequestConsumer):
    """Consumes ``<ns>.run-requests``, enqueues each run and answers. Reconnects with backoff."""

    role = "run_requests"
    kind = "run"

    def __init__(self, settings: Settings, producer: Producer) -> None:
        super().__init__(settings, producer, Topology.of(settings).run_requests)

    def _admit(self, body: bytes, *, message_id: str | None, user: str | None) -> Answer:
        """Enqueue the run the body asks for; every refusal is an answer.

        Raises:
            StoreError: Redis could not be reached (nothing decided).
        """
        try:
            spec = decode_run_request(body, max_bytes=self._settings.max_spec_bytes)
        except SpecError as exc:
            log.info("run_request_invalid", problems=[p.field for p in exc.problems][:20], size=len(body))
            return refusal("invalid run spec", exc.problems)
        keyed_by_message = spec.idempotency_key is None and message_id is not None
        if keyed_by_message:
            # At least once: a request redelivered after its run was written (a worker that died before the
            # ack) must not create a second run. The stored request stays the body as it came.
            spec = spec.model_copy(update={"idempotency_key": MESSAGE_ID_KEY_PREFIX + str(message_id)})
        who = f"amqp:{user}" if user else "amqp"
        tenant, refused = self._requester(user)
        if refused is not None:
            return refused
        return enqueue_answer(lambda: operations.enqueue(self._producer, spec, scope=idempotency_scope(user),
                                                         tenant=tenant),
                              kind=self.kind, who=who, tenant=tenant, keyed_by_message=keyed_by_message)


def enqueue_answer(enqueue: Callable[[], Enqueued], *, kind: str, who: str, tenant: str | None,
                   keyed_by_message: bool) -> Answer:
    """Enqueue a run (``enqueue``: a run request's, a continue request's) and say what came of it; every
    refusal is an answer.

    Raises:
        StoreError: Redis could not be reached (nothing decided).
    """
    try:
        enqueued = enqueue()
    except SpecError as exc:  # the admission policy: the catalog, inline definitions, the bounds
        log.info(f"{kind}_request_refused", by=who, problems=[p.field for p in exc.problems][:20])
        return refusal("run spec refused", exc.problems)
    except QuotaExceeded as exc:
        log.info(f"{kind}_request_over_quota", by=who, tenant=tenant, quota=exc.quota)
        retry = (f"; ask again in {exc.retry_after_s} s" if exc.retry_after_s
                 else "; ask again once one of its runs ends")
        return refusal(str(exc), [FieldProblem(loc=("tenant",), msg=f"{exc.quota} is {exc.limit}{retry}")])
    except IdempotencyConflict as exc:
        loc: tuple[str, ...] = ("properties", "message_id") if keyed_by_message else ("idempotency_key",)
        log.info(f"{kind}_request_conflict", by=who, run_id=exc.run_id)
        return refusal(str(exc), [FieldProblem(loc=loc, msg="already names a run created from a different spec")],
                       run_id=exc.run_id)
    except PublishError as exc:
        log.warning(f"{kind}_request_publish_failed", by=who, error=str(exc))
        return refusal("RabbitMQ did not take the run's message; the run is failed (enqueue_failed)",
                       [FieldProblem(loc=("spec",), msg="the run's message was not confirmed by RabbitMQ")])
    log.info(f"{kind}_request_enqueued" if enqueued.created else f"{kind}_request_deduplicated",
             run_id=enqueued.run_id, by=who, status=enqueued.status.value)
    return Answer(encode_run_request_answer(enqueued.run_id, enqueued.status.value, created=enqueued.created))


def idempotency_scope(user: str | None) -> str:
    """The idempotency keys of requests from RabbitMQ user ``user`` (or from no named user): a scope of their
    own, apart from each HTTP token's and the CLI's (a token name has no ``/``; the user is quoted, so no ``:``
    of a user's name can make two users' keys meet)."""
    return "amqp/" + quote(user or "", safe="")
