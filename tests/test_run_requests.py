"""Run requests on RabbitMQ alone (docs/messages.md, "Run requests"), from clients that do not import runbrake: a
plain-pika script in a subprocess, and a Node script with amqplib when npm can install it.

A real worker consumes ``<ns>.run-requests``, admits each spec as ``POST /v1/runs`` would, enqueues the run and
answers on the request's ``reply_to``; the run then executes against a real MCP server. A refused request is
answered with the errors; one with nobody to answer lands in ``<ns>.run-requests.dead`` with the reason.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pika
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jsonschema import Draft202012Validator

from runbrake.shared import RunStatus, RunStore, Settings, StepKind, ToolOutcome
from runbrake.shared.catalog import Admission
from runbrake.shared.errors import SpecError
from runbrake.shared.messaging.wire import DEAD_REASON_HEADER, DEAD_SIZE_HEADER, Topology, decode_run_request
from tests.amqp_clients import CLIENTS, node_client, queue_types
from tests.events_helpers import assert_valid_bodies, expected_keys, position
from tests.mcp_helpers import Toolbox
from tests.polling import poll_until
from tests.test_fuzz_inputs import SHAPED, examples
from tests.worker_helpers import WorkerProcess, call, spec, take_messages, wait_for_run

pytestmark = pytest.mark.integration

MESSAGES_DOC = Path(__file__).resolve().parent.parent / "docs" / "messages.md"


def answer_schema() -> Draft202012Validator:
    """The JSON Schema of an answer, as docs/messages.md, "Run requests: JSON Schema", gives it."""
    section = MESSAGES_DOC.read_text().split("## Run requests: JSON Schema", 1)[1]
    schema = json.loads(section.split("```json", 1)[1].split("```", 1)[0])
    Draft202012Validator.check_schema(schema)
    return Draft202012Validator(schema)


ANSWER_SCHEMA = answer_schema()


def request(settings: Settings, body: str | bytes, *options: str) -> subprocess.CompletedProcess[str]:
    """Publish ``body`` with the plain-pika script, in a process of its own (and await the answer unless told).
    The body goes through stdin: a command line cannot carry a megabyte."""
    text = body if isinstance(body, str) else body.decode()
    return subprocess.run(
        [sys.executable, str(CLIENTS / "request_run.py"), settings.rabbitmq_url, settings.namespace, "-", *options],
        input=text, capture_output=True, text=True, timeout=90, check=False,
    )


def answered(settings: Settings, body: str | bytes, *options: str) -> dict[str, Any]:
    """The answer to a request, as JSON."""
    sent = request(settings, body, *options)
    assert sent.returncode == 0, sent.stderr
    answer: dict[str, Any] = json.loads(sent.stdout)
    ANSWER_SCHEMA.validate(answer)  # every answer a test sees is one docs/messages.md describes
    return answer


def summing_spec(toolbox: Toolbox, **extra: Any) -> str:
    """A run that calls the toolbox's get-sum once and answers, as the JSON a backend would publish."""
    return json.dumps(spec({"toolbox": toolbox.spec}, [{"tool_calls": [call("get-sum", a=2, b=3)]},
                                                        {"content": "five"}], **extra).raw)


def dead_letters(settings: Settings, count: int) -> list[tuple[bytes, dict[str, Any]]]:
    return take_messages(settings, Topology.of(settings).run_requests_dead_queue, count, timeout=30)


def completed_with_the_sum(store: RunStore, run_id: str) -> None:
    record = wait_for_run(store, run_id, timeout=60)
    assert record.status is RunStatus.COMPLETED, record
    [tool] = [s for s in record.steps if s.kind is StepKind.TOOL]
    assert (tool.tool_name, tool.tool_outcome, tool.content) == ("get-sum", ToolOutcome.OK, "5")


def test_a_run_requested_from_plain_pika_is_answered_with_its_id_and_completes(
    worker: WorkerProcess, toolbox_http: Toolbox, store: RunStore, rabbitmq: Settings
) -> None:
    answer = answered(rabbitmq, summing_spec(toolbox_http))

    assert (answer["status"], answer["created"]) == ("queued", True)
    completed_with_the_sum(store, answer["run_id"])
    assert store.get(answer["run_id"]).request["input"] == "test run"
    worker.wait_for_log("run_request_enqueued", run_id=answer["run_id"], by="amqp")


