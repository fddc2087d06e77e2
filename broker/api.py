"""The HTTP API and the runs page: ``runbrake serve`` (docs/http-api.md).

Stateless: every request reads and writes Redis (the authority) and RabbitMQ, so any number of
replicas can serve the same namespace. Per process: one asynchronous Redis store for the reads, one
Redis subscription for live events (broker/events.py), and a small pool of threads for the
synchronous calls that publish on RabbitMQ (enqueue, cancel, approve, deny). pika is not
thread-safe, so each of those threads has its own cancel publisher; Dramatiq's broker keeps a
connection per thread by itself.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import concurrent.futures
import contextlib
import functools
import json
import math
import queue
import re
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping, MutableMapping
from dataclasses import dataclass, field
from datetime import datetime
from importlib import resources
from typing import Annotated, Any, Final, TypeVar

import pika
import pika.exceptions
import structlog
from fastapi import Depends, FastAPI, Header, Path, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from runbrake.broker.auth import Tokens
from runbrake.broker.connections import Connections
from runbrake.broker.events import EventHub, EventStreamResponse, StreamSlots, Subscriber, run_events, status_events
from runbrake.broker.render import run_json, run_summary, server_health, tenant_server_health, webhook_deliveries
from runbrake.shared import operations, tracing
from runbrake.shared.async_store import AsyncRunStore
from runbrake.shared.catalog import Admission
from runbrake.shared.errors import (
    ApiError,
    IdempotencyConflict,
    NotReplicated,
    PublishError,
    QuotaExceeded,
    ResumeUnsent,
    RunbrakeError,
    RunNotFound,
    SpecError,
    StoreError,
    TransitionRefused,
)
from runbrake.shared.logging import silenced
from runbrake.shared.messaging.cancel import CancelPublisher
from runbrake.shared.messaging.producer import Enqueued, Producer
from runbrake.shared.messaging.rabbitmq import RunbrakeBroker, build_broker
from runbrake.shared.messaging.wire import connection_parameters, declare_events
from runbrake.shared.records import MAX_SEARCH_CHARS, RunSearch
from runbrake.shared.schema_check import SCHEMA_CHECKS
from runbrake.shared.settings import Settings
from runbrake.shared.spec import RunSpec, parse_label_filters, run_spec_json_schema
from runbrake.shared.status import RunStatus
from runbrake.shared.store import RunStore
from runbrake.shared.threads import received
from runbrake.shared.timeline import LABELS

log = structlog.get_logger(__name__)

T = TypeVar("T")

RUN_ID: Final = re.compile(r"[0-9a-f]{32}")
MAX_REASON_CHARS: Final = 1000
MAX_REASON_BODY_BYTES: Final = 8192
"""Largest body of cancel, approve and deny: a reason of MAX_REASON_CHARS, JSON-escaped, with room to spare."""
LOOPBACK_HOSTS: Final = ("127.0.0.1", "localhost", "[::1]")
"""The ``Host`` names a token-less API answers unless RUNBRAKE_API_ALLOWED_HOSTS says otherwise."""
METHODS: Final = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
"""Methods the metrics name; any other is counted as ``other`` (a label must not take a client's words)."""
PROBES: Final = frozenset({"/healthz", "/readyz"})
"""Answered whatever the ``Host``: probes reach a replica by its address, and these say nothing but up or not."""
AMQP_THREADS: Final = 8
"""Threads for the calls that publish on RabbitMQ; each holds its own connections."""
READY_CACHE_S: Final = 1.0
"""How long a RabbitMQ reachability check is reused: a probe every second must not open a connection each."""
QUOTA_RETRY_AFTER_S: Final = 5
"""``Retry-After`` of an enqueue refused by ``max_runs_in_flight``: when a run ends, nobody can say."""
ANONYMOUS: Final = "anonymous"
"""Who the API records as having cancelled or decided when it runs without tokens (loopback only)."""


class ReasonBody(BaseModel):
    """The body of cancel, approve and deny: an optional reason, recorded with the decision."""

    model_config = ConfigDict(extra="forbid")
    reason: Annotated[str, Field(max_length=MAX_REASON_CHARS)] | None = None


class SteerBody(BaseModel):
    """The body of a steer: the new user message (at most ``RUNBRAKE_MAX_INPUT_CHARS``) and an optional reason,
    recorded on the ``steer`` step (docs/http-api.md, "Steer a run")."""

    model_config = ConfigDict(extra="forbid")
    input: Annotated[str, Field(min_length=1, description="The new user message the run goes on with.")]
    reason: Annotated[str, Field(max_length=MAX_REASON_CHARS)] | None = None


# -- per-process state ---------------------------------------------------------------------------


@dataclass
class Metrics:
    """The API's Prometheus metrics, in a registry of its own (GET /metrics)."""

    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        self.requests = Counter("runbrake_api_requests_total", "HTTP requests answered, by route and status.",
                                ["method", "route", "status"], registry=self.registry)
        self.latency = Histogram(
            "runbrake_api_request_seconds", "Time from a request to its response's start, by route.",
            ["method", "route"], registry=self.registry,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
        )
        self.event_clients = Gauge("runbrake_api_event_clients", "Clients of the events endpoints right now.",
                                   registry=self.registry)
        self.dropped = Counter("runbrake_api_event_clients_dropped_total",
                               "Event clients dropped because they fell too far behind.", registry=self.registry)
        self.stalled = Counter("runbrake_api_event_clients_stalled_total",
                               "Event clients dropped because a send did not complete within "
                               "RUNBRAKE_API_SEND_TIMEOUT_S.", registry=self.registry)
        self.streams_refused = Counter("runbrake_api_event_streams_refused_total",
                                       "Event streams refused (429): the token held its "
                                       "RUNBRAKE_API_MAX_STREAMS_PER_TOKEN.", registry=self.registry)
        self.events_unreadable = Counter("runbrake_api_events_unreadable_total",
                                         "Messages on <ns>:events the event hub could not read and skipped.",
                                         registry=self.registry)
        self.hub_restarts = Counter("runbrake_api_event_hub_restarts_total",
                                    "Times the event hub failed on something unexpected and started again.",
                                    registry=self.registry)


class AmqpWorkers:
    """A few threads for synchronous calls that publish on RabbitMQ; each has its own cancel publisher.

    Each thread owns its connections (pika is not thread-safe) and, between calls, services them on a timer:
    an idle connection answers RabbitMQ's heartbeats, so the first cancel after idle minutes is confirmed as
    fast as any (issue 30; docs/messages.md, "Idle connections").
    """

    def __init__(self, settings: Settings, broker: RunbrakeBroker) -> None:
        self._settings = settings
        self._broker = broker
        self._local = threading.local()
        self._publishers: list[CancelPublisher] = []
        self._lock = threading.Lock()
        self._calls: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future[Any]] | None] = (
            queue.SimpleQueue())
        self._threads = [threading.Thread(target=self._serve, name=f"runbrake-api-amqp-{number}", daemon=True)
                         for number in range(AMQP_THREADS)]
        for thread in self._threads:
            thread.start()

    async def run(self, call: Callable[[], T]) -> T:
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._calls.put((call, future))
        return await asyncio.wrap_future(future)

    def publisher(self) -> CancelPublisher:
        """This thread's cancel publisher (pika is not thread-safe)."""
        publisher: CancelPublisher | None = getattr(self._local, "publisher", None)
        if publisher is None:
            publisher = self._local.publisher = CancelPublisher(self._settings)
            with self._lock:
                self._publishers.append(publisher)
        return publisher

    def close(self) -> None:
        for _thread in self._threads:
            self._calls.put(None)
        for thread in self._threads:
            thread.join()
        for publisher in self._publishers:  # the threads are gone: nothing else uses these now
            publisher.close()

    def _serve(self) -> None:
        publisher = self.publisher()
        while True:
            try:
                item = self._calls.get(timeout=min(publisher.keep_alive_interval(), self._broker.keep_alive()))
            except queue.Empty:
                publisher.keep_alive()
                continue
            if item is None:
                return
            call, future = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(call())
            except BaseException as exc:  # noqa: BLE001 - handed to the awaiting request, as an executor does
                future.set_exception(exc)


