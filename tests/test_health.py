"""The worker's /healthz and /readyz, its service checks and the queue-depth sampler (worker/health.py),
against the real Redis and RabbitMQ and a real worker process."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from dramatiq.asyncio import EventLoopThread, get_event_loop_thread, set_event_loop_thread
from dramatiq.logging import get_logger

from runbrake.shared import RunStore, Settings
from runbrake.shared.messaging.rabbitmq import build_broker
from runbrake.shared.messaging.wire import Topology, run_message
from runbrake.worker import metrics
from runbrake.worker.health import (
    CHECK_INTERVAL_S,
    Check,
    HealthEndpoints,
    ServiceChecks,
    event_loop_check,
    serve,
)
from tests.polling import poll_until
from tests.ports import free_port
from tests.worker_helpers import Metrics, WorkerProcess, scrape_metrics

pytestmark = pytest.mark.integration

ALL_READY = {"redis", "rabbitmq", "cancel_listener", "consumers", "draining"}


def consuming() -> tuple[bool, str]:
    """What ``Intake.consumer_status`` answers for a worker that takes messages."""
    return True, "4 of 4 consumer threads alive, consuming"


@pytest.fixture
def services(store: RunStore, rabbitmq: Settings) -> Iterator[ServiceChecks]:
    """Service checks of this test's namespace, run by hand (check_once), never as a thread."""
    checks = ServiceChecks(rabbitmq, store, sample_queue_depth=False)
    yield checks
    checks.close()


@pytest.fixture
def loop_thread() -> Iterator[EventLoopThread]:
    """A running Dramatiq event loop thread, installed where the liveness check looks for it."""
    thread = EventLoopThread(get_logger(__name__))
    thread.start(timeout=5.0)
    set_event_loop_thread(thread)
    yield thread
    set_event_loop_thread(None)
    thread.stop()
    thread.join(5)


def _get(url: str) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:  # noqa: S310 - the tests' own loopback URLs
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        with error:
            return error.code, json.loads(error.read())


# -- readiness ------------------------------------------------------------------------------------


def test_readiness_is_ok_when_both_services_answered_the_listener_consumes_and_nothing_drains(
    services: ServiceChecks,
) -> None:
    listener_ready, draining = threading.Event(), threading.Event()
    listener_ready.set()
    services.check_once()

    report = HealthEndpoints(services, listener_ready, draining, consumers=consuming).readiness()

    assert (report.ok, report.failed, int(report.status)) == (True, [], 200)
    assert set(report.body()["checks"]) == ALL_READY  # type: ignore[arg-type]


def test_readiness_fails_naming_the_listener_while_it_is_not_consuming(services: ServiceChecks) -> None:
    services.check_once()

    report = HealthEndpoints(services, threading.Event(), threading.Event(), consumers=consuming).readiness()

    assert (report.ok, report.failed, int(report.status)) == (False, ["cancel_listener"], 503)
    assert report.body()["checks"]["cancel_listener"] == {  # type: ignore[index]
        "ok": False, "detail": "not consuming (connecting or reconnecting)"}


def test_readiness_fails_while_draining(services: ServiceChecks) -> None:
    listener_ready, draining = threading.Event(), threading.Event()
    listener_ready.set()
    draining.set()
    services.check_once()

    report = HealthEndpoints(services, listener_ready, draining, consumers=consuming).readiness()

    assert report.failed == ["draining"]


def test_readiness_fails_before_the_first_check_and_when_the_last_one_is_stale(services: ServiceChecks) -> None:
    assert [services.verdict(name).detail for name in ("redis", "rabbitmq")] == ["not checked yet"] * 2

    services.check_once()
    later = time.monotonic() + 60

    assert [services.verdict(name).ok for name in ("redis", "rabbitmq")] == [True, True]
    stale = [services.verdict(name, now=later) for name in ("redis", "rabbitmq")]
    assert [check.ok for check in stale] == [False, False]
    assert all("last checked 6" in check.detail for check in stale)


def test_an_unreachable_rabbitmq_or_redis_fails_its_own_check(store: RunStore, settings: Settings) -> None:
    down = f"127.0.0.1:{free_port()}"
    unreachable = Settings(
        namespace=settings.namespace, rabbitmq_url=f"amqp://guest:guest@{down}/",
        redis_url=f"redis://{down}/0", redis_timeout_s=0.5,
    )
    dead_store = RunStore.connect(unreachable)
    checks = ServiceChecks(unreachable, dead_store, sample_queue_depth=False)
    try:
        checks.check_once()
        verdicts = {name: checks.verdict(name) for name in ("redis", "rabbitmq")}
    finally:
        checks.close()
        dead_store.close()

    assert {name: check.ok for name, check in verdicts.items()} == {"redis": False, "rabbitmq": False}
    assert "Redis" in verdicts["redis"].detail


# -- liveness -------------------------------------------------------------------------------------


def test_liveness_fails_without_a_running_event_loop() -> None:
    installed = get_event_loop_thread()
    set_event_loop_thread(None)
    try:
        verdict = event_loop_check()
    finally:
        set_event_loop_thread(installed)

    assert verdict == Check("event_loop", ok=False, detail="the event loop is not running")


