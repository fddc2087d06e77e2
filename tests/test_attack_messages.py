"""Forged run messages, dead consumer threads, unbounded dead letters and open health ports (issue 15),
reproduced against the real RabbitMQ and Redis and real worker processes.

The bodies are published with plain pika straight on ``<ns>.runs`` (or its delay queue), as anyone with
write access to the virtual host could. The worker checks each envelope before Dramatiq reads it
(``wire.check_run_message``, ``rabbitmq.CheckedConsumer``; docs/messages.md, "Run queue: what a worker
accepts"): what it does not accept is dead-lettered once, with the reason, and acked.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import socket
import struct
import subprocess
import threading
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import dramatiq.worker
import pika
import pika.data
import pika.exceptions
import pytest
from dramatiq.asyncio import get_event_loop_thread

from runbrake.shared import AsyncRunStore, ConfigError, RunSpec, RunStatus, RunStore, Settings
from runbrake.shared.catalog import Admission
from runbrake.shared.messaging._amqp_tables import harden_table_decoding
from runbrake.shared.messaging.producer import Producer
from runbrake.shared.messaging.rabbitmq import build_broker
from runbrake.shared.messaging.wire import (
    DEAD_LETTER_MAX_BYTES,
    DEAD_LETTER_MAX_LENGTH,
    DEAD_LETTER_TTL_MS,
    DEAD_REASON_HEADER,
    DEAD_SIZE_HEADER,
    MAX_RUN_MESSAGE_BYTES,
    NOOP_ACTOR,
    RUN_ACTOR,
    MalformedRunMessage,
    Topology,
    check_run_message,
    run_message,
)
from runbrake.worker import metrics
from runbrake.worker.actors import declare_run_actor
from runbrake.worker.intake import Intake
from runbrake.worker.registry import ActiveRuns
from runbrake.worker.runtime import Runtime
from tests.polling import poll_until
from tests.ports import free_port
from tests.worker_helpers import WorkerProcess, take_messages, wait_for_run

RUN_ID = "3f2a9c1e0b7d4e6f8a1b2c3d4e5f6a7b"
QUEUE = "ns.runs"


def envelope(**fields: Any) -> dict[str, Any]:
    """A run message as runbrake's producer writes it, with ``fields`` replaced (``None`` removes one)."""
    body: dict[str, Any] = {
        "queue_name": QUEUE, "actor_name": RUN_ACTOR, "args": [RUN_ID], "kwargs": {"resume": False},
        "options": {}, "message_id": str(uuid.uuid4()), "message_timestamp": 1_796_006_036_512,
    }
    body.update(fields)
    return {name: value for name, value in body.items() if value is not None}


def encoded(**fields: Any) -> bytes:
    return json.dumps(envelope(**fields)).encode()


# What the attack and its variants publish, and a word the refusal's reason must contain.
FORGED: dict[str, tuple[bytes, str]] = {
    "foreign-queue-name": (encoded(queue_name="elsewhere.runs"), "queue_name"),
    "not-json": (b"not json at all", "JSON"),
    "not-utf8": (b'{"queue_name": "\xff"}', "UTF-8"),
    "nan": (encoded(message_timestamp=float("nan")), "JSON"),
    "array": (json.dumps([envelope()]).encode(), "object"),
    "huge": (encoded(message_id="x" * (2 * MAX_RUN_MESSAGE_BYTES)), "bytes"),
    "deeply-nested": (b"[" * 60_000, "JSON"),
    "unknown-field": (encoded(extra=1), "extra"),
    "message-id-missing": (encoded(message_id=None), "message_id"),
    "timestamp-missing": (encoded(message_timestamp=None), "message_timestamp"),
    "timestamp-string": (encoded(message_timestamp="now"), "message_timestamp"),
    "message-id-number": (encoded(message_id=7), "message_id"),
    "unknown-actor": (encoded(actor_name="os.system"), "actor_name"),
    "actor-number": (encoded(actor_name=1), "actor_name"),
    "noop-actor-undeclared": (encoded(actor_name=NOOP_ACTOR, args=[], kwargs={}), "actor_name"),
    "args-not-a-list": (encoded(args=RUN_ID), "args"),
    "bad-run-id": (encoded(args=["x" * 32]), "run id"),
    "run-id-object": (encoded(args=[{"not": "an id"}]), "run id"),
    "two-args": (encoded(args=[RUN_ID, True]), "run id"),
    "kwargs-unknown": (encoded(kwargs={"resume": False, "spec": {}}), "kwargs"),
    "resume-string": (encoded(kwargs={"resume": "yes"}), "resume"),
    "time-limit-option": (encoded(options={"time_limit": 1}), "time_limit"),
    "retry-exhausted-option": (encoded(options={"on_retry_exhausted": "noop"}), "on_retry_exhausted"),
    "eta-on-the-run-queue": (encoded(options={"eta": 0}), "eta"),
    "negative-retries": (encoded(options={"retries": -1_000_000}), "retries"),
    "options-not-an-object": (encoded(options=[]), "options"),
}


