"""The HTTP API as its clients use it (docs/http-api.md): a real ``runbrake serve`` process on the real
Redis and RabbitMQ, real workers and MCP servers where a run must execute, plain HTTP from here."""

from __future__ import annotations

import json
import os
import subprocess
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx2
import pytest

from runbrake.broker import Client
from runbrake.broker.client import ApiError, Event, parse_events
from runbrake.shared import RunStatus, RunStep, RunStore, Settings, StepKind
from runbrake.shared.messaging.producer import Producer
from tests.api_helpers import TOKENS, ApiProcess, bearer, serve_command, write_tokens
from tests.mcp_helpers import Toolbox, wait_for_event
from tests.ports import free_port
from tests.test_cli import namespace_keys, queued_messages, runbrake, valid_spec
from tests.worker_helpers import WorkerProcess, call, spec, wait_for_run

pytestmark = pytest.mark.integration

JSON = {"Content-Type": "application/json"}
"""What every request with a body says (docs/http-api.md, "Requests")."""


def slow_spec(toolbox: Toolbox, seconds: float = 30) -> dict[str, Any]:
    return spec({"toolbox": toolbox.spec}, [{"tool_calls": [call("slow", seconds=seconds)]}, {"content": "done"}]).raw


def gated_spec(toolbox: Toolbox) -> dict[str, Any]:
    return spec({"toolbox": toolbox.spec}, [{"tool_calls": [call("get-sum", a=2, b=3)]}, {"content": "It is 5."}],
                approval_required=["toolbox.get-sum"]).raw


def events_until(client: Client, run_id: str, done: Callable[[list[Event]], bool], **kwargs: Any) -> list[Event]:
    """Read the run's events until ``done`` holds or the stream ends (the read is bounded by its timeout)."""
    seen: list[Event] = []
    for event in client.events(run_id, read_timeout_s=30, **kwargs):
        seen.append(event)
        if done(seen):
            break
    return seen


def next_event(stream: Iterator[Event], event_id: str, *, replayed_status: dict[str, str]) -> Event:
    """The step event ``event_id``, past repeats of the status the replay already sent: the claim's own
    "running" may reach the API's subscription after the client subscribed (on a cluster it travels the
    cluster bus to the API's node), and is then forwarded once more. Anything else first fails the test;
    each read is bounded by the stream's read timeout."""
    for seen in stream:
        if (seen.event, seen.id) == ("step", event_id):
            return seen
        assert (seen.event, seen.data) == ("status", replayed_status), f"before step {event_id}: {seen}"
    pytest.fail(f"the stream ended before step {event_id}")


# -- enqueue -------------------------------------------------------------------------------------


def test_enqueue_answers_201_with_the_run_and_a_repeated_key_200_or_409(
    api: ApiProcess, store: RunStore, rabbitmq: Settings
) -> None:
    body = json.dumps(valid_spec())
    with httpx2.Client(base_url=api.url) as http:
        first = http.post("/v1/runs", content=body, headers={"Idempotency-Key": "order-17", **JSON})
        again = http.post("/v1/runs", content=body, headers={"Idempotency-Key": "order-17", **JSON})
        in_body = http.post("/v1/runs", json={**valid_spec(), "idempotency_key": "order-17"})
        other = http.post("/v1/runs", json={**valid_spec(), "input": "something else"},
                          headers={"Idempotency-Key": "order-17"})

    assert first.status_code == 201, first.text
    run_id = first.json()["run_id"]
    assert first.json() == {"run_id": run_id, "status": "queued", "created": True}
    assert first.headers["location"] == f"/v1/runs/{run_id}"
    assert (again.status_code, again.json()) == (200, {"run_id": run_id, "status": "queued", "created": False})
    assert (in_body.status_code, in_body.json()["run_id"]) == (200, run_id)  # the header and the body key agree
    assert other.status_code == 409
    assert other.json()["run_id"] == run_id
    assert "different spec" in other.json()["error"]
    assert store.get(run_id).request == {**valid_spec(), "idempotency_key": "order-17"}
    assert queued_messages(rabbitmq) == 1


