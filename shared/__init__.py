"""runbrake's domain: outcomes, tool results, steps, run status, the Redis run store, the timeline,
settings and errors. Knows nothing of RabbitMQ or MCP; beside it, ``shared/messaging/`` holds the RabbitMQ
contract and ``shared/operations.py`` the operations every entry point offers (docs/architecture.md,
"Layers").

Every name is imported when it is first used (module ``__getattr__``, PEP 562): ``import runbrake.shared.errors``
does not load the run store, pydantic's spec models and redis.asyncio with it, so a command that needs none
of them starts fast (docs/benchmarks.md, "CLI start-up (`bench/cli_startup.py`)")."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
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

_MODULE_OF: Final[dict[str, str]] = {
    "AsyncRunStore": "async_store",
    "CancelRequested": "errors",
    "ConfigError": "errors",
    "ProviderError": "errors",
    "PublishError": "errors",
    "RunbrakeError": "errors",
    "RunNotFound": "errors",
    "SpecError": "errors",
    "StoreError": "errors",
    "ToolArgumentsRefused": "errors",
    "ToolCallCancelled": "errors",
    "ToolTransportError": "errors",
    "TransitionRefused": "errors",
    "ToolOutcome": "outcome",
    "Appended": "records",
    "CancelRequest": "records",
    "Claim": "records",
    "Created": "records",
    "RunRecord": "records",
    "Transition": "records",
    "Settings": "settings",
    "McpServerSpec": "spec",
    "RunSpec": "spec",
    "RunStatus": "status",
    "TerminationReason": "status",
    "RunStep": "steps",
    "StepError": "steps",
    "StepKind": "steps",
    "StepReason": "steps",
    "RunStore": "store",
    "LABELS": "timeline",
    "label": "timeline",
    "outcome_label": "timeline",
    "step_outcome": "timeline",
    "ToolResult": "tool_result",
}
"""The module (under ``runbrake.shared``) each public name lives in."""

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


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # the next use is a plain attribute
    return value
