"""Steer and continue requests on RabbitMQ alone (docs/messages.md, "Steer requests", "Continue requests"; issue
30, item 3), from the plain-pika client in a subprocess (tests/clients/request_run.py, ``--door``).

A real worker consumes ``<ns>.steer-requests`` and ``<ns>.continue-requests``, applies each request as its HTTP
route would and answers on the request's direct reply-to; a refused request with nobody to answer lands in the
queue's ``.dead`` twin with the reason. The tenant is the one the catalog gives the ``user_id`` RabbitMQ checked.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from jsonschema import Draft202012Validator

from runbrake.shared import RunSpec, RunStatus, RunStore, Settings, StepKind, ToolOutcome
from runbrake.shared.errors import SpecError
from runbrake.shared.messaging.producer import Producer
from runbrake.shared.messaging.wire import (
    DEAD_REASON_HEADER,
    Topology,
    decode_continue_request,
    decode_steer_request,
)
from tests.amqp_clients import CLIENTS
from tests.mcp_helpers import Toolbox, wait_for_event
from tests.test_tenants import rabbitmq_user, set_catalog
from tests.worker_helpers import WorkerProcess, call, spec, take_messages, wait_for_run

pytestmark = pytest.mark.integration

WAIT_S = 60.0
UNKNOWN = "0" * 32
MESSAGES_DOC = Path(__file__).resolve().parent.parent / "docs" / "messages.md"


def documented(definition: str) -> Draft202012Validator:
    """One definition of docs/messages.md's "Steer and continue requests: JSON Schema"."""
    section = MESSAGES_DOC.read_text().split("## Steer and continue requests: JSON Schema", 1)[1]
    schema = json.loads(section.split("```json", 1)[1].split("```", 1)[0])
    Draft202012Validator.check_schema(schema)
    return Draft202012Validator({**schema, "$ref": f"#/$defs/{definition}"})


def request(settings: Settings, door: str, body: str, *options: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(CLIENTS / "request_run.py"), settings.rabbitmq_url, settings.namespace, "-",
         "--door", door, *options], input=body, capture_output=True, text=True, timeout=90, check=False)


def answered(settings: Settings, door: str, body: Any, *options: str) -> dict[str, Any]:
    sent = request(settings, door, body if isinstance(body, str) else json.dumps(body), *options)
    assert sent.returncode == 0, sent.stderr
    answer: dict[str, Any] = json.loads(sent.stdout)
    return answer


def slow_run(producer: Producer, toolbox: Toolbox) -> str:
    """A run in a 60 s tool call until someone steers or cancels it; steered, it answers "after the steer"."""
    return producer.enqueue(spec({"toolbox": toolbox.spec}, [{"tool_calls": [call("slow", seconds=60)]},
                                                             {"content": "after the steer"}])).run_id


def finished(producer: Producer, store: RunStore, content: str = "first") -> str:
    run_id = producer.enqueue(RunSpec.parse({"input": "hello", "model": {
        "provider": "scripted", "turns": [{"content": content}]}})).run_id
    assert wait_for_run(store, run_id, timeout=WAIT_S).status is RunStatus.COMPLETED
    return run_id


def continuation(run_id: str, text: str = "again", content: str = "second") -> dict[str, Any]:
    return {"run_id": run_id, "input": text, "model": {"provider": "scripted", "turns": [{"content": content}]}}


def test_the_worker_starts_once_the_steer_and_continue_queues_are_consumed(worker: WorkerProcess) -> None:
    """A request published right after worker_started is routed (the publisher sets mandatory)."""
    assert worker.logged("worker_started", steer_requests_ready=True, continue_requests_ready=True)


