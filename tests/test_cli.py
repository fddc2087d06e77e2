"""The ``runbrake`` command as an operator uses it (docs/usage.md, "Using it").

Every test runs the real command in a subprocess with the test's environment (the
``namespace`` fixture puts ``RUNBRAKE_NAMESPACE`` there) and reads its exit code, stdout
and stderr. Exit codes: 0 success, 1 refused by the run's state, 2 bad input (nothing
written or sent), 3 a service could not be reached.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pika
import pika.exceptions
import pytest

from runbrake.shared import RunStatus, RunStep, RunStore, Settings, StepKind, TerminationReason, ToolResult
from runbrake.shared.messaging.producer import Producer
from tests.catalog_helpers import add_to_catalog
from tests.ports import free_port
from tests.worker_helpers import (
    WorkerProcess,
    spec,
)

_CONSOLE_SCRIPT = Path(sys.executable).parent / "runbrake"
_COMMAND = [str(_CONSOLE_SCRIPT)] if _CONSOLE_SCRIPT.exists() else [sys.executable, "-c",
                                                                       "from runbrake.broker.cli import main; main()"]
_CLI_TIMEOUT_S = 30.0
_RUN_ID = re.compile(r"^[0-9a-f]{32}$")
_DEAD_SERVER = {"url": "http://127.0.0.1:9/mcp"}

# The fields `show --json` promises (docs/usage.md, "Using it").
RUN_FIELDS = {"run_id", "status", "termination_reason", "created_at", "started_at", "finished_at", "error",
              "cancel", "input", "instructions", "labels", "model", "output", "output_json", "usage", "budget",
              "budget_use", "parent_run_id", "thread", "worker_losses", "lost_worker", "caller_run_id", "root_run_id",
              "depth", "children", "waiting_below", "steps"}
LISTED_FIELDS = (RUN_FIELDS - {"steps", "input", "instructions", "output", "output_json", "budget", "budget_use",
                                "children", "waiting_below"}
                 | {"input_preview"})
"""A run in a listing: without what a listing does not read (docs/http-api.md, "Runs: reading")."""
STEP_FIELDS = {"sequence", "kind", "round", "duration_ms", "recorded_at", "content", "detail", "outcome"}
TOOL_STEP_FIELDS = STEP_FIELDS | {"tool_server", "tool_name", "tool_call_id", "tool_is_error", "tool_outcome"}


def runbrake(*args: str, env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``runbrake ARGS`` as a user would, in this test's environment (plus ``env``)."""
    return subprocess.run(
        [*_COMMAND, *args], env={**os.environ, **(env or {})}, capture_output=True, text=True,
        timeout=_CLI_TIMEOUT_S, check=False,
    )


