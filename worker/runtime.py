"""The runtime: claims a run, runs its segment through the ladder, and owns persistence.

The loop reports each step through :class:`RunHooks`; the hook appends the step and
probes the cancel key in the same round trip (docs/cancellation.md, "Cancellation: the
probe"). A set key raises :class:`CancelRequested`, which the ladder catches before
anything else: the cancel already won the terminal transition, so the ladder settles
nothing and returns ``CANCELLED``.

Everything here runs on the worker process's one event loop, so every Redis round trip
is awaited (:class:`~runbrake.shared.async_store.AsyncRunStore`): a blocking call would
stall every run on the loop and delay interrupts.
"""

from __future__ import annotations

import asyncio
import functools
import os
import socket
import uuid
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from enum import StrEnum
from typing import TypeVar

import anyio
import structlog

from runbrake.shared import redaction, tracing
from runbrake.shared.async_store import AsyncRunStore
from runbrake.shared.catalog import Admission, AdmittedRun
from runbrake.shared.errors import (
    CancelRequested,
    OwnershipLost,
    RunBoundReached,
    RunbrakeError,
    SpecError,
    SteerRequested,
    StoreError,
)
from runbrake.shared.records import Claim, Sent, Transition, TreeLink
from runbrake.shared.settings import Settings
from runbrake.shared.spec import RunSpec
from runbrake.shared.status import RunStatus, TerminationReason
from runbrake.shared.steps import RunStep, StepKind
from runbrake.worker import mcp_tasks, metrics
from runbrake.worker.agents import AgentCalls, Caller, ChildRuns, Slot
from runbrake.worker.budget import BudgetGuard
from runbrake.worker.conversation import Message, ModelSettings, ToolCall
from runbrake.worker.deltas import DeltaPublisher, StreamedText
from runbrake.worker.loop import HANDOFF_REASON, LoopEnd, LoopEndKind, LoopState, ToolLoop
from runbrake.worker.models import ModelProvider, RetryPolicy, provider_for
from runbrake.worker.progress import ProgressSubscriber
from runbrake.worker.redrive import Sender
from runbrake.worker.registry import ActiveRuns, RunHandle
from runbrake.worker.steer import steer_step
from runbrake.worker.subscribers import Subscriber, Subscribers
from runbrake.worker.toolbox import Toolbox

log = structlog.get_logger(__name__)

SENDER_THREADS = 4
"""Threads sending handed-over and resumed runs' messages, each waiting for its confirm."""

T = TypeVar("T")


class RunOutcome(StrEnum):
    """What one segment of a run came to, from this worker's point of view."""

    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"
    SUSPENDED = "suspended"
    HANDED_OVER = "handed_over"
    """The worker shut down: the run went back to the queue for another worker to continue."""
    SKIPPED = "skipped"
    """The message was a no-op: the run was not in a status this message may claim."""
    LOST = "lost"
    """The worker's own settle was refused: another writer (a cancel) ended the run first."""


