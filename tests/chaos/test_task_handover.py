"""An MCP task outlives its worker (docs/usage.md, "Long tool calls as MCP tasks"): a hand-over leaves the task
running and the next worker polls the same task id; so does the worker that takes a run up after kill -9 of its
worker; the server sees one ``tools/call``. A task the server forgot (it restarted) is recorded lost. The hand-over
the same over the 2026-07-28 tasks extension (PyPI ``fastmcp-tasks``: no MCP session to keep).

Real worker processes, the npm ``server-everything`` behind a counting proxy (tests/mcp_task_helpers.py), PyPI
``llm-mock-api`` as the model, real Redis and RabbitMQ. Lost-worker detection is shortened as in
tests/chaos/test_worker_lost.py.
"""

from __future__ import annotations

import signal
from collections.abc import Callable

import pytest

from runbrake.shared import RunRecord, RunStatus, RunStore, StepKind, TerminationReason, ToolOutcome
from runbrake.shared.messaging.cancel import CancelPublisher, cancel_run
from runbrake.shared.messaging.producer import Producer
from runbrake.worker.mcp_tasks import TaskHandle
from tests.llm_mock import LlmMock
from tests.mcp_task_helpers import (  # noqa: F401 - the fixtures
    Everything,
    ExtensionServer,
    everything_fixture,
    tasks_extension_fixture,
)
from tests.polling import poll_until
from tests.test_mcp_tasks import recorded_task, research_run, tool_messages, tool_step
from tests.test_mcp_tasks_extension import extension_run
from tests.worker_helpers import WorkerProcess, wait_for_run

pytestmark = pytest.mark.integration

FAST = {"RUNBRAKE_WORKER_BEAT_S": "0.5", "RUNBRAKE_WORKER_LOST_S": "5"}
WAIT_S = 60.0


def _kinds(record: RunRecord) -> list[tuple[StepKind, ToolOutcome | None]]:
    return [(s.kind, s.tool_outcome) for s in record.steps]


def _handed_over(server: Everything, start_worker: Callable[..., WorkerProcess], store: RunStore,
                 start_run: Callable[[], str], call_id: str) -> tuple[TaskHandle, WorkerProcess]:
    """A run (``start_run``) whose worker is stopped (SIGTERM, a 1 s drain) once its task ``call_id`` was recorded,
    the server paused meanwhile (the task stands still until the next worker polls it), and the worker started
    next, checked to have polled the task to its end with no second ``tools/call``; its task and that worker."""
    first = start_worker(RUNBRAKE_DRAIN_S="1")
    run_id = start_run()
    handle = recorded_task(store, run_id, call_id)
    server.pause()

    first.process.send_signal(signal.SIGTERM)
    assert first.process.wait(timeout=20) == 0
    second = start_worker()
    server.resume()
    record = wait_for_run(store, run_id, timeout=WAIT_S)

    assert (record.status, record.termination_reason) == (RunStatus.COMPLETED, TerminationReason.COMPLETED)
    assert _kinds(record) == [(StepKind.MODEL, None), (StepKind.HANDOFF, None), (StepKind.TOOL, ToolOutcome.OK),
                              (StepKind.MODEL, None)]
    step = tool_step(record)
    assert (step.detail["task_id"], step.detail["task_status"]) == (handle.task_id, "completed")
    assert first.logged("mcp_task_handed_over", task_id=handle.task_id)
    assert second.logged("mcp_task_reattached", task_id=handle.task_id)
    assert server.proxy.methods["tools/call"] == 1
    return handle, second


def test_a_hand_over_mid_task_leaves_it_running_and_the_next_worker_polls_it_with_no_second_tools_call(
    llm_mock: LlmMock, everything: Everything, start_worker: Callable[..., WorkerProcess], store: RunStore,
    producer: Producer,
) -> None:
    handle, second = _handed_over(
        everything, start_worker, store, lambda: research_run(producer, llm_mock, everything, "call_task_handed"),
        "call_task_handed")

    assert any("Research Report" in text for text in tool_messages(llm_mock, "call_task_handed"))
    # The first worker kept its session for the task; the second ended it once the task was done: no leak.
    poll_until(lambda: everything.proxy.ended[handle.session_id] == 1, timeout=WAIT_S,
               failure=lambda: f"the kept MCP session {handle.session_id} was not ended: {everything.proxy.ended}")
    second.wait_for_log("mcp_session_ended", timeout=WAIT_S, session_id=handle.session_id)


def _killed_mid_task(llm_mock: LlmMock, everything: Everything, start_worker: Callable[..., WorkerProcess],
                     store: RunStore, producer: Producer, call_id: str, **server: str) -> tuple[str, TaskHandle]:
    """A run whose worker was killed (-9) once its task ``call_id`` was recorded, the server paused meanwhile (the
    task stands still until it is resumed); the run's id and its task."""
    doomed = start_worker(**FAST)
    run_id = research_run(producer, llm_mock, everything, call_id, **server)
    handle = recorded_task(store, run_id, call_id)
    everything.pause()
    doomed.process.send_signal(signal.SIGKILL)
    doomed.process.wait(timeout=10)
    return run_id, handle


