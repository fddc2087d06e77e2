"""Settings: one frozen dataclass, read once from the environment at the edge and passed in.

Each setting is declared once, as a field of :class:`Settings`: its variable is ``RUNBRAKE_`` plus the
field's name in capitals, its type and rule are the annotation, its default is the value, and its
docstring is its documentation. ``Settings.from_env()`` reads the variables; ``docs/configuration.md`` is
generated from the same fields (``python -m runbrake.shared._settings_doc``, checked by tests/test_docs.py).
Plain Python, no pydantic: every command reads the settings, and ``runbrake show`` and ``cancel`` start in
under 0.3 s (docs/benchmarks.md, "CLI start-up (`bench/cli_startup.py`)").
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import re
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar

from runbrake.shared.errors import ConfigError

PREFIX = "RUNBRAKE_"

_NAMESPACE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_ALLOWED_HOST = re.compile(r"^(\*|([a-z0-9][a-z0-9.-]{0,252}|\[[0-9a-f:.]{2,45}\])(:[0-9]{1,5})?)$")
_LABEL = r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOSTNAME = re.compile(rf"^(?=.{{1,253}}$){_LABEL}(\.{_LABEL})*$")
_SERVICE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
MAX_RABBITMQ_NODES = 16
MAX_SENTINELS = 16
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


class _Refused(ValueError):
    """A variable's value that its setting's rule refuses; the message says why (``ConfigError`` names it)."""


def _refuse(message: str) -> _Refused:
    return _Refused(message)


@dataclass(frozen=True, slots=True)
class _Check:
    """A setting's rule: parses the variable's text (a keyword value passes as it is) and says what it accepts.

    ``empty_keeps_default``: an empty variable counts as unset (true for every setting but the service URLs
    and the namespace, for which an empty value is a mistake to report).
    """

    accepts: str
    parse: Callable[[Any], Any]
    empty_keeps_default: bool = True


def _number(kind: type[int] | type[float], low: float, high: float) -> _Check:
    what = "an integer" if kind is int else "a number"

    def parse(raw: Any) -> Any:
        value = raw
        if isinstance(raw, str):
            try:
                value = kind(raw)
            except ValueError:
                raise _refuse(f"must be {what}, got {raw!r}") from None
        if isinstance(value, int | float) and not isinstance(value, bool) and not low <= value <= high:
            raise _refuse(f"must be from {low} to {high}, got {value}")
        return value

    return _Check(f"{what}, {low} to {high}", parse)


def _integer(low: int, high: int = 10**9) -> _Check:
    return _number(int, low, high)


_SECONDS = _number(float, 0.001, 3600.0)


def _parse_bool(raw: Any) -> Any:
    if not isinstance(raw, str):
        return raw
    if raw.lower() in _TRUE:
        return True
    if raw.lower() in _FALSE:
        return False
    raise _refuse(f"must be true or false, got {raw!r}")


_BOOL = _Check(f"{', '.join(_TRUE)} / {', '.join(_FALSE)}", _parse_bool)


def _prefixed(*schemes: str) -> _Check:
    names = [f"{scheme}//" for scheme in schemes]
    listed = f"{', '.join(names[:-1])} or {names[-1]}"
    article = "an" if listed[0] in "aeiou" else "a"

    def parse(raw: Any) -> Any:
        if isinstance(raw, str) and not raw.startswith(schemes):
            raise _refuse(f"must be {article} {listed} URL")
        return raw

    return _Check(f"{article} {listed} URL", parse, empty_keeps_default=False)


def _parse_amqp_urls(raw: Any) -> Any:
    """One or more AMQP URLs, comma-separated (the nodes of a RabbitMQ cluster, tried in order)."""
    if not isinstance(raw, str):
        return raw
    urls = [part.strip() for part in raw.split(",")]
    if len(urls) > MAX_RABBITMQ_NODES:
        raise _refuse(f"names at most {MAX_RABBITMQ_NODES} nodes, got {len(urls)}")
    for url in urls:
        if not url.startswith(("amqp://", "amqps://")):
            raise _refuse(f"must be amqp:// or amqps:// URLs, comma-separated, got {url[:100]!r}")
    return ",".join(urls)


def _parse_sentinels(raw: Any) -> Any:
    """``host:port`` pairs, comma-separated; empty: no Sentinel."""
    if not isinstance(raw, str):
        return raw
    if raw.strip() == "":
        return ()
    pairs = []
    for part in (item.strip() for item in raw.split(",")):
        host, _, port = part.rpartition(":")
        host = host.removeprefix("[").removesuffix("]")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise _refuse(f"must be comma-separated host:port pairs, got {part[:100]!r}")
        try:
            ipaddress.ip_address(host)
        except ValueError:
            if not _HOSTNAME.fullmatch(host):
                raise _refuse(f"must be comma-separated host:port pairs, got {part[:100]!r}") from None
        pairs.append((host, int(port)))
    if len(pairs) > MAX_SENTINELS:
        raise _refuse(f"names at most {MAX_SENTINELS} sentinels, got {len(pairs)}")
    return tuple(pairs)


def _parse_service(raw: Any) -> Any:
    if isinstance(raw, str) and raw and not _SERVICE.fullmatch(raw):
        raise _refuse(f"must be 1-64 letters, digits, '.', '_' or '-', got {raw[:100]!r}")
    return raw


def _parse_namespace(raw: Any) -> Any:
    if isinstance(raw, str) and not _NAMESPACE.fullmatch(raw):
        raise _refuse("use 1-64 letters, digits, '.', '_' or '-'")
    return raw


def _parse_host(raw: Any) -> Any:
    """An IP address (``127.0.0.1``, ``0.0.0.0``, ``::``) or a host name to listen on."""
    if not isinstance(raw, str):
        return raw
    try:
        ipaddress.ip_address(raw)
    except ValueError:
        if not _HOSTNAME.fullmatch(raw):
            raise _refuse(f"must be an IP address or a host name, got {raw[:100]!r}") from None
    return raw


def _choice(*choices: str) -> _Check:
    def parse(raw: Any) -> Any:
        if isinstance(raw, str) and raw not in choices:
            raise _refuse(f"must be one of {', '.join(choices)}, got {raw!r}")
        return raw

    return _Check(" or ".join(choices), parse)


def _parse_hosts(raw: Any) -> Any:
    if not isinstance(raw, str):
        return raw
    if raw.strip() == "":
        return None
    hosts = tuple(part.strip().lower() for part in raw.split(","))
    for host in hosts:
        if not _ALLOWED_HOST.fullmatch(host):
            raise _refuse(f"must be comma-separated host names (host, host:port, [::1] or *), got {host!r}")
    return hosts


def _parse_path(raw: Any) -> Any:
    return raw or None


_PATH = _Check("a file path", _parse_path)


@dataclass(frozen=True, kw_only=True)
class Settings:
    """How this process reaches its services and the bounds it works within.

    ``Settings(...)`` takes keyword fields (unset ones keep their defaults), checked by each field's rule, and
    never reads the environment; ``Settings.from_env()`` reads it, once, at the edge. Frozen:
    ``with_changes(**fields)`` makes a copy.

    Raises:
        ConfigError: naming the variable of a field whose value cannot be used.
    """

    rabbitmq_url: Annotated[
        str, _Check("`amqp://` or `amqps://` URLs, comma-separated", _parse_amqp_urls, empty_keeps_default=False)
    ] = "amqp://guest:guest@127.0.0.1:5672/"
    """RabbitMQ for run messages and cancel messages: one node's URL, or the URLs of a cluster's nodes,
    comma-separated (at most 16). Every connection (the producer, each consumer, the cancel listener, the
    publishers) tries them in order and, when the node it was on goes, reconnects to the first that answers
    (docs/operating.md, "A RabbitMQ cluster")."""
    redis_url: Annotated[str, _prefixed("redis:", "rediss:", "unix:")] = "redis://127.0.0.1:6379/0"
    """Redis, the authority for runs, steps and cancel keys."""
    namespace: Annotated[str, _Check("1-64 letters, digits, `.`, `_` or `-`", _parse_namespace, False)] = "runbrake"
    """Prefix of every Redis key, of the queue `<ns>.runs` and of every exchange (`<ns>.cancel`…), so two
    deployments (or two test runs) on one broker never see each other's runs."""
    max_tool_result_chars: Annotated[int, _integer(1)] = 16_000
    """Bound on each content channel of a tool result, in characters."""
    mcp_progress: Annotated[str, _choice("always", "off")] = "always"
    """Whether the worker asks MCP servers for progress of its tool calls (`_meta.progressToken`): `always`
    (each call's latest report is kept for `runbrake show`, the runs page and the events stream), or
    `off` (no call asks, so servers send none and the worker's loop handles none). A report cost the
    worker's loop 0.2–0.35 ms of CPU on a shared 2-core machine (docs/benchmarks.md, "Notifications per
    process")."""
    event_loop: Annotated[str, _choice("uvloop", "asyncio")] = "uvloop"
    """The worker's event loop: `uvloop` (libuv's, under the same asyncio and anyio API) or `asyncio`
    (the standard library's). uvloop took 13–18 % off the loop's CPU per MCP progress notification
    with the SDK alone, and up to 13 % more on top of the worker's own handling (docs/benchmarks.md,
    "Notifications per process")."""
    switch_interval_ms: Annotated[float, _number(float, 0.1, 100.0)] = 1.0
    """How long the worker's event loop may hold Python's GIL while another thread waits for it, in
    milliseconds (`sys.setswitchinterval`; Python's own default is 5): a cancel reaches the cancel
    listener's thread while the loop is busy, and waits this long at most before it is handled."""
    gc_interval_s: Annotated[float, _number(float, 0, 3600.0)] = 0.5
    """How often a worker process collects the garbage among the objects it allocated since the last time, in
    seconds (0: never; Python's allocation thresholds alone); the survivors are then frozen out of the
    collector's sight, and the whole heap is collected once the frozen part has doubled. The worker's
    thresholds make collections of older objects hours apart, and the cycles its runs leave (cancel scopes,
    exceptions) waited that long: its RSS rose 9.5 % over a 30-minute soak (docs/benchmarks.md, "Soak: the
    RSS growth"). A shorter interval makes each collection shorter (it walks what came since the last): at
    about 1,000 runs held, 10 s apart paused the process 108-198 ms, and at 300-450 runs held (loaded) 1 s apart
    34-38 ms and 0.5 s apart 15 ms on average (docs/benchmarks.md, "Saturation: the collector's pause")."""
    admit_max_lag_ms: Annotated[float, _number(float, 0, 10_000.0)] = 50.0
    """The event loop's lag past which a worker process takes no new run, in milliseconds (0: not watched).
    The lag is how late a callback scheduled on the loop from another thread runs, the 90th percentile of
    the last second; past it a run's message is held and then handed back to the queue for a worker with
    room (docs/leases.md, "Capacity: runs in flight"), so the runs the process holds keep their cancels
    fast. `--concurrency` stays the upper bound."""
    admit_max_cpu_pct: Annotated[float, _number(float, 0, 100.0)] = 35.0
    """The share of one core past which a worker process takes no new run, in percent (0: not watched): the
    CPU it used over the last second (plus the time its threads waited for a core the machine gave to
    others), divided by its runs in flight, is projected to one run more. The loop's
    lag stays near zero until the loop is nearly always busy and then grows fast; the CPU grows in proportion
    to the runs held, so this bound refuses the run that would cost the held runs their prompt cancels before
    the lag shows (docs/leases.md, "Capacity: runs in flight")."""
    admit_max_pause_ms: Annotated[float, _number(float, 0, 10_000.0)] = 15.0
    """The collector's pause past which a worker process takes no new run, in milliseconds (0: not watched): the
    longest collection of the last 5 s. A collection holds every thread of the process, and a cancel that comes
    meanwhile waits for it: the slowest cancels amid hundreds of runs held each met one, and the collections'
    pauses grow with the runs held (docs/benchmarks.md, "Saturation: where a cancel's time went")."""
    admit_max_rss_mb: Annotated[int, _integer(0, 1_048_576)] = 0
    """The resident memory past which a worker process takes no new run, in MiB (0: not watched). Set it
    below the container's memory limit: a process that stops taking runs is not OOM-killed with all of them."""
    admit_min_runs: Annotated[int, _integer(0, 100_000)] = 16
    """Below this many runs in flight a worker process takes a run whatever its loop's lag and memory say: a
    lag it did not cause (a collection, a neighbour on the machine) does not starve a nearly idle process."""
    cancel_poll_ms: Annotated[int, _integer(10)] = 250
    """Backstop interval: how often a worker reads its active runs' cancel keys, in milliseconds."""
    run_time_limit_s: Annotated[int, _integer(1)] = 3600
    """Wall-clock limit of one segment of a run, in seconds; hitting it fails the run with reason
    `time_limit`."""
    model_retries: Annotated[int, _integer(0, 20)] = 4
    """Retries of a model call that failed with 429, 408, 409, a 5xx, a timeout or a connection error, after
    its first attempt (0: none), with exponential backoff and full jitter; a catalog model's `max_retries`
    overrides it (docs/leases.md, "Retries")."""
    model_retry_max_s: Annotated[float, _number(float, 0, 3600.0)] = 60.0
    """Most time one model call may spend waiting between its attempts, in seconds; a wait (a backoff, or
    the endpoint's `Retry-After`) that would go past it gives up instead."""
    lease_s: Annotated[int, _integer(5)] = 60
    """How long a worker's claim on a run is good for without renewal, in seconds; the holding worker renews
    it every third of that, and any worker fails a run whose lease expired (`lease_lost`)."""
    worker_beat_s: Annotated[float, _number(float, 0.1, 60.0)] = 1.0
    """How often each worker process says it is alive (one Redis round trip from a thread of its own, off the
    event loop), in seconds (docs/leases.md, "Lost workers")."""
    worker_lost_s: Annotated[float, _number(float, 1.0, 3600.0)] = 6.0
    """A worker process that has not said it is alive for this long is lost, in seconds: any other worker
    puts its runs back to `queued` (each call it had in flight recorded `cancelled`, `worker_lost`) and another
    worker continues them. Keep it several beats (`RUNBRAKE_WORKER_BEAT_S`) long."""
    max_worker_losses: Annotated[int, _integer(0)] = 3
    """How many lost workers a run survives: the next loss ends it `failed` (`lease_lost`) rather than
    resuming it, so a run that kills every worker it lands on stops (0: the first loss ends it)."""
    metrics_port: Annotated[int, _integer(0, 65535)] = 0
    """Port of the worker's Prometheus `/metrics` (process *i* of `--processes` serves port + *i*); 0 turns
    it off."""
    redis_timeout_s: Annotated[float, _SECONDS] = 2.0
    """Socket timeout for Redis calls, in seconds."""
    catalog: Annotated[str | None, _PATH] = None
    """Path of the operator's catalog (TOML) of MCP servers and models a spec may name, read by every
    process; unset: an empty catalog."""
    allow_inline: Annotated[bool, _BOOL] = False
    """Accept inline MCP servers and models in a spec (development and tests only: whoever enqueues then
    chooses what the worker starts and reaches)."""
    rabbitmq_allow_untenanted: Annotated[bool, _BOOL] = True
    """Accept run and cancel requests on RabbitMQ whose `user_id` the catalog's `[rabbitmq_users]` does not map
    to a tenant (or that carry none): they act as an operator, on every run. True keeps the requests of
    backends that predate tenants working; set it false once the catalog maps every publishing user, and the
    others are refused (answered, or dead-lettered with the reason). docs/security.md, "Tenants"."""
    max_spec_bytes: Annotated[int, _integer(1024, 64 * 1_048_576)] = 1_048_576
    """Largest run spec accepted, in bytes (1 MiB); a larger one makes the CLI exit 2 and `POST /v1/runs`
    answer `413`."""
    max_input_chars: Annotated[int, _integer(1, 10_000_000)] = 100_000
    """Longest `input` accepted, in characters."""
    max_messages: Annotated[int, _integer(0, 100_000)] = 1000
    """Most `messages` (the conversation before `input`) a spec may carry."""
    max_history_chars: Annotated[int, _integer(1, 100_000_000)] = 500_000
    """Bound on the `messages` of a spec: their `content` and tool-call arguments (as JSON) together, in
    characters."""
    max_output_schema_bytes: Annotated[int, _integer(2, 10_485_760)] = 65_536
    """Largest `output_schema` a spec may carry, in bytes of compact JSON (64 KiB)."""
    schema_check_s: Annotated[float, _SECONDS] = 5.0
    """Seconds of wall clock one check of an `output_schema` (at enqueue, at claim) or of a final answer against
    it may take, in a child process of its own; a schema past it is refused naming `output_schema`, an answer
    past it is handed back to the model as a mismatch (docs/security.md, "Bounds")."""
    max_argument_chars: Annotated[int, _integer(100, 10_000_000)] = 16_000
    """Bound on a tool call's arguments as stored (JSON characters)."""
    max_model_content_chars: Annotated[int, _integer(1000, 10_000_000)] = 100_000
    """Bound on a model turn's text as kept (the step, the conversation, the final answer), in characters;
    a longer one is cut with a mark and its step's `detail.content_truncated` says so. The default is
    the bound on `input` (`RUNBRAKE_MAX_INPUT_CHARS`): some 25,000 tokens, past the output limit of
    most models, while a step stays small enough to send whole on every events replay."""
    max_tool_calls_per_turn: Annotated[int, _integer(1, 1000)] = 32
    """Most tool calls one model turn may ask for; more fails the run (`too_many_tool_calls`)."""
    max_parallel_tool_calls: Annotated[int, _integer(1, 1000)] = 8
    """Most tool calls of one turn a run has in flight at once (the others of the turn wait for a free
    place, in call order); a catalog server's `max_concurrency` bounds its calls per worker process too.
    1 runs a turn's calls one after another."""
    max_steps_cap: Annotated[int, _integer(1, 1_000_000)] = 1000
    """Highest `max_steps` a spec may ask for (its default is 200)."""
    max_agent_depth: Annotated[int, _integer(1, 16)] = 3
    """Deepest agent tree: a run that calls catalog agents (`agents`) may make chains of child runs this many
    levels below it, no more (docs/usage.md, "Agent trees"); a spec or catalog agent that could go deeper is
    refused."""
    max_agent_calls: Annotated[int, _integer(1, 10_000)] = 16
    """Most child runs one run may start by calling agents; a call past it is a failed tool result."""
    retention_s: Annotated[int, _integer(0)] = 7 * 24 * 3600
    """How long a finished run's record is kept, in seconds (7 days); 0 keeps it forever."""
    webhook_retry_s: Annotated[int, _integer(1)] = 86_400
    """How long a webhook delivery is retried after its event, in seconds (24 h); then it is given up and
    recorded (docs/webhooks.md)."""
    webhook_backoff_s: Annotated[float, _SECONDS] = 1.0
    """The first wait before a failed webhook delivery is tried again, in seconds; it doubles with each
    failure up to `RUNBRAKE_WEBHOOK_BACKOFF_MAX_S` (each wait jittered down by up to half)."""
    webhook_backoff_max_s: Annotated[float, _SECONDS] = 60.0
    """The longest wait between two attempts of a webhook delivery, in seconds: a receiver that comes back
    gets its deliveries within about this long."""
    webhook_timeout_s: Annotated[float, _SECONDS] = 10.0
    """How long one webhook request may take as a whole (connect, send, the answer read to its end; not each
    read), in seconds; longer is a failure."""
    webhook_concurrency: Annotated[int, _integer(1, 256)] = 16
    """Webhook requests in flight at once per worker process that delivers (one run's stay in order)."""
    redrive_s: Annotated[int, _integer(1)] = 60
    """A run queued this long without being claimed has its message sent again, in seconds."""
    drain_s: Annotated[int, _integer(0, 86_400)] = 30
    """On SIGTERM, how long runs in flight may go on before they are handed to another worker, in
    seconds."""
    api_tokens: Annotated[str | None, _PATH] = None
    """Path of the HTTP API's tokens file (TOML); unset: no authentication, and the API serves loopback
    only."""
    health_port: Annotated[int, _integer(0, 65535)] = 0
    """Port of the worker's `/healthz` and `/readyz` (process *i* of `--processes` serves port + *i*); 0
    turns it off."""
    health_host: Annotated[str, _Check("an IP address or a host name", _parse_host)] = "127.0.0.1"
    """Address the worker's health and metrics ports listen on: loopback, unless set (`0.0.0.0` or `::`
    where a kubelet or a scraper reaches the pod's address; the Kubernetes manifests set it)."""
    redis_cluster: Annotated[bool, _BOOL] = False
    """`RUNBRAKE_REDIS_URL` names seed nodes of a Redis Cluster; each namespace is spread over 16
    hash-tagged shards, every script touching one slot (docs/store.md, "The run store on a Redis
    Cluster"). Single-node key names are unchanged when off."""
    redis_sentinels: Annotated[
        tuple[tuple[str, int], ...], _Check("comma-separated `host:port` pairs", _parse_sentinels)
    ] = ()
    """Redis Sentinels (`host:port,…`, at most 16) that name the primary of `RUNBRAKE_REDIS_SENTINEL_MASTER`;
    the store follows the primary they promote. `RUNBRAKE_REDIS_URL` then gives only the database, the
    password and the scheme (`rediss://` for TLS), not the host (docs/operating.md, "Redis failover").
    Unset: `RUNBRAKE_REDIS_URL` names the Redis. Not with `RUNBRAKE_REDIS_CLUSTER`."""
    redis_sentinel_master: Annotated[str, _Check("1-64 letters, digits, `.`, `_` or `-`", _parse_service)] = ""
    """The name the Sentinels monitor the primary under (their `sentinel monitor NAME …`); required with
    `RUNBRAKE_REDIS_SENTINELS`."""
    redis_min_replicas_ack: Annotated[int, _integer(0, 16)] = 0
    """Replicas that must acknowledge each transition that may not be lost once acknowledged (create, the
    cancel fence, approve, deny, settle, hand-over) before it is answered: each is followed by `WAIT n`,
    and fails as a store error when fewer replicas have it within `RUNBRAKE_REDIS_REPLICA_ACK_TIMEOUT_S`
    (the worker retries it as it retries an outage). 0 turns it off (docs/operating.md, "Redis failover")."""
    redis_replica_ack_timeout_s: Annotated[float, _SECONDS] = 1.0
    """How long a transition waits for `RUNBRAKE_REDIS_MIN_REPLICAS_ACK` replicas, in seconds; below
    `RUNBRAKE_REDIS_TIMEOUT_S`."""
    otel: Annotated[bool, _BOOL] = False
    """Traces (OpenTelemetry): spans for the enqueue, each run segment, model call, tool call and cancel,
    exported over OTLP/HTTP as the standard `OTEL_EXPORTER_OTLP_*` variables say, and the W3C `traceparent`
    carried in the run and cancel messages and every MCP HTTP request (docs/operating.md, "Traces"). Needs
    the `otel` extra (`pip install "runbrake[otel]"`); off, runbrake imports neither OpenTelemetry's tracing SDK
    nor its exporter."""
    queue_type: Annotated[str, _choice("classic", "quorum")] = "classic"
    """How the run and cancel-request queues are declared: `quorum` declares `<ns>.runs` and its
    `.DQ`/`.XQ` twins, and `<ns>.cancel-requests` and its dead-letter queue, as quorum queues."""
    api_allowed_hosts: Annotated[
        tuple[str, ...] | None,
        _Check("comma-separated `host`, `host:port`, `[::1]` or `*`", _parse_hosts),
    ] = None
    """`Host` headers the HTTP API answers (lowercase; `name` any port, `name:port` that port, `*` any
    host); any other is `400` (DNS rebinding; `/healthz` and `/readyz` answer any). Unset: the loopback
    names (`127.0.0.1`, `localhost`, `[::1]`) without tokens, any host with tokens (docs/http-api.md,
    "Allowed hosts")."""
    api_header_timeout_s: Annotated[float, _SECONDS] = 10.0
    """How long the HTTP API waits for a request's headers to be complete, in seconds, before it closes
    the connection (`408`; slowloris)."""
    api_send_timeout_s: Annotated[float, _SECONDS] = 30.0
    """How long `runbrake serve` waits for an events client to take the next chunk of its stream before
    it drops the client (its socket buffer stayed full), in seconds (docs/http-api.md, "Events: limits")."""
    api_max_streams_per_token: Annotated[int, _integer(1, 100_000)] = 16
    """Event streams (`/v1/runs/{id}/events` and `/v1/events` together) one token may hold open at once on
    one `serve` process (without tokens: all clients together); the next is `429`."""

    variables: ClassVar[Mapping[str, str]]
    """Each field's environment variable (filled in below the class)."""

    def __post_init__(self) -> None:
        for name, (check, kinds) in _RULES.items():
            try:
                value = _conform(check.parse(getattr(self, name)), kinds)
            except _Refused as exc:
                raise ConfigError(self.variables[name], str(exc)) from None
            object.__setattr__(self, name, value)  # the parsed value: frozen, so past the dataclass's guard
        self._check_together()

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        """Read ``RUNBRAKE_*`` variables (``os.environ`` unless given); unset ones keep their defaults. Exactly
        ``RUNBRAKE_<FIELD>`` in capitals is read; an empty variable counts as unset, except where the field's
        rule says an empty value is a mistake (``_Check.empty_keeps_default``).

        Raises:
            ConfigError: naming the variable whose value cannot be used.
        """
        source = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for name, variable in cls.variables.items():
            raw = source.get(variable)
            if raw is None or (raw == "" and _RULES[name][0].empty_keeps_default):
                continue
            values[name] = raw
        return cls(**values)

    def with_changes(self, **changes: Any) -> Settings:
        """A copy with these fields changed, checked like keyword fields.

        Raises:
            ConfigError: naming the variable of a field whose value cannot be used.
        """
        return dataclasses.replace(self, **changes)

    @property
    def rabbitmq_urls(self) -> tuple[str, ...]:
        """The RabbitMQ nodes' URLs, in the order connections try them."""
        return tuple(self.rabbitmq_url.split(","))

    def _check_together(self) -> None:
        """The rules that span settings.

        Raises:
            ConfigError: naming the variable that cannot be used with the others.
        """
        variables = type(self).variables
        if self.redis_sentinels and not self.redis_sentinel_master:
            raise ConfigError(variables["redis_sentinel_master"], "is required with RUNBRAKE_REDIS_SENTINELS")
        if self.redis_sentinels and self.redis_cluster:
            raise ConfigError(variables["redis_sentinels"], "cannot be used with RUNBRAKE_REDIS_CLUSTER")
        if self.redis_sentinels and self.redis_url.startswith("unix:"):
            raise ConfigError(variables["redis_url"],
                              "must be a redis:// or rediss:// URL with RUNBRAKE_REDIS_SENTINELS")
        if self.redis_min_replicas_ack and self.redis_cluster:
            raise ConfigError(variables["redis_min_replicas_ack"], "cannot be used with RUNBRAKE_REDIS_CLUSTER "
                              "(a WAIT counts one node's replicas)")
        if self.redis_min_replicas_ack and self.redis_replica_ack_timeout_s >= self.redis_timeout_s:
            raise ConfigError(variables["redis_replica_ack_timeout_s"],
                              f"must be below RUNBRAKE_REDIS_TIMEOUT_S ({self.redis_timeout_s:g} s): the WAIT "
                              "that waits for replicas would outlast the socket")