# -- the check itself, without services ----------------------------------------------------------


@pytest.mark.parametrize("body", ["plain", "resume", "retried"])
def test_what_runbrake_and_dramatiq_write_is_accepted(body: str) -> None:
    message = {
        "plain": run_message(Topology("ns"), RUN_ID).asdict(),
        "resume": run_message(Topology("ns"), RUN_ID, resume=True).asdict(),
        "retried": envelope(options={"retries": 3, "traceback": "Traceback …", "requeue_timestamp": 1}),
    }[body]

    check_run_message(json.dumps({**message, "args": list(message["args"])}).encode(), queue=QUEUE,
                      actors={RUN_ACTOR})


def test_a_delayed_message_carries_its_eta_and_names_the_delay_queue() -> None:
    check_run_message(encoded(queue_name="ns.runs.DQ", options={"eta": 1, "retries": 1}), queue="ns.runs.DQ",
                      actors={RUN_ACTOR})

    with pytest.raises(MalformedRunMessage, match="eta"):
        check_run_message(encoded(queue_name="ns.runs.DQ"), queue="ns.runs.DQ", actors={RUN_ACTOR})
    with pytest.raises(MalformedRunMessage, match="queue_name"):
        check_run_message(encoded(queue_name="elsewhere.runs.DQ", options={"eta": 1}), queue="ns.runs.DQ",
                          actors={RUN_ACTOR})


@pytest.mark.parametrize("name", list(FORGED))
def test_a_forged_envelope_is_refused_naming_what_is_wrong(name: str) -> None:
    body, word = FORGED[name]

    with pytest.raises(MalformedRunMessage) as refused:
        check_run_message(body, queue=QUEUE, actors={RUN_ACTOR})

    assert word in str(refused.value)
    assert len(str(refused.value)) <= 300


# -- against the real RabbitMQ -------------------------------------------------------------------


def publish(settings: Settings, body: bytes, *, queue: str | None = None) -> None:
    """Publish ``body`` on ``queue`` (the run queue by default) with plain pika, as an attacker would."""
    connection = pika.BlockingConnection(pika.URLParameters(settings.rabbitmq_url))
    try:
        channel = connection.channel()
        channel.confirm_delivery()
        channel.basic_publish(exchange="", routing_key=queue or Topology.of(settings).run_queue, body=body,
                              mandatory=True, properties=pika.BasicProperties(delivery_mode=2))
    finally:
        connection.close()


def take_dead_letters(settings: Settings, count: int) -> list[tuple[bytes, dict[str, Any]]]:
    """Take ``count`` messages off ``<ns>.runs.XQ`` (bounded wait), with their headers."""
    return take_messages(settings, f"{Topology.of(settings).run_queue}.XQ", count)


