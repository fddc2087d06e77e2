"""The worker's garbage collection (worker/intake.py, ``tune_gc`` and ``Collector``): with its thresholds a cycle
waits for 2,000 more allocations before even a young collection, and one that was alive then waits in an older
generation for far more, so the collector part frees it on a timer
(``RUNBRAKE_GC_INTERVAL_S``; docs/benchmarks.md, "Soak: the RSS growth"), freezing what survived so that the
next walks only what came since, and thawing the frozen heap once it doubled."""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Iterator

import pytest

from runbrake.shared.settings import Settings
from runbrake.worker.intake import GC_THRESHOLDS, Collector, tune_gc
from tests.polling import poll_until


class Node:
    """One end of a reference cycle."""

    other: Node | None = None


def cycle(freed: threading.Event) -> None:
    """Make a two-object cycle, unreachable once this returns; ``freed`` is set when it is collected."""
    a, b = Node(), Node()
    a.other, b.other = b, a
    weakref.finalize(a, freed.set)


@pytest.fixture
def tuned_gc() -> Iterator[None]:
    """This process's collector as a worker's (``tune_gc``), put back as it was afterwards."""
    thresholds, callbacks = gc.get_threshold(), list(gc.callbacks)
    gc.collect()
    tune_gc()
    try:
        yield
    finally:
        gc.unfreeze()
        gc.set_threshold(*thresholds)
        gc.callbacks[:] = callbacks
        gc.collect()


@pytest.mark.usefixtures("tuned_gc")
def test_a_cycle_the_thresholds_leave_alone_is_freed_by_the_collector_within_its_interval() -> None:
    assert gc.get_threshold() == GC_THRESHOLDS
    freed = threading.Event()
    cycle(freed)
    kept = [[] for _ in range(500)]  # allocations well under the 2,000 of a young collection
    assert not freed.is_set()  # nothing collects it yet: without the collector it would wait
    collector = Collector(0.05, in_flight=lambda: 0)
    collector.start()
    try:
        poll_until(freed.is_set, timeout=30, failure=lambda: "the collector did not free the cycle")
        assert collector.health().ok
    finally:
        collector.stop()
        collector.join(10)
    assert not collector.is_alive()
    del kept


@pytest.mark.usefixtures("tuned_gc")
def test_what_survives_a_collection_is_frozen_so_the_next_walks_only_what_came_since() -> None:
    collector = Collector(1, in_flight=lambda: 1)  # ticked here, not started
    collector.tick()
    before = gc.get_freeze_count()
    kept = [Node() for _ in range(1_000)]
    freed = threading.Event()
    cycle(freed)
    collector.tick()
    assert freed.is_set(), "the garbage that came since the last collection is collected"
    assert gc.get_freeze_count() >= before + len(kept), "what survived is frozen"
    del kept


def run_heap(objects: int) -> list[Node]:
    """What a run keeps alive, as far as the collector can tell: objects in cycles (each its own), which only
    a collection frees once the run drops them."""
    heap = [Node() for _ in range(objects)]
    for node in heap:
        node.other = node
    return heap


def held_cycle(freed: threading.Event) -> list[Node]:
    """A two-object cycle kept alive by the list returned (cleared, it is garbage); ``freed`` is set when collected."""
    holder = [Node()]
    holder[0].other = Node()
    holder[0].other.other = holder[0]
    weakref.finalize(holder[0], freed.set)
    return holder


@pytest.mark.usefixtures("tuned_gc")
def test_more_runs_held_do_not_thaw_the_frozen_heap_but_garbage_as_large_as_it_does() -> None:
    runs: list[list[Node]] = []
    collector = Collector(1, in_flight=lambda: len(runs))
    collector.tick()  # the boot heap
    freed = threading.Event()
    holder = held_cycle(freed)
    runs.append(run_heap(20_000))
    collector.tick()  # one run's heap and the cycle frozen while alive
    collector.tick()  # the runs in flight did not grow since: the objects per run seen
    holder.clear()  # the cycle dies frozen: only a thaw frees it
    for _ in range(3):  # the runs held grow eightfold: each run's heap is frozen, as many per run as before
        runs.extend(run_heap(20_000) for _ in range(len(runs)))
        collector.tick()
        collector.tick()
    assert not freed.is_set(), "the runs' growth thawed the frozen heap"
    del runs[len(runs) // 4:]  # three runs in four end: their cycles are frozen garbage now
    collector.tick()  # per run in flight the frozen heap grew fourfold: this one thaws it and collects it all
    assert freed.is_set()


@pytest.mark.usefixtures("tuned_gc")
def test_runs_just_taken_set_no_measure_the_heap_is_thawed_against() -> None:
    runs: list[list[Node]] = []
    collector = Collector(1, in_flight=lambda: len(runs))
    freed = threading.Event()
    holder = held_cycle(freed)
    collector.tick()  # the boot heap, and the cycle frozen while alive
    holder.clear()  # the cycle dies frozen: only a thaw frees it
    runs.extend([] for _ in range(10))  # ten runs just taken, nothing built yet: per run, next to nothing
    collector.tick()
    for run in runs:  # they build their heaps: per run, far more than just read
        run.extend(run_heap(20_000))
    collector.tick()  # the runs in flight did not grow: judged against the fewest seen, which is this
    assert not freed.is_set(), "the runs' building thawed the frozen heap"


@pytest.mark.usefixtures("tuned_gc")
def test_the_garbage_of_the_process_start_is_not_counted_as_its_boot_heap() -> None:
    freed = threading.Event()
    holder = held_cycle(freed)
    run_heap(60_000)  # the start's garbage: cycles no collection has found yet, more than a run's heap
    runs: list[list[Node]] = []
    collector = Collector(1, in_flight=lambda: len(runs))
    collector.tick()  # the boot heap, and the cycle frozen while alive
    holder.clear()  # the cycle dies frozen: only a thaw frees it
    runs.append(run_heap(20_000))
    collector.tick()
    collector.tick()  # the runs in flight did not grow: one run's heap per run, the fewest seen
    runs.extend(run_heap(20_000) for _ in range(3))
    collector.tick()
    collector.tick()  # four runs, as many blocks per run as one
    assert not freed.is_set(), "more runs held thawed the frozen heap"


@pytest.mark.usefixtures("tuned_gc")
def test_an_interval_of_zero_turns_the_collector_off() -> None:
    collector = Collector(0, in_flight=lambda: 0)
    collector.start()
    collector.join(10)
    assert not collector.is_alive()  # it returned at once: no tick ever comes
    assert collector.health().detail == "off"


def test_a_worker_collects_twice_a_second_by_default_and_the_setting_is_read() -> None:
    assert Settings.from_env({}).gc_interval_s == 0.5
    assert Settings.from_env({"RUNBRAKE_GC_INTERVAL_S": "0"}).gc_interval_s == 0.0
    assert Settings.from_env({"RUNBRAKE_GC_INTERVAL_S": "2.5"}).gc_interval_s == 2.5