Settings.variables = {field.name: f"{PREFIX}{field.name.upper()}" for field in dataclasses.fields(Settings)}


def _kinds(annotation: Any) -> tuple[type, ...]:
    """The types a field's value may have once parsed: its annotation's, a union's members."""
    if typing.get_origin(annotation) is Annotated:
        return _kinds(typing.get_args(annotation)[0])
    if isinstance(annotation, type):
        return (annotation,)
    origin = typing.get_origin(annotation)
    if isinstance(origin, type) and origin is not type(None) and origin.__module__ == "builtins":
        return (origin,)  # tuple[...]: what the rule parsed is a tuple of what it says
    return tuple(kind for member in typing.get_args(annotation) for kind in _kinds(member))


def _conform(value: Any, kinds: tuple[type, ...]) -> Any:
    """``value`` as a field of these types takes it: an int for a float field becomes a float, a bool is
    never a number.

    Raises:
        _Refused: the value is none of the field's types.
    """
    if isinstance(value, bool) and bool not in kinds:
        raise _refuse(f"must be {' or '.join(kind.__name__ for kind in kinds)}, got {value!r}")
    if float in kinds and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, kinds):
        raise _refuse(f"must be {' or '.join(kind.__name__ for kind in kinds)}, got {repr(value)[:100]}")
    return value


_RULES: dict[str, tuple[_Check, tuple[type, ...]]] = {
    name: (next(item for item in typing.get_args(hint)[1:] if isinstance(item, _Check)), _kinds(hint))
    for name, hint in typing.get_type_hints(Settings, include_extras=True).items()
    if name in Settings.variables
}
"""Each field's rule and the types its value may have, read once from the annotations."""


def check_of(name: str) -> _Check:
    """The rule of the field ``name`` of :class:`Settings` (what it accepts, how its variable is parsed)."""
    return _RULES[name][0]


def descriptions() -> dict[str, str]:
    """Each field's documentation: the docstring below it in the class's source (for docs/configuration.md)."""
    import ast  # noqa: PLC0415 - only the generated page and its test read the docstrings
    import inspect  # noqa: PLC0415

    body = ast.parse(inspect.getsource(Settings)).body[0]
    assert isinstance(body, ast.ClassDef)
    found: dict[str, str] = {}
    for statement, following in zip(body.body, body.body[1:], strict=False):
        if (isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)
                and isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str) and statement.target.id in Settings.variables):
            found[statement.target.id] = inspect.cleandoc(following.value.value)
    return found
