"""Property-based tests of what a hostile model endpoint or MCP server may answer, dripped or not: every answer
(any status, any headers, any body, whole, cut short, compressed or not, in pieces that come slowly) gives a
turn or a :class:`~shared.errors.ProviderError` (a tool result or a failed call), never another exception, and
no redirect is followed (docs/security.md, "Tested attacks").

The endpoint is tests/hostile_http.py's server on loopback, one for the module, answering each example as
drawn. ``make test`` runs a few derandomised examples (each one real HTTP, some waiting out a deadline);
``make fuzz`` many more.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from typing import Any

import anyio
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runbrake.shared.errors import ProviderError, ToolTransportError
from runbrake.shared.outcome import ToolOutcome
from runbrake.shared.spec import AnthropicModel, HttpServerSpec, OpenAIModel
from runbrake.worker.conversation import Message, ModelSettings, ModelTurn, ToolCall
from runbrake.worker.mcp_tool import execute
from runbrake.worker.mcp_transport import McpConnection
from runbrake.worker.models import RetryPolicy, provider_for
from tests.hostile_http import HostileServer, Pieces, Reply, Request, Whole, mcp_responder
from tests.test_fuzz_inputs import examples

pytestmark = pytest.mark.integration

DEADLINE_S = 0.5
"""The call's ``timeout_s``: a slow drip of pieces outlasts it."""
ELSEWHERE = "/elsewhere"
"""Where a drawn redirect points: the same server, so a redirect followed would show as a request here."""

_OPENAI_ANSWER = {"id": "x", "object": "chat.completion",
                  "choices": [{"index": 0, "message": {"role": "assistant", "content": "hello"},
                               "finish_reason": "stop"}]}
_ANTHROPIC_ANSWER = {"id": "x", "type": "message", "role": "assistant", "content": [{"type": "text", "text": "hi"}],
                     "usage": {"input_tokens": 1, "output_tokens": 1}}
_OPENAI_STREAM = (b'data: {"choices": [{"index": 0, "delta": {"content": "hel"}}]}\n\n'
                  b'data: {"choices": [{"index": 0, "delta": {"content": "lo"}}]}\n\ndata: [DONE]\n\n')
_ANTHROPIC_STREAM = (b'event: message_start\ndata: {"type": "message_start", "message": {"id": "x", "role": '
                     b'"assistant", "content": [], "usage": {"input_tokens": 1, "output_tokens": 0}}}\n\n'
                     b'event: content_block_start\ndata: {"type": "content_block_start", "index": 0, '
                     b'"content_block": {"type": "text", "text": ""}}\n\n'
                     b'event: content_block_delta\ndata: {"type": "content_block_delta", "index": 0, '
                     b'"delta": {"type": "text_delta", "text": "hi"}}\n\n'
                     b'event: message_stop\ndata: {"type": "message_stop"}\n\n')

BODIES = st.one_of(
    st.sampled_from([json.dumps(_OPENAI_ANSWER).encode(), json.dumps(_ANTHROPIC_ANSWER).encode(), _OPENAI_STREAM,
                     _ANTHROPIC_STREAM, b"", b"{", b"[]", b"null", b'{"error": {"message": "no"}}']),
    st.binary(max_size=400),
)
"""Good answers of both APIs, whole and streamed, and anything else."""


