"""The trust boundary (docs/security.md): a spec names what the operator's catalog allows and nothing
else, secrets never leave the worker, every input is bounded, a poisoned message kills nothing, and a
finished run's record is gone after its retention."""

from __future__ import annotations

import json
import os
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pika
import pika.exceptions
import pytest

from runbrake.shared import RunSpec, RunStatus, RunStore, Settings, SpecError, StepKind, TerminationReason
from runbrake.shared.catalog import Admission, Catalog
from runbrake.shared.errors import ConfigError, IdempotencyConflict
from runbrake.shared.messaging.cancel import CancelPublisher, cancel_run
from runbrake.shared.messaging.producer import Producer
from runbrake.shared.messaging.rabbitmq import build_broker
from runbrake.shared.messaging.wire import Topology, run_message
from runbrake.shared.outcome import ToolOutcome
from tests.catalog_helpers import add_to_catalog, catalog_path, to_toml
from tests.mcp_helpers import Toolbox, http_toolbox, matching_events, wait_for_event
from tests.openai_stub import OpenAIStub, StubToolCall
from tests.polling import poll_until
from tests.test_cli import UNKNOWN_ID, assert_clean_failure, namespace_keys, runbrake, write_spec
from tests.worker_helpers import WorkerProcess, call, spec, wait_for_run

pytestmark = pytest.mark.integration

RCE = {"command": "sh", "args": ["-c", "id > {marker}; env >> {marker}"]}


def _rce_spec(marker: Path) -> dict[str, Any]:
    server = {"command": RCE["command"], "args": [a.format(marker=marker) for a in RCE["args"]]}
    return {"input": "hi", "model": {"provider": "scripted", "turns": [{"content": "done"}]},
            "mcp_servers": {"evil": server}}


def test_an_inline_stdio_server_is_refused_at_enqueue_and_nothing_is_written(
    store: RunStore, rabbitmq: Settings, tmp_path: Path
) -> None:
    marker = tmp_path / "pwned"

    result = runbrake("enqueue", str(write_spec(tmp_path / "spec.json", _rce_spec(marker))))

    assert_clean_failure(result, 2, "mcp_servers", "inline servers are refused", "RUNBRAKE_ALLOW_INLINE")
    assert namespace_keys(store) == []
    assert not marker.exists()


def test_an_inline_stdio_server_published_past_the_producer_fails_at_claim_and_starts_nothing(
    store: RunStore, producer: Producer, worker: WorkerProcess, tmp_path: Path
) -> None:
    marker = tmp_path / "pwned"
    # What a client with queue access but no catalog rights could do: write the run and send its message.
    run_id = store.create(_rce_spec(marker)).run_id
    producer.send(run_id)

    record = wait_for_run(store, run_id)

    assert (record.status, record.termination_reason) == (RunStatus.FAILED, TerminationReason.SPEC_REFUSED)
    assert "inline servers are refused" in record.error
    assert record.steps == ()
    assert not marker.exists()


def test_a_catalog_server_gets_its_bearer_token_from_the_worker_and_the_token_is_never_stored_or_logged(
    store: RunStore, producer: Producer, start_worker: Callable[..., WorkerProcess], tmp_path: Path
) -> None:
    token = secrets.token_hex(16)
    events = tmp_path / "events.jsonl"
    with http_toolbox(events, args=("--bearer-env", "TOOLS_TOKEN"), env={**os.environ, "TOOLS_TOKEN": token}) as tb:
        add_to_catalog({"tools": {"url": tb.spec.url, "headers": {"Authorization": "Bearer ${TOOLS_TOKEN}"}}})
        worker = start_worker(TOOLS_TOKEN=token)
        run = producer.enqueue(RunSpec.parse({
            "input": "2 + 3?", "mcp_servers": ["tools"],
            "model": {"provider": "scripted", "turns": [
                {"tool_calls": [{"server": "tools", "tool": "get-sum", "arguments": {"a": 2, "b": 3}}]},
                {"content": "5"}]},
        }))
        record = wait_for_run(store, run.run_id)

    assert record.status is RunStatus.COMPLETED
    assert [(s.tool_name, s.tool_outcome, s.content) for s in record.steps if s.kind is StepKind.TOOL] == [
        ("get-sum", ToolOutcome.OK, "5")]
    stored = [store.redis.dump(key) or b"" for key in namespace_keys(store)]
    assert all(token.encode() not in value for value in stored)
    assert token not in worker.log_path.read_text()
    assert token not in runbrake("show", run.run_id, "--json").stdout
    assert token not in catalog_path().read_text()


