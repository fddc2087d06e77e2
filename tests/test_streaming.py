"""Streamed model answers (docs/cancellation.md, "Streaming"): the OpenAI and Anthropic providers stream from
llm-mock-api (tests/llm_mock.py) into the same turn a whole answer gives, the run's events stream carries
``delta`` events at most ten a second, and a cancel mid-stream keeps the text said so far in a cancelled step."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import anyio
import httpx2
import jsonschema
import pytest
from hypothesis import given
from hypothesis import strategies as st
from llm_mock_api.types.reply import ReplyOptions

from runbrake.shared import RunStatus, RunStore, StepKind, TerminationReason, step_outcome
from runbrake.shared.errors import SpecError
from runbrake.shared.redaction import remember, scrub
from runbrake.shared.spec import AnthropicModel, OpenAIModel, RunSpec
from runbrake.worker.anthropic_provider import AnthropicProvider
from runbrake.worker.conversation import Message, ToolInfo
from runbrake.worker.deltas import MIN_INTERVAL_S, DeltaPublisher, StreamedText
from runbrake.worker.model_stream import (
    MAX_LINE_BYTES,
    ChatCompletionAssembly,
    MessageAssembly,
    MidStream,
    sse_events,
)
from runbrake.worker.models import ModelProvider, OpenAIProvider
from tests.api_helpers import ApiProcess
from tests.catalog_helpers import add_to_catalog
from tests.llm_mock import LlmMock, reply
from tests.worker_helpers import WorkerProcess, wait_for_run

TOOLS = (ToolInfo(server="calc", name="add", description="Add two numbers",
                  input_schema={"type": "object", "properties": {"a": {"type": "number"}}}),)
CONVERSATION = (Message(role="system", content="Answer briefly."), Message(role="user", content="What is 2 + 3?"))
ANSWER = "Two and three make five; " * 8
WAIT_S = 60.0
HTTP_API = Path(__file__).parent.parent / "docs" / "http-api.md"


def delta_schema() -> dict[str, Any]:
    """The JSON Schema of a delta event's data, as docs/http-api.md states it."""
    blocks = HTTP_API.read_text(encoding="utf-8").split("```json\n")[1:]
    schema: dict[str, Any] = next(json.loads(b.split("```")[0]) for b in blocks if "urn:runbrake:http:delta" in b)
    return schema


def _provider(kind: str, mock: LlmMock, *, stream: bool | None = None) -> ModelProvider:
    if kind == "openai":
        return OpenAIProvider(OpenAIModel(base_url=mock.openai_url, model="gpt-mock", stream=stream))
    return AnthropicProvider(AnthropicModel(base_url=mock.anthropic_url, model="claude-mock", stream=stream))


# -- the providers -----------------------------------------------------------------------------------

