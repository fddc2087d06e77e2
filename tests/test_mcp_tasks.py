"""Long tool calls as MCP tasks (docs/usage.md, "Long tool calls as MCP tasks"): a tool that requires a task is
called as one, its task id recorded before anything waits on it, polled until it ends, and its result reaches the
model; a cancel reaches the task as ``tasks/cancel``; ``tasks = "off"`` refuses the tool to the model.

Real worker processes, the npm ``server-everything`` (tool ``simulate-research-query``, ``taskSupport:
"required"``) behind a counting proxy (tests/mcp_task_helpers.py), PyPI ``llm-mock-api`` as the model, real Redis
and RabbitMQ.
"""

from __future__ import annotations

from typing import Any

import pytest

from runbrake.shared import RunRecord, RunSpec, RunStatus, RunStore, StepKind, TerminationReason, ToolOutcome
from runbrake.shared.messaging.cancel import CancelPublisher, cancel_run
from runbrake.shared.messaging.producer import Producer
from runbrake.shared.records import TASK_PREFIX
from runbrake.worker.mcp_tasks import TaskHandle
from tests.catalog_helpers import add_to_catalog
from tests.llm_mock import LlmMock, reply
from tests.mcp_task_helpers import RESEARCH, Everything, everything_fixture  # noqa: F401 - the fixture
from tests.polling import poll_until
from tests.worker_helpers import WorkerProcess, wait_for_run

pytestmark = pytest.mark.integration

WAIT_S = 60.0


def research_run(producer: Producer, mock: LlmMock, everything: Everything, call_id: str, **server: Any) -> str:
    """A run of the catalog model ``mock`` that asks for one research task (``call_id``) and answers once its
    result came; the catalog's ``everything`` entry with ``server`` (``tasks``…)."""
    add_to_catalog({"everything": {"transport": "http", "url": everything.url, **server}},
                   models={"mock": {"provider": "openai", "base_url": mock.openai_url, "model": "gpt-mock"}})
    mock.server.when(f"research {call_id}").reply(
        reply(tools=[(f"everything__{RESEARCH}", {"topic": f"tasks of {call_id}"}, call_id)])).times(1)
    mock.server.when_tool_result(call_id).reply(reply(f"answered after {call_id}"))
    spec = RunSpec.parse({"input": f"research {call_id}", "model": "mock", "mcp_servers": ["everything"]})
    return producer.enqueue(spec).run_id


def recorded_task(store: RunStore, run_id: str, call_id: str) -> TaskHandle:
    """The task the run recorded for ``call_id``, once it is there."""
    def found() -> TaskHandle | None:
        value = store.redis.hget(store.keys.run(run_id), f"{TASK_PREFIX}{call_id}")
        return None if value is None else TaskHandle.from_json(str(value))

    return poll_until(found, timeout=WAIT_S, failure=lambda: f"no task recorded for {call_id} of run {run_id}")


def tool_step(record: RunRecord) -> Any:
    [step] = [s for s in record.steps if s.kind is StepKind.TOOL]
    return step


def cancelled_by_its_server(store: RunStore, publisher: CancelPublisher, run_id: str, handle: TaskHandle) -> RunRecord:
    """Cancel the run whose task is ``handle``; its record once the call's step is in, checked to say the run was
    cancelled and the call's task too, by its server (side effects unknown)."""
    assert cancel_run(store, publisher, run_id, reason="stop", requested_by="test").won
    record = wait_for_run(store, run_id, lambda r: any(s.kind is StepKind.TOOL for s in r.steps), timeout=WAIT_S)

    assert (record.status, record.termination_reason) == (RunStatus.CANCELLED, TerminationReason.CANCELLED)
    step = tool_step(record)
    assert step.tool_outcome is ToolOutcome.CANCELLED
    assert (step.detail["task_id"], step.detail["task_status"]) == (handle.task_id, "cancelled")
    assert step.detail["side_effects"] == "unknown"
    return record


def tool_messages(mock: LlmMock, call_id: str) -> list[str]:
    """What the model was shown as the result of ``call_id``."""
    return [m.get("content") or "" for body in mock.bodies() for m in body["messages"]
            if m.get("role") == "tool" and m.get("tool_call_id") == call_id]


def test_a_tool_that_requires_a_task_is_called_as_one_recorded_first_and_its_result_reaches_the_model(
    llm_mock: LlmMock, everything: Everything, worker: WorkerProcess, store: RunStore, producer: Producer,
) -> None:
    run_id = research_run(producer, llm_mock, everything, "call_task_done")
    handle = recorded_task(store, run_id, "call_task_done")
    record = wait_for_run(store, run_id, timeout=WAIT_S)

    assert (record.status, record.steps[-1].content) == (RunStatus.COMPLETED, "answered after call_task_done")
    step = tool_step(record)
    assert step.tool_outcome is ToolOutcome.OK
    assert (step.detail["task_id"], step.detail["task_status"]) == (handle.task_id, "completed")
    assert "Research Report: tasks of call_task_done" in step.content
    assert any("Research Report" in text for text in tool_messages(llm_mock, "call_task_done"))
    assert everything.proxy.methods["tools/call"] == 1
    assert everything.proxy.methods["tasks/result"] == 1
    assert everything.proxy.methods["tasks/get"] >= 1
    # Once its result is in, the run's record keeps no task in flight.
    assert store.redis.hget(store.keys.run(run_id), f"{TASK_PREFIX}call_task_done") is None


def test_a_cancel_sends_tasks_cancel_and_records_the_task_the_server_cancelled(
    llm_mock: LlmMock, everything: Everything, worker: WorkerProcess, store: RunStore, producer: Producer,
    publisher: CancelPublisher,
) -> None:
    run_id = research_run(producer, llm_mock, everything, "call_task_cancel")
    handle = recorded_task(store, run_id, "call_task_cancel")

    cancelled_by_its_server(store, publisher, run_id, handle)

    assert everything.proxy.methods["tasks/cancel"] == 1
    assert everything.proxy.methods["tasks/result"] == 0


def test_tasks_off_refuses_a_tool_that_requires_a_task_to_the_model_and_calls_nothing(
    llm_mock: LlmMock, everything: Everything, worker: WorkerProcess, store: RunStore, producer: Producer,
) -> None:
    run_id = research_run(producer, llm_mock, everything, "call_task_off", tasks="off")
    record = wait_for_run(store, run_id, timeout=WAIT_S)

    assert record.status is RunStatus.COMPLETED
    step = tool_step(record)
    assert (step.tool_outcome, step.detail["reason"]) == (ToolOutcome.FAILED, "invalid_call")
    assert 'tasks = "off"' in step.content
    assert "task_id" not in step.detail
    assert everything.proxy.methods["tools/call"] == 0