def test_a_catalog_server_whose_token_variable_is_unset_fails_its_calls_naming_the_variable(
    store: RunStore, producer: Producer, worker: WorkerProcess, tmp_path: Path
) -> None:
    with http_toolbox(tmp_path / "events.jsonl", args=("--bearer-env", "TOOLS_TOKEN"),
                      env={**os.environ, "TOOLS_TOKEN": "s3cret-value"}) as tb:
        add_to_catalog({"tools": {"url": tb.spec.url, "headers": {"Authorization": "Bearer ${UNSET_TOKEN_VAR}"}}})
        run = producer.enqueue(spec({}, [{"tool_calls": [call("get-sum", server="tools", a=1, b=1)]},
                                         {"content": "x"}], mcp_servers=["tools"]))
        record = wait_for_run(store, run.run_id)

    [tool] = [s for s in record.steps if s.kind is StepKind.TOOL]
    assert tool.tool_outcome is ToolOutcome.FAILED
    assert "UNSET_TOKEN_VAR" in tool.content


def test_an_inline_openai_model_is_refused_so_an_api_key_cannot_be_sent_anywhere(tmp_path: Path) -> None:
    admission = Admission(Catalog.empty())
    inline = RunSpec.parse({"input": "hi", "model": {
        "provider": "openai", "base_url": "http://attacker.example/v1", "model": "x", "api_key_env": "FAKE_SECRET"}})

    with pytest.raises(SpecError) as refused:
        admission.admit(inline)

    assert [p.field for p in refused.value.problems] == ["model"]
    assert "inline openai model is refused" in refused.value.problem


def test_a_model_and_servers_outside_the_catalog_are_refused_each_named() -> None:
    admission = Admission(Catalog.parse({"mcp_servers": {"calc": {"url": "http://127.0.0.1:1/mcp"}}}))
    named = RunSpec.parse({"input": "hi", "model": "nope", "mcp_servers": ["calc", "ghost"]})

    with pytest.raises(SpecError) as refused:
        admission.admit(named)

    assert {p.field for p in refused.value.problems} == {"model", "mcp_servers[1]"}


def test_a_catalog_allowlist_refuses_tools_outside_it() -> None:
    catalog = Catalog.parse({"mcp_servers": {"calc": {"url": "http://127.0.0.1:1/mcp", "tools": ["get-sum"]}}})
    asks = RunSpec.parse({"input": "hi", "mcp_servers": ["calc"], "model": {"provider": "scripted", "turns": [
        {"tool_calls": [{"server": "calc", "tool": "slow"}]}]}})

    with pytest.raises(SpecError) as refused:
        Admission(catalog).admit(asks)

    assert refused.value.field == "model.turns[0].tool_calls[0].tool"


def test_a_broken_catalog_names_every_problem() -> None:
    with pytest.raises(ConfigError) as refused:
        Catalog.parse({"mcp_servers": {"a": {"url": "ftp://x"}, "b": {}}, "models": {"m": {"provider": "openai"}}})

    text = str(refused.value)
    assert text.startswith("RUNBRAKE_CATALOG")
    for place in ("mcp_servers.a.url", "mcp_servers.b", "models.m.base_url"):
        assert place in text