class RunHooks:
    """The loop's hooks for one run: persist each step and probe its boundary; hand out call scopes.

    One Redis read of the cancel key per boundary: the append of a step carries the probe of
    the boundary it makes, and the check before a model call reads the key only when a call
    ran since the last probe (a step recorded just before stands for the same boundary). A
    cancel the listener already verified needs no read at all.
    """

    def __init__(self, store: AsyncRunStore, handle: RunHandle, *, max_steps: int, lease_s: float = 60.0,
                 subscribers: Subscribers | None = None, budget: BudgetGuard | None = None,
                 tree: TreeLink | None = None) -> None:
        self._store = store
        self._tree = tree
        """Where the run sits in an agent tree (its model steps count above it: worker/agents.py), or None."""
        self._budget = budget
        """Prices the model steps and stops the run at its budget (worker/budget.py); None without one."""
        self._handle = handle
        self._subscribers = Subscribers() if subscribers is None else subscribers
        self._max_steps = max_steps
        self._lease_s = lease_s
        self._probed = False
        """True from a probe until the next call starts: nothing happened since that could matter."""
        self._deltas: DeltaPublisher | None = None
        """The run's ``delta`` events (worker/deltas.py), made at its first model call."""
        self._applying = False
        """The steer's answers are being recorded: their boundaries do not raise the steer again."""
        self.completion: Transition | None = None
        """What the final step's settle came to (:meth:`complete`), once the loop completed."""
        self._marked: set[str] = set()
        """The tool calls whose marks an append wrote (:class:`Sent`), until they go out."""
        self._marked_model: int | None = None
        """The model call whose mark the last round trip wrote, until it goes out."""

    async def record(self, step: RunStep, sent: Sent | None = None) -> None:
        if self._budget is not None:
            step = self._budget.priced(step)
        step = self._subscribers.before_step(self._handle.run_id, step)
        token = uuid.uuid4().hex
        # A model step below the first run of a tree counts against every run above it in the same round trip.
        above = () if self._tree is None else self._tree.ancestors
        appended = await durably(
            lambda: self._store.append_step(self._handle.run_id, step, token=token, owner=self._handle.owner,
                                            sent=sent, above=above),
            within_s=self._lease_s, what="append_step")
        self._probed = True
        self._marked_model = None if sent is None else sent.model
        if sent is not None:
            self._marked.update(sent.calls)
        await self._subscribers.step(self._handle.run_id, appended.step)
        if appended.cancelled or self._handle.cancel_seen:
            raise CancelRequested(self._handle.run_id)
        if self._budget is not None:
            await self._budget.counted(appended.step)
        if appended.step.sequence >= self._max_steps:
            raise RunBoundReached(TerminationReason.MAX_STEPS,
                                  f"the run recorded its {self._max_steps} steps (max_steps)")
        if self._handle.steer is not None and not self._applying:
            raise SteerRequested(self._handle.run_id)

    async def complete(self, step: RunStep) -> None:
        final = step if self._budget is None else self._budget.priced(step)
        token = uuid.uuid4().hex
        appended, transition, steer = await durably(
            lambda: self._store.complete(self._handle.run_id, final, owner=self._handle.owner, token=token),
            within_s=self._lease_s, what="complete")
        self._probed = True
        await self._subscribers.step(self._handle.run_id, appended.step)
        if steer is not None:
            # A steer was stored before the settle: the answer stays recorded, and the run goes on with the steer's
            # message (docs/cancellation.md, "Steer: the final answer").
            self._handle.steer_reached(steer)
            raise SteerRequested(self._handle.run_id)
        if transition.steered:
            # The steer key holds what no steer wrote (logged steer_unreadable): nothing to go on with, so the
            # answer stands and the run completes, rather than waiting, running, for the reaper.
            transition = await durably(
                lambda: self._store.settle(self._handle.run_id, RunStatus.COMPLETED, TerminationReason.COMPLETED,
                                           owner=self._handle.owner, final=final),
                within_s=self._lease_s, what="complete")
        if not transition.won:
            log.info("run_final_step_recorded_after_cancel", sequence=appended.step.sequence)
        self.completion = transition

    async def probe(self) -> None:
        """The boundary's probe, where no step was just recorded (a resume after approval)."""
        self._seen()
        if not self._probed:
            self._probed = True
            if await self._store.cancel_requested(self._handle.run_id):
                raise CancelRequested(self._handle.run_id)

    def _seen(self) -> None:
        """What the cancel listener, a sweeper or a steer already told this run, raised."""
        if self._handle.lost:
            raise OwnershipLost(self._handle.run_id)
        if self._handle.cancel_seen:
            raise CancelRequested(self._handle.run_id)
        if self._handle.steer is not None:
            raise SteerRequested(self._handle.run_id)  # applying it probes the cancel key (STEER_APPLY)

    async def checkpoint(self, round_number: int) -> None:
        self._seen()
        if self._probed and self._marked_model == round_number:
            return  # the append just before probed this boundary and marked the call
        # The model call's mark, which probes the cancel key too: one round trip for both.
        self._probed = True
        await self._mark_sent(None, round_number)
        self._marked_model = round_number

    async def sending(self, call_id: str | None, round_number: int) -> None:
        if self._handle.lost:
            raise OwnershipLost(self._handle.run_id)
        marked = self._marked_model == round_number if call_id is None else call_id in self._marked
        if not marked:
            await self._mark_sent(call_id, round_number)
            return
        if call_id is None:
            self._marked_model = None
        else:
            self._marked.discard(call_id)
        if self._handle.cancel_seen:  # what the mark's own round trip would have found
            raise CancelRequested(self._handle.run_id)

    async def _mark_sent(self, call_id: str | None, round_number: int) -> None:
        await durably(lambda: self._store.mark_sent(self._handle.run_id, owner=self._handle.owner, call_id=call_id,
                                                    round_number=round_number),
                      within_s=self._lease_s, what="mark_sent")

    async def keep_task(self, call_id: str, task: str | None) -> None:
        await durably(lambda: self._store.keep_task(self._handle.run_id, owner=self._handle.owner, call_id=call_id,
                                                    task=task),
                      within_s=self._lease_s, what="keep_task")

    async def task_of(self, call_id: str) -> str | None:
        return await durably(lambda: self._store.task_of(self._handle.run_id, call_id), within_s=self._lease_s,
                             what="task_of")

    @property
    def run_id(self) -> str:
        return self._handle.run_id

    def in_flight(self, grace_s: float | None = None) -> AbstractContextManager[anyio.CancelScope]:
        self._probed = False
        return self._handle.in_flight(grace_s)

    def streamed_text(self, round_number: int, *, max_chars: int) -> StreamedText:
        if self._deltas is None:
            self._deltas = DeltaPublisher(self._handle.run_id, self._store.publish_delta)
        return self._deltas.text(round_number, max_chars=max_chars)

    @property
    def handing_over(self) -> bool:
        return self._handle.handing_over

    @property
    def leaves_tasks_running(self) -> bool:
        handle = self._handle
        return (handle.handing_over or handle.lost) and not handle.cancel_seen and handle.steer is None

    @property
    def steering(self) -> bool:
        return self._handle.steer is not None and not self._handle.cancel_seen

    async def apply_steer(self, answers: Sequence[RunStep], round_number: int) -> str | None:
        steer = self._handle.steer
        if steer is None:
            return None
        self._applying = True
        try:
            for answer in answers:
                await self.record(answer)
        finally:
            self._applying = False
        spared = redaction.current_submitted()
        if spared is not None:  # the steer's text is the submitter's too, from its own step on
            spared.add(steer.input, steer.reason, steer.requested_by)
        token = uuid.uuid4().hex
        self._marked_model = None
        appended = await durably(
            lambda: self._store.apply_steer(self._handle.run_id, steer, steer_step(steer, round_number),
                                            owner=self._handle.owner, token=token),
            within_s=self._lease_s, what="apply_steer")
        self._probed = True
        if appended is not None and (appended.cancelled or self._handle.cancel_seen):
            raise CancelRequested(self._handle.run_id)  # a cancel wins: the steer is not applied
        self._handle.steer_applied()
        if appended is None:
            log.warning("steer_not_applied", steer_id=steer.id, why="the stored steer is not this one any more")
            return None
        log.info("run_steer_applied", sequence=appended.step.sequence, requested_by=steer.requested_by)
        await self._subscribers.step(self._handle.run_id, appended.step)
        if appended.step.sequence >= self._max_steps:
            raise RunBoundReached(TerminationReason.MAX_STEPS,
                                  f"the run recorded its {self._max_steps} steps (max_steps)")
        return steer.input


