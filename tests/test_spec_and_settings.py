"""Settings from the environment and the run spec: defaults, every variable and every bound, and bad
input refused with the name of what is wrong: every offending field of a spec at once (docs/usage.md,
"A run spec"), through ``RunSpec`` and through ``runbrake enqueue``, and the spec's JSON Schema."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from jsonschema import Draft202012Validator

from runbrake.shared import ConfigError, RunSpec, RunStore, Settings, SpecError
from runbrake.shared.errors import FieldProblem
from runbrake.shared.settings import descriptions
from runbrake.shared.spec import (
    HttpServerSpec,
    OpenAIModel,
    ScriptedModel,
    ScriptedTurn,
    StdioServerSpec,
    run_spec_json_schema,
)
from tests.test_cli import assert_clean_failure, namespace_keys, queued_messages, runbrake

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
        ("RUNBRAKE_CATALOG", "/etc/runbrake/catalog.toml", "catalog", "/etc/runbrake/catalog.toml"),
        ("RUNBRAKE_ALLOW_INLINE", "true", "allow_inline", True),
        ("RUNBRAKE_MAX_SPEC_BYTES", "2048", "max_spec_bytes", 2048),
        ("RUNBRAKE_MAX_INPUT_CHARS", "500", "max_input_chars", 500),
        ("RUNBRAKE_MAX_ARGUMENT_CHARS", "300", "max_argument_chars", 300),
        ("RUNBRAKE_MAX_TOOL_CALLS_PER_TURN", "4", "max_tool_calls_per_turn", 4),
        ("RUNBRAKE_MAX_PARALLEL_TOOL_CALLS", "1", "max_parallel_tool_calls", 1),
        ("RUNBRAKE_MAX_STEPS_CAP", "50", "max_steps_cap", 50),
        ("RUNBRAKE_MAX_AGENT_DEPTH", "2", "max_agent_depth", 2),
        ("RUNBRAKE_MAX_AGENT_CALLS", "4", "max_agent_calls", 4),
        ("RUNBRAKE_RETENTION_S", "0", "retention_s", 0),
        ("RUNBRAKE_REDRIVE_S", "5", "redrive_s", 5),
        ("RUNBRAKE_DRAIN_S", "2", "drain_s", 2),
        ("RUNBRAKE_API_TOKENS", "/etc/runbrake/tokens.toml", "api_tokens", "/etc/runbrake/tokens.toml"),
        ("RUNBRAKE_HEALTH_PORT", "9500", "health_port", 9500),
        ("RUNBRAKE_REDIS_CLUSTER", "yes", "redis_cluster", True),
        ("RUNBRAKE_QUEUE_TYPE", "quorum", "queue_type", "quorum"),
        ("RUNBRAKE_API_ALLOWED_HOSTS", "API.example, [::1]:8080,*", "api_allowed_hosts",
         ("api.example", "[::1]:8080", "*")),
        ("RUNBRAKE_API_HEADER_TIMEOUT_S", "2.5", "api_header_timeout_s", 2.5),
    ],
)
def test_settings_read_each_runbrake_variable(variable: str, raw: str, attribute: str, expected: object) -> None:
    settings = Settings.from_env({variable: raw})

    assert getattr(settings, attribute) == expected
    # ...and only that one: every other field keeps its default.
    defaults = Settings()
    for name in Settings.variables:
        if name != attribute:
            assert getattr(settings, name) == getattr(defaults, name), name


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
        ("RUNBRAKE_GC_INTERVAL_S", "-1"),
        ("RUNBRAKE_GC_INTERVAL_S", "3601"),
        ("RUNBRAKE_GC_INTERVAL_S", "nan"),
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
        ("RUNBRAKE_ALLOW_INLINE", "maybe"),
        ("RUNBRAKE_MAX_SPEC_BYTES", "10"),
        ("RUNBRAKE_RETENTION_S", "-1"),
        ("RUNBRAKE_REDRIVE_S", "0"),
        ("RUNBRAKE_MAX_PARALLEL_TOOL_CALLS", "0"),
        ("RUNBRAKE_HEALTH_PORT", "70000"),
        ("RUNBRAKE_REDIS_CLUSTER", "2"),
        ("RUNBRAKE_QUEUE_TYPE", "stream"),
        ("RUNBRAKE_API_ALLOWED_HOSTS", "http://api.example"),
        ("RUNBRAKE_API_ALLOWED_HOSTS", "api.example,,ops.example"),
        ("RUNBRAKE_API_ALLOWED_HOSTS", "*:80"),
        ("RUNBRAKE_API_HEADER_TIMEOUT_S", "0"),
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


def test_the_settings_read_exactly_these_variables() -> None:
    """Names are a contract (docs/configuration.md): a field renamed renames its variable, and fails here."""
    assert sorted(Settings.variables.values()) == sorted([
        "RUNBRAKE_RABBITMQ_URL", "RUNBRAKE_REDIS_URL", "RUNBRAKE_NAMESPACE", "RUNBRAKE_MAX_TOOL_RESULT_CHARS",
        "RUNBRAKE_MCP_PROGRESS", "RUNBRAKE_EVENT_LOOP", "RUNBRAKE_SWITCH_INTERVAL_MS", "RUNBRAKE_GC_INTERVAL_S",
        "RUNBRAKE_ADMIT_MAX_LAG_MS", "RUNBRAKE_ADMIT_MAX_CPU_PCT", "RUNBRAKE_ADMIT_MAX_PAUSE_MS",
        "RUNBRAKE_ADMIT_MAX_RSS_MB",
        "RUNBRAKE_ADMIT_MIN_RUNS",
        "RUNBRAKE_CANCEL_POLL_MS", "RUNBRAKE_RUN_TIME_LIMIT_S", "RUNBRAKE_MODEL_RETRIES", "RUNBRAKE_MODEL_RETRY_MAX_S",
        "RUNBRAKE_LEASE_S", "RUNBRAKE_WORKER_BEAT_S", "RUNBRAKE_WORKER_LOST_S", "RUNBRAKE_MAX_WORKER_LOSSES",
        "RUNBRAKE_METRICS_PORT",
        "RUNBRAKE_REDIS_TIMEOUT_S", "RUNBRAKE_CATALOG", "RUNBRAKE_ALLOW_INLINE", "RUNBRAKE_MAX_SPEC_BYTES",
        "RUNBRAKE_RABBITMQ_ALLOW_UNTENANTED",
        "RUNBRAKE_MAX_INPUT_CHARS", "RUNBRAKE_MAX_ARGUMENT_CHARS", "RUNBRAKE_MAX_MODEL_CONTENT_CHARS",
        "RUNBRAKE_MAX_MESSAGES", "RUNBRAKE_MAX_HISTORY_CHARS", "RUNBRAKE_MAX_OUTPUT_SCHEMA_BYTES",
        "RUNBRAKE_SCHEMA_CHECK_S",
        "RUNBRAKE_MAX_TOOL_CALLS_PER_TURN", "RUNBRAKE_MAX_PARALLEL_TOOL_CALLS", "RUNBRAKE_MAX_STEPS_CAP",
        "RUNBRAKE_MAX_AGENT_DEPTH", "RUNBRAKE_MAX_AGENT_CALLS",
        "RUNBRAKE_RETENTION_S", "RUNBRAKE_REDRIVE_S", "RUNBRAKE_OTEL",
        "RUNBRAKE_DRAIN_S", "RUNBRAKE_API_TOKENS", "RUNBRAKE_HEALTH_PORT", "RUNBRAKE_HEALTH_HOST",
        "RUNBRAKE_REDIS_CLUSTER", "RUNBRAKE_REDIS_SENTINELS", "RUNBRAKE_REDIS_SENTINEL_MASTER",
        "RUNBRAKE_REDIS_MIN_REPLICAS_ACK", "RUNBRAKE_REDIS_REPLICA_ACK_TIMEOUT_S", "RUNBRAKE_QUEUE_TYPE",
        "RUNBRAKE_API_ALLOWED_HOSTS", "RUNBRAKE_API_HEADER_TIMEOUT_S", "RUNBRAKE_API_SEND_TIMEOUT_S",
        "RUNBRAKE_API_MAX_STREAMS_PER_TOKEN", "RUNBRAKE_WEBHOOK_RETRY_S", "RUNBRAKE_WEBHOOK_BACKOFF_S",
        "RUNBRAKE_WEBHOOK_BACKOFF_MAX_S", "RUNBRAKE_WEBHOOK_TIMEOUT_S", "RUNBRAKE_WEBHOOK_CONCURRENCY",
    ])


def test_every_setting_has_its_documentation() -> None:
    documented = descriptions()
    assert [name for name in Settings.variables if not documented.get(name)] == []


def test_settings_cannot_be_changed_once_read() -> None:
    settings = Settings.from_env({})

    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.namespace = "other"  # type: ignore[misc]


def test_a_copy_with_changes_is_checked_like_the_variables() -> None:
    settings = Settings.from_env({})

    assert settings.with_changes(lease_s=10).lease_s == 10
    assert settings.with_changes(lease_s=10).namespace == settings.namespace
    with pytest.raises(ConfigError) as raised:
        settings.with_changes(lease_s=4)
    assert raised.value.variable == "RUNBRAKE_LEASE_S"


@pytest.mark.parametrize(("field", "value"), [("namespace", 5), ("lease_s", True), ("lease_s", 10.5),
                                            ("allow_inline", "perhaps"), ("catalog", 3)])
def test_a_keyword_field_of_another_type_is_refused_naming_its_variable(field: str, value: object) -> None:
    with pytest.raises(ConfigError) as raised:
        Settings(**{field: value})

    assert raised.value.variable == Settings.variables[field]


def test_a_whole_number_for_a_seconds_field_is_kept_as_a_float() -> None:
    assert Settings(redis_timeout_s=1).redis_timeout_s == 1.0
    assert isinstance(Settings(redis_timeout_s=1).redis_timeout_s, float)


def test_only_the_exact_variable_names_are_read() -> None:
    """A lower-case ``runbrake_lease_s`` or an unknown ``RUNBRAKE_*`` variable changes nothing."""
    assert Settings.from_env({"runbrake_lease_s": "10", "RUNBRAKE_NO_SUCH_SETTING": "x"}) == Settings()


def test_keyword_fields_never_read_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RUNBRAKE_NAMESPACE", "from-the-env")

    assert Settings().namespace == "runbrake"
    assert Settings(lease_s=10).namespace == "runbrake"


# -- the run spec -------------------------------------------------------------------------------

README_EXAMPLE = """
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
  "idempotency_key": "optional-caller-key",
  "tool_timeout_s": 60
}
"""


def example() -> dict[str, Any]:
    return copy.deepcopy(json.loads(README_EXAMPLE))


def refused(data: object) -> SpecError:
    """The SpecError that ``RunSpec.parse(data)`` raises."""
    with pytest.raises(SpecError) as raised:
        RunSpec.parse(data)
    return raised.value


def fields(error: SpecError) -> list[str]:
    return [problem.field for problem in error.problems]


def test_the_readme_example_is_a_valid_spec() -> None:
    spec = RunSpec.from_json(README_EXAMPLE)

    assert spec.input == "What is 2 + 3?"
    assert isinstance(spec.model, ScriptedModel)
    assert len(spec.model.turns) == 2
    call = spec.model.turns[0].tool_calls[0]
    assert (call.server, call.tool, dict(call.arguments)) == ("calc", "get-sum", {"a": 2, "b": 3})
    assert spec.model.turns[1].content == "It is 5."
    calc, local = spec.mcp_servers["calc"], spec.mcp_servers["local"]
    assert isinstance(calc, HttpServerSpec)
    assert (calc.name, calc.transport, calc.url) == ("calc", "http", "http://127.0.0.1:3001/mcp")
    assert isinstance(local, StdioServerSpec)
    assert (local.name, local.transport, local.command, local.args, local.env) == (
        "local", "stdio", "python", ("-m", "mytools"), {})
    assert spec.max_rounds == 8
    assert spec.approval_required == frozenset({"calc.get-sum"})
    assert spec.idempotency_key == "optional-caller-key"
    assert spec.tool_timeout_s == 60.0
    assert isinstance(spec.tool_timeout_s, float)


def test_a_parsed_spec_is_stored_as_it_was_given_and_parses_again_to_the_same_spec() -> None:
    spec = RunSpec.parse(example())

    assert spec.raw == example()
    assert json.loads(spec.to_json()) == example()
    assert "name" not in spec.to_json()  # a server's name is its key, never added to what is stored
    assert RunSpec.from_json(spec.to_json()) == spec


def test_parsing_does_not_keep_a_reference_to_the_callers_dict() -> None:
    data = example()
    spec = RunSpec.parse(data)

    data["input"] = "changed"
    data["mcp_servers"]["calc"]["url"] = "http://elsewhere/mcp"

    assert spec.raw["input"] == "What is 2 + 3?"
    assert spec.raw["mcp_servers"]["calc"]["url"] == "http://127.0.0.1:3001/mcp"


def test_a_minimal_spec_gets_the_defaults() -> None:
    spec = RunSpec.parse({"input": "hi", "model": {"provider": "scripted", "turns": [{"content": "hello"}]}})

    assert spec.max_rounds == 8
    assert spec.mcp_servers == ()
    assert spec.max_steps == 200
    assert spec.approval_required == frozenset()
    assert spec.idempotency_key is None
    assert spec.tool_timeout_s == 60.0
    assert spec.model == ScriptedModel(turns=(ScriptedTurn(content="hello"),))


def test_an_openai_spec_is_valid() -> None:
    spec = RunSpec.parse({"input": "hi", "model": {"provider": "openai", "base_url": "http://127.0.0.1:9/v1",
                                                    "model": "gpt-x", "api_key_env": "MY_KEY"}})

    assert spec.model == OpenAIModel(base_url="http://127.0.0.1:9/v1", model="gpt-x", api_key_env="MY_KEY")


@pytest.mark.parametrize(("server", "transport", "kind"), [
    ({"transport": "http", "url": "http://127.0.0.1:3001/mcp"}, "http", HttpServerSpec),
    ({"transport": "stdio", "command": "python"}, "stdio", StdioServerSpec),
    ({"url": "https://tools.example/mcp"}, "http", HttpServerSpec),
    ({"command": "python", "args": ["-m", "x"], "env": {"A": "1"}}, "stdio", StdioServerSpec),
], ids=["http-explicit", "stdio-explicit", "http-inferred", "stdio-inferred"])
def test_a_server_is_http_or_stdio_by_its_transport_or_by_url_or_command(
    server: dict[str, Any], transport: str, kind: type
) -> None:
    data = example()
    data["mcp_servers"]["calc"] = server

    spec = RunSpec.parse(data)

    assert isinstance(spec.mcp_servers["calc"], kind)
    assert spec.mcp_servers["calc"].transport == transport
    assert spec.mcp_servers["calc"].name == "calc"
    assert spec.raw["mcp_servers"]["calc"] == server  # stored as given: no inferred transport added


def _set(path: str, value: object) -> Callable[[dict[str, Any]], None]:
    """Set a dotted path (list indexes as numbers) in the example spec."""

    def apply(spec: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node: Any = spec
        for part in parents:
            node = node[int(part)] if part.isdigit() else node[part]
        node[int(last) if last.isdigit() else last] = value

    return apply


def _drop(path: str) -> Callable[[dict[str, Any]], None]:
    def apply(spec: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node: Any = spec
        for part in parents:
            node = node[int(part)] if part.isdigit() else node[part]
        del node[last]

    return apply


def _server(name: str, entry: object = None) -> Callable[[dict[str, Any]], None]:
    """Add a server under ``name`` (any text, dots included) to the example spec."""

    def apply(spec: dict[str, Any]) -> None:
        spec["mcp_servers"][name] = {"url": "http://127.0.0.1:9/mcp"} if entry is None else entry

    return apply


def _openai(**fields: object) -> Callable[[dict[str, Any]], None]:
    """Make the example's model an openai one, with these fields changed (None: left out)."""

    def apply(spec: dict[str, Any]) -> None:
        model = {"provider": "openai", "base_url": "http://127.0.0.1:9/v1", "model": "m", **fields}
        spec["model"] = {key: value for key, value in model.items() if value is not None}

    return apply