def test_liveness_answers_from_a_running_loop_and_fails_while_the_loop_is_blocked(
    loop_thread: EventLoopThread,
) -> None:
    assert event_loop_check().ok

    release = threading.Event()
    loop_thread.loop.call_soon_threadsafe(release.wait, 30)  # blocks the loop until released
    try:
        blocked = event_loop_check(timeout_s=0.2)
    finally:
        release.set()

    assert blocked == Check("event_loop", ok=False, detail="no answer within 0.2 s")
    assert event_loop_check().ok


def test_the_endpoints_answer_json_with_200_or_503(services: ServiceChecks, loop_thread: EventLoopThread) -> None:
    listener_ready = threading.Event()
    services.check_once()
    port = free_port()
    server = serve(HealthEndpoints(services, listener_ready, threading.Event(), consumers=consuming), port)
    try:
        alive = _get(f"http://127.0.0.1:{port}/healthz")
        unready = _get(f"http://127.0.0.1:{port}/readyz")
        listener_ready.set()
        ready = _get(f"http://127.0.0.1:{port}/readyz")
        missing = _get(f"http://127.0.0.1:{port}/metrics")
    finally:
        server.shutdown()
        server.server_close()

    assert alive[0] == 200
    assert alive[1]["ok"] is True
    assert alive[1]["checks"]["event_loop"]["ok"] is True
    assert unready[0] == 503
    assert (unready[1]["ok"], unready[1]["failed"]) == (False, ["cancel_listener"])
    assert set(unready[1]["checks"]) == ALL_READY
    assert (ready[0], ready[1]["ok"], ready[1]["failed"]) == (200, True, [])
    assert missing[0] == 404


# -- the queue-depth sampler ----------------------------------------------------------------------


def _depth(queue: str) -> float | None:
    for family in metrics.QUEUE_DEPTH.collect():
        for sample in family.samples:
            if sample.labels.get("queue") == queue:
                return float(sample.value)
    return None


@pytest.mark.parametrize("settings", ["single", "cluster"], indirect=True)  # tests/cluster_helpers.py
def test_one_process_samples_the_queue_depth_and_hands_over_when_it_stops(
    store: RunStore, rabbitmq: Settings,
) -> None:
    topology = Topology.of(rabbitmq)
    broker = build_broker(rabbitmq)
    try:
        for _ in range(3):
            broker.enqueue(run_message(topology, "0" * 32))  # no run, no consumer: stays ready
    finally:
        broker.close()
    first = ServiceChecks(rabbitmq, store, sample_queue_depth=True)
    second = ServiceChecks(rabbitmq, store, sample_queue_depth=True)
    try:
        first.check_once()
        second.check_once()
        sampled_by_first = (first.sampling, second.sampling, _depth(topology.run_queue))

        first.close()  # resigns and releases the lock
        after_first_left = _depth(topology.run_queue)
        second.check_once()
        sampled_by_second = (second.sampling, _depth(topology.run_queue))
    finally:
        first.close()
        second.close()

    assert sampled_by_first == (True, False, 3.0)
    assert after_first_left is None
    assert sampled_by_second == (True, 3.0)
    assert store.redis.exists(f"{rabbitmq.namespace}:queue-depth-sampler") == 0


# -- a real worker --------------------------------------------------------------------------------


def test_a_worker_serves_healthz_readyz_and_the_gauges(
    start_worker: Callable[..., WorkerProcess], store: RunStore,
) -> None:
    health_port, metrics_port = free_port(), free_port()
    worker = start_worker(RUNBRAKE_HEALTH_PORT=str(health_port), RUNBRAKE_METRICS_PORT=str(metrics_port))
    worker.wait_for_log("health_serving", port=health_port)

    ready = poll_until(
        lambda: (answer := _get(f"http://127.0.0.1:{health_port}/readyz"))[0] == 200 and answer,
        timeout=20, failure=lambda: f"/readyz never answered 200: {_get(f'http://127.0.0.1:{health_port}/readyz')}",
    )
    alive = _get(f"http://127.0.0.1:{health_port}/healthz")
    queue = Topology(store.namespace).run_queue
    worker.wait_for_log("queue_depth_sampler_elected", queue=queue)

    def scrape() -> Metrics:
        return scrape_metrics(metrics_port)

    # The first sample may find the queue not declared yet (the worker's consumer declares it); the next
    # round, one check interval later, has it.
    def with_depth() -> Metrics | None:
        found = scrape()
        return found if ("runbrake_queue_depth", (("queue", queue),)) in found else None

    samples = poll_until(with_depth, timeout=3 * CHECK_INTERVAL_S, interval=0.2,
                         failure=lambda: f"no runbrake_queue_depth sample: {scrape()}")

    assert ready[1]["ok"] is True
    assert set(ready[1]["checks"]) == ALL_READY
    assert alive[0] == 200
    assert alive[1]["checks"]["event_loop"]["ok"] is True
    assert samples[("runbrake_runs_in_flight", ())] == 0.0
    assert samples[("runbrake_cancel_listener_connected", ())] == 1.0
    assert samples[("runbrake_queue_depth", (("queue", queue),))] == 0.0

