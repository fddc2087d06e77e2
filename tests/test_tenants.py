"""Tenants (docs/http-api.md, "Tenants and quotas"; docs/security.md, "Tenants"): a tenant's token reaches only
its tenant's runs, another tenant's being answered exactly as a missing one; RabbitMQ requests take their tenant
from the user_id RabbitMQ checked; quotas refuse an enqueue atomically, with nothing written; a catalog entry for
some tenants is refused to every other run, as if missing; a tenant's feed replay reads only its own status changes,
and any replay scans a bounded part of the outbox.

Every test runs a real ``runbrake serve`` (and, for RabbitMQ, a real worker) on the shared Redis and RabbitMQ.
"""

from __future__ import annotations

import concurrent.futures
import json
import subprocess
import sys
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx2
import pytest

from runbrake.broker.auth import digest
from runbrake.broker.events import FEED_REPLAY_MAX_SCAN
from runbrake.shared import RunStatus, RunStep, RunStore, Settings, StepKind, TerminationReason
from runbrake.shared.messaging.producer import Producer
from runbrake.shared.messaging.wire import DEAD_REASON_HEADER, Topology
from runbrake.shared.tool_result import ToolResult
from tests.amqp_clients import CLIENTS
from tests.api_helpers import ApiProcess
from tests.catalog_helpers import catalog_path, to_toml
from tests.events_helpers import Frame, frames
from tests.mcp_helpers import Toolbox
from tests.polling import poll_until
from tests.test_cli import assert_clean_failure, runbrake, write_spec
from tests.worker_helpers import WorkerProcess, call, spec, take_messages, wait_for_run

pytestmark = pytest.mark.integration

TENANT_TOKENS = {
    "alpha-app": ("alpha-token", "alpha"),
    "beta-app": ("beta-token", "beta"),
    "ops": ("ops-token", None),
}
"""name → (token, tenant); every one may read, submit and operate."""

SPEC: dict[str, Any] = {"input": "hello", "model": {"provider": "scripted", "turns": [{"content": "hi"}]}}


def write_tenant_tokens(path: Path) -> Path:
    lines = []
    for name, (token, tenant) in TENANT_TOKENS.items():
        lines += [f"[tokens.{name}]", f'sha256 = "{digest(token)}"', 'roles = ["read", "submit", "operate"]']
        if tenant:
            lines.append(f'tenant = "{tenant}"')
        lines.append("")
    path.write_text("\n".join(lines), encoding="utf-8")
    return path


def set_catalog(**sections: dict[str, Any]) -> None:
    """Write these sections (``tenants``, ``rabbitmq_users``) into the test's catalog."""
    path = catalog_path()
    data = tomllib.loads(path.read_text()) if path.exists() else {}
    data.update(sections)
    staged = path.with_suffix(".staged")
    staged.write_text(to_toml(data))
    staged.replace(path)


def client(api: ApiProcess, name: str) -> httpx2.Client:
    return httpx2.Client(base_url=api.url, timeout=30.0,
                         headers={"Authorization": f"Bearer {TENANT_TOKENS[name][0]}"})


def enqueue(http: httpx2.Client, spec: dict[str, Any] | None = None) -> httpx2.Response:
    return http.post("/v1/runs", json=spec or SPEC)


@pytest.fixture(name="tenant_api")
def tenant_api_fixture(start_api: Callable[..., ApiProcess], tmp_path: Path) -> ApiProcess:
    return start_api(tokens=write_tenant_tokens(tmp_path / "tenant-tokens.toml"))


@pytest.fixture(name="clients")
def clients_fixture(tenant_api: ApiProcess) -> Iterator[dict[str, httpx2.Client]]:
    made = {name: client(tenant_api, name) for name in TENANT_TOKENS}
    yield made
    for http in made.values():
        http.close()


def test_a_tenants_runs_carry_its_label_and_a_spec_cannot_set_one(
    clients: dict[str, httpx2.Client], store: RunStore
) -> None:
    created = enqueue(clients["alpha-app"])
    assert created.status_code == 201, created.text

    assert store.get(created.json()["run_id"]).labels == {"tenant": "alpha"}
    refused = enqueue(clients["alpha-app"], {**SPEC, "labels": {"tenant": "beta"}})
    assert refused.status_code == 422
    assert [e["field"] for e in refused.json()["errors"]] == ["labels.tenant"]
    by_ops = enqueue(clients["ops"], {**SPEC, "labels": {"tenant": "alpha"}})
    assert by_ops.status_code == 422  # nobody names a tenant in a spec: it comes from the credential
    assert [r.run_id for r in store.recent(limit=10)] == [created.json()["run_id"]]


