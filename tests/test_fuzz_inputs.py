"""Property-based tests of every input a caller or an operator controls: each gives its value or its own
clear error, never another exception (docs/security.md, "Tested attacks").

``make test`` runs a bounded, derandomised number of examples (the ``ci`` profile in tests/conftest.py:
the same examples every run, so a failure is never a flake); ``make fuzz`` runs many more, at random.
"""

from __future__ import annotations

import json
import os
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runbrake.broker.auth import Tokens, TokensFileError
from runbrake.shared.catalog import Admission, Catalog
from runbrake.shared.errors import ConfigError, SpecError
from runbrake.shared.messaging.wire import (
    RUN_ACTOR,
    MalformedCancelRequest,
    MalformedRunMessage,
    check_run_message,
    decode_cancel,
    decode_cancel_request,
)
from runbrake.shared.schema_check import SCHEMA_CHECKS
from runbrake.shared.settings import Settings
from runbrake.shared.spec import RunSpec

FUZZING = os.environ.get("HYPOTHESIS_PROFILE", "ci") == "fuzz"
"""``make fuzz``: the tests that drive real servers take many more examples too."""


def examples(ci: int, fuzz: int) -> int:
    """Examples for a test that drives real servers: ``ci`` in ``make test``, ``fuzz`` in ``make fuzz``."""
    return fuzz if FUZZING else ci


# -- strategies ------------------------------------------------------------------------------------

_SCALARS = (st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
            | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=40))
JSON = st.recursive(_SCALARS, lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.text(max_size=12), inner, max_size=4), max_leaves=20)
"""Any JSON value (finite numbers: the parsers are fed NaN separately, as text)."""

_SPEC_KEYS = ("input", "model", "mcp_servers", "max_rounds", "approval_required", "idempotency_key",
              "tool_timeout_s", "max_steps", "instructions", "messages", "model_settings", "output_schema",
              "labels", "provider", "turns", "tool_calls", "server", "tool", "arguments", "url", "command",
              "base_url", "content", "fail", "delay_ms", "role", "tool_call_id")
_KEYS = st.sampled_from(_SPEC_KEYS) | st.text(max_size=10)
SHAPED = st.recursive(_SCALARS, lambda inner: st.lists(inner, max_size=3)
                      | st.dictionaries(_KEYS, inner, max_size=6), max_leaves=30)
"""JSON whose keys are mostly the spec's own names, so the values reach the field validators."""

_GOOD_SPEC: dict[str, Any] = {
    "input": "What is 2 + 3?",
    "model": {"provider": "scripted", "turns": [
        {"tool_calls": [{"server": "calc", "tool": "add", "arguments": {"a": 2, "b": 3}}]},
        {"content": "5"}]},
    "mcp_servers": ["calc"],
}


def _replace_at(document: Any, path: list[int], value: Any) -> Any:
    """``document`` with the node picked by ``path`` (indices into each level's members) set to ``value``."""
    if not path or not isinstance(document, dict | list) or not document:
        return value
    keys = list(document) if isinstance(document, dict) else list(range(len(document)))
    key = keys[path[0] % len(keys)]
    copy: Any = dict(document) if isinstance(document, dict) else list(document)
    copy[key] = _replace_at(document[key], path[1:], value)
    return copy


MUTATED_SPECS = st.builds(_replace_at, st.just(_GOOD_SPEC), st.lists(st.integers(0, 10), max_size=5), SHAPED)
"""A valid spec with one node anywhere in it replaced by something else."""


def _value_or(expected: type[Exception], call: Callable[..., Any], *args: Any) -> Any:
    """What ``call(*args)`` returns, or the ``expected`` error it raised (any other error fails the test)."""
    try:
        return call(*args)
    except expected as exc:
        return exc


def _spec_or_its_error(parse: Callable[[Any], RunSpec], value: Any) -> None:
    outcome = _value_or(SpecError, parse, value)
    if isinstance(outcome, SpecError):
        assert outcome.problems, "a SpecError names at least one field"
        assert all(problem.field and problem.msg for problem in outcome.problems), outcome.problems
    else:
        assert isinstance(outcome, RunSpec)
        json.loads(outcome.to_json())  # what is stored with the run is JSON every reader takes


# -- the run spec ----------------------------------------------------------------------------------


@given(st.binary(max_size=300))
def test_any_bytes_are_a_spec_or_a_spec_error(data: bytes) -> None:
    _spec_or_its_error(RunSpec.from_json, data)


@given(JSON)
def test_any_json_value_is_a_spec_or_a_spec_error(value: Any) -> None:
    _spec_or_its_error(RunSpec.parse, value)


@given(SHAPED)
def test_spec_shaped_json_is_a_spec_or_a_spec_error(value: Any) -> None:
    _spec_or_its_error(RunSpec.parse, value)


