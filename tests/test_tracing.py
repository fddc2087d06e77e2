"""Traces (docs/operating.md, "Traces"): off, nothing of OpenTelemetry's SDK is loaded; on, one trace runs from
the enqueue through the run message, the worker's segment, its model and tool calls, to the MCP server's HTTP
requests, and from a cancel through its message to the interrupt.

The in-process tests record spans with the SDK's in-memory exporter on a provider of their own (the process's
global one is left alone, so no other test is traced); tests/test_tracing_otlp.py exports from real processes to an
OTLP/HTTP receiver.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from typing import Any

import anyio
import pika
import pytest
from hypothesis import given
from hypothesis import strategies as st
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from runbrake.shared import RunStore, Settings, tracing
from runbrake.shared._otel import OtelTracing
from runbrake.shared.async_store import AsyncRunStore
from runbrake.shared.catalog import Admission
from runbrake.shared.messaging.cancel import CancelPublisher, cancel_run
from runbrake.shared.messaging.producer import Producer
from runbrake.shared.messaging.wire import (
    RUN_ACTOR,
    MalformedRunMessage,
    Topology,
    cancel_properties,
    cancel_traceparent,
    check_run_message,
    run_message,
)
from runbrake.shared.spec import OpenAIModel, RunSpec
from runbrake.shared.status import RunStatus
from runbrake.worker.cancel_listener import CancelListener
from runbrake.worker.registry import ActiveRuns
from runbrake.worker.runtime import RunOutcome, Runtime
from runbrake.worker.tracing import TracingSubscriber
from tests.catalog_helpers import add_to_catalog
from tests.llm_mock import LlmMock, reply
from tests.mcp_helpers import (
    Toolbox,
    matching_events,
    toolbox_http_fixture,  # noqa: F401 - registers the `toolbox_http` fixture
    wait_for_event_async,
)
from tests.worker_helpers import call, producer_fixture, spec, take_messages  # noqa: F401 - `producer`

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


# -- off: nothing loaded --------------------------------------------------------------------------

_LOADED = """
import json, sys
from runbrake.shared import tracing
from runbrake.shared.settings import Settings
import runbrake.broker.cli, runbrake.broker.api, runbrake.worker.process, runbrake.worker.runtime
on = tracing.configure(Settings.from_env(), service="test").enabled
loaded = sorted(m for m in sys.modules if m.startswith(("opentelemetry.sdk.trace", "opentelemetry.exporter",
                "opentelemetry.proto", "runbrake.shared._otel", "runbrake.worker.tracing")))
print(json.dumps({"on": on, "loaded": loaded}))
"""


@pytest.mark.parametrize(("otel", "loads_sdk"), [("", False), ("false", False), ("true", True)])
def test_with_tracing_off_neither_opentelemetrys_tracing_sdk_nor_its_exporter_is_imported(
    otel: str, loads_sdk: bool, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not the whole of ``opentelemetry``: the MCP SDK imports its API, and redis-py its metrics SDK where it is
    installed (redis/observability/providers.py), whatever runbrake does; the tracer, exporter and runbrake's
    own tracing modules are what turning tracing on loads."""
    _loaded_with(otel, loads_sdk, monkeypatch)


