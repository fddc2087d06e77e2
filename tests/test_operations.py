"""The operations every entry point offers (shared/operations.py) say a refusal with a typed error, against the
real Redis: an unknown run is ``RunNotFound``, a run in the wrong status is ``TransitionRefused`` naming the
status it was found in, and a refused operation changes nothing. The CLI and the API map these in one place
each (their own tests pin the exit codes and statuses)."""

from __future__ import annotations

import pytest

from runbrake.shared import operations
from runbrake.shared.errors import RunNotFound, TransitionRefused
from runbrake.shared.messaging.producer import Producer
from runbrake.shared.messaging.rabbitmq import build_broker
from runbrake.shared.settings import Settings
from runbrake.shared.status import RunStatus
from runbrake.shared.store import RunStore

pytestmark = pytest.mark.integration

UNKNOWN = "0" * 32
REQUEST = {"input": "test run", "model": {"provider": "scripted", "turns": [{"content": "hi"}]}, "mcp_servers": []}


def queued_run(store: RunStore) -> str:
    return store.create(REQUEST).run_id


def test_cancelling_an_unknown_run_raises_run_not_found(store: RunStore) -> None:
    with pytest.raises(RunNotFound) as raised:
        operations.cancel(store, None, UNKNOWN, reason="stop", requested_by="test")

    assert raised.value.run_id == UNKNOWN
    assert str(raised.value) == f"no run with id {UNKNOWN!r}"


def test_cancelling_a_finished_run_raises_transition_refused_with_the_status_found_and_keeps_the_first_cancel(
    store: RunStore,
) -> None:
    run_id = queued_run(store)
    assert operations.cancel(store, None, run_id, reason="first", requested_by="one").won

    with pytest.raises(TransitionRefused) as raised:
        operations.cancel(store, None, run_id, reason="second", requested_by="two")

    assert raised.value.found is RunStatus.CANCELLED
    assert str(raised.value) == f"run {run_id} is already cancelled; nothing to cancel"
    cancel = store.get(run_id).cancel
    assert cancel is not None
    assert (cancel.reason, cancel.requested_by) == ("first", "one")


def test_denying_a_run_that_does_not_wait_for_approval_raises_transition_refused_and_leaves_it_queued(
    store: RunStore,
) -> None:
    run_id = queued_run(store)

    with pytest.raises(TransitionRefused) as raised:
        operations.deny(store, run_id, decided_by="test", reason="no")

    assert raised.value.found is RunStatus.QUEUED
    assert str(raised.value) == f"run {run_id} is queued, not waiting for approval"
    record = store.get(run_id)
    assert record.status is RunStatus.QUEUED
    assert record.steps == ()


def test_approving_an_unknown_run_or_one_that_does_not_wait_raises_and_sends_nothing(
    store: RunStore, settings: Settings,
) -> None:
    run_id = queued_run(store)
    broker = build_broker(settings)  # connects on first use: a refused approval never uses it
    try:
        producer = Producer(store, broker)
        with pytest.raises(RunNotFound):
            operations.approve(store, producer, UNKNOWN, decided_by="test")
        with pytest.raises(TransitionRefused) as raised:
            operations.approve(store, producer, run_id, decided_by="test")
    finally:
        broker.close()

    assert raised.value.found is RunStatus.QUEUED
    assert store.get(run_id).steps == ()


def test_the_cli_maps_each_error_to_its_exit_code_in_one_table_and_a_subclass_takes_its_ancestors() -> None:
    from runbrake.broker.cli import EXIT_BAD_INPUT, EXIT_REFUSED, EXIT_UNAVAILABLE, exit_code
    from runbrake.shared.errors import ProviderError, ResumeUnsent, SpecError, StoreError

    assert exit_code(RunNotFound(UNKNOWN)) == EXIT_REFUSED
    assert exit_code(TransitionRefused(UNKNOWN, "cancel", RunStatus.COMPLETED)) == EXIT_REFUSED
    assert exit_code(SpecError("input", "is missing")) == EXIT_BAD_INPUT
    assert exit_code(StoreError("Redis is down")) == EXIT_UNAVAILABLE
    assert exit_code(ResumeUnsent("RabbitMQ is down", run_id=UNKNOWN)) == EXIT_UNAVAILABLE
    assert exit_code(ProviderError("not an entry point's error")) is None
