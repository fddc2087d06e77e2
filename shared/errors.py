"""The errors runbrake raises, as one tree.

    RunbrakeError
     ├── ConfigError             bad settings in the environment
     ├── SpecError               an invalid run spec (names every offending field)
     ├── StoreError              Redis could not be reached or answered nonsense
     ├── RunNotFound             no run with that id
     ├── TransitionRefused       a guarded transition found another status
     ├── RunBoundReached         a run reached max_steps or the tool calls a turn may ask for
     ├── IdempotencyConflict     an idempotency key came again with a different spec
     ├── InvalidRunId            a malformed run id
     ├── PublishError            RabbitMQ did not take (or confirm) a message
     ├── ProviderError           the model provider failed
     └── ToolTransportError      an MCP call did not produce a result
                                  (is_cancellation: it was cut off on purpose)

    BaseException
     ├── CancelRequested         internal control flow: the run's cancel key is set
     └── OwnershipLost           internal control flow: the run is no longer this worker's

``CancelRequested`` derives from ``BaseException`` on purpose, like Dramatiq's
``Interrupt`` and structlog's ``DropEvent``: no ``except Exception`` between the
probe and the runtime's ladder may swallow it (docs/architecture.md, "Cancellation: the probe").
Third-party errors are translated at the edge and chained (``raise ... from exc``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import ClassVar

from runbrake.shared.status import TerminationReason


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


class RunNotFound(RunbrakeError):
    """Raised when no run exists under the given id; ``where`` says where it was looked for, when known."""

    def __init__(self, run_id: str, *, where: str = "") -> None:
        super().__init__(f"no run with id {run_id!r}" + (f" ({where})" if where else ""))
        self.run_id = run_id
        self.where = where


class TransitionRefused(RunbrakeError):
    """Raised when a guarded transition finds the run in a status it does not accept."""

    def __init__(self, run_id: str, transition: str, found: str) -> None:
        super().__init__(f"run {run_id}: cannot {transition}, it is {found}")
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


class IdempotencyConflict(RunbrakeError):
    """Raised when an idempotency key that created a run comes again with a different spec."""

    def __init__(self, key: str, run_id: str) -> None:
        super().__init__(f"idempotency key {key[:100]!r} already created run {run_id} from a different spec")
        self.key = key
        self.run_id = run_id


class InvalidRunId(RunbrakeError):
    """Raised when a run id is malformed (runbrake's ids are 32 lowercase hex characters)."""

    def __init__(self, value: str) -> None:
        shown = value if len(value) <= 100 else value[:100] + "…"
        super().__init__(f"not a run id: {shown!r} (run ids are 32 lowercase hex characters)")
        self.value = value


class PublishError(RunbrakeError):
    """Raised when RabbitMQ refuses, drops or does not confirm a published message."""


class ProviderError(RunbrakeError):
    """Raised when the model provider fails to produce a turn."""

    reason: TerminationReason | None = TerminationReason.PROVIDER_FAILED


class ToolTransportError(RunbrakeError):
    """Raised when an MCP call does not produce a result: a protocol error, a dead
    server, a timeout, or a call cut off by a cancel.

    Which of these it is shows in ``is_cancellation``, set only by
    :meth:`for_cancelled_call` (docs/architecture.md, "Tool outcomes"): call sites never compare
    codes or message text to decide what "cancelled" means.
    """

    def __init__(self, message: str, *, server: str = "", tool: str = "") -> None:
        super().__init__(message)
        self.server = server
        self.tool = tool
        self._cancellation = False
        self._invalid_arguments = False

    @classmethod
    def for_cancelled_call(cls, *, server: str, tool: str) -> ToolTransportError:
        """The call was cut off because its run was cancelled."""
        error = cls(f"call to {server}.{tool} was cancelled", server=server, tool=tool)
        error._cancellation = True
        return error

    @property
    def is_cancellation(self) -> bool:
        """True only for an error built by :meth:`for_cancelled_call`."""
        return self._cancellation

    @classmethod
    def for_invalid_arguments(cls, message: str, *, server: str, tool: str) -> ToolTransportError:
        """The server refused the call's arguments (JSON-RPC -32602): the caller's mistake, not the server's."""
        error = cls(message, server=server, tool=tool)
        error._invalid_arguments = True
        return error

    @property
    def is_invalid_arguments(self) -> bool:
        """True only for an error built by :meth:`for_invalid_arguments`."""
        return self._invalid_arguments


class OwnershipLost(BaseException):
    """Raised when the store refuses a worker's write because the run is no longer its own (its lease
    was reaped, another worker claimed it): the worker stops the run at once and writes nothing more.

    A ``BaseException`` for the reason :class:`CancelRequested` is one: nothing between the store and
    the runtime's ladder may swallow it.
    """

    def __init__(self, run_id: str) -> None:
        super().__init__(run_id)
        self.run_id = run_id


class CancelRequested(BaseException):
    """Raised by the runtime's probe when the run's cancel key is set; caught only by the ladder."""

    reason: ClassVar[TerminationReason] = TerminationReason.CANCELLED

    def __init__(self, run_id: str) -> None:
        super().__init__(run_id)
        self.run_id = run_id
