"""A run on the ``openai`` provider end to end: a real worker process asks a local OpenAI-compatible
server (the stub, on 127.0.0.1 in this test process) and calls tools on a real MCP server."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from runbrake.shared import RunSpec, RunStatus, RunStore, StepKind, TerminationReason, ToolOutcome, step_outcome
from runbrake.shared.messaging.producer import Producer
from tests.catalog_helpers import add_to_catalog
from tests.mcp_helpers import (
    Toolbox,
    matching_events,
)
from tests.openai_stub import (
    OpenAIStub,
    StubToolCall,
)
from tests.worker_helpers import (
    WorkerProcess,
    wait_for_run,
)

pytestmark = pytest.mark.integration

TOOLBOX_TOOLS = {"toolbox__get-sum", "toolbox__fail", "toolbox__slow", "toolbox__echo"}


def openai_spec(stub: OpenAIStub, toolbox: Toolbox) -> RunSpec:
    """A run of the catalog model ``stub`` (the local OpenAI-compatible server) and server ``toolbox``."""
    add_to_catalog({"toolbox": toolbox.spec}, models={"stub": {"provider": "openai", "base_url": stub.base_url,
                                                                "model": "stub"}})
    return RunSpec.parse({"input": "What is 2 + 3?", "model": "stub", "mcp_servers": ["toolbox"]})


def tool_names(request: dict[str, Any]) -> set[str]:
    return {tool["function"]["name"] for tool in request.get("tools", [])}


def test_an_openai_run_calls_the_tool_the_model_asks_for_and_completes_with_its_answer(
    openai_stub: OpenAIStub, toolbox_http: Toolbox, worker: WorkerProcess, producer: Producer, store: RunStore
) -> None:
    openai_stub.reply(tool_calls=[StubToolCall("toolbox__get-sum", {"a": 2, "b": 3})])
    openai_stub.reply(content="5")

    run = producer.enqueue(openai_spec(openai_stub, toolbox_http))
    record = wait_for_run(store, run.run_id)

    assert (record.status, record.termination_reason) == (RunStatus.COMPLETED, TerminationReason.COMPLETED)
    assert [(s.sequence, s.kind) for s in record.steps] == [(1, StepKind.MODEL), (2, StepKind.TOOL),
                                                           (3, StepKind.MODEL)]
    tool = record.steps[1]
    assert (tool.tool_server, tool.tool_name, tool.tool_outcome, tool.content) == (
        "toolbox", "get-sum", ToolOutcome.OK, "5")
    assert record.steps[-1].content == "5"
    assert len(matching_events(toolbox_http.events, "finished", tool="get-sum")) == 1

    first, second = openai_stub.requests
    assert first["model"] == "stub"
    assert [(m["role"], m["content"]) for m in first["messages"]] == [("user", "What is 2 + 3?")]
    assert tool_names(first) == TOOLBOX_TOOLS
    # The second request carries the assistant's call and the tool's answer to that very call.
    assistant, answer = second["messages"][1:]
    call_id = assistant["tool_calls"][0]["id"]
    assert call_id == tool.tool_call_id
    assert assistant["tool_calls"][0]["function"]["name"] == "toolbox__get-sum"
    assert (answer["role"], answer["tool_call_id"], answer["content"]) == ("tool", call_id, "5")


def test_an_openai_endpoint_answering_500_fails_the_run_with_provider_failed(
    openai_stub: OpenAIStub, toolbox_http: Toolbox, start_worker: Callable[..., WorkerProcess], producer: Producer,
    store: RunStore,
) -> None:
    openai_stub.reply(status=500, error_message="the model is on fire")
    start_worker(RUNBRAKE_MODEL_RETRIES="0")  # a 500 is retried by default (tests/test_model_retries_run.py)

    run = producer.enqueue(openai_spec(openai_stub, toolbox_http))
    record = wait_for_run(store, run.run_id)

    assert (record.status, record.termination_reason) == (RunStatus.FAILED, TerminationReason.PROVIDER_FAILED)
    assert [(s.kind, step_outcome(s)) for s in record.steps] == [(StepKind.MODEL, "failed")]
    error = record.steps[0].error
    assert error is not None
    assert "500" in error
    assert "the model is on fire" in error
    assert len(openai_stub.requests) == 1
    assert matching_events(toolbox_http.events, "started") == []
