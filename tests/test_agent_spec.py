"""The spec of an agent run a backend can ship (issue 17, item 1): instructions, the conversation before the
input, model settings with the catalog's defaults and caps, an output schema and labels; each bounded and
checked, every problem named at once, before anything is written or sent."""

from __future__ import annotations

from typing import Any

import pytest

from runbrake.shared.catalog import Admission, Catalog
from runbrake.shared.errors import ConfigError, SpecError
from runbrake.shared.records import read_record
from runbrake.shared.spec import RunSpec, parse_label_filters
from runbrake.shared.steps import RunStep, StepKind
from runbrake.worker.metrics import REGISTRY, MetricsSubscriber
from runbrake.worker.runtime import model_settings, opening
from runbrake.worker.structured import AnswerCheck

SCRIPTED = {"provider": "scripted", "turns": [{"content": "ok"}]}
CALC = {"calc": {"url": "http://127.0.0.1:9/mcp"}}


def spec_with(**fields: Any) -> dict[str, Any]:
    return {"input": "What now?", "model": SCRIPTED, "mcp_servers": CALC, **fields}


def problems(data: dict[str, Any], admission: Admission | None = None) -> dict[str, str]:
    """Every problem with a spec, by field (parsed, then admitted when ``admission`` is given)."""
    def check() -> None:
        parsed = RunSpec.parse(data)
        if admission is not None:
            admission.admit(parsed)

    with pytest.raises(SpecError) as raised:
        check()
    return {p.field: p.msg for p in raised.value.problems}


def call(call_id: str, server: str = "calc", tool: str = "get-sum") -> dict[str, Any]:
    return {"id": call_id, "server": server, "tool": tool, "arguments": {"a": 2}}


HISTORY = [
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": None, "tool_calls": [call("c1")]},
    {"role": "tool", "tool_call_id": "c1", "content": "5"},
    {"role": "assistant", "content": "It is 5."},
]


def test_a_spec_of_before_keeps_its_meaning_and_gains_empty_fields() -> None:
    spec = RunSpec.parse({"input": "hi", "model": SCRIPTED})

    assert (spec.instructions, spec.messages, spec.output_schema, spec.labels) == (None, (), None, {})
    assert spec.model_settings.model_dump(exclude_none=True) == {}
    # A record stored before these fields existed reads with them empty.
    record = read_record("a" * 32, {"status": "completed", "request": '{"input": "hi"}'}, (), None)
    assert (record.labels, record.model, record.output, record.output_json) == ({}, None, None, None)
    assert record.to_dict()["usage"] == {"input_tokens": 0, "output_tokens": 0, "total_tokens": 0, "model_calls": 0}


def test_the_conversation_starts_with_the_instructions_then_the_history_then_the_input() -> None:
    spec = RunSpec.parse(spec_with(instructions="Be brief.", messages=HISTORY))

    messages = opening(spec)

    assert [(m.role, m.content) for m in messages] == [
        ("system", "Be brief."), ("user", "What is 2 + 3?"), ("assistant", None), ("tool", "5"),
        ("assistant", "It is 5."), ("user", "What now?")]
    [earlier] = messages[2].tool_calls
    assert (earlier.id, earlier.model_name, dict(earlier.arguments)) == ("c1", "calc__get-sum", {"a": 2})
    assert messages[3].tool_call_id == "c1"


def test_inconsistent_messages_are_refused_each_at_its_field_all_at_once() -> None:
    found = problems(spec_with(messages=[
        {"role": "tool", "tool_call_id": "nobody", "content": "5"},
        {"role": "assistant", "tool_calls": [call("c1"), call("c2")]},
        {"role": "tool", "tool_call_id": "c1", "content": "5"},
        {"role": "user", "content": "and?"},
        {"role": "tool", "tool_call_id": "c1", "content": "again"},
        {"role": "assistant", "tool_calls": [call("c1")]},
        {"role": "tool", "tool_call_id": "c1", "content": "5"},
    ]))

    assert found == {
        "messages[0].tool_call_id": "'nobody' answers no tool call of an assistant message before it",
        "messages[1].tool_calls": "not answered by a tool message before message 3: 'c2'",
        "messages[4].tool_call_id": "'c1' is answered already",
        "messages[5].tool_calls[0].id": "'c1' is used by another call already",
    }


def test_a_call_left_unanswered_at_the_end_of_the_history_is_refused() -> None:
    found = problems(spec_with(messages=[{"role": "assistant", "tool_calls": [call("c9")]}]))

    assert found == {"messages[0].tool_calls": "not answered by a tool message (input comes after the last "
                                               "message): 'c9'"}