# Every bound of the spec: (what, a value just inside, a value just outside, the field named).
BOUNDS: list[tuple[str, Callable[[dict[str, Any]], None], Callable[[dict[str, Any]], None], str]] = [
    ("input non-empty", _set("input", "x"), _set("input", ""), "input"),
    ("input not only whitespace", _set("input", " x "), _set("input", " \t\n"), "input"),
    ("input a string", _set("input", "42"), _set("input", 42), "input"),
    ("max_rounds low", _set("max_rounds", 1), _set("max_rounds", 0), "max_rounds"),
    ("max_rounds high", _set("max_rounds", 1000), _set("max_rounds", 1001), "max_rounds"),
    ("max_rounds not a string", _set("max_rounds", 8), _set("max_rounds", "8"), "max_rounds"),
    ("max_rounds not a boolean", _set("max_rounds", 1), _set("max_rounds", True), "max_rounds"),
    ("max_rounds not a float", _set("max_rounds", 2), _set("max_rounds", 2.5), "max_rounds"),
    ("tool_timeout_s above 0", _set("tool_timeout_s", 0.001), _set("tool_timeout_s", 0), "tool_timeout_s"),
    ("tool_timeout_s not negative", _set("tool_timeout_s", 1), _set("tool_timeout_s", -1), "tool_timeout_s"),
    ("tool_timeout_s high", _set("tool_timeout_s", 86_400), _set("tool_timeout_s", 86_400.001), "tool_timeout_s"),
    ("tool_timeout_s finite", _set("tool_timeout_s", 86_400.0), _set("tool_timeout_s", math.inf), "tool_timeout_s"),
    ("tool_timeout_s a number", _set("tool_timeout_s", 1.5), _set("tool_timeout_s", math.nan), "tool_timeout_s"),
    ("tool_timeout_s not a boolean", _set("tool_timeout_s", 1), _set("tool_timeout_s", True), "tool_timeout_s"),
    ("tool_timeout_s not a string", _set("tool_timeout_s", 60), _set("tool_timeout_s", "60"), "tool_timeout_s"),
    ("idempotency_key short", _set("idempotency_key", "k"), _set("idempotency_key", ""), "idempotency_key"),
    ("idempotency_key long", _set("idempotency_key", "k" * 200), _set("idempotency_key", "k" * 201),
     "idempotency_key"),
    ("idempotency_key a string", _set("idempotency_key", None), _set("idempotency_key", 7), "idempotency_key"),
    ("delay_ms low", _set("model.turns.1.delay_ms", 0), _set("model.turns.1.delay_ms", -1),
     "model.turns[1].delay_ms"),
    ("delay_ms high", _set("model.turns.1.delay_ms", 3_600_000), _set("model.turns.1.delay_ms", 3_600_001),
     "model.turns[1].delay_ms"),
    ("delay_ms not a boolean", _set("model.turns.1.delay_ms", 1), _set("model.turns.1.delay_ms", True),
     "model.turns[1].delay_ms"),
    ("turns non-empty", _set("model.turns", [{"content": "x"}]), _set("model.turns", []), "model.turns"),
    ("turn says something", _set("model.turns.1", {"fail": "boom"}), _set("model.turns.1", {}), "model.turns[1]"),
    ("turn content a string", _set("model.turns.1.content", ""), _set("model.turns.1.content", 5),
     "model.turns[1].content"),
    ("turn fail non-empty", _set("model.turns.1.fail", "x"), _set("model.turns.1.fail", ""), "model.turns[1].fail"),
    ("tool calls a list", _set("model.turns.1.tool_calls", []), _set("model.turns.1.tool_calls", {}),
     "model.turns[1].tool_calls"),
    ("tool call tool non-empty", _set("model.turns.0.tool_calls.0.tool", "t"),
     _set("model.turns.0.tool_calls.0.tool", ""), "model.turns[0].tool_calls[0].tool"),
    ("tool call server declared", _set("model.turns.0.tool_calls.0.server", "local"),
     _set("model.turns.0.tool_calls.0.server", "nosuch"), "model.turns[0].tool_calls[0].server"),
    ("tool call arguments an object", _set("model.turns.0.tool_calls.0.arguments", {}),
     _set("model.turns.0.tool_calls.0.arguments", [1]), "model.turns[0].tool_calls[0].arguments"),
    ("provider known", _set("model.provider", "scripted"), _set("model.provider", "gemini"), "model.provider"),
    ("provider present", _set("model.provider", "scripted"), _drop("model.provider"), "model.provider"),
    ("model an object", _set("model", {"provider": "scripted", "turns": [{"content": "x"}]}), _set("model", 42),
     "model"),
    ("openai base_url http", _openai(base_url="https://api.example/v1"), _openai(base_url="ftp://api.example"),
     "model.base_url"),
    ("openai model non-empty", _openai(model="m"), _openai(model=""), "model.model"),
    ("openai api_key_env non-empty", _openai(api_key_env="K"), _openai(api_key_env=""), "model.api_key_env"),
    ("server name long", _server("a" * 64), _server("a" * 65), "mcp_servers." + "a" * 65),
    ("server name without __", _server("a_b-1"), _server("a__b"), "mcp_servers.a__b"),
    ("server name characters", _server("ab"), _server("a.b"), 'mcp_servers["a.b"]'),
    ("server name non-empty", _server("a"), _server(""), 'mcp_servers[""]'),
    ("server url http", _set("mcp_servers.calc.url", "https://x/mcp"), _set("mcp_servers.calc.url", "ftp://x"),
     "mcp_servers.calc.url"),
    ("server url or command", _set("mcp_servers.calc", {"url": "http://x"}), _set("mcp_servers.calc", {}),
     "mcp_servers.calc"),
    ("server not both", _set("mcp_servers.calc", {"command": "x"}),
     _set("mcp_servers.calc", {"url": "http://x", "command": "x"}), "mcp_servers.calc"),
    ("server an object", _set("mcp_servers.calc", {"url": "http://x"}), _set("mcp_servers.calc", "http://x"),
     "mcp_servers.calc"),
    ("server transport known", _set("mcp_servers.calc.transport", "http"), _set("mcp_servers.calc.transport", "ws"),
     "mcp_servers.calc.transport"),
    ("command non-empty", _set("mcp_servers.local.command", "x"), _set("mcp_servers.local.command", ""),
     "mcp_servers.local.command"),
    ("args strings", _set("mcp_servers.local.args", ["-m", "3"]), _set("mcp_servers.local.args", ["-m", 3]),
     "mcp_servers.local.args[1]"),
    ("env values strings", _set("mcp_servers.local.env", {"A": "1"}), _set("mcp_servers.local.env", {"A": 1}),
     "mcp_servers.local.env.A"),
    ("args only on stdio", _set("mcp_servers.local.args", ["x"]), _set("mcp_servers.calc.args", ["x"]),
     "mcp_servers.calc.args"),
    ("env only on stdio", _set("mcp_servers.local.env", {}), _set("mcp_servers.calc.env", {}), "mcp_servers.calc.env"),
    ("mcp_servers an object", _set("mcp_servers", {"calc": {"url": "http://x"}, "local": {"command": "x"}}),
     _set("mcp_servers", 42), "mcp_servers"),
    ("approval entry has a tool", _set("approval_required", ["calc.x"]), _set("approval_required", ["calc"]),
     "approval_required[0]"),
    ("approval entry tool non-empty", _set("approval_required", ["calc.x"]), _set("approval_required", ["calc."]),
     "approval_required[0]"),
    ("approval entry server declared", _set("approval_required", ["calc.x", "local.y"]),
     _set("approval_required", ["calc.x", "nosuch.y"]), "approval_required[1]"),
    ("approval entry a string", _set("approval_required", []), _set("approval_required", [7]),
     "approval_required[0]"),
    ("approval_required a list", _set("approval_required", ["calc.get-sum"]),
     _set("approval_required", "calc.get-sum"), "approval_required"),
]


