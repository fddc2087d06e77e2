"""The worker's Prometheus metrics. Each worker process serves its own registry on its own port; the run
metrics are counted by :class:`MetricsSubscriber`, one of the worker's subscribers (worker/subscribers.py)."""

from __future__ import annotations

import threading
from collections.abc import Sized
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from runbrake.shared.async_store import AsyncRunStore
from runbrake.shared.outcome import ToolOutcome
from runbrake.shared.status import RunStatus, TerminationReason
from runbrake.shared.steps import RunStep, StepKind
from runbrake.shared.timeline import step_outcome
from runbrake.worker.parts import Health, Part
from runbrake.worker.subscribers import Subscriber

REGISTRY = CollectorRegistry(auto_describe=True)

TOOL_CALLS = Counter(
    "runbrake_tool_calls_total", "Tool calls by MCP server and outcome (ok, failed, cancelled).",
    ["server", "outcome"], registry=REGISTRY,
)
MODEL_TOKENS = Counter(
    "runbrake_model_tokens_total",
    "Tokens the model calls used, as the providers reported them, by model (the catalog name, or an inline "
    "model's provider) and kind (input, output).",
    ["model", "kind"], registry=REGISTRY,
)
RUNS_FINISHED = Counter(
    "runbrake_runs_finished_total",
    "Run segments this worker ended, by the run's status and termination reason (reason empty for a run another "
    "writer ended first, for a reason this worker did not learn).",
    ["status", "reason"], registry=REGISTRY,
)
MESSAGES_SKIPPED = Counter(
    "runbrake_messages_skipped_total", "Run messages acked as no-ops (duplicate, stale or no longer queued).",
    registry=REGISTRY,
)
RUNS_REDRIVEN = Counter(
    "runbrake_runs_redriven_total", "Run messages sent again because nobody claimed the run within RUNBRAKE_REDRIVE_S.",
    registry=REGISTRY,
)
RUNS_RECLAIMED = Counter(
    "runbrake_runs_reclaimed_total",
    "Runs of a lost worker process put back to the queue by this process (docs/leases.md, \"Lost workers\").",
    registry=REGISTRY,
)
HANDOFFS = Counter(
    "runbrake_runs_handed_over_total",
    "Runs this worker handed back to the queue when its drain (RUNBRAKE_DRAIN_S) ran out at shutdown.",
    registry=REGISTRY,
)
CONSUMER_RESTARTS = Counter(
    "runbrake_consumer_restarts_total",
    "Dramatiq threads of this worker that died and were replaced: kind worker_thread (the consumer threads that "
    "take run messages) or queue_consumer (the thread reading a queue off RabbitMQ).",
    ["kind"], registry=REGISTRY,
)
CANCEL_LATENCY = Histogram(
    "runbrake_cancel_latency_seconds", "From the cancel request to the interrupted call being recorded.",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
    registry=REGISTRY,
)

GC_PAUSE = Histogram(
    "runbrake_gc_pause_seconds",
    "How long each of Python's garbage collections in this process held the interpreter, by generation (2: a "
    "full collection; worker/intake.py, Collector).",
    ["generation"],
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
    registry=REGISTRY,
)