def test_each_message_has_the_shape_of_its_role_and_names_the_runs_servers() -> None:
    found = problems(spec_with(messages=[
        {"role": "user"},
        {"role": "user", "content": "x", "tool_call_id": "c1"},
        {"role": "assistant"},
        {"role": "assistant", "tool_calls": [call("c1", server="elsewhere")]},
        {"role": "tool", "content": "5"},
        {"role": "system", "content": "sneaky"},
    ]))

    assert found == {
        "messages[0].content": "Field required: a user message needs content",
        "messages[1].tool_call_id": "only a tool message answers a call",
        "messages[2].content": "an assistant message needs content or tool_calls",
        "messages[3].tool_calls[0].server": "must name a server in mcp_servers",
        "messages[4].tool_call_id": "Field required: a tool message names the call it answers",
        "messages[5].role": "Input should be 'user', 'assistant' or 'tool'",
    }


def test_model_settings_labels_and_the_output_schema_are_bounded() -> None:
    found = problems(spec_with(
        model_settings={"temperature": 2.5, "top_p": -0.1, "max_output_tokens": 0, "stop": ["a", "b", "c", "d", "e"],
                        "seed": "7", "tool_choice": "always", "parallel_tool_calls": 1, "top_k": 3},
        labels={"Tenant": "acme", "user": "u" * 257, **{f"k{i}": "v" for i in range(15)}},
        output_schema={"type": "objekt"},
    ), Admission(Catalog.empty(), allow_inline=True))

    assert set(found) == {
        "model_settings.temperature", "model_settings.top_p", "model_settings.max_output_tokens",
        "model_settings.stop", "model_settings.seed", "model_settings.tool_choice",
        "model_settings.parallel_tool_calls", "model_settings.top_k", "labels.Tenant", "labels.user",
    }
    assert found["model_settings.top_k"] == "unknown field"
    # Whether it is a JSON Schema at all is checked at admission, after the byte bound (shared/catalog.py).
    invalid = problems(spec_with(output_schema={"type": "objekt"}), Admission(Catalog.empty(), allow_inline=True))
    assert list(invalid) == ["output_schema"]
    assert invalid["output_schema"].startswith("is not a valid JSON Schema (Draft 2020-12) at type:")
    assert problems(spec_with(labels={f"k{i}": "v" for i in range(17)})) == {"labels": "has 17 labels; at most 16"}
    assert problems(spec_with(output_schema={"properties": {"a": {"$ref": "https://example.com/s.json"}}})) == {
        "output_schema": "refers outside itself ('https://example.com/s.json'): only local references ('#/...') "
                         "are allowed"}


def test_the_spec_settings_go_over_the_catalog_defaults_and_a_cap_fills_in_max_output_tokens() -> None:
    catalog = Catalog.parse({"models": {"fast": {
        "provider": "openai", "base_url": "http://127.0.0.1:9/v1", "model": "m",
        "defaults": {"temperature": 0.2, "seed": 7}, "caps": {"max_output_tokens": 512, "temperature": 1.0}}}})
    admission = Admission(catalog)

    admitted = admission.admit(RunSpec.parse({"input": "x", "model": "fast", "model_settings": {"temperature": 0.9},
                                              "output_schema": {"type": "object"}}))

    settings = model_settings(admitted)
    assert (settings.temperature, settings.seed, settings.max_output_tokens) == (0.9, 7, 512)
    assert settings.output_schema == {"type": "object"}
    assert admitted.model_name == "fast"


def test_a_setting_above_the_catalog_cap_is_refused_naming_both() -> None:
    catalog = Catalog.parse({"models": {"fast": {
        "provider": "openai", "base_url": "http://127.0.0.1:9/v1", "model": "m", "caps": {"max_output_tokens": 512}}}})

    found = problems({"input": "x", "model": "fast", "model_settings": {"max_output_tokens": 4096}}, Admission(catalog))

    assert found == {"model_settings.max_output_tokens": "is 4096; the catalog model 'fast' caps it at 512 "
                                                         "(models.fast.caps.max_output_tokens)"}


def test_a_catalog_default_above_its_own_cap_or_an_unknown_setting_is_refused() -> None:
    model = {"provider": "openai", "base_url": "http://127.0.0.1:9/v1", "model": "m"}
    with pytest.raises(ConfigError, match=r"models\.fast\.defaults\.max_output_tokens"):
        Catalog.parse({"models": {"fast": {**model, "defaults": {"max_output_tokens": 900},
                                           "caps": {"max_output_tokens": 512}}}})
    with pytest.raises(ConfigError, match=r"models\.fast\.caps\.seed: unknown field"):
        Catalog.parse({"models": {"fast": {**model, "caps": {"seed": 1}}}})


