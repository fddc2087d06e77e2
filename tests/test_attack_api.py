"""Attacks on the HTTP API's request side (issue 15; docs/security.md, "Tested attacks"), each against a
real ``runbrake serve`` on the real Redis and RabbitMQ, with raw sockets where the attack is in how the
bytes arrive, and a real browser (Debian's chromium) for the cross-site requests.

The attacker has no token, or a token of their own; every test asserts what the attack gets now and
that nothing was written to Redis on its behalf.
"""

from __future__ import annotations

import base64
import contextlib
import http.server
import json
import random
import re
import select
import socket
import string
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx2
import pytest

from runbrake.shared import RunStatus, RunStore, Settings, StepKind
from tests.api_helpers import ApiProcess, bearer, write_tokens
from tests.ports import free_port
from tests.test_cli import namespace_keys, valid_spec
from tests.test_page import browser_fixture  # noqa: F401 - the fixture, for the cross-site test

pytestmark = pytest.mark.integration

JSON = {"Content-Type": "application/json"}
SOCKET_TIMEOUT_S = 10.0
"""Bound on every raw-socket read: a server that does not answer fails the test instead of hanging it."""
KNOWN_ROUTES = {"/v1/runs", "/v1/runs/{run_id}", "/v1/runs/{run_id}/events", "/v1/events",
                "/v1/runs/{run_id}/cancel", "/v1/runs/{run_id}/approve", "/v1/runs/{run_id}/deny",
                "/v1/servers", "/v1/webhooks", "/v1/schema/run-spec", "/healthz", "/readyz", "/metrics", "/",
                "/favicon.ico",
                "/page/{name}", "/openapi.json", "unmatched"}


def port_of(api: ApiProcess) -> int:
    return int(api.url.rsplit(":", 1)[1])


def connect(api: ApiProcess) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port_of(api)), timeout=SOCKET_TIMEOUT_S)
    sock.settimeout(SOCKET_TIMEOUT_S)
    return sock


