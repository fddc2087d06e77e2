"""Settings from the environment and the run spec: defaults, every variable, and bad input refused
with the name of what is wrong (DESIGN.md section 6)."""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Callable
from typing import Any

import pytest

from runbrake.shared import ConfigError, RunSpec, Settings, SpecError
from runbrake.shared.spec import OpenAIModel, ScriptedModel

# -- settings -----------------------------------------------------------------------------------


def test_settings_default_to_the_local_services_under_the_runbrake_namespace() -> None:
    settings = Settings.from_env({})

    assert settings.rabbitmq_url == "amqp://guest:guest@127.0.0.1:5672/"
    assert settings.redis_url == "redis://127.0.0.1:6379/0"
    assert settings.namespace == "runbrake"
    assert settings == Settings()


def test_settings_defaults_for_the_bounds() -> None:
    settings = Settings.from_env({})

    assert settings.max_tool_result_chars == 16_000
    assert settings.cancel_poll_ms == 250
    assert settings.run_time_limit_s == 3600
    assert settings.lease_s == 60
    assert settings.metrics_port == 0
    assert settings.redis_timeout_s == 2.0


@pytest.mark.parametrize(
    ("variable", "raw", "attribute", "expected"),
    [
        ("RUNBRAKE_RABBITMQ_URL", "amqps://u:p@mq.example:5671/vh", "rabbitmq_url", "amqps://u:p@mq.example:5671/vh"),
        ("RUNBRAKE_REDIS_URL", "rediss://cache.example:6380/2", "redis_url", "rediss://cache.example:6380/2"),
        ("RUNBRAKE_REDIS_URL", "unix:///run/redis.sock", "redis_url", "unix:///run/redis.sock"),
        ("RUNBRAKE_NAMESPACE", "test-abc_1.x", "namespace", "test-abc_1.x"),
        ("RUNBRAKE_MAX_TOOL_RESULT_CHARS", "500", "max_tool_result_chars", 500),
        ("RUNBRAKE_CANCEL_POLL_MS", "40", "cancel_poll_ms", 40),
        ("RUNBRAKE_RUN_TIME_LIMIT_S", "90", "run_time_limit_s", 90),
        ("RUNBRAKE_LEASE_S", "15", "lease_s", 15),
        ("RUNBRAKE_METRICS_PORT", "9191", "metrics_port", 9191),
        ("RUNBRAKE_REDIS_TIMEOUT_S", "0.25", "redis_timeout_s", 0.25),
    ],
)
def test_settings_read_each_runbrake_variable(variable: str, raw: str, attribute: str, expected: object) -> None:
    settings = Settings.from_env({variable: raw})

    assert getattr(settings, attribute) == expected
    # ...and only that one: every other field keeps its default.
    defaults = Settings()
    for f in dataclasses.fields(Settings):
        if f.name != attribute:
            assert getattr(settings, f.name) == getattr(defaults, f.name), f.name


@pytest.mark.parametrize(
    "variable",
    ["RUNBRAKE_MAX_TOOL_RESULT_CHARS", "RUNBRAKE_CANCEL_POLL_MS", "RUNBRAKE_RUN_TIME_LIMIT_S", "RUNBRAKE_LEASE_S",
     "RUNBRAKE_METRICS_PORT", "RUNBRAKE_REDIS_TIMEOUT_S"],
)
def test_an_empty_numeric_variable_keeps_its_default(variable: str) -> None:
    assert Settings.from_env({variable: ""}) == Settings()


def test_settings_read_the_process_environment_when_given_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RUNBRAKE_NAMESPACE", "from-the-env")
    monkeypatch.setenv("RUNBRAKE_LEASE_S", "33")

    settings = Settings.from_env()

    assert settings.namespace == "from-the-env"
    assert settings.lease_s == 33


