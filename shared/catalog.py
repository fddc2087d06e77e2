"""The operator's catalog, and admission: which MCP servers and models a run may reach.

Whoever can enqueue a run must not choose what a worker starts or where it sends its
secrets (docs/security.md). So the operator names the servers and models in a TOML file
(``RUNBRAKE_CATALOG``), and a spec names them::

    [mcp_servers.everything]
    url = "https://tools.internal/mcp"
    headers = { Authorization = "Bearer ${TOOLS_TOKEN}" }
    tools = ["get-sum", "echo"]
    max_concurrency = 16
    timeout_s = 60

    [models.default]
    provider = "openai"
    base_url = "https://api.openai.com/v1"
    model = "gpt-4.1-mini"
    api_key_env = "OPENAI_API_KEY"
    defaults = { temperature = 0.2 }      # model_settings a spec leaves out
    caps = { max_output_tokens = 4096 }   # upper bounds: a spec above one is refused

``${VAR}`` in header and env values is expanded from the worker's environment when it
connects (:func:`expand`), never before: the values are never written to Redis, logged or
put in a step. :class:`Admission` decides whether a spec may run: at enqueue (refused:
exit 2, nothing written) and again when a worker claims it (refused: ``spec_refused``).
"""

from __future__ import annotations

import datetime
import json
import math
import os
import re
import tomllib
import urllib.parse
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Final, Literal, TypeAlias

import structlog
from pydantic import Field, ValidationError, field_validator
from pydantic.json_schema import SkipJsonSchema

from runbrake.shared import redaction
from runbrake.shared.agents import AgentSpec, check_agents, height
from runbrake.shared.budget import NO_BUDGET, Budget, Prices
from runbrake.shared.errors import ConfigError, FieldProblem, SpecError
from runbrake.shared.records import Quota
from runbrake.shared.registry import PROVIDERS, TRANSPORTS, Registry
from runbrake.shared.schema_check import SCHEMA_CHECKS
from runbrake.shared.settings import Settings
from runbrake.shared.spec import (
    AGENT_SERVER,
    LABEL_KEY,
    MAX_BUDGET_TOKENS,
    VARIABLE_PATTERN,
    CatalogModelSpec,
    CatalogServerSpec,
    ModelSettingsSpec,
    ModelSpec,
    RunSpec,
    ScriptedModel,
    ServerSpec,
    SpecModel,
    TenantNames,
    problems_of,
    variables_in,
)

__all__ = ["Admission", "AdmittedRun", "Catalog", "CatalogFile", "MissingVariable", "ModelCaps", "ModelDefaults",
           "ModelPolicy", "RabbitmqUser", "Section", "TenantPolicy", "WebhookSpec", "expand", "open_to", "variables_in"]

log = structlog.get_logger(__name__)

_DEFAULTS: Final = Settings()


_ENV_NAME: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
_EVENT_PATTERN: Final = re.compile(r"\*|(run|step)\.(\*|[a-z][a-z0-9_]{0,63})")


class WebhookSpec(SpecModel):
    """A webhook the operator names (``[webhooks.NAME]``): where a run's events go, signed (docs/webhooks.md)."""

    url: Annotated[str, Field(min_length=1, max_length=2048)]
    """Where the events are POSTed: an http:// or https:// URL of the operator's (never of a spec's)."""
    secret_env: Annotated[str, Field(min_length=1, max_length=128)]
    """The environment variable on the worker that holds the signing secret (Standard Webhooks' whsec_<base64>)."""
    events: Annotated[tuple[str, ...], Field(strict=False, min_length=1, max_length=64)]
    """The event types it wants: run.completed, step.tool…, a kind's wildcard run.* or step.*, or * for all."""
    tenants: TenantNames | None = None
    """The tenants whose runs may name it in ``notify``; left out, every run may (docs/security.md, "Tenants")."""

    @field_validator("url")
    @classmethod
    def _url(cls, value: str) -> str:
        parsed = urllib.parse.urlsplit(value)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ValueError("must be an http:// or https:// URL with a host")
        return value

    @field_validator("secret_env")
    @classmethod
    def _secret_env(cls, value: str) -> str:
        if not _ENV_NAME.fullmatch(value):
            raise ValueError("must be an environment variable's name (letters, digits, '_')")
        return value

    @field_validator("events")
    @classmethod
    def _events(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for event in value:
            if not _EVENT_PATTERN.fullmatch(event):
                raise ValueError(f"{event!r} is no event type: run.<status>, step.<kind>, run.*, step.* or *")
        return value

    def wants(self, event_type: str) -> bool:
        """Whether this webhook wants events of ``event_type`` (``run.completed``, ``step.tool``…)."""
        kind = event_type.partition(".")[0]
        return any(p in ("*", event_type, f"{kind}.*") for p in self.events)


class ModelCaps(SpecModel):
    """Upper bounds a catalog model puts on a spec's model_settings and budget (``[models.NAME.caps]``)."""

    temperature: Annotated[float, Field(ge=0, le=2, allow_inf_nan=False)] | None = None
    top_p: Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)] | None = None
    max_output_tokens: Annotated[int, Field(ge=1, le=10_000_000)] | None = None
    """Also the value sent when neither the spec nor the defaults set one: every call is bounded."""
    max_total_tokens: Annotated[int, Field(ge=1, le=MAX_BUDGET_TOKENS)] | None = None
    """The most a spec's ``budget.max_total_tokens`` may be; also the budget of a run that gives none (and has
    no default): every run of the model is bounded."""


