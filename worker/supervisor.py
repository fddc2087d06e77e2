"""``runbrake worker``: one worker process in place, or N child processes supervised here (by default one
per CPU this process may use, :func:`default_processes`).

The supervisor forwards SIGTERM/SIGINT to its children so each stops its own segments cleanly, and
restarts a child that dies (logged with its exit status, after a backoff that grows while deaths
come quickly). A child that keeps dying right after it starts (a wrong password, a port taken) makes
the supervisor give up and exit non-zero rather than restart it forever: code 3 when the children
said a service could not be reached, 1 otherwise.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import FrameType

import structlog

from runbrake.shared.logging import configure_logging
from runbrake.shared.settings import Settings
from runbrake.worker.process import EXIT_UNAVAILABLE, run_worker_process

log = structlog.get_logger(__name__)

EARLY_DEATH_S = 10.0
"""A child that dies within this long of its start died starting."""
EARLY_DEATHS_TO_GIVE_UP = 3
"""Consecutive deaths at start after which the supervisor gives up."""
MAX_BACKOFF_S = 30.0
POLL_S = 0.5


def default_processes() -> int:
    """One worker process per CPU this process may use, as Dramatiq does: ``os.process_cpu_count()`` where
    Python has it (3.13), else the CPUs of this process's affinity mask (``taskset``, a cpuset).

    A container sees the node's CPUs either way, not its CPU limit: the manifests in deploy/ set
    ``--processes`` explicitly (docs/deploying.md, "Sizing processes and concurrency").
    """
    process_cpu_count: Callable[[], int | None] | None = getattr(os, "process_cpu_count", None)
    count = process_cpu_count() if process_cpu_count is not None else len(os.sched_getaffinity(0))
    return max(1, count or 1)


@dataclass
class _Child:
    index: int
    command: list[str]
    process: subprocess.Popen[bytes] = field(init=False)
    started: float = field(init=False)
    early_deaths: int = 0

    def start(self) -> None:
        self.process = subprocess.Popen(self.command)
        self.started = time.monotonic()


def run_workers(settings: Settings, *, processes: int | None, concurrency: int) -> int:
    """Run until SIGTERM/SIGINT; returns the exit code. ``processes`` None: :func:`default_processes`."""
    configure_logging()
    if processes is None:
        processes = default_processes()
    if processes == 1:
        return run_worker_process(settings, concurrency=concurrency)
    children = [
        _Child(i, [sys.executable, "-m", "runbrake.worker", "--index", str(i), "--concurrency", str(concurrency)])
        for i in range(processes)
    ]
    for child in children:
        child.start()
    stopping = threading.Event()

    def forward(signum: int, _frame: FrameType | None) -> None:
        stopping.set()
        for child in children:
            if child.process.poll() is None:
                child.process.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    log.info("workers_started", processes=processes, concurrency=concurrency, pids=[c.process.pid for c in children])
    code = _supervise(children, stopping)
    for child in children:
        child.process.wait()
    return code


def _supervise(children: list[_Child], stopping: threading.Event) -> int:
    restart_at: dict[int, float] = {}
    while not stopping.wait(POLL_S):
        for child in children:
            if child.index in restart_at:
                if time.monotonic() >= restart_at[child.index] and not stopping.is_set():
                    del restart_at[child.index]
                    child.start()
                    log.info("worker_process_restarted", index=child.index, pid=child.process.pid)
                continue
            status = child.process.poll()
            if status is None:
                continue
            # Exit 3 is the child saying it could not start (worker_cannot_start), however long that took: on
            # a loaded host a child can take longer than EARLY_DEATH_S to find out, and must still count.
            early = status == EXIT_UNAVAILABLE or time.monotonic() - child.started < EARLY_DEATH_S
            child.early_deaths = child.early_deaths + 1 if early else 0
            log.error("worker_process_exited", index=child.index, pid=child.process.pid, exit_status=status,
                      while_starting=early)
            if child.early_deaths >= EARLY_DEATHS_TO_GIVE_UP:
                log.critical("worker_processes_keep_dying", index=child.index, exit_status=status,
                             deaths=child.early_deaths, action="stopping every worker process")
                for other in children:
                    if other.process.poll() is None:
                        other.process.send_signal(signal.SIGTERM)
                return EXIT_UNAVAILABLE if status == EXIT_UNAVAILABLE else 1
            restart_at[child.index] = time.monotonic() + min(MAX_BACKOFF_S, 2.0 ** child.early_deaths)
    return 0
