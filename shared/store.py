"""The run store on Redis: runs, steps and cancel keys, with guarded transitions (DESIGN.md section 3).

Every transition is one Lua script (``shared/_scripts.py``); nothing here reads a
status in Python and then writes. A refused transition changes nothing, is logged
with the status it found, and returns that status in a :class:`Transition`.

Keys, all under the namespace (``{run_id}`` is a hash tag):

    <ns>:run:{<id>}           hash   the run: status, reason, times, owner, request, pending turn
    <ns>:run:{<id>}:steps     list   the steps as JSON, in sequence order
    <ns>:run:{<id>}:cancel    string the cancel request as JSON; lives as long as the run, no TTL
    <ns>:runs                 zset   run ids by creation time
    <ns>:idem:<key>           string the run id an idempotency key created
    <ns>:servers              hash   tool calls per "<server>|<outcome>", for per-server health
    <ns>:leases               zset   running run ids by lease expiry, for the reaper
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import redis
import structlog

from runbrake.shared import _scripts
from runbrake.shared.errors import RunNotFound, StoreError
from runbrake.shared.settings import Settings
from runbrake.shared.status import RunStatus, TerminationReason
from runbrake.shared.steps import RunStep, StepKind

log = structlog.get_logger(__name__)

_STEP_SYSTEM_FIELDS = ("sequence", "recorded_at")


@dataclass(frozen=True, slots=True)
class CancelRequest:
    """Who asked to cancel a run, why, and when (epoch seconds)."""

    reason: str
    requested_by: str
    requested_at: float

    def to_dict(self) -> dict[str, Any]:
        return {"reason": self.reason, "requested_by": self.requested_by, "requested_at": self.requested_at}


@dataclass(frozen=True, slots=True)
class Transition:
    """What a guarded transition came to: whether it happened, and the status its guard found."""

    won: bool
    found: RunStatus
    exists: bool = True
    owner_mismatch: bool = False

    def __bool__(self) -> bool:
        return self.won


@dataclass(frozen=True, slots=True)
class Created:
    """What :meth:`RunStore.create` did: the run id, and False when an idempotency key named an existing run."""

    run_id: str
    created: bool


@dataclass(frozen=True, slots=True)
class RunRecord:
    """A run as stored, with its steps in sequence order."""

    run_id: str
    status: RunStatus
    termination_reason: TerminationReason
    created_at: float
    started_at: float | None
    finished_at: float | None
    owner: str
    lease_expires_at: float | None
    request: Mapping[str, Any]
    pending: Mapping[str, Any] | None
    error: str
    segments: int
    cancel: CancelRequest | None
    steps: tuple[RunStep, ...] = field(default=())

    def to_dict(self) -> dict[str, Any]:
        """The fields ``runbrake show --json`` promises (DESIGN.md section 6), steps without outcomes."""
        return {
            "run_id": self.run_id,
            "status": self.status.value,
            "termination_reason": self.termination_reason.value,
            "created_at": self.created_at,
            "started_at": self.started_at,
            "finished_at": self.finished_at,
            "error": self.error,
            "cancel": None if self.cancel is None else self.cancel.to_dict(),
            "steps": [step.to_dict() for step in self.steps],
        }


class RunStore:
    """Runs, steps and cancel keys in Redis under one namespace."""

    def __init__(self, client: redis.Redis, namespace: str) -> None:
        self._redis = client
        self.namespace = namespace
        register = client.register_script
        self._create = register(_scripts.CREATE)
        self._claim = register(_scripts.CLAIM)
        self._resume_claim = register(_scripts.RESUME_CLAIM)
        self._suspend = register(_scripts.SUSPEND)
        self._approve = register(_scripts.APPROVE)
        self._settle = register(_scripts.SETTLE)
        self._cancel = register(_scripts.CANCEL)
        self._append = register(_scripts.APPEND_STEP)
        self._renew = register(_scripts.RENEW_LEASE)
        self._reap = register(_scripts.REAP)

    @classmethod
    def connect(cls, settings: Settings) -> RunStore:
        """A store on ``settings.redis_url`` under ``settings.namespace``. Connects lazily."""
        client = redis.Redis.from_url(
            settings.redis_url,
            decode_responses=True,
            socket_timeout=settings.redis_timeout_s,
            socket_connect_timeout=min(settings.redis_timeout_s, 1.0),
            health_check_interval=30,
        )
        return cls(client, settings.namespace)

    @property
    def redis(self) -> redis.Redis:
        """The client, for health checks and tests."""
        return self._redis

    def close(self) -> None:
        self._redis.close()

    # -- keys -----------------------------------------------------------------------------------

    def run_key(self, run_id: str) -> str:
        return f"{self.namespace}:run:{{{run_id}}}"

    def steps_key(self, run_id: str) -> str:
        return f"{self.run_key(run_id)}:steps"

    def cancel_key(self, run_id: str) -> str:
        return f"{self.run_key(run_id)}:cancel"

    def _index_key(self) -> str:
        return f"{self.namespace}:runs"

    def _idempotency_key(self, key: str) -> str:
        return f"{self.namespace}:idem:{key}"

    def _servers_key(self) -> str:
        return f"{self.namespace}:servers"

    def _leases_key(self) -> str:
        return f"{self.namespace}:leases"

    # -- transitions ----------------------------------------------------------------------------

    def create(self, request: Mapping[str, Any], *, idempotency_key: str | None = None) -> Created:
        """Write a queued run with its request. The same idempotency key returns the same run.

        Raises:
            StoreError: when Redis cannot be reached.
        """
        run_id = uuid.uuid4().hex
        idem = self._idempotency_key(idempotency_key) if idempotency_key else self._idempotency_key("-")
        won, value = self._call(
            self._create,
            [self.run_key(run_id), idem, self._index_key()],
            [run_id, json.dumps(request, sort_keys=True), repr(time.time()),
             "1" if idempotency_key else "0", idempotency_key or ""],
        )
        if won:
            log.info("run_created", run_id=run_id)
        else:
            log.info("run_create_deduplicated", run_id=value, idempotency_key=idempotency_key)
        return Created(run_id=str(value), created=bool(won))

    def claim(self, run_id: str, owner: str, *, lease_s: float) -> Transition:
        """queued → running, stamping owner, started_at and the lease."""
        now = time.time()
        return self._transition(
            "claim", run_id, self._claim, [self.run_key(run_id), self._leases_key()],
            [owner, repr(now), repr(now + lease_s), run_id],
        )

    def resume_claim(self, run_id: str, owner: str, *, lease_s: float) -> Transition:
        """waiting_for_approval (approved) → running, stamping the new owner and lease."""
        now = time.time()
        return self._transition(
            "resume_claim", run_id, self._resume_claim, [self.run_key(run_id), self._leases_key()],
            [owner, repr(now), repr(now + lease_s), run_id],
        )

    def suspend(self, run_id: str, owner: str, pending: Mapping[str, Any]) -> Transition:
        """running → waiting_for_approval (owner-guarded), storing the pending turn."""
        return self._transition(
            "suspend", run_id, self._suspend, [self.run_key(run_id), self._leases_key()],
            [owner, json.dumps(pending), run_id],
        )

    def approve(self, run_id: str) -> Transition:
        """Record an approval on a run waiting for one; the resume claim consumes it."""
        return self._transition("approve", run_id, self._approve, [self.run_key(run_id)], [])

    def settle(
        self,
        run_id: str,
        status: RunStatus,
        reason: TerminationReason,
        *,
        owner: str | None = None,
        error: str = "",
        required_status: RunStatus | None = None,
    ) -> Transition:
        """non-terminal → completed or failed. Owner-guarded when ``owner`` is given; limited to
        ``required_status`` when given (``deny`` settles only a run that waits for approval)."""
        if status not in (RunStatus.COMPLETED, RunStatus.FAILED):
            raise ValueError(f"settle goes to completed or failed, not {status.value} (cancel has its own fence)")
        return self._transition(
            f"settle_{status.value}", run_id, self._settle, [self.run_key(run_id), self._leases_key()],
            [status.value, reason.value, owner or "", repr(time.time()), error[:2000],
             "" if required_status is None else required_status.value, run_id],
        )

    def cancel(self, run_id: str, *, reason: str, requested_by: str) -> Transition:
        """non-terminal → cancelled, writing the cancel key in the same script (the fence)."""
        request = CancelRequest(reason=reason, requested_by=requested_by, requested_at=time.time())
        return self._transition(
            "cancel", run_id, self._cancel, [self.run_key(run_id), self.cancel_key(run_id), self._leases_key()],
            [json.dumps(request.to_dict()), repr(request.requested_at), run_id],
        )

    def renew_leases(self, owners: Mapping[str, str], *, lease_s: float) -> set[str]:
        """Extend the leases of these running runs (run id → owner) in one round trip.

        Returns the runs whose lease was not renewed (no longer running, or owned by another).

        Raises:
            StoreError: when Redis cannot be reached.
        """
        if not owners:
            return set()
        expires = repr(time.time() + lease_s)
        try:
            with self._redis.pipeline(transaction=False) as pipe:
                for run_id, owner in owners.items():
                    self._renew(keys=[self.run_key(run_id), self._leases_key()], args=[owner, expires, run_id],
                                client=pipe)
                renewed = pipe.execute()
        except redis.RedisError as exc:
            raise StoreError(f"Redis at {self._describe()}: {exc}") from exc
        return {run_id for run_id, ok in zip(owners, renewed, strict=True) if not ok}

    def reap_expired(self, *, limit: int = 100) -> list[str]:
        """Fail (``lease_lost``) the running runs whose lease expired: their worker died without a word.

        Any worker may call this; each run is decided by one guarded script, so concurrent
        reapers never both win. Returns the runs this call failed.

        Raises:
            StoreError: when Redis cannot be reached.
        """
        now = time.time()
        try:
            due = cast(list[str], self._redis.zrangebyscore(self._leases_key(), "-inf", now, start=0, num=limit))
        except redis.RedisError as exc:
            raise StoreError(f"Redis at {self._describe()}: {exc}") from exc
        reaped = []
        for run_id in due:
            if self._transition("reap", run_id, self._reap, [self.run_key(run_id), self._leases_key()],
                                [repr(now), run_id]).won:
                log.warning("run_lease_lost", run_id=run_id)
                reaped.append(run_id)
        return reaped

    def append_step(self, run_id: str, step: RunStep) -> RunStep:
        """Record a step; the store assigns its sequence (strictly increasing per run).

        Raises:
            RunNotFound: when the run does not exist.
            StoreError: when Redis cannot be reached.
        """
        recorded_at = time.time()
        body = {k: v for k, v in step.to_dict().items() if k not in _STEP_SYSTEM_FIELDS}
        counter = (
            f"{step.tool_server}|{step.tool_outcome.value}"
            if step.tool_server is not None and step.tool_outcome is not None
            else ""
        )
        # One script, one round trip: the append and the server's outcome counter.
        sequence = self._call(
            self._append, [self.run_key(run_id), self.steps_key(run_id), self._servers_key()],
            [json.dumps(body, separators=(",", ":")), repr(recorded_at), counter],
        )
        if not sequence:
            raise RunNotFound(run_id)
        return step.with_sequence(int(sequence), recorded_at)

    def server_outcomes(self) -> dict[str, dict[str, int]]:
        """Tool calls per MCP server and outcome, counted as steps were recorded.

        Raises:
            StoreError: when Redis cannot be reached.
        """
        try:
            raw = cast(dict[str, str], self._redis.hgetall(self._servers_key()))
        except redis.RedisError as exc:
            raise StoreError(f"could not read server counts from Redis at {self._describe()}: {exc}") from exc
        counts: dict[str, dict[str, int]] = {}
        for field_name, value in raw.items():
            server, _, outcome = field_name.rpartition("|")
            counts.setdefault(server, {})[outcome] = int(value)
        return counts

    # -- reads ----------------------------------------------------------------------------------

    def get(self, run_id: str) -> RunRecord:
        """The run with its steps and cancel request, read in one transaction.

        Raises:
            RunNotFound: when no run has this id.
            StoreError: when Redis cannot be reached.
        """
        try:
            with self._redis.pipeline(transaction=True) as pipe:
                pipe.hgetall(self.run_key(run_id))
                pipe.lrange(self.steps_key(run_id), 0, -1)
                pipe.get(self.cancel_key(run_id))
                fields, raw_steps, raw_cancel = pipe.execute()
        except redis.RedisError as exc:
            raise StoreError(f"could not read run {run_id} from Redis at {self._describe()}: {exc}") from exc
        if not fields:
            raise RunNotFound(run_id)
        steps = tuple(_step(run_id, raw) for raw in raw_steps)
        return _record(run_id, fields, steps, _cancel_request(raw_cancel))

    def status(self, run_id: str) -> RunStatus:
        """The run's status alone.

        Raises:
            RunNotFound: when no run has this id.
        """
        try:
            value = self._redis.hget(self.run_key(run_id), "status")
        except redis.RedisError as exc:
            raise StoreError(f"could not read run {run_id} from Redis at {self._describe()}: {exc}") from exc
        if value is None:
            raise RunNotFound(run_id)
        return RunStatus.parse(cast(str, value), run_id=run_id)

    def recent(self, *, limit: int = 20, status: RunStatus | None = None, scan: int = 1000) -> list[RunRecord]:
        """The most recent runs (without steps), newest first; filtered by status among the last ``scan``."""
        try:
            ids = cast(list[str], self._redis.zrevrange(self._index_key(), 0, (scan if status else limit) - 1))
            with self._redis.pipeline(transaction=False) as pipe:
                for run_id in ids:
                    pipe.hgetall(self.run_key(run_id))
                    pipe.get(self.cancel_key(run_id))
                results = pipe.execute()
        except redis.RedisError as exc:
            raise StoreError(f"could not list runs from Redis at {self._describe()}: {exc}") from exc
        records = []
        for run_id, fields, raw_cancel in zip(ids, results[::2], results[1::2], strict=True):
            if not fields:
                continue
            record = _record(run_id, fields, (), _cancel_request(raw_cancel))
            if status is None or record.status is status:
                records.append(record)
            if len(records) >= limit:
                break
        return records

    def cancel_requested(self, run_id: str) -> bool:
        """The probe: one Redis read of the cancel key. Reading never consumes it.

        Fail-soft: an unreachable Redis answers False and logs, so a store hiccup never
        fabricates a cancellation (DESIGN.md section 4, layer 2).
        """
        try:
            return bool(self._redis.exists(self.cancel_key(run_id)))
        except redis.RedisError as exc:
            log.warning("cancel_probe_failed", run_id=run_id, error=str(exc))
            return False

    def cancel_request(self, run_id: str) -> CancelRequest | None:
        """The run's cancel request (one GET), or None. Fail-soft like the probe."""
        try:
            raw = cast(str | None, self._redis.get(self.cancel_key(run_id)))
        except redis.RedisError as exc:
            log.warning("cancel_read_failed", run_id=run_id, error=str(exc))
            return None
        return _cancel_request(raw)

    def cancelled_among(self, run_ids: Iterable[str]) -> set[str]:
        """Which of these runs have a cancel key, in one round trip (one MGET). Fail-soft like the probe."""
        ids = list(run_ids)
        if not ids:
            return set()
        try:
            values = cast(Sequence[str | None], self._redis.mget([self.cancel_key(i) for i in ids]))
        except redis.RedisError as exc:
            log.warning("cancel_poll_failed", runs=len(ids), error=str(exc))
            return set()
        return {run_id for run_id, value in zip(ids, values, strict=True) if value is not None}

    def ping(self) -> None:
        """Raises StoreError when Redis does not answer."""
        try:
            self._redis.ping()
        except redis.RedisError as exc:
            raise StoreError(f"Redis at {self._describe()} does not answer: {exc}") from exc

    def delete_namespace(self) -> int:
        """Delete every key under this namespace (tests and the demo clean up with this)."""
        deleted = 0
        for key in self._redis.scan_iter(match=f"{self.namespace}:*", count=500):
            deleted += self._redis.delete(key)
        return deleted

    # -- internals ------------------------------------------------------------------------------

    def _describe(self) -> str:
        kwargs = self._redis.connection_pool.connection_kwargs
        return f"{kwargs.get('host', '?')}:{kwargs.get('port', '?')}"

    def _call(self, script: Any, keys: list[str], args: list[str]) -> Any:
        try:
            return script(keys=keys, args=args)
        except redis.RedisError as exc:
            raise StoreError(f"Redis at {self._describe()}: {exc}") from exc

    def _transition(self, name: str, run_id: str, script: Any, keys: list[str], args: list[str]) -> Transition:
        answer = self._call(script, keys, args)
        won, found = bool(answer[0]), str(answer[1])
        status = RunStatus.parse(found, run_id=run_id) if found else RunStatus.UNKNOWN
        result = Transition(won=won, found=status, exists=bool(found), owner_mismatch=len(answer) > 2)
        if won:
            log.debug("transition", transition=name, run_id=run_id, found=found)
        else:
            log.info(
                "transition_refused", transition=name, run_id=run_id, found=found or "missing",
                owner_mismatch=result.owner_mismatch,
            )
        return result


