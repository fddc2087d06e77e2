"""Retries of a model call (docs/leases.md, "Retries"): the policy's waits, and every provider behind
:func:`provider_for` against real HTTP endpoints (llm-mock-api; the OpenAI stub where a reply must carry a
``Retry-After`` header, which llm-mock-api's error replies cannot)."""

from __future__ import annotations

import anyio
import pytest

from runbrake.shared.errors import ProviderError, RetriedAttempt
from runbrake.shared.settings import Settings
from runbrake.shared.spec import AnthropicModel, OpenAIModel
from runbrake.worker.conversation import Message
from runbrake.worker.models import RetryPolicy, provider_for
from tests.llm_mock import LlmMock, reply
from tests.openai_stub import OpenAIStub
from tests.polling import poll_until_async

QUESTION = (Message(role="user", content="What is 2 + 3?"),)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _attempt(wait_s: float, status: int | None = 500) -> RetriedAttempt:
    return RetriedAttempt(error="HTTP 500", status=status, wait_s=wait_s)


# -- the policy ---------------------------------------------------------------------------------------


def test_the_defaults_are_four_retries_and_sixty_seconds_of_waiting() -> None:
    policy = RetryPolicy.from_settings(Settings())

    assert (policy.retries, policy.max_wait_s, policy.timeout_s) == (4, 60.0, None)


def test_the_backoff_doubles_with_each_retry_and_full_jitter_draws_from_zero_up_to_it() -> None:
    policy = RetryPolicy(retries=10, max_wait_s=3600)
    error = ProviderError("HTTP 503", status=503)

    highest = [policy.wait_s(error, [_attempt(0)] * n, draw=1.0) for n in range(4)]
    lowest = [policy.wait_s(error, [_attempt(0)] * n, draw=0.0) for n in range(4)]

    assert highest == [0.5, 1.0, 2.0, 4.0]
    assert lowest == [0.0, 0.0, 0.0, 0.0]
    assert policy.wait_s(error, [], draw=0.5) == 0.25


def test_a_retry_after_is_the_least_the_call_waits() -> None:
    policy = RetryPolicy(retries=4, max_wait_s=60)

    assert policy.wait_s(ProviderError("HTTP 429", status=429, retry_after_s=7.0), [], draw=0.0) == 7.0
    assert policy.wait_s(ProviderError("HTTP 429", status=429, retry_after_s=0.1), [], draw=1.0) == 0.5


@pytest.mark.parametrize("status", [400, 401, 403, 404, 422])
def test_a_4xx_other_than_408_409_429_is_not_retried(status: int) -> None:
    assert RetryPolicy().wait_s(ProviderError("no", status=status), [], draw=0.0) is None


@pytest.mark.parametrize("error", [ProviderError("HTTP 408", status=408), ProviderError("HTTP 409", status=409),
                                   ProviderError("HTTP 429", status=429), ProviderError("HTTP 502", status=502),
                                   ProviderError("timed out", transient=True)])
def test_429_408_409_5xx_timeouts_and_connection_errors_are_retried(error: ProviderError) -> None:
    assert RetryPolicy().wait_s(error, [], draw=0.0) == 0.0


def test_a_malformed_answer_is_not_retried() -> None:
    assert RetryPolicy().wait_s(ProviderError("the model answered without a choice"), [], draw=0.0) is None


def test_the_call_gives_up_once_its_retries_are_spent() -> None:
    policy = RetryPolicy(retries=2, max_wait_s=60)
    error = ProviderError("HTTP 500", status=500)

    assert policy.wait_s(error, [_attempt(0)], draw=0.0) == 0.0
    assert policy.wait_s(error, [_attempt(0), _attempt(0)], draw=0.0) is None


def test_a_wait_that_would_pass_the_waiting_budget_gives_up_instead() -> None:
    policy = RetryPolicy(retries=4, max_wait_s=10)

    assert policy.wait_s(ProviderError("HTTP 429", status=429, retry_after_s=10.0), [], draw=0.0) == 10.0
    assert policy.wait_s(ProviderError("HTTP 429", status=429, retry_after_s=11.0), [], draw=0.0) is None
    assert policy.wait_s(ProviderError("HTTP 429", status=429, retry_after_s=4.0), [_attempt(7.0)], draw=0.0) is None


