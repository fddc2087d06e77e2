"""Attacks on what the store keeps (docs/security.md, "Tested attacks"): secrets copied into stored text,
unbounded model content, NaN in tool arguments, bidi controls in attribution, secrets in ``catalog check``.

Everything behind these tests is real: Redis, RabbitMQ, a worker process, ``runbrake serve``, the example
MCP server and the local OpenAI-compatible stub. The secret is the model's API key, held in the
environment of the worker and the API (as a deployment would), named by the catalog.
"""

from __future__ import annotations

import json
import math
import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx2
import pytest
import redis

from runbrake.shared import RunStatus, RunStep, RunStore, Settings, StepKind, TerminationReason, ToolOutcome
from runbrake.shared import _store_core as core
from runbrake.shared.errors import ConfigError
from runbrake.shared.messaging.producer import Producer
from runbrake.shared.operations import approve_run, deny_run
from runbrake.shared.redaction import REDACTED, remember, scrub, scrub_value, strip_bidi
from runbrake.shared.spec import RunSpec
from tests.api_helpers import ApiProcess
from tests.catalog_helpers import add_to_catalog, to_toml
from tests.mcp_helpers import Toolbox
from tests.openai_stub import OpenAIStub, StubToolCall
from tests.test_cli import runbrake, valid_spec
from tests.test_page import browser_fixture, open_page  # noqa: F401 - registers the `browser` fixture
from tests.worker_helpers import WorkerProcess, has_step, wait_for_run

pytestmark = pytest.mark.integration

KEY_VARIABLE = "RB_ATTACK_MODEL_KEY"
BIDI = "\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069\u200e\u200f\u061c"


def strict_json(text: str) -> Any:
    """``json.loads`` as a browser's JSON.parse reads: NaN and Infinity are errors."""
    def refuse(token: str) -> Any:
        raise ValueError(f"{token} is not JSON")

    return json.loads(text, parse_constant=refuse)


def every_stored_text(store: RunStore) -> dict[str, list[str]]:
    """Every value of every key of the store's namespace, read by type: strings, hash fields and values,
    list items, set members, sorted-set members, stream entries' fields and values."""
    client = store.redis
    found: dict[str, list[str]] = {}
    for key in client.scan_iter(match=f"{store.namespace}:*", count=500):
        kind = client.type(key)
        if kind == "string":
            values = [client.get(key) or ""]
        elif kind == "hash":
            values = [text for pair in client.hgetall(key).items() for text in pair]
        elif kind == "list":
            values = client.lrange(key, 0, -1)
        elif kind == "set":
            values = list(client.smembers(key))
        elif kind == "zset":
            values = [member for member, _ in client.zrange(key, 0, -1, withscores=True)]
        elif kind == "stream":  # the outbox: every event's fields
            values = [text for _, fields in client.xrange(key) for pair in fields.items() for text in pair]
        else:
            pytest.fail(f"{key} is a {kind}: read it here too")
        found[key] = [key, *values]
    return found


@pytest.fixture(name="events")
def events_fixture(store: RunStore) -> Iterator[Callable[[], list[str]]]:
    """Everything published on the namespace's events channel from now on (what every SSE client gets)."""
    subscriber = store.redis.pubsub(ignore_subscribe_messages=True)
    subscriber.subscribe(store.keys.events)
    received: list[str] = []

    def drain() -> list[str]:
        while (message := subscriber.get_message(timeout=0.01)) is not None:
            received.append(message["data"])
        return list(received)

    yield drain
    subscriber.close()


@pytest.fixture(name="secret")
def secret_fixture(monkeypatch: pytest.MonkeyPatch, namespace: str) -> str:
    """The model's API key: a fresh value in this test's environment (so in the worker's and the API's)."""
    value = f"sk-attack-{uuid.uuid4().hex}"
    monkeypatch.setenv(KEY_VARIABLE, value)
    return value


def _post(api: ApiProcess, path: str, body: Any, expect: int) -> dict[str, Any]:
    response = httpx2.post(f"{api.url}{path}", json=body, timeout=15)
    assert response.status_code == expect, response.text
    result: dict[str, Any] = response.json()
    return result


# -- secrets: every path into Redis ----------------------------------------------------------------