def ready_messages(settings: Settings, queue: str) -> int | None:
    """Messages ready in ``queue``; None when it does not exist."""
    connection = pika.BlockingConnection(pika.URLParameters(settings.rabbitmq_url))
    try:
        count: int = connection.channel().queue_declare(queue=queue, passive=True).method.message_count
        return count
    except pika.exceptions.ChannelClosedByBroker:
        return None
    finally:
        connection.close()


def finished_run(producer: Producer, store: RunStore) -> RunStatus:
    run = producer.enqueue(RunSpec.parse({"input": "after the attack", "model": {
        "provider": "scripted", "turns": [{"content": "done"}]}}))
    return wait_for_run(store, run.run_id).status


def test_a_worker_says_it_started_only_once_a_message_published_to_its_queues_is_routed(
    start_worker: Callable[..., WorkerProcess], rabbitmq: Settings,
) -> None:
    """``worker_started`` came once the consumer threads were started, not bound: in a new namespace a
    message published right after it could find no queue (CI of 3bc26b8: NO_ROUTE on ``<ns>.runs``)."""
    run_queue = Topology.of(rabbitmq).run_queue
    worker = start_worker()

    assert worker.logged("worker_started", consuming=True, cancel_requests_ready=True)
    for queue in (run_queue, f"{run_queue}.DQ"):  # mandatory, confirmed: unroutable raises
        publish(rabbitmq, encoded(queue_name="elsewhere.runs"), queue=queue)
    take_dead_letters(rabbitmq, 2)


def test_forged_queue_names_no_longer_stop_a_worker_and_are_dead_lettered_once_through_a_restart(
    start_worker: Callable[..., WorkerProcess], producer: Producer, store: RunStore, rabbitmq: Settings,
) -> None:
    """The attack of issue 15: four copies of an envelope naming another queue killed all four consumer
    threads, and came back after every restart. Now each is dead-lettered once and the worker goes on."""
    forged = [encoded(queue_name="elsewhere.runs", message_id=f"forged-{i}") for i in range(4)]
    worker = start_worker()
    for body in forged:
        publish(rabbitmq, body)

    worker.wait_for_log("run_message_malformed", count=4)
    assert finished_run(producer, store) is RunStatus.COMPLETED
    dead = take_dead_letters(rabbitmq, 4)
    assert sorted(body for body, _ in dead) == sorted(forged)
    assert all("queue_name" in headers[DEAD_REASON_HEADER] for _, headers in dead)

    assert worker.stop() == 0
    assert ready_messages(rabbitmq, Topology.of(rabbitmq).run_queue) == 0  # all acked: nothing to redeliver
    again = start_worker()
    assert finished_run(producer, store) is RunStatus.COMPLETED
    assert again.logged("run_message_malformed") == []
    assert ready_messages(rabbitmq, f"{Topology.of(rabbitmq).run_queue}.XQ") == 0
    assert ready_messages(rabbitmq, "elsewhere.runs") is None


def test_every_kind_of_malformed_envelope_is_dead_lettered_once_with_its_reason_and_the_worker_goes_on(
    worker: WorkerProcess, producer: Producer, store: RunStore, rabbitmq: Settings,
) -> None:
    run_queue = Topology.of(rabbitmq).run_queue
    forged = {name: (body.replace(QUEUE.encode(), run_queue.encode()), word) for name, (body, word) in FORGED.items()}
    for body, _ in forged.values():
        publish(rabbitmq, body)

    dead = take_dead_letters(rabbitmq, len(forged))

    assert finished_run(producer, store) is RunStatus.COMPLETED
    reasons = dict(dead)
    for name, (body, word) in forged.items():
        kept = body[:MAX_RUN_MESSAGE_BYTES]
        assert kept in reasons, name
        assert word in reasons[kept][DEAD_REASON_HEADER], (name, reasons[kept])
    huge = forged["huge"][0]
    assert reasons[huge[:MAX_RUN_MESSAGE_BYTES]][DEAD_SIZE_HEADER] == len(huge)
    assert len(worker.logged("run_message_malformed")) == len(forged)
    assert ready_messages(rabbitmq, f"{run_queue}.XQ") == 0  # once each, nothing more


