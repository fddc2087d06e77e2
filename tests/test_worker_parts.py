"""The worker's parts (docs/architecture.md, "The worker's parts"), its subscriber list ("The subscriber
list") and the one map from what ended a segment to the run's termination reason ("How a segment ends")."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator
from typing import Any

import pytest

from runbrake.shared import AsyncRunStore, RunStatus, RunStore, Settings, StepKind, TerminationReason
from runbrake.shared.catalog import Admission, Catalog
from runbrake.shared.errors import (
    CancelRequested,
    OwnershipLost,
    ProviderError,
    RunBoundReached,
    RunbrakeError,
    SpecError,
)
from runbrake.shared.steps import RunStep
from runbrake.worker.parts import Health, Part, Periodic, stop_all
from runbrake.worker.registry import ActiveRuns
from runbrake.worker.runtime import RunOutcome, Runtime, ending_of
from runbrake.worker.subscribers import Subscriber

# -- parts ----------------------------------------------------------------------------------------


class _Recorded(Part):
    """A part that writes what is done to it into a shared journal."""

    def __init__(self, name: str, journal: list[str]) -> None:
        self.name = name
        self._journal = journal

    def start(self) -> None:
        self._journal.append(f"start {self.name}")

    def stop(self) -> None:
        self._journal.append(f"stop {self.name}")

    def join(self, timeout: float | None = None) -> None:
        self._journal.append(f"join {self.name}")

    def health(self) -> Health:
        return Health(True, "recorded")


def test_parts_are_asked_to_stop_in_reverse_order_and_then_joined_in_that_order() -> None:
    journal: list[str] = []
    parts: list[Part] = [_Recorded(name, journal) for name in ("listener", "leases", "health")]

    stop_all(parts, join_s=1)

    assert journal == ["stop health", "stop leases", "stop listener", "join health", "join leases", "join listener"]


class _FailsOnce(Periodic):
    def __init__(self) -> None:
        super().__init__("test-fails-once", interval_s=0.01, tick_first=True)
        self.ticks = 0
        self.went_on = threading.Event()

    def tick(self) -> None:
        self.ticks += 1
        if self.ticks == 1:
            raise RuntimeError("the first tick fails")
        self.went_on.set()


def test_a_periodic_part_whose_tick_raises_logs_it_and_ticks_again() -> None:
    part = _FailsOnce()
    part.start()
    try:
        assert part.went_on.wait(10)
        assert part.health().ok
    finally:
        part.stop()
        part.join(5)

    assert not part.is_alive()
    assert not part.health().ok


def test_a_periodic_part_that_is_off_never_ticks_and_is_healthy() -> None:
    class Off(Periodic):
        def tick(self) -> None:
            raise AssertionError("an off part ticked")

    part = Off("test-off", interval_s=0.01, enabled=False)
    part.start()
    part.join(5)

    assert part.health() == Health(True, "off")


# -- how a segment ends ---------------------------------------------------------------------------


@pytest.mark.parametrize(("error", "reason"), [
    (SpecError("model", "unknown model"), TerminationReason.SPEC_REFUSED),
    (ProviderError("the model answered 500"), TerminationReason.PROVIDER_FAILED),
    (RunBoundReached(TerminationReason.MAX_STEPS, "max_steps"), TerminationReason.MAX_STEPS),
    (RunBoundReached(TerminationReason.TOO_MANY_TOOL_CALLS, "too many"), TerminationReason.TOO_MANY_TOOL_CALLS),
    (CancelRequested("run-1"), TerminationReason.CANCELLED),
    (OwnershipLost("run-1"), TerminationReason.LEASE_LOST),
    (TimeoutError(), TerminationReason.TIME_LIMIT),
    (RunbrakeError("resumed run has no pending turn"), TerminationReason.TOOL_LOOP_ERROR),
    (KeyError("a bug"), TerminationReason.TOOL_LOOP_ERROR),
    (KeyboardInterrupt(), TerminationReason.WORKER_SHUTDOWN),
], ids=lambda value: type(value).__name__ if isinstance(value, BaseException) else str(value))
def test_each_way_a_segment_ends_maps_to_one_termination_reason(
    error: BaseException, reason: TerminationReason,
) -> None:
    assert ending_of(error).reason is reason


def test_a_run_ending_error_carries_its_reason_on_the_class() -> None:
    assert SpecError.reason is TerminationReason.SPEC_REFUSED
    assert ProviderError.reason is TerminationReason.PROVIDER_FAILED
    assert CancelRequested.reason is TerminationReason.CANCELLED
    assert RunbrakeError.reason is None


# -- the subscriber list --------------------------------------------------------------------------


class _Journal(Subscriber):
    """Hears every event and writes it down."""

    def __init__(self) -> None:
        self.events: list[tuple[Any, ...]] = []

    def after_status(self, run_id: str, status: RunStatus) -> None:
        self.events.append(("status", run_id, status))

    async def after_step(self, run_id: str, step: RunStep) -> None:
        self.events.append(("step", run_id, step.kind, step.sequence))

    def after_settle(self, run_id: str, status: RunStatus, reason: TerminationReason | None) -> None:
        self.events.append(("settle", run_id, status, reason))

    def after_skip(self, run_id: str, found: RunStatus | None) -> None:
        self.events.append(("skip", run_id, found))


class _Broken(Subscriber):
    async def after_step(self, run_id: str, step: RunStep) -> None:
        raise RuntimeError("a subscriber with a bug")


@pytest.fixture
async def async_store(settings: Settings, store: RunStore) -> AsyncIterator[AsyncRunStore]:
    connected = AsyncRunStore.connect(settings)
    yield connected
    await connected.aclose()


def _run(store: RunStore, turns: list[dict[str, Any]]) -> str:
    """A queued run of a scripted model with no MCP server."""
    spec = {"input": "test run", "model": {"provider": "scripted", "turns": turns}, "mcp_servers": []}
    return store.create(spec).run_id


def _runtime(settings: Settings, store: AsyncRunStore, *subscribers: Subscriber) -> Runtime:
    return Runtime(settings, store, ActiveRuns(), Admission(Catalog.empty()), subscribers=subscribers)


@pytest.mark.integration
@pytest.mark.anyio
async def test_every_subscriber_hears_a_runs_status_steps_and_settle_and_a_broken_one_fails_no_run(
    settings: Settings, store: RunStore, async_store: AsyncRunStore,
) -> None:
    journal = _Journal()
    runtime = _runtime(settings, async_store, _Broken(), journal)
    run_id = _run(store, [{"content": "It is 5."}])

    outcome = await runtime.execute(run_id)
    again = await runtime.execute(run_id)  # a duplicate message: skipped

    assert (outcome, again) == (RunOutcome.COMPLETED, RunOutcome.SKIPPED)
    assert journal.events == [
        ("status", run_id, RunStatus.RUNNING),
        ("step", run_id, StepKind.MODEL, 1),
        ("settle", run_id, RunStatus.COMPLETED, TerminationReason.COMPLETED),
        ("skip", run_id, RunStatus.COMPLETED),
    ]
    assert store.get(run_id).status is RunStatus.COMPLETED


@pytest.mark.integration
@pytest.mark.anyio
async def test_a_run_failed_by_its_provider_is_settled_with_the_errors_own_reason(
    settings: Settings, store: RunStore, async_store: AsyncRunStore,
) -> None:
    journal = _Journal()
    run_id = _run(store, [{"fail": "the model is down"}])

    outcome = await _runtime(settings, async_store, journal).execute(run_id)

    record = store.get(run_id)
    assert outcome is RunOutcome.FAILED
    assert (record.status, record.termination_reason) == (RunStatus.FAILED, TerminationReason.PROVIDER_FAILED)
    assert journal.events[-1] == ("settle", run_id, RunStatus.FAILED, TerminationReason.PROVIDER_FAILED)
    assert [e[2] for e in journal.events if e[0] == "step"] == [StepKind.MODEL]
