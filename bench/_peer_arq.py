"""arq, as ``bench/peers.py`` measures it: one ``arq`` worker (``run_worker``, arq's defaults: 0.5 s poll, results
kept an hour) with ``allow_abort_jobs=True`` (what ``Job.abort`` needs) and ``max_jobs`` jobs at once, on the
queue ``<ns>:arq:queue``. Started by the benchmark, in its namespace::

    python -m bench._peer_arq --max-jobs 8

Functions: ``quick(tag, url, get_sum, echo)`` (the quick run of ``bench/_peer.py``, counted in Redis as that
peer counts) and ``slow(marker, url, seconds, after)`` (:func:`bench._peer.slow_then_echo`, whose ``finally``
notes that its cleanup ran). arq keeps its job keys under its own fixed prefix (``arq:job:<id>``,
``arq:result:<id>``, the ``arq:abort`` set): the benchmark names every job ``<ns>-…`` and deletes those keys.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any, Final

from arq.connections import RedisSettings
from arq.worker import run_worker

from bench._peer import PeerKeys, noted_slow_run, quick_run
from runbrake.shared.settings import Settings

ARQ_PREFIXES: Final = ("arq:job:", "arq:result:", "arq:in-progress:", "arq:retry:")
ARQ_ABORT_SET: Final = "arq:abort"


def arq_queue(namespace: str) -> str:
    """The peer's arq queue (a sorted set), under the namespace."""
    return f"{namespace}:arq:queue"


def redis_settings(settings: Settings) -> RedisSettings:
    return RedisSettings.from_dsn(settings.redis_url)


async def quick(ctx: dict[str, Any], tag: str, url: str, get_sum: dict[str, Any], echo: dict[str, Any]) -> None:
    """The quick run, counted in Redis (``PeerKeys``) on arq's own connection."""
    keys = PeerKeys(ctx["namespace"], tag)
    try:
        await quick_run(url, get_sum, echo)
    except Exception as exc:
        await ctx["redis"].incr(keys.failed)
        await ctx["redis"].rpush(keys.errors, f"{type(exc).__name__}: {exc}"[:500])
        raise
    async with ctx["redis"].pipeline(transaction=False) as pipe:
        pipe.incr(keys.done)
        pipe.set(keys.last_done, repr(time.time()))
        await pipe.execute()


async def slow(ctx: dict[str, Any], marker: str, url: str, seconds: float, after: dict[str, Any]) -> None:
    """The run the benchmark cancels with ``Job.abort``; its ``finally`` notes that cleanup ran."""
    await noted_slow_run(ctx["redis"], ctx["namespace"], marker, url, seconds, after)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench._peer_arq", description=__doc__.splitlines()[0])
    parser.add_argument("--max-jobs", type=int, default=8, help="jobs at once (arq's max_jobs; default 8)")
    args = parser.parse_args(argv)
    settings = Settings.from_env()

    async def on_startup(ctx: dict[str, Any]) -> None:
        ctx["namespace"] = settings.namespace
        print(json.dumps({"event": "worker_started", "max_jobs": args.max_jobs,
                          "queues": [arq_queue(settings.namespace)], "pid": os.getpid()}), flush=True)

    class WorkerSettings:
        functions: Final = [quick, slow]

    run_worker(WorkerSettings, redis_settings=redis_settings(settings), queue_name=arq_queue(settings.namespace),
               max_jobs=args.max_jobs, allow_abort_jobs=True, on_startup=on_startup, handle_signals=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
