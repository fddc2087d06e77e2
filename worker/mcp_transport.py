"""The MCP transport edge: one open client per server per segment (over one HTTP connection pool per
server and event loop), and interruptible calls.

Every error the MCP SDK, httpx2 or the operating system raises is translated here into
:class:`~shared.errors.ToolTransportError` (chained with ``from exc``); nothing outside
this module sees a third-party exception. Only :meth:`McpConnection.call` decides that a
call was *cancelled*, and it decides from the interrupt scope (``cancelled_caught``),
never from a code or a message (docs/store.md, "Tool outcomes").

Why each client lives in a task of its own: the SDK's client runs its transport in task
groups entered with the client. Had the segment's own task entered it, a transport fault
(an HTTP server dying mid-call raises ``httpx2.RemoteProtocolError`` in a background
task) would cancel the whole segment body, not just the call, and every exception from
the body would come out wrapped in an ``ExceptionGroup``. In a task of its own the
fault ends only that task; the SDK then wakes the pending call with "connection closed",
which this module reports as a failed call. The client is still entered and exited in
one task, as the SDK requires (docs/pitfalls.md, "Pitfalls: one MCP client per task").
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
import os
import ssl
import weakref
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import AbstractContextManager, AsyncExitStack, asynccontextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Final, Literal

import anyio
import anyio.lowlevel
import httpx2
import structlog
from anyio.abc import TaskGroup
from mcp import Client, InputRequiredRoundsExceededError, MCPError, StdioServerParameters
from mcp.client import Transport
from mcp.client import session as sdk_session
from mcp.client.extension import ClaimContext, ClientExtension, ResultClaim
from mcp.client.stdio import get_default_environment
from mcp.shared.dispatcher import ProgressFnT
from mcp_types import INVALID_PARAMS, CallToolResult, RequestParamsMeta, Result
from mcp_types.version import MODERN_PROTOCOL_VERSIONS
from pydantic import ConfigDict, ValidationError

from runbrake.shared import tracing
from runbrake.shared.catalog import expand
from runbrake.shared.errors import ToolArgumentsRefused, ToolCallCancelled, ToolTransportError
from runbrake.shared.registry import TRANSPORTS
from runbrake.shared.spec import HttpServerSpec, McpServerSpec, StdioServerSpec, TaskUse
from runbrake.shared.tracing import TRACEPARENT
from runbrake.worker.bounded_bodies import bound_bodies
from runbrake.worker.conversation import ToolInfo
from runbrake.worker.mcp_progress import ProgressRoutes, ProgressTap
from runbrake.worker.mcp_session import SessionHttp
from runbrake.worker.mcp_stdio import bounded_stdio_client

__all__ = ["MAX_MESSAGE_BYTES", "TASKS_EXTENSION", "McpConnection", "TaskStarted", "is_transport_fault"]

log = structlog.get_logger(__name__)

MAX_MESSAGE_BYTES: Final = 4 * 1024 * 1024
"""The most bytes of one message an MCP server sends over HTTP (a JSON answer, or one event of a stream),
counted before it is parsed; past it the call fails and the rest is never read (docs/security.md, "Bounds").
Far above what a result keeps (``RUNBRAKE_MAX_TOOL_RESULT_CHARS`` per content channel)."""

_MAX_TOOL_PAGES: Final = 100
"""A server whose ``tools/list`` cursor never ends cannot hang discovery."""

_TRANSPORT_FAULTS: Final = (
    MCPError,  # an error response, "connection closed", a request the SDK timed out
    ValidationError,  # a result that does not conform to the negotiated protocol version
    InputRequiredRoundsExceededError,  # the server kept asking for input
    httpx2.HTTPError,  # connect, read, write and status errors of the HTTP transport
    OSError,  # a command that cannot be started, a broken pipe, a refused connection
    anyio.BrokenResourceError,
    anyio.ClosedResourceError,
    anyio.EndOfStream,
)
"""What a dead, broken or misbehaving server makes the SDK raise; anything else is a bug and propagates."""

_SHARED_TOOLS_MAX: Final = 4_096
"""The most tools :func:`_shared` keeps; past it the table starts again from nothing."""

_shared_tools: dict[tuple[str, str, str], ToolInfo] = {}
"""Per worker process: the last listing of each tool of each server (by name and where it is), as
:func:`_shared` hands it to every run that lists the same."""


def _shared(where: str, tool: ToolInfo) -> ToolInfo:
    """``tool`` as the process last kept it when that is equal (its description and input schema alike),
    else ``tool``, kept from now on: every run still lists its servers' tools at its start and sees what they
    answered, but runs that got the same keep one copy, not one each (about 4 KiB a run of the npm reference
    server's: docs/benchmarks.md, "Saturation: memory per run"). Nothing changes a ``ToolInfo`` or its schema
    once made (the providers copy the schema into each request)."""
    key = (tool.server, where, tool.name)
    kept = _shared_tools.get(key)
    if kept == tool:
        return kept
    if len(_shared_tools) >= _SHARED_TOOLS_MAX:
        _shared_tools.clear()
    _shared_tools[key] = tool
    return tool


TASKS_EXTENSION: Final = "io.modelcontextprotocol/tasks"
"""The identifier of the MCP tasks extension of protocol 2026-07-28 (SEP-2663)."""


@dataclass(frozen=True, slots=True)
class TaskStarted:
    """What a ``tools/call`` came to when the server made it a task of the 2026-07-28 tasks extension (SEP-2663,
    "Task Creation"): the server's ``Task`` as it answered (``taskId``, ``status``, ``pollIntervalMs``…)."""

    task: Mapping[str, Any]


class _TaskCreated(Result):
    """The ``CreateTaskResult`` of the tasks extension: ``resultType: "task"`` and the task's fields, flat."""

    model_config = ConfigDict(extra="allow")
    result_type: Literal["task"]
    task_id: str


class _Claimed(Exception):
    """Raised by the tasks claim's resolver, caught in :meth:`McpConnection.call`: the SDK's ``Client.call_tool``
    would otherwise want a resolver to wait for the task to end, inside the call; runbrake waits for it outside
    (worker/mcp_tasks.py), where a hand-over can leave it running."""

    def __init__(self, created: _TaskCreated) -> None:
        super().__init__(created.task_id)
        self.task = created.model_dump(by_alias=True, exclude_none=True)


async def _hand_out(created: _TaskCreated, _context: ClaimContext) -> CallToolResult:
    raise _Claimed(created)


class _TasksExtension(ClientExtension):
    """The client side of the tasks extension, in the SDK's own terms (``mcp.client.extension``): advertised in
    every request's capabilities, so the server may answer a ``tools/call`` with a task, which the claim hands
    out of the call. Only for a catalog server whose ``tasks`` is not ``"off"``."""

    identifier = TASKS_EXTENSION

    def claims(self) -> Sequence[ResultClaim[Any]]:
        return (ResultClaim(result_type="task", model=_TaskCreated, resolve=_hand_out,
                            protocol_versions=frozenset(MODERN_PROTOCOL_VERSIONS)),)


def _shared_call_tool_adapters() -> None:
    """The SDK builds a pydantic ``TypeAdapter`` of ``tools/call``'s results, with one arm per extension claim, for
    every session that adopts a 2026-07-28 server (``mcp.client.session._build_call_tool_adapter``): 0.28 ms of CPU
    a session here (a loaded machine), for a type that depends only on the claims' tags and models. Built
    once per tags and models here, and shared: the adapter holds no state of a session (docs/pitfalls.md,
    "Pitfalls: mcp 2.x's per-session result adapter")."""
    build = sdk_session._build_call_tool_adapter
    adapters: dict[tuple[tuple[str, object], ...], Any] = {}

    def shared(active: Mapping[str, ResultClaim[Any]]) -> Any:
        if not active:
            return build(active)
        key = tuple(sorted((tag, claim.model) for tag, claim in active.items()))
        adapter = adapters.get(key)
        if adapter is None:
            adapter = adapters[key] = build(active)
        return adapter

    sdk_session._build_call_tool_adapter = shared


_shared_call_tool_adapters()


class _Request:
    """One ``tools/call`` made in a task of the connection's own, so that a call cut off is recorded before the SDK
    tells the server: cancelling the request's task only schedules it, and the cut-off call's task goes on to its
    step's append first (docs/cancellation.md, "Cancellation: the interrupt")."""

    def __init__(self, pending: set[_Request]) -> None:
        self.done = anyio.Event()
        self.started = False
        """The request's task ran: its request may have reached the server (cancelled before, it never went out)."""
        self._scope = anyio.CancelScope()
        self._pending = pending
        """Its connection's requests whose task has not ended (``McpConnection._told`` waits for them)."""
        self._result: CallToolResult | None = None
        self._error: BaseException | None = None

    def spawn(self, tasks: TaskGroup, client: Client, tool: str, arguments: dict[str, Any],
              meta: RequestParamsMeta | None) -> None:
        """Start the request in ``tasks``, the connection's task group."""
        self._pending.add(self)
        tasks.start_soon(self._make, client, tool, arguments, meta)

    async def _make(self, client: Client, tool: str, arguments: dict[str, Any], meta: RequestParamsMeta | None) -> None:
        """The request's task: never raises but for its group's cancellation (its caller reads what it came to)."""
        try:
            with self._scope:
                self.started = True
                self._result = await client.call_tool(tool, arguments, meta=meta)
        except Exception as exc:  # noqa: BLE001 - handed to the caller (McpConnection.call), which translates it
            self._error = exc
        except BaseException:  # the connection's task group is cancelled: the client is gone
            self._error = anyio.ClosedResourceError()
            raise
        finally:
            self.done.set()
            self._pending.discard(self)

    def abandon(self) -> None:
        """Cut the request off unless it is done (its task tells the server); from the caller's task."""
        if not self.done.is_set():
            self._scope.cancel()

    def answer(self) -> CallToolResult | None:
        """What the request came to: the server's result, None when it was cut off, or what the SDK raised."""
        if self._error is not None and self.done.is_set():
            raise self._error
        return self._result


class McpConnection:
    """One open MCP client for one server, for one segment of a run.

    Open it with :meth:`open`; discover tools with :meth:`list_tools`; call them with
    :meth:`call`. Calls are made from the caller's task; the client itself lives in a
    task of its own (see the module docstring).
    """

    def __init__(self, spec: McpServerSpec) -> None:
        self.spec = spec
        self._client: Client | None = None
        self._fault: Exception | None = None
        self._ready = anyio.Event()
        self._closing = anyio.Event()
        self._progress = ProgressRoutes()
        self._tasks: TaskGroup | None = None
        self._requests: set[_Request] = set()
        """The requests whose task has not ended: cut-off ones still telling their server (``_Request``)."""
        self.session: SessionHttp | None = None
        """The HTTP transport's MCP session (worker/mcp_session.py); None over stdio."""
        self.task_support: dict[str, str] = {}
        """Each listed tool's ``execution.taskSupport`` (``forbidden``, ``optional``, ``required``), where it says."""

    @property
    def server(self) -> str:
        """The server's name in the run spec."""
        return self.spec.name

    @classmethod
    @asynccontextmanager
    async def open(cls, spec: McpServerSpec, *, connect_timeout_s: float = 10.0) -> AsyncIterator[McpConnection]:
        """Connect to the server described by ``spec``, and disconnect when the block ends.

        Args:
            spec: the server: streamable HTTP (``url``) or stdio (``command``, ``args``, ``env``).
            connect_timeout_s: how long starting and reaching the server and the protocol
                handshake may take, in seconds.

        Raises:
            ToolTransportError: the server could not be started or reached, or did not
                complete the handshake within ``connect_timeout_s``. Names the server.
        """
        connection = cls(spec)
        # Entered and exited by hand, with no exception passed to __aexit__, so that an
        # exception (or a CancelRequested) raised by the block passes through unchanged
        # instead of being wrapped in an ExceptionGroup by the task group. The client task
        # never raises (it keeps its fault for the calls), so the task group has nothing
        # of its own to report.
        task_group = connection._tasks = anyio.create_task_group()
        await task_group.__aenter__()
        try:
            task_group.start_soon(connection._serve, connect_timeout_s)
            await connection._ready.wait()
            if connection._client is None:
                fault = connection._fault
                raise ToolTransportError(
                    f"could not connect to MCP server {spec.name!r} ({spec.where()}): {_describe(fault)}",
                    server=spec.name,
                ) from fault
            yield connection
        finally:
            await connection._told()
            connection._closing.set()
            if connection._client is None:
                # Still connecting (the block never ran: the caller was cancelled meanwhile),
                # or already gone: there is no client to close gracefully, so do not wait for one.
                task_group.cancel_scope.cancel()
            await task_group.__aexit__(None, None, None)

    async def _serve(self, connect_timeout_s: float) -> None:
        """The client's task: enter the client, wait for the segment to end, exit the client."""
        try:
            # One scope around the client's whole life, its deadline lifted once connected:
            # a scope entered around the handshake alone would have to be exited while the
            # client's own task groups are still open, which anyio refuses.
            with anyio.CancelScope(deadline=anyio.current_time() + connect_timeout_s) as connecting:
                async with AsyncExitStack() as stack:
                    transport, self.session = _target(self.spec, self._progress)
                    # The tasks extension is offered to a server only where its catalog entry lets calls be tasks.
                    extensions = [] if self.spec.tasks is TaskUse.OFF else [_TasksExtension()]
                    client = await stack.enter_async_context(Client(transport, extensions=extensions))
                    connecting.deadline = math.inf
                    self._client = client
                    self._ready.set()
                    await self._closing.wait()
            if connecting.cancelled_caught:
                self._fault = TimeoutError(f"no handshake within {connect_timeout_s:g} s")
        except Exception as exc:  # noqa: BLE001 - this task must not raise (module docstring); calls re-raise it
            self._fault = exc
            if self._closing.is_set():
                log.warning("mcp_disconnect_failed", server=self.server, error=_describe(exc))
            elif self._ready.is_set():
                log.warning("mcp_connection_lost", server=self.server, error=_describe(exc))
        finally:
            self._client = None
            self._ready.set()

    async def list_tools(self, *, timeout_s: float = 30.0) -> list[ToolInfo]:
        """The tools the server offers, every page of them.

        Raises:
            ToolTransportError: the server failed, answered nonsense or took longer than ``timeout_s``.
        """
        client = self._live_client("tools/list")
        tools: list[ToolInfo] = []
        cursor: str | None = None
        with anyio.move_on_after(timeout_s) as deadline:
            try:
                for _ in range(_MAX_TOOL_PAGES):
                    page = await client.list_tools(cursor=cursor)
                    self.task_support.update((tool.name, tool.execution.task_support) for tool in page.tools
                                             if tool.execution is not None and tool.execution.task_support)
                    where = self.spec.where()
                    tools.extend(
                        _shared(where, ToolInfo(
                            server=self.server,
                            name=tool.name,
                            description=tool.description or "",
                            input_schema=tool.input_schema,
                        ))
                        for tool in page.tools
                    )
                    cursor = page.next_cursor
                    if cursor is None:
                        self._progress.drop_tools()
                        return tools
            except Exception as exc:
                if not is_transport_fault(exc):
                    raise
                raise self._error(exc, "listing tools failed") from exc
        if deadline.cancelled_caught:
            raise ToolTransportError(
                f"MCP server {self.server!r}: listing tools timed out after {timeout_s:g} s", server=self.server
            )
        raise ToolTransportError(
            f"MCP server {self.server!r}: tools/list still had more pages after {_MAX_TOOL_PAGES}",
            server=self.server,
        )

    async def call(
        self,
        tool: str,
        arguments: Mapping[str, Any],
        *,
        timeout_s: float,
        interrupt: anyio.CancelScope,
        progress: ProgressFnT | None = None,
    ) -> CallToolResult | TaskStarted:
        """Call ``tool`` and return the server's result, ``is_error`` results included, or the task the server made
        of the call (the 2026-07-28 tasks extension: only where it offers it, :attr:`offers_task_extension`).

        Args:
            tool: the tool's name on the server.
            arguments: the call's arguments (JSON-shaped).
            timeout_s: how long the call may take, in seconds.
            interrupt: an unentered scope the caller may cancel at any time, from the event
                loop's thread, to cut the call off; cancelled before the call starts, the
                request is never sent.
            progress: called with each MCP progress notification the server sends for this call.

        Raises:
            ToolCallCancelled: ``interrupt`` cut the call off.
            ToolArgumentsRefused: the server refused the call's arguments (JSON-RPC -32602).
            ToolTransportError: the call timed out, the server died or the protocol broke.
            Cancellation: a cancellation that does not come from ``interrupt`` (the task
                itself is being cancelled) propagates unchanged.
        """
        client = self._live_client(f"call to {tool}", tool=tool)
        request = _Request(self._requests)
        result: CallToolResult | None = None
        try:
            # The interrupt scope is the outer one: when the deadline and the interrupt both
            # fire, the interrupt catches the cancellation and the call counts as cancelled.
            with interrupt, anyio.move_on_after(timeout_s), self._progress_meta(progress) as meta:
                # A scope cancelled before this point (a cancel that came while the call waited for a
                # max_concurrency slot) raises here: the request was never sent, the server did nothing.
                # Past it, the request may reach the server (docs/cancellation.md, "Side effects of a
                # cut-off call"): a cut-off call's side effects are unknown from here on.
                await anyio.lowlevel.checkpoint()
                assert self._tasks is not None  # open() made it before the client
                request.spawn(self._tasks, client, tool, dict(arguments), meta)
                await request.done.wait()
        finally:
            # Cut off (or timed out): the request's own task is cancelled, and the SDK tells the server from
            # there (notifications/cancelled, or on 2026-07-28 HTTP, closing the request's stream: docs/pitfalls.md,
            # "Pitfalls: mcp 2.x cancellation") while this task goes on to record the call; the connection's close
            # waits for it.
            request.abandon()
        try:
            result = request.answer()
        except _Claimed as claimed:
            return TaskStarted(claimed.task)
        except Exception as exc:
            if not is_transport_fault(exc):
                raise
            if isinstance(exc, MCPError) and exc.code == INVALID_PARAMS:
                raise ToolArgumentsRefused(
                    f"MCP server {self.server!r} refused the arguments of {tool}: {_describe(exc)}",
                    server=self.server, tool=tool,
                ) from exc
            raise self._error(exc, f"call to {tool} failed", tool=tool) from exc
        if result is not None:
            # The call completed: a cancel that came after the answer cut nothing off, so the
            # answer is reported as it is, not as a cancellation.
            return result
        if interrupt.cancelled_caught:
            raise ToolCallCancelled(server=self.server, tool=tool, sent=request.started)
        # No result, no exception, not interrupted: only the deadline's scope swallows a
        # cancellation here, an outer one propagates through both scopes.
        raise ToolTransportError(
            f"call to {self.server}.{tool} timed out after {timeout_s:g} s", server=self.server, tool=tool
        )

    async def _told(self) -> None:
        """Wait, shielded, for the requests cut off to have told their server, before the client closes: a
        session closed first would take their notifications/cancelled with it. The SDK bounds each such write
        (5 s)."""
        with anyio.CancelScope(shield=True):
            for request in list(self._requests):
                await request.done.wait()

    @property
    def offers_tasks(self) -> bool:
        """The server said it runs ``tools/call`` as tasks (2025-11-25 ``capabilities.tasks.requests.tools.call``)."""
        client = self._client
        if client is None:
            return False
        tasks = client.server_capabilities.tasks
        return tasks is not None and tasks.requests is not None and tasks.requests.tools is not None \
            and tasks.requests.tools.call is not None

    @property
    def offers_task_extension(self) -> bool:
        """The server offers the 2026-07-28 tasks extension (``capabilities.extensions`` names it) and this connection
        declared it: the server may answer any ``tools/call`` with a task (SEP-2663, "Capability Negotiation")."""
        client = self._client
        if client is None or self.spec.tasks is TaskUse.OFF or client.protocol_version not in MODERN_PROTOCOL_VERSIONS:
            return False
        return TASKS_EXTENSION in (client.server_capabilities.extensions or {})

    @property
    def protocol_version(self) -> str:
        """The protocol version the handshake settled on ("" once closed)."""
        return "" if self._client is None else self._client.protocol_version

    def _progress_meta(self, progress: ProgressFnT | None) -> AbstractContextManager[RequestParamsMeta | None]:
        """The call's request ``_meta``: a progress token routed to ``progress`` (worker/mcp_progress.py),
        or none, and then the server is not asked for progress at all."""
        if progress is None or self._tasks is None:
            return nullcontext()
        routed: AbstractContextManager[RequestParamsMeta | None] = self._progress.route(progress, self._tasks)
        return routed

    def _live_client(self, what: str, *, tool: str = "") -> Client:
        if self._client is not None:
            return self._client
        if self._fault is not None:
            raise ToolTransportError(
                f"MCP server {self.server!r}: {what}: connection lost: {_describe(self._fault)}",
                server=self.server,
                tool=tool,
            ) from self._fault
        raise ToolTransportError(
            f"MCP server {self.server!r}: {what}: connection is closed", server=self.server, tool=tool
        )

    def _error(self, exc: Exception, what: str, *, tool: str = "") -> ToolTransportError:
        return ToolTransportError(
            f"MCP server {self.server!r}: {what}: {_describe(exc)}", server=self.server, tool=tool
        )


def _target(spec: McpServerSpec, progress: ProgressRoutes) -> tuple[Transport, SessionHttp | None]:
    """What the SDK's client connects with: the implementation the server's transport entry names
    (shared/registry.py), its progress notifications for ``progress`` taken out where they come in
    (worker/mcp_progress.py); one not implemented here fails the server's connect, never falls back. With it, the
    HTTP transport's session, when it is one."""
    implementation: Callable[[McpServerSpec], Transport | StdioServerParameters] = TRANSPORTS.implementation(spec)
    target = implementation(spec)
    transport: Transport = bounded_stdio_client(target) if isinstance(target, StdioServerParameters) else target
    return ProgressTap(transport, progress), target if isinstance(target, SessionHttp) else None


def http_target(spec: HttpServerSpec) -> SessionHttp:
    """The ``http`` transport: streamable HTTP over a client this loop's clients of the server's URL lend it."""
    # Catalog headers are expanded here, in the worker, when it connects (docs/security.md).
    headers = {
        name: expand(value, os.environ, where=f"mcp_servers.{spec.name}.headers.{name}")
        for name, value in spec.headers.items()
    }
    return SessionHttp(spec.url, _http_clients_of(spec.url, headers).lend, max_sse_event_size=MAX_MESSAGE_BYTES)


def stdio_target(spec: StdioServerSpec) -> StdioServerParameters:
    """The ``stdio`` transport: the server's command as a subprocess, each line it writes within
    :data:`~worker.mcp_stdio.MAX_LINE_BYTES` (:func:`_target` connects through worker/mcp_stdio.py)."""
    # The server gets mcp's safe defaults (PATH, HOME, ...) and its own env, never the
    # worker's whole environment with its credentials.
    env = {
        name: expand(value, os.environ, where=f"mcp_servers.{spec.name}.env.{name}")
        for name, value in spec.env.items()
    }
    return StdioServerParameters(command=spec.command, args=list(spec.args), env=get_default_environment() | env)


_http_clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[tuple[str, str], ClientShare]] = (
    weakref.WeakKeyDictionary())


