"""A run outlives its worker (docs/leases.md, "Lost workers"): kill -9 of the worker holding runs in tool
calls, another worker up, and the runs go on there from their last recorded step, each call that was in flight
on the record once (``cancelled``, ``worker_lost``); a worker paused past detection writes and calls nothing
when it wakes; a cancel while the owner is dead still gets the call on the record; a live worker keeps its runs.

Real worker processes, the toolbox MCP server over HTTP (its events say which calls started), PyPI
``llm-mock-api`` as the model (it records every request, so a model call made twice would show), real Redis and
RabbitMQ. Detection is shortened for the tests (a beat every 0.5 s, lost after 5 s); bench/worker_loss.py
measures the defaults.
"""

from __future__ import annotations

import json
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import httpx2
import pytest
from llm_mock_api.types.reply import ReplyOptions

from runbrake.shared import RunRecord, RunSpec, RunStatus, RunStore, StepKind, TerminationReason, ToolOutcome
from runbrake.shared.messaging.cancel import cancel_run
from runbrake.shared.messaging.producer import Producer
from tests.api_helpers import ApiProcess
from tests.catalog_helpers import add_to_catalog
from tests.llm_mock import LlmMock, held_reply, reply
from tests.mcp_helpers import Toolbox, matching_events, wait_for_event
from tests.polling import poll_until
from tests.test_cli import runbrake
from tests.test_steer import store_steer
from tests.worker_helpers import WorkerProcess, servers_json, wait_for_run

pytestmark = pytest.mark.integration

FAST = {"RUNBRAKE_WORKER_BEAT_S": "0.5", "RUNBRAKE_WORKER_LOST_S": "5"}
CUT_OFF = "the call was cut off: the worker executing the run was lost"
RUNS = 3
WAIT_S = 60.0


def _catalog(mock: LlmMock, toolbox: Toolbox, *, stream: bool = True, **server: Any) -> None:
    """The catalog: model ``mock`` (streamed or not) and the toolbox entry with ``server`` (``on_worker_lost``…)."""
    add_to_catalog({"toolbox": {"transport": "http", "url": str(toolbox.spec.url), **server}},  # type: ignore[union-attr]
                   models={"mock": {"provider": "openai", "base_url": mock.openai_url, "model": "gpt-mock",
                                    "stream": stream}})


def _runs(producer: Producer, mock: LlmMock, toolbox: Toolbox, count: int, *, seconds: float = 60,
          extra: dict[str, Any] | None = None, **server: Any) -> dict[str, str]:
    """``count`` runs of the catalog model ``mock`` (their spec with ``extra``), each asking for one ``slow``
    call (its note names the run), the catalog's toolbox entry with ``server``; run id → call id."""
    _catalog(mock, toolbox, **server)
    calls = {}
    for i in range(count):
        call_id = f"call_lost_{i}"
        mock.server.when(f"lost run {i}").reply(
            reply(tools=[("toolbox__slow", {"seconds": seconds, "note": call_id}, call_id)])).times(1)
        mock.server.when_tool_result(call_id).reply(reply(f"run {i} answered after the loss"))
        spec = RunSpec.parse({"input": f"lost run {i}", "model": "mock", "mcp_servers": ["toolbox"], **(extra or {})})
        calls[producer.enqueue(spec).run_id] = call_id
    return calls


def _kill(worker: WorkerProcess) -> None:
    worker.process.send_signal(signal.SIGKILL)
    worker.process.wait(timeout=10)


def _hold_the_answer_to(mock: LlmMock, call_id: str, release: threading.Event) -> threading.Event:
    """The model's answer to ``call_id``'s result is held (in flight) until ``release``, once; the returned
    event is set when that model call arrives. The next model call with that result is answered."""
    arrived = threading.Event()
    mock.server.when_tool_result(call_id).reply(held_reply(arrived, release)).times(1).first()
    return arrived


def _requests_of(mock: LlmMock, text: str) -> list[list[dict[str, Any]]]:
    """The message lists the model received for one run (its input ``text``)."""
    return [body["messages"] for body in mock.bodies()
            if any(m.get("role") == "user" and m.get("content") == text for m in body["messages"])]


