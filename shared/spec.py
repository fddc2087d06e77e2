"""The run spec: what a backend service hands over (docs/architecture.md).

The spec is a pydantic model. ``RunSpec.parse`` and ``RunSpec.from_json`` validate a whole
spec and raise one :class:`SpecError` that names every offending field, before anything is
written or sent. :func:`run_spec_json_schema` states the same contract as a JSON Schema
(Draft 2020-12); ``runbrake schema`` prints it and docs/run-spec.schema.json holds a copy.

The model providers and MCP transports are registered here, beside their spec models, in the registries of
shared/registry.py; the spec's tagged unions are built from those (docs/pitfalls.md, "Adding a model
provider or transport").
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Callable, Iterable, Mapping
from enum import StrEnum
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Final, Literal, Protocol, Self, TypeAlias, Union

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    GetCoreSchemaHandler,
    GetPydanticSchema,
    PrivateAttr,
    Tag,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic.dataclasses import dataclass
from pydantic.json_schema import SkipJsonSchema

from runbrake.shared.errors import FieldProblem, SpecError
from runbrake.shared.registry import PROVIDERS, TRANSPORTS, Entry, Registry, Shown, either

__all__ = [
    "AGENT_SERVER",
    "DEFAULT_MAX_ROUNDS",
    "DEFAULT_TOOL_TIMEOUT_S",
    "VARIABLE_PATTERN",
    "AnthropicModel",
    "BudgetSpec",
    "CatalogModelSpec",
    "CatalogServerSpec",
    "HistoryMessage",
    "HistoryToolCall",
    "HttpServerSpec",
    "McpServerSpec",
    "ModelSettingsSpec",
    "ModelSpec",
    "OnCancel",
    "OpenAIModel",
    "ProviderSpec",
    "RunSpec",
    "ScriptedModel",
    "ScriptedToolCall",
    "ScriptedTurn",
    "ServerSpec",
    "StdioServerSpec",
    "TaskUse",
    "TenantNames",
    "parse_label_filters",
    "run_spec_json_schema",
    "variables_in",
]

MAX_LABELS: Final = 16
LABEL_KEY: Final = re.compile(r"[a-z0-9_.-]{1,63}")
"""A label's key (docs/usage.md, "Labels"): lowercase letters, digits, '_', '.', '-'; never ':' or '=', which
split a filter (``runbrake runs --label K=V``, ``GET /v1/runs?label=K:V``)."""
MAX_LABEL_VALUE_CHARS: Final = 256
MAX_STOP_SEQUENCES: Final = 4

DEFAULT_MAX_ROUNDS: Final = 8
DEFAULT_TOOL_TIMEOUT_S: Final = 60.0
DEFAULT_MAX_STEPS: Final = 200
SCHEMA_ID: Final = "urn:runbrake:run-spec"
"""The schema's ``$id``: a name, not a location (the file lives in docs/run-spec.schema.json)."""

_SERVER_NAME: Final = re.compile(r"[A-Za-z0-9_-]{1,64}")
_SERVERS_CONTEXT: Final = "runbrake.spec.servers"
"""Validation-context key: the server names the spec declares, for the checks of references to them."""


# -- the rules that are not plain bounds -----------------------------------------------------------


def _refuse(problem: str) -> ValueError:
    """A broken rule of runbrake's own: pydantic reports a ValueError raised in a validator as a
    ``value_error`` at the value, and :func:`problems_of` shows ``problem`` as it is."""
    return ValueError(problem)


def _refuse_at(loc: tuple[str | int, ...], problem: str, value: object) -> ValidationError:
    """The same at ``loc`` below the value being validated: pydantic re-roots a ValidationError raised in
    a validator there, where a ValueError can only point at the value itself."""
    return ValidationError.from_exception_data(
        "RunSpec", [{"type": "value_error", "loc": loc, "input": value, "ctx": {"error": problem}}]
    )


def _in_a_whole_spec(info: ValidationInfo) -> bool:
    """Whether a part is validated as part of a spec (by RunSpec), not built on its own."""
    return isinstance(info.context, dict) and _SERVERS_CONTEXT in info.context


def _declared_servers(info: ValidationInfo) -> frozenset[str] | None:
    """The server names the spec declares; None for a part built on its own, or when mcp_servers is
    itself invalid (its own error says so; references cannot be checked against it)."""
    servers = info.context.get(_SERVERS_CONTEXT) if isinstance(info.context, dict) else None
    return servers if isinstance(servers, frozenset) else None


def _text(value: str) -> str:
    if not value.strip():
        raise _refuse("must not be empty or only whitespace")
    return value


def _http_url(value: str) -> str:
    if not value.startswith(("http://", "https://")):
        raise _refuse("must be an http:// or https:// URL")
    return value


def _server_name(value: str) -> str:
    # Names become tool names shown to a model (<server>__<tool>): no '__', no line breaks.
    if not _SERVER_NAME.fullmatch(value) or "__" in value:
        raise _refuse("server names are 1 to 64 letters, digits, '-' or '_', without '__'")
    return value


def _known_server(value: str, info: ValidationInfo) -> str:
    servers = _declared_servers(info)
    if servers is not None and value not in servers:
        raise _refuse("must name a server in mcp_servers")
    return value


def _approval_entry(value: str, info: ValidationInfo) -> str:
    server, dot, tool = value.partition(".")
    if not dot or not server or not tool:
        raise _refuse("must be '<server>.<tool>'")
    servers = _declared_servers(info)
    if servers is not None and server not in servers:
        raise _refuse(f"names the server {server!r}, which is not in mcp_servers")
    return value


def _tenant_name(value: str) -> str:
    if not LABEL_KEY.fullmatch(value):
        raise _refuse("a tenant is 1 to 63 of a-z, 0-9, '_', '.', '-'")
    return value


def _some_tenants(value: tuple[str, ...]) -> tuple[str, ...]:
    if not value:
        raise _refuse("names no tenant: name at least one, or leave it out for an entry every run may use")
    return value


TenantNames = Annotated[
    tuple[Annotated[str, AfterValidator(_tenant_name)], ...],
    Field(strict=False, max_length=1_000),
    AfterValidator(_some_tenants),
]
"""A catalog entry's ``tenants``: the tenants whose runs may use it, 1 to 1,000 names (docs/security.md,
"Tenants"). An entry without it is every run's."""


_Text = Annotated[str, AfterValidator(_text), WithJsonSchema({"type": "string", "minLength": 1, "pattern": r"\S"})]
_NonEmpty = Annotated[str, Field(min_length=1)]
_HttpUrl = Annotated[str, AfterValidator(_http_url), WithJsonSchema({"type": "string", "pattern": "^https?://"})]
_ServerName = Annotated[
    str,
    AfterValidator(_server_name),
    # "not" rather than an anchored pattern: '$' also matches before a final line break in some regex dialects.
    WithJsonSchema({"type": "string", "minLength": 1, "maxLength": 64, "not": {"pattern": "[^A-Za-z0-9_-]|__"}}),
]
_ServerRef = Annotated[str, AfterValidator(_known_server)]