def _http_clients_of(url: str, headers: dict[str, str]) -> ClientShare:
    """The HTTP clients (connection pools) of one server URL and header set, shared by every run on this event
    loop (:class:`ClientShare`); the SDK leaves a client it was given open.

    A client per segment cost each run in flight its own pool and transport, and a connect per segment;
    shared, a run costs just the connections its streams hold (docs/leases.md, "Capacity: runs in flight"). No cap
    on connections: each call in flight holds one, and ``--concurrency`` bounds the calls. The SDK's
    default client would also build an SSL context per connection, ~50 ms of CPU on the loop
    (bench/throughput.py profile): one context per process. A JSON answer is read within
    :data:`MAX_MESSAGE_BYTES` (worker/bounded_bodies.py); an event stream's events are, by the SDK.
    """
    shares = _http_clients.setdefault(asyncio.get_running_loop(), {})
    key = (url, json.dumps(headers, sort_keys=True))
    share = shares.get(key)
    if share is None:
        share = shares[key] = ClientShare(functools.partial(
            httpx2.AsyncClient, verify=_ssl_context(), timeout=httpx2.Timeout(30.0, read=300.0), headers=headers,
            limits=httpx2.Limits(max_connections=None, max_keepalive_connections=_KEEPALIVE_CONNECTIONS),
            event_hooks={"request": [_carry_traceparent] if tracing.current().enabled else [],
                         "response": [_BOUNDED]},
        ))
    return share


