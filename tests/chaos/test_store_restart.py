"""Redis, the system of record, restarted in the middle of a batch of runs: no record is lost and every run
still completes, its one tool call made once.

The private Redis runs with AOF on and ``appendfsync everysec``, as deployed. It is restarted cleanly
(SIGTERM, which Redis handles as SHUTDOWN: it fsyncs the AOF before it exits), the way an operator or
Kubernetes restarts it. A hard kill (-9) with ``everysec`` may lose up to a second of writes, by design
of that setting; that loss is not what this test is about.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable

import pytest

from runbrake.shared import RunStatus, StepKind, ToolOutcome
from tests.chaos.conftest import Client, PrivateRedis
from tests.mcp_helpers import Toolbox, matching_events, wait_for_event
from tests.worker_helpers import WorkerProcess, call, spec, wait_for_run

pytestmark = pytest.mark.integration

RUNS = 100
RESTART_AFTER = 30
"""Calls finished before Redis is restarted: about a third of the batch done, a worker's worth in flight."""


def test_a_redis_restart_during_100_runs_loses_no_record_and_every_run_completes(
    private_redis: PrivateRedis, toolbox_http: Toolbox, point_at: Callable[..., Client],
    start_worker: Callable[..., WorkerProcess],
) -> None:
    client = point_at({"RUNBRAKE_REDIS_URL": private_redis.url}, lease_s=10)
    workers = [start_worker(concurrency=4), start_worker(concurrency=4)]
    # A short call whose length names the run in the server's events.
    seconds = {client.producer.enqueue(spec({"toolbox": toolbox_http.spec}, [
        {"tool_calls": [call("slow", seconds=0.3 + i / 10_000)]}, {"content": "done"}])).run_id: 0.3 + i / 10_000
        for i in range(RUNS)}
    wait_for_event(toolbox_http.events, "finished", tool="slow", count=RESTART_AFTER, timeout=60)

    began = time.monotonic()
    private_redis.restart()
    restart_s = time.monotonic() - began
    records = [wait_for_run(client.store, run_id, timeout=60) for run_id in seconds]

    print(f"redis restarted in {restart_s:.2f} s; "
          + ", ".join(f"{event}: {sum(len(w.logged(event)) for w in workers)}"
                      for event in ("store_write_retrying", "lease_upkeep_failed", "run_lease_lost")))
    assert len(records) == RUNS  # every record is still there (wait_for_run read each one)
    assert Counter(r.status for r in records) == {RunStatus.COMPLETED: RUNS}
    assert all([(s.kind, s.tool_outcome) for s in r.steps] == [
        (StepKind.MODEL, None), (StepKind.TOOL, ToolOutcome.OK), (StepKind.MODEL, None)] for r in records)
    started = Counter(e["args"]["seconds"] for e in matching_events(toolbox_http.events, "started", tool="slow"))
    assert started == Counter(seconds.values())  # one call per run: nothing ran twice
