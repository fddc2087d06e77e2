"""Admission by health: a worker process past its health bound takes no new run and hands the message back,
so the excess waits ``queued`` while the runs it holds go on (worker/saturation.py; docs/leases.md,
"Capacity: runs in flight")."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator

import pytest

from runbrake.shared import RunStatus, RunStore, ToolOutcome
from runbrake.shared.messaging.cancel import CancelPublisher
from runbrake.shared.messaging.producer import Producer
from runbrake.shared.operations import cancel
from runbrake.worker.saturation import FIRST_RATE, PAUSE_WINDOW_S, ROUND, LoopWatch, Pauses, Ramp
from tests.mcp_helpers import Toolbox, read_events, wait_for_event
from tests.polling import poll_until
from tests.worker_helpers import WorkerProcess, call, has_step, spec, wait_for_run

FLOOR = 3
"""RUNBRAKE_ADMIT_MIN_RUNS in these tests: below it a process takes a run whatever its health says."""


def most_calls_at_once(toolbox: Toolbox) -> int:
    """The most ``slow`` calls the server had in flight at one moment, from its own record."""
    at_once = most = 0
    for event in read_events(toolbox.events):
        if event["tool"] != "slow":
            continue
        at_once += 1 if event["event"] == "started" else -1
        most = max(most, at_once)
    return most


BOUNDS = {
    # 1 MiB: every process is past it.
    "memory": ({"RUNBRAKE_ADMIT_MAX_RSS_MB": "1", "RUNBRAKE_ADMIT_MAX_CPU_PCT": "0"}, "resident memory"),
    # 0.1 % of a core: a process with runs in flight uses more, whatever the machine, so one run more is past it.
    "cpu": ({"RUNBRAKE_ADMIT_MAX_CPU_PCT": "0.1", "RUNBRAKE_ADMIT_MAX_PAUSE_MS": "0"}, "projected with one run more"),
    # 1 µs: the collector's timer collects twice a second, and every collection takes longer.
    "pause": ({"RUNBRAKE_ADMIT_MAX_PAUSE_MS": "0.001", "RUNBRAKE_ADMIT_MAX_CPU_PCT": "0"}, "a collection paused"),
}


@pytest.mark.integration
@pytest.mark.parametrize("bound", BOUNDS)
def test_a_worker_past_a_health_bound_leaves_the_excess_queued_and_serves_the_runs_it_holds(
    bound: str, toolbox_http: Toolbox, start_worker: Callable[..., WorkerProcess], producer: Producer,
    store: RunStore, publisher: CancelPublisher,
) -> None:
    # Past the bound from the start, so only the floor lets runs in.
    env, reason = BOUNDS[bound]
    worker = start_worker(concurrency=64, RUNBRAKE_ADMIT_MIN_RUNS=str(FLOOR), **env)
    runs = [producer.enqueue(spec({"toolbox": toolbox_http.spec},
                                  [{"tool_calls": [call("slow", seconds=6)]}, {"content": "done"}])).run_id
            for _ in range(6)]
    wait_for_event(toolbox_http.events, "started", tool="slow", count=FLOOR, timeout=30)

    # A consumer thread held a fourth run for a while, then handed it back unclaimed, naming the bound.
    [handed, *_] = poll_until(lambda: worker.logged("run_handed_back") or None, timeout=30,
                              failure=lambda: "the worker never handed a run back")
    assert reason in handed["reason"]
    assert handed["reason"].startswith(f"{FLOOR} runs in flight here")
    assert store.get(handed["run_id"]).status is RunStatus.QUEUED

    # A cancel amid them is recorded as one, and frees a place for the next run.
    running = next(run_id for run_id in runs if store.get(run_id).status is RunStatus.RUNNING)
    assert cancel(store, publisher, running, reason="amid the load", requested_by="test").message_confirmed
    cancelled = wait_for_run(store, running, has_step("tool"), timeout=30)
    assert cancelled.status is RunStatus.CANCELLED
    assert cancelled.steps[-1].tool_outcome is ToolOutcome.CANCELLED

    # Every other run completes, its call whole, and the server never had more calls at once than the floor.
    for run_id in runs:
        if run_id != running:
            record = wait_for_run(store, run_id, timeout=90)
            assert record.status is RunStatus.COMPLETED, run_id
            assert [step.tool_outcome for step in record.steps if step.tool_outcome] == [ToolOutcome.OK]
    assert most_calls_at_once(toolbox_http) == FLOOR
    assert len([e for e in read_events(toolbox_http.events) if e["event"] == "finished"]) == 5


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    """An event loop running on a thread of its own, as a worker's does."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield loop
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()