SESSIONS_PER_CLIENT: Final = 16
"""MCP connections one HTTP client serves at once. httpcore's pool walks every connection it holds, and every
request waiting, whenever a request comes or a response closes: each connection in flight holds two (its
``GET`` event stream, its call's ``POST`` stream), so one client for a whole server cost each request a walk of
two thousand at a thousand calls held (9 % of the loop at 520; docs/benchmarks.md, "Saturation: where the loop's
time went")."""


class ClientShare:
    """The HTTP clients of one server on one loop, each lent to at most :data:`SESSIONS_PER_CLIENT` connections at
    once: a connection takes the first with room (:meth:`lend`), so the fewest clients serve and the others
    empty; a client other than the first is closed when its last connection gives it back."""

    def __init__(self, make: Callable[[], httpx2.AsyncClient]) -> None:
        self._make = make
        self._lent: dict[httpx2.AsyncClient, int] = {}
        """Each client, oldest first, and the connections it is lent to."""

    @asynccontextmanager
    async def lend(self) -> AsyncIterator[httpx2.AsyncClient]:
        """A client for one connection's life."""
        client = next((c for c, lent in self._lent.items() if lent < SESSIONS_PER_CLIENT), None)
        if client is None:
            client = self._make()
        self._lent[client] = self._lent.get(client, 0) + 1
        try:
            yield client
        finally:
            self._lent[client] -= 1
            if not self._lent[client] and client is not next(iter(self._lent)):
                del self._lent[client]
                with anyio.CancelScope(shield=True):  # its idle connections' sockets, closed whatever cut us off
                    await client.aclose()


