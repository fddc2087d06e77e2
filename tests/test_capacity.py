"""Capacity: one worker process holds ``--concurrency`` runs in flight on a few consumer threads, and a full
worker leaves further messages in the queue (worker/intake.py; docs/leases.md, "Capacity: runs in flight")."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pika
import pytest
from click.testing import CliRunner

from runbrake.broker.cli import main
from runbrake.shared import RunStatus, RunStore, Settings, StepKind
from runbrake.shared.messaging.producer import Producer
from runbrake.worker import supervisor
from runbrake.worker.intake import CONSUMER_THREADS
from runbrake.worker.process import DEFAULT_CONCURRENCY, MAX_CONCURRENCY
from tests.mcp_helpers import Toolbox, matching_events, wait_for_event
from tests.polling import poll_until
from tests.worker_helpers import WorkerProcess, call, spec, wait_for_run, worker_env

pytestmark = pytest.mark.integration


def slow_run(toolbox: Toolbox, seconds: float = 120) -> Any:
    return spec({"toolbox": toolbox.spec}, [{"tool_calls": [call("slow", seconds=seconds)]}, {"content": "never"}])


def ready_messages(settings: Settings) -> int:
    """Messages ready in the run queue (RabbitMQ's count leaves out those delivered and not yet acked)."""
    connection = pika.BlockingConnection(pika.URLParameters(settings.rabbitmq_url))
    try:
        declared = connection.channel().queue_declare(queue=f"{settings.namespace}.runs", passive=True)
    finally:
        connection.close()
    count: int = declared.method.message_count
    return count


def test_one_process_holds_more_runs_in_flight_than_it_has_consumer_threads_and_sigterm_ends_them_all(
    toolbox_http: Toolbox, start_worker: Callable[..., WorkerProcess], producer: Producer, store: RunStore
) -> None:
    worker = start_worker(concurrency=64)
    [started] = worker.logged("worker_started")
    assert (started["concurrency"], started["consumer_threads"]) == (64, CONSUMER_THREADS) == (64, 4)

    runs = [producer.enqueue(slow_run(toolbox_http)).run_id for _ in range(40)]
    wait_for_event(toolbox_http.events, "started", tool="slow", count=40, timeout=60)
    assert all(store.get(run_id).status is RunStatus.RUNNING for run_id in runs)

    assert worker.stop() == 0
    # SIGTERM: after the drain (2 s in the tests) every segment in flight is handed back to the queue.
    records = [store.get(run_id) for run_id in runs]
    assert {(r.status, r.steps[-1].kind) for r in records} == {(RunStatus.QUEUED, StepKind.HANDOFF)}
    assert worker.logged("worker_handing_over", runs=40)
    assert len(matching_events(toolbox_http.events, "finished", tool="slow")) == 0


def test_a_full_worker_leaves_further_messages_in_the_queue(
    toolbox_http: Toolbox, start_worker: Callable[..., WorkerProcess], producer: Producer, store: RunStore,
    settings: Settings,
) -> None:
    start_worker(concurrency=2)  # two consumer threads, prefetch two
    runs = [producer.enqueue(slow_run(toolbox_http)).run_id for _ in range(8)]
    wait_for_event(toolbox_http.events, "started", tool="slow", count=2, timeout=30)

    # Two in flight (acked), two held by the consumer threads waiting for a slot, four left to other workers.
    poll_until(lambda: ready_messages(settings) == 4, timeout=15,
               failure=lambda: f"{ready_messages(settings)} messages ready, not 4")
    statuses = [store.get(run_id).status for run_id in runs]
    assert statuses.count(RunStatus.RUNNING) == 2
    assert statuses.count(RunStatus.QUEUED) == 6
    assert len(matching_events(toolbox_http.events, "started", tool="slow")) == 2


def test_a_message_waiting_for_a_slot_is_run_by_another_worker_when_its_worker_stops(
    toolbox_http: Toolbox, start_worker: Callable[..., WorkerProcess], producer: Producer, store: RunStore,
) -> None:
    full = start_worker(concurrency=1)
    first = producer.enqueue(slow_run(toolbox_http)).run_id
    wait_for_event(toolbox_http.events, "started", tool="slow", timeout=30)
    waiting = producer.enqueue(spec({"toolbox": toolbox_http.spec}, [{"content": "done"}])).run_id

    assert full.stop() == 0
    assert store.get(first).status is RunStatus.QUEUED  # handed over at the drain's end
    start_worker(concurrency=1)

    assert wait_for_run(store, waiting, timeout=30).status is RunStatus.COMPLETED


def test_a_message_a_full_worker_holds_is_handed_back_for_a_worker_with_room(
    toolbox_http: Toolbox, start_worker: Callable[..., WorkerProcess], producer: Producer, store: RunStore,
) -> None:
    full = start_worker(concurrency=1)
    producer.enqueue(slow_run(toolbox_http))
    wait_for_event(toolbox_http.events, "started", tool="slow", timeout=30)
    waiting = producer.enqueue(spec({"toolbox": toolbox_http.spec}, [{"content": "done"}])).run_id
    # Held SLOT_WAIT_S, then handed back through Dramatiq's delay queue (logged as a retry, not an error).
    poll_until(lambda: any(str(e.get("event")).startswith("Retrying message") for e in full.events()), timeout=15,
               failure=lambda: "the full worker never handed the message back")

    start_worker(concurrency=1)

    assert wait_for_run(store, waiting, timeout=30).status is RunStatus.COMPLETED
    assert not full.logged("run_claimed", run_id=waiting)


def test_threads_is_kept_as_an_alias_of_concurrency(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[dict[str, int]] = []

    def run_workers(_settings: Settings, *, processes: int, concurrency: int) -> int:
        asked.append({"processes": processes, "concurrency": concurrency})
        return 0

    monkeypatch.setattr(supervisor, "run_workers", run_workers)
    runner = CliRunner()
    for arguments in (["--concurrency", "300"], ["--threads", "300"], []):
        result = runner.invoke(main, ["worker", "--processes", "2", *arguments])
        assert result.exit_code == 0, result.output
    assert asked == [{"processes": 2, "concurrency": 300}] * 2 + [{"processes": 2, "concurrency": 8}]
    assert "--concurrency, --threads" in runner.invoke(main, ["worker", "--help"]).output
    # The CLI spells the worker's bounds out (it does not import the worker): they must agree.
    [option] = [p for p in main.commands["worker"].params if p.name == "concurrency"]
    assert (option.default, option.type.max) == (DEFAULT_CONCURRENCY, MAX_CONCURRENCY)  # type: ignore[attr-defined]

    # The worker process itself takes both spellings too.
    worker = WorkerProcess(tmp_path / "worker.log", worker_env(),
                           command=[sys.executable, "-m", "runbrake.worker", "--threads", "3"])
    try:
        [started] = worker.logged("worker_started")
        assert (started["concurrency"], started["consumer_threads"]) == (3, 3)
    finally:
        assert worker.stop() == 0