def _webhook_name(value: str) -> str:
    if not _SERVER_NAME.fullmatch(value) or "__" in value:
        raise _refuse("webhook names are 1 to 64 letters, digits, '-' or '_' (a name of the operator's catalog, "
                      "never a URL)")
    return value


_WebhookName = Annotated[
    str, AfterValidator(_webhook_name),
    WithJsonSchema({"type": "string", "minLength": 1, "maxLength": 64, "not": {"pattern": "[^A-Za-z0-9_-]|__"}}),
]
_ApprovalEntry = Annotated[
    str, AfterValidator(_approval_entry), WithJsonSchema({"type": "string", "pattern": r"^[A-Za-z0-9_-]+\.[\s\S]"})
]


MAX_NOTIFY: Final = 8
"""Webhooks one spec may name in ``notify``."""

_LIST_AS_TUPLE: Final = Field(strict=False)
"""For tuple fields: the before-validators of the model and server unions hand JSON arrays on as Python
lists, which a strict tuple refuses; only the container is lax, its items stay strict."""


_SPEC_CONFIG: Final = ConfigDict(extra="forbid", strict=True, use_attribute_docstrings=True)
"""Every part of the spec: unknown keys refused, no coercion ("8" is no integer, true no number),
field docstrings as the JSON Schema's descriptions."""


class SpecModel(BaseModel):
    """A part of the run spec with the spec's rules, immutable."""

    model_config = ConfigDict(**_SPEC_CONFIG, frozen=True)


def _require(*names: str) -> Callable[[dict[str, Any]], None]:
    """A ``json_schema_extra`` hook: these fields have defaults in Python but are required in the JSON."""

    def extra(schema: dict[str, Any]) -> None:
        schema["required"] = [*names, *(name for name in schema.get("required", []) if name not in names)]

    return extra


def _without_unique_items(schema: dict[str, Any]) -> None:
    # Repeating an approval entry is harmless, so the schema does not refuse it either.
    schema.pop("uniqueItems", None)


def _non_empty(turns: tuple[ScriptedTurn, ...]) -> tuple[ScriptedTurn, ...]:
    # A check after the items, not Field(min_length=1): that one also fires, wrongly, when items failed.
    if not turns:
        raise _refuse("needs at least one turn")
    return turns


# -- the model -------------------------------------------------------------------------------------
# The model side is made of (pydantic) dataclasses, as before, so that they can still be built
# positionally: ScriptedToolCall("calc", "get-sum", {"a": 2}). A BaseModel takes keywords only, and a
# custom __init__ would be called by validation too, losing the validation context.


@dataclass(frozen=True, config=_SPEC_CONFIG)
class ScriptedToolCall:
    """One tool call a scripted turn asks for."""

    server: _ServerRef
    """The MCP server to call: a key of mcp_servers."""
    tool: _NonEmpty
    """The tool's name on that server."""
    arguments: dict[str, Any] = Field(default_factory=dict)
    """The tool's arguments (a JSON object)."""


@dataclass(frozen=True, config=ConfigDict(**_SPEC_CONFIG, json_schema_extra={"anyOf": [
    {"required": ["content"], "properties": {"content": {"type": "string"}}},
    {"required": ["tool_calls"], "properties": {"tool_calls": {"minItems": 1}}},
    {"required": ["fail"], "properties": {"fail": {"type": "string"}}},
]}))
class ScriptedTurn:
    """One deterministic model turn: content, tool calls, a stand-in latency or a stand-in failure."""

    content: str | None = None
    """The model's answer text."""
    tool_calls: Annotated[tuple[ScriptedToolCall, ...], _LIST_AS_TUPLE] = ()
    """The tool calls the model asks for."""
    delay_ms: Annotated[int, Field(ge=0, le=3_600_000)] = 0
    """How long the model takes to answer, in milliseconds (a stand-in latency)."""
    fail: _NonEmpty | None = None
    """Make this model call fail with this message (a stand-in provider failure)."""

    @model_validator(mode="after")
    def _says_something(self) -> Self:
        if self.content is None and not self.tool_calls and self.fail is None:
            raise _refuse("needs 'content', 'tool_calls' or 'fail'")
        return self


@dataclass(frozen=True, config=ConfigDict(**_SPEC_CONFIG, json_schema_extra=_require("provider")))
class ScriptedModel:
    """The 'scripted' provider: turns played in order, one per model call."""

    turns: Annotated[
        tuple[ScriptedTurn, ...], _LIST_AS_TUPLE, AfterValidator(_non_empty), Field(json_schema_extra={"minItems": 1})
    ]
    """The turns, played one per model call."""
    provider: Literal["scripted"] = "scripted"
    """Deterministic turns, for tests and demos."""


def _only_in_a_catalog(value: object, info: ValidationInfo) -> object:
    if _in_a_whole_spec(info):
        raise _refuse("unknown field (only an operator's catalog sets it)")
    return value


# A catalog model's retry and timeout overrides (docs/leases.md, "Retries"); in a run spec they are
# refused like a server's catalog-only fields: how long a worker waits on an endpoint is the operator's call.
_MaxRetries = SkipJsonSchema[Annotated[Annotated[int, Field(ge=0, le=20)] | None, BeforeValidator(_only_in_a_catalog)]]
_ModelTimeout = SkipJsonSchema[Annotated[
    Annotated[float, Field(gt=0, le=3600, allow_inf_nan=False)] | None, BeforeValidator(_only_in_a_catalog)]]
# Whether the model's answer is streamed (docs/cancellation.md, "Streaming"): the operator's call, like the above.
_Stream = SkipJsonSchema[Annotated[bool | None, BeforeValidator(_only_in_a_catalog)]]


@dataclass(frozen=True, config=ConfigDict(**_SPEC_CONFIG, json_schema_extra=_require("provider")))
class OpenAIModel:
    """The 'openai' provider: any OpenAI-compatible chat-completions endpoint."""

    base_url: _HttpUrl
    """The endpoint's base URL, e.g. https://api.openai.com/v1."""
    model: _NonEmpty
    """The model's name at that endpoint."""
    api_key_env: _NonEmpty | None = None
    """The environment variable (on the worker) that holds the API key."""
    provider: Literal["openai"] = "openai"
    """Any OpenAI-compatible chat-completions endpoint."""
    max_retries: _MaxRetries = None
    """Catalog only: retries of a failed model call (default ``RUNBRAKE_MODEL_RETRIES``)."""
    timeout_s: _ModelTimeout = None
    """Catalog only: seconds one request to the model may take as a whole, its answer read to the end (default
    120)."""
    stream: _Stream = None
    """Catalog only: ``false`` asks for the whole answer at once; by default it is streamed (``delta`` events)."""


