"""The catalog's ``tasks`` (docs/usage.md, "Long tool calls as MCP tasks"): which tools are called as MCP tasks,
refused in a run spec; and what the sweeper plans for a lost worker's call whose task the run recorded
(worker/reclaim.py): no cut-off step, the call pending for the next worker to poll its task."""

from __future__ import annotations

import pytest

from runbrake.shared import RunSpec, StepKind
from runbrake.shared.catalog import Catalog
from runbrake.shared.errors import ConfigError, SpecError
from runbrake.shared.spec import TaskUse
from runbrake.worker.mcp_tasks import TaskHandle
from runbrake.worker.reclaim import plan
from tests.test_worker_lost_policies import SERVER, _fields, _model


def test_a_catalog_server_says_tasks_the_default_being_auto() -> None:
    servers = Catalog.parse({"mcp_servers": {"plain": SERVER, "eager": {**SERVER, "tasks": "prefer"},
                                             "never": {**SERVER, "tasks": "off"}}}).mcp_servers
    assert [servers[name].tasks for name in ("plain", "eager", "never")] == [TaskUse.AUTO, TaskUse.PREFER,
                                                                            TaskUse.OFF]
    assert Catalog.parse({"mcp_servers": {"e": {**SERVER, "tasks": "prefer"}}}).describe()[
        "mcp_servers"]["e"]["tasks"] == "prefer"


@pytest.mark.parametrize(("use", "support", "as_task"), [
    (TaskUse.AUTO, "required", True), (TaskUse.AUTO, "optional", False), (TaskUse.AUTO, None, False),
    (TaskUse.PREFER, "required", True), (TaskUse.PREFER, "optional", True), (TaskUse.PREFER, "forbidden", False),
    (TaskUse.OFF, "required", None), (TaskUse.OFF, "optional", False),
])
def test_which_tools_are_called_as_tasks(use: TaskUse, support: str | None, as_task: bool | None) -> None:
    assert use.as_task(support) is as_task


def test_a_bad_tasks_value_in_the_catalog_is_refused_naming_the_field() -> None:
    with pytest.raises(ConfigError, match=r"mcp_servers\.s\.tasks"):
        Catalog.parse({"mcp_servers": {"s": {**SERVER, "tasks": "always"}}})


def test_a_run_spec_may_not_set_tasks_only_the_catalog_does() -> None:
    with pytest.raises(SpecError, match=r"tasks.*only an operator's catalog sets it"):
        RunSpec.parse({"input": "x", "model": {"provider": "scripted", "turns": [{"content": "x"}]},
                       "mcp_servers": {"s": {**SERVER, "tasks": "prefer"}}})


def test_a_lost_workers_call_with_a_recorded_task_is_not_cut_off_but_pending_for_the_next_worker() -> None:
    task = TaskHandle("s", "t-1", "session-1", "2025-11-25").to_json()
    planned = plan(_fields(**{"sent:a": "1", "sent:b": "1", "task:a": task}), (_model(1, 1, "a", "b"),),
                   worker="w", max_losses=3)

    assert [(s.kind, s.tool_call_id) for s in planned.steps] == [(StepKind.TOOL, "b"), (StepKind.HANDOFF, None)]
    assert [c["id"] for c in planned.pending["pending_calls"]] == ["a"]
    assert planned.steps[-1].detail["pending_calls"] == 1


@pytest.mark.parametrize("text", ["", "{}", "[1]", '{"server": "s"}', "not json"])
def test_a_task_record_no_worker_wrote_is_no_handle(text: str) -> None:
    assert TaskHandle.from_json(text) is None


def test_a_task_handle_round_trips() -> None:
    handle = TaskHandle("s", "t-1", "session-1", "2025-11-25")
    assert TaskHandle.from_json(handle.to_json()) == handle

