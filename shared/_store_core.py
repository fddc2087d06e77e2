"""The run store's pure core: keys, the calls each operation sends, and how each answer is read.

Nothing here does I/O. An operation is an :class:`Op`: the Redis calls of one round
trip (a script, or a pipeline of commands), how to read their answers, and what to do
when Redis cannot be reached. Two thin executors send ops: :class:`~runbrake.shared.store.RunStore`
(synchronous: the CLI, the cancel listener thread, tests) and
:class:`~runbrake.shared.async_store.AsyncRunStore` (``redis.asyncio``: everything on a worker's
event loop). Keys, script arguments and answer parsing are written once, here; so is the
translation of ``redis`` errors into :class:`StoreError` (:func:`failed`).

Keys on a single Redis, all under the namespace (``{run_id}`` is a hash tag, so a run's keys share one slot):

    <ns>:run:{<id>}           hash   the run: status, reason, times, owner, request, pending turn, labels,
                                     model, input preview, usage (input/output tokens, model calls)
    <ns>:run:{<id>}:steps     list   the steps as JSON, in sequence order
    <ns>:run:{<id>}:cancel    string the cancel request as JSON; lives as long as the run, no TTL
    <ns>:runs                 zset   run ids by creation time
    <ns>:idem:<key>           string the run id an idempotency key created
    <ns>:servers              hash   tool calls per "<server>|<outcome>", for per-server health
    <ns>:leases               zset   running run ids by lease expiry, for the reaper
    <ns>:outbox               stream every status change and step as an event, for the relay and the feed

On a Redis Cluster (``RUNBRAKE_REDIS_CLUSTER``) the same structures carry the hash tag of one of
:data:`SHARDS` shards, ``{<ns>|<shard>}``: ``<ns>:run:{<ns>|<shard>}:<id>`` (and ``:steps``, ``:cancel``),
``<ns>:leases:{<ns>|<shard>}``, ``<ns>:idem:{<ns>|<shard>}:<key>``…; a run's shard is the last hex digit of
its id. Every script touches one shard, so one slot; readers that span the namespace merge the shards.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
import time
import urllib.parse
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Generic, TypeVar

import redis
import structlog

from runbrake.shared import _api_scripts, _scripts
from runbrake.shared._scripts import Script
from runbrake.shared.errors import CancelRequested, NotReplicated, OwnershipLost, RunNotFound, StoreError
from runbrake.shared.records import (
    ARGUMENT_ERROR,
    CANCELLED_SIDE_EFFECTS_UNKNOWN,
    MAX_CALL_TOKENS,
    SENT_MODEL,
    SENT_PREFIX,
    TASK_PREFIX,
    WORKER_LOST_NONE,
    WORKER_LOST_UNKNOWN,
    Appended,
    CancelRequest,
    Claim,
    Created,
    FeedPage,
    OutboxEntry,
    Quota,
    QuotaHit,
    RunRecord,
    Sent,
    SteerRequest,
    Transition,
    TreeLink,
    read_cancel_request,
    read_json_field,
    read_record,
    read_steer_request,
    read_step,
    read_tree,
)
from runbrake.shared.redaction import scrub, scrub_value, strip_bidi
from runbrake.shared.run_end import answer_members
from runbrake.shared.status import RunStatus, TerminationReason
from runbrake.shared.steps import RunStep, StepError, StepKind, StepReason
from runbrake.shared.threads import ThreadLink
from runbrake.shared.tool_result import SideEffects

log = structlog.get_logger("runbrake.shared.store")

T = TypeVar("T")

_STEP_SYSTEM_FIELDS: Final = ("sequence", "recorded_at")

MAX_ERROR_CHARS: Final = 2000


SHARDS: Final = 16
"""Shards of a namespace on a Redis Cluster (docs/store.md, "The run store on a Redis Cluster"): each
namespace-wide structure exists once per shard, in the shard's slot, beside the runs of that shard. Fixed:
changing it would move every run."""


@dataclass(frozen=True, slots=True)
class Keys:
    """The Redis keys of one namespace, and how long its finished runs are kept (0: forever).

    On a single Redis (``cluster`` False) the layout is the one external tooling knows, byte for byte.
    On a Redis Cluster every key carries its shard's hash tag ``{<ns>|<shard>}``: a run's keys and the
    namespace-wide structures of its shard share one slot, so every script touches one slot.
    """

    namespace: str
    retention_s: int = 0
    cluster: bool = False

    @property
    def shards(self) -> range:
        """Every shard of the namespace (one on a single Redis)."""
        return range(SHARDS if self.cluster else 1)

    def shard(self, run_id: str) -> int:
        """A run's shard: the last hex digit of its id (uniform, since ids are random), 0 on a single Redis."""
        if not self.cluster:
            return 0
        last = run_id[-1:].lower()
        return int(last, 16) % SHARDS if last and last in "0123456789abcdef" else 0

    def new_run_id(self, idempotency_key: str | None, tenant: str | None = None) -> str:
        """A fresh run id (32 lowercase hex). In a cluster, a tenant's run goes to the tenant's shard, so
        that one script counts all of the tenant's runs against its quotas; any other run created with an
        idempotency key goes to the key's shard (its last digit says so), so that the script that creates it
        touches one slot."""
        run_id = uuid.uuid4().hex
        if not self.cluster or not (idempotency_key or tenant):
            return run_id
        shard = self.tenant_shard(tenant) if tenant else self.idempotency_shard(idempotency_key or "")
        return f"{run_id[:-1]}{shard:x}"

    def tenant_shard(self, tenant: str) -> int:
        """The shard of a tenant's runs and counts: from a digest, the same in every process."""
        return self.idempotency_shard(f"tenant/{tenant}")

    def idempotency_shard(self, key: str) -> int:
        """The shard an idempotency key (and the run it creates) lives in: from a digest, the same in every
        process."""
        return int(hashlib.sha256(key.encode()).hexdigest()[-1], 16) % SHARDS if self.cluster else 0

    def _tag(self, shard: int) -> str:
        return f"{{{self.namespace}|{shard}}}"

    def _sharded(self, name: str, shard: int) -> str:
        """``<ns>:<name>`` on a single Redis; ``<ns>:<name>:{<ns>|<shard>}`` in a cluster."""
        return f"{self.namespace}:{name}:{self._tag(shard)}" if self.cluster else f"{self.namespace}:{name}"

    def retention(self, run_id: str) -> tuple[str, str, str, str]:
        """The keys a run's end touches to keep it for its retention: its own three, and the finished set."""
        return self.run(run_id), self.steps(run_id), self.cancel(run_id), self.finished(self.shard(run_id))

    def outbox(self, shard: int) -> str:
        """The stream of events (status changes and steps) that the relay publishes and ``GET /v1/events``
        replays (docs/messaging.md, "The outbox"): one per shard in a cluster, beside its runs."""
        return self._sharded("outbox", shard)

    @property
    def relay_lease(self) -> str:
        """Which relay publishes the outbox now (its name, expiring): one per namespace."""
        return self._sharded("relay", 0)

    def webhook_key(self, name: str) -> str:
        """A webhook structure (docs/webhooks.md, "Keys"): all in shard 0's slot, so each script touches one."""
        return self._sharded(name, 0)

    def outbox_of(self, run_id: str) -> str:
        """The outbox a run's events go to: its shard's."""
        return self.outbox(self.shard(run_id))

    def waiting_lists(self, run_id: str) -> tuple[str, str]:
        """The leases and unclaimed sets of a run's shard: a transition moves the run in or out of them."""
        return self.leases(self.shard(run_id)), self.unclaimed(self.shard(run_id))

    def run(self, run_id: str) -> str:
        if self.cluster:
            return f"{self.namespace}:run:{self._tag(self.shard(run_id))}:{run_id}"
        return f"{self.namespace}:run:{{{run_id}}}"

    def steps(self, run_id: str) -> str:
        return f"{self.run(run_id)}:steps"

    def cancel(self, run_id: str) -> str:
        return f"{self.run(run_id)}:cancel"

    def children(self, run_id: str) -> str:
        """The child runs its agent calls started (docs/usage.md, "Agent trees"): a hash, call id → child run
        id, in the run's own slot."""
        return f"{self.run(run_id)}:children"

    def steer(self, run_id: str) -> str:
        """The steer waiting to be applied (docs/cancellation.md, "Steer"): at most one, deleted when applied."""
        return f"{self.run(run_id)}:steer"

    def index(self, shard: int) -> str:
        """Run ids by creation time."""
        return self._sharded("runs", shard)

    def thread(self, root: str, shard: int) -> str:
        """The continuations of the thread whose first run is ``root`` that live in ``shard``, by creation time
        (docs/store.md, "Threads"): each is in its own run's slot, so the script that creates it touches
        one; a thread's listing reads every shard's."""
        if self.cluster:
            return f"{self.namespace}:thread:{self._tag(shard)}:{root}"
        return f"{self.namespace}:thread:{root}"

    def idempotency(self, key: str, shard: int) -> str:
        if self.cluster:
            return f"{self.namespace}:idem:{self._tag(shard)}:{key}"
        return f"{self.namespace}:idem:{key}"

    def servers(self, shard: int) -> str:
        return self._sharded("servers", shard)

    def leases(self, shard: int) -> str:
        return self._sharded("leases", shard)

    def servers_hour(self, when: float, shard: int) -> str:
        """Tool calls per server and outcome in the hour ``when`` falls in (for ``runbrake servers --since``)."""
        return self._sharded(f"servers:{int(when // 3600)}", shard)

    def tenants(self, shard: int) -> str:
        """In-flight runs (queued, running, waiting for approval) per tenant: a hash, tenant → count."""
        return self._sharded("tenants", shard)

    def tenant_enqueues(self, shard: int) -> str:
        """Enqueues per tenant in the current minute: a hash, tenant → ``"<minute> <count>"``."""
        return self._sharded("tenant-enqueues", shard)

    def unclaimed(self, shard: int) -> str:
        """Runs waiting for a worker (queued, or approved and waiting for their resume), scored by when their
        message was last sent: the re-drive's work list."""
        return self._sharded("unclaimed", shard)

    def finished(self, shard: int) -> str:
        """Finished runs by the time their retention ends (the sweeper's work list)."""
        return self._sharded("finished", shard)

    @property
    def workers(self) -> str:
        """The live worker processes, scored by when each is lost unless it says it is alive again (Redis's
        clock; docs/leases.md, "Lost workers"): one per namespace."""
        return self._sharded("workers", 0)

    @property
    def lost_workers(self) -> str:
        """The worker processes taken as lost, scored by when: their beats are refused."""
        return self._sharded("lost-workers", 0)

    @property
    def events(self) -> str:
        """The pub/sub channel of status changes and appended steps (docs/store.md, "The run store").
        One channel in a cluster too: a PUBLISH reaches the subscribers of every node."""
        return f"{self.namespace}:events"

    @property
    def tree_wakes(self) -> str:
        """The pub/sub channel on which an agent tree's run names the run above it that should look again: its
        caller when it ended, each ancestor when its use grew (shared/_scripts.py, ``announce_end`` and
        ``ADD_BELOW``). The events channel's name and ``:tree-wakes``."""
        return f"{self.events}:tree-wakes"

    def by_shard(self, run_ids: Iterable[str]) -> dict[int, list[str]]:
        """These runs grouped by shard, in the given order within each (a command spans one slot)."""
        groups: dict[int, list[str]] = {}
        for run_id in run_ids:
            groups.setdefault(self.shard(run_id), []).append(run_id)
        return groups


# -- what goes on the wire -----------------------------------------------------------------------


