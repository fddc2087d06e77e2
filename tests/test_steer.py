"""Steer: stop the current turn and go on with a new user message, in the same run (docs/cancellation.md,
"Steer"; issue 18, item 1).

Real worker processes, the toolbox MCP server over HTTP (its events file says when each call started), real
Redis and RabbitMQ; the model is PyPI ``llm-mock-api`` (tests/llm_mock.py) where what the model receives
matters, the scripted provider elsewhere.
"""

from __future__ import annotations

import hashlib
import json
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx2
import pytest

from runbrake.broker import Client
from runbrake.broker.client import ApiError
from runbrake.shared import RunRecord, RunSpec, RunStatus, RunStore, Settings, StepKind, TerminationReason, ToolOutcome
from runbrake.shared.errors import RunNotFound, SpecError, TransitionRefused
from runbrake.shared.messaging.cancel import CancelPublisher, cancel_run
from runbrake.shared.messaging.producer import Producer
from runbrake.shared.messaging.steer import SteerResult
from runbrake.shared.operations import steer
from runbrake.shared.records import SteerRequest
from runbrake.shared.spec import OnCancel
from runbrake.shared.timeline import step_outcome
from tests.api_helpers import ApiProcess, write_tokens
from tests.catalog_helpers import add_to_catalog
from tests.llm_mock import LlmMock, held_reply, reply
from tests.mcp_helpers import Toolbox, matching_events, wait_for_event
from tests.test_cli import runbrake
from tests.worker_helpers import WorkerProcess, call, has_step, spec, wait_for_run

pytestmark = pytest.mark.integration

BACKSTOP_OFF = {"RUNBRAKE_CANCEL_POLL_MS": "600000"}
"""Ten minutes between backstop polls: within a test only the wake-up (or the probe) delivers a steer."""
WAIT_S = 30.0
MAX_INPUT_CHARS = 100_000



def _steer(store: RunStore, publisher: CancelPublisher, producer: Producer, run_id: str, text: Any,
           reason: Any = "change of plan") -> SteerResult:
    return steer(store, publisher, producer, run_id, text=text, reason=reason, requested_by="test",
                 max_input_chars=MAX_INPUT_CHARS)


def _model_run(mock: LlmMock, toolbox: Toolbox, text: str, **extra: Any) -> RunSpec:
    add_to_catalog({"toolbox": {"transport": "http", "url": str(toolbox.spec.url)}},  # type: ignore[union-attr]
                   models={"mock": {"provider": "openai", "base_url": mock.openai_url, "model": "gpt-mock"}})
    return RunSpec.parse({"input": text, "model": "mock", "mcp_servers": ["toolbox"], **extra})


def _kinds(record: RunRecord) -> list[str]:
    return [s.kind.value for s in record.steps]


def store_steer(store: RunStore, run_id: str, text: str) -> None:
    """Store a steer without its wake-up (as if RabbitMQ had lost it, or before anyone could deliver it)."""
    request = SteerRequest(id=uuid.uuid4().hex, input=text, reason="", requested_by="test", requested_at=0.0)
    assert store.steer(run_id, request).transition.won


def assert_steered_once_and_completed(record: RunRecord, answer: str, kinds: list[str]) -> None:
    """The run completed with ``answer`` after these steps, one of them the steer, its cut-off call steered."""
    assert (record.status, record.steps[-1].content) == (RunStatus.COMPLETED, answer)
    assert _kinds(record) == kinds
    assert kinds.count("steer") == 1
    assert all(s.detail.get("reason") == "steered" for s in record.steps[:kinds.index("steer")]
               if s.kind is StepKind.TOOL)


