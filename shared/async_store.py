"""The run store on ``redis.asyncio``, for everything on a worker's event loop.

A worker process runs every run on one event loop; a synchronous Redis round trip there
would stall every run on it and delay interrupts. This executor sends the same
operations as :class:`~runbrake.shared.store.RunStore` (``shared/_store_core.py`` builds
them and reads their answers), awaiting each round trip instead. It offers what a
segment needs: claim, append (with the probe), probe, settle, suspend.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any, TypeVar

import redis
import redis.asyncio
import redis.asyncio.sentinel

from runbrake.shared import _store_core as core
from runbrake.shared.errors import RunNotFound
from runbrake.shared.records import (
    ANY_RUN,
    Appended,
    CancelRequest,
    Claim,
    Created,
    FeedPage,
    OutboxEntry,
    Quota,
    RunRecord,
    RunSearch,
    Sent,
    SteerRequest,
    Transition,
    TreeLink,
    read_cancel_request,
    read_record,
    read_step,
)
from runbrake.shared.settings import Settings
from runbrake.shared.status import RunStatus, TerminationReason
from runbrake.shared.steps import RunStep
from runbrake.shared.store import client_options, sentinel_options, where_of

T = TypeVar("T")

POOL_CONNECTIONS = 64
"""Connections of one event loop's pool: round trips are short, so a few dozen serve hundreds of runs."""
POOL_WAIT_S = 30.0
"""How long a round trip waits for a free connection before it fails as a store error."""

Client = redis.asyncio.Redis | redis.asyncio.RedisCluster


def plain_client(settings: Settings, **options: Any) -> redis.asyncio.Redis:
    """One asyncio client with these options (a subscriber's: ``broker/events.py``): on the URL's node, or,
    with ``RUNBRAKE_REDIS_SENTINELS``, on the primary the Sentinels name (and the next one after a failover)."""
    if not settings.redis_sentinels:
        return redis.asyncio.Redis.from_url(settings.redis_url, **options)
    connection, sentinel_kwargs = sentinel_options(settings)
    sentinels = redis.asyncio.sentinel.Sentinel(  # type: ignore[no-untyped-call]
        list(settings.redis_sentinels), sentinel_kwargs=sentinel_kwargs)
    client: redis.asyncio.Redis = sentinels.master_for(
        settings.redis_sentinel_master, redis_class=redis.asyncio.Redis,
        **{**connection, "socket_timeout": None, "health_check_interval": 30, **options})
    return client