def test_a_secret_a_model_and_a_server_copy_into_every_stored_field_is_in_no_key_of_the_namespace(
    secret: str, openai_stub: OpenAIStub, toolbox_http: Toolbox, start_worker: Callable[..., WorkerProcess],
    start_api: Callable[..., ApiProcess], store: RunStore, events: Callable[[], list[str]],
) -> None:
    add_to_catalog({"toolbox": toolbox_http.spec}, models={"stub": {
        "provider": "openai", "base_url": openai_stub.base_url, "model": "stub", "api_key_env": KEY_VARIABLE}})
    api = start_api()
    worker = start_worker()

    def enqueue(**extra: Any) -> str:
        spec = {"input": "attack", "model": "stub", "mcp_servers": ["toolbox"], **extra}
        return str(_post(api, "/v1/runs", spec, 201)["run_id"])

    # 1. A model reply copying the key, tool arguments carrying it, a tool result and a tool error echoing it.
    openai_stub.reply(content=f"the key is {secret}", tool_calls=[
        StubToolCall("toolbox__echo", {"text": f"echo {secret}"}),
        StubToolCall("toolbox__fail", {"message": f"failing with {secret}"})])
    openai_stub.reply(content=f"done, {secret}")
    copied = wait_for_run(store, enqueue())
    # 2. A provider error quoting it (the model step's error and the run's error).
    openai_stub.reply(status=401, error_message=f"invalid key {secret}")
    refused = wait_for_run(store, enqueue())
    # 3. A gated call carrying it: the pending turn and pending_call; approved (a decider's reason is theirs, kept as
    #    written: tests/test_attack_redaction.py).
    openai_stub.reply(content=f"asking with {secret}",
                      tool_calls=[StubToolCall("toolbox__echo", {"text": f"gated {secret}"})])
    gated_id = enqueue(approval_required=["toolbox.echo"])
    wait_for_run(store, gated_id, lambda r: r.status is RunStatus.WAITING_FOR_APPROVAL)
    pending_raw = store.redis.hget(store.run_key(gated_id), "pending") or ""
    pending_call = httpx2.get(f"{api.url}/v1/runs/{gated_id}").json()["pending_call"]
    openai_stub.reply(content="approved and done")
    _post(api, f"/v1/runs/{gated_id}/approve", {"reason": "fine"}, 200)
    gated = wait_for_run(store, gated_id)
    # 4. MCP progress quoting it as a bearer token, then a hand-over (the pending conversation), then a cancel.
    openai_stub.reply(content=f"working with {secret}", tool_calls=[
        StubToolCall("toolbox__slow", {"seconds": 60, "note": f"auth=Bearer {secret}"})])
    slow_id = enqueue()
    in_flight = wait_for_run(store, slow_id, lambda r: r.progress is not None, timeout=30)
    progress_raw = store.redis.hget(store.run_key(slow_id), "progress") or ""
    progress_served = httpx2.get(f"{api.url}/v1/runs/{slow_id}").json()["progress"]
    worker.stop()  # drains 2 s (tests/conftest.py), then hands the run over
    wait_for_run(store, slow_id, lambda r: r.status is RunStatus.QUEUED and has_step("handoff")(r))
    handoff_raw = store.redis.hget(store.run_key(slow_id), "pending") or ""
    _post(api, f"/v1/runs/{slow_id}/cancel", {"reason": "enough"}, 202)
    cancelled = wait_for_run(store, slow_id)

    stored = every_stored_text(store)
    published = events()

    # The key was live: the stub received it, so every process held it.
    assert openai_stub.headers[0]["authorization"] == f"Bearer {secret}"
    leaks = sorted(key for key, values in stored.items() if any(secret in value for value in values))
    assert leaks == []
    assert [message for message in published if secret in message] == []
    for message in published:
        strict_json(message)
    assert secret not in worker.log_path.read_text()
    assert secret not in api.log()

    # Each path was taken, and redaction is what kept the key out.
    model, echo, fail, final = copied.steps
    assert (copied.status, model.content, final.content) == (RunStatus.COMPLETED, f"the key is {REDACTED}",
                                                             f"done, {REDACTED}")
    assert [c["arguments"] for c in model.detail["tool_calls"]] == [
        {"text": f"echo {REDACTED}"}, {"message": f"failing with {REDACTED}"}]
    assert (echo.content, fail.tool_outcome, REDACTED in fail.content) == (f"echo {REDACTED}", "failed", True)
    assert refused.termination_reason is TerminationReason.PROVIDER_FAILED
    assert REDACTED in refused.error
    assert REDACTED in (refused.steps[0].error or "")
    assert REDACTED in pending_raw
    assert pending_call["arguments"] == {"text": f"gated {REDACTED}"}
    approval = next(s for s in gated.steps if s.kind is StepKind.APPROVAL)
    assert (approval.content, approval.detail["reason"]) == ("fine", "fine")
    assert approval.detail["call"]["arguments"] == {"text": f"gated {REDACTED}"}
    # The resumed call runs with the arguments as stored: the key never reaches the tool from the store.
    assert [s.content for s in gated.steps if s.kind is StepKind.TOOL] == [f"gated {REDACTED}"]
    assert f"Bearer {REDACTED}" in progress_raw
    assert f"Bearer {REDACTED}" in (progress_served or {}).get("message", "")
    assert in_flight.progress is not None
    assert REDACTED in handoff_raw
    assert cancelled.status is RunStatus.CANCELLED
    assert cancelled.cancel is not None
    assert cancelled.cancel.reason == "enough"


