"""The one bounded wait the tests use: poll a condition until it holds, fail the test after a deadline.

A poll of something another process writes (a log file, Redis, ``rabbitmqctl``) is waiting on
an event with a bound, not a sleep used as synchronisation.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import anyio
import pytest

T = TypeVar("T")

POLL_S = 0.02


def poll_until(
    check: Callable[[], T | None],
    *,
    timeout: float,
    failure: Callable[[], str],
    interval: float = POLL_S,
    give_up: Callable[[], bool] = lambda: False,
) -> T:
    """Call ``check`` until it returns something truthy and return that; fail the test with
    ``failure()`` after ``timeout`` seconds, or as soon as ``give_up()`` says waiting is pointless."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if give_up() or time.monotonic() >= deadline:
            pytest.fail(failure())
        time.sleep(interval)


async def poll_until_async(
    check: Callable[[], T | None], *, timeout: float, failure: Callable[[], str], interval: float = POLL_S
) -> T:
    """:func:`poll_until` without blocking the event loop (the thing being watched may run on it)."""
    deadline = anyio.current_time() + timeout
    while True:
        result = check()
        if result:
            return result
        if anyio.current_time() >= deadline:
            pytest.fail(failure())
        await anyio.sleep(interval)


__all__ = ["poll_until", "poll_until_async"]