def test_a_steer_request_is_answered_on_its_reply_to_and_the_run_goes_on_with_the_new_input(
    worker: WorkerProcess, toolbox_http: Toolbox, producer: Producer, store: RunStore, rabbitmq: Settings
) -> None:
    run_id = slow_run(producer, toolbox_http)
    wait_for_event(toolbox_http.events, "started", tool="slow", timeout=WAIT_S)

    body = {"run_id": run_id, "input": "go by train", "reason": "flight full"}
    documented("steer_request").validate(body)
    answer = answered(rabbitmq, "steer", body)

    assert answer == {"run_id": run_id, "steered": True, "found": "running", "message_confirmed": True}
    documented("steer_answer").validate(answer)
    record = wait_for_run(store, run_id, timeout=WAIT_S)
    assert (record.status, record.steps[-1].content) == (RunStatus.COMPLETED, "after the steer")
    assert [s.kind for s in record.steps] == [StepKind.MODEL, StepKind.TOOL, StepKind.STEER, StepKind.MODEL]
    assert (record.steps[1].tool_outcome, record.steps[1].detail["reason"]) == (ToolOutcome.CANCELLED, "steered")
    steered = record.steps[2].detail
    assert (steered["input"], steered["reason"], steered["requested_by"]) == ("go by train", "flight full", "amqp")
    worker.wait_for_log("steer_request_applied", run_id=run_id)


def test_a_continue_request_is_answered_with_the_new_run_which_carries_on_the_conversation_once_per_message_id(
    worker: WorkerProcess, producer: Producer, store: RunStore, rabbitmq: Settings
) -> None:
    parent = finished(producer, store)
    documented("continue_request").validate(continuation(parent))

    answer = answered(rabbitmq, "continue", continuation(parent), "--message-id", "turn-2")
    again = answered(rabbitmq, "continue", continuation(parent), "--message-id", "turn-2")

    assert answer == {"run_id": answer["run_id"], "status": "queued", "created": True}
    assert (again["run_id"], again["created"]) == (answer["run_id"], False)  # delivered twice, one run
    record = wait_for_run(store, answer["run_id"], timeout=WAIT_S)
    assert (record.status, record.steps[-1].content, record.parent_run_id) == (RunStatus.COMPLETED, "second", parent)
    assert [m["content"] for m in record.request["messages"]] == ["hello", "first"]
    assert record.input == "again"
    assert len(store.recent(limit=10)) == 2


def test_bad_steer_and_continue_requests_are_answered_with_errors_naming_the_field_and_change_nothing(
    worker: WorkerProcess, toolbox_http: Toolbox, producer: Producer, store: RunStore, rabbitmq: Settings
) -> None:
    running = slow_run(producer, toolbox_http)
    wait_for_event(toolbox_http.events, "started", tool="slow", timeout=WAIT_S)
    cases: list[tuple[str, Any, list[Any]]] = [
        ("steer", "not json", ["body"]),
        ("steer", ["a list"], ["body"]),
        ("steer", {"input": "x"}, ["run_id"]),
        ("steer", {"run_id": running, "input": "x", "priority": "high"}, ["priority"]),
        ("steer", {"run_id": running, "input": "   "}, ["input"]),
        ("steer", {"run_id": running, "input": "x", "reason": 7}, ["reason"]),
        ("steer", {"run_id": UNKNOWN, "input": "x"}, ["run_id"]),
        ("continue", "[1, 2", ["body"]),
        ("continue", {"run_id": "nope", "input": "x"}, ["run_id"]),
        ("continue", {"run_id": UNKNOWN, "input": "x"}, ["run_id"]),
        ("continue", {"run_id": running, "input": "x"}, ["run_id"]),  # not finished
        ("continue", {"run_id": running, "input": "x", "max_rounds": "many"}, ["run_id"]),
    ]
    for door, body, loc in cases:
        answer = answered(rabbitmq, door, body)
        assert [e["loc"] for e in answer["errors"]][:1] == [loc], (door, body, answer)
        assert answer["error"]
    assert [r.run_id for r in store.recent(limit=10)] == [running]
    assert store.pending_steer(running) is None
    assert store.status(running) is RunStatus.RUNNING

    # With nobody to answer, each lands in its queue's .dead twin with the reason.
    topology = Topology.of(rabbitmq)
    for door, dead in (("steer", topology.steer_requests.dead_queue),
                       ("continue", topology.continue_requests.dead_queue)):
        sent = request(rabbitmq, door, json.dumps({"run_id": "nope", "input": "x"}), "--no-reply")
        assert sent.returncode == 0, sent.stderr
        [(body, headers)] = take_messages(rabbitmq, dead, 1, timeout=30)
        assert json.loads(body) == {"run_id": "nope", "input": "x"}
        assert "run_id: must be a run id" in headers[DEAD_REASON_HEADER]


