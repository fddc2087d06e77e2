"""Agent runs a backend can ship, end to end (issue 17, items 1 and 2): a real worker process asks an
OpenAI-compatible endpoint nobody here wrote (PyPI ``llm-mock-api``, tests/llm_mock.py) and calls a real MCP
server; what the endpoint received is read back from it, and the run record holds the input, the
instructions, the labels, the model, the answer and its usage."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx2
import pytest

from runbrake.broker import Client
from runbrake.shared import RunStatus, RunStep, RunStore, StepKind, TerminationReason
from runbrake.shared import _store_core as core
from runbrake.shared.messaging.producer import Producer
from runbrake.shared.spec import RunSpec
from tests.api_helpers import ApiProcess
from tests.catalog_helpers import add_to_catalog
from tests.llm_mock import LlmMock, reply
from tests.mcp_helpers import Toolbox
from tests.test_cli import runbrake
from tests.worker_helpers import WorkerProcess, wait_for_run

pytestmark = pytest.mark.integration

HISTORY = [
    {"role": "user", "content": "What is 1 + 1?"},
    {"role": "assistant", "tool_calls": [{"id": "h1", "server": "toolbox", "tool": "get-sum",
                                          "arguments": {"a": 1, "b": 1}}]},
    {"role": "tool", "tool_call_id": "h1", "content": "2"},
    {"role": "assistant", "content": "It is 2."},
]


def agent_spec(mock: LlmMock, toolbox: Toolbox, **fields: Any) -> RunSpec:
    """A run of the catalog model ``mock`` (llm-mock-api, capped at 512 output tokens, temperature 0.3 by
    default) with the catalog server ``toolbox``."""
    add_to_catalog({"toolbox": toolbox.spec}, models={"mock": {
        "provider": "openai", "base_url": mock.openai_url, "model": "gpt-mock",
        "defaults": {"temperature": 0.3}, "caps": {"max_output_tokens": 512}}})
    return RunSpec.parse({"input": "What is 2 + 3?", "model": "mock", "mcp_servers": ["toolbox"], **fields})


def test_instructions_history_and_settings_reach_the_endpoint_and_the_record_holds_answer_and_usage(
    llm_mock: LlmMock, toolbox_http: Toolbox, worker: WorkerProcess, producer: Producer, store: RunStore
) -> None:
    llm_mock.server.when("2 + 3").reply(reply(tools=[("toolbox__get-sum", {"a": 2, "b": 3}, "call_1")],
                                              usage=(200, 30))).times(1)
    llm_mock.server.when_tool_result("call_1").reply(reply("It is 5.", usage=(321, 42)))
    spec = agent_spec(llm_mock, toolbox_http, instructions="Answer in one short sentence.", messages=HISTORY,
                      labels={"team": "acme", "user": "u-7"},
                      model_settings={"top_p": 0.9, "stop": ["END"], "seed": 7, "tool_choice": "auto",
                                      "parallel_tool_calls": False})

    run = producer.enqueue(spec)
    record = wait_for_run(store, run.run_id)

    assert (record.status, record.termination_reason) == (RunStatus.COMPLETED, TerminationReason.COMPLETED)
    first, second = llm_mock.bodies()
    assert [(m["role"], m.get("content")) for m in first["messages"]] == [
        ("system", "Answer in one short sentence."), ("user", "What is 1 + 1?"), ("assistant", None),
        ("tool", "2"), ("assistant", "It is 2."), ("user", "What is 2 + 3?")]
    earlier = first["messages"][2]["tool_calls"][0]
    assert (earlier["id"], earlier["function"]["name"], json.loads(earlier["function"]["arguments"])) == (
        "h1", "toolbox__get-sum", {"a": 1, "b": 1})
    assert first["messages"][3]["tool_call_id"] == "h1"
    # The spec's settings, the catalog's default temperature, and its cap sent as max_tokens.
    for body in (first, second):
        assert {k: body.get(k) for k in ("temperature", "top_p", "max_tokens", "stop", "seed", "tool_choice",
                                         "parallel_tool_calls")} == {
            "temperature": 0.3, "top_p": 0.9, "max_tokens": 512, "stop": ["END"], "seed": 7, "tool_choice": "auto",
            "parallel_tool_calls": False}
    assert [m["role"] for m in second["messages"]][-2:] == ["assistant", "tool"]

    data = store.get(run.run_id).to_dict()
    assert {k: data[k] for k in ("input", "instructions", "labels", "model", "output", "output_json", "usage")} == {
        "input": "What is 2 + 3?", "instructions": "Answer in one short sentence.",
        "labels": {"team": "acme", "user": "u-7"}, "model": "mock", "output": "It is 5.", "output_json": None,
        "usage": {"input_tokens": 521, "output_tokens": 72, "total_tokens": 593, "model_calls": 2},
    }
    model_steps = [s for s in record.steps if s.kind is StepKind.MODEL]
    assert [s.detail["usage"] for s in model_steps] == [
        {"input_tokens": 200, "output_tokens": 30, "total_tokens": 230},
        {"input_tokens": 321, "output_tokens": 42, "total_tokens": 363}]
    assert {s.detail["model"] for s in model_steps} == {"mock"}


ANSWER_SCHEMA = {"type": "object", "required": ["sum"], "properties": {"sum": {"type": "integer"}},
                 "additionalProperties": False}


def test_a_structured_answer_that_does_not_match_is_handed_back_and_the_valid_one_is_the_output_json(
    llm_mock: LlmMock, toolbox_http: Toolbox, worker: WorkerProcess, producer: Producer, store: RunStore
) -> None:
    llm_mock.server.when("2 + 3").reply(reply('{"sum": "five"}', usage=(50, 5))).times(1)
    llm_mock.server.when("does not match the required output schema").reply(reply('{"sum": 5}', usage=(80, 4)))

    run = producer.enqueue(agent_spec(llm_mock, toolbox_http, output_schema=ANSWER_SCHEMA))
    record = wait_for_run(store, run.run_id)

    assert (record.status, record.output, record.output_json) == (RunStatus.COMPLETED, '{"sum": 5}', {"sum": 5})
    first, second = llm_mock.bodies()
    assert first["response_format"] == {"type": "json_schema", "json_schema": {"name": "output",
                                                                               "schema": ANSWER_SCHEMA}}
    assistant, handed_back = second["messages"][-2:]
    assert (assistant["role"], assistant["content"]) == ("assistant", '{"sum": "five"}')
    assert handed_back["role"] == "user"
    assert "at /sum: 'five' is not of type 'integer'" in handed_back["content"]
    invalid, valid = record.steps
    assert invalid.detail["output_error"] == "at /sum: 'five' is not of type 'integer'"
    assert "output_json" not in invalid.detail
    assert valid.detail["output_json"] == {"sum": 5}
    assert record.usage.to_dict() == {"input_tokens": 130, "output_tokens": 9, "total_tokens": 139, "model_calls": 2}


def test_an_answer_that_never_matches_ends_the_run_at_max_rounds(
    llm_mock: LlmMock, toolbox_http: Toolbox, worker: WorkerProcess, producer: Producer, store: RunStore
) -> None:
    llm_mock.server.fallback(reply("not JSON at all"))

    run = producer.enqueue(agent_spec(llm_mock, toolbox_http, output_schema=ANSWER_SCHEMA, max_rounds=2))
    record = wait_for_run(store, run.run_id)

    assert (record.status, record.termination_reason) == (RunStatus.FAILED, TerminationReason.MAX_ROUNDS)
    assert (record.output, record.output_json) == (None, None)
    assert len(llm_mock.bodies()) == 2
    assert all(s.detail["output_error"].startswith("the answer is not JSON") for s in record.steps)


def test_a_model_step_appended_twice_with_one_token_counts_its_usage_once(store: RunStore) -> None:
    """The usage is summed where the step is appended: a write retried after a lost answer (the same token)
    is recorded once and counted once, whichever worker appends it."""
    run_id = store.create(RunSpec.parse({"input": "x", "model": {"provider": "scripted", "turns": [
        {"content": "ok"}]}, "labels": {"team": "acme"}}).raw).run_id
    step = RunStep(kind=StepKind.MODEL, round=1, content="ok",
                   detail={"usage": {"input_tokens": 10, "output_tokens": 3, "total_tokens": 13}})

    for _ in range(2):
        store.execute(core.append_step(store.keys, run_id, step, token="the-one-append"))
    store.execute(core.append_step(store.keys, run_id, RunStep(kind=StepKind.MODEL, round=2, error="boom"),
                                   token="failed-call"))

    record = store.get(run_id)
    assert len(record.steps) == 2
    assert record.usage.to_dict() == {"input_tokens": 10, "output_tokens": 3, "total_tokens": 13, "model_calls": 1}
    assert (record.labels, record.model, record.input_preview) == ({"team": "acme"}, "scripted", "x")


def scripted(labels: dict[str, str]) -> dict[str, Any]:
    return {"input": f"run of {labels}", "model": {"provider": "scripted", "turns": [{"content": "ok"}]},
            "labels": labels}


def test_runs_are_filtered_by_labels_over_the_cli_the_http_api_and_the_client(
    api: ApiProcess, producer: Producer, store: RunStore
) -> None:
    ids = {name: producer.enqueue(RunSpec.parse(scripted(labels))).run_id for name, labels in {
        "acme-u1": {"team": "acme", "user": "u1"}, "acme-u2": {"team": "acme", "user": "u2"},
        "other": {"team": "other", "user": "u1"}, "none": {}}.items()}

    def listed(answer: Callable[[], Any]) -> set[str]:
        return {ids_by_run[run["run_id"]] for run in answer()}

    ids_by_run = {run_id: name for name, run_id in ids.items()}
    cli = runbrake("runs", "--label", "team=acme", "--json")
    assert cli.returncode == 0, cli.stderr
    assert listed(lambda: json.loads(cli.stdout)) == {"acme-u1", "acme-u2"}
    both = runbrake("runs", "--label", "team=acme", "--label", "user=u1", "--json")
    assert listed(lambda: json.loads(both.stdout)) == {"acme-u1"}

    answer = httpx2.get(f"{api.url}/v1/runs", params=[("label", "team:acme"), ("label", "user:u2")])
    assert answer.status_code == 200
    assert listed(lambda: answer.json()["runs"]) == {"acme-u2"}
    with Client(api.url) as client:
        assert listed(lambda: client.runs(labels={"user": "u1"})["runs"]) == {"acme-u1", "other"}
        [summary] = client.runs(labels={"team": "other"})["runs"]
    assert (summary["labels"], summary["input_preview"], summary["model"]) == (
        {"team": "other", "user": "u1"}, "run of {'team': 'other', 'user': 'u1'}", "scripted")
    assert "input" not in summary


def test_a_malformed_label_filter_is_refused_with_exit_2_and_422(api: ApiProcess, store: RunStore) -> None:
    cli = runbrake("runs", "--label", "tenant")
    assert cli.returncode == 2
    assert "--label" in cli.stderr
    assert "KEY=VALUE" in cli.stderr

    answer = httpx2.get(f"{api.url}/v1/runs", params={"label": "Tenant:acme"})
    assert answer.status_code == 422
    assert answer.json()["errors"][0]["loc"] == ["query", "label"]


@pytest.mark.parametrize("path", ["/v1/runs", f"/v1/runs/{'a' * 32}", "/v1/servers", "/healthz", "/v1/schema/run-spec"])
def test_an_unknown_query_parameter_is_422_naming_it_never_ignored(api: ApiProcess, path: str) -> None:
    answer = httpx2.get(f"{api.url}{path}", params={"tenant": "acme"})

    assert answer.status_code == 422
    [error] = answer.json()["errors"]
    assert error["loc"] == ["query", "tenant"]
    assert error["msg"].startswith("unknown query parameter")
