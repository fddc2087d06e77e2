"""The runtime's step hook: the probe that decides whether a run stops at a boundary."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from structlog.testing import capture_logs

from runbrake.shared import AsyncRunStore, CancelRequested, Settings, StoreError
from runbrake.worker.registry import ActiveRuns
from runbrake.worker.runtime import RunHooks
from tests.ports import free_port


@pytest.fixture
async def unreachable_store() -> AsyncIterator[AsyncRunStore]:
    store = AsyncRunStore.connect(Settings(redis_url=f"redis://127.0.0.1:{free_port()}/0", redis_timeout_s=0.5))
    yield store
    await store.aclose()


@pytest.mark.anyio
async def test_the_probe_fabricates_no_cancel_when_redis_is_unreachable(unreachable_store: AsyncRunStore) -> None:
    """The probe before a model call is its sent mark (MARK_SENT): it is retried while Redis is away, and a Redis
    that stays away is a store error, never a cancel."""
    handle = ActiveRuns().register("run-1", "owner-1")
    hooks = RunHooks(unreachable_store, handle, max_steps=200, lease_s=1.0)

    with capture_logs() as logs, pytest.raises(StoreError):
        await hooks.checkpoint(0)

    assert {e["write"] for e in logs if e["event"] == "store_write_retrying"} == {"mark_sent"}


@pytest.mark.anyio
async def test_a_cancel_the_listener_verified_stops_the_run_without_asking_redis(
    unreachable_store: AsyncRunStore,
) -> None:
    handle = ActiveRuns().register("run-1", "owner-1")
    handle.cancel_seen = True
    hooks = RunHooks(unreachable_store, handle, max_steps=200)

    with capture_logs() as logs, pytest.raises(CancelRequested):
        await hooks.checkpoint(0)

    assert [e for e in logs if e["event"] == "store_write_retrying"] == []
