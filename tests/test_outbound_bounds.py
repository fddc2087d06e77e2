"""Every outbound read is bounded in bytes and in wall time, and no model call follows a redirect (issue 27,
docs/security.md, "Bounds" and "Tested attacks").

The hostile endpoints are tests/hostile_http.py's server on loopback: it floods, drips and redirects as no
outside server does, and counts what it managed to send. The runs go through a real worker over the real
RabbitMQ and Redis; the webhook dispatchers run in this process over the real Redis (as in
tests/test_webhooks.py).
"""

from __future__ import annotations

import json
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from runbrake.shared import RunSpec, RunStatus, RunStep, RunStore, Settings, StepKind, TerminationReason, ToolOutcome
from runbrake.shared.catalog import CatalogFile
from runbrake.shared.errors import ProviderError
from runbrake.shared.messaging.producer import Producer
from runbrake.shared.spec import AnthropicModel, OpenAIModel
from runbrake.worker.conversation import Message
from runbrake.worker.mcp_stdio import MAX_LINE_BYTES
from runbrake.worker.mcp_transport import MAX_MESSAGE_BYTES
from runbrake.worker.model_stream import MAX_STREAM_BYTES
from runbrake.worker.models import RetryPolicy, provider_for
from runbrake.worker.webhooks import WebhookDispatcher
from tests.catalog_helpers import add_to_catalog, catalog_path, to_toml
from tests.hostile_http import Drip, Flood, HostileServer, Pieces, Whole, mcp_responder, tool_result_flood
from tests.polling import poll_until
from tests.ports import free_port
from tests.webhook_helpers import Receiver, new_secret
from tests.worker_helpers import WorkerProcess, wait_for_run

pytestmark = pytest.mark.integration

FLOOD_BYTES = 100 * 1024 * 1024
"""What a hostile endpoint offers: 100 MB (the worker went to 1.28 GB RSS on a tool result of it). What it
manages to send is the bound plus what the sockets buffer on both sides (loopback's autotuned buffers reach
several MB each): under half of it, where reading it whole sends all of it."""
DRIP_S = 0.5
"""A dripping endpoint's byte interval: well under any per-read timeout, so only a deadline cuts it."""
DRIP_BYTES = 4000
"""A drip this long takes 2,000 s: finishing it is impossible within any bound of these tests."""
BOUND_S = 60.0
"""How long a test waits for what it expects, on a loaded machine; a drip outlasts it many times over."""
PROVIDERS = {"openai": ("/v1", "/v1/chat/completions"), "anthropic": ("", "/v1/messages")}
"""Each provider: its ``base_url``'s path, and the path its SDK POSTs to."""


def _model(provider: str, base_url: str, **extra: Any) -> dict[str, Any]:
    return {"provider": provider, "base_url": base_url, "model": "hostile", "max_retries": 0, **extra}


def _run_of_model(producer: Producer, provider: str, server: HostileServer, **extra: Any) -> str:
    """A run of the catalog model ``hostile`` (``provider`` at ``server``); answers its run id."""
    add_to_catalog({}, models={"hostile": _model(provider, server.url + PROVIDERS[provider][0], **extra)})
    run = producer.enqueue(RunSpec.parse({"input": "Tell me everything.", "model": "hostile"}))
    return run.run_id


def _failed_model_error(store: RunStore, run_id: str) -> str:
    record = wait_for_run(store, run_id, timeout=BOUND_S)
    assert (record.status, record.termination_reason) == (RunStatus.FAILED, TerminationReason.PROVIDER_FAILED)
    assert [s.kind for s in record.steps] == [StepKind.MODEL]
    error = record.steps[0].error
    assert error is not None
    return error


def test_a_tool_result_past_its_byte_bound_fails_the_call_and_the_rest_is_never_read(
    worker: WorkerProcess, producer: Producer, store: RunStore,
) -> None:
    """A 100 MB ``tools/call`` answer: the call fails naming the bound, and the server could send only what the
    worker read before it stopped (plus the sockets' buffers), not the 100 MB."""
    with HostileServer(mcp_responder(tool_result_flood(FLOOD_BYTES))) as server:
        add_to_catalog({"hostile": {"url": f"{server.url}/mcp"}})
        run = producer.enqueue(RunSpec.parse({
            "input": "Call it.", "mcp_servers": ["hostile"],
            "model": {"provider": "scripted", "turns": [
                {"tool_calls": [{"server": "hostile", "tool": "huge", "arguments": {}}]}, {"content": "done"}]},
        }))
        record = wait_for_run(store, run.run_id, timeout=BOUND_S)
        sent = server.sent

    assert record.status is RunStatus.COMPLETED
    tool = next(s for s in record.steps if s.kind is StepKind.TOOL)
    assert tool.tool_outcome is ToolOutcome.FAILED
    assert f"the MCP server's answer exceeded {MAX_MESSAGE_BYTES} bytes" in (tool.content or "")
    assert sent < FLOOD_BYTES // 2, f"the worker read {sent} bytes of the flood"


