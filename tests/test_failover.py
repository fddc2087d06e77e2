"""Failover settings and their pieces: several RabbitMQ nodes, Redis Sentinels, replicas acknowledging the
durable transitions (docs/operating.md, "Redis failover" and "A RabbitMQ cluster"). The faults themselves
are in tests/chaos/test_redis_failover.py and tests/chaos/test_rabbitmq_cluster.py."""

from __future__ import annotations

import logging

import pytest
import redis
from structlog.testing import capture_logs

from runbrake.shared import ConfigError, RunStatus, RunStore, Settings, TerminationReason
from runbrake.shared import _store_core as core
from runbrake.shared.errors import NotReplicated, StoreError
from runbrake.shared.messaging.rabbitmq import BrokerOutage
from runbrake.shared.messaging.wire import connection_parameters
from runbrake.shared.steps import RunStep, StepKind
from tests.test_cli import runbrake


def test_rabbitmq_url_takes_the_nodes_of_a_cluster_in_order_and_every_connection_gets_one_parameter_set_each() -> None:
    settings = Settings.from_env({"RUNBRAKE_RABBITMQ_URL": "amqp://a:b@10.0.0.1:5672/, amqp://a:b@10.0.0.2:5673/"})
    assert settings.rabbitmq_urls == ("amqp://a:b@10.0.0.1:5672/", "amqp://a:b@10.0.0.2:5673/")
    nodes = connection_parameters(settings, name="runbrake-test", connection_attempts=1)
    assert [(p.host, p.port, p.connection_attempts) for p in nodes] == [("10.0.0.1", 5672, 1), ("10.0.0.2", 5673, 1)]
    assert all(p.client_properties == {"connection_name": "runbrake-test"} for p in nodes)


@pytest.mark.parametrize(("environ", "variable"), [
    ({"RUNBRAKE_RABBITMQ_URL": "amqp://a/,http://b/"}, "RUNBRAKE_RABBITMQ_URL"),
    ({"RUNBRAKE_RABBITMQ_URL": ",".join(["amqp://a/"] * 17)}, "RUNBRAKE_RABBITMQ_URL"),
    ({"RUNBRAKE_REDIS_SENTINELS": "10.0.0.1:26379"}, "RUNBRAKE_REDIS_SENTINEL_MASTER"),
    ({"RUNBRAKE_REDIS_SENTINELS": "10.0.0.1", "RUNBRAKE_REDIS_SENTINEL_MASTER": "m"}, "RUNBRAKE_REDIS_SENTINELS"),
    ({"RUNBRAKE_REDIS_SENTINELS": "bad host:1", "RUNBRAKE_REDIS_SENTINEL_MASTER": "m"}, "RUNBRAKE_REDIS_SENTINELS"),
    ({"RUNBRAKE_REDIS_SENTINELS": "h:1", "RUNBRAKE_REDIS_SENTINEL_MASTER": "m", "RUNBRAKE_REDIS_CLUSTER": "true"},
     "RUNBRAKE_REDIS_SENTINELS"),
    ({"RUNBRAKE_REDIS_SENTINELS": "h:1", "RUNBRAKE_REDIS_SENTINEL_MASTER": "m", "RUNBRAKE_REDIS_URL": "unix:///r.sock"},
     "RUNBRAKE_REDIS_URL"),
    ({"RUNBRAKE_REDIS_SENTINEL_MASTER": "no spaces"}, "RUNBRAKE_REDIS_SENTINEL_MASTER"),
    ({"RUNBRAKE_REDIS_MIN_REPLICAS_ACK": "1", "RUNBRAKE_REDIS_CLUSTER": "true"}, "RUNBRAKE_REDIS_MIN_REPLICAS_ACK"),
    ({"RUNBRAKE_REDIS_MIN_REPLICAS_ACK": "1", "RUNBRAKE_REDIS_REPLICA_ACK_TIMEOUT_S": "2"},
     "RUNBRAKE_REDIS_REPLICA_ACK_TIMEOUT_S"),
    ({"RUNBRAKE_REDIS_MIN_REPLICAS_ACK": "17"}, "RUNBRAKE_REDIS_MIN_REPLICAS_ACK"),
])
def test_failover_settings_that_cannot_work_are_refused_naming_the_variable(environ: dict[str, str],
                                                                           variable: str) -> None:
    with pytest.raises(ConfigError) as raised:
        Settings.from_env(environ)
    assert raised.value.variable == variable


def test_sentinels_are_read_as_host_port_pairs_and_the_url_keeps_only_database_and_credentials() -> None:
    settings = Settings.from_env({"RUNBRAKE_REDIS_SENTINELS": "10.0.0.1:26379, sentinel-b:26380,[::1]:26381",
                                  "RUNBRAKE_REDIS_SENTINEL_MASTER": "runs",
                                  "RUNBRAKE_REDIS_URL": "rediss://user:pw@ignored:1/3"})
    assert settings.redis_sentinels == (("10.0.0.1", 26379), ("sentinel-b", 26380), ("::1", 26381))
    assert core.sentinel_url_options(settings.redis_url) == {"db": 3, "username": "user", "password": "pw",
                                                             "ssl": True}
    store = RunStore.connect(settings)  # lazily: nothing is reached yet
    assert store.where == "sentinel master runs via 10.0.0.1:26379,sentinel-b:26380,::1:26381"
    store.close()


