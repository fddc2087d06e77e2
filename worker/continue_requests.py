"""The continue-requests consumer: continuations that backends publish on RabbitMQ alone (docs/messages.md,
"Continue requests").

One :class:`ContinueRequestConsumer` per worker process consumes the durable queue ``<ns>.continue-requests``.
Each body is ``{"run_id", "input", …}``: the finished run to carry on, and the body of ``POST
/v1/runs/{id}/continue`` (its ``input`` and any run-spec field but ``messages``), enqueued through the same
call (:func:`runbrake.shared.operations.continue_run`: the catalog, the bounds, the tenant's quotas,
idempotency). The answer is a run request's: ``{"run_id", "status", "created"}`` or ``{"error", "errors"}``;
the request and its answer follow the run requests' rules (worker/_requests.py), the ``message_id`` standing
for a missing ``idempotency_key`` as there.
"""

from __future__ import annotations

import structlog

from runbrake.shared import operations
from runbrake.shared.errors import FieldProblem, IdempotencyConflict, RunNotFound, SpecError, TransitionRefused
from runbrake.shared.messaging.producer import Enqueued, Producer
from runbrake.shared.messaging.wire import Topology, decode_continue_request
from runbrake.shared.settings import Settings
from runbrake.shared.store import RunStore
from runbrake.worker._requests import Answer, RequestConsumer, refusal
from runbrake.worker.run_requests import MESSAGE_ID_KEY_PREFIX, enqueue_answer, idempotency_scope
from runbrake.worker.steer_requests import UNKNOWN_RUN

log = structlog.get_logger(__name__)


class ContinueRequestConsumer(RequestConsumer):
    """Consumes ``<ns>.continue-requests``, enqueues each continuation and answers. Reconnects with backoff."""

    role = "continue_requests"
    kind = "continue"

    def __init__(self, settings: Settings, store: RunStore, producer: Producer) -> None:
        super().__init__(settings, producer, Topology.of(settings).continue_requests)
        self._store = store

    def _admit(self, body: bytes, *, message_id: str | None, user: str | None) -> Answer:
        try:
            run_id, fields = decode_continue_request(body, max_bytes=self._settings.max_spec_bytes)
        except SpecError as exc:
            log.info("continue_request_invalid", problems=[p.field for p in exc.problems][:20], size=len(body))
            return refusal("invalid continue request", exc.problems)
        keyed_by_message = "idempotency_key" not in fields and message_id is not None
        if keyed_by_message:  # at least once, as a run request (worker/run_requests.py)
            fields["idempotency_key"] = MESSAGE_ID_KEY_PREFIX + str(message_id)
        tenant, refused = self._requester(user)
        if refused is not None:
            return refused
        who = f"amqp:{user}" if user else "amqp"

        def enqueue() -> Enqueued:
            enqueued = operations.continue_run(self._producer, self._store, run_id, fields,
                                               scope=idempotency_scope(user), tenant=tenant)
            if not enqueued.created and self._store.get(enqueued.run_id).parent_run_id != run_id:
                # The key names a run that does not continue this one (as POST /v1/runs/{id}/continue's 409).
                raise IdempotencyConflict(str(fields["idempotency_key"]), enqueued.run_id)
            return enqueued

        try:
            return enqueue_answer(enqueue, kind=self.kind, who=who, tenant=tenant, keyed_by_message=keyed_by_message)
        except RunNotFound:
            log.info("continue_request_unknown_run", run_id=run_id, by=who)
            return refusal(f"run {run_id} not found", [FieldProblem(loc=("run_id",), msg=UNKNOWN_RUN)])
        except TransitionRefused as exc:
            log.info("continue_request_refused", run_id=run_id, by=who, found=exc.found.value)
            return refusal(str(exc), [FieldProblem(loc=("run_id",), msg=str(exc))], run_id=run_id)