def test_a_forged_delayed_message_is_not_moved_to_the_queue_it_names(
    worker: WorkerProcess, producer: Producer, store: RunStore, rabbitmq: Settings,
) -> None:
    """Dramatiq moves a due message from the delay queue to the queue its ``queue_name`` names: without the
    check, into another namespace's run queue, declared for the occasion."""
    run_queue = Topology.of(rabbitmq).run_queue
    elsewhere = f"{rabbitmq.namespace}-elsewhere.runs"
    body = encoded(queue_name=f"{elsewhere}.DQ", options={"eta": 0})
    try:
        publish(rabbitmq, body, queue=f"{run_queue}.DQ")

        [(dead, headers)] = take_dead_letters(rabbitmq, 1)

        assert (dead, "queue_name" in headers[DEAD_REASON_HEADER]) == (body, True)
        assert finished_run(producer, store) is RunStatus.COMPLETED
        assert ready_messages(rabbitmq, elsewhere) is None
    finally:
        _delete_queues(rabbitmq, elsewhere, f"{elsewhere}.DQ", f"{elsewhere}.XQ")


def _delete_queues(settings: Settings, *queues: str) -> None:
    connection = pika.BlockingConnection(pika.URLParameters(settings.rabbitmq_url))
    try:
        channel = connection.channel()
        for queue in queues:
            channel.queue_delete(queue=queue)
    finally:
        connection.close()



# -- hostile headers -------------------------------------------------------------------------------


class _Raw(bytes):
    """A header value the attacker's client writes as it is: a field type byte and its encoding."""


def _far_timestamp() -> _Raw:
    return _Raw(b"T" + struct.pack(">Q", 2**63))  # seconds past anything datetime holds


def _deep_table(depth: int = 5000) -> _Raw:
    inner = b"F" + struct.pack(">I", 0)
    for _ in range(depth):
        content = b"\x01k" + inner
        inner = b"F" + struct.pack(">I", len(content)) + content
    return _Raw(inner)


def publish_with_headers(settings: Settings, body: bytes, headers: dict[str, _Raw], *, queue: str) -> None:
    """Publish with headers pika itself would never encode: RabbitMQ passes them through as they are."""
    encode = pika.data.encode_value

    def raw_encode(pieces: list[bytes], value: Any) -> int:
        if isinstance(value, _Raw):
            pieces.append(bytes(value))
            return len(value)
        return int(encode(pieces, value))

    connection = pika.BlockingConnection(pika.URLParameters(settings.rabbitmq_url))
    try:
        channel = connection.channel()
        channel.confirm_delivery()
        pika.data.encode_value = raw_encode
        try:
            channel.basic_publish(exchange="", routing_key=queue, body=body, mandatory=True,
                                  properties=pika.BasicProperties(delivery_mode=2, headers=dict(headers)))
        finally:
            pika.data.encode_value = encode
    finally:
        connection.close()


def test_the_hardened_decoding_keeps_a_far_timestamp_as_seconds_and_a_too_deep_table_as_none() -> None:
    harden_table_decoding()
    table = {"when": _far_timestamp(), "deep": _deep_table(), "plain": _Raw(b"S" + struct.pack(">I", 2) + b"ok")}
    encoded_table = b"".join(bytes([len(key)]) + key.encode() + value for key, value in table.items())

    decoded, end = pika.data.decode_table(struct.pack(">I", len(encoded_table)) + encoded_table, 0)

    assert decoded == {"when": 2**63, "deep": {"k": {"k": decoded["deep"]["k"]["k"]}}, "plain": "ok"}
    assert end == 4 + len(encoded_table)