def test_an_invalid_spec_is_422_naming_every_field_and_nothing_is_written_or_sent(
    api: ApiProcess, store: RunStore, rabbitmq: Settings
) -> None:
    bad = {**valid_spec(), "max_rounds": "8", "tool_timeout_s": -1, "surprise": 1}
    with httpx2.Client(base_url=api.url) as http:
        invalid = http.post("/v1/runs", json=bad)
        not_json = http.post("/v1/runs", content=b"{not json", headers=JSON)
        bad_key = http.post("/v1/runs", json=valid_spec(), headers={"Idempotency-Key": "k" * 201})

    assert invalid.status_code == 422
    errors = invalid.json()["errors"]
    assert {tuple(e["loc"]) for e in errors} == {("max_rounds",), ("tool_timeout_s",), ("surprise",)}
    assert all(e["msg"] for e in errors)
    assert not_json.status_code == 422
    assert not_json.json()["errors"][0]["loc"] == ["spec"]
    assert bad_key.status_code == 422
    assert bad_key.json()["errors"][0]["loc"] == ["idempotency_key"]
    assert namespace_keys(store) == []
    assert queued_messages(rabbitmq) is None  # not even declared


def test_a_spec_above_max_spec_bytes_is_413_before_it_is_parsed(
    start_api: Callable[..., ApiProcess], store: RunStore, rabbitmq: Settings
) -> None:
    api = start_api(RUNBRAKE_MAX_SPEC_BYTES="2048")
    big = json.dumps({**valid_spec(), "input": "x" * 3000})

    def chunks() -> Any:  # no Content-Length: the limit holds while the body streams in
        yield big[:1000].encode()
        yield big[1000:].encode()

    with httpx2.Client(base_url=api.url) as http:
        declared = http.post("/v1/runs", content=big, headers=JSON)
        streamed = http.post("/v1/runs", content=chunks(), headers=JSON)
        garbage = http.post("/v1/runs", content=b"\xff" * 5000, headers=JSON)

    for response in (declared, streamed, garbage):
        assert response.status_code == 413, response.text
        assert "2048" in response.json()["error"]
    assert namespace_keys(store) == []


# -- reading -------------------------------------------------------------------------------------


def test_a_run_reads_as_show_json_and_unknown_or_malformed_ids_are_404_and_422(
    api: ApiProcess, store: RunStore
) -> None:
    run_id = store.create(valid_spec()).run_id
    store.append_step(run_id, RunStep(kind=StepKind.MODEL, round=1, content="hello"))
    with Client(api.url) as client:
        got = client.get(run_id)
        with pytest.raises(ApiError) as missing:
            client.get("0" * 32)
        with pytest.raises(ApiError) as malformed:
            client.get("not-a-run-id")

    shown = runbrake("show", run_id, "--json")
    assert shown.returncode == 0, shown.stderr
    assert got == json.loads(shown.stdout)
    assert got["pending_call"] is None
    assert got["progress"] is None
    assert missing.value.status_code == 404
    assert malformed.value.status_code == 422
    assert malformed.value.errors[0]["loc"] == ["path", "run_id"]


@pytest.mark.parametrize("settings", ["single", "cluster"], indirect=True)  # tests/cluster_helpers.py
def test_runs_are_listed_newest_first_in_pages_with_a_cursor_and_filtered_by_status(
    api: ApiProcess, store: RunStore
) -> None:
    ids = [store.create(valid_spec()).run_id for _ in range(7)]
    for run_id in ids[:3]:
        store.cancel(run_id, reason="x", requested_by="t")
    with Client(api.url) as client:
        pages, cursor = [], None
        while True:
            page = client.runs(limit=3, cursor=cursor)
            pages.append([r["run_id"] for r in page["runs"]])
            cursor = page["next_cursor"]
            if cursor is None:
                break
        cancelled = client.runs(status="cancelled", limit=2)
        rest = client.runs(status="cancelled", limit=2, cursor=cancelled["next_cursor"])
        with pytest.raises(ApiError) as bad_status:
            client.runs(status="sleeping")
        with pytest.raises(ApiError) as bad_cursor:
            client.runs(cursor="garbage!")

    assert [run_id for page in pages for run_id in page] == list(reversed(ids))
    assert [len(page) for page in pages] == [3, 3, 1]
    assert [r["run_id"] for r in cancelled["runs"] + rest["runs"]] == list(reversed(ids[:3]))
    assert all(r["status"] == "cancelled" for r in cancelled["runs"])
    assert set(cancelled["runs"][0]) == {"run_id", "status", "termination_reason", "created_at", "started_at",
                                         "finished_at", "error", "cancel", "labels", "model", "usage",
                                         "input_preview", "parent_run_id", "thread", "worker_losses", "lost_worker",
                                         "caller_run_id", "root_run_id", "depth"}
    assert (bad_status.value.status_code, bad_cursor.value.status_code) == (422, 422)


