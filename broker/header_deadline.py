"""uvicorn's HTTP/1.1 protocol with a deadline on a request's headers (docs/http-api.md, "Requests").

uvicorn (0.54, h11) bounds an idle keep-alive connection (``timeout_keep_alive``, armed only after a
response) and the size of an incomplete head (``h11_max_incomplete_event_size``), but not the time a
client takes to send it: a client that sends one header byte every few seconds holds its connection
forever, and a few thousand such clients hold the server (slowloris). This protocol starts a timer
whenever the connection waits for a request (on connect, and after each response) and stops it when
h11 has the whole head; when it fires, the connection is closed, with a ``408`` if part of a request
had arrived. The request's body is the application's to bound (broker/api.py reads it after the
token check, with a size limit).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, ClassVar, Final

import h11
import structlog
from uvicorn.protocols.http.h11_impl import H11Protocol

log = structlog.get_logger(__name__)

_TIMEOUT_BODY: Final = json.dumps({"error": "the request's headers did not arrive in time"}).encode()
_TIMEOUT_ANSWER: Final = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
    b"content-length: " + str(len(_TIMEOUT_BODY)).encode() + b"\r\n\r\n" + _TIMEOUT_BODY
)


class HeaderDeadlineProtocol(H11Protocol):
    """H11Protocol that closes a connection whose request head is not complete ``header_timeout_s``
    seconds after the connection began to wait for it."""

    header_timeout_s: ClassVar[float] = 10.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._track()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._track()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._track()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop()
        super().connection_lost(exc)

    def _track(self) -> None:
        """Run the timer exactly while the connection waits for a request's head."""
        waiting = self.conn.their_state is h11.IDLE and self.conn.our_state is h11.IDLE
        if not waiting or self.transport.is_closing():
            self._stop()
        elif self._header_deadline is None:
            self._header_deadline = self.loop.call_later(self.header_timeout_s, self._expired)

    def _stop(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _expired(self) -> None:
        self._header_deadline = None
        if self.transport.is_closing():
            return
        started, _closed = self.conn.trailing_data
        if started:  # part of a request came: say why it ends (written raw, h11 has no request to answer)
            self.transport.write(_TIMEOUT_ANSWER)
        log.info("api_header_timeout", client=self.client and f"{self.client[0]}:{self.client[1]}",
                 received_bytes=len(started), timeout_s=self.header_timeout_s)
        self.transport.close()


def header_deadline_protocol(timeout_s: float) -> type[HeaderDeadlineProtocol]:
    """The protocol class to pass as uvicorn's ``http``, with this header deadline in seconds."""

    class Bound(HeaderDeadlineProtocol):
        header_timeout_s = timeout_s

    return Bound