def _all_requests_of(mock: LlmMock, text: str, count: int) -> list[list[dict[str, Any]]]:
    """The ``count`` message lists the model received for one run, shortest first: a held request is in the
    mock's history only once its held answer was released (waited for, bounded)."""
    return sorted(poll_until(lambda: requests if len(requests := _requests_of(mock, text)) >= count else None,
                             timeout=WAIT_S, failure=lambda: f"fewer than {count} model requests of {text!r}"),
                  key=len)


def _lost_in_a_model_call(dying: WorkerProcess, arrived: threading.Event, release: threading.Event,
                          start_worker: Callable[..., WorkerProcess], store: RunStore, run_id: str,
                          ready: Callable[[], object]) -> tuple[WorkerProcess, RunRecord]:
    """Once the model call ``dying`` makes for ``run_id`` ``arrived`` and ``ready()`` returned, another worker
    is started and ``dying`` killed; that worker and the run as it ended. The held call is let go at the end."""
    try:
        assert arrived.wait(WAIT_S)
        ready()
        successor = start_worker(**FAST)
        _kill(dying)
        return successor, wait_for_run(store, run_id, timeout=WAIT_S)
    finally:
        release.set()


def _kinds(record: RunRecord) -> list[tuple[StepKind, ToolOutcome | None, object]]:
    return [(s.kind, s.tool_outcome, s.detail.get("reason")) for s in record.steps]


def test_kill_9_of_the_worker_holding_runs_in_tool_calls_resumes_them_on_another_worker_with_each_call_on_record(
    llm_mock: LlmMock, toolbox_http: Toolbox, start_worker: Callable[..., WorkerProcess], store: RunStore,
    producer: Producer,
) -> None:
    doomed = start_worker(**FAST)
    calls = _runs(producer, llm_mock, toolbox_http, RUNS)
    wait_for_event(toolbox_http.events, "started", tool="slow", count=RUNS, timeout=WAIT_S)
    survivor = start_worker(**FAST)

    _kill(doomed)
    records = {run_id: wait_for_run(store, run_id, timeout=WAIT_S) for run_id in calls}

    for run_id, record in records.items():
        i = list(calls).index(run_id)
        assert (record.status, record.termination_reason) == (RunStatus.COMPLETED, TerminationReason.COMPLETED)
        assert _kinds(record) == [(StepKind.MODEL, None, None), (StepKind.TOOL, ToolOutcome.CANCELLED, "worker_lost"),
                                  (StepKind.HANDOFF, None, "worker_lost"), (StepKind.MODEL, None, None)]
        cut, handoff, final = record.steps[1:]
        # The call had gone out (the server saw it start): the server may have acted.
        assert (cut.tool_call_id, cut.detail["side_effects"], cut.content) == (calls[run_id], "unknown", CUT_OFF)
        assert f":{doomed.pid}:" in handoff.detail["worker"]
        assert final.content == f"run {i} answered after the loss"
        assert record.segments == 2
        assert survivor.logged("run_claimed", run_id=run_id)
        # The recorded model call was not made again: the model saw the input once, then the cut-off result.
        first, second = _requests_of(llm_mock, f"lost run {i}")
        assert [m["role"] for m in first] == ["user"]
        assert (second[-1]["role"], second[-1]["tool_call_id"], second[-1]["content"]) == (
            "tool", calls[run_id], CUT_OFF)
    assert {e["run_id"] for e in survivor.logged("run_worker_lost", outcome="requeued")} == set(calls)
    # Reported, not retried: each call was made once.
    assert len(matching_events(toolbox_http.events, "started", tool="slow")) == RUNS
    assert survivor.logged("lease_not_renewed") == []
    [health] = [h for h in servers_json() if h["server"] == "toolbox"]
    assert (health["worker_lost"], health["side_effects_unknown"], health["cancelled"]) == (RUNS, RUNS, RUNS)


