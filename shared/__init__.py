"""runbrake's domain: outcomes, tool results, steps, run status, the Redis run store, the timeline,
settings and errors. Knows nothing of RabbitMQ or MCP."""

from shared.errors import (
    CancelRequested,
    ConfigError,
    ProviderError,
    PublishError,
    RunbrakeError,
    RunNotFound,
    SpecError,
    StoreError,
    ToolTransportError,
    TransitionRefused,
)
from shared.outcome import ToolOutcome
from shared.settings import Settings
from shared.spec import McpServerSpec, RunSpec
from shared.status import RunStatus, TerminationReason
from shared.steps import RunStep, StepError, StepKind
from shared.store import CancelRequest, Created, RunRecord, RunStore, Transition
from shared.timeline import LABELS, label, outcome_label, step_outcome
from shared.tool_result import ToolResult

__all__ = [
    "LABELS",
    "CancelRequest",
    "CancelRequested",
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
    "StoreError",
    "TerminationReason",
    "ToolOutcome",
    "ToolResult",
    "ToolTransportError",
    "Transition",
    "TransitionRefused",
    "label",
    "outcome_label",
    "step_outcome",
]