@pytest.mark.parametrize(
    ("variable", "raw"),
    [
        ("RUNBRAKE_RABBITMQ_URL", "http://127.0.0.1:5672/"),
        ("RUNBRAKE_RABBITMQ_URL", ""),
        ("RUNBRAKE_REDIS_URL", "127.0.0.1:6379"),
        ("RUNBRAKE_REDIS_URL", "amqp://127.0.0.1/"),
        ("RUNBRAKE_NAMESPACE", ""),
        ("RUNBRAKE_NAMESPACE", "has space"),
        ("RUNBRAKE_NAMESPACE", "a:b"),
        ("RUNBRAKE_NAMESPACE", "glob*"),
        ("RUNBRAKE_NAMESPACE", "-leading-dash"),
        ("RUNBRAKE_NAMESPACE", "x" * 65),
        ("RUNBRAKE_MAX_TOOL_RESULT_CHARS", "lots"),
        ("RUNBRAKE_MAX_TOOL_RESULT_CHARS", "0"),
        ("RUNBRAKE_CANCEL_POLL_MS", "9"),
        ("RUNBRAKE_CANCEL_POLL_MS", "2.5"),
        ("RUNBRAKE_RUN_TIME_LIMIT_S", "-1"),
        ("RUNBRAKE_LEASE_S", "4"),
        ("RUNBRAKE_METRICS_PORT", "65536"),
        ("RUNBRAKE_METRICS_PORT", "-1"),
        ("RUNBRAKE_REDIS_TIMEOUT_S", "fast"),
        ("RUNBRAKE_REDIS_TIMEOUT_S", "0"),
        ("RUNBRAKE_REDIS_TIMEOUT_S", "3601"),
        ("RUNBRAKE_REDIS_TIMEOUT_S", "nan"),
        ("RUNBRAKE_REDIS_TIMEOUT_S", "inf"),
    ],
)
def test_a_bad_setting_raises_config_error_naming_the_variable(variable: str, raw: str) -> None:
    with pytest.raises(ConfigError) as raised:
        Settings.from_env({variable: raw})

    assert raised.value.variable == variable
    assert str(raised.value).startswith(variable)


@pytest.mark.parametrize("raw", ["runbrake\n", "runbrake\r\n", "\nrunbrake"])
def test_a_namespace_with_a_line_break_is_refused(raw: str) -> None:
    """A namespace prefixes every Redis key, queue and exchange; a line break must not slip in."""
    with pytest.raises(ConfigError) as raised:
        Settings.from_env({"RUNBRAKE_NAMESPACE": raw})

    assert raised.value.variable == "RUNBRAKE_NAMESPACE"


def test_settings_cannot_be_changed_once_read() -> None:
    settings = Settings.from_env({})

    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.namespace = "other"  # type: ignore[misc]


# -- the run spec -------------------------------------------------------------------------------

DESIGN_EXAMPLE = """
{
  "input": "What is 2 + 3?",
  "model": {"provider": "scripted", "turns": [
      {"tool_calls": [{"server": "calc", "tool": "get-sum", "arguments": {"a": 2, "b": 3}}]},
      {"content": "It is 5."}
  ]},
  "mcp_servers": {
      "calc": {"url": "http://127.0.0.1:3001/mcp"},
      "local": {"command": "python", "args": ["-m", "mytools"], "env": {}}
  },
  "max_rounds": 8,
  "approval_required": ["calc.get-sum"],
  "idempotency_key": "optional-caller-key"
}
"""


def example() -> dict[str, Any]:
    return copy.deepcopy(json.loads(DESIGN_EXAMPLE))


