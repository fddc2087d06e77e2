"""Traces (OpenTelemetry), off unless ``RUNBRAKE_OTEL=true``: the one door every part of runbrake goes through.

Off, nothing here imports opentelemetry's SDK or exporter: :func:`current` answers a :class:`Tracing` whose
spans are no-ops, and carries no ``traceparent``. On (:func:`configure`, called once per process at its edge:
the CLI's settings, the worker process), it answers the OpenTelemetry implementation
(``shared/_otel.py``), which exports over OTLP/HTTP as the standard ``OTEL_EXPORTER_OTLP_*`` variables say
(docs/operating.md, "Traces").

What crosses a process is the W3C ``traceparent`` alone (https://www.w3.org/TR/trace-context/, "traceparent
Header"), checked by :func:`is_traceparent` wherever it arrives: the run message's Dramatiq options, the
cancel message's AMQP headers, every MCP HTTP request's headers.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Final, TypeVar

from runbrake.shared.errors import ConfigError
from runbrake.shared.settings import Settings

TRACEPARENT: Final = "traceparent"
"""The W3C header (and Dramatiq option, and AMQP header) that carries a trace across processes."""

_TRACEPARENT: Final = re.compile(r"00-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}-[0-9a-f]{2}")
"""Version 00, lowercase hex, neither id all zeros (W3C Trace Context, "traceparent Header Field Values")."""

T = TypeVar("T")

Attribute = str | bool | int | float
"""A span attribute's value, as OpenTelemetry takes it."""


def is_traceparent(value: object) -> bool:
    """A version-00 ``traceparent`` value: 55 characters, ``00-<trace id>-<span id>-<flags>``."""
    return isinstance(value, str) and len(value) == 55 and _TRACEPARENT.fullmatch(value) is not None


class Span:
    """A span being recorded; this one records nothing (tracing off)."""

    def set(self, attributes: Mapping[str, Attribute]) -> None:
        """Add ``attributes`` to the span."""

    def event(self, name: str, attributes: Mapping[str, Attribute]) -> None:
        """Add an event (a moment with attributes) to the span."""

    def fail(self, description: str) -> None:
        """Mark the span's status an error."""


NO_SPAN: Final = Span()


class Tracing:
    """Tracing off: spans that record nothing, no ``traceparent`` to carry. ``shared/_otel.py`` is the other."""

    enabled: bool = False

    @contextmanager
    def span(self, name: str, attributes: Mapping[str, Attribute] | None = None, *, parent: str | None = None,
             kind: str = "internal") -> Iterator[Span]:
        """A span around the block, made current for it: a child of ``parent`` (a ``traceparent``) when given,
        else of the current span. ``kind`` is an OpenTelemetry span kind's name (``producer``, ``consumer``,
        ``client``, ``server``, ``internal``)."""
        yield NO_SPAN

    def traceparent(self) -> str | None:
        """The current span's ``traceparent``, to carry in a message or a request (None: no span)."""
        return None

    def within(self, parent: str | None, call: Callable[[], T]) -> T:
        """``call()`` in the trace ``parent`` names (a caller's ``traceparent`` header; anything but a W3C
        version-00 value is ignored): its spans are that trace's. Off, or without a parent, just ``call()``."""
        return call()

    def tracer(self, name: str) -> Any:
        """An OpenTelemetry tracer named ``name`` on this process's provider (None: tracing off)."""
        return None


_OFF: Final = Tracing()
_current: Tracing = _OFF


def current() -> Tracing:
    """This process's tracing (off until :func:`configure` turned it on)."""
    return _current


def configure(settings: Settings, *, service: str) -> Tracing:
    """Turn tracing on when ``settings.otel`` says so (once per process; later calls answer the same), naming
    the process ``service`` unless ``OTEL_SERVICE_NAME`` names it. Off, nothing of opentelemetry is imported.

    Raises:
        ConfigError: tracing is on but the ``otel`` extra (OpenTelemetry's SDK and exporter) is not installed.
    """
    global _current  # noqa: PLW0603 - one tracing per process, like OpenTelemetry's own global provider
    if settings.otel and not _current.enabled:
        try:
            from runbrake.shared import _otel  # noqa: PLC0415 - imported only when tracing is on
        except ImportError as exc:
            raise ConfigError("RUNBRAKE_OTEL", f"tracing needs the otel extra (pip install 'runbrake[otel]'): "
                                               f"{exc}") from exc
        _current = _otel.OtelTracing.install(service)
    return _current
