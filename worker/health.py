"""The worker's health endpoints and its service checks (docs/leases.md, "Health and readiness").

Each worker process with ``RUNBRAKE_HEALTH_PORT`` set serves, on that port plus its index:

- ``GET /healthz`` (liveness): the process answers and its event loop runs a no-op scheduled with
  ``loop.call_soon_threadsafe`` within :data:`LOOP_TIMEOUT_S`. Every run of the process lives on that
  one loop, so a loop that does not answer is a process to restart.
- ``GET /readyz`` (readiness): Redis answered a PING and RabbitMQ a round trip within the last
  :data:`STALE_AFTER_S`, the cancel listener is bound and consuming, a consumer thread is alive and the run
  queue is consumed (``consumers``: a worker whose threads died, or whose queue declaration RabbitMQ refuses,
  takes no run), and the process is not draining (it got SIGTERM).

Both listen on ``RUNBRAKE_HEALTH_HOST`` (loopback unless set: the Kubernetes manifests set ``0.0.0.0`` so
that the kubelet reaches the pod's address).

Both answer 200 or 503 with one JSON object: ``{"ok": bool, "failed": [names], "checks": {name:
{"ok": bool, "detail": str}}}``.

:class:`ServiceChecks` is the thread behind the Redis and RabbitMQ checks, every
:data:`CHECK_INTERVAL_S`, on a pika connection of its own (pika is not thread-safe). With metrics on,
it also samples ``runbrake_queue_depth``: the one process of the namespace holding the short-lived
Redis lock ``<ns>:queue-depth-sampler`` reads the run queue's ready messages with a passive
``queue_declare`` (docs/messages.md, "Run queue: declaration").
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Final

import pika
import pika.exceptions
import redis
import structlog
from dramatiq.asyncio import get_event_loop_thread

from runbrake.shared.errors import StoreError
from runbrake.shared.messaging.wire import Topology, connection_parameters
from runbrake.shared.settings import Settings
from runbrake.shared.store import RunStore
from runbrake.worker import metrics
from runbrake.worker.parts import Part, Periodic, ServerPart

log = structlog.get_logger(__name__)

LOOP_TIMEOUT_S: Final = 2.0
"""How long /healthz waits for the event loop to run a no-op."""
CHECK_INTERVAL_S: Final = 5.0
"""How often the Redis and RabbitMQ checks (and the queue-depth sample) run."""
STALE_AFTER_S: Final = 3 * CHECK_INTERVAL_S
"""A check older than this counts as failed: a check thread stuck on a dead connection shows up too."""
SAMPLER_TTL_MS: Final = 15_000
"""The queue-depth sampler's lock lives this long unless renewed: another process takes over that soon
after the sampler dies."""

# KEYS[1] the sampler lock; ARGV[1] this process's identity; ARGV[2] the lock's TTL in ms.
# Returns 1 while this process holds the lock (taken now, or renewed), 0 while another one does.
_HOLD_SAMPLER: Final = """
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return 1 end
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
"""
# KEYS[1] the sampler lock; ARGV[1] this process's identity. Deletes the lock only if it is ours.
_RELEASE_SAMPLER: Final = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


@dataclass(frozen=True, slots=True)
class Check:
    """One named check's verdict."""

    name: str
    ok: bool
    detail: str


@dataclass(frozen=True, slots=True)
class Report:
    """The verdict of an endpoint: OK only when every check is."""

    checks: tuple[Check, ...]

    @property
    def ok(self) -> bool:
        return all(check.ok for check in self.checks)

    @property
    def failed(self) -> list[str]:
        return [check.name for check in self.checks if not check.ok]

    @property
    def status(self) -> HTTPStatus:
        return HTTPStatus.OK if self.ok else HTTPStatus.SERVICE_UNAVAILABLE

    def body(self) -> dict[str, object]:
        return {
            "ok": self.ok,
            "failed": self.failed,
            "checks": {check.name: {"ok": check.ok, "detail": check.detail} for check in self.checks},
        }


def event_loop_check(timeout_s: float = LOOP_TIMEOUT_S) -> Check:
    """Schedule a no-op on Dramatiq's event loop from this thread and wait for it, at most ``timeout_s``."""
    loop_thread = get_event_loop_thread()
    if loop_thread is None or not loop_thread.loop.is_running():
        return Check("event_loop", ok=False, detail="the event loop is not running")
    answered = threading.Event()
    started = time.monotonic()
    try:
        loop_thread.loop.call_soon_threadsafe(answered.set)
    except RuntimeError:  # closed between the check and the call
        return Check("event_loop", ok=False, detail="the event loop is closed")
    if not answered.wait(timeout_s):
        return Check("event_loop", ok=False, detail=f"no answer within {timeout_s:g} s")
    return Check("event_loop", ok=True, detail=f"answered in {(time.monotonic() - started) * 1000:.1f} ms")