class ModelDefaults(ModelSettingsSpec):
    """What a spec leaves out takes (``[models.NAME.defaults]``): its model_settings, and its budget's
    ``max_total_tokens``."""

    max_total_tokens: Annotated[int, Field(ge=1, le=MAX_BUDGET_TOKENS)] | None = None

    def settings(self) -> ModelSettingsSpec:
        """The model_settings among these defaults."""
        return ModelSettingsSpec.model_validate(self.model_dump(exclude={"max_total_tokens"}))


_USD_PER_MTOK = Annotated[float, Field(ge=0, le=1_000_000, allow_inf_nan=False)]


class ModelPolicy(SpecModel):
    """What a catalog model says about the settings it is asked with (defaults and caps), and its prices."""

    defaults: ModelDefaults | None = None
    """The model_settings (and budget.max_total_tokens) a spec leaves out."""
    caps: ModelCaps | None = None
    """Upper bounds on temperature, top_p, max_output_tokens and budget.max_total_tokens."""
    input_usd_per_mtok: _USD_PER_MTOK | None = None
    """US dollars per million input tokens: with the output price, the cost in each model step's usage and
    the run's (``cost_usd``), and what ``budget.max_cost_usd`` counts."""
    output_usd_per_mtok: _USD_PER_MTOK | None = None
    """US dollars per million output tokens."""
    tenants: TenantNames | None = None
    """The tenants whose runs may use the model; left out, every run may (docs/security.md, "Tenants")."""

    @property
    def prices(self) -> Prices | None:
        """The model's prices, when it has both."""
        if self.input_usd_per_mtok is None or self.output_usd_per_mtok is None:
            return None
        return Prices(self.input_usd_per_mtok, self.output_usd_per_mtok)


class TenantPolicy(SpecModel):
    """A tenant's quotas (``[tenants.NAME]``; docs/http-api.md, "Tenants and quotas"); absent: no bound."""

    max_runs_in_flight: Annotated[int, Field(ge=1, le=1_000_000)] | None = None
    """Runs of the tenant queued, running or waiting for approval at once."""
    max_enqueues_per_minute: Annotated[int, Field(ge=1, le=1_000_000)] | None = None
    """Runs the tenant may enqueue in one minute (of Redis's clock)."""

    def quota(self) -> Quota:
        return Quota(self.max_runs_in_flight, self.max_enqueues_per_minute)


class RabbitmqUser(SpecModel):
    """What a RabbitMQ user's requests are (``[rabbitmq_users]``: ``user = { tenant = "NAME" }``)."""

    tenant: str
    """The tenant whose runs the user's run and cancel requests create and reach."""


Section: TypeAlias = Literal["mcp_servers", "models", "webhooks"]
"""The catalog's sections whose entries may name the ``tenants`` that may use them."""


def open_to(tenants: tuple[str, ...] | None, tenant: str | None) -> bool:
    """Whether an entry for ``tenants`` (None: for every run) may be used by a run of ``tenant`` (None: a run of
    no tenant, which may use only untenanted entries; docs/security.md, "Tenants")."""
    return tenants is None or (tenant is not None and tenant in tenants)


_POLICY_KEYS: Final = ("defaults", "caps", "input_usd_per_mtok", "output_usd_per_mtok", "tenants")
"""The keys of a catalog model entry that are not its provider's: read into :class:`ModelPolicy` (one shape for
every provider, so a provider's spec need not carry them)."""