def read_head(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """The status, headers (lowercase names) and whatever of the body came with them."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"the server closed the connection without an answer (got {data!r})"
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {name.strip().lower(): value.strip() for name, _, value in (line.partition(":") for line in lines)}
    return int(status_line.split(" ")[1]), headers, rest


def read_to_eof(sock: socket.socket) -> bytes:
    """Everything until the server closes the connection (bounded by the socket's timeout)."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def waiting_run(store: RunStore) -> str:
    """A run waiting for approval of one call, as a worker leaves it."""
    run_id = store.create(valid_spec()).run_id
    assert store.claim(run_id, "w", lease_s=60).won
    calls = [{"id": "c1", "server": "calc", "tool": "get-sum", "arguments": {"a": 2, "b": 3}}]
    assert store.suspend(run_id, "w", {"messages": [], "model_calls": 1, "pending_calls": calls}).won
    return run_id


def metric_labels(text: str, name: str) -> list[dict[str, str]]:
    """The label sets of every sample of the metric ``name`` in a Prometheus text page."""
    samples = re.findall(rf"^{name}\{{(.*?)\}} ", text, flags=re.MULTILINE)
    return [dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', labels)) for labels in samples]


# -- memory: bodies nobody reads ------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/runs", "/v1/runs/" + "0" * 32 + "/deny", "/v1/runs/" + "0" * 32 + "/cancel"])
def test_without_a_token_a_huge_declared_body_is_answered_401_before_it_is_sent(
    start_api: Callable[..., ApiProcess], tokens_file: Path, store: RunStore, path: str
) -> None:
    api = start_api(tokens=tokens_file)
    with connect(api) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     "Content-Length: 400000000\r\n\r\n".encode())
        status, headers, body = read_head(sock)  # not one byte of the 400 MB was sent
        rest = read_to_eof(sock)  # and the server does not wait for them: it closes the connection

    assert status == 401
    assert headers["connection"] == "close"
    assert "bearer token" in json.loads(body + rest)["error"]
    assert namespace_keys(store) == []


def test_without_a_token_a_chunked_body_is_answered_401_and_the_connection_closed(
    start_api: Callable[..., ApiProcess], tokens_file: Path, store: RunStore
) -> None:
    api = start_api(tokens=tokens_file)
    chunk = b"x" * 65536
    with connect(api) as sock:
        sock.sendall(b"POST /v1/runs/" + b"0" * 32 + b"/deny HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
        sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        status, headers, _ = read_head(sock)
        with contextlib.suppress(ConnectionResetError):  # the chunk the server never read may earn a reset
            read_to_eof(sock)

    assert (status, headers["connection"]) == (401, "close")
    assert namespace_keys(store) == []


def test_a_decision_body_above_its_bound_is_413_and_the_run_is_untouched(
    start_api: Callable[..., ApiProcess], tokens_file: Path, store: RunStore
) -> None:
    api = start_api(tokens=tokens_file)
    run_id = waiting_run(store)
    big = json.dumps({"reason": "x" * 100_000})

    def chunks() -> Iterator[bytes]:  # no Content-Length: the bound holds while the body streams in
        yield big[:5000].encode()
        yield big[5000:].encode()

    with httpx2.Client(base_url=api.url, headers={**bearer("ops-alice"), **JSON}) as http:
        declared = http.post(f"/v1/runs/{run_id}/deny", content=big)
        streamed = http.post(f"/v1/runs/{run_id}/approve", content=chunks())

    for response in (declared, streamed):
        assert response.status_code == 413, response.text
        assert response.json()["limit"] == 8192
    assert store.get(run_id).status is RunStatus.WAITING_FOR_APPROVAL


# -- cross-site requests: Content-Type ------------------------------------------------------------


def test_a_body_that_is_not_declared_json_is_415_and_nothing_is_written(api: ApiProcess, store: RunStore) -> None:
    run_id = waiting_run(store)
    before = sorted(namespace_keys(store))
    spec = json.dumps(valid_spec())
    with httpx2.Client(base_url=api.url) as http:
        plain = http.post("/v1/runs", content=spec, headers={"Content-Type": "text/plain"})
        form = http.post("/v1/runs", content=spec, headers={"Content-Type": "application/x-www-form-urlencoded"})
        untyped = http.post("/v1/runs", content=spec)
        bare_cancel = http.post(f"/v1/runs/{run_id}/cancel")  # what a no-cors cross-site POST can send
        plain_approve = http.post(f"/v1/runs/{run_id}/approve", content=b"{}", headers={"Content-Type": "text/plain"})
        bare_deny = http.post(f"/v1/runs/{run_id}/deny")

    for response in (plain, form, untyped, bare_cancel, plain_approve, bare_deny):
        assert response.status_code == 415, response.text
        assert "application/json" in response.json()["error"]
    assert sorted(namespace_keys(store)) == before
    assert store.get(run_id).status is RunStatus.WAITING_FOR_APPROVAL
    assert store.cancel_request(run_id) is None


def test_a_decision_with_content_type_json_and_no_body_is_accepted_as_an_empty_object(
    api: ApiProcess, store: RunStore
) -> None:
    run_id = waiting_run(store)
    with httpx2.Client(base_url=api.url) as http:
        not_json = http.post(f"/v1/runs/{run_id}/deny", content=b"reason", headers=JSON)
        not_an_object = http.post(f"/v1/runs/{run_id}/deny", content=b"[1]", headers=JSON)
        extra = http.post(f"/v1/runs/{run_id}/deny", json={"reason": "r", "who": "x"})
        denied = http.post(f"/v1/runs/{run_id}/deny", headers={"Content-Type": "application/json; charset=utf-8"})

    for response in (not_json, not_an_object, extra):
        assert response.status_code == 422, response.text
        assert response.json()["errors"][0]["loc"][0] == "body"
    assert denied.status_code == 200, denied.text
    record = store.get(run_id)
    assert record.status is RunStatus.FAILED
    assert [s.content for s in record.steps if s.kind is StepKind.APPROVAL] == ["denied by operator"]


def test_a_cross_site_page_cannot_create_or_approve_runs_in_a_real_browser(
    browser: Any, api: ApiProcess, store: RunStore
) -> None:
    """A page from another origin sends what needs no CORS preflight (``mode: "no-cors"``, text/plain): the
    browser sends it, the API refuses it (415), and Redis holds no new run and no approval."""
    run_id = waiting_run(store)
    before = sorted(namespace_keys(store))
    attack = {"api": api.url, "run_id": run_id, "spec": json.dumps(valid_spec())}
    page_html = ("<!doctype html><title>elsewhere</title><script>\n"
                 f"const attack = {json.dumps(attack)};\n" + """
async function send(path, init) {
  try { await fetch(attack.api + path, {mode: "no-cors", method: "POST", ...init}); return "sent"; }
  catch (error) { return "blocked: " + error; }
}
window.attack = (async () => [
  await send("/v1/runs", {headers: {"Content-Type": "text/plain"}, body: attack.spec}),
  await send("/v1/runs/" + attack.run_id + "/approve", {headers: {"Content-Type": "text/plain"}, body: "{}"}),
  await send("/v1/runs/" + attack.run_id + "/approve", {}),
])();
</script>""").encode()

    class Elsewhere(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(page_html)))
            self.end_headers()
            self.wfile.write(page_html)

        def log_message(self, *args: Any) -> None:
            pass

    other = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), Elsewhere)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    try:
        page = browser.new_page()
        page.set_default_timeout(30_000)
        page.goto(f"http://127.0.0.1:{other.server_address[1]}/")  # another port: another origin
        sent = page.evaluate("window.attack")
        page.close()
    finally:
        other.shutdown()
        other.server_close()

    assert sent == ["sent", "sent", "sent"]  # the browser let them go: only the API can refuse them
    metrics = httpx2.get(f"{api.url}/metrics").text
    refused = {(s["route"], s["status"]) for s in metric_labels(metrics, "runbrake_api_requests_total")
               if s["method"] == "POST"}
    assert refused == {("/v1/runs", "415"), ("/v1/runs/{run_id}/approve", "415")}
    assert sorted(namespace_keys(store)) == before
    record = store.get(run_id)
    assert record.status is RunStatus.WAITING_FOR_APPROVAL
    assert [s for s in record.steps if s.kind is StepKind.APPROVAL] == []


