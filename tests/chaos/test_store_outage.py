"""A Redis outage shorter than the lease fails no run: steps finished during it are kept by the worker and
written when Redis is back, and nobody reaps a lease for time during which nobody could renew."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable

import pytest
import redis

from runbrake.shared import RunStatus, Settings, StepKind, ToolOutcome
from tests.chaos.conftest import Client, Outage, PrivateRedis
from tests.mcp_helpers import Toolbox, matching_events, wait_for_event
from tests.worker_helpers import WorkerProcess, call, spec, wait_for_run

pytestmark = pytest.mark.integration


def test_a_redis_blip_during_tool_calls_fails_no_run_and_loses_no_step(
    stoppable_redis: Outage, toolbox_http: Toolbox, point_at: Callable[..., Client],
    start_worker: Callable[..., WorkerProcess],
) -> None:
    client = point_at(stoppable_redis.env, lease_s=10)
    worker = start_worker()
    runs = [client.producer.enqueue(spec({"toolbox": toolbox_http.spec}, [
        {"tool_calls": [call("slow", seconds=2)]}, {"content": "done"}])).run_id for _ in range(5)]
    wait_for_event(toolbox_http.events, "started", tool="slow", count=5, timeout=20)

    for pid in stoppable_redis.pids:
        os.kill(pid, signal.SIGSTOP)  # Redis stops answering; the calls finish meanwhile
    try:
        wait_for_event(toolbox_http.events, "finished", tool="slow", count=5, timeout=20)
        worker.wait_for_log("store_write_retrying", timeout=10)
    finally:
        for pid in stoppable_redis.pids:
            os.kill(pid, signal.SIGCONT)
    records = [wait_for_run(client.store, run_id, timeout=30) for run_id in runs]

    assert [r.status for r in records] == [RunStatus.COMPLETED] * 5
    assert all([(s.kind, s.tool_outcome) for s in r.steps] == [
        (StepKind.MODEL, None), (StepKind.TOOL, ToolOutcome.OK), (StepKind.MODEL, None)] for r in records)
    assert worker.logged("run_lease_lost") == []
    assert len(matching_events(toolbox_http.events, "started", tool="slow")) == 5  # nothing ran twice


def test_a_worker_warns_loudly_when_its_redis_keeps_nothing_on_disk(
    private_redis: PrivateRedis, rabbitmq: Settings, start_worker: Callable[..., WorkerProcess],
) -> None:
    durable = start_worker(RUNBRAKE_REDIS_URL=private_redis.url)
    client = redis.Redis(port=private_redis.port)
    try:
        client.config_set("appendonly", "no")
        client.config_set("save", "")
        volatile = start_worker(RUNBRAKE_REDIS_URL=private_redis.url)
    finally:
        client.close()

    assert durable.logged("redis_not_persistent") == []
    [warning] = volatile.logged("redis_not_persistent")
    assert (warning["level"], warning["appendonly"]) == ("warning", "no")
