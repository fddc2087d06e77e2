"""MCP progress of the call in flight (docs/http-api.md, "Events"), and what ``runbrake show`` prints about
a run in flight or waiting for approval, in English and German."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import anyio
import pytest
import redis.asyncio

from runbrake.shared import AsyncRunStore, RunStatus, RunStep, RunStore, Settings, StepKind, ToolResult
from runbrake.shared.messaging.producer import Producer
from runbrake.worker.conversation import ToolCall
from runbrake.worker.progress import ProgressSubscriber
from tests.mcp_helpers import Toolbox, wait_for_event
from tests.polling import poll_until_async
from tests.test_cli import runbrake, valid_spec
from tests.worker_helpers import WorkerProcess, call, spec, wait_for_run

pytestmark = pytest.mark.integration


def test_progress_of_the_call_in_flight_is_kept_shown_and_forgotten_when_its_step_is_recorded(
    worker: WorkerProcess, toolbox_http: Toolbox, producer: Producer, store: RunStore
) -> None:
    run_id = producer.enqueue(spec({"toolbox": toolbox_http.spec},
                                   [{"tool_calls": [call("slow", seconds=30)]}, {"content": "x"}])).run_id
    wait_for_event(toolbox_http.events, "started", tool="slow", timeout=20)

    record = wait_for_run(store, run_id, lambda r: r.progress is not None and (r.progress["progress"] or 0) >= 2)
    shown = runbrake("show", run_id)
    shown_de = runbrake("show", run_id, "--lang", "de")
    as_json = json.loads(runbrake("show", run_id, "--json").stdout)
    assert store.cancel(run_id, reason="enough", requested_by="t").won
    done = wait_for_run(store, run_id, lambda r: any(s.kind is StepKind.TOOL for s in r.steps))

    progress = record.progress or {}
    assert {k: progress[k] for k in ("tool_server", "tool_name", "tool_call_id", "total")} == {
        "tool_server": "toolbox", "tool_name": "slow", "tool_call_id": "call_0_0", "total": 30.0}
    assert progress["message"].endswith("of 30 s")
    assert progress["started_at"] <= progress["updated_at"]
    in_flight = shown.stdout.splitlines()[-1].split()
    assert in_flight[:3] == ["…", "1", "tool"]
    assert "in flight" in shown.stdout
    assert "toolbox.slow:" in in_flight
    assert "läuft" in shown_de.stdout.splitlines()[-1]
    assert as_json["progress"]["tool_call_id"] == "call_0_0"
    assert done.progress is None
    assert json.loads(runbrake("show", run_id, "--json").stdout)["progress"] is None


@pytest.mark.anyio
async def test_only_the_latest_report_of_each_run_is_written_and_none_lands_after_its_calls_step(
    store: RunStore, settings: Settings
) -> None:
    first, second = (store.create(valid_spec()).run_id for _ in range(2))
    for run_id in (first, second):
        store.claim(run_id, "w", lease_s=60)
    call_1, call_2 = ToolCall(id="c1", server="s", tool="t"), ToolCall(id="c2", server="s", tool="t")
    async_store = AsyncRunStore.connect(settings)
    subscriber = store.redis.pubsub(ignore_subscribe_messages=True)
    subscriber.subscribe(store.keys.events)
    progress = ProgressSubscriber(async_store)
    try:
        progress.before_tool_call(first, call_1)
        progress.before_tool_call(second, call_2)
        for done in range(1, 6):  # five reports of each run before a flush: each run's latest is written once
            await progress.on_tool_progress(first, call_1, done, 10, f"step {done}")
            await progress.on_tool_progress(second, call_2, done * 2, 20, None)
        written = await poll_until_async(lambda: all(store.get(r).progress for r in (first, second)), timeout=10,
                                         failure=lambda: "the reports never reached the records")
        # A report on its way when its call's step is recorded lands as nothing: the step closed the call.
        await progress.on_tool_progress(first, call_1, 6, 10, "on its way")
        await progress.on_tool_progress(second, call_2, 12, 20, None)
        store.append_step(first, RunStep.tool(round=1, server="s", name="t", result=ToolResult.ok("x"),
                                              call_id="c1"))
        await poll_until_async(lambda: (store.get(second).progress or {}).get("progress") == 12, timeout=10,
                               failure=lambda: "the second run's report never reached its record")
        messages = _progress_messages(subscriber)
        await progress.after_tool_call(second, call_2)
        await progress.on_tool_progress(second, call_2, 13, 20, "after its end")
    finally:
        subscriber.close()
        await async_store.aclose()

    assert written
    assert [(m["run_id"], m["progress"]["progress"]) for m in messages] == [(first, 5), (second, 10), (second, 12)]
    assert messages[0]["progress"]["message"] == "step 5"
    assert store.get(first).progress is None
    assert store.get(second).progress["progress"] == 12  # type: ignore[index]


@pytest.mark.anyio
async def test_a_calls_end_waits_for_no_round_trip_even_with_every_connection_of_the_store_busy(
    store: RunStore, settings: Settings
) -> None:
    """The end of a cut-off call comes before its step's append, on the cancel's path: it must not queue for a
    connection behind progress writes (issue 29). Here the store's only connection is held by a BLPOP."""
    run_id = store.create(valid_spec()).run_id
    store.claim(run_id, "w", lease_s=60)
    name = f"runbrake-test-{uuid.uuid4().hex[:12]}"
    pool = redis.asyncio.BlockingConnectionPool.from_url(settings.redis_url, max_connections=1, timeout=30,
                                                         client_name=name)
    client = redis.asyncio.Redis.from_pool(pool)
    one = AsyncRunStore(client, settings.namespace)
    progress = ProgressSubscriber(one)
    tool_call = ToolCall(id="c1", server="s", tool="t")
    held = f"{settings.namespace}:test-held"
    try:
        progress.before_tool_call(run_id, tool_call)
        await progress.on_tool_progress(run_id, tool_call, 1, 10, None)
        await poll_until_async(lambda: store.get(run_id).progress, timeout=10,
                               failure=lambda: "the report never reached the record")
        async with anyio.create_task_group() as tasks:
            async def hold() -> None:
                await client.blpop([held], 30)

            tasks.start_soon(hold)
            await poll_until_async(lambda: any(c["name"] == name and c["cmd"] == "blpop"
                                               for c in store.redis.client_list()), timeout=10,
                                   failure=lambda: "the BLPOP never took the store's connection")
            with anyio.fail_after(10):
                await progress.after_tool_call(run_id, tool_call)
            still_held = any(c["name"] == name and c["cmd"] == "blpop" for c in store.redis.client_list())
            store.redis.rpush(held, "go")
    finally:
        store.redis.delete(held)
        await one.aclose()

    assert still_held


