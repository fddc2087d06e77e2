"""What the run store answers: runs as read, transitions as decided, steps as appended.

Values only: built from Redis's answers by ``shared/_store_core.py``, shared by the
synchronous store (``shared/store.py``) and the asynchronous one (``shared/async_store.py``).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import structlog

from runbrake.shared.budget import budget_use
from runbrake.shared.errors import InvalidRunId
from runbrake.shared.status import RunStatus, TerminationReason
from runbrake.shared.steps import RunStep, StepKind

ARGUMENT_ERROR: Final = "argument_error"
CANCELLED_SIDE_EFFECTS_UNKNOWN: Final = "cancelled_side_effects_unknown"
"""The per-server counter of cancelled calls cut off after their request was sent (``detail.side_effects =
"unknown"``); ``runbrake servers`` adds them to the cancelled calls and shows them apart."""
WORKER_LOST_NONE: Final = "worker_lost"
WORKER_LOST_UNKNOWN: Final = "worker_lost_side_effects_unknown"
"""The per-server counters of calls cut off by the loss of their worker process (``detail.reason =
"worker_lost"``), never sent and sent; ``runbrake servers`` adds them to the cancelled calls (the second to the
side effects unknown too) and shows their sum as ``worker_lost``."""
"""The per-server counter (``RunStore.server_outcomes``) of failed calls whose arguments were at fault, beside
the counters named by the outcomes; public because the CLI and the API show it (broker/render.py)."""

SENT_PREFIX: Final = "sent:"
"""A run hash field ``sent:<call id>``: the tool call's request was about to go out, after the step of this
sequence (docs/leases.md, "Lost workers")."""
SENT_MODEL: Final = "sent:model"
"""A run hash field ``"<round> <sequence>"``: the model call of that round was about to go out."""
TASK_PREFIX: Final = "task:"
"""The run's field naming an MCP task in flight (``task:<call id>``: its server, task id and MCP session, as JSON),
written before anything waits on the task and deleted once its result is in (worker/mcp_tasks.py)."""


@dataclass(frozen=True, slots=True)
class Sent:
    """The calls whose marks an append writes: they go out right after its step (docs/leases.md, "Lost
    workers"): the model call of round ``model`` and the tool calls ``calls`` (their ids)."""

    model: int | None = None
    calls: tuple[str, ...] = ()

    def arguments(self) -> tuple[str, ...]:
        """APPEND_STEP's mark arguments: the model's round ('' for none), then each tool call's field."""
        return ("" if self.model is None else str(self.model), *(f"{SENT_PREFIX}{c}" for c in self.calls))


log = structlog.get_logger(__name__)

RUN_ID: Final = re.compile(r"[0-9a-f]{32}")
"""What a run id looks like: the store generates them (uuid4, hex)."""


def check_run_id(value: str) -> str:
    """``value`` when it is a well-formed run id.

    Raises:
        InvalidRunId: echoing at most 100 characters of it.
    """
    if not RUN_ID.fullmatch(value):
        raise InvalidRunId(value)
    return value


@dataclass(frozen=True, slots=True)
class CancelRequest:
    """Who asked to cancel a run, why, and when (epoch seconds)."""

    reason: str
    requested_by: str
    requested_at: float

    def to_dict(self) -> dict[str, Any]:
        return {"reason": self.reason, "requested_by": self.requested_by, "requested_at": self.requested_at}


@dataclass(frozen=True, slots=True)
class SteerRequest:
    """A steer waiting to be applied (docs/cancellation.md, "Steer"): the new user message, why, who asked and
    when (epoch seconds); ``id`` names it, so that the script that applies it consumes this one and no other."""

    id: str
    input: str
    reason: str
    requested_by: str
    requested_at: float

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "input": self.input, "reason": self.reason, "requested_by": self.requested_by,
                "requested_at": self.requested_at}

    def detail(self) -> dict[str, Any]:
        """The ``steer`` step's ``detail``: what was asked, by whom, why and when."""
        return {"input": self.input, "reason": self.reason, "requested_by": self.requested_by,
                "requested_at": self.requested_at}


