"""Tool calls made as MCP tasks: called, recorded, polled, cancelled, handed over (docs/usage.md, "Long tool calls
as MCP tasks"), in either revision of the protocol, behind one wait (:class:`_Waiting`) and two wires:

- protocol 2025-11-25 (:class:`_SessionWire`): a ``tools/call`` with ``task: {ttl}`` is answered at once with a
  task id; the worker polls ``tasks/get`` and fetches ``tasks/result`` once the task ends; ``tasks/cancel`` answers
  the task's status;
- the 2026-07-28 tasks extension, SEP-2663 (:class:`_ExtensionWire`): the worker declares the extension on its
  requests and the server decides which ``tools/call`` it answers with a task (``resultType: "task"``); the
  worker polls ``tasks/get``, whose answer carries the result once the task ended; ``tasks/cancel`` is only
  acknowledged, so the worker polls on until the task says what came of it. No MCP session: any worker polls.

The task id (with the 2025-11-25 server's MCP session id) is written to the run's record (``task:<call id>``,
shared/records.py) before anything waits on it, as the extension asks ("Clients SHOULD persist task IDs to durable
storage so that polling can resume after a crash or restart"). Each status change is reported like MCP progress.
What stops the wait decides what becomes of the task:

- a cancel, a steer, a budget or a deadline (the call's interrupt scope) sends ``tasks/cancel``; the server's
  answer is recorded: ``cancelled``, or the real result when the task completed anyway;
- a hand-over (or the loss of the run's lease) leaves the task running and the MCP session open
  (:class:`~shared.errors.CallHandedOver`): never cancelled by a worker that is no longer the run's; the next
  worker finds the recorded task and polls it instead of calling the tool again, as it does after a lost worker
  (worker/reclaim.py);
- a task (or session) the server no longer knows is lost (:class:`~shared.errors.TaskUnknown`), like a call cut
  off by a lost worker: the tool's ``on_worker_lost`` says what follows.

The 2025-11-25 task requests go as plain JSON-RPC over the server's shared HTTP client with the recorded
``Mcp-Session-Id``: a worker that re-attaches has no SDK session of that id (the SDK would open a new one with
``initialize``). The extension's go through the SDK's own session (worker/mcp_transport.py), which is stateless.
A task that asks for input (``input_required``) is cancelled and the call fails, saying so: runbrake answers no
input request of a server (``tasks/update`` is never sent), as it answers no sampling or elicitation request.
"""

from __future__ import annotations

import importlib.metadata
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any, Final, Protocol

import anyio
import anyio.lowlevel
import httpx2
import structlog
from mcp.shared.dispatcher import ProgressFnT
from mcp_types import CLIENT_CAPABILITIES_META_KEY, CLIENT_INFO_META_KEY, PROTOCOL_VERSION_META_KEY, CallToolResult
from mcp_types.version import MODERN_PROTOCOL_VERSIONS
from pydantic import ValidationError

from runbrake.shared.errors import (
    CallHandedOver,
    LostCallFails,
    TaskUnknown,
    ToolArgumentsRefused,
    ToolTransportError,
)
from runbrake.shared.spec import McpServerSpec, OnWorkerLost
from runbrake.shared.tool_result import Failure, TaskStatus, ToolResult
from runbrake.worker.conversation import ToolCall
from runbrake.worker.mcp_transport import MAX_MESSAGE_BYTES, TASKS_EXTENSION, McpConnection, TaskStarted

__all__ = ["TaskHandle", "TaskRecords", "TaskRpc", "call_as_task", "cancel_left"]

log = structlog.get_logger(__name__)