# -- DNS rebinding: Host ---------------------------------------------------------------------------


def test_without_tokens_only_loopback_hosts_are_served(api: ApiProcess, store: RunStore) -> None:
    port = port_of(api)
    with httpx2.Client(base_url=api.url) as http:
        foreign = [http.get("/v1/runs", headers={"Host": host})
                   for host in ("rebind.example", f"rebind.example:{port}", "127.0.0.1.rebind.example", "")]
        spec = http.post("/v1/runs", json=valid_spec(), headers={"Host": f"attacker.example:{port}"})
        loopback = [http.get("/v1/runs", headers={"Host": host})
                    for host in ("127.0.0.1", f"localhost:{port}", f"[::1]:{port}", "LOCALHOST")]

    for response in (*foreign, spec):
        assert response.status_code == 400, response.text
        assert "Host" in response.json()["error"]
    assert [r.status_code for r in loopback] == [200, 200, 200, 200]
    assert namespace_keys(store) == []


def test_with_tokens_any_host_is_served_unless_allowed_hosts_says_otherwise(
    start_api: Callable[..., ApiProcess], tokens_file: Path
) -> None:
    open_api = start_api(tokens=tokens_file)
    listed = start_api(tokens=tokens_file, RUNBRAKE_API_ALLOWED_HOSTS="api.example, ops.example:8443")
    read = bearer("reader")
    anywhere = httpx2.get(f"{open_api.url}/v1/runs", headers={**read, "Host": "whatever.example"})
    named = httpx2.get(f"{listed.url}/v1/runs", headers={**read, "Host": "api.example:9000"})
    with_port = httpx2.get(f"{listed.url}/v1/runs", headers={**read, "Host": "ops.example:8443"})
    wrong_port = httpx2.get(f"{listed.url}/v1/runs", headers={**read, "Host": "ops.example:8080"})
    loopback = httpx2.get(f"{listed.url}/v1/runs", headers={**read, "Host": "127.0.0.1"})
    probe = httpx2.get(f"{listed.url}/healthz", headers={"Host": "10.1.2.3:8080"})  # a kubelet's probe

    assert (anywhere.status_code, named.status_code, with_port.status_code) == (200, 200, 200)
    assert (wrong_port.status_code, loopback.status_code) == (400, 400)
    assert "error" in loopback.json()
    assert probe.status_code == 200


# -- metrics labels ---------------------------------------------------------------------------------


def test_random_methods_and_paths_do_not_grow_the_metrics(start_api: Callable[..., ApiProcess],
                                                          tokens_file: Path) -> None:
    api = start_api(tokens=tokens_file)
    rng = random.Random(15)
    with httpx2.Client(base_url=api.url) as http:
        http.get("/healthz")
        before = len(http.get("/metrics").text)
        for _ in range(300):
            method = "".join(rng.choices(string.ascii_uppercase, k=120))
            path = "/" + "".join(rng.choices(string.ascii_lowercase, k=40))
            http.request(method, rng.choice([path, "/v1/runs", "/healthz"]))
        after = http.get("/metrics").text

    samples = metric_labels(after, "runbrake_api_requests_total")
    assert {s["method"] for s in samples} <= {"GET", "other"}
    assert {s["route"] for s in samples} <= KNOWN_ROUTES
    assert len(samples) <= 12  # a handful of (method, route, status) series, whatever the requests said
    assert len(after) < before + 8000


