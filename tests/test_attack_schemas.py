"""Attacks with a JSON Schema (issue 27, findings 1 and 2; docs/security.md, "Tested attacks"): an
``output_schema`` that is costly to check, or an answer that is costly to validate against one, never holds a
process that serves others. Each is checked in a child process within ``RUNBRAKE_SCHEMA_CHECK_S``
(shared/schema_check.py), against the real worker, ``runbrake serve``, RabbitMQ and Redis.

Before, the worker validated the answer on its event loop (``^(a+)+$`` against 31 characters froze it
116 s) and ``check_schema`` ran inside the spec's parse, before the byte bound, on ``serve``'s loop (a 450 KB
``allOf`` froze it 50 s).
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

import httpx2
import pytest

from runbrake.broker.api import AMQP_THREADS
from runbrake.shared import RunStatus, RunStore, Settings, StepKind, TerminationReason
from runbrake.shared.messaging.cancel import CancelPublisher, cancel_run
from runbrake.shared.messaging.producer import Producer
from runbrake.worker.structured import INTERRUPTED_CHECK
from tests.api_helpers import ApiProcess
from tests.polling import poll_until
from tests.ports import free_port
from tests.test_run_requests import answered
from tests.worker_helpers import WorkerProcess, spec, wait_for_run

pytestmark = pytest.mark.integration

BACKTRACKING = {"type": "string", "pattern": "^(a+)+$"}
"""A pattern Python's ``re`` needs 2^n steps for on ``"a" * n + "!"``."""
BACKTRACKED = json.dumps("a" * 40 + "!")
"""An answer ``re`` would take days of CPU to refuse against :data:`BACKTRACKING`."""
UNIQUE = {"type": "array", "uniqueItems": True}
DISTINCT = json.dumps([{"k": i} for i in range(8000)], separators=(",", ":"))
"""8,000 distinct objects: jsonschema compares each pair (4,000 held a worker 33 s)."""
COSTLY_SCHEMA = {"allOf": [{}] * 21_000}
"""63 KB, within the 64 KiB bound: ``check_schema`` of it takes about 5 s of a core on this machine quiet, more
beside other work: the tests give it a bound well below that."""
CHECK_S = 20
"""RUNBRAKE_SCHEMA_CHECK_S of the worker under attack: far longer than an innocent run takes."""
WAIT_S = 15.0


def scripted(*turns: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"input": "x", "model": {"provider": "scripted", "turns": list(turns)}, **extra}


def refused_for(answer: dict[str, Any]) -> dict[str, str]:
    """A 422's (or a refused run request's) problems, by field."""
    return {".".join(str(part) for part in error["loc"]): error["msg"] for error in answer["errors"]}


def test_answers_that_take_long_to_validate_stall_no_other_run_and_are_handed_back_at_the_bound(
    start_worker: Any, producer: Producer, store: RunStore, rabbitmq: Settings
) -> None:
    """Another run completes, and another is cancelled mid-call, while the worker still validates a
    backtracking pattern and a ``uniqueItems`` answer; /healthz answers. A cancel cuts a check off at once;
    an answer not validated within the bound is handed back saying so."""
    health_port = free_port()
    worker: WorkerProcess = start_worker(RUNBRAKE_SCHEMA_CHECK_S=str(CHECK_S), RUNBRAKE_HEALTH_PORT=str(health_port))
    pattern = producer.enqueue(spec({}, [{"content": BACKTRACKED}], output_schema=BACKTRACKING, max_rounds=1))
    unique = producer.enqueue(spec({}, [{"content": DISTINCT}], output_schema=UNIQUE, max_rounds=1))
    for attack in (pattern, unique):
        worker.wait_for_log("run_claimed", run_id=attack.run_id, timeout=WAIT_S)

    other = producer.enqueue(spec({}, [{"content": "done"}]))
    completed = wait_for_run(store, other.run_id, timeout=WAIT_S)
    slow = producer.enqueue(spec({}, [{"content": "late", "delay_ms": 600_000}]))
    wait_for_run(store, slow.run_id, lambda record: record.status is RunStatus.RUNNING, timeout=WAIT_S)
    publisher = CancelPublisher(rabbitmq)
    try:
        assert cancel_run(store, publisher, slow.run_id, reason="test", requested_by="test").won
    finally:
        publisher.close()
    cancelled = worker.wait_for_log("run_segment_ended", run_id=slow.run_id, timeout=WAIT_S)[0]
    healthz = httpx2.get(f"http://127.0.0.1:{health_port}/healthz", timeout=WAIT_S)

    # The answers are validated still: their model steps are recorded only once they are (worker/loop.py).
    attacks = [store.get(attack.run_id) for attack in (pattern, unique)]
    assert [(record.status, record.steps) for record in attacks] == [(RunStatus.RUNNING, ())] * 2
    assert (completed.status, completed.output) == (RunStatus.COMPLETED, "done")
    assert cancelled["outcome"] == "cancelled"  # its model call in flight was cut off
    assert healthz.status_code == 200

    publisher = CancelPublisher(rabbitmq)
    try:
        assert cancel_run(store, publisher, unique.run_id, reason="test", requested_by="test").won
    finally:
        publisher.close()
    assert worker.wait_for_log("run_segment_ended", run_id=unique.run_id, timeout=WAIT_S)[0]["outcome"] == "cancelled"

    ended = wait_for_run(store, pattern.run_id, timeout=CHECK_S + 60)
    assert (ended.status, ended.termination_reason) == (RunStatus.FAILED, TerminationReason.MAX_ROUNDS)
    assert ended.steps[0].detail["output_error"] == (
        f"the answer could not be validated against the output schema within {CHECK_S} s (RUNBRAKE_SCHEMA_CHECK_S)")


