"""Lost-worker policies (docs/usage.md, "Lost-worker policies") and what the sweeper writes for a lost worker's
run (worker/reclaim.py): the catalog's ``on_worker_lost`` / ``tools_on_worker_lost``, refused in a spec; each
call in flight on the record once, ``side_effects`` from its "sent" mark; the conversation rebuilt in call
order; the poison bound."""

from __future__ import annotations

import json
from typing import Any

import pytest

from runbrake.broker.render import render_run
from runbrake.shared import RunSpec, StepKind
from runbrake.shared.catalog import Catalog
from runbrake.shared.errors import ConfigError, SpecError
from runbrake.shared.records import read_record
from runbrake.shared.spec import OnWorkerLost
from runbrake.shared.steps import RunStep
from runbrake.shared.timeline import Lang
from runbrake.shared.tool_result import ToolResult
from runbrake.worker.conversation import ToolCall
from runbrake.worker.reclaim import CUT_OFF, plan

SERVER = {"url": "http://127.0.0.1:1/mcp"}


def test_a_catalog_server_and_its_tools_say_on_worker_lost_the_default_being_report() -> None:
    servers = Catalog.parse({"mcp_servers": {
        "plain": SERVER,
        "safe": {**SERVER, "on_worker_lost": "retry", "tools_on_worker_lost": {"charge": "fail"}},
    }}).mcp_servers
    assert servers["plain"].worker_lost_policy("x") is OnWorkerLost.REPORT
    assert servers["safe"].worker_lost_policy("search") is OnWorkerLost.RETRY
    assert servers["safe"].worker_lost_policy("charge") is OnWorkerLost.FAIL


@pytest.mark.parametrize(("entry", "field"), [
    ({"on_worker_lost": "maybe"}, "on_worker_lost"),
    ({"tools_on_worker_lost": {"slow": "again"}}, "tools_on_worker_lost"),
])
def test_a_bad_lost_worker_policy_in_the_catalog_is_refused_naming_the_field(entry: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError, match=rf"mcp_servers\.s\.{field}"):
        Catalog.parse({"mcp_servers": {"s": {**SERVER, **entry}}})


@pytest.mark.parametrize("entry", [{"on_worker_lost": "retry"}, {"tools_on_worker_lost": {"x": "retry"}}])
def test_a_run_spec_may_not_set_a_lost_worker_policy_only_the_catalog_does(entry: dict[str, Any]) -> None:
    with pytest.raises(SpecError, match="only an operator's catalog sets it"):
        RunSpec.parse({"input": "x", "model": {"provider": "scripted", "turns": [{"content": "x"}]},
                       "mcp_servers": {"s": {**SERVER, **entry}}})


def _step(sequence: int, step: RunStep) -> RunStep:
    return step.with_sequence(sequence, 0.0)


def _model(sequence: int, round_number: int, *calls: str) -> RunStep:
    detail = {"tool_calls": [{"id": c, "server": "s", "tool": "t", "arguments": {}} for c in calls]}
    return _step(sequence, RunStep(kind=StepKind.MODEL, round=round_number, content="", detail=detail))


def _tool(sequence: int, call_id: str, content: str) -> RunStep:
    return _step(sequence, RunStep.tool(round=1, server="s", name="t", result=ToolResult.ok(content), call_id=call_id))


def _fields(**extra: str) -> dict[str, str]:
    request = {"input": "hi", "model": {"provider": "scripted", "turns": [{"content": "x"}]}, "mcp_servers": ["s"]}
    return {"status": "running", "seq": "3", "request": json.dumps(request), **extra}


def test_each_unrecorded_call_gets_one_cut_off_step_its_side_effects_from_its_sent_mark_results_in_call_order() -> None:
    steps = (_model(1, 1, "a", "b", "c"), _tool(2, "c", "C done"), _tool(3, "zz", "not this turn's"))
    planned = plan(_fields(**{"sent:a": "1"}), steps, worker="w:1:x", max_losses=3)

    cut = [s for s in planned.steps if s.kind is StepKind.TOOL]
    assert [(s.tool_call_id, s.detail["side_effects"], s.detail["reason"]) for s in cut] == [
        ("a", "unknown", "worker_lost"), ("b", "none", "worker_lost")]
    handoff = planned.steps[-1]
    assert (handoff.kind, handoff.detail["worker"], handoff.detail["worker_losses"]) == (StepKind.HANDOFF, "w:1:x", 1)
    messages = planned.pending["messages"]
    assert [(m["role"], m["tool_call_id"], m["content"]) for m in messages[2:]] == [
        ("tool", "a", CUT_OFF), ("tool", "b", CUT_OFF), ("tool", "c", "C done")]
    assert (planned.pending["model_calls"], planned.seq, planned.fail) == (1, 3, False)