_IDENT: Final = re.compile(r"[A-Za-z0-9_.:|{}@+/=-]{0,300}")


class Ident(str):
    """A script argument runbrake made itself (a run id, an owner, a step token, a status, a channel
    name): sent as it is. Anything else in a script's arguments is treated as text from outside."""

    __slots__ = ()

    def __new__(cls, value: str) -> Ident:
        if not _IDENT.fullmatch(value):
            raise ValueError(f"not an identifier runbrake made (letters, digits, '_.:|{{}}@+/=-'): {value[:60]!r}")
        return super().__new__(cls, value)


class Verbatim(str):
    """A script argument kept exactly as the caller gave it, unscrubbed: only the run's request (it is what
    runs: cutting a URL's password out of an inline server would change the run), its idempotency key
    (part of a key's name) and the answer its terminal event carries (JSON scrubbed value by value before it
    was cut: shared/run_end.py). Build one with :func:`verbatim_json` or for the key directly."""

    __slots__ = ()


Arg = Ident | Verbatim | str | int | float | Mapping[str, Any] | list[Any] | tuple[Any, ...]
"""What a script argument may be given as; :func:`wire` says how each is sent."""


def stored_json(value: Mapping[str, Any] | list[Any] | tuple[Any, ...]) -> str:
    """The one form in which a structure from a model, a tool, an MCP server or a caller is written to Redis:
    compact JSON of it with every string scrubbed (``shared/redaction.py`` :func:`scrub_value`: remembered
    secrets, bearer tokens, URL passwords) and no NaN or Infinity token, which would break every reader of
    the events channel (docs/security.md, "Where secrets live")."""
    return json.dumps(scrub_value(value), separators=(",", ":"), allow_nan=False)


def verbatim_json(value: Mapping[str, Any]) -> Verbatim:
    """The run's request as stored: JSON with sorted keys, as given (see :class:`Verbatim`), never NaN.

    Raises:
        ValueError: when it holds NaN or Infinity (``RunSpec`` refuses those before: docs/security.md).
    """
    return Verbatim(json.dumps(value, sort_keys=True, allow_nan=False))


def wire(value: Arg) -> str:
    """One script argument as sent: an :class:`Ident` or :class:`Verbatim` as it is; a number in its exact
    form (never NaN or Infinity); free text scrubbed; a mapping or list as :func:`stored_json`.

    Every value a script writes passes here (:class:`ScriptCall` applies it to each argument), so a new
    field cannot reach Redis unscrubbed by forgetting a call.

    Raises:
        ValueError: for a non-finite number.
        TypeError: for anything else.
    """
    if isinstance(value, Ident | Verbatim):
        return str(value)
    if isinstance(value, bool):
        raise TypeError("a script argument is not a bool: send '1' or '0' as an Ident")
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"a script argument is a finite number, not {value!r}")
        return repr(value)
    if isinstance(value, str):
        return scrub(value)
    if isinstance(value, Mapping | list | tuple):
        return stored_json(value)
    raise TypeError(f"cannot send a {type(value).__name__} as a script argument")


@dataclass(frozen=True, slots=True, init=False)
class ScriptCall:
    """One EVALSHA of a Lua script. Its arguments are made as sent here, each through :func:`wire`: the one
    way a value gets into a script, and a script is the one way anything is written (:class:`Command`
    only reads and deletes)."""

    script: Script
    keys: tuple[str, ...]
    args: tuple[str, ...]
    """The arguments as sent."""

    def __init__(self, script: Script, keys: Iterable[str], args: Iterable[Arg]) -> None:
        object.__setattr__(self, "script", script)
        object.__setattr__(self, "keys", tuple(keys))
        object.__setattr__(self, "args", tuple(wire(arg) for arg in args))


_READS_AND_DELETES: Final = frozenset({
    "GET", "MGET", "EXISTS", "HGET", "HMGET", "HGETALL", "HEXISTS", "HLEN", "HSCAN", "LRANGE", "LLEN", "LINDEX",
    "ZRANGE", "ZREVRANGE", "ZRANGEBYSCORE", "ZREVRANGEBYSCORE", "ZSCORE", "ZCARD", "ZCOUNT", "SCAN",
    "DEL", "UNLINK", "HDEL", "ZREM", "EXPIRE", "PEXPIRE", "PING", "ECHO", "TTL", "PTTL", "TYPE", "WAIT",
    "XRANGE", "XREVRANGE", "XLEN", "XREADGROUP", "XAUTOCLAIM", "XACK", "XPENDING",
})
"""What a plain command may do: read, delete, expire, ask. A write is a script, whose arguments go through
:func:`wire`. The outbox's group commands belong here: they hand out and acknowledge entries, writing no value."""


@dataclass(frozen=True, slots=True)
class Command:
    """One plain Redis command that reads or deletes, e.g. ``Command(("HGETALL", key))``."""

    args: tuple[Any, ...]

    def __post_init__(self) -> None:
        if not self.args or str(self.args[0]).upper() not in _READS_AND_DELETES:
            verb = str(self.args[0]) if self.args else "nothing"
            raise ValueError(f"a plain command reads or deletes, not {verb}: write with a script (ScriptCall)")


Call = ScriptCall | Command

_NO_FALLBACK: Final = object()


@dataclass(frozen=True, slots=True)
class Op(Generic[T]):
    """One round trip: the calls, how to read their answers, and what an unreachable Redis means.

    ``fallback``: when set, an unreachable Redis is logged as ``fallback_event`` and the op answers
    the fallback instead of raising (the probe is fail-soft: a store hiccup never fabricates a
    cancel). Without it, the executor raises :class:`StoreError`.

    ``durable``: a transition that must never be lost once acknowledged (create, the cancel fence, approve,
    deny, settle, hand-over). With ``RUNBRAKE_REDIS_MIN_REPLICAS_ACK`` set, the executor sends it with a
    ``WAIT`` on the same connection (:class:`Replication`) and answers only once enough replicas have it.
    """

    what: str
    calls: tuple[Call, ...]
    parse: Callable[[list[Any]], T]
    transaction: bool = False
    fallback: Any = _NO_FALLBACK
    fallback_event: str = ""
    context: Mapping[str, Any] | None = None
    durable: bool = False

    def __post_init__(self) -> None:
        if self.durable and self.fallback is not _NO_FALLBACK:
            raise ValueError("a durable op has no fallback: it is acknowledged or it fails")
        if self.transaction and any(isinstance(call, ScriptCall) for call in self.calls):
            # A script missing from Redis's cache fails inside MULTI while the rest commits; retrying
            # it alone would break the transaction's all-or-nothing reading.
            raise ValueError("a transaction carries plain commands only")


def durable(op: Op[T]) -> Op[T]:
    """The same op, marked as a transition that must not be lost once acknowledged (:class:`Op`)."""
    return dataclasses.replace(op, durable=True)


@dataclass(frozen=True, slots=True)
class Replication:
    """How many replicas must acknowledge a durable op, and for how long it waits for them
    (``RUNBRAKE_REDIS_MIN_REPLICAS_ACK``, ``RUNBRAKE_REDIS_REPLICA_ACK_TIMEOUT_S``; docs/operating.md,
    "Redis failover"). ``replicas`` 0: durable ops are sent like any other.

    ``WAIT`` counts the replicas that have every write its own connection made, so the executors send it
    in the same pipeline as the op's calls, after them, on one connection (:meth:`calls`).
    """

    replicas: int = 0
    timeout_s: float = 1.0

    @classmethod
    def of(cls, settings: Any) -> Replication:
        """From ``Settings`` (typed loosely: this module does not import the settings)."""
        return cls(settings.redis_min_replicas_ack, settings.redis_replica_ack_timeout_s)

    def applies(self, op: Op[Any]) -> bool:
        return bool(self.replicas) and op.durable

    @property
    def wait(self) -> Command:
        return Command(("WAIT", self.replicas, max(1, round(self.timeout_s * 1000))))

    def check(self, op: Op[Any], acknowledged: Any, where: str) -> None:
        """Raises :class:`NotReplicated` when fewer replicas than asked acknowledged ``op``."""
        if isinstance(acknowledged, int) and acknowledged >= self.replicas:
            return
        raise NotReplicated(f"Redis at {where}: {op.what}: acknowledged by {acknowledged} of the "
                            f"{self.replicas} replicas asked for within {self.timeout_s:g} s "
                            "(RUNBRAKE_REDIS_MIN_REPLICAS_ACK): the primary has it, a failover now may lose it")


def queue(pipe: Any, call: Call, **options: Any) -> None:
    """Queue ``call`` on a pipeline (the synchronous and the asynchronous pipelines queue alike;
    ``options`` go with a script, e.g. the cluster node it is for)."""
    if isinstance(call, ScriptCall):
        # As a command, not pipe.evalsha(): redis-py's cluster pipelines refuse that method, though they
        # route the command by its first key like any other (every script touches one slot).
        pipe.execute_command("EVALSHA", call.script.sha, len(call.keys), *call.keys, *call.args, **options)
    else:
        pipe.execute_command(*call.args)


def missing_scripts(answers: Sequence[Any]) -> list[int]:
    """The positions of answers that say Redis did not have the script (NOSCRIPT): those calls did
    not run, so sending them again after loading the script is safe."""
    return [i for i, answer in enumerate(answers) if isinstance(answer, redis.exceptions.NoScriptError)]


def raise_first_error(answers: Sequence[Any]) -> None:
    """A pipeline executed with ``raise_on_error=False`` answers errors as values: raise the first."""
    for answer in answers:
        if isinstance(answer, redis.RedisError):
            raise answer


UNREACHABLE: Final = (redis.RedisError, redis.exceptions.RedisClusterException)
"""What an unreachable Redis raises: a cluster client that finds no node answering raises the second."""


def failed(op: Op[T], exc: Exception, where: str) -> T:
    """What an op comes to when Redis failed: its fallback (logged), or a :class:`StoreError`.

    The one place ``redis`` errors are translated.
    """
    if op.fallback is not _NO_FALLBACK:
        log.warning(op.fallback_event, error=str(exc), redis=where, **(op.context or {}))
        fallback: T = op.fallback
        return fallback
    raise StoreError(f"Redis at {where}: {op.what}: {exc}") from exc


def describe(client: Any) -> str:
    """``host:port`` of a client, for messages (a cluster client: ``cluster host:port`` of its first seed
    node, read without connecting)."""
    if not hasattr(client, "connection_pool"):
        return f"cluster {next(iter(client.nodes_manager.startup_nodes), '?')}"
    kwargs = client.connection_pool.connection_kwargs
    return f"{kwargs.get('host', kwargs.get('path', '?'))}:{kwargs.get('port', '?')}"


def describe_sentinels(master: str, sentinels: Sequence[tuple[str, int]]) -> str:
    """``sentinel master NAME via host:port,…``, for messages."""
    return f"sentinel master {master} via {','.join(f'{host}:{port}' for host, port in sentinels)}"


def sentinel_url_options(url: str) -> dict[str, Any]:
    """What of a Redis URL a Sentinel-managed client keeps: the database, the credentials and TLS (the
    Sentinels name the host and port)."""
    options = redis.connection.parse_url(url)  # type: ignore[no-untyped-call]
    kept = {name: options[name] for name in ("db", "username", "password") if options.get(name) is not None}
    if url.startswith("rediss:"):
        kept["ssl"] = True
    return kept


def describe_url(url: str, *, cluster: bool) -> str:
    """``host:port`` of a Redis URL, for messages (``cluster host:port`` for a cluster's seed node)."""
    parsed = urllib.parse.urlsplit(url)
    where = f"{parsed.hostname or parsed.path or '?'}:{parsed.port or 6379}"
    return f"cluster {where}" if cluster else where


