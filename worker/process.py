"""One worker process: Dramatiq worker threads, the event loop, the cancel listener, the backstop and
the lease keeper."""

from __future__ import annotations

import signal
import threading
from types import FrameType

import structlog
from dramatiq import Worker

from runbrake.broker.rabbitmq import build_broker
from runbrake.broker.wire import Topology
from runbrake.shared.async_store import AsyncRunStore
from runbrake.shared.logging import configure_logging
from runbrake.shared.settings import Settings
from runbrake.shared.store import RunStore
from runbrake.worker import metrics
from runbrake.worker.actors import declare_noop_actor, declare_run_actor
from runbrake.worker.cancel_listener import Backstop, CancelListener
from runbrake.worker.cancel_requests import CancelRequestConsumer
from runbrake.worker.leases import LeaseKeeper
from runbrake.worker.registry import ActiveRuns
from runbrake.worker.runtime import Runtime

log = structlog.get_logger(__name__)

SHUTDOWN_GRACE_MS = 10_000


def run_worker_process(settings: Settings, *, threads: int, index: int = 0, include_noop: bool = False) -> None:
    """Run until SIGTERM or SIGINT, then stop: stop consuming, interrupt the segments in flight
    (each records ``worker_shutdown``), close the listener."""
    configure_logging()
    structlog.contextvars.bind_contextvars(worker=index)
    store = RunStore.connect(settings)
    store.ping()
    registry = ActiveRuns()
    # The runtime runs on the AsyncIO middleware's event loop: its store awaits every round trip.
    runtime = Runtime(settings, AsyncRunStore.connect(settings), registry)
    broker = build_broker(settings)
    topology = Topology.of(settings)
    declare_run_actor(broker, runtime, settings)
    queues = {topology.run_queue}
    if include_noop:
        declare_noop_actor(broker, settings)
        queues.add(topology.noop_queue)
    if settings.metrics_port:
        metrics.serve(settings.metrics_port + index)
    listener = CancelListener(settings, store, registry)
    backstop = Backstop(settings, store, registry)
    leases = LeaseKeeper(settings, store, registry)
    requests = CancelRequestConsumer(settings, store)  # docs/messages.md, "Cancel requests"
    requests.start()
    listener.start()
    backstop.start()
    leases.start()
    # worker_timeout: how often idle consumers wake up; 200 ms makes a stop take a fraction of a second.
    worker = Worker(broker, queues=queues, worker_threads=threads, worker_timeout=200)
    # A prefetched message is a run nobody executes yet: hold at most one per thread.
    worker.queue_prefetch = threads
    stop = threading.Event()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        log.info("worker_stopping", signal=signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    worker.start()
    listener.ready.wait(10)
    log.info("worker_started", threads=threads, queues=sorted(queues), listener_ready=listener.ready.is_set())
    stop.wait()
    worker.stop(timeout=SHUTDOWN_GRACE_MS)
    listener.stop()
    requests.stop()
    backstop.stop()
    leases.stop()
    listener.join(5)
    requests.join(5)
    broker.close()
    store.close()
    log.info("worker_stopped")
