"""The ``anthropic`` provider against llm-mock-api's Messages endpoint (tests/llm_mock.py): what the endpoint
received (system prompt, tools, tool_use and tool_result, settings), what comes back (text, calls, usage),
how a mistaken call is handed back, how errors come back, and that a cancel interrupts a request."""

from __future__ import annotations

import threading

import anyio
import anyio.to_thread
import pytest

from runbrake.shared.catalog import Admission, Catalog
from runbrake.shared.errors import ProviderError, SpecError
from runbrake.shared.spec import AnthropicModel, RunSpec
from runbrake.worker.anthropic_provider import DEFAULT_MAX_TOKENS, AnthropicProvider
from runbrake.worker.conversation import Message, ModelSettings, ToolCall, ToolInfo, Usage
from tests.llm_mock import LlmMock, held_reply, reply

TOOLS = (ToolInfo(server="time", name="convert_time", description="Convert a time between timezones",
                  input_schema={"type": "object", "properties": {"time": {"type": "string"}}}),)
CONVERSATION = (
    Message(role="system", content="Answer in one line."),
    Message(role="user", content="What time is 12:00 London in Tokyo?"),
)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _provider(mock: LlmMock, **fields: str) -> AnthropicProvider:
    return AnthropicProvider(AnthropicModel(model="claude-mock", base_url=mock.anthropic_url, **fields))


@pytest.mark.anyio
async def test_the_system_prompt_goes_in_system_and_the_tools_by_their_model_names(llm_mock: LlmMock) -> None:
    llm_mock.server.when("12:00").reply(reply("21:00.", usage=(200, 30)))

    turn = await _provider(llm_mock).complete(CONVERSATION, TOOLS, round_index=0)

    assert (turn.content, turn.tool_calls, turn.usage) == ("21:00.", (), Usage(input_tokens=200, output_tokens=30))
    [request] = llm_mock.requests()
    assert (request.format, request.model, request.system_message) == ("anthropic", "claude-mock",
                                                                       "Answer in one line.")
    assert list(request.tool_names) == ["time__convert_time"]
    [body] = llm_mock.bodies()
    assert body["system"] == "Answer in one line."
    assert [m["role"] for m in body["messages"]] == ["user"]
    assert body["max_tokens"] == DEFAULT_MAX_TOKENS
    assert body["tools"][0]["input_schema"] == dict(TOOLS[0].input_schema)
    assert "tool_choice" not in body


@pytest.mark.anyio
async def test_a_tool_use_is_a_call_and_its_result_goes_back_as_a_tool_result(llm_mock: LlmMock) -> None:
    llm_mock.server.when("12:00").reply(reply(tools=[("time__convert_time", {"time": "12:00"}, "toolu_7")])).times(1)
    llm_mock.server.when_tool_result("toolu_7").reply(reply("21:00 in Tokyo.", usage=(321, 42)))
    provider = _provider(llm_mock)

    turn = await provider.complete(CONVERSATION, TOOLS, round_index=0)
    [call] = turn.tool_calls
    assert (call.id, call.server, call.tool, dict(call.arguments), call.problem) == (
        "toolu_7", "time", "convert_time", {"time": "12:00"}, None)
    assert turn.content is None
    answer = await provider.complete(
        (*CONVERSATION, Message(role="assistant", tool_calls=turn.tool_calls),
         Message(role="tool", content="21:00", tool_call_id="toolu_7")), TOOLS, round_index=1)

    assert (answer.content, answer.usage) == ("21:00 in Tokyo.", Usage(input_tokens=321, output_tokens=42))
    sent = llm_mock.bodies()[1]["messages"]
    assert [m["role"] for m in sent] == ["user", "assistant", "user"]
    assert sent[1]["content"] == [{"type": "tool_use", "id": "toolu_7", "name": "time__convert_time",
                                   "input": {"time": "12:00"}}]
    assert sent[2]["content"] == [{"type": "tool_result", "tool_use_id": "toolu_7", "content": "21:00"}]


@pytest.mark.anyio
async def test_the_results_of_one_turns_calls_go_back_together_in_one_user_message(llm_mock: LlmMock) -> None:
    first = (*CONVERSATION, Message(role="assistant", content="Checking both.", tool_calls=(
        _call("toolu_1"), _call("toolu_2"))), Message(role="tool", content="a", tool_call_id="toolu_1"),
        Message(role="tool", content="b", tool_call_id="toolu_2"))

    await _provider(llm_mock).complete(first, TOOLS, round_index=1)

    sent = llm_mock.bodies()[0]["messages"]
    assert [m["role"] for m in sent] == ["user", "assistant", "user"]
    assert sent[1]["content"][0] == {"type": "text", "text": "Checking both."}
    assert [b["tool_use_id"] for b in sent[2]["content"]] == ["toolu_1", "toolu_2"]


def _call(call_id: str) -> ToolCall:
    return ToolCall(id=call_id, server="time", tool="convert_time", arguments={"time": "09:00"})


