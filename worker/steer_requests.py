"""The steer-requests consumer: steers that backends publish on RabbitMQ alone (docs/messages.md, "Steer
requests").

One :class:`SteerRequestConsumer` per worker process consumes the durable queue ``<ns>.steer-requests``. Each
body is ``{"run_id", "input", "reason"?}``, applied like ``POST /v1/runs/{id}/steer`` through the same call
(:func:`runbrake.shared.operations.steer`: the steer stored in Redis, then the worker running the run woken,
or the resume of a run that waited for approval sent). The answer, on the request's direct reply-to, is the
HTTP API's 202 body ``{"run_id", "steered", "found", "message_confirmed"}`` or its 4xx body ``{"error",
"errors"}``; the request and its answer follow the run requests' rules (worker/_requests.py).
"""

from __future__ import annotations

import structlog

from runbrake.shared import operations
from runbrake.shared.errors import FieldProblem, RunNotFound, SpecError, TransitionRefused
from runbrake.shared.logging import silenced
from runbrake.shared.messaging.cancel import CancelPublisher
from runbrake.shared.messaging.producer import Producer
from runbrake.shared.messaging.wire import Topology, decode_steer_request, encode_steer_request_answer
from runbrake.shared.settings import Settings
from runbrake.shared.store import RunStore
from runbrake.worker._requests import Answer, RequestConsumer, refusal

log = structlog.get_logger(__name__)

UNKNOWN_RUN = "no run has that id (never created, past its retention, or another tenant's)"


class SteerRequestConsumer(RequestConsumer):
    """Consumes ``<ns>.steer-requests``, applies each steer and answers. Reconnects with backoff."""

    role = "steer_requests"
    kind = "steer"

    def __init__(self, settings: Settings, store: RunStore, producer: Producer) -> None:
        super().__init__(settings, producer, Topology.of(settings).steer_requests)
        self._store = store
        self._publisher = CancelPublisher(settings)
        """The wake-up's own connection, used from this thread only."""

    def _keep_alive(self) -> float:
        self._publisher.keep_alive()
        return min(self._publisher.keep_alive_interval(), super()._keep_alive())

    def _stopped(self) -> None:
        with silenced("pika"):  # a connection RabbitMQ dropped anyway (an outage) closes with a traceback
            self._publisher.close()

    def _admit(self, body: bytes, *, message_id: str | None, user: str | None) -> Answer:
        try:
            request = decode_steer_request(body, max_bytes=self._settings.max_spec_bytes)
        except SpecError as exc:
            log.info("steer_request_invalid", problems=[p.field for p in exc.problems][:20], size=len(body))
            return refusal("invalid steer request", exc.problems)
        tenant, refused = self._requester(user)
        if refused is not None:
            return refused
        who = f"amqp:{user}" if user else "amqp"
        missing = refusal(f"run {request.run_id} not found", [FieldProblem(loc=("run_id",), msg=UNKNOWN_RUN)])
        # Another tenant's run is answered as a missing one: the requester learns nothing of it.
        if tenant is not None and self._store.tenant_of(request.run_id) != tenant:
            log.info("steer_request_unknown_run", run_id=request.run_id, by=who, tenant=tenant)
            return missing
        try:
            result = operations.steer(self._store, self._publisher, self._producer, request.run_id,
                                      text=request.input, reason=request.reason, requested_by=who,
                                      max_input_chars=self._settings.max_input_chars)
        except SpecError as exc:
            log.info("steer_request_invalid", problems=[p.field for p in exc.problems][:20], size=len(body))
            return refusal("invalid steer", exc.problems)
        except RunNotFound:
            log.info("steer_request_unknown_run", run_id=request.run_id, by=who)
            return missing
        except TransitionRefused as exc:
            log.info("steer_request_refused", run_id=request.run_id, by=who, found=exc.found.value)
            return refusal(str(exc), [FieldProblem(loc=("run_id",), msg=str(exc))], run_id=request.run_id)
        log.info("steer_request_applied", run_id=request.run_id, by=who, found=result.found.value,
                 message_confirmed=result.message_confirmed)
        return Answer(encode_steer_request_answer(request.run_id, result.found.value,
                                                  message_confirmed=result.message_confirmed))
