"""Traces exported over OTLP/HTTP by real processes (docs/operating.md, "Traces"): ``runbrake enqueue`` and a
worker, both with ``RUNBRAKE_OTEL=true`` and the standard ``OTEL_EXPORTER_OTLP_ENDPOINT``, export to a receiver
this test starts, which decodes each export request with ``opentelemetry-proto``; the MCP server the run calls
records the ``traceparent`` of each HTTP request it gets. One trace id runs through all of it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx2
import pytest

from runbrake.shared import RunStore, Settings
from runbrake.shared.messaging.wire import Topology
from runbrake.shared.status import RunStatus
from tests.api_helpers import ApiProcess, start_api_fixture  # noqa: F401 - registers the `start_api` fixture
from tests.mcp_helpers import (
    Toolbox,
    matching_events,
    toolbox_http_fixture,  # noqa: F401 - registers the `toolbox_http` fixture
)
from tests.otlp_receiver import ReceivedSpan, Receiver
from tests.polling import poll_until
from tests.worker_helpers import (  # noqa: F401 - registers the `start_worker` fixture
    WorkerProcess,
    call,
    spec,
    start_worker_fixture,
    take_messages,
    wait_for_run,
)


@pytest.fixture(name="receiver")
def receiver_fixture() -> Iterator[Receiver]:
    receiver = Receiver()
    yield receiver
    receiver.close()


def _traced(receiver: Receiver) -> dict[str, str]:
    """The environment of a traced process exporting to ``receiver``, its batches sent every 100 ms."""
    return {"RUNBRAKE_OTEL": "true", "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
            "OTEL_BSP_SCHEDULE_DELAY": "100"}


def _enqueue(spec_path: Path, env: dict[str, str]) -> str:
    done = subprocess.run([str(Path(sys.executable).parent / "runbrake"), "enqueue", str(spec_path), "--json"],
                          env={**os.environ, **env}, capture_output=True, text=True, timeout=60,
                          check=False)
    assert done.returncode == 0, done.stderr
    run_id: str = json.loads(done.stdout)["run_id"]
    return run_id


@pytest.mark.integration
def test_a_trace_from_runbrake_enqueue_to_the_mcp_servers_http_request_carries_one_trace_id(
    receiver: Receiver, store: RunStore, rabbitmq: Settings, toolbox_http: Toolbox,
    start_worker: Callable[..., WorkerProcess], tmp_path: Path,
) -> None:
    start_worker(**_traced(receiver))
    run_spec = spec({"toolbox": toolbox_http.spec}, [{"tool_calls": [call("get-sum", a=2, b=3)]},
                                                      {"content": "It is 5."}])
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(json.dumps(run_spec.raw))

    run_id = _enqueue(spec_path, _traced(receiver))

    assert wait_for_run(store, run_id, timeout=60).status is RunStatus.COMPLETED

    def exported() -> list[ReceivedSpan] | None:
        wanted = [receiver.named(n) for n in ("runbrake.enqueue", "runbrake.run.segment", "execute_tool get-sum")]
        return [found[0] for found in wanted] if all(wanted) and len(receiver.named("chat scripted")) == 2 else None

    enqueue, segment, tool = poll_until(
        exported, timeout=30, failure=lambda: f"spans received: {[(s.service, s.name) for s in receiver.spans]}")
    trace_id = enqueue.trace_id
    assert (enqueue.service, segment.service) == ("runbrake", "runbrake-worker")
    assert enqueue.attributes["runbrake.run_id"] == run_id
    assert (segment.trace_id, segment.parent_id) == (trace_id, enqueue.span_id)
    assert (tool.trace_id, tool.parent_id) == (trace_id, segment.span_id)
    assert (tool.attributes["runbrake.tool.server"], tool.attributes["runbrake.tool.outcome"]) == ("toolbox", "ok")
    for model in receiver.named("chat scripted"):
        assert (model.trace_id, model.parent_id, model.attributes["gen_ai.system"]) == (
            trace_id, segment.span_id, "scripted")
    received = [e["args"]["traceparent"] for e in matching_events(toolbox_http.events, "traceparent")]
    assert received
    assert {value.split("-")[1] for value in received} == {trace_id}
    # The call's request was sent under the tool call's span: directly, or under the MCP SDK's own client span
    # for the request (mcp/shared/_otel.py), which the worker's provider records as the tool span's child.
    under_tool = {tool.span_id} | {s.span_id for s in receiver.spans if s.parent_id == tool.span_id}
    assert under_tool & {value.split("-")[2] for value in received}


CALLER = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
"""A backend's span, as its ``traceparent`` header names it (W3C Trace Context's own example ids)."""


@pytest.mark.integration
def test_a_run_posted_with_a_traceparent_header_continues_the_callers_trace_into_the_run_message(
    receiver: Receiver, store: RunStore, rabbitmq: Settings, toolbox_http: Toolbox,
    start_api: Callable[..., ApiProcess],
) -> None:
    api = start_api(**_traced(receiver))
    run_spec = spec({"toolbox": toolbox_http.spec}, [{"content": "It is 5."}])

    answer = httpx2.post(f"{api.url}/v1/runs", json=run_spec.raw, headers={"traceparent": CALLER}, timeout=30)

    assert answer.status_code == 201, answer.text
    run_id = answer.json()["run_id"]
    enqueue = poll_until(lambda: receiver.named("runbrake.enqueue"), timeout=30,
                         failure=lambda: f"spans received: {[(s.service, s.name) for s in receiver.spans]}")[0]
    assert (enqueue.trace_id, enqueue.parent_id) == (CALLER.split("-")[1], CALLER.split("-")[2])
    assert enqueue.attributes["runbrake.run_id"] == run_id
    [(body, _headers)] = take_messages(rabbitmq, Topology.of(rabbitmq).run_queue, 1)
    assert json.loads(body)["options"]["traceparent"].split("-")[1:3] == [enqueue.trace_id, enqueue.span_id]
