"""Drain and hand-over: a worker stopped by SIGTERM lets its runs finish for ``RUNBRAKE_DRAIN_S``, then hands
the rest back to the queue; another worker continues them from where they stood (docs/leases.md,
"Drain and hand-over")."""

from __future__ import annotations

import signal
from collections.abc import Callable

import pytest

from runbrake.shared import RunStatus, RunStore, Settings, StepKind, TerminationReason, ToolOutcome
from runbrake.shared.messaging.cancel import CancelPublisher, cancel_run
from runbrake.shared.messaging.producer import Producer
from tests.mcp_helpers import Toolbox, matching_events, wait_for_event
from tests.worker_helpers import WorkerProcess, call, spec, wait_for_run

pytestmark = pytest.mark.integration


def test_a_run_in_a_long_call_at_the_drain_deadline_is_handed_over_and_completed_by_another_worker(
    toolbox_http: Toolbox, start_worker: Callable[..., WorkerProcess], producer: Producer, store: RunStore
) -> None:
    first = start_worker(RUNBRAKE_DRAIN_S="2")
    run = producer.enqueue(spec({"toolbox": toolbox_http.spec}, [
        {"tool_calls": [call("slow", seconds=60)]}, {"content": "done after the hand-over"}]))
    wait_for_event(toolbox_http.events, "started", tool="slow")
    first_owner = store.get(run.run_id).owner
    second = start_worker()

    first.process.send_signal(signal.SIGTERM)
    assert first.process.wait(timeout=20) == 0
    record = wait_for_run(store, run.run_id, timeout=20)

    assert (record.status, record.termination_reason) == (RunStatus.COMPLETED, TerminationReason.COMPLETED)
    assert [(s.kind, s.tool_outcome) for s in record.steps] == [
        (StepKind.MODEL, None), (StepKind.TOOL, ToolOutcome.CANCELLED), (StepKind.HANDOFF, None),
        (StepKind.MODEL, None)]
    cut_off, handoff, final = record.steps[1:]
    assert cut_off.detail["reason"] == handoff.detail["reason"] == "worker_shutdown"
    assert final.content == "done after the hand-over"
    assert record.segments == 2
    assert record.owner != first_owner
    [handed] = first.logged("run_handed_over")
    assert handed["run_id"] == run.run_id
    assert second.logged("run_claimed", run_id=run.run_id)
    assert len(matching_events(toolbox_http.events, "started", tool="slow")) == 1  # the call was not made again


def test_a_short_call_finishes_on_its_own_worker_within_the_default_drain(
    toolbox_http: Toolbox, start_worker: Callable[..., WorkerProcess], producer: Producer, store: RunStore
) -> None:
    worker = start_worker(RUNBRAKE_DRAIN_S="30")
    run = producer.enqueue(spec({"toolbox": toolbox_http.spec}, [
        {"tool_calls": [call("slow", seconds=3)]}, {"content": "done"}]))
    wait_for_event(toolbox_http.events, "started", tool="slow")

    worker.process.send_signal(signal.SIGTERM)
    assert worker.process.wait(timeout=20) == 0

    record = store.get(run.run_id)  # already terminal: the worker exited only once its run was done
    assert (record.status, record.segments) == (RunStatus.COMPLETED, 1)
    assert [s.tool_outcome for s in record.steps if s.kind is StepKind.TOOL] == [ToolOutcome.OK]
    assert worker.logged("worker_drained", runs_finished=1)
    assert worker.logged("run_handed_over") == []


def test_a_cancel_of_a_handed_over_run_wins_and_no_worker_takes_it_up(
    toolbox_http: Toolbox, start_worker: Callable[..., WorkerProcess], producer: Producer, store: RunStore
) -> None:
    first = start_worker(RUNBRAKE_DRAIN_S="1")
    run = producer.enqueue(spec({"toolbox": toolbox_http.spec}, [
        {"tool_calls": [call("slow", seconds=60)]}, {"tool_calls": [call("get-sum", a=1, b=2)]}, {"content": "x"}]))
    wait_for_event(toolbox_http.events, "started", tool="slow")

    first.process.send_signal(signal.SIGTERM)
    assert first.process.wait(timeout=20) == 0
    assert store.get(run.run_id).status is RunStatus.QUEUED
    assert cancel_run(store, None, run.run_id, reason="stop it", requested_by="test").won
    second = start_worker()
    second.wait_for_log("run_message_skipped", run_id=run.run_id, found="cancelled")

    record = store.get(run.run_id)
    assert (record.status, record.termination_reason) == (RunStatus.CANCELLED, TerminationReason.CANCELLED)
    assert record.steps[-1].kind is StepKind.HANDOFF
    assert matching_events(toolbox_http.events, "started", tool="get-sum") == []


