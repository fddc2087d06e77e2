"""Continue a finished run, and threads (issue 18, item 2; docs/usage.md, "Continue a finished run"): a new run
carries on its parent's conversation, which OpenAI's and Anthropic's endpoints (llm-mock-api, tests/llm_mock.py)
accept as it is sent: every tool call answered, in order, a cut-off one answered as cancelled."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

import httpx2
import pytest

from runbrake.broker import Client
from runbrake.shared import RunStatus, RunStore, TerminationReason
from runbrake.shared.messaging.cancel import CancelPublisher, cancel_run
from runbrake.shared.messaging.producer import Producer
from runbrake.shared.spec import RunSpec
from runbrake.shared.threads import ThreadLink
from tests.api_helpers import ApiProcess
from tests.catalog_helpers import add_to_catalog
from tests.llm_mock import LlmMock, reply
from tests.mcp_helpers import Toolbox, wait_for_event
from tests.polling import poll_until
from tests.test_cli import runbrake
from tests.test_tenants import client, write_tenant_tokens
from tests.worker_helpers import WorkerProcess, wait_for_run

pytestmark = pytest.mark.integration

WAIT_S = 60.0
"""Generous: the machine is shared; nothing here is timed."""


def catalog(mock: LlmMock, toolbox: Toolbox) -> None:
    add_to_catalog({"toolbox": toolbox.spec}, models={
        "gpt": {"provider": "openai", "base_url": mock.openai_url, "model": "gpt-mock"},
        "claude": {"provider": "anthropic", "base_url": mock.anthropic_url, "model": "claude-mock"}})


def scripted(content: str = "ok", **fields: Any) -> dict[str, Any]:
    return {"input": "hello", "model": {"provider": "scripted", "turns": [{"content": content}]}, **fields}


def finished(producer: Producer, store: RunStore, spec: dict[str, Any]) -> str:
    run_id = producer.enqueue(RunSpec.parse(spec)).run_id
    assert wait_for_run(store, run_id, timeout=WAIT_S).status is RunStatus.COMPLETED
    return run_id


def openai_conversation(body: dict[str, Any]) -> list[tuple[str, Any]]:
    """The roles and what each message says: its text, its calls' ids, or the call it answers."""
    said: list[tuple[str, Any]] = []
    for message in body["messages"]:
        if message.get("tool_calls"):
            said.append((message["role"], [c["id"] for c in message["tool_calls"]]))
        elif message["role"] == "tool":
            said.append(("tool", (message["tool_call_id"], message["content"])))
        else:
            said.append((message["role"], message["content"]))
    return said


def anthropic_conversation(body: dict[str, Any]) -> list[tuple[str, Any]]:
    """The same for a Messages body: text, tool_use ids, tool_result ids with their text."""
    said: list[tuple[str, Any]] = []
    for message in body["messages"]:
        blocks = message["content"] if isinstance(message["content"], list) else [
            {"type": "text", "text": message["content"]}]
        for block in blocks:
            if block["type"] == "text":
                said.append((message["role"], block["text"]))
            elif block["type"] == "tool_use":
                said.append((message["role"], ("tool_use", block["id"])))
            elif block["type"] == "tool_result":
                content = block["content"]
                text = content if isinstance(content, str) else "".join(part["text"] for part in content)
                said.append((message["role"], ("tool_result", block["tool_use_id"], text)))
    return said


