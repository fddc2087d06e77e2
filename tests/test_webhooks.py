"""Signed webhooks (docs/webhooks.md): a run's events POSTed to the webhooks its spec names, signed as the
Standard Webhooks specification says, at least once, in order per run, retried with backoff while the
receiver is down, and queryable with ``runbrake webhooks`` and ``GET /v1/webhooks``.

The receiver (tests/webhook_helpers.py) verifies every signature with the PyPI ``standardwebhooks``
package. Dispatchers run in this process over the real Redis, with short backoffs; runs are written
through the store as a worker writes them (claim, a step, settle), so many can finish at once.
"""

from __future__ import annotations

import json
import tomllib
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx2
import pytest

from runbrake.shared import RunStatus, RunStep, RunStore, Settings, StepKind, TerminationReason
from runbrake.shared.catalog import Admission, Catalog, CatalogFile
from runbrake.shared.errors import SpecError
from runbrake.shared.spec import RunSpec
from runbrake.worker.webhooks import WebhookDispatcher, backoff_s
from tests.api_helpers import ApiProcess, bearer
from tests.catalog_helpers import catalog_path, to_toml
from tests.events_helpers import position
from tests.polling import poll_until
from tests.test_cli import assert_clean_failure, runbrake, write_spec
from tests.webhook_helpers import Receiver, cataloged_receiver

pytestmark = pytest.mark.integration

RUNS = 10
SECRET_ENV = "RUNBRAKE_TEST_WEBHOOK_SECRET"
SCRIPTED = {"provider": "scripted", "turns": [{"content": "done"}]}


@pytest.fixture
def receiver(namespace: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Receiver]:
    """A receiver on a free port, the catalog's webhooks ``orders`` (run events only) and ``audit`` pointing at it."""
    with cataloged_receiver(monkeypatch.setenv, SECRET_ENV, orders=["run.*"], audit=["step.model"]) as hook:
        yield hook


@pytest.fixture
def dispatchers(settings: Settings, receiver: Receiver) -> Iterator[list[WebhookDispatcher]]:
    """Two dispatchers of this namespace (one delivers), backoff 0.05 s doubling to 0.5 s."""
    fast = settings.with_changes(webhook_backoff_s=0.05, webhook_backoff_max_s=0.5, webhook_timeout_s=5.0)
    stores = [RunStore.connect(fast) for _ in range(2)]
    started = [WebhookDispatcher(fast, store, CatalogFile(catalog_path())) for store in stores]
    for dispatcher in started:
        dispatcher.start()
    yield started
    for dispatcher in started:
        dispatcher.stop()
    for dispatcher, store in zip(started, stores, strict=True):
        dispatcher.join(15)
        assert not dispatcher.is_alive()
        store.close()


def _finish(store: RunStore, notify: list[str], tenant: str | None = None) -> str:
    """A run (of ``tenant``) naming these webhooks, taken to completed as a worker would: claim, one step, settle."""
    run_id = store.create({"input": "notify me", "model": SCRIPTED, "notify": notify}, tenant=tenant).run_id
    owner = f"test-{uuid.uuid4().hex[:8]}"
    assert store.claim(run_id, owner, lease_s=60).won
    store.append_step(run_id, RunStep(kind=StepKind.MODEL, round=1, content="done"))
    assert store.settle(run_id, RunStatus.COMPLETED, TerminationReason.COMPLETED, owner=owner).won
    return run_id


def _assert_in_order(receiver: Receiver, run_ids: list[str]) -> None:
    for run_id in run_ids:
        mine = receiver.of_run(run_id)
        assert [d.body["type"] for d in mine] == ["run.queued", "run.running", "run.completed"], run_id
        ids = [d.webhook_id for d in mine]
        assert ids == sorted(ids, key=position)
        for delivery in mine:
            assert delivery.body["event_id"] == delivery.webhook_id
            assert delivery.body["run_id"] == run_id


def _cli_deliveries(*args: str) -> list[dict[str, object]]:
    result = runbrake("webhooks", "--json", *args)
    assert result.returncode == 0, result.stderr
    listed: list[dict[str, object]] = json.loads(result.stdout)
    return listed


