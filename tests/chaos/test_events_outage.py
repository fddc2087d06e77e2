"""RabbitMQ killed (kill -9) while runs finish: their events wait in the outbox and are all published once
the node is back, in order per run, none lost (the consumer's durable queue holds every event the outbox
holds, copies aside); meanwhile ``GET /v1/events`` resumed with ``Last-Event-ID`` replays
exactly the status changes that happened (docs/messages.md, "Run events: delivery"; docs/http-api.md,
"Events: resuming").

The node is the test's own (``private_rabbitmq``), booted again on the same port and data folder: the
consumer's durable queue and the persistent, confirmed events in it survive, as they would in production.
Two workers run, so two relays: one publishes, the other stands by.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable

import pytest

from runbrake.shared import RunStatus, Settings
from runbrake.shared._store_core import RELAY_GROUP
from runbrake.shared.messaging.wire import RUN_ID_HEADER
from tests.api_helpers import ApiProcess
from tests.chaos.conftest import Client, PrivateRabbitMQ, PrivateRedis
from tests.events_helpers import events_queue, feed, frames, position, stored_statuses, take_events
from tests.mcp_helpers import Toolbox, wait_for_event
from tests.polling import poll_until
from tests.worker_helpers import WorkerProcess, call, spec, wait_for_run

pytestmark = pytest.mark.integration

RUNS = 10
CALL_S = 12.0
"""How long each run's tool call lasts: the node is killed while every run is inside it."""
BEFORE = ("run.queued", "run.running", "step.model")
AFTER = ("step.tool", "step.model", "run.completed")


def test_runs_that_end_while_rabbitmq_is_down_have_every_event_published_in_order_once_it_is_back(
    private_rabbitmq: PrivateRabbitMQ, private_redis: PrivateRedis, toolbox_http: Toolbox, rabbitmq: Settings,
    start_worker: Callable[..., WorkerProcess], start_api: Callable[..., ApiProcess],
    point_at: Callable[..., Client],
) -> None:
    client = point_at({"RUNBRAKE_RABBITMQ_URL": private_rabbitmq.url, "RUNBRAKE_REDIS_URL": private_redis.url},
                      lease_s=60, redis_timeout_s=2.0)
    settings, store, producer = client.settings, client.store, client.producer
    outbox = f"{settings.namespace}:outbox"
    workers = [start_worker(concurrency=RUNS), start_worker(concurrency=RUNS)]
    api = start_api()
    with events_queue(settings) as queue:
        run_ids = [producer.enqueue(spec({"toolbox": toolbox_http.spec}, [
            {"tool_calls": [call("slow", seconds=CALL_S + i / 1000)]}, {"content": "done"}])).run_id
            for i in range(RUNS)]
        wait_for_event(toolbox_http.events, "started", tool="slow", count=RUNS, timeout=60)
        last_seen = str(store.redis.xrevrange(outbox, "+", "-", count=1)[0][0])  # every run is in its call
        killed_at = time.time()
        private_rabbitmq.kill()
        records = {run_id: wait_for_run(store, run_id, timeout=CALL_S + 60) for run_id in run_ids}
        assert all(r.finished_at is not None and r.finished_at > killed_at for r in records.values()), (
            "a run ended before the node was down: the test proves nothing")
        poll_until(lambda: [e for w in workers for e in w.logged("event_relay_interrupted")], timeout=30,
                   failure=lambda: "no relay noticed that RabbitMQ was gone")
        # The feed does not need RabbitMQ: resumed from the last event before the outage, it replays
        # exactly the status changes since.
        missed = stored_statuses(store, settings, last_seen)
        with feed(api, last_seen) as response:
            stream = frames(response)
            replayed = [next(stream) for _ in missed]
        written = [stream_id for stream_id, _ in store.redis.xrange(outbox)]

        private_rabbitmq.start()

        last_written = str(store.redis.xrevrange(outbox, "+", "-", count=1)[0][0])

        def all_acknowledged() -> bool:
            # The relay's group (the webhook dispatcher reads the same outbox through its own).
            [group] = [g for g in store.redis.xinfo_groups(outbox) if g["name"] in (RELAY_GROUP, RELAY_GROUP.encode())]
            return bool(group["pending"] == 0 and group["last-delivered-id"] == last_written)

        poll_until(all_acknowledged, timeout=60, interval=0.2,
                   failure=lambda: f"the relays did not publish the outbox: {store.redis.xinfo_groups(outbox)}")
        # Everything acknowledged was confirmed; a node booted after a kill -9 may still be recovering the queue
        # (its index is rebuilt from scratch) when the confirms come: taken with a bound, never drained at once.
        try:
            received = take_events(settings, queue, len(written), distinct=True, timeout=60)
        except AssertionError as exc:
            queues = private_rabbitmq.ctl("list_queues", "name", "messages", "state")
            raise AssertionError(f"{exc}\nthe node's queues: {queues}") from exc

    assert [status for _, _, status in missed] == ["completed"] * RUNS
    assert [(f.id, f.data["run_id"], f.data["status"]) for f in replayed] == missed

    assert all(r.status is RunStatus.COMPLETED for r in records.values())
    assert len(written) == (len(BEFORE) + len(AFTER)) * RUNS
    assert len([i for i in written if position(i) > position(last_seen)]) == len(AFTER) * RUNS  # the outage's
    events = {e.message_id: e for e in received}
    assert sorted(events, key=position) == written  # every event published, none lost, none made up
    # At least once: a copy is the same message (same id, routing key and body), never another event. (A
    # node killed with -9 may also deliver again messages whose acks it had not written down.)
    for copy in received:
        assert (copy.routing_key, copy.body) == (events[copy.message_id].routing_key, events[copy.message_id].body)
    print(f"{len(received)} messages on the queue for {len(events)} events "
          f"({sum(e.redelivered for e in received)} redelivered by the restarted node)")
    for run_id in run_ids:
        mine = [e for e in received if e.headers[RUN_ID_HEADER] == run_id]
        unique = list({e.message_id: e for e in mine}.values())
        assert [e.routing_key for e in unique] == [*BEFORE, *AFTER]
        assert [e.message_id for e in unique] == sorted((e.message_id for e in unique), key=position)
        assert all(e.persistent for e in unique)
    per_run = Counter((*BEFORE, *AFTER))
    assert Counter(e.routing_key for e in events.values()) == {key: n * RUNS for key, n in per_run.items()}