def test_a_continue_of_a_completed_openai_run_sends_its_whole_conversation_then_the_new_input(
    llm_mock: LlmMock, toolbox_http: Toolbox, worker: WorkerProcess, api: ApiProcess, store: RunStore,
    producer: Producer,
) -> None:
    catalog(llm_mock, toolbox_http)
    llm_mock.server.when("2 + 3").reply(reply(tools=[("toolbox__get-sum", {"a": 2, "b": 3}, "call_1")])).times(1)
    llm_mock.server.when_tool_result("call_1").reply(reply("It is 5.")).times(1)
    parent = finished(producer, store, {"input": "What is 2 + 3?", "model": "gpt", "mcp_servers": ["toolbox"],
                                        "instructions": "Be brief.", "labels": {"team": "acme"}})
    llm_mock.server.when("times 2").reply(reply("It is 10.")).first()

    with Client(api.url) as http:
        answer = http.continue_run(parent, "And times 2?")
    assert (answer["created"], answer["status"]) == (True, "queued")
    record = wait_for_run(store, answer["run_id"], timeout=WAIT_S)

    assert (record.status, record.output) == (RunStatus.COMPLETED, "It is 10.")
    assert (record.parent_run_id, record.thread, dict(record.labels)) == (parent, parent, {"team": "acme"})
    assert record.instructions == "Be brief."
    assert openai_conversation(llm_mock.bodies()[-1]) == [
        ("system", "Be brief."), ("user", "What is 2 + 3?"), ("assistant", ["call_1"]), ("tool", ("call_1", "5")),
        ("assistant", "It is 5."), ("user", "And times 2?")]
    shown = httpx2.get(f"{api.url}/v1/runs/{answer['run_id']}").json()
    assert (shown["parent_run_id"], shown["thread"]) == (parent, parent)
    assert httpx2.get(f"{api.url}/v1/runs/{parent}").json()["parent_run_id"] is None


def test_a_continue_of_a_run_cancelled_mid_tool_call_answers_the_cut_off_call_and_the_one_never_made(
    llm_mock: LlmMock, toolbox_http: Toolbox, start_worker: Callable[..., WorkerProcess], store: RunStore,
    producer: Producer, publisher: CancelPublisher,
) -> None:
    """Anthropic refuses a tool_use without its tool_result: the slow call cut off by the cancel keeps its
    cancelled result, and the call after it (never started: one call at a time) is answered as cancelled."""
    start_worker(RUNBRAKE_MAX_PARALLEL_TOOL_CALLS="1")
    catalog(llm_mock, toolbox_http)
    llm_mock.server.when("slow sum").reply(reply(tools=[("toolbox__slow", {"seconds": 60}, "toolu_slow"),
                                                        ("toolbox__get-sum", {"a": 1, "b": 2}, "toolu_sum")])).times(1)
    parent = producer.enqueue(RunSpec.parse({"input": "a slow sum", "model": "claude",
                                             "mcp_servers": ["toolbox"]})).run_id
    wait_for_event(toolbox_http.events, "started", tool="slow", timeout=WAIT_S)
    assert cancel_run(store, publisher, parent, reason="enough", requested_by="test").won
    assert wait_for_run(store, parent, timeout=WAIT_S).status is RunStatus.CANCELLED
    llm_mock.server.when("go on").reply(reply("Going on.")).first()

    cli = runbrake("continue", parent, "go on", "--json")

    assert cli.returncode == 0, cli.stderr
    child = json.loads(cli.stdout)
    assert (child["status"], child["created"]) == ("queued", True)
    record = wait_for_run(store, child["run_id"], timeout=WAIT_S)
    assert (record.status, record.output, record.parent_run_id) == (RunStatus.COMPLETED, "Going on.", parent)
    said = anthropic_conversation(llm_mock.bodies()[-1])
    assert said[0] == ("user", "a slow sum")
    assert said[1:3] == [("assistant", ("tool_use", "toolu_slow")), ("assistant", ("tool_use", "toolu_sum"))]
    (_, (_, slow_id, slow_text)), (_, (_, sum_id, sum_text)) = said[3:5]
    assert (slow_id, sum_id) == ("toolu_slow", "toolu_sum")
    assert "cancel" in slow_text.lower()
    assert sum_text == "cancelled: the call was not made; the run ended cancelled (cancelled) before it"
    assert said[-1] == ("user", "go on")