def test_runs_that_complete_are_delivered_signed_in_order_per_run_and_listed(
    dispatchers: list[WebhookDispatcher], receiver: Receiver, store: RunStore, rabbitmq: Settings,
    start_api: Callable[..., ApiProcess], tokens_file: Path,
) -> None:
    run_ids = [_finish(store, ["orders"]) for _ in range(RUNS)]
    unnotified = _finish(store, [])
    audited = _finish(store, ["audit"])

    poll_until(lambda: len(set(receiver.ids())) >= 3 * RUNS + 1, timeout=60,
               failure=lambda: f"{len(set(receiver.ids()))} of {3 * RUNS + 1} deliveries arrived")

    assert receiver.refused == []  # every signature verified by standardwebhooks
    _assert_in_order(receiver, run_ids)
    assert receiver.of_run(unnotified) == []
    assert [d.body["type"] for d in receiver.of_run(audited)] == ["step.model"]  # its events filter
    assert sorted(d.leading for d in dispatchers) == [False, True]

    listed = _cli_deliveries()
    assert len(listed) == 3 * RUNS + 1
    assert {d["status"] for d in listed} == {"delivered"}
    assert all(d["attempts"] == 1 and d["status_code"] == 204 for d in listed)
    assert "body" not in listed[0]
    assert _cli_deliveries("--failing") == []
    human = runbrake("webhooks")
    assert human.returncode == 0
    assert "delivered" in human.stdout
    assert run_ids[0] in human.stdout

    api = start_api(tokens=tokens_file)
    url = f"{api.url}/v1/webhooks"
    assert httpx2.get(url, timeout=10).status_code == 401  # the read role
    answer = httpx2.get(url, params={"limit": 5}, headers=bearer("reader"), timeout=10)
    assert answer.status_code == 200
    assert [d["event_id"] for d in answer.json()] == [d["event_id"] for d in listed[:5]]
    failing = httpx2.get(url, params={"failing": "true"}, headers=bearer("reader"), timeout=10)
    assert failing.json() == []
    assert httpx2.get(url, params={"limit": 0}, headers=bearer("reader"), timeout=10).status_code == 422


def test_a_receiver_down_then_up_gets_every_delivery_afterwards_and_failing_shows_it_meanwhile(
    dispatchers: list[WebhookDispatcher], receiver: Receiver, store: RunStore
) -> None:
    receiver.stop()  # refusing connections
    run_ids = [_finish(store, ["orders"]) for _ in range(RUNS)]

    def failing() -> list[dict[str, object]] | None:
        listed = _cli_deliveries("--failing")
        return listed if len(listed) >= RUNS and all(int(str(d["attempts"])) >= 2 for d in listed) else None

    down = poll_until(failing, timeout=60, failure=lambda: f"failing: {_cli_deliveries('--failing')}")
    assert {d["status"] for d in down} == {"retrying"}
    assert all("ConnectError" in str(d["error"]) for d in down)
    assert {d["type"] for d in down} == {"run.queued"}  # each run's next event waits for its first
    human = runbrake("webhooks", "--failing")
    assert "retrying" in human.stdout
    assert "ConnectError" in human.stdout

    receiver.start()
    poll_until(lambda: len(set(receiver.ids())) >= 3 * RUNS, timeout=60,
               failure=lambda: f"{len(set(receiver.ids()))} of {3 * RUNS} deliveries arrived")

    assert receiver.refused == []
    _assert_in_order(receiver, run_ids)
    poll_until(lambda: _cli_deliveries("--failing") == [], timeout=30,
               failure=lambda: f"still failing: {_cli_deliveries('--failing')}")


def test_a_delivery_past_its_retry_window_is_given_up_recorded_and_the_run_goes_on(
    settings: Settings, receiver: Receiver, store: RunStore
) -> None:
    receiver.answer = 500
    quick = settings.with_changes(webhook_backoff_s=0.5, webhook_backoff_max_s=0.5, webhook_retry_s=1)
    dispatcher = WebhookDispatcher(quick, RunStore.connect(quick), CatalogFile(catalog_path()))
    dispatcher.start()
    try:
        run_id = _finish(store, ["orders"])
        poll_until(lambda: len(_cli_deliveries("--failing")) == 3, timeout=60,
                   failure=lambda: f"failing: {_cli_deliveries('--failing')}")
    finally:
        dispatcher.stop()
        dispatcher.join(15)
    given_up = _cli_deliveries("--failing")
    assert {d["status"] for d in given_up} == {"gave_up"}
    assert {d["run_id"] for d in given_up} == {run_id}
    assert all(d["status_code"] == 500 and "HTTP 500" in str(d["error"]) for d in given_up)


