"""Three minutes of the soak (bench/soak.py, issue 21, item 4): mixed load on two workers, one restarted three
times, ``runbrake serve`` with an events client; every run terminal as its shape says, nothing growing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from runbrake.shared.settings import Settings
from runbrake.shared.store import RunStore

REPO = Path(__file__).resolve().parent.parent
MINUTES = 3
RUNS = MINUTES * 60 * 5
"""5 runs a second, in a cycle of twelve shapes: quick ×4, long ×2, cancel ×2, approve, steered, deny, budgeted."""
RESTARTS = 3
"""Every 45 s: a restart (a hand-over, then a new worker's start) took 40-60 s on this 2-core machine when it
was shared by several test runs, so five in three minutes (the soak's default) did not all fit."""

pytestmark = pytest.mark.long  # first in make test, alone in make test-long (docs/development.md, "Tests")


@pytest.mark.integration
@pytest.mark.timeout(MINUTES * 60 + 420)
def test_three_minutes_of_mixed_load_end_every_run_as_its_shape_says_and_nothing_grows(
    store: RunStore, rabbitmq: Settings, tmp_path: Path,
) -> None:
    out = tmp_path / "soak.json"
    finished = subprocess.run(
        [sys.executable, "-m", "bench.soak", "--minutes", str(MINUTES), "--restarts", str(RESTARTS), "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=MINUTES * 60 + 360, check=False,
    )
    assert out.exists(), finished.stderr[-4000:]
    results = json.loads(out.read_text(encoding="utf-8"))
    context = json.dumps({k: v for k, v in results.items() if k != "samples"}, indent=1)[:6000]
    assert finished.returncode == 0, f"{finished.stderr[-2000:]}\n{context}"
    assert results["verdict"] == "pass", context
    assert results["failed"] == [], context
    runs = results["runs"]
    assert runs["sent"] == runs["terminal"] == RUNS, context
    assert runs["stuck_count"] == 0, context
    assert runs["vanished"] == [], context
    assert runs["unexpected"] == [], context
    assert runs["by_shape"] == {
        "quick": {"completed/completed": RUNS * 4 // 12},
        "long": {"completed/completed": RUNS * 2 // 12},
        "cancel": {"cancelled/cancelled": RUNS * 2 // 12},
        "approve": {"completed/completed": RUNS // 12},
        "deny": {"failed/approval_denied": RUNS // 12},
        "steered": {"completed/completed": RUNS // 12},
        "budgeted": {"cancelled/deadline_exceeded": RUNS // 12},
    }, context
    assert runs["cancelled_in_flight"] == RUNS * 2 // 12, context  # every cancel came while its call ran
    # Every steer came while its call ran, but for a run being handed over just then (it answers without one).
    assert runs["steered_in_flight"] + sum(runs["steers_refused"].values()) >= RUNS // 12 - 3, context
    assert set(runs["steers_refused"]) <= {"queued"}, context
    assert runs["refused_decisions"] == {}, context
    restarts = results["restarts"]
    assert len(restarts) == RESTARTS, context
    assert all(r["exit_code"] == 0 and r["handed_over"] >= 1 for r in restarts), context
    assert runs["handed_over"] >= sum(r["handed_over"] for r in restarts), context
    assert results["processes_alive_at_end"] == dict.fromkeys(
        ("toolbox", "serve", "worker_steady", "worker_rolling"), True), context
    # Samples every 10 s, and one after the last run ended; the events client read the whole time.
    assert len(results["samples"]) >= MINUTES * 6, context
    assert results["events_client"]["status_events"] >= RUNS, context
    # Each worker's /healthz answered with its loop lag (the rolling one not while it restarts).
    assert results["loop_lag_ms"]["worker_steady"]["unanswered"] == 0, context
    assert results["loop_lag_ms"]["worker_rolling"]["samples"] >= MINUTES * 6 - 5, context