@pytest.mark.parametrize("header", ["far-timestamp", "deep-table"])
def test_a_hostile_header_no_longer_drops_the_consumers_connection_over_and_over(
    header: str, worker: WorkerProcess, producer: Producer, store: RunStore, rabbitmq: Settings,
) -> None:
    """pika decodes headers in its frame parser: without the hardened decoding (shared/messaging/_amqp_tables.py) each
    of these closed the consumer's connection, and the requeued message closed the next one, for ever."""
    value = {"far-timestamp": _far_timestamp, "deep-table": _deep_table}[header]()
    topology = Topology.of(rabbitmq)
    forged = encoded(queue_name="elsewhere.runs")
    publish_with_headers(rabbitmq, forged, {"x": value}, queue=topology.run_queue)
    publish_with_headers(rabbitmq, b"not a cancel request", {"x": value}, queue=topology.cancel_requests_queue)
    publish_with_headers(rabbitmq, b"not a run request", {"x": value}, queue=topology.run_requests_queue)

    [(dead, headers)] = take_dead_letters(rabbitmq, 1)

    assert (dead, "queue_name" in headers[DEAD_REASON_HEADER]) == (forged, True)
    worker.wait_for_log("cancel_request_malformed")
    poll_until(lambda: ready_messages(rabbitmq, topology.cancel_requests_dead_queue) == 1, timeout=20,
               failure=lambda: "the malformed cancel request was not dead-lettered")
    poll_until(lambda: ready_messages(rabbitmq, topology.run_requests_dead_queue) == 1, timeout=20,
               failure=lambda: "the malformed run request was not dead-lettered")
    assert finished_run(producer, store) is RunStatus.COMPLETED
    assert worker.logged("cancel_requests_disconnected") == worker.logged("run_requests_disconnected") == []

# -- consumer threads that die ---------------------------------------------------------------------


class _Killed(BaseException):
    """Raised into a Dramatiq thread from outside, the way Dramatiq's own time limit interrupts one."""


def _kill(thread: threading.Thread) -> None:
    assert thread.ident is not None
    done = ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(_Killed))
    assert done == 1


def _restarts(kind: str) -> float:
    return metrics.REGISTRY.get_sample_value("runbrake_consumer_restarts_total", {"kind": kind}) or 0.0


def _dramatiq_threads(kind: type[threading.Thread]) -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if isinstance(thread, kind) and thread.is_alive()]


@pytest.fixture
def intake(store: RunStore, rabbitmq: Settings, producer: Producer) -> Iterator[Intake]:
    """A worker's intake in this process: the run actor on the real broker, four consumer threads."""
    broker = build_broker(rabbitmq)
    async_store = AsyncRunStore.connect(rabbitmq)
    runtime = Runtime(rabbitmq, async_store, ActiveRuns(), Admission.from_settings(rabbitmq), sender=producer)
    taking = Intake(runtime, concurrency=4)
    declare_run_actor(broker, taking, rabbitmq)
    taking.start_consuming(broker, {Topology.of(rabbitmq).run_queue})
    yield taking
    taking.stop_consuming()
    loop_thread = get_event_loop_thread()
    assert loop_thread is not None
    asyncio.run_coroutine_threadsafe(async_store.aclose(), loop_thread.loop).result(10)  # on the loop it ran on
    taking.stop(grace_s=2)
    broker.close()


def test_a_consumer_thread_that_dies_is_replaced_and_counted_and_runs_go_on(
    intake: Intake, producer: Producer, store: RunStore, rabbitmq: Settings,
) -> None:
    run_queue = Topology.of(rabbitmq).run_queue

    def consuming() -> bool:
        return intake.consumer_status(run_queue)[0]

    poll_until(consuming, timeout=20, failure=lambda: f"never consumed: {intake.consumer_status(run_queue)}")
    for kind, thread_class in (("worker_thread", dramatiq.worker.WorkerThread),
                               ("queue_consumer", dramatiq.worker.ConsumerThread)):
        before = _restarts(kind)
        victim = _dramatiq_threads(thread_class)[0]
        count = len(_dramatiq_threads(thread_class))

        _kill(victim)

        poll_until(lambda: _restarts(kind) == before + 1, timeout=20,  # noqa: B023 - called within the iteration
                   failure=lambda: f"no restart counted: {_restarts(kind)}")  # noqa: B023
        victim.join(5)
        assert not victim.is_alive()
        assert len(_dramatiq_threads(thread_class)) == count
        poll_until(consuming, timeout=20, failure=lambda: f"not consuming again: {intake.consumer_status(run_queue)}")
        assert finished_run(producer, store) is RunStatus.COMPLETED