def test_a_continue_of_a_continue_is_a_thread_of_three_listed_from_any_members_root(
    worker: WorkerProcess, api: ApiProcess, store: RunStore, producer: Producer,
) -> None:
    root = finished(producer, store, scripted("first", labels={"team": "t"}))
    with Client(api.url) as http:
        second = http.continue_run(root, "again", model={"provider": "scripted", "turns": [{"content": "second"}]})
        assert wait_for_run(store, second["run_id"], timeout=WAIT_S).status is RunStatus.COMPLETED
        third = http.continue_run(second["run_id"], "once more",
                                  model={"provider": "scripted", "turns": [{"content": "third"}]})
        last = wait_for_run(store, third["run_id"], timeout=WAIT_S)
        producer.enqueue(RunSpec.parse(scripted("not in the thread")))

        assert (last.parent_run_id, last.thread) == (second["run_id"], root)
        assert [m["content"] for m in last.request["messages"]] == ["hello", "first", "again", "second"]
        members = [root, second["run_id"], third["run_id"]]
        for member in members:
            thread = store.get(member).thread
            assert [r["run_id"] for r in http.runs(thread=thread)["runs"]] == members
        listed = http.runs(thread=root)
    assert [r["parent_run_id"] for r in listed["runs"]] == [None, root, second["run_id"]]
    assert listed["next_cursor"] is None
    cli = runbrake("runs", "--thread", root, "--json")
    assert cli.returncode == 0, cli.stderr
    assert [r["run_id"] for r in json.loads(cli.stdout)] == members
    shown = runbrake("show", third["run_id"], "--lang", "de")
    assert f"Setzt fort: {second['run_id']}   Verlauf: {root}" in shown.stdout


def test_a_continue_of_a_run_not_finished_is_409_and_exit_1_and_writes_nothing(
    api: ApiProcess, store: RunStore, producer: Producer,
) -> None:
    queued = producer.enqueue(RunSpec.parse(scripted())).run_id  # no worker: it stays queued

    answer = httpx2.post(f"{api.url}/v1/runs/{queued}/continue", json={"input": "more"})

    assert answer.status_code == 409
    assert answer.json()["status"] == "queued"
    assert "only a finished run" in answer.json()["error"]
    cli = runbrake("continue", queued, "more")
    assert cli.returncode == 1
    assert "only a finished run" in cli.stderr
    assert [r.run_id for r in store.recent()] == [queued]


def test_an_unknown_run_is_404_and_exit_1_and_another_tenants_is_404_word_for_word(
    worker: WorkerProcess, start_api: Callable[..., ApiProcess], store: RunStore, tmp_path: Any,
) -> None:
    api = start_api(tokens=write_tenant_tokens(tmp_path / "tenant-tokens.toml"))
    unknown = "0" * 32
    with client(api, "alpha-app") as alpha, client(api, "beta-app") as beta, client(api, "ops") as ops:
        created = alpha.post("/v1/runs", json=scripted()).json()["run_id"]
        assert wait_for_run(store, created, timeout=WAIT_S).status is RunStatus.COMPLETED

        theirs = beta.post(f"/v1/runs/{created}/continue", json={"input": "mine now"})
        missing = beta.post(f"/v1/runs/{unknown}/continue", json={"input": "mine now"})
        own = alpha.post(f"/v1/runs/{created}/continue", json={"input": "go on"})
        by_operator = ops.post(f"/v1/runs/{created}/continue", json={"input": "from ops"})
        beta_sees = beta.get("/v1/runs", params={"thread": created}).json()["runs"]
        alpha_sees = alpha.get("/v1/runs", params={"thread": created}).json()["runs"]

    assert (theirs.status_code, missing.status_code) == (404, 404)
    assert theirs.json()["error"].replace(created, "ID") == missing.json()["error"].replace(unknown, "ID")
    assert (own.status_code, by_operator.status_code) == (201, 201)
    assert store.get(own.json()["run_id"]).labels == {"tenant": "alpha"}
    assert store.get(by_operator.json()["run_id"]).labels == {"tenant": "alpha"}  # the tenant's thread stays its
    assert beta_sees == []
    assert [r["run_id"] for r in alpha_sees] == [created, own.json()["run_id"], by_operator.json()["run_id"]]
    cli = runbrake("continue", unknown, "more")
    assert cli.returncode == 1
    assert "past its retention" in cli.stderr


@pytest.mark.parametrize(("body", "field"), [
    ({"input": ""}, "input"),
    ({"text": "more"}, "input"),
    ({"input": "more", "messages": []}, "messages"),
    ({"input": "more", "max_rounds": 0}, "max_rounds"),
    ({"input": "more", "labels": {"tenant": "x"}}, "labels.tenant"),
])
def test_a_bad_body_is_422_naming_the_field_and_writes_nothing(
    worker: WorkerProcess, api: ApiProcess, store: RunStore, producer: Producer, body: dict[str, Any], field: str,
) -> None:
    parent = finished(producer, store, scripted())

    answer = httpx2.post(f"{api.url}/v1/runs/{parent}/continue", json=body)

    assert answer.status_code == 422, answer.text
    assert field in [e["field"] for e in answer.json()["errors"]]
    assert [r.run_id for r in store.recent()] == [parent]


