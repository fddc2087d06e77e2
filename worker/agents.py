"""Agent calls: a run calls a catalog agent as a tool, and the call is a child run (docs/usage.md, "Agent
trees").

:class:`AgentCalls` wraps a segment's toolbox as the tool loop's runner: the run's agents are tools
(``agent__<name>``, ``{"input": string}``) beside its servers' tools, and a call of one

1. starts the child run: its spec built from the agent (shared/agents.py) with an idempotency key of the caller
   and the call, so that the call starts one run however often it is made (a worker that takes the caller up
   after a lost one makes the call again and finds the same child); written queued with its place in the tree
   (caller, root, depth, ancestors) and its message sent, like any run, to any worker;
2. records the child on the caller (its ``children`` hash) before it waits;
3. waits, as a tool call waits for its server: in a scope the loop hands out, the caller's slot lent meanwhile
   (:class:`Slot`), woken when a run below ends or spends (worker/tree_wakes.py), then reading the child's status
   with the caller's cancel key (and the use of the runs below, for the caller's budget), and reading them every
   ``FALLBACK_S`` without a wake;
4. hands the child's answer back as the tool result (``output``, or ``output_json`` as JSON), a failed or
   cancelled child as a failed result the model can act on, each with ``child_run_id``.

A call cut off by a cancel or a steer cancels its child (each level's worker cancels the level below, and an
operator's cancel fences the whole tree at once: shared/messaging/cancel.py). One cut off by a hand-over raises
:class:`~shared.errors.CallHandedOver`: left unrecorded, it is made again by the next worker (worker/loop.py,
``_Turn.detached``), as one cut off by a lost worker is (its ``on_worker_lost`` is ``retry``:
worker/liveness.py): either finds the child it started and waits for it. A lost lease cancels nothing: the run
is no longer this worker's.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Protocol

import anyio
import structlog

from runbrake.shared.agents import AGENT_INPUT_SCHEMA, AgentSpec, child_request
from runbrake.shared.async_store import AsyncRunStore
from runbrake.shared.budget import BUDGET_REQUESTER
from runbrake.shared.catalog import Admission
from runbrake.shared.errors import CallHandedOver, SpecError, StoreError
from runbrake.shared.messaging.cancel import CancelPublisher
from runbrake.shared.records import RunRecord, TreeLink
from runbrake.shared.settings import Settings
from runbrake.shared.spec import AGENT_SERVER, RunSpec
from runbrake.shared.status import RunStatus
from runbrake.shared.tool_result import Failure, ToolResult
from runbrake.worker.budget import BudgetGuard
from runbrake.worker.conversation import ToolCall, ToolInfo
from runbrake.worker.loop import ToolRunner
from runbrake.worker.redrive import Sender
from runbrake.worker.registry import ActiveRuns, RunHandle
from runbrake.worker.tree_wakes import FALLBACK_S, TreeWakes

log = structlog.get_logger(__name__)



class ChildRuns:
    """What the agent calls of a worker process share: the sending of child runs' messages and of the cancel
    wake-ups of children cut off, from two threads of its own (pika is not thread-safe: each has its own
    publisher)."""

    def __init__(self, settings: Settings, store: AsyncRunStore, registry: ActiveRuns, admission: Admission,
                 sender: Sender | None) -> None:
        self.settings = settings
        self.store = store
        self.registry = registry
        self.admission = admission
        self._sender = sender
        self._threads = ThreadPoolExecutor(2, thread_name_prefix="runbrake-agents")
        self._local = threading.local()
        self.wakes = TreeWakes(settings, store.keys.tree_wakes)
        """Wakes the waits of this process's agent calls when a run below them ends or spends."""

    async def send(self, run_id: str) -> None:
        """Send a child run's message; one that does not go out is re-driven (its run waits in the unclaimed set:
        docs/leases.md, "Re-drive")."""
        if self._sender is None:
            return
        sender = self._sender
        try:
            await asyncio.wrap_future(self._threads.submit(lambda: sender.send(run_id)))
        except Exception as exc:  # noqa: BLE001 - the re-drive sends it
            log.warning("child_run_message_failed", child_run_id=run_id, error=str(exc) or repr(exc))

    async def cancel(self, run_id: str, *, reason: str, requested_by: str) -> None:
        """Fence a child run and every unfinished run below it, cut their calls off here when this process executes
        them, and wake their workers (one wake-up reaches a run and the runs below it: worker/cancel_listener.py).
        A child this process saw cancelled already (a cancel of the tree fenced it) needs nothing more."""
        if self.registry.cancel_seen(run_id):
            return
        try:
            transition = await self.store.cancel(run_id, reason=reason, requested_by=requested_by)
        except StoreError as exc:
            log.warning("child_run_cancel_failed", child_run_id=run_id, error=str(exc))
            return
        if not transition.won:
            # Fenced already (a cancel of the tree fences every run below before it wakes their workers): a child
            # this process executes is cut off here at once rather than when its wake-up comes.
            if transition.found is RunStatus.CANCELLED:
                self.registry.interrupt(run_id)
            return
        log.info("child_run_cancelled", child_run_id=run_id, reason=reason)
        here = self.registry.interrupt(run_id)
        await self.stop_below(run_id, reason=reason, requested_by=requested_by, wake=not here)

    async def stop_below(self, run_id: str, *, reason: str, requested_by: str, wake: bool = False) -> None:
        """Fence every unfinished run below ``run_id``, a run just stopped (a cut-off child, a run its budget
        stopped: worker/budget.py), as an operator's cancel does (shared/messaging/cancel.py), and wake their
        workers with one wake-up of ``run_id`` (also when ``wake``: the run itself is not executed here). What
        this cannot write, each caller's cut-off call still cancels, level by level."""
        try:
            below = await self.store.cancel_below(run_id, reason=f"{reason} (cancelled with run {run_id})",
                                                  requested_by=requested_by)
        except StoreError as exc:
            log.warning("run_tree_cancel_failed", run_id=run_id, error=str(exc))
            below = []
        if below:
            log.info("run_tree_cancelled", run_id=run_id, below=len(below))
        if not below and not wake:
            return
        try:
            await asyncio.wrap_future(self._threads.submit(self._publish, run_id))
        except Exception as exc:  # noqa: BLE001 - the backstop finds the fence within two polls
            log.warning("child_run_wakeup_failed", child_run_id=run_id, error=str(exc) or repr(exc))

    async def budget_brake(self, run_id: str, reason: str) -> None:
        """The runs below a run its budget stopped stop with it (worker/budget.py, ``tree_brake``)."""
        await self.stop_below(run_id, reason=reason, requested_by=BUDGET_REQUESTER)

    def _publish(self, run_id: str) -> None:
        publisher = getattr(self._local, "publisher", None)
        if publisher is None:
            publisher = self._local.publisher = CancelPublisher(self.settings)
        publisher.publish(run_id)