def test_kill_9_mid_task_the_worker_that_takes_the_run_up_polls_the_same_task_with_no_second_tools_call(
    llm_mock: LlmMock, everything: Everything, start_worker: Callable[..., WorkerProcess], store: RunStore,
    producer: Producer,
) -> None:
    run_id, handle = _killed_mid_task(llm_mock, everything, start_worker, store, producer, "call_task_killed")

    survivor = start_worker(**FAST)
    everything.resume()
    record = wait_for_run(store, run_id, timeout=WAIT_S)

    assert (record.status, record.termination_reason) == (RunStatus.COMPLETED, TerminationReason.COMPLETED)
    assert _kinds(record) == [(StepKind.MODEL, None), (StepKind.HANDOFF, None), (StepKind.TOOL, ToolOutcome.OK),
                              (StepKind.MODEL, None)]
    assert record.steps[1].detail["reason"] == "worker_lost"
    step = tool_step(record)
    assert (step.detail["task_id"], step.detail["task_status"]) == (handle.task_id, "completed")
    assert survivor.logged("mcp_task_reattached", task_id=handle.task_id)
    assert everything.proxy.methods["tools/call"] == 1


@pytest.mark.parametrize("policy", ["report", "fail"])
def test_a_task_the_server_forgot_is_recorded_lost_with_unknown_side_effects_and_the_model_is_told(
    llm_mock: LlmMock, everything: Everything, start_worker: Callable[..., WorkerProcess], store: RunStore,
    producer: Producer, policy: str,
) -> None:
    """As docs/usage.md says ("Long tool calls as MCP tasks"): the lost call follows the tool's ``on_worker_lost``:
    ``report`` hands the lost result to the model, ``fail`` records it and ends the run ``failed`` with
    ``lease_lost``, its error naming the call (``retry`` makes the call again)."""
    run_id, handle = _killed_mid_task(llm_mock, everything, start_worker, store, producer, f"call_forgot_{policy}",
                                      on_worker_lost=policy)
    everything.restart()  # every session and task forgotten
    start_worker(**FAST)

    record = wait_for_run(store, run_id, timeout=WAIT_S)

    step = tool_step(record)
    assert step.tool_outcome is ToolOutcome.CANCELLED
    assert (step.detail["task_id"], step.detail["task_status"], step.detail["side_effects"]) == (
        handle.task_id, "lost", "unknown")
    told = [text for text in tool_messages(llm_mock, f"call_forgot_{policy}") if "no longer known" in text]
    if policy == "report":
        assert record.status is RunStatus.COMPLETED
        assert told
    else:
        assert (record.status, record.termination_reason) == (RunStatus.FAILED, TerminationReason.LEASE_LOST)
        assert handle.task_id in (record.error or "")
        assert 'on_worker_lost = "fail"' in (record.error or "")
        assert not told  # no model call after the lost call
    assert everything.proxy.methods["tools/call"] == 1


@pytest.mark.timeout(300)  # may install fastmcp-tasks first (tests/test_mcp_tasks_extension.py)
def test_a_hand_over_mid_task_of_the_2026_extension_resumes_on_another_worker_with_no_second_tools_call(
    llm_mock: LlmMock, tasks_extension: ExtensionServer, start_worker: Callable[..., WorkerProcess], store: RunStore,
    producer: Producer,
) -> None:
    def start_run() -> str:
        return extension_run(producer, llm_mock, tasks_extension, "call_ext_handed", "research",
                             {"topic": "handed over", "seconds": 3})

    _handed_over(tasks_extension, start_worker, store, start_run, "call_ext_handed")

    assert tool_messages(llm_mock, "call_ext_handed") == ["Research Report: handed over"]


@pytest.mark.timeout(300)  # may install fastmcp-tasks first (tests/test_mcp_tasks_extension.py)
def test_a_cancel_after_a_hand_over_set_a_task_aside_still_cancels_the_task_on_its_server(
    llm_mock: LlmMock, tasks_extension: ExtensionServer, start_worker: Callable[..., WorkerProcess], store: RunStore,
    producer: Producer, publisher: CancelPublisher,
) -> None:
    """The run waits in the queue with its task running when the cancel comes: no call will poll the task again, so
    the worker that takes the run's message (and finds it cancelled) sends ``tasks/cancel``."""
    first = start_worker(RUNBRAKE_DRAIN_S="1")
    run_id = extension_run(producer, llm_mock, tasks_extension, "call_ext_aside", "research",
                           {"topic": "set aside", "seconds": 300})
    handle = recorded_task(store, run_id, "call_ext_aside")
    first.process.send_signal(signal.SIGTERM)
    assert first.process.wait(timeout=20) == 0
    assert first.logged("mcp_task_handed_over", task_id=handle.task_id)

    assert cancel_run(store, publisher, run_id, reason="stop", requested_by="test").won
    second = start_worker()

    second.wait_for_log("mcp_task_cancelled_left", timeout=WAIT_S, task_id=handle.task_id, task_status="cancelled")
    assert store.get(run_id).status is RunStatus.CANCELLED
    assert (tasks_extension.proxy.methods["tools/call"], tasks_extension.proxy.methods["tasks/cancel"]) == (1, 1)
