"""Dramatiq with ``dramatiq-abort``, as ``bench/peers.py`` measures it: the hand-written peer of
``bench/_peer.py`` (same broker, the ``AsyncIO`` middleware, the same MCP client) plus ``Abortable`` on a Redis
backend, as dramatiq-abort's README sets it up, with its defaults (every actor abortable, abort mode ``ABORT``,
the watcher waiting 1 s per cycle). Started by the benchmark, in its namespace::

    python -m bench._peer_abort --threads 8

Actors on the queue ``<ns>.peer``: ``peer_run`` (the quick run of ``bench/_peer.py``) and
``peer_slow(marker, url, seconds, after)`` (:func:`bench._peer.slow_then_echo`), whose ``finally`` notes in Redis
that its cleanup ran (:func:`bench._peer.end_key`). How Dramatiq itself ended each message (``done``, or
``failed`` with the exception's name) is written by a small middleware to :func:`record_key`, with the time: the
"run recorded as stopped" of the benchmark.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from typing import Any, Final

import dramatiq
import redis
import redis.asyncio
from dramatiq import Message, Middleware
from dramatiq.brokers.rabbitmq import RabbitmqBroker
from dramatiq_abort import Abortable, abort
from dramatiq_abort.backends import RedisBackend

from bench._peer import build_peer_broker, declare_peer_actor, noted_slow_run, peer_queue, serve
from runbrake.shared.messaging.wire import Topology
from runbrake.shared.settings import Settings

SLOW_ACTOR: Final = "peer_slow"


def record_key(namespace: str, message_id: str) -> str:
    """The Redis hash where Dramatiq's verdict on a message is written: ``status`` and ``t`` (epoch seconds)."""
    return f"{namespace}:peers:dramatiq:{message_id}"


def build_abort_broker(settings: Settings) -> RabbitmqBroker:
    """The peer's broker with ``Abortable`` on Redis (its keys under the namespace); both sides use one."""
    broker = build_peer_broker(settings)
    backend = RedisBackend(client=redis.Redis.from_url(settings.redis_url),
                           namespace=f"{settings.namespace}:dramatiq-aborts:")
    broker.add_middleware(Abortable(backend=backend))
    return broker


def slow_message(topology: Topology, marker: str, url: str, seconds: float, after: dict[str, Any]) -> Message[Any]:
    """A message for ``peer_slow``."""
    return Message(queue_name=peer_queue(topology), actor_name=SLOW_ACTOR, args=(marker, url, seconds, after),
                   kwargs={}, options={})


def abort_message(broker: RabbitmqBroker, message_id: str) -> None:
    """dramatiq-abort's ``abort(message_id)`` with its defaults (mode ABORT), through ``broker``'s Abortable."""
    middleware = next(m for m in broker.middleware if isinstance(m, Abortable))
    abort(message_id, middleware=middleware)


class Verdicts(Middleware):
    """Writes how Dramatiq ended each ``peer_slow`` message (done, or failed with the exception) to Redis."""

    def __init__(self, settings: Settings) -> None:
        self._namespace = settings.namespace
        self._redis = redis.Redis.from_url(settings.redis_url)

    def after_process_message(self, broker: dramatiq.Broker, message: Message[Any], *, result: Any = None,
                              exception: BaseException | None = None) -> None:
        if message.actor_name != SLOW_ACTOR:
            return
        status = "done" if exception is None else f"failed ({type(exception).__name__})"
        self._redis.hset(record_key(self._namespace, message.message_id), mapping={"status": status,
                                                                                    "t": repr(time.time())})


def declare_slow_actor(broker: RabbitmqBroker, settings: Settings) -> Any:
    """``peer_slow(marker, url, seconds, after)`` on the peer's queue; no retries."""
    notes = redis.asyncio.Redis.from_url(settings.redis_url)

    async def peer_slow(marker: str, url: str, seconds: float, after: dict[str, Any]) -> None:
        await noted_slow_run(notes, settings.namespace, marker, url, seconds, after)

    return dramatiq.actor(broker=broker, actor_name=SLOW_ACTOR, queue_name=peer_queue(Topology.of(settings)),
                          max_retries=0)(peer_slow)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench._peer_abort", description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=8, help="Dramatiq worker threads (default 8)")
    args = parser.parse_args(argv)
    settings = Settings.from_env()
    broker = build_abort_broker(settings)
    broker.add_middleware(Verdicts(settings))
    declare_peer_actor(broker, settings)
    declare_slow_actor(broker, settings)
    serve(broker, peer_queue(Topology.of(settings)), threads=args.threads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