def test_exactly_the_transitions_that_must_not_be_lost_are_durable() -> None:
    keys = core.Keys("ns")
    run_id = "a" * 32
    step = RunStep(kind=StepKind.MODEL, round=1, content="done")
    durable = {
        "create": core.create(keys, {"input": "x"}, idempotency_key=None),
        "cancel": core.cancel(keys, run_id, reason="r", requested_by="t"),
        "approve": core.approve(keys, run_id),
        "approve_once": core.approve_once(keys, run_id),
        "deny": core.settle(keys, run_id, RunStatus.FAILED, TerminationReason.APPROVAL_DENIED,
                            required_status=RunStatus.WAITING_FOR_APPROVAL),
        "settle": core.settle(keys, run_id, RunStatus.FAILED, TerminationReason.TOOL_LOOP_ERROR, owner="o"),
        "complete": core.complete(keys, run_id, step, owner="o"),
        "hand_over": core.hand_over(keys, run_id, step, owner="o", pending={}),
    }
    others = {
        "claim": core.claim(keys, run_id, "o", lease_s=5), "append_step": core.append_step(keys, run_id, step),
        "probe": core.cancel_requested(keys, run_id), "renew": core.renew_leases(keys, {run_id: "o"}, lease_s=5),
        "get": core.get(keys, run_id),
    }
    assert {name for name, op in {**durable, **others}.items() if op.durable} == set(durable)


def _replicas(client: redis.Redis) -> int:
    return int(client.info("replication").get("connected_slaves", 0))


def test_a_durable_write_fewer_replicas_acknowledged_fails_as_a_store_error_and_other_ops_do_not_wait(
    store: RunStore,
) -> None:
    asked = _replicas(store.redis) + 1  # one more than the Redis has: WAIT cannot be satisfied
    waiting = RunStore(store.redis, store.namespace, replication=core.Replication(asked, 0.05))
    with pytest.raises(NotReplicated) as raised:
        waiting.create({"input": "x"})
    assert isinstance(raised.value, StoreError)  # retried where an outage is (worker/runtime.py, durably)
    assert f"of the {asked} replicas asked for" in str(raised.value)
    # The primary has it (WAIT does not undo a write): the caller asks again or checks.
    [run_id] = store.redis.zrange(store.keys.index(0), 0, -1)
    assert store.status(run_id) is RunStatus.QUEUED
    assert waiting.status(run_id) is RunStatus.QUEUED  # a read sends no WAIT
    assert waiting.cancel_requested(run_id) is False
    with pytest.raises(NotReplicated):
        waiting.cancel(run_id, reason="r", requested_by="t")
    assert store.status(run_id) is RunStatus.CANCELLED


def test_a_broker_outage_is_one_line_when_lost_and_one_when_back_whatever_dramatiq_repeats() -> None:
    outage = BrokerOutage()
    logger = logging.getLogger("dramatiq.worker.ConsumerThread(test-outage.runs)")

    def record(message: str, level: int = logging.CRITICAL) -> bool:
        return outage.filter(logger.makeRecord(logger.name, level, __file__, 1, message, (), None))

    with capture_logs() as logs:
        for _ in range(3):
            assert record("Consumer encountered a connection error: Stream connection lost") is False
            assert record("Restarting consumer in 3.00 seconds.", logging.INFO) is False
            assert record("Failed to post_process_message(execute_run('x')) due to a connection error: …",
                          logging.WARNING) is False
        assert record("Failed to ack message: not in known tags.", logging.WARNING) is False
        assert record("Enqueueing message 'x' on queue 'q'.", logging.DEBUG) is True  # anything else passes
        outage.back("test-outage.runs")
        outage.back("test-outage.runs.DQ")
    assert [(e["event"], e["log_level"]) for e in logs] == [("broker_connection_lost", "warning"),
                                                            ("broker_connection_restored", "info")]
    assert logs[1]["acks_lost_so_far"] == 1


def test_runbrake_cancel_whose_fence_too_few_replicas_acknowledged_exits_3_and_says_asking_again_is_safe(
    store: RunStore,
) -> None:
    run_id = store.create({"input": "x"}).run_id
    asked = _replicas(store.redis) + 1
    done = runbrake("cancel", run_id, env={"RUNBRAKE_REDIS_MIN_REPLICAS_ACK": str(asked),
                                           "RUNBRAKE_REDIS_REPLICA_ACK_TIMEOUT_S": "0.05"})
    assert done.returncode == 3, done.stderr
    assert "asking again is safe" in done.stderr
    assert "is the service running" not in done.stderr
    assert store.status(run_id) is RunStatus.CANCELLED  # the primary has the fence