def test_catalog_check_lists_the_catalog_with_secrets_as_variables_never_values(tmp_path: Path) -> None:
    path = tmp_path / "catalog.toml"
    path.write_text(to_toml({
        "mcp_servers": {"tools": {"url": "https://tools.internal/mcp", "headers": {"Authorization": "Bearer ${TK}"}}},
        "models": {"default": {"provider": "openai", "base_url": "https://api.example/v1", "model": "m",
                               "api_key_env": "OPENAI_KEY"}},
    }))

    result = runbrake("catalog", "check", str(path), "--json", env={"TK": "top-secret-token"})

    assert result.returncode == 0, result.stderr
    described = json.loads(result.stdout)
    assert described["mcp_servers"]["tools"]["headers"]["Authorization"] == {
        "template": "Bearer ${TK}", "variables": {"TK": True}}
    assert described["models"]["default"]["api_key_env"] == "OPENAI_KEY"
    assert "top-secret-token" not in result.stdout
    path.write_text('[mcp_servers.x]\nurl = "ftp://nope"\n')
    assert_clean_failure(runbrake("catalog", "check", str(path)), 2, "mcp_servers.x.url")


# -- bounds --------------------------------------------------------------------------------------


def _scripted(**extra: Any) -> dict[str, Any]:
    return {"input": "hi", "model": {"provider": "scripted", "turns": [{"content": "x"}]}, **extra}


def _turn_of(calls: int) -> dict[str, Any]:
    return {"input": "hi", "mcp_servers": {"s": {"url": "http://127.0.0.1:1/mcp"}},
            "model": {"provider": "scripted", "turns": [{"tool_calls": [{"server": "s", "tool": "t"}] * calls}]}}


@pytest.mark.parametrize(
    ("field", "settings", "inside", "outside"),
    [
        ("input", {"max_input_chars": 10}, _scripted(input="x" * 10), _scripted(input="x" * 11)),
        ("max_steps", {"max_steps_cap": 50}, _scripted(max_steps=50), _scripted(max_steps=51)),
        ("model.turns[0].tool_calls", {"max_tool_calls_per_turn": 2},
          _turn_of(2), _turn_of(3)),
    ],
    ids=["input", "max_steps", "tool_calls_per_turn"],
)
def test_each_bound_admits_just_inside_and_refuses_just_outside_naming_field_and_limit(
    field: str, settings: dict[str, int], inside: dict[str, Any], outside: dict[str, Any]
) -> None:
    admission = Admission(Catalog.empty(), allow_inline=True, **settings)
    limit = str(next(iter(settings.values())))

    admission.admit(RunSpec.parse(inside))
    with pytest.raises(SpecError) as refused:
        admission.admit(RunSpec.parse(outside))

    assert refused.value.field == field
    assert f"the limit is {limit}" in refused.value.problem


def test_a_spec_file_over_the_size_bound_is_refused_before_it_is_read_whole(
    store: RunStore, rabbitmq: Settings, tmp_path: Path
) -> None:
    spec_file = write_spec(tmp_path / "spec.json", _scripted(input="x" * 5000))
    size = spec_file.stat().st_size

    assert runbrake("enqueue", str(spec_file), env={"RUNBRAKE_MAX_SPEC_BYTES": str(size)}).returncode == 0
    result = runbrake("enqueue", str(spec_file), env={"RUNBRAKE_MAX_SPEC_BYTES": str(size - 1)})

    assert_clean_failure(result, 2, "spec", f"larger than {size - 1} bytes", "RUNBRAKE_MAX_SPEC_BYTES")


def test_a_run_that_reaches_max_steps_fails_with_reason_max_steps(
    toolbox_http: Toolbox, store: RunStore, producer: Producer, worker: WorkerProcess
) -> None:
    loop = {"tool_calls": [call("get-sum", a=1, b=1)]}
    run = producer.enqueue(spec({"toolbox": toolbox_http.spec}, [loop, loop, loop, {"content": "x"}], max_steps=3))

    record = wait_for_run(store, run.run_id)

    assert (record.status, record.termination_reason) == (RunStatus.FAILED, TerminationReason.MAX_STEPS)
    assert len(record.steps) == 3