@dataclass(frozen=True, config=ConfigDict(**_SPEC_CONFIG, json_schema_extra=_require("provider")))
class AnthropicModel:
    """The 'anthropic' provider: Anthropic's Messages API, or an endpoint compatible with it."""

    model: _NonEmpty
    """The model's name, e.g. claude-sonnet-4-5."""
    api_key_env: _NonEmpty | None = None
    """The environment variable (on the worker) that holds the API key."""
    base_url: _HttpUrl = "https://api.anthropic.com"
    """The API's base URL (without /v1)."""
    provider: Literal["anthropic"] = "anthropic"
    """Anthropic's Messages API."""
    max_retries: _MaxRetries = None
    """Catalog only: retries of a failed model call (default ``RUNBRAKE_MODEL_RETRIES``)."""
    timeout_s: _ModelTimeout = None
    """Catalog only: seconds one request to the model may take as a whole, its answer read to the end (default
    120)."""
    stream: _Stream = None
    """Catalog only: ``false`` asks for the whole answer at once; by default it is streamed (``delta`` events)."""


def _describe_endpoint(model: OpenAIModel | AnthropicModel, shown: Shown) -> dict[str, Any]:
    return {"base_url": shown.url(model.base_url), "model": model.model, "api_key_env": model.api_key_env,
            "api_key_set": None if model.api_key_env is None else shown.is_set(model.api_key_env),
            "max_retries": model.max_retries, "timeout_s": model.timeout_s, "stream": model.stream is not False}


def _endpoint_variables(model: OpenAIModel | AnthropicModel) -> tuple[str, ...]:
    return () if model.api_key_env is None else (model.api_key_env,)


PROVIDERS.register(Entry(
    tag="scripted", spec=ScriptedModel, implementation="runbrake.worker.models:ScriptedProvider",
    title="deterministic turns", inline=True, catalog=False))  # it reaches nothing: inline, never in a catalog
PROVIDERS.register(Entry(
    tag="openai", spec=OpenAIModel, implementation="runbrake.worker.models:OpenAIProvider",
    title="OpenAI-compatible endpoint", describe=_describe_endpoint, variables=_endpoint_variables))
PROVIDERS.register(Entry(
    tag="anthropic", spec=AnthropicModel, implementation="runbrake.worker.anthropic_provider:AnthropicProvider",
    title="Anthropic Messages API", describe=_describe_endpoint, variables=_endpoint_variables))


# -- the tagged unions, from the registries ---------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class _Members:
    """The members of one tagged union as its schema was built (:func:`_tagged_union`): what the
    discriminator and the one validator before it need, worked out once."""

    field: str
    tags: tuple[str, ...]
    specs: tuple[type, ...]
    implied: tuple[tuple[str, str], ...]
    """(key, tag): the keys that imply a member when the tag field is left out."""
    unknown: str
    missing: str

    @classmethod
    def of(cls, registry: Registry, tags: tuple[str, ...]) -> _Members:
        entries = [registry[tag] for tag in tags]
        implied = tuple((e.implied_by, e.tag) for e in entries if e.implied_by is not None)
        missing = (
            "needs exactly one of " + either(f"{e.implied_by!r} ({e.title})" for e in entries if e.implied_by)
            if implied else f"Field required: {registry.one_of(tags)}"
        )
        return cls(field=registry.tag_field, tags=tags, specs=tuple(e.spec for e in entries), implied=implied,
                   unknown=f"must be {registry.one_of(tags)}", missing=missing)

    def tag_of(self, value: Any) -> str | None:
        """The member to validate a part with: its tag field, else the tag its keys imply (one at most)."""
        if isinstance(value, self.specs):
            return str(getattr(value, self.field))
        if not isinstance(value, dict):
            return None
        if self.field in value:
            tag = value[self.field]
            return tag if isinstance(tag, str) else None
        implied = [tag for key, tag in self.implied if key in value]
        return implied[0] if len(implied) == 1 else None

    def check(self, value: Any) -> Any:
        """Before the union, so that each mistake gets its own message at its own field (not "unable to
        extract tag" at the part)."""
        if isinstance(value, self.specs):
            return value
        if not isinstance(value, dict):
            raise _refuse("must be an object")
        if self.field in value:
            if value[self.field] not in self.tags:
                raise _refuse_at((self.field,), self.unknown, value[self.field])
            return value
        if not self.implied:
            raise _refuse_at((self.field,), self.missing, value)
        if self.tag_of(value) is None:
            raise _refuse(self.missing)
        return value


def _tagged_union(registry: Registry, *, in_catalog: bool = False) -> GetPydanticSchema:
    """The tagged union of a registry's members (those a catalog may define, with ``in_catalog``), built
    anew whenever a model using it is rebuilt (:func:`_rebuild`), so that it follows the registry."""

    def schema(source: Any, handler: GetCoreSchemaHandler) -> Any:  # a pydantic_core CoreSchema
        members = _Members.of(registry, tuple(e.tag for e in registry if e.catalog or not in_catalog))
        if len(members.specs) == 1:
            # A union of one is its member: its own messages, and its tag field's default applies.
            return handler.generate_schema(members.specs[0])
        tagged = tuple(Annotated[spec, Tag(tag)] for tag, spec in zip(members.tags, members.specs, strict=True))
        return handler.generate_schema(Annotated[
            Union[tagged],  # noqa: UP007 - a union of a tuple of types has no '|' spelling
            Discriminator(members.tag_of),
            BeforeValidator(members.check),
        ])

    return GetPydanticSchema(schema)


class ProviderSpec(Protocol):
    """What every model provider's spec has: its tag."""

    @property
    def provider(self) -> str: ...


ModelSpec: TypeAlias = Annotated[ProviderSpec, _tagged_union(PROVIDERS)]
"""Which model provider a run uses: one of :data:`~shared.registry.PROVIDERS`."""
CatalogModelSpec: TypeAlias = Annotated[ProviderSpec, _tagged_union(PROVIDERS, in_catalog=True)]
"""A model an operator's catalog defines: a provider whose entry allows it in a catalog."""


class OnCancel(StrEnum):
    """What a cancel does to a tool call in flight (a catalog server's ``on_cancel``)."""

    INTERRUPT = "interrupt"
    """Cut off at once (the default)."""
    FINISH = "finish"
    """Let complete, up to the server's ``cancel_grace_s``; the run stops right after it."""