def test_a_steer_during_a_tool_call_cuts_it_off_answers_the_call_not_started_and_the_model_gets_the_new_input(
    llm_mock: LlmMock, toolbox_http: Toolbox, start_worker: Callable[..., WorkerProcess], producer: Producer,
    store: RunStore, publisher: CancelPublisher,
) -> None:
    # One call at a time: the second call of the turn is still waiting for its place when the steer comes.
    start_worker(RUNBRAKE_MAX_PARALLEL_TOOL_CALLS="1", **BACKSTOP_OFF)
    llm_mock.server.when("book the trip").reply(reply(tools=[
        ("toolbox__slow", {"seconds": 60}, "call_slow"), ("toolbox__echo", {"text": "later"}, "call_echo"),
    ])).times(1)
    llm_mock.server.when("go by train instead").reply(reply("Booked the train."))
    run = producer.enqueue(_model_run(llm_mock, toolbox_http, "book the trip"))
    wait_for_event(toolbox_http.events, "started", tool="slow", timeout=WAIT_S)

    result = _steer(store, publisher, producer, run.run_id, "go by train instead", reason="the flight is full")

    assert (result.found, result.message_confirmed) == (RunStatus.RUNNING, True)
    record = wait_for_run(store, run.run_id, timeout=WAIT_S)
    assert (record.status, record.termination_reason) == (RunStatus.COMPLETED, TerminationReason.COMPLETED)
    assert _kinds(record) == ["model", "tool", "tool", "steer", "model"]
    slow, echo = record.steps[1:3]
    # The call in flight cut off, the one not started answered: both cancelled, steered, each side effect said.
    assert [(s.tool_call_id, s.tool_outcome, s.detail["reason"], s.detail["side_effects"]) for s in (slow, echo)] == [
        ("call_slow", ToolOutcome.CANCELLED, "steered", "unknown"),
        ("call_echo", ToolOutcome.CANCELLED, "steered", "none")]
    assert matching_events(toolbox_http.events, "started", tool="echo") == []  # never sent
    steered = record.steps[3]
    assert steered.detail["input"] == "go by train instead"
    assert (steered.detail["reason"], steered.detail["requested_by"]) == ("the flight is full", "test")
    assert record.steps[-1].content == "Booked the train."
    assert record.input == "book the trip"  # the run's input stays the original
    # Not a cancel: no cancel request was ever stored.
    assert record.cancel is None
    # The model saw every earlier call answered, then the new message.
    second = llm_mock.bodies()[1]["messages"]
    assert [(m["role"], m.get("tool_call_id")) for m in second] == [
        ("user", None), ("assistant", None), ("tool", "call_slow"), ("tool", "call_echo"), ("user", None)]
    assert second[-1]["content"] == "go by train instead"
    assert store.pending_steer(run.run_id) is None  # consumed when applied


def test_a_steer_of_a_run_waiting_for_approval_answers_the_waiting_call_and_puts_the_run_back_to_work(
    toolbox_http: Toolbox, worker: WorkerProcess, producer: Producer, store: RunStore, publisher: CancelPublisher,
) -> None:
    run = producer.enqueue(spec({"toolbox": toolbox_http.spec}, [
        {"tool_calls": [call("echo", text="needs a yes")]},
        {"content": "went on without it"},
    ], approval_required=["toolbox.echo"]))
    wait_for_run(store, run.run_id, lambda r: r.status is RunStatus.WAITING_FOR_APPROVAL, timeout=WAIT_S)

    result = _steer(store, publisher, producer, run.run_id, "skip that, just answer")

    assert result.found is RunStatus.WAITING_FOR_APPROVAL
    record = wait_for_run(store, run.run_id, timeout=WAIT_S)
    assert (record.status, record.steps[-1].content) == (RunStatus.COMPLETED, "went on without it")
    assert _kinds(record) == ["model", "tool", "steer", "model"]
    answered = record.steps[1]
    assert (answered.tool_outcome, answered.detail["reason"], answered.detail["side_effects"]) == (
        ToolOutcome.CANCELLED, "steered", "none")
    assert matching_events(toolbox_http.events, "started", tool="echo") == []  # no approval needed, none made


def test_a_cancel_after_a_steer_wins_and_the_run_ends_cancelled(
    toolbox_http: Toolbox, worker: WorkerProcess, producer: Producer, store: RunStore, publisher: CancelPublisher,
) -> None:
    run = producer.enqueue(spec({"toolbox": toolbox_http.spec}, [
        {"tool_calls": [call("slow", seconds=60, note="first")]},
        {"tool_calls": [call("slow", seconds=60, note="second")]},
        {"content": "never reached"},
    ]))
    wait_for_event(toolbox_http.events, "started", tool="slow", timeout=WAIT_S)

    _steer(store, publisher, producer, run.run_id, "do something else")
    assert cancel_run(store, publisher, run.run_id, reason="stop after all", requested_by="test").won

    worker.wait_for_log("run_segment_ended", run_id=run.run_id, timeout=WAIT_S)
    record = store.get(run.run_id)
    assert (record.status, record.termination_reason) == (RunStatus.CANCELLED, TerminationReason.CANCELLED)
    assert _kinds(record).count("steer") <= 1
    assert not any(s.kind is StepKind.MODEL and s.content == "never reached" for s in record.steps)
    assert worker.logged("run_segment_ended", run_id=run.run_id)[0]["outcome"] == "cancelled"


