"""Agent trees (issue 32; docs/usage.md, "Agent trees"): a run calls catalog agents as tools, each call a child
run on any worker, and every brake reaches the whole tree.

The catalog's and the spec's rules are unit tests; the rest runs on real worker processes, Redis and RabbitMQ,
llm-mock-api as the agents' model (each child's input picks its rule) and the toolbox MCP server over HTTP for
long tool calls (its events file says when each call started and was cut off on the server).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import pytest

from runbrake.shared import RunRecord, RunStatus, RunStep, RunStore, StepKind, TerminationReason, ToolOutcome
from runbrake.shared._store_core import add_below, append_step, below_use
from runbrake.shared.catalog import Admission, Catalog
from runbrake.shared.errors import ConfigError, SpecError
from runbrake.shared.messaging.cancel import CancelPublisher, cancel_run
from runbrake.shared.messaging.producer import Producer
from runbrake.shared.records import TreeLink
from runbrake.shared.spec import RunSpec
from runbrake.worker.intake import Slots
from runbrake.worker.registry import ActiveRuns
from tests.catalog_helpers import add_to_catalog
from tests.llm_mock import LlmMock, reply
from tests.mcp_helpers import Toolbox, matching_events, wait_for_event
from tests.polling import poll_until
from tests.ports import free_port
from tests.test_cli import runbrake
from tests.test_tenants import set_catalog
from tests.worker_helpers import WorkerProcess, call, scrape_metrics, wait_for_run

WAIT_S = 30.0
MODEL = {"provider": "openai", "base_url": "http://127.0.0.1:9/v1", "model": "m"}


def _agent(description: str, **fields: Any) -> dict[str, Any]:
    return {"description": description, "model": "mock", **fields}


RESEARCHER = _agent("Finds things out", mcp_servers=["toolbox"])
"""An agent whose model (llm-mock-api, by the rules each test sets) calls the toolbox."""


# -- the catalog and the spec -----------------------------------------------------------------------


def test_the_catalog_refuses_an_agent_naming_what_it_does_not_define_and_a_loop_of_agents() -> None:
    with pytest.raises(ConfigError) as raised:
        Catalog.parse({"models": {"mock": MODEL}, "agents": {
            "lost": {"description": "d", "model": "nope", "mcp_servers": ["nowhere"], "agents": ["nobody"]}}})
    assert "agents.lost.model: 'nope' is not a model of the catalog" in str(raised.value)
    assert "agents.lost.mcp_servers: 'nowhere' is not a server of the catalog" in str(raised.value)
    assert "agents.lost.agents: 'nobody' is not an agent of the catalog" in str(raised.value)
    with pytest.raises(ConfigError, match=r"a loop of agents calling each other \(a -> b -> c -> a\)"):
        Catalog.parse({"models": {"mock": MODEL}, "agents": {
            "a": _agent("a", agents=["b"]), "b": _agent("b", agents=["c"]), "c": _agent("c", agents=["a"])}})
    with pytest.raises(ConfigError, match=r"a loop of agents calling each other \(self -> self\)"):
        Catalog.parse({"models": {"mock": MODEL}, "agents": {"self": _agent("s", agents=["self"])}})


def test_a_spec_names_agents_and_never_defines_one_and_admission_bounds_the_tree_depth() -> None:
    with pytest.raises(SpecError) as raised:
        RunSpec.parse({"input": "x", "model": "mock", "agents": [{"description": "d", "model": "mock"}]})
    assert [p.field for p in raised.value.problems] == ["agents[0]"]
    assert "a spec cannot define an agent" in raised.value.problems[0].msg
    with pytest.raises(SpecError, match=r"^agents: must be a list of names"):
        RunSpec.parse({"input": "x", "model": "mock", "agents": {"mine": {"model": "mock"}}})
    chain = {"one": _agent("1", agents=["two"]), "two": _agent("2", agents=["three"]),
             "three": _agent("3", agents=["four"]), "four": _agent("4")}
    admission = Admission(Catalog.parse({"models": {"mock": MODEL}, "agents": chain}))
    admission.admit(RunSpec.parse({"input": "x", "model": "mock", "agents": ["two"]}))  # three levels: allowed
    with pytest.raises(SpecError) as refused:
        admission.admit(RunSpec.parse({"input": "x", "model": "mock", "agents": ["one", "nobody"]}))
    assert {p.field: p.msg for p in refused.value.problems} == {
        "agents[1]": "'nobody' is not an agent of the catalog (it has four, one, three, two)",
        "agents": "make a tree 4 levels deep; the limit is 3 (RUNBRAKE_MAX_AGENT_DEPTH)"}


def test_a_runs_cancel_wake_up_reaches_the_runs_below_it_that_the_process_executes() -> None:
    """What the cancel listener interrupts for one wake-up (worker/cancel_listener.py), once their keys say so."""
    async def reached() -> list[list[str]]:
        registry = ActiveRuns()
        registry.register("root", "o")
        registry.register("middle", "o", above=("root",))
        registry.register("leaf", "o", above=("middle", "root"))
        registry.register("other", "o")
        return [registry.with_below(run_id) for run_id in ("root", "middle", "leaf", "elsewhere")]

    assert asyncio.run(reached()) == [["root", "middle", "leaf"], ["middle", "leaf"], ["leaf"], []]


def test_a_slot_lent_by_a_waiting_caller_comes_back_to_it_before_any_new_run_takes_one() -> None:
    """worker/intake.py ``Slots``: a caller lends its slot while it waits; taking it back, it waits on the loop for
    the next slot given back, ahead of the consumer threads; cut off, it takes one at once, past capacity."""
    async def scenario() -> list[tuple[int, int]]:
        slots = Slots(1)
        seen = []
        assert slots.acquire(0)  # the caller runs
        slots.lend()  # and waits for its child, which takes the slot
        assert slots.acquire(0)
        seen.append((slots.running, slots.lent))
        back = asyncio.ensure_future(slots.take_back())  # the caller's child answered: it wants its slot again
        await asyncio.sleep(0)  # yields once: asyncio runs the ready task up to its wait, deterministically
        assert not back.done()
        assert not slots.acquire(0)  # no new run jumps ahead of it
        slots.release()  # the child's segment ended: its slot goes to the caller
        await asyncio.wait_for(back, timeout=5)
        seen.append((slots.running, slots.lent))
        slots.lend()  # waits again; another run takes the slot; the caller is cut off meanwhile
        assert slots.acquire(0)
        cut_off = asyncio.ensure_future(slots.take_back())
        await asyncio.sleep(0)
        cut_off.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cut_off
        seen.append((slots.running, slots.lent))
        slots.release()  # a slot taken past capacity ends with its run; it is handed to nobody
        slots.release()
        seen.append((slots.running, slots.in_flight))
        return seen

    assert asyncio.run(scenario()) == [(1, 1), (1, 0), (2, 0), (0, 0)]


@pytest.mark.integration
def test_enqueue_refuses_an_unknown_agent_with_exit_code_2_and_writes_nothing(
    producer: Producer, store: RunStore, tmp_path: Any
) -> None:
    path = tmp_path / "spec.json"
    path.write_text(json.dumps({"input": "x", "model": {"provider": "scripted", "turns": [{"content": "ok"}]},
                                "agents": ["nobody"]}))
    result = runbrake("enqueue", str(path))
    assert result.returncode == 2
    assert "agents[0]" in result.stderr
    assert store.recent() == []


# -- a tree on real workers ---------------------------------------------------------------------------


def _tree_catalog(llm_mock: LlmMock, toolbox: Toolbox, **agents: dict[str, Any]) -> None:
    add_to_catalog({"toolbox": toolbox.spec}, models={"mock": {
        "provider": "openai", "base_url": llm_mock.openai_url, "model": "gpt-mock"}}, agents=agents)


def _caller(turns: list[dict[str, Any]], agents: list[str], **extra: Any) -> RunSpec:
    return RunSpec.parse({"input": "delegate", "model": {"provider": "scripted", "turns": turns}, "agents": agents,
                          **extra})


def _ask(agent: str, text: str) -> dict[str, Any]:
    return call(agent, server="agent", input=text)


def _children(store: RunStore, run_id: str, count: int) -> list[str]:
    return poll_until(lambda: (found := store.get(run_id).children) and len(found) >= count and
                      [found[c] for c in sorted(found)], timeout=WAIT_S,
                      failure=lambda: f"run {run_id} has not {count} children: {store.get(run_id).children}")


def _cancelled_tree(store: RunStore, ids: list[str]) -> list[RunRecord]:
    records = [wait_for_run(store, run_id, timeout=WAIT_S) for run_id in ids]
    assert [(r.status, r.termination_reason) for r in records] == [
        (RunStatus.CANCELLED, TerminationReason.CANCELLED)] * len(ids)
    return records


@pytest.mark.integration
def test_a_caller_with_two_agents_in_long_tool_calls_cancelled_cancels_every_call_in_the_tree(
    llm_mock: LlmMock, toolbox_http: Toolbox, worker: WorkerProcess, producer: Producer, store: RunStore,
    publisher: CancelPublisher,
) -> None:
    _tree_catalog(llm_mock, toolbox_http, researcher=RESEARCHER, coder=_agent("Writes code", mcp_servers=["toolbox"]))
    llm_mock.server.when("research slowly").reply(reply(tools=[("toolbox__slow", {"seconds": 120}, "call_r")]))
    llm_mock.server.when("code slowly").reply(reply(tools=[("toolbox__slow", {"seconds": 120}, "call_c")]))
    run = producer.enqueue(_caller([{"tool_calls": [_ask("researcher", "research slowly"),
                                                    _ask("coder", "code slowly")]},
                                    {"content": "never reached"}], ["researcher", "coder"]))
    wait_for_event(toolbox_http.events, "started", tool="slow", count=2, timeout=WAIT_S)
    children = _children(store, run.run_id, 2)
    asked = len(llm_mock.requests())

    assert cancel_run(store, publisher, run.run_id, reason="stop the tree", requested_by="test").won

    root, *below = _cancelled_tree(store, [run.run_id, *children])
    for child in below:
        assert (child.caller_run_id, child.root_run_id, child.depth) == (run.run_id, run.run_id, 1)
        assert child.cancel is not None
        assert child.cancel.reason == f"stop the tree (cancelled with run {run.run_id})"
        worker.wait_for_log("run_segment_ended", run_id=child.run_id, outcome="cancelled", timeout=WAIT_S)
        tools = [s for s in store.get(child.run_id).steps if s.kind is StepKind.TOOL]
        assert [(s.tool_name, s.tool_outcome) for s in tools] == [("slow", ToolOutcome.CANCELLED)]
    worker.wait_for_log("run_segment_ended", run_id=run.run_id, outcome="cancelled", timeout=WAIT_S)
    calls = [s for s in store.get(run.run_id).steps if s.kind is StepKind.TOOL]
    assert sorted((s.tool_name, s.tool_outcome, s.detail["child_run_id"]) for s in calls) == sorted(
        [("researcher", ToolOutcome.CANCELLED, children[0]), ("coder", ToolOutcome.CANCELLED, children[1])]
        if store.get(children[0]).input == "research slowly" else
        [("coder", ToolOutcome.CANCELLED, children[0]), ("researcher", ToolOutcome.CANCELLED, children[1])])
    wait_for_event(toolbox_http.events, "cancelled", tool="slow", count=2, timeout=WAIT_S)
    assert len(llm_mock.requests()) == asked  # no model call after the cancel, anywhere in the tree
    assert root.to_dict()["children"] == children


@pytest.mark.integration
def test_a_three_level_tree_cancelled_at_the_root_is_cancelled_to_its_leaf(
    llm_mock: LlmMock, toolbox_http: Toolbox, worker: WorkerProcess, producer: Producer, store: RunStore,
    publisher: CancelPublisher,
) -> None:
    _tree_catalog(llm_mock, toolbox_http, planner=_agent("Plans", agents=["researcher"]), researcher=RESEARCHER)
    llm_mock.server.when("plan it").reply(reply(tools=[("agent__researcher", {"input": "dig deep"}, "call_p")]))
    llm_mock.server.when("dig deep").reply(reply(tools=[("toolbox__slow", {"seconds": 120}, "call_d")]))
    run = producer.enqueue(_caller([{"tool_calls": [_ask("planner", "plan it")]}, {"content": "never"}], ["planner"]))
    wait_for_event(toolbox_http.events, "started", tool="slow", timeout=WAIT_S)
    [planner] = _children(store, run.run_id, 1)
    [researcher] = _children(store, planner, 1)

    assert cancel_run(store, publisher, run.run_id, reason="enough", requested_by="test").won

    _root, middle, leaf = _cancelled_tree(store, [run.run_id, planner, researcher])
    assert (middle.depth, leaf.depth, leaf.caller_run_id, leaf.root_run_id) == (1, 2, planner, run.run_id)
    assert leaf.cancel is not None
    assert f"cancelled with run {run.run_id}" in leaf.cancel.reason
    wait_for_event(toolbox_http.events, "cancelled", tool="slow", timeout=WAIT_S)
    listed = json.loads(runbrake("runs", "--root", run.run_id, "--json").stdout)
    assert [(r["run_id"], r["depth"], r["status"]) for r in listed] == [
        (run.run_id, 0, "cancelled"), (planner, 1, "cancelled"), (researcher, 2, "cancelled")]


@pytest.mark.integration
def test_an_agents_answer_is_the_callers_tool_result_and_show_names_the_tree(
    llm_mock: LlmMock, toolbox_http: Toolbox, worker: WorkerProcess, producer: Producer, store: RunStore,
) -> None:
    _tree_catalog(llm_mock, toolbox_http, researcher=_agent("Finds things out", instructions="Be brief."))
    llm_mock.server.when("what is the capital of Norway").reply(reply("Oslo", usage=(20, 3)))
    run = producer.enqueue(_caller([{"tool_calls": [_ask("researcher", "what is the capital of Norway")]},
                                    {"content": "done"}], ["researcher"]))

    record = wait_for_run(store, run.run_id, timeout=WAIT_S)

    assert record.status is RunStatus.COMPLETED
    [step] = [s for s in record.steps if s.kind is StepKind.TOOL]
    assert (step.tool_name, step.tool_outcome, step.content) == ("researcher", ToolOutcome.OK, "Oslo")
    child = store.get(step.detail["child_run_id"])
    assert (child.status, child.output, child.instructions) == (RunStatus.COMPLETED, "Oslo", "Be brief.")
    shown = json.loads(runbrake("show", child.run_id, "--json").stdout)
    assert {k: shown[k] for k in ("caller_run_id", "root_run_id", "depth", "children")} == {
        "caller_run_id": run.run_id, "root_run_id": run.run_id, "depth": 1, "children": []}
    assert json.loads(runbrake("show", run.run_id, "--json").stdout)["children"] == [child.run_id]
    assert llm_mock.requests()[0].system_message == "Be brief."


@pytest.mark.integration
def test_a_steer_of_the_caller_cancels_its_childs_call_with_reason_steered(
    llm_mock: LlmMock, toolbox_http: Toolbox, worker: WorkerProcess, producer: Producer, store: RunStore,
) -> None:
    _tree_catalog(llm_mock, toolbox_http, researcher=RESEARCHER)
    llm_mock.server.when("research slowly").reply(reply(tools=[("toolbox__slow", {"seconds": 120}, "call_r")]))
    run = producer.enqueue(_caller([{"tool_calls": [_ask("researcher", "research slowly")]},
                                    {"content": "steered on"}], ["researcher"]))
    wait_for_event(toolbox_http.events, "started", tool="slow", timeout=WAIT_S)
    [child] = _children(store, run.run_id, 1)

    assert runbrake("steer", run.run_id, "never mind").returncode == 0

    below = wait_for_run(store, child, timeout=WAIT_S)
    assert below.status is RunStatus.CANCELLED
    assert below.cancel is not None
    assert below.cancel.reason == f"steered: its caller, run {run.run_id}, was steered"
    record = wait_for_run(store, run.run_id, timeout=WAIT_S)
    assert (record.status, record.output) == (RunStatus.COMPLETED, "steered on")
    [step] = [s for s in record.steps if s.kind is StepKind.TOOL]
    assert (step.tool_outcome, step.detail["child_run_id"], step.detail["reason"]) == (
        ToolOutcome.CANCELLED, child, "steered")
    wait_for_event(toolbox_http.events, "cancelled", tool="slow", timeout=WAIT_S)


@pytest.mark.integration
def test_a_token_budget_spent_by_grandchildren_stops_the_whole_tree(
    llm_mock: LlmMock, toolbox_http: Toolbox, worker: WorkerProcess, producer: Producer, store: RunStore,
) -> None:
    _tree_catalog(llm_mock, toolbox_http, planner=_agent("Plans", agents=["researcher"]), researcher=RESEARCHER)
    llm_mock.server.when("plan it").reply(reply(tools=[("agent__researcher", {"input": "dig deep"}, "call_p")],
                                                usage=(10, 10)))
    llm_mock.server.when("dig deep").reply(reply(tools=[("toolbox__slow", {"seconds": 120}, "call_d")],
                                                 usage=(400, 100)))
    run = producer.enqueue(_caller([{"tool_calls": [_ask("planner", "plan it")]}, {"content": "never"}],
                                   ["planner"], budget={"max_total_tokens": 300}))

    root = wait_for_run(store, run.run_id, timeout=WAIT_S)

    assert (root.status, root.termination_reason) == (RunStatus.CANCELLED, TerminationReason.BUDGET_EXCEEDED)
    [planner] = _children(store, run.run_id, 1)
    [researcher] = _children(store, planner, 1)
    records = [wait_for_run(store, r, timeout=WAIT_S) for r in (planner, researcher)]
    assert [r.status for r in records] == [RunStatus.CANCELLED, RunStatus.CANCELLED]
    assert root.usage.total_tokens == 0  # its own model is scripted: what stopped it was spent below
    # The whole tree at once: the root's budget fenced every run below it, not each caller its child in turn.
    for record in records:
        assert record.cancel is not None
        assert (record.cancel.requested_by, record.cancel.reason.endswith(f"(cancelled with run {run.run_id})")) == (
            "budget", True), record.cancel
    wait_for_event(toolbox_http.events, "cancelled", tool="slow", timeout=WAIT_S)


@pytest.mark.integration
def test_a_tenants_quota_of_runs_in_flight_counts_every_run_of_its_trees(
    llm_mock: LlmMock, toolbox_http: Toolbox, worker: WorkerProcess, producer: Producer, store: RunStore,
    publisher: CancelPublisher,
) -> None:
    _tree_catalog(llm_mock, toolbox_http, researcher=RESEARCHER)
    set_catalog(tenants={"alpha": {"max_runs_in_flight": 2}})
    llm_mock.server.when("research slowly").reply(reply(tools=[("toolbox__slow", {"seconds": 120}, "call_r")]))
    run = producer.enqueue(_caller([{"tool_calls": [_ask("researcher", "research slowly"),
                                                    _ask("researcher", "research slowly too")]},
                                    {"content": "never"}], ["researcher"]), tenant="alpha")

    refused = poll_until(lambda: [s for s in store.get(run.run_id).steps if s.kind is StepKind.TOOL], timeout=WAIT_S,
                         failure=lambda: f"run {run.run_id} recorded no call")
    [child] = _children(store, run.run_id, 1)
    assert [(s.tool_outcome, s.content) for s in refused] == [(ToolOutcome.FAILED, (
        "the agent 'researcher' was not called: the tenant is at its quota max_runs_in_flight (2)"))]
    assert store.in_flight("alpha") == 2  # the first run and its child

    assert cancel_run(store, publisher, run.run_id, reason="enough", requested_by="test").won

    _cancelled_tree(store, [run.run_id, child])
    assert store.in_flight("alpha") == 0  # each run of the tree left the tenant's count as it ended


@pytest.mark.integration
def test_a_childs_deadline_is_at_most_what_its_caller_has_left(
    llm_mock: LlmMock, toolbox_http: Toolbox, worker: WorkerProcess, producer: Producer, store: RunStore,
) -> None:
    _tree_catalog(llm_mock, toolbox_http, researcher=_agent("Finds things out", mcp_servers=["toolbox"],
                                                            budget={"deadline_s": 3600}))
    llm_mock.server.when("research slowly").reply(reply(tools=[("toolbox__slow", {"seconds": 120}, "call_r")]))
    run = producer.enqueue(_caller([{"tool_calls": [_ask("researcher", "research slowly")]}, {"content": "never"}],
                                   ["researcher"], budget={"deadline_s": 6}))
    [child] = _children(store, run.run_id, 1)

    below = wait_for_run(store, child, timeout=WAIT_S)

    deadline = below.request["budget"]["deadline_s"]
    assert 0 < deadline <= 6
    assert below.termination_reason in {TerminationReason.DEADLINE_EXCEEDED, TerminationReason.CANCELLED}
    root = wait_for_run(store, run.run_id, timeout=WAIT_S)
    assert (root.status, root.termination_reason) == (RunStatus.CANCELLED, TerminationReason.DEADLINE_EXCEEDED)
    assert matching_events(toolbox_http.events, "finished", tool="slow") == []


@pytest.mark.integration
def test_a_child_waiting_for_approval_is_shown_at_the_root_and_its_approval_completes_the_tree(
    llm_mock: LlmMock, toolbox_http: Toolbox, worker: WorkerProcess, producer: Producer, store: RunStore,
) -> None:
    _tree_catalog(llm_mock, toolbox_http, researcher={**RESEARCHER, "approval_required": ["toolbox.get-sum"]})
    llm_mock.server.when("add them").reply(reply(tools=[("toolbox__get-sum", {"a": 2, "b": 3}, "call_sum")])).times(1)
    llm_mock.server.when_tool_result("call_sum").reply(reply("5"))
    run = producer.enqueue(_caller([{"tool_calls": [_ask("researcher", "add them")]}, {"content": "done"}],
                                   ["researcher"]))
    [child] = _children(store, run.run_id, 1)
    wait_for_run(store, child, lambda r: r.status is RunStatus.WAITING_FOR_APPROVAL, timeout=WAIT_S)

    shown = json.loads(runbrake("show", run.run_id, "--json").stdout)
    assert (shown["status"], shown["waiting_below"]) == ("running", [child])
    assert f"Darunter wartet auf Freigabe: {child}" in runbrake("show", run.run_id, "--lang", "de").stdout
    assert runbrake("approve", child).returncode == 0

    record = wait_for_run(store, run.run_id, timeout=WAIT_S)
    assert (record.status, [s.content for s in record.steps if s.kind is StepKind.TOOL]) == (
        RunStatus.COMPLETED, ["5"])
    assert json.loads(runbrake("show", run.run_id, "--json").stdout)["waiting_below"] == []


@pytest.mark.integration
def test_a_three_level_tree_completes_on_one_worker_of_concurrency_one_each_waiting_caller_lending_its_slot(
    llm_mock: LlmMock, toolbox_http: Toolbox, start_worker: Callable[..., WorkerProcess], producer: Producer,
    store: RunStore,
) -> None:
    """A caller waiting for its child gives its slot back (docs/leases.md, "Capacity: runs in flight"): with one
    slot, the root's child and grandchild run on the same worker. Holding it (as before), the child's message would
    be handed back for ever while the root waited."""
    metrics_port = free_port()
    start_worker(concurrency=1, RUNBRAKE_METRICS_PORT=str(metrics_port))
    _tree_catalog(llm_mock, toolbox_http, planner=_agent("Plans", agents=["researcher"]),
                  researcher={**RESEARCHER, "approval_required": ["toolbox.get-sum"]})
    delegate = reply(tools=[("agent__researcher", {"input": "add them"}, "call_p")])
    llm_mock.server.when("plan it").reply(delegate).times(1)
    llm_mock.server.when("add them").reply(reply(tools=[("toolbox__get-sum", {"a": 2, "b": 3}, "call_sum")])).times(1)
    llm_mock.server.when_tool_result("call_sum").reply(reply("5"))
    llm_mock.server.when_tool_result("call_p").reply(reply("the sum is 5"))
    run = producer.enqueue(_caller([{"tool_calls": [_ask("planner", "plan it")]}, {"content": "done"}], ["planner"]))
    [planner] = _children(store, run.run_id, 1)
    [researcher] = _children(store, planner, 1)
    wait_for_run(store, researcher, lambda r: r.status is RunStatus.WAITING_FOR_APPROVAL, timeout=WAIT_S)

    # The grandchild waits for approval (in flight nowhere); its caller and the root wait for their children, in
    # flight here, each with its slot lent.
    lent = poll_until(lambda: (m := scrape_metrics(metrics_port))[("runbrake_slots_lent", ())] == 2 and m,
                      timeout=WAIT_S, failure=lambda: f"slots lent: {scrape_metrics(metrics_port)}")
    assert lent[("runbrake_runs_in_flight", ())] == 2
    assert runbrake("approve", researcher).returncode == 0

    records = [wait_for_run(store, r, timeout=WAIT_S) for r in (run.run_id, planner, researcher)]
    assert [(r.status, r.output) for r in records] == [
        (RunStatus.COMPLETED, "done"), (RunStatus.COMPLETED, "the sum is 5"), (RunStatus.COMPLETED, "5")]
    assert [s.content for s in records[0].steps if s.kind is StepKind.TOOL] == ["the sum is 5"]
    ended = poll_until(lambda: (m := scrape_metrics(metrics_port))[("runbrake_runs_in_flight", ())] == 0 and m,
                       timeout=WAIT_S, failure=lambda: f"runs in flight: {scrape_metrics(metrics_port)}")
    assert ended[("runbrake_slots_lent", ())] == 0


@pytest.mark.integration
def test_a_child_runs_end_and_its_use_name_the_runs_above_on_the_tree_wakes_channel(store: RunStore) -> None:
    """What wakes a waiting agent call (worker/tree_wakes.py): the child's terminal transition names its caller,
    a model step below names each run above; a first run's end names nobody."""
    spec = {"input": "x", "model": {"provider": "scripted", "turns": [{"content": "ok"}]}}
    root = store.create(spec).run_id
    middle = store.create(spec, tree=TreeLink(caller_run_id=root, root_run_id=root, depth=1, ancestors=(root,))).run_id
    leaf = store.create(spec, tree=TreeLink(caller_run_id=middle, root_run_id=root, depth=2,
                                            ancestors=(middle, root))).run_id
    pubsub = store.redis.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(store.keys.tree_wakes)
    try:
        poll_until(lambda: pubsub.get_message(timeout=0.1) is None and pubsub.subscribed, timeout=WAIT_S,
                   failure=lambda: "the subscription was not confirmed")
        store.execute(add_below(store.keys, (middle, root), 120, 0.0))
        for run_id in (leaf, middle, root):
            assert store.cancel(run_id, reason="done", requested_by="test").won
        heard: list[str] = []
        poll_until(lambda: (message := pubsub.get_message(timeout=0.1)) is not None and heard.append(
            message["data"]) is None and len(heard) >= 4, timeout=WAIT_S, failure=lambda: f"heard only {heard}")
    finally:
        pubsub.close()
    assert heard == [middle, root, middle, root]  # the use below counted above; the leaf ended, the middle ended
    assert [store.execute(below_use(store.keys, r)) for r in (middle, root)] == [(120, 0.0), (120, 0.0)]


@pytest.mark.integration
def test_a_model_step_below_counts_against_each_run_above_once_even_when_its_append_is_sent_again(
    store: RunStore,
) -> None:
    """The step's append carries the count above (shared/_store_core.py, ``append_step``): one round trip, and an
    append retried after a lost answer (the same token) neither records the step nor counts its use twice."""
    spec = {"input": "x", "model": {"provider": "scripted", "turns": [{"content": "ok"}]}}
    root = store.create(spec).run_id
    child = store.create(spec, tree=TreeLink(caller_run_id=root, root_run_id=root, depth=1, ancestors=(root,))).run_id
    step = RunStep(kind=StepKind.MODEL, round=1, content="ok",
                   detail={"usage": {"input_tokens": 30, "output_tokens": 12, "cost_usd": 0.5}})

    answers = [store.execute(append_step(store.keys, child, step, token="t1", above=(root,))) for _ in range(2)]
    store.execute(append_step(store.keys, child, step, token="t2", above=(root,)))

    assert [a.step.sequence for a in answers] == [1, 1]  # the second send of t1 recorded nothing
    assert store.execute(below_use(store.keys, root)) == (84, 1.0)  # t1 once, t2 once