def _script(script: Script, keys: Iterable[str], args: Iterable[Arg], what: str,
            parse: Callable[[list[Any]], T]) -> Op[T]:
    return Op(what, (ScriptCall(script, keys, args),), parse)


# -- transitions ---------------------------------------------------------------------------------


def _transition(name: str, run_id: str) -> Callable[[list[Any]], Transition]:
    def parse(answers: list[Any]) -> Transition:
        return _read_transition(name, run_id, answers[0])

    return parse


def _read_transition(name: str, run_id: str, answer: Sequence[Any]) -> Transition:
    won, found = bool(answer[0]), str(answer[1])
    status = RunStatus.parse(found, run_id=run_id) if found else RunStatus.UNKNOWN
    why = str(answer[2]) if len(answer) > 2 else ""
    result = Transition(won=won, found=status, exists=bool(found), owner_mismatch=why == "owner",
                        steered=why == "steer")
    if won:
        log.debug("transition", transition=name, run_id=run_id, found=found)
    else:
        # Nothing is lost silently: a refused transition says what it found.
        log.info("transition_refused", transition=name, run_id=run_id, found=found or "missing",
                 owner_mismatch=result.owner_mismatch, **({"steered": True} if result.steered else {}))
    return result


INPUT_PREVIEW_CHARS: Final = 200
"""How much of a run's input its listing shows (``input_preview``)."""


def create(keys: Keys, request: Mapping[str, Any], *, idempotency_key: str | None, tenant: str | None = None,
           quota: Quota | None = None, link: ThreadLink | None = None, tree: TreeLink | None = None) -> Op[Created]:
    """Write a queued run with its request; the same idempotency key answers the run it created.

    The request is a validated spec's (shared/spec.py): its labels, its model's name (a catalog name, or an
    inline model's provider) and the start of its input are also kept as fields of their own. A ``tenant``'s
    run also carries the label ``tenant``, and counts against the tenant's ``quota``: over one, nothing is
    written and the answer says which (``Created.quota``). A continuation (``link``) keeps its parent and its
    thread's root, and joins the thread's index, in the same script; a child run (``tree``) keeps its caller,
    its tree's first run, its depth and its ancestors (docs/usage.md, "Agent trees")."""
    run_id = keys.new_run_id(idempotency_key, tenant)
    shard = keys.shard(run_id)
    quota = quota or Quota()
    now = time.time()
    idem = keys.idempotency(idempotency_key or "-", shard)

    request_json = verbatim_json(request)
    digest = hashlib.sha256(request_json.encode()).hexdigest()

    def parse(answers: list[Any]) -> Created:
        won, value, *conflict = answers[0]
        if won:
            log.info("run_created", run_id=run_id, tenant=tenant)
        elif conflict and _text(conflict[0]) == "quota":
            name, limit, retry = _text(conflict[1]), int(conflict[2]), int(conflict[3])
            log.info("run_create_over_quota", tenant=tenant, quota=name, limit=limit)
            return Created(run_id="", created=False, over_quota=QuotaHit(name, limit, retry))
        elif conflict:
            log.info("run_create_conflict", run_id=value, idempotency_key=idempotency_key)
        else:
            log.info("run_create_deduplicated", run_id=value, idempotency_key=idempotency_key)
        return Created(run_id=str(value), created=bool(won), conflict=bool(conflict))

    labels = _labels(request)
    if tenant:
        labels[TENANT_LABEL] = tenant
    return durable(_script(
        _scripts.CREATE,
        (keys.run(run_id), idem, keys.index(shard), keys.unclaimed(shard), keys.tenants(shard),
         keys.tenant_enqueues(shard), keys.thread(link.thread if link else "-", shard), keys.outbox(shard)),
        (Ident(run_id), request_json, now, Ident("1" if idempotency_key else "0"), Verbatim(idempotency_key or ""),
         Ident(digest), labels, _model_name(request), str(request.get("input", ""))[:INPUT_PREVIEW_CHARS],
         Ident(tenant or ""), quota.max_runs_in_flight or 0, quota.max_enqueues_per_minute or 0,
         Ident(link.parent_run_id if link else ""), Ident(link.thread if link else ""),
         Ident(tree.caller_run_id if tree else ""), Ident(tree.root_run_id if tree else ""), tree.depth if tree else 0,
         Ident("/".join(tree.ancestors) if tree else ""), keys.retention_s, Ident(keys.events)),
        "create a run", parse,
    ))


TENANT_LABEL: Final = "tenant"
"""The label a tenant's runs carry, set by the store from the credential, never by a spec (shared/catalog.py)."""


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _labels(request: Mapping[str, Any]) -> dict[str, str]:
    labels = request.get("labels")
    return {str(k): str(v) for k, v in labels.items()} if isinstance(labels, Mapping) else {}


def _model_name(request: Mapping[str, Any]) -> str:
    model = request.get("model")
    if isinstance(model, str):
        return model
    return str(model.get("provider", "")) if isinstance(model, Mapping) else ""


def claim(keys: Keys, run_id: str, owner: str, *, lease_s: float, resume: bool = False,
          worker: str = "") -> Op[Claim]:
    """queued → running (or, with ``resume``, approved waiting_for_approval → running), stamping owner,
    ``worker`` (the claiming process's liveness id: docs/leases.md, "Lost workers") and lease (expiring
    ``lease_s`` after now by Redis's clock); in the same round trip, read what the segment needs (the
    request, the pending turn, the run's tenant)."""
    script = _scripts.RESUME_CLAIM if resume else _scripts.CLAIM
    name = "resume_claim" if resume else "claim"

    def parse(answers: list[Any]) -> Claim:
        transition = _read_transition(name, run_id, answers[0])
        request, pending, tenant, ancestors, root, depth = answers[1]
        return Claim(
            won=transition.won, found=transition.found, exists=transition.exists,
            owner_mismatch=transition.owner_mismatch,
            request_json=request if transition.won else None,
            pending=read_json_field(pending) if transition.won else None,
            steer=read_steer_request(answers[2]) if transition.won else None,
            tenant=_text(tenant) if transition.won and tenant else None,
            tree=read_tree(ancestors, root, depth) if transition.won else None,
        )

    return Op(f"{name} run {run_id}", (
        ScriptCall(script, (keys.run(run_id), *keys.waiting_lists(run_id), keys.outbox_of(run_id)),
                   (Ident(owner), float(lease_s), Ident(run_id), Ident(worker), keys.retention_s,
                    Ident(keys.events))),
        Command(("HMGET", keys.run(run_id), "request", "pending", "tenant", "ancestors", "root_run_id", "depth")),
        Command(("GET", keys.steer(run_id))),
    ), parse)


def suspend(keys: Keys, run_id: str, owner: str, pending: Mapping[str, Any]) -> Op[Transition]:
    """running → waiting_for_approval (owner-guarded), storing the pending turn (scrubbed, like every value
    a script writes: :func:`wire`; the resumed segment continues from what is stored)."""
    return _script(_scripts.SUSPEND, (keys.run(run_id), keys.leases(keys.shard(run_id)), keys.outbox_of(run_id)),
                   (Ident(owner), pending, Ident(run_id), keys.retention_s, Ident(keys.events)),
                   f"suspend run {run_id}", _transition("suspend", run_id))


def hand_over(keys: Keys, run_id: str, step: RunStep, *, owner: str, pending: Mapping[str, Any],
              token: str = "") -> Op[tuple[Appended, Transition]]:
    """Record the hand-over step and put the run back to ``queued`` with its conversation as the pending
    turn (owner-guarded), in one round trip. As in :func:`complete`, a cancel that won first refuses
    the transition."""
    append = append_step(keys, run_id, step, token=token, owner=owner)
    handoff = _script(_scripts.HANDOFF, (keys.run(run_id), *keys.waiting_lists(run_id), keys.outbox_of(run_id)),
                      (Ident(owner), pending, Ident(run_id), time.time(), keys.retention_s, Ident(keys.events)),
                      f"hand over run {run_id}", _transition("handoff", run_id))

    def parse(answers: list[Any]) -> tuple[Appended, Transition]:
        return append.parse(answers[:1]), handoff.parse(answers[1:])

    return Op(f"hand over run {run_id}", append.calls + handoff.calls, parse, durable=True)


def approve(keys: Keys, run_id: str) -> Op[Transition]:
    """Record an approval on a run waiting for one; the resume claim consumes it."""
    once = approve_once(keys, run_id)
    return Op(once.what, once.calls, lambda answers: once.parse(answers)[0], durable=True)


def settle(keys: Keys, run_id: str, status: RunStatus, reason: TerminationReason, *, owner: str | None = None,
           error: str = "", required_status: RunStatus | None = None, unless_steered: bool = False,
           final: RunStep | None = None) -> Op[Transition]:
    """non-terminal → completed or failed. Owner-guarded when ``owner`` is given; limited to
    ``required_status`` when given (``deny`` settles only a run that waits for approval); refused while a steer
    waits with ``unless_steered`` (the completion: docs/cancellation.md, "Steer: the final answer").
    ``final``: the model step that answered a completing run, whose answer ``run.completed`` carries
    (shared/run_end.py)."""
    if status not in (RunStatus.COMPLETED, RunStatus.FAILED):
        raise ValueError(f"settle goes to completed or failed, not {status.value} (cancel has its own fence)")
    if final is not None and status is not RunStatus.COMPLETED:
        raise ValueError("only a completed run has an answer (final)")
    return durable(_script(
        _scripts.SETTLE,
        (keys.run(run_id), *keys.waiting_lists(run_id), keys.tenants(keys.shard(run_id)), keys.steer(run_id),
         *keys.retention(run_id), keys.outbox_of(run_id)),
        # Scrubbed before it is cut, so that a cut cannot leave the start of a secret behind.
        (Ident(status.value), Ident(reason.value), Ident(owner or ""), time.time(), scrub(error)[:MAX_ERROR_CHARS],
         Ident("" if required_status is None else required_status.value), Ident(run_id),
         Ident("1" if unless_steered else ""), Verbatim(answer_members(final)), keys.retention_s, Ident(keys.events)),
        f"settle run {run_id}", _transition(f"settle_{status.value}", run_id),
    ))


CANCEL_REASONS: Final = frozenset({TerminationReason.CANCELLED, TerminationReason.BUDGET_EXCEEDED,
                                   TerminationReason.DEADLINE_EXCEEDED})
"""The termination reasons a cancel ends a run with: an operator's, or the run's own budget's."""


def cancel_all(keys: Keys, run_ids: Sequence[str], *, reason: str, requested_by: str) -> Op[list[Transition]]:
    """The cancel fence of each of ``run_ids`` in one round trip (an agent tree's runs below a cancelled one:
    docs/usage.md, "Agent trees"); each is its own script, refused where its run is terminal already."""
    fences = [cancel(keys, run_id, reason=reason, requested_by=requested_by) for run_id in run_ids]
    return durable(Op(f"cancel {len(run_ids)} runs", tuple(call for fence in fences for call in fence.calls),
                      lambda answers: [fence.parse([answer]) for fence, answer in zip(fences, answers, strict=True)]))


