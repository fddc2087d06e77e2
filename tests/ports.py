"""Loopback ports for the servers the tests start, safe when several test processes pick them at once.

A port the kernel hands out for ``bind(("127.0.0.1", 0))`` comes from its ephemeral range (32768-60999 on
Linux), the same range every outgoing connection on the machine takes its local port from: between the
probe's close and the server's own bind, any client socket (a worker's Redis connection, another test's
request) may take it. And ``make test`` runs the suite on several pytest-xdist processes
(docs/development.md, "Tests"), each picking ports for its own servers.

So :func:`free_port` picks below the ephemeral range and below the block the RabbitMQ chaos tests use
(15000-24990 and their CLI's distribution ports: tests/chaos/conftest.py), in a block of its own for each
xdist worker (``PYTEST_XDIST_WORKER``: ``gw0``, ``gw1``…), going through its block in turn from a random
start: a port is handed out again only after the whole block, long after the server that had it was
stopped, and two workers never hand out the same one.
"""

from __future__ import annotations

import os
import random
import re
import socket

FIRST_PORT = 10_000
BLOCK = 500
BLOCKS = 10
"""10000-14999: ten blocks of 500 ports, one for each of up to ten xdist workers (an eleventh shares gw0's)."""


def port_is_free(port: int) -> bool:
    """Can this loopback port be bound now?"""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _worker_index() -> int:
    """This process's xdist worker number (``gw3`` → 3), 0 outside xdist."""
    match = re.fullmatch(r"gw(\d+)", os.environ.get("PYTEST_XDIST_WORKER", ""))
    return int(match.group(1)) % BLOCKS if match else 0


class _Block:
    """The ports of this process's block, handed out in turn."""

    def __init__(self, index: int) -> None:
        self.first = FIRST_PORT + index * BLOCK
        self.next = random.randrange(BLOCK)  # not a secret: a start of its own for each run

    def take(self) -> int:
        for _ in range(BLOCK):
            port = self.first + self.next
            self.next = (self.next + 1) % BLOCK
            if port_is_free(port):
                return port
        raise RuntimeError(f"no free loopback port in {self.first}-{self.first + BLOCK - 1}")


_block: _Block | None = None


def free_port() -> int:
    """A loopback port nothing listens on right now, that no other test process hands out."""
    global _block  # noqa: PLW0603 - one block for the process, made on first use (after xdist set the variable)
    if _block is None:
        _block = _Block(_worker_index())
    return _block.take()
