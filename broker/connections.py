"""The open HTTP connections of ``runbrake serve``, so that an events stream can abort the one of a client
that stopped reading (docs/http-api.md, "Events: limits").

ASGI gives an application no way to abort its connection. Ending the response is not enough for a client
that does not read: uvicorn then closes the transport, and asyncio's ``close()`` waits until the buffered
bytes are written, which for a peer that never reads is forever, so the socket and the bytes stay. The
server's protocol class is therefore wrapped (uvicorn accepts a protocol class as ``http``) so that each
connection's transport is known by its peer address, which ASGI does give the application
(``scope["client"]``), and the callable :meth:`Connections.aborter` answers closes it at once, dropping
what it buffered. A request whose ``scope["client"]`` uvicorn's proxy-headers middleware rewrote from
``X-Forwarded-For`` (sent by a trusted proxy, by default one on loopback) is not found: its stream still
ends, and uvicorn closes that connection the graceful way (the proxy is then the one not reading).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, MutableMapping
from typing import Any

from uvicorn.protocols.http.auto import AutoHTTPProtocol

Peer = tuple[str, int]


class Connections:
    """The transports of this process's HTTP connections, by peer address."""

    def __init__(self) -> None:
        self._by_peer: dict[Peer, asyncio.BaseTransport] = {}

    def __len__(self) -> int:
        return len(self._by_peer)

    def protocol(self, base: type[asyncio.Protocol] = AutoHTTPProtocol) -> type[asyncio.Protocol]:
        """An HTTP protocol class for uvicorn (its ``http``) that records each connection here: ``base``
        (by default uvicorn's own choice, ``auto``) with two methods extended."""
        registry = self

        class TrackedProtocol(base):  # type: ignore[misc, valid-type]
            _runbrake_transport: asyncio.BaseTransport | None = None

            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                super().connection_made(transport)
                self._runbrake_transport = transport
                registry._add(transport)

            def connection_lost(self, exc: Exception | None) -> None:
                if self._runbrake_transport is not None:
                    registry._remove(self._runbrake_transport)
                super().connection_lost(exc)

        return TrackedProtocol

    def aborter(self, scope: MutableMapping[str, Any]) -> Callable[[], None] | None:
        """A callable that aborts the connection ``scope`` arrived on, or None when it is not known here
        (another ASGI server, a Unix socket)."""
        transport = self._by_peer.get(_peer(scope.get("client")) or ("", -1))
        if transport is None:
            return None
        return transport.abort if isinstance(transport, asyncio.WriteTransport) else transport.close

    def _add(self, transport: asyncio.BaseTransport) -> None:
        peer = _peer(transport.get_extra_info("peername"))
        if peer is not None:
            self._by_peer[peer] = transport

    def _remove(self, transport: asyncio.BaseTransport) -> None:
        peer = _peer(transport.get_extra_info("peername"))
        if peer is not None and self._by_peer.get(peer) is transport:
            del self._by_peer[peer]


def _peer(address: Any) -> Peer | None:
    """``(host, port)`` of a socket address (IPv6 addresses have four members), as uvicorn puts it in
    ``scope["client"]``."""
    if isinstance(address, list | tuple) and len(address) >= 2:
        try:
            return str(address[0]), int(address[1])
        except (TypeError, ValueError):
            return None
    return None
