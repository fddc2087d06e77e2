"""Tracing on: the OpenTelemetry implementation of :class:`~runbrake.shared.tracing.Tracing`.

Imported only by :func:`runbrake.shared.tracing.configure` when ``RUNBRAKE_OTEL=true`` (the ``otel`` extra
installs the SDK and the exporter). The exporter is OTLP/HTTP (protobuf), configured by the standard
variables (``OTEL_EXPORTER_OTLP_ENDPOINT``, ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``, ``…_HEADERS``,
``…_TIMEOUT``; ``OTEL_BSP_*`` for the batch processor; ``OTEL_SERVICE_NAME``,
``OTEL_RESOURCE_ATTRIBUTES``), read by the SDK itself. A process that set a global tracer provider of its own
(an application embedding runbrake's library calls) keeps it: runbrake's spans go where that one sends them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Final

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from runbrake.shared import tracing
from runbrake.shared.tracing import TRACEPARENT, Attribute, T, is_traceparent

TRACER_NAME: Final = "runbrake"

_KINDS: Final = {kind.name.lower(): kind for kind in trace.SpanKind}
_PROPAGATOR: Final = TraceContextTextMapPropagator()


class OtelSpan(tracing.Span):
    """A recording span."""

    def __init__(self, span: trace.Span) -> None:
        self._span = span

    def set(self, attributes: Mapping[str, Attribute]) -> None:
        self._span.set_attributes(dict(attributes))

    def event(self, name: str, attributes: Mapping[str, Attribute]) -> None:
        self._span.add_event(name, dict(attributes))

    def fail(self, description: str) -> None:
        self._span.set_status(trace.StatusCode.ERROR, description)


class OtelTracing(tracing.Tracing):
    """Spans recorded by OpenTelemetry's SDK and exported over OTLP/HTTP."""

    enabled = True

    def __init__(self, provider: trace.TracerProvider) -> None:
        self.provider = provider
        self._tracer = provider.get_tracer(TRACER_NAME)

    @classmethod
    def install(cls, service: str) -> OtelTracing:
        """runbrake's spans on a tracer provider of its own: a batch processor in front of the OTLP/HTTP
        exporter (flushed at exit), the resource named ``service`` unless the environment names it; or on the
        process's global provider, where the process set one itself.

        Not made the global provider: the libraries runbrake uses that are instrumented (the MCP SDK makes a
        client span per JSON-RPC message) would then record about as many spans again as runbrake's own,
        for what the tool call's span already says (bench/tracing.py). Their context still follows runbrake's:
        the MCP SDK's ``params._meta`` carries the tool call's ``traceparent``."""
        provider = trace.get_tracer_provider()
        if isinstance(provider, trace.ProxyTracerProvider):
            resource = Resource.create()
            if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
                resource = resource.merge(Resource({SERVICE_NAME: service}))
            own = TracerProvider(resource=resource)
            own.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
            provider = own
        return cls(provider)

    def tracer(self, name: str) -> trace.Tracer:
        return self.provider.get_tracer(name)

    @contextmanager
    def span(self, name: str, attributes: Mapping[str, Attribute] | None = None, *, parent: str | None = None,
             kind: str = "internal") -> Iterator[tracing.Span]:
        context = extract(parent) if parent is not None else None
        with self._tracer.start_as_current_span(name, context=context, kind=_KINDS[kind],
                                               attributes=dict(attributes or {})) as span:
            yield OtelSpan(span)

    def traceparent(self) -> str | None:
        return current_traceparent()

    def within(self, parent: str | None, call: Callable[[], T]) -> T:
        context = extract(parent) if parent is not None else None
        if context is None:
            return call()
        token = otel_context.attach(context)
        try:
            return call()
        finally:
            otel_context.detach(token)


def current_traceparent() -> str | None:
    """The current span's ``traceparent`` (None when there is no valid current span)."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier)
    value = carrier.get(TRACEPARENT)
    return value if is_traceparent(value) else None


def extract(value: str) -> Context | None:
    """The context a ``traceparent`` names; None for anything :func:`~runbrake.shared.tracing.is_traceparent`
    refuses (the span then starts under the current context, a new trace if there is none)."""
    if not is_traceparent(value):
        return None
    return _PROPAGATOR.extract({TRACEPARENT: value})