def test_another_tenants_run_is_answered_exactly_as_a_missing_one(
    clients: dict[str, httpx2.Client], store: RunStore
) -> None:
    alpha, beta, ops = clients["alpha-app"], clients["beta-app"], clients["ops"]
    run_id = enqueue(alpha).json()["run_id"]
    missing = "0" * 32

    for method, path in [("GET", "/v1/runs/{}"), ("GET", "/v1/runs/{}/events"), ("GET", "/v1/runs/{}/steps/1/messages"),
                         ("POST", "/v1/runs/{}/cancel"),
                         ("POST", "/v1/runs/{}/approve"), ("POST", "/v1/runs/{}/deny")]:
        body = {} if method == "POST" else None
        theirs = beta.request(method, path.format(run_id), json=body)
        absent = beta.request(method, path.format(missing), json=body)
        assert theirs.status_code == absent.status_code == 404, (path, theirs.text, absent.text)
        assert theirs.text == absent.text.replace(missing, run_id), path  # byte for byte, but for the id
    theirs = beta.post(f"/v1/runs/{run_id}/steer", json={"input": "x"})
    absent = beta.post(f"/v1/runs/{missing}/steer", json={"input": "x"})
    assert theirs.status_code == absent.status_code == 404
    assert theirs.text == absent.text.replace(missing, run_id)
    assert beta.get("/v1/runs").json()["runs"] == []
    assert beta.get("/v1/runs", params={"label": "tenant:alpha"}).json()["runs"] == []
    assert beta.get("/v1/webhooks").status_code == 403  # deliveries of every tenant's runs: an operator's
    assert store.status(run_id) is RunStatus.QUEUED  # nothing B asked changed it

    assert [r["run_id"] for r in alpha.get("/v1/runs").json()["runs"]] == [run_id]
    assert [r["run_id"] for r in ops.get("/v1/runs").json()["runs"]] == [run_id]
    assert alpha.get(f"/v1/runs/{run_id}").status_code == 200
    assert alpha.post(f"/v1/runs/{run_id}/approve", json={}).status_code == 409  # its own: not waiting
    assert alpha.post(f"/v1/runs/{run_id}/cancel", json={}).status_code == 202


def test_a_tenants_event_feed_hears_only_its_tenants_runs(clients: dict[str, httpx2.Client]) -> None:
    alpha, beta = clients["alpha-app"], clients["beta-app"]
    alpha_run = enqueue(alpha).json()["run_id"]

    with beta.stream("GET", "/v1/events", timeout=httpx2.Timeout(30.0)) as feed:
        assert feed.status_code == 200
        lines = feed.iter_lines()
        assert alpha.post(f"/v1/runs/{alpha_run}/cancel", json={}).status_code == 202
        beta_run = enqueue(beta).json()["run_id"]
        # Redis delivers in order: had alpha's cancel reached beta's feed, it would come first.
        first = next(json.loads(line[6:]) for line in lines if line.startswith("data: ") and "status" in line)
    assert (first["run_id"], first["status"]) == (beta_run, "queued")


def test_a_tenants_feed_replayed_from_last_event_id_holds_only_its_tenants_runs(
    clients: dict[str, httpx2.Client], store: RunStore, settings: Settings
) -> None:
    alpha, beta = clients["alpha-app"], clients["beta-app"]
    alpha_run = enqueue(alpha).json()["run_id"]
    beta_run = enqueue(beta).json()["run_id"]
    assert alpha.post(f"/v1/runs/{alpha_run}/cancel", json={}).status_code == 202
    assert beta.post(f"/v1/runs/{beta_run}/cancel", json={}).status_code == 202
    [(first_id, _fields)] = store.redis.xrange(f"{settings.namespace}:outbox", count=1)  # alpha's queued

    with beta.stream("GET", "/v1/events", headers={"Last-Event-ID": first_id}) as feed:
        assert feed.status_code == 200
        statuses = (json.loads(line[6:]) for line in feed.iter_lines() if line.startswith("data: ")
                    and '"status"' in line)
        replayed = [next(statuses), next(statuses)]
    assert [(e["run_id"], e["status"]) for e in replayed] == [(beta_run, "queued"), (beta_run, "cancelled")]