@pytest.mark.anyio
@pytest.mark.parametrize("kind", ["openai", "anthropic"])
async def test_a_streamed_answer_comes_to_the_same_turn_as_the_whole_one_and_its_text_arrives_in_pieces(
    llm_mock: LlmMock, kind: str
) -> None:
    answer = reply(ANSWER, tools=[("calc__add", {"a": 2, "b": [3, {"c": None}]}, "call_7")], usage=(21, 13))
    llm_mock.server.when("2 + 3").reply(answer, ReplyOptions(chunk_size=7))
    pieces: list[str] = []
    text = StreamedText(1, max_chars=10_000, wake=lambda: pieces.append(text.unsent()))

    streamed = await _provider(kind, llm_mock).complete(CONVERSATION, TOOLS, round_index=0, text=text)
    whole = await _provider(kind, llm_mock, stream=False).complete(CONVERSATION, TOOLS, round_index=0)

    assert streamed == whole
    assert streamed.content == ANSWER
    assert [(c.id, c.tool, dict(c.arguments)) for c in streamed.tool_calls] == [
        ("call_7", "add", {"a": 2, "b": [3, {"c": None}]})]
    assert streamed.usage is not None
    assert streamed.usage.output_tokens == 13
    assert "".join(pieces) == text.text == ANSWER
    assert len(pieces) == -(-len(ANSWER) // 7)  # one per chunk the endpoint sent
    streamed_body, whole_body = llm_mock.bodies()
    assert streamed_body["stream"] is True
    assert "stream" not in whole_body
    if kind == "openai":
        assert streamed_body["stream_options"] == {"include_usage": True}


@pytest.mark.anyio
@pytest.mark.parametrize("kind", ["openai", "anthropic"])
async def test_an_error_before_the_stream_began_is_retryable_as_without_streaming(llm_mock: LlmMock,
                                                                                  kind: str) -> None:
    llm_mock.server.next_error(503, "overloaded")
    text = StreamedText(1, max_chars=100)

    with pytest.raises(Exception) as raised:  # noqa: PT011 - the type is checked below, with its fields
        await _provider(kind, llm_mock).complete(CONVERSATION, TOOLS, round_index=0, text=text)

    assert not isinstance(raised.value, MidStream)
    assert (getattr(raised.value, "status", None), getattr(raised.value, "retryable", None)) == (503, True)
    assert text.text == ""


def test_stream_is_a_catalog_models_field_refused_in_a_run_spec() -> None:
    with pytest.raises(SpecError) as raised:
        RunSpec.parse({"input": "x", "model": {"provider": "openai", "base_url": "http://127.0.0.1:9/v1",
                                               "model": "m", "stream": False}})
    assert "model.stream" in str(raised.value)
    assert "only an operator's catalog" in str(raised.value)


# -- reading the stream ------------------------------------------------------------------------------

async def _chunks(parts: Iterable[bytes]) -> AsyncIterator[bytes]:
    for part in parts:
        yield part


async def _events(parts: Iterable[bytes]) -> list[tuple[str, str]]:
    return [event async for event in sse_events(_chunks(parts))]


@pytest.mark.anyio
async def test_server_sent_events_are_read_across_chunk_boundaries_with_crlf_comments_and_multiline_data() -> None:
    parts = [b": a comment\r\nevent: mess", b"age_start\r\ndata: {\"a\":\r\ndata: 1}\r\n\r", b"\ndata: [DONE]\n\n"]

    assert await _events(parts) == [("message_start", '{"a":\n1}'), ("", "[DONE]")]


@pytest.mark.anyio
async def test_a_line_longer_than_its_bound_is_refused_before_it_is_kept_whole() -> None:
    endless = (b"data: " + b"x" * (1024 * 1024) for _ in range(MAX_LINE_BYTES // (1024 * 1024) + 2))

    with pytest.raises(MidStream, match="line of the streamed answer exceeded"):
        await _events(endless)


def test_a_chat_completions_stream_that_ends_before_done_is_an_error_not_a_shorter_answer() -> None:
    assembly = ChatCompletionAssembly(None)
    assembly.feed("", json.dumps({"choices": [{"index": 0, "delta": {"content": "Half an answ"}}]}))

    with pytest.raises(MidStream, match="ended before it was complete"):
        assembly.result()
    assert not MidStream("x").retryable


def test_tool_call_arguments_streamed_in_pieces_are_joined_by_index() -> None:
    assembly = ChatCompletionAssembly(None)
    for delta in ({"tool_calls": [{"index": 0, "id": "c1", "type": "function", "function": {"name": "calc__add",
                                                                                             "arguments": '{"a"'}}]},
                  {"tool_calls": [{"index": 1, "id": "c2", "function": {"name": "calc__add", "arguments": "{}"}}]},
                  {"tool_calls": [{"index": 0, "function": {"arguments": ": 2}"}}]}):
        assembly.feed("", json.dumps({"choices": [{"index": 0, "delta": delta}]}))
    assembly.feed("", "[DONE]")

    calls = assembly.result()["choices"][0]["message"]["tool_calls"]
    assert [(c["id"], c["function"]["arguments"]) for c in calls] == [("c1", '{"a": 2}'), ("c2", "{}")]


def test_an_error_event_in_a_messages_stream_is_an_error_that_is_not_retried() -> None:
    assembly = MessageAssembly(None)
    assembly.feed("message_start", json.dumps({"type": "message_start", "message": {"content": [], "usage": {}}}))

    with pytest.raises(MidStream, match="overloaded_error"):
        assembly.feed("error", json.dumps({"type": "error", "error": {"type": "overloaded_error"}}))


@pytest.mark.anyio
async def test_text_that_arrives_while_a_delta_is_on_its_way_goes_out_whole_in_the_next_one() -> None:
    published: list[dict[str, Any]] = []
    sending, release = asyncio.Event(), asyncio.Event()

    async def publish(run_id: str, delta: Mapping[str, Any]) -> bool:
        published.append({"run_id": run_id, **delta})
        sending.set()
        await release.wait()
        return True

    deltas = DeltaPublisher("r1", publish, min_interval_s=0)
    text = deltas.text(3, max_chars=7)  # ends at a space: nothing held back (no value of the process begins there)
    with anyio.fail_after(10):
        text.append("Hel")
        await sending.wait()
        sending.clear()
        for piece in ("lo", ", w", "orld"):  # past max_chars: kept and sent up to it
            text.append(piece)
        release.set()
        await sending.wait()
    text.close()

    assert published == [{"run_id": "r1", "round": 3, "text": "Hel"}, {"run_id": "r1", "round": 3, "text": "lo, "}]
    assert text.text == "Hello, "


SECRET, OVERLAPPING = "sk-prop-A1b2-xyz9", "xyz9-prop-B3c4"
"""Two remembered values, the second beginning with the end of the first."""
FRAGMENTS = (SECRET, OVERLAPPING, SECRET[:6], OVERLAPPING[:7], "Bearer ", "tok3n-value", "https://user:", "pa55word",
             "@host/", " ", "x", "\n")


@given(fragments=st.lists(st.sampled_from(FRAGMENTS), max_size=14), cuts=st.lists(st.integers(1, 9), max_size=40))
def test_deltas_joined_are_the_scrubbed_text_so_far_and_never_hold_a_secret_or_its_start(
    fragments: list[str], cuts: list[int]
) -> None:
    remember(SECRET, OVERLAPPING)
    whole = "".join(fragments)
    text = StreamedText(1, max_chars=100_000)
    deltas, at = [], 0
    for size in [*cuts, len(whole)]:  # the text arrives in pieces of these sizes, a delta after each
        text.append(whole[at:at + size])
        at += size
        deltas.append(text.unsent())
    joined = "".join(deltas)

    assert scrub(whole).startswith(joined)  # a secret cut short would differ from its [redacted] here
    assert SECRET not in joined
    assert OVERLAPPING not in joined


# -- runs --------------------------------------------------------------------------------------------

def _model(kind: str, mock: LlmMock, name: str = "mock", **catalog: Any) -> str:
    base = ({"provider": "openai", "base_url": mock.openai_url, "model": "gpt-mock"} if kind == "openai" else
            {"provider": "anthropic", "base_url": mock.anthropic_url, "model": "claude-mock"})
    add_to_catalog(models={name: {**base, **catalog}})
    return name


def _enqueue(api: ApiProcess, model: str) -> str:
    response = httpx2.post(f"{api.url}/v1/runs", json={"input": "What is 2 + 3?", "model": model}, timeout=30)
    assert response.status_code == 201, response.text
    run_id: str = response.json()["run_id"]
    return run_id


def _read_events(api: ApiProcess, run_id: str,
                 until: Callable[[str, dict[str, Any]], bool] = lambda kind, _data: kind == "end",
                 ) -> list[tuple[str, dict[str, Any]]]:
    """The run's SSE events, as (event, data), until ``until`` says so (by default, the stream's end)."""
    got: list[tuple[str, dict[str, Any]]] = []
    kind = ""
    with httpx2.stream("GET", f"{api.url}/v1/runs/{run_id}/events", timeout=WAIT_S) as response:
        for line in response.iter_lines():
            if line.startswith("event: "):
                kind = line.removeprefix("event: ")
            elif line.startswith("data: "):
                got.append((kind, json.loads(line.removeprefix("data: "))))
                if until(kind, got[-1][1]):
                    break
    return got


@pytest.mark.integration
@pytest.mark.parametrize("kind", ["openai", "anthropic"])
def test_a_streamed_run_sends_coalesced_deltas_and_records_what_a_whole_answer_records(
    llm_mock: LlmMock, worker: WorkerProcess, api: ApiProcess, store: RunStore, kind: str
) -> None:
    # 80 chunks 25 ms apart: some two seconds of streaming, far more chunks than ten deltas a second allow.
    llm_mock.server.when("2 + 3").reply(reply(ANSWER, usage=(40, 60)), ReplyOptions(latency=25, chunk_size=2))
    streamed, whole = _model(kind, llm_mock), _model(kind, llm_mock, "whole", stream=False)

    started = time.monotonic()
    run_id = _enqueue(api, streamed)
    events = _read_events(api, run_id)
    elapsed = time.monotonic() - started
    other = wait_for_run(store, _enqueue(api, whole), timeout=WAIT_S)
    record = store.get(run_id)

    assert (record.status, record.termination_reason) == (RunStatus.COMPLETED, TerminationReason.COMPLETED)
    def kept(steps: Iterable[Any]) -> list[tuple[Any, ...]]:  # detail.model names the catalog entry
        return [(s.kind, s.content, {k: v for k, v in s.detail.items() if k != "model"}) for s in steps]

    assert kept(record.steps) == kept(other.steps)
    assert record.usage == other.usage
    deltas = [data for event, data in events if event == "delta"]
    assert len(deltas) >= 2
    for delta in deltas:
        jsonschema.validate(delta, delta_schema())
    assert {d["round"] for d in deltas} == {1}
    assert "".join(d["text"] for d in deltas) in ANSWER  # in order; the text since the last one, each
    assert len(deltas) <= elapsed / MIN_INTERVAL_S + 1  # at most ten a second over the stream's life
    kinds = [event for event, _ in events]
    assert kinds.index("step") > max(i for i, event in enumerate(kinds) if event == "delta")
    assert [b.get("stream") for b in llm_mock.bodies()] == [True, None]


@pytest.mark.integration
@pytest.mark.parametrize("kind", ["openai", "anthropic"])
def test_a_cancel_mid_stream_stops_reading_and_keeps_the_partial_text_in_a_cancelled_step(
    llm_mock: LlmMock, worker: WorkerProcess, api: ApiProcess, store: RunStore, kind: str
) -> None:
    # Some 40 s of streaming, 100 ms a chunk: the cancel comes long before the end.
    llm_mock.server.when("2 + 3").reply(reply("word " * 400), ReplyOptions(latency=100, chunk_size=5))
    run_id = _enqueue(api, _model(kind, llm_mock))

    seen = _read_events(api, run_id, until=lambda event, _data: event == "delta")
    cancelled = httpx2.post(f"{api.url}/v1/runs/{run_id}/cancel", json={"reason": "enough"}, timeout=30)
    record = wait_for_run(store, run_id, lambda r: any(s.kind is StepKind.MODEL for s in r.steps), timeout=WAIT_S)

    assert cancelled.status_code == 202
    assert (record.status, record.termination_reason) == (RunStatus.CANCELLED, TerminationReason.CANCELLED)
    [step] = record.steps
    assert (step.kind, step.interrupted, step_outcome(step), step.detail) == (StepKind.MODEL, True, "cancelled",
                                                                            {"partial": True})
    assert seen[-1][1]["text"] in step.content
    assert step.content
    assert ("word " * 400).startswith(step.content)
    assert len(step.content) < len("word " * 400)
    assert len(llm_mock.requests()) == 1