async def durably(write: Callable[[], Awaitable[T]], *, within_s: float, what: str) -> T:
    """``write()``, tried again with backoff while Redis cannot be reached, for up to ``within_s`` (the
    lease: a worker that keeps its run's record must not give up sooner than others would reap it).

    A step is kept and written when Redis is back, rather than dropped with the run failed for a blip
    (docs/leases.md, "Store outages"); writes retried this way are idempotent.

    Raises:
        StoreError: when Redis stayed unreachable for ``within_s``.
    """
    deadline = anyio.current_time() + within_s
    backoff = 0.05
    while True:
        try:
            return await write()
        except StoreError as exc:
            if anyio.current_time() + backoff > deadline:
                raise
            log.warning("store_write_retrying", write=what, error=str(exc), retry_in_s=backoff)
            await anyio.sleep(backoff)
            backoff = min(backoff * 2, 2.0)


def opening(spec: RunSpec) -> list[Message]:
    """The conversation a run starts with: its instructions (a system message), the messages before its
    input, then the input as the new user message."""
    messages = [Message(role="system", content=spec.instructions)] if spec.instructions is not None else []
    for message in spec.messages:
        calls = tuple(ToolCall(id=c.id, server=c.server, tool=c.tool, arguments=c.arguments)
                      for c in message.tool_calls)
        messages.append(Message(role=message.role, content=message.content, tool_calls=calls,
                                tool_call_id=message.tool_call_id))
    messages.append(Message(role="user", content=spec.input))
    return messages