def test_a_steer_of_a_finished_run_is_refused_naming_its_status_and_an_unknown_run_is_not_found(
    worker: WorkerProcess, producer: Producer, store: RunStore, publisher: CancelPublisher,
) -> None:
    run = producer.enqueue(RunSpec.parse({"input": "hi", "model": {"provider": "scripted",
                                                                    "turns": [{"content": "hello"}]}}))
    wait_for_run(store, run.run_id, timeout=WAIT_S)

    with pytest.raises(TransitionRefused) as refused:
        _steer(store, publisher, producer, run.run_id, "too late")
    assert refused.value.found is RunStatus.COMPLETED
    assert "completed" in str(refused.value)
    with pytest.raises(RunNotFound):
        _steer(store, publisher, producer, "0" * 32, "nobody")
    assert store.pending_steer(run.run_id) is None
    assert not has_step("steer")(store.get(run.run_id))


@pytest.mark.parametrize(("text", "reason", "field"), [
    ("", "why", "input"), ("   ", "why", "input"), (None, "why", "input"),
    ("x" * (MAX_INPUT_CHARS + 1), "why", "input"), ("fine", "r" * 1001, "reason"),
])
def test_a_steer_with_an_empty_or_too_long_input_or_reason_is_refused_naming_the_field_and_writes_nothing(
    store: RunStore, producer: Producer, publisher: CancelPublisher, text: Any, reason: Any, field: str,
) -> None:
    created = store.create({"input": "x", "model": {"provider": "scripted", "turns": [{"content": "y"}]}})

    with pytest.raises(SpecError) as refused:
        _steer(store, publisher, producer, created.run_id, text, reason)

    assert [p.field for p in refused.value.problems] == [field]
    assert store.pending_steer(created.run_id) is None


def test_a_second_steer_before_the_first_is_applied_is_refused_and_the_first_stays_as_it_was(
    store: RunStore,
) -> None:
    created = store.create({"input": "x", "model": {"provider": "scripted", "turns": [{"content": "y"}]}})
    assert store.claim(created.run_id, "owner-1", lease_s=60).won
    first = SteerRequest(id="a" * 32, input="first", reason="", requested_by="t", requested_at=1.0)

    assert store.steer(created.run_id, first).transition.won
    again = store.steer(created.run_id, SteerRequest(id="b" * 32, input="second", reason="", requested_by="t",
                                                     requested_at=2.0))

    assert (again.transition.won, again.pending, again.transition.found) == (False, True, RunStatus.RUNNING)
    assert store.pending_steer(created.run_id) == first


def test_a_queued_run_cannot_be_steered(store: RunStore) -> None:
    created = store.create({"input": "x", "model": {"provider": "scripted", "turns": [{"content": "y"}]}})

    steered = store.steer(created.run_id, SteerRequest(id="a" * 32, input="now", reason="", requested_by="t",
                                                       requested_at=1.0))

    assert (steered.transition.won, steered.transition.found) == (False, RunStatus.QUEUED)
    assert store.pending_steer(created.run_id) is None


# -- the entry points: the HTTP API, the client, the CLI ------------------------------------------------


