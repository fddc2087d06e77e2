"""The values the tool loop, the model providers and the MCP tools pass between them."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from runbrake.shared.errors import ProviderError, RetriedAttempt
from runbrake.shared.records import MAX_CALL_TOKENS

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
        """``server__tool``, the name shown to a real model; a call to no server of the run keeps the name the
        model used (``tool``), so the conversation shows it what it asked for."""
        return f"{self.server}{TOOL_NAME_SEPARATOR}{self.tool}" if self.server else self.tool

    def to_dict(self) -> dict[str, Any]:
        data = {"id": self.id, "server": self.server, "tool": self.tool, "arguments": dict(self.arguments)}
        if self.problem is not None:
            data["problem"] = self.problem
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ToolCall:
        return cls(id=data["id"], server=data["server"], tool=data["tool"], arguments=data.get("arguments", {}),
                   problem=data.get("problem"))


MAX_MODEL_TOOL_NAME_CHARS = 200
"""How much of a tool name a model made up is kept (in the call's step and the conversation)."""


def model_tool_call(call_id: str, name: str, arguments: object, servers: Collection[str]) -> ToolCall:
    """A tool call as a model named it (``<server>__<tool>``), for a provider to hand to the loop.

    A name that is not ``<server>__<tool>`` of one of ``servers``, or ``arguments`` that are not a JSON object,
    make a call with a :attr:`ToolCall.problem` (its server ``""`` when it names none of the run's): the loop
    hands it back to the model as a failed step, ``invalid_call``, and never executes it. Whether the tool
    exists on its server is the toolbox's to say (worker/toolbox.py ``Toolbox.problem``).
    """
    server, separator, tool = name.partition(TOOL_NAME_SEPARATOR)
    if not separator or not tool or server not in servers or len(name) > MAX_MODEL_TOOL_NAME_CHARS:
        shown = name[:MAX_MODEL_TOOL_NAME_CHARS]
        return ToolCall(id=call_id, server="", tool=shown, problem=f"there is no tool named {shown!r}")
    if not isinstance(arguments, dict):
        return ToolCall(id=call_id, server=server, tool=tool,
                        problem=f"the arguments of {name} must be a JSON object, not {_json_kind(arguments)}")
    return ToolCall(id=call_id, server=server, tool=tool, arguments=arguments)


def _json_kind(value: object) -> str:
    if isinstance(value, list):
        return "an array"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    return "null" if value is None else "an unknown value"


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

    @classmethod
    def reported(cls, input_tokens: int, output_tokens: int) -> Usage:
        """The usage a provider reported, refused beyond :data:`MAX_CALL_TOKENS` a count.

        Raises:
            ProviderError: a count above the bound (the answer cannot be counted as it says; it is not stored).
        """
        for name, count in (("input", input_tokens), ("output", output_tokens)):
            if count > MAX_CALL_TOKENS:
                raise ProviderError(f"the model endpoint reported {count} {name} tokens for one call; the most "
                                    f"runbrake counts is {MAX_CALL_TOKENS} (docs/security.md, \"Bounds\")")
        return cls(input_tokens=input_tokens, output_tokens=output_tokens)


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