def test_a_model_turn_over_the_tool_call_bound_fails_the_run_and_long_arguments_are_stored_cut(
    openai_stub: OpenAIStub, toolbox_http: Toolbox, store: RunStore, producer: Producer,
    start_worker: Callable[..., WorkerProcess],
) -> None:
    start_worker(RUNBRAKE_MAX_TOOL_CALLS_PER_TURN="1", RUNBRAKE_MAX_ARGUMENT_CHARS="100")
    openai_stub.reply(tool_calls=[StubToolCall("toolbox__echo", {"text": "y" * 500}),
                                  StubToolCall("toolbox__echo", {"text": "z"})])
    add_to_catalog({"toolbox": toolbox_http.spec},
                   models={"stub": {"provider": "openai", "base_url": openai_stub.base_url, "model": "stub"}})
    run = producer.enqueue(RunSpec.parse({"input": "echo", "model": "stub", "mcp_servers": ["toolbox"]}))

    record = wait_for_run(store, run.run_id)

    assert (record.status, record.termination_reason) == (RunStatus.FAILED, TerminationReason.TOO_MANY_TOOL_CALLS)
    [model] = record.steps
    first = model.detail["tool_calls"][0]["arguments"]
    assert first["_chars"] == len(json.dumps({"text": "y" * 500}, separators=(",", ":")))
    assert len(first["_truncated"]) == 100
    assert matching_events(toolbox_http.events, "started") == []


# -- idempotency and run ids ---------------------------------------------------------------------


def test_an_idempotency_key_binds_to_its_spec(store: RunStore, producer: Producer) -> None:
    first = producer.enqueue(RunSpec.parse(_scripted(idempotency_key="order-7")))

    again = producer.enqueue(RunSpec.parse(_scripted(idempotency_key="order-7")))
    with pytest.raises(IdempotencyConflict) as conflict:
        producer.enqueue(RunSpec.parse(_scripted(idempotency_key="order-7", input="something else")))

    assert (again.run_id, again.created) == (first.run_id, False)
    assert conflict.value.run_id == first.run_id


def test_reusing_an_idempotency_key_with_another_spec_exits_1(
    store: RunStore, rabbitmq: Settings, tmp_path: Path
) -> None:
    assert runbrake("enqueue", str(write_spec(tmp_path / "a.json", _scripted(idempotency_key="k")))).returncode == 0

    result = runbrake("enqueue", str(write_spec(tmp_path / "b.json", _scripted(idempotency_key="k", input="other"))))

    assert_clean_failure(result, 1, "idempotency key", "different spec")


@pytest.mark.parametrize("command", ["show", "cancel", "approve", "deny"])
def test_a_malformed_run_id_is_bad_input_echoed_at_most_100_characters(command: str) -> None:
    result = runbrake(command, "x" * 5000)

    assert_clean_failure(result, 2, "not a run id")
    assert "x" * 101 not in result.stderr


# -- a listener nothing can kill -----------------------------------------------------------------


def test_a_poisoned_cancel_message_is_dropped_and_the_next_cancel_is_still_delivered_by_message(
    toolbox_http: Toolbox, store: RunStore, producer: Producer, start_worker: Callable[..., WorkerProcess],
    settings: Settings,
) -> None:
    worker = start_worker(RUNBRAKE_CANCEL_POLL_MS="5000")
    run = producer.enqueue(spec({"toolbox": toolbox_http.spec}, [{"tool_calls": [call("slow", seconds=30)]},
                                                                  {"content": "x"}]))
    wait_for_event(toolbox_http.events, "started", tool="slow", timeout=15)
    nested = b"[" * 100_000 + b"]" * 100_000
    connection = pika.BlockingConnection(pika.URLParameters(settings.rabbitmq_url))
    try:
        connection.channel().basic_publish(exchange=Topology.of(settings).cancel_exchange, routing_key="", body=nested)
    finally:
        connection.close()
    worker.wait_for_log("cancel_message_malformed")

    publisher = CancelPublisher(settings)
    try:
        started = time.monotonic()
        assert cancel_run(store, publisher, run.run_id, reason="stop", requested_by="test").won
        worker.wait_for_log("cancel_message_delivered", run_id=run.run_id, timeout=1.0)
        elapsed = time.monotonic() - started
    finally:
        publisher.close()

    assert elapsed < 1.0
    record = wait_for_run(store, run.run_id, lambda r: any(s.kind is StepKind.TOOL for s in r.steps))
    assert [s.tool_outcome for s in record.steps if s.kind is StepKind.TOOL] == [ToolOutcome.CANCELLED]


