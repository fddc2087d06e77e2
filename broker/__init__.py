"""The producing side: enqueue, cancel, approve, the wire, the CLI, the HTTP API and its client.

``from runbrake.broker import Client`` is the HTTP API's Python client (broker/client.py), imported
on first use so that the rest of the package does not load it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from runbrake.broker.client import Client

__all__ = ["Client"]


def __getattr__(name: str) -> Any:
    if name == "Client":
        from runbrake.broker.client import Client  # noqa: PLC0415 - loaded on first use

        return Client
    raise AttributeError(f"module 'runbrake.broker' has no attribute {name!r}")