def model_settings(admitted: AdmittedRun) -> ModelSettings:
    """How the run's model is asked: the admitted model_settings (the catalog's defaults applied) and the
    spec's output_schema."""
    given = admitted.model_settings
    return ModelSettings(
        temperature=given.temperature, top_p=given.top_p, max_output_tokens=given.max_output_tokens,
        stop=given.stop, seed=given.seed, tool_choice=given.tool_choice,
        parallel_tool_calls=given.parallel_tool_calls, output_schema=admitted.spec.output_schema,
    )


def default_subscribers(store: AsyncRunStore, settings: Settings) -> list[Subscriber]:
    """The worker's subscriber list: the metrics, the progress of the call in flight (unless
    ``RUNBRAKE_MCP_PROGRESS=off``: nobody then listens to progress, so no call asks for it,
    worker/subscribers.py), and with tracing on (``RUNBRAKE_OTEL``), the spans of each model and tool call
    (worker/tracing.py, imported only then)."""
    subscribers: list[Subscriber] = [metrics.MetricsSubscriber(store)]
    if settings.mcp_progress == "always":
        subscribers.append(ProgressSubscriber(store))
    if tracing.current().enabled:
        from runbrake.worker.tracing import TracingSubscriber  # noqa: PLC0415 - opentelemetry only when on

        subscribers.append(TracingSubscriber(store))
    return subscribers


def new_owner() -> str:
    """This worker's identity on a claim: host, process and a random suffix."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


@dataclass(frozen=True, slots=True)
class Ending:
    """How an exception out of a segment ends the run: its termination reason, what the record says, and
    the event logged (the runtime logs the few that carry more, worker/runtime.py ``Runtime._ended_by``)."""

    reason: TerminationReason
    error: str
    event: str = ""


def ending_of(exc: BaseException) -> Ending:
    """The one map from what ended a segment to the reason the run ends with (docs/labels.md,
    "Termination reason (`termination_reason`)").

    A runbrake error says its own (``RunbrakeError.reason``, ``CancelRequested.reason``: shared/errors.py);
    ``OwnershipLost`` means another writer owns the run now (nothing is settled: the reaper says
    ``lease_lost``); the runtime's own time limit is anyio's ``TimeoutError``; any other exception is a fault
    of the tool loop; anything else (a ``BaseException``: the worker interrupted the segment on its way out,
    worker/intake.py ``Intake.interrupt_all``) is recorded ``worker_shutdown``, rather than leave the run
    "running" forever, and re-raised.
    """
    if isinstance(exc, OwnershipLost):
        return Ending(TerminationReason.LEASE_LOST, "")
    if isinstance(exc, CancelRequested):
        return Ending(exc.reason, "")
    if isinstance(exc, RunbrakeError) and exc.reason is not None:
        if isinstance(exc, SpecError):
            return Ending(exc.reason, f"spec refused: {exc}")
        return Ending(exc.reason, str(exc), _EVENTS.get(exc.reason, "run_failed"))
    if isinstance(exc, TimeoutError):
        return Ending(TerminationReason.TIME_LIMIT, str(exc))
    if isinstance(exc, Exception):
        return Ending(TerminationReason.TOOL_LOOP_ERROR, f"{type(exc).__name__}: {exc}")
    return Ending(TerminationReason.WORKER_SHUTDOWN, "the worker stopped while the run was executing")


_EVENTS = {
    TerminationReason.PROVIDER_FAILED: "run_provider_failed",
    TerminationReason.MAX_STEPS: "run_bound_reached",
    TerminationReason.TOO_MANY_TOOL_CALLS: "run_bound_reached",
}
"""The log event of a run ended by a runbrake error's own reason."""


