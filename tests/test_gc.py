"""The worker's garbage collection (worker/intake.py, ``tune_gc`` and ``Collector``): with its thresholds a cycle
waits for 50,000 more allocations before even a young collection, so the collector part frees it on a timer
(``RUNBRAKE_GC_INTERVAL_S``; docs/benchmarks.md, "Soak: the RSS growth")."""

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
    thresholds = gc.get_threshold()
    gc.collect()
    tune_gc()
    try:
        yield
    finally:
        gc.unfreeze()
        gc.set_threshold(*thresholds)
        gc.collect()


@pytest.mark.usefixtures("tuned_gc")
def test_a_cycle_the_thresholds_leave_alone_is_freed_by_the_collector_within_its_interval() -> None:
    assert gc.get_threshold() == GC_THRESHOLDS
    freed = threading.Event()
    cycle(freed)
    kept = [[] for _ in range(1_000)]  # allocations well under the 50,000 of a young collection
    assert not freed.is_set()  # nothing collects it yet: without the collector it would wait
    collector = Collector(0.05)
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
def test_an_interval_of_zero_turns_the_collector_off() -> None:
    collector = Collector(0)
    collector.start()
    collector.join(10)
    assert not collector.is_alive()  # it returned at once: no tick ever comes
    assert collector.health().detail == "off"


def test_a_worker_collects_every_minute_by_default_and_the_setting_is_read() -> None:
    assert Settings.from_env({}).gc_interval_s == 60.0
    assert Settings.from_env({"RUNBRAKE_GC_INTERVAL_S": "0"}).gc_interval_s == 0.0
    assert Settings.from_env({"RUNBRAKE_GC_INTERVAL_S": "2.5"}).gc_interval_s == 2.5
