"""The hand-written peer of ``bench/overhead.py``: a plain Dramatiq actor doing a quick run's MCP work
without runbrake. Started by the benchmark, in its namespace::

    python -m bench._peer --threads 8

One process: a RabbitMQ broker on the same RabbitMQ (Dramatiq's default middleware plus ``AsyncIO``),
``--threads`` worker threads, prefetch = threads (as ``runbrake.worker.process`` sets it), consuming the
queue ``<ns>.peer`` (and Dramatiq's ``.DQ``/``.XQ`` twins; the benchmark deletes them when it ends).

Per message ``peer_run(tag, url, get_sum_arguments, echo_arguments)``, on Dramatiq's event loop:

1. opens an MCP client over streamable HTTP to ``url``, with an ``httpx2.AsyncClient`` built the way
   runbrake's ``worker/mcp_transport.py`` builds it (one SSL context per process, ``functools.cache``;
   the same timeouts), and the SDK's defaults otherwise;
2. lists the tools, calls ``get-sum``, then ``echo``; a result with ``isError`` counts as a failure;
3. counts the message in Redis (redis-py's asyncio client): ``INCR <ns>:peer:<tag>:done`` and the time of
   the latest completion (``SET …:last_done``, in the same round trip, so the benchmark reads the time the
   work ended rather than the time its poll saw it), or ``INCR …:failed`` and the error.

It prints one JSON line ``{"event": "worker_started", …}`` when it consumes, as a runbrake worker logs.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import ssl
import sys
import threading
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from types import FrameType
from typing import Any, Final

import anyio
import dramatiq
import httpx2
import pika
import redis.asyncio
from dramatiq import Message, Worker
from dramatiq.brokers.rabbitmq import RabbitmqBroker
from dramatiq.middleware import AsyncIO
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp_types import Tool

from runbrake.shared.messaging.wire import Topology
from runbrake.shared.settings import Settings

PEER_ACTOR: Final = "peer_run"
STOP_GRACE_MS: Final = 10_000
MAX_ERRORS_KEPT: Final = 20


def peer_queue(topology: Topology) -> str:
    """The peer's queue: the benchmark's own, under the namespace, beside runbrake's (not one of them)."""
    return f"{topology.namespace}.peer"


@dataclass(frozen=True, slots=True)
class PeerKeys:
    """The Redis keys one batch of peer messages (one ``tag``) counts itself in; under the namespace, so the
    benchmark's cleanup deletes them with the runs."""

    namespace: str
    tag: str

    @property
    def done(self) -> str:
        return f"{self.namespace}:peer:{self.tag}:done"

    @property
    def last_done(self) -> str:
        return f"{self.namespace}:peer:{self.tag}:last_done"

    @property
    def failed(self) -> str:
        return f"{self.namespace}:peer:{self.tag}:failed"

    @property
    def errors(self) -> str:
        return f"{self.namespace}:peer:{self.tag}:errors"


class PeerError(RuntimeError):
    """A tool the peer needs is missing, or a call answered with ``isError``."""


# -- both sides: the broker and the message --------------------------------------------------------


def build_peer_broker(settings: Settings) -> RabbitmqBroker:
    """A plain Dramatiq RabbitMQ broker (default middleware, publisher confirms) with ``AsyncIO`` added.

    The benchmark sends with one of these too: the queue's arguments must be the ones the peer declares."""
    broker = RabbitmqBroker(url=settings.rabbitmq_url, confirm_delivery=True)
    broker.add_middleware(AsyncIO())
    return broker


def peer_message(
    topology: Topology, tag: str, url: str, get_sum: Mapping[str, Any], echo: Mapping[str, Any]
) -> Message[Any]:
    """One message for the peer: everything it needs is in it (a runbrake run keeps its request in Redis)."""
    return Message(queue_name=peer_queue(topology), actor_name=PEER_ACTOR,
                   args=(tag, url, dict(get_sum), dict(echo)), kwargs={}, options={})


def delete_peer_queues(settings: Settings) -> None:
    """Delete the peer's queue and its Dramatiq twins (missing ones are fine)."""
    base = peer_queue(Topology.of(settings))
    connection = pika.BlockingConnection(pika.URLParameters(settings.rabbitmq_url))
    try:
        channel = connection.channel()
        for queue in (base, f"{base}.DQ", f"{base}.XQ"):
            channel.queue_delete(queue=queue)
    finally:
        if connection.is_open:
            connection.close()


# -- the MCP client, as runbrake's worker builds it --------------------------------------------------


@functools.cache
def _ssl_context() -> ssl.SSLContext:
    """One SSL context per process: the SDK's default HTTP client would build one per connection."""
    return ssl.create_default_context()


@asynccontextmanager
async def open_client(url: str) -> AsyncIterator[Client]:
    """An MCP client over streamable HTTP, on an httpx2 client with the process's SSL context."""
    async with (
        httpx2.AsyncClient(verify=_ssl_context(), timeout=httpx2.Timeout(30.0, read=300.0)) as http,
        Client(streamable_http_client(url, http_client=http)) as client,
    ):
        yield client