class OnWorkerLost(StrEnum):
    """What becomes of a tool call cut off by the loss of its worker process (a catalog server's
    ``on_worker_lost``; docs/leases.md, "Lost workers")."""

    REPORT = "report"
    """The default: the model is told the call was cut off with its outcome unknown, and decides."""
    RETRY = "retry"
    """The call is made again by the worker that takes the run up: for tools that are safe to repeat."""
    FAIL = "fail"
    """The run ends ``failed``/``lease_lost`` with the call's step recorded: for calls a person must look at."""


class TaskUse(StrEnum):
    """Which tools of a catalog server are called as MCP tasks (its ``tasks``; docs/usage.md, "Long tool calls as
    MCP tasks")."""

    AUTO = "auto"
    """The default: the tools whose ``execution.taskSupport`` is ``required``."""
    PREFER = "prefer"
    """Also the tools that say ``optional``."""
    OFF = "off"
    """None: a tool that requires a task is refused to the model as an invalid call."""

    def as_task(self, support: str | None) -> bool | None:
        """Whether a tool whose ``taskSupport`` is ``support`` is called as a task; None: it cannot be called."""
        if support == "required":
            return None if self is TaskUse.OFF else True
        return support == "optional" and self is TaskUse.PREFER


DEFAULT_CANCEL_GRACE_S: Final = 30.0
MAX_CANCEL_GRACE_S: Final = 3_600.0


class ServerSpec(SpecModel):
    """What every MCP server spec has: its name, filled in from its key in mcp_servers, and what only an
    operator's catalog may say about it (docs/security.md): which tools are allowed, how many calls
    may be in flight, the default time a call may take."""

    if TYPE_CHECKING:
        transport: str
        """Its tag: one of :data:`~shared.registry.TRANSPORTS`."""

    name: SkipJsonSchema[str] = Field(default="", exclude=True)
    """The server's key in mcp_servers (not part of the JSON object)."""
    tools: SkipJsonSchema[tuple[_NonEmpty, ...] | None] = Field(default=None, strict=False)
    """Catalog only: the tools a run may see and call; others are invisible to the model and refused."""
    max_concurrency: SkipJsonSchema[Annotated[int, Field(ge=1, le=100_000)] | None] = None
    """Catalog only: calls in flight to this server per worker process."""
    timeout_s: SkipJsonSchema[Annotated[float, Field(gt=0, le=86_400, allow_inf_nan=False)] | None] = None
    """Catalog only: the default time one call may take, in seconds."""
    on_cancel: SkipJsonSchema[OnCancel] = OnCancel.INTERRUPT
    """Catalog only: what a cancel does to a call in flight: ``interrupt`` cuts it off at once; ``finish``
    lets it complete (up to ``cancel_grace_s``), records its real result, and the run stops right after it
    (docs/usage.md, "Cancel policies")."""
    cancel_grace_s: SkipJsonSchema[Annotated[float, Field(gt=0, le=MAX_CANCEL_GRACE_S, allow_inf_nan=False)]] = (
        DEFAULT_CANCEL_GRACE_S)
    """Catalog only: how long a ``finish`` call may go on after a cancel before it is interrupted, in seconds."""
    tools_on_cancel: SkipJsonSchema[dict[_NonEmpty, OnCancel]] = Field(default_factory=dict)
    """Catalog only: ``on_cancel`` per tool of this server, over the server's own (``{slow = "finish"}``)."""
    tenants: SkipJsonSchema[TenantNames | None] = None
    """Catalog only: the tenants whose runs may use this server; left out, every run may (docs/security.md,
    "Tenants")."""
    on_worker_lost: SkipJsonSchema[OnWorkerLost] = OnWorkerLost.REPORT
    """Catalog only: what becomes of a call cut off by the loss of its worker process: ``report`` (the model is
    told), ``retry`` (made again), ``fail`` (the run fails) (docs/leases.md, "Lost workers")."""
    tools_on_worker_lost: SkipJsonSchema[dict[_NonEmpty, OnWorkerLost]] = Field(default_factory=dict)
    """Catalog only: ``on_worker_lost`` per tool of this server, over the server's own (``{get-sum = "retry"}``)."""
    tasks: SkipJsonSchema[TaskUse] = TaskUse.AUTO
    """Catalog only: which tools are called as MCP tasks: ``auto`` (those that require it), ``prefer`` (also those
    that offer it), ``off`` (none; a tool that requires it is refused) (docs/usage.md, "Long tool calls as MCP
    tasks")."""

    @field_validator("name", mode="before")
    @classmethod
    def _not_in_the_json(cls, value: object, info: ValidationInfo) -> object:
        if _in_a_whole_spec(info):
            raise _refuse("unknown field (a server's name is its key in mcp_servers)")
        return value

    # check_fields=False: 'headers' belongs to the HTTP server only.
    @field_validator("tools", "max_concurrency", "timeout_s", "on_cancel", "cancel_grace_s", "tools_on_cancel",
                     "tenants", "on_worker_lost", "tools_on_worker_lost", "tasks", "headers", mode="before",
                     check_fields=False)
    @classmethod
    def _catalog_only(cls, value: object, info: ValidationInfo) -> object:
        if _in_a_whole_spec(info):
            raise _refuse("unknown field (only an operator's catalog sets it)")
        return value

    def where(self) -> str:
        """Where the server is, for messages: its URL, its command."""
        raise NotImplementedError

    def worker_lost_policy(self, tool: str) -> OnWorkerLost:
        """What becomes of a call of ``tool`` cut off by the loss of its worker process."""
        return self.tools_on_worker_lost.get(tool, self.on_worker_lost)

    def cancel_grace(self, tool: str) -> float | None:
        """How long a call of ``tool`` may go on after a cancel: None when it is interrupted at once."""
        policy = self.tools_on_cancel.get(tool, self.on_cancel)
        return self.cancel_grace_s if policy is OnCancel.FINISH else None


class HttpServerSpec(ServerSpec):
    """An MCP server over streamable HTTP."""

    transport: Literal["http"] = "http"
    """Streamable HTTP; may be left out when 'url' is given."""
    url: _HttpUrl
    """The server's MCP endpoint, e.g. http://127.0.0.1:3001/mcp."""
    headers: SkipJsonSchema[dict[str, str]] = Field(default_factory=dict)
    """Catalog only: HTTP headers sent to the server; ``${VAR}`` is expanded from the worker's environment
    when it connects, never written anywhere."""

    def where(self) -> str:
        return self.url


