"""Model providers: the scripted provider plays its turns, the OpenAI provider speaks chat completions.

The OpenAI provider is exercised against ``tests.openai_stub``, a local server speaking
that API (tests never call a real LLM: docs/development.md, "Development").
"""

from __future__ import annotations

import functools
import json

import anyio
import pytest

from runbrake.shared.errors import ProviderError
from runbrake.shared.spec import OpenAIModel, ScriptedModel, ScriptedToolCall, ScriptedTurn
from runbrake.worker.conversation import Message, ModelTurn, ToolCall, ToolInfo, Usage
from runbrake.worker.models import OpenAIProvider, ScriptedProvider, provider_for
from tests.openai_stub import OpenAIStub, StubToolCall

CALC_TOOLS = (
    ToolInfo(
        server="calc",
        name="get-sum",
        description="Adds two numbers.",
        input_schema={"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}},
    ),
)
QUESTION = (Message(role="user", content="What is 2 + 3?"),)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _openai(stub: OpenAIStub, *, api_key_env: str | None = None) -> OpenAIProvider:
    return OpenAIProvider(OpenAIModel(base_url=stub.base_url, model="stub-model", api_key_env=api_key_env))


# --- scripted -----------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_the_scripted_provider_answers_each_round_with_the_turn_at_that_index() -> None:
    provider = ScriptedProvider(
        ScriptedModel(
            turns=(
                ScriptedTurn(tool_calls=(ScriptedToolCall("calc", "get-sum", {"a": 2, "b": 3}),)),
                ScriptedTurn(content="It is 5."),
            )
        )
    )

    second = await provider.complete(QUESTION, CALC_TOOLS, round_index=1)
    first = await provider.complete(QUESTION, CALC_TOOLS, round_index=0)

    assert second == ModelTurn(content="It is 5.")
    assert first == ModelTurn(
        content=None,
        tool_calls=(ToolCall(id="call_0_0", server="calc", tool="get-sum", arguments={"a": 2, "b": 3}),),
    )


@pytest.mark.anyio
async def test_a_scripted_delay_is_interrupted_by_a_cancel_scope() -> None:
    provider = ScriptedProvider(ScriptedModel(turns=(ScriptedTurn(content="late", delay_ms=3_600_000),)))

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(functools.partial(provider.complete, QUESTION, CALC_TOOLS, round_index=0))
            # The provider task is then parked in its delay.
            await anyio.wait_all_tasks_blocked()
            tg.cancel_scope.cancel()

    assert tg.cancel_scope.cancelled_caught


@pytest.mark.anyio
async def test_a_scripted_turn_with_fail_raises_a_provider_error_with_its_message() -> None:
    provider = ScriptedProvider(ScriptedModel(turns=(ScriptedTurn(fail="model overloaded"),)))

    with pytest.raises(ProviderError, match="model overloaded"):
        await provider.complete(QUESTION, CALC_TOOLS, round_index=0)


@pytest.mark.anyio
async def test_a_scripted_model_that_runs_out_of_turns_raises_a_provider_error_naming_the_round() -> None:
    provider = ScriptedProvider(ScriptedModel(turns=(ScriptedTurn(content="only one"),)))

    with pytest.raises(ProviderError, match="round 1"):
        await provider.complete(QUESTION, CALC_TOOLS, round_index=1)


def test_provider_for_picks_the_provider_named_by_the_spec() -> None:
    assert isinstance(provider_for(ScriptedModel(turns=(ScriptedTurn(content="x"),))).provider, ScriptedProvider)
    assert isinstance(provider_for(OpenAIModel(base_url="http://127.0.0.1:1/v1", model="m")).provider, OpenAIProvider)


# --- openai -------------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_the_openai_provider_returns_the_models_content(openai_stub: OpenAIStub) -> None:
    openai_stub.reply("It is 5.")

    turn = await _openai(openai_stub).complete(QUESTION, CALC_TOOLS, round_index=0)

    assert turn == ModelTurn(content="It is 5.", usage=Usage(input_tokens=0, output_tokens=0))
    assert openai_stub.requests[0]["model"] == "stub-model"
    assert openai_stub.requests[0]["messages"] == [{"role": "user", "content": "What is 2 + 3?"}]


@pytest.mark.anyio
async def test_the_openai_provider_maps_a_server__tool_call_to_a_tool_call(openai_stub: OpenAIStub) -> None:
    openai_stub.reply(tool_calls=[StubToolCall("calc__get-sum", {"a": 2, "b": 3})])

    turn = await _openai(openai_stub).complete(QUESTION, CALC_TOOLS, round_index=0)

    assert turn.content is None
    [call] = turn.tool_calls
    assert (call.server, call.tool, dict(call.arguments)) == ("calc", "get-sum", {"a": 2, "b": 3})
    assert call.id.startswith("call_stub_")


@pytest.mark.anyio
async def test_the_openai_provider_shows_tools_as_server__tool_functions(openai_stub: OpenAIStub) -> None:
    openai_stub.reply("ok")

    await _openai(openai_stub).complete(QUESTION, CALC_TOOLS, round_index=0)

    assert openai_stub.requests[0]["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "calc__get-sum",
                "description": "Adds two numbers.",
                "parameters": {
                    "type": "object",
                    "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                },
            },
        }
    ]


@pytest.mark.anyio
async def test_the_openai_provider_sends_no_tools_field_when_there_are_no_tools(openai_stub: OpenAIStub) -> None:
    openai_stub.reply("ok")

    await _openai(openai_stub).complete(QUESTION, (), round_index=0)

    assert "tools" not in openai_stub.requests[0]


