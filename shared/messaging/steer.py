"""The steer: store it in Redis, then wake the worker that holds the run, or send the resume of a run that waited
for approval (docs/cancellation.md, "Steer").

Like a cancel, the steer is decided and kept in Redis (the STEER script) and the message is only a wake-up: a
lost one is made up for by the worker's backstop, and a worker that dies or hands the run over leaves the steer
stored for the next one, which applies it exactly once (the STEER_APPLY script consumes it with its step).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

import pika.exceptions
import structlog

from runbrake.shared import redaction
from runbrake.shared.errors import FieldProblem, PublishError, RunNotFound, SpecError, TransitionRefused
from runbrake.shared.messaging.cancel import CancelPublisher
from runbrake.shared.records import SteerRequest
from runbrake.shared.redaction import strip_bidi
from runbrake.shared.status import RunStatus
from runbrake.shared.store import RunStore

if TYPE_CHECKING:  # a producer is handed in: a cancel's caller does not load the spec's and catalog's models
    from runbrake.shared.messaging.producer import Producer

log = structlog.get_logger(__name__)

MAX_STEER_REASON_CHARS: Final = 1000
"""The bound on a steer's reason (as on a cancel's, broker/api.py ``MAX_REASON_CHARS``)."""


@dataclass(frozen=True, slots=True)
class SteerResult:
    """A steer stored: the status the run was found in, and whether its message (the wake-up of a running run,
    the resume of one that waited for approval) was confirmed by RabbitMQ."""

    run_id: str
    found: RunStatus
    message_confirmed: bool
    message_error: str | None = None


def check_steer(text: object, reason: object, *, max_input_chars: int) -> SteerRequest:
    """A steer's new message and reason, checked: a non-blank ``input`` of at most ``max_input_chars``
    (``RUNBRAKE_MAX_INPUT_CHARS``, the bound on a spec's input) and a ``reason`` of at most
    :data:`MAX_STEER_REASON_CHARS`.

    Raises:
        SpecError: naming every offending field (``input``, ``reason``); nothing is written or sent.
    """
    problems: list[tuple[str, str]] = []
    if not isinstance(text, str) or not text.strip():
        problems.append(("input", "must be a non-empty string: the new user message"))
    elif len(text) > max_input_chars:
        problems.append(("input", f"is {len(text)} characters; the limit is {max_input_chars} "
                                  "(RUNBRAKE_MAX_INPUT_CHARS)"))
    if not isinstance(reason, str):
        problems.append(("reason", "must be a string"))
    elif len(reason) > MAX_STEER_REASON_CHARS:
        problems.append(("reason", f"is {len(reason)} characters; the limit is {MAX_STEER_REASON_CHARS}"))
    if problems:
        raise SpecError.from_problems(FieldProblem(loc=(name,), msg=msg, field=name) for name, msg in problems)
    assert isinstance(text, str)
    assert isinstance(reason, str)
    return SteerRequest(id=uuid.uuid4().hex, input=text, reason=strip_bidi(reason), requested_by="",
                        requested_at=0.0)


def steer_run(store: RunStore, publisher: CancelPublisher, producer: Producer, run_id: str, request: SteerRequest,
              *, requested_by: str) -> SteerResult:
    """Store the steer (``request``, from :func:`check_steer`), then wake the worker running the run, or send the
    resume message of a run that waited for approval.

    Raises:
        RunNotFound: no run has that id.
        TransitionRefused: the run is neither running nor waiting for approval (``found``), or a steer of it is
            still waiting to be applied (one at a time).
        StoreError: Redis could not be reached (nothing stored, nothing sent).
    """
    request = SteerRequest(id=request.id, input=request.input, reason=request.reason,
                           requested_by=strip_bidi(requested_by), requested_at=time.time())
    with redaction.submitted(redaction.Submitted(request.input, request.reason, request.requested_by)):
        steered = store.steer(run_id, request)  # the caller's words, kept as written (shared/redaction.py)
    if not steered.transition.exists:
        raise RunNotFound(run_id)
    found = steered.transition.found
    if steered.pending:
        raise TransitionRefused(run_id, "steer", found,
                                f"run {run_id} has a steer still waiting to be applied; steer again once its "
                                "steer step is recorded")
    if not steered.transition.won:
        raise TransitionRefused(run_id, "steer", found,
                                f"run {run_id} is {found.value}; only a running run or one waiting for approval "
                                "can be steered")
    log.info("run_steered", run_id=run_id, requested_by=request.requested_by, reason=request.reason,
             was=found.value, chars=len(request.input))
    try:
        if found is RunStatus.WAITING_FOR_APPROVAL:
            producer.send(run_id, resume=True)
        else:
            publisher.publish(run_id, steer=True)
    except (PublishError, pika.exceptions.AMQPError) as exc:
        # The steer stands: the backstop finds it (running), the re-drive resends the resume (waiting).
        publisher.close()
        log.warning("steer_message_not_confirmed", run_id=run_id, error=repr(exc))
        return SteerResult(run_id, found, message_confirmed=False, message_error=repr(exc))
    return SteerResult(run_id, found, message_confirmed=True)