def test_the_same_idempotency_key_twice_answers_the_same_run_and_creates_one(
    worker: WorkerProcess, toolbox_http: Toolbox, store: RunStore, rabbitmq: Settings
) -> None:
    body = summing_spec(toolbox_http, idempotency_key="order-42")

    first, second = answered(rabbitmq, body), answered(rabbitmq, body)

    assert first["run_id"] == second["run_id"]
    assert (first["created"], second["created"]) == (True, False)
    completed_with_the_sum(store, first["run_id"])
    assert [r.run_id for r in store.recent(limit=10)] == [first["run_id"]]


def test_a_request_delivered_twice_with_its_message_id_and_no_key_creates_one_run(
    worker: WorkerProcess, toolbox_http: Toolbox, store: RunStore, rabbitmq: Settings
) -> None:
    """At least once: a redelivery (the same message_id) of a request already written answers the same run."""
    body = summing_spec(toolbox_http)

    first = answered(rabbitmq, body, "--message-id", "m-1")
    second = answered(rabbitmq, body, "--message-id", "m-1")
    other = answered(rabbitmq, body, "--message-id", "m-2")

    assert (second["run_id"], second["created"]) == (first["run_id"], False)
    assert other["run_id"] != first["run_id"]
    assert sorted(r.run_id for r in store.recent(limit=10)) == sorted([first["run_id"], other["run_id"]])
    assert "idempotency_key" not in store.get(first["run_id"]).request  # the request is stored as it came


def test_an_idempotency_key_with_another_spec_is_answered_with_the_conflict(
    worker: WorkerProcess, toolbox_http: Toolbox, store: RunStore, rabbitmq: Settings
) -> None:
    first = answered(rabbitmq, summing_spec(toolbox_http, idempotency_key="k"))

    answer = answered(rabbitmq, summing_spec(toolbox_http, idempotency_key="k", max_steps=7))

    assert answer["run_id"] == first["run_id"]
    assert [e["loc"] for e in answer["errors"]] == [["idempotency_key"]]
    assert len(store.recent(limit=10)) == 1


HOSTILE = {
    "missing-input": (json.dumps({"model": {"provider": "scripted", "turns": []}}), ["input"]),
    "unknown-field": (json.dumps({"input": "x", "surprise": 1}), ["surprise"]),
    "wrong-type": (json.dumps({"input": "x", "max_steps": "many"}), ["max_steps"]),
    "not-json": ("not json at all", ["spec"]),
    "nan": ('{"input": "x", "tool_timeout_s": NaN}', ["tool_timeout_s"]),
    "deep-nesting": ('{"input": "x", "metadata": ' + "[" * 5000 + "]" * 5000 + "}", ["spec"]),
    "array": (json.dumps([{"input": "x"}]), ["spec"]),
    "huge": (json.dumps({"input": "x" * 1_100_000}), ["spec"]),
}


@pytest.mark.parametrize(("body", "loc"), HOSTILE.values(), ids=HOSTILE.keys())
def test_an_invalid_spec_is_answered_with_errors_naming_the_field_and_nothing_is_written(
    body: str, loc: list[str], worker: WorkerProcess, store: RunStore, rabbitmq: Settings
) -> None:
    answer = answered(rabbitmq, body)

    assert "run_id" not in answer
    assert loc in [e["loc"] for e in answer["errors"]], answer
    assert all(e["msg"] for e in answer["errors"])
    assert store.recent(limit=10) == []
    worker.wait_for_log("run_request_invalid")


def test_a_spec_the_catalog_refuses_is_answered_with_errors_and_nothing_is_written(
    worker: WorkerProcess, store: RunStore, rabbitmq: Settings
) -> None:
    body = json.dumps({"input": "x", "model": {"provider": "scripted", "turns": [{"content": "x"}]},
                       "mcp_servers": ["nowhere"]})

    answer = answered(rabbitmq, body)

    assert answer["error"] == "run spec refused"
    assert answer["errors"][0]["loc"] == ["mcp_servers", 0], answer
    assert store.recent(limit=10) == []


@pytest.mark.parametrize("body", [
    "not json at all",
    json.dumps({"input": "x", "max_steps": 0}),
    json.dumps({"input": "x" * 1_100_000}),
], ids=["not-json", "out-of-range", "huge"])
def test_a_refused_request_with_nobody_to_answer_is_dead_lettered_with_the_reason_and_the_consumer_goes_on(
    body: str, worker: WorkerProcess, toolbox_http: Toolbox, store: RunStore, rabbitmq: Settings
) -> None:
    sent = request(rabbitmq, body, "--no-reply")
    assert sent.returncode == 0, sent.stderr

    [(dead_body, headers)] = dead_letters(rabbitmq, 1)
    assert headers[DEAD_REASON_HEADER].startswith("invalid run spec: ")
    if len(body) > rabbitmq.max_spec_bytes:
        assert (headers[DEAD_SIZE_HEADER], len(dead_body)) == (len(body), rabbitmq.max_spec_bytes)
    else:
        assert dead_body == body.encode()
    assert store.recent(limit=10) == []
    # The consumer is still there.
    completed_with_the_sum(store, answered(rabbitmq, summing_spec(toolbox_http))["run_id"])


