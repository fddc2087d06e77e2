"""A Python client of the HTTP API (docs/http-api.md), over ``httpx2``.

    from runbrake.broker import Client

    with Client("http://127.0.0.1:8080", token="...") as client:
        run = client.enqueue({"input": "...", "model": {...}, "mcp_servers": {...}})
        for event in client.events(run["run_id"]):
            print(event.event, event.data)
        client.cancel(run["run_id"], reason="enough")

Every method answers the API's JSON. An error answer raises :class:`ApiError` with the HTTP status and
the body (``{"error": ..., "errors": [...]}``): the class the API itself answers with (shared/errors.py),
re-exported here. A server that cannot be reached raises ``httpx2.TransportError``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import httpx2

from runbrake.shared.errors import ApiError
from runbrake.shared.spec import RunSpec

__all__ = ["ApiError", "Client", "Event"]


@dataclass(frozen=True, slots=True)
class Event:
    """One server-sent event: ``step``, ``progress``, ``delta``, ``status`` or ``end``; ``id`` is a step's
    sequence."""

    event: str
    data: Any
    id: str | None = None


class Client:
    """The runbrake HTTP API, synchronously. Use as a context manager, or call :meth:`close`."""

    def __init__(self, base_url: str, *, token: str | None = None, timeout_s: float = 30.0,
                 transport: httpx2.BaseTransport | None = None) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx2.Client(base_url=base_url.rstrip("/"), headers=headers,
                                   timeout=httpx2.Timeout(timeout_s), transport=transport)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    # -- runs -------------------------------------------------------------------------------------

    def enqueue(self, spec: Mapping[str, Any] | RunSpec | str | bytes, *,
                idempotency_key: str | None = None) -> dict[str, Any]:
        """Enqueue a run: ``{run_id, status, created}`` (``created`` false for a repeated idempotency key).

        Raises:
            ApiError: 422 naming every invalid field, 409 for a key used with another spec, 413, 401, 403.
        """
        if isinstance(spec, RunSpec):
            body = json.dumps(spec.raw).encode()
        elif isinstance(spec, str | bytes):
            body = spec.encode() if isinstance(spec, str) else spec
        else:
            body = json.dumps(dict(spec)).encode()
        headers = {"Content-Type": "application/json"}
        if idempotency_key is not None:
            headers["Idempotency-Key"] = idempotency_key
        return self._answer(self._http.post("/v1/runs", content=body, headers=headers))  # type: ignore[no-any-return]

    def continue_run(self, run_id: str, input: str, *, idempotency_key: str | None = None,
                     **fields: Any) -> dict[str, Any]:
        """Continue a finished run: a new run that carries on its conversation with ``input`` (``fields``: any
        other run-spec field but messages, replacing the parent's); ``{run_id, status, created}``.

        Raises:
            ApiError: 404 for an unknown run, 409 for one not finished, 422 naming every invalid field, 413.
        """
        headers = {"Content-Type": "application/json"}
        if idempotency_key is not None:
            headers["Idempotency-Key"] = idempotency_key
        body = json.dumps({"input": input, **fields}).encode()
        return self._answer(self._http.post(  # type: ignore[no-any-return]
            f"/v1/runs/{run_id}/continue", content=body, headers=headers))

    def get(self, run_id: str) -> dict[str, Any]:
        """The run and its steps, as ``runbrake show --json`` prints it."""
        return self._answer(self._http.get(f"/v1/runs/{run_id}"))  # type: ignore[no-any-return]

    def runs(self, *, status: str | None = None, labels: Mapping[str, str] | None = None, limit: int = 20,
             cursor: str | None = None, thread: str | None = None) -> dict[str, Any]:
        """One page of runs, newest first: ``{runs: [...], next_cursor}``; only those carrying every one of
        ``labels`` when given. ``thread`` (a run id): the thread it is in instead, oldest first."""
        params: dict[str, Any] = {"limit": limit}
        if thread:
            params["thread"] = thread
        if status:
            params["status"] = status
        if labels:
            params["label"] = [f"{key}:{value}" for key, value in labels.items()]
        if cursor:
            params["cursor"] = cursor
        return self._answer(self._http.get("/v1/runs", params=params))  # type: ignore[no-any-return]

    def cancel(self, run_id: str, *, reason: str | None = None) -> dict[str, Any]:
        """Cancel a run: ``{run_id, cancelled: true, message_confirmed}``; 409 when it already finished."""
        return self._decide(run_id, "cancel", reason)

    def steer(self, run_id: str, text: str, *, reason: str | None = None) -> dict[str, Any]:
        """Steer a run: cut off its current turn and go on with ``text`` as the next user message. Answers
        ``{run_id, steered: true, found, message_confirmed}``; 409 unless it is running or waiting for approval."""
        body = {"input": text} if reason is None else {"input": text, "reason": reason}
        return self._answer(self._http.post(f"/v1/runs/{run_id}/steer", json=body))  # type: ignore[no-any-return]

    def approve(self, run_id: str, *, reason: str | None = None) -> dict[str, Any]:
        """Approve the call a run waits for; 409 when it does not wait."""
        return self._decide(run_id, "approve", reason)

    def deny(self, run_id: str, *, reason: str | None = None) -> dict[str, Any]:
        """Deny the call a run waits for (the run ends failed, approval_denied); 409 when it does not wait."""
        return self._decide(run_id, "deny", reason)

    def events(self, run_id: str, *, last_event_id: int | None = None,
               read_timeout_s: float = 60.0) -> Iterator[Event]:
        """The run's events as they happen (steps replayed first), until the run ends: the stream's last
        events are the terminal ``status`` (with the run's ``output``, ``usage`` and ``error``) and ``end``,
        and the iterator returns right after them. ``last_event_id`` resumes after that step."""
        headers = {"Accept": "text/event-stream"}
        if last_event_id is not None:
            headers["Last-Event-ID"] = str(last_event_id)
        timeout = httpx2.Timeout(30.0, read=read_timeout_s)
        with self._http.stream("GET", f"/v1/runs/{run_id}/events", headers=headers, timeout=timeout) as response:
            if response.status_code >= 400:
                response.read()
                self._answer(response)
            for event in parse_events(response.iter_lines()):
                yield event
                if event.event == "end":
                    return

    def servers(self) -> list[dict[str, Any]]:
        return self._answer(self._http.get("/v1/servers"))  # type: ignore[no-any-return]

    def _decide(self, run_id: str, action: str, reason: str | None) -> dict[str, Any]:
        body = {} if reason is None else {"reason": reason}
        return self._answer(self._http.post(f"/v1/runs/{run_id}/{action}", json=body))  # type: ignore[no-any-return]

    @staticmethod
    def _answer(response: httpx2.Response) -> Any:
        try:
            body = response.json()
        except ValueError:
            body = response.text
        if response.status_code >= 400:
            raise ApiError(response.status_code, body)
        return body


def parse_events(lines: Iterator[str]) -> Iterator[Event]:
    """Server-sent events from the lines of a ``text/event-stream`` body (comments and ``retry`` skipped)."""
    event, event_id = "message", None
    data: list[str] = []
    for line in lines:
        if line == "":
            if data:
                yield Event(event, json.loads("\n".join(data)), event_id)
            event, data, event_id = "message", [], None
            continue
        if line.startswith(":"):
            continue
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "event":
            event = value
        elif name == "data":
            data.append(value)
        elif name == "id":
            event_id = value
    if data:
        yield Event(event, json.loads("\n".join(data)), event_id)