def test_a_worker_paused_past_detection_writes_nothing_and_calls_nothing_when_it_wakes(
    llm_mock: LlmMock, toolbox_http: Toolbox, start_worker: Callable[..., WorkerProcess], store: RunStore,
    producer: Producer,
) -> None:
    paused = start_worker(**FAST)
    [(run_id, call_id)] = _runs(producer, llm_mock, toolbox_http, 1, seconds=30).items()
    wait_for_event(toolbox_http.events, "started", tool="slow", timeout=WAIT_S)
    survivor = start_worker(**FAST)

    paused.process.send_signal(signal.SIGSTOP)
    try:
        taken = wait_for_run(store, run_id, lambda r: any(s.kind is StepKind.HANDOFF for s in r.steps),
                             timeout=WAIT_S)
    finally:
        paused.process.send_signal(signal.SIGCONT)
    # Awake: its beat is refused and it cuts off its call, whose step the owner guard refuses. (The run's new
    # message may have reached the paused process too, before it stopped: then it claims the run anew, a new
    # segment under a new owner, and finishes it.)
    paused.wait_for_log("worker_taken_as_lost", timeout=WAIT_S)
    paused.wait_for_log("run_ownership_lost", run_id=run_id, timeout=WAIT_S)
    record = wait_for_run(store, run_id, timeout=WAIT_S)

    assert survivor.logged("run_worker_lost", run_id=run_id, outcome="requeued")
    assert _kinds(taken) == [(StepKind.MODEL, None, None), (StepKind.TOOL, ToolOutcome.CANCELLED, "worker_lost"),
                             (StepKind.HANDOFF, None, "worker_lost")]
    # Nothing the paused segment did landed: after the hand-over only the next segment's final answer.
    assert record.steps[:3] == taken.steps
    assert [(s.kind, s.content) for s in record.steps[3:]] == [(StepKind.MODEL, "run 0 answered after the loss")]
    assert (record.status, record.segments) == (RunStatus.COMPLETED, 2)
    assert len(llm_mock.bodies()) == 2  # the first turn, once, and the one after the loss
    assert len(matching_events(toolbox_http.events, "started", tool="slow")) == 1  # no tool call again
    assert taken.steps[1].tool_call_id == call_id


def test_a_run_cancelled_while_its_worker_is_dead_stays_cancelled_with_its_call_on_the_record(
    llm_mock: LlmMock, toolbox_http: Toolbox, start_worker: Callable[..., WorkerProcess], store: RunStore,
    producer: Producer,
) -> None:
    doomed = start_worker(**FAST)
    [(run_id, call_id)] = _runs(producer, llm_mock, toolbox_http, 1).items()
    wait_for_event(toolbox_http.events, "started", tool="slow", timeout=WAIT_S)
    survivor = start_worker(**FAST)

    _kill(doomed)
    # Well within detection (5 s after the last beat): the cancel finds the run still "running".
    assert cancel_run(store, None, run_id, reason="stop it", requested_by="test").won
    record = wait_for_run(store, run_id, lambda r: any(s.kind is StepKind.TOOL for s in r.steps), timeout=WAIT_S)

    assert (record.status, record.termination_reason) == (RunStatus.CANCELLED, TerminationReason.CANCELLED)
    assert _kinds(record) == [(StepKind.MODEL, None, None), (StepKind.TOOL, ToolOutcome.CANCELLED, "worker_lost")]
    assert (record.steps[1].tool_call_id, record.steps[1].detail["side_effects"]) == (call_id, "unknown")
    survivor.wait_for_log("run_worker_lost", run_id=run_id, outcome="ended")  # logged once its script answered
    assert survivor.logged("run_claimed", run_id=run_id) == []
    assert len(llm_mock.bodies()) == 1


def test_a_steer_stored_while_the_worker_is_dead_is_applied_once_by_the_worker_that_takes_the_run_up(
    llm_mock: LlmMock, toolbox_http: Toolbox, start_worker: Callable[..., WorkerProcess], store: RunStore,
    producer: Producer,
) -> None:
    doomed = start_worker(**FAST)
    [(run_id, call_id)] = _runs(producer, llm_mock, toolbox_http, 1).items()
    llm_mock.server.when("answer from what you have").reply(reply("answered as steered")).first()
    wait_for_event(toolbox_http.events, "started", tool="slow", timeout=WAIT_S)
    survivor = start_worker(**FAST)

    _kill(doomed)
    store_steer(store, run_id, "answer from what you have")  # well within detection: the run is still "running"
    record = wait_for_run(store, run_id, timeout=WAIT_S)

    assert (record.status, record.steps[-1].content) == (RunStatus.COMPLETED, "answered as steered")
    assert _kinds(record) == [(StepKind.MODEL, None, None), (StepKind.TOOL, ToolOutcome.CANCELLED, "worker_lost"),
                              (StepKind.HANDOFF, None, "worker_lost"), (StepKind.STEER, None, ""),
                              (StepKind.MODEL, None, None)]
    assert record.steps[1].tool_call_id == call_id
    assert len(survivor.logged("run_steer_applied", run_id=run_id)) == 1
    assert store.pending_steer(run_id) is None
    # The model saw the cut-off result, then the steer's message.
    last = llm_mock.bodies()[-1]["messages"]
    assert [(m["role"], m.get("tool_call_id")) for m in last[-2:]] == [("tool", call_id), ("user", None)]
    assert last[-1]["content"] == "answer from what you have"