@given(MUTATED_SPECS)
def test_a_good_spec_changed_anywhere_is_a_spec_or_a_spec_error(value: Any) -> None:
    _spec_or_its_error(RunSpec.parse, value)


@given(st.text(alphabet='{}[]:,"0123456789.eE+-truefalsnNIiy \\u', max_size=80))
def test_json_like_text_with_nan_and_escapes_is_a_spec_or_a_spec_error(text: str) -> None:
    _spec_or_its_error(RunSpec.from_json, text)


@given(MUTATED_SPECS)
def test_admission_of_any_parsed_spec_admits_it_or_names_what_it_refuses(value: Any) -> None:
    try:
        spec = RunSpec.parse(value)
    except SpecError:
        return
    outcome = _value_or(SpecError, Admission.from_settings(Settings(), Catalog.empty()).admit, spec)
    if isinstance(outcome, SpecError):
        assert all(problem.field for problem in outcome.problems)


# -- pathological schemas and answers (issue 27) ------------------------------------------------------

_BACKTRACKING = st.sampled_from(("^(a+)+$", "^(a|aa)+$", "^(a*)*b$", "(x+x+)+y", "^(\\w+\\s?)*$", "^([a-z]+)*[0-9]$"))
_LETTERS = st.sampled_from(("a", "x", "ab", "w "))
PATHOLOGICAL_SCHEMAS = st.one_of(
    _BACKTRACKING.map(lambda pattern: {"type": "string", "pattern": pattern}),
    _BACKTRACKING.map(lambda pattern: {"type": "object", "patternProperties": {pattern: {}}}),
    _BACKTRACKING.map(lambda pattern: {"type": "string", "format": "regex", "pattern": pattern}),
    st.just({"type": "array", "uniqueItems": True}),
    st.integers(1, 12_000).map(lambda n: {"allOf": [{}] * n}),
    st.integers(1, 300).map(lambda depth: _nested({"$ref": "#"}, depth)),
    st.just({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}),
    st.builds(lambda n, schema: {"anyOf": [schema] * n}, st.integers(1, 2_000), st.sampled_from(({}, {"not": {}}))),
)
"""Schemas that are costly to check, or to validate an answer against (issue 27): backtracking patterns, a
uniqueItems, thousands of subschemas, references in a loop, nesting past the parser's depth."""
PATHOLOGICAL_ANSWERS = st.one_of(
    st.builds(lambda text, n, end: json.dumps(text * n + end), _LETTERS, st.integers(0, 60), st.sampled_from("!1 ")),
    st.integers(0, 6_000).map(lambda n: json.dumps([{"k": i} for i in range(n)])),
    st.integers(0, 6_000).map(lambda n: json.dumps({"a" * 40 + str(i): i for i in range(n)})),
    st.integers(1, 1_500).map(lambda depth: "[" * depth + "]" * depth),
    JSON.map(json.dumps),
)
SCHEMA_CHECK_S = 0.5
"""The bound the property tests hold each check to: most examples are past it."""


def _nested(inner: dict[str, Any], depth: int) -> dict[str, Any]:
    schema = inner
    for _ in range(depth):
        schema = {"items": schema}
    return schema


@settings(max_examples=examples(ci=12, fuzz=600))
@given(PATHOLOGICAL_SCHEMAS, PATHOLOGICAL_ANSWERS)
def test_a_costly_schema_or_answer_gets_its_verdict_or_a_refusal_at_the_bound(schema: dict[str, Any],
                                                                              answer: str) -> None:
    """Checked in a child process (shared/schema_check.py): a verdict, or the bound's refusal, never a hang nor
    another exception; the pool checks again afterwards."""
    problem = SCHEMA_CHECKS.schema_problem(schema, within_s=SCHEMA_CHECK_S)
    assert problem is None or problem.startswith(("is not a valid JSON Schema", "could not be checked as a JSON "
                                                                                  "Schema within 0.5 s")), problem
    verdict = SCHEMA_CHECKS.answer_problem(schema, answer, within_s=SCHEMA_CHECK_S)
    assert verdict is None or (verdict and len(verdict) <= 501), verdict
    assert SCHEMA_CHECKS.answer_problem({"type": "integer"}, "5", within_s=30) is None


@settings(max_examples=examples(ci=6, fuzz=300))
@given(PATHOLOGICAL_SCHEMAS)
def test_a_spec_with_a_costly_schema_is_admitted_or_refused_naming_output_schema(schema: dict[str, Any]) -> None:
    admission = Admission(Catalog.empty(), schema_check_s=SCHEMA_CHECK_S)
    given = {"input": "x", "model": {"provider": "scripted", "turns": [{"content": "{}"}]}, "output_schema": schema}
    outcome = _value_or(SpecError, lambda: admission.admit(RunSpec.parse(given)))
    if isinstance(outcome, SpecError):
        assert {problem.field for problem in outcome.problems} <= {"output_schema", "spec"}, outcome.problems