@st.composite
def answers(draw: st.DrawFn) -> Pieces:
    """An HTTP answer of any shape, in pieces that may come slowly."""
    status = draw(st.sampled_from([200, 200, 200, 204, 302, 307, 400, 404, 429, 500, 503]))
    body = draw(BODIES)
    headers: list[bytes] = []
    content_type = draw(st.sampled_from([b"application/json", b"text/event-stream", b"text/plain", None]))
    if content_type is not None:
        headers.append(b"content-type: " + content_type)
    encoding = draw(st.sampled_from([None, b"gzip", b"identity", b"br"]))
    if encoding is not None:
        headers.append(b"content-encoding: " + encoding)
        if encoding == b"gzip" and draw(st.booleans()):
            body = gzip.compress(body)
    length = draw(st.sampled_from(["exact", "short", "long", "none"]))
    if length != "none":
        declared = len(body) + {"exact": 0, "short": -1, "long": 100}[length]
        headers.append(b"content-length: " + str(max(declared, 0)).encode())
    if status in (302, 307):
        headers.append(b"location: " + ELSEWHERE.encode())
    headers.extend(draw(st.lists(st.sampled_from([b"x-junk: \xff\xfe", b"transfer-encoding: chunked",
                                                  b"retry-after: 99999999999", b"retry-after: nan"]), max_size=2)))
    cuts = sorted(draw(st.lists(st.integers(0, len(body)), max_size=6)))
    pieces = tuple(body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)], strict=True))
    head = b"\r\n".join([f"HTTP/1.1 {status} Drawn".encode(), *headers, b"", b""])
    return Pieces(head, pieces, every_s=draw(st.sampled_from([0.0, 0.01, 0.2])))


@pytest.fixture(scope="module")
def endpoint() -> Iterator[HostileServer]:
    with HostileServer(lambda request: Whole(500)) as server:
        yield server


async def _ask(spec: OpenAIModel | AnthropicModel) -> ModelTurn | ProviderError:
    provider = provider_for(spec, RetryPolicy(retries=0))
    try:
        return await provider.complete([Message(role="user", content="hi")], [], round_index=0,
                                       settings=ModelSettings(timeout_s=DEADLINE_S))
    except ProviderError as exc:
        return exc


@settings(max_examples=examples(12, 2_000), suppress_health_check=[HealthCheck.function_scoped_fixture],
          deadline=None)
@given(answer=answers(), provider=st.sampled_from(["openai", "anthropic"]), stream=st.booleans())
def test_any_answer_of_a_model_endpoint_dripped_or_not_is_a_turn_or_a_provider_error(
    endpoint: HostileServer, answer: Pieces, provider: str, stream: bool,
) -> None:
    endpoint.respond = lambda request: answer
    spec = (OpenAIModel(base_url=f"{endpoint.url}/v1", model="m", stream=stream) if provider == "openai"
            else AnthropicModel(base_url=endpoint.url, model="m", stream=stream))
    before = len(endpoint.requests)

    outcome = anyio.run(_ask, spec)  # a drip cut off at DEADLINE_S; the per-test timeout is the backstop

    assert isinstance(outcome, ModelTurn | ProviderError)
    asked = [r.path for r in endpoint.requests[before:]]
    assert ELSEWHERE not in asked, "a redirect was followed"


def _tool_answer(answer: Pieces) -> Any:
    def call(request: Request) -> Reply:
        return answer

    return call


@settings(max_examples=examples(8, 1_000), suppress_health_check=[HealthCheck.function_scoped_fixture],
          deadline=None)
@given(answer=answers())
def test_any_answer_of_an_mcp_server_to_a_tool_call_is_a_result_or_a_failed_call(
    endpoint: HostileServer, answer: Pieces,
) -> None:
    endpoint.respond = mcp_responder(_tool_answer(answer))
    spec = HttpServerSpec(name="hostile", url=f"{endpoint.url}/mcp")

    async def call() -> ToolOutcome:
        async with McpConnection.open(spec) as connection:
            result = await execute(connection, ToolCall(id="c1", server="hostile", tool="huge", arguments={}),
                                   timeout_s=DEADLINE_S * 4, interrupt=anyio.CancelScope(), max_chars=16_000)
        return result.outcome

    try:
        outcome: ToolOutcome | ToolTransportError = anyio.run(call)
    except ToolTransportError as exc:  # the connection itself broke: a failed call for the run
        outcome = exc

    assert isinstance(outcome, ToolOutcome | ToolTransportError)
    assert outcome is not ToolOutcome.CANCELLED
