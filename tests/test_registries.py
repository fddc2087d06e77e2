"""A model provider or an MCP transport is one registry entry (shared/registry.py): the spec's unions and their
messages, the inline policy, the catalog, ``catalog check``, the JSON Schema and the worker's construction all
follow it. Each test registers its own member and removes it before it ends."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import anyio
import pytest
from click.testing import CliRunner
from pydantic import ConfigDict
from pydantic.dataclasses import dataclass

from runbrake.broker.cli import main
from runbrake.shared.catalog import Admission, Catalog
from runbrake.shared.errors import ProviderError, SpecError, ToolTransportError
from runbrake.shared.registry import PROVIDERS, TRANSPORTS, Entry, Shown
from runbrake.shared.spec import RunSpec, ServerSpec, run_spec_json_schema
from runbrake.worker.conversation import Message, ModelTurn, ToolInfo
from runbrake.worker.mcp_transport import McpConnection
from runbrake.worker.models import provider_for

SCHEMA_FILE = Path(__file__).resolve().parent.parent / "docs" / "run-spec.schema.json"


@dataclass(frozen=True, config=ConfigDict(extra="forbid", strict=True))
class EchoModel:
    """A provider that exists in this test module only."""

    endpoint: str
    provider: Literal["echo"] = "echo"


class EchoProvider:
    """Its implementation: answers with its endpoint."""

    def __init__(self, spec: EchoModel) -> None:
        self.spec = spec

    async def complete(self, messages: Sequence[Message], tools: Sequence[ToolInfo], *, round_index: int) -> ModelTurn:
        return ModelTurn(content=self.spec.endpoint, tool_calls=())


def _describe_echo(model: EchoModel, shown: Shown) -> dict[str, Any]:
    return {"endpoint": shown.url(model.endpoint)}


def echo_entry(**overrides: Any) -> Entry:
    fields: dict[str, Any] = {"tag": "echo", "spec": EchoModel, "implementation": f"{__name__}:EchoProvider",
                              "title": "echo", "describe": _describe_echo}
    return Entry(**(fields | overrides))


@pytest.fixture
def registered() -> Iterator[list[str]]:
    """Registers what a test adds to PROVIDERS (``provider:TAG``) or TRANSPORTS (``transport:TAG``), and
    removes it again, so that no other test sees it."""
    added: list[str] = []
    yield added
    for item in added:
        kind, _, tag = item.partition(":")
        (PROVIDERS if kind == "provider" else TRANSPORTS).unregister(tag)


def register_provider(added: list[str], entry: Entry) -> None:
    PROVIDERS.register(entry)
    added.append(f"provider:{entry.tag}")


def echo_spec() -> dict[str, Any]:
    return {"input": "hi", "model": {"provider": "echo", "endpoint": "https://echo.example/v1"}}


def test_a_provider_registered_without_saying_inline_is_refused_inline_and_admitted_where_inline_is_allowed(
    registered: list[str],
) -> None:
    register_provider(registered, echo_entry())
    spec = RunSpec.parse(echo_spec())
    assert spec.model == EchoModel(endpoint="https://echo.example/v1")

    with pytest.raises(SpecError) as refused:
        Admission(source=Catalog.empty()).admit(spec)
    assert refused.value.field == "model"
    assert "an inline echo model is refused" in refused.value.problem
    assert Admission(source=Catalog.empty(), allow_inline=True).admit(spec).model == spec.model


def test_a_provider_whose_entry_allows_inline_is_admitted_inline(registered: list[str]) -> None:
    register_provider(registered, echo_entry(inline=True))
    spec = RunSpec.parse(echo_spec())
    assert Admission(source=Catalog.empty()).admit(spec).model == spec.model


def test_a_catalog_entry_of_a_registered_provider_is_accepted_and_described_by_catalog_check(
    registered: list[str], tmp_path: Path,
) -> None:
    register_provider(registered, echo_entry())
    path = tmp_path / "catalog.toml"
    path.write_text('[models.e]\nprovider = "echo"\nendpoint = "https://u:pw@echo.example/v1"\n', encoding="utf-8")

    checked = CliRunner().invoke(main, ["catalog", "check", str(path), "--json"])
    assert checked.exit_code == 0, checked.output
    assert json.loads(checked.output)["models"] == {
        "e": {"provider": "echo", "endpoint": "https://u:***@echo.example/v1"}}
    listed = CliRunner().invoke(main, ["catalog", "check", str(path)])
    assert listed.exit_code == 0, listed.output
    assert "model e: echo" in listed.output

    spec = RunSpec.parse({"input": "hi", "model": "e"})
    admitted = Admission(source=Catalog.load(path)).admit(spec)
    assert admitted.model == EchoModel(endpoint="https://u:pw@echo.example/v1")
    assert isinstance(provider_for(admitted.model).provider, EchoProvider)


def test_the_schema_names_a_registered_provider_and_is_the_documented_one_again_once_it_is_removed(
    registered: list[str],
) -> None:
    register_provider(registered, echo_entry())
    schema = json.dumps(run_spec_json_schema())
    assert "EchoModel" in schema
    assert '"const": "echo"' in schema

    PROVIDERS.unregister("echo")
    assert "EchoModel" not in json.dumps(run_spec_json_schema())
    assert run_spec_json_schema() == json.loads(SCHEMA_FILE.read_text(encoding="utf-8"))


def test_the_message_for_an_unknown_provider_lists_the_registered_ones(registered: list[str]) -> None:
    spec = {"input": "hi", "model": {"provider": "nope"}}
    with pytest.raises(SpecError) as before:
        RunSpec.parse(spec)
    assert (before.value.field, before.value.problem) == (
        "model.provider", "must be 'scripted', 'openai' or 'anthropic'")

    register_provider(registered, echo_entry())
    with pytest.raises(SpecError) as after:
        RunSpec.parse(spec)
    assert after.value.problem == "must be 'scripted', 'openai', 'anthropic' or 'echo'"


def test_a_provider_the_worker_cannot_import_fails_closed_with_a_provider_error(registered: list[str]) -> None:
    register_provider(registered, echo_entry(implementation=f"{__name__}:NoSuchProvider"))
    with pytest.raises(ProviderError, match="model provider 'echo' has no implementation here"):
        provider_for(EchoModel(endpoint="https://echo.example/v1"))


class PipeServerSpec(ServerSpec):
    """A transport that exists in this test module only, and has no implementation in the worker."""

    transport: Literal["pipe"] = "pipe"
    pipe: str

    def where(self) -> str:
        return f"pipe: {self.pipe}"


def test_a_registered_transport_is_implied_by_its_key_refused_inline_and_fails_closed_without_an_implementation(
    registered: list[str],
) -> None:
    TRANSPORTS.register(Entry(tag="pipe", spec=PipeServerSpec, implementation=f"{__name__}:no_such_target",
                              title="a named pipe", implied_by="pipe"))
    registered.append("transport:pipe")
    spec = RunSpec.parse({"input": "hi", "model": {"provider": "scripted", "turns": [{"content": "x"}]},
                          "mcp_servers": {"p": {"pipe": "runbrake-test-pipe"}}})
    assert isinstance(spec.mcp_servers, dict)
    server = spec.mcp_servers["p"]
    assert isinstance(server, PipeServerSpec)
    assert server.name == "p"
    with pytest.raises(SpecError, match="inline servers are refused"):
        Admission(source=Catalog.empty()).admit(spec)

    with pytest.raises(SpecError) as neither:
        RunSpec.parse({"input": "hi", "model": {"provider": "scripted", "turns": [{"content": "x"}]},
                       "mcp_servers": {"p": {}}})
    assert neither.value.problem == (
        "needs exactly one of 'url' (streamable HTTP), 'command' (stdio) or 'pipe' (a named pipe)")

    async def connect() -> None:
        async with McpConnection.open(server):
            pytest.fail("a transport without an implementation connected")

    with pytest.raises(ToolTransportError, match="MCP transport 'pipe' has no implementation here"):
        anyio.run(connect)


@pytest.mark.parametrize("entry", [*PROVIDERS, *TRANSPORTS], ids=lambda entry: entry.tag)
def test_every_built_in_member_names_an_implementation_the_worker_imports(entry: Entry) -> None:
    module, _, name = entry.implementation.partition(":")
    __import__(module)
    assert callable(getattr(sys.modules[module], name))