@dataclass
class ApiState:
    settings: Settings
    tokens: Tokens | None
    store: AsyncRunStore
    sync_store: RunStore
    broker: RunbrakeBroker
    hub: EventHub
    amqp: AmqpWorkers
    metrics: Metrics
    admission: Admission
    """What a spec must meet: the operator's catalog (read again when it changes) and the bounds."""
    connections: Connections
    """This process's HTTP connections, so that a stream can abort a client's (broker/connections.py)."""
    streams: StreamSlots
    """Event streams open per token (``RUNBRAKE_API_MAX_STREAMS_PER_TOKEN``)."""
    rabbitmq_checked: tuple[float, str | None] = (0.0, None)


# -- auth ----------------------------------------------------------------------------------------


def _state(request: Request) -> ApiState:
    state: ApiState = request.app.state.api
    return state


@dataclass(frozen=True, slots=True)
class Caller:
    """Who a request is: its token's name (``anonymous`` without tokens) and its tenant (None: an operator,
    who reaches every run; docs/http-api.md, "Tenants and quotas")."""

    name: str
    tenant: str | None = None

    def reaches(self, tenant: str | None) -> bool:
        """Whether this caller may see a run of ``tenant`` ("" for a run of none; None for no such run)."""
        return tenant is not None and (self.tenant is None or tenant == self.tenant)


def require(role: str) -> Callable[[Request], Caller]:
    """A dependency: who presents the token of the request, which must grant ``role``
    (docs/http-api.md, "Tokens"); ``anonymous`` when the API runs without tokens."""

    def check(request: Request) -> Caller:
        tokens = _state(request).tokens
        if tokens is None:
            return Caller(ANONYMOUS)
        scheme, _, presented = request.headers.get("authorization", "").partition(" ")
        token = tokens.identify(presented.strip()) if scheme.lower() == "bearer" and presented.strip() else None
        if token is None:
            raise ApiError.answer(401, "a valid bearer token is required (Authorization: Bearer <token>)",
                                  headers={"WWW-Authenticate": 'Bearer realm="runbrake"'})
        if role not in token.roles:
            raise ApiError.answer(403, f"token {token.name!r} lacks the {role!r} role")
        return Caller(token.name, token.tenant)

    return check


Reader = Annotated[Caller, Depends(require("read"))]
Submitter = Annotated[Caller, Depends(require("submit"))]
Operator = Annotated[Caller, Depends(require("operate"))]


async def _visible(state: ApiState, who: Caller, run_id: str) -> None:
    """Nothing when ``who`` may reach the run; else :class:`RunNotFound`, the answer of a run that does not
    exist, word for word: a tenant's token learns nothing of another tenant's runs, not even that they exist."""
    if who.tenant is None:
        return
    if not who.reaches(await state.store.tenant_of(run_id)):
        raise RunNotFound(run_id)


def valid_run_id(run_id: Annotated[str, Path(
        description="A run id: 32 lowercase hex characters.",
        # In the OpenAPI document so that clients (and tests/test_fuzz_api.py) know it; checked here, with our words.
        json_schema_extra={"pattern": "^[0-9a-f]{32}$"})]) -> str:
    if not RUN_ID.fullmatch(run_id):
        raise ApiError.answer(422, "invalid run id", errors=[
            {"loc": ["path", "run_id"], "msg": "a run id is 32 lowercase hex characters"}])
    return run_id


RunId = Annotated[str, Depends(valid_run_id)]


def _cursor(value: str | None) -> tuple[float, str] | None:
    """The position a ``next_cursor`` names: ``[score, run_id]`` with a finite number, nothing else (a
    ``nan`` or a string would reach Redis as a score it refuses; a nested one, the parser's recursion)."""
    if not value:
        return None
    try:
        position = json.loads(base64.urlsafe_b64decode(value.encode() + b"=" * (-len(value) % 4)))
    except (ValueError, RecursionError, binascii.Error):
        position = None
    if isinstance(position, list) and len(position) == 2:
        score, run_id = position
        if (isinstance(score, int | float) and not isinstance(score, bool) and math.isfinite(score)
                and isinstance(run_id, str) and RUN_ID.fullmatch(run_id)):
            return float(score), run_id
    raise ApiError.answer(422, "invalid cursor", errors=[
        {"loc": ["query", "cursor"], "msg": "pass next_cursor from the previous page unchanged"}])


def _label_filter(given: list[str]) -> dict[str, str]:
    """``label=KEY:VALUE`` parameters as the labels a run must carry (docs/http-api.md, "Runs: reading")."""
    try:
        return parse_label_filters(given, separator=":")
    except SpecError as exc:
        raise ApiError.answer(422, "invalid label filter", errors=[
            {"loc": ["query", "label"], "msg": p.msg} for p in exc.problems]) from exc


def _search(text: str | None, since: str | None, until: str | None) -> RunSearch:
    """The ``q``, ``since`` and ``until`` of a listing as what it searches for (docs/http-api.md, "Runs:
    reading"); every bad one named in one 422."""
    problems: list[dict[str, Any]] = []
    if text is not None and len(text) > MAX_SEARCH_CHARS:
        problems.append({"loc": ["query", "q"], "msg": f"at most {MAX_SEARCH_CHARS} characters"})
    bounds = {name: _instant(value, name, problems) for name, value in (("since", since), ("until", until))}
    low, high = bounds["since"], bounds["until"]
    if low is not None and high is not None and low > high:
        problems.append({"loc": ["query", "until"], "msg": "until is before since"})
    if problems:
        raise ApiError.answer(422, "invalid search", errors=problems)
    return RunSearch(text=(text or "").strip(), since=low, until=high)