def test_a_body_that_is_not_an_object_is_422_and_one_too_large_413_and_the_cli_refuses_empty_text_with_2(
    worker: WorkerProcess, start_api: Callable[..., ApiProcess], store: RunStore, producer: Producer,
) -> None:
    api = start_api(RUNBRAKE_MAX_SPEC_BYTES="2048")
    parent = finished(producer, store, scripted())

    listed = httpx2.post(f"{api.url}/v1/runs/{parent}/continue", json=["more"])
    large = httpx2.post(f"{api.url}/v1/runs/{parent}/continue", json={"input": "x" * 4096})
    cli = runbrake("continue", parent, "  ")

    assert (listed.status_code, listed.json()["errors"][0]["loc"]) == (422, ["body"])
    assert large.status_code == 413
    assert cli.returncode == 2
    assert "input" in cli.stderr
    assert [r.run_id for r in store.recent()] == [parent]


def test_a_thread_cannot_grow_past_the_history_bounds(
    worker: WorkerProcess, start_api: Callable[..., ApiProcess], store: RunStore, producer: Producer,
) -> None:
    api = start_api(RUNBRAKE_MAX_MESSAGES="3")
    root = finished(producer, store, scripted())
    second = httpx2.post(f"{api.url}/v1/runs/{root}/continue", json={"input": "more"})
    assert second.status_code == 201  # two messages: the root's input and its answer
    assert wait_for_run(store, second.json()["run_id"], timeout=WAIT_S).status is RunStatus.COMPLETED

    third = httpx2.post(f"{api.url}/v1/runs/{second.json()['run_id']}/continue", json={"input": "and more"})

    assert third.status_code == 422
    [problem] = third.json()["errors"]
    assert problem["field"] == "messages"
    assert "RUNBRAKE_MAX_MESSAGES" in problem["msg"]


def test_the_same_idempotency_key_answers_the_same_continuation_and_sends_nothing_more(
    worker: WorkerProcess, api: ApiProcess, store: RunStore, producer: Producer,
) -> None:
    parent = finished(producer, store, scripted())
    first = httpx2.post(f"{api.url}/v1/runs/{parent}/continue", json={"input": "more"},
                        headers={"Idempotency-Key": "k-1"})
    again = httpx2.post(f"{api.url}/v1/runs/{parent}/continue", json={"input": "more"},
                        headers={"Idempotency-Key": "k-1"})
    other = httpx2.post(f"{api.url}/v1/runs/{parent}/continue", json={"input": "something else"},
                        headers={"Idempotency-Key": "k-1"})

    assert (first.status_code, again.status_code, other.status_code) == (201, 200, 409)
    assert again.json() == {**first.json(), "created": False, "status": again.json()["status"]}


@pytest.mark.parametrize("settings", ["single", "cluster"], indirect=True)  # tests/cluster_helpers.py
def test_a_swept_continuation_leaves_its_threads_index(store: RunStore) -> None:
    """The thread's index is bounded by the retention: the sweeper takes a continuation out of it with the run."""
    kept_a_second = RunStore(store.redis, store.namespace, retention_s=1)
    assert kept_a_second.keys == dataclasses.replace(store.keys, retention_s=1)
    root = store.create(scripted()).run_id
    store.settle(root, RunStatus.COMPLETED, TerminationReason.COMPLETED)
    child = store.create(scripted(), link=ThreadLink(parent_run_id=root, thread=root)).run_id
    assert [r.run_id for r in store.thread(root)] == [root, child]
    assert kept_a_second.settle(child, RunStatus.COMPLETED, TerminationReason.COMPLETED).won

    poll_until(lambda: child in kept_a_second.sweep_expired(), timeout=WAIT_S,
               failure=lambda: f"run {child} was not swept within {WAIT_S:g} s")

    assert [r.run_id for r in store.thread(root)] == [root]
    assert store.redis.exists(store.keys.thread(root, store.keys.shard(child))) == 0
