"""The Dramatiq actors of a worker process, declared against its broker and runtime at boot."""

from __future__ import annotations

from typing import Any

import dramatiq
import structlog
from dramatiq.middleware import CurrentMessage

from runbrake.shared.errors import MalformedMessage, StoreError
from runbrake.shared.messaging.rabbitmq import RunbrakeBroker
from runbrake.shared.messaging.wire import NOOP_ACTOR, RUN_ACTOR, Topology
from runbrake.shared.records import RUN_ID
from runbrake.shared.settings import Settings
from runbrake.shared.tracing import TRACEPARENT
from runbrake.worker.intake import HandBack, Intake

log = structlog.get_logger(__name__)


def declare_run_actor(broker: RunbrakeBroker, intake: Intake, settings: Settings) -> Any:
    """``execute_run(run_id, resume=False)``: take a slot, claim the run, and leave its segment running on
    the event loop (worker/intake.py); the message is acked once the claim is decided.

    Retries only when Redis could not be reached at claim, or the worker handed the message back, full or
    stopping (:func:`retry_store_outages`): the claim is guarded, so a retried message either claims a run nobody
    claimed yet or is a no-op. Nothing else is retried, and a cancelled run is never re-run. The segment
    itself outlives the actor: the runtime's own time limit bounds it (reason ``time_limit``) and a
    stopping worker interrupts it (``Intake.stop``, reason ``worker_shutdown``). Dramatiq's time limit
    bounds only the wait for a slot and a claim (seconds).
    """

    def execute_run(run_id: str, resume: bool = False) -> None:
        if not isinstance(run_id, str) or not RUN_ID.fullmatch(run_id) or not isinstance(resume, bool):
            # Anyone with access to the queue can publish; a message that cannot name a run is
            # dead-lettered once (this error is not retried) instead of looking like a store outage.
            log.error("run_message_malformed", run_id=repr(run_id)[:100], resume=repr(resume)[:20])
            raise MalformedMessage(f"a run message must carry a run id, not {type(run_id).__name__}")
        message = CurrentMessage.get_current_message()
        # Checked with the envelope (shared/messaging/wire.py, check_run_message): a W3C value or absent.
        traceparent = message.options.get(TRACEPARENT) if message is not None else None
        intake.take(run_id, resume=resume, traceparent=traceparent if isinstance(traceparent, str) else None)

    return dramatiq.actor(
        broker=broker,
        actor_name=RUN_ACTOR,
        queue_name=Topology.of(settings).run_queue,
        retry_when=retry_store_outages,
        min_backoff=1_000,
        max_backoff=60_000,
        time_limit=(settings.run_time_limit_s + settings.lease_s + 60) * 1000,
    )(execute_run)


STORE_OUTAGE_RETRIES = 30
"""With backoff from 1 s doubling to 60 s, about 25 minutes of Redis outage before a message gives up."""


def retry_store_outages(retries: int, exception: BaseException) -> bool:
    """Dramatiq's ``retry_when``: retry a run message only when the run store could not be reached, or the
    worker handed it back unclaimed (:class:`~runbrake.worker.intake.HandBack`: full or stopping; as often
    as that happens, since every worker may be full for long).

    Without it, a Redis blip at the moment of the claim would dead-letter the message and leave
    the run ``queued`` until the re-drive sends it again (worker/redrive.py).
    """
    if isinstance(exception, HandBack):
        return True
    return isinstance(exception, StoreError) and retries < STORE_OUTAGE_RETRIES


def declare_noop_actor(broker: RunbrakeBroker, settings: Settings) -> Any:
    """A no-op actor on its own queue: the benchmark's ceiling for the broker itself."""

    def noop() -> None:
        return None

    return dramatiq.actor(broker=broker, actor_name=NOOP_ACTOR, queue_name=Topology.of(settings).noop_queue,
                         max_retries=0)(noop)
