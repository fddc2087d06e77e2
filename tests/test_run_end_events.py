"""The events that end a run carry its answer (issue 30, item 2; docs/messages.md, "Run events: the body"):
``run.completed``, ``run.failed`` and ``run.cancelled`` on RabbitMQ, to webhooks, as the SSE ``status`` event
and on ``GET /v1/events`` carry ``output``, ``output_json``, ``usage`` and ``error`` as ``GET /v1/runs/{id}``
names them, a long answer cut to ``EVENT_OUTPUT_CHARS`` with ``output_truncated``; and a run's event stream
ends right after its terminal status, the steps of what a cancel cut off sent before it (item 4;
docs/http-api.md, "Events").
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2
import jsonschema
import pytest

from runbrake.broker import Client
from runbrake.shared import RunStatus, RunStep, RunStore, Settings, StepKind, TerminationReason, ToolResult
from runbrake.shared.messaging.producer import Producer
from runbrake.shared.messaging.wire import encode_run_event
from runbrake.shared.run_end import EVENT_OUTPUT_CHARS
from tests.api_helpers import ApiProcess
from tests.events_helpers import assert_valid_bodies, events_queue, feed, frames, take_events
from tests.polling import poll_until
from tests.webhook_helpers import Receiver, cataloged_receiver
from tests.worker_helpers import WorkerProcess, spec, wait_for_run

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parent.parent
SECRET_ENV = "RUNBRAKE_TEST_WEBHOOK_SECRET"
SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}, "sources": {"type": "array"}},
          "required": ["answer", "sources"]}
LONG = "é" * (EVENT_OUTPUT_CHARS + 100)


@pytest.fixture
def receiver(namespace: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Receiver]:
    """A receiver on a free port behind the catalog's webhook ``ends`` (the events that end a run)."""
    with cataloged_receiver(monkeypatch.setenv, SECRET_ENV, ends=["run.completed", "run.failed"]) as hook:
        yield hook


def _status_schema() -> Any:
    """The JSON Schema of a status event's data, as docs/http-api.md states it."""
    blocks = (REPO / "docs" / "http-api.md").read_text(encoding="utf-8").split("```json\n")[1:]
    return next(json.loads(b.split("```")[0]) for b in blocks if "urn:runbrake:http:status" in b)


def _end(record_json: dict[str, Any]) -> dict[str, Any]:
    """What an event that ends the run must carry, from ``GET /v1/runs/{id}``'s answer (not truncated)."""
    return {"output": record_json["output"], "output_json": record_json["output_json"], "output_truncated": False,
            "usage": record_json["usage"], "error": record_json["error"]}


def _subset(expected: dict[str, Any], body: dict[str, Any]) -> dict[str, Any]:
    return {key: body.get(key, "<absent>") for key in expected}


def _feed_status(api: ApiProcess, after: str, run_id: str, status: str) -> dict[str, Any]:
    """The status event ``GET /v1/events`` replays after the event id ``after`` for this run and status."""
    with feed(api, after) as response:
        for event in frames(response):
            if event.event == "status" and event.data["run_id"] == run_id and event.data["status"] == status:
                return event.data
    pytest.fail(f"the feed ended without {run_id}'s {status}")