def test_a_live_worker_keeps_its_runs_past_the_detection_bound(
    llm_mock: LlmMock, toolbox_http: Toolbox, start_worker: Callable[..., WorkerProcess], store: RunStore,
    producer: Producer,
) -> None:
    live = start_worker(**FAST)
    other = start_worker(**FAST)
    calls = _runs(producer, llm_mock, toolbox_http, RUNS, seconds=12)  # longer than the 5 s bound, twice over
    records = {run_id: wait_for_run(store, run_id, timeout=WAIT_S) for run_id in calls}

    for record in records.values():
        assert record.status is RunStatus.COMPLETED
        assert [s.kind for s in record.steps] == [StepKind.MODEL, StepKind.TOOL, StepKind.MODEL]
        assert record.steps[1].tool_outcome is ToolOutcome.OK
        assert record.segments == 1
    for worker in (live, other):
        assert worker.logged("workers_lost") == []
        assert worker.logged("worker_taken_as_lost") == []
        assert worker.logged("lease_not_renewed") == []
    assert len(matching_events(toolbox_http.events, "started", tool="slow")) == RUNS


def test_a_call_whose_catalog_says_retry_is_made_again_by_the_worker_that_takes_the_run_up(
    llm_mock: LlmMock, toolbox_http: Toolbox, start_worker: Callable[..., WorkerProcess], store: RunStore,
    producer: Producer,
) -> None:
    doomed = start_worker(**FAST)
    [(run_id, call_id)] = _runs(producer, llm_mock, toolbox_http, 1, seconds=20, on_worker_lost="retry").items()
    wait_for_event(toolbox_http.events, "started", tool="slow", timeout=WAIT_S)
    survivor = start_worker(**FAST)
    _kill(doomed)
    record = wait_for_run(store, run_id, timeout=WAIT_S)

    assert record.status is RunStatus.COMPLETED
    assert _kinds(record) == [(StepKind.MODEL, None, None), (StepKind.TOOL, ToolOutcome.CANCELLED, "worker_lost"),
                              (StepKind.HANDOFF, None, "worker_lost"), (StepKind.TOOL, ToolOutcome.OK, None),
                              (StepKind.MODEL, None, None)]
    cut, handoff, made_again = record.steps[1:4]
    assert (cut.detail["on_worker_lost"], handoff.detail["pending_calls"]) == ("retry", 1)
    assert cut.tool_call_id == made_again.tool_call_id == call_id
    assert len(matching_events(toolbox_http.events, "started", tool="slow")) == 2  # made again, once
    assert survivor.logged("run_claimed", run_id=run_id)
    # The model saw the real result of the call made again, never the cut-off one.
    last = llm_mock.bodies()[-1]["messages"]
    assert [m["content"] for m in last if m["role"] == "tool"] == [made_again.content]


