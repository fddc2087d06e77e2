"""Long tool calls as MCP tasks over the 2026-07-28 tasks extension (SEP-2663; docs/usage.md, "Long tool calls as
MCP tasks"): the server answers a ``tools/call`` with ``resultType: "task"``, the worker records the task id before
anything waits on it, polls ``tasks/get`` (sending ``Mcp-Name``) and hands the result inlined there to the model; a
cancel reaches the task as ``tasks/cancel``; a task that asks for input is cancelled and the call fails, saying so;
a call the server answers at once is an ordinary call.

Real worker processes, a server of the extension nobody here wrote (PyPI ``fastmcp-tasks``: tests/
tasks_extension_server.py) behind a counting proxy (tests/mcp_task_helpers.py), PyPI ``llm-mock-api`` as the model,
real Redis and RabbitMQ.
"""

from __future__ import annotations

from typing import Any

import pytest

from runbrake.broker.render import render_run
from runbrake.shared import RunSpec, RunStatus, RunStore, ToolOutcome
from runbrake.shared.messaging.cancel import CancelPublisher
from runbrake.shared.messaging.producer import Producer
from runbrake.shared.records import TASK_PREFIX
from tests.catalog_helpers import add_to_catalog
from tests.llm_mock import LlmMock, reply
from tests.mcp_task_helpers import ExtensionServer, tasks_extension_fixture  # noqa: F401 - the fixture
from tests.test_mcp_tasks import cancelled_by_its_server, recorded_task, tool_messages, tool_step
from tests.worker_helpers import WorkerProcess, wait_for_run

# The first test to start the server installs PyPI fastmcp-tasks in its own venv (~40 s, once: bench/_harness.py
# python_package), within its timeout.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

WAIT_S = 60.0


def extension_run(producer: Producer, mock: LlmMock, server: ExtensionServer, call_id: str, tool: str,
                  arguments: dict[str, Any], **entry: Any) -> str:
    """A run of the catalog model ``mock`` that calls ``tool`` of the catalog server ``tasks`` once (``call_id``) and
    answers once its result came; the server's catalog entry with ``entry`` (``tasks``…)."""
    add_to_catalog({"tasks": {"transport": "http", "url": server.url, **entry}},
                   models={"mock": {"provider": "openai", "base_url": mock.openai_url, "model": "gpt-mock"}})
    mock.server.when(f"call {call_id}").reply(reply(tools=[(f"tasks__{tool}", arguments, call_id)])).times(1)
    mock.server.when_tool_result(call_id).reply(reply(f"answered after {call_id}"))
    spec = RunSpec.parse({"input": f"call {call_id}", "model": "mock", "mcp_servers": ["tasks"]})
    return producer.enqueue(spec).run_id


def test_a_call_the_server_makes_a_task_is_recorded_first_polled_with_mcp_name_and_its_result_reaches_the_model(
    llm_mock: LlmMock, tasks_extension: ExtensionServer, worker: WorkerProcess, store: RunStore, producer: Producer,
) -> None:
    run_id = extension_run(producer, llm_mock, tasks_extension, "call_ext_done", "research",
                           {"topic": "extension tasks", "seconds": 2})
    handle = recorded_task(store, run_id, "call_ext_done")
    record = wait_for_run(store, run_id, timeout=WAIT_S)

    assert (record.status, record.steps[-1].content) == (RunStatus.COMPLETED, "answered after call_ext_done")
    assert (handle.protocol, handle.session_id) == ("2026-07-28", "")
    step = tool_step(record)
    assert step.tool_outcome is ToolOutcome.OK
    assert (step.detail["task_id"], step.detail["task_status"]) == (handle.task_id, "completed")
    assert step.content == "Research Report: extension tasks"
    assert tool_messages(llm_mock, "call_ext_done") == ["Research Report: extension tasks"]
    methods = tasks_extension.proxy.methods
    assert (methods["tools/call"], methods["tasks/cancel"], methods["tasks/result"]) == (1, 0, 0)
    assert methods["tasks/get"] >= 1
    # Every tasks/get named the task in its Mcp-Name header (SEP-2663, "Streamable HTTP: Routing Headers").
    assert tasks_extension.proxy.names[handle.task_id] == methods["tasks/get"]
    assert store.redis.hget(store.keys.run(run_id), f"{TASK_PREFIX}call_ext_done") is None


def test_a_cancel_sends_the_extensions_tasks_cancel_and_records_the_task_the_server_cancelled(
    llm_mock: LlmMock, tasks_extension: ExtensionServer, worker: WorkerProcess, store: RunStore, producer: Producer,
    publisher: CancelPublisher,
) -> None:
    run_id = extension_run(producer, llm_mock, tasks_extension, "call_ext_cancel", "research",
                           {"topic": "never finished", "seconds": 300})
    handle = recorded_task(store, run_id, "call_ext_cancel")

    record = cancelled_by_its_server(store, publisher, run_id, handle)

    assert tasks_extension.proxy.methods["tasks/cancel"] == 1
    assert tasks_extension.proxy.names[handle.task_id] >= 2  # its tasks/cancel and the tasks/get that confirmed it
    # `runbrake show` says what became of the task, in either language (docs/labels.md).
    assert "(MCP task cancelled)" in render_run(record)
    assert "(MCP-Aufgabe abgebrochen)" in render_run(record, "de")


def test_a_task_that_asks_for_input_is_cancelled_on_its_server_and_the_call_fails_saying_so(
    llm_mock: LlmMock, tasks_extension: ExtensionServer, worker: WorkerProcess, store: RunStore, producer: Producer,
) -> None:
    run_id = extension_run(producer, llm_mock, tasks_extension, "call_ext_input", "confirm", {"question": "go on?"})
    record = wait_for_run(store, run_id, timeout=WAIT_S)

    assert record.status is RunStatus.COMPLETED
    step = tool_step(record)
    assert step.tool_outcome is ToolOutcome.FAILED
    assert "asked for input (input_required)" in step.content
    assert step.detail["task_status"] == "cancelled"
    assert tasks_extension.proxy.methods["tasks/cancel"] == 1
    assert tasks_extension.proxy.methods["tasks/update"] == 0  # runbrake answers no input request


def test_a_call_the_server_answers_at_once_is_an_ordinary_call_with_no_task(
    llm_mock: LlmMock, tasks_extension: ExtensionServer, worker: WorkerProcess, store: RunStore, producer: Producer,
) -> None:
    run_id = extension_run(producer, llm_mock, tasks_extension, "call_ext_at_once", "echo", {"text": "at once"})
    record = wait_for_run(store, run_id, timeout=WAIT_S)

    step = tool_step(record)
    assert (step.tool_outcome, step.content) == (ToolOutcome.OK, "at once")
    assert "task_id" not in step.detail
    assert tasks_extension.proxy.methods["tasks/get"] == 0


def test_tasks_off_does_not_declare_the_extension_so_a_tool_that_needs_a_task_fails_with_the_servers_error(
    llm_mock: LlmMock, tasks_extension: ExtensionServer, worker: WorkerProcess, store: RunStore, producer: Producer,
) -> None:
    run_id = extension_run(producer, llm_mock, tasks_extension, "call_ext_off", "research", {"topic": "off"},
                           tasks="off")
    record = wait_for_run(store, run_id, timeout=WAIT_S)

    step = tool_step(record)
    assert step.tool_outcome is ToolOutcome.FAILED
    assert "-32021" in step.content or "requires the tasks extension" in step.content
    assert "task_id" not in step.detail
    assert tasks_extension.proxy.methods["tools/call"] == 1
