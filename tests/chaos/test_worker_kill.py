"""kill -9 of one of two workers in the middle of a batch: the runs it held are failed ``lease_lost`` by the
other worker within a lease and a third, nothing else is, and no tool call is made twice."""

from __future__ import annotations

import signal
import time
from collections import Counter
from collections.abc import Callable

import pytest

from runbrake.shared import RunStatus, TerminationReason
from tests.chaos.conftest import Client, PrivateRedis
from tests.mcp_helpers import Toolbox, matching_events, wait_for_event
from tests.worker_helpers import WorkerProcess, call, spec, wait_for_run

pytestmark = pytest.mark.integration

LEASE_S = 5  # the shortest lease Settings accepts
RUNS = 20
CONCURRENCY = 4
TOOL_S = 2.0


def test_kill_9_of_one_of_two_workers_fails_only_its_runs_lease_lost_and_runs_nothing_twice(
    private_redis: PrivateRedis, toolbox_http: Toolbox, point_at: Callable[..., Client],
    start_worker: Callable[..., WorkerProcess],
) -> None:
    client = point_at({"RUNBRAKE_REDIS_URL": private_redis.url}, lease_s=LEASE_S, redis_timeout_s=2.0)
    doomed = start_worker(concurrency=CONCURRENCY)
    survivor = start_worker(concurrency=CONCURRENCY)
    # Each run's call waits a length of its own, which names the run in the server's events.
    seconds = {client.producer.enqueue(spec({"toolbox": toolbox_http.spec}, [
        {"tool_calls": [call("slow", seconds=TOOL_S + i / 100)]}, {"content": "done"}])).run_id: TOOL_S + i / 100
        for i in range(RUNS)}
    # Both workers busy: each holds as many runs as its concurrency, every one inside its tool call.
    wait_for_event(toolbox_http.events, "started", tool="slow", count=2 * CONCURRENCY, timeout=30)
    assert doomed.logged("run_claimed"), "the doomed worker took no run"

    killed_at = time.time()
    doomed.process.send_signal(signal.SIGKILL)
    doomed.process.wait(timeout=10)
    records = {run_id: wait_for_run(client.store, run_id, timeout=40) for run_id in seconds}

    claimed, ended = ({e["run_id"] for e in doomed.logged(event)} for event in ("run_claimed", "run_segment_ended"))
    held = claimed - ended  # what the killed worker was executing
    lost = {run_id for run_id, r in records.items() if r.termination_reason is TerminationReason.LEASE_LOST}
    doomed_owner = f":{doomed.pid}:"
    assert held, "the doomed worker was executing nothing when it was killed"
    # Exactly the runs the killed worker was executing are lease_lost; every other run completed.
    assert lost == held
    assert all(records[run_id].status is RunStatus.FAILED and doomed_owner in records[run_id].error
               for run_id in lost)
    assert {r.status for run_id, r in records.items() if run_id not in lost} == {RunStatus.COMPLETED}
    # The survivor's claims are the other runs; it lost none of its own and reaped the doomed worker's.
    assert {e["run_id"] for e in survivor.logged("run_claimed")} == set(seconds) - held
    assert {e["run_id"] for e in survivor.logged("run_lease_lost")} == held
    assert survivor.logged("lease_not_renewed") == []
    # Nothing ran twice: one call per run on the server (the killed worker's runs had started theirs).
    started = Counter(e["args"]["seconds"] for e in matching_events(toolbox_http.events, "started", tool="slow"))
    assert started == Counter(seconds.values())
    # Reaped within a lease and a third of the kill (the last renewal came before it; reaping runs every
    # third of a lease). An allowance of a second for the reaper's round trips on a loaded machine.
    reaped_after = [records[run_id].finished_at - killed_at for run_id in lost]  # type: ignore[operator]
    print(f"reaped {len(lost)} run(s) {min(reaped_after):.2f}-{max(reaped_after):.2f} s after kill -9")
    assert max(reaped_after) <= LEASE_S * 4 / 3 + 1.0