def test_a_valid_request_with_nobody_to_answer_is_enqueued(
    worker: WorkerProcess, toolbox_http: Toolbox, store: RunStore, rabbitmq: Settings
) -> None:
    sent = request(rabbitmq, summing_spec(toolbox_http, idempotency_key="fire-and-forget"), "--no-reply")
    assert sent.returncode == 0, sent.stderr

    [entry] = worker.wait_for_log("run_request_enqueued", timeout=30)
    completed_with_the_sum(store, entry["run_id"])


def test_a_reply_to_naming_a_queue_of_its_own_is_refused_so_a_reply_cannot_become_a_cancel_request(
    worker: WorkerProcess, toolbox_http: Toolbox, store: RunStore, rabbitmq: Settings
) -> None:
    """The worker may write to every queue: a reply steered into <ns>.cancel-requests would cancel the run."""
    topology = Topology.of(rabbitmq)

    sent = request(rabbitmq, summing_spec(toolbox_http), "--reply-to", topology.cancel_requests_queue)

    assert sent.returncode == 0, sent.stderr
    [(_body, headers)] = dead_letters(rabbitmq, 1)
    assert headers[DEAD_REASON_HEADER].startswith("reply_to must be")
    assert store.recent(limit=10) == []
    connection = pika.BlockingConnection(pika.URLParameters(rabbitmq.rabbitmq_url))
    try:
        declared = connection.channel().queue_declare(topology.cancel_requests_queue, passive=True)
    finally:
        connection.close()
    assert declared.method.message_count == 0


def test_a_reply_to_naming_a_workers_cancel_listener_queue_is_refused_and_nothing_is_written(
    worker: WorkerProcess, toolbox_http: Toolbox, store: RunStore, rabbitmq: Settings
) -> None:
    """The worker's answer {"run_id": …} published on a cancel listener's queue would read as a cancel wake-up
    (issue 27, finding 8). Those queues are named by runbrake, never by the server, so they are refused like any
    named queue."""
    [connected] = worker.wait_for_log("cancel_listener_connected")
    listener = connected["queue"]
    assert listener.startswith(f"{rabbitmq.namespace}.cancel.listener.")

    sent = request(rabbitmq, summing_spec(toolbox_http), "--reply-to", listener)

    assert sent.returncode == 0, sent.stderr
    [(_body, headers)] = dead_letters(rabbitmq, 1)
    assert "direct reply-to" in headers[DEAD_REASON_HEADER]
    worker.wait_for_log("run_request_dead_lettered")
    assert store.recent(limit=10) == []
    assert not worker.logged("run_request_enqueued")


def test_a_requester_may_have_its_answer_on_a_server_named_queue_of_its_own_as_rabbitmqs_rpc_tutorial_does(
    worker: WorkerProcess, toolbox_http: Toolbox, store: RunStore, rabbitmq: Settings
) -> None:
    sent = request(rabbitmq, summing_spec(toolbox_http), "--exclusive-queue")

    assert sent.returncode == 0, sent.stderr
    answer = json.loads(sent.stdout)
    assert answer["created"] is True, answer
    assert wait_for_run(store, answer["run_id"], timeout=60).status is RunStatus.COMPLETED


def test_a_backend_on_node_requests_a_run_and_follows_its_events_to_the_end_over_rabbitmq_alone(
    worker: WorkerProcess, toolbox_http: Toolbox, store: RunStore, rabbitmq: Settings
) -> None:
    """The whole backend story in one amqplib client: enqueue on <ns>.run-requests, the answer on its reply-to,
    then the run's events on <ns>.events in order, up to run.completed (tests/clients/backend_run.mjs)."""
    script = node_client("backend_run.mjs")

    sent = subprocess.run(["node", str(script), rabbitmq.rabbitmq_url, rabbitmq.namespace, summing_spec(toolbox_http)],
                          capture_output=True, text=True, timeout=90, check=False)

    assert sent.returncode == 0, sent.stderr
    first, *lines = [json.loads(line) for line in sent.stdout.splitlines() if line.strip()]
    answer = first["answer"]
    ANSWER_SCHEMA.validate(answer)
    assert (answer["status"], answer["created"]) == ("queued", True)
    completed_with_the_sum(store, answer["run_id"])
    record = store.get(answer["run_id"])
    assert [e["routing_key"] for e in lines] == expected_keys(record) == [
        "run.queued", "run.running", "step.model", "step.tool", "step.model", "run.completed"]
    ids = [e["message_id"] for e in lines]
    assert ids == sorted(ids, key=position)
    assert len(set(ids)) == len(ids)
    assert {e["body"]["run_id"] for e in lines} == {answer["run_id"]}
    assert_valid_bodies([e["body"] for e in lines])  # docs/messages.md, "Run events: JSON Schema"