@pytest.mark.parametrize("inside", [i for _, i, _, _ in BOUNDS], ids=[n for n, *_ in BOUNDS])
def test_a_value_just_inside_a_bound_is_valid(inside: Callable[[dict[str, Any]], None]) -> None:
    data = example()
    inside(data)

    spec = RunSpec.parse(data)

    assert spec.raw == json.loads(json.dumps(data))


@pytest.mark.parametrize(("outside", "field"), [(o, f) for _, _, o, f in BOUNDS], ids=[n for n, *_ in BOUNDS])
def test_a_value_just_outside_a_bound_is_refused_naming_the_field(
    outside: Callable[[dict[str, Any]], None], field: str
) -> None:
    data = example()
    outside(data)

    error = refused(data)

    assert fields(error) == [field], error
    assert error.field == field
    assert str(error).startswith(f"{field}: ")


REQUIRED = [
    ("input", _drop("input"), "input"),
    ("model", _drop("model"), "model"),
    ("turns", _drop("model.turns"), "model.turns"),
    ("tool call server", _drop("model.turns.0.tool_calls.0.server"), "model.turns[0].tool_calls[0].server"),
    ("tool call tool", _drop("model.turns.0.tool_calls.0.tool"), "model.turns[0].tool_calls[0].tool"),
    ("openai base_url", _openai(base_url=None), "model.base_url"),
    ("openai model", _openai(model=None), "model.model"),
]


