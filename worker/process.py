"""One worker process: the intake (a few Dramatiq consumer threads feeding ``--concurrency`` runs on the
event loop, worker/intake.py), the cancel listener, the cancel- and run-request consumers, the backstop and the
lease keeper."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
import time
from types import FrameType

import pika
import pika.exceptions
import redis
import structlog
from dramatiq import Broker
from dramatiq.common import dq_name

from runbrake.shared import tracing
from runbrake.shared.async_store import AsyncRunStore
from runbrake.shared.catalog import Admission
from runbrake.shared.errors import StoreError
from runbrake.shared.logging import configure_logging, silenced
from runbrake.shared.messaging._amqp_tables import harden_table_decoding
from runbrake.shared.messaging.producer import Producer
from runbrake.shared.messaging.rabbitmq import build_broker
from runbrake.shared.messaging.wire import Topology, connection_parameters
from runbrake.shared.settings import Settings
from runbrake.shared.store import RunStore
from runbrake.worker import metrics
from runbrake.worker.actors import declare_noop_actor, declare_run_actor
from runbrake.worker.cancel_listener import Backstop, CancelListener
from runbrake.worker.cancel_requests import CancelRequestConsumer
from runbrake.worker.continue_requests import ContinueRequestConsumer
from runbrake.worker.health import health_parts
from runbrake.worker.intake import Collector, Intake, tune_gc
from runbrake.worker.leases import LeaseKeeper
from runbrake.worker.liveness import Liveness, WorkerIdentity
from runbrake.worker.parts import Part, start_all, stop_all
from runbrake.worker.redrive import Redriver
from runbrake.worker.registry import ActiveRuns
from runbrake.worker.relay import EventRelay
from runbrake.worker.retention import Sweeper
from runbrake.worker.run_requests import RunRequestConsumer
from runbrake.worker.runtime import Runtime
from runbrake.worker.saturation import LoopWatch, running_loop
from runbrake.worker.steer_requests import SteerRequestConsumer
from runbrake.worker.webhooks import WebhookDispatcher

log = structlog.get_logger(__name__)

SHUTDOWN_GRACE_S = 10.0
WATCHDOG_INTERVAL_S = 5.0


DEFAULT_CONCURRENCY = 8
"""Runs in flight per worker process unless ``--concurrency`` says otherwise (the former ``--threads`` default)."""
MAX_CONCURRENCY = 10_000
"""The highest ``--concurrency`` accepted; docs/benchmarks.md, "Sizing", says what a process holds in practice."""

EXIT_UNAVAILABLE = 3
"""Redis or RabbitMQ could not be reached (or refused the credentials) at start."""


def run_worker_process(
    settings: Settings, *, concurrency: int, index: int = 0, include_noop: bool = False
) -> int:
    """Run until SIGTERM or SIGINT, then drain: stop consuming, let the runs in flight go on for up to
    ``RUNBRAKE_DRAIN_S`` and hand the rest over to other workers (:func:`drain`), close the listener.
    At most ``concurrency`` runs are in flight.
    Returns the exit code: 3 at once, with one log line, when Redis or RabbitMQ cannot be reached at
    start (a wrong password included)."""
    configure_logging()
    tracing.configure(settings, service="runbrake-worker")  # off unless RUNBRAKE_OTEL (docs/operating.md, "Traces")
    harden_table_decoding()  # before any consumer connects: a hostile header must not drop its connection
    use_event_loop(settings)
    structlog.contextvars.bind_contextvars(worker=index)
    store = RunStore.connect(settings)
    try:
        store.ping()
        _check_rabbitmq(settings)
    except (StoreError, pika.exceptions.AMQPError) as exc:
        log.error(  # noqa: TRY400 - one clear line, not a traceback: the cause is in the message
            "worker_cannot_start", error=str(exc) or repr(exc), namespace=settings.namespace)
        store.close()
        return EXIT_UNAVAILABLE
    _warn_unless_persistent(store)
    registry = ActiveRuns()
    broker = build_broker(settings)
    producer = Producer(store, broker)
    # The runtime runs on the AsyncIO middleware's event loop: its store awaits every round trip.
    admission = Admission.from_settings(settings)
    identity = WorkerIdentity()  # beaten for by Liveness; stamped on each claim (docs/leases.md, "Lost workers")
    runtime = Runtime(settings, AsyncRunStore.connect(settings), registry, admission, sender=producer,
                      worker=lambda: identity.id)
    topology = Topology.of(settings)
    watch = LoopWatch(running_loop, concurrency=concurrency, max_lag_ms=settings.admit_max_lag_ms,
                      max_rss_mb=settings.admit_max_rss_mb, min_runs=settings.admit_min_runs,
                      max_cpu_pct=settings.admit_max_cpu_pct, max_pause_ms=settings.admit_max_pause_ms,
                      in_flight=lambda: intake.running)  # the intake, built next, asks the watch
    intake = Intake(runtime, concurrency=concurrency, watch=watch)
    metrics.SATURATION.set_function(watch.saturation)
    metrics.SLOTS_LENT.set_function(lambda: intake.lent)
    declare_run_actor(broker, intake, settings)
    queues = {topology.run_queue}
    if include_noop:
        declare_noop_actor(broker, settings)
        queues.add(topology.noop_queue)
    stop = threading.Event()
    draining = threading.Event()  # set on SIGTERM/SIGINT: /readyz answers 503 from then on (worker/health.py)
    hurry = threading.Event()  # a second signal: hand the runs over now, without waiting out the drain
    listener = CancelListener(settings, store, registry)
    # docs/messages.md, "Run requests": admitted like POST /v1/runs (the catalog, the bounds, idempotency)
    run_requests = RunRequestConsumer(settings, Producer(store, broker, admission))
    # docs/messages.md, "Steer requests", "Continue requests": applied like their HTTP routes
    steer_requests = SteerRequestConsumer(settings, store, Producer(store, broker, admission))
    continue_requests = ContinueRequestConsumer(settings, store, Producer(store, broker, admission))
    cancel_requests = CancelRequestConsumer(settings, store, admission)  # docs/messages.md, "Cancel requests"
    metrics.watch_process(registry, listener.ready)
    # The parts, in start order (docs/architecture.md, "The worker's parts"); stopped in reverse once the
    # intake has drained, so the listener still interrupts and the lease keeper still renews during the drain.
    # Built first: a health port already taken fails the process before it starts a part or takes a run.
    parts: list[Part] = [
        *([metrics.MetricsServer(settings.metrics_port + index, settings.health_host)] if settings.metrics_port
          else []),
        cancel_requests,
        run_requests,
        steer_requests,
        continue_requests,
        listener,
        Backstop(settings, store, registry),
        Liveness(settings, RunStore.connect(settings), registry, identity, sender=producer,  # its own connection
                 admission=admission),
        LeaseKeeper(settings, store, registry),
        Sweeper(settings, store),
        Redriver(settings, store, producer),
        EventRelay(settings, RunStore.connect(settings)),  # docs/messages.md, "Run events"; its own connections
        WebhookDispatcher(settings, RunStore.connect(settings)),  # docs/webhooks.md; its own connections
        Collector(settings.gc_interval_s, in_flight=lambda: intake.in_flight),  # collections on a timer (intake.py)
        watch,  # admission by health (worker/saturation.py)
        *health_parts(settings, store, index=index, listener_ready=listener.ready, draining=draining,
                      consumers=lambda: intake.consumer_status(topology.run_queue)),
    ]

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        if draining.is_set():
            log.warning("worker_stopping_now", signal=signal.Signals(signum).name, action="handing runs over")
            hurry.set()
            return
        log.info("worker_stopping", signal=signal.Signals(signum).name)
        draining.set()
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    start_all(parts)
    if settings.metrics_port:
        log.info("metrics_serving", host=settings.health_host, port=settings.metrics_port + index)
    tune_gc()  # thousands of runs in flight on one loop (worker/intake.py)
    intake.start_consuming(broker, queues)
    # Each queue declared and consumed (the run queue, its delay twin, the requests' queues):
    # a message published from now on is routed. Bounded, all together.
    consumed = [broker.consuming(queue) for queue in (*queues, *map(dq_name, queues))]
    deadline = time.monotonic() + STARTUP_WAIT_S
    requests = (run_requests, cancel_requests, steer_requests, continue_requests)
    for ready in (*consumed, listener.ready, *(consumer.ready for consumer in requests)):
        ready.wait(max(0.0, deadline - time.monotonic()))
    log.info("worker_started", pid=os.getpid(), concurrency=concurrency, consumer_threads=intake.consumer_threads,
             queues=sorted(queues), consuming=all(event.is_set() for event in consumed),
             listener_ready=listener.ready.is_set(),
             **{f"{consumer.role}_ready": consumer.ready.is_set() for consumer in requests})
    while not stop.wait(WATCHDOG_INTERVAL_S):
        _replace_dead(parts)
    drain(intake, registry, drain_s=settings.drain_s, hurry=hurry)
    intake.stop(grace_s=SHUTDOWN_GRACE_S)  # what is left after the hand-over is failed worker_shutdown
    stop_all(parts, join_s=PART_JOIN_S)
    _close_quietly(broker)
    store.close()
    log.info("worker_stopped")
    return 0


STARTUP_WAIT_S = 10.0
"""How long the start waits for its consumers to be bound before it logs ``worker_started`` anyway (with
``consuming`` or a ``…_ready`` false): they go on connecting after it."""

PART_JOIN_S = 5.0
"""How long a stopping part is waited for."""


def _replace_dead(parts: list[Part]) -> None:
    """Start a fresh part in place of one whose thread died, where it has one (the cancel listener)."""
    for position, part in enumerate(parts):
        health = part.health()
        if health.ok:
            continue
        replacement = part.replacement()
        if replacement is None:
            continue
        # Should never happen (the listener survives its own errors); if it does, say so loudly.
        log.critical(f"{getattr(part, 'role', type(part).__name__)}_died", detail=health.detail,
                     action="starting a new one")
        parts[position] = replacement
        replacement.start()


HANDOVER_WAIT_S = 10.0
"""How long the runs asked to hand over get to reach their next boundary and write it (each cut-off call
is recorded first), plus ``HANDOVER_WAIT_PER_RUN_S`` for each."""
HANDOVER_WAIT_PER_RUN_S = 0.005
"""2,000 runs of one process, their calls reporting progress every second, took 7.3 s to hand over on a
2-core machine (docs/benchmarks.md, "Scale (`bench/scale.py`)"): 20 s for them."""


def drain(intake: Intake, registry: ActiveRuns, *, drain_s: float, hurry: threading.Event) -> None:
    """Stop taking runs, let those in flight go on for up to ``drain_s`` seconds, then hand the rest over.

    A handed-over run has its call in flight cut off (recorded ``cancelled``, ``detail.reason`` =
    ``worker_shutdown``), goes back to ``queued`` with its conversation saved, and another worker
    continues it (docs/leases.md, "Drain and hand-over"). The cancel listener keeps running
    meanwhile, so a cancel during the drain still interrupts at once.
    """
    deadline = time.monotonic() + drain_s
    intake.stop_consuming()
    in_flight = intake.in_flight
    log.info("worker_draining", runs_in_flight=in_flight, drain_s=drain_s)
    if intake.wait_idle(max(0.0, deadline - time.monotonic()), unless=hurry):
        log.info("worker_drained", runs_finished=in_flight)
        return
    asked = registry.hand_over_all()
    log.warning("worker_handing_over", runs=asked, drain_s=drain_s)
    if not intake.wait_idle(HANDOVER_WAIT_S + HANDOVER_WAIT_PER_RUN_S * asked):
        log.error("worker_handover_incomplete", runs=intake.in_flight,
                  action="the runs left are failed worker_shutdown as the worker stops")


def use_event_loop(settings: Settings) -> None:
    """The loop Dramatiq's AsyncIO middleware will create (``asyncio.new_event_loop()`` under the policy set
    here: ``RUNBRAKE_EVENT_LOOP``), and how long it may hold the GIL from the cancel listener's thread
    (``RUNBRAKE_SWITCH_INTERVAL_MS``). Before the middleware starts its loop."""
    if settings.event_loop == "uvloop":
        import uvloop  # noqa: PLC0415 - loaded by the worker process alone

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    sys.setswitchinterval(settings.switch_interval_ms / 1000)


def _warn_unless_persistent(store: RunStore) -> None:
    """Redis is the system of record: without AOF or snapshots a restart erases every run. Say so loudly
    (docs/store.md, "The run store"); a Redis that does not let us ask (a managed one) is trusted.
    On a cluster, each primary is asked."""
    try:
        nodes = store.persistence()
    except redis.RedisError:
        return
    for where, config in nodes:
        if config.get("appendonly") != "yes" and not config.get("save"):
            log.warning("redis_not_persistent", redis=where, appendonly=config.get("appendonly"),
                        save=config.get("save"), risk="a Redis restart erases every run",
                        fix="appendonly yes, appendfsync everysec (deploy/compose.yaml, deploy/k8s)")


def _check_rabbitmq(settings: Settings) -> None:
    """Connect once and go: a wrong password fails here, not in an endless reconnect loop."""
    parameters = connection_parameters(settings, connection_attempts=1)
    # pika logs each failed step itself, several lines with tracebacks; the caller says it in one.
    with silenced("pika"):
        connection = pika.BlockingConnection(parameters)
    connection.close()


def _close_quietly(broker: Broker) -> None:
    """Close the broker's connections, once every thread that used them has stopped. Dramatiq's broker keeps
    a connection per thread that declared a queue or sent a message (each consumer thread declares its queue
    through one, then never touches it again): RabbitMQ has dropped the idle ones (shared/logging.py,
    ``silenced``)."""
    with silenced("pika"):
        broker.close()
