"""The wire (queue and exchange names, message bodies, one function to delete a namespace's
topology) and the store's Lua scripts (statuses come from the enums, a lost script cache heals)."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from typing import Any

import pika
import pika.exceptions
import pytest
import redis

from runbrake.shared import AsyncRunStore, RunStatus, RunStep, RunStore, Settings, StepKind, StoreError, _scripts
from runbrake.shared.messaging.wire import (
    MAX_CANCEL_BODY_BYTES,
    NOOP_ACTOR,
    RUN_ACTOR,
    Topology,
    decode_cancel,
    delete_topology,
    encode_cancel,
    run_message,
)
from runbrake.shared.status import TerminationReason
from tests.ports import free_port

# -- names and bodies ----------------------------------------------------------------------------


def test_every_name_of_a_namespace_is_derived_from_it_in_one_place() -> None:
    topology = Topology("ns-1")

    assert (topology.run_queue, topology.noop_queue) == ("ns-1.runs", "ns-1.noop")
    assert topology.cancel_exchange == "ns-1.cancel"
    assert topology.queues() == (
        "ns-1.runs", "ns-1.runs.DQ", "ns-1.runs.XQ", "ns-1.noop", "ns-1.noop.DQ", "ns-1.noop.XQ",
    )


def test_a_run_message_carries_the_run_id_and_whether_it_resumes_nothing_more() -> None:
    message = run_message(Topology("ns-1"), "abc", resume=True)

    assert (message.queue_name, message.actor_name) == ("ns-1.runs", RUN_ACTOR) == ("ns-1.runs", "execute_run")
    assert (message.args, message.kwargs, message.options) == (("abc",), {"resume": True}, {})
    assert NOOP_ACTOR == "noop"


def test_a_cancel_body_round_trips_and_is_the_documented_json() -> None:
    body = encode_cancel("run-1")

    assert json.loads(body) == {"run_id": "run-1"}
    assert decode_cancel(body) == "run-1"
    assert decode_cancel(b'{"run_id": "run-2", "reason": "ops"}') == "run-2"


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"not json",
        b"\xff\xfe\x00garbage",
        b"[1, 2]",
        b'"run-1"',
        b"null",
        b'{"run_id": 7}',
        b'{"run_id": {"nested": "dict"}}',
        b'{"run_id": ""}',
        b'{"runid": "x"}',
        json.dumps({"run_id": "x" * 101}).encode(),
        b"[" * 100_000 + b"]" * 100_000,
        b'{"run_id": "x", "pad": "' + b"y" * MAX_CANCEL_BODY_BYTES + b'"}',
    ],
    ids=["empty", "text", "binary", "list", "string", "null", "int-id", "dict-id", "empty-id", "no-id", "long-id",
         "deeply-nested", "oversized"],
)
def test_a_malformed_cancel_body_decodes_to_nothing_and_never_raises(body: bytes) -> None:
    assert decode_cancel(body) is None


@pytest.mark.integration
def test_deleting_a_namespaces_topology_removes_every_queue_and_the_cancel_exchange(rabbitmq: Settings) -> None:
    topology = Topology.of(rabbitmq)
    connection = pika.BlockingConnection(pika.URLParameters(rabbitmq.rabbitmq_url))
    try:
        channel = connection.channel()
        for queue in topology.queues():
            channel.queue_declare(queue=queue, durable=True)
        topology.declare_cancel_exchange(channel)
    finally:
        connection.close()

    delete_topology(rabbitmq)

    connection = pika.BlockingConnection(pika.URLParameters(rabbitmq.rabbitmq_url))
    try:
        for queue in topology.queues():
            channel = connection.channel()
            with pytest.raises(pika.exceptions.ChannelClosedByBroker, match="NOT_FOUND"):
                channel.queue_declare(queue=queue, passive=True)
        channel = connection.channel()
        with pytest.raises(pika.exceptions.ChannelClosedByBroker, match="NOT_FOUND"):
            channel.exchange_declare(exchange=topology.cancel_exchange, passive=True)
    finally:
        connection.close()


# -- the scripts ---------------------------------------------------------------------------------

_LITERALS = re.compile(
    "'(" + "|".join(re.escape(v) for v in [*RunStatus, *TerminationReason] if v and v != "unknown") + ")'"
)


@pytest.mark.parametrize("script", _scripts.ALL, ids=lambda s: s.name)
def test_no_script_spells_a_status_or_reason_itself(script: _scripts.Script) -> None:
    assert _LITERALS.findall(script.template) == []
    assert re.findall(r"\$\w+", script.source) == []  # every placeholder filled in


def test_the_terminal_check_in_lua_is_built_from_the_python_enum() -> None:
    for status in (RunStatus.QUEUED, RunStatus.RUNNING, RunStatus.WAITING_FOR_APPROVAL):
        assert f"st ~= '{status.value}'" in _scripts.SETTLE.source
    assert "'completed'" not in _scripts.SETTLE.source


@pytest.mark.parametrize("settings", ["single", "cluster"], indirect=True)  # tests/cluster_helpers.py
@pytest.mark.integration
def test_the_store_heals_when_redis_lost_its_script_cache(store: RunStore) -> None:
    created = store.create({"input": "x"})
    store.redis.script_flush()

    assert store.claim(created.run_id, "w1", lease_s=60).won
    store.redis.script_flush()
    assert store.renew_leases({created.run_id: "w1"}, lease_s=60) == set()

    assert store.status(created.run_id) is RunStatus.RUNNING


@pytest.mark.parametrize("settings", ["single", "cluster"], indirect=True)  # tests/cluster_helpers.py
@pytest.mark.integration
@pytest.mark.anyio
async def test_the_async_store_heals_when_redis_lost_its_script_cache(store: RunStore, settings: Settings) -> None:
    created = store.create({"input": "x"})
    async_store = AsyncRunStore.connect(settings)
    try:
        store.redis.script_flush()
        claim = await async_store.claim(created.run_id, "w1", lease_s=60)
        store.redis.script_flush()
        appended = await async_store.append_step(created.run_id, RunStep(kind=StepKind.MODEL, round=1))
    finally:
        await async_store.aclose()

    assert claim.won
    assert claim.request == {"input": "x"}
    assert (appended.step.sequence, appended.cancelled) == (1, False)


@pytest.mark.parametrize("settings", ["single", "cluster"], indirect=True)  # tests/cluster_helpers.py
@pytest.mark.integration
@pytest.mark.anyio
async def test_the_async_claim_reads_the_request_in_the_same_round_trip_and_the_append_probes(
    store: RunStore, settings: Settings
) -> None:
    created = store.create({"input": "hello"})
    async_store = AsyncRunStore.connect(settings)
    try:
        claim = await async_store.claim(created.run_id, "w1", lease_s=60)
        first = await async_store.append_step(created.run_id, RunStep(kind=StepKind.MODEL, round=1))
        assert store.cancel(created.run_id, reason="stop", requested_by="ops").won
        second = await async_store.append_step(created.run_id, RunStep(kind=StepKind.MODEL, round=2))
        refused = await async_store.claim(created.run_id, "w2", lease_s=60)
    finally:
        await async_store.aclose()

    assert (claim.won, claim.found, claim.request, claim.pending) == (True, RunStatus.QUEUED, {"input": "hello"}, None)
    assert (first.cancelled, second.cancelled) == (False, True)
    assert [s.sequence for s in store.get(created.run_id).steps] == [1, 2]
    assert (refused.won, refused.found, refused.request) == (False, RunStatus.CANCELLED, None)


@pytest.mark.anyio
async def test_the_async_store_names_redis_when_it_cannot_be_reached_and_its_probe_stays_fail_soft() -> None:
    unreachable = AsyncRunStore.connect(Settings(redis_url=f"redis://127.0.0.1:{free_port()}/0", redis_timeout_s=0.5))
    try:
        with pytest.raises(StoreError, match=r"Redis at 127\.0\.0\.1:\d+: claim run r1"):
            await unreachable.claim("r1", "w1", lease_s=60)
        assert await unreachable.cancel_requested("r1") is False
    finally:
        await unreachable.aclose()


@pytest.mark.parametrize("settings", ["single", "cluster"], indirect=True)  # tests/cluster_helpers.py
@pytest.mark.integration
def test_every_status_change_and_appended_step_is_announced_on_the_events_channel(
    store: RunStore, settings: Settings
) -> None:
    # Subscribed as the API's event hub is (broker/events.py): one connection to the URL's node. On a
    # cluster, the scripts publish on whichever node holds the run, and every node hears it.
    listener = redis.Redis.from_url(settings.redis_url, decode_responses=True)
    subscriber = listener.pubsub(ignore_subscribe_messages=True)
    subscriber.subscribe(store.keys.events)
    try:
        created = store.create({"input": "x"})
        store.claim(created.run_id, "w1", lease_s=60)
        store.append_step(created.run_id, RunStep(kind=StepKind.MODEL, round=1, content="hi"))
        store.cancel(created.run_id, reason="stop", requested_by="ops")
        store.settle(created.run_id, RunStatus.COMPLETED, TerminationReason.COMPLETED)  # refused: announces nothing
        events = _messages(subscriber, until=lambda got: len(got) >= 4, timeout=5.0)
        late = _messages(subscriber, until=lambda _got: False, timeout=0.3)
    finally:
        subscriber.close()
        listener.close()

    assert late == []
    assert [(e["event"], e.get("status")) for e in events] == [
        ("status", "queued"), ("status", "running"), ("step", None), ("status", "cancelled"),
    ]
    assert {e["run_id"] for e in events} == {created.run_id}
    assert events[2]["step"] == store.get(created.run_id).steps[0].to_dict()
    assert events[3]["termination_reason"] == "cancelled"


def _messages(
    subscriber: Any, *, until: Callable[[list[dict[str, Any]]], bool], timeout: float
) -> list[dict[str, Any]]:
    """The channel's messages until ``until`` holds or ``timeout`` s pass (a bounded wait on events)."""
    got: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout
    while not until(got) and time.monotonic() < deadline:
        message = subscriber.get_message(timeout=max(0.0, deadline - time.monotonic()))
        if message is not None:
            got.append(json.loads(message["data"]))
    return got
