"""The supervisor supervises: a worker process that dies is restarted and logged; workers that cannot
reach their services say so in one line and exit 3 instead of retrying forever."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from runbrake.shared import Settings
from runbrake.worker import supervisor
from tests.worker_helpers import WorkerProcess, worker_env

pytestmark = pytest.mark.integration

RUNBRAKE = str(Path(sys.executable).parent / "runbrake")
WRONG_PASSWORD = {"RUNBRAKE_RABBITMQ_URL": "amqp://guest:not-the-password@127.0.0.1:5672/"}


def test_a_worker_with_a_wrong_rabbitmq_password_exits_3_with_one_clear_line(rabbitmq: Settings) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "runbrake.worker", "--threads", "2"], env=worker_env(**WRONG_PASSWORD),
        capture_output=True, text=True, timeout=60, check=False,
    )

    assert result.returncode == 3, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) <= 3, lines
    assert "worker_cannot_start" in result.stderr
    assert "not-the-password" not in result.stderr  # the URL's password is redacted from the log


def test_the_supervisor_gives_up_on_children_that_keep_dying_at_start_and_exits_3(rabbitmq: Settings) -> None:
    result = subprocess.run(
        [RUNBRAKE, "worker", "--processes", "2", "--threads", "1"], env=worker_env(**WRONG_PASSWORD),
        capture_output=True, text=True, timeout=120, check=False,
    )

    assert result.returncode == 3, result.stderr[-2000:]
    assert "worker_processes_keep_dying" in result.stderr
    assert result.stderr.count("worker_process_restarted") >= 2


def test_the_supervisor_restarts_a_child_that_died_and_logs_its_exit_status(
    rabbitmq: Settings, tmp_path: Path
) -> None:
    supervisor = WorkerProcess(tmp_path / "supervisor.log", worker_env(),
                               command=[RUNBRAKE, "worker", "--processes", "2", "--threads", "1"], started=2)
    try:
        [started] = supervisor.wait_for_log("workers_started")
        victim = started["pids"][0]
        os.kill(victim, signal.SIGKILL)

        [exited] = supervisor.wait_for_log("worker_process_exited", timeout=10)
        supervisor.wait_for_log("worker_process_restarted", timeout=15)
        supervisor.wait_for_log("worker_started", count=3, timeout=30)
    finally:
        code = supervisor.stop()

    assert (exited["pid"], exited["exit_status"]) == (victim, -signal.SIGKILL)
    assert code == 0


def test_children_that_exit_3_count_as_dying_at_start_however_long_they_took(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # On a loaded host a child with a wrong password can take longer than EARLY_DEATH_S to say so and exit 3;
    # the supervisor used to count that as a late death (and reset the count while the child was still
    # starting), so it restarted such children forever instead of exiting 3.
    monkeypatch.setattr(supervisor, "EARLY_DEATH_S", 0.05)
    monkeypatch.setattr(supervisor, "POLL_S", 0.05)
    slow_failure = [sys.executable, "-c", "import sys, time; time.sleep(0.3); sys.exit(3)"]
    children = [supervisor._Child(i, slow_failure) for i in range(2)]
    for child in children:
        child.start()
    monkeypatch.setattr(supervisor, "MAX_BACKOFF_S", 0.0)  # restart at once: the test is about counting

    code = supervisor._supervise(children, threading.Event())

    for child in children:
        child.process.wait(timeout=10)
    assert code == 3
    assert max(child.early_deaths for child in children) == supervisor.EARLY_DEATHS_TO_GIVE_UP


def test_the_default_process_count_is_the_cpus_python_says_this_process_may_use(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Python 3.13's os.process_cpu_count() counts the affinity mask (and PYTHON_CPU_COUNT); before it, the mask.
    monkeypatch.setattr(os, "process_cpu_count", lambda: 5, raising=False)
    assert supervisor.default_processes() == 5

    monkeypatch.setattr(os, "process_cpu_count", lambda: None, raising=False)
    assert supervisor.default_processes() == 1  # "cannot tell" is one process, never none

    monkeypatch.delattr(os, "process_cpu_count", raising=False)
    assert supervisor.default_processes() == len(os.sched_getaffinity(0))


@pytest.mark.parametrize("cpus", ["one", "all"])
def test_without_processes_the_worker_starts_one_process_per_cpu_it_may_use(
    rabbitmq: Settings, tmp_path: Path, cpus: str
) -> None:
    usable = sorted(os.sched_getaffinity(0))
    allowed = usable[:1] if cpus == "one" else usable
    if len(allowed) == 1 and cpus == "all":
        pytest.skip("this machine lets the tests use one CPU: 'one' covers it")
    taskset = ["taskset", "--cpu-list", ",".join(map(str, allowed))]
    worker = WorkerProcess(tmp_path / "worker.log", worker_env(),
                           command=[*taskset, RUNBRAKE, "worker", "--concurrency", "1"], started=len(allowed))
    try:
        started = worker.logged("worker_started")
        supervised = worker.logged("workers_started")
    finally:
        code = worker.stop()

    assert code == 0
    if len(allowed) == 1:
        assert supervised == []  # one process runs in place, with no supervisor
        assert [entry["pid"] for entry in started] == [worker.pid]
    else:
        [entry] = supervised
        assert entry["processes"] == len(allowed)
        assert sorted(e["pid"] for e in started) == sorted(entry["pids"])
