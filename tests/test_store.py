"""The run store against the real Redis: guarded transitions, the cancel fence, steps in order,
idempotency, fail-soft probes (docs/store.md, "The run lifecycle" and "Cancellation")."""

from __future__ import annotations

import json
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import pytest
import redis
from structlog.testing import capture_logs

from runbrake.shared import (
    RunNotFound,
    RunStatus,
    RunStep,
    RunStore,
    Settings,
    StepKind,
    StoreError,
    TerminationReason,
    ToolOutcome,
    ToolResult,
    Transition,
)
from runbrake.shared import _store_core as core
from runbrake.shared.messaging.cancel import cancel_run
from tests.polling import poll_until

pytestmark = pytest.mark.integration


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Every test of the store runs on a single Redis and on a three-master Redis Cluster."""
    if "settings" in metafunc.fixturenames:
        metafunc.parametrize("settings", ["single", "cluster"], indirect=True)

OWNER = "worker-1/thread-1"
OTHER = "worker-2/thread-7"
BARRIER_TIMEOUT_S = 30

QUEUED = RunStatus.QUEUED
RUNNING = RunStatus.RUNNING
WAITING = RunStatus.WAITING_FOR_APPROVAL
COMPLETED = RunStatus.COMPLETED
FAILED = RunStatus.FAILED
CANCELLED = RunStatus.CANCELLED
ALL_STATUSES = (QUEUED, RUNNING, WAITING, COMPLETED, FAILED, CANCELLED)
NON_TERMINAL = (QUEUED, RUNNING, WAITING)
TERMINAL = (COMPLETED, FAILED, CANCELLED)


# -- helpers ------------------------------------------------------------------------------------


def model_step(content: str = "thinking", round: int = 1) -> RunStep:
    return RunStep(kind=StepKind.MODEL, round=round, content=content)


def run_in(store: RunStore, status: RunStatus) -> str:
    """A run brought to ``status`` through the store's own transitions, with one step recorded."""
    run_id = store.create({"input": "What is 2 + 3?"}).run_id
    store.append_step(run_id, model_step())
    if status is not QUEUED:
        assert store.claim(run_id, OWNER, lease_s=60)
    if status is WAITING:
        assert store.suspend(run_id, OWNER, {"tool_calls": [{"server": "calc", "tool": "get-sum"}]})
    elif status is COMPLETED:
        assert store.settle(run_id, COMPLETED, TerminationReason.COMPLETED, owner=OWNER)
    elif status is FAILED:
        assert store.settle(run_id, FAILED, TerminationReason.PROVIDER_FAILED, owner=OWNER, error="boom")
    elif status is CANCELLED:
        assert store.cancel(run_id, reason="first", requested_by="ops")
    assert store.status(run_id) is status
    return run_id


def snapshot(store: RunStore, run_id: str) -> dict[str, Any]:
    """Everything Redis holds for a run, raw, plus the record as the store reads it."""
    r = store.redis
    return {
        "run": r.hgetall(store.run_key(run_id)),
        "steps": r.lrange(store.steps_key(run_id), 0, -1),
        "cancel": r.get(store.cancel_key(run_id)),
        "cancel_ttl": r.ttl(store.cancel_key(run_id)),
        "indexed": r.zscore(f"{store.namespace}:runs", run_id),
        "lease": r.zscore(leases_of(store, run_id), run_id),
        "record": store.get(run_id) if r.exists(store.run_key(run_id)) else None,
    }


