"""Approval: a tool named in ``approval_required`` waits for an operator (docs/store.md, "The run lifecycle").

A real worker runs the run until the gated call, the operator decides with the real
``runbrake approve`` / ``runbrake deny`` / ``runbrake cancel`` commands, and the toolbox
server's events file tells whether the gated tool ever ran.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from runbrake.shared import RunRecord, RunStatus, RunStore, StepKind, TerminationReason, ToolOutcome
from runbrake.shared.messaging.producer import Producer
from tests.mcp_helpers import (
    Toolbox,
    matching_events,
)
from tests.worker_helpers import (
    WorkerProcess,
    call,
    spec,
    wait_for_run,
)

pytestmark = pytest.mark.integration

_CONSOLE_SCRIPT = Path(sys.executable).parent / "runbrake"
_COMMAND = [str(_CONSOLE_SCRIPT)] if _CONSOLE_SCRIPT.exists() else [sys.executable, "-c",
                                                                       "from runbrake.broker.cli import main; main()"]
GATED = "get-sum"


def runbrake(*args: str) -> subprocess.CompletedProcess[str]:
    """Run ``runbrake ARGS`` as an operator would, in this test's environment."""
    return subprocess.run([*_COMMAND, *args], env=dict(os.environ), capture_output=True, text=True, timeout=30,
                          check=False)


def succeeded(result: subprocess.CompletedProcess[str]) -> bool:
    return result.returncode == 0 and "Traceback" not in result.stderr


def gated_run(producer: Producer, toolbox: Toolbox) -> str:
    """Enqueue a run whose first turn calls the gated tool and whose second answers."""
    return producer.enqueue(spec(
        {"toolbox": toolbox.spec},
        [{"tool_calls": [call(GATED, a=2, b=3)]}, {"content": "It is 5."}],
        approval_required=[f"toolbox.{GATED}"],
    )).run_id


def waiting(record: RunRecord) -> bool:
    return record.status is RunStatus.WAITING_FOR_APPROVAL


def gated_tool_starts(toolbox: Toolbox) -> int:
    return len(matching_events(toolbox.events, "started", tool=GATED))


def test_a_gated_tool_suspends_the_run_before_it_is_called(
    toolbox_http: Toolbox, worker: WorkerProcess, producer: Producer, store: RunStore
) -> None:
    run_id = gated_run(producer, toolbox_http)

    record = wait_for_run(store, run_id, waiting)

    worker.wait_for_log("run_waiting_for_approval", run_id=run_id)
    assert (record.status, record.termination_reason, record.finished_at) == (
        RunStatus.WAITING_FOR_APPROVAL, TerminationReason.NONE, None)
    assert [(s.sequence, s.kind) for s in record.steps] == [(1, StepKind.MODEL)]
    assert record.pending is not None
    assert [(c["server"], c["tool"]) for c in record.pending["pending_calls"]] == [("toolbox", GATED)]
    assert gated_tool_starts(toolbox_http) == 0


def test_approve_resumes_the_run_which_calls_the_tool_once_and_completes(
    toolbox_http: Toolbox, worker: WorkerProcess, producer: Producer, store: RunStore
) -> None:
    run_id = gated_run(producer, toolbox_http)
    wait_for_run(store, run_id, waiting)

    approved = runbrake("approve", run_id)

    assert succeeded(approved), approved.stderr
    assert f"approved {run_id}" in approved.stdout
    record = wait_for_run(store, run_id)
    assert (record.status, record.termination_reason) == (RunStatus.COMPLETED, TerminationReason.COMPLETED)
    assert [(s.sequence, s.kind) for s in record.steps] == [
        (1, StepKind.MODEL), (2, StepKind.APPROVAL), (3, StepKind.TOOL), (4, StepKind.MODEL)]
    approval, tool = record.steps[1], record.steps[2]
    assert approval.detail["decision"] == "approved"
    assert approval.detail["call"]["tool"] == GATED
    assert (tool.tool_name, tool.tool_outcome, tool.content) == (GATED, ToolOutcome.OK, "5")
    assert record.steps[-1].content == "It is 5."
    assert gated_tool_starts(toolbox_http) == 1


def test_deny_fails_the_run_with_approval_denied_and_the_tool_never_runs(
    toolbox_http: Toolbox, worker: WorkerProcess, producer: Producer, store: RunStore
) -> None:
    run_id = gated_run(producer, toolbox_http)
    wait_for_run(store, run_id, waiting)

    denied = runbrake("deny", run_id, "--reason", "not this one")

    assert succeeded(denied), denied.stderr
    record = store.get(run_id)
    assert (record.status, record.termination_reason) == (RunStatus.FAILED, TerminationReason.APPROVAL_DENIED)
    assert record.finished_at is not None
    assert [(s.sequence, s.kind) for s in record.steps] == [(1, StepKind.MODEL), (2, StepKind.APPROVAL)]
    assert (record.steps[1].detail["decision"], record.steps[1].content) == ("denied", "not this one")
    assert record.steps[1].detail["call"]["tool"] == GATED
    # Even a stale resume message cannot bring the denied call back.
    producer.send(run_id, resume=True)
    worker.wait_for_log("run_message_skipped", run_id=run_id)
    assert store.get(run_id) == record
    assert gated_tool_starts(toolbox_http) == 0


def test_a_cancel_while_waiting_wins_and_a_later_approve_is_refused(
    toolbox_http: Toolbox, worker: WorkerProcess, producer: Producer, store: RunStore
) -> None:
    run_id = gated_run(producer, toolbox_http)
    wait_for_run(store, run_id, waiting)

    cancelled = runbrake("cancel", run_id, "--reason", "changed my mind")
    approved = runbrake("approve", run_id)

    assert succeeded(cancelled), cancelled.stderr
    assert "was waiting_for_approval" in cancelled.stdout
    assert approved.returncode == 1
    assert "Traceback" not in approved.stderr
    assert f"run {run_id} is cancelled, not waiting for approval" in approved.stderr
    record = store.get(run_id)
    assert (record.status, record.termination_reason) == (RunStatus.CANCELLED, TerminationReason.CANCELLED)
    assert [s.kind for s in record.steps] == [StepKind.MODEL]
    producer.send(run_id, resume=True)
    worker.wait_for_log("run_message_skipped", run_id=run_id)
    assert gated_tool_starts(toolbox_http) == 0


def test_approving_twice_runs_the_tool_exactly_once(
    toolbox_http: Toolbox, start_worker: Callable[..., WorkerProcess], producer: Producer, store: RunStore
) -> None:
    first_worker = start_worker()
    run_id = gated_run(producer, toolbox_http)
    wait_for_run(store, run_id, waiting)
    # No worker while the operator decides: both approvals land on a run that is still waiting.
    first_worker.stop()

    # A repeated approve re-sends the resume message (for one that was lost); the resume claim
    # lets exactly one of the two messages resume the run.
    first, second = runbrake("approve", run_id), runbrake("approve", run_id)
    worker = start_worker()
    record = wait_for_run(store, run_id)
    worker.wait_for_log("run_message_skipped", run_id=run_id)
    late = runbrake("approve", run_id)

    assert succeeded(first), first.stderr
    assert succeeded(second), second.stderr
    assert len(worker.logged("run_claimed", run_id=run_id)) == 1
    assert record.status is RunStatus.COMPLETED
    assert [s.kind for s in record.steps].count(StepKind.APPROVAL) == 1
    assert [s.sequence for s in record.steps] == [1, 2, 3, 4]
    assert late.returncode == 1
    assert f"run {run_id} is completed, not waiting for approval" in late.stderr
    assert gated_tool_starts(toolbox_http) == 1