def test_a_quota_of_runs_in_flight_refuses_the_next_with_429_and_admits_it_once_a_run_ends(
    clients: dict[str, httpx2.Client], store: RunStore
) -> None:
    set_catalog(tenants={"alpha": {"max_runs_in_flight": 1}})
    alpha, beta = clients["alpha-app"], clients["beta-app"]
    first = enqueue(alpha).json()["run_id"]

    refused = enqueue(alpha)
    assert refused.status_code == 429, refused.text
    assert int(refused.headers["Retry-After"]) > 0
    assert (refused.json()["quota"], refused.json()["limit"]) == ("max_runs_in_flight", 1)
    assert [r.run_id for r in store.recent(limit=10)] == [first]  # nothing written
    assert enqueue(beta).status_code == 201  # another tenant's quota is its own
    assert store.in_flight("alpha") == 1

    assert alpha.post(f"/v1/runs/{first}/cancel", json={}).status_code == 202
    assert store.in_flight("alpha") == 0
    assert enqueue(alpha).status_code == 201


def test_an_enqueue_rate_quota_refuses_with_the_seconds_left_in_the_minute(
    clients: dict[str, httpx2.Client], store: RunStore
) -> None:
    set_catalog(tenants={"alpha": {"max_enqueues_per_minute": 1}})
    alpha = clients["alpha-app"]

    # One fits in a minute; the next meets the bound, unless a minute of Redis's clock turned in between,
    # which can happen once among a few quick tries.
    answers = [enqueue(alpha)]
    while answers[-1].status_code == 201 and len(answers) < 3:
        answers.append(enqueue(alpha))

    over = answers[-1]
    assert over.status_code == 429, [a.text for a in answers]
    assert 1 <= int(over.headers["Retry-After"]) <= 60
    assert (over.json()["quota"], over.json()["limit"]) == ("max_enqueues_per_minute", 1)
    assert len(store.recent(limit=10)) == len(answers) - 1  # the refused one wrote nothing


def test_concurrent_enqueues_against_a_quota_of_one_let_exactly_one_through(
    tenant_api: ApiProcess, store: RunStore
) -> None:
    set_catalog(tenants={"alpha": {"max_runs_in_flight": 1}})

    def attempt(_: int) -> int:
        with client(tenant_api, "alpha-app") as http:
            return enqueue(http).status_code

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        codes = sorted(pool.map(attempt, range(8)))

    assert codes == [201] + [429] * 7
    assert len(store.recent(limit=20)) == 1
    assert store.in_flight("alpha") == 1


# -- RabbitMQ ------------------------------------------------------------------------------------


def request_run(settings: Settings, body: dict[str, Any], *options: str) -> dict[str, Any]:
    sent = subprocess.run(
        [sys.executable, str(CLIENTS / "request_run.py"), settings.rabbitmq_url, settings.namespace, "-", *options],
        input=json.dumps(body), capture_output=True, text=True, timeout=90, check=False,
    )
    assert sent.returncode == 0, sent.stderr
    answer: dict[str, Any] = json.loads(sent.stdout)
    return answer


def cancel_request(settings: Settings, run_id: str, user: str | None) -> None:
    body = json.dumps({"run_id": run_id, "reason": f"asked by {user}"})
    sent = subprocess.run(
        [sys.executable, str(CLIENTS / "publish_cancel_request.py"), settings.rabbitmq_url, settings.namespace, body,
         *([user] if user else [])], capture_output=True, text=True, timeout=60, check=False,
    )
    assert sent.returncode == 0, sent.stderr


def rabbitmq_user(settings: Settings) -> str:
    """The user the tests connect to RabbitMQ as: the only user_id RabbitMQ lets them set."""
    return httpx2.URL(settings.rabbitmq_url).username or "guest"


def gated_spec(toolbox: Toolbox) -> dict[str, Any]:
    """A run that waits for approval before its one tool call: in flight until someone decides."""
    return spec({"toolbox": toolbox.spec}, [{"tool_calls": [call("get-sum", a=2, b=3)]}, {"content": "five"}],
                approval_required=["toolbox.get-sum"], labels={"kind": "test"}).raw


def waiting(store: RunStore, run_id: str) -> None:
    record = wait_for_run(store, run_id, lambda r: r.status is not RunStatus.QUEUED and r.status is not
                          RunStatus.RUNNING, timeout=60)
    assert record.status is RunStatus.WAITING_FOR_APPROVAL, record


