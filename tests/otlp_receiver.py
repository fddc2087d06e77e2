"""An OTLP/HTTP trace receiver for the tests and the benchmarks: ``POST /v1/traces`` on a free loopback port,
each export request decoded with ``opentelemetry-proto`` (the protobuf encoding the SDK's OTLP/HTTP exporter
sends), its spans kept with their service's name (docs/operating.md, "Traces").

    receiver = Receiver()   # listening; receiver.endpoint is what OTEL_EXPORTER_OTLP_ENDPOINT names
    ...
    receiver.named("runbrake.enqueue")
    receiver.close()
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

MAX_EXPORT_BYTES = 8 * 1024 * 1024


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    attributes: dict[str, Any]


def _value(any_value: Any) -> Any:
    kind = any_value.WhichOneof("value")
    return getattr(any_value, kind) if kind is not None else None


class Receiver:
    """An OTLP/HTTP trace receiver on a free loopback port: ``POST /v1/traces`` with a protobuf body."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.requests = 0
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length", "0"))
                if self.path != "/v1/traces" or not 0 < length <= MAX_EXPORT_BYTES:
                    self.send_error(400)
                    return
                request = ExportTraceServiceRequest.FromString(self.rfile.read(length))
                receiver.add(request)
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *_args: object) -> None:
                return

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, name="otlp-receiver", daemon=True)
        self._thread.start()

    def add(self, request: ExportTraceServiceRequest) -> None:
        received = []
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    received.append(ReceivedSpan(
                        service=str(resource.get("service.name", "")), name=span.name,
                        trace_id=span.trace_id.hex(), span_id=span.span_id.hex(),
                        parent_id=span.parent_span_id.hex(),
                        attributes={a.key: _value(a.value) for a in span.attributes},
                    ))
        with self._lock:
            self.requests += 1
            self.spans.extend(received)

    def named(self, name: str) -> list[ReceivedSpan]:
        with self._lock:
            return [s for s in self.spans if s.name == name]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(5)

    def count(self) -> int:
        """How many spans arrived so far."""
        with self._lock:
            return len(self.spans)