def start_runbrake(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([*_COMMAND, *args], env=dict(os.environ), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def assert_clean_failure(result: subprocess.CompletedProcess[str], code: int, *mentions: str) -> None:
    """Exit ``code``, one readable message on stderr naming each of ``mentions``, no traceback."""
    assert result.returncode == code, (result.returncode, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    for mention in mentions:
        assert mention in result.stderr, (mention, result.stderr)


def write_spec(path: Path, data: object) -> Path:
    path.write_text(data if isinstance(data, str) else json.dumps(data), encoding="utf-8")
    return path


def valid_spec() -> dict[str, Any]:
    """A spec naming the catalog server ``calc`` (written into the test's catalog when it has one)."""
    if "RUNBRAKE_CATALOG" in os.environ:
        add_to_catalog({"calc": _DEAD_SERVER})
    return {
        "input": "What is 2 + 3?",
        "model": {"provider": "scripted", "turns": [
            {"tool_calls": [{"server": "calc", "tool": "get-sum", "arguments": {"a": 2, "b": 3}}]},
            {"content": "It is 5."},
        ]},
        "mcp_servers": ["calc"],
    }


UNKNOWN_ID = "0123456789abcdef0123456789abcdef"
"""A well-formed run id that names no run."""


def queued_messages(settings: Settings) -> int | None:
    """Messages waiting in the namespace's run queue; None when the queue does not exist."""
    connection = pika.BlockingConnection(pika.URLParameters(settings.rabbitmq_url))
    try:
        declared = connection.channel().queue_declare(queue=f"{settings.namespace}.runs", passive=True)
    except pika.exceptions.ChannelClosedByBroker as exc:
        if exc.reply_code == 404:
            return None
        raise
    finally:
        if connection.is_open:
            connection.close()
    count: int = declared.method.message_count
    return count


def namespace_keys(store: RunStore) -> list[str]:
    return list(store.redis.scan_iter(f"{store.namespace}:*"))


def finished_run(store: RunStore, status: RunStatus = RunStatus.COMPLETED) -> str:
    """A run that went queued → running → ``status`` in the store."""
    run_id = store.create(valid_spec()).run_id
    assert store.claim(run_id, "test-owner", lease_s=60).won
    reason = TerminationReason.COMPLETED if status is RunStatus.COMPLETED else TerminationReason.TOOL_LOOP_ERROR
    assert store.settle(run_id, status, reason, owner="test-owner").won
    return run_id


def run_with_every_outcome(store: RunStore) -> str:
    """A cancelled run whose steps are a model call and three tool calls: ok, failed, cancelled."""
    run_id = store.create(valid_spec()).run_id
    assert store.claim(run_id, "test-owner", lease_s=60).won
    store.append_step(run_id, RunStep(kind=StepKind.MODEL, round=1, duration_ms=12,
                                      detail={"tool_calls": [{"server": "calc", "tool": "get-sum"}]}))
    for name, result in (("get-sum", ToolResult.ok("5")), ("fail", ToolResult.error("boom")),
                         ("slow", ToolResult.cancelled("cut off by a cancel"))):
        store.append_step(run_id, RunStep.tool(round=1, server="calc", name=name, result=result, duration_ms=7))
    assert store.cancel(run_id, reason="enough", requested_by="tester").won
    return run_id


# -- help ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", [[], ["enqueue"], ["cancel"], ["show"], ["runs"], ["servers"], ["webhooks"],
                                     ["approve"], ["deny"], ["steer"], ["worker"], ["demo"], ["continue"]],
                         ids=lambda c: " ".join(c) or "runbrake")
def test_runbrake_and_each_subcommand_explain_themselves_with_help(command: list[str]) -> None:
    result = runbrake(*command, "--help")

    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("Usage: ")
    assert result.stderr == ""


# -- enqueue -------------------------------------------------------------------------------------


@pytest.mark.integration
@pytest.mark.parametrize("as_json", [False, True], ids=["plain", "json"])
def test_enqueue_persists_a_queued_run_sends_one_message_and_prints_the_run_id(
    as_json: bool, store: RunStore, rabbitmq: Settings, tmp_path: Path
) -> None:
    spec_file = write_spec(tmp_path / "spec.json", valid_spec())

    result = runbrake("enqueue", str(spec_file), *(["--json"] if as_json else []))

    assert result.returncode == 0, result.stderr
    if as_json:
        printed = json.loads(result.stdout)
        run_id = printed["run_id"]
        assert printed["status"] == "queued"
    else:
        run_id = result.stdout.strip()
    assert _RUN_ID.fullmatch(run_id), result.stdout
    record = store.get(run_id)
    assert (record.status, record.started_at, record.steps) == (RunStatus.QUEUED, None, ())
    assert record.request == valid_spec()
    assert queued_messages(rabbitmq) == 1


@pytest.mark.integration
@pytest.mark.parametrize(("text", "field"), [
    ('{"input": "x", ', "spec"),
    (json.dumps({k: v for k, v in valid_spec().items() if k != "input"}), "input"),
    (json.dumps({**valid_spec(), "model": {"provider": "gemini", "model": "gemini-pro"}}), "model.provider"),
    (json.dumps({**valid_spec(), "model": {"provider": "scripted", "turns": [
        {"tool_calls": [{"server": "nowhere", "tool": "get-sum"}]}]}}), "model.turns[0].tool_calls[0].server"),
    (json.dumps({**valid_spec(), "max_rounds": 0}), "max_rounds"),
    (json.dumps({**valid_spec(), "colour": "blue"}), "colour"),
], ids=["invalid-json", "missing-input", "unknown-provider", "unknown-server", "max-rounds-0", "unknown-field"])
def test_a_bad_spec_exits_2_naming_the_field_and_nothing_is_written_or_sent(
    text: str, field: str, store: RunStore, rabbitmq: Settings, tmp_path: Path
) -> None:
    result = runbrake("enqueue", str(write_spec(tmp_path / "spec.json", text)))

    assert_clean_failure(result, 2, f"invalid spec: {field}:")
    assert result.stdout == ""
    assert namespace_keys(store) == []
    assert not queued_messages(rabbitmq)


@pytest.mark.integration
def test_enqueue_of_a_missing_file_exits_2_and_writes_nothing(
    store: RunStore, rabbitmq: Settings, tmp_path: Path
) -> None:
    missing = tmp_path / "no-such-spec.json"

    result = runbrake("enqueue", str(missing))

    assert_clean_failure(result, 2, str(missing))
    assert namespace_keys(store) == []
    assert not queued_messages(rabbitmq)


# -- unknown runs --------------------------------------------------------------------------------


@pytest.mark.integration
@pytest.mark.parametrize("command", ["show", "cancel", "approve", "deny"])
def test_a_command_on_an_unknown_run_exits_1_saying_there_is_no_such_run(
    command: str, store: RunStore, rabbitmq: Settings
) -> None:
    result = runbrake(command, "0123456789abcdef0123456789abcdef")

    assert_clean_failure(result, 1, "no run with id '0123456789abcdef0123456789abcdef'")
    assert namespace_keys(store) == []


# -- cancel --------------------------------------------------------------------------------------


@pytest.mark.integration
@pytest.mark.parametrize("status", [RunStatus.COMPLETED, RunStatus.FAILED])
def test_cancel_of_a_finished_run_exits_1_and_says_its_status(
    status: RunStatus, store: RunStore, rabbitmq: Settings
) -> None:
    run_id = finished_run(store, status)
    before = store.get(run_id)

    result = runbrake("cancel", run_id)

    assert_clean_failure(result, 1, f"already {status.value}")
    assert store.get(run_id) == before
    assert not store.cancel_requested(run_id)


@pytest.mark.integration
def test_cancel_json_of_a_queued_run_reports_the_win_and_the_confirmed_message(
    store: RunStore, rabbitmq: Settings
) -> None:
    run_id = store.create(valid_spec()).run_id

    result = runbrake("cancel", run_id, "--reason", "not needed", "--by", "tester", "--json")

    assert result.returncode == 0, result.stderr
    printed = json.loads(result.stdout)
    assert (printed["run_id"], printed["cancelled"], printed["found"], printed["message_confirmed"]) == (
        run_id, True, "queued", True)
    record = store.get(run_id)
    assert (record.status, record.termination_reason) == (RunStatus.CANCELLED, TerminationReason.CANCELLED)
    assert record.cancel is not None
    assert (record.cancel.reason, record.cancel.requested_by) == ("not needed", "tester")


@pytest.mark.integration
def test_racing_cancels_of_a_queued_run_have_one_winner_and_the_run_never_executes(
    producer: Producer, store: RunStore, start_worker: Callable[..., WorkerProcess]
) -> None:
    run_id = producer.enqueue(spec({"calc": _DEAD_SERVER}, valid_spec()["model"]["turns"])).run_id

    racers = [start_runbrake("cancel", run_id, "--by", f"racer-{n}") for n in range(8)]
    results = [(*racer.communicate(timeout=_CLI_TIMEOUT_S), racer.returncode) for racer in racers]

    codes = sorted(code for _, _, code in results)
    assert codes == [0] + [1] * 7, results
    for _, stderr, code in results:
        assert "Traceback" not in stderr
        if code == 1:
            assert f"run {run_id} is already cancelled" in stderr
    winner = next(n for n, (_, _, code) in enumerate(results) if code == 0)
    record = store.get(run_id)
    assert record.cancel is not None
    assert record.cancel.requested_by == f"racer-{winner}"

    worker = start_worker()
    skipped = worker.wait_for_log("run_message_skipped", run_id=run_id)

    assert skipped[0]["found"] == "cancelled"
    assert worker.logged("run_claimed", run_id=run_id) == []
    record = store.get(run_id)
    assert (record.status, record.started_at, record.steps) == (RunStatus.CANCELLED, None, ())


# -- show ----------------------------------------------------------------------------------------


@pytest.mark.integration
def test_show_json_prints_the_contract_fields_with_an_outcome_on_every_step(store: RunStore) -> None:
    run_id = run_with_every_outcome(store)

    result = runbrake("show", run_id, "--json")

    assert result.returncode == 0, result.stderr
    shown = json.loads(result.stdout)
    assert set(shown) == RUN_FIELDS | {"pending_call", "progress"}  # the two are null unless waiting / in flight
    assert (shown["run_id"], shown["status"], shown["termination_reason"]) == (run_id, "cancelled", "cancelled")
    assert shown["created_at"] <= shown["started_at"] <= shown["finished_at"]
    assert set(shown["cancel"]) == {"reason", "requested_by", "requested_at"}
    assert (shown["cancel"]["reason"], shown["cancel"]["requested_by"]) == ("enough", "tester")
    model, *tools = shown["steps"]
    assert set(model) == STEP_FIELDS
    assert (model["sequence"], model["kind"], model["round"], model["duration_ms"], model["outcome"]) == (
        1, "model", 1, 12, "")
    assert all(set(step) == TOOL_STEP_FIELDS for step in tools)
    assert [(s["sequence"], s["kind"], s["round"], s["duration_ms"], s["tool_server"], s["tool_name"],
             s["tool_is_error"], s["tool_outcome"], s["outcome"]) for s in tools] == [
        (2, "tool", 1, 7, "calc", "get-sum", False, "ok", "ok"),
        (3, "tool", 1, 7, "calc", "fail", True, "failed", "failed"),
        (4, "tool", 1, 7, "calc", "slow", True, "cancelled", "cancelled"),
    ]


@pytest.mark.integration
@pytest.mark.parametrize(("lang", "header", "outcomes"), [
    ("en", "Outcome", ["ok", "failed", "cancelled"]),
    ("de", "Ergebnis", ["ok", "fehlgeschlagen", "abgebrochen"]),
])
def test_show_prints_the_timeline_with_an_outcome_column_in_the_chosen_language(
    lang: str, header: str, outcomes: list[str], store: RunStore
) -> None:
    run_id = run_with_every_outcome(store)

    result = runbrake("show", run_id, "--lang", lang)

    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    heading = next(line for line in lines if line.startswith("#"))
    start, end = heading.index(header), heading.index("Detail")
    rows = lines[lines.index(heading) + 2:]
    assert [row[start:end].strip() for row in rows] == ["", *outcomes]


# -- runs ----------------------------------------------------------------------------------------


@pytest.mark.integration
def test_runs_json_lists_recent_runs_newest_first_and_filters_by_status(store: RunStore) -> None:
    queued = store.create(valid_spec()).run_id
    completed = finished_run(store)
    cancelled = store.create(valid_spec()).run_id
    assert store.cancel(cancelled, reason="x", requested_by="tester").won

    listed = runbrake("runs", "--json")
    only_cancelled = runbrake("runs", "--status", "cancelled", "--json")

    assert listed.returncode == only_cancelled.returncode == 0, (listed.stderr, only_cancelled.stderr)
    runs = json.loads(listed.stdout)
    assert [(r["run_id"], r["status"]) for r in runs] == [
        (cancelled, "cancelled"), (completed, "completed"), (queued, "queued")]
    assert all(set(r) == LISTED_FIELDS for r in runs)
    assert [r["run_id"] for r in json.loads(only_cancelled.stdout)] == [cancelled]


# -- configuration and services ------------------------------------------------------------------


@pytest.mark.parametrize("command", [["show", UNKNOWN_ID], ["runs"], ["servers"], ["cancel", UNKNOWN_ID],
                                     ["approve", UNKNOWN_ID], ["deny", UNKNOWN_ID], ["enqueue", "SPEC"]],
                         ids=lambda c: c[0])
def test_an_unreachable_redis_exits_3_with_a_message_naming_redis(
    command: list[str], namespace: str, tmp_path: Path
) -> None:
    args = [str(write_spec(tmp_path / "spec.json", valid_spec())) if a == "SPEC" else a for a in command]

    result = runbrake(*args, env={"RUNBRAKE_REDIS_URL": f"redis://127.0.0.1:{free_port()}/0"})

    assert_clean_failure(result, 3, "Redis")


def test_a_bad_namespace_exits_2_naming_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RUNBRAKE_NAMESPACE", "bad name!")

    result = runbrake("show", UNKNOWN_ID)

    assert_clean_failure(result, 2, "RUNBRAKE_NAMESPACE")


def test_catalog_check_lists_every_section_it_describes_webhooks_tenants_and_rabbitmq_users_too(
    tmp_path: Path,
) -> None:
    from runbrake.broker.cli import CATALOG_LINES
    from runbrake.shared.catalog import Catalog

    path = tmp_path / "catalog.toml"
    path.write_text("\n".join([
        '[mcp_servers.calc]', 'url = "http://127.0.0.1:9/mcp"',
        '[models.gpt]', 'provider = "openai"', 'base_url = "https://api.example/v1"', 'model = "gpt-x"',
        '[webhooks.orders]', 'url = "https://hooks.example/x"', 'secret_env = "ORDERS_SECRET"',
        'events = ["run.completed", "run.failed"]',
        '[tenants.acme]', 'max_runs_in_flight = 5', '[tenants.free]',
        '[rabbitmq_users]', 'billing = { tenant = "acme" }', '']))

    result = runbrake("catalog", "check", str(path), env={"ORDERS_SECRET": "whsec_x"})

    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        f"{path}: ok",
        "  server calc (http): http://127.0.0.1:9/mcp",
        "  model gpt: gpt-x at https://api.example/v1",
        "  webhook orders: https://hooks.example/x  events: run.completed, run.failed  secret: ${ORDERS_SECRET} (set)",
        "  tenant acme: max_runs_in_flight 5",
        "  tenant free: no quotas",
        "  rabbitmq user billing: tenant acme",
    ]
    # Every section --json shows has its lines in the text: a section added to the catalog cannot be left out.
    assert set(CATALOG_LINES) == set(Catalog.load(str(path)).describe())
