"""Run events on RabbitMQ (docs/messages.md, "Run events"): the store writes every status change and step to
the outbox in the script that makes it, and the relay publishes them on the topic exchange ``<ns>.events``,
persistent and confirmed, in order per run, with the run's labels as headers.

A Node consumer with amqplib (no runbrake, no Python) follows a real worker's run to its end; relays started
in this process publish runs the test writes through the store, so their labels can be set (issue 17 gives
specs labels; until then the run's ``labels`` field is written here as that issue stores it).
"""

from __future__ import annotations

import json
import select
import subprocess
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

from runbrake.shared import RunStatus, RunStep, RunStore, Settings, StepKind, TerminationReason
from runbrake.shared.messaging.producer import Producer
from runbrake.shared.messaging.wire import EVENT_ID_HEADER, RUN_ID_HEADER, RunEventMessage
from runbrake.worker.outbox_reader import RENEW_S
from runbrake.worker.relay import ConfirmedPublisher, EventRelay
from tests.amqp_clients import node_client
from tests.events_helpers import assert_valid_bodies, drain_events, events_queue, expected_keys, position, take_events
from tests.mcp_helpers import Toolbox
from tests.polling import poll_until
from tests.worker_helpers import WorkerProcess, call, spec, wait_for_run

pytestmark = pytest.mark.integration

RUNS = 20


def _line(process: subprocess.Popen[str], timeout: float) -> str:
    """The next line the process prints (a bounded wait)."""
    assert process.stdout is not None
    ready, _, _ = select.select([process.stdout], [], [], timeout)
    if not ready:
        pytest.fail(f"the Node consumer printed nothing within {timeout:g} s")
    return process.stdout.readline().strip()


