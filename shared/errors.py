"""The errors runbrake raises, as one tree.

    RunbrakeError
     ├── ConfigError             bad settings in the environment
     ├── SpecError               an invalid run spec (names the field)
     ├── StoreError              Redis could not be reached or answered nonsense
     ├── RunNotFound             no run with that id
     ├── TransitionRefused       a guarded transition found another status
     ├── PublishError            RabbitMQ did not take (or confirm) a message
     ├── ProviderError           the model provider failed
     └── ToolTransportError      an MCP call did not produce a result
                                  (is_cancellation: it was cut off on purpose)

    BaseException
     └── CancelRequested         internal control flow: the run's cancel key is set

``CancelRequested`` derives from ``BaseException`` on purpose, like Dramatiq's
``Interrupt`` and structlog's ``DropEvent``: no ``except Exception`` between the
probe and the runtime's ladder may swallow it (DESIGN.md section 4, layer 2).
Third-party errors are translated at the edge and chained (``raise ... from exc``).
"""

from __future__ import annotations


class RunbrakeError(Exception):
    """Raised for every error runbrake reports; catch this to catch them all."""


class ConfigError(RunbrakeError):
    """Raised when a setting in the environment cannot be used."""

    def __init__(self, variable: str, problem: str) -> None:
        super().__init__(f"{variable}: {problem}")
        self.variable = variable


class SpecError(RunbrakeError):
    """Raised when a run spec is invalid; ``field`` names the offending field."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field
        self.problem = problem


class StoreError(RunbrakeError):
    """Raised when the run store (Redis) cannot be reached or answers something unusable."""


class RunNotFound(RunbrakeError):
    """Raised when no run exists under the given id."""

    def __init__(self, run_id: str) -> None:
        super().__init__(f"no run with id {run_id!r}")
        self.run_id = run_id


class TransitionRefused(RunbrakeError):
    """Raised when a guarded transition finds the run in a status it does not accept."""

    def __init__(self, run_id: str, transition: str, found: str) -> None:
        super().__init__(f"run {run_id}: cannot {transition}, it is {found}")
        self.run_id = run_id
        self.transition = transition
        self.found = found


class PublishError(RunbrakeError):
    """Raised when RabbitMQ refuses, drops or does not confirm a published message."""


class ProviderError(RunbrakeError):
    """Raised when the model provider fails to produce a turn."""


class ToolTransportError(RunbrakeError):
    """Raised when an MCP call does not produce a result: a protocol error, a dead
    server, a timeout, or a call cut off by a cancel.

    Which of these it is shows in ``is_cancellation``, set only by
    :meth:`for_cancelled_call` (ADR-191, decision 6): call sites never compare
    codes or message text to decide what "cancelled" means.
    """

    def __init__(self, message: str, *, server: str = "", tool: str = "") -> None:
        super().__init__(message)
        self.server = server
        self.tool = tool
        self._cancellation = False

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


class CancelRequested(BaseException):
    """Raised by the runtime's probe when the run's cancel key is set; caught only by the ladder."""

    def __init__(self, run_id: str) -> None:
        super().__init__(run_id)
        self.run_id = run_id