# -- messages on the queues ------------------------------------------------------------------------

_ENVELOPE_KEYS = st.sampled_from(("queue_name", "actor_name", "args", "kwargs", "options", "message_id",
                                  "message_timestamp", "eta", "resume", "retries", "max_retries")) | st.text(max_size=8)
ENVELOPES = st.dictionaries(_ENVELOPE_KEYS, SHAPED | st.sampled_from(("rb.runs", RUN_ACTOR, "a" * 32)), max_size=9)
_QUEUES = ("rb.runs", "rb.runs.DQ")


@given(st.binary(max_size=200) | ENVELOPES.map(lambda e: json.dumps(e).encode()), st.sampled_from(_QUEUES))
def test_any_run_message_is_accepted_or_refused_with_a_reason(body: bytes, queue: str) -> None:
    outcome = _value_or(MalformedRunMessage, lambda: check_run_message(body, queue=queue, actors={RUN_ACTOR, "noop"}))
    assert outcome is None or str(outcome)


_CANCEL_KEYS = st.sampled_from(("run_id", "reason", "requested_by")) | st.text(max_size=8)
CANCEL_BODIES = st.dictionaries(_CANCEL_KEYS, SHAPED | st.just("0" * 32), max_size=4)


@given(st.binary(max_size=200) | CANCEL_BODIES.map(lambda b: json.dumps(b).encode()))
def test_any_cancel_request_is_read_or_refused_with_a_reason(body: bytes) -> None:
    outcome = _value_or(MalformedCancelRequest, decode_cancel_request, body)
    assert str(outcome) if isinstance(outcome, MalformedCancelRequest) else len(outcome.run_id) == 32


@given(st.binary(max_size=200) | CANCEL_BODIES.map(lambda b: json.dumps(b).encode()))
def test_a_cancel_wake_up_never_raises(body: bytes) -> None:
    run_id = decode_cancel(body)
    assert run_id is None or isinstance(run_id, str)


# -- the operator's files ----------------------------------------------------------------------------

_TOML_LINES = st.sampled_from((
    "[mcp_servers.calc]", "[mcp_servers.\"a b\"]", "[models.default]", "[tokens.ops]", "[other]",
    'url = "http://127.0.0.1:1/mcp"', 'url = "file:///etc/passwd"', 'command = ["python", "-m", "x"]',
    'command = "python"', "tools = [\"add\"]", "tools = []", "max_concurrency = 0", "max_concurrency = 99999999999",
    "timeout_s = inf", "timeout_s = nan", "timeout_s = -1", "timeout_s = 1979-05-27", "url = 07:32:00",
    'provider = "openai"', 'provider = "scripted"', 'provider = "nope"', 'base_url = "http://x/v1"',
    'model = "m"', 'api_key_env = "KEY"', 'headers = { Authorization = "Bearer ${TOKEN}" }',
    'env = { A = "${B}" }', 'sha256 = "' + "a" * 64 + '"', 'roles = ["read"]', 'roles = ["root"]', "roles = 3",
    "x = { y = { z = 1 } }", "[[mcp_servers]]", "a.b.c = 1",
))
TOML_TEXTS = st.lists(_TOML_LINES | st.text(max_size=20), max_size=12).map("\n".join)


def _toml(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(TOML_TEXTS)
def test_any_catalog_file_is_a_catalog_or_a_config_error(tmp_path: Path, text: str) -> None:
    outcome = _value_or(ConfigError, Catalog.load, _toml(tmp_path / "catalog.toml", text))
    assert str(outcome) if isinstance(outcome, ConfigError) else json.dumps(outcome.describe(environ={}))


@given(st.dictionaries(st.sampled_from(("mcp_servers", "models")) | st.text(max_size=6),
                       st.dictionaries(st.text(max_size=6), SHAPED, max_size=3), max_size=3))
def test_any_catalog_mapping_is_a_catalog_or_a_config_error(data: dict[str, Any]) -> None:
    outcome = _value_or(ConfigError, Catalog.parse, data)
    assert isinstance(outcome, Catalog) or str(outcome)


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(TOML_TEXTS | st.binary(max_size=100).map(lambda b: b.decode("latin-1")))
def test_any_tokens_file_is_tokens_or_a_tokens_file_error(tmp_path: Path, text: str) -> None:
    outcome = _value_or(TokensFileError, Tokens.load, _toml(tmp_path / "tokens.toml", text))
    assert isinstance(outcome, Tokens) or str(outcome)


def test_the_toml_lines_include_what_toml_has_and_json_has_not() -> None:
    # The catalog strategy reaches dates, times and nan/inf, which found a TypeError in Catalog.parse.
    assert tomllib.loads("timeout_s = 1979-05-27\nx = nan")["timeout_s"].year == 1979
