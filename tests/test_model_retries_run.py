"""Retries and the Anthropic provider in real runs: a worker process asks llm-mock-api (tests/llm_mock.py)
and, for the Anthropic run, calls PyPI ``mcp-server-time`` over stdio (docs/leases.md, "Retries")."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from runbrake.shared import RunSpec, RunStatus, RunStore, StepKind, TerminationReason, ToolOutcome, step_outcome
from runbrake.shared.messaging.cancel import CancelPublisher, cancel_run
from runbrake.shared.messaging.producer import Producer
from runbrake.shared.settings import Settings
from tests.catalog_helpers import add_to_catalog
from tests.llm_mock import LlmMock, reply
from tests.openai_stub import OpenAIStub
from tests.worker_helpers import WorkerProcess, wait_for_run

pytestmark = pytest.mark.integration

WAIT_S = 30.0
"""Generous: a run here waits out real (jittered) backoffs of up to a few seconds."""


@pytest.fixture(name="publisher")
def publisher_fixture(rabbitmq: Settings) -> Iterator[CancelPublisher]:
    publisher = CancelPublisher(rabbitmq)
    yield publisher
    publisher.close()


def _openai_run(base_url: str, **catalog: Any) -> RunSpec:
    add_to_catalog(models={"mock": {"provider": "openai", "base_url": base_url, "model": "gpt-mock", **catalog}})
    return RunSpec.parse({"input": "What is 2 + 3?", "model": "mock"})


def test_a_run_whose_model_answers_429_then_200_completes_with_two_attempts_recorded(
    llm_mock: LlmMock, worker: WorkerProcess, producer: Producer, store: RunStore
) -> None:
    llm_mock.server.next_error(429, "rate limited")
    llm_mock.server.when("2 + 3").reply(reply("Five.", usage=(20, 2)))

    record = wait_for_run(store, producer.enqueue(_openai_run(llm_mock.openai_url)).run_id, timeout=WAIT_S)

    assert (record.status, record.termination_reason) == (RunStatus.COMPLETED, TerminationReason.COMPLETED)
    [step] = record.steps
    assert (step.kind, step.content, step.detail["attempts"]) == (StepKind.MODEL, "Five.", 2)
    [retried] = step.detail["retried"]
    assert retried["status"] == 429
    assert "rate limited" in retried["error"]
    assert retried["wait_s"] >= 0
    assert len(llm_mock.requests()) == 2


def test_a_run_whose_model_answers_500_three_times_then_200_completes(
    llm_mock: LlmMock, worker: WorkerProcess, producer: Producer, store: RunStore
) -> None:
    for _ in range(3):
        llm_mock.server.next_error(500, "overloaded")
    llm_mock.server.when("2 + 3").reply(reply("Five."))

    record = wait_for_run(store, producer.enqueue(_openai_run(llm_mock.openai_url)).run_id, timeout=WAIT_S)

    assert (record.status, record.termination_reason) == (RunStatus.COMPLETED, TerminationReason.COMPLETED)
    [step] = record.steps
    assert step.detail["attempts"] == 4
    assert [r["status"] for r in step.detail["retried"]] == [500, 500, 500]
    assert len(llm_mock.requests()) == 4


def test_a_run_whose_model_answers_400_fails_at_once_with_one_attempt(
    llm_mock: LlmMock, worker: WorkerProcess, producer: Producer, store: RunStore
) -> None:
    llm_mock.server.next_error(400, "bad request")
    llm_mock.server.when("2 + 3").reply(reply("never sent"))

    record = wait_for_run(store, producer.enqueue(_openai_run(llm_mock.openai_url)).run_id, timeout=WAIT_S)

    assert (record.status, record.termination_reason) == (RunStatus.FAILED, TerminationReason.PROVIDER_FAILED)
    [step] = record.steps
    assert (step.kind, step_outcome(step), step.detail) == (StepKind.MODEL, "failed", {"attempts": 1})
    assert "bad request" in (step.error or "")
    assert len(llm_mock.requests()) == 1


def test_a_catalog_models_max_retries_bounds_the_attempts_of_a_run(
    llm_mock: LlmMock, worker: WorkerProcess, producer: Producer, store: RunStore
) -> None:
    for _ in range(4):
        llm_mock.server.next_error(503, "down")

    run = producer.enqueue(_openai_run(llm_mock.openai_url, max_retries=1))
    record = wait_for_run(store, run.run_id, timeout=WAIT_S)

    assert (record.status, record.termination_reason) == (RunStatus.FAILED, TerminationReason.PROVIDER_FAILED)
    [step] = record.steps
    assert step.detail["attempts"] == 2
    assert len(llm_mock.requests()) == 2


def test_a_cancel_during_a_backoff_wait_records_the_model_step_cancelled_and_sends_nothing_more(
    openai_stub: OpenAIStub, start_worker: Callable[..., WorkerProcess], producer: Producer, store: RunStore,
    publisher: CancelPublisher,
) -> None:
    # The stub, not llm-mock-api: the wait must be long for sure, and only a Retry-After header makes it so.
    openai_stub.reply(status=429, error_message="slow down", headers={"Retry-After": "3000"})
    openai_stub.reply("never asked for")
    worker = start_worker(RUNBRAKE_MODEL_RETRY_MAX_S="3600")

    run = producer.enqueue(_openai_run(openai_stub.base_url))
    [waiting] = worker.wait_for_log("model_call_retrying", run_id=run.run_id, timeout=WAIT_S)
    result = cancel_run(store, publisher, run.run_id, reason="operator stop", requested_by="ops@example.test")
    assert result.won, result
    outcome = worker.wait_for_log("run_segment_ended", run_id=run.run_id, timeout=WAIT_S)[0]["outcome"]

    assert (waiting["status"], waiting["wait_s"]) == (429, 3000.0)
    assert outcome == "cancelled"
    record = store.get(run.run_id)
    assert (record.status, record.termination_reason) == (RunStatus.CANCELLED, TerminationReason.CANCELLED)
    assert [(s.kind, s.interrupted, s.error, step_outcome(s)) for s in record.steps] == [
        (StepKind.MODEL, True, None, "cancelled")]
    assert len(openai_stub.requests) == 1


def test_an_anthropic_run_calls_a_real_mcp_server_and_completes_with_its_answer_and_usage(
    llm_mock: LlmMock, worker: WorkerProcess, producer: Producer, store: RunStore
) -> None:
    arguments = {"source_timezone": "Europe/London", "time": "12:00", "target_timezone": "Asia/Tokyo"}
    llm_mock.server.when("Tokyo").reply(
        reply(tools=[("time__convert_time", arguments, "toolu_1")], usage=(200, 30))).times(1)
    llm_mock.server.when_tool_result("toolu_1").reply(reply("It is evening in Tokyo.", usage=(321, 42)))
    add_to_catalog(
        {"time": {"transport": "stdio", "command": sys.executable, "args": ["-m", "mcp_server_time"]}},
        models={"claude": {"provider": "anthropic", "base_url": llm_mock.anthropic_url, "model": "claude-mock"}})
    spec = RunSpec.parse({"input": "What time is 12:00 in London in Tokyo?", "model": "claude",
                          "mcp_servers": ["time"]})
    # The run's instructions (a leading system message) are the spec's, once agent-spec lands; the provider's
    # mapping of them to `system` is tested in tests/test_anthropic_provider.py.

    record = wait_for_run(store, producer.enqueue(spec).run_id, timeout=WAIT_S)

    assert (record.status, record.termination_reason) == (RunStatus.COMPLETED, TerminationReason.COMPLETED)
    assert [s.kind for s in record.steps] == [StepKind.MODEL, StepKind.TOOL, StepKind.MODEL]
    first, tool, final = record.steps
    assert first.detail["usage"] == {"input_tokens": 200, "output_tokens": 30, "total_tokens": 230}
    assert (tool.tool_server, tool.tool_name, tool.tool_call_id, tool.tool_outcome) == (
        "time", "convert_time", "toolu_1", ToolOutcome.OK)
    assert "Asia/Tokyo" in tool.content
    assert (final.content, final.detail["usage"]) == (
        "It is evening in Tokyo.", {"input_tokens": 321, "output_tokens": 42, "total_tokens": 363})
    asked, answered = llm_mock.bodies()
    assert {t["name"] for t in asked["tools"]} == {"time__convert_time", "time__get_current_time"}
    assert [m["role"] for m in answered["messages"]] == ["user", "assistant", "user"]
    assert answered["messages"][1]["content"] == [
        {"type": "tool_use", "id": "toolu_1", "name": "time__convert_time", "input": arguments}]
    [result] = answered["messages"][2]["content"]
    assert (result["type"], result["tool_use_id"], result["content"]) == ("tool_result", "toolu_1", tool.content)
