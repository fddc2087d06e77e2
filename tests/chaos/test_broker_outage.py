"""The RabbitMQ node killed (kill -9) for 20 s under a batch of 100 queued runs: every run completes once
the node is back, each worker's cancel listener reconnects by itself, and the cancels issued while the
node was down (written to Redis; their wake-up message could not be published) are found by the backstop,
so those runs end cancelled without waiting for the broker. The cancels go through ``cancel_run`` with a
``CancelPublisher``, as ``runbrake cancel`` does: the fence in Redis, then a publish that fails.

The node is the test's own (``private_rabbitmq``), killed and booted again on the same port and data
folder: the durable run queue and its persistent, confirmed messages survive, as they would in production.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from datetime import datetime

import pytest

from runbrake.shared import RunStatus, RunStore, Settings, TerminationReason
from runbrake.shared.catalog import Admission
from runbrake.shared.messaging.cancel import CancelPublisher, cancel_run
from runbrake.shared.messaging.producer import Producer
from runbrake.shared.messaging.rabbitmq import build_broker
from tests.chaos.conftest import MAX_LINES_PER_OUTAGE, PrivateRabbitMQ, PrivateRedis, loud_lines, start_batch
from tests.mcp_helpers import Toolbox, matching_events, wait_for_event
from tests.polling import poll_until
from tests.worker_helpers import WorkerProcess, wait_for_run

pytestmark = pytest.mark.integration

OUTAGE_S = 20.0
"""How long the node stays down, from the kill -9 to the restart (which then takes a few seconds more)."""
RUNS = 100
LONG_RUNS = 5
"""Runs inside a long call when the node dies: four are cancelled during the outage, one after it."""
KILL_AFTER = 10
"""Short calls finished before the kill: the batch has begun, most of it is still queued."""


def _at(entry: dict[str, object]) -> float:
    return datetime.fromisoformat(str(entry["timestamp"])).timestamp()


@pytest.mark.timeout(240)  # a node's boot, 20 s down, a second boot: 92 s at a load of 9-14 on 2 cores, past 120 once
def test_a_20_s_rabbitmq_outage_under_100_queued_runs_loses_no_run_and_cancels_still_land(
    private_rabbitmq: PrivateRabbitMQ, private_redis: PrivateRedis, toolbox_http: Toolbox, rabbitmq: Settings,
    start_worker: Callable[..., WorkerProcess], monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("RUNBRAKE_RABBITMQ_URL", private_rabbitmq.url)
    monkeypatch.setenv("RUNBRAKE_REDIS_URL", private_redis.url)
    settings = Settings.from_env()
    store = RunStore.connect(settings)
    broker = build_broker(settings)
    publisher = CancelPublisher(settings)
    workers = [start_worker(concurrency=4), start_worker(concurrency=4)]
    try:
        producer = Producer(store, broker, Admission.from_settings(settings))

        long_runs, short = start_batch(producer, toolbox_http, runs=RUNS, long=LONG_RUNS, finished=KILL_AFTER)

        killed_at = time.time()
        private_rabbitmq.kill()
        for worker in workers:
            worker.wait_for_log("cancel_listener_disconnected", timeout=10)

        # Cancels while the node is down: the fence is written, the wake-up cannot be published.
        cancelled_at = {}
        for run_id in long_runs[:-1]:
            result = cancel_run(store, publisher, run_id, reason="outage drill", requested_by="chaos test")
            cancelled_at[run_id] = time.time()
            assert (result.won, result.message_confirmed) == (True, False)
        def found_by_backstop() -> list[dict[str, object]] | None:
            entries = [e for w in workers for e in w.logged("cancel_found_by_backstop")]
            return entries if len(entries) >= len(cancelled_at) else None

        found = poll_until(found_by_backstop, timeout=10,
                           failure=lambda: "the backstop did not find the cancels made during the outage")
        wait_for_event(toolbox_http.events, "cancelled", tool="slow", count=len(cancelled_at), timeout=10)
        assert time.time() - killed_at < OUTAGE_S, "the cancels landed only after the outage was over"

        time.sleep(max(0.0, killed_at + OUTAGE_S - time.time()))  # the rest of the outage: its length, not a wait
        down_s = time.time() - killed_at
        boot_s = private_rabbitmq.start()
        back_at = time.time()
        reconnected = [w.wait_for_log("cancel_listener_connected", count=2, timeout=30)[1] for w in workers]

        # The listener consumes again: a cancel after the outage travels by message.
        last = long_runs[-1]
        assert cancel_run(store, publisher, last, reason="after the outage", requested_by="chaos test"
                          ).message_confirmed is True
        poll_until(lambda: [e for w in workers for e in w.logged("cancel_message_delivered", run_id=last)],
                   timeout=10, failure=lambda: "the reconnected listener did not deliver the cancel")

        records = {run_id: wait_for_run(store, run_id, timeout=60) for run_id in [*long_runs, *short]}
        drained_s = time.time() - back_at
        for worker in workers:  # the other consumer thread of the same kind is back as well
            worker.wait_for_log("cancel_requests_connected", count=2, timeout=15)
    finally:
        publisher.close()
        broker.close()
        store.delete_namespace()
        store.close()

    loud = [loud_lines(worker, killed_at) for worker in workers]
    reconnect_s = [_at(entry) - back_at for entry in reconnected]
    backstop_s = [_at(e) - cancelled_at[e["run_id"]] for e in found]
    print(f"node down {down_s:.1f} s, booted in {boot_s:.1f} s; listeners reconnected "
          f"{min(reconnect_s):.1f}-{max(reconnect_s):.1f} s after it accepted connections; the backstop found the "
          f"{len(found)} cancels {min(backstop_s):.2f}-{max(backstop_s):.2f} s after they were written; all runs "
          f"ended {drained_s:.1f} s after the node was back; warning-or-louder lines per worker since the kill: {loud}")

    assert {e["run_id"] for e in found} == set(long_runs[:-1])
    assert Counter(r.status for r in records.values()) == {RunStatus.COMPLETED: RUNS - LONG_RUNS,
                                                          RunStatus.CANCELLED: LONG_RUNS}
    assert {run_id for run_id, r in records.items() if r.termination_reason is TerminationReason.CANCELLED} == set(
        long_runs)
    # Nothing ran twice, though every message held by a worker when the node died came back.
    started = Counter(e["args"]["seconds"] for e in matching_events(toolbox_http.events, "started", tool="slow"))
    assert started == Counter([600 + i for i in range(LONG_RUNS)] + list(short.values()))
    assert [e for w in workers for e in w.logged("run_redriven")] == []  # no message was lost with the node
    assert all(len(lines) <= MAX_LINES_PER_OUTAGE for lines in loud)  # not one per reconnect attempt