def test_stored_json_stays_json_where_scrubbing_its_text_would_have_broken_it(store: RunStore) -> None:
    secret = f"pw{uuid.uuid4().hex[:10]}"
    remember(secret)
    run_id = store.create(valid_spec()).run_id
    # A URL password pattern across two strings, a key that is a secret, a secret in a nested list.
    detail = {"a": "ftp://user:", "b": "x@host", secret: [f"in {secret}"], "quote": f'"{secret}"'}
    store.append_step(run_id, RunStep(kind=StepKind.MODEL, round=1, content="ok", detail=detail))

    raw = store.redis.lrange(store.steps_key(run_id), 0, -1)[0]
    step = strict_json(raw)

    assert secret not in raw
    assert step["detail"] == {"a": "ftp://user:", "b": "x@host", REDACTED: [f"in {REDACTED}"],
                              "quote": f'"{REDACTED}"'}


def test_redaction_cuts_bearer_tokens_url_passwords_and_remembered_values_from_every_string_of_a_value() -> None:
    secret = f"remembered-{uuid.uuid4().hex}"
    remember(secret)

    assert scrub("Authorization: Bearer abc.DEF-123_~+/=") == f"Authorization: Bearer {REDACTED}"
    assert scrub("auth=bearer zyxwvu9") == f"auth=bearer {REDACTED}"
    assert scrub("the bearer of bad news") == "the bearer of bad news"
    assert scrub("https://u:hunter2@host/x") == f"https://u:{REDACTED}@host/x"
    assert scrub_value({secret: [secret, 1, None, {"k": f"x{secret}y"}], "n": math.nan, "i": -math.inf}) == {
        REDACTED: [REDACTED, 1, None, {"k": f"x{REDACTED}y"}], "n": "NaN", "i": "-Infinity"}


def test_nothing_reaches_a_script_but_through_the_one_serialiser_and_plain_commands_cannot_write() -> None:
    secret = f"wire-{uuid.uuid4().hex}"
    remember(secret)

    assert core.wire(f"error: {secret}") == f"error: {REDACTED}"
    assert json.loads(core.wire({"pending": [secret]})) == {"pending": [REDACTED]}
    assert core.wire(core.Ident("host:42:abcd")) == "host:42:abcd"
    with pytest.raises(ValueError, match="finite"):
        core.wire(math.nan)
    with pytest.raises(TypeError):
        core.wire(True)
    with pytest.raises(ValueError, match="identifier"):
        core.Ident("has spaces")
    with pytest.raises(ValueError, match="reads or deletes"):
        core.Command(("HSET", "k", "f", secret))
    call = core.set_progress(core.Keys("ns"), {"a" * 32: {"message": f"token {secret}", "progress": math.inf}})
    assert all(secret not in arg for c in call.calls if isinstance(c, core.ScriptCall) for arg in c.args)
    assert strict_json(call.calls[0].args[0])["progress"] == "Infinity"  # type: ignore[union-attr]


# -- bounded model content --------------------------------------------------------------------------


def test_a_huge_model_reply_is_stored_cut_to_the_bound_and_its_step_says_so(
    openai_stub: OpenAIStub, toolbox_http: Toolbox, worker: WorkerProcess, producer: Producer, store: RunStore
) -> None:
    default = Settings().max_model_content_chars
    openai_stub.reply(content="x" * (default * 2 + 17))
    add_to_catalog({"toolbox": toolbox_http.spec}, models={"stub": {
        "provider": "openai", "base_url": openai_stub.base_url, "model": "stub"}})

    record = wait_for_run(store, producer.enqueue(RunSpec.parse(
        {"input": "talk", "model": "stub", "mcp_servers": ["toolbox"]})).run_id)

    [step] = record.steps
    assert record.status is RunStatus.COMPLETED
    assert len(step.content) == default
    assert "…[truncated " in step.content[-40:]
    assert step.detail["content_truncated"] == {"chars": default * 2 + 17, "kept": default}
    assert len(store.redis.lindex(store.steps_key(record.run_id), 0) or "") < default + 1000


