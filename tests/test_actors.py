"""The run actor's wiring (Dramatiq's StubBroker is fine here: no run is executed)."""

from __future__ import annotations

import pytest
from dramatiq.asyncio import get_event_loop_thread
from dramatiq.brokers.stub import StubBroker
from dramatiq.middleware import AsyncIO, Retries, TimeLimit

from runbrake.shared import AsyncRunStore, Settings, StoreError
from runbrake.shared.catalog import Admission, Catalog
from runbrake.shared.messaging.rabbitmq import INTERRUPT_CHECK_S, default_middleware
from runbrake.shared.messaging.wire import RUN_ACTOR, Topology
from runbrake.worker.actors import STORE_OUTAGE_RETRIES, declare_run_actor, retry_store_outages
from runbrake.worker.intake import CapacityClosed, Intake
from runbrake.worker.registry import ActiveRuns
from runbrake.worker.runtime import Runtime


def test_only_a_store_outage_is_retried_and_only_so_often() -> None:
    assert retry_store_outages(0, StoreError("Redis at 127.0.0.1:6379: connection refused"))
    assert retry_store_outages(STORE_OUTAGE_RETRIES - 1, StoreError("still down"))
    assert not retry_store_outages(STORE_OUTAGE_RETRIES, StoreError("still down"))
    assert retry_store_outages(0, CapacityClosed("the worker stopped taking runs"))
    assert not retry_store_outages(0, ValueError("a bug"))
    assert not retry_store_outages(0, RuntimeError("anything else"))


def test_the_run_actor_is_declared_on_the_namespaced_queue_with_explicit_limits() -> None:
    settings = Settings(namespace="wiring", run_time_limit_s=120)
    broker = StubBroker(middleware=default_middleware())
    runtime = Runtime(settings, AsyncRunStore.connect(settings), ActiveRuns(), Admission(Catalog.empty()))

    actor = declare_run_actor(broker, Intake(runtime, concurrency=8), settings)

    assert (actor.actor_name, actor.queue_name) == (RUN_ACTOR, Topology("wiring").run_queue)
    assert (actor.actor_name, actor.queue_name) == ("execute_run", "wiring.runs")
    assert actor.options["retry_when"] is retry_store_outages
    # The actor only waits for a slot and a claim; its limit outlasts the longest a segment can hold a slot
    # (the runtime's limit, then a settle retried for a lease), so only a stuck wait gives the message back.
    assert actor.options["time_limit"] == (120 + 60 + 60) * 1000
    # The segment outlives the actor (acked at claim): the intake interrupts it on shutdown, not Dramatiq.
    assert not actor.options.get("notify_shutdown")
    broker.close()


@pytest.mark.parametrize("middleware", [Retries, AsyncIO, TimeLimit], ids=lambda m: m.__name__)
def test_the_broker_carries_the_middleware_the_run_actor_needs(middleware: type) -> None:
    assert any(isinstance(m, middleware) for m in default_middleware())


def test_worker_threads_look_for_dramatiqs_interrupt_once_a_second_not_ten_times() -> None:
    [asyncio_middleware] = [m for m in default_middleware() if isinstance(m, AsyncIO)]
    broker = StubBroker(middleware=[])
    asyncio_middleware.before_worker_boot(broker, None)
    try:
        loop_thread = get_event_loop_thread()
        assert loop_thread is not None
        assert loop_thread.interrupt_check_ival == INTERRUPT_CHECK_S == 1.0
    finally:
        asyncio_middleware.after_worker_shutdown(broker, None)
        broker.close()