def test_history_instructions_and_the_output_schema_are_held_to_the_settings_bounds() -> None:
    admission = Admission(Catalog.empty(), allow_inline=True, max_input_chars=10, max_messages=3,
                          max_history_chars=20, max_output_schema_bytes=40, max_argument_chars=100)
    big_call = {**call("c1"), "arguments": {"a": "x" * 200}}

    found = problems(spec_with(
        instructions="x" * 11,
        messages=[{"role": "user", "content": "y" * 15}, {"role": "assistant", "tool_calls": [big_call]},
                  {"role": "tool", "tool_call_id": "c1", "content": "5"}, {"role": "assistant", "content": "z"}],
        output_schema={"type": "object", "properties": {"answer": {"type": "string"}}},
    ), admission)

    assert found == {
        "instructions": "is 11 characters; the limit is 10 (RUNBRAKE_MAX_INPUT_CHARS)",
        "messages": "holds 225 characters; the limit is 20 (RUNBRAKE_MAX_HISTORY_CHARS)",
        "messages[1].tool_calls[0].arguments": "is 208 characters as JSON; the limit is 100 "
                                               "(RUNBRAKE_MAX_ARGUMENT_CHARS)",
        "output_schema": "is 59 bytes; the limit is 40 (RUNBRAKE_MAX_OUTPUT_SCHEMA_BYTES)",
    }
    assert problems(spec_with(messages=[{"role": "user", "content": "a"}] * 4), admission) == {
        "messages": "has 4 messages; the limit is 3 (RUNBRAKE_MAX_MESSAGES)"}


def test_a_history_call_to_a_tool_outside_the_catalog_allowlist_is_refused() -> None:
    catalog = Catalog.parse({"mcp_servers": {"calc": {"url": "http://127.0.0.1:9/mcp", "tools": ["get-sum"]}}})

    found = problems({"input": "x", "model": SCRIPTED, "mcp_servers": ["calc"], "messages": [
        {"role": "assistant", "tool_calls": [call("c1", tool="rm")]}, {"role": "tool", "tool_call_id": "c1",
                                                                        "content": "done"}]}, Admission(catalog))

    assert found == {"messages[0].tool_calls[0].tool": "calc allows only get-sum"}


@pytest.mark.parametrize(("given", "separator", "labels"), [
    (["tenant=acme", "user=u:1=2"], "=", {"tenant": "acme", "user": "u:1=2"}),
    (["tenant:acme", "env:"], ":", {"tenant": "acme", "env": ""}),
    ([], ":", {}),
])
def test_label_filters_split_at_the_first_separator(given: list[str], separator: str, labels: dict[str, str]) -> None:
    assert parse_label_filters(given, separator=separator) == labels


def test_malformed_label_filters_are_refused_each_by_position() -> None:
    with pytest.raises(SpecError) as raised:
        parse_label_filters(["tenant", "Tenant:acme", "a:b", "a:c", f"k:{'v' * 257}"], separator=":")

    assert [p.field for p in raised.value.problems] == ["label[0]", "label[1]", "label[3]", "label[4]"]


@pytest.mark.anyio
async def test_an_answer_is_checked_as_json_against_the_schema() -> None:
    check = AnswerCheck({"type": "object", "required": ["city"], "properties": {"city": {"type": "string"}}},
                        within_s=30)

    assert (await check.check('{"city": "Oslo"}')).value == {"city": "Oslo"}
    assert (await check.check('```json\n{"city": "Oslo"}\n```')).value == {"city": "Oslo"}
    assert (await check.check('{"city": 7}')).problem == "at /city: 7 is not of type 'string'"
    assert (await check.check("Oslo")).problem is not None
    assert (await check.check(None)).problem is not None
    dangling = (await AnswerCheck({"$ref": "#/$defs/missing"}, within_s=30).check("{}")).problem
    assert dangling is not None
    assert dangling.startswith("the output schema has a reference to nothing")


@pytest.mark.anyio
async def test_the_worker_counts_each_model_calls_tokens_by_model_and_kind() -> None:
    subscriber = MetricsSubscriber(store=None)  # type: ignore[arg-type]  # read only for cancelled steps

    def counted(kind: str) -> float:
        return REGISTRY.get_sample_value("runbrake_model_tokens_total", {"model": "metrics-test", "kind": kind}) or 0.0

    before = counted("input"), counted("output")
    for tokens in ((200, 30), (321, 42)):
        await subscriber.after_step("0" * 32, RunStep(kind=StepKind.MODEL, round=1, content="x", detail={
            "model": "metrics-test", "usage": {"input_tokens": tokens[0], "output_tokens": tokens[1]}}))

    assert (counted("input") - before[0], counted("output") - before[1]) == (521, 72)


def test_the_catalog_describes_a_models_defaults_and_caps() -> None:
    catalog = Catalog.parse({"models": {"fast": {
        "provider": "openai", "base_url": "http://127.0.0.1:9/v1", "model": "m",
        "defaults": {"temperature": 0.2}, "caps": {"max_output_tokens": 512}}}})

    shown = catalog.describe({})["models"]["fast"]

    assert (shown["defaults"], shown["caps"]) == ({"temperature": 0.2}, {"max_output_tokens": 512})
