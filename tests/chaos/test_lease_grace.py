"""Nobody reaps a lease for time during which nobody could renew: a lease keeper that lost Redis renews
as soon as Redis answers again, but reaps nothing until Redis has answered it for a whole lease
(docs/leases.md, "Leases")."""

from __future__ import annotations

import os
import signal
import uuid

import pytest
from structlog.testing import capture_logs

from runbrake.shared import RunStatus, RunStore, Settings, TerminationReason
from runbrake.worker.leases import LeaseKeeper
from runbrake.worker.registry import ActiveRuns
from tests.chaos.conftest import PrivateRedis

pytestmark = pytest.mark.integration

LEASE_S = 5


class Clock:
    """The keeper's monotonic clock, moved by the test (the grace is counted on it; leases on Redis's)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def running(store: RunStore, owner: str) -> str:
    run_id = store.create({"input": "x"}).run_id
    assert store.claim(run_id, owner, lease_s=LEASE_S).won
    return run_id


def expire(store: RunStore, run_id: str) -> None:
    """Age a lease past its end by Redis's clock, as an outage longer than the lease would have."""
    seconds, micros = store.redis.time()
    past = seconds + micros / 1e6 - 1
    store.redis.hset(store.run_key(run_id), "lease_expires_at", repr(past))
    store.redis.zadd(f"{store.namespace}:leases", {run_id: past})


@pytest.mark.anyio  # the registry takes a run on an event loop
async def test_a_lease_that_ran_out_during_an_outage_is_reaped_only_a_lease_after_redis_answers_again(
    private_redis: PrivateRedis,
) -> None:
    settings = Settings(redis_url=private_redis.url, namespace=f"test-{uuid.uuid4().hex[:12]}", lease_s=LEASE_S,
                        redis_timeout_s=0.3)
    store = RunStore.connect(settings)
    registry = ActiveRuns()
    clock = Clock()
    keeper = LeaseKeeper(settings, store, registry, clock=clock)
    try:
        mine = running(store, "alive")
        registry.register(mine, "alive")
        gone = running(store, "gone")  # its worker died without a word: nobody renews it
        keeper.tend()

        with capture_logs() as logs:
            os.kill(private_redis.process.pid, signal.SIGSTOP)
            try:
                keeper.tend()  # times out: nobody can renew now
            finally:
                os.kill(private_redis.process.pid, signal.SIGCONT)
            expire(store, gone)
            expire(store, mine)  # the live worker's lease ran out during the outage too

            keeper.tend()  # Redis answers again: renew, but do not reap
            assert (store.status(mine), store.status(gone)) == (RunStatus.RUNNING, RunStatus.RUNNING)
            renewed = store.get(mine).lease_expires_at
            assert renewed is not None
            assert renewed > store.redis.time()[0]

            clock.now += LEASE_S - 0.5
            keeper.tend()
            assert store.status(gone) is RunStatus.RUNNING  # still within the grace

            clock.now += 0.5
            keeper.tend()  # a whole lease with Redis answering: the one nobody renewed is reaped
        record = store.get(gone)
        assert (record.status, record.termination_reason) == (RunStatus.FAILED, TerminationReason.LEASE_LOST)
        assert store.status(mine) is RunStatus.RUNNING
        events = [e["event"] for e in logs if e["event"].startswith("lease_")]
        assert events == ["lease_upkeep_failed", "lease_reaping_paused", "lease_reaping_resumed"]
    finally:
        store.delete_namespace()
        store.close()


def test_a_second_outage_during_the_grace_starts_it_again(private_redis: PrivateRedis) -> None:
    settings = Settings(redis_url=private_redis.url, namespace=f"test-{uuid.uuid4().hex[:12]}", lease_s=LEASE_S,
                        redis_timeout_s=0.3)
    store = RunStore.connect(settings)
    clock = Clock()
    keeper = LeaseKeeper(settings, store, ActiveRuns(), clock=clock)
    try:
        gone = running(store, "gone")
        for _ in range(2):
            os.kill(private_redis.process.pid, signal.SIGSTOP)
            try:
                keeper.tend()
            finally:
                os.kill(private_redis.process.pid, signal.SIGCONT)
            expire(store, gone)
            keeper.tend()
            clock.now += LEASE_S - 0.5
            keeper.tend()
            assert store.status(gone) is RunStatus.RUNNING

        clock.now += 0.5
        keeper.tend()
        assert store.status(gone) is RunStatus.FAILED
    finally:
        store.delete_namespace()
        store.close()
