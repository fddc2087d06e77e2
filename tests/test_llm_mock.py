"""The OpenAI provider against ``llm-mock-api`` (tests/llm_mock.py): what the endpoint received, and how its
error replies come back as :class:`~shared.errors.ProviderError` (status, ``Retry-After``, retryable)."""

from __future__ import annotations

import pytest

from runbrake.shared.errors import ProviderError
from runbrake.shared.spec import OpenAIModel
from runbrake.worker.conversation import Message, ModelSettings, ToolInfo, Usage
from runbrake.worker.models import OpenAIProvider, retry_after_s
from tests.llm_mock import LlmMock, reply

TOOLS = (ToolInfo(server="calc", name="add", description="Add two numbers",
                  input_schema={"type": "object", "properties": {"a": {"type": "number"}}}),)
CONVERSATION = (
    Message(role="system", content="Answer in one word."),
    Message(role="user", content="What is 2 + 3?"),
)


def _provider(mock: LlmMock) -> OpenAIProvider:
    return OpenAIProvider(OpenAIModel(base_url=mock.openai_url, model="gpt-mock"))


@pytest.mark.anyio
async def test_the_endpoint_receives_the_system_message_the_tools_and_the_model(llm_mock: LlmMock) -> None:
    llm_mock.server.when("2 + 3").reply(reply("Five.", usage=(21, 3)))

    turn = await _provider(llm_mock).complete(CONVERSATION, TOOLS, round_index=0, settings=ModelSettings())

    assert turn.content == "Five."
    assert turn.usage == Usage(input_tokens=21, output_tokens=3)
    [request] = llm_mock.requests()
    assert request.format == "openai"
    assert request.model == "gpt-mock"
    assert request.system_message == "Answer in one word."
    assert list(request.tool_names) == ["calc__add"]


@pytest.mark.anyio
async def test_a_429_comes_back_retryable_with_its_status(llm_mock: LlmMock) -> None:
    llm_mock.server.next_error(429, "rate limited")

    with pytest.raises(ProviderError) as raised:
        await _provider(llm_mock).complete(CONVERSATION, TOOLS, round_index=0)

    assert raised.value.status == 429
    assert raised.value.retryable
    assert "rate limited" in str(raised.value)


@pytest.mark.anyio
@pytest.mark.parametrize(("status", "retryable"), [(500, True), (503, True), (408, True), (400, False), (401, False),
                                                   (404, False), (422, False)])
async def test_which_statuses_are_worth_another_attempt(llm_mock: LlmMock, status: int, retryable: bool) -> None:
    llm_mock.server.next_error(status, "no")

    with pytest.raises(ProviderError) as raised:
        await _provider(llm_mock).complete(CONVERSATION, TOOLS, round_index=0)

    assert (raised.value.status, raised.value.retryable) == (status, retryable)


@pytest.mark.anyio
async def test_an_endpoint_that_is_not_listening_is_a_transient_error() -> None:
    provider = OpenAIProvider(OpenAIModel(base_url="http://127.0.0.1:9/v1", model="m"))

    with pytest.raises(ProviderError) as raised:
        await provider.complete(CONVERSATION, TOOLS, round_index=0)

    assert raised.value.status is None
    assert raised.value.transient
    assert raised.value.retryable


@pytest.mark.parametrize(("header", "seconds"), [("2", 2.0), (" 0.5 ", 0.5), ("0", 0.0), ("-1", None), ("nan", None),
                                                 ("inf", None), ("Wed, 21 Oct 2015 07:28:00 GMT", None), (None, None),
                                                 ("99999999", 3600.0)])
def test_retry_after_reads_delta_seconds_only_and_bounds_them(header: str | None, seconds: float | None) -> None:
    assert retry_after_s(header) == seconds


@pytest.mark.anyio
async def test_a_tool_call_and_its_result_go_back_as_chat_completions_expects(llm_mock: LlmMock) -> None:
    # The last user message stays the same in every round of a run: the first rule matches once only.
    llm_mock.server.when("2 + 3").reply(reply(tools=[("calc__add", {"a": 2}, "call_7")])).times(1)
    provider = _provider(llm_mock)

    turn = await provider.complete(CONVERSATION, TOOLS, round_index=0)
    [call] = turn.tool_calls
    assert (call.id, call.server, call.tool, dict(call.arguments)) == ("call_7", "calc", "add", {"a": 2})

    llm_mock.server.when_tool_result("call_7").reply(reply("Five."))
    answer = await provider.complete(
        (*CONVERSATION, Message(role="assistant", tool_calls=turn.tool_calls),
         Message(role="tool", content="5", tool_call_id="call_7")),
        TOOLS, round_index=1)

    assert answer.content == "Five."
    sent = llm_mock.bodies()[1]["messages"]
    assert [m["role"] for m in sent] == ["system", "user", "assistant", "tool"]
    assert sent[2]["tool_calls"][0]["id"] == "call_7"
    assert sent[3] == {"role": "tool", "content": "5", "tool_call_id": "call_7"}
