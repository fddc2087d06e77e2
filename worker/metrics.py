"""The worker's Prometheus metrics. Each worker process serves its own registry on its own port."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server

REGISTRY = CollectorRegistry(auto_describe=True)

TOOL_CALLS = Counter(
    "runbrake_tool_calls_total", "Tool calls by MCP server and outcome (ok, failed, cancelled).",
    ["server", "outcome"], registry=REGISTRY,
)
RUNS_FINISHED = Counter(
    "runbrake_runs_finished_total", "Run segments this worker ended, by the run's status.",
    ["status"], registry=REGISTRY,
)
MESSAGES_SKIPPED = Counter(
    "runbrake_messages_skipped_total", "Run messages acked as no-ops (duplicate, stale or no longer queued).",
    registry=REGISTRY,
)
RUNS_REDRIVEN = Counter(
    "runbrake_runs_redriven_total", "Run messages sent again because nobody claimed the run within RUNBRAKE_REDRIVE_S.",
    registry=REGISTRY,
)
CANCEL_LATENCY = Histogram(
    "runbrake_cancel_latency_seconds", "From the cancel request to the interrupted call being recorded.",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
    registry=REGISTRY,
)


def serve(port: int) -> None:
    """Serve /metrics on 0.0.0.0:``port`` from a daemon thread."""
    start_http_server(port, registry=REGISTRY)