RUNS_IN_FLIGHT = Gauge(
    "runbrake_runs_in_flight", "Runs this worker process is executing (its registry of active runs).",
    registry=REGISTRY,
)
SLOTS_LENT = Gauge(
    "runbrake_slots_lent",
    "Runs of this worker process waiting for an agent run they called, their --concurrency slot lent to another run "
    "(worker/intake.py, Slots); they are counted in runbrake_runs_in_flight too.",
    registry=REGISTRY,
)
CANCEL_LISTENER_CONNECTED = Gauge(
    "runbrake_cancel_listener_connected", "1 while this process's cancel listener is bound and consuming, else 0.",
    registry=REGISTRY,
)
EVENT_LOOP_LAG = Gauge(
    "runbrake_event_loop_lag_seconds",
    "How late a callback scheduled on this process's event loop runs: the 90th percentile of the last second "
    "(worker/saturation.py).",
    registry=REGISTRY,
)
SATURATION = Gauge(
    "runbrake_worker_saturation",
    "How saturated this process is, 1.0 at a bound: the largest of its runs in flight against --concurrency, its "
    "event loop's lag against RUNBRAKE_ADMIT_MAX_LAG_MS, its CPU against RUNBRAKE_ADMIT_MAX_CPU_PCT, its RSS "
    "against RUNBRAKE_ADMIT_MAX_RSS_MB and its longest collection of the last 5 s against RUNBRAKE_ADMIT_MAX_PAUSE_MS.",
    registry=REGISTRY,
)
ADMISSION_RATE = Gauge(
    "runbrake_admission_rate",
    "How many new runs a second this process may take now: grown like TCP's slow start while its loop answers "
    "promptly, halved when the loop's lag rises (worker/saturation.py, Ramp).",
    registry=REGISTRY,
)
QUEUE_DEPTH = Gauge(
    "runbrake_queue_depth",
    "Messages ready in the queue (not counting those delivered and unacked), sampled every few seconds by "
    "the one worker process that holds the <ns>:queue-depth-sampler lock; other processes export no sample.",
    ["queue"], registry=REGISTRY,
)


class MetricsSubscriber(Subscriber):
    """The run metrics, counted from the worker's subscriber list (worker/subscribers.py)."""

    def __init__(self, store: AsyncRunStore) -> None:
        self._store = store
        """Read for a cancelled call's cancel request: its latency runs from the request to the step."""

    def after_skip(self, run_id: str, found: RunStatus | None) -> None:
        MESSAGES_SKIPPED.inc()

    def after_status(self, run_id: str, status: RunStatus) -> None:
        if status is RunStatus.QUEUED:  # handed over (worker/runtime.py, Runtime._hand_over)
            HANDOFFS.inc()

    async def after_step(self, run_id: str, step: RunStep) -> None:
        outcome = step_outcome(step)
        if step.kind is StepKind.TOOL and step.tool_server:  # "": a call to no server of the run
            TOOL_CALLS.labels(server=step.tool_server, outcome=outcome).inc()
        usage = step.detail.get("usage") if step.kind is StepKind.MODEL else None
        if isinstance(usage, dict):
            model = str(step.detail.get("model", ""))
            for kind in ("input", "output"):
                tokens = usage.get(f"{kind}_tokens")
                if isinstance(tokens, int) and tokens > 0:
                    MODEL_TOKENS.labels(model=model, kind=kind).inc(tokens)
        if outcome == ToolOutcome.CANCELLED.value:
            request = await self._store.cancel_request(run_id)
            if request is not None:
                CANCEL_LATENCY.observe(max(0.0, step.recorded_at - request.requested_at))

    def after_settle(self, run_id: str, status: RunStatus, reason: TerminationReason | None) -> None:
        RUNS_FINISHED.labels(status=status.value, reason="" if reason is None else reason.value).inc()


def watch_process(active_runs: Sized, listener_ready: threading.Event) -> None:
    """Read the in-flight and listener gauges from the process's registry and listener at scrape time."""
    RUNS_IN_FLIGHT.set_function(lambda: len(active_runs))
    CANCEL_LISTENER_CONNECTED.set_function(lambda: 1.0 if listener_ready.is_set() else 0.0)


class MetricsServer(Part):
    """/metrics on ``host:port`` from a daemon thread (loopback unless ``RUNBRAKE_HEALTH_HOST`` says otherwise).
    Binds when started: first in the process's parts, so a port already taken fails the process before any
    other part starts."""

    def __init__(self, port: int, host: str = "127.0.0.1") -> None:
        self._port = port
        self._host = host
        self._served: tuple[WSGIServer, threading.Thread] | None = None

    def start(self) -> None:
        self._served = start_http_server(self._port, addr=self._host, registry=REGISTRY)

    def stop(self) -> None:
        if self._served is not None and self._served[1].is_alive():
            self._served[0].shutdown()

    def join(self, timeout: float | None = None) -> None:
        if self._served is not None:
            self._served[1].join(timeout)
            self._served[0].server_close()

    def health(self) -> Health:
        serving = self._served is not None and self._served[1].is_alive()
        return Health(True, "serving") if serving else Health(False, "not serving")
