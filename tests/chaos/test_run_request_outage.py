"""A run request that arrives while Redis is down is not lost: the worker keeps it on the queue (requeued after a
pause) until Redis answers again, then enqueues the run once and answers (docs/messages.md, "Run requests")."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable

import pytest

from runbrake.shared import RunStatus, Settings
from tests.amqp_clients import CLIENTS
from tests.chaos.conftest import Client, PrivateRedis
from tests.mcp_helpers import Toolbox
from tests.worker_helpers import WorkerProcess, call, spec, wait_for_run

pytestmark = pytest.mark.integration


def test_a_run_request_during_a_redis_outage_is_enqueued_once_and_answered_when_redis_is_back(
    private_redis: PrivateRedis, point_at: Callable[..., Client], start_worker: Callable[..., WorkerProcess],
    toolbox_http: Toolbox, rabbitmq: Settings,
) -> None:
    client = point_at({"RUNBRAKE_REDIS_URL": private_redis.url}, lease_s=30)
    worker = start_worker()
    body = json.dumps(spec({"toolbox": toolbox_http.spec}, [{"tool_calls": [call("get-sum", a=1, b=1)]},
                                                             {"content": "two"}]).raw)

    private_redis.stop()
    try:
        requester = subprocess.Popen(
            [sys.executable, str(CLIENTS / "request_run.py"), rabbitmq.rabbitmq_url, rabbitmq.namespace, body,
             "--message-id", "during-the-outage"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        worker.wait_for_log("run_request_store_unavailable", count=2, timeout=30)  # tried, requeued, tried again
    finally:
        private_redis.start()
    out, err = requester.communicate(timeout=90)

    assert requester.returncode == 0, err
    answer = json.loads(out)
    assert (answer["status"], answer["created"]) == ("queued", True)
    assert wait_for_run(client.store, answer["run_id"], timeout=60).status is RunStatus.COMPLETED
    assert [r.run_id for r in client.store.recent(limit=10)] == [answer["run_id"]]