def test_a_rabbitmq_users_requests_are_its_tenants_and_cannot_cancel_another_tenants_run(
    worker: WorkerProcess, toolbox_http: Toolbox, clients: dict[str, httpx2.Client], store: RunStore,
    rabbitmq: Settings,
) -> None:
    user = rabbitmq_user(rabbitmq)
    gated = gated_spec(toolbox_http)
    set_catalog(rabbitmq_users={user: {"tenant": "beta"}}, tenants={"beta": {"max_runs_in_flight": 1}})
    alpha_run = enqueue(clients["alpha-app"], gated).json()["run_id"]
    beta_run = request_run(rabbitmq, gated, "--user-id", user)["run_id"]
    waiting(store, alpha_run)
    waiting(store, beta_run)
    assert store.get(beta_run).labels == {"kind": "test", "tenant": "beta"}

    over = request_run(rabbitmq, gated, "--user-id", user)
    assert [e["loc"] for e in over["errors"]] == [["tenant"]], over
    assert "max_runs_in_flight" in over["errors"][0]["msg"]
    assert len(store.recent(limit=10)) == 2  # nothing written

    cancel_request(rabbitmq, alpha_run, user)  # beta's user, alpha's run: as if it did not exist
    cancel_request(rabbitmq, beta_run, user)  # then its own, which the one consumer takes after
    assert wait_for_run(store, beta_run, timeout=60).status is RunStatus.CANCELLED
    assert store.status(alpha_run) is RunStatus.WAITING_FOR_APPROVAL
    worker.wait_for_log("cancel_request_unknown_run", run_id=alpha_run)
    assert clients["beta-app"].get(f"/v1/runs/{beta_run}").status_code == 200
    assert clients["alpha-app"].get(f"/v1/runs/{beta_run}").status_code == 404
    # Its run ended: the quota admits the next request.
    assert request_run(rabbitmq, gated, "--user-id", user)["created"] is True


def test_untenanted_requests_are_refused_where_the_operator_says_so(
    start_worker: Callable[..., WorkerProcess], store: RunStore, rabbitmq: Settings
) -> None:
    worker = start_worker(RUNBRAKE_RABBITMQ_ALLOW_UNTENANTED="false")

    answer = request_run(rabbitmq, SPEC)
    assert [e["loc"] for e in answer["errors"]] == [["properties", "user_id"]], answer
    unmapped = request_run(rabbitmq, SPEC, "--user-id", rabbitmq_user(rabbitmq))
    assert [e["loc"] for e in unmapped["errors"]] == [["properties", "user_id"]], unmapped
    assert store.recent(limit=10) == []
    run_id = store.create(SPEC).run_id
    cancel_request(rabbitmq, run_id, None)
    [(_body, headers)] = take_messages(rabbitmq, Topology.of(rabbitmq).cancel_requests_dead_queue, 1, timeout=30)
    assert "RUNBRAKE_RABBITMQ_ALLOW_UNTENANTED" in headers[DEAD_REASON_HEADER]
    assert store.status(run_id) is RunStatus.QUEUED
    assert worker.process.poll() is None


def test_rabbitmq_refuses_a_user_id_that_is_not_the_connections_user(
    worker: WorkerProcess, rabbitmq: Settings
) -> None:
    """What the tenant of a request rests on: RabbitMQ itself checks user_id against the connection's user."""
    sent = subprocess.run(
        [sys.executable, str(CLIENTS / "request_run.py"), rabbitmq.rabbitmq_url, rabbitmq.namespace, "-",
         "--user-id", "someone-else"], input=json.dumps(SPEC), capture_output=True, text=True, timeout=90,
        check=False)
    assert sent.returncode == 1
    assert "PRECONDITION_FAILED" in sent.stderr or "406" in sent.stderr, sent.stderr


# -- catalog entries for some tenants ------------------------------------------------------------

NOWHERE = "http://127.0.0.1:9"
"""Where the scoped entries point: nothing listens there, and nothing of these tests may connect."""