@pytest.mark.parametrize(("mutate", "field"), [(m, f) for _, m, f in REQUIRED], ids=[n for n, *_ in REQUIRED])
def test_a_missing_required_field_is_refused_naming_it(mutate: Callable[[dict[str, Any]], None], field: str) -> None:
    data = example()
    mutate(data)

    error = refused(data)

    assert [(p.field, p.msg) for p in error.problems] == [(field, "Field required")]


def test_three_mistakes_are_reported_together_each_naming_its_field() -> None:
    data = example()
    data["max_rounds"] = "8"
    data["model"]["turns"][1]["content"] = 5
    data["mcp_servers"]["calc"]["url"] = "ftp://127.0.0.1/mcp"

    error = refused(data)

    assert sorted(fields(error)) == ["max_rounds", "mcp_servers.calc.url", "model.turns[1].content"]
    for problem in error.problems:
        assert f"{problem.field}: {problem.msg}" in str(error)
    assert "http:// or https://" in str(error)


def test_problems_carry_their_place_in_the_json_as_a_loc() -> None:
    data = example()
    data["model"]["turns"][0]["tool_calls"][0]["server"] = "nosuch"

    error = refused(data)

    assert [problem.loc for problem in error.problems] == [("model", "turns", 0, "tool_calls", 0, "server")]
    assert error.problem == "must name a server in mcp_servers"