@dataclass(slots=True)
class _Result:
    ok: bool
    at: float
    """time.monotonic() of the check."""
    detail: str


class ServiceChecks(Periodic):
    """Every interval: PING Redis, a round trip to RabbitMQ, and (when asked to) the queue-depth sample."""

    def __init__(
        self, settings: Settings, store: RunStore, *, sample_queue_depth: bool,
        interval_s: float = CHECK_INTERVAL_S, stale_after_s: float = STALE_AFTER_S,
    ) -> None:
        super().__init__("runbrake-service-checks", interval_s=interval_s, tick_first=True)
        self._settings = settings
        self._store = store
        self._sample = sample_queue_depth
        self._stale_after_s = stale_after_s
        self._run_queue = Topology.of(settings).run_queue
        self._sampler_key = f"{settings.namespace}:queue-depth-sampler"
        self._identity = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._hold_sampler = store.redis.register_script(_HOLD_SAMPLER)
        self._release_sampler = store.redis.register_script(_RELEASE_SAMPLER)
        self._sampling = False
        """This process holds the sampler lock."""
        self._exported = False
        """This process exports a runbrake_queue_depth sample."""
        self._lock = threading.Lock()
        self._results: dict[str, _Result] = {}
        self._connection: pika.BlockingConnection | None = None
        self._channel: pika.adapters.blocking_connection.BlockingChannel | None = None

    # -- the thread ------------------------------------------------------------------------------

    def tick(self) -> None:
        try:
            self.check_once()
        except Exception:  # the thread goes on: a dead one would leave /readyz stale for good
            log.exception("service_checks_round_failed")
            self._close()

    def _stopped(self) -> None:
        self.close()

    def close(self) -> None:
        """Resign as the queue-depth sampler (the lock is released, so another process takes over at its
        next check) and close the RabbitMQ connection. From the thread that ran the checks: the thread
        does it on its way out; a caller of :meth:`check_once` does it itself."""
        self._stop_sampling(release=True)
        self._close()

    @property
    def sampling(self) -> bool:
        """This process holds the sampler lock and exports ``runbrake_queue_depth``."""
        return self._sampling

    def check_once(self) -> None:
        """One round: Redis, RabbitMQ, and the queue-depth sample. Called by the thread (tests call it too)."""
        self._check_redis()
        self._check_rabbitmq()
        if self._sample:
            self._sample_queue_depth()

    # -- verdicts --------------------------------------------------------------------------------

    def verdict(self, name: str, *, now: float | None = None) -> Check:
        """``redis`` or ``rabbitmq``: OK when the last check succeeded and is recent."""
        now = time.monotonic() if now is None else now
        with self._lock:
            result = self._results.get(name)
        if result is None:
            return Check(name, ok=False, detail="not checked yet")
        age = now - result.at
        if age > self._stale_after_s:
            return Check(name, ok=False, detail=f"last checked {age:.1f} s ago ({result.detail})")
        return Check(name, ok=result.ok, detail=f"{result.detail}, {age:.1f} s ago")

    def _record(self, name: str, ok: bool, detail: str) -> None:
        with self._lock:
            previous = self._results.get(name)
            self._results[name] = _Result(ok=ok, at=time.monotonic(), detail=detail)
        if not ok and (previous is None or previous.ok):
            log.warning("service_check_failed", service=name, detail=detail)
        elif ok and previous is not None and not previous.ok:
            log.info("service_check_recovered", service=name)

    # -- the checks ------------------------------------------------------------------------------

    def _check_redis(self) -> None:
        try:
            self._store.ping()
        except StoreError as exc:
            self._record("redis", ok=False, detail=str(exc))
        else:
            self._record("redis", ok=True, detail="PING answered")

    def _check_rabbitmq(self) -> None:
        try:
            channel = self._open_channel()
            channel.basic_qos(prefetch_count=0)  # a synchronous round trip that changes nothing
        except pika.exceptions.AMQPError as exc:
            self._close()
            self._record("rabbitmq", ok=False, detail=repr(exc))
        else:
            self._record("rabbitmq", ok=True, detail="round trip answered")

    def _open_channel(self) -> pika.adapters.blocking_connection.BlockingChannel:
        if self._connection is None or not self._connection.is_open:
            self._close()
            parameters = connection_parameters(
                self._settings, name=f"runbrake-health {self._settings.namespace} pid={os.getpid()}",
                socket_timeout=5, heartbeat=30)
            self._connection = pika.BlockingConnection(parameters)
        if self._channel is None or not self._channel.is_open:
            self._channel = self._connection.channel()
        return self._channel

    def _close(self) -> None:
        connection, self._connection, self._channel = self._connection, None, None
        if connection is not None and connection.is_open:
            with contextlib.suppress(pika.exceptions.AMQPError):
                connection.close()

    # -- the queue-depth sample ------------------------------------------------------------------

    def _sample_queue_depth(self) -> None:
        try:
            holds = bool(self._hold_sampler(keys=[self._sampler_key], args=[self._identity, SAMPLER_TTL_MS]))
        except redis.RedisError as exc:
            log.debug("queue_depth_sampler_unknown", error=repr(exc))
            holds = False
        if not holds:
            self._stop_sampling(release=False)
            return
        if not self._sampling:
            self._sampling = True
            log.info("queue_depth_sampler_elected", queue=self._run_queue)
        try:
            frame = self._open_channel().queue_declare(queue=self._run_queue, passive=True)
        except pika.exceptions.AMQPError as exc:  # 404 until a worker or producer declared the queue
            self._channel = None
            self._drop_sample()
            log.debug("queue_depth_not_sampled", queue=self._run_queue, error=repr(exc))
            return
        metrics.QUEUE_DEPTH.labels(queue=self._run_queue).set(frame.method.message_count)
        self._exported = True

    def _drop_sample(self) -> None:
        if self._exported:
            self._exported = False
            metrics.QUEUE_DEPTH.remove(self._run_queue)

    def _stop_sampling(self, *, release: bool) -> None:
        """Drop this process's sample (another process now samples, or none) and, on the way out,
        hand the lock over at once instead of letting it expire."""
        if self._sampling:
            self._sampling = False
            log.info("queue_depth_sampler_resigned", queue=self._run_queue)
        self._drop_sample()
        if release and self._sample:
            with contextlib.suppress(redis.RedisError):
                self._release_sampler(keys=[self._sampler_key], args=[self._identity])


