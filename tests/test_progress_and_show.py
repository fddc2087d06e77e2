"""MCP progress of the call in flight (docs/http-api.md, "Events"), and what ``runbrake show`` prints about
a run in flight or waiting for approval, in English and German."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from runbrake.shared import AsyncRunStore, RunStatus, RunStep, RunStore, Settings, StepKind
from runbrake.shared.messaging.producer import Producer
from runbrake.worker.conversation import ToolCall
from runbrake.worker.progress import ProgressReporter
from tests.mcp_helpers import Toolbox, wait_for_event
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
async def test_progress_writes_are_rate_limited_per_call_and_none_lands_after_the_call_ended(
    store: RunStore, settings: Settings
) -> None:
    run_id = store.create(valid_spec()).run_id
    store.claim(run_id, "w", lease_s=60)
    now = [100.0]
    async_store = AsyncRunStore.connect(settings)
    subscriber = store.redis.pubsub(ignore_subscribe_messages=True)
    subscriber.subscribe(store.keys.events)
    try:
        reporter = ProgressReporter(async_store, run_id, clock=lambda: now[0])
        report = reporter.for_call(ToolCall(id="c1", server="s", tool="t"))
        for done in range(1, 6):  # five reports inside one 2 s window: one write
            await report(done, 10, f"step {done}")
        first = store.get(run_id).progress
        now[0] += 2.05
        await report(6, 10, None)
        second = store.get(run_id).progress
        await reporter.call_ended()
        now[0] += 1
        await report(7, 10, "too late")
        messages = _progress_messages(subscriber)
    finally:
        subscriber.close()
        await async_store.aclose()

    assert first is not None
    assert (first["progress"], first["message"]) == (1, "step 1")
    assert second is not None
    assert (second["progress"], second["message"]) == (6, None)
    assert store.get(run_id).progress is None
    assert [m["progress"]["progress"] for m in messages] == [1, 6]


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