# -- error shapes -----------------------------------------------------------------------------------


def test_unknown_routes_wrong_methods_and_bad_parameters_answer_in_the_error_shape(api: ApiProcess) -> None:
    with httpx2.Client(base_url=api.url) as http:
        unknown = http.get("/v1/nothing-here")
        wrong_method = http.delete("/v1/runs")
        bad_limit = http.get("/v1/runs", params={"limit": "many"})
        bad_file = http.get("/page/secrets.txt")

    assert (unknown.status_code, unknown.json()) == (404, {"error": "Not Found"})
    assert (wrong_method.status_code, wrong_method.json()) == (405, {"error": "Method Not Allowed"})
    assert wrong_method.headers["allow"]  # Starlette names the methods of the route it matched
    assert bad_limit.status_code == 422
    assert bad_limit.json()["errors"][0]["loc"] == ["query", "limit"]
    assert "error" in bad_limit.json()
    assert (bad_file.status_code, set(bad_file.json())) == (404, {"error"})


def cursor_of(document: str) -> str:
    return base64.urlsafe_b64encode(document.encode()).decode().rstrip("=")


@pytest.mark.parametrize("document", [
    '["nan", "%s"]', '[NaN, "%s"]', '[1e400, "%s"]', '[-Infinity, "%s"]', '[true, "%s"]', '["1", "%s"]',
    '[1, "%s", 3]', '{"a": 1, "b": "%s"}', '[1, ["%s"]]', "[" * 9000, "not json",
])
def test_a_malformed_cursor_is_422_naming_cursor_never_500_or_503(
    api: ApiProcess, store: RunStore, document: str
) -> None:
    run_id = store.create(valid_spec()).run_id
    cursor = cursor_of(document.replace("%s", run_id))  # "[" * 9000: deeper than Python's recursion limit
    response = httpx2.get(f"{api.url}/v1/runs", params={"cursor": cursor}, timeout=10)

    assert response.status_code == 422, response.text
    assert response.json()["errors"] == [
        {"loc": ["query", "cursor"], "msg": "pass next_cursor from the previous page unchanged"}]


def test_a_valid_cursor_still_pages(api: ApiProcess, store: RunStore) -> None:
    ids = {store.create(valid_spec()).run_id for _ in range(3)}
    with httpx2.Client(base_url=api.url) as http:
        first = http.get("/v1/runs", params={"limit": 2}).json()
        second = http.get("/v1/runs", params={"limit": 2, "cursor": first["next_cursor"]}).json()

    assert {r["run_id"] for r in first["runs"] + second["runs"]} == ids
    assert second["next_cursor"] is None


def test_a_store_error_answer_does_not_name_the_redis_address(
    start_api: Callable[..., ApiProcess], store: RunStore
) -> None:
    port = free_port()  # nothing listens there
    api = start_api(RUNBRAKE_REDIS_URL=f"redis://127.0.0.1:{port}/0", RUNBRAKE_REDIS_TIMEOUT_S="0.5")
    with httpx2.Client(base_url=api.url, timeout=20) as http:
        listing = http.get("/v1/runs")
        one = http.get("/v1/runs/" + "0" * 32)
        ready = http.get("/readyz")

    for response in (listing, one):
        assert response.status_code == 503, response.text
        assert set(response.json()) == {"error"}
    assert ready.status_code == 503
    for response in (listing, one, ready):
        assert str(port) not in response.text
        assert "127.0.0.1" not in response.text
    assert str(port) in api.log()  # the operator still learns where


def test_a_rabbitmq_error_answer_does_not_name_its_address(
    start_api: Callable[..., ApiProcess], store: RunStore
) -> None:
    port = free_port()  # nothing listens there
    api = start_api(RUNBRAKE_RABBITMQ_URL=f"amqp://guest:guest@127.0.0.1:{port}/")
    with httpx2.Client(base_url=api.url, timeout=30) as http:
        enqueued = http.post("/v1/runs", json=valid_spec())
        ready = http.get("/readyz")

    assert enqueued.status_code == 503, enqueued.text
    assert set(enqueued.json()) == {"error"}
    assert ready.status_code == 503
    assert ready.json()["rabbitmq"] == "unreachable"
    for response in (enqueued, ready):
        assert str(port) not in response.text
    [run] = store.recent()
    assert (run.status, run.termination_reason.value) == (RunStatus.FAILED, "enqueue_failed")