class Catalog(SpecModel):
    """What the operator allows: MCP servers and models by name, and the webhooks a spec may notify."""

    mcp_servers: dict[str, CatalogServerSpec] = Field(default_factory=dict)
    """The MCP servers a spec may name (of the transports whose registry entry allows a catalog)."""
    models: dict[str, CatalogModelSpec] = Field(default_factory=dict)
    """The models a spec may name (of the providers whose entry allows a catalog: ``scripted`` needs no entry,
    it reaches nothing)."""
    webhooks: dict[str, WebhookSpec] = Field(default_factory=dict)
    """The webhooks a spec may name in ``notify`` (docs/webhooks.md)."""
    agents: dict[str, AgentSpec] = Field(default_factory=dict)
    """The agents a spec may name in ``agents``: each call of one is a child run (docs/usage.md, "Agent trees")."""
    policies: SkipJsonSchema[dict[str, ModelPolicy]] = Field(default_factory=dict)
    """Per model: the ``defaults``, ``caps``, prices and ``tenants`` of its entry (read apart from its provider's
    fields)."""
    tenants: dict[str, TenantPolicy] = Field(default_factory=dict)
    """Quotas per tenant (a tenant without an entry has none). Here rather than in the tokens file: the
    workers read the catalog and not the tokens, and they admit the runs requested over RabbitMQ."""
    rabbitmq_users: dict[str, RabbitmqUser] = Field(default_factory=dict)
    """The tenant of each RabbitMQ user whose requests name it in ``user_id`` (RabbitMQ checks it)."""

    def quota(self, tenant: str) -> Quota:
        """The tenant's quotas (none when the catalog names none)."""
        policy = self.tenants.get(tenant)
        return Quota() if policy is None else policy.quota()

    def tenant_of_user(self, user: str) -> str | None:
        """The tenant a RabbitMQ user's requests belong to; None when the catalog maps no such user."""
        entry = self.rabbitmq_users.get(user)
        return None if entry is None else entry.tenant

    def tenants_of(self, section: Section, name: str) -> tuple[str, ...] | None:
        """The tenants an entry of ``section`` (by name) is for; None when it is every run's (or no such entry)."""
        if section == "models":
            policy = self.policies.get(name)
            return None if policy is None else policy.tenants
        entry = self.mcp_servers.get(name) if section == "mcp_servers" else self.webhooks.get(name)
        return None if entry is None else entry.tenants

    def usable(self, section: Section, tenant: str | None) -> list[str]:
        """The names of the entries of ``section`` a run of ``tenant`` (None: of no tenant) may use."""
        names = self.mcp_servers if section == "mcp_servers" else self.models if section == "models" else self.webhooks
        return [name for name in names if open_to(self.tenants_of(section, name), tenant)]

    def requester(self, user: str | None, *, allow_untenanted: bool) -> tuple[str | None, str | None]:
        """Whose a RabbitMQ request is, from its ``user_id`` (which RabbitMQ checked against the publishing
        connection's user): ``(tenant, None)``; ``(None, None)`` for an operator's request, where
        ``allow_untenanted`` (RUNBRAKE_RABBITMQ_ALLOW_UNTENANTED) lets an unmapped one be; ``(None, why)``
        when it is refused."""
        tenant = self.tenant_of_user(user) if user else None
        if tenant is not None or allow_untenanted:
            return tenant, None
        if user is None:
            return None, ("the request has no user_id, and only a user the catalog's [rabbitmq_users] maps to a "
                          "tenant may ask (RUNBRAKE_RABBITMQ_ALLOW_UNTENANTED is false)")
        return None, (f"user_id {user[:100]!r} is not in the catalog's [rabbitmq_users], and only a mapped user "
                      "may ask (RUNBRAKE_RABBITMQ_ALLOW_UNTENANTED is false)")

    @classmethod
    def empty(cls) -> Catalog:
        return cls()

    @classmethod
    def load(cls, path: str | Path) -> Catalog:
        """Read and check a catalog file.

        Raises:
            ConfigError: naming the file and every problem in it (``RUNBRAKE_CATALOG``).
        """
        try:
            data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
        except OSError as exc:
            raise ConfigError("RUNBRAKE_CATALOG", f"cannot read {path}: {exc.strerror}") from exc
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError("RUNBRAKE_CATALOG", f"{path} is not valid TOML: {exc}") from exc
        catalog = cls.parse(data, where=str(path))
        # Every process that reads the catalog (CLI, API, workers) knows its secrets, to cut them out of
        # what it logs and stores (docs/security.md, "Where secrets live"); it never sends them.
        catalog.remember_secrets(os.environ)
        return catalog

    @classmethod
    def parse(cls, data: Mapping[str, Any], *, where: str = "catalog") -> Catalog:
        """Check a catalog given as a mapping (as TOML reads it).

        Raises:
            ConfigError: naming every problem, each with its place (``mcp_servers.calc.url: …``).
        """
        unusable = list(_not_json(data, ()))
        if unusable:
            # TOML has dates, times and nan/inf; a catalog has no field for them (found by tests/test_fuzz_inputs.py).
            raise ConfigError("RUNBRAKE_CATALOG", f"{where}: " + "; ".join(
                f"{'.'.join(map(str, loc))}: {what}, which no catalog field takes" for loc, what in unusable))
        data, policies = _policies_apart(data)
        try:
            catalog = cls.model_validate_json(json.dumps(dict(data), allow_nan=False))
        except ValidationError as exc:
            problems = "; ".join(f"{p.field}: {p.msg}" for p in problems_of(exc))
            raise ConfigError("RUNBRAKE_CATALOG", f"{where}: {problems}") from exc
        checked: dict[str, ModelPolicy] = {}
        for name, policy in policies.items():
            try:
                checked[name] = ModelPolicy.model_validate_json(json.dumps(policy))
            except ValidationError as exc:
                problems = "; ".join(f"models.{name}.{p.field}: {p.msg}" for p in problems_of(exc))
                raise ConfigError("RUNBRAKE_CATALOG", f"{where}: {problems}") from exc
        above = [f"models.{n}.defaults.{setting}" for n, p in checked.items() for setting in _above_caps(p)]
        if above:
            raise ConfigError("RUNBRAKE_CATALOG", f"{where}: a default above its cap: {', '.join(above)}")
        catalog = catalog.model_copy(update={"policies": checked})
        names = [f"mcp_servers.{n}" for n in catalog.mcp_servers if not _plain(n)]
        names += [f"models.{n}" for n in catalog.models if not _plain(n)]
        names += [f"webhooks.{n}" for n in catalog.webhooks if not _plain(n)]
        names += [f"agents.{n}" for n in catalog.agents if not _plain(n)]
        if names:
            raise ConfigError("RUNBRAKE_CATALOG", f"{where}: names use 1 to 64 letters, digits, '-' or '_' "
                                                  f"(no '__'): {', '.join(names)}")
        tenants = [f"tenants.{n}" for n in catalog.tenants if not LABEL_KEY.fullmatch(n)]
        tenants += [f"rabbitmq_users.{u}.tenant" for u, e in catalog.rabbitmq_users.items()
                    if not LABEL_KEY.fullmatch(e.tenant)]
        tenants += [f"rabbitmq_users.{u[:64]}" for u in catalog.rabbitmq_users if not 1 <= len(u) <= 255]
        if tenants:
            raise ConfigError("RUNBRAKE_CATALOG", f"{where}: a tenant is 1 to 63 of a-z, 0-9, '_', '.', '-' and a "
                                                  f"RabbitMQ user 1 to 255 characters: {', '.join(tenants)}")
        agents = check_agents(catalog.agents, models=catalog.models, servers=catalog.mcp_servers)
        if catalog.agents and AGENT_SERVER in catalog.mcp_servers:
            agents.append(f"mcp_servers.{AGENT_SERVER}: the name is the agents' tools' (agent__<name>) while the "
                          "catalog defines agents")
        if agents:
            raise ConfigError("RUNBRAKE_CATALOG", f"{where}: {'; '.join(agents)}")
        servers = {name: server.model_copy(update={"name": name}) for name, server in catalog.mcp_servers.items()}
        return catalog.model_copy(update={"mcp_servers": servers})

    @classmethod
    def from_settings(cls, settings: Settings) -> Catalog:
        """The catalog ``RUNBRAKE_CATALOG`` names, or an empty one."""
        return cls.load(settings.catalog) if settings.catalog else cls.empty()

    def variables(self) -> set[str]:
        """Every environment variable the catalog names: ``${VAR}`` in header and env values, ``api_key_env``."""
        names: set[str] = set()
        for registry, specs in ((PROVIDERS, self.models.values()), (TRANSPORTS, self.mcp_servers.values())):
            for spec in specs:
                names.update(registry.of(spec).variables(spec))
        names.update(hook.secret_env for hook in self.webhooks.values())
        return names

    def remember_secrets(self, environ: Mapping[str, str]) -> None:
        """Remember (``shared/redaction.py``) the value of each variable the catalog names that ``environ``
        sets, so that this process's logs and store cut it out too, not only the worker that expands it."""
        redaction.remember(*(environ[name] for name in sorted(self.variables()) if environ.get(name)))

    def describe(self, environ: Mapping[str, str] | None = None, *, show_secrets: bool = False) -> dict[str, Any]:
        """What the catalog defines. Variables show as ``${VAR}`` with whether VAR is set, never its value;
        unless ``show_secrets``, the secrets written into the file itself show as ``***`` too: a URL's
        password, literal header values (an auth scheme word before them stays), and literal values of
        env entries whose name says secret (``*TOKEN*``, ``*KEY*``, ``*SECRET*``, ``*PASSWORD*``…)."""
        shown = _Shown(os.environ if environ is None else environ, show_secrets=show_secrets)
        servers = {
            name: {"transport": server.transport, "tools": server.tools, "max_concurrency": server.max_concurrency,
                   "timeout_s": server.timeout_s, "on_cancel": server.on_cancel.value,
                   "cancel_grace_s": server.cancel_grace_s,
                   "tools_on_cancel": {tool: policy.value for tool, policy in server.tools_on_cancel.items()},
                   "tenants": None if server.tenants is None else list(server.tenants),
                   "on_worker_lost": server.on_worker_lost.value,
                   "tools_on_worker_lost": {tool: policy.value
                                            for tool, policy in server.tools_on_worker_lost.items()},
                   "tasks": server.tasks.value,
                   **TRANSPORTS.of(server).describe(server, shown)}
            for name, server in self.mcp_servers.items()
        }
        models = {name: {"provider": model.provider, **PROVIDERS.of(model).describe(model, shown),
                         **self._policy(name)} for name, model in self.models.items()}
        webhooks = {name: {"url": shown.url(hook.url), "secret_env": hook.secret_env,
                           "secret_set": shown.is_set(hook.secret_env), "events": list(hook.events),
                           "tenants": None if hook.tenants is None else list(hook.tenants)}
                    for name, hook in self.webhooks.items()}
        tenants = {name: policy.model_dump(exclude_none=True) for name, policy in self.tenants.items()}
        users = {user: {"tenant": entry.tenant} for user, entry in self.rabbitmq_users.items()}
        agents = {name: agent.model_dump(mode="json", exclude_none=True) for name, agent in self.agents.items()}
        return {"mcp_servers": servers, "models": models, "tenants": tenants, "rabbitmq_users": users,
                "webhooks": webhooks, "agents": agents}


    def _policy(self, model: str) -> dict[str, Any]:
        """A model's defaults and caps as ``describe`` shows them (nothing when it sets none)."""
        policy = self.policies.get(model)
        return {} if policy is None else policy.model_dump(mode="json", exclude_none=True)