def test_a_webhook_the_catalog_gave_to_some_tenants_gets_no_event_of_another_tenants_run(
    dispatchers: list[WebhookDispatcher], receiver: Receiver, store: RunStore
) -> None:
    """A run admitted before the operator gave the webhook to beta (or written past admission) is not delivered."""
    catalog = tomllib.loads(catalog_path().read_text())
    catalog["webhooks"]["orders"]["tenants"] = ["beta"]
    staged = catalog_path().with_suffix(".staged")
    staged.write_text(to_toml(catalog))
    staged.replace(catalog_path())

    alpha_run = _finish(store, ["orders"], tenant="alpha")
    untenanted = _finish(store, ["orders"])
    beta_run = _finish(store, ["orders"], tenant="beta")
    poll_until(lambda: len(receiver.of_run(beta_run)) >= 3, timeout=60,
               failure=lambda: f"{len(receiver.of_run(beta_run))} of beta's 3 deliveries arrived")

    # The outbox is read in order: the two earlier runs' events were read, and nothing of them was queued.
    assert {d["run_id"] for d in store.webhook_deliveries(count=100)} == {beta_run}
    assert receiver.of_run(alpha_run) == receiver.of_run(untenanted) == []


def test_a_spec_naming_an_unknown_webhook_is_refused_naming_the_field_and_nothing_is_written(
    receiver: Receiver, store: RunStore, rabbitmq: Settings, tmp_path: Path, start_api: Callable[..., ApiProcess]
) -> None:
    spec = {"input": "x", "model": SCRIPTED, "notify": ["orders", "missing"]}
    result = runbrake("enqueue", str(write_spec(tmp_path / "spec.json", spec)))
    assert_clean_failure(result, 2, "notify[1]", "'missing' is not a webhook of the catalog")
    url = {**spec, "notify": ["https://attacker.example/hook"]}
    result = runbrake("enqueue", str(write_spec(tmp_path / "url.json", url)))
    assert_clean_failure(result, 2, "notify[0]", "never a URL")

    api = start_api()
    answer = httpx2.post(f"{api.url}/v1/runs", json=spec, timeout=10)
    assert answer.status_code == 422
    assert [e["loc"] for e in answer.json()["errors"]] == [["notify", 1]]
    assert not list(store.redis.scan_iter(match=f"{store.namespace}:run:*"))


def test_admission_and_the_catalog_check_webhooks() -> None:
    catalog = Catalog.parse({"webhooks": {"orders": {"url": "https://hooks.example/x", "secret_env": "S",
                                                     "events": ["run.completed", "step.*"]}}})
    hook = catalog.webhooks["orders"]
    assert hook.wants("run.completed")
    assert hook.wants("step.tool")
    assert not hook.wants("run.failed")
    admission = Admission(source=catalog)
    admitted = admission.admit(RunSpec.parse({"input": "x", "model": SCRIPTED, "notify": ["orders"]}))
    assert admitted.spec.notify == ("orders",)
    with pytest.raises(SpecError) as refused:
        admission.admit(RunSpec.parse({"input": "x", "model": SCRIPTED, "notify": ["nope"]}))
    assert [p.loc for p in refused.value.problems] == [("notify", 0)]
    for bad in ({"url": "file:///etc/passwd", "secret_env": "S", "events": ["*"]},
                {"url": "https://x", "secret_env": "NOT-A-NAME", "events": ["*"]},
                {"url": "https://x", "secret_env": "S", "events": ["everything"]},
                {"url": "https://x", "secret_env": "S", "events": []}):
        with pytest.raises(Exception, match="webhooks"):
            Catalog.parse({"webhooks": {"w": bad}})
    settings = Settings()
    waits = [backoff_s(n, settings) for n in range(1, 12)]
    assert all(settings.webhook_backoff_s / 2 <= w <= settings.webhook_backoff_max_s for w in waits)
    assert waits[-1] >= settings.webhook_backoff_max_s / 2