def test_servers_schema_openapi_health_and_metrics(api: ApiProcess, store: RunStore) -> None:
    run_id = store.create(valid_spec()).run_id
    store.append_step(run_id, RunStep.tool(round=1, server="calc", name="x", result=_ok()))
    with httpx2.Client(base_url=api.url) as http:
        servers = http.get("/v1/servers").json()
        schema = http.get("/v1/schema/run-spec").json()
        openapi = http.get("/openapi.json").json()
        health, ready = http.get("/healthz"), http.get("/readyz")
        metrics = http.get("/metrics").text

    assert servers == [
        {"server": "calc", "ok": 1, "failed": 0, "argument_errors": 0, "cancelled": 0, "side_effects_unknown": 0,
         "worker_lost": 0, "failure_rate": 0.0}]
    assert schema["$id"] == "urn:runbrake:run-spec"
    assert {"/v1/runs", "/v1/runs/{run_id}", "/v1/runs/{run_id}/events", "/v1/runs/{run_id}/cancel",
            "/v1/runs/{run_id}/approve", "/v1/runs/{run_id}/deny"} <= set(openapi["paths"])
    assert (health.status_code, ready.status_code, ready.json()) == (
        200, 200, {"ready": True, "redis": "ok", "rabbitmq": "ok", "events": "ok"})
    assert 'runbrake_api_requests_total{method="GET",route="/v1/servers",status="200"} 1.0' in metrics
    assert 'runbrake_api_request_seconds_count{method="GET",route="/v1/schema/run-spec"} 1.0' in metrics


def test_readyz_is_503_naming_rabbitmq_when_it_cannot_be_reached(
    start_api: Callable[..., ApiProcess]
) -> None:
    api = start_api(RUNBRAKE_RABBITMQ_URL=f"amqp://guest:guest@127.0.0.1:{free_port()}/")

    ready = httpx2.get(f"{api.url}/readyz", timeout=10)

    assert ready.status_code == 503
    assert ready.json()["redis"] == "ok"
    assert ready.json()["rabbitmq"].startswith("unreachable")
    assert httpx2.get(f"{api.url}/healthz").status_code == 200


def _ok() -> Any:
    from runbrake.shared import ToolResult

    return ToolResult.ok("1")


# -- events --------------------------------------------------------------------------------------


@pytest.mark.parametrize("settings", ["single", "cluster"], indirect=True)  # tests/cluster_helpers.py
def test_events_replay_the_steps_then_follow_live_and_end_right_after_the_terminal_status(
    api: ApiProcess, store: RunStore
) -> None:
    run_id = store.create(valid_spec()).run_id
    store.claim(run_id, "w", lease_s=60)
    store.append_step(run_id, RunStep(kind=StepKind.MODEL, round=1, content="one"))
    with Client(api.url) as client:
        stream = client.events(run_id, read_timeout_s=30)
        first = [next(stream) for _ in range(2)]  # the replayed step and the current status
        store.append_step(run_id, RunStep(kind=StepKind.MODEL, round=2, content="two"))
        live = next_event(stream, "2", replayed_status=first[1].data)
        store.cancel(run_id, reason="stop", requested_by="t")
        store.append_step(run_id, RunStep(kind=StepKind.MODEL, round=2, content="cut off by the cancel"))
        rest = list(stream)
        resumed = list(client.events(run_id, last_event_id=2))

    assert [(e.event, e.id, e.data.get("sequence")) for e in first] == [("step", "1", 1), ("status", None, None)]
    assert first[1].data == {"run_id": run_id, "status": "running", "termination_reason": ""}
    assert live.data["content"] == "two"
    assert live.data == {**store.get(run_id).steps[1].to_dict(), "outcome": ""}
    # What the cancel cut off (recorded after it) comes before the status, which ends the stream.
    assert [(e.event, e.data.get("status") or e.data.get("sequence")) for e in rest] == [
        ("step", 3), ("status", "cancelled"), ("end", None)]
    # Resuming after step 2: only step 3, then the status, then the end.
    assert [(e.event, e.id) for e in resumed] == [("step", "3"), ("status", None), ("end", None)]