@pytest.mark.anyio
async def test_the_settings_go_where_the_messages_api_has_them(llm_mock: LlmMock) -> None:
    settings = ModelSettings(temperature=0.2, top_p=0.9, seed=7, max_output_tokens=300, stop=("END",),
                             tool_choice="required", parallel_tool_calls=False,
                             output_schema={"type": "object", "properties": {"time": {"type": "string"}}})

    await _provider(llm_mock).complete(CONVERSATION, TOOLS, round_index=0, settings=settings)

    [body] = llm_mock.bodies()
    assert body["max_tokens"] == 300
    assert body["stop_sequences"] == ["END"]
    assert body["tool_choice"] == {"type": "any", "disable_parallel_tool_use": True}
    assert body["output_config"] == {"format": {"type": "json_schema", "schema": dict(settings.output_schema or {})}}
    # The Messages API (as the SDK states it) has no temperature, top_p or seed.
    assert not {"temperature", "top_p", "seed"} & set(body)


@pytest.mark.anyio
async def test_tool_choice_none_is_sent_as_none(llm_mock: LlmMock) -> None:
    await _provider(llm_mock).complete(CONVERSATION, TOOLS, round_index=0, settings=ModelSettings(tool_choice="none"))

    assert llm_mock.bodies()[0]["tool_choice"] == {"type": "none"}


@pytest.mark.anyio
async def test_a_call_to_a_tool_the_run_does_not_have_comes_back_with_a_problem_not_an_error(
    llm_mock: LlmMock,
) -> None:
    llm_mock.server.when("12:00").reply(reply(tools=[("get_weather", {"city": "Oslo"}, "toolu_w"),
                                                     ("time__convert_time", {"time": "12:00"}, "toolu_t")]))

    turn = await _provider(llm_mock).complete(CONVERSATION, TOOLS, round_index=0)

    weather, good = turn.tool_calls
    assert weather.id == "toolu_w"
    assert weather.problem is not None
    assert "get_weather" in weather.problem
    assert "time__convert_time" in weather.problem
    assert good.problem is None


@pytest.mark.anyio
@pytest.mark.parametrize(("status", "retryable"), [(429, True), (500, True), (529, True), (400, False),
                                                   (401, False)])
async def test_an_error_reply_comes_back_as_a_provider_error_with_its_status(
    llm_mock: LlmMock, status: int, retryable: bool
) -> None:
    llm_mock.server.next_error(status, "nope")

    with pytest.raises(ProviderError) as raised:
        await _provider(llm_mock).complete(CONVERSATION, TOOLS, round_index=0)

    assert (raised.value.status, raised.value.retryable) == (status, retryable)
    assert "nope" in str(raised.value)
    assert len(llm_mock.requests()) == 1  # the SDK's own retries are off


@pytest.mark.anyio
async def test_the_api_key_comes_from_the_named_variable_and_an_unset_one_sends_nothing(
    llm_mock: LlmMock, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RUNBRAKE_TEST_ANTHROPIC_KEY", "sk-ant-test")
    monkeypatch.delenv("RUNBRAKE_TEST_MISSING_KEY", raising=False)

    await _provider(llm_mock, api_key_env="RUNBRAKE_TEST_ANTHROPIC_KEY").complete(CONVERSATION, (), round_index=0)
    with pytest.raises(ProviderError, match="RUNBRAKE_TEST_MISSING_KEY"):
        await _provider(llm_mock, api_key_env="RUNBRAKE_TEST_MISSING_KEY").complete(CONVERSATION, (), round_index=0)

    [request] = llm_mock.requests()
    assert "sk-ant-test" in {request.headers.get("x-api-key"), (request.headers.get("authorization") or "")[7:]}


@pytest.mark.anyio
async def test_a_request_cancelled_by_a_cancel_scope_raises_cancellation_not_provider_error(
    llm_mock: LlmMock,
) -> None:
    arrived, release = threading.Event(), threading.Event()
    llm_mock.server.when("12:00").reply(held_reply(arrived, release))
    raised: list[BaseException] = []

    async def ask() -> None:
        try:
            await _provider(llm_mock).complete(CONVERSATION, TOOLS, round_index=0)
        except BaseException as exc:
            raised.append(exc)
            raise

    try:
        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                tg.start_soon(ask)
                assert await anyio.to_thread.run_sync(arrived.wait, 15)
                tg.cancel_scope.cancel()
    finally:
        release.set()

    assert tg.cancel_scope.cancelled_caught
    assert [type(exc) for exc in raised] == [anyio.get_cancelled_exc_class()]


def test_an_anthropic_model_in_the_catalog_defaults_its_base_url_and_is_refused_inline_by_default() -> None:
    catalog = Catalog.parse({"models": {"claude": {"provider": "anthropic", "model": "claude-sonnet-4-5",
                                                   "api_key_env": "ANTHROPIC_API_KEY", "max_retries": 2}}})
    model = catalog.models["claude"]
    assert isinstance(model, AnthropicModel)
    assert (model.base_url, model.max_retries) == ("https://api.anthropic.com", 2)

    spec = RunSpec.parse({"input": "hi", "model": {"provider": "anthropic", "model": "claude-sonnet-4-5"}})
    with pytest.raises(SpecError, match="inline anthropic model is refused"):
        Admission(source=catalog).admit(spec)
    with pytest.raises(SpecError, match="only an operator's catalog sets it"):
        RunSpec.parse({"input": "hi", "model": {"provider": "anthropic", "model": "m", "timeout_s": 5}})