def test_the_model_content_bound_is_a_setting_that_names_itself_when_wrong() -> None:
    assert Settings.from_env({"RUNBRAKE_MAX_MODEL_CONTENT_CHARS": "5000"}).max_model_content_chars == 5000
    assert Settings().max_model_content_chars == 100_000
    for bad in ("lots", "10"):
        with pytest.raises(ConfigError, match="RUNBRAKE_MAX_MODEL_CONTENT_CHARS"):
            Settings.from_env({"RUNBRAKE_MAX_MODEL_CONTENT_CHARS": bad})


# -- NaN and Infinity -------------------------------------------------------------------------------


def _nan_spec() -> str:
    return ('{"input": "x", "model": {"provider": "scripted", "turns": [{"tool_calls": [{"server": "toolbox", '
            '"tool": "echo", "arguments": {"text": "a", "n": NaN, "deep": [1, Infinity]}}]}, {"content": "y"}]}, '
            '"mcp_servers": ["toolbox"]}')


def test_a_spec_with_nan_or_infinity_in_tool_arguments_is_refused_naming_the_field_and_nothing_is_written(
    api: ApiProcess, store: RunStore, tmp_path: Path, toolbox_http: Toolbox
) -> None:
    add_to_catalog({"toolbox": toolbox_http.spec})
    path = tmp_path / "nan.json"
    path.write_text(_nan_spec())

    cli = runbrake("enqueue", str(path))
    response = httpx2.post(f"{api.url}/v1/runs", content=_nan_spec(), headers={"Content-Type": "application/json"})

    assert cli.returncode == 2, cli.stderr
    assert "model.turns[0].tool_calls[0].arguments.n" in cli.stderr
    assert "model.turns[0].tool_calls[0].arguments.deep[1]" in cli.stderr
    assert response.status_code == 422, response.text
    locations = [error["loc"] for error in response.json()["errors"]]
    assert ["model", "turns", 0, "tool_calls", 0, "arguments", "n"] in locations
    assert list(store.redis.scan_iter(match=f"{store.namespace}:run*")) == []


def test_nan_tool_arguments_from_a_model_are_an_invalid_call_and_every_stream_of_the_run_stays_json(
    openai_stub: OpenAIStub, toolbox_http: Toolbox, worker: WorkerProcess, api: ApiProcess, store: RunStore,
    events: Callable[[], list[str]],
) -> None:
    add_to_catalog({"toolbox": toolbox_http.spec}, models={"stub": {
        "provider": "openai", "base_url": openai_stub.base_url, "model": "stub"}})
    # The stub, not llm-mock-api: only it sends arguments verbatim, and NaN is not JSON.
    openai_stub.reply(tool_calls=[StubToolCall("toolbox__echo", '{"text": NaN}')])
    openai_stub.reply(content="no NaN then")
    run_id = _post(api, "/v1/runs", {"input": "x", "model": "stub", "mcp_servers": ["toolbox"]}, 201)["run_id"]
    record = wait_for_run(store, run_id)
    # A step written with a NaN by a library caller is stored as the string "NaN", never the token.
    store.append_step(run_id, RunStep(kind=StepKind.APPROVAL, round=1, content="n",
                                      detail={"score": math.nan, "cap": math.inf}))

    shown = strict_json(runbrake("show", run_id, "--json").stdout)
    with httpx2.stream("GET", f"{api.url}/v1/runs/{run_id}/events", timeout=15) as stream:
        data = [line[5:].strip() for line in stream.iter_lines() if line.startswith("data:")]

    assert (record.status, record.termination_reason) == (RunStatus.COMPLETED, TerminationReason.COMPLETED)
    handed_back = record.steps[1]
    assert (handed_back.tool_outcome, handed_back.detail.get("reason")) == (ToolOutcome.FAILED, "invalid_call")
    assert "are not JSON" in handed_back.content
    assert record.steps[0].detail["tool_calls"][0]["arguments"] == {}  # kept as text in the problem, never as JSON
    assert shown["steps"][-1]["detail"] == {"score": "NaN", "cap": "Infinity"}
    assert [strict_json(d) for d in data]
    for message in events():
        strict_json(message)
    for raw in store.redis.lrange(store.steps_key(run_id), 0, -1):
        strict_json(raw)