_BOUNDED: Final = bound_bodies(MAX_MESSAGE_BYTES, what="the MCP server's answer", event_streams=False)


async def _carry_traceparent(request: httpx2.Request) -> None:
    """With tracing on, every MCP HTTP request carries the current span's W3C ``traceparent``, so a traced MCP
    server continues the run's trace (docs/operating.md, "Traces"). The SDK sends each request in the
    context of the call that made it: the tool call's span (worker/tracing.py) is the current one."""
    traceparent = tracing.current().traceparent()
    if traceparent is not None:
        request.headers[TRACEPARENT] = traceparent


_KEEPALIVE_CONNECTIONS: Final = 16
"""Idle connections each HTTP client (:class:`ClientShare`) keeps for the next segments' connects. Not more: the
pool looks at every idle connection's socket (a ``select`` each, ``is_socket_readable``) whenever a request is
assigned or a response closed, two passes or more a request, so a pool left with 64 idle after a burst would spend
more on each request than the connect it saves."""


@functools.cache
def _ssl_context() -> ssl.SSLContext:
    return ssl.create_default_context()


def is_transport_fault(exc: BaseException) -> bool:
    # The SDK's task groups report faults as ExceptionGroups: a group is a transport
    # fault when every exception in it is one.
    if isinstance(exc, BaseExceptionGroup):
        return all(is_transport_fault(inner) for inner in exc.exceptions)
    return isinstance(exc, _TRANSPORT_FAULTS)


def _describe(exc: BaseException | None) -> str:
    """``Type: message`` for each exception in ``exc``, ExceptionGroups flattened."""
    if exc is None:
        return "unknown error"
    if isinstance(exc, BaseExceptionGroup):
        return "; ".join(_describe(inner) for inner in exc.exceptions)
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