def test_a_line_past_its_bound_from_a_stdio_server_fails_the_call_not_the_worker(
    worker: WorkerProcess, producer: Producer, store: RunStore,
) -> None:
    """A stdio server answering ``tools/call`` with one 100 MB line: the worker stops holding it at the line
    bound and ends the connection, so the call fails (the SDK's reader held the whole line and the call was
    ``ok``); the run goes on."""
    add_to_catalog({"hostile": {"command": sys.executable,
                                "args": [str(Path(__file__).with_name("hostile_stdio.py")), str(FLOOD_BYTES)]}})
    run = producer.enqueue(RunSpec.parse({
        "input": "Call it.", "mcp_servers": ["hostile"],
        "model": {"provider": "scripted", "turns": [
            {"tool_calls": [{"server": "hostile", "tool": "huge", "arguments": {}}]}, {"content": "done"}]},
    }))
    record = wait_for_run(store, run.run_id, timeout=BOUND_S)

    assert record.status is RunStatus.COMPLETED
    tool = next(s for s in record.steps if s.kind is StepKind.TOOL)
    assert tool.tool_outcome is ToolOutcome.FAILED
    assert [e["max_bytes"] for e in worker.logged("mcp_line_too_long")] == [MAX_LINE_BYTES]


@pytest.mark.parametrize("provider", sorted(PROVIDERS))
def test_a_huge_answer_from_a_model_that_does_not_stream_fails_the_call_and_is_not_read_whole(
    provider: str, worker: WorkerProcess, producer: Producer, store: RunStore,
) -> None:
    """``stream = false`` and a 100 MB answer: the call fails naming the bound (not retried); the endpoint
    could send only what the worker read before it stopped."""
    flood = Flood(FLOOD_BYTES, prefix=b'{"id": "x", "choices": [{"index": 0, "message": {"content": "',
                  suffix=b'"}}]}')
    with HostileServer(lambda request: flood) as server:
        run_id = _run_of_model(producer, provider, server, stream=False)
        error = _failed_model_error(store, run_id)
        sent = server.sent

    assert f"the model's answer exceeded {MAX_STREAM_BYTES} bytes" in error
    assert [r.path for r in server.requests] == [PROVIDERS[provider][1]]
    assert sent < FLOOD_BYTES // 2, f"the worker read {sent} bytes of the flood"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("provider", sorted(PROVIDERS))
def test_a_dripping_model_endpoint_is_cut_off_at_the_models_timeout_not_at_the_end_of_the_drip(
    provider: str, stream: bool, worker: WorkerProcess, producer: Producer, store: RunStore,
) -> None:
    """A byte every half second, 2,000 s of them, against ``timeout_s = 2``: the call ends at its deadline
    (each read alone would never time out) and the step says so."""
    drip = Drip(b" " * DRIP_BYTES, every_s=DRIP_S)
    with HostileServer(lambda request: drip) as server:
        run_id = _run_of_model(producer, provider, server, stream=stream, timeout_s=2)
        error = _failed_model_error(store, run_id)

    assert "the model call timed out after 2 s" in error
    assert server.sent < DRIP_BYTES


@pytest.mark.parametrize("provider", sorted(PROVIDERS))
def test_a_redirect_from_a_model_endpoint_is_not_followed(
    provider: str, worker: WorkerProcess, producer: Producer, store: RunStore,
) -> None:
    """A 307 to an internal address: the conversation is never POSTed there, and nothing of that service's
    answer comes back; the step names the redirect that was not followed."""
    internal_answer = json.dumps({"internal": "secret-of-the-internal-service"}).encode()
    with HostileServer(lambda request: Whole(200, {"content-type": "application/json"}, internal_answer)) as internal:
        with HostileServer(lambda request: Whole(307, {"location": f"{internal.url}/steal"})) as endpoint:
            run_id = _run_of_model(producer, provider, endpoint)
            error = _failed_model_error(store, run_id)

        assert internal.requests == []
    assert len(endpoint.requests) == 1
    assert "307" in error
    assert "follow no redirects" in error
    assert "secret-of-the-internal-service" not in error


