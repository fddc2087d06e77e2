"""The run store on Redis, synchronous: runs, steps and cancel keys, with guarded transitions.

Every transition is one Lua script (``shared/_scripts.py``); nothing here reads a status
in Python and then writes. A refused transition changes nothing, is logged with the
status it found, and returns that status in a :class:`Transition`
(docs/store.md, "The run lifecycle").

This is one of two thin executors of the operations in ``shared/_store_core.py``; the
other, :class:`~runbrake.shared.async_store.AsyncRunStore`, serves a worker's event loop.
This one serves the CLI, the cancel listener's thread and the lease keeper.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

import redis
import redis.sentinel

from runbrake.shared import _store_core as core
from runbrake.shared.errors import RunNotFound
from runbrake.shared.outcome import DeliveryStatus
from runbrake.shared.records import (
    CancelRequest,
    Claim,
    Created,
    OutboxEntry,
    Quota,
    RunRecord,
    SteerRequest,
    Transition,
    TreeLink,
)
from runbrake.shared.settings import Settings
from runbrake.shared.status import RunStatus, TerminationReason
from runbrake.shared.steps import RunStep
from runbrake.shared.threads import ThreadLink

__all__ = ["CancelRequest", "Claim", "Created", "RunRecord", "RunStore", "Transition"]

T = TypeVar("T")

Client = redis.Redis | redis.RedisCluster
"""A single Redis, or a Redis Cluster (``RUNBRAKE_REDIS_CLUSTER``)."""


def client_options(settings: Settings) -> dict[str, Any]:
    """How both executors connect: decoded answers, bounded waits."""
    return {
        "decode_responses": True,
        "socket_timeout": settings.redis_timeout_s,
        "socket_connect_timeout": min(settings.redis_timeout_s, 1.0),
        "health_check_interval": 30,
    }


def sentinel_options(settings: Settings) -> tuple[dict[str, Any], dict[str, Any]]:
    """How a Sentinel-managed client connects (``RUNBRAKE_REDIS_SENTINELS``): the options of its
    connections to the primary (those of :func:`client_options`, with the database, credentials and TLS of
    ``RUNBRAKE_REDIS_URL``), and those of its connections to the Sentinels (bounded waits alike)."""
    timeouts = {"socket_timeout": settings.redis_timeout_s,
                "socket_connect_timeout": min(settings.redis_timeout_s, 1.0)}
    return {**core.sentinel_url_options(settings.redis_url), **client_options(settings)}, timeouts


def where_of(settings: Settings) -> str:
    """Where a store of these settings looks, for messages."""
    if settings.redis_sentinels:
        return core.describe_sentinels(settings.redis_sentinel_master, settings.redis_sentinels)
    return core.describe_url(settings.redis_url, cluster=settings.redis_cluster)


class RunStore:
    """Runs, steps and cancel keys in Redis under one namespace (synchronous)."""

    def __init__(self, client: Client | Callable[[], redis.RedisCluster], namespace: str, *, retention_s: int = 0,
                 where: str = "", replication: core.Replication | None = None) -> None:
        """``client``: a client, or a function that makes a cluster client when it is first needed
        (redis-py's asks the cluster for its slots as it is made; a store connects lazily).
        ``replication``: how many replicas acknowledge each durable transition (none by default)."""
        self._client: Client | None = None
        self._make: Callable[[], redis.RedisCluster] | None = None
        if isinstance(client, (redis.Redis, redis.RedisCluster)):
            self._client = client
        else:
            self._make = client
        self._making = threading.Lock()
        self.namespace = namespace
        self.keys = core.Keys(namespace, retention_s, cluster=not isinstance(client, redis.Redis))
        self.where = where or core.describe(client)
        self.replication = replication or core.Replication()

    @classmethod
    def connect(cls, settings: Settings) -> RunStore:
        """A store on ``settings.redis_url`` under ``settings.namespace``. Connects lazily. With
        ``settings.redis_cluster`` the URL names a seed node of a Redis Cluster; with
        ``settings.redis_sentinels`` the Sentinels name the primary, and the client follows the one they
        promote (redis-py's ``SentinelConnectionPool`` asks them on every new connection; a connection
        to a former primary that answers READONLY is dropped as a connection error)."""
        where, replication = where_of(settings), core.Replication.of(settings)
        if settings.redis_cluster:
            return cls(lambda: redis.RedisCluster.from_url(settings.redis_url, **client_options(settings)),
                       settings.namespace, retention_s=settings.retention_s, where=where)
        if settings.redis_sentinels:
            options, sentinel_kwargs = sentinel_options(settings)
            sentinels = redis.sentinel.Sentinel(  # type: ignore[no-untyped-call]
                list(settings.redis_sentinels), sentinel_kwargs=sentinel_kwargs)
            client: redis.Redis = sentinels.master_for(  # type: ignore[no-untyped-call]
                settings.redis_sentinel_master, redis_class=redis.Redis, **options)
            return cls(client, settings.namespace, retention_s=settings.retention_s, where=where,
                       replication=replication)
        client = redis.Redis.from_url(settings.redis_url, **client_options(settings))
        return cls(client, settings.namespace, retention_s=settings.retention_s, where=where,
                   replication=replication)

    @property
    def redis(self) -> Client:
        """The client, for health checks and tests (a cluster's is made here on first use).

        Raises:
            RedisClusterException: when no seed node of the cluster answers.
        """
        if self._client is None:
            with self._making:
                if self._client is None and self._make is not None:
                    self._client = self._make()
        assert self._client is not None  # one of the two is always set
        return self._client

    @property
    def cluster(self) -> bool:
        """Whether this store is on a Redis Cluster."""
        return self.keys.cluster

    def close(self) -> None:
        """Close the client and its connections."""
        if isinstance(self._client, redis.RedisCluster):
            # A cluster client made from a URL gives each node a pool the node's client does not own, so
            # RedisCluster.close() leaves their sockets open (redis-py 8.1, cluster.py, create_redis_node).
            self._client.disconnect_connection_pools()  # type: ignore[no-untyped-call]
        if self._client is not None:
            self._client.close()

    def execute(self, op: core.Op[T]) -> T:
        """Send one op (one round trip) and read its answer.

        Raises:
            StoreError: when Redis cannot be reached and the op has no fallback.
        """
        try:
            answers = self._send(op)
        except core.UNREACHABLE as exc:
            return core.failed(op, exc, self.where)
        return op.parse(answers)

    def _send(self, op: core.Op[Any]) -> list[Any]:
        if self.replication.applies(op):
            return self._send_replicated(op)
        if len(op.calls) == 1 and not op.transaction:
            return [self._one(op.calls[0])]
        client = self.redis
        with client.pipeline(transaction=op.transaction) as pipe:
            for call in op.calls:
                core.queue(pipe, call, **self._route(client, call))
            answers: list[Any] = pipe.execute(raise_on_error=False)
        for i in core.missing_scripts(answers):
            answers[i] = self._one(op.calls[i])
        core.raise_first_error(answers)
        return answers

    def _send_replicated(self, op: core.Op[Any]) -> list[Any]:
        """The op's calls and a WAIT after them, in one pipeline (one connection: WAIT counts the replicas
        that have that connection's writes). A script Redis did not have is loaded and sent again, with the
        WAIT, in a second pipeline."""
        calls, wait = list(op.calls), self.replication.wait
        answers = self._pipeline([*calls, wait])
        missing = core.missing_scripts(answers[:-1])
        if missing:
            for i in missing:
                self.redis.script_load(calls[i].script.source)  # type: ignore[union-attr]
            again = self._pipeline([*(calls[i] for i in missing), wait])
            for i, answer in zip(missing, again, strict=False):
                answers[i] = answer
            answers[-1] = again[-1]
        core.raise_first_error(answers)
        self.replication.check(op, answers[-1], self.where)
        return answers[:-1]

    def _pipeline(self, calls: list[core.Call]) -> list[Any]:
        with self.redis.pipeline(transaction=False) as pipe:
            for call in calls:
                core.queue(pipe, call)
            answers: list[Any] = pipe.execute(raise_on_error=False)
        return answers

    @staticmethod
    def _route(client: Client, call: core.Call) -> dict[str, Any]:
        """Where a cluster pipeline sends a script: named here, because redis-py's synchronous cluster
        pipeline would otherwise ask a node for the keys of every EVALSHA (COMMAND GETKEYS), one round
        trip each. A MOVED answer is still followed (the retry routes by the key)."""
        if isinstance(client, redis.RedisCluster) and isinstance(call, core.ScriptCall):
            return {"target_nodes": client.get_node_from_key(call.keys[0])}  # type: ignore[no-untyped-call]
        return {}

    def _one(self, call: core.Call) -> Any:
        client = self.redis
        if isinstance(call, core.Command):
            return client.execute_command(*call.args)  # type: ignore[no-untyped-call]
        try:
            return client.evalsha(call.script.sha, len(call.keys), *call.keys, *call.args)
        except redis.exceptions.NoScriptError:
            # Redis lost its script cache (a restart, SCRIPT FLUSH): load and send again; it did not run.
            # (A cluster client loads it on every primary.)
            client.script_load(call.script.source)
            return client.evalsha(call.script.sha, len(call.keys), *call.keys, *call.args)

    # -- keys -----------------------------------------------------------------------------------

    def run_key(self, run_id: str) -> str:
        return self.keys.run(run_id)

    def steps_key(self, run_id: str) -> str:
        return self.keys.steps(run_id)

    def cancel_key(self, run_id: str) -> str:
        return self.keys.cancel(run_id)

    # -- transitions ----------------------------------------------------------------------------

    def create(self, request: Mapping[str, Any], *, idempotency_key: str | None = None, tenant: str | None = None,
               quota: Quota | None = None, link: ThreadLink | None = None, tree: TreeLink | None = None) -> Created:
        """Write a queued run with its request. The same idempotency key returns the same run. A tenant's
        run is counted against ``quota`` in the same script (over it: nothing written, ``over_quota``). A
        continuation's ``link`` names its parent and thread; a child run's ``tree`` its place in its agent tree."""
        return self.execute(core.create(self.keys, request, idempotency_key=idempotency_key, tenant=tenant,
                                        quota=quota, link=link, tree=tree))

    def tenant_of(self, run_id: str) -> str | None:
        """The run's tenant ("" for none); None when no run has that id."""
        return self.execute(core.tenant_of(self.keys, run_id))

    def in_flight(self, tenant: str) -> int:
        """How many of the tenant's runs are queued, running or waiting for approval."""
        return self.execute(core.in_flight(self.keys, tenant))

    def claim(self, run_id: str, owner: str, *, lease_s: float) -> Claim:
        """queued → running, stamping owner, started_at and the lease."""
        return self.execute(core.claim(self.keys, run_id, owner, lease_s=lease_s))

    def resume_claim(self, run_id: str, owner: str, *, lease_s: float) -> Claim:
        """waiting_for_approval (approved) → running, stamping the new owner and lease."""
        return self.execute(core.claim(self.keys, run_id, owner, lease_s=lease_s, resume=True))

    def suspend(self, run_id: str, owner: str, pending: Mapping[str, Any]) -> Transition:
        return self.execute(core.suspend(self.keys, run_id, owner, pending))

    def approve(self, run_id: str) -> Transition:
        return self.execute(core.approve(self.keys, run_id))

    def approve_once(self, run_id: str) -> tuple[Transition, bool]:
        """Approve a waiting run; also says whether this call made the decision (False: approved already)."""
        return self.execute(core.approve_once(self.keys, run_id))

    def settle(self, run_id: str, status: RunStatus, reason: TerminationReason, *, owner: str | None = None,
               error: str = "", required_status: RunStatus | None = None, final: RunStep | None = None) -> Transition:
        """Settle the run (``_store_core.settle``); ``final``: the model step whose answer a completing run's
        ``run.completed`` event carries."""
        return self.execute(core.settle(self.keys, run_id, status, reason, owner=owner, error=error,
                                        required_status=required_status, final=final))

    def cancel(self, run_id: str, *, reason: str, requested_by: str,
               termination: TerminationReason = TerminationReason.CANCELLED) -> Transition:
        return self.execute(core.cancel(self.keys, run_id, reason=reason, requested_by=requested_by,
                                        termination=termination))

    def cancel_reading_children(self, run_id: str, *, reason: str, requested_by: str) -> tuple[Transition, list[str]]:
        """:meth:`cancel`, and the runs one level below ``run_id`` read in the same round trip."""
        return self.execute(core.cancel_reading_children(self.keys, run_id, reason=reason, requested_by=requested_by))

    def cancel_below(self, run_id: str, *, reason: str, requested_by: str, first: list[str] | None = None) -> list[str]:
        """Fence every unfinished run below ``run_id`` in its agent tree, each with ``reason``; answers the runs
        this cancelled (docs/usage.md, "Agent trees"). ``first``: the level below ``run_id``, read already."""
        below = self.descendants(run_id, first=first)
        if not below:
            return []
        fences = self.execute(core.cancel_all(self.keys, below, reason=reason, requested_by=requested_by))
        return [child for child, fence in zip(below, fences, strict=True) if fence.won]

    def steer(self, run_id: str, request: SteerRequest) -> core.Steered:
        """Store a steer on a running run or one waiting for approval (docs/cancellation.md, "Steer")."""
        return self.execute(core.steer(self.keys, run_id, request))

    def pending_steer(self, run_id: str) -> SteerRequest | None:
        """The steer waiting to be applied, or None (fail-soft)."""
        return self.execute(core.pending_steer(self.keys, run_id))

    def wakeups_among(self, run_ids: Iterable[str]) -> tuple[set[str], dict[str, SteerRequest]]:
        """Which of these runs have a cancel key, and their steers waiting, in one MGET. Fail-soft."""
        ids = list(run_ids)
        return self.execute(core.wakeups_among(self.keys, ids)) if ids else (set(), {})

    def renew_leases(self, owners: Mapping[str, str], *, lease_s: float) -> set[str]:
        """Extend these runs' leases (run id → owner) in one round trip; returns those not renewed."""
        return self.execute(core.renew_leases(self.keys, owners, lease_s=lease_s)) if owners else set()

    def beat(self, worker: str, *, lost_s: float) -> bool:
        """Say this worker process is alive for ``lost_s`` more seconds; False once it was taken as lost."""
        return self.execute(core.beat(self.keys, worker, lost_s=lost_s))

    def leave(self, worker: str) -> None:
        """This worker process stops cleanly: nobody takes it as lost."""
        self.execute(core.leave(self.keys, worker))

    def lapse(self, *, limit: int = 100) -> list[str]:
        """Take the worker processes whose liveness expired (each is taken by one caller only)."""
        return self.execute(core.lapse(self.keys, limit=limit))

    def runs_of_workers(self, workers: Iterable[str]) -> dict[str, str]:
        """The running runs held by these worker processes: run id → worker."""
        wanted = set(workers)
        running = self.execute(core.leased_runs(self.keys))
        if not running or not wanted:
            return {}
        held = self.execute(core.field_of(self.keys, running, "worker"))
        return {run_id: worker for run_id, worker in held.items() if worker in wanted}

    def owners_of(self, run_ids: Iterable[str]) -> dict[str, str]:
        """These runs → the owner each is held under now ("" for none: queued, reaped, reclaimed)."""
        ids = list(run_ids)
        return self.execute(core.field_of(self.keys, ids, "owner")) if ids else {}

    def restamp(self, owners: Mapping[str, str], worker: str) -> set[str]:
        """Stamp these runs (run id → owner) with a new worker id; returns those taken from this owner."""
        return self.execute(core.restamp(self.keys, owners, worker)) if owners else set()

    def lost_view(self, run_id: str) -> tuple[dict[str, str], tuple[RunStep, ...]]:
        """A run's fields and steps, read together, for rebuilding it after its worker was lost."""
        return self.execute(core.lost_view(self.keys, run_id))

    def reclaim(self, run_id: str, *, worker: str, seq: int, steps: Sequence[RunStep], running: bool, fail: bool,
                pending: Mapping[str, Any], error: str) -> core.Reclaimed:
        """Record the cut-off calls of a lost worker's run and put it back to ``queued`` (or fail it), guarded."""
        return self.execute(core.reclaim(self.keys, run_id, worker=worker, seq=seq, steps=steps, running=running,
                                         fail=fail, pending=pending, error=error))

    def reap_expired(self, *, limit: int = 100) -> list[str]:
        """Fail (``lease_lost``) the running runs whose lease expired: their worker stopped without a word.

        Any worker may call this; each run is decided by one guarded script, so concurrent
        reapers never both win. Returns the runs this call failed.
        """
        due = self.execute(core.expired_leases(self.keys, limit=limit))
        return [run_id for run_id in due if self.execute(core.reap(self.keys, run_id)).won]

    def append_step(self, run_id: str, step: RunStep) -> RunStep:
        """Record a step; the store assigns its sequence (strictly increasing per run).

        Raises:
            RunNotFound: when the run does not exist.
        """
        return self.execute(core.append_step(self.keys, run_id, step)).step

    # -- reads ----------------------------------------------------------------------------------

    def get(self, run_id: str) -> RunRecord:
        """The run with its steps and cancel request (RunNotFound, saying where it looked, when absent)."""
        try:
            return self.execute(core.get(self.keys, run_id))
        except RunNotFound:
            raise RunNotFound(run_id, where=self.location) from None

    def status(self, run_id: str) -> RunStatus:
        try:
            return self.execute(core.status(self.keys, run_id))
        except RunNotFound:
            raise RunNotFound(run_id, where=self.location) from None

    @property
    def location(self) -> str:
        """Where this store looks, for messages: ``namespace N in Redis host:port/db`` (``in Redis cluster
        host:port`` on a cluster, which has no databases)."""
        if self._client is None or isinstance(self._client, redis.RedisCluster):
            return f"namespace {self.namespace!r} in Redis {self.where}"
        db = self._client.connection_pool.connection_kwargs.get("db", 0)
        return f"namespace {self.namespace!r} in Redis {self.where}/{db}"

    def recent(self, *, limit: int = 20, status: RunStatus | None = None, labels: Mapping[str, str] | None = None,
               scan: int = 1000) -> list[RunRecord]:
        """The most recent runs (without steps), newest first; filtered by status and labels (all must match)
        among the last ``scan``."""
        ids = self.execute(core.recent_ids(self.keys, count=scan if status or labels else limit))
        return self.execute(core.records(self.keys, ids, limit=limit, status=status, labels=labels)) if ids else []

    def thread(self, run_id: str, *, limit: int = 1000, status: RunStatus | None = None,
               labels: Mapping[str, str] | None = None) -> list[RunRecord]:
        """The thread ``run_id`` is in (docs/store.md, "Threads"): its first run and its continuations
        (without steps), oldest first; filtered by status and labels (all must match)."""
        root = core.thread_root(self.execute(core.summaries(self.keys, [run_id]))[0], run_id)
        records = self.execute(core.summaries(self.keys, self.execute(core.thread_ids(self.keys, root, count=limit))))
        return core.in_thread(records, root, limit=limit, status=status, labels=labels)

    def descendants(self, run_id: str, *, limit: int = 10_000, first: list[str] | None = None) -> list[str]:
        """Every run below ``run_id`` in its agent tree, level by level, at most ``limit`` (one round trip a
        level; docs/usage.md, "Agent trees"). ``first``: the level below ``run_id``, read already."""
        found = [] if first is None else first[:limit]
        level = [run_id] if first is None else found
        while level and len(found) < limit:
            level = core.next_level(self.execute(core.children(self.keys, level)))
            found += level
        return found[:limit]

    def tree(self, run_id: str, *, limit: int = 1000, status: RunStatus | None = None,
             labels: Mapping[str, str] | None = None) -> list[RunRecord]:
        """The agent tree whose first run is ``run_id``: it and every run below it (without steps), level by
        level; filtered by status and labels (all must match)."""
        records = self.execute(core.summaries(self.keys, [run_id, *self.descendants(run_id, limit=limit)]))
        return core.in_tree(records, limit=limit, status=status, labels=labels)

    def waiting_below(self, record: RunRecord) -> RunRecord:
        """``record`` with the runs below it in its agent tree that wait for approval (none read without
        children)."""
        return core.waiting_in(record, self.tree(record.run_id)) if record.children else record

    def server_outcomes(self, *, since: float | None = None) -> dict[str, dict[str, int]]:
        """Tool calls per server and outcome; with ``since`` (epoch seconds), those of the hours since then."""
        return self.execute(core.server_outcomes(self.keys, since=since))

    def cancel_requested(self, run_id: str) -> bool:
        """The probe (fail-soft: an unreachable Redis answers False and logs)."""
        return self.execute(core.cancel_requested(self.keys, run_id))

    def cancel_request(self, run_id: str) -> CancelRequest | None:
        return self.execute(core.cancel_request(self.keys, run_id))

    def cancelled_among(self, run_ids: Iterable[str]) -> set[str]:
        """Which of these runs have a cancel key, in one MGET. Fail-soft."""
        ids = list(run_ids)
        return self.execute(core.cancelled_among(self.keys, ids)) if ids else set()

    def ping(self) -> None:
        """Raises StoreError when Redis does not answer."""
        self.execute(core.ping())

    def redrive_due(self, *, older_than_s: float, limit: int = 100) -> list[tuple[str, bool]]:
        """Take the re-drive of runs nobody claimed within ``older_than_s`` of their message: (run id,
        resume) for each this call took; another worker's call takes none of the same in the same interval."""
        cutoff = time.time() - older_than_s
        taken = []
        for run_id in self.execute(core.unclaimed_since(self.keys, cutoff=cutoff, limit=limit)):
            kind = self.execute(core.take_redrive(self.keys, run_id, cutoff=cutoff))
            if kind:
                taken.append((run_id, kind == "resume"))
        return taken

    def sweep_expired(self, *, limit: int = 500) -> list[str]:
        """Delete the finished runs whose retention ended: every key of a run, its idempotency key and its
        index entries go together. Returns the runs deleted."""
        due = self.execute(core.expired_runs(self.keys, limit=limit))
        if not due:
            return []
        idempotency = self.execute(core.idempotency_keys(self.keys, due))
        threads = self.execute(core.threads_of(self.keys, due))
        self.execute(core.forget(self.keys, dict(zip(due, idempotency, strict=True)),
                                 dict(zip(due, threads, strict=True))))
        return list(due)

    # -- the outbox (docs/messaging.md, "The outbox"; worker/relay.py reads it) ----------------------

    def trim_outbox(self, *, retention_s: float) -> int:
        """Delete the outbox entries older than ``retention_s`` exactly (the writes trim approximately)."""
        return self.execute(core.outbox_trim(self.keys, retention_s=retention_s))

    def relay_cursor(self) -> OutboxCursor:
        """The relay's reading of the outbox (its group ``relay``) and its lease."""
        return OutboxCursor(self, core.RELAY_GROUP, self.keys.relay_lease)

    def webhook_cursor(self) -> OutboxCursor:
        """The webhook dispatcher's reading of the outbox (its group ``webhooks``, a cursor beside the relay's)
        and its lease."""
        return OutboxCursor(self, core.WEBHOOK_GROUP, self.keys.webhook_key("webhook-lease"))

    def outbox_after(self, after: str | None, *, count: int) -> tuple[list[OutboxEntry], str | None]:
        """The next ``count`` events after the event id ``after`` (None: from the oldest kept), and the oldest
        event id kept."""
        return self.execute(core.outbox_after(self.keys, after, count=count))

    # -- webhooks (docs/webhooks.md, "How delivery works"; worker/webhooks.py delivers) -----------------

    def run_requests(self, run_ids: Sequence[str]) -> list[str | None]:
        """The stored request (spec JSON) of each run; None for a run that is gone."""
        return self.execute(core.run_requests(self.keys, run_ids))

    def webhook_queue(self, webhook: str, run_id: str, event_id: str, *, event_type: str, body: str,
                      occurred_at: float, now: float) -> bool:
        """Queue the delivery of one event to one webhook behind the run's earlier ones; False when queued
        already."""
        fields: dict[str, core.Arg] = {
            "webhook": core.Ident(webhook), "run_id": core.Ident(run_id), "event_id": core.Ident(event_id),
            "type": core.Ident(event_type), "body": body, "status": core.Ident(DeliveryStatus.PENDING.value),
            "attempts": 0,
            "created_at": now, "occurred_at": occurred_at,
        }
        return self.execute(core.webhook_queue(self.keys, webhook, run_id, event_id, fields, now=now))

    def webhook_result(self, webhook: str, run_id: str, event_id: str, *, outcome: DeliveryStatus, attempts: int,
                       status_code: int, error: str, now: float, next_at: float) -> bool:
        """Record an attempt (``delivered``, ``retrying`` until ``next_at``, or ``gave_up``)."""
        retrying = outcome is DeliveryStatus.RETRYING
        fields: dict[str, core.Arg] = {
            "status": core.Ident(outcome.value), "attempts": attempts, "status_code": status_code, "error": error,
            "last_attempt_at": now, "next_attempt_at": next_at if retrying else 0,
        }
        if outcome is DeliveryStatus.DELIVERED:
            fields["delivered_at"] = now
        return self.execute(core.webhook_result(self.keys, webhook, run_id, event_id, outcome=outcome.value,
                                                fields=fields, now=now, next_at=next_at))

    def webhooks_due(self, *, now: float, count: int) -> list[str]:
        """Lines (``<webhook>|<run id>``) whose next delivery is due, oldest first."""
        return self.execute(core.webhooks_due(self.keys, now=now, count=count))

    def webhook_heads(self, lines: Sequence[str]) -> list[dict[str, str]]:
        """The delivery at the head of each line (empty when none)."""
        if not lines:
            return []
        heads: list[str] = self.execute(core.webhook_line_heads(self.keys, lines))
        return self.execute(core.webhook_fields(heads))

    def webhook_sweep(self, *, before: float, count: int = 500) -> int:
        """Delete up to ``count`` deliveries last touched before ``before``; answers how many."""
        expired = self.execute(core.webhook_expired(self.keys, before=before, count=count))
        return self.execute(core.webhook_forget(self.keys, expired)) if expired else 0

    def webhook_deliveries(self, *, failing: bool = False, count: int = 100) -> list[dict[str, str]]:
        """The latest webhook deliveries (or only those retrying or given up), newest first (docs/webhooks.md)."""
        delivery_keys: list[str] = self.execute(core.webhook_index(self.keys, failing=failing, count=count))
        return [found for found in self.execute(core.webhook_fields(delivery_keys)) if found]

    def persistence(self) -> list[tuple[str, dict[str | None, str | None]]]:
        """Each node's ``appendonly`` and ``save`` (every primary of a cluster), for the worker's warning
        about a Redis that keeps nothing on disk."""
        client = self.redis
        if isinstance(client, redis.Redis):
            return [(self.where, {**client.config_get("appendonly"), **client.config_get("save")})]
        primaries: list[Any] = client.get_primaries()  # type: ignore[no-untyped-call]
        return [(node.name, {**client.config_get("appendonly", target_nodes=node),
                             **client.config_get("save", target_nodes=node)}) for node in primaries]

    def delete_namespace(self) -> int:
        """Delete every key under this namespace (tests and the demo clean up with this; a cluster client
        scans every primary)."""
        deleted = 0
        client = self.redis
        for key in client.scan_iter(match=f"{self.namespace}:*", count=500):
            deleted += client.delete(key)
        return deleted


class OutboxCursor:
    """One consumer group's reading of the outbox, and the lease of the one reader of all a namespace's
    processes that reads through it (the relay's, the webhook dispatcher's: worker/outbox_reader.py)."""

    def __init__(self, store: RunStore, group: str, lease_key: str) -> None:
        self._store = store
        self.group = group
        self._lease_key = lease_key

    def make_groups(self) -> int:
        """Make the group on every outbox where it is missing; answers how many were made."""
        return self._store.execute(core.outbox_groups(self._store.keys, self.group))

    def lease(self, reader: str, *, lease_s: float) -> bool:
        """Take or renew the lease; answers whether ``reader`` holds it."""
        return self._store.execute(core.relay_lease(self._store.keys, reader, lease_s=lease_s, key=self._lease_key))

    def release(self, reader: str) -> bool:
        """Give the lease up if ``reader`` holds it (a reader that stops: the next one need not wait it out)."""
        return self._store.execute(core.relay_release(self._store.keys, reader, key=self._lease_key))

    def pending(self, reader: str, *, count: int) -> tuple[list[OutboxEntry], int]:
        """Take over the entries the group handed out and nobody acknowledged, oldest first, and say how many
        pending ones were trimmed before they were taken."""
        return self._store.execute(core.outbox_pending(self._store.keys, reader, count=count, group=self.group))

    def new(self, reader: str, *, count: int, block_ms: int | None = None,
            done: Sequence[OutboxEntry] = ()) -> list[OutboxEntry]:
        """The next entries nobody in the group was handed yet (waiting up to ``block_ms`` for one on a single
        Redis), after acknowledging ``done`` in the same round trip."""
        return self._store.execute(core.outbox_ack_and_new(self._store.keys, done, reader, count=count,
                                                           block_ms=block_ms, group=self.group))

    def ack(self, entries: Sequence[OutboxEntry]) -> int:
        """Acknowledge entries the reader is done with (they stay in the outbox until the retention ends)."""
        return self._store.execute(core.outbox_ack(self._store.keys, entries, self.group)) if entries else 0