def schema_children_of(pid: int) -> set[int]:
    """The checking processes (shared/schema_check.py) a process started, from /proc."""
    found = set()
    for entry in Path("/proc").iterdir():
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid == pid and b"_schema_child.py" in (entry / "cmdline").read_bytes():
                found.add(int(entry.name))
        except (OSError, ValueError, IndexError):
            continue
    return found


def cpu_seconds(pid: int) -> float:
    """The CPU time a process has spent so far (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_a_worker_that_stops_mid_validation_kills_the_check_and_exits_cleanly(
    start_worker: Any, producer: Producer, store: RunStore
) -> None:
    """SIGTERM while an answer is validated within a bound of ten minutes: the hand-over cuts the check off
    like a call in flight (its child killed), the answer is handed back as not validated and the run goes
    back to the queue for another worker; the worker exits cleanly, at once (before: never by itself)."""
    worker: WorkerProcess = start_worker(RUNBRAKE_SCHEMA_CHECK_S="600", RUNBRAKE_DRAIN_S="1")
    pattern = producer.enqueue(spec({}, [{"content": BACKTRACKED}], output_schema=BACKTRACKING, max_rounds=2))
    worker.wait_for_log("run_claimed", run_id=pattern.run_id, timeout=WAIT_S)
    # A child that has spent a second of CPU is in the backtracking match (it starts in a quarter of that, and
    # checks the schema in milliseconds). A bound for a loaded machine: the child may get a tenth of a CPU.
    validating = poll_until(lambda: {pid for pid in schema_children_of(worker.pid) if cpu_seconds(pid) > 1.0},
                            timeout=60, failure=lambda: "no checking process is validating the answer")

    assert worker.stop() == 0
    assert {pid for pid in validating if Path(f"/proc/{pid}").exists()} == set()
    handed = store.get(pattern.run_id)
    assert handed.status is RunStatus.QUEUED
    assert [(step.kind, step.detail.get("output_error")) for step in handed.steps] == [
        (StepKind.MODEL, INTERRUPTED_CHECK), (StepKind.HANDOFF, None)]


def test_schemas_too_costly_to_check_are_refused_422_naming_them_while_serve_answers_healthz_and_cancels(
    start_api: Any, store: RunStore
) -> None:
    """More costly schemas at once than serve has threads that publish (AMQP_THREADS): /healthz and a cancel are
    answered while every one is still checked, each is refused naming output_schema, nothing is written."""
    api: ApiProcess = start_api(RUNBRAKE_ALLOW_INLINE="true", RUNBRAKE_SCHEMA_CHECK_S="5")
    queued = store.create(scripted({"content": "{}"})).run_id
    answers: list[httpx2.Response] = []
    posts = [threading.Thread(target=lambda: answers.append(httpx2.post(
        f"{api.url}/v1/runs", json=scripted({"content": "{}"}, output_schema=COSTLY_SCHEMA), timeout=120)))
        for _ in range(AMQP_THREADS + 1)]
    for post in posts:
        post.start()
    try:
        healthz = httpx2.get(f"{api.url}/healthz", timeout=30)
        cancel = httpx2.post(f"{api.url}/v1/runs/{queued}/cancel", json={}, timeout=30)
        answered_while_checking = len(answers)
    finally:
        for post in posts:
            post.join(timeout=120)

    assert (healthz.status_code, cancel.status_code) == (200, 202), cancel.text
    assert answered_while_checking == 0, "serve answered /healthz or the cancel only after a schema's check"
    assert [answer.status_code for answer in answers] == [422] * len(posts)
    assert {json.dumps(refused_for(answer.json())) for answer in answers} == {json.dumps({
        "output_schema": "could not be checked as a JSON Schema within 5 s (RUNBRAKE_SCHEMA_CHECK_S): it is too "
                         "costly to check"})}
    # A schema over the byte bound is refused by its size, before anything parses it as a schema.
    huge = httpx2.post(f"{api.url}/v1/runs", json=scripted({"content": "{}"}, output_schema={"allOf": [{}] * 150_000}),
                       timeout=30)
    assert huge.status_code == 422
    assert refused_for(huge.json()) == {"output_schema": "is 450011 bytes; the limit is 65536 "
                                                         "(RUNBRAKE_MAX_OUTPUT_SCHEMA_BYTES)"}
    assert [record.run_id for record in store.recent(limit=10)] == [queued]


def test_a_run_request_with_a_schema_too_costly_to_check_is_answered_with_the_refusal(
    start_worker: Any, store: RunStore, rabbitmq: Settings
) -> None:
    start_worker(RUNBRAKE_SCHEMA_CHECK_S="2", RUNBRAKE_ALLOW_INLINE="true")

    answer = answered(rabbitmq, json.dumps(scripted({"content": "{}"}, output_schema=COSTLY_SCHEMA)))

    assert refused_for(answer) == {"output_schema": "could not be checked as a JSON Schema within 2 s "
                                                    "(RUNBRAKE_SCHEMA_CHECK_S): it is too costly to check"}
    assert store.recent(limit=10) == []
