"""Generated bodies published on the real queues of a running worker: run messages on ``<ns>.runs`` and
cancel requests on ``<ns>.cancel-requests``, as anyone with write access to the virtual host could.

Each is dead-lettered (with its reason) when the checks of the wire refuse it and applied when they
accept it, never a dead consumer thread: after every batch the worker still runs the next real run, and the
dead-letter queues hold exactly the bodies the checks refuse (docs/messages.md, "Run queue: what a worker
accepts"; docs/security.md, "Tested attacks").
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pika
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runbrake.shared import RunSpec, RunStatus, RunStore, Settings
from runbrake.shared.messaging.producer import Producer
from runbrake.shared.messaging.wire import (
    DEAD_REASON_HEADER,
    MAX_RUN_MESSAGE_BYTES,
    NOOP_ACTOR,
    RUN_ACTOR,
    MalformedCancelRequest,
    MalformedRunMessage,
    Topology,
    check_run_message,
    decode_cancel_request,
)
from tests.test_fuzz_inputs import SHAPED, examples
from tests.worker_helpers import WorkerProcess, take_messages, wait_for_run

_BATCHES = examples(ci=4, fuzz=200)
"""Batches per run of the test: each batch is published, then a real run must complete."""


def _envelopes(queue: str) -> st.SearchStrategy[bytes]:
    """Run-message bodies: mostly runbrake's own envelope with fields changed, dropped or added."""
    good = {"queue_name": queue, "actor_name": RUN_ACTOR, "args": ["0" * 32], "kwargs": {"resume": False},
            "options": {}, "message_id": "fuzz", "message_timestamp": 1_796_006_036_512}
    names = st.sampled_from([*good, "eta", "extra"])
    values = SHAPED | st.sampled_from((queue, "elsewhere.runs", RUN_ACTOR, NOOP_ACTOR, ["f" * 32], 2**64, -1))
    changed = st.dictionaries(names, values, max_size=3).flatmap(
        lambda change: st.sets(names, max_size=2).map(
            lambda dropped: {k: v for k, v in {**good, **change}.items() if k not in dropped}))
    return changed.map(lambda body: json.dumps(body).encode()) | st.binary(max_size=80)


_CANCEL_REQUESTS = (st.dictionaries(st.sampled_from(("run_id", "reason", "requested_by", "x")),
                                    SHAPED | st.sampled_from(("0" * 32, "A" * 32, "r" * 300)), max_size=4)
                    .map(lambda body: json.dumps(body).encode()) | st.binary(max_size=80))


def _publish(settings: Settings, bodies: list[tuple[str, bytes]]) -> None:
    connection = pika.BlockingConnection(pika.URLParameters(settings.rabbitmq_url))
    try:
        channel = connection.channel()
        channel.confirm_delivery()
        for queue, body in bodies:
            channel.basic_publish(exchange="", routing_key=queue, body=body, mandatory=True,
                                  properties=pika.BasicProperties(delivery_mode=2))
    finally:
        connection.close()


def _refused(check: Callable[[], Any], error: type[Exception]) -> bool:
    try:
        check()
    except error:
        return True
    return False


def test_generated_messages_on_the_real_queues_are_dead_lettered_or_applied_and_the_worker_goes_on(
    worker: WorkerProcess, producer: Producer, store: RunStore, rabbitmq: Settings,
) -> None:
    topology = Topology.of(rabbitmq)
    run_queue, requests_queue = topology.run_queue, topology.cancel_requests_queue
    actors = {RUN_ACTOR, NOOP_ACTOR}
    batches = 0

    @settings(max_examples=_BATCHES, suppress_health_check=list(HealthCheck))
    @given(runs=st.lists(_envelopes(run_queue), max_size=6), requests=st.lists(_CANCEL_REQUESTS, max_size=6))
    def batch(runs: list[bytes], requests: list[bytes]) -> None:
        nonlocal batches
        batches += 1
        _publish(rabbitmq, [(run_queue, body) for body in runs] + [(requests_queue, body) for body in requests])
        refused_runs = [body[:MAX_RUN_MESSAGE_BYTES] for body in runs if _refused(
            lambda body=body: check_run_message(body, queue=run_queue, actors=actors), MalformedRunMessage)]
        refused_requests = [body for body in requests if _refused(
            lambda body=body: decode_cancel_request(body), MalformedCancelRequest)]

        dead_runs = take_messages(rabbitmq, f"{run_queue}.XQ", len(refused_runs))
        dead_requests = take_messages(rabbitmq, topology.cancel_requests_dead_queue, len(refused_requests))

        assert sorted(body for body, _ in dead_runs) == sorted(refused_runs)
        assert sorted(body for body, _ in dead_requests) == sorted(refused_requests)
        assert all(headers.get(DEAD_REASON_HEADER) for _, headers in dead_runs + dead_requests)
        run = producer.enqueue(RunSpec.parse({"input": f"after batch {batches}", "model": {
            "provider": "scripted", "turns": [{"content": "done"}]}}))
        assert wait_for_run(store, run.run_id).status is RunStatus.COMPLETED
        assert worker.process.poll() is None

    batch()

    assert batches >= 1
    assert worker.logged("consumer_thread_died") == []
    assert worker.logged("run_message_check_failed") == []
