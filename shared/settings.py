"""Settings: one frozen dataclass, read once from the environment at the edge and passed in."""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypeVar

from runbrake.shared.errors import ConfigError

_NAMESPACE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_ALLOWED_HOST = re.compile(r"^(\*|([a-z0-9][a-z0-9.-]{0,252}|\[[0-9a-f:.]{2,45}\])(:[0-9]{1,5})?)$")


@dataclass(frozen=True, slots=True)
class Settings:
    """How this process reaches its services and the bounds it works within."""

    rabbitmq_url: str = "amqp://guest:guest@127.0.0.1:5672/"
    """RabbitMQ for run messages and cancel messages. ``RUNBRAKE_RABBITMQ_URL``."""
    redis_url: str = "redis://127.0.0.1:6379/0"
    """Redis, the authority for runs, steps and cancel keys. ``RUNBRAKE_REDIS_URL``."""
    namespace: str = "runbrake"
    """Prefix of every Redis key, queue and exchange. ``RUNBRAKE_NAMESPACE``."""
    max_tool_result_chars: int = 16_000
    """Bound on each content channel of a tool result, in characters. ``RUNBRAKE_MAX_TOOL_RESULT_CHARS``."""
    cancel_poll_ms: int = 250
    """Backstop interval: how often a worker reads its active runs' cancel keys, in milliseconds.
    ``RUNBRAKE_CANCEL_POLL_MS``."""
    run_time_limit_s: int = 3600
    """Wall-clock limit of one segment of a run, in seconds; hitting it fails the run with reason
    ``time_limit``. ``RUNBRAKE_RUN_TIME_LIMIT_S``."""
    lease_s: int = 60
    """How long a worker's claim on a run is good for without renewal, in seconds. ``RUNBRAKE_LEASE_S``."""
    metrics_port: int = 0
    """Port of the worker's Prometheus endpoint (each process adds its index); 0 turns it off.
    ``RUNBRAKE_METRICS_PORT``."""
    redis_timeout_s: float = 2.0
    """Socket timeout for Redis calls, in seconds. ``RUNBRAKE_REDIS_TIMEOUT_S``."""
    catalog: str | None = None
    """Path of the operator's catalog (TOML) of MCP servers and models a spec may name; unset: none.
    ``RUNBRAKE_CATALOG``."""
    allow_inline: bool = False
    """Accept inline MCP servers and models in a spec (development and tests only: whoever enqueues then
    chooses what the worker starts and reaches). ``RUNBRAKE_ALLOW_INLINE``."""
    max_spec_bytes: int = 1_048_576
    """Largest run spec accepted, in bytes (1 MiB). ``RUNBRAKE_MAX_SPEC_BYTES``."""
    max_input_chars: int = 100_000
    """Longest ``input`` accepted, in characters. ``RUNBRAKE_MAX_INPUT_CHARS``."""
    max_argument_chars: int = 16_000
    """Bound on a tool call's arguments as stored (JSON characters). ``RUNBRAKE_MAX_ARGUMENT_CHARS``."""
    max_model_content_chars: int = 100_000
    """Bound on a model turn's text as kept (the step, the conversation, the final answer), in characters;
    a longer one is cut with a mark and its step's ``detail.content_truncated`` says so. The default is
    the bound on ``input`` (``RUNBRAKE_MAX_INPUT_CHARS``): some 25,000 tokens, past the output limit of
    most models, while a step stays small enough to send whole on every events replay.
    ``RUNBRAKE_MAX_MODEL_CONTENT_CHARS``."""
    max_tool_calls_per_turn: int = 32
    """Most tool calls one model turn may ask for; more fails the run (``too_many_tool_calls``).
    ``RUNBRAKE_MAX_TOOL_CALLS_PER_TURN``."""
    max_steps_cap: int = 1000
    """Highest ``max_steps`` a spec may ask for (its default is 200). ``RUNBRAKE_MAX_STEPS_CAP``."""
    retention_s: int = 7 * 24 * 3600
    """How long a finished run's record is kept, in seconds (7 days); 0 keeps it forever.
    ``RUNBRAKE_RETENTION_S``."""
    redrive_s: int = 60
    """A run queued this long without being claimed has its message sent again, in seconds.
    ``RUNBRAKE_REDRIVE_S``."""
    drain_s: int = 30
    """On SIGTERM, how long runs in flight may go on before they are handed to another worker, in
    seconds. ``RUNBRAKE_DRAIN_S``."""
    api_tokens: str | None = None
    """Path of the HTTP API's tokens file (TOML); unset: the API serves loopback only.
    ``RUNBRAKE_API_TOKENS``."""
    health_port: int = 0
    """Port of the worker's /healthz and /readyz (each process adds its index); 0 turns it off.
    ``RUNBRAKE_HEALTH_PORT``."""
    health_host: str = "127.0.0.1"
    """Address the worker's health and metrics ports listen on: loopback, unless set (``0.0.0.0`` where a
    kubelet or a scraper reaches the pod's address). ``RUNBRAKE_HEALTH_HOST``."""
    redis_cluster: bool = False
    """``RUNBRAKE_REDIS_URL`` names seed nodes of a Redis Cluster. ``RUNBRAKE_REDIS_CLUSTER``."""
    queue_type: str = "classic"
    """``classic`` or ``quorum``: how the run and cancel-request queues are declared.
    ``RUNBRAKE_QUEUE_TYPE``."""
    api_allowed_hosts: tuple[str, ...] | None = None
    """``Host`` headers the HTTP API answers (lowercase; ``name`` any port, ``name:port`` that port, ``*``
    any host); unset: the loopback names without tokens, any host with tokens (docs/http-api.md, "Allowed
    hosts"). ``RUNBRAKE_API_ALLOWED_HOSTS``, comma-separated."""
    api_header_timeout_s: float = 10.0
    """How long the HTTP API waits for a request's headers to be complete, in seconds, before it closes
    the connection (slowloris). ``RUNBRAKE_API_HEADER_TIMEOUT_S``."""
    api_send_timeout_s: float = 30.0
    """How long ``runbrake serve`` waits for an events client to take the next chunk of its stream before
    it drops the client (its socket buffer stayed full), in seconds. ``RUNBRAKE_API_SEND_TIMEOUT_S``."""
    api_max_streams_per_token: int = 16
    """Event streams one token may hold open at once on one ``serve`` process (without tokens: all
    clients together); the next is ``429``. ``RUNBRAKE_API_MAX_STREAMS_PER_TOKEN``."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        """Read ``RUNBRAKE_*`` variables; unset ones keep their defaults.

        Raises:
            ConfigError: naming the variable whose value cannot be used.
        """
        env = os.environ if environ is None else environ
        defaults = cls()
        namespace = env.get("RUNBRAKE_NAMESPACE", defaults.namespace)
        if not _NAMESPACE.fullmatch(namespace):
            raise ConfigError("RUNBRAKE_NAMESPACE", "use 1-64 letters, digits, '.', '_' or '-'")
        rabbitmq_url = env.get("RUNBRAKE_RABBITMQ_URL", defaults.rabbitmq_url)
        if not rabbitmq_url.startswith(("amqp://", "amqps://")):
            raise ConfigError("RUNBRAKE_RABBITMQ_URL", "must be an amqp:// or amqps:// URL")
        redis_url = env.get("RUNBRAKE_REDIS_URL", defaults.redis_url)
        if not redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise ConfigError("RUNBRAKE_REDIS_URL", "must be a redis://, rediss:// or unix:// URL")
        return cls(
            rabbitmq_url=rabbitmq_url,
            redis_url=redis_url,
            namespace=namespace,
            max_tool_result_chars=_int(env, "RUNBRAKE_MAX_TOOL_RESULT_CHARS", defaults.max_tool_result_chars, 1),
            cancel_poll_ms=_int(env, "RUNBRAKE_CANCEL_POLL_MS", defaults.cancel_poll_ms, 10),
            run_time_limit_s=_int(env, "RUNBRAKE_RUN_TIME_LIMIT_S", defaults.run_time_limit_s, 1),
            lease_s=_int(env, "RUNBRAKE_LEASE_S", defaults.lease_s, 5),
            metrics_port=_int(env, "RUNBRAKE_METRICS_PORT", defaults.metrics_port, 0, 65535),
            redis_timeout_s=_float(env, "RUNBRAKE_REDIS_TIMEOUT_S", defaults.redis_timeout_s),
            catalog=env.get("RUNBRAKE_CATALOG") or None,
            allow_inline=_bool(env, "RUNBRAKE_ALLOW_INLINE", defaults.allow_inline),
            max_spec_bytes=_int(env, "RUNBRAKE_MAX_SPEC_BYTES", defaults.max_spec_bytes, 1024, 64 * 1_048_576),
            max_input_chars=_int(env, "RUNBRAKE_MAX_INPUT_CHARS", defaults.max_input_chars, 1, 10_000_000),
            max_argument_chars=_int(env, "RUNBRAKE_MAX_ARGUMENT_CHARS", defaults.max_argument_chars, 100, 10_000_000),
            max_model_content_chars=_int(
                env, "RUNBRAKE_MAX_MODEL_CONTENT_CHARS", defaults.max_model_content_chars, 1000, 10_000_000),
            max_tool_calls_per_turn=_int(
                env, "RUNBRAKE_MAX_TOOL_CALLS_PER_TURN", defaults.max_tool_calls_per_turn, 1, 1000),
            max_steps_cap=_int(env, "RUNBRAKE_MAX_STEPS_CAP", defaults.max_steps_cap, 1, 1_000_000),
            retention_s=_int(env, "RUNBRAKE_RETENTION_S", defaults.retention_s, 0),
            redrive_s=_int(env, "RUNBRAKE_REDRIVE_S", defaults.redrive_s, 1),
            drain_s=_int(env, "RUNBRAKE_DRAIN_S", defaults.drain_s, 0, 86_400),
            api_tokens=env.get("RUNBRAKE_API_TOKENS") or None,
            health_port=_int(env, "RUNBRAKE_HEALTH_PORT", defaults.health_port, 0, 65535),
            health_host=_host(env, "RUNBRAKE_HEALTH_HOST", defaults.health_host),
            redis_cluster=_bool(env, "RUNBRAKE_REDIS_CLUSTER", defaults.redis_cluster),
            queue_type=_choice(env, "RUNBRAKE_QUEUE_TYPE", defaults.queue_type, ("classic", "quorum")),
            api_allowed_hosts=_hosts(env, "RUNBRAKE_API_ALLOWED_HOSTS"),
            api_header_timeout_s=_float(env, "RUNBRAKE_API_HEADER_TIMEOUT_S", defaults.api_header_timeout_s),
            api_send_timeout_s=_float(env, "RUNBRAKE_API_SEND_TIMEOUT_S", defaults.api_send_timeout_s),
            api_max_streams_per_token=_int(
                env, "RUNBRAKE_API_MAX_STREAMS_PER_TOKEN", defaults.api_max_streams_per_token, 1, 100_000),
        )


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _bool(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    if raw.lower() in _TRUE:
        return True
    if raw.lower() in _FALSE:
        return False
    raise ConfigError(name, f"must be true or false, got {raw!r}")


_LABEL = r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOSTNAME = re.compile(rf"^(?=.{{1,253}}$){_LABEL}(\.{_LABEL})*$")


def _host(env: Mapping[str, str], name: str, default: str) -> str:
    """An IP address (``127.0.0.1``, ``0.0.0.0``, ``::``) or a host name to listen on."""
    raw = env.get(name) or default
    try:
        ipaddress.ip_address(raw)
    except ValueError:
        if not _HOSTNAME.fullmatch(raw):
            raise ConfigError(name, f"must be an IP address or a host name, got {raw[:100]!r}") from None
    return raw


def _choice(env: Mapping[str, str], name: str, default: str, choices: tuple[str, ...]) -> str:
    raw = env.get(name) or default
    if raw not in choices:
        raise ConfigError(name, f"must be one of {', '.join(choices)}, got {raw!r}")
    return raw


def _hosts(env: Mapping[str, str], name: str) -> tuple[str, ...] | None:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return None
    hosts = tuple(part.strip().lower() for part in raw.split(","))
    for host in hosts:
        if not _ALLOWED_HOST.fullmatch(host):
            raise ConfigError(name, f"must be comma-separated host names (host, host:port, [::1] or *), got {host!r}")
    return hosts


def _int(env: Mapping[str, str], name: str, default: int, low: int, high: int = 10**9) -> int:
    return _number(env, name, default, int, "an integer", low=low, high=high)


def _float(env: Mapping[str, str], name: str, default: float) -> float:
    return _number(env, name, default, float, "a number", low=0.001, high=3600.0)


_N = TypeVar("_N", int, float)


def _number(env: Mapping[str, str], name: str, default: _N, kind: type[_N], what: str, *, low: _N, high: _N) -> _N:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = kind(raw)
    except ValueError:
        raise ConfigError(name, f"must be {what}, got {raw!r}") from None
    if not low <= value <= high:
        raise ConfigError(name, f"must be from {low} to {high}, got {value}")
    return value