def _progress_messages(subscriber: Any, *, quiet_s: float = 0.5) -> list[dict[str, Any]]:
    """The progress messages on the channel, read until it stayed quiet for ``quiet_s`` (a bounded wait)."""
    found = []
    deadline = time.monotonic() + quiet_s
    while time.monotonic() < deadline:
        message = subscriber.get_message(timeout=max(0.0, deadline - time.monotonic()))
        if message is None:
            continue
        data = json.loads(message["data"])
        if data["event"] == "progress":
            found.append(data)
            deadline = time.monotonic() + quiet_s
    return found


def test_show_prints_the_call_a_waiting_run_waits_for_and_speaks_german_throughout(store: RunStore) -> None:
    run_id = store.create(valid_spec()).run_id
    assert store.claim(run_id, "w", lease_s=60).won
    calls = [{"id": "c1", "server": "calc", "tool": "get-sum", "arguments": {"a": 2, "b": 3}}]
    store.append_step(run_id, RunStep(kind=StepKind.MODEL, round=1, detail={"tool_calls": calls}))
    assert store.suspend(run_id, "w", {"messages": [], "model_calls": 1, "pending_calls": calls}).won

    english = runbrake("show", run_id)
    german = runbrake("show", run_id, "--lang", "de")
    as_json = json.loads(runbrake("show", run_id, "--json").stdout)

    assert "Waiting for approval: calc.get-sum {\"a\": 2, \"b\": 3}" in english.stdout
    assert "Status: waiting for approval" in english.stdout
    assert "calls calc.get-sum" in english.stdout
    assert "Wartet auf Freigabe: calc.get-sum {\"a\": 2, \"b\": 3}" in german.stdout
    assert "Status: wartet auf Freigabe" in german.stdout
    assert "gestartet:" in german.stdout
    assert "beendet:" in german.stdout
    assert "ruft auf calc.get-sum" in german.stdout
    assert german.stdout.startswith(f"Lauf {run_id}")
    for english_word in ("started:", "finished:", "waiting_for_approval", " calls "):
        assert english_word not in german.stdout
    assert as_json["pending_call"] == {"tool_server": "calc", "tool_name": "get-sum", "tool_call_id": "c1",
                                       "arguments": {"a": 2, "b": 3}, "arguments_text": '{"a": 2, "b": 3}'}

    assert store.cancel(run_id, reason="nein", requested_by="ops").won
    cancelled = runbrake("show", run_id, "--lang", "de").stdout
    assert "Status: abgebrochen   Grund: abgebrochen" in cancelled
    assert "Abgebrochen: 'nein' von ops am" in cancelled
    assert store.get(run_id).status is RunStatus.CANCELLED
    assert json.loads(runbrake("show", run_id, "--json").stdout)["pending_call"] is None


def test_a_pending_call_with_huge_arguments_is_cut_in_show_and_pending_call(store: RunStore) -> None:
    run_id = store.create(valid_spec()).run_id
    store.claim(run_id, "w", lease_s=60)
    calls = [{"id": "c1", "server": "calc", "tool": "get-sum", "arguments": {"text": "x" * 20_000}}]
    store.suspend(run_id, "w", {"messages": [], "model_calls": 1, "pending_calls": calls})

    pending = json.loads(runbrake("show", run_id, "--json").stdout)["pending_call"]

    assert pending["arguments"] is None
    assert len(pending["arguments_text"]) == 4000
    assert pending["arguments_text"].endswith("…")
