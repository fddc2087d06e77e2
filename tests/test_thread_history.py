"""The history a continuation carries (shared/threads.py; docs/usage.md, "Continue a finished run"), built from
stored steps: what the store bounded stays bounded, a call the history cannot name is left out with its result,
a structured answer handed back is repeated, and the spec it makes is one the spec's own checks accept."""

from __future__ import annotations

import json
from typing import Any

import pytest

from runbrake.shared import RunSpec, RunStep, SpecError, StepKind
from runbrake.shared.outcome import ToolOutcome
from runbrake.shared.records import RunRecord, read_record
from runbrake.shared.threads import continuation, conversation, hand_back
from runbrake.shared.tool_result import ToolResult

REQUEST = {"input": "Sum it", "model": "gpt", "mcp_servers": ["toolbox"], "instructions": "Be brief.",
           "labels": {"team": "acme"}, "idempotency_key": "parent-key", "max_rounds": 5}


def model(round_: int, content: str = "", calls: list[dict[str, Any]] | None = None, **detail: Any) -> RunStep:
    return RunStep(kind=StepKind.MODEL, round=round_, content=content, detail={"tool_calls": calls or [], **detail})


def tool(call_id: str, content: str, *, server: str = "toolbox") -> RunStep:
    return RunStep.tool(round=1, server=server, name="get-sum", result=ToolResult(ToolOutcome.OK, content),
                        call_id=call_id)


def parent(*steps: RunStep, status: str = "completed", request: dict[str, Any] | None = None) -> RunRecord:
    fields = {"status": status, "termination_reason": status, "request": json.dumps(request or REQUEST)}
    return read_record("a" * 32, fields, steps, None)


def test_results_follow_their_calls_in_call_order_whatever_order_they_completed_in() -> None:
    calls = [{"id": "c1", "server": "toolbox", "tool": "get-sum", "arguments": {"a": 1}},
             {"id": "c2", "server": "toolbox", "tool": "get-sum", "arguments": {"a": 2}}]
    record = parent(model(1, "", calls), tool("c2", "two"), tool("c1", "one"), model(2, "Done."))

    assert conversation(record, frozenset({"toolbox"})) == [
        {"role": "user", "content": "Sum it"},
        {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
        {"role": "tool", "tool_call_id": "c2", "content": "two"},
        {"role": "assistant", "content": "Done."},
    ]


def test_a_steered_turn_carries_its_cut_off_calls_answered_and_the_steers_input_as_the_next_user_message() -> None:
    calls = [{"id": "c1", "server": "toolbox", "tool": "get-sum", "arguments": {"a": 1}}]
    cut = RunStep.tool(round=1, server="toolbox", name="get-sum", call_id="c1",
                       result=ToolResult.cancelled("the call was cut off: the run was steered"))
    steer = RunStep(kind=StepKind.STEER, round=1, content="Use b instead",
                    detail={"input": "Use b instead", "reason": "wrong", "requested_by": "ops"})
    record = parent(model(1, "", calls), cut, steer, model(2, "Done with b."))

    assert conversation(record, frozenset({"toolbox"})) == [
        {"role": "user", "content": "Sum it"},
        {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "tool", "tool_call_id": "c1", "content": "the call was cut off: the run was steered"},
        {"role": "user", "content": "Use b instead"},
        {"role": "assistant", "content": "Done with b."},
    ]


def test_cut_arguments_are_carried_as_a_mark_and_a_call_of_no_server_is_left_out_with_its_result() -> None:
    cut = {"id": "c1", "server": "toolbox", "tool": "echo", "arguments": {"_truncated": '{"text":"xx', "_chars": 90000}}
    made_up = {"id": "c2", "server": "", "tool": "nowhere", "arguments": {}, "problem": "there is no tool named 'x'"}
    record = parent(model(1, "Let me see.", [cut, made_up]), tool("c1", "echoed"), tool("c2", "invalid", server=""))

    history = conversation(record, frozenset({"toolbox"}))

    assert history[1] == {"role": "assistant", "content": "Let me see.", "tool_calls": [
        {"id": "c1", "server": "toolbox", "tool": "echo", "arguments": {"_truncated": True, "_chars": 90000}}]}
    assert history[2:] == [{"role": "tool", "tool_call_id": "c1", "content": "echoed"}]


def test_an_interrupted_or_failed_model_call_and_an_empty_turn_say_nothing_and_a_mismatch_is_handed_back() -> None:
    record = parent(RunStep(kind=StepKind.MODEL, round=1, interrupted=True, content="interrupted"),
                    RunStep(kind=StepKind.MODEL, round=1, error="503"),
                    model(1, '{"sum": "five"}', output_error="at /sum: 'five' is not of type 'integer'"),
                    model(2, ""))

    assert conversation(record, frozenset())[1:] == [
        {"role": "assistant", "content": '{"sum": "five"}'},
        {"role": "user", "content": hand_back("at /sum: 'five' is not of type 'integer'")},
    ]


def test_the_continuation_is_the_parents_spec_with_the_bodys_fields_and_never_its_idempotency_key() -> None:
    record = parent(model(1, "Five."), request={**REQUEST, "mcp_servers": [], "model": "gpt"})

    spec = continuation(record, {"input": "Again", "labels": {"team": "other"}})

    assert isinstance(spec, RunSpec)
    assert (spec.input, spec.instructions, spec.labels, spec.max_rounds, spec.idempotency_key) == (
        "Again", "Be brief.", {"team": "other"}, 5, None)
    assert [m.content for m in spec.messages] == ["Sum it", "Five."]


def test_a_body_that_gives_messages_or_breaks_the_spec_names_the_field() -> None:
    record = parent(model(1, "Five."), request={**REQUEST, "mcp_servers": []})
    with pytest.raises(SpecError) as given:
        continuation(record, {"input": "x", "messages": []})
    with pytest.raises(SpecError) as broken:
        continuation(record, {"input": "x", "max_rounds": "many"})
    assert given.value.field == "messages"
    assert broken.value.field == "max_rounds"
