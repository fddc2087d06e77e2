"""Per-tool cancel policies and what a cut-off call may have done (docs/cancellation.md, "Cancel policies:
finish" and "Side effects of a cut-off call").

Real worker processes, the toolbox MCP server over HTTP (its events file says when each call started, finished
or was cancelled on the server), real Redis and RabbitMQ; the model is the scripted provider. The catalog names
the toolbox twice where a turn mixes policies: ``toolbox`` with ``slow`` set to ``finish``, ``cut`` (the same
server) with the default ``interrupt``.
"""

from __future__ import annotations

from typing import Any

import pytest

from runbrake.broker.render import render_run
from runbrake.shared import RunRecord, RunStatus, RunStore, StepKind, TerminationReason, ToolOutcome
from runbrake.shared.catalog import Catalog
from runbrake.shared.errors import ConfigError, SpecError
from runbrake.shared.messaging.cancel import CancelPublisher, cancel_run
from runbrake.shared.messaging.producer import Producer
from runbrake.shared.spec import OnCancel, RunSpec
from runbrake.shared.steps import RunStep
from runbrake.shared.timeline import Lang, label
from runbrake.shared.tool_result import SideEffects, ToolResult
from tests.mcp_helpers import Toolbox, matching_events, wait_for_event
from tests.worker_helpers import WorkerProcess, call, servers_json, spec

WAIT_S = 30.0


def _tools_by_call(record: RunRecord) -> dict[str, Any]:
    return {s.tool_call_id or "": s for s in record.steps if s.kind is StepKind.TOOL}


def _cancelled(worker: WorkerProcess, store: RunStore, publisher: CancelPublisher, run_id: str) -> RunRecord:
    assert cancel_run(store, publisher, run_id, reason="stop", requested_by="test").won
    assert worker.wait_for_log("run_segment_ended", run_id=run_id, timeout=WAIT_S)[0]["outcome"] == "cancelled"
    record = store.get(run_id)
    assert (record.status, record.termination_reason) == (RunStatus.CANCELLED, TerminationReason.CANCELLED)
    return record


@pytest.mark.integration
def test_a_finish_call_completes_after_a_cancel_and_the_run_stops_right_after_it_while_its_sibling_is_cut_off(
    toolbox_http: Toolbox, worker: WorkerProcess, producer: Producer, store: RunStore, publisher: CancelPublisher,
) -> None:
    finishing = toolbox_http.spec.model_copy(update={"tools_on_cancel": {"slow": OnCancel.FINISH}})
    run = producer.enqueue(spec({"toolbox": finishing, "cut": toolbox_http.spec}, [
        {"tool_calls": [call("slow", seconds=3, note="finish"), call("slow", server="cut", seconds=60, note="cut")]},
        {"tool_calls": [call("echo", text="never called")]},
        {"content": "never reached"},
    ]))
    wait_for_event(toolbox_http.events, "started", tool="slow", count=2, timeout=WAIT_S)

    record = _cancelled(worker, store, publisher, run.run_id)

    tools = _tools_by_call(record)
    finished, cut = tools["call_0_0"], tools["call_0_1"]
    assert finished.tool_outcome is ToolOutcome.OK
    assert "side_effects" not in finished.detail
    assert cut.tool_outcome is ToolOutcome.CANCELLED
    assert cut.detail["side_effects"] == "unknown"
    # The interrupt call was cut off at once, before the finish call's real result came back.
    assert cut.sequence < finished.sequence
    # The run stopped right after the finish call: no further model or tool call.
    assert [s.kind for s in record.steps] == [StepKind.MODEL, StepKind.TOOL, StepKind.TOOL]
    assert worker.logged("call_interrupted", run_id=run.run_id, calls=1, finishing=1)
    assert len(matching_events(toolbox_http.events, "finished", tool="slow")) == 1
    assert matching_events(toolbox_http.events, "started", tool="echo") == []


@pytest.mark.integration
def test_a_finish_call_past_its_grace_is_interrupted_and_recorded_cancelled_with_unknown_side_effects(
    toolbox_http: Toolbox, worker: WorkerProcess, producer: Producer, store: RunStore, publisher: CancelPublisher,
) -> None:
    finishing = toolbox_http.spec.model_copy(update={"on_cancel": OnCancel.FINISH, "cancel_grace_s": 1.0})
    run = producer.enqueue(spec({"toolbox": finishing}, [
        {"tool_calls": [call("slow", seconds=30)]},
        {"content": "never reached"},
    ]))
    wait_for_event(toolbox_http.events, "started", tool="slow", timeout=WAIT_S)

    record = _cancelled(worker, store, publisher, run.run_id)

    step = _tools_by_call(record)["call_0_0"]
    assert step.tool_outcome is ToolOutcome.CANCELLED
    assert step.detail["side_effects"] == "unknown"
    assert [s.kind for s in record.steps] == [StepKind.MODEL, StepKind.TOOL]
    assert worker.logged("call_interrupted", run_id=run.run_id, calls=0, finishing=1)
    wait_for_event(toolbox_http.events, "cancelled", tool="slow", timeout=WAIT_S)
    assert matching_events(toolbox_http.events, "finished") == []


