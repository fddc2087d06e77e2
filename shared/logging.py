"""structlog, configured once: JSON lines when not on a terminal, console rendering on one."""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import structlog

from runbrake.shared import redaction

_configured = False


def configure_logging(level: str = "INFO", *, json: bool | None = None) -> None:
    """Configure structlog and the stdlib root logger (Dramatiq and pika log there). Idempotent.

    Args:
        level: the lowest level written.
        json: force JSON lines (True) or console rendering (False); by default JSON unless stderr
            is a terminal.
    """
    global _configured  # noqa: PLW0603 - configuration is process-wide by nature
    if _configured:
        return
    _configured = True
    as_json = (not sys.stderr.isatty()) if json is None else json
    renderer: structlog.types.Processor = (
        structlog.processors.JSONRenderer() if as_json else structlog.dev.ConsoleRenderer()
    )
    shared_processors: list[structlog.types.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    # Last before rendering, so that exceptions formatted into text are scrubbed too (docs/security.md).
    redact: list[structlog.types.Processor] = [redaction.processor]
    # The console renderer formats exceptions itself; JSON needs them turned into a string field.
    exceptions: list[structlog.types.Processor] = [structlog.processors.format_exc_info] if as_json else []
    structlog.configure(
        processors=[*shared_processors, structlog.processors.StackInfoRenderer(), *exceptions, *redact, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelNamesMapping()[level.upper()]),
        # One write a line, its newline with it: print() writes them apart, and with PYTHONUNBUFFERED (most
        # containers) the processes of one supervisor, sharing its stderr, put their lines into each other's.
        logger_factory=structlog.WriteLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    handler = _StructlogOutput()
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta, *redact, renderer,
        ], foreign_pre_chain=shared_processors)
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # pika logs every connection step at INFO, httpx2 every HTTP request (eight lines for a run with two
    # MCP calls, each rendered on the event loop): their warnings are what matter to an operator.
    for chatty in ("pika", "httpx2", "httpcore2"):
        logging.getLogger(chatty).setLevel(logging.WARNING)
    # pika logs each failed step of each connection attempt at ERROR, with tracebacks (connection_workflow,
    # io_services_utils, blocking_connection): a reconnect loop during an outage repeats them every few
    # seconds per connection. Every one of those attempts ends in an exception runbrake handles and reports
    # once, in its own words (worker/_consumer.py; shared/messaging/rabbitmq.py, BrokerOutage).
    for workflow in ("pika.adapters", "pika.connection"):
        logging.getLogger(workflow).setLevel(logging.CRITICAL)
    # The MCP SDK says INFO "GET stream disconnected, reconnecting in 1000ms..." whenever a server from before
    # protocol 2026-07-28 closes a session's GET stream, which it does each time a client ends the session
    # (mcp/client/streamable_http.py, handle_get_stream): a normal close, worth DEBUG.
    logging.getLogger("mcp.client.streamable_http").addFilter(_AsDebug("GET stream disconnected"))


@contextmanager
def silenced(name: str) -> Iterator[None]:
    """Nothing below CRITICAL from logger ``name`` (and its children) while the block runs.

    For closing pika connections at a clean stop: Dramatiq's broker and the cancel publishers keep
    connections that sit idle, a ``BlockingConnection`` answers heartbeats only while it is used, and
    RabbitMQ drops it after two missed ones; closing a dropped one made pika log ConnectionResetError
    tracebacks and ``BlockingConnection.close(200, 'Normal shutdown') called on closed connection`` at
    error level (issue 16; Dramatiq hides only "Broken pipe", dramatiq/brokers/rabbitmq.py
    ``_ignore_pika_logs``). At a clean stop that is not an error.
    """
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.CRITICAL)  # setLevel, not the attribute: it clears the loggers' cached levels
    try:
        yield
    finally:
        logger.setLevel(level)


class _AsDebug(logging.Filter):
    """Lowers a logger's records whose message starts with ``prefix`` to DEBUG (dropped unless DEBUG is on)."""

    def __init__(self, prefix: str) -> None:
        super().__init__()
        self._prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno > logging.DEBUG and record.getMessage().startswith(self._prefix):
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)
        return True


class _StructlogOutput(logging.Handler):
    """Writes stdlib records (Dramatiq's, pika's) through structlog's own output, whose lock is per file:
    with two writers holding two locks, lines from two threads could interleave into one."""

    def __init__(self) -> None:
        super().__init__()
        self._output = structlog.WriteLogger(file=sys.stderr)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self._output.msg(self.format(record))
        except Exception:  # noqa: BLE001 - logging must never raise into the caller
            self.handleError(record)