def test_an_invalid_spec_from_node_is_answered_with_errors_naming_the_field_and_nothing_is_written(
    worker: WorkerProcess, store: RunStore, rabbitmq: Settings
) -> None:
    script = node_client("request_run.mjs")
    body = json.dumps({"input": "x", "model": {"provider": "scripted", "turns": [{"content": "x"}]}, "max_steps": 0})

    sent = subprocess.run(["node", str(script), rabbitmq.rabbitmq_url, rabbitmq.namespace, body],
                          capture_output=True, text=True, timeout=90, check=False)

    assert sent.returncode == 0, sent.stderr
    answer = json.loads(sent.stdout)
    ANSWER_SCHEMA.validate(answer)
    assert [e["loc"] for e in answer["errors"]] == [["max_steps"]]
    assert store.recent(limit=10) == []


def test_the_queues_are_quorum_queues_when_asked(
    start_worker: Callable[..., WorkerProcess], rabbitmq: Settings
) -> None:
    start_worker(RUNBRAKE_QUEUE_TYPE="quorum")
    topology = Topology.of(rabbitmq)

    types = queue_types()

    assert types[topology.run_requests_queue] == "quorum"
    assert types[topology.run_requests_dead_queue] == "quorum"


# -- generated requests --------------------------------------------------------------------------

_BATCHES = examples(ci=3, fuzz=150)
_GOOD: dict[str, Any] = {"input": "generated", "model": {"provider": "scripted", "turns": [{"content": "done"}]}}
_REQUESTS = (
    st.dictionaries(st.sampled_from(("input", "model", "max_steps", "tool_timeout_s", "mcp_servers", "x")),
                    SHAPED, max_size=3).map(lambda change: json.dumps({**_GOOD, **change}).encode())
    | st.binary(max_size=80)
)
"""Run-request bodies: mostly a good spec with fields changed or added (no idempotency_key: each accepted one
is a run of its own), and bytes."""


def _accepted(body: bytes, admission: Admission, settings: Settings) -> bool:
    try:
        admission.admit(decode_run_request(body, max_bytes=settings.max_spec_bytes))
    except SpecError:
        return False
    return True


def test_generated_requests_are_enqueued_or_dead_lettered_and_the_consumer_goes_on(
    worker: WorkerProcess, store: RunStore, rabbitmq: Settings
) -> None:
    """Without reply_to, each generated body the parser and the catalog accept is one run, and each other lands
    in the dead-letter queue with its reason; nothing makes the consumer fail or restart."""
    topology = Topology.of(rabbitmq)
    admission = Admission.from_settings(rabbitmq)
    runs = 0

    @settings(max_examples=_BATCHES, suppress_health_check=list(HealthCheck), deadline=None)
    @given(bodies=st.lists(_REQUESTS, min_size=1, max_size=6))
    def batch(bodies: list[bytes]) -> None:
        nonlocal runs
        connection = pika.BlockingConnection(pika.URLParameters(rabbitmq.rabbitmq_url))
        try:
            channel = connection.channel()
            channel.confirm_delivery()
            for body in bodies:
                channel.basic_publish(topology.run_requests_exchange, topology.run_requests_routing_key, body,
                                      pika.BasicProperties(delivery_mode=2), mandatory=True)
        finally:
            connection.close()
        refused = [body for body in bodies if not _accepted(body, admission, rabbitmq)]
        runs += len(bodies) - len(refused)

        dead = take_messages(rabbitmq, topology.run_requests_dead_queue, len(refused)) if refused else []

        assert sorted(body for body, _ in dead) == sorted(refused)
        assert all(headers.get(DEAD_REASON_HEADER) for _, headers in dead)
        poll_until(lambda: len(store.recent(limit=1000)) == runs, timeout=30,
                   failure=lambda: f"{len(store.recent(limit=1000))} runs, not {runs}")

    batch()

    assert worker.logged("run_request_failed") == []
    assert worker.logged("run_requests_crashed") == []
    assert worker.process.poll() is None
