"""The ``runbrake`` command (docs/usage.md, "Using it").

Exit codes: 0 success, 1 refused by the run's state (unknown run, already finished,
not waiting), 2 bad input (nothing written or sent), 3 a service (Redis, RabbitMQ)
could not be reached.

Each command imports what it needs when it runs: ``runbrake --help`` loads click and the error classes,
``show`` the store and the renderer, ``cancel`` the store and the cancel publisher, and none loads pydantic
(the run spec's models; the settings are a plain dataclass), Dramatiq or the async store (docs/benchmarks.md,
"CLI start-up (`bench/cli_startup.py`)"; tests/test_cli_startup.py). Every ops script pays a command's
start-up on every call.
"""

from __future__ import annotations

import contextlib
import functools
import getpass
import ipaddress
import json
import socket
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Final, NoReturn, TypeVar, cast

import click

from runbrake.shared.errors import (
    ConfigError,
    IdempotencyConflict,
    InvalidRunId,
    NotReplicated,
    PublishError,
    RunbrakeError,
    RunNotFound,
    SpecError,
    StoreError,
    TransitionRefused,
)
from runbrake.shared.status import RunStatus

if TYPE_CHECKING:
    from runbrake.shared.messaging.producer import Enqueued
    from runbrake.shared.settings import Settings
    from runbrake.shared.store import RunStore

EXIT_REFUSED = 1
EXIT_BAD_INPUT = 2
EXIT_UNAVAILABLE = 3

EXIT_CODES: Final[dict[type[RunbrakeError], int]] = {
    SpecError: EXIT_BAD_INPUT,
    ConfigError: EXIT_BAD_INPUT,
    InvalidRunId: EXIT_BAD_INPUT,
    RunNotFound: EXIT_REFUSED,
    TransitionRefused: EXIT_REFUSED,
    IdempotencyConflict: EXIT_REFUSED,
    StoreError: EXIT_UNAVAILABLE,
    PublishError: EXIT_UNAVAILABLE,
}
"""The one map from the errors of the operations (shared/operations.py) and the settings to the contract's
exit codes: 1 refused by the run's state, 2 bad input, 3 a service could not be reached. A subclass takes
its nearest listed ancestor's code; an error not listed is a bug, and shows its traceback."""

F = TypeVar("F", bound=Callable[..., Any])


def fail(message: str, code: int) -> NoReturn:
    click.echo(f"runbrake: error: {message}", err=True)
    sys.exit(code)


def exit_code(exc: RunbrakeError) -> int | None:
    """The exit code of ``exc`` (:data:`EXIT_CODES`), or None when it is not one a user can act on."""
    return next((EXIT_CODES[kind] for kind in type(exc).__mro__ if kind in EXIT_CODES), None)


def _messages(exc: RunbrakeError) -> list[str]:
    """What the user is told about ``exc``: one line per problem of an invalid spec, so that every mistake
    can be fixed in one go."""
    if isinstance(exc, SpecError):
        return [f"invalid spec: {problem.field}: {problem.msg}" for problem in exc.problems]
    if isinstance(exc, ConfigError):
        return [f"invalid setting {exc}"]
    if isinstance(exc, NotReplicated):  # Redis answered: the hint about a service not running would mislead
        return [f"{exc}; asking again is safe (docs/operating.md, 'Redis failover')"]
    if isinstance(exc, StoreError | PublishError):
        return [f"{exc} (is the service running? see docs/development.md, 'Services')"]
    return [str(exc)]


def user_errors(command: F) -> F:
    """Turn runbrake's errors into one-line messages and the contract's exit code (:data:`EXIT_CODES`);
    no traceback."""

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except RunbrakeError as exc:
            code = exit_code(exc)
            if code is None:
                raise
            for line in _messages(exc):
                click.echo(f"runbrake: error: {line}", err=True)
            sys.exit(code)

    return cast(F, wrapper)


def settings_from_env() -> Settings:
    """The settings of this command, read once; tracing turned on when they say so (docs/operating.md, "Traces")."""
    from runbrake.shared import tracing
    from runbrake.shared.settings import Settings

    settings = Settings.from_env()
    tracing.configure(settings, service="runbrake")
    return settings


@contextmanager
def open_store(settings: Settings) -> Iterator[RunStore]:
    from runbrake.shared.store import RunStore

    store = RunStore.connect(settings)
    try:
        yield store
    finally:
        store.close()


def whoami() -> str:
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