TERMINAL: Final = frozenset({"completed", "failed", "cancelled"})
"""The task statuses after which nothing changes (2025-11-25, "Task status")."""
_POLL_S: Final = (0.05, 5.0)
"""The bounds put on the interval a server asks polls at (``pollInterval``); 1 s when it asks none."""
_CANCEL_WITHIN_S: Final = 10.0
"""How long ``tasks/cancel`` and the result of a task that completed anyway may take once a brake came."""
_VERSION: Final = importlib.metadata.version("runbrake")
"""This worker's version, in the client info of the extension's requests."""
_CANCEL_POLL_S: Final = 0.1
"""The longest interval between polls of an extension task once it was asked to cancel: the brake is waiting."""
_TASK_NOT_FOUND: Final = ("not found", "unknown task", "no valid session", "expired")
"""Words of the error a server gives for a task or session it does not know: the TypeScript SDK answers -32602
(the code of any bad parameter) with "Task not found", and HTTP 400/404 for an unknown session; the extension's
examples say "Task not found" and "Task has expired" (SEP-2663, "Protocol Errors")."""
LOST: Final = "the MCP task of the call is no longer known to its server (restarted, or its TTL passed)"
"""The content of a lost task's step."""
LOST_STATUS: Final = TaskStatus.LOST.value
"""A lost task's ``detail.task_status`` (the others are the server's: ``working``, ``completed``, ``cancelled``…)."""


@dataclass(frozen=True, slots=True)
class TaskHandle:
    """What a worker needs to poll a task another worker started: kept in the run's record as JSON."""

    server: str
    task_id: str
    session_id: str
    protocol: str

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> TaskHandle | None:
        """The handle ``text`` holds; None for anything else (a record no worker of this version wrote)."""
        try:
            data = json.loads(text)
            return cls(**{name: str(data[name]) for name in ("server", "task_id", "session_id", "protocol")})
        except (ValueError, TypeError, KeyError):
            return None


class TaskRecords(Protocol):
    """Where a run keeps the tasks of its calls in flight (the runtime's hooks, worker/runtime.py)."""

    async def keep_task(self, call_id: str, task: str | None) -> None:
        """Record the task of ``call_id`` (None: forget it), owner-guarded and durably."""

    async def task_of(self, call_id: str) -> str | None:
        """The task recorded for ``call_id``, None when there is none."""

    @property
    def leaves_tasks_running(self) -> bool:
        """The run's calls are cut off because the worker hands the run over (or lost it), not by a cancel or a
        steer: a task in flight is left running for the next worker, never cancelled."""


