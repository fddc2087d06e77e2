"""The entry points: the CLI, the HTTP API and its client, the runs page, the demo, the example MCP server.

They call the operations of ``runbrake.shared.operations`` and publish through ``runbrake.shared.messaging``
(docs/architecture.md, "Layers"); the worker imports nothing from here.

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