# -- bidi controls in attribution -------------------------------------------------------------------


def test_bidi_controls_in_a_cancel_reason_and_requester_and_in_approval_attribution_are_not_stored(
    store: RunStore, producer: Producer
) -> None:
    cancelled = store.create(valid_spec()).run_id
    approved = store.create(valid_spec()).run_id
    denied = store.create(valid_spec()).run_id
    for run_id in (approved, denied):
        assert store.claim(run_id, "w", lease_s=60).won
        assert store.suspend(run_id, "w", {"messages": [], "model_calls": 1, "pending_calls": [
            {"id": "c1", "server": "calc", "tool": "get-sum", "arguments": {}}]}).won

    assert store.cancel(cancelled, reason=f"too{BIDI} slow", requested_by="\u202eeve\u202c").won
    assert approve_run(store, producer, approved, decided_by="\u2067ops\u2069", reason="fine\u202e!").decided
    assert deny_run(store, denied, decided_by="\u200fops", reason="no\u202d way").decided

    cancel = store.get(cancelled).cancel
    assert cancel is not None
    assert (cancel.reason, cancel.requested_by) == ("too slow", "eve")
    approval = store.get(approved).steps[-1].detail
    assert (approval["decided_by"], approval["reason"]) == ("ops", "fine!")
    denial = store.get(denied)
    assert (denial.steps[-1].detail["decided_by"], denial.steps[-1].detail["reason"], denial.error) == (
        "ops", "no way", "no way")
    assert strip_bidi(f"a{BIDI}b") == "ab"


_LAYOUT = """
([selector, prefix]) => {
  // Where the words after the user text are drawn, against the user text itself.
  const cell = document.querySelector(selector);
  const isolate = cell.querySelector("bdi.user");
  const after = [...cell.childNodes].find((n) => n.nodeType === Node.TEXT_NODE && n.textContent.startsWith(prefix));
  const range = document.createRange();
  range.selectNodeContents(after);
  // The same words without the isolate: what the page showed before.
  const plain = document.createElement("div");
  plain.textContent = cell.textContent;
  document.body.append(plain);
  const plainRange = document.createRange();
  const text = plain.firstChild;
  const at = text.textContent.indexOf(prefix);
  plainRange.setStart(text, at); plainRange.setEnd(text, at + prefix.length);
  const userRange = document.createRange();
  const from = text.textContent.indexOf(isolate.textContent);
  userRange.setStart(text, from); userRange.setEnd(text, from + isolate.textContent.length);
  const result = {
    isolated: getComputedStyle(isolate).unicodeBidi,
    userRight: isolate.getBoundingClientRect().right, afterLeft: range.getBoundingClientRect().left,
    plainUserLeft: userRange.getBoundingClientRect().left, plainAfterLeft: plainRange.getBoundingClientRect().left,
  };
  plain.remove();
  return result;
}
"""