UNKNOWN_KEYS = [
    ("top level", _set("colour", "blue"), "colour"),
    ("scripted model", _set("model.temperature", 0.2), "model.temperature"),
    ("openai model", _openai(organization="acme"), "model.organization"),
    ("turn", _set("model.turns.1.speed", 3), "model.turns[1].speed"),
    ("tool call", _set("model.turns.0.tool_calls.0.timeout", 3), "model.turns[0].tool_calls[0].timeout"),
    ("http server", _set("mcp_servers.calc.headers", {}), "mcp_servers.calc.headers"),
    ("stdio server", _set("mcp_servers.local.cwd", "/srv"), "mcp_servers.local.cwd"),
    ("server name as a field", _set("mcp_servers.calc.name", "calc"), "mcp_servers.calc.name"),
]


@pytest.mark.parametrize(("mutate", "field"), [(m, f) for _, m, f in UNKNOWN_KEYS], ids=[n for n, *_ in UNKNOWN_KEYS])
def test_an_unknown_key_is_refused_at_every_level(mutate: Callable[[dict[str, Any]], None], field: str) -> None:
    data = example()
    mutate(data)

    error = refused(data)

    assert fields(error) == [field]
    assert error.problem.startswith("unknown field")


def test_unknown_keys_at_every_level_are_all_reported_at_once() -> None:
    data = example()
    for name, mutate, _ in UNKNOWN_KEYS:
        if name != "openai model":  # it replaces the scripted model, whose unknown key is in the list too
            mutate(data)

    error = refused(data)

    assert sorted(fields(error)) == sorted(f for n, _, f in UNKNOWN_KEYS if n != "openai model")


