"""The store's key layout: byte for byte the documented one on a single Redis; on a Redis Cluster, every
script's keys in one slot (docs/store.md, "The run store on a Redis Cluster"). Pure: no Redis."""

from __future__ import annotations

import uuid

import pytest
from redis.crc import key_slot

from runbrake.shared import RunStatus, RunStep, StepKind, TerminationReason
from runbrake.shared import _store_core as core
from runbrake.shared.records import SteerRequest

RUN = "0123456789abcdef0123456789abcdef"


def test_the_single_node_layout_is_the_documented_one() -> None:
    keys = core.Keys("ns")

    assert (keys.run(RUN), keys.steps(RUN), keys.cancel(RUN)) == (
        f"ns:run:{{{RUN}}}", f"ns:run:{{{RUN}}}:steps", f"ns:run:{{{RUN}}}:cancel")
    assert (keys.index(0), keys.leases(0), keys.unclaimed(0), keys.finished(0), keys.servers(0)) == (
        "ns:runs", "ns:leases", "ns:unclaimed", "ns:finished", "ns:servers")
    assert (keys.idempotency("order-1", 0), keys.servers_hour(7200.5, 0), keys.events) == (
        "ns:idem:order-1", "ns:servers:2", "ns:events")
    assert (keys.outbox(0), keys.outbox_of(RUN), keys.relay_lease) == ("ns:outbox", "ns:outbox", "ns:relay")
    assert list(keys.shards) == [0]
    assert keys.shard(RUN) == 0


def _slots(op: core.Op[object]) -> list[set[int]]:
    """The slots of each script call's keys."""
    return [{key_slot(key.encode()) for key in call.keys} for call in op.calls if isinstance(call, core.ScriptCall)]


def test_on_a_cluster_every_script_of_a_run_touches_one_slot() -> None:
    keys = core.Keys("ns", retention_s=60, cluster=True)
    run_id = uuid.uuid4().hex
    step = RunStep(kind=StepKind.TOOL, round=1, tool_server="calc", tool_name="get-sum")
    steer = SteerRequest(id="a" * 32, input="new", reason="", requested_by="me", requested_at=1.0)
    ops: list[core.Op[object]] = [
        core.claim(keys, run_id, "w", lease_s=60), core.claim(keys, run_id, "w", lease_s=60, resume=True),
        core.suspend(keys, run_id, "w", {}), core.approve_once(keys, run_id),
        core.settle(keys, run_id, RunStatus.FAILED, TerminationReason.TOOL_LOOP_ERROR),
        core.cancel(keys, run_id, reason="r", requested_by="me"), core.append_step(keys, run_id, step),
        core.complete(keys, run_id, step, owner="w"), core.renew_leases(keys, {run_id: "w"}, lease_s=60),
        core.reap(keys, run_id), core.take_redrive(keys, run_id, cutoff=0.0), core.get(keys, run_id),
        core.set_progress(keys, {run_id: {}}), core.hand_over(keys, run_id, step, owner="w", pending={}),
        core.steer(keys, run_id, steer), core.apply_steer(keys, run_id, steer, step, owner="w", token="t"),
    ]

    for op in ops:
        assert all(len(slots) == 1 for slots in _slots(op)), op.what
    shard_slot = key_slot(keys.leases(keys.shard(run_id)).encode())
    assert {slot for op in ops for slots in _slots(op) for slot in slots} == {shard_slot}


@pytest.mark.parametrize("idempotency_key", [None, "order-1", "another key"])
def test_on_a_cluster_a_create_touches_the_slot_of_its_idempotency_key_and_its_run(idempotency_key: str | None) -> None:
    keys = core.Keys("ns", cluster=True)

    op = core.create(keys, {"input": "x"}, idempotency_key=idempotency_key)

    [slots] = _slots(op)
    assert len(slots) == 1
    run_id = op.calls[0].args[0]  # type: ignore[union-attr]
    assert len(run_id) == 32
    assert int(run_id, 16) >= 0
    if idempotency_key is not None:
        assert keys.shard(run_id) == keys.idempotency_shard(idempotency_key)


@pytest.mark.parametrize("idempotency_key", [None, "order-1"])
def test_on_a_cluster_a_tenants_runs_and_counts_share_the_tenants_slot(idempotency_key: str | None) -> None:
    """One script counts all of a tenant's runs against its quotas: they all live in the tenant's shard, and a
    run's end releases it from the count in its own slot (docs/store.md, "The run store on a Redis
    Cluster")."""
    keys = core.Keys("ns", retention_s=60, cluster=True)
    tenant_slot = key_slot(keys.tenants(keys.tenant_shard("alpha")).encode())

    creates = [core.create(keys, {"input": "x"}, idempotency_key=idempotency_key, tenant="alpha") for _ in range(20)]

    assert all(_slots(op) == [{tenant_slot}] for op in creates)
    run_id = creates[0].calls[0].args[0]  # type: ignore[union-attr]
    ends = [core.settle(keys, run_id, RunStatus.FAILED, TerminationReason.TOOL_LOOP_ERROR),
            core.cancel(keys, run_id, reason="r", requested_by="me"), core.reap(keys, run_id),
            core.in_flight(keys, "alpha")]
    assert all(_slots(op) in ([{tenant_slot}], []) for op in ends)
    assert {key_slot(str(call.args[1]).encode()) for call in core.in_flight(keys, "alpha").calls
            if isinstance(call, core.Command)} == {tenant_slot}


def test_on_a_cluster_runs_spread_over_every_shard_and_readers_ask_each() -> None:
    keys = core.Keys("ns", cluster=True)

    assert len({keys.shard(uuid.uuid4().hex) for _ in range(2000)}) == core.SHARDS
    assert len({key_slot(keys.leases(shard).encode()) for shard in keys.shards}) == core.SHARDS
    assert len(core.expired_leases(keys, limit=10).calls) == core.SHARDS
    assert len(core.index_after(keys, None, count=10).calls) == core.SHARDS
    assert len(core.outbox_new(keys, "relay-1", count=10).calls) == core.SHARDS  # each shard's outbox
    assert len({key_slot(keys.outbox(shard).encode()) for shard in keys.shards}) == core.SHARDS
    ids = [uuid.uuid4().hex for _ in range(40)]
    for poll in (core.cancelled_among(keys, ids), core.wakeups_among(keys, ids)):
        assert all(len({key_slot(str(key).encode()) for key in call.args[1:]}) == 1
                   for call in poll.calls if isinstance(call, core.Command))


def test_merging_the_shards_newest_first_stops_where_a_full_shard_was_not_read_further() -> None:
    full = [("a3", 30.0), ("a2", 20.0)]  # full at count 2: a1 (10.0) exists but was not read
    short = [("b4", 40.0), ("b1", 15.0)]

    merged, exhausted = core.merge_newest([full, short[:1], []], 2)
    assert (merged, exhausted) == ([("b4", 40.0), ("a3", 30.0)], False)
    merged, exhausted = core.merge_newest([full, short], 3)
    assert (merged, exhausted) == ([("b4", 40.0), ("a3", 30.0), ("a2", 20.0)], False)  # b1 is left
    # b1 (15.0) lies past a2, where the full shard's unread entries may be: it waits for the next page.
    merged, exhausted = core.merge_newest([full, short], 2)
    assert (merged, exhausted) == ([("b4", 40.0), ("a3", 30.0)], False)
    assert core.merge_newest([[("x", 1.0)]], 2) == ([("x", 1.0)], True)
