"""Streamed model answers read off the wire: server-sent events, bounded, assembled into the answer the
non-streaming request gives (docs/cancellation.md, "Streaming").

:func:`sse_events` reads the body of a ``text/event-stream`` response into ``(event, data)`` pairs, refusing
a line longer than :data:`MAX_LINE_BYTES` and a body past :data:`MAX_STREAM_BYTES` (an endpoint may be
hostile, docs/security.md). :class:`ChatCompletionAssembly` (OpenAI chat-completion chunks) and
:class:`MessageAssembly` (Anthropic Messages events) fold the events into the JSON body a non-streaming
request answers with, so that the providers map both through the same code (``_turn``), and hand each piece
of text to the call's :class:`~worker.deltas.StreamedText` as it arrives. Whatever breaks once the stream
has begun is a :class:`MidStream` error: the providers raise it as a :class:`~shared.errors.ProviderError`
that is not retried, never as a partial answer taken for a whole one.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping
from typing import Any, Final, Protocol

import httpx2

from runbrake.shared.errors import ProviderError
from runbrake.worker.deltas import StreamedText

__all__ = ["MAX_LINE_BYTES", "MAX_STREAM_BYTES", "Assembly", "ChatCompletionAssembly", "MessageAssembly",
           "MidStream", "is_event_stream", "read_answer", "sse_events"]

MAX_STREAM_BYTES: Final = 16 * 1024 * 1024
"""The most bytes one streamed answer may take (the text, the tool calls' arguments and the framing)."""
MAX_LINE_BYTES: Final = 4 * 1024 * 1024
"""The longest line of the stream (one event's ``data``)."""


class MidStream(ProviderError):
    """Raised when a streamed answer breaks after it began: not retried (its text may have been shown)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)


def is_event_stream(content_type: str | None) -> bool:
    """Whether a response is a stream of server-sent events (an endpoint may ignore ``stream`` and answer whole)."""
    return (content_type or "").split(";")[0].strip().lower() == "text/event-stream"


async def sse_events(chunks: AsyncIterator[bytes]) -> AsyncIterator[tuple[str, str]]:
    """The ``(event, data)`` of each server-sent event (the WHATWG event-stream format: ``data`` lines
    joined with newlines, comments and other fields skipped, ``event`` "" where none was named). Lines end
    with LF or CRLF (a lone CR, which no model endpoint sends, is not read as a line's end).

    Raises:
        MidStream: for a line or a stream past its bound, or a body that is not UTF-8.
    """
    total = 0
    partial: list[bytes] = []  # the line being read, in the pieces it came in (no quadratic joining)
    partial_bytes = 0
    event, data = "", list[str]()
    async for chunk in chunks:
        total += len(chunk)
        if total > MAX_STREAM_BYTES:
            raise MidStream(f"the streamed answer exceeded {MAX_STREAM_BYTES} bytes")
        *ended, rest = chunk.split(b"\n")
        if ended:
            ended[0] = b"".join((*partial, ended[0]))
            partial, partial_bytes = [], 0
        if rest:
            partial.append(rest)
            partial_bytes += len(rest)
            if partial_bytes > MAX_LINE_BYTES:
                raise MidStream(f"a line of the streamed answer exceeded {MAX_LINE_BYTES} bytes")
        for raw in ended:
            if len(raw) > MAX_LINE_BYTES:
                raise MidStream(f"a line of the streamed answer exceeded {MAX_LINE_BYTES} bytes")
            try:
                line = raw.removesuffix(b"\r").decode()
            except UnicodeDecodeError as exc:
                raise MidStream("the streamed answer is not UTF-8") from exc
            if not line:
                if data:
                    yield event, "\n".join(data)
                event, data = "", list[str]()
                continue
            name, _, value = line.partition(":")
            value = value.removeprefix(" ")
            if name == "data":
                data.append(value)
            elif name == "event":
                event = value
    if data:
        yield event, "\n".join(data)


def _json_object(data: str) -> dict[str, Any]:
    try:
        value = json.loads(data)
    except ValueError as exc:
        raise MidStream(f"the streamed answer sent an event that is not JSON: {data[:200]!r}") from exc
    if not isinstance(value, dict):
        raise MidStream(f"the streamed answer sent an event that is not an object: {data[:200]!r}")
    return value


class ChatCompletionAssembly:
    """An OpenAI chat-completions stream (``chat.completion.chunk`` objects, then ``[DONE]``) folded into a
    ``chat.completion``: the first choice's text and tool calls (their ``arguments`` joined by ``index``), the
    usage the last chunk carries (``stream_options.include_usage``)."""

    def __init__(self, text: StreamedText | None) -> None:
        self._text = text
        self._content: list[str] = []
        self._calls: dict[int, dict[str, Any]] = {}
        self._arguments: dict[int, list[str]] = {}
        self._usage: Any = None
        self._finish: Any = None
        self._head: dict[str, Any] = {}
        self.done = False
        self.began = False
        """An event was read: an error from now on is :class:`MidStream`."""

    def feed(self, event: str, data: str) -> None:
        """One event's ``data`` (chat completions name no events)."""
        self.began = True
        if data.strip() == "[DONE]":
            self.done = True
            return
        chunk = _json_object(data)
        if "error" in chunk:
            raise MidStream(f"the model's stream ended with an error: {str(chunk['error'])[:300]}")
        if not self._head:
            self._head = {k: chunk[k] for k in ("id", "created", "model") if k in chunk}
        if chunk.get("usage") is not None:
            self._usage = chunk["usage"]
        choices = chunk.get("choices")
        if not isinstance(choices, list):
            return
        for choice in choices:
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue  # runbrake asks for one choice (n is never sent)
            if choice.get("finish_reason") is not None:
                self._finish = choice["finish_reason"]
            delta = choice.get("delta")
            if isinstance(delta, dict):
                self._delta(delta)

    def _delta(self, delta: dict[str, Any]) -> None:
        piece = delta.get("content")
        if isinstance(piece, str) and piece:
            self._content.append(piece)
            if self._text is not None:
                self._text.append(piece)
        calls = delta.get("tool_calls")
        if not isinstance(calls, list):
            return
        for call in calls:
            index = call.get("index") if isinstance(call, dict) else None
            if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < _MAX_CALLS:
                raise MidStream(f"the streamed answer sent a malformed tool call: {call!r:.200}")
            known = self._calls.setdefault(index, {"type": "function", "function": {}})
            if isinstance(call.get("id"), str):
                known["id"] = call["id"]
            function = call.get("function")
            if isinstance(function, dict):
                if isinstance(function.get("name"), str):
                    known["function"]["name"] = known["function"].get("name", "") + function["name"]
                if isinstance(function.get("arguments"), str):
                    self._arguments.setdefault(index, []).append(function["arguments"])

    def result(self) -> dict[str, Any]:
        """The ``chat.completion`` the stream came to.

        Raises:
            MidStream: when the stream ended before ``[DONE]`` (the connection closed early).
        """
        if not self.done:
            raise MidStream("the streamed answer ended before it was complete")
        calls = []
        for index in sorted(self._calls):
            call = self._calls[index]
            call["function"]["arguments"] = "".join(self._arguments.get(index, []))
            calls.append(call)
        message: dict[str, Any] = {"role": "assistant", "content": "".join(self._content) if self._content else None}
        if calls:
            message["tool_calls"] = calls
        return {**self._head, "object": "chat.completion", "usage": self._usage,
                "choices": [{"index": 0, "message": message, "finish_reason": self._finish}]}


_MAX_CALLS: Final = 10_000
"""A tool call's ``index`` beyond this is no index (the loop bounds a turn's calls far lower)."""


class MessageAssembly:
    """An Anthropic Messages stream (``message_start``, content blocks with their deltas, ``message_delta``,
    ``message_stop``) folded into a ``message``: text blocks joined, each ``tool_use`` block's
    ``input_json_delta`` pieces read as its ``input``, the usage of ``message_start`` updated by
    ``message_delta``'s."""

    def __init__(self, text: StreamedText | None) -> None:
        self._text = text
        self._message: dict[str, Any] | None = None
        self._blocks: dict[int, dict[str, Any]] = {}
        self._json: dict[int, list[str]] = {}
        self._texts: dict[int, list[str]] = {}
        self.done = False
        self.began = False

    def feed(self, event: str, data: str) -> None:
        """One event (its ``type`` is read from the data; ``event`` names the same)."""
        self.began = True
        body = _json_object(data)
        kind = body.get("type", event)
        if kind == "error":
            raise MidStream(f"the model's stream ended with an error: {str(body.get('error'))[:300]}")
        if kind == "message_start":
            message = body.get("message")
            if not isinstance(message, dict):
                raise MidStream(f"the streamed answer sent a malformed message_start: {data[:200]!r}")
            self._message = dict(message)
            return
        if self._message is None:
            if kind == "ping":
                return
            raise MidStream(f"the streamed answer sent {kind!r} before message_start")
        index = body.get("index")
        if kind == "content_block_start" and isinstance(index, int) and isinstance(body.get("content_block"), dict):
            self._blocks[index] = dict(body["content_block"])
        elif kind == "content_block_delta" and index in self._blocks and isinstance(body.get("delta"), dict):
            self._delta(index, body["delta"])
        elif kind == "content_block_stop" and index in self._blocks:
            self._stop(index)
        elif kind == "message_delta":
            self._message_delta(body)
        elif kind == "message_stop":
            self.done = True
        # ping, and events this version does not know: nothing to assemble (the API adds event types).

    def _delta(self, index: int, delta: dict[str, Any]) -> None:
        kind = delta.get("type")
        if kind == "text_delta" and isinstance(delta.get("text"), str):
            self._texts.setdefault(index, []).append(delta["text"])
            if self._text is not None:
                self._text.append(delta["text"])
        elif kind == "input_json_delta" and isinstance(delta.get("partial_json"), str):
            self._json.setdefault(index, []).append(delta["partial_json"])

    def _stop(self, index: int) -> None:
        block = self._blocks[index]
        if block.get("type") == "text":
            block["text"] = str(block.get("text") or "") + "".join(self._texts.pop(index, []))
        elif block.get("type") == "tool_use" and index in self._json:
            raw = "".join(self._json.pop(index))
            try:
                block["input"] = json.loads(raw) if raw.strip() else {}
            except ValueError:
                block["input"] = raw  # not an object: the call comes back with a problem (anthropic_provider)

    def _message_delta(self, body: dict[str, Any]) -> None:
        assert self._message is not None
        delta = body.get("delta")
        if isinstance(delta, dict):
            for key in ("stop_reason", "stop_sequence"):
                if key in delta:
                    self._message[key] = delta[key]
        usage = body.get("usage")
        if isinstance(usage, dict):
            known = self._message.get("usage")
            merged = dict(known) if isinstance(known, dict) else {}
            merged.update({k: v for k, v in usage.items() if v is not None})
            self._message["usage"] = merged

    def result(self) -> dict[str, Any]:
        """The ``message`` the stream came to.

        Raises:
            MidStream: when the stream ended before ``message_stop``.
        """
        if not self.done or self._message is None:
            raise MidStream("the streamed answer ended before it was complete")
        for index in list(self._blocks):
            if index in self._texts or index in self._json:
                self._stop(index)  # a block the stream did not close: kept as it came
        return {**self._message, "content": [self._blocks[i] for i in sorted(self._blocks)]}


class Assembly(Protocol):
    """What folds a stream's events into an answer (:class:`ChatCompletionAssembly`, :class:`MessageAssembly`)."""

    began: bool
    done: bool

    def feed(self, event: str, data: str) -> None: ...

    def result(self) -> dict[str, Any]: ...


class _Response(Protocol):
    """The SDKs' streaming response (``with_streaming_response``): its headers and its body's bytes."""

    @property
    def headers(self) -> Mapping[str, str]: ...

    def iter_bytes(self) -> AsyncIterator[bytes]: ...


async def read_answer(response: _Response, assembly: Assembly, *, where: str) -> dict[str, Any]:
    """The answer's JSON body: assembled from the events of a stream, or read whole when the endpoint
    answered at once (a compatible server may ignore ``stream``), either way within :data:`MAX_STREAM_BYTES`.

    Raises:
        ProviderError: a :class:`MidStream` one (not retried) when the answer broke after its first event; a
            transient one (retried) when the connection broke before it; one for a body that is not JSON.
    """
    try:
        if not is_event_stream(response.headers.get("content-type")):
            return await _whole(response.iter_bytes())
        async for event, data in sse_events(response.iter_bytes()):
            assembly.feed(event, data)
            if assembly.done:
                break
        return assembly.result()
    except MidStream as exc:
        raise MidStream(f"{where}: {exc}") from exc
    except httpx2.HTTPError as exc:  # a read of the body failed: the SDK translates only the request's errors
        if assembly.began:
            raise MidStream(f"{where}: the streamed answer broke off: {type(exc).__name__}: {str(exc)[:200]}") from exc
        raise ProviderError(f"{where}: {type(exc).__name__}: {str(exc)[:200]}", transient=True) from exc


async def _whole(chunks: AsyncIterator[bytes]) -> dict[str, Any]:
    parts: list[bytes] = []
    total = 0
    async for chunk in chunks:
        total += len(chunk)
        if total > MAX_STREAM_BYTES:
            raise MidStream(f"the answer exceeded {MAX_STREAM_BYTES} bytes")
        parts.append(chunk)
    try:
        return _json_object(b"".join(parts).decode())
    except (UnicodeDecodeError, MidStream) as exc:
        raise ProviderError(f"the model's answer is not a JSON object: {exc}") from exc