def test_steer_through_the_api_and_the_client_answers_202_then_409_once_finished_and_404_for_an_unknown_run(
    api: ApiProcess, worker: WorkerProcess, toolbox_http: Toolbox, store: RunStore,
) -> None:
    with Client(api.url) as client:
        run_id = client.enqueue(spec({"toolbox": toolbox_http.spec}, [
            {"tool_calls": [call("slow", seconds=60)]}, {"content": "on the new course"}]).raw)["run_id"]
        wait_for_event(toolbox_http.events, "started", tool="slow", timeout=WAIT_S)
        steered = client.steer(run_id, "change course", reason="from the API")
        record = wait_for_run(store, run_id, timeout=WAIT_S)
        with pytest.raises(ApiError) as late:
            client.steer(run_id, "too late")
        with pytest.raises(ApiError) as unknown:
            client.steer("f" * 32, "nobody")

    assert steered == {"run_id": run_id, "steered": True, "found": "running", "message_confirmed": True}
    assert (record.status, record.steps[-1].content) == (RunStatus.COMPLETED, "on the new course")
    steer_step = next(s for s in record.steps if s.kind is StepKind.STEER)
    assert (steer_step.detail["requested_by"], steer_step.detail["reason"]) == ("anonymous", "from the API")
    assert (late.value.status_code, late.value.body["status"]) == (409, "completed")
    assert unknown.value.status_code == 404


@pytest.mark.parametrize(("body", "loc"), [
    ({}, ["body", "input"]), ({"input": ""}, ["body", "input"]), ({"input": "   "}, ["body", "input"]),
    ({"input": 3}, ["body", "input"]), ({"input": "ok", "reason": "r" * 1001}, ["body", "reason"]),
    ({"input": "ok", "extra": 1}, ["body", "extra"]),
])
def test_a_bad_steer_body_is_422_naming_the_field_and_nothing_is_stored(
    api: ApiProcess, store: RunStore, body: dict[str, Any], loc: list[str],
) -> None:
    run_id = store.create({"input": "x", "model": {"provider": "scripted", "turns": [{"content": "y"}]}}).run_id
    assert store.claim(run_id, "owner-1", lease_s=60).won

    with httpx2.Client(base_url=api.url) as http:
        answer = http.post(f"/v1/runs/{run_id}/steer", json=body)
        too_long = http.post(f"/v1/runs/{run_id}/steer", json={"input": "x" * (MAX_INPUT_CHARS + 1)})

    assert answer.status_code == 422
    assert [e["loc"] for e in answer.json()["errors"]] == [loc]
    assert too_long.status_code == 422
    assert [e["loc"] for e in too_long.json()["errors"]] == [["body", "input"]]
    assert "RUNBRAKE_MAX_INPUT_CHARS" in too_long.json()["errors"][0]["msg"]
    assert store.pending_steer(run_id) is None


def test_a_steer_needs_the_operate_role_and_a_tenant_steers_only_its_own_runs(
    start_api: Callable[..., ApiProcess], tmp_path: Path, store: RunStore,
) -> None:
    tokens = write_tokens(tmp_path / "tokens.toml", {"ops": ("t-ops", ["operate"]), "sub": ("t-sub", ["submit"])})
    digest = hashlib.sha256(b"t-alpha").hexdigest()
    tokens.write_text(tokens.read_text()
                      + f'[tokens.alpha]\nsha256 = "{digest}"\nroles = ["operate"]\ntenant = "alpha"\n')
    api = start_api(tokens=tokens)
    run_id = store.create({"input": "x", "model": {"provider": "scripted", "turns": [{"content": "y"}]}}).run_id
    assert store.claim(run_id, "owner-1", lease_s=60).won
    missing = "0" * 32

    def as_(token: str, run: str) -> httpx2.Response:
        return http.post(f"/v1/runs/{run}/steer", json={"input": "x"}, headers={"Authorization": f"Bearer {token}"})

    with httpx2.Client(base_url=api.url) as http:
        submitter, theirs, absent = as_("t-sub", run_id), as_("t-alpha", run_id), as_("t-alpha", missing)
        operator = as_("t-ops", run_id)

    assert submitter.status_code == 403
    assert theirs.status_code == absent.status_code == 404
    assert theirs.text == absent.text.replace(missing, run_id)
    assert operator.status_code == 202
    pending = store.pending_steer(run_id)
    assert pending is not None
    assert pending.requested_by == "ops"