def scope_catalog(common_tenants: list[str] | None = None) -> None:
    """Servers ``ours`` (alpha's), ``theirs`` (beta's) and ``common`` (every run's, unless ``common_tenants``),
    beta's model ``their-model`` and beta's webhook ``their-hook``."""
    common: dict[str, Any] = {"url": f"{NOWHERE}/common"}
    if common_tenants is not None:
        common["tenants"] = common_tenants
    set_catalog(
        mcp_servers={"ours": {"url": f"{NOWHERE}/ours", "tenants": ["alpha"]},
                     "theirs": {"url": f"{NOWHERE}/theirs", "tenants": ["beta"]}, "common": common},
        models={"their-model": {"provider": "openai", "base_url": f"{NOWHERE}/v1", "model": "m",
                                "api_key_env": "RUNBRAKE_TEST_THEIR_KEY", "tenants": ["beta"],
                                "caps": {"max_output_tokens": 100}}},
        webhooks={"their-hook": {"url": f"{NOWHERE}/hook", "secret_env": "RUNBRAKE_TEST_THEIR_SECRET",
                                 "events": ["*"], "tenants": ["beta"]}},
    )


THEIRS: dict[str, Any] = {"input": "x", "model": "their-model", "mcp_servers": ["theirs", "common"],
                          "notify": ["their-hook"]}
"""A spec naming each of beta's entries, and one every run may use."""


def test_a_tenants_run_naming_another_tenants_server_model_or_webhook_is_refused_as_if_it_did_not_exist(
    clients: dict[str, httpx2.Client], store: RunStore, tmp_path: Path
) -> None:
    scope_catalog()
    alpha, ops = clients["alpha-app"], clients["ops"]

    refused = enqueue(alpha, THEIRS)
    assert refused.status_code == 422, refused.text
    errors = {e["field"]: e["msg"] for e in refused.json()["errors"]}
    assert sorted(errors) == ["mcp_servers[0]", "model", "notify[0]"]
    # Word for word what a name the catalog lacks gets; the names listed are only those open to alpha.
    missing = enqueue(alpha, {"input": "x", "model": "nope", "mcp_servers": ["none", "common"], "notify": ["nil"]})
    absent = {e["field"]: e["msg"] for e in missing.json()["errors"]}
    assert errors["mcp_servers[0]"] == absent["mcp_servers[0]"].replace("'none'", "'theirs'")
    assert errors["mcp_servers[0]"].endswith("(it has common, ours)")
    assert errors["model"] == absent["model"].replace("'nope'", "'their-model'")
    assert errors["notify[0]"] == absent["notify[0]"].replace("'nil'", "'their-hook'")
    above_cap = enqueue(alpha, {"input": "x", "model": "their-model", "model_settings": {"max_output_tokens": 500}})
    assert [e["field"] for e in above_cap.json()["errors"]] == ["model"]  # its caps do not tell alpha it exists

    by_ops = enqueue(ops, THEIRS)  # a run of no tenant: only untenanted entries
    assert by_ops.status_code == 422
    assert sorted(e["field"] for e in by_ops.json()["errors"]) == ["mcp_servers[0]", "model", "notify[0]"]
    assert "mcp_servers.theirs.tenants" in by_ops.text
    cli = runbrake("enqueue", str(write_spec(tmp_path / "theirs.json", THEIRS)))
    assert_clean_failure(cli, 2, "mcp_servers[0]", "model", "notify[0]", "a run of no tenant may not use it")
    assert store.recent(limit=10) == []  # nothing written by any of them

    ours = enqueue(alpha, {**SPEC, "mcp_servers": ["ours", "common"]})
    assert ours.status_code == 201, ours.text
    assert enqueue(clients["beta-app"], THEIRS).status_code == 201  # beta's own entries
    # A continuation of alpha's own run is alpha's, and admitted as such.
    assert alpha.post(f"/v1/runs/{ours.json()['run_id']}/cancel", json={}).status_code == 202
    went_on = alpha.post(f"/v1/runs/{ours.json()['run_id']}/continue",
                         json={"input": "more", "mcp_servers": ["theirs"]})
    assert went_on.status_code == 422, went_on.text
    assert [e["field"] for e in went_on.json()["errors"]] == ["mcp_servers[0]"]
    assert len(store.recent(limit=10)) == 2