def _instant(value: str | None, name: str, problems: list[dict[str, Any]]) -> float | None:
    """A point in time as epoch seconds: ISO 8601 with its UTC offset (a time without one would mean whatever
    the server's zone is) or a finite number of epoch seconds. A bad one is added to ``problems``."""
    if value is None or not value.strip():
        return None
    text = value.strip()
    try:
        number = float(text)
    except ValueError:
        pass
    else:
        if math.isfinite(number) and number >= 0:
            return number
        problems.append({"loc": ["query", name], "msg": "epoch seconds must be a finite number, 0 or more"})
        return None
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        moment = None
    if moment is None or moment.tzinfo is None:
        problems.append({"loc": ["query", name], "msg": (
            "an ISO 8601 time with its offset (2026-12-05T14:00:00Z, 2026-12-05T15:00+01:00) or epoch seconds")})
        return None
    return moment.timestamp()


async def no_unknown_query(request: Request) -> None:
    """A dependency of every route: a GET with a query parameter its route does not take is refused (422,
    naming it), never silently ignored: ``?tenant=acme`` must not answer every run."""
    if request.method not in ("GET", "HEAD"):
        return
    route = request.scope.get("route")
    known = _query_names(route) if isinstance(route, APIRoute) else frozenset()
    unknown = sorted({name for name in request.query_params if name not in known})
    if unknown:
        takes = ", ".join(sorted(known)) or "none"
        raise ApiError.answer(422, "unknown query parameter", errors=[
            {"loc": ["query", name[:100]], "msg": f"unknown query parameter; this endpoint takes: {takes}"}
            for name in unknown[:10]])


def _query_names(route: APIRoute) -> frozenset[str]:
    """The query parameters a route takes, its dependencies' included (a walk of a few objects: no cache)."""
    names: set[str] = set()
    pending = [route.dependant]
    while pending:
        dependant = pending.pop()
        names.update(param.alias for param in dependant.query_params)
        pending.extend(dependant.dependencies)
    return frozenset(names)


def _next_cursor(position: tuple[float, str] | None) -> str | None:
    if position is None:
        return None
    return base64.urlsafe_b64encode(json.dumps([position[0], position[1]]).encode()).decode().rstrip("=")


# -- the app -------------------------------------------------------------------------------------

_ERROR_SCHEMA: Final = {"type": "object", "required": ["error"], "properties": {"error": {"type": "string"}}}
_BODY_ERRORS: Final[dict[int | str, dict[str, Any]]] = {
    413: {"description": "The body is larger than its bound (docs/http-api.md, \"Requests\").",
          "content": {"application/json": {"schema": _ERROR_SCHEMA}}},
    415: {"description": "The request does not say Content-Type: application/json.",
          "content": {"application/json": {"schema": _ERROR_SCHEMA}}},
}

_ENQUEUE_ERRORS: Final[dict[int | str, dict[str, Any]]] = {
    **_BODY_ERRORS,
    429: {"description": "The token's tenant is at one of its quotas; nothing was written. Retry-After says when "
                         "to ask again (docs/http-api.md, \"Tenants and quotas\").",
          "content": {"application/json": {"schema": _ERROR_SCHEMA}}},
}


_STEP_ERRORS: Final[dict[int | str, dict[str, Any]]] = {
    404: {"description": "No such run (or another tenant's), or no such step in it.",
          "content": {"application/json": {"schema": _ERROR_SCHEMA}}},
}


_CONTINUE_ERRORS: Final[dict[int | str, dict[str, Any]]] = {
    **_ENQUEUE_ERRORS,
    404: {"description": "No such run (never created, past its retention, or another tenant's).",
          "content": {"application/json": {"schema": _ERROR_SCHEMA}}},
    409: {"description": "The run is not finished (completed, failed or cancelled), or the idempotency key names "
                         "another run.", "content": {"application/json": {"schema": _ERROR_SCHEMA}}},
}