def test_a_call_whose_catalog_says_fail_ends_the_run_failed_lease_lost_with_the_call_on_record(
    llm_mock: LlmMock, toolbox_http: Toolbox, start_worker: Callable[..., WorkerProcess], store: RunStore,
    producer: Producer,
) -> None:
    doomed = start_worker(**FAST)
    [(run_id, call_id)] = _runs(producer, llm_mock, toolbox_http, 1, on_worker_lost="fail").items()
    wait_for_event(toolbox_http.events, "started", tool="slow", timeout=WAIT_S)
    survivor = start_worker(**FAST)
    _kill(doomed)
    record = wait_for_run(store, run_id, timeout=WAIT_S)

    assert (record.status, record.termination_reason) == (RunStatus.FAILED, TerminationReason.LEASE_LOST)
    assert _kinds(record) == [(StepKind.MODEL, None, None), (StepKind.TOOL, ToolOutcome.CANCELLED, "worker_lost")]
    assert (record.steps[1].tool_call_id, record.steps[1].detail["on_worker_lost"]) == (call_id, "fail")
    assert "toolbox.slow" in record.error
    assert 'on_worker_lost = "fail"' in record.error
    assert record.worker_losses == 1
    survivor.wait_for_log("run_worker_lost", run_id=run_id, outcome="failed")  # logged once its script answered
    assert survivor.logged("run_claimed", run_id=run_id) == []
    assert len(llm_mock.bodies()) == 1


@contextmanager
def _deltas(store: RunStore) -> Iterator[Callable[[str], bool]]:
    """While open, whether the events channel carried a ``delta`` of a run (its id): a streamed answer's text
    reached the worker."""
    subscriber = store.redis.pubsub(ignore_subscribe_messages=True)
    subscriber.subscribe(store.keys.events)
    seen: set[str] = set()

    def streaming(run_id: str) -> bool:
        while (message := subscriber.get_message(timeout=0.05)) is not None:
            event = json.loads(message["data"])
            if event.get("event") == "delta":
                seen.add(str(event.get("run_id")))
        return run_id in seen

    try:
        yield streaming
    finally:
        subscriber.close()


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
def test_kill_9_during_a_model_call_makes_that_call_again_and_never_a_model_call_already_recorded(
    llm_mock: LlmMock, toolbox_http: Toolbox, start_worker: Callable[..., WorkerProcess], store: RunStore,
    producer: Producer, stream: bool,
) -> None:
    _catalog(llm_mock, toolbox_http, stream=stream)
    arrived, release = threading.Event(), threading.Event()
    llm_mock.server.when("model lost").reply(reply(tools=[("toolbox__get-sum", {"a": 2, "b": 3}, "call_sum")])).times(1)
    if stream:  # the second model call streams its answer, slowly: the worker is killed mid-stream
        def slow_stream(_request: Any) -> Any:
            arrived.set()
            return reply("still thinking " * 60)

        llm_mock.server.when_tool_result("call_sum").reply(
            slow_stream, ReplyOptions(latency=200, chunk_size=3)).times(1)
    else:  # the second model call is held, nothing said yet
        llm_mock.server.when_tool_result("call_sum").reply(held_reply(arrived, release)).times(1)
    llm_mock.server.when_tool_result("call_sum").reply(reply("5, after the loss"))
    doomed = start_worker(**FAST)
    with _deltas(store) as streaming:
        run_id = producer.enqueue(RunSpec.parse({"input": "model lost", "model": "mock",
                                                 "mcp_servers": ["toolbox"]})).run_id
        survivor, record = _lost_in_a_model_call(
            doomed, arrived, release, start_worker, store, run_id,
            lambda: stream and poll_until(lambda: streaming(run_id), timeout=WAIT_S,
                                          failure=lambda: "no delta of the run"))

    assert (record.status, record.steps[-1].content) == (RunStatus.COMPLETED, "5, after the loss")
    assert [(s.kind, s.round, s.interrupted, s.detail.get("reason")) for s in record.steps] == [
        (StepKind.MODEL, 1, False, None), (StepKind.TOOL, 1, False, None), (StepKind.MODEL, 2, True, "worker_lost"),
        (StepKind.HANDOFF, 1, False, "worker_lost"), (StepKind.MODEL, 2, False, None)]
    assert f":{doomed.pid}:" in record.steps[3].detail["worker"]
    assert (record.segments, record.worker_losses) == (2, 1)
    assert survivor.logged("run_claimed", run_id=run_id)
    # The recorded first model call was made once; the one in flight again, with exactly the messages it had.
    first, in_flight, again = _all_requests_of(llm_mock, "model lost", 3)
    assert [m["role"] for m in first] == ["user"]
    assert again == in_flight
    assert [m["role"] for m in again] == ["user", "assistant", "tool"]
    assert len(llm_mock.bodies()) == 3
    assert len(matching_events(toolbox_http.events, "started", tool="get-sum")) == 1