@dataclass(frozen=True, slots=True)
class Transition:
    """What a guarded transition came to: whether it happened, and the status its guard found."""

    won: bool
    found: RunStatus
    exists: bool = True
    owner_mismatch: bool = False
    steered: bool = False
    """A completing settle found a steer waiting (docs/cancellation.md, "Steer: the final answer")."""

    def __bool__(self) -> bool:
        return self.won


@dataclass(frozen=True, slots=True)
class TreeLink:
    """Where a child run sits in its tree: the run whose call made it, the tree's first run, and its depth
    (the first run's is 0)."""

    caller_run_id: str
    root_run_id: str
    depth: int
    ancestors: tuple[str, ...]
    """Every run above it, its caller first: each counts the child's usage against its own budget."""


@dataclass(frozen=True, slots=True)
class Claim(Transition):
    """A claim (queued → running, or an approved resume): the transition, and when it was won, what the
    segment needs to start, read in the same round trip: the run's request and its pending turn.

    The request is kept as the JSON text it is stored as: the worker validates that text directly,
    rather than decoding it here only to encode it again for the validator."""

    request_json: str | None = None
    pending: Mapping[str, Any] | None = None
    steer: SteerRequest | None = None
    """A steer waiting to be applied (a steered approval resumes, or the last worker died or handed over first)."""
    tenant: str | None = None
    """The run's tenant (None: of no tenant), whose catalog entries admission allows again at claim."""
    tree: TreeLink | None = None
    """Where the run sits in an agent tree, when an agent call made it (docs/usage.md, "Agent trees")."""

    @property
    def request(self) -> Mapping[str, Any] | None:
        """The request as a mapping."""
        return read_json_field(self.request_json)


@dataclass(frozen=True, slots=True)
class Quota:
    """A tenant's quotas (the catalog's ``[tenants.NAME]``); None: no bound."""

    max_runs_in_flight: int | None = None
    max_enqueues_per_minute: int | None = None


@dataclass(frozen=True, slots=True)
class QuotaHit:
    """The quota a create was refused by: its name, its limit, and when asking again may pass (seconds; 0:
    when a run of the tenant ends, which nobody can say)."""

    quota: str
    limit: int
    retry_after_s: int


@dataclass(frozen=True, slots=True)
class Created:
    """What a create did: the run id, and False when an idempotency key named an existing run (with
    ``conflict`` when that run was created from a different request), or when a quota refused it
    (``over_quota``; nothing written, no run id)."""

    run_id: str
    created: bool
    conflict: bool = False
    over_quota: QuotaHit | None = None


@dataclass(frozen=True, slots=True)
class Appended:
    """A recorded step (with its sequence) and the probe of the boundary it made: whether the run's
    cancel key was set when the step was appended."""

    step: RunStep
    cancelled: bool


MAX_CALL_TOKENS: Final = 10**12
"""The most input (or output) tokens one model call may report (docs/security.md, "Bounds"): a count is kept
exactly up to it and refused beyond, never stored as another number. A run's sums stay below 2**53 (exact
as a double, in every JSON reader) with up to 4,500 model calls."""