def create_app(settings: Settings, tokens: Tokens | None) -> FastAPI:
    """The ASGI app of ``runbrake serve``. Its ``state.connections`` makes the protocol class to serve it
    with (``http=app.state.connections.protocol()``), without which a stalled stream's connection is closed
    gracefully instead of aborted (broker/connections.py)."""
    connections = Connections()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        metrics = Metrics()
        hub = EventHub(settings, on_drop=metrics.dropped.inc, on_unreadable=metrics.events_unreadable.inc,
                       on_restart=metrics.hub_restarts.inc)
        broker = build_broker(settings)
        state = ApiState(
            settings=settings, tokens=tokens, store=AsyncRunStore.connect(settings),
            sync_store=RunStore.connect(settings), broker=broker, hub=hub,
            amqp=AmqpWorkers(settings, broker), metrics=metrics, admission=Admission.from_settings(settings),
            connections=connections, streams=StreamSlots(settings.api_max_streams_per_token),
        )
        app.state.api = state
        await hub.start()
        try:  # beside the workers' topology (docs/messages.md, "Run events: declaration")
            with silenced("pika"):
                await asyncio.get_running_loop().run_in_executor(None, declare_events, settings)
        except pika.exceptions.AMQPError as exc:
            log.warning("events_exchange_not_declared", error=str(exc) or repr(exc), by="the workers, at their start")
        log.info("api_started", namespace=settings.namespace, tokens=None if tokens is None else len(tokens.names),
                 events_subscribed=hub.ready)
        try:
            yield
        finally:
            await hub.stop()
            # Idle since their last publish, RabbitMQ may have dropped them (shared/logging.py, "silenced").
            with silenced("pika"):
                await asyncio.get_running_loop().run_in_executor(None, state.amqp.close)
                state.broker.close()
            state.sync_store.close()
            await state.store.aclose()

    app = FastAPI(
        title="runbrake", version="1", lifespan=lifespan, docs_url=None, redoc_url=None,
        description="Runs, their events, cancel and approval (docs/http-api.md).",
        dependencies=[Depends(no_unknown_query)],
    )
    app.add_middleware(RequestGuard, allowed_hosts=allowed_hosts(settings, tokens))
    app.add_middleware(MetricsMiddleware)  # outside the guard: refused requests are counted too
    app.state.connections = connections

    @app.exception_handler(RunbrakeError)
    async def runbrake_error(_request: Request, exc: RunbrakeError) -> JSONResponse:
        answer = _answer_for(exc)
        if answer is None:
            raise exc  # a bug: answered 500 by the handler of Exception below, and logged
        return answer

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = [{"loc": list(e.get("loc", ())), "msg": str(e.get("msg", ""))} for e in exc.errors()]
        return JSONResponse({"error": "invalid request", "errors": errors}, status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        """Starlette's own answers (an unknown route, a method the route lacks) in the documented shape."""
        return JSONResponse({"error": str(exc.detail)}, status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def internal_error(_request: Request, exc: Exception) -> JSONResponse:
        """A bug: the documented shape and nothing of the exception (Starlette logs it and re-raises)."""
        return JSONResponse({"error": "internal error"}, status_code=500)

    _routes(app)
    _page_routes(app)
    return app


def _routes(app: FastAPI) -> None:
    @app.post("/v1/runs", status_code=201, tags=["runs"], responses=_ENQUEUE_ERRORS, openapi_extra={"requestBody": {
        "required": True,
        "content": {"application/json": {"schema": {
            "type": "object", "description": "A run spec: see GET /v1/schema/run-spec"}}},
    }})
    async def enqueue(request: Request, who: Submitter,
                      idempotency_key: Annotated[str | None, Header()] = None) -> JSONResponse:
        """Validate a run spec, persist the run and send it to the workers."""
        state = _state(request)
        body = await _json_body(request, state.settings.max_spec_bytes, "the spec", "RUNBRAKE_MAX_SPEC_BYTES")
        spec = _spec(body, idempotency_key)
        await _schema_checked(state, spec.output_schema)
        # Each token has its own idempotency keys (docs/http-api.md, "Idempotency keys"): a key says
        # nothing about another submitter's runs. Without tokens, one scope, shared with the CLI.
        scope = None if state.tokens is None else who.name
        # A traced caller's traceparent is the enqueue's parent (docs/operating.md, "Traces"); off, a no-op.
        parent = request.headers.get(tracing.TRACEPARENT)
        enqueued: Enqueued = await state.amqp.run(lambda: tracing.current().within(parent, lambda: operations.enqueue(
            Producer(state.sync_store, state.broker, state.admission), spec, scope=scope, tenant=who.tenant)))
        if enqueued.created:
            log.info("api_run_enqueued", run_id=enqueued.run_id, by=who.name, tenant=who.tenant)
        return await _enqueued(state, enqueued, spec.raw, spec.idempotency_key)

    @app.post("/v1/runs/{run_id}/continue", status_code=201, tags=["runs"], responses=_CONTINUE_ERRORS,
              openapi_extra={"requestBody": {"required": True, "content": {"application/json": {"schema": {
                  "type": "object", "required": ["input"],
                  "description": "input, and any run-spec field but messages, each replacing the parent's "
                                 "(docs/usage.md, \"Continue a finished run\")"}}}}})
    async def continue_run(request: Request, who: Submitter, run_id: RunId,
                           idempotency_key: Annotated[str | None, Header()] = None) -> JSONResponse:
        """Enqueue a new run that carries on a finished run's conversation (``runbrake continue``)."""
        state = _state(request)
        body = _continue_body(await _json_body(request, state.settings.max_spec_bytes, "the body",
                                               "RUNBRAKE_MAX_SPEC_BYTES"), idempotency_key)
        await _schema_checked(state, body.get("output_schema"))
        await _visible(state, who, run_id)
        scope = None if state.tokens is None else who.name
        enqueued = await state.amqp.run(lambda: operations.continue_run(
            Producer(state.sync_store, state.broker, state.admission), state.sync_store, run_id, body,
            scope=scope, tenant=who.tenant))
        stored = await state.store.get(enqueued.run_id)
        if enqueued.created:
            log.info("api_run_continued", run_id=enqueued.run_id, parent_run_id=run_id, by=who.name)
        elif stored.parent_run_id != run_id:
            raise ApiError.answer(409, f"idempotency key {body.get('idempotency_key')!r} already names run "
                                       f"{enqueued.run_id}, which does not continue {run_id}", run_id=enqueued.run_id)
        return await _enqueued(state, enqueued, stored.request, body.get("idempotency_key"))

    @app.get("/v1/runs", tags=["runs"])
    async def list_runs(request: Request, who: Reader, *, status: str | None = None, limit: int = 20,
                        cursor: str | None = None,
                        label: Annotated[list[str] | None, Query(
                            description="KEY:VALUE; repeat it: a run must carry every label given")] = None,
                        thread: Annotated[str | None, Query(
                            description="A run id: list the thread it is in, oldest first, in one page")] = None,
                        root: Annotated[str | None, Query(
                            description="A run id: list the agent tree it is the first run of, level by level, "
                                        "in one page")] = None,
                        q: Annotated[str | None, Query(
                            description="Text the run id, the start of the input, the model, a label (KEY=VALUE) "
                                        "or the error holds, in any case")] = None,
                        since: Annotated[str | None, Query(
                            description="Runs created at or after: ISO 8601 with its offset "
                                        "(2026-12-05T14:00:00Z) or epoch seconds")] = None,
                        until: Annotated[str | None, Query(
                            description="Runs created at or before: ISO 8601 with its offset or epoch seconds")] = None,
                        ) -> dict[str, Any]:
        """Runs newest first, one page at a time; ``next_cursor`` is null on the last page. Filtered by
        ``status``, by ``label=KEY:VALUE`` (repeatable: all must match), by text (``q``) and by creation time
        (``since``, ``until``). A tenant's token lists only its tenant's runs. ``thread=ROOT_ID`` lists a thread
        instead: its first run and every continuation, oldest first (docs/http-api.md, "Threads"); ``root=ID`` an
        agent tree: the run and every run below it, level by level (docs/usage.md, "Agent trees")."""
        labels = _label_filter(label or [])
        search = _search(q, since, until)
        if who.tenant is not None:
            if labels.get("tenant", who.tenant) != who.tenant:
                return {"runs": [], "next_cursor": None}
            labels["tenant"] = who.tenant
        wanted = None
        if status:
            if status not in {s.value for s in RunStatus if s is not RunStatus.UNKNOWN}:
                raise ApiError.answer(422, "invalid status", errors=[{"loc": ["query", "status"], "msg": (
                    "one of " + ", ".join(s.value for s in RunStatus if s is not RunStatus.UNKNOWN))}])
            wanted = RunStatus(status)
        if not 1 <= limit <= 1000:
            raise ApiError.answer(422, "invalid limit", errors=[{"loc": ["query", "limit"], "msg": "from 1 to 1000"}])
        store = _state(request).store
        for name, run_id, what, listed in (("thread", thread, "a thread", store.thread),
                                           ("root", root, "a tree", store.tree)):
            if run_id is None:
                continue
            if not RUN_ID.fullmatch(run_id) or cursor:
                raise ApiError.answer(422, f"invalid {name}", errors=[{"loc": ["query", name], "msg": (
                    f"a run id (32 lowercase hex characters); {what} is listed in one page, without a cursor")}])
            found = await listed(run_id, limit=limit, status=wanted, labels=labels)
            return {"runs": [run_summary(r) for r in found if search.admits(r)], "next_cursor": None}
        records, position = await _state(request).store.page(limit=limit, status=wanted, after=_cursor(cursor),
                                                             labels=labels, search=search)
        return {"runs": [run_summary(r) for r in records], "next_cursor": _next_cursor(position)}

    @app.get("/v1/runs/{run_id}", tags=["runs"])
    async def get_run(request: Request, who: Reader, run_id: RunId) -> dict[str, Any]:
        """The run and its steps: the object ``runbrake show --json`` prints."""
        state = _state(request)
        await _visible(state, who, run_id)
        return run_json(await state.store.waiting_below(await state.store.get(run_id)))

    @app.get("/v1/runs/{run_id}/steps/{sequence}/messages", tags=["runs"], responses=_STEP_ERRORS)
    async def step_messages(request: Request, who: Reader, run_id: RunId,
                            sequence: Annotated[int, Path(ge=1, le=2**31)]) -> dict[str, Any]:
        """What the model call of step ``sequence`` was sent: the conversation rebuilt from the run's record
        (its instructions, history, input and the steps before it), the last 200 messages at most, each text
        cut at 20,000 characters (``content_truncated``), and the run's model settings (docs/http-api.md,
        "What a model call received")."""
        state = _state(request)
        await _visible(state, who, run_id)
        record = await state.store.get(run_id)
        try:
            return received(record, sequence)
        except LookupError as exc:
            raise ApiError.answer(404, str(exc)) from exc
        except ValueError as exc:
            raise ApiError.answer(422, "not a model step", errors=[
                {"loc": ["path", "sequence"], "msg": str(exc)}]) from exc

    @app.get("/v1/runs/{run_id}/events", tags=["runs"], response_class=StreamingResponse)
    async def events(request: Request, who: Reader, run_id: RunId,
                     last_event_id: Annotated[str | None, Header()] = None) -> StreamingResponse:
        """Server-sent events: ``step`` (replayed, then live), ``progress``, ``status``, and ``delta`` (a
        streamed model answer's text since the last one, live only); ends after the run's terminal status.
        Reconnect with ``Last-Event-ID`` (a step sequence) to resume."""
        state = _state(request)
        last = _last_event_id(last_event_id)
        await _visible(state, who, run_id)
        give_back = await _stream_slot(state, who.name)
        subscriber = state.hub.subscribe(run_id)  # first subscribe, then read: nothing falls between
        try:
            head = await state.store.head(run_id)
        except BaseException:
            state.hub.unsubscribe(subscriber)
            give_back()
            raise
        return _event_stream(state, run_events(state.store, subscriber, head, last_event_id=last), subscriber,
                             give_back)

    @app.get("/v1/events", tags=["runs"], response_class=StreamingResponse)
    async def all_status(request: Request, who: Reader,
                         last_event_id: Annotated[str | None, Header()] = None) -> StreamingResponse:
        """Server-sent ``status`` events of every run of the namespace (the runs page's list), each with its
        event id; a tenant's token hears only its tenant's runs. Reconnect with ``Last-Event-ID`` (an event
        id) to replay what happened meanwhile, as long as it is kept (``RUNBRAKE_RETENTION_S``); an older one
        is answered with ``resync`` first."""
        state = _state(request)
        after = _feed_event_id(last_event_id)
        give_back = await _stream_slot(state, who.name)
        # First subscribe, then replay: nothing falls between.
        subscriber = state.hub.subscribe(None, tenant=who.tenant)
        return _event_stream(state, status_events(state.store, subscriber, last_event_id=after), subscriber,
                             give_back)

    @app.post("/v1/runs/{run_id}/cancel", status_code=202, tags=["decisions"], responses=_BODY_ERRORS,
              openapi_extra=_REASON_BODY)
    async def cancel(request: Request, who: Operator, run_id: RunId) -> JSONResponse:
        """Win the fence in Redis, then wake the worker that runs the run (like ``runbrake cancel``)."""
        state = _state(request)
        reason = await _reason(request) or "cancelled via the API"
        await _visible(state, who, run_id)
        result = await state.amqp.run(lambda: operations.cancel(
            state.sync_store, state.amqp.publisher(), run_id, reason=reason, requested_by=who.name))
        return JSONResponse({"run_id": run_id, "cancelled": True, "message_confirmed": result.message_confirmed},
                            status_code=202)

    @app.post("/v1/runs/{run_id}/steer", status_code=202, tags=["decisions"], responses=_BODY_ERRORS,
              openapi_extra=_STEER_BODY)
    async def steer(request: Request, who: Operator, run_id: RunId) -> JSONResponse:
        """Cut off the run's current turn and go on with a new user message, in the same run (like ``runbrake
        steer``): 202 once the steer is stored; 409 unless the run is running or waiting for approval, or while
        a steer of it is still waiting to be applied."""
        state = _state(request)
        body = await _steer_body(request, state.settings.max_spec_bytes)
        await _visible(state, who, run_id)
        try:
            result = await state.amqp.run(lambda: operations.steer(
                state.sync_store, state.amqp.publisher(), Producer(state.sync_store, state.broker), run_id,
                text=body.input, reason=body.reason or "", requested_by=who.name,
                max_input_chars=state.settings.max_input_chars))
        except SpecError as exc:
            errors = [{"loc": ["body", *p.loc], "msg": p.msg} for p in exc.problems]
            raise ApiError.answer(422, "invalid steer", errors=errors) from None
        return JSONResponse({"run_id": run_id, "steered": True, "found": result.found.value,
                             "message_confirmed": result.message_confirmed}, status_code=202)

    @app.post("/v1/runs/{run_id}/approve", tags=["decisions"], responses=_BODY_ERRORS,
              openapi_extra=_REASON_BODY)
    async def approve(request: Request, who: Operator, run_id: RunId) -> dict[str, Any]:
        """Approve the call the run waits for (recorded with who and why); a worker resumes the run."""
        state = _state(request)
        reason = await _reason(request) or ""
        await _visible(state, who, run_id)
        await state.amqp.run(lambda: operations.approve(
            state.sync_store, Producer(state.sync_store, state.broker), run_id, decided_by=who.name, reason=reason))
        return {"run_id": run_id, "approved": True}

    @app.post("/v1/runs/{run_id}/deny", tags=["decisions"], responses=_BODY_ERRORS,
              openapi_extra=_REASON_BODY)
    async def deny(request: Request, who: Operator, run_id: RunId) -> dict[str, Any]:
        """Deny the call the run waits for: the run ends failed (approval_denied)."""
        state = _state(request)
        reason = await _reason(request) or "denied by operator"
        await _visible(state, who, run_id)
        await state.amqp.run(lambda: operations.deny(state.sync_store, run_id, decided_by=who.name, reason=reason))
        return {"run_id": run_id, "denied": True}

    @app.get("/v1/servers", tags=["operations"])
    async def servers(request: Request, who: Reader) -> list[dict[str, Any]]:
        """Per MCP server: ok, failed and cancelled tool calls (``runbrake servers --json``), counted over every
        run. A tenant's token lists only the catalog's servers open to it, with the counts of those it alone may
        use; those of a server other tenants may use too are null (docs/security.md, "Tenants")."""
        state = _state(request)
        counts = await state.store.server_outcomes()
        if who.tenant is None:
            return server_health(counts)
        catalog = state.admission.catalog
        usable = catalog.usable("mcp_servers", who.tenant)
        return tenant_server_health(counts, usable, alone=[
            name for name in usable if catalog.tenants_of("mcp_servers", name) == (who.tenant,)])

    @app.get("/v1/webhooks", tags=["operations"])
    async def webhooks(request: Request, who: Reader,
                       failing: Annotated[bool, Query(description="Only deliveries retrying or given up.")] = False,
                       limit: Annotated[int, Query(ge=1, le=1000, description="Deliveries at most.")] = 100,
                       ) -> list[dict[str, Any]]:
        """Webhook deliveries, newest first (``runbrake webhooks --json``; docs/webhooks.md); every tenant's
        runs' deliveries, so an operator's alone (403 for a tenant's token)."""
        if who.tenant is not None:
            raise ApiError.answer(403, f"token {who.name!r} is a tenant's; webhook deliveries are an operator's")
        return webhook_deliveries(await _state(request).store.webhook_deliveries(failing=failing, count=limit))

    @app.get("/v1/schema/run-spec", tags=["runs"])
    async def schema(_who: Reader) -> dict[str, Any]:
        """The run spec's JSON Schema (``runbrake schema``)."""
        return run_spec_json_schema()

    @app.get("/healthz", tags=["operations"])
    async def healthz() -> dict[str, str]:
        """The process is alive."""
        return {"status": "ok"}

    @app.get("/readyz", tags=["operations"])
    async def readyz(request: Request) -> JSONResponse:
        """Redis and RabbitMQ answer: 200, or 503 naming the one that does not."""
        state = _state(request)
        checks: dict[str, str] = {}
        try:
            await asyncio.wait_for(state.store.ping(), state.settings.redis_timeout_s + 1)
            checks["redis"] = "ok"
        except (StoreError, TimeoutError) as exc:  # the error names the address: logged, not answered
            log.warning("api_not_ready", service="redis", error=str(exc) or type(exc).__name__)
            checks["redis"] = "unreachable"
        problem = await _rabbitmq_problem(state)
        if problem is not None:
            log.warning("api_not_ready", service="rabbitmq", error=problem)
        checks["rabbitmq"] = "ok" if problem is None else "unreachable"
        # Live events: the hub's subscription (it restarts itself; until then no stream hears a thing).
        checks["events"] = "ok" if state.hub.ready else "not subscribed to live events"
        ready = all(value == "ok" for value in checks.values())
        return JSONResponse({"ready": ready, **checks}, status_code=200 if ready else 503)

    @app.get("/metrics", tags=["operations"], response_class=PlainTextResponse)
    async def metrics(request: Request) -> Response:
        """Prometheus text: request counts and latencies, event clients."""
        return Response(generate_latest(_state(request).metrics.registry), media_type=CONTENT_TYPE_LATEST)


_SSE_HEADERS: Final = {"Cache-Control": "no-store", "X-Accel-Buffering": "no"}


STREAM_RETRY_AFTER_S: Final = 5
"""``Retry-After`` of a refused event stream (429, 503)."""
LAST_EVENT_ID: Final = re.compile(r"[0-9]{1,18}")
"""A step sequence as a client echoes it: ASCII digits, at most 18 (below Redis's 64-bit list indexes)."""


def _last_event_id(value: str | None) -> int:
    """The step sequence a reconnecting client had last (0: none); anything but digits is 422."""
    if not value:
        return 0
    if not LAST_EVENT_ID.fullmatch(value.strip(" \t")):
        raise ApiError.answer(422, "invalid Last-Event-ID", errors=[
            {"loc": ["header", "last-event-id"], "msg": "a step sequence: 1 to 18 digits"}])
    return int(value.strip(" \t"))


FEED_EVENT_ID: Final = re.compile(r"[0-9]{1,20}-[0-9]{1,20}")


def _feed_event_id(value: str | None) -> str | None:
    """The feed's ``Last-Event-ID``: an event id (``<ms>-<seq>``), or None without the header (or an empty one)."""
    if value is None or not value.strip(" \t"):
        return None
    if not FEED_EVENT_ID.fullmatch(value.strip(" \t")):
        raise ApiError.answer(422, "invalid Last-Event-ID", errors=[
            {"loc": ["header", "last-event-id"], "msg": "an event id of this feed: <digits>-<digits>"}])
    return value.strip(" \t")


async def _stream_slot(state: ApiState, who: str) -> Callable[[], None]:
    """One of ``who``'s event stream slots (429 when all are taken), once live events are available (503
    while the hub is not subscribed)."""
    if not await state.hub.wait_ready():
        raise ApiError.answer(503, "live events are not available right now; retry",
                              headers={"Retry-After": str(STREAM_RETRY_AFTER_S)})
    give_back = state.streams.take(who)
    if give_back is None:
        state.metrics.streams_refused.inc()
        log.info("event_stream_refused", by=who, open=state.streams.held(who))
        raise ApiError.answer(429, f"too many event streams open for {who!r}: at most {state.streams.per_token} "
                                   "at once (RUNBRAKE_API_MAX_STREAMS_PER_TOKEN); close one or retry later",
                              headers={"Retry-After": str(STREAM_RETRY_AFTER_S)}, limit=state.streams.per_token)
    return give_back


def _event_stream(state: ApiState, frames: AsyncGenerator[bytes, None], subscriber: Subscriber,
                  give_back: Callable[[], None]) -> EventStreamResponse:
    """The response of an events route: it gives back the subscriber and the slot however it ends."""
    state.metrics.event_clients.inc()

    def closed() -> None:
        state.hub.unsubscribe(subscriber)
        give_back()
        state.metrics.event_clients.dec()

    return EventStreamResponse(frames, send_timeout_s=state.settings.api_send_timeout_s, headers=_SSE_HEADERS,
                               on_close=closed, on_stall=state.metrics.stalled.inc, abort=state.connections.aborter)


def _answer_for(exc: RunbrakeError) -> JSONResponse | None:
    """The one map from runbrake's errors (those of the operations, shared/operations.py, and the API's own
    :class:`ApiError`) to the API's answers; None for an error that is a bug (answered 500).

    A ``StoreError`` or ``PublishError`` names the service's address: the log has it, the client does not
    (docs/http-api.md, "Errors").
    """
    match exc:
        case ApiError():
            return JSONResponse(exc.body, status_code=exc.status_code, headers=exc.headers)
        case RunNotFound():
            return JSONResponse({"error": str(exc), "run_id": exc.run_id}, status_code=404)
        case TransitionRefused():
            return JSONResponse({"error": str(exc), "run_id": exc.run_id, "status": exc.found.value},
                                status_code=409)
        case IdempotencyConflict():
            return JSONResponse({"error": str(exc), "run_id": exc.run_id}, status_code=409)
        case QuotaExceeded():
            retry = exc.retry_after_s or QUOTA_RETRY_AFTER_S
            return JSONResponse({"error": str(exc), "quota": exc.quota, "limit": exc.limit}, status_code=429,
                                headers={"Retry-After": str(retry)})
        case SpecError():  # the admission policy at enqueue: the catalog, inline definitions, the bounds
            errors = [{"loc": list(p.loc), "msg": p.msg, "field": p.field} for p in exc.problems]
            return JSONResponse({"error": "run spec refused", "errors": errors}, status_code=422)
        case NotReplicated():
            log.warning("api_store_not_replicated", error=str(exc))
            return JSONResponse({"error": "the run store (Redis) did not get the change onto enough replicas in "
                                          "time; asking again is safe"}, status_code=503)
        case StoreError():
            log.warning("api_store_unavailable", error=str(exc))
            return JSONResponse({"error": "the run store (Redis) could not be reached"}, status_code=503)
        case ResumeUnsent():
            log.warning("api_resume_unsent", run_id=exc.run_id, error=str(exc))
            return JSONResponse({"error": "RabbitMQ did not take the resume message; the approval stands, approve "
                                          "again to resend", "run_id": exc.run_id}, status_code=503)
        case PublishError():  # an enqueue whose message RabbitMQ did not confirm (settled failed, enqueue_failed)
            log.warning("api_publish_failed", error=str(exc))
            return JSONResponse({"error": "RabbitMQ did not take the run's message; the run is failed "
                                          "(enqueue_failed)"}, status_code=503)
    return None


_REASON_BODY: Final = {"requestBody": {
    "required": False,
    "description": "Optional; the request itself must say Content-Type: application/json (docs/http-api.md, "
                   "\"Requests\"). An empty body is {}.",
    "content": {"application/json": {"schema": ReasonBody.model_json_schema()}},
}}


_STEER_BODY: Final = {"requestBody": {
    "required": True,
    "description": "Sent with Content-Type: application/json (docs/http-api.md, \"Requests\"); at most "
                   "RUNBRAKE_MAX_SPEC_BYTES.",
    "content": {"application/json": {"schema": SteerBody.model_json_schema()}},
}}


async def _steer_body(request: Request, limit: int) -> SteerBody:
    """The body of a steer (JSON, at most ``limit`` bytes: RUNBRAKE_MAX_SPEC_BYTES), checked for its shape; the
    input's length is checked by the operation (RUNBRAKE_MAX_INPUT_CHARS)."""
    body = await _json_body(request, limit, "the body", "RUNBRAKE_MAX_SPEC_BYTES")
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        raise ApiError.answer(422, "invalid request", errors=[
            {"loc": ["body"], "msg": "not JSON: send {\"input\": \"...\", \"reason\": \"...\"}"}]) from None
    try:
        return SteerBody.model_validate(data)
    except ValidationError as exc:
        errors = [{"loc": ["body", *e["loc"]], "msg": e["msg"]} for e in exc.errors()]
        raise ApiError.answer(422, "invalid steer", errors=errors) from None


async def _json_body(request: Request, limit: int, what: str, setting: str | None = None) -> bytes:
    """The raw body of a request that must be JSON: ``415`` unless ``Content-Type`` says
    ``application/json``, ``413`` as soon as it exceeds ``limit`` bytes (before anything parses it).

    Called after the token check, never before: an unauthenticated request's body is not read
    (docs/http-api.md, "Requests"). The Content-Type rule keeps browsers from sending a cross-site
    request without a CORS preflight, which this API never grants (a "simple" request may only carry
    text/plain, form or multipart bodies).
    """
    media_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if media_type != "application/json":
        raise ApiError.answer(415, "the body must be JSON, sent with Content-Type: application/json",
                              headers={"Accept-Post": "application/json"})
    too_large = f"{what} is larger than {limit} bytes" + (f" ({setting})" if setting else "")
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > limit):
        raise ApiError.answer(413, too_large, limit=limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError.answer(413, too_large, limit=limit)
        chunks.append(chunk)
    return b"".join(chunks)


async def _reason(request: Request) -> str | None:
    """The ``reason`` of a cancel, approve or deny body (JSON, at most MAX_REASON_BODY_BYTES; empty = ``{}``)."""
    body = await _json_body(request, MAX_REASON_BODY_BYTES, "the body")
    try:
        data = json.loads(body) if body.strip() else {}
    except (ValueError, RecursionError):
        raise ApiError.answer(422, "invalid request", errors=[
            {"loc": ["body"], "msg": "not JSON: send {} or {\"reason\": \"...\"}"}]) from None
    try:
        return ReasonBody.model_validate(data).reason
    except ValidationError as exc:
        errors = [{"loc": ["body", *e["loc"]], "msg": e["msg"]} for e in exc.errors()]
        raise ApiError.answer(422, "invalid request", errors=errors) from None


def _spec(body: bytes, idempotency_key: str | None) -> RunSpec:
    """The validated spec; an ``Idempotency-Key`` header sets (or overrides) its idempotency_key."""
    document: bytes | str = body
    if idempotency_key is not None:
        try:
            data = json.loads(body)
        except (ValueError, RecursionError):
            data = None  # the spec's own parser says what is wrong with it
        if isinstance(data, dict):
            data["idempotency_key"] = idempotency_key
            document = json.dumps(data)
    try:
        return RunSpec.from_json(document)
    except SpecError as exc:
        errors = [{"loc": list(p.loc), "msg": p.msg, "field": p.field} for p in exc.problems]
        raise ApiError.answer(422, "invalid run spec", errors=errors) from exc


async def _schema_checked(state: ApiState, schema: object) -> None:
    """Check an ``output_schema`` on the schema pool's own threads (shared/schema_check.py), so that a schema that
    takes RUNBRAKE_SCHEMA_CHECK_S holds none of the AMQP_THREADS that cancels and enqueues publish from; the
    admission on one of those then finds the verdict remembered and refuses the spec naming the field."""
    if isinstance(schema, dict):
        await SCHEMA_CHECKS.off_loop(lambda: state.admission.output_schema_problem(schema))


async def _enqueued(state: ApiState, enqueued: Enqueued, request: Mapping[str, Any],
                    idempotency_key: object) -> JSONResponse:
    """The answer to an enqueue: 201 for a new run; 200 for the run an idempotency key already created from
    the same request, 409 from another."""
    answer = {"run_id": enqueued.run_id, "status": enqueued.status.value, "created": enqueued.created}
    headers = {"Location": f"/v1/runs/{enqueued.run_id}"}
    if enqueued.created:
        return JSONResponse(answer, status_code=201, headers=headers)
    stored = await state.store.get(enqueued.run_id)
    if dict(stored.request) != dict(request):
        raise ApiError.answer(409, f"idempotency key {idempotency_key!r} already names run "
                                   f"{enqueued.run_id}, created from a different spec", run_id=enqueued.run_id)
    return JSONResponse(answer, status_code=200, headers=headers)


def _continue_body(body: bytes, idempotency_key: str | None) -> dict[str, Any]:
    """A continue's body: a JSON object (its fields are checked as the spec they make); an ``Idempotency-Key``
    header sets (or overrides) its idempotency_key."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        data = None
    if not isinstance(data, dict):
        raise ApiError.answer(422, "invalid request", errors=[
            {"loc": ["body"], "msg": "must be a JSON object: {\"input\": \"...\"} and any run-spec field but "
                                     "messages"}])
    if idempotency_key is not None:
        data["idempotency_key"] = idempotency_key
    return data


async def _rabbitmq_problem(state: ApiState) -> str | None:
    checked_at, problem = state.rabbitmq_checked
    if time.monotonic() - checked_at < READY_CACHE_S:
        return problem

    def check() -> str | None:
        parameters = connection_parameters(state.settings, socket_timeout=2.0, blocked_connection_timeout=2.0,
                                           connection_attempts=1)
        try:
            pika.BlockingConnection(parameters).close()
        except pika.exceptions.AMQPError as exc:
            return repr(exc)
        return None

    problem = await asyncio.get_running_loop().run_in_executor(None, check)
    state.rabbitmq_checked = (time.monotonic(), problem)
    return problem


# -- the runs page -------------------------------------------------------------------------------

_PAGE_TYPES: Final = {"app.js": "text/javascript; charset=utf-8", "app.css": "text/css; charset=utf-8"}


@functools.cache
def _page_file(name: str) -> str:
    return resources.files("runbrake.broker").joinpath("page", name).read_text(encoding="utf-8")


def _language(accept_language: str | None) -> str:
    """``de`` when the browser prefers German over English, else ``en``."""
    best, best_q = "en", -1.0
    for part in (accept_language or "").split(","):
        tag, _, params = part.strip().partition(";")
        q = 1.0
        with contextlib.suppress(ValueError):
            q = float(params.strip().removeprefix("q=")) if params.strip().startswith("q=") else 1.0
        primary = tag.strip().lower().split("-")[0]
        if primary in ("en", "de") and q > best_q:
            best, best_q = primary, q
    return best


def _page_routes(app: FastAPI) -> None:
    @app.get("/", include_in_schema=False)
    async def page(request: Request) -> Response:
        state = _state(request)
        config = {"labels": LABELS, "lang": _language(request.headers.get("accept-language")),
                  "tokens": state.tokens is not None}
        html = _page_file("index.html").replace(
            "/*RUNBRAKE_CONFIG*/null", json.dumps(config, ensure_ascii=False).replace("</", "<\\/"))
        return Response(html, media_type="text/html; charset=utf-8", headers=_PAGE_HEADERS)

    @app.get("/favicon.ico", include_in_schema=False)
    async def favicon() -> Response:
        return Response(status_code=204)

    @app.get("/page/{name}", include_in_schema=False)
    async def page_file(name: str) -> Response:
        if name not in _PAGE_TYPES:
            raise ApiError.answer(404, "no such file")
        return Response(_page_file(name), media_type=_PAGE_TYPES[name], headers=_PAGE_HEADERS)


_PAGE_HEADERS: Final = {
    "Cache-Control": "no-cache",
    # Everything the page loads is its own: no CDN, no inline script, no framing.
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                               "frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
}


# -- metrics middleware --------------------------------------------------------------------------

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class MetricsMiddleware:
    """Counts requests and times them to the start of their response, by route template (pure ASGI,
    so that streams pass through untouched)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500

        async def timed_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
                metrics = self._metrics(scope)
                if metrics is not None:
                    metrics.latency.labels(_method(scope), _route(scope)).observe(time.perf_counter() - started)
            await send(message)

        try:
            await self.app(scope, receive, timed_send)
        finally:
            metrics = self._metrics(scope)
            if metrics is not None:
                metrics.requests.labels(_method(scope), _route(scope), str(status)).inc()

    @staticmethod
    def _metrics(scope: Scope) -> Metrics | None:
        app = scope.get("app")
        state = getattr(getattr(app, "state", None), "api", None)
        return state.metrics if isinstance(state, ApiState) else None


def _method(scope: Scope) -> str:
    method = scope.get("method")
    return method if method in METHODS else "other"


def _route(scope: Scope) -> str:
    """The route's template (a fixed set), or ``unmatched`` for every path no route has."""
    route = scope.get("route")
    path = getattr(route, "path", None)
    return path if isinstance(path, str) else "unmatched"


# -- request guard -------------------------------------------------------------------------------


def allowed_hosts(settings: Settings, tokens: Tokens | None) -> frozenset[str] | None:
    """The ``Host`` headers the API answers (docs/http-api.md, "Allowed hosts"); None: any.

    Without tokens the API trusts whoever reaches it, so a page on another site must not reach it
    through a name it controls that resolves to 127.0.0.1 (DNS rebinding): only the loopback names,
    unless RUNBRAKE_API_ALLOWED_HOSTS says otherwise. With tokens a request proves itself, so any.
    """
    hosts = settings.api_allowed_hosts
    if hosts is None:
        return None if tokens is not None else frozenset(LOOPBACK_HOSTS)
    return None if "*" in hosts else frozenset(hosts)


def _host_allowed(host: str, allowed: frozenset[str]) -> bool:
    """Whether a ``Host`` header names an allowed entry: ``name`` allows it on any port, ``name:port`` on that one."""
    host = host.strip().lower()
    if host.startswith("["):
        name, bracket, port = host.partition("]")
        name += bracket
    else:
        name, colon, port = host.rpartition(":") if ":" in host else (host, "", "")
        port = colon + port
    if not name or (port and not (port.startswith(":") and port[1:].isdigit())):
        return False
    return name in allowed or host in allowed


class RequestGuard:
    """What every request meets before a route sees it (pure ASGI), and what it leaves behind:

    - a ``Host`` outside the allowed hosts is ``400`` (DNS rebinding), except on the probes;
    - an answer given before the request's body was read to its end (a ``401``, a ``415``, a ``413``)
      closes the connection, so that the client cannot make the server take in a body nobody reads.
    """

    def __init__(self, app: ASGIApp, *, allowed_hosts: frozenset[str] | None) -> None:
        self.app = app
        self.allowed_hosts = allowed_hosts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers: list[tuple[bytes, bytes]] = scope["headers"]
        has_body = any(name == b"transfer-encoding" or (name == b"content-length" and value.strip() != b"0")
                       for name, value in headers)
        if self.allowed_hosts is not None and scope["path"] not in PROBES:
            hosts = [value.decode("latin-1") for name, value in headers if name == b"host"]
            if len(hosts) != 1 or not _host_allowed(hosts[0], self.allowed_hosts):
                log.info("api_host_refused", host=hosts[0][:200] if len(hosts) == 1 else None, hosts=len(hosts))
                await _answer(send, 400, {"error": "this Host is not served here (RUNBRAKE_API_ALLOWED_HOSTS)"},
                              close=has_body)
                return
        body_read = not has_body

        async def reading() -> Message:
            nonlocal body_read
            message = await receive()
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_read = True
            return message

        async def answering(message: Message) -> None:
            if message["type"] == "http.response.start" and not body_read:
                message["headers"] = [*message.get("headers", []), (b"connection", b"close")]
            await send(message)

        await self.app(scope, reading, answering)


async def _answer(send: Send, status: int, body: dict[str, Any], *, close: bool) -> None:
    content = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(content)).encode())]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": content})