def cancel(keys: Keys, run_id: str, *, reason: str, requested_by: str,
           termination: TerminationReason = TerminationReason.CANCELLED) -> Op[Transition]:
    """non-terminal → cancelled, writing the cancel key in the same script (the fence). The reason and who
    asked are shown as attribution ("reason (by who)"): stored without bidi controls, which could reorder
    what follows them (shared/redaction.py :func:`strip_bidi`). ``termination``: the run's
    ``termination_reason``, ``cancelled`` but for a run its budget stops (worker/budget.py)."""
    if termination not in CANCEL_REASONS:
        raise ValueError(f"a cancel ends a run with one of {sorted(CANCEL_REASONS)}, not {termination.value!r}")
    request = CancelRequest(reason=strip_bidi(reason), requested_by=strip_bidi(requested_by),
                            requested_at=time.time())
    return durable(_script(
        _scripts.CANCEL,
        (keys.run(run_id), keys.cancel(run_id), *keys.waiting_lists(run_id), keys.tenants(keys.shard(run_id)),
         *keys.retention(run_id), keys.outbox_of(run_id)),
        (request.to_dict(), request.requested_at, Ident(run_id), Ident(termination.value), keys.retention_s,
         Ident(keys.events)),
        f"cancel run {run_id}", _transition("cancel", run_id),
    ))


def cancel_reading_children(keys: Keys, run_id: str, *, reason: str, requested_by: str) -> Op[tuple[Transition,
                                                                                                  list[str]]]:
    """:func:`cancel`, and the runs one level below ``run_id`` in its agent tree read in the same round trip: a run
    that started no agent costs its cancel one round trip, not two (docs/usage.md, "Agent trees")."""
    fence = cancel(keys, run_id, reason=reason, requested_by=requested_by)
    below = children(keys, [run_id])

    def parse(answers: list[Any]) -> tuple[Transition, list[str]]:
        return fence.parse(answers[:1]), next_level(below.parse(answers[1:]))

    return Op(fence.what, fence.calls + below.calls, parse, durable=True)


@dataclass(frozen=True, slots=True)
class Steered:
    """What a steer request came to: stored (``won``), or refused with the status found; ``pending`` when a
    steer not yet applied refused it."""

    transition: Transition
    pending: bool = False


def steer(keys: Keys, run_id: str, request: SteerRequest) -> Op[Steered]:
    """Store a steer on a running run or one waiting for approval (STEER; docs/cancellation.md, "Steer")."""
    def parse(answers: list[Any]) -> Steered:
        answer = answers[0]
        pending = len(answer) > 2 and answer[2] == "pending"
        return Steered(_read_transition("steer", run_id, answer[:2]), pending=pending)

    return durable(_script(
        _scripts.STEER, (keys.run(run_id), keys.steer(run_id), keys.unclaimed(keys.shard(run_id))),
        (request.to_dict(), time.time(), Ident(run_id)), f"steer run {run_id}", parse))


def apply_steer(keys: Keys, run_id: str, request: SteerRequest, step: RunStep, *, owner: str,
                token: str) -> Op[Appended | None]:
    """Consume the stored steer and append its ``steer`` step, in one script (STEER_APPLY): exactly once. None
    when the stored steer is not this one any more (nothing appended); ``cancelled`` when a cancel won (nothing
    appended either: the step answered is not recorded).

    Raises:
        OwnershipLost: the run is not ``owner``'s any more.
        RunNotFound: no such run.
    """
    recorded_at = time.time()
    body = {k: v for k, v in step.to_dict().items() if k not in _STEP_SYSTEM_FIELDS}

    def parse(answers: list[Any]) -> Appended | None:
        sequence, cancelled, *refused = answers[0]
        if refused and refused[0] == "owner":
            raise OwnershipLost(run_id)
        if refused:
            return None
        if cancelled:
            return Appended(step, cancelled=True)
        if not sequence:
            raise RunNotFound(run_id)
        return Appended(step.with_sequence(int(sequence), recorded_at), cancelled=False)

    return durable(_script(
        _scripts.STEER_APPLY,
        (keys.run(run_id), keys.steps(run_id), keys.cancel(run_id), keys.steer(run_id), keys.outbox_of(run_id)),
        (body, recorded_at, Ident(run_id), Ident(token), Ident(owner), Ident(request.id), keys.retention_s,
         Ident(keys.events)),
        f"apply the steer of run {run_id}", parse))


def steer_waiting(keys: Keys, run_id: str) -> Op[bool]:
    """After a suspend: when a steer is stored, put the run that now waits for approval back to work
    (STEER_WAITING); True when the caller should send its resume message."""
    return durable(_script(_scripts.STEER_WAITING, (keys.run(run_id), keys.steer(run_id),
                                                    keys.unclaimed(keys.shard(run_id))),
                           (time.time(), Ident(run_id)), f"resume the steered run {run_id}",
                           lambda answers: bool(answers[0])))


def pending_steer(keys: Keys, run_id: str) -> Op[SteerRequest | None]:
    """The steer waiting to be applied (one GET), or None. Fail-soft like the probe."""
    return Op(f"read the steer of run {run_id}", (Command(("GET", keys.steer(run_id))),),
              lambda a: read_steer_request(a[0]),
              fallback=None, fallback_event="steer_read_failed", context={"run_id": run_id})


def wakeups_among(keys: Keys, run_ids: Sequence[str]) -> Op[tuple[set[str], dict[str, SteerRequest]]]:
    """Which of these runs have a cancel key, and which a steer waiting, in one MGET (one per shard in a
    cluster) over both keys of each run: the backstop's poll. Fail-soft: none."""
    groups = list(keys.by_shard(run_ids).values())

    def parse(answers: list[Any]) -> tuple[set[str], dict[str, SteerRequest]]:
        cancelled: set[str] = set()
        steers: dict[str, SteerRequest] = {}
        for ids, answer in zip(groups, answers, strict=True):
            for run_id, fence, raw in zip(ids, answer[0::2], answer[1::2], strict=True):
                if fence is not None:
                    cancelled.add(run_id)
                pending = read_steer_request(raw)
                if pending is not None:
                    steers[run_id] = pending
        return cancelled, steers

    return Op("poll cancel and steer keys", tuple(
        Command(("MGET", *(key for i in ids for key in (keys.cancel(i), keys.steer(i))))) for ids in groups),
        parse, fallback=(set(), {}), fallback_event="cancel_poll_failed", context={"runs": sum(map(len, groups))})


def step_body(step: RunStep) -> dict[str, Any]:
    """A step as a script appends it: without the fields the store assigns (sequence, recorded_at)."""
    return {k: v for k, v in step.to_dict().items() if k not in _STEP_SYSTEM_FIELDS}


def server_counter(step: RunStep) -> str:
    """The per-server outcome field a tool step counts in (``runbrake servers``), "" for a step that counts
    in none."""
    if not step.tool_server or step.tool_outcome is None:
        # A call to no server of the run (a name a model made up: server "") is counted nowhere.
        return ""
    # Argument errors are the caller's mistake: counted apart, so they do not make a server look flaky.
    outcome = ARGUMENT_ERROR if step.detail.get("failure") == "arguments" else step.tool_outcome.value
    unknown = step.detail.get("side_effects") == SideEffects.UNKNOWN.value
    if step.detail.get("reason") == StepReason.WORKER_LOST.value:  # cut off by a lost worker: counted apart
        outcome = WORKER_LOST_UNKNOWN if unknown else WORKER_LOST_NONE
    elif unknown:
        outcome = CANCELLED_SIDE_EFFECTS_UNKNOWN  # cut off after its request was sent: counted apart
    return f"{step.tool_server}|{outcome}"


def append_step(keys: Keys, run_id: str, step: RunStep, *, token: str = "", owner: str = "",
                sent: Sent | None = None, above: Sequence[str] = ()) -> Op[Appended]:
    """Record a step (the store assigns its sequence) and probe the cancel key, in one script; with ``sent``,
    the marks of the calls that go out right after it, written with it while the run runs (no round trip of
    their own: docs/leases.md, "Lost workers"); with ``above`` (the runs above it in its agent tree), a model
    step's use counted against each of them (:func:`add_below`), in the same round trip.

    The answer raises :class:`RunNotFound` when the run does not exist. ``token`` names this append: sent
    again (a retry after a lost answer), it is recorded once, and counted above once.
    """
    recorded_at = time.time()
    body = step_body(step)
    counter = server_counter(step)

    answered = step.kind is StepKind.MODEL and not step.error and not step.interrupted
    usage = step.detail.get("usage") if answered else None
    tokens = [_tokens(usage, "input_tokens"), _tokens(usage, "output_tokens")]

    def parse(answers: list[Any]) -> Appended:
        sequence, cancelled, *refused = answers[0]
        if refused:
            raise OwnershipLost(run_id)
        if not sequence:
            raise RunNotFound(run_id)
        return Appended(step.with_sequence(int(sequence), recorded_at), cancelled=bool(cancelled))

    token = token or uuid.uuid4().hex
    append = _script(
        _scripts.APPEND_STEP,
        (keys.run(run_id), keys.steps(run_id), keys.servers(keys.shard(run_id)), keys.cancel(run_id),
         keys.servers_hour(recorded_at, keys.shard(run_id)), keys.outbox_of(run_id)),
        (body, recorded_at, counter, Ident(run_id), Ident(token), Ident(owner),
         1 if answered else 0, *tokens, _cost(usage), step.tool_call_id or "",
         *(sent.arguments() if sent else ()), keys.retention_s,
         Ident(keys.events)),
        f"append a step to run {run_id}", parse,
    )
    cost = _cost(usage)
    if not above or not (sum(tokens) or cost):
        return append
    # Each ancestor's run is a key of its own slot: its own script, pipelined with the append.
    counted = add_below(keys, above, sum(tokens), float(cost) if cost else 0.0, once=(run_id, token))
    return dataclasses.replace(append, calls=(*append.calls, *counted.calls))


def _tokens(usage: object, kind: str) -> int:
    """A count of a model step's ``detail.usage`` (0 when absent or not a count: the provider said nothing).

    Raises:
        StepError: a count above :data:`MAX_CALL_TOKENS`: summed, it would not be exact (nothing is appended).
    """
    value = usage.get(kind) if isinstance(usage, Mapping) else None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        return 0
    if value > MAX_CALL_TOKENS:
        raise StepError(f"detail.usage.{kind} is {value}; the most one model call counts is {MAX_CALL_TOKENS} "
                        "(docs/security.md, \"Bounds\")")
    return value


def _cost(usage: object) -> Ident:
    """A model step's ``detail.usage.cost_usd`` as the script adds it ("" when the model has no prices)."""
    value = usage.get("cost_usd") if isinstance(usage, Mapping) else None
    # 1e13: above what a call within MAX_CALL_TOKENS can cost at the highest price a catalog takes (10**6 USD per
    # million tokens, each way).
    if isinstance(value, int | float) and not isinstance(value, bool) and 0 <= value < 1e13:
        return Ident(repr(float(value)))
    return Ident("")


def budget_use(keys: Keys, run_id: str) -> Op[BudgetUse | None]:
    """What a run used so far, for its budget, and what the runs below it in an agent tree used (``below_tokens``,
    ``below_cost_usd``: :func:`add_below`); None when there is no such run."""
    def parse(answers: list[Any]) -> BudgetUse | None:
        created, tokens_in, tokens_out, cost, below_tokens, below_cost = answers[0]
        if created is None:
            return None
        return BudgetUse(float(created), _tokens_of(tokens_in) + _tokens_of(tokens_out),
                         None if cost is None else float(cost), _tokens_of(below_tokens),
                         float(below_cost) if below_cost else 0.0)

    return Op(f"read the budget use of run {run_id}",
              (Command(("HMGET", keys.run(run_id), "created_at", "input_tokens", "output_tokens", "cost_usd",
                        "below_tokens", "below_cost_usd")),),
              parse)


