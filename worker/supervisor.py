"""``runbrake worker``: one worker process in place, or N child processes supervised here."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from types import FrameType

import structlog

from runbrake.shared.logging import configure_logging
from runbrake.shared.settings import Settings
from runbrake.worker.process import run_worker_process

log = structlog.get_logger(__name__)


def run_workers(settings: Settings, *, processes: int, threads: int) -> int:
    """Run until SIGTERM/SIGINT. One process runs in place; several run as children that get the
    signal forwarded, so each stops its own segments cleanly. Returns the exit code."""
    configure_logging()
    if processes == 1:
        run_worker_process(settings, threads=threads)
        return 0
    children = [
        subprocess.Popen([sys.executable, "-m", "runbrake.worker", "--index", str(i), "--threads", str(threads)])
        for i in range(processes)
    ]
    stopping = threading.Event()

    def forward(signum: int, _frame: FrameType | None) -> None:
        stopping.set()
        for child in children:
            if child.poll() is None:
                child.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    log.info("workers_started", processes=processes, threads=threads, pids=[c.pid for c in children])
    codes = [child.wait() for child in children]
    if not stopping.is_set():
        log.error("worker_process_exited", codes=codes)
        return 1
    return 0