@pytest.mark.integration
def test_a_call_cut_off_waiting_for_a_max_concurrency_slot_had_no_side_effects_and_one_in_flight_unknown_ones(
    toolbox_http: Toolbox, worker: WorkerProcess, producer: Producer, store: RunStore, publisher: CancelPublisher,
) -> None:
    one_at_a_time = toolbox_http.spec.model_copy(update={"max_concurrency": 1})
    run = producer.enqueue(spec({"toolbox": one_at_a_time}, [
        {"tool_calls": [call("slow", seconds=60, note="in flight"), call("slow", seconds=60, note="waiting")]},
        {"content": "never reached"},
    ]))
    wait_for_event(toolbox_http.events, "started", tool="slow", timeout=WAIT_S)

    record = _cancelled(worker, store, publisher, run.run_id)

    tools = _tools_by_call(record)
    assert [tools[c].tool_outcome for c in ("call_0_0", "call_0_1")] == [ToolOutcome.CANCELLED] * 2
    assert tools["call_0_0"].detail["side_effects"] == "unknown"
    assert tools["call_0_1"].detail["side_effects"] == "none"
    assert len(matching_events(toolbox_http.events, "started", tool="slow")) == 1  # the server never saw the second
    [health] = [h for h in servers_json() if h["server"] == "toolbox"]
    assert (health["cancelled"], health["side_effects_unknown"]) == (2, 1)


# -- the policy's fields and how a cut-off step is shown ------------------------------------------------------


@pytest.mark.parametrize("lang", ["en", "de"])
def test_show_labels_a_cut_off_steps_side_effects_in_both_languages(lang: Lang) -> None:
    steps = tuple(RunStep.tool(round=1, server="toolbox", name="slow", call_id=f"call_{i}",
                               result=ToolResult.cancelled("cut off", sent=sent)).with_sequence(i + 1, 0.0)
                  for i, sent in enumerate((True, False)))
    record = RunRecord(run_id="0" * 32, status=RunStatus.CANCELLED, termination_reason=TerminationReason.CANCELLED,
                       created_at=0.0, started_at=None, finished_at=None, owner="", lease_expires_at=None,
                       request={}, pending=None, error="", segments=1, cancel=None, steps=steps)
    shown = render_run(record, lang)
    assert label("side_effects.unknown", lang) in shown
    assert label("side_effects.none", lang) in shown
    assert "side_effects." not in shown
    assert [s.detail["side_effects"] for s in steps] == [SideEffects.UNKNOWN.value, SideEffects.NONE.value]


def test_a_catalog_server_and_its_tools_say_on_cancel_and_a_grace_the_default_being_interrupt() -> None:
    catalog = Catalog.parse({"mcp_servers": {
        "plain": {"url": "http://127.0.0.1:1/mcp"},
        "careful": {"url": "http://127.0.0.1:1/mcp", "on_cancel": "finish", "cancel_grace_s": 5,
                    "tools_on_cancel": {"quick": "interrupt"}},
        "mixed": {"url": "http://127.0.0.1:1/mcp", "tools_on_cancel": {"charge": "finish"}},
    }})
    servers = catalog.mcp_servers
    assert servers["plain"].cancel_grace("slow") is None
    assert (servers["careful"].cancel_grace("slow"), servers["careful"].cancel_grace("quick")) == (5.0, None)
    assert (servers["mixed"].cancel_grace("charge"), servers["mixed"].cancel_grace("other")) == (30.0, None)


@pytest.mark.parametrize(("entry", "field"), [
    ({"on_cancel": "later"}, "on_cancel"),
    ({"cancel_grace_s": 0}, "cancel_grace_s"),
    ({"cancel_grace_s": 3_601}, "cancel_grace_s"),
    ({"tools_on_cancel": {"slow": "sometimes"}}, "tools_on_cancel"),
])
def test_a_bad_cancel_policy_in_the_catalog_is_refused_naming_the_field(entry: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError, match=rf"mcp_servers\.s\.{field}"):
        Catalog.parse({"mcp_servers": {"s": {"url": "http://127.0.0.1:1/mcp", **entry}}})


@pytest.mark.parametrize("entry", [{"on_cancel": "finish"}, {"cancel_grace_s": 5}, {"tools_on_cancel": {}}])
def test_a_run_spec_may_not_set_a_cancel_policy_only_the_catalog_does(entry: dict[str, Any]) -> None:
    with pytest.raises(SpecError, match="only an operator's catalog sets it"):
        RunSpec.parse({"input": "x", "model": {"provider": "scripted", "turns": [{"content": "x"}]},
                       "mcp_servers": {"s": {"url": "http://127.0.0.1:1/mcp", **entry}}})