def test_the_design_example_is_a_valid_spec() -> None:
    spec = RunSpec.from_json(DESIGN_EXAMPLE)

    assert spec.input == "What is 2 + 3?"
    assert isinstance(spec.model, ScriptedModel)
    assert len(spec.model.turns) == 2
    call = spec.model.turns[0].tool_calls[0]
    assert (call.server, call.tool, dict(call.arguments)) == ("calc", "get-sum", {"a": 2, "b": 3})
    assert spec.model.turns[1].content == "It is 5."
    assert spec.mcp_servers["calc"].transport == "http"
    assert spec.mcp_servers["calc"].url == "http://127.0.0.1:3001/mcp"
    assert spec.mcp_servers["local"].transport == "stdio"
    assert spec.mcp_servers["local"].command == "python"
    assert spec.mcp_servers["local"].args == ("-m", "mytools")
    assert spec.max_rounds == 8
    assert spec.approval_required == frozenset({"calc.get-sum"})
    assert spec.idempotency_key == "optional-caller-key"


def test_a_parsed_spec_is_stored_as_it_was_given_and_parses_again_to_the_same_spec() -> None:
    spec = RunSpec.parse(example())

    assert json.loads(spec.to_json()) == example()
    assert RunSpec.from_json(spec.to_json()) == spec


def test_parsing_does_not_keep_a_reference_to_the_callers_dict() -> None:
    data = example()
    spec = RunSpec.parse(data)

    data["input"] = "changed"

    assert json.loads(spec.to_json())["input"] == "What is 2 + 3?"


def test_a_minimal_spec_gets_the_defaults() -> None:
    spec = RunSpec.parse({"input": "hi", "model": {"provider": "scripted", "turns": [{"content": "hello"}]}})

    assert spec.max_rounds == 8
    assert spec.mcp_servers == {}
    assert spec.approval_required == frozenset()
    assert spec.idempotency_key is None


def test_an_openai_spec_is_valid() -> None:
    spec = RunSpec.parse({"input": "hi", "model": {"provider": "openai", "base_url": "http://127.0.0.1:9/v1",
                                                    "model": "gpt-x", "api_key_env": "MY_KEY"}})

    assert spec.model == OpenAIModel(base_url="http://127.0.0.1:9/v1", model="gpt-x", api_key_env="MY_KEY")


def _set(path: str, value: object) -> Callable[[dict[str, Any]], None]:
    """Set a dotted path (list indexes as numbers) in the example spec."""

    def apply(spec: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node: Any = spec
        for part in parents:
            node = node[int(part)] if part.isdigit() else node[part]
        node[int(last) if last.isdigit() else last] = value

    return apply


def _drop(key: str) -> Callable[[dict[str, Any]], None]:
    return lambda spec: spec.pop(key)


BAD_SPECS: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
    ("missing input", _drop("input"), "input"),
    ("blank input", _set("input", "   "), "input"),
    ("input not a string", _set("input", 42), "input"),
    ("missing model", _drop("model"), "model"),
    ("unknown provider", _set("model.provider", "anthropic"), "model.provider"),
    ("no turns", _set("model.turns", []), "model.turns"),
    ("empty turn", _set("model.turns.1", {}), "model.turns[1]"),
    ("unknown turn field", _set("model.turns.1.speed", 3), "model.turns[1].speed"),
    ("negative delay", _set("model.turns.1.delay_ms", -1), "model.turns[1].delay_ms"),
    ("empty fail message", _set("model.turns.1.fail", ""), "model.turns[1].fail"),
    ("tool call naming an unknown server", _set("model.turns.0.tool_calls.0.server", "nosuch"),
     "model.turns[0].tool_calls[0].server"),
    ("tool call without a tool", _set("model.turns.0.tool_calls.0.tool", ""), "model.turns[0].tool_calls[0].tool"),
    ("tool call arguments not an object", _set("model.turns.0.tool_calls.0.arguments", [1]),
     "model.turns[0].tool_calls[0].arguments"),
    ("max_rounds zero", _set("max_rounds", 0), "max_rounds"),
    ("max_rounds too large", _set("max_rounds", 1001), "max_rounds"),
    ("max_rounds a string", _set("max_rounds", "8"), "max_rounds"),
    ("max_rounds a boolean", _set("max_rounds", True), "max_rounds"),
    ("max_rounds a float", _set("max_rounds", 2.5), "max_rounds"),
    ("approval entry without a tool", _set("approval_required", ["calc"]), "approval_required[0]"),
    ("approval entry with an empty tool", _set("approval_required", ["calc."]), "approval_required[0]"),
    ("approval entry naming an unknown server", _set("approval_required", ["calc.get-sum", "nosuch.x"]),
     "approval_required[1]"),
    ("approval entry not a string", _set("approval_required", [7]), "approval_required"),
    ("approval_required not a list", _set("approval_required", "calc.get-sum"), "approval_required"),
    ("server with both url and command", _set("mcp_servers.calc.command", "python"), "mcp_servers.calc"),
    ("server with neither url nor command", _set("mcp_servers.calc", {}), "mcp_servers.calc"),
    ("server url not http", _set("mcp_servers.calc.url", "ftp://x"), "mcp_servers.calc.url"),
    ("http server with args", _set("mcp_servers.calc.args", ["x"]), "mcp_servers.calc"),
    ("stdio args not strings", _set("mcp_servers.local.args", ["-m", 3]), "mcp_servers.local.args"),
    ("stdio env values not strings", _set("mcp_servers.local.env", {"A": 1}), "mcp_servers.local.env"),
    ("unknown server field", _set("mcp_servers.calc.headers", {}), "mcp_servers.calc.headers"),
    ("server name with a double underscore", _set("mcp_servers.a__b", {"url": "http://x"}), "mcp_servers.a__b"),
    ("mcp_servers not an object", _set("mcp_servers", []), "mcp_servers"),
    ("empty idempotency key", _set("idempotency_key", ""), "idempotency_key"),
    ("idempotency key too long", _set("idempotency_key", "k" * 201), "idempotency_key"),
    ("tool timeout zero", _set("tool_timeout_s", 0), "tool_timeout_s"),
    ("unknown top-level field", _set("priority", "high"), "priority"),
]