@pytest.mark.anyio
async def test_the_openai_provider_sends_tool_calls_and_their_results_linked_by_id(
    openai_stub: OpenAIStub,
) -> None:
    openai_stub.reply("It is 5.")
    call = ToolCall(id="call_0_0", server="calc", tool="get-sum", arguments={"a": 2, "b": 3})
    conversation = (
        Message(role="system", content="Be brief."),
        *QUESTION,
        Message(role="assistant", tool_calls=(call,)),
        Message(role="tool", content="5", tool_call_id="call_0_0"),
    )

    await _openai(openai_stub).complete(conversation, CALC_TOOLS, round_index=1)

    system, _, assistant, tool = openai_stub.requests[0]["messages"]
    assert system == {"role": "system", "content": "Be brief."}
    assert assistant["role"] == "assistant"
    assert assistant["content"] is None
    [sent] = assistant["tool_calls"]
    assert (sent["id"], sent["type"], sent["function"]["name"]) == ("call_0_0", "function", "calc__get-sum")
    assert json.loads(sent["function"]["arguments"]) == {"a": 2, "b": 3}
    assert tool == {"role": "tool", "content": "5", "tool_call_id": "call_0_0"}


@pytest.mark.anyio
async def test_an_http_500_becomes_a_provider_error_chained_to_the_sdk_error(openai_stub: OpenAIStub) -> None:
    openai_stub.reply(status=500, error_message="upstream exploded")

    with pytest.raises(ProviderError, match="upstream exploded") as caught:
        await _openai(openai_stub).complete(QUESTION, CALC_TOOLS, round_index=0)

    assert type(caught.value.__cause__).__module__.startswith("openai")
    # max_retries=0: the provider does not retry behind runbrake's back.
    assert len(openai_stub.requests) == 1


@pytest.mark.anyio
async def test_an_unreachable_endpoint_becomes_a_provider_error(openai_stub: OpenAIStub) -> None:
    base_url = openai_stub.base_url
    openai_stub.stop()  # the fixture's second stop is harmless; the port now refuses connections

    with pytest.raises(ProviderError):
        await OpenAIProvider(OpenAIModel(base_url=base_url, model="m")).complete(QUESTION, (), round_index=0)


@pytest.mark.anyio
@pytest.mark.parametrize("name", ["get-sum", "nowhere__get-sum", "calc__", "get_weather"])
async def test_a_tool_name_that_names_no_tool_of_the_run_comes_back_as_a_call_with_a_problem(
    openai_stub: OpenAIStub, name: str
) -> None:
    openai_stub.reply(tool_calls=[StubToolCall(name, {"city": "Berlin"})])

    turn = await _openai(openai_stub).complete(QUESTION, CALC_TOOLS, round_index=0)

    [call] = turn.tool_calls
    assert (call.server, call.tool, call.model_name) == ("", name, name)
    assert call.problem == f"there is no tool named {name!r}"


@pytest.mark.anyio
@pytest.mark.parametrize(("arguments", "problem"), [
    ('{"a": 2,', "the arguments of calc__get-sum are not JSON: '{\"a\": 2,'"),
    ('{"a": NaN}', "the arguments of calc__get-sum are not JSON"),
    ("[2, 3]", "the arguments of calc__get-sum must be a JSON object, not an array"),
    ('"two"', "the arguments of calc__get-sum must be a JSON object, not a string"),
])
async def test_tool_arguments_that_are_not_a_json_object_come_back_as_a_call_with_a_problem(
    openai_stub: OpenAIStub, arguments: str, problem: str
) -> None:
    openai_stub.reply(tool_calls=[StubToolCall("calc__get-sum", arguments)])

    turn = await _openai(openai_stub).complete(QUESTION, CALC_TOOLS, round_index=0)

    [call] = turn.tool_calls
    assert (call.server, call.tool, dict(call.arguments)) == ("calc", "get-sum", {})
    assert call.problem is not None
    assert call.problem.startswith(problem)


@pytest.mark.anyio
async def test_the_api_key_comes_from_the_named_variable(
    openai_stub: OpenAIStub, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RUNBRAKE_TEST_MODEL_KEY", "sk-test")
    openai_stub.reply("ok")

    await _openai(openai_stub, api_key_env="RUNBRAKE_TEST_MODEL_KEY").complete(QUESTION, (), round_index=0)

    assert openai_stub.headers[0]["authorization"] == "Bearer sk-test"


@pytest.mark.anyio
async def test_an_unset_api_key_variable_is_a_provider_error_naming_it(
    openai_stub: OpenAIStub, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("RUNBRAKE_TEST_MISSING_KEY", raising=False)

    with pytest.raises(ProviderError, match="RUNBRAKE_TEST_MISSING_KEY"):
        await _openai(openai_stub, api_key_env="RUNBRAKE_TEST_MISSING_KEY").complete(QUESTION, (), round_index=0)

    assert openai_stub.requests == []


@pytest.mark.anyio
async def test_a_slow_request_cancelled_by_a_cancel_scope_raises_cancellation_not_provider_error(
    openai_stub: OpenAIStub,
) -> None:
    openai_stub.reply("too late", delay_s=3600)
    raised: list[BaseException] = []

    async def ask() -> None:
        try:
            await _openai(openai_stub).complete(QUESTION, CALC_TOOLS, round_index=0)
        except BaseException as exc:
            raised.append(exc)
            raise

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(ask)
            await openai_stub.wait_for_requests(1)
            tg.cancel_scope.cancel()

    assert tg.cancel_scope.cancelled_caught
    assert [type(exc) for exc in raised] == [anyio.get_cancelled_exc_class()]
