"""DBOS, as ``bench/peers.py`` measures it: one DBOS process on a PostgreSQL system database the benchmark starts
(:class:`PrivatePostgres`), a queue with ``worker_concurrency`` workflows at once and DBOS's defaults otherwise
(the queue polled once a second, LISTEN/NOTIFY on). Started by the benchmark::

    python -m bench._peer_dbos --database-url postgresql://… --concurrency 8

Workflows (async, each MCP step an async ``@DBOS.step``, as DBOS's docs build an agent's tool calls):
``peer_quick(tag, url, get_sum, echo)`` (one step: the quick run of ``bench/_peer.py``, counted in Redis as that
peer counts); ``peer_slow(marker, url, seconds, after)`` (a step calling ``slow``, then a step calling echo
``after``: the run's next tool call) and ``peer_slow_preemptible`` (the same, its slow step
``preemptible=True``: cancelled when its workflow is). The benchmark cancels with ``DBOSClient.cancel_workflow``
and reads the status DBOS records (``CANCELLED``, ``updated_at``).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType
from typing import Any, Final

import redis.asyncio
from dbos import DBOS

from bench._peer import PeerKeys, end_key, open_client, quick_run
from runbrake.shared.settings import Settings

QUEUE: Final = "peers"
QUICK_WORKFLOW: Final = "peer_quick"
SLOW_WORKFLOW: Final = "peer_slow"
SLOW_PREEMPTIBLE_WORKFLOW: Final = "peer_slow_preemptible"
POSTGRES_BIN: Final = Path("/usr/local/bin")
STARTUP_TIMEOUT_S: Final = 60.0


class PostgresError(RuntimeError):
    """Raised when the benchmark's PostgreSQL cannot be set up or started."""


class PrivatePostgres:
    """A PostgreSQL of the benchmark's own: a temporary data directory, a free loopback port, trust
    authentication, stopped and deleted by :meth:`stop`. Run as the ``postgres`` user when this process is root
    (``initdb`` refuses root)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.directory = Path(tempfile.mkdtemp(prefix="runbrake-peers-pg-"))
        self._data = self.directory / "data"
        self._as_user: list[str] = []
        if os.geteuid() == 0:
            shutil.chown(self.directory, user="postgres")
            self._as_user = ["runuser", "-u", "postgres", "--"]

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/runbrake_peers"

    def _run(self, *command: str) -> None:
        done = subprocess.run([*self._as_user, *command], capture_output=True, text=True, check=False,
                              timeout=STARTUP_TIMEOUT_S)
        if done.returncode != 0:
            raise PostgresError(f"{' '.join(command[:2])} failed ({done.returncode}): "
                                f"{(done.stderr or done.stdout).strip()[-500:]}")

    def start(self) -> None:
        """initdb, then start the server and wait until it accepts connections.

        Raises:
            PostgresError: a step failed (its output says why).
        """
        for name in ("initdb", "pg_ctl", "postgres"):
            if not (POSTGRES_BIN / name).exists():
                raise PostgresError(f"{POSTGRES_BIN / name} is missing")
        self._run(str(POSTGRES_BIN / "initdb"), "-D", str(self._data), "-U", "postgres", "-A", "trust",
                  "--no-sync")
        self._run(str(POSTGRES_BIN / "pg_ctl"), "-D", str(self._data), "-l", str(self.directory / "postgres.log"),
                  "-w", "-t", str(int(STARTUP_TIMEOUT_S)), "-o",
                  f"-p {self.port} -k {self.directory} -c listen_addresses=127.0.0.1 -c fsync=off", "start")

    def stop(self) -> None:
        """Stop the server (fast shutdown) and delete its directory."""
        try:
            if (self._data / "postmaster.pid").exists():
                self._run(str(POSTGRES_BIN / "pg_ctl"), "-D", str(self._data), "-m", "fast", "-w", "stop")
        finally:
            shutil.rmtree(self.directory, ignore_errors=True)


@functools.cache
def _settings() -> Settings:
    return Settings.from_env()


@functools.cache
def _notes() -> redis.asyncio.Redis:
    return redis.asyncio.Redis.from_url(_settings().redis_url)


@DBOS.step()
async def quick_step(tag: str, url: str, get_sum: dict[str, Any], echo: dict[str, Any]) -> None:
    keys = PeerKeys(_settings().namespace, tag)
    try:
        await quick_run(url, get_sum, echo)
    except Exception as exc:
        await _notes().incr(keys.failed)
        await _notes().rpush(keys.errors, f"{type(exc).__name__}: {exc}"[:500])
        raise
    async with _notes().pipeline(transaction=False) as pipe:
        pipe.incr(keys.done)
        pipe.set(keys.last_done, repr(time.time()))
        await pipe.execute()


@DBOS.workflow(name=QUICK_WORKFLOW)
async def peer_quick(tag: str, url: str, get_sum: dict[str, Any], echo: dict[str, Any]) -> None:
    await quick_step(tag, url, get_sum, echo)


async def _call(url: str, tool: str, arguments: dict[str, Any]) -> None:
    async with open_client(url) as client:
        await client.list_tools()
        result = await client.call_tool(tool, arguments)
        if result.is_error:
            raise RuntimeError(f"{tool} answered isError: {result.content!r:.200}")


@DBOS.step()
async def slow_step(url: str, seconds: float) -> None:
    await _call(url, "slow", {"seconds": seconds})


@DBOS.step(preemptible=True)
async def slow_step_preemptible(url: str, seconds: float) -> None:
    await _call(url, "slow", {"seconds": seconds})


@DBOS.step()
async def echo_step(url: str, after: dict[str, Any]) -> None:
    await _call(url, "echo", after)


async def _slow(marker: str, url: str, seconds: float, after: dict[str, Any], *, preemptible: bool) -> None:
    outcome = "returned"
    try:
        await (slow_step_preemptible if preemptible else slow_step)(url, seconds)
        await echo_step(url, after)
    except BaseException as exc:
        outcome = type(exc).__name__
        raise
    finally:
        await _notes().hset(end_key(_settings().namespace, marker), mapping={"outcome": outcome,
                                                                            "t": repr(time.time())})


@DBOS.workflow(name=SLOW_WORKFLOW)
async def peer_slow(marker: str, url: str, seconds: float, after: dict[str, Any]) -> None:
    await _slow(marker, url, seconds, after, preemptible=False)


@DBOS.workflow(name=SLOW_PREEMPTIBLE_WORKFLOW)
async def peer_slow_preemptible(marker: str, url: str, seconds: float, after: dict[str, Any]) -> None:
    await _slow(marker, url, seconds, after, preemptible=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench._peer_dbos", description=__doc__.splitlines()[0])
    parser.add_argument("--database-url", required=True, help="the PostgreSQL system database")
    parser.add_argument("--concurrency", type=int, default=8, help="the queue's worker_concurrency (default 8)")
    args = parser.parse_args(argv)
    DBOS(config={"name": "runbrake-peers", "system_database_url": args.database_url, "log_level": "WARNING"})
    DBOS.launch()
    DBOS.register_queue(QUEUE, worker_concurrency=args.concurrency)
    stop = threading.Event()

    def on_signal(_signum: int, _frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    print(json.dumps({"event": "worker_started", "concurrency": args.concurrency, "queues": [QUEUE],
                      "pid": os.getpid()}), flush=True)
    stop.wait()
    DBOS.destroy(destroy_registry=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