def test_a_run_message_with_a_malformed_run_id_is_dead_lettered_once_not_retried(
    store: RunStore, worker: WorkerProcess, settings: Settings
) -> None:
    broker = build_broker(settings)
    try:
        broker.enqueue(run_message(Topology.of(settings), "placeholder").copy(args=({"not": "an id"},)))
    finally:
        broker.close()

    poll_until(lambda: _messages_in(settings, f"{Topology.of(settings).run_queue}.XQ") == 1 or None, timeout=15,
               failure=lambda: "the malformed message was not dead-lettered")
    assert len(worker.logged("run_message_malformed")) == 1
    assert worker.process.poll() is None


def _messages_in(settings: Settings, queue: str) -> int:
    connection = pika.BlockingConnection(pika.URLParameters(settings.rabbitmq_url))
    try:
        count: int = connection.channel().queue_declare(queue=queue, passive=True).method.message_count
        return count
    except pika.exceptions.ChannelClosedByBroker:
        return 0
    finally:
        if connection.is_open:
            connection.close()


# -- retention -----------------------------------------------------------------------------------


def test_a_finished_run_is_gone_whole_after_its_retention(
    store: RunStore, producer: Producer, start_worker: Callable[..., WorkerProcess], monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("RUNBRAKE_RETENTION_S", "2")
    retaining = RunStore.connect(Settings.from_env())
    producer = Producer(retaining, producer._broker, Admission(Catalog.empty()))
    start_worker()
    run = producer.enqueue(RunSpec.parse(_scripted(idempotency_key="kept-for-2s")))
    wait_for_run(retaining, run.run_id)

    # The namespace's own keys stay while workers run: the outbox stream, the relay's and webhook dispatcher's
    # leases and the workers' beats (docs/leases.md, "Lost workers"). Nothing of the run itself does: not its
    # keys, and not one of its events in the outbox (the sweeper trims the outbox to the retention exactly:
    # docs/messaging.md, "The outbox").
    outbox = f"{retaining.namespace}:outbox"
    shared = {outbox, f"{retaining.namespace}:relay", f"{retaining.namespace}:webhook-lease",
              f"{retaining.namespace}:workers"}

    def left() -> list[str]:
        events = [i for i, fields in retaining.redis.xrange(outbox) if fields.get("run") == run.run_id]
        return [key for key in namespace_keys(retaining) if key not in shared] + [f"event {i}" for i in events]

    poll_until(lambda: left() == [] or None, timeout=15, failure=lambda: f"still there: {left()}")

    assert_clean_failure(runbrake("show", run.run_id), 1, "no run")
    assert run.run_id not in runbrake("runs", "--json").stdout
    retaining.close()


def test_unknown_run_ids_are_refused_by_show(store: RunStore) -> None:
    assert_clean_failure(runbrake("show", UNKNOWN_ID), 1, "no run")



def test_the_catalog_shipped_with_the_kubernetes_manifests_loads() -> None:
    catalog = Catalog.load(Path(__file__).resolve().parent.parent / "deploy" / "k8s" / "base" / "catalog.toml")

    assert set(catalog.mcp_servers) == {"tools"}
    assert set(catalog.models) == {"default"}