def test_a_run_that_loses_more_workers_than_the_bound_ends_failed_lease_lost_with_the_count(
    llm_mock: LlmMock, toolbox_http: Toolbox, start_worker: Callable[..., WorkerProcess], store: RunStore,
    producer: Producer, start_api: Callable[..., ApiProcess],
) -> None:
    bounded = {**FAST, "RUNBRAKE_MAX_WORKER_LOSSES": "1"}
    first = start_worker(**bounded)
    [(run_id, call_id)] = _runs(producer, llm_mock, toolbox_http, 1).items()
    # Told its call was cut off, the model asks for it again: the run's second worker is lost in it too.
    llm_mock.server.when_tool_result(call_id).reply(
        reply(tools=[("toolbox__slow", {"seconds": 60, "note": "again"}, "call_again")])).times(1).first()
    wait_for_event(toolbox_http.events, "started", tool="slow", timeout=WAIT_S)
    second = start_worker(**bounded)
    _kill(first)
    wait_for_event(toolbox_http.events, "started", tool="slow", count=2, timeout=WAIT_S)
    third = start_worker(**bounded)
    _kill(second)
    record = wait_for_run(store, run_id, timeout=WAIT_S)

    assert (record.status, record.termination_reason) == (RunStatus.FAILED, TerminationReason.LEASE_LOST)
    assert record.worker_losses == 2
    assert "lost 2 workers (RUNBRAKE_MAX_WORKER_LOSSES = 1)" in record.error
    assert _kinds(record) == [(StepKind.MODEL, None, None), (StepKind.TOOL, ToolOutcome.CANCELLED, "worker_lost"),
                              (StepKind.HANDOFF, None, "worker_lost"), (StepKind.MODEL, None, None),
                              (StepKind.TOOL, ToolOutcome.CANCELLED, "worker_lost")]
    assert [s.tool_call_id for s in record.steps if s.kind is StepKind.TOOL] == [call_id, "call_again"]
    third.wait_for_log("run_worker_lost", run_id=run_id, outcome="failed")
    assert third.logged("run_claimed", run_id=run_id) == []
    shown = runbrake("show", run_id, "--json")
    assert shown.returncode == 0, shown.stderr
    assert (json.loads(shown.stdout)["status"], json.loads(shown.stdout)["worker_losses"]) == ("failed", 2)
    api = start_api()
    answer = httpx2.get(f"{api.url}/v1/runs/{run_id}", timeout=10)
    assert (answer.status_code, answer.json()["worker_losses"]) == (200, 2)


def test_a_run_waiting_for_approval_whose_worker_dies_still_waits_and_resumes_on_approval(
    llm_mock: LlmMock, toolbox_http: Toolbox, start_worker: Callable[..., WorkerProcess], store: RunStore,
    producer: Producer,
) -> None:
    _catalog(llm_mock, toolbox_http)
    llm_mock.server.when("needs a yes").reply(reply(tools=[("toolbox__get-sum", {"a": 2, "b": 3}, "gated")])).times(1)
    llm_mock.server.when_tool_result("gated").reply(reply("5, once approved"))
    doomed = start_worker(**FAST)
    run_id = producer.enqueue(RunSpec.parse({"input": "needs a yes", "model": "mock", "mcp_servers": ["toolbox"],
                                             "approval_required": ["toolbox.get-sum"]})).run_id
    waiting = wait_for_run(store, run_id, lambda r: r.status is RunStatus.WAITING_FOR_APPROVAL, timeout=WAIT_S)
    survivor = start_worker(**FAST)
    _kill(doomed)
    survivor.wait_for_log("workers_lost", timeout=WAIT_S)  # the dead worker was taken as lost: its runs swept

    assert store.get(run_id) == waiting  # still waiting, nothing written
    assert runbrake("approve", run_id).returncode == 0
    record = wait_for_run(store, run_id, timeout=WAIT_S)
    assert (record.status, record.steps[-1].content) == (RunStatus.COMPLETED, "5, once approved")
    assert [s.kind for s in record.steps] == [StepKind.MODEL, StepKind.APPROVAL, StepKind.TOOL, StepKind.MODEL]
    assert record.steps[2].tool_outcome is ToolOutcome.OK
    assert record.worker_losses == 0
    assert survivor.logged("run_claimed", run_id=run_id)
    assert len(matching_events(toolbox_http.events, "started", tool="get-sum")) == 1


