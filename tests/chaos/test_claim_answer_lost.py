"""A claim that Redis applied but whose answer never reached the worker: Redis paused past the client's
timeout with the claim script already in its socket buffer, then resumed and ran it.

Before the fix the worker gave the message back to Dramatiq, whose retry claimed with a new owner, found
the run "running" (under the lost answer's owner, which nobody executes) and skipped it; the run sat
there until it was reaped ``lease_lost``, never having run. Now the worker tries the claim again with
the same owner while Redis cannot be reached, and the claim script recognises it as already this owner's.
"""

from __future__ import annotations

import os
import signal
from collections import Counter
from collections.abc import Callable

import pytest

from runbrake.shared import RunStatus
from tests.chaos.conftest import Client, PrivateRedis
from tests.mcp_helpers import Toolbox, matching_events
from tests.worker_helpers import WorkerProcess, call, spec, wait_for_run

pytestmark = pytest.mark.integration

RUNS = 3


def test_a_claim_whose_answer_was_lost_still_runs_the_run_once(
    private_redis: PrivateRedis, toolbox_http: Toolbox, point_at: Callable[..., Client],
    start_worker: Callable[..., WorkerProcess],
) -> None:
    client = point_at({"RUNBRAKE_REDIS_URL": private_redis.url}, lease_s=5)
    store, producer = client.store, client.producer
    worker = start_worker()
    # Warm-up, four at once: the worker's pool then holds open connections, so each claim below is
    # written to Redis's socket at once (a new connection would time out in its handshake instead).
    warm = [producer.enqueue(spec({"toolbox": toolbox_http.spec}, [
        {"tool_calls": [call("slow", seconds=0.5)]}, {"content": "done"}])).run_id for _ in range(4)]
    for run_id in warm:
        wait_for_run(store, run_id)
    # Written to Redis without a message; the messages go out while Redis is paused.
    runs = [store.create(spec({"toolbox": toolbox_http.spec}, [
        {"tool_calls": [call("get-sum", a=i, b=1000)]}, {"content": "done"}]).raw).run_id for i in range(RUNS)]
    os.kill(private_redis.process.pid, signal.SIGSTOP)
    try:
        for run_id in runs:
            producer.send(run_id)
        # Each claim timed out on the worker's side; Redis holds it, unanswered.
        worker.wait_for_log("store_write_retrying", write="claim", count=RUNS, timeout=20)
    finally:
        os.kill(private_redis.process.pid, signal.SIGCONT)
    records = [wait_for_run(store, run_id, timeout=30) for run_id in runs]

    assert [r.status for r in records] == [RunStatus.COMPLETED] * RUNS
    assert worker.logged("run_lease_lost") == []
    assert worker.logged("run_message_skipped") == []
    sums = Counter(e["args"]["a"] for e in matching_events(toolbox_http.events, "started", tool="get-sum"))
    assert sums == Counter(range(RUNS))  # each run's call made once