def test_steps_recorded_while_clients_connect_reach_each_client_exactly_once_in_order(
    api: ApiProcess, store: RunStore
) -> None:
    run_id = store.create(valid_spec()).run_id
    store.claim(run_id, "w", lease_s=60)
    total = 60
    received: list[list[int]] = []
    lock = threading.Lock()

    def watch() -> None:
        with Client(api.url) as client:
            seqs = [int(e.id) for e in client.events(run_id, read_timeout_s=30) if e.event == "step" and e.id]
        with lock:
            received.append(seqs)

    watchers = [threading.Thread(target=watch) for _ in range(8)]
    for index in range(total):
        store.append_step(run_id, RunStep(kind=StepKind.MODEL, round=index, content=str(index)))
        if index % 8 == 0 and watchers[index // 8:index // 8 + 1]:
            watchers[index // 8].start()  # clients join while steps are being recorded
    store.cancel(run_id, reason="done", requested_by="t")
    for watcher in watchers:
        watcher.join(30)

    assert len(received) == 8
    for seqs in received:
        assert seqs == list(range(1, total + 1))


def test_a_client_that_does_not_read_is_dropped_and_the_others_keep_their_stream(
    api: ApiProcess, store: RunStore
) -> None:
    import socket

    run_id = store.create(valid_spec()).run_id
    store.claim(run_id, "w", lease_s=60)
    slow = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: a small window
    slow.connect(("127.0.0.1", int(api.url.rsplit(":", 1)[1])))
    slow.sendall(f"GET /v1/runs/{run_id}/events HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
    try:
        with Client(api.url) as client:
            stream = client.events(run_id, read_timeout_s=30)
            replayed = next(stream)  # the replay: no steps yet, the status; then live
            assert replayed.event == "status"
            big = "x" * 16_000
            for index in range(1500):  # 24 MB: more than the kernel's and uvicorn's buffers plus the queue
                store.append_step(run_id, RunStep(kind=StepKind.MODEL, round=index, content=big))
                next_event(stream, str(index + 1), replayed_status=replayed.data)
        metrics = httpx2.get(f"{api.url}/metrics").text
    finally:
        slow.close()

    assert "runbrake_api_event_clients_dropped_total 1.0" in metrics


def test_when_the_subscription_breaks_streams_reread_their_run_and_miss_nothing(
    api: ApiProcess, store: RunStore, settings: Settings
) -> None:
    run_id = store.create(valid_spec()).run_id
    store.claim(run_id, "w", lease_s=60)
    name = f"runbrake-api-events-{settings.namespace}"
    with Client(api.url) as client:
        stream = client.events(run_id, read_timeout_s=30)
        replayed = next(stream)
        assert replayed.event == "status"
        [hub] = [c for c in store.redis.client_list() if c.get("name") == name]
        store.redis.client_kill_filter(_id=hub["id"])  # this API's subscription only
        store.append_step(run_id, RunStep(kind=StepKind.MODEL, round=1, content="while it was gone"))
        # Published while the hub reconnected (the re-read replays it, then the status) or delivered live:
        # either way exactly once, in order; nothing but the unchanged status comes between.
        while_gone = next_event(stream, "1", replayed_status=replayed.data)
        store.append_step(run_id, RunStep(kind=StepKind.MODEL, round=2, content="after"))
        after = next_event(stream, "2", replayed_status=replayed.data)

    assert (while_gone.data["content"], after.data["content"]) == ("while it was gone", "after")
    assert api.log().count("event_hub_subscribed") == 2


# -- cancel, approve, deny -------------------------------------------------------------------------


def test_cancel_through_the_api_interrupts_the_call_and_the_stream_shows_it(
    api: ApiProcess, worker: WorkerProcess, toolbox_http: Toolbox, store: RunStore
) -> None:
    with Client(api.url) as client:
        run_id = client.enqueue(slow_spec(toolbox_http))["run_id"]
        wait_for_event(toolbox_http.events, "started", tool="slow", timeout=20)
        seen = events_until(client, run_id, lambda got: any(e.event == "progress" for e in got))
        cancelled = client.cancel(run_id, reason="from the test")
        # The cut-off call is recorded just after the cancel: a stream opened once it is shows it.
        record = wait_for_run(store, run_id, lambda r: any(s.kind is StepKind.TOOL for s in r.steps))
        rest = list(client.events(run_id, last_event_id=1))
        with pytest.raises(ApiError) as again:
            client.cancel(run_id)
        with pytest.raises(ApiError) as unknown:
            client.cancel("f" * 32)

    progress = next(e.data for e in seen if e.event == "progress")
    assert {k: progress[k] for k in ("tool_server", "tool_name")} == {"tool_server": "toolbox", "tool_name": "slow"}
    assert progress["total"] == 30
    assert progress["progress"] >= 1
    assert "of 30 s" in progress["message"]
    assert cancelled == {"run_id": run_id, "cancelled": True, "message_confirmed": True}
    assert record.status is RunStatus.CANCELLED
    assert record.cancel is not None
    assert (record.cancel.reason, record.cancel.requested_by) == (
        "from the test", "anonymous")
    assert [e.data["outcome"] for e in rest if e.event == "step"] == ["cancelled"]
    assert rest[-1].event == "end"
    assert again.value.status_code == 409
    assert again.value.body["status"] == "cancelled"
    assert unknown.value.status_code == 404
    wait_for_event(toolbox_http.events, "cancelled", tool="slow")
    assert record.progress is None  # forgotten before the cancelled step was recorded


def test_approve_and_deny_record_who_and_why_and_refuse_a_run_that_does_not_wait(
    start_api: Callable[..., ApiProcess], tokens_file: Path, worker: WorkerProcess, toolbox_http: Toolbox,
    store: RunStore,
) -> None:
    api = start_api(tokens=tokens_file)
    with Client(api.url, token=TOKENS["ops-alice"][0]) as client:
        approved_id = client.enqueue(gated_spec(toolbox_http))["run_id"]
        denied_id = client.enqueue(gated_spec(toolbox_http))["run_id"]
        for run_id in (approved_id, denied_id):
            wait_for_run(store, run_id, lambda r: r.status is RunStatus.WAITING_FOR_APPROVAL)
        waiting = client.get(approved_id)
        assert client.approve(approved_id, reason="looks right") == {"run_id": approved_id, "approved": True}
        assert client.deny(denied_id, reason="not today") == {"run_id": denied_id, "denied": True}
        approved = wait_for_run(store, approved_id)
        with pytest.raises(ApiError) as late:
            client.approve(approved_id)
        with pytest.raises(ApiError) as late_deny:
            client.deny(approved_id)

    assert waiting["pending_call"] == {"tool_server": "toolbox", "tool_name": "get-sum", "tool_call_id": "call_0_0",
                                       "arguments": {"a": 2, "b": 3}, "arguments_text": '{"a": 2, "b": 3}'}
    assert approved.status is RunStatus.COMPLETED
    approval = approved.steps[1]
    assert (approval.kind, approval.content) == (StepKind.APPROVAL, "looks right")
    assert {k: approval.detail[k] for k in ("decision", "decided_by", "reason")} == {
        "decision": "approved", "decided_by": "ops-alice", "reason": "looks right"}
    denial = store.get(denied_id).steps[-1]
    assert (denial.detail["decision"], denial.detail["decided_by"], denial.content) == (
        "denied", "ops-alice", "not today")
    assert late.value.status_code == 409
    assert late.value.body["status"] == "completed"
    assert late_deny.value.status_code == 409


# -- tokens ----------------------------------------------------------------------------------------


def test_tokens_are_required_and_each_role_allows_its_endpoints(
    start_api: Callable[..., ApiProcess], tokens_file: Path, store: RunStore
) -> None:
    api = start_api(tokens=tokens_file)
    run_id = store.create(valid_spec()).run_id
    with httpx2.Client(base_url=api.url) as http:
        anonymous = http.get(f"/v1/runs/{run_id}")
        wrong = http.get(f"/v1/runs/{run_id}", headers={"Authorization": "Bearer nope"})
        read = http.get(f"/v1/runs/{run_id}", headers=bearer("reader"))
        reader_submits = http.post("/v1/runs", json=valid_spec(), headers=bearer("reader"))
        submitter_cancels = http.post(f"/v1/runs/{run_id}/cancel", json={}, headers=bearer("submitter"))
        operator_cancels = http.post(f"/v1/runs/{run_id}/cancel", json={"reason": "ops"}, headers=bearer("ops-alice"))
        open_endpoints = [http.get(path).status_code for path in ("/healthz", "/readyz", "/metrics", "/")]

    assert (anonymous.status_code, wrong.status_code) == (401, 401)
    assert anonymous.headers["www-authenticate"].startswith("Bearer")
    assert read.status_code == 200
    assert (reader_submits.status_code, submitter_cancels.status_code) == (403, 403)
    assert "operate" in submitter_cancels.json()["error"]
    assert operator_cancels.status_code == 202
    assert store.get(run_id).cancel is not None
    assert store.get(run_id).cancel.requested_by == "ops-alice"  # type: ignore[union-attr]
    assert open_endpoints == [200, 200, 200, 200]


def serve_exit(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    environment = {**os.environ, **env}
    return subprocess.run(serve_command(*args), env=environment, capture_output=True, text=True, timeout=30,
                          check=False)


@pytest.mark.parametrize(("content", "mention"), [
    ("not = [toml", "not valid TOML"),
    ("[tokens.a]\nsha256 = \"abc\"\nroles = [\"read\"]\n", "64 hex characters"),
    (f"[tokens.a]\nsha256 = \"{'a' * 64}\"\nroles = [\"admin\"]\n", "unknown role(s) admin"),
    ("", "no [tokens.NAME] entry"),
], ids=["not-toml", "short-hash", "unknown-role", "empty"])
def test_a_bad_tokens_file_stops_serve_with_exit_2_naming_the_problem(
    tmp_path: Path, content: str, mention: str, namespace: str
) -> None:
    path = tmp_path / "tokens.toml"
    path.write_text(content)

    result = serve_exit("--port", str(free_port()), RUNBRAKE_API_TOKENS=str(path))

    assert result.returncode == 2
    assert mention in result.stderr
    assert str(path) in result.stderr
    assert "Traceback" not in result.stderr


def test_serve_refuses_a_non_loopback_host_without_tokens(namespace: str) -> None:
    environment = {k: v for k, v in os.environ.items() if k != "RUNBRAKE_API_TOKENS"}

    result = subprocess.run(serve_command("--host", "0.0.0.0", "--port", str(free_port())), env=environment,
                            capture_output=True, text=True, timeout=30, check=False)

    assert result.returncode == 2
    assert "refusing to serve on 0.0.0.0 without RUNBRAKE_API_TOKENS" in result.stderr


def test_without_tokens_serve_says_it_serves_loopback_only(api: ApiProcess) -> None:
    assert "no authentication: serving on loopback only" in api.log()


def test_the_client_parses_server_sent_events_like_a_browser() -> None:
    lines = iter(["retry: 1000", "", ": keepalive", "", "id: 4", "event: step", 'data: {"a":', "data: 1}", "",
                  "event: end", "data: {}", ""])

    assert list(parse_events(lines)) == [Event("step", {"a": 1}, "4"), Event("end", {}, None)]


def test_write_tokens_round_trips(tmp_path: Path) -> None:
    from runbrake.broker.auth import Tokens

    tokens = Tokens.load(write_tokens(tmp_path / "t.toml"))

    assert tokens.names == tuple(TOKENS)
    found = tokens.identify(TOKENS["reader"][0])
    assert found is not None
    assert found.roles == frozenset({"read"})
    assert tokens.identify("read-token-2") is None


def test_enqueue_through_the_client_runs_to_completion(
    api: ApiProcess, worker: WorkerProcess, toolbox_http: Toolbox, producer: Producer, store: RunStore
) -> None:
    with Client(api.url) as client:
        run_id = client.enqueue(spec({"toolbox": toolbox_http.spec},
                                     [{"tool_calls": [call("get-sum", a=1, b=2)]}, {"content": "3"}]))["run_id"]
        events = list(client.events(run_id))

    assert [e.event for e in events if e.event != "progress"][-1] == "end"
    assert [e.data["outcome"] for e in events if e.event == "step"] == ["", "ok", ""]
    statuses = [e.data["status"] for e in events if e.event == "status"]
    assert statuses[-1] == "completed"