def test_a_tenant_lists_only_the_servers_open_to_it_with_counts_only_of_its_own(
    clients: dict[str, httpx2.Client], store: RunStore
) -> None:
    scope_catalog()
    run_id = store.create(SPEC).run_id
    for server in ("ours", "theirs", "common"):
        store.append_step(run_id, RunStep.tool(round=1, server=server, name="echo", result=ToolResult.ok("x")))

    alpha = clients["alpha-app"].get("/v1/servers")
    assert alpha.status_code == 200, alpha.text
    assert [(s["server"], s["ok"], s["failed"]) for s in alpha.json()] == [("common", None, None), ("ours", 1, 0)]
    beta = clients["beta-app"].get("/v1/servers").json()
    assert [(s["server"], s["ok"]) for s in beta] == [("common", None), ("theirs", 1)]
    assert [(s["server"], s["ok"]) for s in clients["ops"].get("/v1/servers").json()] == [
        ("common", 1), ("ours", 1), ("theirs", 1)]


def test_a_run_whose_server_became_another_tenants_after_it_was_queued_is_refused_at_claim(
    clients: dict[str, httpx2.Client], producer: Producer, worker: WorkerProcess, store: RunStore,
    rabbitmq: Settings,
) -> None:
    scope_catalog(common_tenants=["beta"])
    # Written as admission allowed it before the operator gave ``common`` to beta, then sent.
    run_id = store.create({**SPEC, "mcp_servers": ["common"]}, tenant="alpha").run_id
    producer.send(run_id)

    record = wait_for_run(store, run_id, timeout=60)
    assert (record.status, record.termination_reason) == (RunStatus.FAILED, TerminationReason.SPEC_REFUSED)
    assert "'common' is not in the catalog (it has ours)" in (record.error or "")  # read with the tenants
    assert record.steps == ()

    # Over RabbitMQ the tenant is the user's: alpha's user naming beta's server is refused, nothing written.
    user = rabbitmq_user(rabbitmq)
    set_catalog(rabbitmq_users={user: {"tenant": "alpha"}})
    answer = request_run(rabbitmq, {**SPEC, "mcp_servers": ["theirs"]}, "--user-id", user)
    assert [(e["loc"], e["msg"]) for e in answer["errors"]] == [
        (["mcp_servers", 0], "'theirs' is not in the catalog (it has ours)")], answer
    assert [r.run_id for r in store.recent(limit=10)] == [run_id]


def test_the_catalog_check_refuses_tenants_that_are_not_a_list_of_names_and_shows_them(tmp_path: Path) -> None:
    path = tmp_path / "catalog.toml"
    hook = {"url": f"{NOWHERE}/hook", "secret_env": "S", "events": ["*"]}
    path.write_text(to_toml({"mcp_servers": {"s": {"url": f"{NOWHERE}/s", "tenants": []}},
                             "webhooks": {"w": {**hook, "tenants": "alpha"}, "v": {**hook, "tenants": ["Alpha!"]}}}))
    assert_clean_failure(runbrake("catalog", "check", str(path)), 2,
                         "mcp_servers.s.tenants: names no tenant", "webhooks.w.tenants", "webhooks.v.tenants[0]")
    model = {"provider": "openai", "base_url": f"{NOWHERE}/v1", "model": "m", "api_key_env": "K"}
    path.write_text(to_toml({"models": {"m": {**model, "tenants": [""]}}}))
    assert_clean_failure(runbrake("catalog", "check", str(path)), 2, "models.m.tenants[0]: a tenant is")

    path.write_text(to_toml({"mcp_servers": {"s": {"url": f"{NOWHERE}/s", "tenants": ["alpha", "beta"]}},
                             "models": {"m": {**model, "tenants": ["alpha"]}},
                             "webhooks": {"w": {**hook, "tenants": ["beta"]}, "v": hook}}))
    shown = runbrake("catalog", "check", "--json", str(path))
    assert shown.returncode == 0, shown.stderr
    described = json.loads(shown.stdout)
    assert described["mcp_servers"]["s"]["tenants"] == ["alpha", "beta"]
    assert described["models"]["m"]["tenants"] == ["alpha"]
    assert (described["webhooks"]["w"]["tenants"], described["webhooks"]["v"]["tenants"]) == (["beta"], None)
    human = runbrake("catalog", "check", str(path))
    assert "tenants: alpha, beta" in human.stdout, human.stdout


# -- the feed's replay reads only what the tenant may see ----------------------------------------


def replayed(api: ApiProcess) -> list[dict[str, Any]]:
    """What ``serve`` logged of each feed replay it finished (``feed_replayed``: scanned, read, sent, bounded)."""
    lines = (line for line in api.log().splitlines() if line.startswith("{"))
    return [entry for entry in map(json.loads, lines) if entry.get("event") == "feed_replayed"]