def emit_json(data: object) -> None:
    click.echo(json.dumps(data, indent=2, sort_keys=False))


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="runbrake")
@click.pass_context
def main(ctx: click.Context) -> None:
    """Run LLM agent runs on workers, and stop them for real.

    Configuration comes from RUNBRAKE_REDIS_URL, RUNBRAKE_RABBITMQ_URL and
    RUNBRAKE_NAMESPACE. Exit codes: 0 success, 1 refused by the run's state,
    2 bad input (nothing written or sent), 3 a service could not be reached.
    """
    from runbrake.shared.logging import configure_logging

    # A worker reports what it does; the one-shot commands speak only up when something is wrong.
    configure_logging("INFO" if ctx.invoked_subcommand in ("worker", "serve") else "WARNING")


class _RunId(click.ParamType[str]):
    """A run id argument: a malformed one is bad input (exit 2), echoed at most 100 characters."""

    name = "RUN_ID"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        from runbrake.shared.records import check_run_id

        try:
            return check_run_id(str(value))
        except InvalidRunId as exc:
            self.fail(str(exc), param, ctx)


RUN_ID = _RunId()


@main.command()
@click.argument("spec_file", type=click.Path(dir_okay=False, allow_dash=True))
@click.option("--json", "as_json", is_flag=True, help="Print {run_id, status} as JSON.")
@user_errors
def enqueue(spec_file: str, as_json: bool) -> None:
    """Validate SPEC_FILE (JSON, or - for stdin), persist the run and send it to the workers."""
    from runbrake.shared import operations
    from runbrake.shared.catalog import Admission
    from runbrake.shared.messaging.producer import Producer
    from runbrake.shared.messaging.rabbitmq import build_broker
    from runbrake.shared.spec import RunSpec

    settings = settings_from_env()
    limit = settings.max_spec_bytes
    try:
        # Bytes, not text: decoding is the spec's business, so that bad UTF-8 is a spec error, not a traceback.
        # Never more than the bound (and one byte to tell), however large the file.
        with (contextlib.nullcontext(sys.stdin.buffer) if spec_file == "-" else Path(spec_file).open("rb")) as f:
            data = f.read(limit + 1)
    except OSError as exc:
        fail(f"cannot read {spec_file}: {exc.strerror}", EXIT_BAD_INPUT)
    if len(data) > limit:
        raise SpecError("spec", f"is larger than {limit} bytes (RUNBRAKE_MAX_SPEC_BYTES)")
    spec = RunSpec.from_json(data)
    admission = Admission.from_settings(settings)
    broker = build_broker(settings)
    with open_store(settings) as store:
        try:
            enqueued = operations.enqueue(Producer(store, broker, admission), spec)
        finally:
            broker.close()
    _print_enqueued(enqueued, as_json)


@main.command("continue")
@click.argument("run_id", type=RUN_ID)
@click.argument("text")
@click.option("--json", "as_json", is_flag=True, help="Print {run_id, status, created} as JSON.")
@user_errors
def continue_(run_id: str, text: str, as_json: bool) -> None:
    """Enqueue a new run that carries on the finished run RUN_ID's conversation with TEXT as its input (its
    spec, labels and thread are RUN_ID's); prints the new run's id."""
    from runbrake.shared import operations
    from runbrake.shared.catalog import Admission
    from runbrake.shared.messaging.producer import Producer
    from runbrake.shared.messaging.rabbitmq import build_broker

    settings = settings_from_env()
    admission = Admission.from_settings(settings)
    broker = build_broker(settings)
    with open_store(settings) as store:
        try:
            enqueued = operations.continue_run(Producer(store, broker, admission), store, run_id, {"input": text})
        finally:
            broker.close()
    _print_enqueued(enqueued, as_json)


def _print_enqueued(enqueued: Enqueued, as_json: bool) -> None:
    if as_json:
        emit_json({"run_id": enqueued.run_id, "status": enqueued.status.value, "created": enqueued.created})
        return
    click.echo(enqueued.run_id)
    if not enqueued.created:
        click.echo(f"(idempotency key matched an existing run; it is {enqueued.status.value})", err=True)


