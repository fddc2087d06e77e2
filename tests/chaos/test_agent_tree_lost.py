"""A caller outlives its worker (docs/usage.md, "Agent trees"; docs/leases.md, "Lost workers" and "Drain and
hand-over"): kill -9 of the worker holding a caller and its two children in long tool calls, or its hand-over,
another worker up; the children go on there from their last step, the caller's agent calls are made again and
find the children they started, and the caller collects their answers: no child is started twice.

Real worker processes, the toolbox MCP server over HTTP, ``llm-mock-api`` as the agents' model, real Redis and
RabbitMQ; detection shortened as in tests/chaos/test_worker_lost.py.
"""

from __future__ import annotations

import signal
from collections.abc import Callable

import pytest

from runbrake.shared import RunRecord, RunSpec, RunStatus, RunStore, StepKind, ToolOutcome
from runbrake.shared.messaging.producer import Producer
from tests.catalog_helpers import add_to_catalog
from tests.llm_mock import LlmMock, reply
from tests.mcp_helpers import Toolbox, matching_events, wait_for_event
from tests.worker_helpers import WorkerProcess, call, wait_for_run

pytestmark = pytest.mark.integration

FAST = {"RUNBRAKE_WORKER_BEAT_S": "0.5", "RUNBRAKE_WORKER_LOST_S": "5"}
WAIT_S = 60.0


def _tree(llm_mock: LlmMock, toolbox: Toolbox, producer: Producer) -> str:
    """A caller asking the agent ``researcher`` twice; each child's model asks for a 60 s call, and answers once
    it has the call's result (the call's own, or the word that it was cut off)."""
    add_to_catalog({"toolbox": toolbox.spec},
                   models={"mock": {"provider": "openai", "base_url": llm_mock.openai_url, "model": "gpt-mock"}},
                   agents={"researcher": {"description": "Finds things out", "model": "mock",
                                          "mcp_servers": ["toolbox"]}})
    for name in ("north", "south"):
        llm_mock.server.when(f"look {name}").reply(
            reply(tools=[("toolbox__slow", {"seconds": 60, "note": name}, f"call_{name}")])).times(1)
        llm_mock.server.when_tool_result(f"call_{name}").reply(reply(f"{name}: nothing found"))
    return producer.enqueue(RunSpec.parse({
        "input": "look around", "agents": ["researcher"], "model": {"provider": "scripted", "turns": [
            {"tool_calls": [call("researcher", server="agent", input="look north"),
                            call("researcher", server="agent", input="look south")]},
            {"content": "done"}]}})).run_id


def _collected(store: RunStore, run_id: str, survivor: WorkerProcess, toolbox: Toolbox) -> RunRecord:
    """The caller completed with both children's answers, each child started once and taken up again."""
    root = wait_for_run(store, run_id, timeout=WAIT_S)
    assert (root.status, root.output) == (RunStatus.COMPLETED, "done")
    children = sorted(root.children.values())
    assert len(children) == 2
    answered = [s for s in root.steps if s.kind is StepKind.TOOL and s.tool_outcome is ToolOutcome.OK]
    assert sorted(s.detail["child_run_id"] for s in answered) == children
    assert sorted(s.content for s in answered) == ["north: nothing found", "south: nothing found"]
    for child in children:
        record = store.get(child)
        assert (record.status, record.caller_run_id, record.segments) == (RunStatus.COMPLETED, run_id, 2)
    assert len(survivor.logged("agent_call_reattached")) == 2
    assert survivor.logged("agent_call_started") == []
    assert len(store.recent(limit=10)) == 3  # the caller and its two children: none started twice
    assert len(matching_events(toolbox.events, "started", tool="slow")) == 2
    return root


def test_kill_9_of_the_worker_holding_a_caller_and_its_children_resumes_the_tree_and_starts_no_child_twice(
    llm_mock: LlmMock, toolbox_http: Toolbox, start_worker: Callable[..., WorkerProcess], store: RunStore,
    producer: Producer,
) -> None:
    doomed = start_worker(**FAST)
    run_id = _tree(llm_mock, toolbox_http, producer)
    wait_for_event(toolbox_http.events, "started", tool="slow", count=2, timeout=WAIT_S)
    survivor = start_worker(**FAST)

    doomed.process.send_signal(signal.SIGKILL)
    doomed.process.wait(timeout=10)

    root = _collected(store, run_id, survivor, toolbox_http)
    assert [s.detail["reason"] for s in root.steps if s.kind is StepKind.TOOL and s.tool_outcome is
            ToolOutcome.CANCELLED] == ["worker_lost", "worker_lost"]


def test_a_hand_over_of_a_waiting_caller_re_attaches_to_its_children_on_the_next_worker(
    llm_mock: LlmMock, toolbox_http: Toolbox, start_worker: Callable[..., WorkerProcess], store: RunStore,
    producer: Producer,
) -> None:
    first = start_worker(RUNBRAKE_DRAIN_S="1")
    run_id = _tree(llm_mock, toolbox_http, producer)
    wait_for_event(toolbox_http.events, "started", tool="slow", count=2, timeout=WAIT_S)
    second = start_worker()

    first.process.send_signal(signal.SIGTERM)
    assert first.process.wait(timeout=30) == 0

    root = _collected(store, run_id, second, toolbox_http)
    # The cut-off agent calls were not recorded: the next worker made them again, unanswered until then.
    assert [(s.kind, s.tool_outcome) for s in root.steps] == [
        (StepKind.MODEL, None), (StepKind.HANDOFF, None), (StepKind.TOOL, ToolOutcome.OK),
        (StepKind.TOOL, ToolOutcome.OK), (StepKind.MODEL, None)]

