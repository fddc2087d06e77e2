"""Where a worker process's CPU goes: py-spy samples of it, sorted into the parts of a run's work.

``bench/overhead.py --profile`` records the runbrake worker with py-spy (``py-spy record --format raw``:
one line per distinct stack, ``frame;frame;…;leaf count``; threads caught waiting are left out) while the
rounds run, then :func:`shares` sorts each busy sample into a :data:`PARTS` entry. py-spy comes with the
``bench`` extra (``pip install -e '.[bench]'``).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Final

THREADS: Final = (
    ("event relay (outbox to RabbitMQ)", ("OutboxReader.run",)),
    ("run intake (Dramatiq consumer, pika)", ("ConsumerThread.run",)),
    ("periodic parts (leases, liveness, progress, metrics)", ("Periodic.run",)),
    ("cancel listener", ("worker/cancel_listener.py",)),
    ("MCP client: the SDK validating results (jsonschema)", ("validate_tool_result",)),
)
"""Parts named by a frame anywhere in a sample's stack: its thread's, or a call whose inside spans libraries."""
PARTS: Final = (
    ("MCP client (SDK, HTTP)", ("worker/mcp_", "mcp/client/", "mcp/shared/", "httpx2/", "httpcore2/", "h11/")),
    ("durable store (Redis round trips)", ("shared/async_store.py", "shared/store.py", "redis/")),
    ("logging (structlog)", ("structlog/", "shared/logging.py")),
    ("redaction", ("shared/redaction.py",)),
    ("run loop, model steps, records", ("worker/loop.py", "worker/models.py", "worker/conversation.py",
                                        "shared/steps.py", "shared/records.py")),
    ("runtime (intake, slots, event loop)", ("worker/runtime.py", "worker/intake.py", "dramatiq/asyncio.py")),
)
"""The others, by the innermost frame that names one (so a Redis call inside the run loop is the store's)."""
IDLE: Final = ("Condition.wait", "Event.wait", "Lock.acquire", "select (", "poll (", "PollPoller.poll",
               "_run_once", "time.sleep")
"""Leaves of a thread waiting that py-spy still sampled (it leaves most waits out by itself)."""


def py_spy() -> str | None:
    """py-spy on PATH, or next to this Python (a venv not activated); None when it is not installed (it comes
    with the ``bench`` extra: ``pip install -e '.[bench]'``)."""
    beside = Path(sys.executable).parent / "py-spy"
    return shutil.which("py-spy") or (str(beside) if beside.is_file() else None)


class Recording:
    """``py-spy record`` of one process until :meth:`stop` (SIGINT: py-spy writes its file then)."""

    def __init__(self, pid: int, output: Path, *, rate: int = 100) -> None:
        self.output = output
        self._process = subprocess.Popen(
            [str(py_spy()), "record", "--pid", str(pid), "--format", "raw", "--rate", str(rate), "--nonblocking",
             "--output", str(output)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def stop(self, timeout: float = 30.0) -> list[str]:
        """Stop recording; py-spy's raw lines (:func:`shares` sorts them)."""
        os.kill(self._process.pid, signal.SIGINT)
        _, errors = self._process.communicate(timeout=timeout)
        if not self.output.exists():
            raise RuntimeError(f"py-spy wrote no profile: {errors.decode(errors='replace')[-500:]}")
        return self.output.read_text(errors="replace").splitlines()


def shares(lines: Iterable[str]) -> dict[str, float]:
    """Of the busy samples in py-spy's raw lines, the share of each part (``other`` for the rest), largest
    first; ``{}`` when nothing was sampled."""
    counts: Counter[str] = Counter()
    for line in lines:
        stack, _, count = line.rstrip().rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        if any(mark in frames[-1] for mark in IDLE):
            continue
        counts[part_of(stack, frames)] += int(count)
    busy = sum(counts.values())
    return {part: n / busy for part, n in counts.most_common()} if busy else {}


def part_of(stack: str, frames: list[str]) -> str:
    """The part one sample belongs to: the first of :data:`THREADS` its stack names, else the innermost frame's
    that names one of :data:`PARTS`."""
    for part, marks in THREADS:
        if any(mark in stack for mark in marks):
            return part
    for frame in reversed(frames):
        for part, marks in PARTS:
            if any(mark in frame for mark in marks):
                return part
    return "other"