def _get(url: str) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:  # noqa: S310 - the test's own loopback URL
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        with error:
            return error.code, json.loads(error.read())


def test_readiness_fails_while_the_worker_consumes_no_run_queue_and_recovers_when_it_does(
    start_worker: Callable[..., WorkerProcess], rabbitmq: Settings,
) -> None:
    """For real: a run queue of another type (a namespace half switched to quorum queues) makes RabbitMQ
    refuse the worker's declaration, so it takes no run; /readyz says so until the queue is gone."""
    run_queue = Topology.of(rabbitmq).run_queue
    connection = pika.BlockingConnection(pika.URLParameters(rabbitmq.rabbitmq_url))
    try:
        connection.channel().queue_declare(queue=run_queue, durable=True, arguments={"x-queue-type": "quorum"})
    finally:
        connection.close()
    port = free_port()
    start_worker(RUNBRAKE_HEALTH_PORT=str(port))
    url = f"http://127.0.0.1:{port}/readyz"

    unready = poll_until(lambda: (answer := _get(url))[0] == 503 and "consumers" in answer[1]["failed"] and answer,
                         timeout=20, failure=lambda: f"/readyz did not fail on the consumers: {_get(url)}")
    _delete_queues(rabbitmq, run_queue)
    ready = poll_until(lambda: (answer := _get(url))[0] == 200 and answer, timeout=30,
                       failure=lambda: f"/readyz never recovered: {_get(url)}")

    assert "not consuming" in unready[1]["checks"]["consumers"]["detail"]
    assert ready[1]["checks"]["consumers"] == {
        "ok": True, "detail": f"4 of 4 consumer threads alive, consuming {run_queue}"}


# -- the health and metrics ports ------------------------------------------------------------------


def _listening_on(port: int) -> set[str]:
    """The IPv4 addresses a socket listens on at ``port`` (Linux's /proc/net/tcp)."""
    found = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        address, hex_port = local.split(":")
        if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
            found.add(socket.inet_ntoa(bytes.fromhex(address)[::-1]))
    return found


@pytest.mark.parametrize(("host", "expected"), [(None, "127.0.0.1"), ("0.0.0.0", "0.0.0.0")])
def test_the_health_and_metrics_ports_listen_on_loopback_unless_told_otherwise(
    host: str | None, expected: str, start_worker: Callable[..., WorkerProcess],
) -> None:
    health_port, metrics_port = free_port(), free_port()
    env = {"RUNBRAKE_HEALTH_PORT": str(health_port), "RUNBRAKE_METRICS_PORT": str(metrics_port)}
    worker = start_worker(**env, **({"RUNBRAKE_HEALTH_HOST": host} if host else {}))

    worker.wait_for_log("health_serving", host=expected, port=health_port)
    worker.wait_for_log("metrics_serving", host=expected, port=metrics_port)

    assert _listening_on(health_port) == {expected}
    assert _listening_on(metrics_port) == {expected}


# -- dead-letter queues: bounded, and an old one kept ---------------------------------------------


def _arguments(queues: set[str]) -> dict[str, dict[str, Any]]:
    listed = subprocess.run(["rabbitmqctl", "list_queues", "-q", "--formatter", "json", "name", "arguments"],
                            capture_output=True, text=True, timeout=60, check=False)
    if listed.returncode != 0:
        pytest.skip(f"rabbitmqctl cannot list queues here: {listed.stderr.strip()}")
    return {queue["name"]: {name: value for name, _, value in queue["arguments"]}
            for queue in json.loads(listed.stdout) if queue["name"] in queues}