@pytest.mark.parametrize(("mutate", "field"), [(m, f) for _, m, f in BAD_SPECS], ids=[n for n, _, _ in BAD_SPECS])
def test_a_bad_spec_is_refused_naming_the_field(mutate: Callable[[dict[str, Any]], None], field: str) -> None:
    data = example()
    mutate(data)

    with pytest.raises(SpecError) as raised:
        RunSpec.parse(data)

    assert raised.value.field == field
    assert str(raised.value).startswith(f"{field}: ")


@pytest.mark.parametrize("data", [None, [], "spec", {1: "x"}])
def test_a_spec_that_is_not_an_object_is_refused_as_spec(data: object) -> None:
    with pytest.raises(SpecError) as raised:
        RunSpec.parse(data)

    assert raised.value.field == "spec"


@pytest.mark.parametrize("text", ["{", "", "{'input': 'single quotes'}", '{"input": "x",}'])
def test_invalid_json_is_refused_as_spec(text: str) -> None:
    with pytest.raises(SpecError) as raised:
        RunSpec.from_json(text)

    assert raised.value.field == "spec"
    assert "JSON" in raised.value.problem


def test_valid_json_that_is_not_an_object_is_refused_as_spec() -> None:
    with pytest.raises(SpecError) as raised:
        RunSpec.from_json("[1, 2]")

    assert raised.value.field == "spec"


@pytest.mark.parametrize("name", ["calc\n", "calc\r\n"])
def test_a_server_name_with_a_line_break_is_refused(name: str) -> None:
    """Server names become tool names shown to a model (``<server>__<tool>``); a line break must not slip in."""
    data = example()
    data["mcp_servers"][name] = data["mcp_servers"].pop("calc")
    data["model"]["turns"][0]["tool_calls"][0]["server"] = name
    data["approval_required"] = []

    with pytest.raises(SpecError) as raised:
        RunSpec.parse(data)

    assert raised.value.field == f"mcp_servers.{name}"
