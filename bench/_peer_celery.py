"""Celery on RabbitMQ, as ``bench/peers.py`` measures it: a prefork worker (Celery's default pool) with
``--concurrency`` child processes, Celery's defaults otherwise (prefetch multiplier 4, acks early, gossip, mingle
and heartbeats on), a Redis result backend, every name under the namespace (queue, exchanges, control and event
exchanges, result keys). Started by the benchmark::

    python -m bench._peer_celery --concurrency 8

Tasks: ``peers.quick(tag, url, get_sum, echo)`` (the quick run of ``bench/_peer.py``, counted in Redis as that peer
counts) and ``peers.slow(marker, url, seconds, after)`` (:func:`bench._peer.slow_then_echo`, whose ``finally`` notes
that its cleanup ran). Celery runs no coroutines: each task runs its MCP work with ``anyio.run``, a new event loop
per task, as Celery's FAQ suggests for asyncio code. The benchmark cancels with ``revoke(task_id)`` and
``revoke(task_id, terminate=True)``; the result backend records how each task ended (``REVOKED``, ``SUCCESS``…) and
when (``date_done``).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any, Final

import anyio
import redis
from celery import Celery
from celery.signals import worker_ready

from bench._peer import PeerKeys, end_key, quick_run, slow_then_echo
from runbrake.shared.settings import Settings

QUICK_TASK: Final = "peers.quick"
SLOW_TASK: Final = "peers.slow"


def celery_queue(namespace: str) -> str:
    return f"{namespace}.celery"


def celery_exchanges(namespace: str) -> tuple[str, ...]:
    """The exchanges the app declares (its queue's, the control ones, the events'), for the cleanup."""
    control = f"{namespace}.celery-control"
    return (celery_queue(namespace), f"{control}.pidbox", f"reply.{control}.pidbox", f"{namespace}.celeryev")


@functools.cache
def _redis(url: str) -> redis.Redis:
    """One client per process (a prefork child builds its own on first use)."""
    return redis.Redis.from_url(url)


def build_app(settings: Settings) -> Celery:
    """The Celery app both the worker and the benchmark use: RabbitMQ broker, Redis results, namespaced names."""
    namespace = settings.namespace
    app = Celery("runbrake-peers", broker=settings.rabbitmq_url, backend=settings.redis_url)
    app.conf.update(
        task_default_queue=celery_queue(namespace),
        task_default_exchange=celery_queue(namespace),
        task_default_routing_key=celery_queue(namespace),
        control_exchange=f"{namespace}.celery-control",
        event_exchange=f"{namespace}.celeryev",
        result_backend_transport_options={"global_keyprefix": f"{namespace}:celery:"},
        broker_connection_retry_on_startup=True,
    )

    @app.task(name=QUICK_TASK)
    def quick(tag: str, url: str, get_sum: dict[str, Any], echo: dict[str, Any]) -> None:
        keys = PeerKeys(namespace, tag)
        counter = _redis(settings.redis_url)
        try:
            anyio.run(quick_run, url, get_sum, echo)
        except Exception as exc:
            counter.incr(keys.failed)
            counter.rpush(keys.errors, f"{type(exc).__name__}: {exc}"[:500])
            raise
        with counter.pipeline(transaction=False) as pipe:
            pipe.incr(keys.done)
            pipe.set(keys.last_done, repr(time.time()))
            pipe.execute()

    @app.task(name=SLOW_TASK)
    def slow(marker: str, url: str, seconds: float, after: dict[str, Any]) -> None:
        outcome = "returned"
        try:
            anyio.run(slow_then_echo, url, seconds, after)
        except BaseException as exc:
            outcome = type(exc).__name__
            raise
        finally:
            _redis(settings.redis_url).hset(end_key(namespace, marker), mapping={"outcome": outcome,
                                                                                "t": repr(time.time())})

    return app


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench._peer_celery", description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=8, help="prefork child processes (default 8)")
    args = parser.parse_args(argv)
    settings = Settings.from_env()
    app = build_app(settings)
    queue = celery_queue(settings.namespace)

    @worker_ready.connect
    def announce(**_kwargs: Any) -> None:
        # Straight to the file descriptor: Celery redirects sys.stdout into its logger.
        os.write(1, (json.dumps({"event": "worker_started", "concurrency": args.concurrency, "queues": [queue],
                                 "pid": os.getpid()}) + "\n").encode())

    app.worker_main(["worker", "--pool=prefork", f"--concurrency={args.concurrency}", "--loglevel=WARNING",
                     "-Q", queue, "-n", f"peers@{settings.namespace}"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
