"""The replayable feed (docs/http-api.md, "Events: resuming"): ``GET /v1/events`` gives each status change
its event id (the outbox's), and a client that reconnects with ``Last-Event-ID`` gets exactly what happened
meanwhile, then live events, each once; an id older than what is kept is answered with ``resync``. Against
a real ``runbrake serve`` on the real Redis.
"""

from __future__ import annotations

import httpx2
import pytest

from runbrake.shared import RunStatus, RunStore, Settings, TerminationReason
from tests.api_helpers import ApiProcess
from tests.events_helpers import feed, frames, position, stored_statuses
from tests.test_cli import valid_spec

pytestmark = pytest.mark.integration


def test_a_feed_resumed_with_last_event_id_replays_exactly_what_it_missed_then_goes_on_live(
    api: ApiProcess, store: RunStore, settings: Settings
) -> None:
    with feed(api) as response:
        first_run = store.create(valid_spec()).run_id
        seen = next(frames(response))
    assert (seen.event, seen.data["run_id"], seen.data["status"]) == ("status", first_run, "queued")
    assert seen.id is not None

    # Disconnected: two runs come and one ends.
    missed_runs = [store.create(valid_spec()).run_id for _ in range(2)]
    assert store.claim(missed_runs[0], "w", lease_s=60).won
    assert store.settle(missed_runs[0], RunStatus.FAILED, TerminationReason.TOOL_LOOP_ERROR, owner="w").won
    missed = stored_statuses(store, settings, seen.id)
    assert [status for _, _, status in missed] == ["queued", "queued", "running", "failed"]

    with feed(api, seen.id) as response:
        stream = frames(response)
        replayed = [next(stream) for _ in missed]
        store.cancel(missed_runs[1], reason="live", requested_by="test")
        live = next(stream)

    assert [(f.id, f.data["run_id"], f.data["status"]) for f in replayed] == missed
    assert replayed[-1].data["termination_reason"] == "tool_loop_error"
    assert (live.event, live.data["run_id"], live.data["status"]) == ("status", missed_runs[1], "cancelled")
    assert live.id is not None
    assert position(live.id) > position(missed[-1][0])


def test_an_event_id_older_than_what_is_kept_is_answered_with_resync_then_what_is_kept(
    api: ApiProcess, store: RunStore, settings: Settings
) -> None:
    run_id = store.create(valid_spec()).run_id

    with feed(api, "1-0") as response:
        stream = frames(response)
        resync, kept = next(stream), next(stream)

    assert resync.event == "resync"
    assert resync.data["reason"] == "older than the oldest event kept"
    assert (kept.event, kept.data["run_id"], kept.data["status"]) == ("status", run_id, "queued")


@pytest.mark.parametrize("bad", ["12", "abc-1", "1-2-3", "9" * 21 + "-0"])
def test_a_last_event_id_that_is_no_event_id_is_refused_naming_the_header(api: ApiProcess, bad: str) -> None:
    answer = httpx2.get(f"{api.url}/v1/events", headers={"Last-Event-ID": bad})

    assert answer.status_code == 422
    assert answer.json()["errors"][0]["loc"] == ["header", "last-event-id"]