@main.command()
@click.argument("run_id", type=RUN_ID)
@click.option("--reason", default="cancelled by operator", show_default=True, help="Why; stored with the cancel.")
@click.option("--by", "requested_by", default=None, help="Who asks (default: user@host).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@user_errors
def cancel(run_id: str, reason: str, requested_by: str | None, as_json: bool) -> None:
    """Cancel RUN_ID: win the fence in Redis, then wake the worker that runs it."""
    from runbrake.shared import operations
    from runbrake.shared.messaging.cancel import CancelPublisher

    settings = settings_from_env()
    publisher = CancelPublisher(settings)
    try:
        with open_store(settings) as store:
            try:
                result = operations.cancel(store, publisher, run_id, reason=reason,
                                           requested_by=requested_by or whoami())
            finally:
                publisher.close()
    except (RunNotFound, TransitionRefused) as exc:
        if not as_json:
            raise
        # --json answers a refusal on stdout too, with the exit code of the error (EXIT_CODES).
        emit_json({"run_id": run_id, "cancelled": False,
                   "found": exc.found.value if isinstance(exc, TransitionRefused) else None,
                   "message_confirmed": None, "message_error": None})
        sys.exit(exit_code(exc))
    if as_json:
        emit_json({
            "run_id": run_id,
            "cancelled": True,
            "found": result.found.value,
            "message_confirmed": result.message_confirmed,
            "message_error": result.message_error,
        })
        sys.exit(0)
    click.echo(f"cancelled {run_id} (was {result.found.value})")
    if result.message_confirmed:
        click.echo("cancel message: confirmed by RabbitMQ")
    else:
        click.echo(
            f"cancel message: NOT confirmed ({result.message_error}); the cancel stands, and workers find "
            f"it within RUNBRAKE_CANCEL_POLL_MS ({settings.cancel_poll_ms} ms)",
        )


@main.command()
@click.argument("run_id", type=RUN_ID)
@click.argument("text")
@click.option("--reason", default="", help="Why; recorded on the steer step.")
@click.option("--by", "requested_by", default=None, help="Who asks (default: user@host).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@user_errors
def steer(run_id: str, text: str, reason: str, requested_by: str | None, as_json: bool) -> None:
    """Steer RUN_ID: cut off its current turn and go on with TEXT as the next user message, in the same run.

    Only a running run or one waiting for approval can be steered (exit 1 otherwise, naming its status);
    one steer at a time (docs/usage.md, "Steer a run").
    """
    from runbrake.shared import operations
    from runbrake.shared.messaging.cancel import CancelPublisher
    from runbrake.shared.messaging.producer import Producer
    from runbrake.shared.messaging.rabbitmq import build_broker

    settings = settings_from_env()
    publisher, broker = CancelPublisher(settings), build_broker(settings)
    try:
        with open_store(settings) as store:
            result = operations.steer(store, publisher, Producer(store, broker), run_id, text=text, reason=reason,
                                      requested_by=requested_by or whoami(),
                                      max_input_chars=settings.max_input_chars)
    except SpecError as exc:
        for problem in exc.problems:
            click.echo(f"runbrake: error: invalid steer: {problem.field}: {problem.msg}", err=True)
        sys.exit(EXIT_BAD_INPUT)
    except (RunNotFound, TransitionRefused) as exc:
        if not as_json:
            raise
        emit_json({"run_id": run_id, "steered": False,
                   "found": exc.found.value if isinstance(exc, TransitionRefused) else None,
                   "message_confirmed": None, "message_error": None})
        sys.exit(exit_code(exc))
    finally:
        publisher.close()
        broker.close()
    if as_json:
        emit_json({"run_id": run_id, "steered": True, "found": result.found.value,
                   "message_confirmed": result.message_confirmed, "message_error": result.message_error})
        sys.exit(0)
    click.echo(f"steered {run_id} (was {result.found.value}); its worker goes on with the new message")
    if not result.message_confirmed:
        click.echo(f"steer message: NOT confirmed ({result.message_error}); the steer stands, and workers find "
                   f"it within RUNBRAKE_CANCEL_POLL_MS ({settings.cancel_poll_ms} ms)")


@main.command()
@click.argument("run_id", type=RUN_ID)
@click.option("--json", "as_json", is_flag=True, help="Print the run and its steps as one JSON object.")
@click.option("--lang", type=click.Choice(["en", "de"]), default="en", show_default=True, help="Label language.")
@user_errors
def show(run_id: str, as_json: bool, lang: str) -> None:
    """Show a run and its timeline, with an Outcome column."""
    from runbrake.broker.render import render_run, run_json

    with open_store(settings_from_env()) as store:
        record = store.waiting_below(store.get(run_id))
    if as_json:
        emit_json(run_json(record))
    else:
        click.echo(render_run(record, "de" if lang == "de" else "en"))


@main.command()
@click.option("--status", "status", type=click.Choice([s.value for s in RunStatus if s is not RunStatus.UNKNOWN]),
              default=None, help="Only runs in this status.")
@click.option("--label", "label_filters", multiple=True, metavar="KEY=VALUE",
              help="Only runs with this label; repeat it: a run must carry every label given.")
@click.option("--thread", "thread", type=RUN_ID, default=None,
              help="List the thread RUN_ID is in instead (its first run and every continuation), oldest first.")
@click.option("--root", "root", type=RUN_ID, default=None,
              help="List the agent tree whose first run is RUN_ID instead (it and every run below it), level by "
                   "level.")
@click.option("--limit", type=click.IntRange(1, 1000), default=20, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list.")
@user_errors
def runs(*, status: str | None, label_filters: tuple[str, ...], thread: str | None, root: str | None, limit: int,
         as_json: bool) -> None:
    """List recent runs, newest first (filters look at the last 1000 runs), one thread or one agent tree."""
    from runbrake.broker.render import render_runs, run_summary
    from runbrake.shared.spec import parse_label_filters

    try:
        labels = parse_label_filters(label_filters, separator="=")
    except SpecError as exc:
        raise click.BadParameter("; ".join(p.msg for p in exc.problems), param_hint="'--label'") from exc
    wanted = RunStatus(status) if status else None
    with open_store(settings_from_env()) as store:
        if thread is not None:
            records = store.thread(thread, limit=limit, status=wanted, labels=labels)
        elif root is not None:
            records = store.tree(root, limit=limit, status=wanted, labels=labels)
        else:
            records = store.recent(limit=limit, status=wanted, labels=labels)
    if as_json:
        emit_json([run_summary(r) for r in records])
    else:
        click.echo(render_runs(records))


class _Duration(click.ParamType[float]):
    """A time window such as ``90s``, ``30m``, ``1h``, ``7d``, in seconds."""

    name = "DURATION"
    _UNITS: ClassVar[dict[str, int]] = {"s": 1, "m": 60, "h": 3600, "d": 86400}

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        text = str(value).strip()
        if not (len(text) > 1 and text[-1] in self._UNITS and text[:-1].isdigit() and int(text[:-1]) > 0):
            self.fail(f"{text[:50]!r} is not a duration like 90s, 30m, 1h or 7d", param, ctx)
        return float(int(text[:-1]) * self._UNITS[text[-1]])


@main.command()
@click.option("--since", type=_Duration(), default=None,
              help="Only calls of this recent window, e.g. 1h (whole hours; counted for 8 days).")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list.")
@user_errors
def servers(since: float | None, as_json: bool) -> None:
    """Per MCP server (by catalog name): ok, failed, argument errors and cancelled tool calls, and a
    failure rate that counts neither cancellations nor argument errors (a server is flaky because of its
    own failures, not because operators cancelled runs or callers sent bad arguments)."""
    from runbrake.broker.render import render_servers, server_health

    with open_store(settings_from_env()) as store:
        health = server_health(store.server_outcomes(since=None if since is None else time.time() - since))
    if as_json:
        emit_json(health)
    else:
        click.echo(render_servers(health))


@main.command()
@click.option("--failing", is_flag=True, help="Only deliveries retrying or given up.")
@click.option("--limit", type=click.IntRange(1, 1000), default=100, show_default=True, help="Deliveries shown at most.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list.")
@user_errors
def webhooks(failing: bool, limit: int, as_json: bool) -> None:
    """Webhook deliveries, newest first: each event sent to each webhook a run names (docs/webhooks.md),
    delivered, retrying (with the last error) or given up."""
    from runbrake.broker.render import render_webhooks, webhook_deliveries

    with open_store(settings_from_env()) as store:
        deliveries = webhook_deliveries(store.webhook_deliveries(failing=failing, count=limit))
    if as_json:
        emit_json(deliveries)
    else:
        click.echo(render_webhooks(deliveries))


@main.command()
@click.argument("run_id", type=RUN_ID)
@click.option("--reason", default="", help="Why; recorded on the approval step.")
@click.option("--by", "decided_by", default=None, help="Who decides (default: user@host).")
@user_errors
def approve(run_id: str, reason: str, decided_by: str | None) -> None:
    """Approve the tool call RUN_ID waits for; a worker resumes the run."""
    from runbrake.shared import operations
    from runbrake.shared.messaging.producer import Producer
    from runbrake.shared.messaging.rabbitmq import build_broker

    settings = settings_from_env()
    broker = build_broker(settings)
    with open_store(settings) as store:
        try:
            operations.approve(store, Producer(store, broker), run_id, decided_by=decided_by or whoami(),
                               reason=reason)
        finally:
            broker.close()
    click.echo(f"approved {run_id}; a worker resumes it")


@main.command()
@click.argument("run_id", type=RUN_ID)
@click.option("--reason", default="denied by operator", show_default=True, help="Why; recorded on the run.")
@click.option("--by", "decided_by", default=None, help="Who decides (default: user@host).")
@user_errors
def deny(run_id: str, reason: str, decided_by: str | None) -> None:
    """Deny the tool call RUN_ID waits for; the run ends failed (approval_denied)."""
    from runbrake.shared import operations

    with open_store(settings_from_env()) as store:
        operations.deny(store, run_id, decided_by=decided_by or whoami(), reason=reason)
    click.echo(f"denied {run_id}; the run failed (approval_denied)")


@main.command()
@click.option("--processes", type=click.IntRange(1, 64), default=None,
              help="Worker processes, each with its own event loop and cancel listener  [default: one per CPU "
                   "this process may use; set it in a container, which sees the node's CPUs]. "
                   "docs/deploying.md, 'Sizing processes and concurrency'.")
@click.option("--concurrency", "--threads", "concurrency", type=click.IntRange(1, 10_000), default=8,
              show_default=True,
              help="Runs in flight per process, all on its one event loop (--threads is its former name, "
                   "deprecated). docs/benchmarks.md, 'Sizing'.")
@user_errors
def worker(processes: int | None, concurrency: int) -> None:
    """Start workers: Dramatiq worker processes with their cancel listeners. Stop with SIGTERM or Ctrl-C.

    Each process takes runs on a few consumer threads and runs up to --concurrency of them at once on its
    event loop; a full process leaves further messages in the queue for other workers.
    """
    from runbrake.worker.supervisor import run_workers  # the producer side never loads the worker

    settings = settings_from_env()
    with open_store(settings) as store:
        store.ping()
    sys.exit(run_workers(settings, processes=processes, concurrency=concurrency))


@main.command()
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on; anything but loopback needs RUNBRAKE_API_TOKENS.")
@click.option("--port", type=click.IntRange(0, 65535), default=8080, show_default=True)
@user_errors
def serve(host: str, port: int) -> None:
    """Serve the HTTP API and the runs page (docs/http-api.md). Stateless: run as many as you like."""
    import uvicorn  # only serve needs the server

    from runbrake.broker.api import create_app
    from runbrake.broker.auth import Tokens, TokensFileError
    from runbrake.broker.header_deadline import header_deadline_protocol

    settings = settings_from_env()
    tokens = None
    if settings.api_tokens:
        try:
            tokens = Tokens.load(settings.api_tokens)
        except TokensFileError as exc:
            fail(f"RUNBRAKE_API_TOKENS: {exc}", EXIT_BAD_INPUT)
        click.echo(f"runbrake serve: {len(tokens.names)} token(s) from {settings.api_tokens}", err=True)
    elif not _is_loopback(host):
        fail(f"refusing to serve on {host} without RUNBRAKE_API_TOKENS: without tokens anyone who reaches the "
             "port could enqueue and cancel runs; set RUNBRAKE_API_TOKENS (docs/http-api.md, \"Tokens\") or "
             "listen on 127.0.0.1", EXIT_BAD_INPUT)
    else:
        click.echo("runbrake serve: no RUNBRAKE_API_TOKENS, so no authentication: serving on loopback only", err=True)
    click.echo(f"runbrake serve: http://{host if ':' not in host else f'[{host}]'}:{port}/ "
               f"(namespace {settings.namespace})", err=True)
    app = create_app(settings, tokens)
    # The protocol class records each connection (an events stream can abort a stalled client's) on top
    # of the header deadline (slowloris; broker/header_deadline.py).
    protocol = app.state.connections.protocol(base=header_deadline_protocol(settings.api_header_timeout_s))
    uvicorn.run(app, host=host, port=port, log_level="warning", access_log=False,
                lifespan="on", timeout_graceful_shutdown=5, http=protocol)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@main.command()
@user_errors
def demo() -> None:
    """The whole story on the local services, in under a minute."""
    from runbrake.broker.demo import run_demo

    sys.exit(run_demo(settings_from_env()))


@main.command()
def schema() -> None:
    """Print the run spec's JSON Schema (Draft 2020-12); docs/run-spec.schema.json is a copy of it."""
    from runbrake.shared.spec import run_spec_json_schema

    click.echo(json.dumps(run_spec_json_schema(), indent=2))


@main.group()
def catalog() -> None:
    """The operator's catalog of MCP servers and models (RUNBRAKE_CATALOG)."""


@catalog.command("check")
@click.argument("path", required=False, type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print what the catalog defines as JSON.")
@click.option("--show-secrets", is_flag=True,
              help="Show the secrets written into the file itself (URL passwords, literal header values, literal "
                   "values of secret-named env entries) instead of ***. Variables' values are never shown.")
@user_errors
def catalog_check(path: str | None, as_json: bool, show_secrets: bool) -> None:
    """Load the catalog (PATH, or RUNBRAKE_CATALOG), report every problem at once (exit 2), and list what
    it defines. Secrets show as ${VAR} with whether VAR is set here, never their values; secrets written
    into the file (a URL's password, a literal header value) show as *** unless --show-secrets."""
    from runbrake.shared.catalog import Catalog

    where = path or settings_from_env().catalog
    if not where:
        fail("no catalog: give a PATH or set RUNBRAKE_CATALOG", EXIT_BAD_INPUT)
    described = Catalog.load(where).describe(show_secrets=show_secrets)
    if as_json:
        emit_json(described)
        return
    click.echo(f"{where}: ok")
    for section, line in CATALOG_LINES.items():
        for name, entry in described[section].items():
            click.echo(f"  {line(name, entry)}")


def _server_line(name: str, server: dict[str, Any]) -> str:
    # What each transport shows comes from its registry entry (shared/registry.py): read what is there.
    target = server.get("url") or " ".join([server.get("command", ""), *server.get("args", [])]).strip()
    secrets = {**server.get("headers", {}), **server.get("env", {})}
    unset = sorted(v for s in secrets.values() for v, is_set in s["variables"].items() if not is_set)
    shown = "; ".join(f"{k}: {s['template']}" for k, s in secrets.items())
    return (f"server {name} ({server['transport']}): {target}"
            + (f"  {'headers' if 'url' in server else 'env'}: {shown}" if shown else "")
            + (f"  tools: {', '.join(server['tools'])}" if server["tools"] else "")
            + _tenants(server)
            + (f"  UNSET here: {', '.join(unset)}" if unset else ""))


def _model_line(name: str, model: dict[str, Any]) -> str:
    key = model.get("api_key_env")
    state = "" if key is None else f"  key: ${{{key}}} ({'set' if model['api_key_set'] else 'UNSET here'})"
    what = " at ".join(str(model[k]) for k in ("model", "base_url") if k in model) or model["provider"]
    return f"model {name}: {what}{state}{_tenants(model)}"


def _webhook_line(name: str, hook: dict[str, Any]) -> str:
    secret = f"${{{hook['secret_env']}}} ({'set' if hook['secret_set'] else 'UNSET here'})"
    return f"webhook {name}: {hook['url']}  events: {', '.join(hook['events'])}  secret: {secret}{_tenants(hook)}"


def _tenants(entry: dict[str, Any]) -> str:
    """The tenants a catalog entry is open to, where it names some (docs/security.md, "Tenants")."""
    return f"  tenants: {', '.join(entry['tenants'])}" if entry.get("tenants") else ""


def _tenant_line(name: str, quotas: dict[str, Any]) -> str:
    return f"tenant {name}: " + (", ".join(f"{k} {v}" for k, v in quotas.items()) or "no quotas")


def _user_line(name: str, user: dict[str, Any]) -> str:
    return f"rabbitmq user {name}: tenant {user['tenant']}"


def _agent_line(name: str, agent: dict[str, Any]) -> str:
    calls = [*agent.get("mcp_servers", []), *(f"agent {a}" for a in agent.get("agents", []))]
    return f"agent {name}: model {agent['model']}" + (f"  calls: {', '.join(calls)}" if calls else "")


CATALOG_LINES: Final[dict[str, Callable[[str, dict[str, Any]], str]]] = {
    "mcp_servers": _server_line, "models": _model_line, "webhooks": _webhook_line, "tenants": _tenant_line,
    "rabbitmq_users": _user_line, "agents": _agent_line,
}
"""How ``catalog check`` shows one entry of each section of :meth:`Catalog.describe`, in this order: every
section it describes (tests/test_cli.py checks that none is left out)."""
