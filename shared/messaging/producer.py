"""The producing side: validate a spec, persist the run, send a message that carries only its id."""

from __future__ import annotations

from dataclasses import dataclass

import structlog

from runbrake.shared import tracing
from runbrake.shared.catalog import Admission, Catalog
from runbrake.shared.errors import IdempotencyConflict, PublishError, QuotaExceeded
from runbrake.shared.messaging.rabbitmq import RunbrakeBroker
from runbrake.shared.messaging.wire import Topology, run_message
from runbrake.shared.spec import RunSpec
from runbrake.shared.status import RunStatus, TerminationReason
from runbrake.shared.store import RunStore
from runbrake.shared.threads import ThreadLink

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class Enqueued:
    """An enqueued run: its id, its status now, and whether this call created it."""

    run_id: str
    status: RunStatus
    created: bool


class Producer:
    """Enqueues runs and resume messages.

    Every spec passes ``admission`` first (the operator's catalog, the inline policy, the bounds);
    without one, the strictest policy applies: an empty catalog, inline servers and models refused.
    """

    def __init__(self, store: RunStore, broker: RunbrakeBroker, admission: Admission | None = None) -> None:
        self._store = store
        self._broker = broker
        self._topology = Topology(store.namespace)
        self._admission = Admission(Catalog.empty()) if admission is None else admission

    @property
    def catalog(self) -> Catalog:
        """The catalog in force now (its tenants' quotas, its RabbitMQ users)."""
        return self._admission.catalog

    def enqueue(self, spec: RunSpec, *, scope: str | None = None, tenant: str | None = None,
                link: ThreadLink | None = None) -> Enqueued:
        """Persist the run (queued, with its request) and send its message.

        Fail-closed: when the send fails, the run is settled failed (reason
        ``enqueue_failed``) so it never waits for a message that does not exist, and
        the caller gets the error. A repeated idempotency key returns the first run
        and sends nothing. ``scope`` (the HTTP API's token name) gives the submitter idempotency keys
        of its own: the store keeps the key as ``<scope>:<key>``, which no other token can name (a token
        name has no ``:``); without one, the key is the spec's (the CLI, a token-less API). A ``tenant``'s
        run carries the label ``tenant`` and is counted against the tenant's quotas in the catalog, in the
        script that writes it (docs/http-api.md, "Tenants and quotas"). A continuation's ``link`` (its parent and
        thread) is written with it (docs/store.md, "Threads").

        Raises:
            SpecError: the spec breaks the admission policy (nothing written or sent).
            IdempotencyConflict: the idempotency key created a run from a different spec.
            QuotaExceeded: the tenant is at one of its quotas (nothing written or sent).
            StoreError: when Redis cannot be reached (nothing was sent).
            PublishError: when RabbitMQ did not confirm the message (the run is failed).
        """
        with tracing.current().span("runbrake.enqueue", kind="producer") as span:
            enqueued = self._enqueue(spec, scope=scope, tenant=tenant, link=link)
            span.set({"runbrake.run_id": enqueued.run_id, "runbrake.run.created": enqueued.created})
            return enqueued

    def _enqueue(self, spec: RunSpec, *, scope: str | None, tenant: str | None, link: ThreadLink | None) -> Enqueued:
        self._admission.admit(spec, tenant=tenant)
        key = spec.idempotency_key
        if key is not None and scope is not None:
            key = f"{scope}:{key}"
        quota = self._admission.catalog.quota(tenant) if tenant else None
        created = self._store.create(spec.raw, idempotency_key=key, tenant=tenant, quota=quota, link=link)
        if created.over_quota is not None:
            hit = created.over_quota
            raise QuotaExceeded(tenant or "", hit.quota, hit.limit, hit.retry_after_s)
        if created.conflict:
            raise IdempotencyConflict(spec.idempotency_key or "", created.run_id)
        if not created.created:
            status = self._store.status(created.run_id)
            log.info("enqueue_deduplicated", run_id=created.run_id, status=status.value)
            return Enqueued(created.run_id, status, created=False)
        try:
            self.send(created.run_id)
        except PublishError as exc:
            self._store.settle(
                created.run_id, RunStatus.FAILED, TerminationReason.ENQUEUE_FAILED, error=str(exc)
            )
            raise
        log.info("run_enqueued", run_id=created.run_id)
        return Enqueued(created.run_id, RunStatus.QUEUED, created=True)

    def keep_alive(self) -> float:
        """Service this thread's connection to RabbitMQ while idle (:meth:`RunbrakeBroker.keep_alive`); returns
        how long until the next call."""
        return self._broker.keep_alive()

    def send(self, run_id: str, *, resume: bool = False) -> None:
        """Send the run's message and wait for RabbitMQ's confirm.

        Raises:
            PublishError: when RabbitMQ could not be reached or did not confirm.
        """
        message = run_message(self._topology, run_id, resume=resume, traceparent=tracing.current().traceparent())
        try:
            self._broker.declare_queue(message.queue_name)
            self._broker.enqueue(message)
        except Exception as exc:
            raise PublishError(f"RabbitMQ did not take the message for run {run_id}: {exc}") from exc
