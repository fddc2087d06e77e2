"""kill -9 of one of two workers in the middle of a batch: the runs it held are taken up by the other worker
(docs/leases.md, "Lost workers") and complete there, each cut-off call on the record once, nothing else is
touched, and no tool call is made twice."""

from __future__ import annotations

import signal
import time
from collections import Counter
from collections.abc import Callable

import pytest

from runbrake.shared import RunStatus, StepKind, ToolOutcome
from tests.chaos.conftest import Client, PrivateRedis
from tests.mcp_helpers import Toolbox, matching_events, wait_for_event
from tests.worker_helpers import WorkerProcess, call, spec, wait_for_run

pytestmark = pytest.mark.integration

LEASE_S = 30  # far past detection: the lease (the last resort) must not decide here
RUNS = 20
CONCURRENCY = 4
TOOL_S = 2.0
FAST = {"RUNBRAKE_WORKER_BEAT_S": "0.5", "RUNBRAKE_WORKER_LOST_S": "5"}


def test_kill_9_of_one_of_two_workers_resumes_only_its_runs_on_the_other_and_runs_nothing_twice(
    private_redis: PrivateRedis, toolbox_http: Toolbox, point_at: Callable[..., Client],
    start_worker: Callable[..., WorkerProcess],
) -> None:
    client = point_at({"RUNBRAKE_REDIS_URL": private_redis.url}, lease_s=LEASE_S, redis_timeout_s=2.0)
    doomed = start_worker(concurrency=CONCURRENCY, **FAST)
    survivor = start_worker(concurrency=CONCURRENCY, **FAST)
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
    records = {run_id: wait_for_run(client.store, run_id, timeout=60) for run_id in seconds}

    claimed, ended = ({e["run_id"] for e in doomed.logged(event)} for event in ("run_claimed", "run_segment_ended"))
    held = claimed - ended  # what the killed worker was executing
    assert held, "the doomed worker was executing nothing when it was killed"
    # Every run completed; exactly those the killed worker held have their call cut off, on the record once.
    assert {r.status for r in records.values()} == {RunStatus.COMPLETED}
    resumed = {run_id for run_id, r in records.items() if any(s.kind is StepKind.HANDOFF for s in r.steps)}
    assert resumed == held
    for run_id in held:
        steps = records[run_id].steps
        assert [(s.kind, s.tool_outcome, s.detail.get("reason")) for s in steps] == [
            (StepKind.MODEL, None, None), (StepKind.TOOL, ToolOutcome.CANCELLED, "worker_lost"),
            (StepKind.HANDOFF, None, "worker_lost"), (StepKind.MODEL, None, None)]
        assert f":{doomed.pid}:" in steps[2].detail["worker"]
    # The survivor took up the doomed worker's runs and claimed them again; it lost none of its own.
    assert {e["run_id"] for e in survivor.logged("run_worker_lost", outcome="requeued")} == held
    assert held <= {e["run_id"] for e in survivor.logged("run_claimed")}
    assert survivor.logged("lease_not_renewed") == []
    assert survivor.logged("run_lease_lost") == []
    # Nothing ran twice: one call per run on the server (the killed worker's runs had started theirs).
    started = Counter(e["args"]["seconds"] for e in matching_events(toolbox_http.events, "started", tool="slow"))
    assert started == Counter(seconds.values())
    taken_after = [records[run_id].steps[2].recorded_at - killed_at for run_id in held]
    print(f"took up {len(held)} run(s) {min(taken_after):.2f}-{max(taken_after):.2f} s after kill -9")
