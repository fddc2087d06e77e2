"""bench/peers.py (issue 20, item 4) without its peers: the module imports without the peers extra (CI does not
install it), its bad arguments exit 2 naming the option, and its verdict on the aims reads the numbers right."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PEER_LIBRARIES = ("arq", "celery", "dbos", "dramatiq_abort")


def _python(*arguments: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *arguments], cwd=REPO, capture_output=True, text=True, timeout=60,
                          check=False)


def test_the_benchmark_imports_none_of_the_peers_libraries_until_a_peer_starts() -> None:
    done = _python("-c", "import json, sys, bench.peers; "
                         f"print(json.dumps(sorted(m for m in {PEER_LIBRARIES!r} if m in sys.modules)))")

    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == []


@pytest.mark.parametrize(("arguments", "named"), [
    (["--runs", "0"], "--runs"),
    (["--runs", "100000"], "--runs"),
    (["--cancels", "-1"], "--cancels"),
    (["--concurrency", "0"], "--concurrency"),
    (["--peers", "celery,sidekiq"], "sidekiq"),
    (["--quiet-wait", "-5"], "--quiet-wait"),
    (["--rounds", "many"], "--rounds"),
])
def test_a_bad_argument_exits_2_naming_it_before_anything_starts(arguments: list[str], named: str) -> None:
    done = _python("-m", "bench.peers", *arguments)

    assert done.returncode == 2
    assert named in done.stderr
    assert "namespace" not in done.stdout  # nothing was started


def test_the_aims_are_judged_against_each_peer_the_leanest_and_celery_terminate() -> None:
    script = """
import json
from bench.peers import ratios
sides = {
    "runbrake": {"per_s": 100.0, "worker_cpu_ms_per_run": 8.0},
    "celery": {"per_s": 80.0, "worker_cpu_ms_per_run": 9.0},
    "arq": {"per_s": 120.0, "worker_cpu_ms_per_run": 7.5},
}
cancels = {
    "runbrake: cancel_run": {"server_saw_stop_ms": {"n": 20, "p50": 5.0, "max": 13.0}},
    "celery: revoke(terminate=True)": {"server_saw_stop_ms": {"n": 20, "p50": 9.0, "max": 12.0}},
}
print(json.dumps(ratios(sides, cancels)))
"""
    done = _python("-c", script)

    assert done.returncode == 0, done.stderr
    verdict = json.loads(done.stdout)
    assert verdict["runbrake_to"]["celery"] == {"runs_per_s": 1.25, "worker_cpu_per_run": 0.889}
    assert verdict["aims"]["runs_per_s_at_least_each"] is False  # arq is faster
    assert verdict["aims"]["cpu_within_1_1x_leanest"] == {"leanest": "arq", "met": True, "ratio": 1.067}
    assert verdict["aims"]["cancel_below_celery_terminate"]["p50"] is True
    assert verdict["aims"]["cancel_below_celery_terminate"]["max"] is False
