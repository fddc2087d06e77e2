"""The parts of a worker process beside its intake: each is started, asked to stop, joined, and says whether
it is healthy (docs/architecture.md, "The worker's parts").

worker/process.py lists them once, in start order, and stops them in reverse. Most are :class:`Periodic`:
one thread that does :meth:`Periodic.tick` every interval until it is stopped (the backstop, the lease
keeper, the re-drive, the retention sweeper, the service checks). The cancel listener and the
cancel-request consumer are RabbitMQ consumers (worker/_consumer.py); the health and metrics endpoints are
:class:`ServerPart`. Every one is a :class:`Part`.
"""

from __future__ import annotations

import socketserver
import threading
from dataclasses import dataclass

import structlog

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class Health:
    """What a part says of itself: whether it works, and a detail for a person."""

    ok: bool
    detail: str


class Part:
    """One part of a worker process. ``stop`` only asks (from any thread) and returns; ``join`` waits."""

    def start(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def join(self, timeout: float | None = None) -> None:
        raise NotImplementedError

    def health(self) -> Health:
        raise NotImplementedError

    def replacement(self) -> Part | None:
        """A fresh part to start in place of this one if it died (None: nothing replaces it)."""
        return None


class PartThread(threading.Thread, Part):
    """A part that is one daemon thread; :meth:`stop` sets :attr:`_stopping`, which the thread watches."""

    def __init__(self, name: str) -> None:
        super().__init__(name=name, daemon=True)
        self._stopping = threading.Event()

    def stop(self) -> None:
        self._stopping.set()

    def health(self) -> Health:
        return Health(True, "running") if self.is_alive() else Health(False, "not running")


class Periodic(PartThread):
    """A thread that calls :meth:`tick` every ``interval_s`` until stopped (first at once with
    ``tick_first``; never when not ``enabled``). A tick that raises is logged and the next one comes."""

    def __init__(self, name: str, *, interval_s: float, tick_first: bool = False, enabled: bool = True) -> None:
        super().__init__(name)
        self.interval_s = interval_s
        self._tick_first = tick_first
        self._enabled = enabled

    def tick(self) -> None:
        raise NotImplementedError

    def run(self) -> None:
        try:
            if not self._enabled:
                return
            if self._tick_first:
                self._tick()
            while not self._stopping.wait(self.interval_s):
                self._tick()
        finally:
            self._stopped()

    def _tick(self) -> None:
        try:
            self.tick()
        except Exception:  # the part goes on: a dead thread would leave its job undone for good
            log.exception("worker_part_tick_failed", part=self.name)

    def _stopped(self) -> None:
        """Called once, on the thread, as it ends."""

    def health(self) -> Health:
        if not self._enabled:
            return Health(True, "off")
        return super().health()


class ServerPart(Part):
    """A socket server (the health or the metrics endpoint), bound when built: a port already taken fails
    the process before it takes a run. Serves on a daemon thread of its own."""

    def __init__(self, name: str, server: socketserver.BaseServer) -> None:
        self.server = server
        self._thread = threading.Thread(target=server.serve_forever, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        if self._thread.is_alive():
            self.server.shutdown()  # waits for serve_forever's next poll, half a second at most

    def join(self, timeout: float | None = None) -> None:
        if self._thread.is_alive():
            self._thread.join(timeout)
        self.server.server_close()

    def health(self) -> Health:
        return Health(True, "serving") if self._thread.is_alive() else Health(False, "not serving")


def start_all(parts: list[Part]) -> None:
    """Start ``parts`` in their order."""
    for part in parts:
        part.start()


def stop_all(parts: list[Part], *, join_s: float) -> None:
    """Ask ``parts`` to stop in reverse order, then join them in that order, each for ``join_s`` at most."""
    for part in reversed(parts):
        part.stop()
    for part in reversed(parts):
        part.join(join_s)