class TaskRpc:
    """Plain JSON-RPC requests to an HTTP server's tasks (the module docstring says why not the SDK's): in the MCP
    session ``session_id`` (2025-11-25), or, over the 2026-07-28 extension, each with the request envelope the
    revision asks (protocol version, client capabilities declaring the extension) and the ``Mcp-Method`` and
    ``Mcp-Name`` headers. Each request is an HTTP exchange of its own: one that breaks fails only itself, and a
    ``tasks/get`` is tried once more (it changes nothing)."""

    def __init__(self, connection: McpConnection, session_id: str, protocol: str) -> None:
        session = connection.session
        if session is None or session.http_client is None:
            raise ValueError(f"MCP server {connection.server!r} is not over HTTP or not connected: its tasks cannot "
                             "be polled")
        self._server = connection.server
        self._url = session.url
        self._http = session.http_client
        self._headers = {"accept": "application/json, text/event-stream", "content-type": "application/json",
                         **({"mcp-session-id": session_id} if session_id else {}),
                         **({"mcp-protocol-version": protocol} if protocol else {})}
        self._envelope = _envelope(protocol) if uses_extension(protocol) else None
        self._next_id = 0

    async def request(self, method: str, params: Mapping[str, Any]) -> dict[str, Any]:
        """The result of ``method``.

        Raises:
            TaskUnknown: the server does not know the session or the task.
            ToolTransportError: anything else went wrong (the server's error, the HTTP exchange, the answer).
        """
        body, headers = self._request(method, params)
        for tries_left in reversed(range(2 if method == "tasks/get" else 1)):
            try:
                async with self._http.stream("POST", self._url, json=body, headers=headers) as response:
                    if response.status_code in (400, 404):
                        text = (await response.aread()).decode(errors="replace")
                        raise self._error(method, f"HTTP {response.status_code}: {text[:300]}")
                    response.raise_for_status()
                    message = await _answer(response, str(body["id"]))
                break
            except httpx2.TransportError as exc:
                if tries_left:
                    log.info("mcp_task_request_again", server=self._server, method=method, error=repr(exc))
                    continue
                raise ToolTransportError(f"MCP server {self._server!r}: {method} failed: {exc!r}",
                                         server=self._server) from exc
            except httpx2.HTTPError as exc:
                raise ToolTransportError(f"MCP server {self._server!r}: {method} failed: {exc}",
                                         server=self._server) from exc
        error = message.get("error")
        if isinstance(error, dict):
            raise self._error(method, f"{error.get('code')}: {error.get('message')}")
        result = message.get("result")
        if not isinstance(result, dict):
            raise ToolTransportError(f"MCP server {self._server!r}: {method} answered no result", server=self._server)
        return result

    def _request(self, method: str, params: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
        """The JSON-RPC body of ``method`` and the HTTP headers it goes with."""
        self._next_id += 1
        fields = dict(params) if self._envelope is None else {**params, "_meta": self._envelope}
        body = {"jsonrpc": "2.0", "id": f"runbrake-task-{self._next_id}", "method": method, "params": fields}
        if self._envelope is None:
            return body, self._headers
        task_id = params.get("taskId")
        # SEP-2663, "Streamable HTTP: Routing Headers": Mcp-Name is the task's id on tasks/*.
        return body, {**self._headers, "mcp-method": method, **({"mcp-name": task_id} if task_id else {})}

    def _error(self, method: str, what: str) -> ToolTransportError:
        return _failure(f"MCP server {self._server!r}: {method}: {what}", self._server)


def _envelope(protocol: str) -> dict[str, Any]:
    """The ``_meta`` keys every request of a 2026-07-28 client carries, the tasks extension declared in its
    capabilities (SEP-2663, "Capability Negotiation")."""
    return {PROTOCOL_VERSION_META_KEY: protocol, CLIENT_INFO_META_KEY: {"name": "runbrake", "version": _VERSION},
            CLIENT_CAPABILITIES_META_KEY: {"extensions": {TASKS_EXTENSION: {}}}}


def _failure(text: str, server: str) -> ToolTransportError:
    """The error ``text`` says: :class:`~shared.errors.TaskUnknown` when it is a server's word for a task or session
    it does not know (:data:`_TASK_NOT_FOUND`), else a transport error."""
    kind = TaskUnknown if any(words in text.lower() for words in _TASK_NOT_FOUND) else ToolTransportError
    return kind(text, server=server)


async def _answer(response: httpx2.Response, request_id: str) -> dict[str, Any]:
    """The JSON-RPC message answering ``request_id``: the JSON body, or the event of an event stream that holds it;
    read within :data:`~worker.mcp_transport.MAX_MESSAGE_BYTES`."""
    if not response.headers.get("content-type", "").startswith("text/event-stream"):
        return _message(await response.aread())
    data: list[str] = []
    read = 0
    async for line in response.aiter_lines():
        read += len(line) + 1
        if read > MAX_MESSAGE_BYTES:
            raise ToolTransportError(f"an MCP task answer past {MAX_MESSAGE_BYTES} bytes")
        if line.startswith("data:"):
            data.append(line[5:].strip())
        elif not line and data:
            message = _message("\n".join(data).encode())
            data = []
            if message.get("id") == request_id:
                return message
    raise ToolTransportError("the MCP server's event stream ended without the answer")


def _message(raw: bytes) -> dict[str, Any]:
    try:
        message = json.loads(raw) if raw.strip() else {}
    except ValueError as exc:
        raise ToolTransportError(f"an MCP task answer that is not JSON: {exc}") from exc
    return message if isinstance(message, dict) else {}


@dataclass
class _Task:
    """One task being waited on: its handle, the last status the server gave, how often to poll, and the server's
    last word on it (a ``Task`` object; the extension's carries the result or error once the task ended)."""

    handle: TaskHandle
    status: str = "working"
    message: str = ""
    poll_s: float = 1.0
    last: Mapping[str, Any] | None = None

    def seen(self, task: Mapping[str, Any]) -> bool:
        """Take the server's view of the task (a ``Task`` object); True when its status or message changed."""
        status, message = str(task.get("status") or self.status), str(task.get("statusMessage") or "")
        # 2025-11-25 says pollInterval, the extension pollIntervalMs: milliseconds both.
        interval = task.get("pollIntervalMs", task.get("pollInterval"))
        if isinstance(interval, int | float) and interval > 0:
            self.poll_s = min(max(interval / 1000, _POLL_S[0]), _POLL_S[1])
        changed = (status, message) != (self.status, self.message)
        self.status, self.message, self.last = status, message, task
        return changed


def uses_extension(protocol: str) -> bool:
    """Whether a task of a connection of ``protocol`` is one of the 2026-07-28 tasks extension (else 2025-11-25)."""
    return protocol in MODERN_PROTOCOL_VERSIONS


class _Wire(Protocol):
    """The requests of one revision's tasks, once a task exists."""

    async def get(self, task: _Task) -> Mapping[str, Any]:
        """The server's ``Task`` now (``tasks/get``)."""

    async def cancel(self, task: _Task) -> Mapping[str, Any] | None:
        """``tasks/cancel``: the ``Task`` the server answered, or None when it only acknowledged the cancel."""

    async def result(self, task: _Task) -> Mapping[str, Any]:
        """The ``CallToolResult`` of a task that ended ``completed`` or ``failed`` (raises for a failed one that
        says its error)."""


class _SessionWire:
    """Protocol 2025-11-25: plain JSON-RPC in the task's MCP session (:class:`TaskRpc`)."""

    def __init__(self, rpc: TaskRpc) -> None:
        self._rpc = rpc

    async def get(self, task: _Task) -> Mapping[str, Any]:
        return await self._rpc.request("tasks/get", {"taskId": task.handle.task_id})

    async def cancel(self, task: _Task) -> Mapping[str, Any] | None:
        # "The receiver MUST transition the task to cancelled status before sending the response" (2025-11-25).
        return await self._rpc.request("tasks/cancel", {"taskId": task.handle.task_id})

    async def result(self, task: _Task) -> Mapping[str, Any]:
        return await self._rpc.request("tasks/result", {"taskId": task.handle.task_id})


class _ExtensionWire:
    """The 2026-07-28 tasks extension: plain JSON-RPC with the revision's envelope (:class:`TaskRpc`); the result is
    in the last ``tasks/get`` answer (SEP-2663, "Task Polling"), and ``tasks/cancel`` is only acknowledged."""

    def __init__(self, rpc: TaskRpc, server: str) -> None:
        self._rpc = rpc
        self._server = server

    async def get(self, task: _Task) -> Mapping[str, Any]:
        return await self._rpc.request("tasks/get", {"taskId": task.handle.task_id})

    async def cancel(self, task: _Task) -> Mapping[str, Any] | None:
        # An acknowledgement only: "the task's observable status MAY remain working … after the ack".
        await self._rpc.request("tasks/cancel", {"taskId": task.handle.task_id})
        return None

    async def result(self, task: _Task) -> Mapping[str, Any]:
        last = task.last or {}
        result = last.get("result")
        if task.status == "completed" and isinstance(result, dict):
            return result
        error = last.get("error")
        what = f"{error.get('code')}: {error.get('message')}" if isinstance(error, dict) else "no error given"
        raise ToolTransportError(f"MCP server {self._server!r}: its task {task.handle.task_id} {task.status} "
                                 f"({what})", server=self._server)


async def call_as_task(
    connection: McpConnection,
    call: ToolCall,
    records: TaskRecords,
    *,
    timeout_s: float,
    interrupt: anyio.CancelScope,
    progress: ProgressFnT | None,
    lost: Callable[[ToolCall], OnWorkerLost],
    answer: Callable[[CallToolResult], ToolResult],
) -> ToolResult:
    """Make ``call`` as a task of ``connection``'s server, or poll the task the run recorded for it, and say what it
    came to (not yet scrubbed nor bounded: worker/mcp_tool.py does both). Over the 2026-07-28 extension the server
    may answer the call at once, without a task: that answer is the result.

    Args:
        records: where the task is recorded before anything waits on it.
        timeout_s: how long the task may take, from this worker's first request; past it the task is cancelled.
        interrupt: the call's scope (worker/loop.py): cancelled, it stops the wait (the module docstring says what
            becomes of the task).
        progress: told each status change (and, over the extension, the MCP progress of the call).
        lost: the call's ``on_worker_lost``, for a task the server no longer knows.
        answer: what a ``CallToolResult`` came to.

    Raises:
        CallHandedOver: a hand-over stopped the wait; the task runs on, for the next worker.
        LostCallFails: the server no longer knows the task and ``lost`` says ``fail`` (the lost result with it).
    """
    recorded = await records.task_of(call.id)
    handle = None if recorded is None else TaskHandle.from_json(recorded)
    if handle is not None and handle.server != connection.server:
        handle = None
    waiting = _Waiting(connection, call, records, progress, answer)
    fails = False
    try:
        result = await waiting.run(handle, timeout_s, interrupt)
    except TaskUnknown as exc:
        if handle is None:  # not a task this run recorded before: an error of the call, not a lost task
            result = waiting.stamped(ToolResult.error(str(exc)))
        else:
            log.warning("mcp_task_lost", server=call.server, tool=call.tool, task_id=handle.task_id, error=str(exc))
            if lost(call) is OnWorkerLost.RETRY:  # made again, once, as a lost worker's call is
                await records.keep_task(call.id, None)
                return await call_as_task(connection, call, records, timeout_s=timeout_s, interrupt=interrupt,
                                          progress=progress, lost=lambda _call: OnWorkerLost.REPORT, answer=answer)
            result = replace(ToolResult.cancelled(LOST), task=(handle.task_id, LOST_STATUS))
            fails = lost(call) is OnWorkerLost.FAIL
    except ToolArgumentsRefused as exc:
        result = ToolResult.error(str(exc), failure=Failure.ARGUMENTS)
    except ToolTransportError as exc:
        result = waiting.stamped(ToolResult.error(str(exc)))
    if handle is not None or waiting.recorded:
        # Forgotten once the call has its result, whatever it came to: a later call of the same id starts afresh.
        await records.keep_task(call.id, None)
    if fails:
        assert handle is not None  # only a recorded task is lost
        raise LostCallFails(f"the MCP task {handle.task_id} of {call.qualified_name}, left running by a worker that "
                            f"was lost, is no longer known to its server, and the tool's catalog entry says "
                            f"on_worker_lost = \"fail\": a person must look at it", result)
    return result


@dataclass
class _Waiting:
    """The wait of one call on its task (:func:`call_as_task`)."""

    _connection: McpConnection
    _call: ToolCall
    _records: TaskRecords
    _progress: ProgressFnT | None
    _answer: Callable[[CallToolResult], ToolResult]
    _task: _Task | None = None
    _wire: _Wire | None = None
    _sent: bool = False
    """Whether the ``tools/call`` may have reached the server."""
    _at_once: CallToolResult | None = None
    """The extension server's answer to a call it made no task of."""
    recorded: bool = False
    """Whether this wait recorded a task in the run's record."""

    async def run(self, handle: TaskHandle | None, timeout_s: float, interrupt: anyio.CancelScope) -> ToolResult:
        with interrupt, anyio.move_on_after(timeout_s) as deadline:
            if handle is None:
                await anyio.lowlevel.checkpoint()  # a scope cancelled already: nothing is sent
                await self._start(timeout_s)
            else:
                self._attach(handle)
            if self._at_once is None:
                await self._until_ended()
        if self._at_once is not None:
            return self._answer(self._at_once)
        task = self._task
        if task is None:  # stopped before the server answered the call: it may have started a task, or not
            if interrupt.cancel_called:
                return ToolResult.cancelled(f"call to {self._call.server}.{self._call.tool} was cancelled",
                                            sent=self._sent)
            return ToolResult.error(f"call to {self._call.server}.{self._call.tool} timed out after {timeout_s:g} s")
        if task.status in TERMINAL:
            return await self._ended(task)
        if interrupt.cancel_called and self._records.leaves_tasks_running:
            if self._connection.session is not None and task.handle.session_id:
                self._connection.session.keep(task.handle.session_id)  # it (and its task) outlive this connection
            log.info("mcp_task_handed_over", server=self._call.server, tool=self._call.tool,
                     task_id=task.handle.task_id)
            raise CallHandedOver(self._call.id)
        if task.status == "input_required":
            why = ("the task asked for input (input_required); runbrake answers no input request of a server, "
                   "so it was cancelled")
        elif deadline.cancelled_caught and not interrupt.cancel_called:
            why = f"the task did not end within {timeout_s:g} s, so it was cancelled"
        else:
            why = ""
        with anyio.CancelScope(shield=True), anyio.move_on_after(_CANCEL_WITHIN_S):
            await self._cancel(task)
        if task.status in ("completed", "failed"):  # it ended before the cancel reached it: its real result
            return await self._ended(task)
        if why:
            return self.stamped(ToolResult.error(why))
        return self.stamped(ToolResult.cancelled(
            f"call to {self._call.server}.{self._call.tool} was cancelled (its MCP task: {task.status})"))

    async def _start(self, timeout_s: float) -> None:
        """Make the call: as a task of the session (2025-11-25), or declaring the extension, which may answer at
        once (:attr:`_at_once`) or with a task."""
        if self._connection.offers_task_extension:
            self._sent = True
            # The call's own scope is never cancelled: the outer one (the interrupt, the deadline) cuts it off.
            answer = await self._connection.call(self._call.tool, self._call.arguments, timeout_s=timeout_s,
                                                 interrupt=anyio.CancelScope(), progress=self._progress)
            if isinstance(answer, CallToolResult):
                self._at_once = answer
                return
            rpc = TaskRpc(self._connection, "", self._connection.protocol_version)
            await self._created(answer, session_id="", wire=_ExtensionWire(rpc, self._call.server))
            return
        session = self._connection.session
        if session is None or not session.session_id:
            raise ToolTransportError(f"MCP server {self._call.server!r} gave no MCP session: its tasks cannot be "
                                     "handed over", server=self._call.server, tool=self._call.tool)
        rpc = TaskRpc(self._connection, session.session_id, self._connection.protocol_version)
        self._sent = True
        created = await rpc.request("tools/call", {"name": self._call.tool, "arguments": dict(self._call.arguments),
                                                   "task": {"ttl": math.ceil(timeout_s * 1000)}})
        task = created.get("task")
        if not isinstance(task, dict):
            raise ToolTransportError(f"MCP server {self._call.server!r} answered a task call without a task",
                                     server=self._call.server, tool=self._call.tool)
        await self._created(TaskStarted(task), session_id=session.session_id, wire=_SessionWire(rpc))

    async def _created(self, started: TaskStarted, *, session_id: str, wire: _Wire) -> None:
        task_id = started.task.get("taskId")
        if not isinstance(task_id, str) or not task_id:
            raise ToolTransportError(f"MCP server {self._call.server!r} answered with a task without a taskId",
                                     server=self._call.server, tool=self._call.tool)
        handle = TaskHandle(self._call.server, task_id, session_id, self._connection.protocol_version)
        # Recorded before anything waits on it, and whole: a cancel now must not leave the task unrecorded.
        with anyio.CancelScope(shield=True):
            await self._records.keep_task(self._call.id, handle.to_json())
            self.recorded = True
            self._wire = wire
            self._task = _Task(handle)
            await self._seen(started.task)

    async def cancel_attached(self, handle: TaskHandle) -> str:
        """Take up ``handle`` only to cancel it (:func:`cancel_left`); the status the server gave it after."""
        self._attach(handle)
        assert self._task is not None
        await self._cancel(self._task)
        return self._task.status

    def _attach(self, handle: TaskHandle) -> None:
        rpc = TaskRpc(self._connection, handle.session_id, handle.protocol)
        if uses_extension(handle.protocol):
            self._wire = _ExtensionWire(rpc, handle.server)
        else:
            self._wire = _SessionWire(rpc)
            if self._connection.session is not None:
                self._connection.session.adopt(handle.session_id)  # ended with this connection once its task is
        self._task = _Task(handle)
        log.info("mcp_task_reattached", server=handle.server, tool=self._call.tool, task_id=handle.task_id)

    async def _until_ended(self) -> None:
        task, wire = self._task, self._wire
        assert task is not None
        assert wire is not None
        while task.status not in TERMINAL and task.status != "input_required":
            if task.last is not None:  # the task as the call answered it: polled after its interval
                await anyio.sleep(task.poll_s)
            await self._seen(await wire.get(task))

    async def _seen(self, answer: Mapping[str, Any]) -> None:
        task = self._task
        assert task is not None
        if task.seen(answer) and self._progress is not None:
            await self._progress(0, None, f"task {task.status}" + (f": {task.message}" if task.message else ""))

    async def _cancel(self, task: _Task) -> None:
        """``tasks/cancel``, then the status the server gives: in its answer (2025-11-25), or polled until the task
        ended (the extension's cancel is only acknowledged). A task that ended meanwhile may refuse the cancel: its
        status is read again."""
        assert self._wire is not None
        try:
            answer = await self._wire.cancel(task)
        except TaskUnknown:
            raise
        except ToolTransportError as exc:
            log.info("mcp_task_cancel_refused", server=self._call.server, task_id=task.handle.task_id, error=str(exc))
            answer = None
        if answer is not None:
            await self._seen(answer)
            return
        await self._seen(await self._wire.get(task))
        while task.status not in TERMINAL:
            await anyio.sleep(min(task.poll_s, _CANCEL_POLL_S))
            await self._seen(await self._wire.get(task))

    async def _ended(self, task: _Task) -> ToolResult:
        if task.status == "cancelled":
            return self.stamped(ToolResult.cancelled(
                f"call to {self._call.server}.{self._call.tool} was cancelled by its server (its MCP task: "
                "cancelled)"))
        assert self._wire is not None
        with anyio.CancelScope(shield=True), anyio.move_on_after(_CANCEL_WITHIN_S) as late:
            payload = await self._wire.result(task)
        if late.cancelled_caught:
            raise ToolTransportError(f"MCP server {self._call.server!r}: tasks/result took over "
                                     f"{_CANCEL_WITHIN_S:g} s", server=self._call.server, tool=self._call.tool)
        try:
            result = CallToolResult.model_validate(payload)
        except ValidationError as exc:
            raise ToolTransportError(f"MCP server {self._call.server!r}: the task's result is no tool result: {exc}",
                                     server=self._call.server, tool=self._call.tool) from exc
        return self.stamped(self._answer(result))

    def stamped(self, result: ToolResult) -> ToolResult:
        """``result`` with the task's id and last status, once there is a task."""
        task = self._task
        return result if task is None else replace(result, task=(task.handle.task_id, task.status))


async def cancel_left(servers: Mapping[str, McpServerSpec], tasks: Mapping[str, str]) -> int:
    """Send ``tasks/cancel`` to each task in ``tasks`` (a run's records by call id, :class:`TaskHandle` JSON) on its
    server of ``servers``: the tasks a hand-over or a lost worker left running of a run a cancel ended before any
    worker took it up again, which no call of the run will ever poll. A 2025-11-25 task's kept session is ended
    with it. Says how many tasks the servers took the cancel of; a failure is logged, not raised (the run is ended).
    """
    handles = [handle for handle in map(TaskHandle.from_json, tasks.values()) if handle is not None]
    cancelled = 0
    for server in sorted({handle.server for handle in handles}):
        spec = servers.get(server)
        if spec is None:
            log.warning("mcp_task_left_running", server=server, why="the run no longer names the server")
            continue
        with anyio.move_on_after(_CANCEL_WITHIN_S):
            try:
                async with McpConnection.open(spec) as connection:
                    for handle in (h for h in handles if h.server == server):
                        cancelled += await _cancel_one(connection, handle)
            except ToolTransportError as exc:
                log.warning("mcp_task_left_running", server=server, why=str(exc))
    return cancelled


async def _cancel_one(connection: McpConnection, handle: TaskHandle) -> int:
    waiting = _Waiting(connection, ToolCall(id="", server=handle.server, tool="", arguments={}), _Unrecorded(), None,
                       _no_answer)
    try:
        status = await waiting.cancel_attached(handle)
    except ToolTransportError as exc:
        log.warning("mcp_task_left_running", server=handle.server, task_id=handle.task_id, why=str(exc))
        return 0
    log.info("mcp_task_cancelled_left", server=handle.server, task_id=handle.task_id, task_status=status)
    return 1


def _no_answer(_answer: CallToolResult) -> ToolResult:
    """The answer of a wait that only cancels: never asked for."""
    raise AssertionError("a task taken up only to cancel it has no answer to make")


class _Unrecorded:
    """The records of a wait that only cancels a task (:func:`cancel_left`): nothing to record."""

    leaves_tasks_running = False

    async def keep_task(self, call_id: str, task: str | None) -> None:
        return None

    async def task_of(self, call_id: str) -> str | None:
        return None