@pytest.mark.timeout(180)
def test_a_completed_runs_answer_and_usage_reach_rabbitmq_webhooks_the_run_stream_and_the_feed(
    receiver: Receiver, worker: WorkerProcess, api: ApiProcess, producer: Producer, store: RunStore,
    rabbitmq: Settings,
) -> None:
    # The receiver first: the worker, started after it, has the webhook's secret in its environment.
    with events_queue(rabbitmq, "run.*") as queue:
        answered = producer.enqueue(spec({}, [{"content": '{"answer": 5, "sources": []}'}], output_schema=SCHEMA,
                                         notify=["ends"])).run_id
        long = producer.enqueue(spec({}, [{"content": LONG}], notify=["ends"])).run_id
        records = {run_id: wait_for_run(store, run_id, timeout=60) for run_id in (answered, long)}
        events = take_events(rabbitmq, queue, 6, timeout=60)  # queued, running, completed of each
    poll_until(lambda: len(receiver.ids()) >= 2, timeout=60,
               failure=lambda: f"{len(receiver.ids())} of 2 webhook deliveries arrived")

    with Client(api.url) as client:
        shown = {run_id: client.get(run_id) for run_id in records}
        streamed = {run_id: list(client.events(run_id, read_timeout_s=30))[-2] for run_id in records}
    assert {r.status for r in records.values()} == {RunStatus.COMPLETED}

    # The answer with its JSON (an empty list stays a list), as GET /v1/runs/{id} names it, on every channel.
    expected = _end(shown[answered])
    assert expected["output_json"] == {"answer": 5, "sources": []}
    assert expected["usage"]["model_calls"] == 1
    completed = {e.body["run_id"]: e.body for e in events if e.routing_key == "run.completed"}
    queued = {e.body["run_id"]: e.body["event_id"] for e in events if e.routing_key == "run.queued"}
    delivered = {run_id: receiver.of_run(run_id)[-1].body for run_id in records}
    assert _subset(expected, completed[answered]) == expected
    assert _subset(expected, delivered[answered]) == expected
    assert streamed[answered].event == "status"
    jsonschema.Draft202012Validator(_status_schema()).validate(streamed[long].data)
    assert _subset(expected, streamed[answered].data) == expected
    assert _subset(expected, _feed_status(api, queued[answered], answered, "completed")) == expected

    # A long answer is cut, flagged, and whole in GET /v1/runs/{id}.
    assert shown[long]["output"] == LONG
    cut = {**_end(shown[long]), "output": LONG[:EVENT_OUTPUT_CHARS], "output_truncated": True}
    assert _subset(cut, completed[long]) == cut
    assert _subset(cut, delivered[long]) == cut
    assert _subset(cut, streamed[long].data) == cut
    assert_valid_bodies([e.body for e in events])  # docs/messages.md, "Run events: JSON Schema"
    assert receiver.refused == []


CALL = {"id": "c1", "server": "calc", "tool": "slow", "arguments": {}}


def _running(store: RunStore) -> tuple[str, str]:
    """A running run whose first model step asked for a tool call (in flight from then on)."""
    run_id = store.create({"input": "end me"}).run_id
    owner = f"test-{uuid.uuid4().hex[:8]}"
    assert store.claim(run_id, owner, lease_s=60).won
    detail = {"usage": {"input_tokens": 12, "output_tokens": 7}, "tool_calls": [CALL]}
    store.append_step(run_id, RunStep(kind=StepKind.MODEL, round=1, content="thinking", detail=detail))
    return run_id, owner


def _cut_off(store: RunStore, run_id: str) -> None:
    """Record the call in flight cancelled, as the worker does just after a cancel."""
    store.append_step(run_id, RunStep.tool(round=1, server="calc", name="slow", call_id="c1",
                                           result=ToolResult.cancelled("call to calc.slow was cancelled")))


def _live(client: Client, run_id: str) -> Iterator[Any]:
    """The run's stream, read up to its replayed status (``running``): what comes next is live."""
    stream = client.events(run_id, read_timeout_s=30)
    replayed = next(stream), next(stream)
    assert [e.event for e in replayed] == ["step", "status"]
    assert replayed[1].data["status"] == "running"
    return stream


