"""The cancel path under load (issue 29; docs/benchmarks.md, "Saturation: where a cancel's time went"): a cancel
never queues behind the MCP progress of the runs beside it, and their progress still reaches their records; and
what a call reported is kept with its step (worker/progress.py)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from runbrake.shared import RunStatus, RunStore, StepKind, ToolOutcome
from runbrake.shared.messaging.cancel import CancelPublisher
from runbrake.shared.messaging.producer import Producer
from runbrake.shared.operations import cancel
from runbrake.worker.progress import HISTORY_MESSAGE_CHARS, HISTORY_REPORTS
from tests.mcp_helpers import http_toolbox, read_events, wait_for_event
from tests.polling import poll_until
from tests.test_cli import runbrake
from tests.worker_helpers import WorkerProcess, call, has_step, spec, wait_for_run

RUNS = 12
FLOOD_S = "0.01"
"""How often each call reports progress (the toolbox's ``--progress-s``): a hundred notifications a second a call."""


FIRST_REPORT = 0.02
"""The ``slow`` call's first report in the history test (``--progress-s``): its progress."""


def _progress(store: RunStore, run_id: str) -> float:
    return float((store.get(run_id).progress or {}).get("progress") or 0)


@pytest.mark.integration
def test_a_cancel_amid_a_progress_flood_is_recorded_while_the_flood_goes_on_and_progress_reaches_the_records(
    tmp_path: Path, start_worker: Callable[..., WorkerProcess], producer: Producer, store: RunStore,
    publisher: CancelPublisher,
) -> None:
    with http_toolbox(tmp_path / "toolbox-events.jsonl", args=("--progress-s", FLOOD_S)) as toolbox:
        start_worker(concurrency=RUNS)
        runs = [producer.enqueue(spec({"toolbox": toolbox.spec},
                                      [{"tool_calls": [call("slow", seconds=120)]}, {"content": "done"}])).run_id
                for _ in range(RUNS)]
        wait_for_event(toolbox.events, "started", tool="slow", count=RUNS, timeout=60)
        poll_until(lambda: all(_progress(store, run_id) for run_id in runs), timeout=30,
                   failure=lambda: "the calls' progress never reached every record")
        victim, *others = runs

        assert cancel(store, publisher, victim, reason="amid the flood", requested_by="test").message_confirmed
        cancelled = wait_for_run(store, victim, has_step("tool"), timeout=30)
        at_the_cancel = {run_id: (store.get(run_id).status, _progress(store, run_id)) for run_id in others}
        # The flood goes on, and each other run's latest progress still reaches its record.
        poll_until(lambda: all(_progress(store, run_id) > at_the_cancel[run_id][1] for run_id in others),
                   timeout=30, failure=lambda: "progress stopped reaching the records after the cancel")
        wait_for_event(toolbox.events, "cancelled", tool="slow", timeout=30)
        finished_before_the_cancel = [e for e in read_events(toolbox.events) if e["event"] == "finished"]
        for run_id in others:
            cancel(store, publisher, run_id, reason="done with the test", requested_by="test")
        for run_id in others:
            wait_for_run(store, run_id, has_step("tool"), timeout=30)

    assert cancelled.status is RunStatus.CANCELLED
    assert [step.tool_outcome for step in cancelled.steps if step.tool_outcome] == [ToolOutcome.CANCELLED]
    assert cancelled.progress is None  # forgotten by the cancelled step's own append
    assert {status for status, _ in at_the_cancel.values()} == {RunStatus.RUNNING}
    assert finished_before_the_cancel == []


@pytest.mark.integration
def test_a_tool_step_keeps_its_calls_last_progress_reports_in_order_and_the_run_record_serves_them(
    tmp_path: Path, start_worker: Callable[..., WorkerProcess], producer: Producer, store: RunStore,
) -> None:
    with http_toolbox(tmp_path / "toolbox-events.jsonl", args=("--progress-s", str(FIRST_REPORT))) as toolbox:
        start_worker(concurrency=2)
        run_id = producer.enqueue(spec({"toolbox": toolbox.spec}, [
            {"tool_calls": [call("slow", seconds=3, note="x" * 300)]}, {"content": "done"}])).run_id
        record = wait_for_run(store, run_id, timeout=60)
    shown = json.loads(runbrake("show", run_id, "--json").stdout)

    [step] = [s for s in record.steps if s.kind is StepKind.TOOL]
    history = step.detail["progress_history"]
    reported = [entry["progress"] for entry in history]
    assert record.status is RunStatus.COMPLETED
    assert step.tool_outcome is ToolOutcome.OK
    # About 150 reports (one each 0.02 s for 3 s): the latest 50 are kept, in order, the first ones dropped.
    assert len(history) == HISTORY_REPORTS
    assert reported == sorted(reported)
    assert reported[0] > FIRST_REPORT
    assert {entry["total"] for entry in history} == {3.0}
    assert all(len(entry["message"]) == HISTORY_MESSAGE_CHARS for entry in history)
    assert [entry["at"] for entry in history] == sorted(entry["at"] for entry in history)
    assert [s["detail"].get("progress_history") for s in shown["steps"] if s["kind"] == "tool"] == [history]