@dataclass(frozen=True, slots=True)
class BudgetUse:
    """What a run used of its budget (:func:`budget_use`)."""

    created_at: float
    tokens: int
    cost_usd: float | None
    below_tokens: int = 0
    """Tokens the runs below it in its agent tree used."""
    below_cost_usd: float = 0.0


def below_use(keys: Keys, run_id: str) -> Op[tuple[int, float]]:
    """What the runs below ``run_id`` in its agent tree used: (tokens, cost in USD)."""
    def parse(answers: list[Any]) -> tuple[int, float]:
        tokens, cost = answers[0]
        return _tokens_of(tokens), float(cost) if cost else 0.0

    return Op(f"read the use below run {run_id}",
              (Command(("HMGET", keys.run(run_id), "below_tokens", "below_cost_usd")),), parse)


def add_below(keys: Keys, ancestors: Sequence[str], tokens: int, cost_usd: float, *,
              once: tuple[str, str] | None = None) -> Op[None]:
    """Count a child run's model step against every run above it (docs/usage.md, "Agent trees"): each
    ancestor's ``below_tokens`` and ``below_cost_usd``, which its budget reads (:func:`budget_use`). Each is a
    key of its own slot, so no script spans them; an ancestor that no longer exists is left alone. ``once``: the
    run below and its append's token, counted once however often they are sent (:func:`append_step`)."""
    cost = Ident(repr(float(cost_usd))) if cost_usd else Ident("")
    marks = () if once is None else (Ident(once[0]), Ident(once[1]))
    return Op("count a child's use above it", tuple(
        ScriptCall(_scripts.ADD_BELOW, (keys.run(run_id),),
                   (tokens, cost, Ident(keys.tree_wakes), Ident(run_id), *marks))
        for run_id in ancestors),
        lambda _answers: None)


def add_child(keys: Keys, caller_run_id: str, call_id: str, child_run_id: str) -> Op[None]:
    """Record the child run a call of the caller started (call id → child run id), before the caller waits for
    it: whoever takes the caller up next re-attaches to it, and a cancel of the caller reaches it."""
    return durable(_script(_scripts.ADD_CHILD, (keys.children(caller_run_id), keys.run(caller_run_id)),
                           (call_id, Ident(child_run_id)), f"record the child of run {caller_run_id}",
                           lambda _answers: None))


def children(keys: Keys, run_ids: Sequence[str]) -> Op[list[dict[str, str]]]:
    """The child runs of each of ``run_ids``, by the id of the call that started each."""
    def parse(answers: list[Any]) -> list[dict[str, str]]:
        return [{_text(call): _text(child) for call, child in (found or {}).items()} for found in answers]

    return Op("read children", tuple(Command(("HGETALL", keys.children(i))) for i in run_ids), parse)


def _tokens_of(value: str | bytes | None) -> int:
    try:
        return max(0, int(value)) if value else 0
    except ValueError:
        return 0


def complete(keys: Keys, run_id: str, step: RunStep, *, owner: str,
             token: str = "") -> Op[tuple[Appended, Transition, SteerRequest | None]]:
    """Record the final step and settle the run completed (owner-guarded), in one round trip; and the steer
    that refused the settle, when one waits (``Transition.steered``).

    Redis runs the two scripts in order: when the append's probe finds the run cancelled, the settle's
    guard finds it cancelled too and refuses.
    """
    append = append_step(keys, run_id, step, token=token, owner=owner)
    settle_op = settle(keys, run_id, RunStatus.COMPLETED, TerminationReason.COMPLETED, owner=owner, unless_steered=True,
                       final=step)

    def parse(answers: list[Any]) -> tuple[Appended, Transition, SteerRequest | None]:
        transition = settle_op.parse(answers[1:2])
        return append.parse(answers[:1]), transition, read_steer_request(answers[2]) if transition.steered else None

    return Op(f"complete run {run_id}", (*append.calls, *settle_op.calls, Command(("GET", keys.steer(run_id)))),
              parse, durable=True)


# -- leases --------------------------------------------------------------------------------------


def renew_leases(keys: Keys, owners: Mapping[str, str], *, lease_s: float) -> Op[set[str]]:
    """Extend the leases of these running runs (run id → owner) in one round trip; answers the runs
    whose lease was not renewed (no longer running, or owned by another). Each new expiry is
    ``lease_s`` after now by Redis's clock."""
    ids = list(owners)

    def parse(answers: list[Any]) -> set[str]:
        return {run_id for run_id, ok in zip(ids, answers, strict=True) if not ok}

    return Op("renew leases", tuple(
        ScriptCall(_scripts.RENEW_LEASE, (keys.run(run_id), keys.leases(keys.shard(run_id))),
                   (Ident(owners[run_id]), float(lease_s), Ident(run_id)))
        for run_id in ids
    ), parse)


def expired_leases(keys: Keys, *, limit: int) -> Op[list[str]]:
    """The running runs whose lease expired by now (Redis's clock), oldest first within each shard, at most
    ``limit`` per shard."""
    return Op("read expired leases", tuple(
        ScriptCall(_scripts.EXPIRED_LEASES, (keys.leases(shard),), (limit,)) for shard in keys.shards
    ), _concatenated)


def reap(keys: Keys, run_id: str) -> Op[Transition]:
    """running with an expired lease → failed (``lease_lost``); decided by one guarded script, on Redis's
    clock."""
    def parse(answers: list[Any]) -> Transition:
        transition = _read_transition("reap", run_id, answers[0])
        if transition.won:
            log.warning("run_lease_lost", run_id=run_id)
        return transition

    return _script(_scripts.REAP, (keys.run(run_id), keys.leases(keys.shard(run_id)),
                                   keys.tenants(keys.shard(run_id)), *keys.retention(run_id),
                                   keys.outbox_of(run_id)),
                   (Ident(run_id), keys.retention_s, Ident(keys.events)),
                   f"reap run {run_id}", parse)


# -- lost workers (docs/leases.md, "Lost workers") ---------------------------------------------


LOST_WORKERS_KEPT_S: Final = 86_400
"""How long a lost worker's id stays in the lost set (its beats refused): a day."""


def beat(keys: Keys, worker: str, *, lost_s: float) -> Op[bool]:
    """A worker process says it is alive for ``lost_s`` more seconds (Redis's clock); False when it was taken
    as lost already (it must stop what it runs and take a new id)."""
    return _script(_scripts.BEAT, (keys.workers, keys.lost_workers), (Ident(worker), float(lost_s)),
                   f"beat of worker {worker}", lambda answers: bool(answers[0]))


def leave(keys: Keys, worker: str) -> Op[None]:
    """A worker process that stops cleanly leaves the workers set: nobody takes it as lost."""
    return Op(f"worker {worker} leaves", (Command(("ZREM", keys.workers, worker)),), lambda _answers: None)


def lapse(keys: Keys, *, limit: int = 100) -> Op[list[str]]:
    """Take the workers whose liveness expired (each taken by one caller only)."""
    return _script(_scripts.LAPSE, (keys.workers, keys.lost_workers), (limit, LOST_WORKERS_KEPT_S),
                   "take lost workers", lambda answers: [_text(w) for w in answers[0]])


def field_of(keys: Keys, run_ids: Sequence[str], field: str) -> Op[dict[str, str]]:
    """These runs → one field of each ("" for none): ``worker``, ``owner``."""
    def parse(answers: list[Any]) -> dict[str, str]:
        return {run_id: _text(value or "") for run_id, value in zip(run_ids, answers, strict=True)}

    return Op(f"read the {field} of runs", tuple(Command(("HGET", keys.run(run_id), field)) for run_id in run_ids),
              parse)


def restamp(keys: Keys, owners: Mapping[str, str], worker: str) -> Op[set[str]]:
    """Stamp these runs (run id → the owner this process holds it under) with the process's new id, in one round
    trip; answers the runs taken from it (refused)."""
    ids = list(owners)

    def parse(answers: list[Any]) -> set[str]:
        return {run_id for run_id, ok in zip(ids, answers, strict=True) if not ok}

    return Op("restamp runs", tuple(ScriptCall(_scripts.RESTAMP, (keys.run(run_id),),
                                               (Ident(owners[run_id]), Ident(worker))) for run_id in ids), parse)


def leased_runs(keys: Keys) -> Op[list[str]]:
    """Every run with a lease (running), in every shard."""
    return Op("read the running runs", tuple(Command(("ZRANGE", keys.leases(shard), 0, -1)) for shard in keys.shards),
              _concatenated)


def mark_sent(keys: Keys, run_id: str, *, owner: str, call_id: str | None, round_number: int) -> Op[None]:
    """Write a call's mark before its request goes out (owner-guarded), and probe the cancel key:
    ``sent:<call id>`` for a tool call, ``sent:model`` (with the round) for a model call. Only for a call no
    append just before marked (:class:`Sent`).

    Raises:
        OwnershipLost: the run is not this owner's any more (nothing written: the call must not go out).
        CancelRequested: the run is this owner's but no longer runs, or its cancel key is set.
    """
    field = f"{SENT_PREFIX}{call_id}" if call_id is not None else SENT_MODEL
    args: tuple[Arg, ...] = (Ident(owner), field) if call_id is not None else (Ident(owner), field, round_number)

    def parse(answers: list[Any]) -> None:
        if answers[0] == 0:
            raise OwnershipLost(run_id)
        if answers[0] == 2:  # the script's answer for "yours, but ended"
            raise CancelRequested(run_id)

    return _script(_scripts.MARK_SENT, (keys.run(run_id), keys.cancel(run_id)), args,
                   f"mark a call of run {run_id} sent", parse)


def keep_task(keys: Keys, run_id: str, *, owner: str, call_id: str, task: str | None) -> Op[None]:
    """Write (or, with ``task`` None, delete) the run's ``task:<call id>`` field, owner-guarded.

    Raises:
        OwnershipLost: the run is not this owner's any more (nothing written).
    """
    args: tuple[Arg, ...] = (Ident(owner), f"{TASK_PREFIX}{call_id}", *(() if task is None else (task,)))

    def parse(answers: list[Any]) -> None:
        if answers[0] == 0:
            raise OwnershipLost(run_id)

    return _script(_scripts.KEEP_TASK, (keys.run(run_id),), args, f"keep a task of run {run_id}", parse)


def tasks_left(keys: Keys, run_id: str) -> Op[dict[str, str]]:
    """The run's recorded ``task:<call id>`` fields by call id: the MCP tasks a hand-over or a lost worker left
    running (one HSCAN page: a run records a task per call in flight, far fewer than its ``COUNT``)."""
    def parse(answers: list[Any]) -> dict[str, str]:
        found = answers[0][1]  # redis-py answers HSCAN with (cursor, {field: value}); a pipeline may give the list
        pairs = found.items() if isinstance(found, dict) else zip(found[::2], found[1::2], strict=True)
        return {_text(name).removeprefix(TASK_PREFIX): _text(value) for name, value in pairs}

    return Op(f"read the tasks of run {run_id}",
              (Command(("HSCAN", keys.run(run_id), "0", "MATCH", f"{TASK_PREFIX}*", "COUNT", "1000")),), parse)


def task_of(keys: Keys, run_id: str, call_id: str) -> Op[str | None]:
    """The run's ``task:<call id>`` field, None when there is none."""
    def parse(answers: list[Any]) -> str | None:
        value = answers[0]
        return None if value is None else value.decode() if isinstance(value, bytes) else str(value)

    return Op(f"read a task of run {run_id}", (Command(("HGET", keys.run(run_id), f"{TASK_PREFIX}{call_id}")),),
              parse)


