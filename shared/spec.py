"""The run spec: what a backend service hands over (DESIGN.md section 6).

``RunSpec.parse`` validates a JSON-shaped dict and raises :class:`SpecError`
naming the first offending field, before anything is written or sent.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from runbrake.shared.errors import SpecError

DEFAULT_MAX_ROUNDS = 8
DEFAULT_TOOL_TIMEOUT_S = 60.0
_SERVER_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_TOP_LEVEL = {"input", "model", "mcp_servers", "max_rounds", "approval_required", "idempotency_key",
              "tool_timeout_s"}


@dataclass(frozen=True, slots=True)
class ScriptedToolCall:
    """One tool call a scripted turn asks for."""

    server: str
    tool: str
    arguments: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ScriptedTurn:
    """One deterministic model turn: content, tool calls, a stand-in latency or a stand-in failure."""

    content: str | None = None
    tool_calls: tuple[ScriptedToolCall, ...] = ()
    delay_ms: int = 0
    fail: str | None = None


@dataclass(frozen=True, slots=True)
class ScriptedModel:
    """The ``scripted`` provider: turns played in order, one per model call."""

    turns: tuple[ScriptedTurn, ...]
    provider: str = "scripted"


@dataclass(frozen=True, slots=True)
class OpenAIModel:
    """The ``openai`` provider: any OpenAI-compatible chat-completions endpoint."""

    base_url: str
    model: str
    api_key_env: str | None = None
    provider: str = "openai"


ModelSpec = ScriptedModel | OpenAIModel


@dataclass(frozen=True, slots=True)
class McpServerSpec:
    """How to reach one MCP server: streamable HTTP (``url``) or stdio (``command``)."""

    name: str
    url: str | None = None
    command: str | None = None
    args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)

    @property
    def transport(self) -> str:
        """``http`` or ``stdio``."""
        return "http" if self.url is not None else "stdio"


@dataclass(frozen=True, slots=True)
class RunSpec:
    """A validated run spec."""

    input: str
    model: ModelSpec
    mcp_servers: Mapping[str, McpServerSpec]
    max_rounds: int = DEFAULT_MAX_ROUNDS
    approval_required: frozenset[str] = frozenset()
    idempotency_key: str | None = None
    tool_timeout_s: float = DEFAULT_TOOL_TIMEOUT_S
    raw: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)
    """The spec as it was given, stored with the run."""

    @classmethod
    def parse(cls, data: object) -> RunSpec:
        """Validate ``data`` (a JSON-shaped dict).

        Raises:
            SpecError: naming the first field that is missing, of the wrong type or out of range.
        """
        spec = _mapping(data, "spec")
        unknown = sorted(set(spec) - _TOP_LEVEL)
        if unknown:
            raise SpecError(unknown[0], "unknown field")
        text = spec.get("input")
        if not isinstance(text, str) or not text.strip():
            raise SpecError("input", "must be a non-empty string")
        servers = _servers(spec.get("mcp_servers", {}))
        model = _model(spec.get("model"), servers)
        max_rounds = _int(spec.get("max_rounds", DEFAULT_MAX_ROUNDS), "max_rounds", low=1, high=1000)
        approval = _approval(spec.get("approval_required", []), servers)
        key = spec.get("idempotency_key")
        if key is not None and (not isinstance(key, str) or not key or len(key) > 200):
            raise SpecError("idempotency_key", "must be a string of 1 to 200 characters")
        timeout = spec.get("tool_timeout_s", DEFAULT_TOOL_TIMEOUT_S)
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not (
            0 < timeout <= 86_400 and math.isfinite(timeout)
        ):
            raise SpecError("tool_timeout_s", "must be a number of seconds in (0, 86400]")
        return cls(
            input=text,
            model=model,
            mcp_servers=servers,
            max_rounds=max_rounds,
            approval_required=approval,
            idempotency_key=key,
            tool_timeout_s=float(timeout),
            raw=json.loads(json.dumps(spec)),
        )

    @classmethod
    def from_json(cls, text: str) -> RunSpec:
        """Parse and validate a JSON document.

        Raises:
            SpecError: on invalid JSON (field ``spec``) or an invalid spec.
        """
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise SpecError("spec", f"not valid JSON ({exc.msg} at line {exc.lineno})") from exc
        return cls.parse(data)

    def to_json(self) -> str:
        """The spec as stored with the run."""
        return json.dumps(self.raw, sort_keys=True)


def _mapping(value: object, name: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise SpecError(name, "must be an object")
    return value


def _int(value: object, name: str, *, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise SpecError(name, f"must be an integer from {low} to {high}")
    return value


def _str_list(value: object, name: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise SpecError(name, "must be a list of strings")
    return tuple(value)


def _servers(value: object) -> dict[str, McpServerSpec]:
    servers = _mapping(value, "mcp_servers")
    parsed: dict[str, McpServerSpec] = {}
    for name, raw in servers.items():
        where = f"mcp_servers.{name}"
        if not _SERVER_NAME.fullmatch(name) or "__" in name:
            raise SpecError(where, "server names use letters, digits, '-' and '_' (no '__'), at most 64")
        entry = _mapping(raw, where)
        unknown = sorted(set(entry) - {"url", "command", "args", "env"})
        if unknown:
            raise SpecError(f"{where}.{unknown[0]}", "unknown field")
        url, command = entry.get("url"), entry.get("command")
        if (url is None) == (command is None):
            raise SpecError(where, "needs exactly one of 'url' (streamable HTTP) or 'command' (stdio)")
        if url is not None:
            if not isinstance(url, str) or not url.startswith(("http://", "https://")):
                raise SpecError(f"{where}.url", "must be an http:// or https:// URL")
            if "args" in entry or "env" in entry:
                raise SpecError(where, "'args' and 'env' belong to a stdio server ('command')")
            parsed[name] = McpServerSpec(name=name, url=url)
            continue
        if not isinstance(command, str) or not command:
            raise SpecError(f"{where}.command", "must be a non-empty string")
        args = _str_list(entry.get("args", []), f"{where}.args")
        env = _mapping(entry.get("env", {}), f"{where}.env")
        if not all(isinstance(v, str) for v in env.values()):
            raise SpecError(f"{where}.env", "values must be strings")
        parsed[name] = McpServerSpec(name=name, command=command, args=args, env=dict(env))
    return parsed


def _model(value: object, servers: Mapping[str, McpServerSpec]) -> ModelSpec:
    model = _mapping(value, "model")
    provider = model.get("provider")
    if provider == "scripted":
        turns = model.get("turns")
        if not isinstance(turns, list) or not turns:
            raise SpecError("model.turns", "must be a non-empty list")
        return ScriptedModel(turns=tuple(_turn(t, f"model.turns[{i}]", servers) for i, t in enumerate(turns)))
    if provider == "openai":
        for key in ("base_url", "model"):
            if not isinstance(model.get(key), str) or not model[key]:
                raise SpecError(f"model.{key}", "must be a non-empty string")
        if not str(model["base_url"]).startswith(("http://", "https://")):
            raise SpecError("model.base_url", "must be an http:// or https:// URL")
        key_env = model.get("api_key_env")
        if key_env is not None and (not isinstance(key_env, str) or not key_env):
            raise SpecError("model.api_key_env", "must be the name of an environment variable")
        return OpenAIModel(base_url=model["base_url"], model=model["model"], api_key_env=key_env)
    raise SpecError("model.provider", "must be 'scripted' or 'openai'")


def _turn(value: object, where: str, servers: Mapping[str, McpServerSpec]) -> ScriptedTurn:
    turn = _mapping(value, where)
    unknown = sorted(set(turn) - {"content", "tool_calls", "delay_ms", "fail"})
    if unknown:
        raise SpecError(f"{where}.{unknown[0]}", "unknown field")
    content = turn.get("content")
    if content is not None and not isinstance(content, str):
        raise SpecError(f"{where}.content", "must be a string")
    fail = turn.get("fail")
    if fail is not None and (not isinstance(fail, str) or not fail):
        raise SpecError(f"{where}.fail", "must be a non-empty message")
    delay = _int(turn.get("delay_ms", 0), f"{where}.delay_ms", low=0, high=3_600_000)
    raw_calls = turn.get("tool_calls", [])
    if not isinstance(raw_calls, list):
        raise SpecError(f"{where}.tool_calls", "must be a list")
    calls = []
    for j, raw in enumerate(raw_calls):
        at = f"{where}.tool_calls[{j}]"
        call = _mapping(raw, at)
        server, tool = call.get("server"), call.get("tool")
        if not isinstance(server, str) or server not in servers:
            raise SpecError(f"{at}.server", "must name a server in mcp_servers")
        if not isinstance(tool, str) or not tool:
            raise SpecError(f"{at}.tool", "must be a non-empty string")
        arguments = _mapping(call.get("arguments", {}), f"{at}.arguments")
        calls.append(ScriptedToolCall(server=server, tool=tool, arguments=dict(arguments)))
    if content is None and not calls and fail is None:
        raise SpecError(where, "needs 'content', 'tool_calls' or 'fail'")
    return ScriptedTurn(content=content, tool_calls=tuple(calls), delay_ms=delay, fail=fail)


def _approval(value: object, servers: Mapping[str, McpServerSpec]) -> frozenset[str]:
    names = _str_list(value, "approval_required")
    for i, name in enumerate(names):
        server, dot, tool = name.partition(".")
        if not dot or not tool or server not in servers:
            raise SpecError(f"approval_required[{i}]", "must be '<server>.<tool>' with a server in mcp_servers")
    return frozenset(names)
