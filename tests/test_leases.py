"""Leases, the last resort: a run whose worker died and that no sweep took up (docs/leases.md, "Lost
workers") does not stay "running" forever. The sweep is held off here (a worker is lost only after ten minutes)
so that the lease alone decides."""

from __future__ import annotations

import signal
from collections.abc import Callable

import pytest

from runbrake.shared import RunStatus, RunStore, TerminationReason, ToolOutcome
from runbrake.shared.messaging.producer import Producer
from tests.mcp_helpers import Toolbox, matching_events, wait_for_event
from tests.worker_helpers import WorkerProcess, call, spec, wait_for_run

pytestmark = pytest.mark.integration

SHORT_LEASE = {"RUNBRAKE_LEASE_S": "5", "RUNBRAKE_WORKER_LOST_S": "600"}


def test_the_run_of_a_killed_worker_is_failed_lease_lost_by_another_worker(
    toolbox_http: Toolbox, start_worker: Callable[..., WorkerProcess], producer: Producer, store: RunStore
) -> None:
    doomed = start_worker(**SHORT_LEASE)
    run = producer.enqueue(spec({"toolbox": toolbox_http.spec}, [{"tool_calls": [call("slow", seconds=60)]},
                                                                   {"content": "never"}]))
    wait_for_event(toolbox_http.events, "started", tool="slow")
    owner = store.get(run.run_id).owner

    doomed.process.send_signal(signal.SIGKILL)
    doomed.process.wait()
    start_worker(**SHORT_LEASE)

    record = wait_for_run(store, run.run_id, timeout=30)
    assert (record.status, record.termination_reason) == (RunStatus.FAILED, TerminationReason.LEASE_LOST)
    assert owner in record.error


def test_a_run_longer_than_its_lease_completes_because_its_worker_renews_the_lease(
    toolbox_http: Toolbox, start_worker: Callable[..., WorkerProcess], producer: Producer, store: RunStore
) -> None:
    # Two workers with short leases: whichever does not hold the run reaps every ~1.7 s.
    start_worker(**SHORT_LEASE)
    start_worker(**SHORT_LEASE)
    run = producer.enqueue(spec({"toolbox": toolbox_http.spec}, [{"tool_calls": [call("slow", seconds=8)]},
                                                                   {"content": "done"}]))

    record = wait_for_run(store, run.run_id, timeout=40)

    assert (record.status, record.termination_reason) == (RunStatus.COMPLETED, TerminationReason.COMPLETED)
    tool = next(s for s in record.steps if s.tool_outcome is not None)
    assert tool.tool_outcome is ToolOutcome.OK
    assert tool.duration_ms > 5_000  # the call outlived the lease it was claimed with


def test_a_paused_worker_whose_run_was_reaped_writes_nothing_and_calls_no_tool_after_the_reap(
    toolbox_http: Toolbox, start_worker: Callable[..., WorkerProcess], producer: Producer, store: RunStore
) -> None:
    stale = start_worker(**SHORT_LEASE)
    run = producer.enqueue(spec({"toolbox": toolbox_http.spec}, [
        {"tool_calls": [call("slow", seconds=3)]}, {"tool_calls": [call("get-sum", a=1, b=2)]}, {"content": "x"}]))
    wait_for_event(toolbox_http.events, "started", tool="slow")

    stale.process.send_signal(signal.SIGSTOP)  # paused past its lease, mid-call: it looks dead
    try:
        start_worker(**SHORT_LEASE)  # the reaper (started after the pause: a slow start cannot let the run end first)
        reaped = wait_for_run(store, run.run_id, timeout=30)
        steps_at_reap = len(reaped.steps)
    finally:
        stale.process.send_signal(signal.SIGCONT)
    stale.wait_for_log("run_segment_ended", run_id=run.run_id, timeout=30)

    record = store.get(run.run_id)
    assert (reaped.status, reaped.termination_reason) == (RunStatus.FAILED, TerminationReason.LEASE_LOST)
    assert (record.status, len(record.steps)) == (RunStatus.FAILED, steps_at_reap)  # nothing appended after
    assert matching_events(toolbox_http.events, "started", tool="get-sum") == []  # and no further call
    assert stale.logged("run_segment_ended", run_id=run.run_id)[0]["outcome"] == "lost"  # not counted as a cancel