class HealthEndpoints:
    """What /healthz and /readyz answer, from the process's parts."""

    def __init__(
        self, services: ServiceChecks, listener_ready: threading.Event, draining: threading.Event,
        *, consumers: Callable[[], tuple[bool, str]], loop_check: Callable[[], Check] = event_loop_check,
    ) -> None:
        self._services = services
        self._listener_ready = listener_ready
        self._draining = draining
        self._consumers = consumers
        """Whether the process takes run messages, and a detail (``Intake.consumer_status``)."""
        self._loop_check = loop_check

    def liveness(self) -> Report:
        return Report((self._loop_check(),))

    def readiness(self) -> Report:
        now = time.monotonic()
        listening = self._listener_ready.is_set()
        draining = self._draining.is_set()
        consuming, consumers = self._consumers()
        return Report((
            self._services.verdict("redis", now=now),
            self._services.verdict("rabbitmq", now=now),
            Check("cancel_listener", ok=listening,
                  detail="bound and consuming" if listening else "not consuming (connecting or reconnecting)"),
            Check("consumers", ok=consuming, detail=consumers),
            Check("draining", ok=not draining,
                  detail="draining after SIGTERM: takes no new runs" if draining else "not draining"),
        ))


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    endpoints: HealthEndpoints


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/healthz":
            report = self.server.endpoints.liveness()
        elif path == "/readyz":
            report = self.server.endpoints.readiness()
        else:
            self._send(HTTPStatus.NOT_FOUND, {"error": "not found; try /healthz or /readyz"})
            return
        self._send(report.status, report.body())

    def _send(self, status: HTTPStatus, body: dict[str, object]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: object) -> None:
        """Probes every few seconds are not worth a log line each."""


class _Server6(_Server):
    address_family = socket.AF_INET6


def health_server(endpoints: HealthEndpoints, port: int, host: str = "127.0.0.1") -> ServerPart:
    """/healthz and /readyz on ``host:port``, bound and not yet serving (loopback by default; an IPv6
    address such as ``::`` works too)."""
    server = (_Server6 if ":" in host else _Server)((host, port), _Handler)
    server.endpoints = endpoints
    return ServerPart("runbrake-health", server)


def serve(endpoints: HealthEndpoints, port: int, host: str = "127.0.0.1") -> ThreadingHTTPServer:
    """Serve /healthz and /readyz on ``host:port`` from a daemon thread. Returns the server; ``shutdown()``
    stops it."""
    part = health_server(endpoints, port, host)
    part.start()
    assert isinstance(part.server, ThreadingHTTPServer)
    return part.server


def health_parts(
    settings: Settings, store: RunStore, *, index: int, listener_ready: threading.Event,
    draining: threading.Event, consumers: Callable[[], tuple[bool, str]],
) -> list[Part]:
    """The parts the settings ask for, in start order: the checks when health or metrics are on (metrics
    carry the queue-depth sample), the server when ``health_port`` is set (on ``health_port + index``),
    bound already."""
    if not settings.health_port and not settings.metrics_port:
        return []
    services = ServiceChecks(settings, store, sample_queue_depth=bool(settings.metrics_port))
    if not settings.health_port:
        return [services]
    port = settings.health_port + index
    server = health_server(HealthEndpoints(services, listener_ready, draining, consumers=consumers), port,
                           settings.health_host)
    log.info("health_serving", host=settings.health_host, port=port)
    return [services, server]
