"""kill -9 of the worker right after a steer, and a hand-over with a steer pending: the steer is kept in Redis,
and the next worker applies it exactly once (docs/cancellation.md, "Steer: durable, exactly once").

The steered run waits for approval, so the steer sends its resume message; the worker that would take it has its
one slot held by another run's long call and cannot claim it before it is killed. A second worker claims the
resume, answers the waiting call as cancelled (steered), records one ``steer`` step and completes the run.
"""

from __future__ import annotations

import signal
from collections.abc import Callable

import pytest

from runbrake.shared import RunStatus, RunStore, ToolOutcome
from runbrake.shared.messaging.cancel import CancelPublisher
from runbrake.shared.messaging.producer import Producer
from runbrake.shared.operations import steer
from tests.mcp_helpers import Toolbox, matching_events, wait_for_event
from tests.test_steer import assert_steered_once_and_completed, store_steer
from tests.worker_helpers import WorkerProcess, call, spec, wait_for_run

pytestmark = pytest.mark.integration

WAIT_S = 30.0



def test_kill_9_of_the_worker_right_after_a_steer_leaves_it_to_the_next_worker_which_applies_it_once(
    toolbox_http: Toolbox, start_worker: Callable[..., WorkerProcess], producer: Producer, store: RunStore,
    publisher: CancelPublisher,
) -> None:
    doomed = start_worker(concurrency=1)
    steered = producer.enqueue(spec({"toolbox": toolbox_http.spec}, [
        {"tool_calls": [call("echo", text="needs a yes")]},
        {"content": "went on with the steer"},
    ], approval_required=["toolbox.echo"]))
    wait_for_run(store, steered.run_id, lambda r: r.status is RunStatus.WAITING_FOR_APPROVAL, timeout=WAIT_S)
    # The doomed worker's one slot is taken by a long call: the steered run's resume waits for it.
    producer.enqueue(spec({"toolbox": toolbox_http.spec}, [
        {"tool_calls": [call("slow", seconds=600)]}, {"content": "never"}]))
    wait_for_event(toolbox_http.events, "started", tool="slow", timeout=WAIT_S)

    result = steer(store, publisher, producer, steered.run_id, text="skip it, answer now", reason="chaos",
                   requested_by="test", max_input_chars=100_000)
    doomed.process.send_signal(signal.SIGKILL)
    doomed.process.wait(timeout=10)

    assert result.message_confirmed
    assert not doomed.logged("run_claimed", run_id=steered.run_id, segment="resume")
    survivor = start_worker(concurrency=2)
    record = wait_for_run(store, steered.run_id, timeout=WAIT_S)
    assert_steered_once_and_completed(record, "went on with the steer", ["model", "tool", "steer", "model"])
    assert record.steps[1].tool_outcome is ToolOutcome.CANCELLED
    assert record.steps[2].detail["input"] == "skip it, answer now"
    assert len(survivor.logged("run_steer_applied", run_id=steered.run_id)) == 1
    assert store.pending_steer(steered.run_id) is None
    assert matching_events(toolbox_http.events, "started", tool="echo") == []


def test_a_steer_pending_at_a_hand_over_is_applied_once_by_the_worker_that_continues_the_run(
    toolbox_http: Toolbox, start_worker: Callable[..., WorkerProcess], producer: Producer, store: RunStore,
) -> None:
    # No backstop and no wake-up: the first worker never learns of the steer before it hands the run over.
    first = start_worker(RUNBRAKE_DRAIN_S="1", RUNBRAKE_CANCEL_POLL_MS="600000")
    run = producer.enqueue(spec({"toolbox": toolbox_http.spec}, [
        {"tool_calls": [call("slow", seconds=60)]}, {"content": "continued with the steer"}]))
    wait_for_event(toolbox_http.events, "started", tool="slow", timeout=WAIT_S)
    store_steer(store, run.run_id, "after the hand-over")

    first.process.send_signal(signal.SIGTERM)
    first.wait_for_log("run_handed_over", run_id=run.run_id, timeout=WAIT_S)
    second = start_worker()

    record = wait_for_run(store, run.run_id, timeout=WAIT_S)
    assert (record.status, record.steps[-1].content) == (RunStatus.COMPLETED, "continued with the steer")
    assert [s.kind.value for s in record.steps] == ["model", "tool", "handoff", "steer", "model"]
    assert record.steps[1].detail["reason"] == "worker_shutdown"  # cut off by the hand-over, not the steer
    assert record.steps[3].detail["input"] == "after the hand-over"
    assert len(second.logged("run_steer_applied", run_id=run.run_id)) == 1
    assert store.pending_steer(run.run_id) is None