def test_runbrake_steer_exits_0_1_or_2_and_says_what_it_did(store: RunStore, rabbitmq: Settings) -> None:
    running = store.create({"input": "x", "model": {"provider": "scripted", "turns": [{"content": "y"}]}}).run_id
    assert store.claim(running, "owner-1", lease_s=60).won
    finished = store.create({"input": "x", "model": {"provider": "scripted", "turns": [{"content": "y"}]}}).run_id
    store.cancel(finished, reason="t", requested_by="t")

    bad = runbrake("steer", running, "")
    ok = runbrake("steer", running, "new plan", "--reason", "because", "--json")
    again = runbrake("steer", running, "another")
    refused = runbrake("steer", finished, "late", "--json")

    assert (bad.returncode, bad.stdout) == (2, "")
    assert "invalid steer: input" in bad.stderr
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout) == {"run_id": running, "steered": True, "found": "running",
                                     "message_confirmed": True, "message_error": None}
    assert again.returncode == 1
    assert "still waiting to be applied" in again.stderr
    assert refused.returncode == 1
    assert json.loads(refused.stdout)["found"] == "cancelled"
    pending = store.pending_steer(running)
    assert pending is not None
    assert (pending.input, pending.reason) == ("new plan", "because")


# -- how a steer reaches the run ---------------------------------------------------------------------------


def test_a_steer_whose_wake_up_is_lost_is_found_by_the_backstop_and_applied_once(
    toolbox_http: Toolbox, worker: WorkerProcess, producer: Producer, store: RunStore,
) -> None:
    run = producer.enqueue(spec({"toolbox": toolbox_http.spec}, [
        {"tool_calls": [call("slow", seconds=60)]}, {"content": "found by the poll"}]))
    wait_for_event(toolbox_http.events, "started", tool="slow", timeout=WAIT_S)

    store_steer(store, run.run_id, "poll me")

    record = wait_for_run(store, run.run_id, timeout=WAIT_S)
    assert_steered_once_and_completed(record, "found by the poll", ["model", "tool", "steer", "model"])
    assert worker.logged("steer_found_by_backstop", run_id=run.run_id)
    assert len(worker.logged("run_steer_applied", run_id=run.run_id)) == 1


def test_a_steer_lets_a_finish_call_complete_records_its_real_result_then_applies(
    toolbox_http: Toolbox, start_worker: Callable[..., WorkerProcess], producer: Producer, store: RunStore,
    publisher: CancelPublisher,
) -> None:
    start_worker(**BACKSTOP_OFF)
    finishing = toolbox_http.spec.model_copy(update={"tools_on_cancel": {"slow": OnCancel.FINISH}})
    run = producer.enqueue(spec({"toolbox": finishing}, [
        {"tool_calls": [call("slow", seconds=3)]}, {"content": "after the finish"}]))
    wait_for_event(toolbox_http.events, "started", tool="slow", timeout=WAIT_S)

    _steer(store, publisher, producer, run.run_id, "now this")

    record = wait_for_run(store, run.run_id, timeout=WAIT_S)
    assert (record.status, record.steps[-1].content) == (RunStatus.COMPLETED, "after the finish")
    assert _kinds(record) == ["model", "tool", "steer", "model"]
    assert (record.steps[1].tool_outcome, record.steps[1].content) == (ToolOutcome.OK, "slept 3.0 s")
    assert len(matching_events(toolbox_http.events, "finished", tool="slow")) == 1


def test_a_steer_during_a_model_call_records_it_interrupted_drops_its_answer_and_asks_again_with_the_new_input(
    llm_mock: LlmMock, toolbox_http: Toolbox, start_worker: Callable[..., WorkerProcess], producer: Producer,
    store: RunStore, publisher: CancelPublisher,
) -> None:
    start_worker(**BACKSTOP_OFF)
    arrived, release = threading.Event(), threading.Event()
    llm_mock.server.when("think hard").reply(held_reply(arrived, release))
    llm_mock.server.when("think less").reply(reply("Quick answer."))
    run = producer.enqueue(_model_run(llm_mock, toolbox_http, "think hard"))
    try:
        assert arrived.wait(WAIT_S)
        _steer(store, publisher, producer, run.run_id, "think less")
        record = wait_for_run(store, run.run_id, timeout=WAIT_S)
    finally:
        release.set()

    assert (record.status, record.steps[-1].content) == (RunStatus.COMPLETED, "Quick answer.")
    assert _kinds(record) == ["model", "steer", "model"]
    interrupted = record.steps[0]
    assert (interrupted.interrupted, interrupted.detail["reason"], step_outcome(interrupted)) == (
        True, "steered", "cancelled")
    # The interrupted call's answer never entered the conversation: the user's two messages, nothing between.
    last = llm_mock.bodies()[-1]["messages"]
    assert [(m["role"], m["content"]) for m in last] == [("user", "think hard"), ("user", "think less")]
    assert record.usage.model_calls == 1  # the interrupted call is not counted as an answer