class StdioServerSpec(ServerSpec):
    """An MCP server the worker starts as a subprocess and talks to over stdio."""

    transport: Literal["stdio"] = "stdio"
    """stdio; may be left out when 'command' is given."""
    command: _NonEmpty
    """The program to start."""
    args: Annotated[tuple[str, ...], _LIST_AS_TUPLE] = ()
    """Its arguments."""
    env: dict[str, str] = Field(default_factory=dict)
    """Environment variables for it, on top of a safe default set (PATH, HOME, ...), never the worker's own."""

    def where(self) -> str:
        return f"stdio: {self.command}"


def _describe_http(server: HttpServerSpec, shown: Shown) -> dict[str, Any]:
    return {"url": shown.url(server.url), "headers": {k: shown.secret(v) for k, v in server.headers.items()}}


def _describe_stdio(server: StdioServerSpec, shown: Shown) -> dict[str, Any]:
    return {"command": server.command, "args": list(server.args),
            "env": {k: shown.secret(v, literal_is_secret=shown.secret_name(k)) for k, v in server.env.items()}}


VARIABLE_PATTERN: Final = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
"""A ``${VAR}`` reference in a catalog's header or env value (expanded in the worker: shared/catalog.py)."""


def variables_in(template: str) -> list[str]:
    """The variables a ``${VAR}`` template names."""
    return VARIABLE_PATTERN.findall(template)


def _variables(templates: Iterable[str]) -> list[str]:
    return [name for template in templates for name in variables_in(template)]


TRANSPORTS.register(Entry(
    tag="http", spec=HttpServerSpec, implementation="runbrake.worker.mcp_transport:http_target",
    title="streamable HTTP", implied_by="url", describe=_describe_http,
    variables=lambda server: _variables(server.headers.values())))
TRANSPORTS.register(Entry(
    tag="stdio", spec=StdioServerSpec, implementation="runbrake.worker.mcp_transport:stdio_target",
    title="stdio", implied_by="command", describe=_describe_stdio,
    variables=lambda server: _variables(server.env.values())))

McpServerSpec: TypeAlias = Annotated[ServerSpec, _tagged_union(TRANSPORTS)]
"""How to reach one MCP server: one of :data:`~shared.registry.TRANSPORTS`."""
CatalogServerSpec: TypeAlias = Annotated[ServerSpec, _tagged_union(TRANSPORTS, in_catalog=True)]
"""An MCP server an operator's catalog defines: a transport whose entry allows it in a catalog."""

_CATALOG_NAME: Final = re.compile(r"[A-Za-z0-9_-]{1,64}")


def _catalog_name(value: str) -> str:
    if not _CATALOG_NAME.fullmatch(value) or "__" in value:
        raise _refuse("catalog names are 1 to 64 letters, digits, '-' or '_', without '__'")
    return value


_CatalogName = Annotated[
    str, AfterValidator(_catalog_name),
    WithJsonSchema({"type": "string", "minLength": 1, "maxLength": 64, "not": {"pattern": "[^A-Za-z0-9_-]|__"}}),
]


def _form(value: Any) -> str:
    """Which form a reference takes: a catalog name (a string, or a list of them) or an inline definition."""
    return "catalog" if isinstance(value, str | list | tuple) else "inline"


ModelRef: TypeAlias = Annotated[
    Annotated[_CatalogName, Tag("catalog")] | Annotated[ModelSpec, Tag("inline")],
    Discriminator(_form),
]
"""A model: the name of one in the operator's catalog, or inline (``scripted``; ``openai`` and ``anthropic``
only where inline definitions are allowed)."""

ServersRef: TypeAlias = Annotated[
    Annotated[tuple[_CatalogName, ...], Tag("catalog"), _LIST_AS_TUPLE]
    | Annotated[dict[_ServerName, McpServerSpec], Tag("inline")],
    Discriminator(_form),
]
"""The MCP servers: names in the operator's catalog, or inline definitions by name (development only)."""

_TAGGED_UNIONS: Final[tuple[tuple[tuple[str | None, ...], frozenset[str] | Registry], ...]] = (
    (("model",), frozenset({"catalog", "inline"})),
    (("model",), PROVIDERS),
    (("mcp_servers",), frozenset({"catalog", "inline"})),
    (("mcp_servers", None), TRANSPORTS),  # None: any server name
    (("models", None), PROVIDERS),  # the catalog's models, by name
)
"""Where the spec has a tagged union, and its tags: pydantic puts a member's tag into an error's loc
(``model.scripted.turns``), a level the JSON does not have."""

# -- the conversation before the input, how the model is asked, what it answers with --------------


def _label_key(value: str) -> str:
    if not LABEL_KEY.fullmatch(value):
        raise _refuse("label keys are 1 to 63 of a-z, 0-9, '_', '.', '-'")
    return value


_LabelKey = Annotated[
    str, AfterValidator(_label_key),
    WithJsonSchema({"type": "string", "minLength": 1, "maxLength": 63, "not": {"pattern": "[^a-z0-9_.-]"}}),
]
_LabelValue = Annotated[str, Field(max_length=MAX_LABEL_VALUE_CHARS)]


def _few_labels(labels: dict[str, str]) -> dict[str, str]:
    if len(labels) > MAX_LABELS:
        raise _refuse(f"has {len(labels)} labels; at most {MAX_LABELS}")
    return labels


def parse_label_filters(given: Iterable[str], *, separator: str) -> dict[str, str]:
    """Label filters (``KEY=VALUE`` on the command line, ``KEY:VALUE`` in a query) as the labels a run must
    carry, each key and value held to the rules of a spec's labels.

    Raises:
        SpecError: naming every filter that is malformed, and a key given twice.
    """
    labels: dict[str, str] = {}
    problems: list[FieldProblem] = []
    for index, text in enumerate(given):
        if index >= MAX_LABELS:
            problems.append(FieldProblem(loc=("label",), msg=f"at most {MAX_LABELS} label filters"))
            break
        key, found, value = text.partition(separator)
        shown = repr(text[:80])
        if not found or not LABEL_KEY.fullmatch(key):
            problems.append(FieldProblem(loc=("label", index), msg=(
                f"{shown} is not KEY{separator}VALUE with a key of 1 to 63 of a-z, 0-9, '_', '.', '-'")))
        elif len(value) > MAX_LABEL_VALUE_CHARS:
            problems.append(FieldProblem(loc=("label", index),
                                         msg=f"the value of {key!r} is longer than {MAX_LABEL_VALUE_CHARS} characters"))
        elif key in labels and labels[key] != value:
            problems.append(FieldProblem(loc=("label", index), msg=f"{key!r} is given twice with different values"))
        else:
            labels[key] = value
    if problems:
        raise SpecError.from_problems(problems)
    return labels