def refusals(logs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [entry for entry in logs if entry["event"] == "transition_refused"]


def closed_port() -> int:
    """A loopback port nothing listens on: bound to find it free, then closed."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def observed(settings: Settings) -> Iterator[tuple[RunStore, list[dict[str, Any]]]]:
    """A store on one pinned connection, and the commands Redis saw from it (and from the scripts it ran).

    Uses MONITOR: every command the store's own connection sends is listed, then an ECHO marker
    closes the window. Deterministic even when other clients use the same Redis at the same time.
    """
    if settings.redis_cluster:
        pytest.skip("MONITOR watches one node: the commands sent are counted on a single Redis")
    client = redis.Redis.from_url(settings.redis_url, decode_responses=True, single_connection_client=True)
    watcher = redis.Redis.from_url(settings.redis_url, decode_responses=True, socket_timeout=10)
    seen: list[dict[str, Any]] = []
    try:
        address = client.client_info()["addr"]
        with watcher.monitor() as monitor:
            yield RunStore(client, settings.namespace), seen
            marker = f"end-of-window-{uuid.uuid4().hex}"
            client.echo(marker)
            for entry in monitor.listen():
                mine = f"{entry['client_address']}:{entry['client_port']}" == address
                if mine and marker in entry["command"]:
                    break
                if mine or (entry["client_type"] == "lua" and settings.namespace in entry["command"]):
                    seen.append(entry)
    finally:
        client.close()
        watcher.close()


def names(entries: list[dict[str, Any]], client_type: str = "tcp") -> list[str]:
    return [e["command"].split(" ", 1)[0].upper() for e in entries if e["client_type"] == client_type]


# -- create and idempotency ---------------------------------------------------------------------


def test_create_writes_a_queued_run_with_its_request(store: RunStore) -> None:
    before = time.time()
    created = store.create({"input": "What is 2 + 3?", "max_rounds": 8})
    after = time.time()

    record = store.get(created.run_id)
    assert created.created is True
    assert record.status is QUEUED
    assert record.termination_reason is TerminationReason.NONE
    assert record.request == {"input": "What is 2 + 3?", "max_rounds": 8}
    assert before <= record.created_at <= after
    assert record.started_at is None
    assert record.finished_at is None
    assert record.cancel is None
    assert record.steps == ()
    assert [r.run_id for r in store.recent()] == [created.run_id]


def test_the_same_idempotency_key_returns_the_same_run_and_creates_nothing_new(store: RunStore) -> None:
    first = store.create({"input": "one"}, idempotency_key="caller-42")
    second = store.create({"input": "two"}, idempotency_key="caller-42")

    assert second.run_id == first.run_id
    assert first.created is True
    assert second.created is False
    assert [r.run_id for r in store.recent()] == [first.run_id]
    assert store.get(first.run_id).request == {"input": "one"}


def test_different_idempotency_keys_create_different_runs(store: RunStore) -> None:
    first = store.create({"input": "x"}, idempotency_key="key-a")
    second = store.create({"input": "x"}, idempotency_key="key-b")

    assert first.run_id != second.run_id
    assert first.created is True
    assert second.created is True
    assert {r.run_id for r in store.recent()} == {first.run_id, second.run_id}


def test_creates_without_an_idempotency_key_are_never_deduplicated(store: RunStore) -> None:
    first = store.create({"input": "x"})
    second = store.create({"input": "x"})

    assert first.run_id != second.run_id
    assert second.created is True
    assert len(store.recent()) == 2


def test_concurrent_creates_with_one_idempotency_key_make_exactly_one_run(store: RunStore) -> None:
    workers = 20
    barrier = threading.Barrier(workers, timeout=BARRIER_TIMEOUT_S)

    def create(i: int) -> Any:
        barrier.wait()
        return store.create({"input": f"attempt {i}"}, idempotency_key="same-key")

    with ThreadPoolExecutor(max_workers=workers) as pool:
        results = list(pool.map(create, range(workers)))

    assert len({r.run_id for r in results}) == 1
    assert sum(r.created for r in results) == 1
    assert len(store.recent()) == 1


def test_recent_lists_newest_first_and_filters_by_status(store: RunStore) -> None:
    queued = run_in(store, QUEUED)
    cancelled = run_in(store, CANCELLED)
    completed = run_in(store, COMPLETED)

    assert [r.run_id for r in store.recent()] == [completed, cancelled, queued]
    assert [r.run_id for r in store.recent(status=CANCELLED)] == [cancelled]
    assert [r.run_id for r in store.recent(limit=1)] == [completed]


# -- the transition matrix ----------------------------------------------------------------------

TransitionCall = Callable[[RunStore, str], Transition]

TRANSITIONS: dict[str, tuple[TransitionCall, frozenset[RunStatus], RunStatus]] = {
    # name as logged: (call, statuses it is allowed from, status it leads to)
    "claim": (lambda s, r: s.claim(r, OTHER, lease_s=60), frozenset({QUEUED}), RUNNING),
    "suspend": (lambda s, r: s.suspend(r, OWNER, {"tool_calls": []}), frozenset({RUNNING}), WAITING),
    "approve": (lambda s, r: s.approve(r), frozenset({WAITING}), WAITING),
    # resume_claim needs an approval as well; without one it is refused from every status.
    "resume_claim": (lambda s, r: s.resume_claim(r, OTHER, lease_s=60), frozenset(), RUNNING),
    "settle_completed": (
        lambda s, r: s.settle(r, COMPLETED, TerminationReason.COMPLETED), frozenset(NON_TERMINAL), COMPLETED,
    ),
    "settle_failed": (
        lambda s, r: s.settle(r, FAILED, TerminationReason.TOOL_LOOP_ERROR, error="late"),
        frozenset(NON_TERMINAL), FAILED,
    ),
    "cancel": (lambda s, r: s.cancel(r, reason="late", requested_by="ops"), frozenset(NON_TERMINAL), CANCELLED),
}

REFUSED = [(name, status) for name, (_, allowed, _) in TRANSITIONS.items() for status in ALL_STATUSES
           if status not in allowed]
ALLOWED = [(name, status) for name, (_, allowed, _) in TRANSITIONS.items() for status in ALL_STATUSES
           if status in allowed]


@pytest.mark.parametrize(("name", "status"), REFUSED, ids=[f"{n}-from-{s.value}" for n, s in REFUSED])
def test_a_refused_transition_returns_the_status_it_found_changes_nothing_and_is_logged(
    store: RunStore, name: str, status: RunStatus
) -> None:
    call = TRANSITIONS[name][0]
    run_id = run_in(store, status)
    before = snapshot(store, run_id)

    with capture_logs() as logs:
        result = call(store, run_id)

    assert not result
    assert result.won is False
    assert result.found is status
    assert result.exists is True
    assert snapshot(store, run_id) == before
    assert refusals(logs) == [{
        "event": "transition_refused", "transition": name, "run_id": run_id, "found": status.value,
        "owner_mismatch": False, "log_level": "info",
    }]


@pytest.mark.parametrize(("name", "status"), ALLOWED, ids=[f"{n}-from-{s.value}" for n, s in ALLOWED])
def test_an_allowed_transition_wins_and_reports_the_status_it_left(
    store: RunStore, name: str, status: RunStatus
) -> None:
    call, _, to = TRANSITIONS[name]
    run_id = run_in(store, status)

    with capture_logs() as logs:
        result = call(store, run_id)

    assert result
    assert result.found is status
    assert store.status(run_id) is to
    assert refusals(logs) == []


@pytest.mark.parametrize("name", list(TRANSITIONS))
def test_a_transition_on_an_unknown_run_is_refused_and_writes_nothing(store: RunStore, name: str) -> None:
    run_id = uuid.uuid4().hex

    with capture_logs() as logs:
        result = TRANSITIONS[name][0](store, run_id)

    assert not result
    assert result.exists is False
    assert result.found is RunStatus.UNKNOWN
    assert store.redis.exists(store.run_key(run_id), store.cancel_key(run_id), store.steps_key(run_id)) == 0
    assert [(e["transition"], e["found"]) for e in refusals(logs)] == [(name, "missing")]


# -- claim --------------------------------------------------------------------------------------


def test_claim_moves_a_queued_run_to_running_and_stamps_owner_start_and_lease(store: RunStore) -> None:
    run_id = store.create({"input": "x"}).run_id

    before = time.time()
    result = store.claim(run_id, OWNER, lease_s=45)
    after = time.time()

    record = store.get(run_id)
    assert result.won is True
    assert result.found is QUEUED
    assert record.status is RUNNING
    assert record.owner == OWNER
    assert record.started_at is not None
    assert before <= record.started_at <= after
    assert record.lease_expires_at == pytest.approx(record.started_at + 45)
    assert record.segments == 1
    assert record.finished_at is None


def test_a_second_claim_of_the_same_run_is_refused_and_keeps_the_first_owner(store: RunStore) -> None:
    run_id = store.create({"input": "x"}).run_id
    assert store.claim(run_id, OWNER, lease_s=60)

    second = store.claim(run_id, OTHER, lease_s=60)

    assert second.won is False
    assert second.found is RUNNING
    assert store.get(run_id).owner == OWNER


@pytest.mark.parametrize("resume", [False, True])
def test_a_claim_tried_again_by_its_owner_after_its_answer_was_lost_is_still_won_and_counted_once(
    store: RunStore, resume: bool
) -> None:
    # Owners are unique per attempt: the same owner again is the worker retrying a claim whose answer it
    # never got (Redis paused past the client's timeout), not a second message.
    run_id = run_in(store, WAITING) if resume else store.create({"input": "x"}).run_id
    if resume:
        assert store.approve(run_id)
    claim = store.resume_claim if resume else store.claim
    assert claim(run_id, OTHER, lease_s=60)
    segments = store.get(run_id).segments

    again = claim(run_id, OTHER, lease_s=90)

    record = store.get(run_id)
    assert (again.won, again.found) == (True, WAITING if resume else QUEUED)
    assert again.request_json is not None
    assert (record.status, record.owner, record.segments) == (RUNNING, OTHER, segments)
    assert record.lease_expires_at == pytest.approx(time.time() + 90, abs=5)
    assert not claim(run_id, "worker-3", lease_s=60)  # anyone else is still refused


def test_a_cancelled_queued_run_cannot_be_claimed(store: RunStore) -> None:
    run_id = store.create({"input": "x"}).run_id
    assert store.cancel(run_id, reason="changed my mind", requested_by="ops")
    before = snapshot(store, run_id)

    result = store.claim(run_id, OWNER, lease_s=60)

    assert result.won is False
    assert result.found is CANCELLED
    assert snapshot(store, run_id) == before
    assert store.get(run_id).started_at is None


# -- suspend, approve, resume -------------------------------------------------------------------


def test_suspend_moves_a_running_run_to_waiting_and_stores_the_pending_turn(store: RunStore) -> None:
    run_id = run_in(store, RUNNING)
    pending = {"tool_calls": [{"server": "calc", "tool": "get-sum", "arguments": {"a": 2}}]}

    result = store.suspend(run_id, OWNER, pending)

    record = store.get(run_id)
    assert result.won is True
    assert result.found is RUNNING
    assert record.status is WAITING
    assert record.pending == pending
    assert record.owner == ""


def test_suspend_by_a_worker_that_does_not_own_the_run_is_refused_and_changes_nothing(store: RunStore) -> None:
    run_id = run_in(store, RUNNING)
    before = snapshot(store, run_id)

    with capture_logs() as logs:
        result = store.suspend(run_id, OTHER, {"tool_calls": []})

    assert result.won is False
    assert result.found is RUNNING
    assert snapshot(store, run_id) == before
    assert [(e["transition"], e["found"]) for e in refusals(logs)] == [("suspend", "running")]


def test_an_approved_waiting_run_is_resumed_by_a_new_owner(store: RunStore) -> None:
    run_id = run_in(store, WAITING)
    assert store.approve(run_id)

    result = store.resume_claim(run_id, OTHER, lease_s=30)

    record = store.get(run_id)
    assert result.won is True
    assert result.found is WAITING
    assert record.status is RUNNING
    assert record.owner == OTHER
    assert record.segments == 2
    assert record.lease_expires_at is not None


def test_a_waiting_run_without_an_approval_is_not_resumed(store: RunStore) -> None:
    run_id = run_in(store, WAITING)
    before = snapshot(store, run_id)

    with capture_logs() as logs:
        result = store.resume_claim(run_id, OTHER, lease_s=30)

    assert result.won is False
    assert result.found is WAITING
    assert snapshot(store, run_id) == before
    assert [(e["transition"], e["found"]) for e in refusals(logs)] == [("resume_claim", "waiting_for_approval")]


def test_an_approval_is_consumed_by_the_one_resume_it_allows(store: RunStore) -> None:
    run_id = run_in(store, WAITING)
    assert store.approve(run_id)
    assert store.resume_claim(run_id, OTHER, lease_s=30)

    duplicate = store.resume_claim(run_id, "worker-3", lease_s=30)

    assert duplicate.won is False
    assert duplicate.found is RUNNING
    assert store.get(run_id).owner == OTHER


def test_a_run_suspended_again_needs_a_new_approval(store: RunStore) -> None:
    run_id = run_in(store, WAITING)
    assert store.approve(run_id)
    assert store.resume_claim(run_id, OTHER, lease_s=30)
    assert store.suspend(run_id, OTHER, {"tool_calls": []})

    result = store.resume_claim(run_id, OTHER, lease_s=30)

    assert result.won is False
    assert store.status(run_id) is WAITING


def test_approving_a_run_twice_is_harmless_and_still_allows_one_resume(store: RunStore) -> None:
    run_id = run_in(store, WAITING)

    assert store.approve(run_id)
    assert store.approve(run_id)
    assert store.resume_claim(run_id, OTHER, lease_s=30)
    assert not store.resume_claim(run_id, "worker-3", lease_s=30)


# -- settle -------------------------------------------------------------------------------------


def test_settle_by_the_owner_completes_a_running_run_with_its_reason(store: RunStore) -> None:
    run_id = run_in(store, RUNNING)

    before = time.time()
    result = store.settle(run_id, COMPLETED, TerminationReason.COMPLETED, owner=OWNER)
    after = time.time()

    record = store.get(run_id)
    assert result.won is True
    assert result.found is RUNNING
    assert record.status is COMPLETED
    assert record.termination_reason is TerminationReason.COMPLETED
    assert record.finished_at is not None
    assert before <= record.finished_at <= after
    assert record.lease_expires_at is None
    assert record.cancel is None


def test_settle_to_failed_records_the_reason_and_the_error(store: RunStore) -> None:
    run_id = run_in(store, RUNNING)

    assert store.settle(run_id, FAILED, TerminationReason.MAX_ROUNDS, owner=OWNER, error="8 rounds used")

    record = store.get(run_id)
    assert record.status is FAILED
    assert record.termination_reason is TerminationReason.MAX_ROUNDS
    assert record.error == "8 rounds used"


def test_settle_by_a_worker_that_does_not_own_the_run_is_refused_and_changes_nothing(store: RunStore) -> None:
    run_id = run_in(store, RUNNING)
    before = snapshot(store, run_id)

    with capture_logs() as logs:
        result = store.settle(run_id, FAILED, TerminationReason.LEASE_LOST, owner=OTHER)

    assert result.won is False
    assert result.found is RUNNING
    assert result.owner_mismatch is True
    assert snapshot(store, run_id) == before
    assert refusals(logs) == [{
        "event": "transition_refused", "transition": "settle_failed", "run_id": run_id, "found": "running",
        "owner_mismatch": True, "log_level": "info",
    }]


def test_settle_with_a_required_status_is_refused_from_any_other_status(store: RunStore) -> None:
    run_id = run_in(store, RUNNING)
    before = snapshot(store, run_id)

    result = store.settle(run_id, FAILED, TerminationReason.APPROVAL_DENIED, required_status=WAITING)

    assert result.won is False
    assert result.found is RUNNING
    assert snapshot(store, run_id) == before


def test_settle_with_a_required_status_wins_from_that_status(store: RunStore) -> None:
    run_id = run_in(store, WAITING)

    result = store.settle(run_id, FAILED, TerminationReason.APPROVAL_DENIED, required_status=WAITING)

    assert result.won is True
    record = store.get(run_id)
    assert record.status is FAILED
    assert record.termination_reason is TerminationReason.APPROVAL_DENIED


@pytest.mark.parametrize("status", [CANCELLED, QUEUED, RUNNING, WAITING, RunStatus.UNKNOWN])
def test_settle_goes_only_to_completed_or_failed(store: RunStore, status: RunStatus) -> None:
    run_id = run_in(store, RUNNING)
    before = snapshot(store, run_id)

    with pytest.raises(ValueError, match="completed or failed"):
        store.settle(run_id, status, TerminationReason.CANCELLED)

    assert snapshot(store, run_id) == before


def test_a_settle_after_a_cancel_is_refused_and_changes_nothing(store: RunStore) -> None:
    run_id = run_in(store, RUNNING)
    assert store.cancel(run_id, reason="stop", requested_by="ops")
    before = snapshot(store, run_id)

    with capture_logs() as logs:
        result = store.settle(run_id, COMPLETED, TerminationReason.COMPLETED, owner=OWNER)

    assert result.won is False
    assert result.found is CANCELLED
    assert snapshot(store, run_id) == before
    record = store.get(run_id)
    assert record.status is CANCELLED
    assert record.termination_reason is TerminationReason.CANCELLED
    assert [(e["transition"], e["found"]) for e in refusals(logs)] == [("settle_completed", "cancelled")]


def test_a_cancel_after_a_settle_is_refused_and_writes_no_cancel_key(store: RunStore) -> None:
    run_id = run_in(store, RUNNING)
    assert store.settle(run_id, COMPLETED, TerminationReason.COMPLETED, owner=OWNER)
    before = snapshot(store, run_id)

    with capture_logs() as logs:
        result = store.cancel(run_id, reason="too late", requested_by="ops")

    assert result.won is False
    assert result.found is COMPLETED
    assert snapshot(store, run_id) == before
    assert store.cancel_requested(run_id) is False
    assert [(e["transition"], e["found"]) for e in refusals(logs)] == [("cancel", "completed")]


# -- cancel -------------------------------------------------------------------------------------


@pytest.mark.parametrize("status", NON_TERMINAL)
def test_cancel_moves_a_non_terminal_run_to_cancelled_and_writes_who_why_and_when(
    store: RunStore, status: RunStatus
) -> None:
    run_id = run_in(store, status)

    before = time.time()
    result = store.cancel(run_id, reason="runaway costs", requested_by="alice@ops")
    after = time.time()

    record = store.get(run_id)
    assert result.won is True
    assert result.found is status
    assert record.status is CANCELLED
    assert record.termination_reason is TerminationReason.CANCELLED
    assert record.cancel is not None
    assert record.cancel.reason == "runaway costs"
    assert record.cancel.requested_by == "alice@ops"
    assert before <= record.cancel.requested_at <= after
    assert record.finished_at == pytest.approx(record.cancel.requested_at)
    raw = json.loads(store.redis.get(store.cancel_key(run_id)) or "null")
    assert raw == {"reason": "runaway costs", "requested_by": "alice@ops", "requested_at": record.cancel.requested_at}


def test_a_second_cancel_is_refused_and_keeps_the_first_request(store: RunStore) -> None:
    run_id = run_in(store, RUNNING)
    assert store.cancel(run_id, reason="first", requested_by="alice")

    second = store.cancel(run_id, reason="second", requested_by="bob")

    assert second.won is False
    assert second.found is CANCELLED
    cancel = store.get(run_id).cancel
    assert cancel is not None
    assert (cancel.reason, cancel.requested_by) == ("first", "alice")


def test_cancel_writes_the_status_and_the_cancel_key_in_one_script(store: RunStore, settings: Settings) -> None:
    run_id = run_in(store, RUNNING)

    with observed(settings) as (pinned, seen):
        assert pinned.cancel(run_id, reason="stop", requested_by="ops")

    sent = names(seen)
    assert sent
    assert set(sent) <= {"EVALSHA", "EVAL", "SCRIPT"}, sent
    in_script = [e["command"] for e in seen if e["client_type"] == "lua"]
    assert any(c.upper().startswith("SET ") and store.cancel_key(run_id) in c for c in in_script), in_script
    assert any(c.upper().startswith("HSET ") and "cancelled" in c for c in in_script), in_script


def test_a_cancel_reads_the_level_below_in_its_fence_round_trip_and_fences_the_tree(
        store: RunStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """``cancel_run`` costs a run that started no agent one round trip; a run with children fences each level below
    it after (shared/messaging/cancel.py)."""
    lone, caller, child, grandchild = (run_in(store, RUNNING) for _ in range(4))
    store.execute(core.add_child(store.keys, caller, "call-1", child))
    store.execute(core.add_child(store.keys, child, "call-1", grandchild))
    ops: list[str] = []
    execute = store.execute

    def counted(op: core.Op[Any]) -> Any:
        ops.append(op.what)
        return execute(op)

    monkeypatch.setattr(store, "execute", counted)
    assert cancel_run(store, None, lone, reason="stop", requested_by="ops").won
    assert ops == [f"cancel run {lone}"]

    assert cancel_run(store, None, caller, reason="stop", requested_by="ops").won
    # The levels below the child and the grandchild; the child itself came with the fence.
    assert ops[1:] == [f"cancel run {caller}", "read children", "read children", "cancel 2 runs"], ops
    for below in (child, grandchild):
        cancel = store.get(below).cancel
        assert cancel is not None
        assert cancel.reason == f"stop (cancelled with run {caller})"


def test_the_cancel_key_lives_exactly_as_long_as_its_run(store: RunStore) -> None:
    run_id = run_in(store, RUNNING)
    assert store.cancel(run_id, reason="stop", requested_by="ops")

    ttl = store.redis.ttl(store.cancel_key(run_id))
    assert ttl == store.redis.ttl(store.run_key(run_id))
    assert ttl > store.keys.retention_s  # the sweeper deletes both at the end of retention; the TTL is a net


def test_without_retention_the_cancel_key_has_no_ttl(store: RunStore) -> None:
    keeping = RunStore(store.redis, store.namespace, retention_s=0)
    run_id = run_in(keeping, RUNNING)
    assert keeping.cancel(run_id, reason="stop", requested_by="ops")

    assert store.redis.ttl(store.cancel_key(run_id)) == -1
    assert store.redis.ttl(store.run_key(run_id)) == -1


def test_probing_the_cancel_key_never_consumes_it(store: RunStore) -> None:
    run_id = run_in(store, RUNNING)
    assert store.cancel(run_id, reason="stop", requested_by="ops")

    assert store.cancel_requested(run_id) is True
    assert store.cancel_requested(run_id) is True
    assert store.cancelled_among([run_id]) == {run_id}
    assert store.cancelled_among([run_id]) == {run_id}
    assert store.get(run_id).cancel is not None
    assert store.redis.exists(store.cancel_key(run_id)) == 1


@pytest.mark.parametrize("status", [QUEUED, RUNNING, WAITING, COMPLETED, FAILED])
def test_the_probe_answers_false_for_a_run_that_was_not_cancelled(store: RunStore, status: RunStatus) -> None:
    run_id = run_in(store, status)

    assert store.cancel_requested(run_id) is False


def test_the_probe_answers_false_for_an_unknown_run(store: RunStore) -> None:
    assert store.cancel_requested(uuid.uuid4().hex) is False


def test_cancelled_among_names_exactly_the_cancelled_runs(store: RunStore) -> None:
    runs = [run_in(store, RUNNING) for _ in range(9)]
    for run_id in runs[::3]:
        assert store.cancel(run_id, reason="stop", requested_by="ops")
    finished = run_in(store, COMPLETED)

    found = store.cancelled_among([*runs, finished, uuid.uuid4().hex])

    assert found == set(runs[::3])


def test_cancelled_among_reads_every_key_in_one_mget_and_nothing_per_key(
    store: RunStore, settings: Settings
) -> None:
    runs = [store.create({"input": str(i)}).run_id for i in range(12)]
    for run_id in runs[:5]:
        assert store.cancel(run_id, reason="stop", requested_by="ops")

    with observed(settings) as (pinned, seen):
        found = pinned.cancelled_among(runs)

    assert found == set(runs[:5])
    assert names(seen) == ["MGET"]
    keys = seen[0]["command"].split(" ")[1:]
    assert keys == [store.cancel_key(run_id) for run_id in runs]


def test_cancelled_among_no_runs_asks_redis_nothing(store: RunStore, settings: Settings) -> None:
    with observed(settings) as (pinned, seen):
        found = pinned.cancelled_among([])

    assert found == set()
    assert seen == []


# -- the fence under a race ---------------------------------------------------------------------


@pytest.mark.parametrize("attempt", range(3))
def test_concurrent_cancels_and_settles_on_one_running_run_have_exactly_one_winner(
    store: RunStore, settings: Settings, attempt: int
) -> None:
    run_id = run_in(store, RUNNING)
    per_kind = 20
    workers = 3 * per_kind
    barrier = threading.Barrier(workers, timeout=BARRIER_TIMEOUT_S)
    stores = [RunStore.connect(settings) for _ in range(workers)]
    for each in stores:
        each.ping()  # connect before the start line, so the race is about the scripts, not connects

    def attempt_one(i: int) -> tuple[str, int, Transition]:
        own = stores[i]
        kind = ("cancel", "settle_completed", "settle_failed")[i % 3]
        barrier.wait()
        if kind == "cancel":
            return kind, i, own.cancel(run_id, reason=f"cancel-{i}", requested_by=f"op-{i}")
        if kind == "settle_completed":
            return kind, i, own.settle(run_id, COMPLETED, TerminationReason.COMPLETED, owner=OWNER)
        return kind, i, own.settle(run_id, FAILED, TerminationReason.TOOL_LOOP_ERROR, error=f"settle-{i}")

    try:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            outcomes = list(pool.map(attempt_one, range(workers)))
    finally:
        for each in stores:
            each.close()

    winners = [(kind, i) for kind, i, result in outcomes if result.won]
    assert len(winners) == 1, winners
    kind, i = winners[0]
    record = store.get(run_id)
    if kind == "cancel":
        assert (record.status, record.termination_reason) == (CANCELLED, TerminationReason.CANCELLED)
        assert record.cancel is not None
        assert (record.cancel.reason, record.cancel.requested_by) == (f"cancel-{i}", f"op-{i}")
    elif kind == "settle_completed":
        assert (record.status, record.termination_reason) == (COMPLETED, TerminationReason.COMPLETED)
        assert record.cancel is None
    else:
        assert (record.status, record.termination_reason) == (FAILED, TerminationReason.TOOL_LOOP_ERROR)
        assert record.error == f"settle-{i}"
        assert record.cancel is None
    # Every loser ran after the winner (scripts are atomic), so each found the winner's status.
    assert {result.found for _, _, result in outcomes if not result.won} == {record.status}


# -- steps --------------------------------------------------------------------------------------


def test_appended_steps_get_increasing_sequences_and_read_back_in_order(store: RunStore) -> None:
    run_id = store.create({"input": "x"}).run_id

    first = store.append_step(run_id, model_step("a"))
    second = store.append_step(run_id, RunStep.tool(round=1, server="calc", name="get-sum",
                                                    result=ToolResult.ok("5"), arguments={"a": 2, "b": 3}))
    third = store.append_step(run_id, RunStep(kind=StepKind.APPROVAL, round=1, detail={"decision": "approved"}))

    assert [first.sequence, second.sequence, third.sequence] == [1, 2, 3]
    assert first.recorded_at > 0
    assert store.get(run_id).steps == (first, second, third)


def test_a_cancelled_tool_step_is_stored_and_read_back_as_cancelled(store: RunStore) -> None:
    run_id = store.create({"input": "x"}).run_id
    step = RunStep.tool(round=1, server="calc", name="slow", result=ToolResult.cancelled("cut off"))

    store.append_step(run_id, step)

    raw = json.loads(store.redis.lrange(store.steps_key(run_id), 0, -1)[0])
    assert raw["tool_outcome"] == ToolOutcome.CANCELLED.value
    assert raw["tool_is_error"] is True
    assert store.get(run_id).steps[0].tool_outcome is ToolOutcome.CANCELLED


def test_a_step_recorded_after_the_cancel_is_kept(store: RunStore) -> None:
    run_id = run_in(store, RUNNING)
    assert store.cancel(run_id, reason="stop", requested_by="ops")

    step = store.append_step(run_id, RunStep.tool(round=1, server="calc", name="slow",
                                                  result=ToolResult.cancelled("cut off")))

    assert store.get(run_id).steps[-1] == step
    assert store.status(run_id) is CANCELLED


def test_appending_to_an_unknown_run_raises_run_not_found_and_writes_nothing(store: RunStore) -> None:
    run_id = uuid.uuid4().hex

    with pytest.raises(RunNotFound) as raised:
        store.append_step(run_id, model_step())

    assert raised.value.run_id == run_id
    assert store.redis.exists(store.run_key(run_id), store.steps_key(run_id)) == 0


def test_steps_appended_concurrently_keep_unique_gap_free_ordered_sequences(store: RunStore) -> None:
    run_id = store.create({"input": "x"}).run_id
    threads, per_thread = 8, 25
    barrier = threading.Barrier(threads, timeout=BARRIER_TIMEOUT_S)

    def append_many(t: int) -> list[RunStep]:
        barrier.wait()
        return [store.append_step(run_id, model_step(f"{t}-{i}", round=i)) for i in range(per_thread)]

    with ThreadPoolExecutor(max_workers=threads) as pool:
        returned = list(pool.map(append_many, range(threads)))

    total = threads * per_thread
    returned_sequences = sorted(step.sequence for steps in returned for step in steps)
    assert returned_sequences == list(range(1, total + 1))
    for steps in returned:  # each writer's own steps got increasing numbers
        assert [s.sequence for s in steps] == sorted(s.sequence for s in steps)

    stored = store.get(run_id).steps
    assert [s.sequence for s in stored] == list(range(1, total + 1))
    by_sequence = {step.sequence: step for steps in returned for step in steps}
    assert all(by_sequence[s.sequence] == s for s in stored)  # what a writer was told is what was stored


# -- reads --------------------------------------------------------------------------------------


def test_get_of_an_unknown_run_raises_run_not_found(store: RunStore) -> None:
    run_id = uuid.uuid4().hex

    with pytest.raises(RunNotFound) as raised:
        store.get(run_id)

    assert raised.value.run_id == run_id


def test_status_of_an_unknown_run_raises_run_not_found(store: RunStore) -> None:
    with pytest.raises(RunNotFound):
        store.status(uuid.uuid4().hex)


def test_an_unknown_stored_status_reads_as_unknown_with_a_log_line(store: RunStore) -> None:
    run_id = run_in(store, RUNNING)
    store.redis.hset(store.run_key(run_id), "status", "paused")

    with capture_logs() as logs:
        record = store.get(run_id)
        status = store.status(run_id)
        listed = store.recent()

    assert record.status is RunStatus.UNKNOWN
    assert status is RunStatus.UNKNOWN
    assert [r.status for r in listed] == [RunStatus.UNKNOWN]
    unknown = [e for e in logs if e["event"] == "run_status_unknown"]
    assert unknown
    assert all(e["stored"] == "paused" and e["run_id"] == run_id for e in unknown)


def test_an_unknown_stored_reason_reads_as_unknown_with_a_log_line(store: RunStore) -> None:
    run_id = run_in(store, FAILED)
    store.redis.hset(store.run_key(run_id), "termination_reason", "solar_flare")

    with capture_logs() as logs:
        record = store.get(run_id)

    assert record.status is FAILED
    assert record.termination_reason is TerminationReason.UNKNOWN
    assert {"event": "termination_reason_unknown", "run_id": run_id, "stored": "solar_flare",
            "log_level": "warning"} in logs


def test_a_run_with_an_unknown_stored_status_is_not_claimed(store: RunStore) -> None:
    run_id = run_in(store, QUEUED)
    store.redis.hset(store.run_key(run_id), "status", "paused")
    before = snapshot(store, run_id)

    with capture_logs() as logs:
        result = store.claim(run_id, OWNER, lease_s=60)

    assert result.won is False
    assert result.found is RunStatus.UNKNOWN
    assert snapshot(store, run_id) == before
    assert [(e["transition"], e["found"]) for e in refusals(logs)] == [("claim", "paused")]


# -- leases -------------------------------------------------------------------------------------


def test_the_owner_renews_its_lease_on_a_running_run(store: RunStore) -> None:
    run_id = run_in(store, RUNNING)
    old = store.get(run_id).lease_expires_at
    assert old is not None

    assert store.renew_leases({run_id: OWNER}, lease_s=600) == set()

    new = store.get(run_id).lease_expires_at
    assert new is not None
    assert new > old
    assert store.redis.zscore(leases_of(store, run_id), run_id) == pytest.approx(new)


@pytest.mark.parametrize(("status", "owner"), [(RUNNING, OTHER), (CANCELLED, OWNER), (COMPLETED, OWNER)])
def test_a_lease_is_not_renewed_for_another_owner_or_a_finished_run(
    store: RunStore, status: RunStatus, owner: str
) -> None:
    run_id = run_in(store, status)
    before = snapshot(store, run_id)

    assert store.renew_leases({run_id: owner}, lease_s=600) == {run_id}
    assert snapshot(store, run_id) == before


def test_many_leases_are_renewed_in_one_call_and_the_lost_ones_are_named(store: RunStore) -> None:
    mine = [run_in(store, RUNNING) for _ in range(3)]
    finished = run_in(store, COMPLETED)

    lost = store.renew_leases({**dict.fromkeys(mine, OWNER), finished: OWNER}, lease_s=600)

    assert lost == {finished}


def leases_of(store: RunStore, run_id: str) -> str:
    """The lease set a run is in (one per shard on a cluster)."""
    return store.keys.leases(store.keys.shard(run_id))


def expire_lease(store: RunStore, run_id: str) -> None:
    """Age a run's lease as if its worker had stopped renewing it a while ago."""
    past = time.time() - 5
    store.redis.hset(store.run_key(run_id), "lease_expires_at", repr(past))
    store.redis.zadd(leases_of(store, run_id), {run_id: past})


def test_a_running_run_whose_lease_expired_is_reaped_as_failed_lease_lost(store: RunStore) -> None:
    run_id = run_in(store, RUNNING)
    expire_lease(store, run_id)

    with capture_logs() as logs:
        assert store.reap_expired() == [run_id]

    record = store.get(run_id)
    assert (record.status, record.termination_reason) == (FAILED, TerminationReason.LEASE_LOST)
    assert OWNER in record.error
    assert store.redis.zscore(leases_of(store, run_id), run_id) is None
    assert [e["run_id"] for e in logs if e["event"] == "run_lease_lost"] == [run_id]
    # Terminal is terminal: the worker's late settle is refused.
    assert not store.settle(run_id, COMPLETED, TerminationReason.COMPLETED, owner=OWNER)


def test_a_live_lease_is_not_reaped(store: RunStore) -> None:
    run_id = run_in(store, RUNNING)
    before = snapshot(store, run_id)

    assert store.reap_expired() == []
    assert snapshot(store, run_id) == before


def test_a_lease_renewed_after_it_was_due_is_not_reaped(store: RunStore) -> None:
    run_id = run_in(store, RUNNING)
    expire_lease(store, run_id)
    store.redis.zadd(leases_of(store, run_id), {run_id: time.time() - 5})
    store.redis.hset(store.run_key(run_id), "lease_expires_at", repr(time.time() + 600))

    assert store.reap_expired() == []
    assert store.status(run_id) is RUNNING


@pytest.mark.parametrize("status", [QUEUED, WAITING, COMPLETED, FAILED])
def test_only_running_runs_hold_a_lease(store: RunStore, status: RunStatus) -> None:
    run_id = run_in(store, status)

    assert store.redis.zscore(leases_of(store, run_id), run_id) is None
    assert store.reap_expired() == []
    assert store.status(run_id) is status


def test_a_run_cancelled_while_running_keeps_its_lease_entry_until_it_runs_out_and_is_never_reaped_as_failed(
    store: RunStore,
) -> None:
    """Should its worker be lost meanwhile, the sweeper still finds the run in the lease set and records the calls
    it had in flight (docs/leases.md, "Lost workers"); the reaper then drops the entry and the run stays cancelled."""
    run_id = run_in(store, CANCELLED)
    assert store.redis.zscore(leases_of(store, run_id), run_id) is not None

    expire_lease(store, run_id)
    assert store.reap_expired() == []

    assert store.redis.zscore(leases_of(store, run_id), run_id) is None
    record = store.get(run_id)
    assert (record.status, record.termination_reason) == (CANCELLED, TerminationReason.CANCELLED)


def test_concurrent_reapers_fail_an_expired_run_once(store: RunStore, settings: Settings) -> None:
    run_id = run_in(store, RUNNING)
    expire_lease(store, run_id)
    reapers = [RunStore.connect(settings) for _ in range(8)]
    barrier = threading.Barrier(len(reapers))

    def reap(reaper: RunStore) -> list[str]:
        barrier.wait()
        return reaper.reap_expired()

    with ThreadPoolExecutor(len(reapers)) as pool:
        results = list(pool.map(reap, reapers))
    for reaper in reapers:
        reaper.close()

    assert sorted(len(r) for r in results) == [0] * 7 + [1]
    assert store.get(run_id).termination_reason is TerminationReason.LEASE_LOST


# -- an unreachable Redis -----------------------------------------------------------------------


@pytest.fixture
def unreachable() -> Iterator[RunStore]:
    """A store pointed at a loopback port where nothing listens."""
    port = closed_port()
    dead = RunStore.connect(Settings(redis_url=f"redis://127.0.0.1:{port}/0", redis_timeout_s=0.5))
    yield dead
    dead.close()


def test_the_probe_answers_not_cancelled_when_redis_is_unreachable_and_logs_it(unreachable: RunStore) -> None:
    with capture_logs() as logs:
        answer = unreachable.cancel_requested("run-1")

    assert answer is False
    failures = [e for e in logs if e["event"] == "cancel_probe_failed"]
    assert len(failures) == 1
    assert failures[0]["run_id"] == "run-1"
    assert failures[0]["log_level"] == "warning"


def test_the_backstop_poll_answers_none_cancelled_when_redis_is_unreachable_and_logs_it(
    unreachable: RunStore,
) -> None:
    with capture_logs() as logs:
        answer = unreachable.cancelled_among(["run-1", "run-2"])

    assert answer == set()
    failures = [e for e in logs if e["event"] == "cancel_poll_failed"]
    assert len(failures) == 1
    assert failures[0]["runs"] == 2


UNREACHABLE_CALLS: dict[str, Callable[[RunStore], object]] = {
    "create": lambda s: s.create({"input": "x"}),
    "claim": lambda s: s.claim("r", OWNER, lease_s=60),
    "resume_claim": lambda s: s.resume_claim("r", OWNER, lease_s=60),
    "suspend": lambda s: s.suspend("r", OWNER, {}),
    "approve": lambda s: s.approve("r"),
    "settle": lambda s: s.settle("r", COMPLETED, TerminationReason.COMPLETED),
    "cancel": lambda s: s.cancel("r", reason="x", requested_by="ops"),
    "renew_leases": lambda s: s.renew_leases({"r": OWNER}, lease_s=60),
    "reap_expired": lambda s: s.reap_expired(),
    "append_step": lambda s: s.append_step("r", model_step()),
    "get": lambda s: s.get("r"),
    "status": lambda s: s.status("r"),
    "recent": lambda s: s.recent(),
    "ping": lambda s: s.ping(),
}


@pytest.mark.parametrize("name", list(UNREACHABLE_CALLS))
def test_transitions_and_reads_raise_store_error_when_redis_is_unreachable(unreachable: RunStore, name: str) -> None:
    with pytest.raises(StoreError) as raised:
        UNREACHABLE_CALLS[name](unreachable)

    assert isinstance(raised.value.__cause__, redis.RedisError)


def test_closing_a_store_closes_every_connection_it_opened(settings: Settings) -> None:
    """On a cluster too: redis-py's RedisCluster.close() leaves the nodes' sockets open, each one then a
    ResourceWarning whenever the garbage collector finds it (issue 16: a green run that exited 1)."""
    store = RunStore.connect(settings)
    run_id = store.create({"input": "x", "model": {"provider": "scripted", "turns": []}}).run_id
    store.get(run_id)
    client = store.redis
    if isinstance(client, redis.RedisCluster):
        nodes = [(n.port, n.redis_connection) for n in client.get_nodes() if n.redis_connection is not None]
    else:
        nodes = [(client.connection_pool.connection_kwargs["port"], client)]
    mine = {(port, conn.client_info()["addr"]) for port, conn in nodes}
    store.delete_namespace()

    store.close()

    def open_ones() -> set[tuple[int, str]]:
        still = set()
        for port in {p for p, _ in mine}:
            with redis.Redis(host="127.0.0.1", port=port, decode_responses=True) as watcher:
                addrs = {c["addr"] for c in watcher.client_list()}
            still |= {(p, a) for p, a in mine if p == port and a in addrs}
        return still

    poll_until(lambda: not open_ones(), timeout=10, failure=lambda: f"still connected after close: {open_ones()}")
