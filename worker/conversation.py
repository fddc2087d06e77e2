"""The values the tool loop, the model providers and the MCP tools pass between them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

TOOL_NAME_SEPARATOR = "__"
"""A real model sees a tool as ``<server>__<tool>`` (docs/usage.md, "Using it")."""


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One tool call a model turn asks for."""

    id: str
    server: str
    tool: str
    arguments: Mapping[str, Any] = field(default_factory=dict)

    @property
    def qualified_name(self) -> str:
        """``server.tool``, the name ``approval_required`` uses."""
        return f"{self.server}.{self.tool}"

    @property
    def model_name(self) -> str:
        """``server__tool``, the name shown to a real model."""
        return f"{self.server}{TOOL_NAME_SEPARATOR}{self.tool}"

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "server": self.server, "tool": self.tool, "arguments": dict(self.arguments)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ToolCall:
        return cls(id=data["id"], server=data["server"], tool=data["tool"], arguments=data.get("arguments", {}))


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
class ModelTurn:
    """What one model call answered: final content, tool calls, or both."""

    content: str | None
    tool_calls: tuple[ToolCall, ...] = ()


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