def test_the_tenant_is_the_rabbitmq_users_and_another_tenants_run_is_answered_as_unknown(
    worker: WorkerProcess, toolbox_http: Toolbox, producer: Producer, store: RunStore, rabbitmq: Settings
) -> None:
    user = rabbitmq_user(rabbitmq)
    set_catalog(rabbitmq_users={user: {"tenant": "beta"}})
    untenanted = finished(producer, store)
    running = slow_run(producer, toolbox_http)
    wait_for_event(toolbox_http.events, "started", tool="slow", timeout=WAIT_S)

    theirs = answered(rabbitmq, "continue", continuation(untenanted), "--user-id", user)
    steer = answered(rabbitmq, "steer", {"run_id": running, "input": "mine now"}, "--user-id", user)

    for answer in (theirs, steer):
        assert [e["loc"] for e in answer["errors"]] == [["run_id"]], answer
        assert "not found" in answer["error"]
    assert store.pending_steer(running) is None
    assert len(store.recent(limit=10)) == 2  # nothing written
    # Its own run: the continuation is beta's too.
    own = answered(rabbitmq, "run", {"input": "hello", "model": {"provider": "scripted", "turns": [
        {"content": "first"}]}}, "--user-id", user)
    assert wait_for_run(store, own["run_id"], timeout=WAIT_S).status is RunStatus.COMPLETED
    continued = answered(rabbitmq, "continue", continuation(own["run_id"]), "--user-id", user)
    assert continued["created"] is True, continued
    assert store.get(continued["run_id"]).labels == {"tenant": "beta"}


def test_a_reply_to_naming_a_workers_own_queue_is_refused_and_dead_lettered_and_nothing_is_applied(
    worker: WorkerProcess, toolbox_http: Toolbox, producer: Producer, store: RunStore, rabbitmq: Settings
) -> None:
    """The worker may write to every queue: only RabbitMQ's direct reply-to is answered (issue 27, finding 8)."""
    [connected] = worker.wait_for_log("cancel_listener_connected")
    topology = Topology.of(rabbitmq)
    running = slow_run(producer, toolbox_http)
    wait_for_event(toolbox_http.events, "started", tool="slow", timeout=WAIT_S)
    parent = finished(producer, store)

    for door, body, dead in (
        ("steer", {"run_id": running, "input": "x"}, topology.steer_requests.dead_queue),
        ("continue", continuation(parent), topology.continue_requests.dead_queue),
    ):
        for queue in (connected["queue"], topology.cancel_requests_queue):
            sent = request(rabbitmq, door, json.dumps(body), "--reply-to", queue)
            assert sent.returncode == 0, sent.stderr
        dead_letters = take_messages(rabbitmq, dead, 2, timeout=30)
        assert all("direct reply-to" in headers[DEAD_REASON_HEADER] for _body, headers in dead_letters)
    assert store.pending_steer(running) is None
    assert store.status(running) is RunStatus.RUNNING
    assert len(store.recent(limit=10)) == 2


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner,
                                                                                 max_size=4), max_leaves=20)
HOSTILE = [b"[" * 5000, b'{"run_id": NaN}', b"\xff\xfe", b"{}" + b" " * 2000, b'"' + b"x" * 100 + b'"', b""]


@pytest.mark.parametrize("decode", [decode_steer_request, decode_continue_request])
@given(body=st.binary(max_size=64) | JSON.map(lambda value: json.dumps(value).encode())
       | st.dictionaries(st.sampled_from(["run_id", "input", "reason", "model"]), JSON, max_size=4).map(
           lambda value: json.dumps(value).encode()) | st.sampled_from(HOSTILE))
def test_any_body_is_read_or_refused_naming_a_field_and_nothing_else_escapes(decode: Any, body: bytes) -> None:
    """No body makes a decoder raise anything but the refusal the consumer answers (a crash would dead-letter it
    as a bug, and a request should be told which field)."""
    problems: tuple[Any, ...] = ()
    try:
        decode(body, max_bytes=1024)
    except SpecError as exc:
        problems = exc.problems
        assert problems
    assert all(problem.field for problem in problems)
