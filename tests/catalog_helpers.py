"""The test's own operator catalog: every test runs with one (``RUNBRAKE_CATALOG`` points at a file in
its temporary folder, set by the ``namespace`` fixture), and the MCP servers and models a test uses are
written into it as the test builds its specs. Workers read the file again when it changes, so a server
added after a worker started is known to it at its next claim."""

from __future__ import annotations

import json
import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from runbrake.shared.spec import HttpServerSpec, McpServerSpec, OpenAIModel, StdioServerSpec


def catalog_path() -> Path:
    """The current test's catalog file."""
    return Path(os.environ["RUNBRAKE_CATALOG"])


def add_to_catalog(
    servers: Mapping[str, McpServerSpec | Mapping[str, Any]] | None = None,
    models: Mapping[str, OpenAIModel | Mapping[str, Any]] | None = None,
    path: Path | None = None,
    agents: Mapping[str, Mapping[str, Any]] | None = None,
) -> None:
    """Write these servers, models and agents into the catalog (replacing entries of the same name)."""
    target = path or catalog_path()
    data = tomllib.loads(target.read_text()) if target.exists() else {}
    for name, server in (servers or {}).items():
        data.setdefault("mcp_servers", {})[name] = _entry(server)
    for name, model in (models or {}).items():
        data.setdefault("models", {})[name] = _entry(model)
    for name, agent in (agents or {}).items():
        data.setdefault("agents", {})[name] = dict(agent)
    # Atomically, as an operator's deploy should: a worker reading it meanwhile sees the old or the new file.
    staged = target.with_suffix(".staged")
    staged.write_text(to_toml(data))
    staged.replace(target)


def _entry(value: Any) -> dict[str, Any]:
    if isinstance(value, HttpServerSpec | StdioServerSpec):
        return {k: v for k, v in value.model_dump(mode="json").items()
                if v not in (None, {}, [], ()) and k != "name"}
    if isinstance(value, OpenAIModel):
        return {k: v for k, v in {"provider": value.provider, "base_url": value.base_url, "model": value.model,
                                  "api_key_env": value.api_key_env}.items() if v is not None}
    return dict(value)


def to_toml(data: Mapping[str, Any]) -> str:
    """The catalog's two levels of tables as TOML (strings, numbers, lists and inline tables of strings)."""
    lines = []
    for section, entries in data.items():
        for name, entry in entries.items():
            lines.append(f"[{section}.{json.dumps(name)}]")
            lines.extend(f"{json.dumps(key)} = {_value(value)}" for key, value in entry.items())
            lines.append("")
    return "\n".join(lines)


def _value(value: Any) -> str:
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{json.dumps(k)} = {_value(v)}" for k, v in value.items()) + " }"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    return json.dumps(value)  # strings, numbers and booleans are written alike in JSON and TOML