def test_the_dead_letter_queues_are_bounded_in_length_bytes_and_age(worker: WorkerProcess, rabbitmq: Settings) -> None:
    topology = Topology.of(rabbitmq)
    dead_letter_queues = {f"{topology.run_queue}.XQ", topology.cancel_requests_dead_queue,
                          topology.run_requests_dead_queue}
    bounds = {"x-max-length": DEAD_LETTER_MAX_LENGTH, "x-max-length-bytes": DEAD_LETTER_MAX_BYTES,
              "x-message-ttl": DEAD_LETTER_TTL_MS, "x-overflow": "drop-head"}

    assert _arguments(dead_letter_queues) == dict.fromkeys(dead_letter_queues, bounds)
    assert worker.logged("dead_letter_queue_unbounded") == []


def test_a_dead_letter_queue_declared_before_the_bounds_is_kept_and_the_worker_still_dead_letters(
    start_worker: Callable[..., WorkerProcess], producer: Producer, store: RunStore, rabbitmq: Settings,
) -> None:
    """An existing deployment upgrades without PRECONDITION_FAILED: the old queues stay as they were, and the
    worker says how to bound them (docs/messages.md, "Dead-letter queues: upgrading")."""
    topology = Topology.of(rabbitmq)
    old = {f"{topology.run_queue}.XQ": {"x-message-ttl": DEAD_LETTER_TTL_MS}, topology.cancel_requests_dead_queue: {}}
    connection = pika.BlockingConnection(pika.URLParameters(rabbitmq.rabbitmq_url))
    try:
        channel = connection.channel()
        for queue, arguments in old.items():
            channel.queue_declare(queue=queue, durable=True, arguments=arguments)
    finally:
        connection.close()

    worker = start_worker()
    publish(rabbitmq, encoded(queue_name="elsewhere.runs"))

    [(_, headers)] = take_dead_letters(rabbitmq, 1)
    assert "queue_name" in headers[DEAD_REASON_HEADER]
    assert finished_run(producer, store) is RunStatus.COMPLETED
    warned = {entry["queue"] for entry in worker.logged("dead_letter_queue_unbounded")}
    assert warned == set(old)
    assert _arguments(set(old)) == old

    # The documented fix, a policy, bounds them as they are.
    policy = f"{rabbitmq.namespace}-dead-letters"
    ns = rabbitmq.namespace.replace(".", "\\.")
    pattern = rf"^{ns}\.(runs|noop)\.XQ$|^{ns}\.cancel-requests\.dead$"
    definition = {"max-length": DEAD_LETTER_MAX_LENGTH, "max-length-bytes": DEAD_LETTER_MAX_BYTES,
                  "message-ttl": DEAD_LETTER_TTL_MS, "overflow": "drop-head"}
    try:
        _rabbitmqctl("set_policy", "--apply-to", "queues", "--priority", "10", policy, pattern, json.dumps(definition))
        listed = json.loads(_rabbitmqctl("list_queues", "-q", "--formatter", "json", "name", "policy"))
        applied = {queue["name"]: queue["policy"] for queue in listed if queue["name"] in old}
        assert applied == dict.fromkeys(old, policy)
    finally:
        _rabbitmqctl("clear_policy", policy)


def _rabbitmqctl(*arguments: str) -> str:
    done = subprocess.run(["rabbitmqctl", *arguments], capture_output=True, text=True, timeout=60, check=False)
    if done.returncode != 0:
        pytest.skip(f"rabbitmqctl {arguments[0]} failed here: {done.stderr.strip()[-300:]}")
    return done.stdout


@pytest.mark.parametrize("value", ["0.0.0.0 ", "host:80", "a b", "-bad"])
def test_a_health_host_that_is_no_address_is_refused_naming_the_variable(value: str) -> None:
    with pytest.raises(ConfigError, match="RUNBRAKE_HEALTH_HOST"):
        Settings.from_env({"RUNBRAKE_HEALTH_HOST": value})