async def list_tools(url: str) -> dict[str, Tool]:
    """The tools of the server at ``url`` (first page), by name."""
    async with open_client(url) as client:
        page = await client.list_tools()
        return {tool.name: tool for tool in page.tools}


def probe(url: str) -> dict[str, Tool]:
    """:func:`list_tools` from synchronous code (the benchmark's own process)."""
    tools: dict[str, Tool] = anyio.run(list_tools, url)
    return tools


async def quick_run(url: str, get_sum: Mapping[str, Any], echo: Mapping[str, Any]) -> None:
    """A quick run's MCP work: connect, list the tools, call get-sum, then echo.

    Raises:
        PeerError: a tool is missing, or a call answered with ``isError``.
    """
    async with open_client(url) as client:
        page = await client.list_tools()
        names = {tool.name for tool in page.tools}
        for tool, arguments in (("get-sum", get_sum), ("echo", echo)):
            if tool not in names:
                raise PeerError(f"the server at {url} has no tool {tool!r}")
            result = await client.call_tool(tool, dict(arguments))
            if result.is_error:
                raise PeerError(f"{tool} answered isError: {result.content!r:.200}")


async def slow_then_echo(url: str, seconds: float, after: Mapping[str, Any]) -> None:
    """The run ``bench/peers.py`` cancels: connect, list the tools, call ``slow(seconds)``, then echo ``after``
    (the run's next tool call: the server seeing it means something ran after the cancel).

    Raises:
        PeerError: a call answered with ``isError``.
    """
    async with open_client(url) as client:
        await client.list_tools()
        for tool, arguments in (("slow", {"seconds": seconds}), ("echo", after)):
            result = await client.call_tool(tool, dict(arguments))
            if result.is_error:
                raise PeerError(f"{tool} answered isError: {result.content!r:.200}")


def end_key(namespace: str, marker: str) -> str:
    """The Redis hash where a peer's cancelled run notes that its own cleanup (``finally``) ran: ``outcome``
    (the exception that ended it, or ``returned``) and ``t`` (epoch seconds)."""
    return f"{namespace}:peers:end:{marker}"


async def noted_slow_run(notes: redis.asyncio.Redis, namespace: str, marker: str, url: str, seconds: float,
                         after: Mapping[str, Any]) -> None:
    """:func:`slow_then_echo`, its end noted at :func:`end_key` in a ``finally`` (the run's cleanup: whether it
    ran after a cancel is what the benchmark asks)."""
    outcome = "returned"
    try:
        await slow_then_echo(url, seconds, after)
    except BaseException as exc:
        outcome = type(exc).__name__
        raise
    finally:
        await notes.hset(end_key(namespace, marker), mapping={"outcome": outcome, "t": repr(time.time())})


# -- the worker process ------------------------------------------------------------------------------


def declare_peer_actor(broker: RabbitmqBroker, settings: Settings) -> Any:
    """``peer_run(tag, url, get_sum_arguments, echo_arguments)`` on the peer's queue; no retries."""
    counter = redis.asyncio.Redis.from_url(settings.redis_url)  # connects on first use, on the event loop

    async def peer_run(tag: str, url: str, get_sum: dict[str, Any], echo: dict[str, Any]) -> None:
        keys = PeerKeys(settings.namespace, tag)
        try:
            await quick_run(url, get_sum, echo)
        except Exception as exc:
            async with counter.pipeline(transaction=False) as pipe:
                pipe.incr(keys.failed)
                pipe.rpush(keys.errors, f"{type(exc).__name__}: {exc}"[:500])
                pipe.ltrim(keys.errors, 0, MAX_ERRORS_KEPT - 1)
                await pipe.execute()
            raise
        async with counter.pipeline(transaction=False) as pipe:
            pipe.incr(keys.done)
            pipe.set(keys.last_done, repr(time.time()))
            await pipe.execute()

    return dramatiq.actor(broker=broker, actor_name=PEER_ACTOR, queue_name=peer_queue(Topology.of(settings)),
                          max_retries=0)(peer_run)


def run_peer_worker(settings: Settings, *, threads: int) -> None:
    """Consume the peer's queue until SIGTERM or SIGINT."""
    broker = build_peer_broker(settings)
    declare_peer_actor(broker, settings)
    serve(broker, peer_queue(Topology.of(settings)), threads=threads)


def serve(broker: RabbitmqBroker, queue: str, *, threads: int) -> None:
    """Consume ``queue`` with ``broker``'s actors on ``threads`` threads until SIGTERM or SIGINT."""
    worker = Worker(broker, queues={queue}, worker_threads=threads, worker_timeout=200)
    worker.queue_prefetch = threads  # as runbrake's worker: at most one prefetched message per thread
    stop = threading.Event()

    def on_signal(_signum: int, _frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    worker.start()
    print(json.dumps({"event": "worker_started", "threads": threads, "queues": [queue], "pid": os.getpid()}),
          flush=True)
    stop.wait()
    worker.stop(timeout=STOP_GRACE_MS)
    broker.close()
    print(json.dumps({"event": "worker_stopped"}), flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench._peer", description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=8, help="Dramatiq worker threads (default 8)")
    args = parser.parse_args(argv)
    run_peer_worker(Settings.from_env(), threads=args.threads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
