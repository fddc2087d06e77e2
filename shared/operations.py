"""The operations every entry point offers (the CLI, the HTTP API): enqueue, continue, cancel, steer, approve, deny.

:func:`enqueue`, :func:`cancel`, :func:`approve` and :func:`deny` raise a typed error for every refusal
(``RunNotFound``, ``TransitionRefused`` with the status found, ``IdempotencyConflict``, ``SpecError``) and
outage (``StoreError``, ``PublishError``), and each entry point maps those to its exit code or HTTP status
in one place (docs/architecture.md, "Layers"). :func:`approve_run`, :func:`deny_run` and
:func:`~runbrake.shared.messaging.cancel.cancel_run` are the calls beneath, which answer a refusal as a
value (the documentation names them as the library's calls).

A decision is a guarded transition like any other (docs/store.md, "The run
lifecycle"): it applies only to a run ``waiting_for_approval``, and a cancel while
waiting wins like anywhere else. Approving records the decision as a step (the call,
who decided and why) and sends a resume message; a worker claims the resume and runs
the call. Denying fails the run (``approval_denied``) and records the denial as its
last step.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import structlog

from runbrake.shared import redaction, threads
from runbrake.shared._store_core import TENANT_LABEL
from runbrake.shared.errors import PublishError, ResumeUnsent, RunNotFound, TransitionRefused
from runbrake.shared.messaging.cancel import CancelPublisher, CancelResult, cancel_run
from runbrake.shared.messaging.steer import SteerResult, check_steer, steer_run
from runbrake.shared.records import Transition
from runbrake.shared.redaction import Submitted, strip_bidi
from runbrake.shared.status import RunStatus, TerminationReason
from runbrake.shared.steps import RunStep, StepKind
from runbrake.shared.store import RunStore

if TYPE_CHECKING:
    # A producer and a spec are handed in: a cancel or a show does not load the spec's and catalog's models
    # (docs/benchmarks.md, "CLI start-up (`bench/cli_startup.py`)").
    from runbrake.shared.messaging.producer import Enqueued, Producer
    from runbrake.shared.spec import RunSpec

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class Decision:
    """What an approve or deny came to: whether it applied, and the status the run was found in."""

    run_id: str
    decided: bool
    found: RunStatus
    exists: bool

    @classmethod
    def of(cls, run_id: str, transition: Transition) -> Decision:
        return cls(run_id, transition.won, transition.found, transition.exists)


def approve_run(store: RunStore, producer: Producer, run_id: str, *, decided_by: str, reason: str = "") -> Decision:
    """Approve the call ``run_id`` waits for, record the approval as a step, and send the resume message.

    Approving an approved run again records nothing and sends the resume again (a lost message can be
    replaced; the resume claim makes a duplicate a no-op).

    Raises:
        StoreError: when Redis cannot be reached.
        PublishError: when RabbitMQ did not take the resume message (the approval stands;
            approving again sends it again).
    """
    # Shown as attribution ("reason (by who)"): without bidi controls, which could reorder what follows.
    decided_by, reason = strip_bidi(decided_by), strip_bidi(reason)
    transition, first = store.approve_once(run_id)
    decision = Decision.of(run_id, transition)
    if not decision.decided:
        return decision
    if first:
        # Recorded before the resume message is sent, so it precedes every step of the resumed segment.
        record = store.get(run_id)
        pending = record.pending or {}
        with redaction.submitted(Submitted.of(record.request, reason, decided_by)):  # theirs: shared/redaction.py
            store.append_step(run_id, RunStep(
                kind=StepKind.APPROVAL, round=int(pending.get("model_calls", 0)), content=reason or "approved",
                detail={"decision": "approved", "decided_by": decided_by, "reason": reason,
                        "call": (pending.get("pending_calls") or [None])[0]},
            ))
        log.info("run_approved", run_id=run_id, decided_by=decided_by, reason=reason)
    producer.send(run_id, resume=True)
    return decision


def deny_run(store: RunStore, run_id: str, *, decided_by: str, reason: str) -> Decision:
    """Deny the call ``run_id`` waits for: the run ends ``failed`` (``approval_denied``), and the denial
    is recorded as a step naming the call, who decided and why.

    Raises:
        StoreError: when Redis cannot be reached.
    """
    decided_by, reason = strip_bidi(decided_by), strip_bidi(reason)
    # What the decider and the run's submitter wrote is kept as written (shared/redaction.py, Submitted).
    with redaction.submitted(Submitted(reason, decided_by)):
        settled = store.settle(run_id, RunStatus.FAILED, TerminationReason.APPROVAL_DENIED, error=reason,
                               required_status=RunStatus.WAITING_FOR_APPROVAL)
    decision = Decision.of(run_id, settled)
    if not decision.decided:
        return decision
    record = store.get(run_id)
    pending = record.pending or {}
    with redaction.submitted(Submitted.of(record.request, reason, decided_by)):
        store.append_step(run_id, RunStep(
            kind=StepKind.APPROVAL, round=int(pending.get("model_calls", 0)), content=reason,
            detail={"decision": "denied", "decided_by": decided_by, "reason": reason,
                    "call": (pending.get("pending_calls") or [None])[0]},
        ))
    log.info("run_denied", run_id=run_id, decided_by=decided_by, reason=reason)
    return decision


# -- the operations, refusals raised ---------------------------------------------------------------


def enqueue(producer: Producer, spec: RunSpec, *, scope: str | None = None, tenant: str | None = None,
            link: threads.ThreadLink | None = None) -> Enqueued:
    """Persist the run and send its message (:meth:`Producer.enqueue`, whose errors are already typed); a
    continuation's ``link`` places it in its thread.

    Raises:
        SpecError: the spec breaks the admission policy (nothing written or sent).
        IdempotencyConflict: the idempotency key created a run from a different spec.
        QuotaExceeded: the tenant is at one of its quotas (nothing written or sent).
        StoreError: Redis could not be reached (nothing sent).
        PublishError: RabbitMQ did not confirm the message (the run is failed, ``enqueue_failed``).
    """
    return producer.enqueue(spec, scope=scope, tenant=tenant, link=link)


def continue_run(producer: Producer, store: RunStore, run_id: str, body: Mapping[str, Any], *,
                 scope: str | None = None, tenant: str | None = None) -> Enqueued:
    """Enqueue a run that carries on the finished run ``run_id``'s conversation with ``body`` (its ``input``
    and any spec field but ``messages``; shared/threads.py), through :func:`enqueue`: the catalog policy, the
    bounds, the tenant's quotas and the idempotency key apply to it as to any run. It is the parent's
    tenant's run, whoever continues it.

    Raises:
        RunNotFound: no run has that id (never created, past its retention, or another ``tenant``'s).
        TransitionRefused: the run is not finished (``found``); nothing written or sent.
        SpecError: the continuation's spec is invalid or breaks the admission policy (nothing written or sent).
        IdempotencyConflict, QuotaExceeded, StoreError, PublishError: as :func:`enqueue`.
    """
    # Another tenant's run is answered as a missing one, word for word (docs/http-api.md, "Tenants and quotas").
    missing = RunNotFound(run_id, where="never created, or past its retention, RUNBRAKE_RETENTION_S")
    try:
        parent = store.get(run_id)
    except RunNotFound:
        raise missing from None
    parent_tenant = parent.labels.get(TENANT_LABEL, "")
    if tenant is not None and parent_tenant != tenant:
        raise missing
    if not threads.finished(parent.status):
        raise TransitionRefused(run_id, "continue", parent.status,
                                f"run {run_id} is {parent.status.value}; only a finished run (completed, failed, "
                                "cancelled) can be continued")
    spec = threads.continuation(parent, body)
    # A tenant's thread stays the tenant's, whoever continues it (an operator, the CLI).
    return enqueue(producer, spec, scope=scope, tenant=tenant or parent_tenant or None,
                   link=threads.ThreadLink(parent_run_id=parent.run_id, thread=parent.thread))


def cancel(store: RunStore, publisher: CancelPublisher | None, run_id: str, *, reason: str,
           requested_by: str) -> CancelResult:
    """Win the fence, then publish the wake-up (:func:`cancel_run`); a cancel that cannot apply raises.

    Raises:
        RunNotFound: no run has that id.
        TransitionRefused: the run is already terminal (``found``); nothing changed.
        StoreError: Redis could not be reached (nothing changed, nothing published).
    """
    result = cancel_run(store, publisher, run_id, reason=reason, requested_by=requested_by)
    if not result.exists:
        raise RunNotFound(run_id)
    if not result.won:
        raise TransitionRefused(run_id, "cancel", result.found,
                                f"run {run_id} is already {result.found.value}; nothing to cancel")
    return result


def steer(store: RunStore, publisher: CancelPublisher, producer: Producer, run_id: str, *, text: object,
          reason: object, requested_by: str, max_input_chars: int) -> SteerResult:
    """Check the new message, store the steer, then wake the worker (or resume the run that waited for approval):
    :func:`~runbrake.shared.messaging.steer.steer_run` (docs/cancellation.md, "Steer").

    Raises:
        SpecError: ``input`` empty or too long, ``reason`` too long (nothing written or sent).
        RunNotFound: no run has that id.
        TransitionRefused: the run is neither running nor waiting for approval, or a steer is still pending.
        StoreError: Redis could not be reached (nothing changed, nothing sent).
    """
    request = check_steer(text, reason, max_input_chars=max_input_chars)
    return steer_run(store, publisher, producer, run_id, request, requested_by=requested_by)


def approve(store: RunStore, producer: Producer, run_id: str, *, decided_by: str, reason: str = "") -> Decision:
    """Approve the call the run waits for and send the resume message (:func:`approve_run`).

    Raises:
        RunNotFound: no run has that id.
        TransitionRefused: the run is not waiting for approval (``found``).
        ResumeUnsent: RabbitMQ did not take the resume message (the approval stands).
        StoreError: Redis could not be reached.
    """
    try:
        decision = approve_run(store, producer, run_id, decided_by=decided_by, reason=reason)
    except PublishError as exc:
        raise ResumeUnsent(str(exc), run_id=run_id) from exc
    return _decided(decision)


def deny(store: RunStore, run_id: str, *, decided_by: str, reason: str) -> Decision:
    """Deny the call the run waits for: the run ends failed, ``approval_denied`` (:func:`deny_run`).

    Raises:
        RunNotFound: no run has that id.
        TransitionRefused: the run is not waiting for approval (``found``).
        StoreError: Redis could not be reached.
    """
    return _decided(deny_run(store, run_id, decided_by=decided_by, reason=reason))


def _decided(decision: Decision) -> Decision:
    if not decision.exists:
        raise RunNotFound(decision.run_id)
    if not decision.decided:
        raise TransitionRefused(decision.run_id, "decide", decision.found,
                                f"run {decision.run_id} is {decision.found.value}, not waiting for approval")
    return decision