class ModelSettingsSpec(SpecModel):
    """How the model is asked; each setting is passed to the provider where it has the notion, and one left
    out takes the catalog model's default (``[models.NAME.defaults]``), else the provider's own."""

    temperature: Annotated[float, Field(ge=0, le=2, allow_inf_nan=False)] | None = None
    """Sampling temperature, 0 to 2."""
    top_p: Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)] | None = None
    """Nucleus sampling: the probability mass of the tokens considered, 0 to 1."""
    max_output_tokens: Annotated[int, Field(ge=1, le=10_000_000)] | None = None
    """Most tokens one model call may answer with (at most the catalog model's cap)."""
    stop: Annotated[
        tuple[Annotated[str, Field(min_length=1, max_length=256)], ...], Field(max_length=MAX_STOP_SEQUENCES),
        _LIST_AS_TUPLE,
    ] | None = None
    """Up to 4 strings at which the model stops answering."""
    seed: Annotated[int, Field(ge=-(2**63), le=2**63 - 1)] | None = None
    """Asks for deterministic sampling where the provider offers it."""
    tool_choice: Literal["auto", "none", "required"] | None = None
    """Whether the model may ('auto'), must not ('none') or must ('required') call a tool."""
    parallel_tool_calls: bool | None = None
    """Whether the model may ask for several tool calls in one turn."""

    CAPPED: ClassVar[tuple[str, ...]] = ("temperature", "top_p", "max_output_tokens")
    """The settings a catalog model may cap (an upper bound); a spec above a cap is refused."""

    def merged(self, defaults: ModelSettingsSpec | None) -> ModelSettingsSpec:
        """These settings, each one left out taken from ``defaults``."""
        if defaults is None:
            return self
        given = self.model_dump(exclude_none=True)
        return defaults.model_copy(update=given)


MAX_DEADLINE_S: Final = 30 * 86_400.0
"""The longest ``budget.deadline_s``: 30 days."""
MAX_BUDGET_TOKENS: Final = 10**12
"""The largest ``budget.max_total_tokens`` (and catalog default or cap of it)."""
MAX_BUDGET_USD: Final = 1_000_000.0
"""The largest ``budget.max_cost_usd``."""


class BudgetSpec(SpecModel):
    """What a run may spend before it is stopped by itself: cancelled, with reason ``deadline_exceeded`` or
    ``budget_exceeded`` (docs/usage.md, "Budgets")."""

    deadline_s: Annotated[float, Field(gt=0, le=MAX_DEADLINE_S, allow_inf_nan=False)] | None = None
    """Seconds of wall clock from enqueue (across segments and hand-overs) after which the run is stopped, a
    call in flight cut off."""
    max_total_tokens: Annotated[int, Field(ge=1, le=MAX_BUDGET_TOKENS)] | None = None
    """Tokens (input and output, every model call of the run) after which the run is stopped (at most the
    catalog model's cap; without one, the catalog model's default or cap)."""
    max_cost_usd: Annotated[float, Field(gt=0, le=MAX_BUDGET_USD, allow_inf_nan=False)] | None = None
    """US dollars of model calls (at the catalog model's prices, which it must have) after which the run is
    stopped."""


def _output_schema(schema: dict[str, Any]) -> dict[str, Any]:
    # A JSON Schema the answer is validated against (worker/structured.py). Only what costs linear time is
    # checked here, on whatever thread parses the spec: whether it is a valid Draft 2020-12 schema is checked at
    # admission, after its byte bound, in a child process within RUNBRAKE_SCHEMA_CHECK_S (shared/catalog.py).
    remote = _remote_ref(schema)
    if remote is not None:
        # Nothing is fetched for a run (docs/security.md, "Bounds"): a reference points into the schema itself.
        raise _refuse(f"refers outside itself ({remote[:100]!r}): only local references ('#/...') are allowed")
    return schema


def _remote_ref(schema: object) -> str | None:
    """A ``$ref`` or ``$dynamicRef`` value in a schema that does not point into it (``#…``), or None. One pass,
    without recursion: linear in the schema's size whatever its shape."""
    pending = [schema]
    while pending:
        value = pending.pop()
        if isinstance(value, dict):
            for key in ("$ref", "$dynamicRef"):
                if isinstance(ref := value.get(key), str) and not ref.startswith("#"):
                    return ref
            pending.extend(value.values())
        elif isinstance(value, list):
            pending.extend(value)
    return None


class HistoryToolCall(SpecModel):
    """A tool call an earlier assistant turn asked for."""

    id: Annotated[str, Field(min_length=1, max_length=200)]
    """The call's id, which the tool message that answers it names as its tool_call_id."""
    server: _ServerRef
    """The MCP server it called: one of the run's mcp_servers."""
    tool: Annotated[str, Field(min_length=1, max_length=200)]
    """The tool's name on that server."""
    arguments: dict[str, Any] = Field(default_factory=dict)
    """Its arguments (a JSON object)."""


class HistoryMessage(SpecModel):
    """One message of the conversation before ``input``: what the user said, what the assistant answered
    (and the tool calls it asked for), and what a tool answered."""

    role: Literal["user", "assistant", "tool"]
    """Who speaks: 'user', 'assistant' or 'tool' (a tool's result; the instructions are their own field)."""
    content: str | None = None
    """The text (a user's and a tool's message need one; an assistant's may be left out when it calls tools)."""
    tool_calls: Annotated[tuple[HistoryToolCall, ...], _LIST_AS_TUPLE, Field(max_length=128)] = ()
    """An assistant message only: the tool calls it asked for; each is answered by a tool message after it."""
    tool_call_id: Annotated[str, Field(min_length=1, max_length=200)] | None = None
    """A tool message only: the id of the call it answers."""

    @model_validator(mode="after")
    def _shaped_for_its_role(self) -> Self:
        problems: list[tuple[tuple[str | int, ...], str]] = []
        if self.role != "assistant" and self.tool_calls:
            problems.append((("tool_calls",), "only an assistant message asks for tool calls"))
        if self.role != "tool" and self.tool_call_id is not None:
            problems.append((("tool_call_id",), "only a tool message answers a call"))
        if self.role == "tool" and self.tool_call_id is None:
            problems.append((("tool_call_id",), "Field required: a tool message names the call it answers"))
        if self.role == "assistant" and self.content is None and not self.tool_calls:
            problems.append((("content",), "an assistant message needs content or tool_calls"))
        if self.role != "assistant" and self.content is None:
            problems.append((("content",), f"Field required: a {self.role} message needs content"))
        if problems:
            raise _refuse_all(problems, self)
        return self


def _refuse_all(problems: list[tuple[tuple[str | int, ...], str]], value: object) -> ValidationError:
    """Several of runbrake's own rules broken below the value: one error each, all reported at once."""
    return ValidationError.from_exception_data("RunSpec", [
        {"type": "value_error", "loc": loc, "input": value, "ctx": {"error": problem}} for loc, problem in problems
    ])


