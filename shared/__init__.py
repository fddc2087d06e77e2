"""runbrake's domain: outcomes, tool results, steps, run status, the Redis run store, the timeline,
settings and errors. Knows nothing of RabbitMQ or MCP; beside it, ``shared/messaging/`` holds the RabbitMQ
contract and ``shared/operations.py`` the operations every entry point offers (docs/architecture.md,
"Layers")."""

from runbrake.shared.async_store import AsyncRunStore
from runbrake.shared.errors import (
    CancelRequested,
    ConfigError,
    ProviderError,
    PublishError,
    RunbrakeError,
    RunNotFound,
    SpecError,
    StoreError,
    ToolArgumentsRefused,
    ToolCallCancelled,
    ToolTransportError,
    TransitionRefused,
)
from runbrake.shared.outcome import ToolOutcome
from runbrake.shared.records import Appended, CancelRequest, Claim, Created, RunRecord, Transition
from runbrake.shared.settings import Settings
from runbrake.shared.spec import McpServerSpec, RunSpec
from runbrake.shared.status import RunStatus, TerminationReason
from runbrake.shared.steps import RunStep, StepError, StepKind, StepReason
from runbrake.shared.store import RunStore
from runbrake.shared.timeline import LABELS, label, outcome_label, step_outcome
from runbrake.shared.tool_result import ToolResult

__all__ = [
    "LABELS",
    "Appended",
    "AsyncRunStore",
    "CancelRequest",
    "CancelRequested",
    "Claim",
    "ConfigError",
    "Created",
    "McpServerSpec",
    "ProviderError",
    "PublishError",
    "RunNotFound",
    "RunRecord",
    "RunSpec",
    "RunStatus",
    "RunStep",
    "RunStore",
    "RunbrakeError",
    "Settings",
    "SpecError",
    "StepError",
    "StepKind",
    "StepReason",
    "StoreError",
    "TerminationReason",
    "ToolArgumentsRefused",
    "ToolCallCancelled",
    "ToolOutcome",
    "ToolResult",
    "ToolTransportError",
    "Transition",
    "TransitionRefused",
    "label",
    "outcome_label",
    "step_outcome",
]