def test_a_catalog_model_overrides_the_retries_and_sets_the_request_timeout() -> None:
    policy = RetryPolicy(retries=4, max_wait_s=60)

    overridden = policy.for_model(OpenAIModel(base_url="http://127.0.0.1:1/v1", model="m", max_retries=0,
                                              timeout_s=5.0))
    kept = policy.for_model(AnthropicModel(model="m"))

    assert (overridden.retries, overridden.max_wait_s, overridden.timeout_s) == (0, 60, 5.0)
    assert kept == policy


# -- against real endpoints ---------------------------------------------------------------------------


def _openai(mock: LlmMock, **catalog: object) -> OpenAIModel:
    return OpenAIModel(base_url=mock.openai_url, model="gpt-mock", **catalog)  # type: ignore[arg-type]


@pytest.mark.anyio
async def test_a_429_then_a_200_completes_with_two_attempts(llm_mock: LlmMock) -> None:
    llm_mock.server.next_error(429, "slow down")
    llm_mock.server.when("2 + 3").reply(reply("Five."))

    turn = await provider_for(_openai(llm_mock)).complete(QUESTION, (), round_index=0)

    assert (turn.content, turn.attempts) == ("Five.", 2)
    [retried] = turn.retried
    assert retried.status == 429
    assert "slow down" in retried.error
    assert len(llm_mock.requests()) == 2


@pytest.mark.anyio
async def test_a_500_three_times_then_a_200_completes_with_four_attempts(llm_mock: LlmMock) -> None:
    for _ in range(3):
        llm_mock.server.next_error(500, "overloaded")
    llm_mock.server.when("2 + 3").reply(reply("Five."))

    turn = await provider_for(_openai(llm_mock)).complete(QUESTION, (), round_index=0)

    assert (turn.content, turn.attempts) == ("Five.", 4)
    assert [r.status for r in turn.retried] == [500, 500, 500]
    assert len(llm_mock.requests()) == 4


@pytest.mark.anyio
async def test_a_400_fails_at_once_with_one_attempt(llm_mock: LlmMock) -> None:
    llm_mock.server.next_error(400, "bad request")
    llm_mock.server.when("2 + 3").reply(reply("never sent"))

    with pytest.raises(ProviderError) as raised:
        await provider_for(_openai(llm_mock)).complete(QUESTION, (), round_index=0)

    assert (raised.value.status, raised.value.attempts, raised.value.retried) == (400, 1, ())
    assert len(llm_mock.requests()) == 1


@pytest.mark.anyio
async def test_a_call_that_keeps_failing_gives_up_after_the_catalog_models_retries(llm_mock: LlmMock) -> None:
    for _ in range(5):
        llm_mock.server.next_error(503, "down")

    with pytest.raises(ProviderError) as raised:
        await provider_for(_openai(llm_mock, max_retries=2)).complete(QUESTION, (), round_index=0)

    assert (raised.value.status, raised.value.attempts) == (503, 3)
    assert [r.status for r in raised.value.retried] == [503, 503]
    assert len(llm_mock.requests()) == 3


@pytest.mark.anyio
async def test_the_anthropic_provider_is_retried_the_same_way(llm_mock: LlmMock) -> None:
    llm_mock.server.next_error(529, "overloaded")
    llm_mock.server.when("2 + 3").reply(reply("Five."))

    turn = await provider_for(AnthropicModel(model="claude-mock", base_url=llm_mock.anthropic_url)).complete(
        QUESTION, (), round_index=0)

    assert (turn.content, turn.attempts, [r.status for r in turn.retried]) == ("Five.", 2, [529])
    assert [r.format for r in llm_mock.requests()] == ["anthropic", "anthropic"]


@pytest.mark.anyio
async def test_the_wait_honours_the_endpoints_retry_after(openai_stub: OpenAIStub) -> None:
    openai_stub.reply(status=429, error_message="slow down", headers={"Retry-After": "1"})
    openai_stub.reply("Five.")

    turn = await provider_for(OpenAIModel(base_url=openai_stub.base_url, model="stub")).complete(
        QUESTION, (), round_index=0)

    assert (turn.content, turn.attempts) == ("Five.", 2)
    [retried] = turn.retried
    assert retried.status == 429
    assert retried.wait_s >= 1.0
    assert len(openai_stub.requests) == 2