class Runtime:
    """Executes run segments in one worker process."""

    def __init__(
        self, settings: Settings, store: AsyncRunStore, registry: ActiveRuns, admission: Admission,
        sender: Sender | None = None, *, subscribers: Sequence[Subscriber] | None = None,
        worker: Callable[[], str] = lambda: "",
    ) -> None:
        """``subscribers`` hear the runs' events (worker/subscribers.py); by default the metrics and, unless
        ``RUNBRAKE_MCP_PROGRESS=off``, the progress of the call in flight. ``worker``: this process's liveness id
        now, stamped on each claim (worker/liveness.py; "" where nothing beats for the process)."""
        self._settings = settings
        self._worker = worker
        self._store = store
        self.registry = registry
        self._admission = admission
        self._sender = sender
        """Sends a handed-over run's message (None: the re-drive sends it, RUNBRAKE_REDRIVE_S later)."""
        self._sending = ThreadPoolExecutor(SENDER_THREADS, thread_name_prefix="runbrake-sender")
        """Where ``_send`` sends from (its threads start at the first send)."""
        self.subscribers = Subscribers(default_subscribers(store, settings) if subscribers is None else subscribers)
        self._children = ChildRuns(settings, store, registry, admission, sender)
        """Where the agent calls of this process's runs start and cancel child runs (worker/agents.py)."""

    async def execute(
        self, run_id: str, *, resume: bool = False, on_claim: Callable[[bool], object] | None = None,
        traceparent: str | None = None, slot: Slot | None = None,
    ) -> RunOutcome:
        """Claim and run one segment of a run. Never raises for the run's own failures.

        ``on_claim(won)`` is called as soon as the claim is decided, before the segment runs: the consumer
        thread that took the message waits only for that (worker/intake.py). With tracing on, the segment is
        a span (``runbrake.run.segment``), a child of ``traceparent`` (the run message's) when given. ``slot``:
        the segment's slot (worker/intake.py, ``Seat``), which its agent calls lend while they wait; None: nothing
        is lent.
        """
        segment = "resume" if resume else "start"
        with tracing.current().span("runbrake.run.segment", {"runbrake.run_id": run_id, "runbrake.segment": segment},
                                    parent=traceparent, kind="consumer") as span:
            outcome = await self._execute(run_id, resume=resume, on_claim=on_claim, slot=slot)
            span.set({"runbrake.segment.outcome": outcome.value})
            return outcome

    async def _execute(self, run_id: str, *, resume: bool, on_claim: Callable[[bool], object] | None,
                       slot: Slot | None) -> RunOutcome:
        with structlog.contextvars.bound_contextvars(run_id=run_id, segment="resume" if resume else "start"):
            owner = new_owner()
            # Tried again with the same owner while Redis cannot be reached: a claim that landed but whose
            # answer was lost is then recognised as this owner's, instead of stranding the run "running".
            worker = self._worker()
            claim = await durably(lambda: self._store.claim(run_id, owner, lease_s=self._settings.lease_s,
                                                            resume=resume, worker=worker),
                                  within_s=self._settings.lease_s, what="claim")
            if on_claim is not None:
                on_claim(claim.won)
            if not claim.won:
                self.subscribers.skip(run_id, claim.found if claim.exists else None)
                if claim.exists:
                    log.info("run_message_skipped", found=claim.found.value)
                    if claim.found is RunStatus.CANCELLED:
                        await self._cancel_tasks_left(run_id)
                else:
                    # Not a duplicate: no such run where this worker looks. Producer and worker may be
                    # pointed at different Redis databases or namespaces; say where this one looked.
                    log.warning("run_message_skipped", found="missing", namespace=self._store.namespace,
                                redis=self._store.where)
                return RunOutcome.SKIPPED
            log.info("run_claimed", owner=owner)
            self.subscribers.status(run_id, RunStatus.RUNNING)
            handle = self.registry.register(run_id, owner, above=() if claim.tree is None else claim.tree.ancestors)
            if self._worker() != worker:
                # This process was taken as lost (and took a new id) between the claim and the registration, so
                # its liveness thread could not restamp the run: do it here, or no sweep would ever find it.
                await self._store.restamp(run_id, owner, self._worker())
            try:
                # What the submitter wrote is theirs: the segment's writes do not cut a value found in it, so a
                # guess echoed back is no oracle (shared/redaction.py, docs/security.md "What redaction promises").
                with redaction.submitted(redaction.Submitted.of_json(claim.request_json or "")):
                    outcome = await self._ladder(run_id, owner, handle, claim, resume=resume, slot=slot)
            finally:
                self.registry.unregister(handle)
            log.info("run_segment_ended", outcome=outcome.value)  # the one line a segment's end costs
            return outcome

    async def _cancel_tasks_left(self, run_id: str) -> None:
        """A run cancelled while it waited for a worker may have MCP tasks a hand-over or a lost worker left running
        (docs/usage.md, "Long tool calls as MCP tasks"): no call will poll them again, so the worker that takes the
        run's message cancels them on their servers (worker/mcp_tasks.py ``cancel_left``). One HSCAN when none."""
        tasks = await self._store.tasks_left(run_id)
        if not tasks:
            return
        try:
            record = await self._store.get(run_id)
            spec = RunSpec.parse(dict(record.request))
            admitted = await asyncio.to_thread(self._admission.admit, spec, tenant=await self._store.tenant_of(run_id))
        except RunbrakeError as exc:
            log.warning("mcp_tasks_left_running", tasks=len(tasks), why=str(exc))
            return
        cancelled = await mcp_tasks.cancel_left(admitted.servers, tasks)
        log.info("mcp_tasks_left_cancelled", tasks=len(tasks), cancelled=cancelled)

    async def _ladder(self, run_id: str, owner: str, handle: RunHandle, claim: Claim, *, resume: bool,
                      slot: Slot | None = None) -> RunOutcome:
        budget: BudgetGuard | None = None
        try:
            # Checked again here: a producer can be bypassed by publishing to the queue directly.
            # A refused spec starts no process and opens no connection (docs/security.md).
            spec = RunSpec.from_json(claim.request_json or "")
            # An output_schema is checked in a child process (shared/schema_check.py): waited for on a thread,
            # so that the loop serves the other runs meanwhile (issue 27).
            admitted = (self._admission.admit(spec, tenant=claim.tenant) if spec.output_schema is None
                        else await asyncio.to_thread(self._admission.admit, spec, tenant=claim.tenant))
            self.subscribers.admit(run_id, admitted)
            spec = admitted.spec
            budget = await BudgetGuard.open(self._store, self.registry, run_id, admitted.budget,
                                            tree_brake=self._children.budget_brake if spec.agents else None)
            hooks = RunHooks(self._store, handle, max_steps=spec.max_steps, lease_s=self._settings.lease_s,
                             subscribers=self.subscribers, budget=budget, tree=claim.tree)
            caller = Caller(run_id, handle, claim.tenant, claim.tree, budget, slot) if spec.agents else None
            state = self._initial_state(spec, claim.pending, resume=resume)
            if resume:
                # The approval step was recorded by whoever approved (runbrake.shared.operations); probe here.
                await hooks.probe()
            if claim.steer is not None:
                # Stored before this segment began (a steered approval, a worker that died or handed over first):
                # the calls still pending are answered by the steer, never made (docs/cancellation.md, "Steer").
                state.pending_calls, state.approved_call_id = [], None
                handle.steer_reached(claim.steer)
            with anyio.fail_after(self._settings.run_time_limit_s):
                async with nullcontext() if budget is None else budget.watching():
                    end = await self._run_loop(admitted, state, hooks, caller)
        except BaseException as exc:  # noqa: BLE001 - every way a segment ends early, mapped in one place: ending_of
            return await self._ended_by(run_id, owner, exc, stopped_by=None if budget is None else budget.stopped)
        if end.kind is LoopEndKind.SUSPENDED:
            return await self._suspend(run_id, owner, end)
        if end.kind is LoopEndKind.HANDOFF:
            return await self._hand_over(run_id, owner, end)
        if end.kind is LoopEndKind.MAX_ROUNDS:
            return await self._settle(run_id, owner, RunStatus.FAILED, TerminationReason.MAX_ROUNDS,
                                f"no final answer within {spec.max_rounds} rounds")
        transition = hooks.completion
        assert transition is not None  # the loop completed through hooks.complete
        if not transition.won:
            return self._lost(run_id, transition.found, stopped_by=None if budget is None else budget.stopped)
        return self._settled(run_id, RunStatus.COMPLETED, TerminationReason.COMPLETED)

    async def _ended_by(self, run_id: str, owner: str, exc: BaseException, *,
                        stopped_by: TerminationReason | None = None) -> RunOutcome:
        """End the segment as ``exc`` says (:func:`ending_of`): log it, settle the run unless the ending says
        not to, and re-raise what stops the worker itself. ``stopped_by``: the reason the segment's budget
        stopped the run with, when its fence won (worker/budget.py, ``BudgetGuard.stopped``)."""
        ending = ending_of(exc)
        if isinstance(exc, OwnershipLost):
            # The run was reaped (this worker looked dead) or taken over: it is not ours to write any more.
            log.warning("run_ownership_lost", owner=owner)
            return RunOutcome.LOST
        if ending.reason is TerminationReason.CANCELLED:
            # The cancel (an operator's, or the budget's own fence) already won the terminal transition: nothing
            # to settle; the subscribers hear the reason that transition recorded.
            log.info("run_cancelled_at_boundary")
            self.subscribers.settle(run_id, RunStatus.CANCELLED, stopped_by or TerminationReason.CANCELLED)
            return RunOutcome.CANCELLED
        error = ending.error
        if ending.reason is TerminationReason.SPEC_REFUSED:
            assert isinstance(exc, SpecError)
            log.warning("run_spec_refused", problems=[f"{p.field}: {p.msg}" for p in exc.problems])
        elif ending.reason is TerminationReason.TIME_LIMIT:
            log.warning("run_time_limit", limit_s=self._settings.run_time_limit_s)
            error = f"segment exceeded {self._settings.run_time_limit_s} s"
        elif ending.reason is TerminationReason.TOOL_LOOP_ERROR:
            log.error("run_tool_loop_error", exc_info=exc)
        elif ending.event:
            log.warning(ending.event, **({"reason": ending.reason.value} if isinstance(exc, RunBoundReached) else {}),
                        error=str(exc))
        outcome = await self._settle(run_id, owner, RunStatus.FAILED, ending.reason, error)
        if ending.reason is TerminationReason.WORKER_SHUTDOWN:
            raise exc
        return outcome

    async def _run_loop(self, admitted: AdmittedRun, state: LoopState, hooks: RunHooks,
                        caller: Caller | None = None) -> LoopEnd:
        spec = admitted.spec
        # An explicit tool_timeout_s applies up to each server's catalog timeout; without one, the catalog's.
        timeout_s = spec.tool_timeout_s if "tool_timeout_s" in spec.raw else None
        # The segment's model calls share one client (docs/benchmarks.md, "Model call overhead").
        async with provider_for(admitted.model, RetryPolicy.from_settings(self._settings)) as provider:
            return await self._run_tools(admitted, state, hooks, provider, timeout_s, caller=caller)

    async def _run_tools(self, admitted: AdmittedRun, state: LoopState, hooks: RunHooks, provider: ModelProvider,
                         timeout_s: float | None, *, caller: Caller | None) -> LoopEnd:
        spec = admitted.spec
        async with Toolbox.open(
            admitted.servers, timeout_s=timeout_s, max_chars=self._settings.max_tool_result_chars,
            calls=self.subscribers.tool_calls(hooks.run_id), tasks=hooks,
        ) as toolbox:
            agents = self._admission.catalog.agents
            runner = toolbox if caller is None else AgentCalls(
                toolbox, {name: agents[name] for name in spec.agents}, caller, self._children)
            loop = ToolLoop(
                provider, runner, hooks,
                max_rounds=spec.max_rounds, approval_required=spec.approval_required,
                max_tool_calls_per_turn=self._settings.max_tool_calls_per_turn,
                max_parallel_tool_calls=self._settings.max_parallel_tool_calls,
                max_argument_chars=self._settings.max_argument_chars,
                max_model_content_chars=self._settings.max_model_content_chars,
                schema_check_s=self._settings.schema_check_s,
                settings=model_settings(admitted), model_name=admitted.model_name,
            )
            # An exception (CancelRequested too) leaves the toolbox unwrapped: each MCP client lives in
            # a task of its own, so no task group of the SDK's lies between the loop and the ladder.
            return await loop.run(state)

    @staticmethod
    def _initial_state(spec: RunSpec, pending: object, *, resume: bool) -> LoopState:
        if not resume:
            if isinstance(pending, dict) and pending.get("messages"):
                # A queued run with a pending turn was handed over: continue where its last worker stopped.
                return LoopState.from_dict(pending)
            return LoopState(messages=opening(spec))
        if not isinstance(pending, dict) or not pending.get("pending_calls"):
            raise RunbrakeError("resumed run has no pending turn")
        state = LoopState.from_dict(pending)
        state.approved_call_id = state.pending_calls[0].id
        return state

    async def _suspend(self, run_id: str, owner: str, end: LoopEnd) -> RunOutcome:
        assert end.state is not None
        transition = await self._store.suspend(run_id, owner, end.state.to_dict())
        if not transition.won:
            return self._lost(run_id, transition.found)
        call = end.state.pending_calls[0]
        log.info("run_waiting_for_approval", tool=call.qualified_name)
        self.subscribers.status(run_id, RunStatus.WAITING_FOR_APPROVAL)
        await self._resume_if_steered(run_id)
        return RunOutcome.SUSPENDED

    async def _resume_if_steered(self, run_id: str) -> None:
        """A steer stored while the run was running that no boundary applied before it was suspended: the run is
        put back to work as a steer of a waiting run is (docs/cancellation.md, "Steer")."""
        if not await self._store.steer_waiting(run_id):
            return
        log.info("run_steered_while_suspending")
        if self._sender is not None:
            try:
                await self._send(run_id, resume=True)
            except Exception as exc:  # noqa: BLE001 - the run waits in the unclaimed set: the re-drive sends it
                log.warning("run_resume_message_failed", error=str(exc) or repr(exc),
                            action=f"re-driven within RUNBRAKE_REDRIVE_S ({self._settings.redrive_s} s)")

    async def _hand_over(self, run_id: str, owner: str, end: LoopEnd) -> RunOutcome:
        """Save the conversation, put the run back to ``queued`` with a ``handoff`` step, and send its
        message: another worker continues it (docs/leases.md, "Drain and hand-over")."""
        assert end.state is not None
        step = RunStep(kind=StepKind.HANDOFF, round=end.state.model_calls,
                       content="the worker shut down; the run went back to the queue for another worker",
                       detail={"reason": HANDOFF_REASON, "pending_calls": len(end.state.pending_calls)})
        token, pending = uuid.uuid4().hex, end.state.to_dict()
        try:
            appended, transition = await durably(
                lambda: self._store.hand_over(run_id, step, owner=owner, pending=pending, token=token),
                within_s=self._settings.lease_s, what="hand_over")
        except OwnershipLost as exc:
            return await self._ended_by(run_id, owner, exc)
        await self.subscribers.step(run_id, appended.step)
        if not transition.won:
            return self._lost(run_id, transition.found)
        log.info("run_handed_over", sequence=appended.step.sequence, pending_calls=len(end.state.pending_calls))
        self.subscribers.status(run_id, RunStatus.QUEUED)
        if self._sender is not None:
            try:
                await self._send(run_id)
            except Exception as exc:  # noqa: BLE001 - the run waits in the unclaimed set: the re-drive sends it
                log.warning("run_handoff_message_failed", error=str(exc) or repr(exc),
                            action=f"re-driven within RUNBRAKE_REDRIVE_S ({self._settings.redrive_s} s)")
        return RunOutcome.HANDED_OVER

    async def _send(self, run_id: str, *, resume: bool = False) -> None:
        """Send a run's message from a few threads of the runtime's own, which keep their RabbitMQ connections
        (Dramatiq's broker holds one per thread), and wait for it, shielded: a hand-over is sent even while the
        worker interrupts what is left. Not anyio's worker threads: each of those opens a connection of its
        own, and each call of ``anyio.to_thread`` walks every task of the loop (``find_root_task``, on a loop
        Dramatiq runs with ``run_forever``): with 2,000 runs in flight a stop handed over 570 runs in 10 s
        (docs/benchmarks.md, "Scale (`bench/scale.py`)")."""
        assert self._sender is not None
        sent = self._sending.submit(functools.partial(self._sender.send, run_id, resume=resume))
        with anyio.CancelScope(shield=True):
            await asyncio.wrap_future(sent)

    async def _settle(
        self, run_id: str, owner: str, status: RunStatus, reason: TerminationReason, error: str
    ) -> RunOutcome:
        transition = await durably(
            lambda: self._store.settle(run_id, status, reason, owner=owner, error=error),
            within_s=self._settings.lease_s, what="settle")
        if not transition.won:
            return self._lost(run_id, transition.found)
        return self._settled(run_id, status, reason)

    def _settled(self, run_id: str, status: RunStatus, reason: TerminationReason) -> RunOutcome:
        self.subscribers.settle(run_id, status, reason)
        log.debug("run_settled", status=status.value, reason=reason.value)
        return RunOutcome.COMPLETED if status is RunStatus.COMPLETED else RunOutcome.FAILED

    def _lost(self, run_id: str, found: RunStatus, *, stopped_by: TerminationReason | None = None) -> RunOutcome:
        # Terminal is terminal: a cancel (or another writer) ended the run first; the store logged it. Its reason
        # is known here only when it was this segment's budget (``stopped_by``).
        log.info("run_settle_lost", found=found.value)
        if found is RunStatus.CANCELLED:
            self.subscribers.settle(run_id, RunStatus.CANCELLED, stopped_by)
            return RunOutcome.CANCELLED
        return RunOutcome.LOST