class AsyncRunStore:
    """Runs, steps and cancel keys in Redis under one namespace, from an event loop.

    Its connections belong to the loop that first uses them: use one instance per loop.
    """

    def __init__(self, client: Client, namespace: str, *, retention_s: int = 0, where: str = "",
                 replication: core.Replication | None = None) -> None:
        self._redis = client
        self.namespace = namespace
        self.keys = core.Keys(namespace, retention_s, cluster=isinstance(client, redis.asyncio.RedisCluster))
        self.where = where or core.describe(client)
        self.replication = replication or core.Replication()
        self._turns: asyncio.Semaphore | None = None
        if not isinstance(getattr(client, "connection_pool", None), redis.asyncio.BlockingConnectionPool):
            # A cluster client, or a Sentinel-managed one, has no blocking pool: past max_connections it
            # refuses at once. Round trips wait their turn here instead (each holds at most one connection
            # per node).
            self._turns = asyncio.Semaphore(POOL_CONNECTIONS)

    @classmethod
    def connect(cls, settings: Settings) -> AsyncRunStore:
        """A store on ``settings.redis_url`` under ``settings.namespace``. Connects lazily.

        The pool blocks when all its connections are busy: hundreds of runs on one loop may each
        want a round trip at once (a burst of cancels records hundreds of steps), and the default
        pool would refuse the 101st with "Too many connections" instead of making it wait its turn.
        """
        where, replication = where_of(settings), core.Replication.of(settings)
        if settings.redis_cluster:
            cluster = redis.asyncio.RedisCluster.from_url(
                settings.redis_url, max_connections=POOL_CONNECTIONS, **client_options(settings))
            return cls(cluster, settings.namespace, retention_s=settings.retention_s, where=where)
        if settings.redis_sentinels:
            # The Sentinels name the primary (and a new one after a failover: shared/store.py, RunStore.connect).
            options, sentinel_kwargs = sentinel_options(settings)
            sentinels = redis.asyncio.sentinel.Sentinel(  # type: ignore[no-untyped-call]
                list(settings.redis_sentinels), sentinel_kwargs=sentinel_kwargs)
            client = sentinels.master_for(settings.redis_sentinel_master, redis_class=redis.asyncio.Redis,
                                          max_connections=POOL_CONNECTIONS, **options)
            return cls(client, settings.namespace, retention_s=settings.retention_s, where=where,
                       replication=replication)
        pool = redis.asyncio.BlockingConnectionPool.from_url(
            settings.redis_url, max_connections=POOL_CONNECTIONS, timeout=POOL_WAIT_S, **client_options(settings)
        )
        # The client owns (and closes) its pool.
        return cls(redis.asyncio.Redis.from_pool(pool), settings.namespace, retention_s=settings.retention_s,
                   where=where, replication=replication)

    async def aclose(self) -> None:
        await self._redis.aclose()

    async def execute(self, op: core.Op[T]) -> T:
        """Send one op (one round trip) and read its answer.

        Raises:
            StoreError: when Redis cannot be reached and the op has no fallback.
        """
        try:
            async with self._turn():
                answers = await self._send(op)
        except core.UNREACHABLE as exc:
            return core.failed(op, exc, self.where)
        return op.parse(answers)

    @contextlib.asynccontextmanager
    async def _turn(self) -> AsyncIterator[None]:
        """On a cluster, wait (bounded) for one of the round trips allowed at once; elsewhere the pool waits."""
        if self._turns is None:
            yield
            return
        try:
            await asyncio.wait_for(self._turns.acquire(), POOL_WAIT_S)
        except TimeoutError:
            raise redis.exceptions.ConnectionError(f"no free connection within {POOL_WAIT_S:g} s") from None
        try:
            yield
        finally:
            self._turns.release()

    async def _send(self, op: core.Op[Any]) -> list[Any]:
        if self.replication.applies(op):
            return await self._send_replicated(op)
        if len(op.calls) == 1 and not op.transaction:
            return [await self._one(op.calls[0])]
        async with self._redis.pipeline(transaction=op.transaction) as pipe:
            for call in op.calls:
                core.queue(pipe, call)
            answers: list[Any] = await pipe.execute(raise_on_error=False)
        for i in core.missing_scripts(answers):
            answers[i] = await self._one(op.calls[i])
        core.raise_first_error(answers)
        return answers

    async def _send_replicated(self, op: core.Op[Any]) -> list[Any]:
        """The op's calls and a WAIT after them on one connection, as :meth:`RunStore._send_replicated`."""
        calls, wait = list(op.calls), self.replication.wait
        answers = await self._pipeline([*calls, wait])
        missing = core.missing_scripts(answers[:-1])
        if missing:
            for i in missing:
                await self._redis.script_load(calls[i].script.source)  # type: ignore[union-attr]
            again = await self._pipeline([*(calls[i] for i in missing), wait])
            for i, answer in zip(missing, again, strict=False):
                answers[i] = answer
            answers[-1] = again[-1]
        core.raise_first_error(answers)
        self.replication.check(op, answers[-1], self.where)
        return answers[:-1]

    async def _pipeline(self, calls: list[core.Call]) -> list[Any]:
        async with self._redis.pipeline(transaction=False) as pipe:
            for call in calls:
                core.queue(pipe, call)
            answers: list[Any] = await pipe.execute(raise_on_error=False)
        return answers

    async def _one(self, call: core.Call) -> Any:
        if isinstance(call, core.Command):
            return await self._redis.execute_command(*call.args)  # type: ignore[no-untyped-call, unused-ignore]
        try:
            return await self._redis.evalsha(call.script.sha, len(call.keys), *call.keys, *call.args)
        except redis.exceptions.NoScriptError:
            # Redis lost its script cache (a restart, SCRIPT FLUSH): load and send again; it did not run.
            await self._redis.script_load(call.script.source)
            return await self._redis.evalsha(call.script.sha, len(call.keys), *call.keys, *call.args)

    # -- what a segment needs -------------------------------------------------------------------

    async def claim(self, run_id: str, owner: str, *, lease_s: float, resume: bool = False,
                    worker: str = "") -> Claim:
        """Claim the run (start, or resume after approval) for the worker process ``worker`` and read its
        request and pending turn."""
        return await self.execute(core.claim(self.keys, run_id, owner, lease_s=lease_s, resume=resume,
                                             worker=worker))

    async def restamp(self, run_id: str, owner: str, worker: str) -> bool:
        """Stamp the run held under ``owner`` with this process's new liveness id; False when it was taken."""
        return not await self.execute(core.restamp(self.keys, {run_id: owner}, worker))

    async def mark_sent(self, run_id: str, *, owner: str, call_id: str | None, round_number: int) -> None:
        """Mark a call as about to be sent (owner-guarded; :func:`core.mark_sent` says what it raises)."""
        await self.execute(core.mark_sent(self.keys, run_id, owner=owner, call_id=call_id,
                                                 round_number=round_number))

    async def keep_task(self, run_id: str, *, owner: str, call_id: str, task: str | None) -> None:
        """Record (or forget, with None) the MCP task of a call in flight (owner-guarded: :func:`core.keep_task`)."""
        await self.execute(core.keep_task(self.keys, run_id, owner=owner, call_id=call_id, task=task))

    async def tasks_left(self, run_id: str) -> dict[str, str]:
        """The MCP tasks recorded for the run's calls, by call id (:func:`core.tasks_left`)."""
        return await self.execute(core.tasks_left(self.keys, run_id))

    async def task_of(self, run_id: str, call_id: str) -> str | None:
        """The MCP task recorded for a call of the run, None when there is none."""
        return await self.execute(core.task_of(self.keys, run_id, call_id))

    async def append_step(self, run_id: str, step: RunStep, *, token: str = "", owner: str = "",
                          sent: Sent | None = None, above: Sequence[str] = ()) -> Appended:
        """Record a step and probe the cancel key, in one round trip (once per ``token``; refused with
        :class:`OwnershipLost` unless ``owner`` still holds the run), with the marks of the calls ``sent`` next, and
        a model step's use counted against the runs ``above`` it in its agent tree (:func:`core.append_step`)."""
        return await self.execute(core.append_step(self.keys, run_id, step, token=token, owner=owner, sent=sent,
                                                   above=above))

    async def apply_steer(self, run_id: str, request: SteerRequest, step: RunStep, *, owner: str,
                          token: str) -> Appended | None:
        """Consume the stored steer and record its ``steer`` step, in one script (exactly once)."""
        return await self.execute(core.apply_steer(self.keys, run_id, request, step, owner=owner, token=token))

    async def steer_waiting(self, run_id: str) -> bool:
        """A steer stored before the run was suspended: mark it steered for its resume (True: send the resume)."""
        return await self.execute(core.steer_waiting(self.keys, run_id))

    async def cancel_requested(self, run_id: str) -> bool:
        """The probe alone (fail-soft: an unreachable Redis answers False and logs)."""
        return await self.execute(core.cancel_requested(self.keys, run_id))

    async def cancel_request(self, run_id: str) -> CancelRequest | None:
        return await self.execute(core.cancel_request(self.keys, run_id))

    async def cancel(self, run_id: str, *, reason: str, requested_by: str,
                     termination: TerminationReason = TerminationReason.CANCELLED) -> Transition:
        """The cancel fence (a run's own budget stops it so: worker/budget.py)."""
        return await self.execute(core.cancel(self.keys, run_id, reason=reason, requested_by=requested_by,
                                              termination=termination))

    async def budget_use(self, run_id: str) -> core.BudgetUse | None:
        """What a run used of its budget, and what the runs below it in its agent tree used; None when there is
        no such run."""
        return await self.execute(core.budget_use(self.keys, run_id))

    # -- agent trees (docs/usage.md, "Agent trees") --------------------------------------------

    async def create(self, request: Mapping[str, Any], *, idempotency_key: str | None, tenant: str | None = None,
                     quota: Quota | None = None, tree: TreeLink | None = None) -> Created:
        """Write a queued child run (shared/store.py, ``RunStore.create``)."""
        return await self.execute(core.create(self.keys, request, idempotency_key=idempotency_key, tenant=tenant,
                                              quota=quota, tree=tree))

    async def status(self, run_id: str) -> RunStatus:
        """The run's status alone (RunNotFound when absent)."""
        return await self.execute(core.status(self.keys, run_id))

    async def child_status(self, child_run_id: str, caller_run_id: str) -> tuple[RunStatus, bool]:
        """A child run's status, and whether its caller's cancel key is set, in one round trip."""
        return await self.execute(core.child_status(self.keys, child_run_id, caller_run_id))

    async def add_child(self, caller_run_id: str, call_id: str, child_run_id: str) -> None:
        """Record the child run a call of the caller started, before the caller waits for it."""
        await self.execute(core.add_child(self.keys, caller_run_id, call_id, child_run_id))

    async def children(self, run_id: str) -> dict[str, str]:
        """The child runs of ``run_id``, by the id of the call that started each."""
        return (await self.execute(core.children(self.keys, [run_id])))[0]

    async def below_use(self, run_id: str) -> tuple[int, float]:
        """(tokens, cost in USD) the runs below ``run_id`` used."""
        return await self.execute(core.below_use(self.keys, run_id))

    async def settle(self, run_id: str, status: RunStatus, reason: TerminationReason, *, owner: str,
                     error: str = "", final: RunStep | None = None) -> Transition:
        return await self.execute(core.settle(self.keys, run_id, status, reason, owner=owner, error=error,
                                              final=final))

    async def complete(
        self, run_id: str, step: RunStep, *, owner: str, token: str = ""
    ) -> tuple[Appended, Transition, SteerRequest | None]:
        """Record the final step and settle the run completed, in one round trip (and the steer that refused it)."""
        return await self.execute(core.complete(self.keys, run_id, step, owner=owner, token=token))

    async def suspend(self, run_id: str, owner: str, pending: Mapping[str, Any]) -> Transition:
        return await self.execute(core.suspend(self.keys, run_id, owner, pending))

    async def hand_over(self, run_id: str, step: RunStep, *, owner: str, pending: Mapping[str, Any],
                        token: str = "") -> tuple[Appended, Transition]:
        """Record the hand-over step and put the run back to ``queued`` with its pending turn, in one
        round trip."""
        return await self.execute(core.hand_over(self.keys, run_id, step, owner=owner, pending=pending,
                                                 token=token))

    # -- what the HTTP API and progress reports need (docs/http-api.md) -------------------------

    async def set_progress(self, reports: Mapping[str, Mapping[str, Any]]) -> int:
        """Keep and announce the latest progress of each run's call in flight (run id → report), in one round
        trip; answers how many were kept (a run no longer running, or whose call's step is recorded, refuses)."""
        return await self.execute(core.set_progress(self.keys, reports)) if reports else 0

    async def publish_delta(self, run_id: str, delta: Mapping[str, Any]) -> bool:
        """Announce a model call's streamed text since the last delta (refused unless the run is running)."""
        return await self.execute(core.publish_delta(self.keys, run_id, delta))

    async def get(self, run_id: str) -> RunRecord:
        """The run with its steps and cancel request (RunNotFound when absent)."""
        return await self.execute(core.get(self.keys, run_id))

    async def tenant_of(self, run_id: str) -> str | None:
        """The run's tenant ("" for none); None when no run has that id."""
        return await self.execute(core.tenant_of(self.keys, run_id))

    async def head(self, run_id: str) -> tuple[RunRecord, int]:
        """The run without its steps and how many steps it holds, read in one transaction
        (:class:`RunNotFound` when absent): what an events stream reads before it pages through the steps
        with :meth:`steps`, so that it never holds a whole run (docs/http-api.md, "Events: limits")."""
        return await self.execute(_head(self.keys, run_id))

    async def steps(self, run_id: str, start: int, count: int) -> tuple[RunStep, ...]:
        """Up to ``count`` steps from list position ``start`` on (0-based). APPEND_STEP numbers steps in
        list order from 1 (shared/_scripts.py), so position ``i`` holds sequence ``i + 1``."""
        return await self.execute(_steps(self.keys, run_id, start, count))

    async def server_outcomes(self) -> dict[str, dict[str, int]]:
        return await self.execute(core.server_outcomes(self.keys))

    @property
    def cluster(self) -> bool:
        """Whether this store is on a Redis Cluster."""
        return self.keys.cluster

    async def outbox_after(self, after: str | None, *, count: int) -> tuple[list[OutboxEntry], str | None]:
        """The next ``count`` events after the event id ``after`` (None: from the oldest kept), and the oldest
        event id kept (``GET /v1/events`` replays them)."""
        return await self.execute(core.outbox_after(self.keys, after, count=count))

    async def feed_page(self, after: str, *, tenant: str | None, count: int) -> FeedPage:
        """Of the next ``count`` events after the event id ``after``, the status changes (of ``tenant``'s runs
        only, unless None), and the oldest event id kept (``GET /v1/events`` replays them)."""
        return await self.execute(core.feed_page(self.keys, after, tenant=tenant, count=count))

    async def webhook_deliveries(self, *, failing: bool = False, count: int = 100) -> list[dict[str, str]]:
        """The latest webhook deliveries (or only those retrying or given up), newest first (docs/webhooks.md)."""
        delivery_keys = await self.execute(core.webhook_index(self.keys, failing=failing, count=count))
        return [found for found in await self.execute(core.webhook_fields(delivery_keys)) if found]

    async def ping(self) -> None:
        """Raises StoreError when Redis does not answer."""
        await self.execute(core.ping())

    async def thread(self, run_id: str, *, limit: int = 1000, status: RunStatus | None = None,
                     labels: Mapping[str, str] | None = None) -> list[RunRecord]:
        """The thread ``run_id`` is in, oldest first (``RunStore.thread``)."""
        root = core.thread_root((await self.execute(core.summaries(self.keys, [run_id])))[0], run_id)
        ids = await self.execute(core.thread_ids(self.keys, root, count=limit))
        records = await self.execute(core.summaries(self.keys, ids))
        return core.in_thread(records, root, limit=limit, status=status, labels=labels)

    async def descendants(self, run_id: str, *, limit: int = 10_000) -> list[str]:
        """Every run below ``run_id`` in its agent tree, level by level (``RunStore.descendants``)."""
        found: list[str] = []
        level = [run_id]
        while level and len(found) < limit:
            level = core.next_level(await self.execute(core.children(self.keys, level)))
            found += level
        return found[:limit]

    async def cancel_below(self, run_id: str, *, reason: str, requested_by: str) -> list[str]:
        """Fence every unfinished run below ``run_id`` (``RunStore.cancel_below``); answers those this cancelled."""
        below = await self.descendants(run_id)
        if not below:
            return []
        fences = await self.execute(core.cancel_all(self.keys, below, reason=reason, requested_by=requested_by))
        return [child for child, fence in zip(below, fences, strict=True) if fence.won]

    async def tree(self, run_id: str, *, limit: int = 1000, status: RunStatus | None = None,
                   labels: Mapping[str, str] | None = None) -> list[RunRecord]:
        """The agent tree whose first run is ``run_id``, level by level (``RunStore.tree``)."""
        ids = [run_id, *await self.descendants(run_id, limit=limit)]
        records = await self.execute(core.summaries(self.keys, ids))
        return core.in_tree(records, limit=limit, status=status, labels=labels)

    async def waiting_below(self, record: RunRecord) -> RunRecord:
        """``record`` with the runs below it in its agent tree that wait for approval (``RunStore.waiting_below``)."""
        return core.waiting_in(record, await self.tree(record.run_id)) if record.children else record

    async def page(
        self, *, limit: int, status: RunStatus | None = None, after: tuple[float, str] | None = None,
        labels: Mapping[str, str] | None = None, search: RunSearch = ANY_RUN, scan: int = 1000,
    ) -> tuple[list[RunRecord], tuple[float, str] | None]:
        """Runs newest first (without steps), after the position ``after``; filtered by ``status``,
        ``labels`` (all must match) and ``search`` (its time window bounds the index range read).

        Examines at most ``scan`` runs, so a rare status costs a bounded amount of work per call. Answers
        the runs and the position to continue from, or None when the index is exhausted.
        """
        found: list[RunRecord] = []
        position = after
        examined = 0
        while examined < scan:
            batch = min(max(limit * 2, 50), scan - examined)
            ids, exhausted = await self.execute(core.index_after(self.keys, position, count=batch,
                                                                 since=search.since, until=search.until))
            if not ids:  # (more runs created in the same microsecond than a batch holds end the listing too)
                return found, None
            records = await self.execute(core.summaries(self.keys, [run_id for run_id, _ in ids]))
            for (run_id, score), record in zip(ids, records, strict=True):
                examined += 1
                position = (score, run_id)
                if record is not None and core.matches(record, status, labels) and search.admits(record):
                    found.append(record)
                    if len(found) >= limit:
                        return found, position
            if exhausted:
                return found, None
        return found, position


# The ranged reads of the events streams. Each touches the run's own keys only, which share one hash slot
# (shared/_store_core.py, the key layout), so they hold on a Redis Cluster too.


def _head(keys: core.Keys, run_id: str) -> core.Op[tuple[RunRecord, int]]:
    def parse(answers: list[Any]) -> tuple[RunRecord, int]:
        fields, raw_cancel, count = answers
        if not fields:
            raise RunNotFound(run_id)
        return read_record(run_id, fields, (), read_cancel_request(raw_cancel)), int(count)

    return core.Op(f"read run {run_id}", (
        core.Command(("HGETALL", keys.run(run_id))),
        core.Command(("GET", keys.cancel(run_id))),
        core.Command(("LLEN", keys.steps(run_id))),
    ), parse, transaction=True)


def _steps(keys: core.Keys, run_id: str, start: int, count: int) -> core.Op[tuple[RunStep, ...]]:
    def parse(answers: list[Any]) -> tuple[RunStep, ...]:
        return tuple(read_step(run_id, raw) for raw in answers[0])

    return core.Op(f"read the steps of run {run_id}",
                   (core.Command(("LRANGE", keys.steps(run_id), start, start + max(count, 1) - 1)),), parse)