@pytest.mark.parametrize("data", [None, [], "spec", 5, {1: "x"}])
def test_a_spec_that_is_not_an_object_is_refused_as_spec(data: object) -> None:
    error = refused(data)

    assert fields(error) == ["spec"]
    assert error.problem == "must be a JSON object"


@pytest.mark.parametrize("data", [{"input": {1, 2}}, {"input": object()}], ids=["set", "object"])
def test_a_dict_that_is_not_json_shaped_is_refused_as_spec(data: object) -> None:
    error = refused(data)

    assert fields(error) == ["spec"]
    assert "JSON" in error.problem


def test_a_deeply_nested_dict_is_refused_as_spec_not_with_a_recursion_error() -> None:
    nested: list[Any] = []
    for _ in range(100_000):
        nested = [nested]

    error = refused({"input": "x", "model": {"provider": "scripted", "turns": [{"content": "x"}]}, "deep": nested})

    assert error.field == "spec"


@pytest.mark.parametrize("text", ["{", "", "{'input': 'single quotes'}", '{"input": "x",}', '{"input": "x"} 5'])
def test_invalid_json_is_refused_as_spec(text: str) -> None:
    with pytest.raises(SpecError) as raised:
        RunSpec.from_json(text)

    assert fields(raised.value) == ["spec"]
    assert raised.value.problem.startswith("not valid JSON")


@pytest.mark.parametrize("text", ["[1, 2]", "5", "null", '"spec"', "true"])
def test_valid_json_that_is_not_an_object_is_refused_as_spec(text: str) -> None:
    with pytest.raises(SpecError) as raised:
        RunSpec.from_json(text)

    assert fields(raised.value) == ["spec"]
    assert raised.value.problem == "must be a JSON object"


def test_a_spec_in_utf8_bytes_is_valid() -> None:
    data = example()
    data["input"] = "Was ist 2 + 3? – Grüße"

    spec = RunSpec.from_json(json.dumps(data, ensure_ascii=False).encode("utf-8"))

    assert spec.input == "Was ist 2 + 3? – Grüße"
    assert spec == RunSpec.parse(data)


@pytest.mark.parametrize(("data", "offset"), [
    (b'{"input": "caf\xe9"}', 14),  # Latin-1, not UTF-8
    (b"\xff\xfe{}", 0),
    (b'{"input": "x\xc3"}', 12),  # a sequence cut short
], ids=["latin-1", "utf-16-bom", "truncated"])
def test_bytes_that_are_not_utf8_are_refused_naming_the_byte(data: bytes, offset: int) -> None:
    with pytest.raises(SpecError) as raised:
        RunSpec.from_json(data)

    assert fields(raised.value) == ["spec"]
    assert "not valid UTF-8" in raised.value.problem
    assert f"byte {offset}" in raised.value.problem


@pytest.mark.parametrize("data", ["[" * 100_000, b"[" * 100_000, '{"a":' * 100_000], ids=["str", "bytes", "objects"])
def test_deep_nesting_is_refused_as_spec_not_with_a_recursion_error(data: str | bytes) -> None:
    with pytest.raises(SpecError) as raised:
        RunSpec.from_json(data)

    assert fields(raised.value) == ["spec"]


@pytest.mark.parametrize("escape", ["\\ud800", "\\udc00", "\\ud800\\u0041"])
def test_a_lone_surrogate_is_refused_as_spec(escape: str) -> None:
    text = '{"input": "x' + escape + '", "model": {"provider": "scripted", "turns": [{"content": "x"}]}}'

    with pytest.raises(SpecError) as raised:
        RunSpec.from_json(text)

    assert fields(raised.value) == ["spec"]