def _consistent(messages: tuple[HistoryMessage, ...]) -> tuple[HistoryMessage, ...]:
    """The history as a provider accepts it: each call id used once; the tool messages after an assistant's
    calls answer those calls, each once, before the conversation goes on; no call left unanswered."""
    problems: list[tuple[tuple[str | int, ...], str]] = []
    seen: set[str] = set()
    open_calls: dict[str, int] = {}  # id -> index of the assistant message that asked, while unanswered
    for index, message in enumerate(messages):
        if message.role == "tool":
            if message.tool_call_id in open_calls:
                del open_calls[message.tool_call_id]
            elif message.tool_call_id in seen:
                problems.append(((index, "tool_call_id"), f"{message.tool_call_id!r} is answered already"))
            else:
                problems.append(((index, "tool_call_id"), f"{message.tool_call_id!r} answers no tool call of an "
                                                          "assistant message before it"))
            continue
        problems += _unanswered(open_calls, f" before message {index}")
        open_calls.clear()
        for j, call in enumerate(message.tool_calls):
            if call.id in seen:
                problems.append(((index, "tool_calls", j, "id"), f"{call.id!r} is used by another call already"))
            seen.add(call.id)
            open_calls[call.id] = index
    problems += _unanswered(open_calls, " (input comes after the last message)")
    if problems:
        raise _refuse_all(problems, messages)
    return messages


def _unanswered(open_calls: dict[str, int], where: str) -> list[tuple[tuple[str | int, ...], str]]:
    """A problem at each assistant message whose calls are not all answered yet."""
    return [((asked, "tool_calls"), f"not answered by a tool message{where}: "
             + ", ".join(repr(call) for call, i in open_calls.items() if i == asked))
            for asked in sorted(set(open_calls.values()))]



AGENT_SERVER: Final = "agent"
"""The server part of an agent's tool name (``agent__<name>``): a run's agent calls name it as their server
(a scripted turn's ``{"server": "agent", "tool": "researcher"}``, an approval's ``agent.researcher``)."""
MAX_AGENTS: Final = 64
"""Agents one spec may name."""


def _agent_ref(value: object) -> object:
    if not isinstance(value, str):
        raise _refuse("must be the name of an agent of the operator's catalog ([agents.NAME]); a spec cannot "
                      "define an agent")
    return value


def _agents_named(value: object) -> object:
    if isinstance(value, dict):
        raise _refuse("must be a list of names of the operator's catalog agents ([agents.NAME]); a spec cannot "
                      "define an agent")
    return value


_AgentRef = Annotated[_CatalogName, BeforeValidator(_agent_ref)]


class RunSpec(SpecModel):
    """A run spec: the input, the model, the MCP servers and the bounds of one run.

    Build one with :meth:`parse` or :meth:`from_json`: they check the references between
    parts (tool calls and approvals name declared servers) and keep the spec as given.
    """

    input: _Text
    """The user's message that starts the run."""
    model: ModelRef
    """The model: the name of one in the operator's catalog, or inline: 'scripted' (deterministic turns), or
    'openai' (an OpenAI-compatible endpoint) or 'anthropic' (the Messages API), these two inline only where
    RUNBRAKE_ALLOW_INLINE=true."""
    mcp_servers: ServersRef = ()
    """The MCP servers the run may call: names in the operator's catalog (a list), or, only where
    RUNBRAKE_ALLOW_INLINE=true, inline definitions by name: streamable HTTP ('url') or stdio ('command')."""
    max_rounds: Annotated[int, Field(ge=1, le=1000)] = DEFAULT_MAX_ROUNDS
    """Model calls allowed; reaching it fails the run with reason max_rounds."""
    approval_required: Annotated[
        frozenset[_ApprovalEntry],
        Field(json_schema_extra=_without_unique_items),
    ] = frozenset()
    """Tools ('<server>.<tool>', the server a key of mcp_servers) whose calls wait for runbrake approve."""
    idempotency_key: Annotated[str, Field(min_length=1, max_length=200)] | None = None
    """The same key returns the same run and sends nothing."""
    tool_timeout_s: Annotated[float, Field(gt=0, le=86_400, allow_inf_nan=False)] = DEFAULT_TOOL_TIMEOUT_S
    """Seconds one tool call may take (at most the catalog's timeout_s for the server); a timeout is
    recorded failed."""
    max_steps: Annotated[int, Field(ge=1, le=1_000_000)] = DEFAULT_MAX_STEPS
    """Steps the run may record, all segments together (at most RUNBRAKE_MAX_STEPS_CAP); reaching it fails
    the run with reason max_steps."""
    notify: Annotated[tuple[_WebhookName, ...], _LIST_AS_TUPLE, Field(max_length=MAX_NOTIFY)] = ()
    """Webhooks of the operator's catalog ([webhooks.NAME]) told of this run's events, by name; a spec never
    gives a URL (docs/webhooks.md)."""
    instructions: _Text | None = None
    """The system prompt: how the model should behave (bounded like input, RUNBRAKE_MAX_INPUT_CHARS)."""
    messages: Annotated[
        tuple[HistoryMessage, ...], _LIST_AS_TUPLE, AfterValidator(_consistent), Field(max_length=100_000)
    ] = ()
    """The conversation before input, oldest first (at most RUNBRAKE_MAX_MESSAGES messages of
    RUNBRAKE_MAX_HISTORY_CHARS characters together); every tool message answers a call of an assistant
    message before it."""
    model_settings: ModelSettingsSpec = Field(default_factory=ModelSettingsSpec)
    """How the model is asked: temperature, top_p, max_output_tokens, stop, seed, tool_choice,
    parallel_tool_calls."""
    output_schema: Annotated[dict[str, Any], AfterValidator(_output_schema)] | None = None
    """A JSON Schema (Draft 2020-12) the final answer must match: the answer is parsed as JSON and
    validated; a mismatch is handed back to the model (bounded by max_rounds). The run's output_json holds
    the parsed answer."""
    labels: Annotated[dict[_LabelKey, _LabelValue], AfterValidator(_few_labels),
                      Field(json_schema_extra={"maxProperties": MAX_LABELS})] = Field(default_factory=dict)
    """Up to 16 key: value strings stored with the run (keys [a-z0-9_.-]{1,63}, values at most 256
    characters), e.g. a tenant or a user; runs are filtered by them."""

    budget: BudgetSpec | None = None
    """What the run may spend: deadline_s (from enqueue), max_total_tokens, max_cost_usd; reaching one
    cancels the run with reason deadline_exceeded or budget_exceeded."""

    agents: Annotated[tuple[_AgentRef, ...], _LIST_AS_TUPLE, BeforeValidator(_agents_named),
                      Field(max_length=MAX_AGENTS)] = ()
    """Agents of the operator's catalog (``[agents.NAME]``) the run may call, by name: the model sees each as the
    tool ``agent__<name>`` taking ``{"input": string}``, and each call is a child run (docs/usage.md, "Agent
    trees"). A spec never defines an agent."""

    _raw: dict[str, Any] = PrivateAttr(default_factory=dict)

    @field_validator("mcp_servers", mode="after")
    @classmethod
    def _named(
        cls, servers: tuple[str, ...] | dict[str, McpServerSpec]
    ) -> tuple[str, ...] | dict[str, McpServerSpec]:
        if isinstance(servers, tuple):
            return servers
        return {name: server.model_copy(update={"name": name}) for name, server in servers.items()}

    @property
    def raw(self) -> dict[str, Any]:
        """The spec as it was given (JSON-shaped), stored with the run."""
        return self._raw

    @classmethod
    def parse(cls, data: object) -> RunSpec:
        """Validate ``data``, a JSON-shaped dict.

        Raises:
            SpecError: naming every field that is missing, unknown, of the wrong type or out of range.
        """
        if not isinstance(data, Mapping) or not all(isinstance(key, str) for key in data):
            raise SpecError("spec", "must be a JSON object")
        try:
            text = json.dumps(dict(data))
        except (TypeError, ValueError, RecursionError) as exc:
            raise SpecError("spec", f"not JSON-shaped ({exc})") from exc
        # Validating the JSON text gives a dict in Python the same strict meaning as in a file.
        return cls.from_json(text)

    @classmethod
    def from_json(cls, text: str | bytes) -> RunSpec:
        """Parse and validate a JSON document (bytes must be UTF-8).

        Raises:
            SpecError: on bytes that are not UTF-8, text that is not JSON, JSON that is not an
                object (all as field ``spec``), or naming every invalid field.
        """
        if isinstance(text, bytes):
            try:
                text.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise SpecError("spec", f"not valid UTF-8 (byte {exc.start}: {exc.reason})") from exc
        try:
            # pydantic's own JSON parser: a depth limit (200) instead of RecursionError, lone surrogates refused.
            raw = _JSON.validate_json(text)
        except ValidationError as exc:
            raise SpecError("spec", f"not valid JSON ({_reason(exc)})") from exc
        if not isinstance(raw, dict):
            raise SpecError("spec", "must be a JSON object")
        non_finite = [FieldProblem(loc=loc, msg="is NaN or Infinity, which JSON has no number for")
                      for loc in _non_finite(raw, ())]
        if non_finite:
            # Python's and pydantic's parsers read them, but a stored NaN breaks every strict JSON reader
            # of the run (the events stream, the page): refused where they enter (docs/security.md).
            raise SpecError.from_problems(non_finite)
        servers = raw.get("mcp_servers", [])
        declared = (
            frozenset(servers) if isinstance(servers, dict)
            else frozenset(s for s in servers if isinstance(s, str)) if isinstance(servers, list) else None
        )
        if declared is not None and raw.get("agents"):
            declared |= {AGENT_SERVER}  # a run's agent calls (agent__<name>) name it as their server
        try:
            spec = cls.model_validate_json(text, context={_SERVERS_CONTEXT: declared})
        except ValidationError as exc:
            raise SpecError.from_problems(problems_of(exc)) from exc
        spec._raw = raw
        return spec

    def to_json(self) -> str:
        """The spec as stored with the run."""
        return json.dumps(self.raw, sort_keys=True)


