"""RUNBRAKE_QUEUE_TYPE=quorum: the run queue and its Dramatiq twins are quorum queues, a worker completes a
run from them, and each listener's exclusive cancel queue stays classic (broker/rabbitmq.py)."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable

import dramatiq.errors
import pika.exceptions
import pytest

from runbrake.broker.producer import Producer
from runbrake.broker.rabbitmq import build_broker
from runbrake.broker.wire import Topology, queue_type_arguments
from runbrake.shared import RunStatus, RunStore, Settings, TerminationReason
from runbrake.shared.catalog import Admission
from tests.mcp_helpers import Toolbox
from tests.worker_helpers import WorkerProcess, call, spec, wait_for_run

pytestmark = pytest.mark.integration


def _queue_types(names: set[str]) -> dict[str, str]:
    done = subprocess.run(
        ["rabbitmqctl", "list_queues", "-q", "--formatter", "json", "name", "type"],
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert done.returncode == 0, done.stderr
    return {queue["name"]: queue["type"] for queue in json.loads(done.stdout) if queue["name"] in names}


def test_queue_type_arguments() -> None:
    assert queue_type_arguments("classic") == {}
    assert queue_type_arguments("quorum") == {"x-queue-type": "quorum"}


def test_a_quorum_worker_completes_a_run_from_quorum_queues_and_listens_on_a_classic_queue(
    toolbox_http: Toolbox, start_worker: Callable[..., WorkerProcess], store: RunStore, rabbitmq: Settings,
) -> None:
    quorum = rabbitmq.with_changes(queue_type="quorum")
    worker = start_worker(RUNBRAKE_QUEUE_TYPE="quorum")
    listener_queue = worker.wait_for_log("cancel_listener_connected")[0]["queue"]
    broker = build_broker(quorum)
    try:
        run = Producer(store, broker, Admission.from_settings(quorum)).enqueue(spec({"toolbox": toolbox_http.spec}, [
            {"tool_calls": [call("get-sum", a=2, b=3)]}, {"content": "It is 5."},
        ]))
        record = wait_for_run(store, run.run_id)
    finally:
        broker.close()

    assert (record.status, record.termination_reason) == (RunStatus.COMPLETED, TerminationReason.COMPLETED)
    run_queue = Topology.of(rabbitmq).run_queue
    twins = {run_queue, f"{run_queue}.DQ", f"{run_queue}.XQ"}
    assert _queue_types({*twins, listener_queue}) == {
        **dict.fromkeys(twins, "quorum"), listener_queue: "classic",
    }


def test_rabbitmq_refuses_to_redeclare_the_quorum_run_queue_as_classic(rabbitmq: Settings) -> None:
    """Why switching a namespace's queue type needs its old queues deleted (docs/operating.md, "Operating")."""
    run_queue = Topology.of(rabbitmq).run_queue
    quorum_broker = build_broker(rabbitmq.with_changes(queue_type="quorum"))
    classic_broker = build_broker(rabbitmq)
    try:
        quorum_broker.declare_queue(run_queue, ensure=True)
        with pytest.raises(dramatiq.errors.ConnectionClosed) as refused:
            classic_broker.declare_queue(run_queue, ensure=True)
    finally:
        quorum_broker.close()
        classic_broker.close()

    assert isinstance(refused.value.__context__, pika.exceptions.ChannelClosedByBroker)
    assert refused.value.__context__.reply_code == 406
    assert "inequivalent arg 'x-queue-type'" in refused.value.__context__.reply_text
