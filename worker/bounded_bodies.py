"""Response bodies read within a bound of bytes: what an endpoint that may be hostile (a model endpoint, an MCP
server) can make the worker hold in memory (docs/security.md, "Bounds").

:func:`bound_bodies` is an httpx2 response hook: installed on a client (``event_hooks={"response": [...]}``), it
wraps each response's body, before a byte of it is read, in a stream that counts the bytes as they come and
raises :class:`ResponseTooLarge` past the bound; the rest is never read and the connection is closed. A
compressed body is counted as it decodes (the response then reads it as the identity encoding), so a small
gzip bomb does not get past the count. Wherever the body is read (``aread`` inside an SDK, a stream read
chunk by chunk), the count is the same. A body whose ``Content-Length`` is within the bound and that is not
encoded is left as it is: HTTP/1.1 reads no more than that.

:class:`ResponseTooLarge` is an ``httpx2.StreamError`` too, because that is what the MCP SDK's streamable HTTP
client catches around a JSON answer (``_handle_json_response``): there it resolves the call with a JSON-RPC
error naming the bound, so the call fails, not the connection.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import httpx2

from runbrake.shared.errors import RunbrakeError

__all__ = ["ResponseTooLarge", "bound_bodies"]

class ResponseTooLarge(RunbrakeError, httpx2.StreamError):
    """Raised when a response body runs past its bound while it is read; nothing past the bound is read."""

    def __init__(self, message: str) -> None:
        super().__init__(message)


def bound_bodies(max_bytes: int, *, what: str, event_streams: bool = True) -> Callable[[httpx2.Response],
                                                                                       Awaitable[None]]:
    """An httpx2 ``response`` event hook bounding every response body at ``max_bytes`` (decoded).

    Args:
        max_bytes: the most bytes one body may have.
        what: what the body is, in words for the error (``"the MCP server's answer"``).
        event_streams: whether ``text/event-stream`` bodies are bounded too; a long-lived stream of events
            whose reader bounds each event (the MCP SDK does) passes unbounded when false.
    """

    async def hook(response: httpx2.Response) -> None:
        if not event_streams and _is_event_stream(response):
            return
        if _declared_within(response, max_bytes):
            return
        raw = response.stream
        assert isinstance(raw, httpx2.AsyncByteStream)
        # Decoded here, counted as decoded: the response itself then reads the identity encoding.
        decoding = httpx2.Response(response.status_code, headers=response.headers, stream=raw,
                                   request=response.request)
        if "content-encoding" in response.headers:
            del response.headers["content-encoding"]
            response.headers.pop("content-length", None)  # the encoded length: not the body's any more
        response.stream = _BoundedBody(decoding, max_bytes, what)

    return hook


def _declared_within(response: httpx2.Response, max_bytes: int) -> bool:
    """Whether the body is framed by a ``Content-Length`` within the bound and not encoded: HTTP/1.1 then reads
    exactly that many bytes (h11 ends the body there), so there is nothing to count. Skipping the count saves a
    second response's iteration of every small JSON answer (bench/overhead.py's profile: 0.6 ms of CPU a run)."""
    length = response.headers.get("content-length")
    return ("content-encoding" not in response.headers and length is not None and length.isdigit()
            and int(length) <= max_bytes)


def _is_event_stream(response: httpx2.Response) -> bool:
    return response.headers.get("content-type", "").split(";")[0].strip().lower() == "text/event-stream"


class _BoundedBody(httpx2.AsyncByteStream):
    """A response's decoded body, raising :class:`ResponseTooLarge` once more than ``max_bytes`` came."""

    def __init__(self, source: httpx2.Response, max_bytes: int, what: str) -> None:
        self._source = source
        self._max_bytes = max_bytes
        self._what = what

    async def __aiter__(self) -> AsyncIterator[bytes]:
        total = 0
        # httpx2's decoders hand a compressed body out in pieces of at most 1 MiB (MAX_DECODE_CHUNK_SIZE).
        async for chunk in self._source.aiter_bytes():
            total += len(chunk)
            if total > self._max_bytes:
                raise ResponseTooLarge(f"{self._what} exceeded {self._max_bytes} bytes; the rest was not read")
            yield chunk

    async def aclose(self) -> None:
        await self._source.aclose()