def test_a_loop_that_stays_busy_closes_the_gate_and_it_opens_again_once_the_loop_answers(
    loop: asyncio.AbstractEventLoop,
) -> None:
    watch = _watch(loop, max_lag_ms=1, max_cpu_pct=0, in_flight=2)
    busy = threading.Event()
    try:
        loop.call_soon_threadsafe(busy.wait, 30)  # the loop runs nothing else until it is set

        def closed() -> bool:
            watch.tick()
            return not watch.admits(2)

        poll_until(closed, timeout=10, failure=lambda: "a loop that answered nothing kept admitting runs")
        assert watch.admits(1), "below the floor a run is always admitted"
        assert "event loop lag" in watch.refusal()
        assert watch.saturation() > 1.0

        busy.set()

        def opened() -> bool:
            watch.tick()  # a round after the lag fell the rate is no longer cut
            return watch.admits(2)

        poll_until(opened, timeout=10, failure=lambda: f"the gate stayed closed: {watch.refusal()}")
        assert watch.refusal() == ""
    finally:
        busy.set()


def test_the_admission_rate_doubles_while_it_is_used_and_halves_with_a_round_off_when_the_lag_rises() -> None:
    ramp = Ramp()
    taken = [ramp.take() for _ in range(FIRST_RATE + 1)]
    assert taken == [True] * FIRST_RATE + [False], "a round's allowance is its rate"
    ramp.next_round(grow=True, cut=False)
    assert ramp.rate == 2 * FIRST_RATE, "slow start: a healthy round that used its rate doubles it"
    ramp.next_round(grow=True, cut=False)
    assert ramp.rate == 2 * FIRST_RATE, "a round that used none of its rate does not grow it"
    while ramp.take():
        pass
    ramp.next_round(grow=True, cut=True)
    assert (ramp.rate, ramp.left) == (FIRST_RATE, 0), "a rising lag halves the rate and takes nothing this round"
    assert not ramp.take()
    ramp.next_round(grow=True, cut=False)
    while ramp.take():
        pass
    ramp.next_round(grow=True, cut=False)
    assert ramp.rate == 2 * FIRST_RATE, "past the threshold the cut set, the rate grows by a step, not doubles"


def test_a_run_that_would_take_the_process_past_its_cpu_bound_is_refused_before_the_loop_lags(
    loop: asyncio.AbstractEventLoop,
) -> None:
    # 20 runs in flight and a bound of 10 % of a core: a process busy on another thread is past it at once.
    watch = _watch(loop, max_lag_ms=10_000, max_cpu_pct=10, in_flight=20)
    spinning = threading.Event()
    spinning.set()

    def spin() -> None:
        while spinning.is_set():
            sum(range(1_000))

    spinner = threading.Thread(target=spin, daemon=True)
    spinner.start()
    try:
        def refused() -> bool:
            for _ in range(ROUND):
                watch.tick()
            return not watch.admits(20)

        poll_until(refused, timeout=30, failure=lambda: f"a busy process admitted a run: {watch.refusal()!r}")
        assert "projected with one run more" in watch.refusal()
        assert watch.saturation() > 1.0
        assert watch.admits(1), "below the floor a run is always admitted"
    finally:
        spinning.clear()
        spinner.join(10)


def test_a_collection_that_paused_the_process_past_its_bound_closes_the_gate(loop: asyncio.AbstractEventLoop) -> None:
    """A cancel that comes during a collection waits for it (docs/benchmarks.md, "Saturation: where a cancel's time
    went"): past ``RUNBRAKE_ADMIT_MAX_PAUSE_MS`` within the last seconds no run is taken."""
    pauses = Pauses()
    watch = _watch(loop, max_lag_ms=10_000, max_cpu_pct=0, in_flight=20, max_pause_ms=15, pauses=pauses)
    pauses.note(0.010)
    watch.tick()
    assert watch.admits(20), f"a pause under the bound refused a run: {watch.refusal()!r}"
    pauses.note(0.040)
    watch.tick()
    assert not watch.admits(20)
    assert watch.refusal() == f"a collection paused the process 40.0 ms within {PAUSE_WINDOW_S:g} s, over 15 ms"
    assert watch.saturation() > 1.0
    assert watch.admits(1), "below the floor a run is always admitted"
    assert pauses.longest(window_s=0.0) == 0.0, "a pause outside the window still counts"


def _watch(loop: asyncio.AbstractEventLoop, *, max_lag_ms: float, max_cpu_pct: float, in_flight: int,
           max_pause_ms: float = 0.0, pauses: Pauses | None = None) -> LoopWatch:
    """A watch of ``loop`` (a floor of 2 runs, no RSS bound) for a process with ``in_flight`` runs."""
    return LoopWatch(lambda: loop, concurrency=100, max_lag_ms=max_lag_ms, max_rss_mb=0, min_runs=2,
                     max_cpu_pct=max_cpu_pct, in_flight=lambda: in_flight, max_pause_ms=max_pause_ms,
                     pauses=pauses or Pauses())