def replay_then_live(http: httpx2.Client, after: str, count: int, live: Callable[[], str]) -> list[Frame]:
    """The first ``count`` frames a replay from ``after`` sends (the last of them read in the replay's last page,
    so the replay ends there), then what comes until the status of the run ``live()`` makes."""
    with http.stream("GET", "/v1/events", headers={"Last-Event-ID": after}) as response:
        assert response.status_code == 200
        stream = frames(response)
        seen = [next(stream) for _ in range(count)]
        run_id = live()
        for more in stream:
            seen.append(more)
            if more.event == "status" and more.data["run_id"] == run_id:
                return seen
    raise AssertionError("the feed ended before the live run's status")


def test_a_tenants_replay_reads_only_its_tenants_status_changes_whatever_another_tenant_did(
    tenant_api: ApiProcess, clients: dict[str, httpx2.Client], store: RunStore, settings: Settings
) -> None:
    """Issue 27: a tenant's replay read every tenant's outbox (47 MB a request); now Redis hands ``serve`` only
    the tenant's status changes."""
    alpha, beta = clients["alpha-app"], clients["beta-app"]
    beta_run = enqueue(beta).json()["run_id"]
    [(first_id, _fields)] = store.redis.xrange(f"{settings.namespace}:outbox", count=1)  # beta's queued
    alpha_run = enqueue(alpha).json()["run_id"]
    for n in range(150):  # alpha's backlog: 600 KB of steps
        store.append_step(alpha_run, RunStep(kind=StepKind.MODEL, round=n, content="a" * 4_000))
    assert alpha.post(f"/v1/runs/{alpha_run}/cancel", json={}).status_code == 202
    assert beta.post(f"/v1/runs/{beta_run}/cancel", json={}).status_code == 202  # the last entry

    seen = replay_then_live(beta, first_id, 1, lambda: enqueue(beta).json()["run_id"])

    assert [(f.data["run_id"], f.data["status"]) for f in seen[:-1]] == [(beta_run, "cancelled")]
    poll_until(lambda: replayed(tenant_api), timeout=30, failure=lambda: tenant_api.log()[-2_000:])
    [logged] = replayed(tenant_api)
    # Every entry after the id was scanned in Redis (alpha's queued, 150 steps, two cancels); serve read one.
    assert (logged["tenant"], logged["scanned"], logged["read"], logged["sent"]) == ("beta", 153, 1, 1)
    assert logged["bounded"] is False


def test_a_replay_scans_at_most_its_bound_and_then_asks_the_client_to_read_the_list_again(
    tenant_api: ApiProcess, clients: dict[str, httpx2.Client], store: RunStore, settings: Settings
) -> None:
    alpha, beta = clients["alpha-app"], clients["beta-app"]
    beta_run = enqueue(beta).json()["run_id"]
    alpha_run = enqueue(alpha).json()["run_id"]
    store.append_step(alpha_run, RunStep(kind=StepKind.MODEL, round=1, content="a" * 1_000))
    outbox = f"{settings.namespace}:outbox"
    entries = store.redis.xrange(outbox)
    first_id, (_step_id, step_fields) = entries[0][0], entries[-1]
    with store.redis.pipeline(transaction=False) as pipe:  # alpha's traffic: its step's entry 10,000 times more
        for _ in range(FEED_REPLAY_MAX_SCAN):
            pipe.xadd(outbox, step_fields)
        pipe.execute()
    assert beta.post(f"/v1/runs/{beta_run}/cancel", json={}).status_code == 202  # past the bound

    seen = replay_then_live(beta, first_id, 1, lambda: enqueue(beta).json()["run_id"])

    assert [(f.event, f.data) for f in seen[:-1]] == [
        ("resync", {"reason": f"more than {FEED_REPLAY_MAX_SCAN} events to replay; read the list again"})]
    poll_until(lambda: replayed(tenant_api), timeout=30, failure=lambda: tenant_api.log()[-2_000:])
    [logged] = replayed(tenant_api)
    assert (logged["scanned"], logged["read"], logged["bounded"]) == (FEED_REPLAY_MAX_SCAN, 0, True)
    # The list the client reads again has beta's run as it is now.
    assert [(r["run_id"], r["status"]) for r in beta.get("/v1/runs").json()["runs"]][-1] == (beta_run, "cancelled")