@dataclass(frozen=True, slots=True)
class RunUsage:
    """The tokens a run used, summed over every model call that answered, in every segment (the store sums
    them as the model steps are appended: shared/_scripts.py, APPEND_STEP)."""

    input_tokens: int = 0
    output_tokens: int = 0
    model_calls: int = 0
    cost_usd: float | None = None
    """What the model calls cost, at the catalog model's prices; None when it has none."""

    @property
    def total_tokens(self) -> int:
        return self.input_tokens + self.output_tokens

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"input_tokens": self.input_tokens, "output_tokens": self.output_tokens,
                                "total_tokens": self.total_tokens, "model_calls": self.model_calls}
        if self.cost_usd is not None:
            data["cost_usd"] = self.cost_usd
        return data


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
    progress: Mapping[str, Any] | None = None
    """The latest MCP progress report of the call in flight, as the worker stored it (docs/http-api.md)."""
    labels: Mapping[str, str] = field(default_factory=dict)
    model: str | None = None
    """The catalog model's name, or an inline model's provider tag (None for a run stored before it was kept)."""
    input_preview: str = ""
    """The first characters of the input (a listing does not read the request)."""
    usage: RunUsage = field(default_factory=RunUsage)
    parent_run_id: str | None = None
    """The run this one continues (docs/usage.md, "Continue a finished run"); None for a thread's first run."""
    thread_root: str | None = None
    """The first run of the thread this one continues, as stored (None for a first run: see :attr:`thread`)."""
    worker_losses: int = 0
    """How many worker processes were lost while they executed the run (docs/leases.md, "Lost workers")."""
    lost_worker: str | None = None
    """The worker process whose loss sent the run back to the queue, until another worker claims it (None
    otherwise): the run is "worker lost, resuming"."""
    caller_run_id: str | None = None
    """The run whose agent call started this one (docs/usage.md, "Agent trees"); None for a tree's first run."""
    root_run_id: str | None = None
    """The first run of the agent tree this one is in, as stored (None for a first run: see :attr:`root`)."""
    depth: int = 0
    """Levels below its tree's first run (0 for the first run)."""
    children: Mapping[str, str] = field(default_factory=dict)
    """The child runs its agent calls started, by the calling tool call's id (read with the run, not listed)."""
    waiting_below: tuple[str, ...] = ()
    """The runs below it in its agent tree waiting for approval, where the reader looked (``show``,
    ``GET /v1/runs/{id}``: ``RunStore.waiting_below``); never stored."""

    @property
    def root(self) -> str:
        """The id of the agent tree's first run, which ``GET /v1/runs?root=`` lists: a first run's own id."""
        return self.root_run_id or self.run_id

    @property
    def thread(self) -> str:
        """The id of the thread's first run, which ``GET /v1/runs?thread=`` lists: a first run's own id."""
        return self.thread_root or self.run_id

    @property
    def input(self) -> str | None:
        """The user's message that started the run (from its request)."""
        value = self.request.get("input")
        return value if isinstance(value, str) else None

    @property
    def budget(self) -> dict[str, Any] | None:
        """The budget the spec gave (its request's ``budget``), or None."""
        value = self.request.get("budget")
        return dict(value) if isinstance(value, Mapping) else None

    @property
    def instructions(self) -> str | None:
        value = self.request.get("instructions")
        return value if isinstance(value, str) else None

    @property
    def final_step(self) -> RunStep | None:
        """The model step that answered a completed run (derived, so that it cannot disagree with the steps)."""
        if self.status is not RunStatus.COMPLETED:
            return None
        last = next((step for step in reversed(self.steps) if step.kind is StepKind.MODEL), None)
        return last if last is not None and not last.error and not last.interrupted else None

    @property
    def output(self) -> str | None:
        """The final answer's text; None until the run completed."""
        step = self.final_step
        return None if step is None else step.content

    @property
    def output_json(self) -> Any:
        """The final answer as parsed and validated against the spec's output_schema (None without one)."""
        step = self.final_step
        return None if step is None else step.detail.get("output_json")

    def to_dict(self) -> dict[str, Any]:
        """The fields ``runbrake show --json`` promises, steps without outcomes."""
        return {
            "run_id": self.run_id,
            "status": self.status.value,
            "termination_reason": self.termination_reason.value,
            "created_at": self.created_at,
            "started_at": self.started_at,
            "finished_at": self.finished_at,
            "error": self.error,
            "cancel": None if self.cancel is None else self.cancel.to_dict(),
            "input": self.input,
            "instructions": self.instructions,
            "labels": dict(self.labels),
            "model": self.model,
            "output": self.output,
            "output_json": self.output_json,
            "usage": self.usage.to_dict(),
            "budget": self.budget,
            "budget_use": budget_use(self.request, self.created_at, self.usage.total_tokens, self.usage.cost_usd),
            "parent_run_id": self.parent_run_id,
            "thread": self.thread,
            "worker_losses": self.worker_losses,
            "lost_worker": self.lost_worker if self.status is RunStatus.QUEUED else None,
            "caller_run_id": self.caller_run_id,
            "root_run_id": self.root,
            "depth": self.depth,
            "children": [self.children[call] for call in sorted(self.children)],
            "waiting_below": list(self.waiting_below),
            "steps": [step.to_dict() for step in self.steps],
        }

    def summary(self) -> dict[str, Any]:
        """The run in a listing: without steps, request or answer (a listing reads none of them), with the
        start of its input instead."""
        data = {k: v for k, v in self.to_dict().items() if k not in _NOT_IN_A_LISTING}
        data["input_preview"] = self.input_preview
        return data


