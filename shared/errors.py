"""The errors runbrake raises, as one tree (tests/test_error_tree.py checks it against the classes).

    RunbrakeError
     ├── ConfigError                 bad settings in the environment
     │    └── MissingVariable        a ${VAR} the catalog names is not set (shared/catalog.py)
     ├── TokensFileError             RUNBRAKE_API_TOKENS cannot be used (broker/auth.py)
     ├── SpecError                   an invalid run spec (names every offending field)
     ├── StepError                   a step that disagrees with itself (shared/steps.py; a ValueError too)
     ├── StoreError                  Redis could not be reached or answered nonsense
     │    └── NotReplicated          a transition fewer replicas acknowledged than RUNBRAKE_REDIS_MIN_REPLICAS_ACK
     ├── RunNotFound                 no run with that id
     ├── TransitionRefused           a guarded transition found another status (``found``)
     ├── RunBoundReached             a run reached max_steps or the tool calls a turn may ask for
     ├── LostCallFails               a call a lost worker cut off, found lost, whose tool says on_worker_lost = "fail"
     ├── IdempotencyConflict         an idempotency key came again with a different spec
     ├── QuotaExceeded               a tenant's quota refused an enqueue (nothing written)
     ├── InvalidRunId                a malformed run id
     ├── PublishError                RabbitMQ did not take (or confirm) a message
     │    └── ResumeUnsent           the resume message of an approval (the approval stands)
     ├── MalformedMessage            a message on RabbitMQ a worker does not accept
     │    ├── MalformedRunMessage    a run message's envelope (shared/messaging/wire.py; a ValueError too)
     │    └── MalformedCancelRequest a cancel request's body (shared/messaging/wire.py; a ValueError too)
     ├── Unreadable                  a message on <ns>:events the API cannot read (broker/events.py; a ValueError too)
     ├── HandBack                    a run message goes back to the queue unclaimed (worker/intake.py;
     │    │                          a Dramatiq Retry too)
     │    ├── WorkerFull             no slot came free in time
     │    └── CapacityClosed         the worker stopped taking runs
     ├── NotImplementedHere          a provider or transport this process has no implementation of
     │                               (shared/registry.py; a LookupError too)
     ├── ProviderError               the model provider failed
     │    └── MidStream              a streamed answer broke after it began: not retried (worker/model_stream.py)
     ├── ResponseTooLarge            an HTTP answer's body past its bound (worker/bounded_bodies.py;
     │                               an httpx2 StreamError too, which the MCP SDK catches around an answer)
     ├── ToolTransportError          an MCP call did not produce a result
     │    ├── ToolCallCancelled      it was cut off on purpose: the run was cancelled
     │    ├── ToolArgumentsRefused   the server refused the call's arguments (JSON-RPC -32602)
     │    └── TaskUnknown            the server no longer knows an MCP task or its session (worker/mcp_tasks.py)
     └── ApiError                    the HTTP API answered an error status (broker/api.py, broker/client.py)

    BaseException
     ├── CancelRequested             internal control flow: the run's cancel key is set
     ├── SteerRequested              internal control flow: a steer cut the turn off (worker/steer.py)
     ├── OwnershipLost               internal control flow: the run is no longer this worker's
     └── CallHandedOver              internal control flow: a hand-over left a call running (task, child run)

    Exception                        private to one module, never raised past it
     ├── _Stalled                    an events stream's client stopped reading (broker/events.py)
     ├── _HandOverDue                the loop's drain deadline passed (worker/loop.py)
     ├── _Claimed                    a call's answer was an MCP task: out of the SDK's call (worker/mcp_transport.py)
     ├── _ChildFailed                a schema check's child did not start, died or closed its pipe
     │                               (shared/schema_check.py)
     ├── _Late                       a schema check's child did not answer within its bound (shared/schema_check.py)
     └── ValueError
          └── _Refused               a setting's value its rule refuses, inside pydantic (shared/settings.py)

``CancelRequested`` derives from ``BaseException`` on purpose, like Dramatiq's
``Interrupt`` and structlog's ``DropEvent``: no ``except Exception`` between the
probe and the runtime's ladder may swallow it (docs/cancellation.md, "Cancellation: the probe").
Third-party errors are translated at the edge and chained (``raise ... from exc``).
A transport fault says which kind it is by its class, as httpx's do: ``except ToolCallCancelled``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from runbrake.shared.status import TerminationReason

if TYPE_CHECKING:
    from collections.abc import Mapping

    from runbrake.shared.status import RunStatus
    from runbrake.shared.tool_result import ToolResult


class RunbrakeError(Exception):
    """Raised for every error runbrake reports; catch this to catch them all.

    ``reason`` is the termination reason a run ends with when this error ends it (worker/runtime.py,
    ``ending_of``, maps every error in one place); ``None`` where an error says nothing of its own.
    """

    reason: TerminationReason | None = None


class ConfigError(RunbrakeError):
    """Raised when a setting in the environment cannot be used."""

    def __init__(self, variable: str, problem: str) -> None:
        super().__init__(f"{variable}: {problem}")
        self.variable = variable


_PLAIN_KEY = re.compile(r"[A-Za-z0-9_-]+")
"""A key written as ``.key`` in a field path; any other is written as ``["key"]``."""


@dataclass(frozen=True, slots=True)
class FieldProblem:
    """One thing wrong with a run spec: where (``loc``, a path into the JSON) and what (``msg``).

    ``field`` is the path as text, ``model.turns[0].content``; it defaults to one built from ``loc``.
    """

    loc: tuple[str | int, ...]
    msg: str
    field: str = ""

    def __post_init__(self) -> None:
        if not self.field:
            object.__setattr__(self, "field", field_path(self.loc))


def field_path(loc: tuple[str | int, ...]) -> str:
    """``("model", "turns", 0, "content")`` as ``model.turns[0].content``; ``spec`` for the whole spec.

    A key that is not a plain name (a line break, a dot, a quote) is written as a JSON string in
    brackets, so that the path stays one unambiguous line: ``mcp_servers["a.b"]``.
    """
    text = ""
    for part in loc:
        if isinstance(part, int):
            text += f"[{part}]"
        elif _PLAIN_KEY.fullmatch(part):
            text += f".{part}" if text else part
        else:
            text += f"[{json.dumps(part)}]"
    return text or "spec"


class SpecError(RunbrakeError):
    """Raised when a run spec is invalid; ``problems`` names every offending field.

    ``SpecError(field, problem)`` reports one problem, named by its text (its ``loc`` is just
    ``(field,)``); :meth:`from_problems` reports several, each with its ``loc``.
    ``field`` and ``problem`` are the first one's; ``str()`` lists them all.
    """

    reason: TerminationReason | None = TerminationReason.SPEC_REFUSED

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(field, problem)
        self.problems: tuple[FieldProblem, ...] = (FieldProblem(loc=(field,), msg=problem, field=field),)

    @classmethod
    def from_problems(cls, problems: Iterable[FieldProblem]) -> SpecError:
        """One error for all of ``problems``.

        Raises:
            ValueError: when ``problems`` is empty.
        """
        found = tuple(problems)
        if not found:
            raise ValueError("a SpecError needs at least one problem")
        error = cls(found[0].field, found[0].msg)
        error.problems = found
        return error

    @property
    def field(self) -> str:
        """The first offending field, e.g. ``model.turns[0].content``."""
        return self.problems[0].field

    @property
    def problem(self) -> str:
        """What is wrong with it."""
        return self.problems[0].msg

    def __str__(self) -> str:
        return "; ".join(f"{p.field}: {p.msg}" for p in self.problems)


class StoreError(RunbrakeError):
    """Raised when the run store (Redis) cannot be reached or answers something unusable."""


class NotReplicated(StoreError):
    """Raised when fewer replicas acknowledged a transition than ``RUNBRAKE_REDIS_MIN_REPLICAS_ACK`` asks:
    the primary has it, but it may be lost if the primary fails now (docs/operating.md, "Redis failover")."""


class RunNotFound(RunbrakeError):
    """Raised when no run exists under the given id; ``where`` says where it was looked for, when known."""

    def __init__(self, run_id: str, *, where: str = "") -> None:
        super().__init__(f"no run with id {run_id!r}" + (f" ({where})" if where else ""))
        self.run_id = run_id
        self.where = where


class TransitionRefused(RunbrakeError):
    """Raised when a guarded transition finds the run in a status it does not accept; ``found`` is that status.

    ``message`` is what the entry points show (shared/operations.py words it per operation).
    """

    def __init__(self, run_id: str, transition: str, found: RunStatus, message: str = "") -> None:
        super().__init__(message or f"run {run_id}: cannot {transition}, it is {found.value}")
        self.run_id = run_id
        self.transition = transition
        self.found = found


class RunBoundReached(RunbrakeError):
    """Raised when a run reaches one of its bounds (``max_steps``, tool calls per turn); ``reason`` is
    the termination reason it ends with."""

    reason: TerminationReason

    def __init__(self, reason: TerminationReason, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class LostCallFails(RunbrakeError):
    """Raised, with the call's result, where the worker that took a run up finds lost a call a lost worker left
    running (an MCP task its server no longer knows: worker/mcp_tasks.py) and the tool says ``on_worker_lost =
    "fail"``: the step is recorded, then the run ends ``failed`` with ``lease_lost``, as the sweep ends a run whose
    call of that policy it cut off (docs/leases.md, "Lost workers")."""

    reason: TerminationReason | None = TerminationReason.LEASE_LOST

    def __init__(self, message: str, result: ToolResult) -> None:
        super().__init__(message)
        self.result = result


class IdempotencyConflict(RunbrakeError):
    """Raised when an idempotency key that created a run comes again with a different spec."""

    def __init__(self, key: str, run_id: str) -> None:
        super().__init__(f"idempotency key {key[:100]!r} already created run {run_id} from a different spec")
        self.key = key
        self.run_id = run_id


class QuotaExceeded(RunbrakeError):
    """Raised when an enqueue would take a tenant over one of its quotas (the catalog's ``[tenants.NAME]``);
    nothing was written. ``retry_after_s`` is when asking again may pass (0: when one of its runs ends)."""

    def __init__(self, tenant: str, quota: str, limit: int, retry_after_s: int) -> None:
        what = "runs in flight" if quota == "max_runs_in_flight" else "enqueues a minute"
        super().__init__(f"tenant {tenant!r} is at its quota of {limit} {what} ({quota})")
        self.tenant = tenant
        self.quota = quota
        self.limit = limit
        self.retry_after_s = retry_after_s


class InvalidRunId(RunbrakeError):
    """Raised when a run id is malformed (runbrake's ids are 32 lowercase hex characters)."""

    def __init__(self, value: str) -> None:
        shown = value if len(value) <= 100 else value[:100] + "…"
        super().__init__(f"not a run id: {shown!r} (run ids are 32 lowercase hex characters)")
        self.value = value


class PublishError(RunbrakeError):
    """Raised when RabbitMQ refuses, drops or does not confirm a published message."""


class ResumeUnsent(PublishError):
    """Raised when RabbitMQ did not take the resume message of an approval: the approval stands, and
    approving again sends the message again."""

    def __init__(self, message: str, *, run_id: str) -> None:
        super().__init__(message)
        self.run_id = run_id


class MalformedMessage(RunbrakeError):
    """Raised when a message on RabbitMQ is not one a worker accepts; the message says why (it goes into
    the dead letter, docs/messages.md)."""


class ProviderError(RunbrakeError):
    """Raised when the model provider fails to produce a turn.

    Args:
        status: the endpoint's HTTP status, when it answered with one.
        retry_after_s: what the endpoint's ``Retry-After`` asked for, in seconds.
        transient: a timeout or a connection error (no status): worth another attempt.
        attempts: requests made before giving up (more than 1 after retries).
        retried: the attempts that were retried before it, in order (worker/models.py, ``RetryingProvider``).
    """

    reason: TerminationReason | None = TerminationReason.PROVIDER_FAILED

    _RETRYABLE_STATUSES: ClassVar[frozenset[int]] = frozenset({408, 409, 429})

    def __init__(self, message: str, *, status: int | None = None, retry_after_s: float | None = None,
                 transient: bool = False, attempts: int = 1, retried: tuple[RetriedAttempt, ...] = ()) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after_s = retry_after_s
        self.transient = transient
        self.attempts = attempts
        self.retried = retried

    @property
    def retryable(self) -> bool:
        """429, 408, 409, a 5xx, a timeout or a connection error: another attempt may succeed
        (docs/leases.md, "Retries"); any other 4xx, or a malformed answer, will not."""
        if self.status is None:
            return self.transient
        return self.status in self._RETRYABLE_STATUSES or self.status >= 500

    def after(self, retried: tuple[RetriedAttempt, ...]) -> ProviderError:
        """The same error as the last of ``len(retried) + 1`` attempts: what a call that gave up raises."""
        return ProviderError(str(self), status=self.status, retry_after_s=self.retry_after_s,
                             transient=self.transient, attempts=len(retried) + 1, retried=retried)


@dataclass(frozen=True, slots=True)
class RetriedAttempt:
    """One model request that failed with an error worth retrying, and how long the call waited after it
    (a model step's ``detail.retried``, docs/leases.md, "Retries")."""

    error: str
    """The error, as a short excerpt (:class:`ProviderError`'s message)."""
    status: int | None
    """The endpoint's HTTP status; ``None`` for a timeout or a connection error."""
    wait_s: float
    """Seconds waited before the next attempt: the backoff, at least what ``Retry-After`` asked for."""

    def to_dict(self) -> dict[str, Any]:
        return {"error": self.error, "status": self.status, "wait_s": self.wait_s}


class ToolTransportError(RunbrakeError):
    """Raised when an MCP call does not produce a result: a protocol error, a dead server, a timeout.

    The kinds a caller acts on are subclasses, caught by type (docs/store.md, "Tool outcomes"):
    :class:`ToolCallCancelled` and :class:`ToolArgumentsRefused`. Call sites never compare codes or
    message text to decide what "cancelled" means.
    """

    def __init__(self, message: str, *, server: str = "", tool: str = "") -> None:
        super().__init__(message)
        self.server = server
        self.tool = tool

    @classmethod
    def for_cancelled_call(cls, *, server: str, tool: str) -> ToolTransportError:
        """The error of a call cut off by a cancel (docs/store.md, "Tool outcomes"): a
        :class:`ToolCallCancelled`, the only way :attr:`is_cancellation` becomes true."""
        return ToolCallCancelled(server=server, tool=tool)

    @property
    def is_cancellation(self) -> bool:
        """Whether the call was cut off by a cancel: derived from the type, never stored beside it."""
        return isinstance(self, ToolCallCancelled)

    @property
    def is_invalid_arguments(self) -> bool:
        """Whether the server refused the call's arguments: derived from the type."""
        return isinstance(self, ToolArgumentsRefused)


class ToolCallCancelled(ToolTransportError):
    """Raised when an MCP call was cut off because its run was cancelled; the tool records it as a
    *cancelled* result, never a failed one (worker/mcp_tool.py)."""

    def __init__(self, *, server: str, tool: str, sent: bool = True) -> None:
        super().__init__(f"call to {server}.{tool} was cancelled"
                         + ("" if sent else " before its request was sent"), server=server, tool=tool)
        self.sent = sent
        """Whether the request may have reached the server (docs/cancellation.md, "Side effects of a cut-off
        call"); False only when it certainly did not."""


class ToolArgumentsRefused(ToolTransportError):
    """Raised when the server refused the call's arguments (JSON-RPC -32602): the caller's mistake, not the
    server's, so it is not counted against the server's health."""


class ApiError(RunbrakeError):
    """Raised when the HTTP API answers an error status: by the API to answer it (broker/api.py), by its
    client on receiving one (broker/client.py). ``status_code`` and ``body`` say which and why.

    ``body`` is the answer's JSON, ``{"error": ..., "errors": [...]}`` and any other members (the client
    keeps the text of an answer that is not JSON); ``headers`` are the answer's own, where the API sets any.
    """

    def __init__(self, status_code: int, body: Any, /, *, headers: Mapping[str, str] | None = None) -> None:
        message = body.get("error") if isinstance(body, dict) else None
        super().__init__(f"HTTP {status_code}: {message or body}")
        self.status_code = status_code
        self.body = body
        self.headers = None if headers is None else dict(headers)

    @classmethod
    def answer(cls, status_code: int, message: str, /, *, headers: Mapping[str, str] | None = None,
               **extra: Any) -> ApiError:
        """The API's answer ``{"error": message, **extra}`` with ``status_code``."""
        return cls(status_code, {"error": message, **extra}, headers=headers)

    @property
    def errors(self) -> list[dict[str, Any]]:
        """The invalid fields of a 422 answer (``loc``, ``msg``)."""
        errors = self.body.get("errors") if isinstance(self.body, dict) else None
        return list(errors or [])


class OwnershipLost(BaseException):
    """Raised when the store refuses a worker's write because the run is no longer its own (its lease
    was reaped, another worker claimed it): the worker stops the run at once and writes nothing more.

    A ``BaseException`` for the reason :class:`CancelRequested` is one: nothing between the store and
    the runtime's ladder may swallow it.
    """

    def __init__(self, run_id: str) -> None:
        super().__init__(run_id)
        self.run_id = run_id


class SteerRequested(BaseException):
    """Raised by the runtime's hooks at the first boundary after a steer reached the run; caught by the tool
    loop, which applies the steer and goes on (docs/cancellation.md, "Steer"). Not a cancel, and not an error:
    a ``BaseException`` for the same reason as :class:`CancelRequested`."""

    def __init__(self, run_id: str) -> None:
        super().__init__(run_id)
        self.run_id = run_id


class CancelRequested(BaseException):
    """Raised by the runtime's probe when the run's cancel key is set; caught only by the ladder."""

    reason: ClassVar[TerminationReason] = TerminationReason.CANCELLED

    def __init__(self, run_id: str) -> None:
        super().__init__(run_id)
        self.run_id = run_id


class TaskUnknown(ToolTransportError):
    """Raised when an MCP server no longer knows a task a run recorded (it restarted, its TTL passed, its session
    ended): the call is lost, as a lost worker's is (worker/mcp_tasks.py)."""


class CallHandedOver(BaseException):
    """Raised by a tool call a hand-over left running, unrecorded: its MCP task (docs/usage.md, "Long tool calls as
    MCP tasks") or the child run of an agent call ("Agent trees"). The call goes to the next worker, which
    re-attaches: it polls the same task, or finds the same child. A ``BaseException`` for the reason
    ``CancelRequested`` is one."""

    def __init__(self, call_id: str) -> None:
        super().__init__(f"call {call_id} was left running for the next worker")
        self.call_id = call_id