def _step(run_id: str, raw: str) -> RunStep:
    """A stored step; one that cannot be read shows as an ``unknown`` step saying so, never a crash."""
    try:
        data = json.loads(raw)
    except ValueError as exc:
        return _unreadable(run_id, 0, exc)
    try:
        return RunStep.from_dict(data)
    except (ValueError, TypeError, AttributeError) as exc:  # StepError is a ValueError
        sequence = data.get("sequence", 0) if isinstance(data, dict) else 0
        return _unreadable(run_id, int(sequence) if isinstance(sequence, int) else 0, exc)


def _unreadable(run_id: str, sequence: int, exc: Exception) -> RunStep:
    log.warning("step_unreadable", run_id=run_id, sequence=sequence, error=str(exc))
    return RunStep(kind=StepKind.UNKNOWN, round=0, sequence=sequence, content=f"unreadable step: {exc}")


def _float_or_none(value: str | None) -> float | None:
    return float(value) if value else None


def _cancel_request(raw: str | None) -> CancelRequest | None:
    if raw is None:
        return None
    data = json.loads(raw)
    return CancelRequest(
        reason=str(data.get("reason", "")),
        requested_by=str(data.get("requested_by", "")),
        requested_at=float(data.get("requested_at", 0.0)),
    )


def _record(run_id: str, fields: Mapping[str, str], steps: tuple[RunStep, ...],
            cancel: CancelRequest | None) -> RunRecord:
    pending = fields.get("pending")
    return RunRecord(
        run_id=run_id,
        status=RunStatus.parse(fields.get("status"), run_id=run_id),
        termination_reason=TerminationReason.parse(fields.get("termination_reason"), run_id=run_id),
        created_at=float(fields.get("created_at") or 0.0),
        started_at=_float_or_none(fields.get("started_at")),
        finished_at=_float_or_none(fields.get("finished_at")),
        owner=fields.get("owner", ""),
        lease_expires_at=_float_or_none(fields.get("lease_expires_at")),
        request=json.loads(fields.get("request") or "{}"),
        pending=json.loads(pending) if pending else None,
        error=fields.get("error", ""),
        segments=int(fields.get("segments") or 0),
        cancel=cancel,
        steps=steps,
    )
