"""Redaction under attack (docs/security.md, "What redaction promises"; issue 27, finding 3 and "redaction is an
oracle"): a secret the stream splits across ``delta`` events is never rebuilt by joining them, a tool that echoes
the worker's MCP header token never gets it to the model endpoint, and a submitter's guess of a secret comes back
the same whether it is right or not.

Everything is real: Redis, RabbitMQ, a worker, ``runbrake serve`` and its event stream, llm-mock-api
(tests/llm_mock.py) as the model endpoint, and the toolbox MCP server over HTTP with ``--echo-headers`` (a tool
answering with the headers of its request, the worker's credentials among them).
"""

from __future__ import annotations

import json
import os
import secrets
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx2
import pytest
from llm_mock_api.types.reply import ReplyOptions
from llm_mock_api.types.request import MockRequest

from runbrake.shared import RunStatus, RunStore, StepKind
from runbrake.shared.redaction import REDACTED
from tests.api_helpers import ApiProcess
from tests.catalog_helpers import add_to_catalog
from tests.llm_mock import LlmMock, reply
from tests.mcp_helpers import Toolbox, http_toolbox
from tests.test_streaming import _read_events
from tests.worker_helpers import WorkerProcess, wait_for_run

pytestmark = pytest.mark.integration

WAIT_S = 60.0
KEY_VARIABLE = "RB_REDACTION_MODEL_KEY"
TOKEN_VARIABLE = "RB_REDACTION_TOOLS_TOKEN"
HEADER_VARIABLE = "RB_REDACTION_TOOLS_KEY"


def _post_run(api: ApiProcess, spec: dict[str, Any]) -> str:
    response = httpx2.post(f"{api.url}/v1/runs", json=spec, timeout=30)
    assert response.status_code == 201, response.text
    run_id: str = response.json()["run_id"]
    return run_id


# -- deltas --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["openai", "anthropic"])
def test_a_secret_the_stream_splits_across_deltas_is_never_rebuilt_by_joining_them(
    llm_mock: LlmMock, start_worker: Callable[..., WorkerProcess], api: ApiProcess, store: RunStore, kind: str
) -> None:
    key, bearer = f"sk-split-{uuid.uuid4().hex}", secrets.token_hex(12)
    answer = f"Here it is: {key} and again Bearer {bearer} then the end of it all."
    # Two characters every 30 ms: the key alone takes over half a second, so some five deltas a second cut it.
    llm_mock.server.when("the key").reply(reply(answer), ReplyOptions(latency=30, chunk_size=2))
    base = ({"provider": "openai", "base_url": llm_mock.openai_url, "model": "gpt-mock"} if kind == "openai" else
            {"provider": "anthropic", "base_url": llm_mock.anthropic_url, "model": "claude-mock"})
    add_to_catalog(models={"streamed": {**base, "api_key_env": KEY_VARIABLE}})
    start_worker(**{KEY_VARIABLE: key})

    run_id = _post_run(api, {"input": "Say the key.", "model": "streamed"})
    events = _read_events(api, run_id)
    record = wait_for_run(store, run_id, timeout=WAIT_S)

    # The key was live: the endpoint received it, so the worker had it to redact.
    sent = llm_mock.requests()[0].headers
    assert key in (sent.get("authorization", "") + sent.get("x-api-key", ""))
    assert record.status is RunStatus.COMPLETED
    [step] = record.steps
    assert step.content == f"Here it is: {REDACTED} and again Bearer {REDACTED} then the end of it all."
    deltas = [data["text"] for event, data in events if event == "delta"]
    assert len(deltas) >= 2
    joined = "".join(deltas)
    assert key not in joined
    assert all(key[:size] not in joined for size in range(len("sk-split-") + 1, len(key)))  # nor a start of it
    assert bearer[:4] not in joined
    assert step.content.startswith(joined)  # what was announced is the scrubbed answer, in order


# -- tool results and the oracle --------------------------------------------------------------------------


@pytest.fixture(name="leaky_toolbox")
def leaky_toolbox_fixture(namespace: str, tmp_path: Path) -> Iterator[tuple[Toolbox, str, str]]:
    """The toolbox over HTTP with ``--echo-headers`` behind a bearer token, in the catalog with that token and a
    second credential header (``X-Tools-Key``) from the worker's environment: (toolbox, token, header key)."""
    token, header_key = f"tok-{uuid.uuid4().hex}", f"hdr-{uuid.uuid4().hex}"
    with http_toolbox(tmp_path / "events.jsonl", args=("--bearer-env", TOKEN_VARIABLE, "--echo-headers"),
                      env={**os.environ, TOKEN_VARIABLE: token}) as toolbox:
        add_to_catalog({"toolbox": {"url": toolbox.spec.url, "headers": {
            "Authorization": f"Bearer ${{{TOKEN_VARIABLE}}}", "X-Tools-Key": f"${{{HEADER_VARIABLE}}}"}}})
        yield toolbox, token, header_key


def _guess_of(request: MockRequest) -> str:
    return request.last_message.removeprefix("Is it ").removesuffix("?")


def _echoing_model(request: MockRequest) -> Any:
    """A model that repeats the guess in its input: first with a call to ``echo`` carrying it and a call to
    ``headers``, then as its answer."""
    guess = _guess_of(request)
    if request.last_tool_call_id is None:
        return reply(f"You asked about {guess}.", tools=[("toolbox__echo", {"text": f"it is {guess}"}, "call_echo"),
                                                        ("toolbox__headers", {}, "call_headers")])
    return reply(f"Answer: {guess}")