def test_a_node_consumer_receives_a_runs_events_in_order_until_it_completes(
    worker: WorkerProcess, toolbox_http: Toolbox, producer: Producer, store: RunStore, rabbitmq: Settings
) -> None:
    script = node_client("consume_run_events.mjs")
    consumer = subprocess.Popen(["node", str(script), rabbitmq.rabbitmq_url, rabbitmq.namespace],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert _line(consumer, 30) == "ready", consumer.stderr.read() if consumer.stderr else ""
        run_id = producer.enqueue(spec({"toolbox": toolbox_http.spec}, [
            {"tool_calls": [call("get-sum", a=2, b=3)]}, {"content": "It is 5."}])).run_id
        assert consumer.stdin is not None
        consumer.stdin.write(run_id + "\n")
        consumer.stdin.flush()
        out, err = consumer.communicate(timeout=60)
    finally:
        if consumer.poll() is None:
            consumer.kill()
            consumer.wait()

    assert consumer.returncode == 0, err
    events = [json.loads(line) for line in out.splitlines() if line.strip()]
    record = wait_for_run(store, run_id)
    assert record.status is RunStatus.COMPLETED
    assert [e["routing_key"] for e in events] == expected_keys(record)
    assert [e["routing_key"] for e in events] == [
        "run.queued", "run.running", "step.model", "step.tool", "step.model", "run.completed"]
    ids = [e["message_id"] for e in events]
    assert ids == sorted(ids, key=position)
    assert len(set(ids)) == len(ids)
    for event in events:
        assert event["headers"][EVENT_ID_HEADER] == event["body"]["event_id"] == event["message_id"]
        assert event["headers"][RUN_ID_HEADER] == event["body"]["run_id"] == run_id
        assert event["body"]["type"] == event["routing_key"]
    steps = [e["body"]["step"] for e in events if e["routing_key"].startswith("step.")]
    assert [s["sequence"] for s in steps] == [s.sequence for s in record.steps]
    assert steps[1]["tool_name"] == "get-sum"
    assert steps[1]["tool_outcome"] == "ok"
    assert events[-1]["body"]["termination_reason"] == "completed"
    assert_valid_bodies([e["body"] for e in events])  # docs/messages.md, "Run events: JSON Schema"


@pytest.fixture
def relays(rabbitmq: Settings) -> Iterator[list[EventRelay]]:
    """Two relays of this namespace in this process, each with a store of its own; stopped afterwards."""
    stores = [RunStore.connect(rabbitmq) for _ in range(2)]
    started = [EventRelay(rabbitmq, store) for store in stores]
    for relay in started:
        relay.start()
    yield started
    for relay in started:
        relay.stop()
    for relay, store in zip(started, stores, strict=True):
        relay.join(10)
        assert not relay.is_alive()
        store.close()


def _finish(store: RunStore, run_id: str, labels: dict[str, str] | None = None) -> None:
    """Take a queued run to completed through the store, as a worker would: claim, one step, settle."""
    if labels is not None:
        store.redis.hset(store.run_key(run_id), "labels", json.dumps(labels))  # as issue 17 stores them
    owner = f"test-{uuid.uuid4().hex[:8]}"
    assert store.claim(run_id, owner, lease_s=60).won
    store.append_step(run_id, RunStep(kind=StepKind.MODEL, round=1, content="done"))
    assert store.settle(run_id, RunStatus.COMPLETED, TerminationReason.COMPLETED, owner=owner).won


@pytest.mark.parametrize("settings", ["single", "cluster"], indirect=True)
@pytest.mark.timeout(240)  # the waits below: 60 s to take the events, 90 s for the relays' confirms
def test_two_relays_publish_every_event_once_in_order_with_the_runs_labels_as_headers(
    relays: list[EventRelay], store: RunStore, rabbitmq: Settings
) -> None:
    with events_queue(rabbitmq) as queue:
        run_ids = [store.create({"input": f"run {i}"}).run_id for i in range(RUNS)]
        for i, run_id in enumerate(run_ids):
            _finish(store, run_id, {"tenant": "acme", "n": str(i), RUN_ID_HEADER: "forged", "long": "x" * 300})

        received = take_events(rabbitmq, queue, 4 * RUNS, timeout=60, distinct=True)

        # A batch whose confirms do not come within the relay's 30 s is published again: allow for one (seen
        # once with the suite on three xdist workers, before a confirm read inside basic_publish was counted).
        poll_until(lambda: sum(r.published for r in relays) >= 4 * RUNS, timeout=90,
                   failure=lambda: f"published: {[r.published for r in relays]}")
        poll_until(lambda: sorted(r.leading for r in relays) == [False, True], timeout=30,  # one publishes
                   failure=lambda: f"leading: {[r.leading for r in relays]}")
        outboxes = [store.keys.outbox(shard) for shard in store.keys.shards]  # one per shard on a cluster
        poll_until(lambda: sum(store.redis.xpending(o, "relay")["pending"] for o in outboxes) == 0, timeout=30,
                   failure=lambda: "the relays left events unacknowledged")
        received += drain_events(rabbitmq, queue)
        # At least once: a copy (a batch whose confirms came too late, published again) is the same message.
        events = list({e.message_id: e for e in received}.values())
        assert len(events) == 4 * RUNS
        for copy in received:
            original = next(e for e in events if e.message_id == copy.message_id)
            assert (copy.routing_key, copy.body) == (original.routing_key, original.body)
        for i, run_id in enumerate(run_ids):
            mine = [e for e in events if e.headers[RUN_ID_HEADER] == run_id]
            assert [e.routing_key for e in mine] == ["run.queued", "run.running", "step.model", "run.completed"]
            assert [e.message_id for e in mine] == sorted((e.message_id for e in mine), key=position)
            for event in mine:
                assert event.persistent
                assert event.headers[EVENT_ID_HEADER] == event.message_id == event.body["event_id"]
            # Labels: the queued event came before they were set; the rest carry them, the forged id and the
            # over-long label left out of the headers.
            assert "tenant" not in mine[0].headers
            for event in mine[1:]:
                assert (event.headers["tenant"], event.headers["n"]) == ("acme", str(i))
                assert "long" not in event.headers
                assert event.body["labels"] == {"tenant": "acme", "n": str(i), RUN_ID_HEADER: "forged"}
        assert_valid_bodies([e.body for e in events])
    assert sum(store.redis.xlen(outbox) for outbox in outboxes) == 4 * RUNS  # published is not trimmed


def test_an_entry_the_store_did_not_write_is_skipped_and_the_next_event_still_goes_out(
    relays: list[EventRelay], store: RunStore, rabbitmq: Settings
) -> None:
    with events_queue(rabbitmq) as queue:
        outbox = f"{rabbitmq.namespace}:outbox"
        store.redis.xadd(outbox, {"run": "not-a-run", "event": "{not json"})
        store.redis.xadd(outbox, {"run": "0" * 32, "event": json.dumps({"event": "status", "run_id": "0" * 32,
                                                                         "status": "Robert'); DROP"})})
        run_id = store.create({"input": "after the garbage"}).run_id

        [event] = take_events(rabbitmq, queue, 1, timeout=60)

        assert (event.routing_key, event.headers[RUN_ID_HEADER]) == ("run.queued", run_id)
        poll_until(lambda: store.redis.xpending(outbox, "relay")["pending"] == 0, timeout=20,
                   failure=lambda: "the skipped entries were not acknowledged")


@pytest.mark.timeout(60)
def test_a_confirm_read_while_its_message_is_still_being_published_counts(rabbitmq: Settings) -> None:
    """A confirm can be read as soon as its message is written: on a loaded machine (a thread that runs again
    only after RabbitMQ answered) before the publisher goes on. Counted after that, the confirm found nothing
    to clear, and a batch whose last message it was waited the relay's whole 30 s and was published again.
    Here every message is written out and its confirm read before the publisher goes on."""
    import pika

    publisher = ConfirmedPublisher(rabbitmq, threading.Event())
    confirmed: list[int] = []
    on_confirm = publisher._on_confirm

    def counting(frame: Any) -> None:
        confirmed.append(frame.method.delivery_tag)
        on_confirm(frame)

    publisher._on_confirm = counting  # type: ignore[method-assign]  # confirm mode is turned on with it below
    publisher.connect()
    channel = publisher._channel
    publish, sent = channel._impl.basic_publish, 0

    def publish_then_stall(*args: Any, **kwargs: Any) -> None:
        nonlocal sent
        publish(*args, **kwargs)
        sent += 1
        poll_until(lambda: channel.connection.process_data_events(time_limit=0.01) or max(confirmed, default=0) >= sent,
                   timeout=10, failure=lambda: f"RabbitMQ confirmed {confirmed}, {sent} published")

    channel._impl.basic_publish = publish_then_stall
    messages = [RunEventMessage(event_id=str(i), routing_key="run.queued", body=b"{}", occurred_at=0.0,
                                properties=pika.BasicProperties(message_id=str(i))) for i in range(3)]
    try:
        publisher.publish(messages, still_leading=lambda: True)  # raised PublishError after 30 s
    finally:
        publisher.close()
    assert sent == 3


@pytest.mark.timeout(120)
def test_a_round_between_lease_renewals_is_one_read_that_acknowledges_the_last(rabbitmq: Settings,
                                                                                store: RunStore) -> None:
    """The lease is renewed, and entries nobody acknowledged are looked for, once every third of a lease
    (worker/outbox_reader.py, ``RENEW_S``), not at every round; a round's read acknowledges what the last one
    published: a relay publishing a trickle of events pays Redis one round trip a round, and leaves nothing
    unacknowledged when it stops."""
    relay_store = RunStore.connect(rabbitmq)
    relay = EventRelay(rabbitmq, relay_store)
    calls: Counter[str] = Counter()
    for name in ("lease", "pending", "new", "ack"):
        setattr(relay._cursor, name, _counted(getattr(relay._cursor, name), name, calls))
    events = 12
    with events_queue(rabbitmq) as queue:
        relay.start()
        try:
            began = time.monotonic()
            for i in range(events):  # one event a round: each published before the next is written
                store.create({"input": f"event {i}"})
                poll_until(lambda n=i + 1: relay.published >= n, timeout=30,
                           failure=lambda: f"{relay.published} published")
            elapsed = time.monotonic() - began
            take_events(rabbitmq, queue, events, timeout=30, distinct=True)
        finally:
            relay.stop()
            relay.join(10)
            relay_store.close()
    renewals = 2 + int(elapsed / RENEW_S)  # the first take, one each third of a lease since, one in flight
    assert calls["new"] >= events
    assert calls["ack"] <= renewals + 1, (calls, elapsed)  # before each look for the unacknowledged, and at the stop
    assert calls["lease"] <= renewals, (calls, elapsed)
    assert calls["pending"] <= renewals, (calls, elapsed)
    assert store.redis.xpending(store.keys.outbox(0), "relay")["pending"] == 0


def _counted(method: Any, name: str, calls: Counter[str]) -> Any:
    """``method``, counting its calls in ``calls[name]``."""
    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[name] += 1
        return method(*args, **kwargs)
    return counted