def test_a_cancel_during_the_drain_interrupts_the_call_at_once(
    toolbox_http: Toolbox, start_worker: Callable[..., WorkerProcess], producer: Producer, store: RunStore,
    rabbitmq: Settings,
) -> None:
    worker = start_worker(RUNBRAKE_DRAIN_S="30")
    run = producer.enqueue(spec({"toolbox": toolbox_http.spec}, [
        {"tool_calls": [call("slow", seconds=60)]}, {"content": "never"}]))
    wait_for_event(toolbox_http.events, "started", tool="slow")

    worker.process.send_signal(signal.SIGTERM)
    worker.wait_for_log("worker_draining")
    publisher = CancelPublisher(rabbitmq)
    try:
        assert cancel_run(store, publisher, run.run_id, reason="stop it", requested_by="test").won
    finally:
        publisher.close()
    assert worker.process.wait(timeout=15) == 0  # long before the 30 s drain: its one run ended

    record = store.get(run.run_id)
    assert record.status is RunStatus.CANCELLED
    tool = next(s for s in record.steps if s.kind is StepKind.TOOL)
    assert tool.tool_outcome is ToolOutcome.CANCELLED
    assert "reason" not in tool.detail
    assert worker.logged("run_handed_over") == []


def test_a_model_call_cut_off_by_the_hand_over_is_made_again_by_the_next_worker(
    toolbox_http: Toolbox, start_worker: Callable[..., WorkerProcess], producer: Producer, store: RunStore
) -> None:
    first = start_worker(RUNBRAKE_DRAIN_S="1")
    run = producer.enqueue(spec({"toolbox": toolbox_http.spec}, [{"content": "the answer", "delay_ms": 4000}]))
    wait_for_run(store, run.run_id, lambda r: r.status is RunStatus.RUNNING)
    first.process.send_signal(signal.SIGTERM)
    assert first.process.wait(timeout=20) == 0
    start_worker()

    record = wait_for_run(store, run.run_id, timeout=20)

    assert record.status is RunStatus.COMPLETED
    assert [(s.kind, s.round, s.interrupted) for s in record.steps] == [
        (StepKind.MODEL, 1, True), (StepKind.HANDOFF, 0, False), (StepKind.MODEL, 1, False)]
    assert record.steps[0].detail == {"reason": "worker_shutdown"}
    assert record.steps[-1].content == "the answer"


def test_a_rolling_restart_of_every_worker_fails_no_run_and_loses_none(
    toolbox_http: Toolbox, start_worker: Callable[..., WorkerProcess], producer: Producer, store: RunStore
) -> None:
    old = [start_worker(RUNBRAKE_DRAIN_S="1"), start_worker(RUNBRAKE_DRAIN_S="1")]
    runs = [producer.enqueue(spec({"toolbox": toolbox_http.spec}, [
        {"tool_calls": [call("slow", seconds=30)]}, {"tool_calls": [call("get-sum", a=1, b=2)]},
        {"content": "done"}])).run_id for _ in range(8)]
    wait_for_event(toolbox_http.events, "started", tool="slow", count=8, timeout=20)
    new = [start_worker(RUNBRAKE_DRAIN_S="1"), start_worker(RUNBRAKE_DRAIN_S="1")]

    for worker in old:  # one at a time: each hands its runs in a 30 s call over
        worker.process.send_signal(signal.SIGTERM)
        assert worker.process.wait(timeout=20) == 0
    records = [wait_for_run(store, run_id, timeout=30) for run_id in runs]

    assert [r.status for r in records] == [RunStatus.COMPLETED] * 8
    assert [len(w.logged("run_handed_over")) >= 4 for w in old] == [True, True]  # 4 threads each, all busy
    assert sum(len(w.logged("run_claimed")) for w in new) >= 8
    for record in records:  # each handed-over call recorded once, as cancelled; the run went on from there
        assert [s.kind for s in record.steps].count(StepKind.HANDOFF) == record.segments - 1
        assert [s.tool_outcome for s in record.steps if s.kind is StepKind.TOOL][-2:] == [
            ToolOutcome.CANCELLED, ToolOutcome.OK]
        assert record.steps[-1].content == "done"
    assert len(matching_events(toolbox_http.events, "started", tool="slow")) == 8  # no call made twice