def test_a_model_call_in_flight_is_recorded_interrupted_and_one_already_answered_is_not() -> None:
    steps = (_model(1, 1, "a"), _tool(2, "a", "A"))
    in_flight = plan(_fields(**{"sent:model": "2 2"}), steps, worker="w", max_losses=3)
    answered = plan(_fields(**{"sent:model": "1 0"}), steps, worker="w", max_losses=3)

    assert [(s.kind, s.round, s.interrupted, s.detail.get("reason")) for s in in_flight.steps[:-1]] == [
        (StepKind.MODEL, 2, True, "worker_lost")]
    assert [s.kind for s in answered.steps] == [StepKind.HANDOFF]
    assert in_flight.pending["model_calls"] == 1  # the next worker makes round 2 again


def test_a_model_mark_written_with_a_turns_step_while_a_call_of_that_turn_was_cut_off_means_no_model_call() -> None:
    # Two calls finishing at once: the second's step marks the model call after the turn, the first's never
    # landed (shared/_scripts.py, APPEND_STEP's marks); the model was not called while a call was in flight.
    steps = (_model(1, 1, "a", "b"), _tool(2, "b", "B"))
    planned = plan(_fields(**{"sent:a": "1", "sent:b": "1", "sent:model": "2 2"}), steps, worker="w", max_losses=3)

    assert [(s.kind, s.tool_call_id, s.interrupted) for s in planned.steps] == [
        (StepKind.TOOL, "a", False), (StepKind.HANDOFF, None, False)]


def test_retry_leaves_the_call_pending_and_fail_fails_the_run_with_the_step_recorded() -> None:
    steps = (_model(1, 1, "a", "b"),)

    def policy(call: ToolCall) -> OnWorkerLost:
        return OnWorkerLost.RETRY if call.id == "a" else OnWorkerLost.REPORT

    retried = plan(_fields(), steps, worker="w", max_losses=3, policy=policy)
    failed = plan(_fields(), steps, worker="w", max_losses=3, policy=lambda _call: OnWorkerLost.FAIL)

    assert [c["id"] for c in retried.pending["pending_calls"]] == ["a"]
    assert [m.get("tool_call_id") for m in retried.pending["messages"] if m["role"] == "tool"] == ["b"]
    assert failed.fail
    assert [s.detail["on_worker_lost"] for s in failed.steps] == ["fail", "fail"]
    assert "s.t" in failed.error


def test_past_the_bound_of_lost_workers_the_run_fails_with_the_count() -> None:
    planned = plan(_fields(worker_losses="3"), (_model(1, 1, "a"),), worker="w", max_losses=3)
    assert planned.fail
    assert "lost 4 workers" in planned.error
    assert [s.kind for s in planned.steps] == [StepKind.TOOL]


def test_a_run_that_ended_while_its_worker_was_dead_gets_the_steps_and_no_handoff() -> None:
    planned = plan(_fields(status="cancelled", **{"sent:a": "1"}), (_model(1, 1, "a"),), worker="w", max_losses=3)
    assert not planned.running
    assert [(s.kind, s.detail.get("side_effects")) for s in planned.steps] == [(StepKind.TOOL, "unknown")]


@pytest.mark.parametrize(("lang", "words"), [("en", "worker lost, resuming"),
                                             ("de", "Worker verloren, wird fortgesetzt")])
def test_a_run_a_lost_worker_left_in_the_queue_says_worker_lost_resuming_until_it_is_claimed(
    lang: Lang, words: str
) -> None:
    waiting = read_record("a" * 32, {**_fields(status="queued", lost_worker="vm:7:abc", worker_losses="1")}, (), None)
    claimed = read_record("a" * 32, {**_fields(status="running", lost_worker="", worker_losses="1")}, (), None)

    assert (waiting.to_dict()["lost_worker"], waiting.to_dict()["worker_losses"]) == ("vm:7:abc", 1)
    assert f"{words}: vm:7:abc" in render_run(waiting, lang)
    assert claimed.to_dict()["lost_worker"] is None
    assert words not in render_run(claimed, lang)