class Slot(Protocol):
    """The slot of the caller's segment (worker/intake.py, ``Seat``): lent while its agent calls wait, so that the
    worker takes another run meanwhile (its child, say), and taken back before its turn goes on."""

    def lend(self) -> None:
        """An agent call starts waiting (its run's calls waiting at once lend one slot)."""

    async def take_back(self, *, now: bool) -> None:
        """The call stops waiting: the run's slot again once a slot is free, waiting on the loop for one; ``now``, at
        once (a call cut off: its run records how it ended without waiting for another run to end)."""


@dataclass(frozen=True, slots=True)
class Caller:
    """The run whose segment makes agent calls: what its children inherit."""

    run_id: str
    handle: RunHandle
    tenant: str | None
    tree: TreeLink | None
    budget: BudgetGuard | None
    slot: Slot | None = None
    """Lent while the run's agent calls wait (None: the calls hold it)."""

    def link(self) -> TreeLink:
        """A child's place in the tree."""
        above = (self.run_id, *(() if self.tree is None else self.tree.ancestors))
        root = self.run_id if self.tree is None else self.tree.root_run_id
        return TreeLink(caller_run_id=self.run_id, root_run_id=root, depth=len(above), ancestors=above)


class AgentCalls:
    """The tool loop's runner for a run with agents: the toolbox's tools and calls, and the agents'."""

    def __init__(self, tools: ToolRunner, agents: Mapping[str, AgentSpec], caller: Caller, runs: ChildRuns) -> None:
        self._inner = tools
        self._agents = agents
        self._caller = caller
        self._runs = runs
        self._tools = [*tools.tools, *(ToolInfo(server=AGENT_SERVER, name=name, description=agent.description,
                                                input_schema=AGENT_INPUT_SCHEMA) for name, agent in agents.items())]

    @property
    def tools(self) -> Sequence[ToolInfo]:
        return self._tools

    def problem(self, call: ToolCall) -> str | None:
        if call.server != AGENT_SERVER:
            return self._inner.problem(call)
        return None if call.tool in self._agents else f"there is no agent named {call.tool!r} in this run"

    def cancel_grace(self, call: ToolCall) -> float | None:
        return None if call.server == AGENT_SERVER else self._inner.cancel_grace(call)

    async def execute(self, call: ToolCall, *, interrupt: anyio.CancelScope) -> ToolResult:
        if call.server != AGENT_SERVER:
            return await self._inner.execute(call, interrupt=interrupt)
        text = call.arguments.get("input")
        if not isinstance(text, str) or not text.strip():
            return ToolResult.error(f"{call.model_name} takes {{\"input\": string}}: what the agent is asked to do",
                                    failure=Failure.ARGUMENTS)
        child: list[str] = []
        result: ToolResult | None = None
        with interrupt:
            result = await self._call(call, self._agents[call.tool], text, child, interrupt)
        if result is not None:
            return result
        return await self._cut_off(call, child[0] if child else None)

    async def _call(self, call: ToolCall, agent: AgentSpec, text: str, child: list[str],
                    interrupt: anyio.CancelScope) -> ToolResult:
        started = await self._start(call, agent, text, child)
        if isinstance(started, ToolResult):
            return started
        status, caller_cancelled = await self._lending(started, interrupt)
        if status is RunStatus.CANCELLED and (self._caller.handle.cancel_seen or caller_cancelled):
            # The cancel of the tree reached the child before the caller's wake-up reached this call: it is the
            # caller's own cancel, and the call is cut off by it, not failed (the child's record is not read: a
            # tree's cancel would read every one at once, in the moment its calls are recorded; the caller's cancel
            # key is read with the child's status, in one round trip).
            return replace(ToolResult.cancelled(f"the call of the agent {call.tool!r} was cut off"),
                           child_run_id=started)
        return self._answer(call, await self._runs.store.get(started))

    async def _start(self, call: ToolCall, agent: AgentSpec, text: str, child: list[str]) -> str | ToolResult:
        """The child run of ``call`` (also put in ``child`` as soon as it is known, for a cut-off to cancel): the
        one started before (found by the call's id: a worker taking the caller up makes the call again), else a
        new one, written and sent; or why it cannot start, for the model."""
        caller, runs = self._caller, self._runs
        known = await runs.store.children(caller.run_id)
        if call.id in known:
            log.info("agent_call_reattached", child_run_id=known[call.id])
            child.append(known[call.id])
            return known[call.id]
        link = caller.link()
        if link.depth > runs.admission.max_agent_depth:
            return _refused(call, f"the agent tree would be {link.depth} levels deep; the limit is "
                                  f"{runs.admission.max_agent_depth} (RUNBRAKE_MAX_AGENT_DEPTH)")
        if len(known) >= runs.settings.max_agent_calls:
            return _refused(call, f"this run started {len(known)} agent runs, its limit (RUNBRAKE_MAX_AGENT_CALLS)")
        left = None if caller.budget is None or caller.budget.deadline_at is None else (
            caller.budget.deadline_at - time.time())
        if left is not None and left <= 0:
            return _refused(call, "the run's deadline passed")
        key = f"agent:{caller.run_id}:{hashlib.sha256(call.id.encode()).hexdigest()[:32]}"
        try:
            spec = RunSpec.parse(child_request(agent, text, key=key, deadline_s=left))
            # An output_schema is checked in a child process: waited for on a thread (shared/catalog.py).
            await asyncio.to_thread(runs.admission.admit, spec, tenant=caller.tenant)
        except SpecError as exc:
            return _refused(call, f"its run was refused: {exc}")
        quota = runs.admission.catalog.quota(caller.tenant) if caller.tenant else None
        created = await runs.store.create(spec.raw, idempotency_key=key, tenant=caller.tenant, quota=quota,
                                          tree=link)
        if created.over_quota is not None:
            return _refused(call, f"the tenant is at its quota {created.over_quota.quota} "
                                  f"({created.over_quota.limit})")
        child.append(created.run_id)
        await runs.store.add_child(caller.run_id, call.id, created.run_id)
        if created.created:
            await runs.send(created.run_id)
            log.info("agent_call_started", agent=call.tool, child_run_id=created.run_id, depth=link.depth)
        return created.run_id

    async def _lending(self, child: str, interrupt: anyio.CancelScope) -> tuple[RunStatus, bool]:
        """:meth:`_wait`, the caller's slot lent meanwhile (docs/leases.md, "Capacity: runs in flight"): taken back
        before the turn goes on, at once when the call was cut off."""
        slot = self._caller.slot
        if slot is None:
            return await self._wait(child)
        slot.lend()
        try:
            return await self._wait(child)
        finally:
            await slot.take_back(now=interrupt.cancel_called)

    async def _wait(self, child: str) -> tuple[RunStatus, bool]:
        """Until the child ends: its terminal status, and whether the caller's cancel key was set then; counting the
        use below against the caller's budget meanwhile: woken when a run below ends or spends
        (worker/tree_wakes.py), else looking again at ``FALLBACK_S``."""
        store, budget = self._runs.store, self._caller.budget
        with self._runs.wakes.watch(self._caller.run_id) as woken:
            while True:
                woken.clear()  # before the reads: a wake that comes during them is not lost
                status, caller_cancelled = await store.child_status(child, self._caller.run_id)
                if status.is_terminal:
                    return status, caller_cancelled
                if budget is not None:
                    await budget.count_below(*await store.below_use(self._caller.run_id))
                with anyio.move_on_after(FALLBACK_S):
                    await woken.wait()

    def _answer(self, call: ToolCall, record: RunRecord) -> ToolResult:
        """The child's end as the tool result the calling model sees."""
        max_chars = self._runs.settings.max_tool_result_chars
        if record.status is RunStatus.COMPLETED:
            value = record.output_json
            structured = None if value is None else json.dumps(value)
            result = ToolResult.ok(structured or record.output or "", structured=structured)
        elif record.status is RunStatus.CANCELLED:
            why = record.cancel.reason if record.cancel is not None else record.termination_reason.value
            result = ToolResult.error(f"the agent {call.tool!r} was stopped ({record.termination_reason.value}): "
                                      f"{why}")
        else:
            result = ToolResult.error(f"the agent {call.tool!r} failed ({record.termination_reason.value}): "
                                      f"{record.error}")
        return replace(result.with_bounded_channels(max_chars), child_run_id=record.run_id)

    async def _cut_off(self, call: ToolCall, child: str | None) -> ToolResult:
        """The call was cut off (a cancel, a steer, a hand-over): its child is cancelled too, but when the run
        is no longer this worker's."""
        handle = self._caller.handle
        result = ToolResult.cancelled(f"the call of the agent {call.tool!r} was cut off", sent=child is not None)
        if child is None or handle.lost:
            return result
        if handle.handing_over and not handle.cancel_seen and handle.steer is None:
            # Handed over, not stopped: the next worker makes the call again and re-attaches (worker/loop.py).
            raise CallHandedOver(call.id)
        why = "steered" if handle.steer is not None and not handle.cancel_seen else "cancelled"
        with anyio.CancelScope(shield=True):
            await self._runs.cancel(child, reason=f"{why}: its caller, run {self._caller.run_id}, was {why}",
                                    requested_by=f"run {self._caller.run_id}")
        return replace(result, child_run_id=child)


def _refused(call: ToolCall, why: str) -> ToolResult:
    return ToolResult.error(f"the agent {call.tool!r} was not called: {why}")
