"""pika's decoding of AMQP field tables (a message's headers), made to survive what a hostile publisher puts there.

pika decodes a delivery's headers inside its frame parser, and an exception there is a lost stream: the
consumer's connection closes, RabbitMQ requeues the unacked message, and the next consumer to get it
loses its connection the same way, for ever. Two headers RabbitMQ passes through unchanged did that to
every consumer of a worker (issue 15; tests/test_attack_messages.py):

- a timestamp (field type ``T``) past what ``datetime`` holds, e.g. 2**63 seconds: ``OverflowError``;
- tables (``F``) or arrays (``A``) nested deeper than Python's recursion limit: ``RecursionError``.

:func:`harden_table_decoding` wraps ``pika.data.decode_value``, which pika's table and array decoding look up
at each call: such a timestamp is kept as its integer seconds, and a table or array too deep becomes
``None``. Everything else decodes as before.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, Final

import pika.data

_ORIGINAL: Final[Callable[[bytes, int], tuple[Any, int]]] = pika.data.decode_value
_LENGTH: Final = struct.Struct(">I")
_SECONDS: Final = struct.Struct(">Q")


def _decode_value(encoded: bytes, offset: int) -> tuple[Any, int]:
    kind = encoded[offset:offset + 1]
    if kind == b"T":
        seconds = _SECONDS.unpack_from(encoded, offset + 1)[0]
        try:
            return datetime.fromtimestamp(seconds, UTC), offset + 1 + _SECONDS.size
        except (OverflowError, ValueError, OSError):
            return seconds, offset + 1 + _SECONDS.size
    if kind in (b"F", b"A"):
        try:
            return _ORIGINAL(encoded, offset)
        except RecursionError:
            length = _LENGTH.unpack_from(encoded, offset + 1)[0]
            return None, offset + 1 + _LENGTH.size + length
    return _ORIGINAL(encoded, offset)


def harden_table_decoding() -> None:
    """Install the tolerant decoding for this process (idempotent); called once as a worker starts."""
    pika.data.decode_value = _decode_value