def _credentials(content: str) -> str:
    """A ``headers`` result's credential lines (the others, a session id among them, differ from call to call);
    any other content as it is."""
    lines = content.splitlines()
    if not any(line.startswith("authorization: ") for line in lines):
        return content
    return "\n".join(line for line in lines if line.startswith(("authorization: ", "x-tools-key: ")))


def _echoing_worker(llm_mock: LlmMock, leaky_toolbox: tuple[Toolbox, str, str],
                    start_worker: Callable[..., WorkerProcess]) -> tuple[WorkerProcess, str, str]:
    """A worker holding the leaky toolbox's token and header key, and the catalog's model ``mock`` echoing what
    the ``headers`` tool returned; the worker and the two secrets."""
    _, token, header_key = leaky_toolbox
    llm_mock.server.when("Is it").reply(_echoing_model)
    add_to_catalog(models={"mock": {"provider": "openai", "base_url": llm_mock.openai_url, "model": "gpt-mock"}})
    return start_worker(**{TOKEN_VARIABLE: token, HEADER_VARIABLE: header_key}), token, header_key


def test_a_tool_that_echoes_the_workers_header_token_never_gets_it_to_the_model_and_its_step_is_redacted(
    llm_mock: LlmMock, leaky_toolbox: tuple[Toolbox, str, str], start_worker: Callable[..., WorkerProcess],
    api: ApiProcess, store: RunStore,
) -> None:
    worker, token, header_key = _echoing_worker(llm_mock, leaky_toolbox, start_worker)

    record = wait_for_run(store, _post_run(api, {"input": "Is it nothing?", "model": "mock",
                                                 "mcp_servers": ["toolbox"]}), timeout=WAIT_S)

    assert record.status is RunStatus.COMPLETED, record.error
    headers = next(s for s in record.steps if s.kind is StepKind.TOOL and s.tool_name == "headers")
    assert f"authorization: Bearer {REDACTED}" in headers.content
    assert f"x-tools-key: {REDACTED}" in headers.content
    bodies = json.dumps(llm_mock.bodies())
    assert token not in bodies
    assert header_key not in bodies
    assert len(llm_mock.bodies()) == 2
    assert f"x-tools-key: {REDACTED}" in bodies  # the tool's result reached the model, scrubbed
    assert token not in worker.log_path.read_text()
    assert header_key not in worker.log_path.read_text()


def test_a_guess_of_a_secret_in_the_input_comes_back_as_a_wrong_guess_does_and_a_servers_own_leak_stays_redacted(
    llm_mock: LlmMock, leaky_toolbox: tuple[Toolbox, str, str], start_worker: Callable[..., WorkerProcess],
    api: ApiProcess, store: RunStore,
) -> None:
    worker, _, header_key = _echoing_worker(llm_mock, leaky_toolbox, start_worker)
    wrong = f"hdr-{uuid.uuid4().hex}"

    def seen(guess: str) -> list[tuple[Any, ...]]:
        """What the run shows of itself, the guess written as GUESS."""
        run_id = _post_run(api, {"input": f"Is it {guess}?", "model": "mock", "mcp_servers": ["toolbox"]})
        record = wait_for_run(store, run_id, timeout=WAIT_S)
        shown = httpx2.get(f"{api.url}/v1/runs/{run_id}", timeout=30).text
        assert shown.count(guess) >= 5  # input, the model's words, the call's arguments, the echo, the answer
        return [(s.kind, s.tool_name, _credentials(s.content).replace(guess, "GUESS"),
                 json.dumps(s.detail.get("tool_calls")).replace(guess, "GUESS")) for s in record.steps] + [
            (record.status, record.output.replace(guess, "GUESS") if record.output else None)]

    right, wrong_seen = seen(header_key), seen(wrong)

    assert right == wrong_seen
    # The server's own copy of the header (its result's headers, which the call's arguments did not carry) is
    # redacted even in the run whose submitter wrote the right value.
    assert any(isinstance(row[2], str) and f"x-tools-key: {REDACTED}" in row[2] for row in right)
    assert header_key not in worker.log_path.read_text()


def test_a_guess_of_a_secret_in_a_cancel_reason_is_kept_as_written_as_a_wrong_guess_is(
    monkeypatch: pytest.MonkeyPatch, start_api: Callable[..., ApiProcess], store: RunStore,
) -> None:
    secret = f"hdr-{uuid.uuid4().hex}"
    monkeypatch.setenv(HEADER_VARIABLE, secret)  # the API loads the catalog naming it, so it redacts the value
    add_to_catalog({"tools": {"url": "http://127.0.0.1:9/mcp", "headers": {"X-Tools-Key": f"${{{HEADER_VARIABLE}}}"}}},
                   models={"mock": {"provider": "openai", "base_url": "http://127.0.0.1:9/v1", "model": "gpt-mock"}})
    api = start_api()
    wrong = f"hdr-{uuid.uuid4().hex}"

    def reason_kept(guess: str) -> str:
        run_id = _post_run(api, {"input": "wait", "model": "mock"})  # no worker: it stays queued
        cancelled = httpx2.post(f"{api.url}/v1/runs/{run_id}/cancel", json={"reason": f"is it {guess}?"}, timeout=30)
        assert cancelled.status_code == 202, cancelled.text
        shown = httpx2.get(f"{api.url}/v1/runs/{run_id}", timeout=30).json()
        assert shown["status"] == "cancelled"
        return str(shown["cancel"]["reason"]).replace(guess, "GUESS")

    assert reason_kept(secret) == reason_kept(wrong) == "is it GUESS?"
    assert secret not in api.log()
