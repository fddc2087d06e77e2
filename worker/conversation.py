"""The values the tool loop, the model providers and the MCP tools pass between them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from runbrake.shared.errors import RetriedAttempt

TOOL_NAME_SEPARATOR = "__"
"""A real model sees a tool as ``<server>__<tool>`` (docs/usage.md, "Using it")."""


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One tool call a model turn asks for."""

    id: str
    server: str
    tool: str
    arguments: Mapping[str, Any] = field(default_factory=dict)
    problem: str | None = None
    """Why the call cannot be executed as the model asked (a tool the run does not have, arguments that are
    not a JSON object, a tool outside the allowlist), in words the model can act on; ``None`` for a good call.
    The loop hands a call with a problem back to the model as a failed tool step (``invalid_call``)."""

    @property
    def qualified_name(self) -> str:
        """``server.tool``, the name ``approval_required`` uses."""
        return f"{self.server}.{self.tool}"

    @property
    def model_name(self) -> str:
        """``server__tool``, the name shown to a real model."""
        return f"{self.server}{TOOL_NAME_SEPARATOR}{self.tool}"

    def to_dict(self) -> dict[str, Any]:
        data = {"id": self.id, "server": self.server, "tool": self.tool, "arguments": dict(self.arguments)}
        if self.problem is not None:
            data["problem"] = self.problem
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ToolCall:
        return cls(id=data["id"], server=data["server"], tool=data["tool"], arguments=data.get("arguments", {}),
                   problem=data.get("problem"))


@dataclass(frozen=True, slots=True)
class ToolInfo:
    """One tool an MCP server offers, as discovered at the start of a segment."""

    server: str
    name: str
    description: str = ""
    input_schema: Mapping[str, Any] = field(default_factory=lambda: {"type": "object"})

    @property
    def model_name(self) -> str:
        return f"{self.server}{TOOL_NAME_SEPARATOR}{self.name}"


@dataclass(frozen=True, slots=True)
class Usage:
    """The tokens one model call used, as the provider reported them."""

    input_tokens: int = 0
    output_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.input_tokens + self.output_tokens

    def to_dict(self) -> dict[str, int]:
        return {"input_tokens": self.input_tokens, "output_tokens": self.output_tokens,
                "total_tokens": self.total_tokens}


@dataclass(frozen=True, slots=True)
class ModelSettings:
    """How the model is asked (the spec's ``model_settings`` after the catalog's defaults and caps); each is
    passed to the provider where it has the notion, ``None`` leaves the provider's own default."""

    temperature: float | None = None
    top_p: float | None = None
    max_output_tokens: int | None = None
    stop: tuple[str, ...] | None = None
    seed: int | None = None
    tool_choice: Literal["auto", "none", "required"] | None = None
    parallel_tool_calls: bool | None = None
    output_schema: Mapping[str, Any] | None = None
    """A JSON Schema the final answer must match (the provider's structured-output option where it has one)."""
    timeout_s: float | None = None
    """Seconds one HTTP request to the model may take (``None``: the provider's default)."""


NO_SETTINGS = ModelSettings()


@dataclass(frozen=True, slots=True)
class ModelTurn:
    """What one model call answered: final content, tool calls, or both."""

    content: str | None
    tool_calls: tuple[ToolCall, ...] = ()
    usage: Usage | None = None
    """The call's tokens, when the provider reported them."""
    attempts: int = 1
    """Requests made for this turn: 1, or more when earlier ones failed with an error worth retrying."""
    retried: tuple[RetriedAttempt, ...] = ()
    """The attempts that failed and were retried before this one, in order."""


@dataclass(frozen=True, slots=True)
class Message:
    """One entry of the conversation shown to the model (chat-completions shaped)."""

    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "role": self.role,
            "content": self.content,
            "tool_calls": [c.to_dict() for c in self.tool_calls],
            "tool_call_id": self.tool_call_id,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Message:
        return cls(
            role=data["role"],
            content=data.get("content"),
            tool_calls=tuple(ToolCall.from_dict(c) for c in data.get("tool_calls", [])),
            tool_call_id=data.get("tool_call_id"),
        )