def lost_view(keys: Keys, run_id: str) -> Op[tuple[dict[str, str], tuple[RunStep, ...]]]:
    """A run's fields and steps, read together (a transaction), for rebuilding it after its worker was lost."""
    def parse(answers: list[Any]) -> tuple[dict[str, str], tuple[RunStep, ...]]:
        fields, raw_steps = answers
        return _fields(fields), tuple(read_step(run_id, raw) for raw in raw_steps)

    return Op(f"read run {run_id} of a lost worker", (
        Command(("HGETALL", keys.run(run_id))),
        Command(("LRANGE", keys.steps(run_id), 0, -1)),
    ), parse, transaction=True)


@dataclass(frozen=True, slots=True)
class Reclaimed:
    """What the reclaim of a lost worker's run came to (``outcome``: requeued, ended, failed, refused)."""

    outcome: str
    found: str
    losses: int = 0
    why: str = ""


_RECLAIMED: Final = {1: "requeued", 2: "ended", 3: "failed"}


def reclaim(keys: Keys, run_id: str, *, worker: str, seq: int, steps: Sequence[RunStep], running: bool, fail: bool,
            pending: Mapping[str, Any], error: str) -> Op[Reclaimed]:
    """The run of a lost worker, in one guarded script: ``steps`` appended, then a ``running`` run back to
    ``queued`` with ``pending`` (or ``failed``/``lease_lost`` with ``error`` when ``fail``); a run that ended
    only gets the steps. Refused unless the run is still ``worker``'s, still running (or ended) as read, and its
    last sequence still ``seq``."""
    now = time.time()
    pairs: list[Arg] = []
    for step in steps:
        pairs += [step_body(step), server_counter(step)]

    def parse(answers: list[Any]) -> Reclaimed:
        code, found, *rest = answers[0]
        found_text = _text(found or "")
        if not code:
            return Reclaimed("refused", found_text, why=_text(rest[0]) if rest else "")
        return Reclaimed(_RECLAIMED[int(code)], found_text, int(rest[0]) if rest else 0)

    shard = keys.shard(run_id)
    return durable(_script(
        _scripts.RECLAIM,
        (keys.run(run_id), keys.steps(run_id), *keys.waiting_lists(run_id), keys.servers(shard),
         keys.servers_hour(now, shard), keys.tenants(shard), *keys.retention(run_id), keys.outbox_of(run_id)),
        (Ident(run_id), Ident(worker), seq, Ident(("fail" if fail else "requeue") if running else "ended"), pending,
         error, now, len(steps),
         *pairs, keys.retention_s, Ident(keys.events)),
        f"reclaim run {run_id} of lost worker {worker}", parse))


# -- reads ---------------------------------------------------------------------------------------


def get(keys: Keys, run_id: str) -> Op[RunRecord]:
    """The run with its steps and cancel request, read in one transaction; :class:`RunNotFound` when absent."""
    def parse(answers: list[Any]) -> RunRecord:
        fields, raw_steps, raw_cancel, children = answers
        if not fields:
            raise RunNotFound(run_id)
        steps = tuple(read_step(run_id, raw) for raw in raw_steps)
        return read_record(run_id, fields, steps, read_cancel_request(raw_cancel), children=children)

    return Op(f"read run {run_id}", (
        Command(("HGETALL", keys.run(run_id))),
        Command(("LRANGE", keys.steps(run_id), 0, -1)),
        Command(("GET", keys.cancel(run_id))),
        Command(("HGETALL", keys.children(run_id))),
    ), parse, transaction=True)


def tenant_of(keys: Keys, run_id: str) -> Op[str | None]:
    """The tenant of a run ("" for none); None when no run has that id."""
    def parse(answers: list[Any]) -> str | None:
        status_value, tenant = answers[0]
        return None if status_value is None else _text(tenant or "")

    return Op(f"read the tenant of run {run_id}", (Command(("HMGET", keys.run(run_id), "status", "tenant")),), parse)


def in_flight(keys: Keys, tenant: str) -> Op[int]:
    """How many of a tenant's runs are queued, running or waiting for approval."""
    return Op(f"read the runs in flight of tenant {tenant}",
              (Command(("HGET", keys.tenants(keys.tenant_shard(tenant)), tenant)),),
              lambda answers: int(answers[0] or 0))


def status(keys: Keys, run_id: str) -> Op[RunStatus]:
    """The run's status alone; :class:`RunNotFound` when absent."""
    def parse(answers: list[Any]) -> RunStatus:
        if answers[0] is None:
            raise RunNotFound(run_id)
        return RunStatus.parse(answers[0], run_id=run_id)

    return Op(f"read run {run_id}", (Command(("HGET", keys.run(run_id), "status")),), parse)


def child_status(keys: Keys, child_run_id: str, caller_run_id: str) -> Op[tuple[RunStatus, bool]]:
    """A child run's status and whether its caller's cancel key is set, in one round trip: what a waiting agent
    call reads when woken (worker/agents.py); :class:`RunNotFound` when the child is absent."""
    def parse(answers: list[Any]) -> tuple[RunStatus, bool]:
        if answers[0] is None:
            raise RunNotFound(child_run_id)
        return RunStatus.parse(answers[0], run_id=child_run_id), bool(answers[1])

    return Op(f"read run {child_run_id} and probe run {caller_run_id}", (
        Command(("HGET", keys.run(child_run_id), "status")), Command(("EXISTS", keys.cancel(caller_run_id)))), parse)


def recent_ids(keys: Keys, *, count: int) -> Op[list[str]]:
    """The ids of the ``count`` most recently created runs, newest first."""
    if not keys.cluster:
        return Op("list runs", (Command(("ZREVRANGE", keys.index(0), 0, count - 1)),),
                  lambda answers: list(answers[0]))

    def parse(answers: list[Any]) -> list[str]:
        return [run_id for run_id, _ in merge_newest([_pairs(a) for a in answers], count)[0]]

    return Op("list runs", tuple(Command(("ZREVRANGE", keys.index(shard), 0, count - 1, "WITHSCORES"))
                                 for shard in keys.shards), parse)


def matches(record: RunRecord, status: RunStatus | None, labels: Mapping[str, str] | None) -> bool:
    """Whether a run is in ``status`` (any, when None) and carries every one of ``labels``."""
    if status is not None and record.status is not status:
        return False
    return not labels or all(record.labels.get(key) == value for key, value in labels.items())


def records(keys: Keys, run_ids: Sequence[str], *, limit: int, status: RunStatus | None,
            labels: Mapping[str, str] | None = None) -> Op[list[RunRecord]]:
    """These runs without their steps, in the given order, filtered by ``status`` and ``labels`` (all must
    match), at most ``limit``."""
    def parse(answers: list[Any]) -> list[RunRecord]:
        found = []
        for run_id, fields, raw_cancel in zip(run_ids, answers[::2], answers[1::2], strict=True):
            if not fields:
                continue
            record = read_record(run_id, fields, (), read_cancel_request(raw_cancel))
            if matches(record, status, labels):
                found.append(record)
            if len(found) >= limit:
                break
        return found

    calls: list[Call] = []
    for run_id in run_ids:
        calls += [Command(("HGETALL", keys.run(run_id))), Command(("GET", keys.cancel(run_id)))]
    return Op("list runs", tuple(calls), parse)


def cancel_requested(keys: Keys, run_id: str) -> Op[bool]:
    """The probe: one read of the cancel key (EXISTS), never consuming it. Fail-soft: False."""
    return Op(f"probe run {run_id}", (Command(("EXISTS", keys.cancel(run_id))),), lambda a: bool(a[0]),
              fallback=False, fallback_event="cancel_probe_failed", context={"run_id": run_id})


def cancel_request(keys: Keys, run_id: str) -> Op[CancelRequest | None]:
    """The run's cancel request (one GET), or None. Fail-soft like the probe."""
    return Op(f"read the cancel of run {run_id}", (Command(("GET", keys.cancel(run_id))),),
              lambda a: read_cancel_request(a[0]),
              fallback=None, fallback_event="cancel_read_failed", context={"run_id": run_id})


def cancelled_among(keys: Keys, run_ids: Sequence[str]) -> Op[set[str]]:
    """Which of these runs have a cancel key, in one MGET (in a cluster, one per shard: an MGET spans one
    slot). Fail-soft: none."""
    groups = list(keys.by_shard(run_ids).values())

    def parse(answers: list[Any]) -> set[str]:
        return {run_id for ids, answer in zip(groups, answers, strict=True)
                for run_id, raw in zip(ids, answer, strict=True) if raw is not None}

    return Op("poll cancel keys", tuple(Command(("MGET", *(keys.cancel(i) for i in ids))) for ids in groups), parse,
              fallback=set(), fallback_event="cancel_poll_failed", context={"runs": sum(map(len, groups))})