def test_a_lone_surrogate_in_a_dict_is_refused_as_spec() -> None:
    with pytest.raises(SpecError) as raised:
        RunSpec.parse({"input": "x\ud800", "model": {"provider": "scripted", "turns": [{"content": "x"}]}})

    assert fields(raised.value) == ["spec"]


@pytest.mark.parametrize("name", ["calc\n", "calc\r\n"])
def test_a_server_name_with_a_line_break_is_refused(name: str) -> None:
    """Server names become tool names shown to a model (``<server>__<tool>``); a line break must not slip in."""
    data = example()
    data["mcp_servers"][name] = data["mcp_servers"].pop("calc")
    data["model"]["turns"][0]["tool_calls"][0]["server"] = name
    data["approval_required"] = []

    error = refused(data)

    # Written as a JSON string, so that the message stays on one line.
    assert fields(error) == [f"mcp_servers[{json.dumps(name)}]"]
    assert "\n" not in str(error)


def test_a_transport_that_contradicts_the_keys_is_refused_naming_them() -> None:
    data = example()
    data["mcp_servers"]["local"] = {"transport": "http", "command": "python"}

    error = refused(data)

    assert [(p.field, p.msg) for p in error.problems] == [
        ("mcp_servers.local.url", "Field required"), ("mcp_servers.local.command", "unknown field")]


def test_a_server_spec_built_in_python_takes_its_name_as_a_field() -> None:
    http = HttpServerSpec(name="calc", url="http://127.0.0.1:3001/mcp")
    stdio = StdioServerSpec(name="local", command="python", args=("-m", "x"))

    assert (http.name, http.transport) == ("calc", "http")
    assert (stdio.name, stdio.transport, stdio.env) == ("local", "stdio", {})
    assert http.model_dump(mode="json", include={"transport", "url"}) == {
        "transport": "http", "url": "http://127.0.0.1:3001/mcp"}


# -- SpecError ----------------------------------------------------------------------------------


def test_a_spec_error_with_one_field_keeps_its_field_and_problem() -> None:
    error = SpecError("mcp_servers.calc", "needs a url")

    assert (error.field, error.problem) == ("mcp_servers.calc", "needs a url")
    assert str(error) == "mcp_servers.calc: needs a url"
    assert [(p.field, p.msg) for p in error.problems] == [("mcp_servers.calc", "needs a url")]


def test_a_spec_error_from_problems_names_each_and_lists_them_all() -> None:
    error = SpecError.from_problems([
        FieldProblem(loc=("model", "turns", 0, "content"), msg="must be a string"),
        FieldProblem(loc=("mcp_servers", "a.b"), msg="bad name"),
        FieldProblem(loc=(), msg="must be a JSON object"),
    ])

    assert fields(error) == ["model.turns[0].content", 'mcp_servers["a.b"]', "spec"]
    assert (error.field, error.problem) == ("model.turns[0].content", "must be a string")
    assert str(error) == ('model.turns[0].content: must be a string; mcp_servers["a.b"]: bad name; '
                          "spec: must be a JSON object")


def test_a_spec_error_needs_a_problem() -> None:
    with pytest.raises(ValueError, match="at least one problem"):
        SpecError.from_problems([])


# -- the JSON Schema ----------------------------------------------------------------------------

SCHEMA_FILE = Path(__file__).resolve().parent.parent / "docs" / "run-spec.schema.json"


def test_the_schema_file_is_the_schema_of_the_model() -> None:
    assert json.loads(SCHEMA_FILE.read_text(encoding="utf-8")) == run_spec_json_schema(), (
        "docs/run-spec.schema.json is out of date; regenerate it: runbrake schema > docs/run-spec.schema.json"
    )


def test_the_schema_is_a_draft_2020_12_schema_with_a_description_for_every_field() -> None:
    schema = run_spec_json_schema()

    Draft202012Validator.check_schema(schema)
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert schema["$id"]
    assert schema["title"]
    objects = [schema, *schema["$defs"].values()]
    described = {name: "description" in field for obj in objects for name, field in obj["properties"].items()}
    assert described
    assert all(described.values()), described
    assert "name" not in schema["$defs"]["HttpServerSpec"]["properties"]  # the key, not a field


SCHEMA_CASES: list[tuple[str, Callable[[dict[str, Any]], None], bool]] = [
    ("the README example", _set("input", "What is 2 + 3?"), True),
    ("explicit transports", _set("mcp_servers", {"calc": {"transport": "http", "url": "http://x"},
                                                 "local": {"transport": "stdio", "command": "x"}}), True),
    ("an openai model", _openai(api_key_env="KEY"), True),
    ("a turn that fails", _set("model.turns.1", {"fail": "boom", "delay_ms": 5}), True),
    ("missing input", _drop("input"), False),
    ("blank input", _set("input", "  "), False),
    ("max_rounds 0", _set("max_rounds", 0), False),
    ("max_rounds a string", _set("max_rounds", "8"), False),
    ("max_rounds a boolean", _set("max_rounds", True), False),
    ("tool_timeout_s 0", _set("tool_timeout_s", 0), False),
    ("unknown top-level key", _set("colour", "blue"), False),
    ("unknown turn key", _set("model.turns.1.speed", 3), False),
    ("empty turn", _set("model.turns.1", {}), False),
    ("no turns", _set("model.turns", []), False),
    ("unknown provider", _set("model.provider", "gemini"), False),
    ("missing provider", _drop("model.provider"), False),
    ("server with url and command", _set("mcp_servers.calc.command", "x"), False),
    ("server with neither", _set("mcp_servers.calc", {}), False),
    ("server transport contradicting its keys", _set("mcp_servers.calc.transport", "stdio"), False),
    ("args on an http server", _set("mcp_servers.calc.args", []), False),
    ("server url not http", _set("mcp_servers.calc.url", "ftp://x"), False),
    ("server name with __", _server("a__b"), False),
    ("server name with a line break", _server("calc\n"), False),
    ("server name as a field", _set("mcp_servers.calc.name", "calc"), False),
    ("approval entry without a tool", _set("approval_required", ["calc"]), False),
    ("empty idempotency key", _set("idempotency_key", ""), False),
]