@pytest.mark.anyio
async def test_a_retry_after_past_the_waiting_budget_gives_up_at_once(openai_stub: OpenAIStub) -> None:
    openai_stub.reply(status=429, error_message="come back tomorrow", headers={"Retry-After": "86400"})
    provider = provider_for(OpenAIModel(base_url=openai_stub.base_url, model="stub"), RetryPolicy(max_wait_s=60))

    with anyio.fail_after(30), pytest.raises(ProviderError) as raised:
        await provider.complete(QUESTION, (), round_index=0)

    assert (raised.value.status, raised.value.retry_after_s, raised.value.attempts) == (429, 3600.0, 1)
    assert len(openai_stub.requests) == 1


@pytest.mark.anyio
async def test_a_cancel_during_a_backoff_wait_interrupts_it_and_sends_nothing_more(openai_stub: OpenAIStub) -> None:
    openai_stub.reply(status=429, error_message="slow down", headers={"Retry-After": "3000"})
    openai_stub.reply("never asked for")
    provider = provider_for(OpenAIModel(base_url=openai_stub.base_url, model="stub"), RetryPolicy(max_wait_s=3600))
    connection = provider.provider.connection  # type: ignore[attr-defined]
    raised: list[BaseException] = []

    async def ask() -> None:
        try:
            await provider.complete(QUESTION, (), round_index=0)
        except BaseException as exc:
            raised.append(exc)
            raise

    async with provider:
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(ask)
                await openai_stub.wait_for_requests(1)
                # The 429 closes the segment's client; the wait (3000 s, from Retry-After) follows at once.
                await poll_until_async(lambda: not connection.open or None, timeout=20,
                                       failure=lambda: "the 429 never came back to the provider")
                tg.cancel_scope.cancel()

    assert tg.cancel_scope.cancelled_caught
    assert [type(exc) for exc in raised] == [anyio.get_cancelled_exc_class()]
    assert len(openai_stub.requests) == 1


@pytest.mark.anyio
async def test_a_catalog_models_timeout_bounds_each_request_and_a_timeout_is_retried(openai_stub: OpenAIStub) -> None:
    openai_stub.reply("too late", delay_s=3600)
    openai_stub.reply("Five.")
    provider = provider_for(OpenAIModel(base_url=openai_stub.base_url, model="stub", timeout_s=0.5))

    with anyio.fail_after(60):
        turn = await provider.complete(QUESTION, (), round_index=0)

    assert (turn.content, turn.attempts) == ("Five.", 2)
    [retried] = turn.retried
    assert retried.status is None
    assert len(openai_stub.requests) == 2


# -- the segment's client -----------------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("kind", ["openai", "anthropic"])
async def test_a_segment_keeps_one_client_for_its_calls_and_closes_it_at_its_end(llm_mock: LlmMock, kind: str) -> None:
    spec = (_openai(llm_mock) if kind == "openai"
            else AnthropicModel(model="claude-mock", base_url=llm_mock.anthropic_url))
    provider = provider_for(spec)
    connection = provider.provider.connection  # type: ignore[attr-defined]

    async with provider:
        await provider.complete(QUESTION, (), round_index=0)
        kept = connection.open
        await provider.complete(QUESTION, (), round_index=1)
    await provider.complete(QUESTION, (), round_index=2)

    assert kept
    assert not connection.open
    assert len(llm_mock.requests()) == 3


@pytest.mark.anyio
async def test_an_interrupted_call_closes_the_segments_client(openai_stub: OpenAIStub) -> None:
    openai_stub.reply("too late", delay_s=3600)
    provider = provider_for(OpenAIModel(base_url=openai_stub.base_url, model="stub"))
    connection = provider.provider.connection  # type: ignore[attr-defined]

    async with provider:
        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                tg.start_soon(lambda: provider.complete(QUESTION, (), round_index=0))
                await openai_stub.wait_for_requests(1)
                assert connection.open
                tg.cancel_scope.cancel()
        closed = not connection.open

    assert tg.cancel_scope.cancelled_caught
    assert closed
