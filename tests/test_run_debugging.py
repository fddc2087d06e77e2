"""Debugging a run over HTTP (docs/http-api.md, "What a model call received" and "Runs: reading"): what each
model call was sent, rebuilt from the run's record and compared with what a real model endpoint received
(PyPI ``llm-mock-api``), and the list searched by text and by creation time, on a real ``runbrake serve``
with the real Redis."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx2
import jsonschema
import pytest

from runbrake.shared import RunStatus, RunStep, RunStore, StepKind
from tests.api_helpers import ApiProcess
from tests.catalog_helpers import add_to_catalog
from tests.llm_mock import LlmMock, reply
from tests.mcp_helpers import Toolbox
from tests.test_cli import valid_spec
from tests.worker_helpers import WorkerProcess, wait_for_run

pytestmark = pytest.mark.integration

HTTP_API = Path(__file__).parent.parent / "docs" / "http-api.md"


def sent_to_the_model(message: dict[str, Any]) -> tuple[Any, ...]:
    """An OpenAI chat message as the model endpoint received it: role, text, the calls (name, arguments) and
    the call it answers."""
    calls = tuple((c["function"]["name"], json.loads(c["function"]["arguments"]))
                  for c in message.get("tool_calls") or [])
    return message["role"], message.get("content") or None, calls, message.get("tool_call_id")


def shown_by_the_api(message: dict[str, Any]) -> tuple[Any, ...]:
    calls = tuple((f"{c['server']}__{c['tool']}", c["arguments"]) for c in message.get("tool_calls") or [])
    return message["role"], message.get("content") or None, calls, message.get("tool_call_id")


def messages_schema() -> dict[str, Any]:
    """The JSON Schema of what a model call received, as docs/http-api.md states it."""
    blocks = HTTP_API.read_text(encoding="utf-8").split("```json\n")[1:]
    schema: dict[str, Any] = next(json.loads(b.split("```")[0]) for b in blocks if "urn:runbrake:http:messages" in b)
    return schema


def test_each_model_call_shows_the_messages_the_model_received_with_settings_attempts_and_usage(
    api: ApiProcess, worker: WorkerProcess, llm_mock: LlmMock, toolbox_http: Toolbox, store: RunStore,
) -> None:
    llm_mock.server.when("sum").reply(reply(tools=[("toolbox__get-sum", {"a": 2, "b": 3}, "call_1")],
                                            usage=(120, 20))).times(1)
    llm_mock.server.when_tool_result("call_1").reply(reply("It is 5.", usage=(160, 5)))
    add_to_catalog({"toolbox": toolbox_http.spec}, models={"mock": {
        "provider": "openai", "base_url": llm_mock.openai_url, "model": "gpt-mock"}})
    asked = {"input": "What is the sum of 2 and 3?", "model": "mock", "mcp_servers": ["toolbox"],
             "instructions": "Use the tools.", "model_settings": {"temperature": 0.2, "seed": 7},
             "messages": [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi."}]}
    run_id = httpx2.post(f"{api.url}/v1/runs", json=asked).json()["run_id"]
    record = wait_for_run(store, run_id)
    assert record.status is RunStatus.COMPLETED, record.error
    model_steps = [s.sequence for s in record.steps if s.kind is StepKind.MODEL]
    tool_step = next(s.sequence for s in record.steps if s.kind is StepKind.TOOL)

    views = [httpx2.get(f"{api.url}/v1/runs/{run_id}/steps/{seq}/messages") for seq in model_steps]
    assert [view.status_code for view in views] == [200, 200], [view.text for view in views]
    received = [body["messages"] for body in llm_mock.bodies()]
    assert len(received) == 2
    for view, sent in zip(views, received, strict=True):
        assert [shown_by_the_api(m) for m in view.json()["messages"]] == [sent_to_the_model(m) for m in sent]
    for view in views:
        jsonschema.validate(view.json(), messages_schema())
    second = views[1].json()
    assert [m["role"] for m in second["messages"]] == ["system", "user", "assistant", "user", "assistant", "tool"]
    assert second["messages"][-1]["content"] == "5"  # the tool's whole result, as the model got it
    assert (second["sequence"], second["round"], second["model"], second["omitted"]) == (model_steps[1], 2,
                                                                                         "mock", 0)
    assert second["settings"] == {"temperature": 0.2, "seed": 7}

    # A tool step was sent nothing; a step the run does not have, and a malformed one, are named.
    not_model = httpx2.get(f"{api.url}/v1/runs/{run_id}/steps/{tool_step}/messages")
    assert not_model.status_code == 422
    assert not_model.json()["errors"][0]["loc"] == ["path", "sequence"]
    assert httpx2.get(f"{api.url}/v1/runs/{run_id}/steps/99/messages").status_code == 404
    assert httpx2.get(f"{api.url}/v1/runs/{run_id}/steps/0/messages").status_code == 422
    assert httpx2.get(f"{api.url}/v1/runs/{'0' * 32}/steps/1/messages").status_code == 404


def test_a_long_conversation_shows_its_last_messages_each_text_cut_and_says_so(
    api: ApiProcess, store: RunStore
) -> None:
    run_id = store.create(valid_spec()).run_id
    for round_number in range(1, 251):
        content = "y" * 25_000 if round_number == 249 else f"answer {round_number}"
        store.append_step(run_id, RunStep(kind=StepKind.MODEL, round=round_number, content=content))
    last = store.get(run_id).steps[-1].sequence

    view = httpx2.get(f"{api.url}/v1/runs/{run_id}/steps/{last}/messages")
    assert view.status_code == 200, view.text
    body = view.json()
    # The input and 249 answers before the last call: the last 200 are shown, the 50 before counted.
    assert (len(body["messages"]), body["omitted"]) == (200, 50)
    assert body["messages"][-2] == {"role": "assistant", "content": "answer 248"}
    assert body["messages"][-1] == {"role": "assistant", "content": "y" * 20_000,
                                    "content_truncated": {"chars": 25_000}}
    jsonschema.validate(body, messages_schema())


@pytest.mark.parametrize("settings", ["single", "cluster"], indirect=True)  # tests/cluster_helpers.py
def test_the_list_is_searched_by_text_and_by_creation_time(api: ApiProcess, store: RunStore) -> None:
    spec = valid_spec()
    weather = store.create({**spec, "input": "What is the WEATHER in Oslo?"}).run_id
    invoice = store.create({**spec, "input": "Summarise invoice 4711", "labels": {"team": "billing"}}).run_id
    other = store.create(spec).run_id
    created = {run_id: store.get(run_id).created_at for run_id in (weather, invoice, other)}

    def listed(**params: Any) -> list[str]:
        answer = httpx2.get(f"{api.url}/v1/runs", params=params)
        assert answer.status_code == 200, answer.text
        return [r["run_id"] for r in answer.json()["runs"]]

    assert listed(q="weather") == [weather]  # the input's start, in any case
    assert listed(q="team=BILL") == [invoice]  # a label
    assert listed(q=invoice[:10]) == [invoice]  # the run id
    assert listed(q="nothing like it") == []
    assert listed(since=created[invoice], until=created[invoice]) == [invoice]  # both ends included
    assert listed(since=created[invoice]) == [other, invoice]
    # ISO 8601 here names a microsecond; the stored time has more digits, so the next microsecond up holds it.
    iso = (datetime.fromtimestamp(created[invoice], tz=UTC) + timedelta(microseconds=1)).isoformat()
    assert listed(until=iso) == [invoice, weather]
    assert listed(q="IS", since=created[invoice]) == [other, invoice]  # "What is 2 + 3?", "Summarise …"
    assert listed(q="weather", since=created[invoice]) == []

    for params, field in [({"since": "2026-12-05T14:00:00"}, "since"), ({"until": "yesterday"}, "until"),
                          ({"since": "nan"}, "since"), ({"q": "x" * 201}, "q"),
                          ({"since": created[other], "until": created[weather]}, "until")]:
        refused = httpx2.get(f"{api.url}/v1/runs", params=params)
        assert refused.status_code == 422, (params, refused.text)
        assert refused.json()["errors"][0]["loc"] == ["query", field], params
    unknown = httpx2.get(f"{api.url}/v1/runs", params={"search": "weather"})
    assert unknown.status_code == 422
    assert "q, root, since, status, thread, until" in unknown.json()["errors"][0]["msg"]
