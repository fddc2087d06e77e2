"""Tree wakes: the agent calls of a worker process wait for their child runs without polling (docs/usage.md,
"Agent trees").

A child run's terminal transition names its caller on the channel ``<ns>:events:tree-wakes``, and a model step
below names each run above (its use grew, for the ancestor's budget: shared/_scripts.py, ``announce_end`` and
``ADD_BELOW``). One :class:`TreeWakes` per process holds one subscription to it, on the process's event loop,
and wakes the waits of the runs named. A wake is only a hint: the waiting call reads the child's status and the
use below from the store, as before; and it still reads them at :data:`FALLBACK_S` without one (a subscription
being re-made, a message missed: pub/sub keeps nothing for a subscriber away).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import Final

import redis.asyncio
import structlog

from runbrake.shared.async_store import plain_client
from runbrake.shared.settings import Settings

log = structlog.get_logger(__name__)

FALLBACK_S: Final = 1.0
"""How long a waiting call goes without a wake before it reads its child's status anyway."""
_RESUBSCRIBE_S: Final = 1.0
"""How long after a lost subscription the next one is tried (the fallback reads go on meanwhile)."""


class TreeWakes:
    """The waits of this process's agent calls, woken by the runs below them (module docstring)."""

    def __init__(self, settings: Settings, channel: str) -> None:
        self._settings = settings
        self._channel = channel
        self._waiting: dict[str, set[asyncio.Event]] = {}
        """Run id -> the events of its calls waiting for a child (a run may wait for several at once)."""
        self._task: asyncio.Task[None] | None = None

    @contextlib.contextmanager
    def watch(self, run_id: str) -> Iterator[asyncio.Event]:
        """An event set whenever a run below ``run_id`` names it (clear it before each wait); on the loop."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="runbrake-tree-wakes")
        event = asyncio.Event()
        self._waiting.setdefault(run_id, set()).add(event)
        try:
            yield event
        finally:
            events = self._waiting.get(run_id)
            if events is not None:
                events.discard(event)
                if not events:
                    del self._waiting[run_id]

    def wake(self, raw: bytes) -> None:
        """A message of the channel: the id of a run whose waits should look again (anything else wakes none)."""
        for event in self._waiting.get(raw.decode(errors="replace"), ()):
            event.set()

    async def _run(self) -> None:
        while True:
            try:
                await self._listen()
            except (redis.RedisError, OSError) as exc:
                log.warning("tree_wakes_disconnected", error=str(exc), retry_in_s=_RESUBSCRIBE_S)
            await asyncio.sleep(_RESUBSCRIBE_S)  # a backoff, not a synchronisation: the waits read at FALLBACK_S

    async def _listen(self) -> None:
        # A plain connection on a Redis Cluster too: a cluster delivers every PUBLISH to the subscribers of every
        # node (broker/events.py does the same for the events channel).
        client = plain_client(self._settings, decode_responses=False, health_check_interval=30,
                              socket_connect_timeout=min(self._settings.redis_timeout_s, 1.0),
                              client_name=f"runbrake-tree-wakes-{self._settings.namespace}")
        pubsub = client.pubsub()
        try:
            await pubsub.subscribe(self._channel)
            async for message in pubsub.listen():
                if message["type"] == "message":
                    self.wake(message["data"])
        finally:
            with contextlib.suppress(redis.RedisError, OSError):
                await pubsub.aclose()  # type: ignore[no-untyped-call]
            with contextlib.suppress(redis.RedisError, OSError):
                await client.aclose()