_NOT_IN_A_LISTING: Final = frozenset({"steps", "input", "instructions", "output", "output_json", "budget",
                                      "budget_use", "children", "waiting_below"})


MAX_SEARCH_CHARS: Final = 200
"""The longest text a listing searches for (``GET /v1/runs?q=``): as long as the input preview it reads."""


@dataclass(frozen=True, slots=True)
class RunSearch:
    """What a listing searches for (docs/http-api.md, "Runs: reading"): runs created within ``since`` and
    ``until`` (epoch seconds, both included; None: unbounded) whose listing fields hold ``text``, compared
    case-insensitively: the run id, the start of the input (``input_preview``), the model, the labels as
    ``KEY=VALUE`` and the error. Only what a listing reads is searched, so a search costs no more than it."""

    text: str = ""
    since: float | None = None
    until: float | None = None

    def admits(self, record: RunRecord) -> bool:
        """Whether ``record`` is one of the runs searched for."""
        if self.since is not None and record.created_at < self.since:
            return False
        if self.until is not None and record.created_at > self.until:
            return False
        if not self.text:
            return True
        wanted = self.text.casefold()
        parts = (record.run_id, record.input_preview, record.model or "", record.error,
                 *(f"{key}={value}" for key, value in record.labels.items()))
        return any(wanted in part.casefold() for part in parts)


ANY_RUN: Final = RunSearch()
"""The search that admits every run."""


# -- reading stored values -----------------------------------------------------------------------


def read_step(run_id: str, raw: str) -> RunStep:
    """A stored step; one that cannot be read shows as an ``unknown`` step saying so, never a crash."""
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # nested past the decoder's depth: RecursionError
        return _unreadable(run_id, 0, exc)
    try:
        return RunStep.from_dict(data)
    except (ValueError, TypeError, AttributeError, OverflowError) as exc:  # StepError is a ValueError; int(1e999)
        sequence = data.get("sequence", 0) if isinstance(data, dict) else 0
        return _unreadable(run_id, int(sequence) if isinstance(sequence, int) else 0, exc)


def _unreadable(run_id: str, sequence: int, exc: Exception) -> RunStep:
    log.warning("step_unreadable", run_id=run_id, sequence=sequence, error=str(exc))
    return RunStep(kind=StepKind.UNKNOWN, round=0, sequence=sequence, content=f"unreadable step: {exc}")


def _float_or_none(value: str | None) -> float | None:
    return float(value) if value else None


def read_cancel_request(raw: str | None) -> CancelRequest | None:
    """A stored cancel request, or None when there is none."""
    if raw is None:
        return None
    data = json.loads(raw)
    return CancelRequest(
        reason=str(data.get("reason", "")),
        requested_by=str(data.get("requested_by", "")),
        requested_at=float(data.get("requested_at", 0.0)),
    )


def read_steer_request(raw: str | bytes | None) -> SteerRequest | None:
    """A stored steer, or None when there is none or it is not one the steer script wrote (never raises: the
    backstop reads what anyone could have written to the key)."""
    if raw is None:
        return None
    try:
        data = json.loads(raw)
        steer = SteerRequest(id=str(data["id"]), input=str(data["input"]), reason=str(data.get("reason", "")),
                             requested_by=str(data.get("requested_by", "")),
                             requested_at=float(data.get("requested_at", 0.0)))
    except (ValueError, TypeError, KeyError, RecursionError):
        log.warning("steer_unreadable", size=len(raw))
        return None
    return steer


def read_json_field(value: str | None) -> Mapping[str, Any] | None:
    """A hash field holding a JSON object (the request, the pending turn), or None when empty."""
    return json.loads(value) if value else None


