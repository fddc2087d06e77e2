"""Approve or deny the tool call a run waits for: the library calls the CLI (and any caller) uses.

A decision is a guarded transition like any other (docs/architecture.md, "The run
lifecycle"): it applies only to a run ``waiting_for_approval``, and a cancel while
waiting wins like anywhere else. Approving records the decision as a step (the call,
who decided and why) and sends a resume message; a worker claims the resume and runs
the call. Denying fails the run (``approval_denied``) and records the denial as its
last step.
"""

from __future__ import annotations

from dataclasses import dataclass

import structlog

from runbrake.broker.producer import Producer
from runbrake.shared.records import Transition
from runbrake.shared.redaction import strip_bidi
from runbrake.shared.status import RunStatus, TerminationReason
from runbrake.shared.steps import RunStep, StepKind
from runbrake.shared.store import RunStore

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
        pending = store.get(run_id).pending or {}
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
    settled = store.settle(run_id, RunStatus.FAILED, TerminationReason.APPROVAL_DENIED, error=reason,
                           required_status=RunStatus.WAITING_FOR_APPROVAL)
    decision = Decision.of(run_id, settled)
    if not decision.decided:
        return decision
    pending = store.get(run_id).pending or {}
    store.append_step(run_id, RunStep(
        kind=StepKind.APPROVAL, round=int(pending.get("model_calls", 0)), content=reason,
        detail={"decision": "denied", "decided_by": decided_by, "reason": reason,
                "call": (pending.get("pending_calls") or [None])[0]},
    ))
    log.info("run_denied", run_id=run_id, decided_by=decided_by, reason=reason)
    return decision