def _loaded_with(otel: str, loads_sdk: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RUNBRAKE_OTEL", otel)
    done = subprocess.run([sys.executable, "-c", _LOADED], capture_output=True, text=True, timeout=60, check=True)

    answer = json.loads(done.stdout)
    assert answer["on"] is loads_sdk
    if loads_sdk:  # the control: the same script does load them when tracing is on
        assert {"opentelemetry.sdk.trace", "opentelemetry.exporter.otlp.proto.http.trace_exporter",
                "runbrake.shared._otel"} <= set(answer["loaded"])
    else:
        assert answer["loaded"] == []


# -- what crosses a process: the traceparent, checked ---------------------------------------------


def test_a_run_message_carries_the_traceparent_option_and_a_worker_accepts_it() -> None:
    topology = Topology("test-ns")
    message = run_message(topology, "a" * 32, traceparent=TRACEPARENT)

    check_run_message(message.encode(), queue=topology.run_queue, actors={RUN_ACTOR})
    assert message.options == {"traceparent": TRACEPARENT}
    assert run_message(topology, "a" * 32).options == {}  # untraced: no option at all


@pytest.mark.parametrize("value", [
    "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01x",  # too long
    "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",  # another version
    "00-00000000000000000000000000000000-00f067aa0ba902b7-01",  # zero trace id
    "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",  # zero span id
    "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",  # uppercase
    "x" * 10_000,
    55,
    None,
    ["00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"],
])
def test_a_run_message_whose_traceparent_is_not_a_w3c_value_is_refused_naming_the_option(value: object) -> None:
    topology = Topology("test-ns")
    envelope = json.loads(run_message(topology, "a" * 32).encode())
    envelope["options"] = {"traceparent": value}

    with pytest.raises(MalformedRunMessage, match=r"options\.traceparent"):
        check_run_message(json.dumps(envelope).encode(), queue=topology.run_queue, actors={RUN_ACTOR})


def test_a_cancel_message_carries_the_traceparent_header_and_only_a_w3c_value_is_read_back() -> None:
    assert cancel_traceparent(cancel_properties(TRACEPARENT)) == TRACEPARENT
    assert cancel_traceparent(cancel_properties(None)) is None
    assert cancel_properties(None).headers is None
    assert cancel_traceparent(pika.BasicProperties(headers={"traceparent": TRACEPARENT.encode()})) == TRACEPARENT
    for hostile in ("00-zz", b"\xff" * 55, 7, {"a": 1}, TRACEPARENT + "0"):
        assert cancel_traceparent(pika.BasicProperties(headers={"traceparent": hostile})) is None


_HEADER_VALUES = (st.text(max_size=80) | st.binary(max_size=80) | st.integers() | st.none()
                  | st.from_regex(r"00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}", fullmatch=True))


@given(_HEADER_VALUES)
def test_any_traceparent_header_on_a_cancel_message_is_read_as_a_w3c_value_or_ignored(value: object) -> None:
    read = cancel_traceparent(pika.BasicProperties(headers={"traceparent": value}))
    assert read is None or tracing.is_traceparent(read)


@given(_HEADER_VALUES)
def test_any_traceparent_option_is_accepted_only_as_a_w3c_value(value: object) -> None:
    topology = Topology("test-ns")
    envelope = json.loads(run_message(topology, "a" * 32).encode())
    envelope["options"] = {"traceparent": value.decode(errors="replace") if isinstance(value, bytes) else value}
    body = json.dumps(envelope).encode()
    if tracing.is_traceparent(envelope["options"]["traceparent"]):
        check_run_message(body, queue=topology.run_queue, actors={RUN_ACTOR})
    else:
        with pytest.raises(MalformedRunMessage, match=r"options\.traceparent"):
            check_run_message(body, queue=topology.run_queue, actors={RUN_ACTOR})


# -- on: one trace, recorded in memory ------------------------------------------------------------


@pytest.fixture
def spans(monkeypatch: pytest.MonkeyPatch) -> Iterator[InMemorySpanExporter]:
    """Tracing on in this process, for this test only, into the SDK's in-memory exporter."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(tracing, "_current", OtelTracing(provider))
    yield exporter
    provider.shutdown()


@pytest.fixture
async def async_store(settings: Settings, store: RunStore) -> AsyncIterator[AsyncRunStore]:
    connected = AsyncRunStore.connect(settings)
    yield connected
    await connected.aclose()


def _traced_runtime(settings: Settings, store: AsyncRunStore, registry: ActiveRuns) -> Runtime:
    """A worker's runtime in this process whose only subscriber is the tracing one."""
    return Runtime(settings, store, registry, Admission.from_settings(settings), subscribers=[TracingSubscriber(store)])


def _named(spans: tuple[ReadableSpan, ...], name: str) -> ReadableSpan:
    found = [s for s in spans if s.name == name]
    assert len(found) == 1, f"{name}: {[s.name for s in spans]}"
    return found[0]


def _ids(span: ReadableSpan) -> tuple[str, str]:
    context = span.get_span_context()
    assert context is not None
    return f"{context.trace_id:032x}", f"{context.span_id:016x}"


def _parent(span: ReadableSpan) -> str | None:
    return f"{span.parent.span_id:016x}" if span.parent is not None else None


def _traceparents(toolbox: Toolbox) -> list[str]:
    return [e["args"]["traceparent"] for e in matching_events(toolbox.events, "traceparent")]


@pytest.mark.integration
@pytest.mark.anyio
async def test_one_trace_runs_from_the_enqueue_through_the_message_and_the_segment_to_the_mcp_servers_requests(
    spans: InMemorySpanExporter, settings: Settings, store: RunStore,
    async_store: AsyncRunStore, producer: Producer, toolbox_http: Toolbox,
) -> None:
    exporter = spans
    run_spec = spec({"toolbox": toolbox_http.spec}, [
        {"tool_calls": [call("get-sum", a=2, b=3)]},
        {"tool_calls": [call("fail", message="no")]},
        {"content": "It is 5."},
    ])
    enqueued = producer.enqueue(run_spec)
    [(body, _headers)] = take_messages(settings, Topology.of(settings).run_queue, 1)
    traceparent = json.loads(body)["options"]["traceparent"]
    check_run_message(body, queue=Topology.of(settings).run_queue, actors={RUN_ACTOR})
    runtime = _traced_runtime(settings, async_store, ActiveRuns())

    outcome = await runtime.execute(enqueued.run_id, traceparent=traceparent)

    assert outcome is RunOutcome.COMPLETED
    recorded = exporter.get_finished_spans()
    enqueue, segment = _named(recorded, "runbrake.enqueue"), _named(recorded, "runbrake.run.segment")
    trace_id, enqueue_id = _ids(enqueue)
    assert traceparent.startswith(f"00-{trace_id}-{enqueue_id}-")
    assert (enqueue.kind, enqueue.attributes["runbrake.run_id"]) == (SpanKind.PRODUCER, enqueued.run_id)
    assert (_ids(segment)[0], _parent(segment)) == (trace_id, enqueue_id)
    assert segment.attributes["runbrake.segment.outcome"] == "completed"
    assert segment.attributes["runbrake.run.status"] == "completed"
    models = [s for s in recorded if s.name == "chat scripted"]
    assert len(models) == 3
    for model in models:
        assert (_ids(model)[0], _parent(model)) == (trace_id, _ids(segment)[1])
        assert model.attributes["gen_ai.operation.name"] == "chat"
        assert model.attributes["gen_ai.system"] == "scripted"
        assert model.attributes["gen_ai.request.model"] == "scripted"
        assert model.start_time is not None
        assert model.end_time is not None
        assert model.start_time <= model.end_time
    ok, failed = _named(recorded, "execute_tool get-sum"), _named(recorded, "execute_tool fail")
    for tool in (ok, failed):
        assert (_ids(tool)[0], _parent(tool)) == (trace_id, _ids(segment)[1])
        assert tool.attributes["runbrake.tool.server"] == "toolbox"
        assert tool.attributes["gen_ai.operation.name"] == "execute_tool"
    assert (ok.attributes["gen_ai.tool.name"], ok.attributes["runbrake.tool.outcome"]) == ("get-sum", "ok")
    assert (failed.attributes["runbrake.tool.outcome"], failed.status.is_ok) == ("failed", False)
    # The MCP server saw the trace: every HTTP request carries it, the calls' requests with their tool span.
    received = _traceparents(toolbox_http)
    assert received, "the MCP server got no traceparent"
    assert {value.split("-")[1] for value in received} == {trace_id}
    parents = {value.split("-")[2] for value in received}
    assert {_ids(ok)[1], _ids(failed)[1]} <= parents


@pytest.mark.integration
@pytest.mark.anyio
async def test_a_cancel_continues_its_trace_through_the_cancel_message_to_the_interrupt_and_records_its_latency(
    spans: InMemorySpanExporter, settings: Settings, store: RunStore,
    async_store: AsyncRunStore, rabbitmq: Settings, toolbox_http: Toolbox,
) -> None:
    exporter = spans
    run_spec = spec({"toolbox": toolbox_http.spec}, [{"tool_calls": [call("slow", seconds=60)]}, {"content": "x"}])
    run_id = store.create(run_spec.raw).run_id
    registry = ActiveRuns()
    listener = CancelListener(settings, store, registry)
    listener.start()
    publisher = CancelPublisher(settings)
    try:
        assert await anyio.to_thread.run_sync(listener.ready.wait, 20)
        runtime = _traced_runtime(settings, async_store, registry)
        outcome: list[RunOutcome] = []

        async def execute() -> None:
            outcome.append(await runtime.execute(run_id))

        async with anyio.create_task_group() as group:
            group.start_soon(execute)
            await wait_for_event_async(toolbox_http.events, "started", tool="slow", timeout=20)
            # From a thread, as an operator's process would: the cancel's span is that thread's own trace.
            await anyio.to_thread.run_sync(lambda: cancel_run(store, publisher, run_id, reason="test",
                                                              requested_by="tracing-test"))
    finally:
        publisher.close()
        listener.stop()
        await anyio.to_thread.run_sync(listener.join, 10)

    assert outcome == [RunOutcome.CANCELLED]
    assert store.get(run_id).status is RunStatus.CANCELLED
    recorded = exporter.get_finished_spans()
    cancel, interrupt = _named(recorded, "runbrake.cancel"), _named(recorded, "runbrake.cancel.interrupt")
    assert (cancel.kind, cancel.attributes["runbrake.cancel.won"]) == (SpanKind.PRODUCER, True)
    assert (_ids(interrupt)[0], _parent(interrupt)) == (_ids(cancel)[0], _ids(cancel)[1])
    assert interrupt.attributes["runbrake.cancel.interrupted"] is True
    tool = _named(recorded, "execute_tool slow")
    assert tool.attributes["runbrake.tool.outcome"] == "cancelled"
    [event] = [e for e in tool.events if e.name == "runbrake.cancel"]
    attributes: dict[str, Any] = dict(event.attributes or {})
    assert attributes["runbrake.cancel.requested_by"] == "tracing-test"
    assert 0 <= attributes["runbrake.cancel.latency_ms"] < 60_000
    segment = _named(recorded, "runbrake.run.segment")
    assert segment.attributes["runbrake.segment.outcome"] == "cancelled"
    assert segment.attributes["runbrake.run.termination_reason"] == "cancelled"


@pytest.mark.integration
@pytest.mark.anyio
@pytest.mark.parametrize(("bound", "reason"), [("deadline_s", "deadline_exceeded"),
                                               ("max_total_tokens", "budget_exceeded")])
async def test_the_segment_span_of_a_run_its_budget_stopped_has_the_budgets_reason_not_an_operators_cancel(
    bound: str, reason: str, spans: InMemorySpanExporter, settings: Settings, store: RunStore,
    async_store: AsyncRunStore, toolbox_http: Toolbox, request: pytest.FixtureRequest,
) -> None:
    """The deadline's timer fences from a task of its own while a call runs; a model call's tokens fence in the
    segment's task: either way the span says the reason the record has (docs/usage.md, "Budgets")."""
    if bound == "deadline_s":
        run_spec = spec({"toolbox": toolbox_http.spec}, [{"tool_calls": [call("slow", seconds=60)]},
                                                         {"content": "never reached"}], budget={"deadline_s": 2})
    else:
        llm_mock: LlmMock = request.getfixturevalue("llm_mock")
        llm_mock.server.when("2 + 3").reply(reply(tools=[("toolbox__get-sum", {"a": 2, "b": 3}, "call_1")],
                                                  usage=(150, 60)))
        add_to_catalog({"toolbox": toolbox_http.spec},
                       models={"mock": OpenAIModel(base_url=llm_mock.openai_url, model="gpt-mock")})
        run_spec = RunSpec.parse({"input": "What is 2 + 3?", "model": "mock", "mcp_servers": ["toolbox"],
                                  "budget": {"max_total_tokens": 200}})
    run_id = store.create(run_spec.raw).run_id

    outcome = await _traced_runtime(settings, async_store, ActiveRuns()).execute(run_id)

    assert outcome is RunOutcome.CANCELLED
    record = store.get(run_id)
    assert (record.status.value, record.termination_reason.value) == ("cancelled", reason)
    segment = _named(spans.get_finished_spans(), "runbrake.run.segment")
    assert {key: segment.attributes[key] for key in ("runbrake.run.status", "runbrake.run.termination_reason")} == {
        "runbrake.run.status": "cancelled", "runbrake.run.termination_reason": reason}


@pytest.mark.integration
@pytest.mark.anyio
async def test_a_model_calls_span_says_its_provider_model_and_the_usage_the_endpoint_reported(
    spans: InMemorySpanExporter, settings: Settings, store: RunStore, async_store: AsyncRunStore,
    llm_mock: LlmMock,
) -> None:
    """The GenAI semantic conventions' attributes, from a real OpenAI-compatible endpoint (``llm-mock-api``)."""
    llm_mock.server.when("2 + 3").reply(reply("It is 5.", usage=(21, 3)))
    add_to_catalog(models={"mock": OpenAIModel(base_url=llm_mock.openai_url, model="gpt-mock")})
    run_id = store.create({"input": "What is 2 + 3?", "model": "mock", "mcp_servers": []}).run_id

    outcome = await _traced_runtime(settings, async_store, ActiveRuns()).execute(run_id)

    assert outcome is RunOutcome.COMPLETED
    model = _named(spans.get_finished_spans(), "chat gpt-mock")
    assert model.kind is SpanKind.CLIENT
    assert {key: model.attributes[key] for key in (
        "gen_ai.operation.name", "gen_ai.system", "gen_ai.request.model", "gen_ai.usage.input_tokens",
        "gen_ai.usage.output_tokens")} == {
        "gen_ai.operation.name": "chat", "gen_ai.system": "openai", "gen_ai.request.model": "gpt-mock",
        "gen_ai.usage.input_tokens": 21, "gen_ai.usage.output_tokens": 3}
    segment = _named(spans.get_finished_spans(), "runbrake.run.segment")
    assert _parent(model) == _ids(segment)[1]
    assert segment.attributes["gen_ai.request.model"] == "gpt-mock"