def server_outcomes(keys: Keys, *, since: float | None = None) -> Op[dict[str, dict[str, int]]]:
    """Tool calls per MCP server and outcome, counted as steps were recorded: all of them, or those of the
    hours since ``since`` (epoch seconds; whole hours, the one ``since`` falls in included)."""
    if since is None:
        sources: tuple[str, ...] = tuple(keys.servers(shard) for shard in keys.shards)
    else:
        first, last = int(since // 3600), int(time.time() // 3600)
        sources = tuple(keys.servers_hour(hour * 3600, shard) for hour in range(first, last + 1)
                        for shard in keys.shards)

    def parse(answers: list[Any]) -> dict[str, dict[str, int]]:
        counts: dict[str, dict[str, int]] = {}
        for answer in answers:
            for field_name, value in answer.items():
                server, _, outcome = field_name.rpartition("|")
                by_outcome = counts.setdefault(server, {})
                by_outcome[outcome] = by_outcome.get(outcome, 0) + int(value)
        return counts

    return Op("read server counts", tuple(Command(("HGETALL", key)) for key in sources), parse)


def expired_runs(keys: Keys, *, limit: int) -> Op[list[str]]:
    """Finished runs whose retention ended by now, at most ``limit`` per shard."""
    now = repr(time.time())
    return Op("read expired runs", tuple(
        Command(("ZRANGEBYSCORE", keys.finished(shard), "-inf", now, "LIMIT", 0, limit)) for shard in keys.shards
    ), _concatenated)


def idempotency_keys(keys: Keys, run_ids: Sequence[str]) -> Op[list[str]]:
    """The idempotency keys these runs were created with ("" where none)."""
    return Op("read idempotency keys", tuple(Command(("HGET", keys.run(i), "idempotency_key")) for i in run_ids),
              lambda answers: [a or "" for a in answers])


def threads_of(keys: Keys, run_ids: Sequence[str]) -> Op[list[str]]:
    """The thread roots these continuations were created in ("" for a thread's first run)."""
    return Op("read threads", tuple(Command(("HGET", keys.run(i), "thread")) for i in run_ids),
              lambda answers: [a or "" for a in answers])


def forget(keys: Keys, runs: Mapping[str, str], threads: Mapping[str, str] | None = None) -> Op[int]:
    """Delete these runs (run id → idempotency key): their keys, idempotency keys and index entries (a
    continuation's in its thread's index: run id → root, in ``threads``) together."""
    calls: list[Call] = [Command(("ZREM", keys.thread(root, keys.shard(run_id)), run_id))
                         for run_id, root in (threads or {}).items() if root]
    for run_id, idempotency_key in runs.items():
        doomed = [keys.run(run_id), keys.steps(run_id), keys.cancel(run_id), keys.steer(run_id),
                  keys.children(run_id)]
        if idempotency_key:
            doomed.append(keys.idempotency(idempotency_key, keys.shard(run_id)))
        calls += [Command(("DEL", *doomed))]
    for shard, ids in keys.by_shard(runs).items():
        calls += [Command(("ZREM", keys.index(shard), *ids)), Command(("ZREM", keys.finished(shard), *ids)),
                  Command(("ZREM", keys.unclaimed(shard), *ids))]
    return Op("forget expired runs", tuple(calls), lambda answers: len(runs))


def unclaimed_since(keys: Keys, *, cutoff: float, limit: int) -> Op[list[str]]:
    """Runs whose message was sent before ``cutoff`` (epoch seconds) and that nobody claimed since (at most
    ``limit`` per shard)."""
    return Op("read unclaimed runs", tuple(
        Command(("ZRANGEBYSCORE", keys.unclaimed(shard), "-inf", repr(cutoff), "LIMIT", 0, limit))
        for shard in keys.shards), _concatenated)


def take_redrive(keys: Keys, run_id: str, *, cutoff: float) -> Op[str]:
    """Take the re-drive of one unclaimed run: ``start``, ``resume``, or ``""`` when it is not due or moved on."""
    return _script(_scripts.REDRIVE, (keys.unclaimed(keys.shard(run_id)), keys.run(run_id)),
                   (Ident(run_id), float(cutoff), time.time()),
                   f"re-drive run {run_id}", lambda answers: str(answers[0] or ""))


def ping() -> Op[None]:
    """Does Redis answer?"""
    return Op("ping", (Command(("PING",)),), lambda _answers: None)



# -- the HTTP API and progress reports (docs/http-api.md) ----------------------------------------

SUMMARY_FIELDS: Final = ("status", "termination_reason", "created_at", "started_at", "finished_at", "owner",
                         "lease_expires_at", "error", "segments", "labels", "model", "input_preview", "model_calls",
                         "input_tokens", "output_tokens", "cost_usd", "parent_run_id", "thread",
                         "worker_losses", "lost_worker", "caller_run_id", "root_run_id", "depth")
"""The hash fields a run listing reads: not the request or the pending turn, which can be large."""


def approve_once(keys: Keys, run_id: str) -> Op[tuple[Transition, bool]]:
    """Record an approval on a run waiting for one; answers the transition and whether this call made
    the decision (False when the run was approved already)."""
    def parse(answers: list[Any]) -> tuple[Transition, bool]:
        answer = answers[0]
        transition = _read_transition("approve", run_id, answer[:2])
        return transition, transition.won and len(answer) > 2 and bool(answer[2])

    return durable(_script(_scripts.APPROVE, (keys.run(run_id), keys.unclaimed(keys.shard(run_id))),
                           (time.time(), Ident(run_id)), f"approve run {run_id}", parse))


def set_progress(keys: Keys, reports: Mapping[str, Mapping[str, Any]]) -> Op[int]:
    """Keep the latest progress of each run's call in flight (run id → report) in the run's ``progress`` field
    and announce it, in one round trip; answers how many were kept. A run no longer running, or whose call's
    step was recorded meanwhile, refuses its report. Fail-soft: progress is a courtesy, never a reason to fail
    a call. A report (an MCP server's words) is scrubbed like every value a script writes (:func:`wire`), and
    spliced into the announcement as the JSON it is stored as."""
    calls = tuple(ScriptCall(_api_scripts.SET_PROGRESS, (keys.run(run_id),),
                             (report, Ident(run_id), str(report.get("tool_call_id") or ""), Ident(keys.events)))
                  for run_id, report in reports.items())
    return Op(f"record progress of {len(calls)} runs", calls, lambda answers: sum(bool(a) for a in answers),
              fallback=0, fallback_event="progress_write_failed")


def publish_delta(keys: Keys, run_id: str, delta: Mapping[str, Any]) -> Op[bool]:
    """Announce the text a model call streamed since the last delta (``{"round", "text"}``), unless the run
    is no longer running (False); nothing is kept. Fail-soft like progress: a delta is a preview, the
    model step that follows is the record (docs/cancellation.md, "Streaming")."""
    return Op(f"publish a delta of run {run_id}", (ScriptCall(
        _api_scripts.PUBLISH_DELTA, (keys.run(run_id),), (delta, Ident(run_id), Ident(keys.events))),),
        lambda answers: bool(answers[0]), fallback=False, fallback_event="delta_publish_failed",
        context={"run_id": run_id})


def index_after(keys: Keys, cursor: tuple[float, str] | None, *, count: int, since: float | None = None,
                until: float | None = None) -> Op[tuple[list[tuple[str, float]], bool]]:
    """Run ids with their creation times, newest first, after ``cursor`` (score, id): the next ``count``
    entries from the cursor's score down, less those at or before the cursor (ties on the score come
    in reverse id order), and whether the index ends there. In a cluster, the shards' indexes merged.
    ``since`` and ``until`` (creation times, both included) bound the range read, so a time window costs
    the runs in it, not the runs around it."""
    tops = [score for score in (None if cursor is None else cursor[0], until) if score is not None]
    top = repr(min(tops)) if tops else "+inf"
    bottom = "-inf" if since is None else repr(since)

    def parse(answers: list[Any]) -> tuple[list[tuple[str, float]], bool]:
        pairs, exhausted = merge_newest([_pairs(answer) for answer in answers], count)
        if cursor is None:
            return pairs, exhausted
        return [(m, s) for m, s in pairs if s < cursor[0] or m < cursor[1]], exhausted

    return Op("list runs", tuple(Command(("ZREVRANGEBYSCORE", keys.index(shard), top, bottom, "WITHSCORES",
                                          "LIMIT", 0, count)) for shard in keys.shards), parse)


def _pairs(flat: Any) -> list[tuple[str, float]]:
    """A WITHSCORES answer as (member, score) pairs."""
    if flat and isinstance(flat[0], (list, tuple)):  # a client that pairs WITHSCORES answers itself
        flat = [item for pair in flat for item in pair]
    return [(str(flat[i]), float(flat[i + 1])) for i in range(0, len(flat), 2)]


def merge_newest(batches: Sequence[list[tuple[str, float]]], count: int) -> tuple[list[tuple[str, float]], bool]:
    """Merge newest-first batches of (id, score), each at most ``count`` long, into the ``count`` newest,
    and say whether nothing is left after them.

    A full batch may have more entries past its last one, so the merge stops at the highest last entry
    among full batches: past it, that shard's entries were not read (one batch: as before the merge).
    """
    full = [batch for batch in batches if len(batch) >= count]
    merged = sorted((pair for batch in batches for pair in batch), key=lambda p: (p[1], p[0]), reverse=True)
    if full:
        edge = max((batch[-1][1], batch[-1][0]) for batch in full)
        merged = [pair for pair in merged if (pair[1], pair[0]) >= edge]
    return merged[:count], not full and len(merged) <= count


def _concatenated(answers: list[Any]) -> list[str]:
    """One list of the ids that the shards answered, in shard order."""
    return [str(item) for answer in answers for item in answer]


def thread_ids(keys: Keys, root: str, *, count: int) -> Op[Sequence[str]]:
    """The first run of the thread ``root`` and up to ``count`` of its continuations, oldest first (every
    shard's index merged by creation time)."""
    def parse(answers: list[Any]) -> list[str]:
        pairs = sorted((pair for answer in answers for pair in _pairs(answer)), key=lambda p: (p[1], p[0]))
        return [root] + [run_id for run_id, _ in pairs[:count]]

    return Op("list a thread", tuple(Command(("ZRANGE", keys.thread(root, shard), 0, count - 1, "WITHSCORES"))
                                     for shard in keys.shards), parse)


def thread_root(record: RunRecord | None, run_id: str) -> str:
    """The first run of the thread ``run_id`` is in (its own id when it is a first run, or gone)."""
    return run_id if record is None else record.thread


def next_level(level: list[dict[str, str]]) -> list[str]:
    """The runs one level below, from the ``children`` of the level above (call id order)."""
    return [children[call] for children in level for call in sorted(children)]


def waiting_in(record: RunRecord, tree: Sequence[RunRecord]) -> RunRecord:
    """``record`` with the runs of its ``tree`` (below it) that wait for approval (``waiting_below``)."""
    waiting = tuple(r.run_id for r in tree if r.run_id != record.run_id and r.status is RunStatus.WAITING_FOR_APPROVAL)
    return dataclasses.replace(record, waiting_below=waiting)


def in_tree(records: Sequence[RunRecord | None], *, limit: int, status: RunStatus | None,
            labels: Mapping[str, str] | None) -> list[RunRecord]:
    """The runs of an agent tree among ``records`` that match ``status`` and ``labels``, at most ``limit``."""
    return [r for r in records if r is not None and matches(r, status, labels)][:limit]


def in_thread(records: Sequence[RunRecord | None], root: str, *, limit: int, status: RunStatus | None,
              labels: Mapping[str, str] | None) -> list[RunRecord]:
    """The runs of the thread ``root`` among ``records`` that match ``status`` and ``labels``, at most ``limit``."""
    found = [r for r in records if r is not None and r.thread == root and matches(r, status, labels)]
    return found[:limit]


def summaries(keys: Keys, run_ids: Sequence[str]) -> Op[list[RunRecord | None]]:
    """These runs without their steps, request or pending turn (None for a run that no longer exists)."""
    def parse(answers: list[Any]) -> list[RunRecord | None]:
        found: list[RunRecord | None] = []
        for run_id, values, raw_cancel in zip(run_ids, answers[::2], answers[1::2], strict=True):
            fields = {name: value for name, value in zip(SUMMARY_FIELDS, values, strict=True) if value is not None}
            found.append(read_record(run_id, fields, (), read_cancel_request(raw_cancel)) if fields else None)
        return found

    calls: list[Call] = []
    for run_id in run_ids:
        calls += [Command(("HMGET", keys.run(run_id), *SUMMARY_FIELDS)), Command(("GET", keys.cancel(run_id)))]
    return Op("list runs", tuple(calls), parse)


# -- the outbox (docs/messaging.md, "The outbox") ------------------------------------------------

RELAY_GROUP: Final = "relay"
"""The one consumer group every relay reads the outbox through."""

def _fields(raw: Any) -> dict[str, str]:
    if isinstance(raw, dict):
        return {str(k): str(v) for k, v in raw.items()}
    flat = list(raw or ())
    return {str(flat[i]): str(flat[i + 1]) for i in range(0, len(flat) - 1, 2)}


def _entries(shard: int, raw: Any) -> list[OutboxEntry]:
    """Stream entries as the client answered them (``(id, fields)`` pairs; a deleted one has no fields)."""
    found = []
    for item in raw or ():
        stream_id, fields = item[0], item[1]
        if stream_id is None or fields is None:
            continue
        values = _fields(fields)
        found.append(OutboxEntry(shard, str(stream_id), values.get("run", ""), values.get("event", ""),
                                 values.get("labels", "")))
    return found


WEBHOOK_GROUP: Final = "webhooks"
"""The consumer group the webhook dispatcher reads the outbox through (its own cursor, beside the relay's)."""


def outbox_groups(keys: Keys, group: str = RELAY_GROUP) -> Op[int]:
    """Make a consumer group (the relay's unless named) on every outbox where it is missing; answers how many
    were made."""
    return Op(f"make the consumer group {group}", tuple(
        ScriptCall(_scripts.OUTBOX_GROUP, (keys.outbox(shard),), (Ident(group),)) for shard in keys.shards
    ), lambda answers: sum(int(a) for a in answers))


def outbox_trim(keys: Keys, *, retention_s: float) -> Op[int]:
    """Delete every outbox entry older than the retention, on every shard; answers how many."""
    return Op("trim the outbox", tuple(
        ScriptCall(_scripts.OUTBOX_TRIM, (keys.outbox(shard),), (int(retention_s),)) for shard in keys.shards
    ), lambda answers: sum(int(a) for a in answers))


def relay_lease(keys: Keys, relay: str, *, lease_s: float, key: str | None = None) -> Op[bool]:
    """Take or renew the lease of the one relay that publishes (or of the lease ``key``: the webhook
    dispatcher's); answers whether ``relay`` holds it."""
    return _script(_scripts.RELAY_LEASE, (key or keys.relay_lease,), (Ident(relay), int(lease_s * 1000)),
                   "take the relay's lease", lambda answers: bool(answers[0]))


def relay_release(keys: Keys, relay: str, *, key: str | None = None) -> Op[bool]:
    """Give the lease up, if ``relay`` holds it (a relay that stops: the next one need not wait it out)."""
    return _script(_scripts.RELAY_RELEASE, (key or keys.relay_lease,), (Ident(relay),),
                   "give the relay's lease up", lambda answers: bool(answers[0]))


def outbox_pending(keys: Keys, relay: str, *, count: int,
                   group: str = RELAY_GROUP) -> Op[tuple[list[OutboxEntry], int]]:
    """Take over every entry the group holds unacknowledged, oldest first (at most ``count`` per shard): a
    relay that died, or this one before RabbitMQ refused a batch. Answers them and how many pending entries
    were trimmed away before anyone published them (Redis drops those from the group as it answers)."""
    def parse(answers: list[Any]) -> tuple[list[OutboxEntry], int]:
        entries: list[OutboxEntry] = []
        trimmed = 0
        for shard, answer in zip(keys.shards, answers, strict=True):
            entries += _entries(shard, answer[1])
            trimmed += len(answer[2]) if len(answer) > 2 else 0  # Redis 7 adds the deleted ids
        return entries, trimmed

    return Op("read the outbox's pending events", tuple(
        Command(("XAUTOCLAIM", keys.outbox(shard), group, relay, 0, "0-0", "COUNT", count))
        for shard in keys.shards), parse)


def outbox_new(keys: Keys, relay: str, *, count: int, block_ms: int | None = None,
               group: str = RELAY_GROUP) -> Op[list[OutboxEntry]]:
    """The next entries no relay was given yet, at most ``count`` per shard; given to ``relay`` (pending
    until acknowledged). ``block_ms``: wait that long for one (a single Redis only: one stream)."""
    def parse(answers: list[Any]) -> list[OutboxEntry]:
        entries: list[OutboxEntry] = []
        for shard, answer in zip(keys.shards, answers, strict=True):
            streams = answer.items() if isinstance(answer, dict) else (answer or ())
            for _stream, raw in streams:
                entries += _entries(shard, raw)
        return entries

    wait = ("BLOCK", block_ms) if block_ms is not None and not keys.cluster else ()
    return Op("read the outbox", tuple(
        Command(("XREADGROUP", "GROUP", group, relay, "COUNT", count, *wait, "STREAMS", keys.outbox(shard), ">"))
        for shard in keys.shards), parse)


def outbox_ack(keys: Keys, entries: Sequence[OutboxEntry], group: str = RELAY_GROUP) -> Op[int]:
    """Acknowledge published entries (they stay in the outbox until they are older than the retention)."""
    by_shard: dict[int, list[str]] = {}
    for entry in entries:
        by_shard.setdefault(entry.shard, []).append(entry.stream_id)
    return Op("acknowledge published events", tuple(
        Command(("XACK", keys.outbox(shard), group, *ids)) for shard, ids in by_shard.items()),
        lambda answers: sum(int(a) for a in answers))


def outbox_ack_and_new(keys: Keys, done: Sequence[OutboxEntry], relay: str, *, count: int,
                       block_ms: int | None = None, group: str = RELAY_GROUP) -> Op[list[OutboxEntry]]:
    """:func:`outbox_ack` of the entries the reader is done with, then :func:`outbox_new`, in one round trip:
    a reader's round costs the read alone (worker/outbox_reader.py, ``OutboxReader.done``)."""
    ack = outbox_ack(keys, done, group)
    read = outbox_new(keys, relay, count=count, block_ms=block_ms, group=group)
    acks = len(ack.calls)
    return Op("acknowledge published events and read the outbox", ack.calls + read.calls,
              lambda answers: read.parse(answers[acks:]))


def outbox_after(keys: Keys, after: str | None, *, count: int) -> Op[tuple[list[OutboxEntry], str | None]]:
    """The next ``count`` events after ``after`` (a stream id; None: from the oldest kept), and the id of the
    oldest event kept (None when the outbox is empty): one shard (a single Redis; ``GET /v1/events``)."""
    start = "-" if after is None else f"({after}"

    def parse(answers: list[Any]) -> tuple[list[OutboxEntry], str | None]:
        oldest = _entries(0, answers[1])
        return _entries(0, answers[0]), oldest[0].stream_id if oldest else None

    return Op("read the outbox", (Command(("XRANGE", keys.outbox(0), start, "+", "COUNT", count)),
                                  Command(("XRANGE", keys.outbox(0), "-", "+", "COUNT", 1))), parse)


def feed_page(keys: Keys, after: str, *, tenant: str | None, count: int) -> Op[FeedPage]:
    """Of the next ``count`` events after the event id ``after``, the status changes (of ``tenant``'s runs only,
    unless None), filtered in Redis (``_api_scripts.FEED_SCAN``); and the id of the oldest event kept: one shard
    (a single Redis; ``GET /v1/events``)."""
    def parse(answers: list[Any]) -> FeedPage:
        last, read, kept = answers[0]
        oldest = _entries(0, answers[1])
        return FeedPage(_entries(0, kept), _text(last) or None, int(read), oldest[0].stream_id if oldest else None)

    return Op("read the outbox's status changes", (
        ScriptCall(_api_scripts.FEED_SCAN, (keys.outbox(0),), (Ident(after), Ident(tenant or ""), count)),
        Command(("XRANGE", keys.outbox(0), "-", "+", "COUNT", 1))), parse)


# -- webhooks (docs/webhooks.md, "How delivery works") ----------------------------------------------


def _webhook_keys(keys: Keys, webhook: str, run_id: str, event_id: str) -> tuple[str, str, str, str, str]:
    """A delivery's hash and line, the due set, the log and the failing set."""
    return (keys.webhook_key(f"webhook:{webhook}:{event_id}"), keys.webhook_key(f"webhook-line:{webhook}:{run_id}"),
            keys.webhook_key("webhook-due"), keys.webhook_key("webhook-log"), keys.webhook_key("webhook-failing"))


def webhook_member(webhook: str, run_id: str) -> str:
    """A line's member in the due set: the webhook and the run (a webhook's name has no '|')."""
    return f"{webhook}|{run_id}"


def run_requests(keys: Keys, run_ids: Sequence[str]) -> Op[list[str | None]]:
    """The stored request (spec JSON) of each run, None for a run that is gone."""
    return Op("read runs' requests", tuple(Command(("HGET", keys.run(run_id), "request")) for run_id in run_ids),
              lambda answers: [None if a is None else str(a) for a in answers])


def webhook_queue(keys: Keys, webhook: str, run_id: str, event_id: str, fields: Mapping[str, Arg], *,
                  now: float) -> Op[bool]:
    """Queue the delivery of one event to one webhook behind the run's earlier ones; False when it was queued
    already (the outbox handed the event out again)."""
    pairs: list[Arg] = []
    for name, value in fields.items():
        pairs += [Ident(name), value]
    return _script(_scripts.WEBHOOK_QUEUE, _webhook_keys(keys, webhook, run_id, event_id)[:4],
                   (Ident(webhook_member(webhook, run_id)), now, *pairs),
                   "queue a webhook delivery", lambda answers: bool(answers[0]))


def webhook_result(keys: Keys, webhook: str, run_id: str, event_id: str, *, outcome: str,
                   fields: Mapping[str, Arg], now: float, next_at: float) -> Op[bool]:
    """Record an attempt: ``delivered`` or ``gave_up`` moves the line on, ``retrying`` makes it wait until
    ``next_at``."""
    pairs: list[Arg] = []
    for name, value in fields.items():
        pairs += [Ident(name), value]
    return _script(_scripts.WEBHOOK_RESULT, _webhook_keys(keys, webhook, run_id, event_id),
                   (Ident(webhook_member(webhook, run_id)), Ident(outcome), now, next_at, *pairs),
                   "record a webhook delivery", lambda answers: bool(answers[0]))


def webhooks_due(keys: Keys, *, now: float, count: int) -> Op[list[str]]:
    """The lines whose next delivery is due (members of the due set), oldest first."""
    return Op("read due webhook deliveries",
              (Command(("ZRANGEBYSCORE", keys.webhook_key("webhook-due"), "-inf", now, "LIMIT", 0, count)),),
              lambda answers: [str(m) for m in answers[0]])


def webhook_line_heads(keys: Keys, members: Sequence[str]) -> Op[list[str]]:
    """The key of the delivery at the head of each line ("" for a line that has none); their fields are read
    by :func:`webhook_fields`. Two reads rather than one script: a script may touch only the keys it is given,
    and the head's key is known only once the line was read (docs/pitfalls.md, "Pitfalls: Lua scripts and
    hash tags")."""
    calls = []
    for member in members:
        webhook, _, run_id = member.partition("|")
        calls.append(Command(("LINDEX", keys.webhook_key(f"webhook-line:{webhook}:{run_id}"), 0)))
    return Op("read webhook lines", tuple(calls), lambda answers: [str(a) if a is not None else "" for a in answers])


def webhook_index(keys: Keys, *, failing: bool, count: int) -> Op[list[str]]:
    """The keys of the latest deliveries (or only those failing: retrying or given up), newest first."""
    index = keys.webhook_key("webhook-failing" if failing else "webhook-log")
    return Op("list webhook deliveries", (Command(("ZREVRANGE", index, 0, count - 1)),),
              lambda answers: [str(m) for m in answers[0]])


def webhook_fields(delivery_keys: Sequence[str]) -> Op[list[dict[str, str]]]:
    """Each delivery's fields, in the order given (empty for one deleted meanwhile, or a "" key)."""
    wanted = [key for key in delivery_keys if key]

    def parse(answers: list[Any]) -> list[dict[str, str]]:
        found = dict(zip(wanted, (_fields(answer) for answer in answers), strict=True))
        return [found.get(key, {}) if key else {} for key in delivery_keys]

    return Op("read webhook deliveries", tuple(Command(("HGETALL", key)) for key in wanted), parse)


def webhook_expired(keys: Keys, *, before: float, count: int) -> Op[list[str]]:
    """Deliveries last touched before ``before`` (the retention's edge)."""
    return Op("read expired webhook deliveries",
              (Command(("ZRANGEBYSCORE", keys.webhook_key("webhook-log"), "-inf", before, "LIMIT", 0, count)),),
              lambda answers: [str(m) for m in answers[0]])


def webhook_forget(keys: Keys, deliveries: Sequence[str]) -> Op[int]:
    """Delete deliveries past the retention and their index entries."""
    return Op("forget webhook deliveries", (
        Command(("DEL", *deliveries)),
        Command(("ZREM", keys.webhook_key("webhook-log"), *deliveries)),
        Command(("ZREM", keys.webhook_key("webhook-failing"), *deliveries)),
    ), lambda answers: int(answers[0]))
