"""The Redis primary killed (kill -9) under 50 runs in flight, with 10 cancels issued around the kill: the
Sentinels promote the replica, the store follows it, and the killed node comes back as a replica.

With ``RUNBRAKE_REDIS_MIN_REPLICAS_ACK=1`` every transition that must not be lost waits for the replica
(``WAIT 1``) before it is answered, so an acknowledged cancel is on the replica before the primary dies:
every acknowledged cancel wins, no run is lost, every run ends terminal (exact counts). Without it,
replication is asynchronous: what the promoted replica never had is lost with the primary, and the test
reports what that was (how much depends on timing; nothing is asserted about it). Writes that fail while
the Sentinels fail over (connection errors, READONLY, or no replica to acknowledge them) are retried: by
the worker as it retries an outage (worker/runtime.py, ``durably``), and here as a caller would.

Everything is the test's own: two redis-servers, three Sentinels (tests/chaos/conftest.py, ``redis_failover``).
RabbitMQ is the machine's, untouched by the fault.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest

from runbrake.shared import RunNotFound, RunStatus, StoreError
from runbrake.shared.messaging.cancel import CancelPublisher, CancelResult, cancel_run
from tests.chaos.conftest import Client, RedisFailover, enqueue_call
from tests.mcp_helpers import Toolbox, matching_events, wait_for_event
from tests.polling import poll_until
from tests.worker_helpers import WorkerProcess, wait_for_run

# First in make test, alone in make test-long (docs/development.md, "Tests").
pytestmark = [pytest.mark.integration, pytest.mark.long]

RUNS = 50
CANCELLED = 10
"""Runs in a long call (only a cancel ends them): half are cancelled just before the kill, half during the
failover."""
SHORT_CALL_S = 8.0
"""The other runs' call: still in flight at the kill, it ends during or after the failover."""
LEASE_S = 60
"""Longer than a failover and the rejoin: a run whose lease could not be renewed meanwhile is not reaped."""


def _acknowledged_cancel(client: Client, publisher: CancelPublisher, run_id: str) -> CancelResult:
    """Cancel the run, asking again (as a caller would) while the store answers an error; the answer that
    comes is the acknowledged one (a retry of a cancel whose WAIT fell short finds the run cancelled)."""
    def attempt() -> CancelResult | None:
        try:
            return cancel_run(client.store, publisher, run_id, reason="failover drill", requested_by="chaos test")
        except StoreError:
            return None

    return poll_until(attempt, timeout=60, interval=0.2, failure=lambda: f"the cancel of {run_id} never answered")


@pytest.mark.timeout(300)  # a failover and the rejoin take 20 s, the 50 runs and both workers as long again
@pytest.mark.parametrize("replicas_ack", [1, 0], ids=["wait-for-replica", "asynchronous"])
def test_a_redis_failover_under_50_runs_keeps_every_acknowledged_cancel_when_writes_wait_for_the_replica(
    replicas_ack: int, redis_failover: RedisFailover, toolbox_http: Toolbox, point_at: Callable[..., Client],
    start_worker: Callable[..., WorkerProcess],
) -> None:
    client = point_at({**redis_failover.env(), "RUNBRAKE_REDIS_MIN_REPLICAS_ACK": str(replicas_ack),
                       "RUNBRAKE_REDIS_REPLICA_ACK_TIMEOUT_S": "1"}, lease_s=LEASE_S, redis_timeout_s=2.0)
    workers = [start_worker(concurrency=RUNS // 2), start_worker(concurrency=RUNS // 2)]
    publisher = CancelPublisher(client.settings)
    try:
        long_runs = [enqueue_call(client.producer, toolbox_http, 600 + i) for i in range(CANCELLED)]
        short = {enqueue_call(client.producer, toolbox_http, SHORT_CALL_S + i / 10_000): SHORT_CALL_S + i / 10_000
                 for i in range(RUNS - CANCELLED)}
        wait_for_event(toolbox_http.events, "started", tool="slow", count=RUNS, timeout=60)

        # Five cancels acknowledged just before the kill, five while the Sentinels fail over.
        answers = {run_id: _acknowledged_cancel(client, publisher, run_id) for run_id in long_runs[:CANCELLED // 2]}
        killed_at = time.monotonic()
        old = redis_failover.kill_primary()
        with ThreadPoolExecutor(max_workers=1) as during:
            # The Sentinels fail over and the killed node rejoins while these cancels are asked (and asked
            # again): a WAIT can be satisfied only once the new primary has its replica back.
            def cancel_during() -> dict[str, CancelResult]:
                found = {}
                for run_id in long_runs[CANCELLED // 2:]:
                    found[run_id] = _acknowledged_cancel(client, publisher, run_id)
                    acknowledged_after.append(time.monotonic() - killed_at)
                return found

            acknowledged_after: list[float] = []
            later = during.submit(cancel_during)
            new, failover_s = redis_failover.wait_for_failover(old)
            promoted_s = time.monotonic() - killed_at
            rejoin_s = redis_failover.rejoin(old)
            answers |= later.result(timeout=120)

        records, lost = {}, []
        for run_id in [*long_runs, *short]:
            try:
                records[run_id] = wait_for_run(client.store, run_id, timeout=120)
            except RunNotFound:
                lost.append(run_id)
        retried = sum(len(w.logged("store_write_retrying")) for w in workers)
        short_of_replicas = sum("replicas asked for" in str(e.get("error")) for w in workers
                                for e in w.logged("store_write_retrying"))
    finally:
        publisher.close()

    acknowledged = {run_id for run_id, answer in answers.items() if answer.won or answer.found is RunStatus.CANCELLED}
    not_kept = sorted(run_id for run_id in acknowledged if run_id in records
                      and records[run_id].status is not RunStatus.CANCELLED)
    statuses = Counter(r.status.value for r in records.values())
    started = Counter(e["args"]["seconds"] for e in matching_events(toolbox_http.events, "started", tool="slow"))
    print(f"replicas_ack={replicas_ack}: primary {old} killed, {new} promoted {promoted_s:.1f} s later "
          f"(Sentinels' failover seen after {failover_s:.1f} s), the old primary back as a replica in "
          f"{rejoin_s:.1f} s; the cancels asked during it acknowledged "
          f"{', '.join(f'{t:.1f}' for t in acknowledged_after)} s after the kill; "
          f"runs {dict(statuses)}; runs lost: {len(lost)}; acknowledged cancels not kept: "
          f"{len(not_kept)} of {len(acknowledged)}; worker writes retried: {retried}, short of replicas: "
          f"{short_of_replicas}; calls started twice: {sum(n - 1 for n in started.values() if n > 1)}")

    assert all(record.status.is_terminal for record in records.values())  # wait_for_run waited for each
    if replicas_ack:
        assert lost == []
        assert acknowledged == set(long_runs)
        assert not_kept == []
        assert statuses == {RunStatus.CANCELLED.value: CANCELLED, RunStatus.COMPLETED.value: RUNS - CANCELLED}
        assert {run_id for run_id, r in records.items() if r.status is RunStatus.CANCELLED} == set(long_runs)