# -- idempotency keys ------------------------------------------------------------------------------


@pytest.mark.parametrize("settings", ["single", "cluster"], indirect=True)  # tests/cluster_helpers.py
def test_an_idempotency_key_belongs_to_the_token_that_used_it(
    start_api: Callable[..., ApiProcess], tmp_path: Path, store: RunStore, settings: Settings
) -> None:
    tokens = write_tokens(tmp_path / "two.toml", {
        "alice": ("alice-token", ["read", "submit"]), "mallory": ("mallory-token", ["read", "submit"])})
    api = start_api(tokens=tokens)
    spec = valid_spec()

    def submit(token: str, body: dict[str, Any]) -> httpx2.Response:
        return httpx2.post(f"{api.url}/v1/runs", json=body, timeout=10,
                           headers={"Authorization": f"Bearer {token}", "Idempotency-Key": "order-1"})

    alice = submit("alice-token", spec)
    alice_again = submit("alice-token", spec)
    mallory_same = submit("mallory-token", spec)
    mallory_other = submit("mallory-token", {**spec, "input": "something else"})

    assert (alice.status_code, mallory_same.status_code) == (201, 201)
    assert (alice_again.status_code, alice_again.json()["run_id"]) == (200, alice.json()["run_id"])
    assert mallory_same.json()["run_id"] != alice.json()["run_id"]
    assert mallory_other.status_code == 409  # mallory's own key, used with another spec
    assert mallory_other.json()["run_id"] == mallory_same.json()["run_id"]
    assert alice.json()["run_id"] not in mallory_other.text
    for answer in (alice, mallory_same):
        assert store.get(answer.json()["run_id"]).request == {**spec, "idempotency_key": "order-1"}


# -- slowloris ---------------------------------------------------------------------------------------


def test_a_client_that_dribbles_its_headers_is_cut_off(start_api: Callable[..., ApiProcess]) -> None:
    api = start_api(RUNBRAKE_API_HEADER_TIMEOUT_S="1")
    head = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n" + b"X-Slow: " + b"a" * 400 + b"\r\n\r\n"
    answer, reset = b"", False
    with connect(api) as sock:
        sent = 0
        while sent < len(head):
            readable, _, _ = select.select([sock], [], [], 0.05)  # the dribble's pace: listen, then one byte
            if readable:
                break
            try:
                sock.sendall(head[sent:sent + 1])
            except OSError:  # the server closed just before this byte, which it answered with a reset
                reset = True
                break
            sent += 1
        try:
            answer = read_to_eof(sock)
        except ConnectionResetError:
            reset = True

    assert sent < len(head), "the whole head went through: the server waited for it"
    # The 408 is lost only when a byte crossed the server's close (then the reset is the answer).
    assert answer.startswith(b"HTTP/1.1 408 ") or (reset and answer == b""), answer
    assert b'"error"' in answer or reset
    assert "api_header_timeout" in api.log()


def test_a_connection_that_sends_nothing_or_idles_after_a_request_is_closed(
    start_api: Callable[..., ApiProcess]
) -> None:
    api = start_api(RUNBRAKE_API_HEADER_TIMEOUT_S="1")
    with connect(api) as silent:
        assert read_to_eof(silent) == b""  # closed by the server within the socket's bound
    with connect(api) as kept:
        kept.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        status, _, _ = read_head(kept)
        kept.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.")  # the next request starts and stalls
        rest = read_to_eof(kept)

    assert status == 200
    assert b"408 " in rest


def test_the_openapi_document_describes_the_decision_bodies_and_the_415(api: ApiProcess) -> None:
    paths = httpx2.get(f"{api.url}/openapi.json").json()["paths"]
    for action in ("cancel", "approve", "deny"):
        post = paths[f"/v1/runs/{{run_id}}/{action}"]["post"]
        schema = post["requestBody"]["content"]["application/json"]["schema"]
        assert set(schema["properties"]) == {"reason"}
        assert {"413", "415"} <= set(post["responses"])
    assert {"413", "415"} <= set(paths["/v1/runs"]["post"]["responses"])