def test_the_page_isolates_outside_text_so_an_override_cannot_flip_the_attribution_after_it(
    browser: Any, api: ApiProcess, store: RunStore, settings: Settings
) -> None:
    run_id = store.create(valid_spec()).run_id
    assert store.claim(run_id, "w", lease_s=60).won
    calls = [{"id": "c1", "server": "calc", "tool": "get-sum", "arguments": {}}]
    # Model content is not attribution and keeps its characters; the page isolates it.
    store.append_step(run_id, RunStep(kind=StepKind.MODEL, round=1, content="\u202eevil reply",
                                      detail={"tool_calls": calls}))
    store.append_step(run_id, RunStep(kind=StepKind.APPROVAL, round=1, content="\u202eevil note",
                                      detail={"decision": "approved", "decided_by": "ops"}))
    _post(api, f"/v1/runs/{run_id}/cancel", {"reason": "\u202eevil reason"}, 202)
    # A record stored before bidi controls were stripped: the page must isolate it anyway.
    raw = redis.Redis.from_url(settings.redis_url, decode_responses=True)
    try:
        raw.set(store.cancel_key(run_id), json.dumps(
            {"reason": "\u202eold evil", "requested_by": "anonymous", "requested_at": 1.0}))
    finally:
        raw.close()
    page, errors = open_page(browser, f"{api.url}/#/runs/{run_id}", locale="en-US")
    from playwright.sync_api import expect

    # The cancel comes with the run's record, the steps with its event stream, a moment later: wait for both.
    expect(page.get_by_test_id("run-cancel")).to_contain_text("(by anonymous)")
    expect(page.locator("[data-testid=step-row][data-kind=model]")).to_contain_text("(calls calc.get-sum)")
    expect(page.locator("[data-testid=step-row][data-kind=approval]")).to_contain_text("evil note (by ops)")
    cancel = page.evaluate(_LAYOUT, ["[data-testid=run-cancel]", " (by "])
    model = page.evaluate(_LAYOUT, ["[data-testid=step-row][data-kind=model] td.detail", " (calls "])
    approval = page.evaluate(_LAYOUT, ["[data-testid=step-row][data-kind=approval] td.detail", " (by "])

    for layout in (cancel, model, approval):
        assert layout["isolated"] == "isolate"
        # Isolated: "(by …)" follows the reason, left to right.
        assert layout["afterLeft"] >= layout["userRight"] - 1
        # Without the isolate the override flips it: the words after are drawn before the text.
        assert layout["plainAfterLeft"] < layout["plainUserLeft"]
    assert errors == []


# -- catalog check ----------------------------------------------------------------------------------


def test_catalog_check_shows_secrets_written_into_the_file_as_stars_unless_asked(tmp_path: Path) -> None:
    path = tmp_path / "catalog.toml"
    path.write_text(to_toml({
        "mcp_servers": {
            "tools": {"url": "https://svc:url-pass-1@tools.internal/mcp",
                      "headers": {"X-Api-Key": "literal-key-2", "Authorization": "Bearer ${TK}"}},
            "local": {"command": "tool", "args": [], "env": {"API_TOKEN": "literal-token-3", "TZ": "Europe/Berlin"}},
        },
        "models": {"m": {"provider": "openai", "base_url": "https://u:model-pass-4@api.example/v1", "model": "m"}},
    }))
    literals = ("url-pass-1", "literal-key-2", "literal-token-3", "model-pass-4")

    text = runbrake("catalog", "check", str(path), env={"TK": "from-env-5"})
    as_json = runbrake("catalog", "check", str(path), "--json", env={"TK": "from-env-5"})
    shown = runbrake("catalog", "check", str(path), "--json", "--show-secrets", env={"TK": "from-env-5"})
    helped = runbrake("catalog", "check", "--help")

    for result in (text, as_json):
        assert result.returncode == 0, result.stderr
        assert [s for s in (*literals, "from-env-5") if s in result.stdout] == []
    described = json.loads(as_json.stdout)
    tools = described["mcp_servers"]["tools"]
    assert tools["url"] == "https://svc:***@tools.internal/mcp"
    assert tools["headers"]["X-Api-Key"]["template"] == "***"
    assert tools["headers"]["Authorization"] == {"template": "Bearer ${TK}", "variables": {"TK": True}}
    assert described["mcp_servers"]["local"]["env"]["API_TOKEN"]["template"] == "***"
    assert described["mcp_servers"]["local"]["env"]["TZ"]["template"] == "Europe/Berlin"
    assert described["models"]["m"]["base_url"] == "https://u:***@api.example/v1"
    assert "https://svc:***@tools.internal/mcp" in text.stdout
    assert "X-Api-Key: ***" in text.stdout
    assert shown.returncode == 0
    assert all(literal in shown.stdout for literal in literals)
    assert "from-env-5" not in shown.stdout
    assert "--show-secrets" in helped.stdout


def test_a_process_that_loads_the_catalog_redacts_the_values_of_the_variables_it_names(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from runbrake.shared.catalog import Catalog

    value = f"catalog-var-{uuid.uuid4().hex}"
    monkeypatch.setenv("RB_ATTACK_TOOLS_TOKEN", value)
    path = tmp_path / "catalog.toml"
    path.write_text(to_toml({"mcp_servers": {"tools": {
        "url": "https://tools.internal/mcp", "headers": {"Authorization": "Token ${RB_ATTACK_TOOLS_TOKEN}"}}}}))

    assert scrub(f"x {value} y") == f"x {value} y"
    Catalog.load(path)

    assert scrub(f"x {value} y") == f"x {REDACTED} y"
    assert os.environ["RB_ATTACK_TOOLS_TOKEN"] == value