def test_a_budget_deadline_is_still_measured_from_the_runs_creation_after_its_worker_was_lost(
    llm_mock: LlmMock, toolbox_http: Toolbox, start_worker: Callable[..., WorkerProcess], store: RunStore,
    producer: Producer,
) -> None:
    deadline_s = 45.0  # past the time a loaded machine takes to start the call, detect the loss and hand over
    doomed = start_worker(**FAST)
    budget = {"budget": {"deadline_s": deadline_s}}
    [(run_id, call_id)] = _runs(producer, llm_mock, toolbox_http, 1, extra=budget).items()
    release = threading.Event()
    arrived = _hold_the_answer_to(llm_mock, call_id, release)  # the next worker is in that model call at the deadline
    wait_for_event(toolbox_http.events, "started", tool="slow", timeout=WAIT_S)
    survivor = start_worker(**FAST)
    _kill(doomed)
    try:
        assert arrived.wait(WAIT_S)
        # The fence ends the run; the worker records the call it cut off after: its segment's end says when.
        survivor.wait_for_log("run_segment_ended", run_id=run_id, timeout=WAIT_S)
    finally:
        release.set()
    record = store.get(run_id)

    assert (record.status, record.termination_reason) == (RunStatus.CANCELLED, TerminationReason.DEADLINE_EXCEEDED)
    handoff = next(s for s in record.steps if s.kind is StepKind.HANDOFF)
    assert survivor.logged("run_claimed", run_id=run_id)
    assert record.created_at is not None
    assert record.finished_at is not None
    # From the run's creation: measured from the segment that took the run up (after the hand-over, some
    # detection time after the creation), it would end later than this.
    assert record.created_at + deadline_s <= record.finished_at < handoff.recorded_at + deadline_s
    assert (record.steps[-1].kind, record.steps[-1].interrupted) == (StepKind.MODEL, True)  # cut off at the deadline


def test_a_hand_over_interrupted_by_a_second_crash_still_ends_with_the_run_completed(
    llm_mock: LlmMock, toolbox_http: Toolbox, start_worker: Callable[..., WorkerProcess], store: RunStore,
    producer: Producer,
) -> None:
    first = start_worker(**FAST)
    [(run_id, call_id)] = _runs(producer, llm_mock, toolbox_http, 1).items()
    release = threading.Event()
    arrived = _hold_the_answer_to(llm_mock, call_id, release)  # the worker that takes the run up dies in it
    wait_for_event(toolbox_http.events, "started", tool="slow", timeout=WAIT_S)
    second = start_worker(**FAST)
    _kill(first)
    # Taken up by the second worker, which dies in its first call: nothing recorded yet.
    third, record = _lost_in_a_model_call(second, arrived, release, start_worker, store, run_id,
                                          lambda: second.wait_for_log("run_claimed", run_id=run_id))

    assert (record.status, record.steps[-1].content) == (RunStatus.COMPLETED, "run 0 answered after the loss")
    assert [(s.kind, s.tool_outcome, s.interrupted, s.detail.get("reason")) for s in record.steps] == [
        (StepKind.MODEL, None, False, None), (StepKind.TOOL, ToolOutcome.CANCELLED, False, "worker_lost"),
        (StepKind.HANDOFF, None, False, "worker_lost"), (StepKind.MODEL, None, True, "worker_lost"),
        (StepKind.HANDOFF, None, False, "worker_lost"), (StepKind.MODEL, None, False, None)]
    lost = [s.detail["worker"] for s in record.steps if s.kind is StepKind.HANDOFF]
    assert [f":{first.pid}:" in lost[0], f":{second.pid}:" in lost[1]] == [True, True]
    assert (record.segments, record.worker_losses) == (3, 2)
    assert third.logged("run_claimed", run_id=run_id)
    # The first model call once; the second twice (in flight when the second worker died, then made again).
    first_call, in_flight, again = _all_requests_of(llm_mock, "lost run 0", 3)
    assert ([m["role"] for m in first_call], again) == (["user"], in_flight)
    assert len(matching_events(toolbox_http.events, "started", tool="slow")) == 1