@dataclass(frozen=True, slots=True)
class _Shown:
    """How :meth:`Catalog.describe` shows values that may hold secrets (shared/registry.py, ``Shown``)."""

    environ: Mapping[str, str]
    show_secrets: bool

    def secret(self, template: str, *, literal_is_secret: bool = True) -> dict[str, Any]:
        shown = template if self.show_secrets or not literal_is_secret else _masked(template)
        return {"template": shown, "variables": {v: v in self.environ for v in variables_in(template)}}

    def url(self, value: str) -> str:
        return value if self.show_secrets else _without_password(value)

    def is_set(self, variable: str) -> bool:
        return variable in self.environ

    def secret_name(self, name: str) -> bool:
        return bool(_SECRET_NAME.search(name))


def _policies_apart(data: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """The catalog without the ``defaults`` and ``caps`` of its model entries, and those by model name."""
    if "policies" in data:
        raise ConfigError("RUNBRAKE_CATALOG", "policies: unknown field (a model's defaults and caps go in its "
                                              "own entry: [models.NAME.defaults], [models.NAME.caps])")
    models = data.get("models")
    if not isinstance(models, Mapping):
        return dict(data), {}
    entries: dict[str, Any] = {}
    policies: dict[str, dict[str, Any]] = {}
    for name, entry in models.items():
        entries[name] = entry
        if isinstance(entry, Mapping) and any(key in entry for key in _POLICY_KEYS):
            policies[name] = {key: entry[key] for key in _POLICY_KEYS if key in entry}
            entries[name] = {key: value for key, value in entry.items() if key not in _POLICY_KEYS}
    return {**data, "models": entries}, policies


def _above_caps(policy: ModelPolicy) -> list[str]:
    """The defaults of a policy that exceed its own caps."""
    if policy.defaults is None or policy.caps is None:
        return []
    return [name for name in (*ModelSettingsSpec.CAPPED, "max_total_tokens")
            if (cap := getattr(policy.caps, name)) is not None
            and (value := getattr(policy.defaults, name)) is not None and value > cap]


def _rebuild() -> None:
    Catalog.model_rebuild(force=True)  # its unions follow the registries (shared/spec.py, _tagged_union)


PROVIDERS.on_change(_rebuild)
TRANSPORTS.on_change(_rebuild)


MASK: Final = "***"
_SECRET_NAME: Final = re.compile(r"(?i)TOKEN|KEY|SECRET|PASS|AUTH|CREDENTIAL|COOKIE|SESSION")
_AUTH_SCHEME: Final = re.compile(r"(?i)^\s*(bearer|basic|token|digest)\s+")


def _masked(template: str) -> str:
    """``template`` with each literal stretch between its ``${VAR}`` references shown as ``***`` (blank
    stretches, and an auth scheme word that opens the value, stay)."""
    parts = re.split(r"(\$\{[A-Za-z_][A-Za-z0-9_]*\})", template)
    shown = []
    for index, part in enumerate(parts):
        if index % 2 or not part.strip():
            shown.append(part)
            continue
        scheme = _AUTH_SCHEME.match(part) if index == 0 else None
        kept = scheme.group(0) if scheme else ""
        shown.append(kept + (MASK if part[len(kept):].strip() else part[len(kept):]))
    return "".join(shown)


def _without_password(url: str) -> str:
    """``url`` with its password, if any, shown as ``***``."""
    parsed = urllib.parse.urlsplit(url)
    if parsed.password is None:
        return url
    host = parsed.netloc.rpartition("@")[2]
    return urllib.parse.urlunsplit(parsed._replace(netloc=f"{parsed.username or ''}:{MASK}@{host}"))


def _plain(name: str) -> bool:
    return bool(re.fullmatch(r"[A-Za-z0-9_-]{1,64}", name)) and "__" not in name


class CatalogFile:
    """The catalog ``RUNBRAKE_CATALOG`` names, read again when the file changes (an operator edits it, a
    ConfigMap is updated), so workers pick up a new server without a restart. A change that does not
    load is logged loudly and the last good catalog stays in force."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._stamp = self._stat()
        self._catalog = Catalog.load(self.path)

    def current(self) -> Catalog:
        stamp = self._stat()
        if stamp != self._stamp:
            try:
                self._catalog = Catalog.load(self.path)
                # Only a catalog that loaded moves the stamp: one caught half-written is read again next time.
                self._stamp = stamp
                log.info("catalog_reloaded", path=str(self.path))
            except ConfigError as exc:
                log.error(  # noqa: TRY400 - the message says it all; a traceback adds nothing
                    "catalog_reload_failed", path=str(self.path), error=str(exc), kept="the last good catalog")
        return self._catalog

    def _stat(self) -> tuple[int, int] | None:
        try:
            stat = self.path.stat()
        except OSError:
            return None
        return stat.st_mtime_ns, stat.st_size


class MissingVariable(ConfigError):
    """Raised when a ``${VAR}`` in the catalog names a variable the worker's environment does not set."""

    def __init__(self, variable: str, where: str) -> None:
        super().__init__(variable, f"is not set in the worker's environment (needed by {where})")


def expand(template: str, environ: Mapping[str, str], *, where: str) -> str:
    """``template`` with every ``${VAR}`` replaced by VAR's value.

    Raises:
        MissingVariable: naming the variable (never a value) and ``where`` it was needed.
    """
    def value(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in environ:
            raise MissingVariable(name, where)
        redaction.remember(environ[name])
        return environ[name]

    return VARIABLE_PATTERN.sub(value, template)


@dataclass(frozen=True, slots=True)
class AdmittedRun:
    """A spec that may run, with what it names resolved: the servers and the model a worker uses."""

    spec: RunSpec
    servers: Mapping[str, ServerSpec]
    model: ModelSpec
    model_settings: ModelSettingsSpec = field(default_factory=ModelSettingsSpec)
    """The spec's model_settings with the catalog model's defaults (and its max_output_tokens cap) applied."""
    model_name: str = ""
    """The catalog model's name, or the inline model's provider tag (the run record's ``model``)."""
    budget: Budget = NO_BUDGET
    """The spec's budget, with the catalog model's default or cap of max_total_tokens, and its prices."""


@dataclass(frozen=True, slots=True)
class Admission:
    """The policy a spec must meet to run: its servers and model from the catalog (inline ones only
    where ``allow_inline``), and the bounds in the settings."""

    source: Catalog | CatalogFile
    """The catalog, or the file it is read from (and read again when it changes)."""
    allow_inline: bool = False
    max_spec_bytes: int = _DEFAULTS.max_spec_bytes
    max_input_chars: int = _DEFAULTS.max_input_chars
    max_messages: int = _DEFAULTS.max_messages
    max_history_chars: int = _DEFAULTS.max_history_chars
    max_output_schema_bytes: int = _DEFAULTS.max_output_schema_bytes
    schema_check_s: float = _DEFAULTS.schema_check_s
    max_argument_chars: int = _DEFAULTS.max_argument_chars
    max_tool_calls_per_turn: int = _DEFAULTS.max_tool_calls_per_turn
    max_steps_cap: int = _DEFAULTS.max_steps_cap
    max_agent_depth: int = _DEFAULTS.max_agent_depth

    @classmethod
    def from_settings(cls, settings: Settings, catalog: Catalog | None = None) -> Admission:
        """The policy of these settings (the catalog file is read unless given)."""
        source: Catalog | CatalogFile = (
            catalog if catalog is not None else CatalogFile(settings.catalog) if settings.catalog else Catalog.empty()
        )
        return cls(
            source=source,
            allow_inline=settings.allow_inline,
            max_spec_bytes=settings.max_spec_bytes,
            max_input_chars=settings.max_input_chars,
            max_messages=settings.max_messages,
            max_history_chars=settings.max_history_chars,
            max_output_schema_bytes=settings.max_output_schema_bytes,
            schema_check_s=settings.schema_check_s,
            max_argument_chars=settings.max_argument_chars,
            max_tool_calls_per_turn=settings.max_tool_calls_per_turn,
            max_steps_cap=settings.max_steps_cap,
            max_agent_depth=settings.max_agent_depth,
        )

    @property
    def catalog(self) -> Catalog:
        """The catalog in force now."""
        return self.source if isinstance(self.source, Catalog) else self.source.current()

    def admit(self, spec: RunSpec, *, tenant: str | None = None) -> AdmittedRun:
        """Resolve what ``spec`` names, or refuse it. A run of ``tenant`` (the credential's; None: of no tenant)
        may name only the catalog entries open to it (:func:`open_to`); to a tenant, any other is as missing. A
        spec with an ``output_schema`` waits for its check in a child process, up to ``schema_check_s``: admit
        it on a thread, never on an event loop.

        Raises:
            SpecError: naming every field that breaks the policy, and the limit where a bound is broken.
        """
        problems: list[FieldProblem] = []

        def refuse(loc: tuple[str | int, ...], msg: str) -> None:
            problems.append(FieldProblem(loc=loc, msg=msg))

        size = len(spec.to_json().encode())
        if size > self.max_spec_bytes:
            refuse(("spec",), f"is {size} bytes; the limit is {self.max_spec_bytes} (RUNBRAKE_MAX_SPEC_BYTES)")
        if len(spec.input) > self.max_input_chars:
            refuse(("input",), f"is {len(spec.input)} characters; the limit is {self.max_input_chars} "
                               "(RUNBRAKE_MAX_INPUT_CHARS)")
        if spec.instructions is not None and len(spec.instructions) > self.max_input_chars:
            refuse(("instructions",), f"is {len(spec.instructions)} characters; the limit is {self.max_input_chars} "
                                      "(RUNBRAKE_MAX_INPUT_CHARS)")
        if spec.max_steps > self.max_steps_cap:
            refuse(("max_steps",), f"is {spec.max_steps}; the limit is {self.max_steps_cap} (RUNBRAKE_MAX_STEPS_CAP)")
        self._bound_history(spec, refuse)
        if spec.output_schema is not None and (problem := self.output_schema_problem(spec.output_schema)):
            refuse(("output_schema",), problem)
        if "tenant" in spec.labels:
            refuse(("labels", "tenant"), "is set from the credential that enqueues the run, never by a spec "
                                         "(docs/http-api.md, \"Tenants and quotas\")")
        catalog = self.catalog
        servers = self._servers(spec, catalog, tenant, refuse)
        model = self._model(spec, catalog, tenant, refuse)
        self._agents(spec, catalog, servers, refuse)
        for i, name in enumerate(spec.notify):
            if name not in catalog.webhooks or not open_to(catalog.tenants_of("webhooks", name), tenant):
                refuse(("notify", i), _unusable(catalog, "webhooks", name, tenant, "is not a webhook of the catalog"))
        for i, message in enumerate(spec.messages):
            for j, earlier in enumerate(message.tool_calls):
                allowed = servers.get(earlier.server)
                if allowed is not None and allowed.tools is not None and earlier.tool not in allowed.tools:
                    refuse(("messages", i, "tool_calls", j, "tool"),
                           f"{earlier.server} allows only {', '.join(allowed.tools)}")
        # A model the run may not use lends it no defaults, caps or prices: they would tell a tenant it exists.
        policy = (catalog.policies.get(spec.model) if isinstance(spec.model, str)
                  and open_to(catalog.tenants_of("models", spec.model), tenant) else None)
        settings = self._settings(spec, policy, refuse)
        budget = _budget(spec, policy, refuse)
        if isinstance(model, ScriptedModel):
            for i, turn in enumerate(model.turns):
                if len(turn.tool_calls) > self.max_tool_calls_per_turn:
                    refuse(("model", "turns", i, "tool_calls"),
                           f"has {len(turn.tool_calls)} calls; the limit is {self.max_tool_calls_per_turn} "
                           "(RUNBRAKE_MAX_TOOL_CALLS_PER_TURN)")
                for j, call in enumerate(turn.tool_calls):
                    allowed = servers.get(call.server)
                    if allowed is not None and allowed.tools is not None and call.tool not in allowed.tools:
                        refuse(("model", "turns", i, "tool_calls", j, "tool"),
                               f"{call.server} allows only {', '.join(allowed.tools)}")
        if problems:
            raise SpecError.from_problems(problems)
        assert model is not None
        name = spec.model if isinstance(spec.model, str) else model.provider
        return AdmittedRun(spec=spec, servers=servers, model=model, model_settings=settings, model_name=name,
                           budget=budget)

    def _agents(self, spec: RunSpec, catalog: Catalog, servers: Mapping[str, ServerSpec], refuse: Any) -> None:
        """The agents a spec names are the catalog's, the tree their calls can make is at most
        RUNBRAKE_MAX_AGENT_DEPTH deep, and no server of the run takes their tools' name."""
        for i, name in enumerate(spec.agents):
            if name not in catalog.agents:
                refuse(("agents", i), f"{name!r} is not an agent of the catalog ({_known(catalog.agents)})")
        depth = height(spec.agents, catalog.agents)
        if depth > self.max_agent_depth:
            refuse(("agents",), f"make a tree {depth} levels deep; the limit is {self.max_agent_depth} "
                                "(RUNBRAKE_MAX_AGENT_DEPTH)")
        if spec.agents and AGENT_SERVER in servers:
            refuse(("mcp_servers",), f"a server named {AGENT_SERVER!r} would take the agents' tools' name "
                                     "(agent__<name>)")

    def output_schema_problem(self, schema: Mapping[str, Any]) -> str | None:
        """What refuses ``schema`` as a spec's ``output_schema`` (None: nothing): its size past
        RUNBRAKE_MAX_OUTPUT_SCHEMA_BYTES, else its check as a JSON Schema, in a child process within
        ``schema_check_s`` (shared/schema_check.py). Blocks: never call it on an event loop."""
        size = len(json.dumps(schema, separators=(",", ":")).encode())
        if size > self.max_output_schema_bytes:
            return f"is {size} bytes; the limit is {self.max_output_schema_bytes} (RUNBRAKE_MAX_OUTPUT_SCHEMA_BYTES)"
        # Only after the byte bound: checking a schema costs more than linear time (docs/security.md, "Bounds").
        return SCHEMA_CHECKS.schema_problem(schema, within_s=self.schema_check_s)

    def _bound_history(self, spec: RunSpec, refuse: Any) -> None:
        """``messages`` within RUNBRAKE_MAX_MESSAGES and RUNBRAKE_MAX_HISTORY_CHARS, each call's arguments
        within RUNBRAKE_MAX_ARGUMENT_CHARS."""
        if len(spec.messages) > self.max_messages:
            refuse(("messages",), f"has {len(spec.messages)} messages; the limit is {self.max_messages} "
                                  "(RUNBRAKE_MAX_MESSAGES)")
        chars = 0
        for i, message in enumerate(spec.messages):
            chars += len(message.content or "")
            for j, call in enumerate(message.tool_calls):
                size = len(json.dumps(call.arguments, separators=(",", ":")))
                chars += size
                if size > self.max_argument_chars:
                    refuse(("messages", i, "tool_calls", j, "arguments"),
                           f"is {size} characters as JSON; the limit is {self.max_argument_chars} "
                           "(RUNBRAKE_MAX_ARGUMENT_CHARS)")
        if chars > self.max_history_chars:
            refuse(("messages",), f"holds {chars} characters; the limit is {self.max_history_chars} "
                                  "(RUNBRAKE_MAX_HISTORY_CHARS)")

    @staticmethod
    def _settings(spec: RunSpec, policy: ModelPolicy | None, refuse: Any) -> ModelSettingsSpec:
        """The spec's model_settings over the catalog model's defaults; a setting above the model's cap is
        refused naming both. Without a max_output_tokens from either, the cap's is sent."""
        if policy is None:
            return spec.model_settings
        caps = policy.caps
        if caps is not None:
            for name in ModelSettingsSpec.CAPPED:
                cap, value = getattr(caps, name), getattr(spec.model_settings, name)
                if cap is not None and value is not None and value > cap:
                    refuse(("model_settings", name), f"is {value}; the catalog model {spec.model!r} caps it at "
                                                     f"{cap} (models.{spec.model}.caps.{name})")
        settings = spec.model_settings.merged(None if policy.defaults is None else policy.defaults.settings())
        if settings.max_output_tokens is None and caps is not None and caps.max_output_tokens is not None:
            settings = settings.model_copy(update={"max_output_tokens": caps.max_output_tokens})
        return settings

    def _servers(self, spec: RunSpec, catalog: Catalog, tenant: str | None, refuse: Any) -> dict[str, ServerSpec]:
        if isinstance(spec.mcp_servers, dict):
            if not self.allow_inline and not all(_inline(TRANSPORTS, s) for s in spec.mcp_servers.values()):
                refuse(("mcp_servers",), "inline servers are refused: name servers of the operator's catalog "
                                         "(RUNBRAKE_ALLOW_INLINE=true is for development and tests only)")
            return dict(spec.mcp_servers)
        servers: dict[str, ServerSpec] = {}
        for i, name in enumerate(spec.mcp_servers):
            server = catalog.mcp_servers.get(name)
            if server is None or not open_to(server.tenants, tenant):
                refuse(("mcp_servers", i), _unusable(catalog, "mcp_servers", name, tenant, "is not in the catalog"))
            else:
                servers[name] = server
        return servers

    def _model(self, spec: RunSpec, catalog: Catalog, tenant: str | None, refuse: Any) -> ModelSpec | None:
        if isinstance(spec.model, str):
            model = catalog.models.get(spec.model)
            if model is None or not open_to(catalog.tenants_of("models", spec.model), tenant):
                refuse(("model",), _unusable(catalog, "models", spec.model, tenant, "is not in the catalog"))
                return None
            return model
        if not self.allow_inline and not _inline(PROVIDERS, spec.model):
            refuse(("model",), f"an inline {spec.model.provider} model is refused: name a model of the operator's "
                               "catalog (RUNBRAKE_ALLOW_INLINE=true is for development and tests only)")
        return spec.model


def _budget(spec: RunSpec, policy: ModelPolicy | None, refuse: Any) -> Budget:
    """The budget a run is held to (docs/usage.md, "Budgets"): the spec's, its max_total_tokens refused above
    the model's cap (as model_settings are) and, left out, the model's default, else its cap; a cost budget
    needs the model's prices."""
    given = spec.budget
    prices = None if policy is None else policy.prices
    tokens = None if given is None else given.max_total_tokens
    caps = None if policy is None else policy.caps
    cap = None if caps is None else caps.max_total_tokens
    if tokens is not None and cap is not None and tokens > cap:
        refuse(("budget", "max_total_tokens"), f"is {tokens}; the catalog model {spec.model!r} caps it at {cap} "
                                               f"(models.{spec.model}.caps.max_total_tokens)")
    if tokens is None and policy is not None:
        tokens = policy.defaults.max_total_tokens if policy.defaults is not None else None
        tokens = cap if tokens is None else tokens
    cost = None if given is None else given.max_cost_usd
    if cost is not None and prices is None:
        where = f"the catalog model {spec.model!r}" if isinstance(spec.model, str) else "an inline model"
        refuse(("budget", "max_cost_usd"), f"needs the model's prices, and {where} has none "
                                           "(input_usd_per_mtok and output_usd_per_mtok of its catalog entry)")
    return Budget(deadline_s=None if given is None else given.deadline_s, max_total_tokens=tokens,
                  max_cost_usd=cost, prices=prices)


def _not_json(value: object, loc: tuple[str | int, ...]) -> Iterator[tuple[tuple[str | int, ...], str]]:
    """Where a TOML document holds what JSON has no value for: a date or time, nan or inf."""
    if isinstance(value, Mapping):
        for key, item in value.items():
            yield from _not_json(item, (*loc, str(key)))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _not_json(item, (*loc, index))
    elif isinstance(value, datetime.date | datetime.time):
        yield loc, f"a TOML {type(value).__name__}"
    elif isinstance(value, float) and not math.isfinite(value):
        yield loc, f"{value}"


def _inline(registry: Registry, spec: object) -> bool:
    """Whether ``spec``'s entry says it may be defined inline; an entry that does not say so may not."""
    return registry.of(spec).inline



def _known(names: Iterable[str]) -> str:
    names = sorted(names)
    return f"it has {', '.join(names)}" if names else "it names none; see RUNBRAKE_CATALOG"


def _unusable(catalog: Catalog, section: Section, name: str, tenant: str | None, missing: str) -> str:
    """Why a run of ``tenant`` may not name the entry ``name`` of ``section``. To a tenant, an entry of other
    tenants is answered exactly as a missing one, and only the entries open to it are listed (as another
    tenant's run is a missing one: docs/http-api.md, "Tenants and quotas"); a run of no tenant is told."""
    if tenant is None and catalog.tenants_of(section, name) is not None:
        return (f"{name!r} is for the tenants its catalog entry names ({section}.{name}.tenants); a run of no "
                "tenant may not use it")
    return f"{name!r} {missing} ({_known(catalog.usable(section, tenant))})"