def _rebuild() -> None:
    # The unions are built when a model's schema is: a registry change builds them again (_tagged_union).
    RunSpec.model_rebuild(force=True)


PROVIDERS.on_change(_rebuild)
TRANSPORTS.on_change(_rebuild)


def _non_finite(value: object, loc: tuple[str | int, ...]) -> list[tuple[str | int, ...]]:
    """Where in a JSON value a number is NaN or infinite (``1e999`` reads as infinity)."""
    if isinstance(value, float):
        return [] if math.isfinite(value) else [loc]
    if isinstance(value, dict):
        return [found for key, item in value.items() for found in _non_finite(item, (*loc, key))]
    if isinstance(value, list):
        return [found for index, item in enumerate(value) for found in _non_finite(item, (*loc, index))]
    return []


_JSON: Final = TypeAdapter(Any)
"""Any JSON document, as Python objects: what a spec is read as before it is validated."""


def _reason(exc: ValidationError) -> str:
    """Why the JSON parser gave up ("EOF while parsing a value at line 1 column 5")."""
    error = exc.errors(include_url=False)[0]
    return str(error.get("ctx", {}).get("error", error["msg"]))


_MESSAGES: Final = {
    # The same mistake in a model and in a dataclass gets the same words.
    "extra_forbidden": "unknown field",
    "unexpected_keyword_argument": "unknown field",
    "missing_argument": "Field required",
}


def problems_of(exc: ValidationError) -> list[FieldProblem]:
    """pydantic's errors as runbrake's problems, each at its place in the JSON."""
    return [
        FieldProblem(loc=_json_loc(error["loc"]), msg=_message(error["type"], error["msg"], error.get("ctx", {})))
        for error in exc.errors(include_url=False)
    ]


def _message(kind: str, msg: str, context: dict[str, Any]) -> str:
    if kind == "value_error":  # runbrake's own rules (see _refuse): the problem without "Value error, "
        return str(context.get("error", msg))
    return _MESSAGES.get(kind, msg)


def _json_loc(loc: tuple[str | int, ...]) -> tuple[str | int, ...]:
    parts = list(loc)
    if parts and parts[-1] == "[key]":  # an invalid key: point at the key itself
        parts.pop()
    for prefix, tags in _TAGGED_UNIONS:
        size = len(prefix)
        if (
            len(parts) > size
            and all(want is None or want == got for want, got in zip(prefix, parts, strict=False))
            and parts[size] in (tags.tags() if isinstance(tags, Registry) else tags)
        ):
            del parts[size]
    return tuple(parts)


def run_spec_json_schema() -> dict[str, Any]:
    """The run spec as a JSON Schema (Draft 2020-12), as ``runbrake schema`` prints it.

    References between parts (a tool call's or an approval's server must be declared in
    mcp_servers) are beyond JSON Schema; :meth:`RunSpec.parse` checks them.
    """
    schema = RunSpec.model_json_schema(mode="validation")
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": SCHEMA_ID,
        "title": "runbrake run spec",
        "description": (
            "What a backend service hands runbrake to start an LLM agent run. Tool calls and "
            "approval_required entries must also name servers declared in mcp_servers, which this "
            "schema cannot express; `runbrake enqueue` checks it."
        ),
        **{key: value for key, value in schema.items() if key not in {"title", "description"}},
    }