def read_record(run_id: str, fields: Mapping[str, str], steps: tuple[RunStep, ...],
                cancel: CancelRequest | None, *, children: Mapping[str, str] | None = None) -> RunRecord:
    """A run from its hash's fields, its steps, its cancel request and its children (call id → run id)."""
    return RunRecord(
        run_id=run_id,
        status=RunStatus.parse(fields.get("status"), run_id=run_id),
        termination_reason=TerminationReason.parse(fields.get("termination_reason"), run_id=run_id),
        created_at=float(fields.get("created_at") or 0.0),
        started_at=_float_or_none(fields.get("started_at")),
        finished_at=_float_or_none(fields.get("finished_at")),
        owner=fields.get("owner", ""),
        lease_expires_at=_float_or_none(fields.get("lease_expires_at")),
        request=read_json_field(fields.get("request")) or {},
        pending=read_json_field(fields.get("pending")),
        error=fields.get("error", ""),
        segments=int(fields.get("segments") or 0),
        cancel=cancel,
        steps=steps,
        progress=_progress(fields.get("progress")),
        labels=_labels(fields.get("labels")),
        model=fields.get("model") or None,
        input_preview=fields.get("input_preview", ""),
        usage=RunUsage(input_tokens=_count(fields.get("input_tokens")),
                       output_tokens=_count(fields.get("output_tokens")),
                       model_calls=_count(fields.get("model_calls")), cost_usd=_cost(fields.get("cost_usd"))),
        parent_run_id=fields.get("parent_run_id") or None,
        worker_losses=_count(fields.get("worker_losses")),
        lost_worker=fields.get("lost_worker") or None,
        thread_root=fields.get("thread") or None,
        caller_run_id=fields.get("caller_run_id") or None,
        root_run_id=fields.get("root_run_id") or None,
        depth=_count(fields.get("depth")),
        children=dict(children or {}),
    )


def read_tree(ancestors: str | bytes | None, root: str | bytes | None, depth: str | bytes | None) -> TreeLink | None:
    """A child run's place in its agent tree from its hash's fields; None for a run no agent call made."""
    text = (ancestors.decode() if isinstance(ancestors, bytes) else ancestors) or ""
    if not text:
        return None
    above = tuple(text.split("/"))
    root_id = (root.decode() if isinstance(root, bytes) else root) or above[-1]
    return TreeLink(caller_run_id=above[0], root_run_id=root_id, depth=_count(
        depth.decode() if isinstance(depth, bytes) else depth) or len(above), ancestors=above)


def _labels(value: str | None) -> dict[str, str]:
    """The stored labels; unreadable ones count as none (the request keeps them as given)."""
    try:
        data = json.loads(value) if value else {}
    except (ValueError, RecursionError):
        return {}
    return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else {}


def _cost(value: str | None) -> float | None:
    try:
        cost = float(value) if value else None
    except ValueError:
        return None
    return None if cost is None or not math.isfinite(cost) else round(max(0.0, cost), 9)


def _count(value: str | None) -> int:
    try:
        return max(0, int(value)) if value else 0
    except ValueError:
        return 0


def _progress(value: str | None) -> Mapping[str, Any] | None:
    """The stored progress report; anything unreadable counts as none (it is a courtesy, never a crash)."""
    try:
        data = json.loads(value) if value else None
    except (ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) else None


_STREAM_ID: Final = re.compile(r"(\d{1,20})-(\d{1,20})")


def stream_position(stream_id: str) -> tuple[int, int] | None:
    """An outbox event's id (a Redis stream id, ``<ms>-<seq>``) as the pair events are ordered by; None for
    anything else (docs/http-api.md, "Events: resuming")."""
    match = _STREAM_ID.fullmatch(stream_id)
    return (int(match[1]), int(match[2])) if match else None


@dataclass(frozen=True, slots=True)
class FeedPage:
    """A page of the feed's replay (``GET /v1/events``): the status changes kept of the entries read, the id of
    the last entry read (None when none was), how many were read, and the id of the oldest event kept."""

    entries: list[OutboxEntry]
    last_read: str | None
    read: int
    oldest: str | None


@dataclass(frozen=True, slots=True)
class OutboxEntry:
    """One event in the outbox (docs/messaging.md, "The outbox"): its shard and stream id, its run, the
    event as the store wrote it (JSON text: ``{"event": "status"|"step", "run_id", …}``), and the run's labels
    as they were then (JSON text; "" when the run had none)."""

    shard: int
    stream_id: str
    run_id: str
    event: str
    labels: str = ""

    @property
    def tenant(self) -> str:
        """The tenant of the entry's run, from its labels ("" for none, or labels that cannot be read)."""
        try:
            labels = json.loads(self.labels) if self.labels else {}
        except ValueError:
            return ""
        tenant = labels.get("tenant", "") if isinstance(labels, dict) else ""
        return tenant if isinstance(tenant, str) else ""