@pytest.mark.parametrize(("answer", "stream", "says", "transient"), [
    pytest.param(Whole(200, {"content-type": "application/json"}, b'{"choices": [}'), False, "answer is not JSON",
                 False, id="whole-not-json"),
    pytest.param(Pieces(b"HTTP/1.1 500 Cut\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n",
                        (b'{"error": ',)), True, "RemoteProtocolError", True, id="streamed-error-body-cut-short"),
])
@pytest.mark.parametrize("provider", sorted(PROVIDERS))
def test_an_answer_an_sdk_cannot_read_is_a_provider_error_not_a_crash(
    provider: str, answer: Whole | Pieces, stream: bool, says: str, transient: bool,
) -> None:
    """What the fuzzing of endpoints found (tests/test_fuzz_endpoints.py): a whole answer that is not JSON, or
    the error body of a streamed call cut short, came out of the SDKs as ``JSONDecodeError`` /
    ``httpx2.RemoteProtocolError``, which no provider caught; now a :class:`ProviderError` saying so, retried
    only where the connection broke."""
    with HostileServer(lambda request: answer) as server:
        base_url = server.url + PROVIDERS[provider][0]
        spec = (OpenAIModel(base_url=base_url, model="m", stream=stream) if provider == "openai"
                else AnthropicModel(base_url=base_url, model="m", stream=stream))

        async def ask() -> None:
            await provider_for(spec, RetryPolicy(retries=0)).complete(
                [Message(role="user", content="hi")], [], round_index=0)

        with pytest.raises(ProviderError, match=says) as raised:
            anyio.run(ask)

    assert raised.value.retryable is transient


SECRET_ENV = "RUNBRAKE_TEST_OUTBOUND_WEBHOOK_SECRET"


@pytest.fixture
def slow_and_quick(namespace: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[HostileServer, Receiver]]:
    """The catalog's webhooks ``slow`` (a receiver that drips its answer for 2,000 s) and ``quick`` (one that
    answers at once), both for ``run.*`` events."""
    secret = new_secret()
    monkeypatch.setenv(SECRET_ENV, secret)
    quick = Receiver(secret, free_port())
    with HostileServer(lambda request: Drip(b" " * DRIP_BYTES, every_s=DRIP_S)) as slow:
        catalog_path().write_text(to_toml({"webhooks": {
            "slow": {"url": f"{slow.url}/hook", "secret_env": SECRET_ENV, "events": ["run.*"]},
            "quick": {"url": quick.url, "secret_env": SECRET_ENV, "events": ["run.*"]},
        }}))
        quick.start()
        try:
            yield slow, quick
        finally:
            quick.stop()


def _finish(store: RunStore, notify: list[str]) -> str:
    """A run naming these webhooks, taken to completed as a worker would: claim, one step, settle."""
    run_id = store.create({"input": "notify me", "model": {"provider": "scripted", "turns": [{"content": "done"}]},
                           "notify": notify}).run_id
    owner = f"test-{uuid.uuid4().hex[:8]}"
    assert store.claim(run_id, owner, lease_s=60).won
    store.append_step(run_id, RunStep(kind=StepKind.MODEL, round=1, content="done"))
    assert store.settle(run_id, RunStatus.COMPLETED, TerminationReason.COMPLETED, owner=owner).won
    return run_id


def test_a_receiver_that_drips_its_answer_holds_its_delivery_slot_no_longer_than_the_webhook_timeout(
    settings: Settings, store: RunStore, slow_and_quick: tuple[HostileServer, Receiver],
) -> None:
    """One delivery slot, taken by a receiver that drips its answer: another webhook's event still goes out,
    while the drip goes on, once ``RUNBRAKE_WEBHOOK_TIMEOUT_S`` (the whole request) has passed."""
    slow, quick = slow_and_quick
    one_slot = settings.with_changes(webhook_concurrency=1, webhook_timeout_s=1.0, webhook_backoff_s=0.05,
                                     webhook_backoff_max_s=0.5)
    dispatcher = WebhookDispatcher(one_slot, store, CatalogFile(catalog_path()))
    dispatcher.start()
    try:
        _finish(store, ["slow"])
        assert slow.dripping.wait(BOUND_S), "the slow receiver was never sent a delivery"
        run_id = _finish(store, ["quick"])

        poll_until(lambda: quick.of_run(run_id) or None, timeout=BOUND_S,
                   failure=lambda: f"the quick receiver got nothing while the slow one dripped: {quick.ids()}")
        assert slow.sent < DRIP_BYTES  # still dripping: it would take 2,000 s
        failing = poll_until(lambda: store.webhook_deliveries(failing=True) or None, timeout=BOUND_S,
                             failure=lambda: "the slow delivery was never recorded as failing")
    finally:
        dispatcher.stop()
        dispatcher.join(15)
    assert not dispatcher.is_alive()
    assert {d["webhook"] for d in failing} == {"slow"}
    assert any("no whole answer within 1 s" in d.get("error", "") for d in failing), failing

