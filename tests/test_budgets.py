"""Budgets that brake by themselves (issue 18, item 3): a run that reaches its deadline, its tokens or its cost
is stopped like an operator's cancel: status cancelled, reason deadline_exceeded or budget_exceeded,
``cancel.requested_by = "budget"``, the call in flight cut off and recorded cancelled (docs/usage.md,
"Budgets"). The admission's rules are unit tests; the rest runs on real workers, Redis, RabbitMQ, MCP servers
and llm-mock-api."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from runbrake.broker.render import render_run
from runbrake.shared import (
    AsyncRunStore,
    CancelRequested,
    RunRecord,
    RunStatus,
    RunStep,
    RunStore,
    Settings,
    StepError,
    StepKind,
    TerminationReason,
    ToolOutcome,
)
from runbrake.shared.budget import Budget
from runbrake.shared.catalog import Admission, Catalog
from runbrake.shared.errors import ConfigError, SpecError
from runbrake.shared.messaging.producer import Producer
from runbrake.shared.records import MAX_CALL_TOKENS, read_record
from runbrake.shared.spec import RunSpec
from runbrake.worker.budget import BudgetGuard
from runbrake.worker.registry import ActiveRuns
from tests.catalog_helpers import add_to_catalog
from tests.llm_mock import LlmMock, reply
from tests.mcp_helpers import Toolbox, matching_events, wait_for_event
from tests.polling import poll_until
from tests.ports import free_port
from tests.test_cli import assert_clean_failure, runbrake, write_spec
from tests.worker_helpers import WorkerProcess, call, scrape_metrics, spec, wait_for_run

WAIT_S = 30.0
MODEL = {"provider": "openai", "base_url": "http://127.0.0.1:9/v1", "model": "m"}
PRICED = {**MODEL, "input_usd_per_mtok": 2.0, "output_usd_per_mtok": 8.0}


def problems(data: dict[str, Any], catalog: Catalog) -> dict[str, str]:
    with pytest.raises(SpecError) as raised:
        Admission(catalog).admit(RunSpec.parse(data))
    return {p.field: p.msg for p in raised.value.problems}


# -- admission -----------------------------------------------------------------------------------


def test_a_budget_with_an_unknown_key_or_a_bound_out_of_range_is_refused_naming_the_field() -> None:
    with pytest.raises(SpecError) as raised:
        RunSpec.parse({"input": "x", "model": "m", "budget": {
            "deadline": 5, "deadline_s": 0, "max_total_tokens": 10**13, "max_cost_usd": -1}})
    assert {p.field for p in raised.value.problems} == {
        "budget.deadline", "budget.deadline_s", "budget.max_total_tokens", "budget.max_cost_usd"}


def test_a_cost_budget_on_a_model_without_prices_is_refused() -> None:
    catalog = Catalog.parse({"models": {"plain": MODEL, "half": {**MODEL, "input_usd_per_mtok": 1.0}}})
    for model in ("plain", "half"):
        found = problems({"input": "x", "model": model, "budget": {"max_cost_usd": 1.0}}, catalog)
        assert list(found) == ["budget.max_cost_usd"]
        assert "has none (input_usd_per_mtok and output_usd_per_mtok" in found["budget.max_cost_usd"]
    inline = Admission(Catalog.empty(), allow_inline=True)
    with pytest.raises(SpecError, match=r"budget\.max_cost_usd: needs the model's prices, and an inline model"):
        inline.admit(RunSpec.parse({"input": "x", "model": {"provider": "scripted", "turns": [{"content": "ok"}]},
                                    "budget": {"max_cost_usd": 1.0}}))


def test_max_total_tokens_above_the_catalog_cap_is_refused_and_left_out_takes_the_default_else_the_cap() -> None:
    catalog = Catalog.parse({"models": {
        "capped": {**PRICED, "caps": {"max_total_tokens": 1000}},
        "defaulted": {**MODEL, "defaults": {"max_total_tokens": 300, "temperature": 0.1},
                      "caps": {"max_total_tokens": 1000}}}})
    admission = Admission(catalog)

    assert problems({"input": "x", "model": "capped", "budget": {"max_total_tokens": 1001}}, catalog) == {
        "budget.max_total_tokens": "is 1001; the catalog model 'capped' caps it at 1000 "
                                   "(models.capped.caps.max_total_tokens)"}
    capped = admission.admit(RunSpec.parse({"input": "x", "model": "capped", "budget": {"max_cost_usd": 0.5}}))
    assert (capped.budget.max_total_tokens, capped.budget.max_cost_usd) == (1000, 0.5)
    assert capped.budget.prices is not None
    assert capped.budget.prices.cost_usd(1_000_000, 500_000) == 6.0
    defaulted = admission.admit(RunSpec.parse({"input": "x", "model": "defaulted"}))
    assert (defaulted.budget.max_total_tokens, defaulted.budget.prices) == (300, None)
    assert defaulted.model_settings.temperature == 0.1
    given = admission.admit(RunSpec.parse({"input": "x", "model": "defaulted", "budget": {"max_total_tokens": 900,
                                                                                           "deadline_s": 60}}))
    assert (given.budget.max_total_tokens, given.budget.deadline_s) == (900, 60)


def test_a_catalog_default_above_its_cap_or_a_negative_price_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"models\.m\.defaults\.max_total_tokens"):
        Catalog.parse({"models": {"m": {**MODEL, "defaults": {"max_total_tokens": 9},
                                        "caps": {"max_total_tokens": 5}}}})
    with pytest.raises(ConfigError, match=r"models\.m\.input_usd_per_mtok: Input should be greater than or equal"):
        Catalog.parse({"models": {"m": {**MODEL, "input_usd_per_mtok": -1.0, "output_usd_per_mtok": 1.0}}})


def test_the_record_shows_the_budget_and_its_use_and_the_cost_where_prices_are_known() -> None:
    fields = {"status": "running", "created_at": "1000.5", "input_tokens": "200", "output_tokens": "30",
              "model_calls": "1", "cost_usd": "0.00064",
              "request": '{"input": "x", "model": "m", "budget": {"deadline_s": 60, "max_cost_usd": 0.01}}'}
    data = read_record("0" * 32, fields, (), None).to_dict()
    assert data["budget"] == {"deadline_s": 60, "max_cost_usd": 0.01}
    assert data["budget_use"] == {"tokens": 230, "cost_usd": 0.00064, "deadline_at": 1060.5}
    assert data["usage"]["cost_usd"] == 0.00064
    plain = read_record("0" * 32, {**fields, "cost_usd": "", "request": '{"input": "x"}'}, (), None).to_dict()
    assert (plain["budget"], plain["budget_use"], "cost_usd" in plain["usage"]) == (None, None, False)


# -- runs ----------------------------------------------------------------------------------------


def stopped_by_budget(record: RunRecord, reason: TerminationReason) -> None:
    assert (record.status, record.termination_reason) == (RunStatus.CANCELLED, reason)
    assert record.cancel is not None
    assert record.cancel.requested_by == "budget"


def priced_spec(mock: LlmMock, toolbox: Toolbox, **fields: Any) -> RunSpec:
    add_to_catalog({"toolbox": toolbox.spec}, models={"priced": {
        "provider": "openai", "base_url": mock.openai_url, "model": "gpt-mock", "input_usd_per_mtok": 2.0,
        "output_usd_per_mtok": 8.0}})
    return RunSpec.parse({"input": "What is 2 + 3?", "model": "priced", "mcp_servers": ["toolbox"], **fields})


@pytest.mark.integration
def test_a_deadline_that_passes_in_a_tool_call_cuts_the_call_off_and_cancels_the_run(
    toolbox_http: Toolbox, worker: WorkerProcess, producer: Producer, store: RunStore
) -> None:
    run = producer.enqueue(spec({"toolbox": toolbox_http.spec}, [
        {"tool_calls": [call("slow", seconds=120)]}, {"tool_calls": [call("get-sum", a=1, b=2)]},
        {"content": "never reached"}], budget={"deadline_s": 8}))
    wait_for_event(toolbox_http.events, "started", tool="slow", timeout=WAIT_S)

    record = wait_for_run(store, run.run_id, timeout=WAIT_S)
    worker.wait_for_log("run_segment_ended", run_id=run.run_id, outcome="cancelled", timeout=WAIT_S)

    stopped_by_budget(record, TerminationReason.DEADLINE_EXCEEDED)
    record = store.get(run.run_id)
    assert [(s.kind, s.tool_outcome) for s in record.steps] == [(StepKind.MODEL, None),
                                                                (StepKind.TOOL, ToolOutcome.CANCELLED)]
    assert record.cancel is not None
    assert "budget.deadline_s" in record.cancel.reason
    assert record.cancel.requested_at >= record.created_at + 8
    wait_for_event(toolbox_http.events, "cancelled", tool="slow", timeout=WAIT_S)  # the server saw it cut off
    assert matching_events(toolbox_http.events, "started", tool="get-sum") == []
    data = record.to_dict()
    assert data["budget"] == {"deadline_s": 8}
    assert data["budget_use"] == {"tokens": 0, "cost_usd": None, "deadline_at": record.created_at + 8}


@pytest.mark.integration
def test_a_token_budget_reached_by_a_model_call_stops_the_run_before_any_further_call(
    llm_mock: LlmMock, toolbox_http: Toolbox, start_worker: Callable[..., WorkerProcess], producer: Producer,
    store: RunStore,
) -> None:
    metrics_port = free_port()
    worker = start_worker(RUNBRAKE_METRICS_PORT=str(metrics_port))
    llm_mock.server.when("2 + 3").reply(reply(tools=[("toolbox__get-sum", {"a": 2, "b": 3}, "call_1")],
                                              usage=(150, 60)))
    run = producer.enqueue(priced_spec(llm_mock, toolbox_http, budget={"max_total_tokens": 200}))

    record = wait_for_run(store, run.run_id, timeout=WAIT_S)
    worker.wait_for_log("run_segment_ended", run_id=run.run_id, outcome="cancelled", timeout=WAIT_S)

    stopped_by_budget(record, TerminationReason.BUDGET_EXCEEDED)
    # The worker's metrics count the run by the reason its record has, not as an operator's cancel.
    finished = {labels: value for (name, labels), value in scrape_metrics(metrics_port).items()
                if name == "runbrake_runs_finished_total"}
    assert finished == {(("reason", "budget_exceeded"), ("status", "cancelled")): 1.0}
    assert record.cancel is not None
    assert "used 210 tokens; its budget is 200" in record.cancel.reason
    assert [s.kind for s in record.steps] == [StepKind.MODEL]
    assert len(llm_mock.requests()) == 1
    assert matching_events(toolbox_http.events, "started") == []
    assert record.to_dict()["budget_use"]["tokens"] == record.usage.total_tokens == 210


@pytest.mark.integration
def test_a_cost_budget_counts_the_catalog_prices_across_model_calls_and_stops_the_run(
    llm_mock: LlmMock, toolbox_http: Toolbox, worker: WorkerProcess, producer: Producer, store: RunStore
) -> None:
    llm_mock.server.when("2 + 3").reply(reply(tools=[("toolbox__get-sum", {"a": 2, "b": 3}, "call_1")],
                                              usage=(200, 30))).times(1)
    llm_mock.server.when_tool_result("call_1").reply(reply(tools=[("toolbox__get-sum", {"a": 5, "b": 1}, "call_2")],
                                                           usage=(321, 42)))
    run = producer.enqueue(priced_spec(llm_mock, toolbox_http, budget={"max_cost_usd": 0.001}))

    record = wait_for_run(store, run.run_id, timeout=WAIT_S)

    stopped_by_budget(record, TerminationReason.BUDGET_EXCEEDED)
    assert [(s.kind, s.tool_outcome) for s in record.steps] == [
        (StepKind.MODEL, None), (StepKind.TOOL, ToolOutcome.OK), (StepKind.MODEL, None)]
    # 200 × 2 + 30 × 8 and 321 × 2 + 42 × 8 USD per million tokens.
    assert [s.detail["usage"]["cost_usd"] for s in record.steps if s.kind is StepKind.MODEL] == [0.00064, 0.000978]
    assert record.usage.cost_usd == pytest.approx(0.001618)
    assert record.to_dict()["usage"]["cost_usd"] == pytest.approx(0.001618)
    assert len(llm_mock.requests()) == 2
    assert len(matching_events(toolbox_http.events, "finished", tool="get-sum")) == 1  # call_2 never started


@pytest.mark.integration
def test_a_cost_budget_on_a_model_without_prices_is_refused_at_enqueue_and_nothing_is_written(
    llm_mock: LlmMock, toolbox_http: Toolbox, producer: Producer, store: RunStore, tmp_path: Path
) -> None:
    add_to_catalog({"toolbox": toolbox_http.spec}, models={"plain": {
        "provider": "openai", "base_url": llm_mock.openai_url, "model": "gpt-mock"}})
    data = {"input": "x", "model": "plain", "mcp_servers": ["toolbox"], "budget": {"max_cost_usd": 1}}
    with pytest.raises(SpecError, match=r"budget\.max_cost_usd"):
        producer.enqueue(RunSpec.parse(data))
    result = runbrake("enqueue", str(write_spec(tmp_path / "spec.json", data)))

    assert_clean_failure(result, 2, "budget.max_cost_usd")
    assert store.recent() == []
    assert llm_mock.requests() == []


@pytest.mark.integration
def test_a_queued_run_past_its_deadline_is_cancelled_at_claim_before_any_call(
    toolbox_http: Toolbox, start_worker: Callable[..., WorkerProcess], producer: Producer, store: RunStore
) -> None:
    run = producer.enqueue(spec({"toolbox": toolbox_http.spec}, [
        {"tool_calls": [call("get-sum", a=1, b=2)]}, {"content": "too late"}], budget={"deadline_s": 0.5}))
    created_at = store.get(run.run_id).created_at
    poll_until(lambda: time.time() > created_at + 0.5, timeout=WAIT_S, failure=lambda: "the clock stood still")

    worker = start_worker()
    worker.wait_for_log("run_segment_ended", run_id=run.run_id, outcome="cancelled", timeout=WAIT_S)

    record = store.get(run.run_id)
    stopped_by_budget(record, TerminationReason.DEADLINE_EXCEEDED)
    assert record.steps == ()
    assert matching_events(toolbox_http.events, "started") == []


@pytest.mark.integration
def test_a_deadline_is_counted_from_enqueue_across_a_hand_over(
    toolbox_http: Toolbox, start_worker: Callable[..., WorkerProcess], producer: Producer, store: RunStore
) -> None:
    first = start_worker(RUNBRAKE_DRAIN_S="1")
    deadline_s = 20
    run = producer.enqueue(spec({"toolbox": toolbox_http.spec}, [
        {"tool_calls": [call("slow", seconds=120)]}, {"tool_calls": [call("slow", seconds=120)]},
        {"content": "never reached"}], budget={"deadline_s": deadline_s}))
    wait_for_event(toolbox_http.events, "started", tool="slow", timeout=WAIT_S)
    second = start_worker()  # started while the first holds the run: the hand-over reaches it at once
    first.process.send_signal(signal.SIGTERM)
    assert first.process.wait(timeout=WAIT_S) == 0

    second.wait_for_log("run_segment_ended", run_id=run.run_id, outcome="cancelled", timeout=WAIT_S + deadline_s)

    record = store.get(run.run_id)
    stopped_by_budget(record, TerminationReason.DEADLINE_EXCEEDED)
    steps = [(s.kind, s.tool_outcome) for s in record.steps]
    handed_over = [(StepKind.MODEL, None), (StepKind.TOOL, ToolOutcome.CANCELLED), (StepKind.HANDOFF, None)]
    # The second worker's slow call is cut off by the deadline; on a machine so loaded that the second claim
    # comes after the deadline, the claim stops the run before any call: either way, counted from enqueue.
    assert steps in ([*handed_over, (StepKind.MODEL, None), (StepKind.TOOL, ToolOutcome.CANCELLED)], handed_over)
    assert record.segments == 2
    resumed_at = record.started_at  # the second claim's
    assert record.cancel is not None
    assert resumed_at is not None
    # From enqueue, not from the second segment's claim: the fence came before that claim's own deadline.
    assert record.created_at + deadline_s <= record.cancel.requested_at < resumed_at + deadline_s


def test_show_prints_the_budget_and_its_use_in_english_and_german() -> None:
    fields = {"status": "cancelled", "termination_reason": "budget_exceeded", "created_at": "1000.5",
              "input_tokens": "200", "output_tokens": "30", "model_calls": "1", "cost_usd": "0.00064",
              "model": "priced", "request": '{"input": "x", "model": "priced", "budget": {"deadline_s": 60, '
                                            '"max_total_tokens": 200, "max_cost_usd": 0.01}}'}
    record = read_record("0" * 32, fields, (), None)

    english, german = render_run(record, "en"), render_run(record, "de")

    assert "Reason: budget exceeded" in english
    assert ("Budget: tokens 230/200, cost 0.000640/0.01 USD, deadline 1970-01-01 00:17:40.500Z"
            in english.splitlines()[4])
    assert "Grund: Budget überschritten" in german
    assert "Budget: Tokens 230/200, Kosten 0.000640/0.01 USD, Frist 1970-01-01 00:17:40.500Z" in german
    running = read_record("0" * 32, {**fields, "status": "running", "termination_reason": ""}, (), None)
    assert " s left)" in render_run(running, "en")
    assert " s übrig)" in render_run(running, "de")


@pytest.mark.integration
def test_a_run_approved_after_its_deadline_is_cancelled_at_the_resumes_claim_and_the_call_is_never_made(
    toolbox_http: Toolbox, worker: WorkerProcess, producer: Producer, store: RunStore
) -> None:
    """A run waiting for approval holds no worker and spends nothing: it is stopped when it would go on."""
    run = producer.enqueue(spec({"toolbox": toolbox_http.spec}, [
        {"tool_calls": [call("get-sum", a=1, b=2)]}, {"content": "too late"}],
        approval_required=["toolbox.get-sum"], budget={"deadline_s": 2}))
    record = wait_for_run(store, run.run_id, lambda r: r.status is RunStatus.WAITING_FOR_APPROVAL, timeout=WAIT_S)
    poll_until(lambda: time.time() > record.created_at + 2, timeout=WAIT_S, failure=lambda: "the clock stood still")

    approved = runbrake("approve", run.run_id)
    assert approved.returncode == 0, approved.stderr
    worker.wait_for_log("run_segment_ended", run_id=run.run_id, outcome="cancelled", timeout=WAIT_S)

    record = store.get(run.run_id)
    stopped_by_budget(record, TerminationReason.DEADLINE_EXCEEDED)
    assert [s.kind for s in record.steps] == [StepKind.MODEL, StepKind.APPROVAL]
    assert matching_events(toolbox_http.events, "started") == []


@pytest.mark.integration
@pytest.mark.anyio
async def test_a_cancel_that_won_first_stays_the_operators_when_the_budget_is_reached_after_it(
    settings: Settings, store: RunStore
) -> None:
    run_id = store.create(RunSpec.parse({"input": "x", "model": {"provider": "scripted", "turns": [
        {"content": "ok"}]}, "budget": {"max_total_tokens": 10}}).raw).run_id
    store.claim(run_id, "w", lease_s=60)
    assert store.cancel(run_id, reason="operator stop", requested_by="ops").won
    async_store = AsyncRunStore.connect(settings)
    try:
        guard = BudgetGuard(async_store, ActiveRuns(), run_id, Budget(max_total_tokens=10))
        step = RunStep(kind=StepKind.MODEL, round=1, detail={"usage": {"input_tokens": 8, "output_tokens": 4}})
        with pytest.raises(CancelRequested):  # the run is cancelled: it stops, but the fence was not the budget's
            await guard.counted(step)
    finally:
        await async_store.aclose()

    record = store.get(run_id)
    assert (record.status, record.termination_reason) == (RunStatus.CANCELLED, TerminationReason.CANCELLED)
    assert record.cancel is not None
    assert (record.cancel.reason, record.cancel.requested_by) == ("operator stop", "ops")


# -- usage counts ----------------------------------------------------------------------------------


@pytest.mark.integration
def test_a_usage_count_above_the_bound_is_refused_and_one_at_the_bound_is_kept_exactly(
    llm_mock: LlmMock, toolbox_http: Toolbox, worker: WorkerProcess, producer: Producer, store: RunStore
) -> None:
    """Issue 27: a model endpoint answering with 2**53 + 1 input tokens was stored as 0, and the run's token
    budget never saw them."""
    llm_mock.server.when("2 + 3").reply(reply("five", usage=(2**53 + 1, 1))).times(1)
    llm_mock.server.when("2 + 3").reply(reply("five", usage=(MAX_CALL_TOKENS, 7)))
    huge = producer.enqueue(priced_spec(llm_mock, toolbox_http, budget={"max_total_tokens": 1000}))
    record = wait_for_run(store, huge.run_id, timeout=WAIT_S)

    assert (record.status, record.termination_reason) == (RunStatus.FAILED, TerminationReason.PROVIDER_FAILED)
    assert f"reported {2**53 + 1} input tokens" in (record.error or ""), record.error
    assert (record.usage.input_tokens, record.usage.model_calls) == (0, 0)  # nothing counted as another number

    exact = producer.enqueue(priced_spec(llm_mock, toolbox_http))
    kept = wait_for_run(store, exact.run_id, timeout=WAIT_S)
    assert kept.status is RunStatus.COMPLETED, kept.error
    assert (kept.usage.input_tokens, kept.usage.output_tokens) == (MAX_CALL_TOKENS, 7)
    assert kept.to_dict()["usage"]["total_tokens"] == MAX_CALL_TOKENS + 7
    assert kept.steps[0].detail["usage"]["input_tokens"] == MAX_CALL_TOKENS


def test_a_step_whose_usage_is_above_the_bound_is_refused_and_nothing_is_appended(store: RunStore) -> None:
    run_id = store.create({"input": "x", "model": {"provider": "scripted", "turns": [{"content": "hi"}]}}).run_id
    step = RunStep(kind=StepKind.MODEL, round=1, content="hi",
                   detail={"usage": {"input_tokens": 2**53, "output_tokens": 1}})

    with pytest.raises(StepError, match=r"detail.usage.input_tokens is 9007199254740992"):
        store.append_step(run_id, step)
    assert store.get(run_id).steps == ()