def test_a_runs_stream_ends_right_after_its_terminal_status_which_carries_its_end(
    api: ApiProcess, store: RunStore,
) -> None:
    completed, owner = _running(store)
    failed, failed_owner = _running(store)
    cancelled, _ = _running(store)
    with Client(api.url) as client:
        streams = {run_id: _live(client, run_id) for run_id in (completed, failed, cancelled)}
        final = RunStep(kind=StepKind.MODEL, round=2, content="It is 5.", detail={"usage": {"input_tokens": 3}})
        store.append_step(completed, final)
        assert store.settle(completed, RunStatus.COMPLETED, TerminationReason.COMPLETED, owner=owner,
                            final=final).won
        assert store.settle(failed, RunStatus.FAILED, TerminationReason.PROVIDER_FAILED, owner=failed_owner,
                            error="the provider answered 503").won
        assert store.cancel(cancelled, reason="enough", requested_by="t").won
        _cut_off(store, cancelled)  # after the cancel: the stream sends it before the status (docs/http-api.md)
        rest = {run_id: list(stream) for run_id, stream in streams.items()}
        shown = {run_id: client.get(run_id) for run_id in streams}
        resumed = list(client.events(cancelled, last_event_id=1))

    for run_id, events in rest.items():
        assert [e.event for e in events] == (["status", "end"] if run_id == failed else ["step", "status", "end"])
        status = events[-2].data
        assert status["status"] == shown[run_id]["status"]
        assert _subset(_end(shown[run_id]), status) == _end(shown[run_id])
    validator = jsonschema.Draft202012Validator(_status_schema())
    for events in rest.values():
        validator.validate(events[-2].data)  # docs/http-api.md, the status event's JSON Schema
    assert rest[completed][-2].data["output"] == "It is 5."
    assert rest[completed][-2].data["usage"] == {"input_tokens": 15, "output_tokens": 7, "total_tokens": 22,
                                                 "model_calls": 2}
    assert rest[failed][-2].data["error"] == "the provider answered 503"
    assert rest[failed][-2].data["output"] is None
    assert rest[cancelled][-2].data["usage"]["model_calls"] == 1
    assert rest[cancelled][0].data["tool_outcome"] == "cancelled"
    assert [(e.event, e.id) for e in resumed] == [("step", "2"), ("status", None), ("end", None)]


def test_the_terminal_status_is_the_streams_last_event_before_end_and_the_server_closes_it_at_once(
    api: ApiProcess, store: RunStore,
) -> None:
    run_id, _ = _running(store)
    with httpx2.stream("GET", f"{api.url}/v1/runs/{run_id}/events",
                       timeout=httpx2.Timeout(30.0)) as response:
        lines = response.iter_lines()
        for line in lines:
            if line == "event: status":
                break
        store.cancel(run_id, reason="enough", requested_by="t")
        _cut_off(store, run_id)
        store.append_step(run_id, RunStep(kind=StepKind.APPROVAL, round=2, content="after the worker let go"))
        after = list(lines)  # to the end of the body: the server closed it

    # The replayed status (running); then the cut-off call, the live status (cancelled), the end, and the end of
    # the body: the step recorded after them is not sent, nor is a keepalive.
    blocks = [block.splitlines() for block in "\n".join(after).split("\n\n") if block.strip()]
    assert [block[0] for block in blocks][1:] == ["id: 2", "event: status", "event: end"]
    assert '"status":"cancelled"' in blocks[2][1]
    assert not any(line.startswith(":") for line in after)


def test_the_end_fields_of_an_outbox_entry_are_checked_and_passed_on_by_the_relay_and_webhooks() -> None:
    run_id = uuid.uuid4().hex
    end = {"output": "ok", "output_json": [], "output_truncated": False, "error": "",
           "usage": {"input_tokens": 1, "output_tokens": 2, "total_tokens": 3, "model_calls": 1, "cost_usd": 0.5}}
    stored = {"event": "status", "run_id": run_id, "status": "completed", "termination_reason": "completed"}

    message = encode_run_event("1-0", run_id, json.dumps({**stored, **end}), "", occurred_at=1.0)
    assert message is not None
    assert {key: json.loads(message.body)[key] for key in end} == end
    for forged in ({"usage": "lots"}, {"output": 5}, {"output": "x" * (EVENT_OUTPUT_CHARS + 1)},
                   {"output_truncated": "no"}, {"usage": {**end["usage"], "model_calls": -1}},
                   {"usage": {**end["usage"], "cost_usd": True}}, {"error": None}):
        assert encode_run_event("1-0", run_id, json.dumps({**stored, **end, **forged}), "", occurred_at=1.0) is None
    # An entry written before the events carried the answer goes out as it is.
    old = encode_run_event("1-0", run_id, json.dumps(stored), "", occurred_at=1.0)
    assert old is not None
    assert "output" not in json.loads(old.body)