def test_a_steer_stored_just_before_the_run_suspends_for_approval_puts_it_back_to_work_with_the_steer(
    toolbox_http: Toolbox, start_worker: Callable[..., WorkerProcess], producer: Producer, store: RunStore,
) -> None:
    worker = start_worker(**BACKSTOP_OFF)
    run = producer.enqueue(spec({"toolbox": toolbox_http.spec}, [
        {"delay_ms": 3000, "tool_calls": [call("echo", text="needs a yes")]},
        {"content": "the steer went first"},
    ], approval_required=["toolbox.echo"]))
    worker.wait_for_log("run_claimed", run_id=run.run_id, timeout=WAIT_S)
    # Stored without a wake-up while the model call runs: no boundary sees it before the run suspends.
    store_steer(store, run.run_id, "never mind")

    record = wait_for_run(store, run.run_id, timeout=WAIT_S)
    assert_steered_once_and_completed(record, "the steer went first", ["model", "tool", "steer", "model"])
    assert worker.logged("run_steered_while_suspending", run_id=run.run_id)
    assert matching_events(toolbox_http.events, "started", tool="echo") == []


def test_a_steer_stored_after_the_final_answer_was_given_but_before_the_run_completed_is_applied(
    toolbox_http: Toolbox, start_worker: Callable[..., WorkerProcess], producer: Producer, store: RunStore,
) -> None:
    """The race a wake-up cannot close: the steer is stored while the final model call is on its way back, and
    nothing tells the worker (no wake-up, the backstop off). The completing settle refuses while the steer waits,
    so the answer stays recorded and the run goes on with the steer (docs/cancellation.md, "Steer: the final
    answer")."""
    worker = start_worker(**BACKSTOP_OFF)
    run = producer.enqueue(spec({"toolbox": toolbox_http.spec}, [
        {"tool_calls": [call("get-sum", a=2, b=3)]}, {"content": "five", "delay_ms": 8000},
        {"content": "five, as you asked again"}]))
    wait_for_run(store, run.run_id, has_step(StepKind.TOOL), timeout=WAIT_S)  # the final model call is under way

    store_steer(store, run.run_id, "say it again")

    record = wait_for_run(store, run.run_id, timeout=WAIT_S)
    assert (record.status, record.output) == (RunStatus.COMPLETED, "five, as you asked again")
    assert _kinds(record) == ["model", "tool", "model", "steer", "model"]
    assert record.steps[1].tool_outcome is ToolOutcome.OK  # nothing was cut off: the steer came after the calls
    assert record.steps[2].content == "five"  # the answer the steer came after stays recorded
    assert record.steps[3].detail["input"] == "say it again"
    assert len(worker.logged("run_steer_applied", run_id=run.run_id)) == 1


def test_a_steer_key_holding_what_no_steer_wrote_lets_the_final_answer_stand_and_the_run_complete(
    toolbox_http: Toolbox, start_worker: Callable[..., WorkerProcess], producer: Producer, store: RunStore,
) -> None:
    """Anyone with Redis could write the steer key: the completing settle refuses while it is there, and the worker,
    finding nothing it can read in it, settles the answer as it is (logged), rather than leave the run running
    until its lease runs out."""
    worker = start_worker(**BACKSTOP_OFF)
    run = producer.enqueue(spec({"toolbox": toolbox_http.spec}, [
        {"tool_calls": [call("get-sum", a=2, b=3)]}, {"content": "five", "delay_ms": 8000}]))
    wait_for_run(store, run.run_id, has_step(StepKind.TOOL), timeout=WAIT_S)  # the final model call is under way

    store.redis.set(store.keys.steer(run.run_id), "{not a steer")

    record = wait_for_run(store, run.run_id, timeout=WAIT_S)
    assert (record.status, record.termination_reason, record.output) == (
        RunStatus.COMPLETED, TerminationReason.COMPLETED, "five")
    assert _kinds(record) == ["model", "tool", "model"]
    assert worker.logged("steer_unreadable") != []
    assert worker.logged("run_steer_applied", run_id=run.run_id) == []