@pytest.mark.parametrize(("mutate", "valid"), [(m, v) for _, m, v in SCHEMA_CASES], ids=[n for n, *_ in SCHEMA_CASES])
def test_the_schema_agrees_with_the_model(mutate: Callable[[dict[str, Any]], None], valid: bool) -> None:
    """Except for references between parts (a tool call's server), which JSON Schema cannot state."""
    data = example()
    mutate(data)

    schema_errors = list(Draft202012Validator(run_spec_json_schema()).iter_errors(data))
    try:
        RunSpec.parse(data)
    except SpecError:
        parsed = False
    else:
        parsed = True

    assert (not schema_errors, parsed) == (valid, valid), schema_errors


# -- the spec through the CLI -------------------------------------------------------------------

_RUNBRAKE = [str(Path(sys.executable).parent / "runbrake")]
_ERROR_LINE = "runbrake: error: invalid spec: "


def enqueue_stdin(data: bytes) -> subprocess.CompletedProcess[str]:
    """``runbrake enqueue -`` with ``data`` on stdin, in this test's environment."""
    result = subprocess.run([*_RUNBRAKE, "enqueue", "-"], input=data, capture_output=True, timeout=30, check=False)
    return subprocess.CompletedProcess(result.args, result.returncode, result.stdout.decode(errors="replace"),
                                       result.stderr.decode(errors="replace"))


def three_mistakes() -> bytes:
    data = example()
    data["max_rounds"] = "8"
    data["model"]["turns"][1]["content"] = 5
    data["mcp_servers"]["calc"]["url"] = "ftp://127.0.0.1/mcp"
    return json.dumps(data).encode()


BAD_SPEC_BYTES = [
    ("invalid-utf8", b'{"input": "caf\xe9"}', ["spec: not valid UTF-8 (byte 14"]),
    ("deep-nesting", b"[" * 100_000, ["spec: not valid JSON"]),
    ("not-an-object", b"[1, 2]", ["spec: must be a JSON object"]),
    ("null", b"null", ["spec: must be a JSON object"]),
    ("lone-surrogate", b'{"input": "\\ud800"}', ["spec: not valid JSON"]),
    ("three-mistakes", three_mistakes(), ["model.turns[1].content: ", "mcp_servers.calc.url: ", "max_rounds: "]),
]


@pytest.mark.integration
@pytest.mark.parametrize("source", ["file", "stdin"])
@pytest.mark.parametrize(("data", "lines"), [(d, e) for _, d, e in BAD_SPEC_BYTES], ids=[n for n, *_ in BAD_SPEC_BYTES])
def test_a_bad_spec_on_the_command_line_exits_2_with_a_line_per_problem_and_writes_nothing(
    data: bytes, lines: list[str], source: str, store: RunStore, rabbitmq: Settings, tmp_path: Path
) -> None:
    if source == "file":
        spec_file = tmp_path / "spec.json"
        spec_file.write_bytes(data)
        result = runbrake("enqueue", str(spec_file))
    else:
        result = enqueue_stdin(data)

    assert_clean_failure(result, 2)
    assert result.stdout == ""
    printed = result.stderr.splitlines()
    assert len(printed) == len(lines), result.stderr
    for line, expected in zip(printed, lines, strict=True):
        assert line.startswith(_ERROR_LINE + expected), (line, expected)
    assert namespace_keys(store) == []
    assert not queued_messages(rabbitmq)


@pytest.mark.integration
def test_a_spec_on_stdin_is_enqueued(store: RunStore, rabbitmq: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RUNBRAKE_ALLOW_INLINE", "true")  # the example defines its servers inline
    data = example()
    data["input"] = "Grüße – 2 + 3?"

    result = enqueue_stdin(json.dumps(data, ensure_ascii=False).encode("utf-8"))

    assert result.returncode == 0, result.stderr
    record = store.get(result.stdout.strip())
    assert record.request == data
    assert queued_messages(rabbitmq) == 1


def test_runbrake_schema_prints_the_json_schema() -> None:
    result = runbrake("schema")

    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == run_spec_json_schema()
    assert result.stdout.startswith('{\n  "$schema"')  # indented


@pytest.mark.parametrize(("variable", "value"), [("RUNBRAKE_MCP_PROGRESS", "sometimes"),
                                                 ("RUNBRAKE_EVENT_LOOP", "trio"),
                                                 ("RUNBRAKE_SWITCH_INTERVAL_MS", "0")])
def test_the_worker_loop_settings_refuse_what_they_do_not_know_naming_the_variable(variable: str, value: str) -> None:
    with pytest.raises(ConfigError) as raised:
        Settings.from_env({variable: value})

    assert raised.value.variable == variable
