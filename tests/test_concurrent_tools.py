"""The calls of one turn run at once; a cancel cuts them all off; a call the run cannot make goes back to the
model (docs/cancellation.md, "Concurrent tool calls" and "Invalid calls go back to the model").

Real worker processes, the toolbox MCP server over HTTP (its events file says when each call started and
ended on the server), real Redis and RabbitMQ; the model is the scripted provider where what the model
receives does not matter, and PyPI ``llm-mock-api`` (tests/llm_mock.py) where it does.
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from runbrake.shared import RunRecord, RunSpec, RunStatus, RunStore, Settings, StepKind, TerminationReason, ToolOutcome
from runbrake.shared.messaging.cancel import CancelPublisher, cancel_run
from runbrake.shared.messaging.producer import Producer
from runbrake.shared.operations import approve_run
from tests.catalog_helpers import add_to_catalog
from tests.llm_mock import LlmMock, reply
from tests.mcp_helpers import Toolbox, matching_events, wait_for_event
from tests.worker_helpers import WorkerProcess, call, has_step, servers_json, spec, wait_for_run

pytestmark = pytest.mark.integration

BACKSTOP_OFF = {"RUNBRAKE_CANCEL_POLL_MS": "600000"}
"""Ten minutes between backstop polls: within a test only the cancel message (or the probe) stops a call."""
WAIT_S = 20.0


@pytest.fixture(name="publisher")
def publisher_fixture(rabbitmq: Settings) -> Iterator[CancelPublisher]:
    publisher = CancelPublisher(rabbitmq)
    yield publisher
    publisher.close()


def _tool_steps(record: RunRecord) -> list[Any]:
    return [s for s in record.steps if s.kind is StepKind.TOOL]


def _model_run(mock: LlmMock, toolbox: Toolbox, text: str, *, tools: list[str] | None = None,
               **extra: Any) -> RunSpec:
    """A run of the catalog model ``mock`` (llm-mock-api, chat completions) with the toolbox server (``tools``:
    its catalog allowlist)."""
    server: dict[str, Any] = {"transport": "http", "url": str(toolbox.spec.url)}  # type: ignore[union-attr]
    if tools is not None:
        server["tools"] = tools
    add_to_catalog({"toolbox": server},
                   models={"mock": {"provider": "openai", "base_url": mock.openai_url, "model": "gpt-mock"}})
    return RunSpec.parse({"input": text, "model": "mock", "mcp_servers": ["toolbox"], **extra})


# -- concurrent calls ---------------------------------------------------------------------------


def test_two_3_s_calls_of_one_turn_run_at_once_and_each_is_recorded_when_it_completes(
    toolbox_http: Toolbox, worker: WorkerProcess, producer: Producer, store: RunStore
) -> None:
    run = producer.enqueue(spec({"toolbox": toolbox_http.spec}, [
        {"tool_calls": [call("slow", seconds=3, note="first"), call("slow", seconds=3, note="second")]},
        {"content": "both done"},
    ]))

    record = wait_for_run(store, run.run_id, timeout=30)

    assert (record.status, record.termination_reason) == (RunStatus.COMPLETED, TerminationReason.COMPLETED)
    model, *tools, final = record.steps
    assert [s.kind for s in record.steps] == [StepKind.MODEL, StepKind.TOOL, StepKind.TOOL, StepKind.MODEL]
    assert sorted(s.tool_call_id or "" for s in tools) == ["call_0_0", "call_0_1"]
    assert [(s.round, s.tool_outcome, s.content) for s in tools] == [(1, ToolOutcome.OK, "slept 3.0 s")] * 2
    started, finished = (matching_events(toolbox_http.events, e, tool="slow") for e in ("started", "finished"))
    assert len(started) == len(finished) == 2
    # Overlap: both calls started on the server before either ended.
    assert max(e["t"] for e in started) < min(e["t"] for e in finished)
    # The turn's two 3 s calls took one call's time, not two (issue 17: "under 4.5 s"), from the model step
    # that asked for them to the last of their steps.
    assert tools[-1].recorded_at - model.recorded_at < 4.5
    assert final.content == "both done"


def test_results_go_back_to_the_model_in_call_order_while_steps_are_recorded_as_calls_complete(
    llm_mock: LlmMock, toolbox_http: Toolbox, worker: WorkerProcess, producer: Producer, store: RunStore
) -> None:
    llm_mock.server.when("two calls").reply(reply(tools=[
        ("toolbox__slow", {"seconds": 2}, "call_slow"), ("toolbox__echo", {"text": "quick"}, "call_echo"),
    ])).times(1)
    llm_mock.server.when_tool_result("call_echo").reply(reply("Both answered."))

    record = wait_for_run(store, producer.enqueue(_model_run(llm_mock, toolbox_http, "two calls")).run_id)

    assert (record.status, record.steps[-1].content) == (RunStatus.COMPLETED, "Both answered.")
    # Recorded as they completed: the echo long before the 2 s call.
    assert [(s.tool_call_id, s.content) for s in _tool_steps(record)] == [
        ("call_echo", "quick"), ("call_slow", "slept 2.0 s")]
    # Sent back in the order the model asked for them.
    second = llm_mock.bodies()[1]["messages"]
    assert [(m["role"], m.get("tool_call_id")) for m in second[-3:]] == [
        ("assistant", None), ("tool", "call_slow"), ("tool", "call_echo")]
    assert [m["content"] for m in second[-2:]] == ["slept 2.0 s", "quick"]


def test_a_cancel_with_three_calls_in_flight_interrupts_all_three_and_records_each_cancelled_once(
    toolbox_http: Toolbox, start_worker: Callable[..., WorkerProcess], producer: Producer, store: RunStore,
    publisher: CancelPublisher,
) -> None:
    worker = start_worker(**BACKSTOP_OFF)
    run = producer.enqueue(spec({"toolbox": toolbox_http.spec}, [
        {"tool_calls": [call("slow", seconds=60), call("slow", seconds=60), call("slow", seconds=60)]},
        {"content": "never reached"},
    ]))
    wait_for_event(toolbox_http.events, "started", tool="slow", count=3, timeout=WAIT_S)

    assert cancel_run(store, publisher, run.run_id, reason="stop all", requested_by="test").won

    assert worker.wait_for_log("run_segment_ended", run_id=run.run_id, timeout=WAIT_S)[0]["outcome"] == "cancelled"
    record = store.get(run.run_id)
    assert (record.status, record.termination_reason) == (RunStatus.CANCELLED, TerminationReason.CANCELLED)
    tools = _tool_steps(record)
    assert sorted(s.tool_call_id or "" for s in tools) == ["call_0_0", "call_0_1", "call_0_2"]
    assert [s.tool_outcome for s in tools] == [ToolOutcome.CANCELLED] * 3
    assert [s.kind for s in record.steps] == [StepKind.MODEL, *[StepKind.TOOL] * 3]
    # One interrupt cut off the three calls at once; the server saw each cancelled, none finished.
    assert worker.logged("call_interrupted", run_id=run.run_id, calls=3)
    wait_for_event(toolbox_http.events, "cancelled", tool="slow", count=3, timeout=WAIT_S)
    assert matching_events(toolbox_http.events, "finished") == []


def test_a_cancel_the_probe_finds_while_sibling_calls_run_cuts_them_off_and_records_them_cancelled(
    toolbox_http: Toolbox, start_worker: Callable[..., WorkerProcess], producer: Producer, store: RunStore,
) -> None:
    # No message and no backstop: only the probe of the first call's step can find the cancel.
    start_worker(**BACKSTOP_OFF)
    run = producer.enqueue(spec({"toolbox": toolbox_http.spec}, [
        {"tool_calls": [call("slow", seconds=5), call("slow", seconds=60), call("slow", seconds=60)]},
        {"content": "never reached"},
    ]))
    wait_for_event(toolbox_http.events, "started", tool="slow", count=3, timeout=WAIT_S)

    assert store.cancel(run.run_id, reason="probe", requested_by="test").won

    record = wait_for_run(store, run.run_id, has_step("tool", 3), timeout=WAIT_S)
    assert record.status is RunStatus.CANCELLED
    first, *cut_off = [(s.tool_call_id, s.tool_outcome) for s in _tool_steps(record)]
    assert first == ("call_0_0", ToolOutcome.OK)
    assert sorted(cut_off) == [("call_0_1", ToolOutcome.CANCELLED), ("call_0_2", ToolOutcome.CANCELLED)]
    wait_for_event(toolbox_http.events, "cancelled", tool="slow", count=2, timeout=WAIT_S)
    assert len(matching_events(toolbox_http.events, "finished", tool="slow")) == 1


def test_a_call_that_needs_approval_waits_for_the_calls_before_it_and_holds_back_those_after_it(
    toolbox_http: Toolbox, worker: WorkerProcess, producer: Producer, store: RunStore
) -> None:
    run_id = producer.enqueue(spec({"toolbox": toolbox_http.spec}, [
        {"tool_calls": [call("echo", text="before"), call("get-sum", a=2, b=3), call("echo", text="after")]},
        {"content": "It is 5."},
    ], approval_required=["toolbox.get-sum"])).run_id

    waiting = wait_for_run(store, run_id, lambda r: r.status is RunStatus.WAITING_FOR_APPROVAL)

    assert [(s.kind, s.tool_call_id) for s in waiting.steps] == [(StepKind.MODEL, None), (StepKind.TOOL, "call_0_0")]
    assert waiting.pending is not None
    assert [c["id"] for c in waiting.pending["pending_calls"]] == ["call_0_1", "call_0_2"]
    assert [e["args"] for e in matching_events(toolbox_http.events, "started")] == [{"text": "before"}]

    approve_run(store, producer, run_id, decided_by="test")
    record = wait_for_run(store, run_id)

    assert (record.status, record.steps[-1].content) == (RunStatus.COMPLETED, "It is 5.")
    kinds = [s.kind for s in record.steps]
    assert kinds == [StepKind.MODEL, StepKind.TOOL, StepKind.APPROVAL, StepKind.TOOL, StepKind.TOOL, StepKind.MODEL]
    assert sorted(s.tool_call_id or "" for s in record.steps[3:5]) == ["call_0_1", "call_0_2"]
    assert len(matching_events(toolbox_http.events, "started")) == 3


def test_a_hand_over_cuts_off_the_calls_in_flight_and_leaves_those_not_started_to_the_next_worker(
    toolbox_http: Toolbox, start_worker: Callable[..., WorkerProcess], producer: Producer, store: RunStore
) -> None:
    # Two places per run: the third call waits for one when the worker shuts down.
    first = start_worker(RUNBRAKE_DRAIN_S="1", RUNBRAKE_MAX_PARALLEL_TOOL_CALLS="2")
    run = producer.enqueue(spec({"toolbox": toolbox_http.spec}, [
        {"tool_calls": [call("slow", seconds=60), call("slow", seconds=60), call("get-sum", a=1, b=2)]},
        {"content": "done"},
    ]))
    wait_for_event(toolbox_http.events, "started", tool="slow", count=2, timeout=WAIT_S)

    first.process.send_signal(signal.SIGTERM)
    assert first.process.wait(timeout=20) == 0
    handed = store.get(run.run_id)
    assert handed.status is RunStatus.QUEUED
    assert handed.pending is not None
    assert [c["id"] for c in handed.pending["pending_calls"]] == ["call_0_2"]
    assert matching_events(toolbox_http.events, "started", tool="get-sum") == []
    start_worker()
    record = wait_for_run(store, run.run_id, timeout=30)

    assert (record.status, record.steps[-1].content) == (RunStatus.COMPLETED, "done")
    steps = [(s.kind, s.tool_call_id, s.tool_outcome, s.detail.get("reason")) for s in record.steps]
    cut_off = sorted(steps[1:3], key=lambda s: s[1] or "")
    assert cut_off == [(StepKind.TOOL, "call_0_0", ToolOutcome.CANCELLED, "worker_shutdown"),
                       (StepKind.TOOL, "call_0_1", ToolOutcome.CANCELLED, "worker_shutdown")]
    assert steps[3:] == [(StepKind.HANDOFF, None, None, "worker_shutdown"),
                         (StepKind.TOOL, "call_0_2", ToolOutcome.OK, None), (StepKind.MODEL, None, None, None)]
    assert record.steps[3].detail["pending_calls"] == 1
    # No call made twice: the cut-off ones are not made again, the pending one once.
    assert len(matching_events(toolbox_http.events, "started", tool="slow")) == 2
    assert len(matching_events(toolbox_http.events, "started", tool="get-sum")) == 1


# -- invalid calls ------------------------------------------------------------------------------


def test_a_call_to_a_tool_the_run_does_not_have_goes_back_to_the_model_and_the_run_completes(
    llm_mock: LlmMock, toolbox_http: Toolbox, worker: WorkerProcess, producer: Producer, store: RunStore
) -> None:
    llm_mock.server.when("weather in Oslo").reply(reply(tools=[("get_weather", {"city": "Oslo"}, "call_w")])).times(1)
    llm_mock.server.when_tool_result("call_w").reply(reply("I cannot look up the weather."))

    record = wait_for_run(store, producer.enqueue(_model_run(llm_mock, toolbox_http, "weather in Oslo")).run_id)

    assert (record.status, record.termination_reason) == (RunStatus.COMPLETED, TerminationReason.COMPLETED)
    assert [s.kind for s in record.steps] == [StepKind.MODEL, StepKind.TOOL, StepKind.MODEL]
    tool = record.steps[1]
    assert (tool.tool_server, tool.tool_name, tool.tool_call_id, tool.tool_outcome) == (
        "", "get_weather", "call_w", ToolOutcome.FAILED)
    assert tool.detail == {"failure": "arguments", "reason": "invalid_call"}
    assert "there is no tool named 'get_weather'" in tool.content
    assert "toolbox__get-sum" in tool.content  # which tools exist
    assert matching_events(toolbox_http.events, "started") == []
    # The model saw its own call and what was wrong with it.
    second = llm_mock.bodies()[1]["messages"]
    assert second[-2]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert (second[-1]["role"], second[-1]["tool_call_id"], second[-1]["content"]) == ("tool", "call_w", tool.content)
    assert record.steps[-1].content == "I cannot look up the weather."
    assert servers_json() == []  # a made-up name is no server's failure, nor anyone's argument error


def test_arguments_that_are_not_an_object_and_a_tool_outside_the_allowlist_are_handed_back_as_argument_errors(
    llm_mock: LlmMock, toolbox_http: Toolbox, worker: WorkerProcess, producer: Producer, store: RunStore
) -> None:
    llm_mock.server.when("mistakes").reply(reply(tools=[
        ("toolbox__get-sum", [2, 3], "call_args"),  # type: ignore[list-item]  # a JSON array, not an object
        ("toolbox__echo", {"text": "hi"}, "call_echo"),  # not in the catalog's allowlist
        ("toolbox__get-sum", {"a": 2, "b": 3}, "call_ok"),
    ])).times(1)
    llm_mock.server.when_tool_result("call_ok").reply(reply("5, after two mistakes."))
    run = _model_run(llm_mock, toolbox_http, "mistakes", tools=["get-sum", "slow"])

    record = wait_for_run(store, producer.enqueue(run).run_id)

    assert (record.status, record.steps[-1].content) == (RunStatus.COMPLETED, "5, after two mistakes.")
    by_call = {s.tool_call_id: s for s in _tool_steps(record)}
    assert {k: (s.tool_outcome, s.detail.get("reason")) for k, s in by_call.items()} == {
        "call_args": (ToolOutcome.FAILED, "invalid_call"), "call_echo": (ToolOutcome.FAILED, "invalid_call"),
        "call_ok": (ToolOutcome.OK, None)}
    assert "the arguments of toolbox__get-sum must be a JSON object, not an array" in by_call["call_args"].content
    assert "toolbox does not allow the tool 'echo'" in by_call["call_echo"].content
    assert "toolbox__get-sum, toolbox__slow" in by_call["call_echo"].content
    assert [e["tool"] for e in matching_events(toolbox_http.events, "started")] == ["get-sum"]
    sent = [(m["tool_call_id"], m["content"]) for m in llm_mock.bodies()[1]["messages"] if m["role"] == "tool"]
    assert sent == [(k, by_call[k].content) for k in ("call_args", "call_echo", "call_ok")]
    assert servers_json() == [
        {"server": "toolbox", "ok": 1, "failed": 0, "argument_errors": 2, "cancelled": 0, "side_effects_unknown": 0,
         "worker_lost": 0, "failure_rate": 0.0}]


def test_a_model_that_keeps_making_invalid_calls_ends_at_max_rounds(
    llm_mock: LlmMock, toolbox_http: Toolbox, worker: WorkerProcess, producer: Producer, store: RunStore
) -> None:
    llm_mock.server.when("loop").reply(reply(tools=[("get_weather", {"city": "Oslo"})]))

    record = wait_for_run(store, producer.enqueue(_model_run(llm_mock, toolbox_http, "loop", max_rounds=3)).run_id)

    assert (record.status, record.termination_reason) == (RunStatus.FAILED, TerminationReason.MAX_ROUNDS)
    assert [s.detail.get("reason") for s in _tool_steps(record)] == ["invalid_call"] * 3
    assert len(llm_mock.requests()) == 3
