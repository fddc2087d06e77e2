"""The tool loop: model call → tool calls → next round, until a final answer or ``max_rounds``.

The loop never touches Redis: persistence and the probe live in the runtime's hooks
(docs/cancellation.md, "Cancellation: the probe"). It reports
every step through :class:`LoopHooks`; the runtime persists the step there and probes
the cancel key, raising :class:`~shared.errors.CancelRequested` through the loop when
the run was cancelled. Every call that can take long (a model call, a tool call) runs
inside a scope the hooks hand out, so a cancel message can interrupt it.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any, Protocol

import anyio

from runbrake.shared.errors import (
    CallHandedOver,
    CancelRequested,
    LostCallFails,
    OwnershipLost,
    ProviderError,
    RetriedAttempt,
    RunBoundReached,
    SteerRequested,
)
from runbrake.shared.outcome import ToolOutcome
from runbrake.shared.records import Sent
from runbrake.shared.status import TerminationReason
from runbrake.shared.steps import RunStep, StepKind, StepReason
from runbrake.shared.tool_result import Failure, ToolResult, bound
from runbrake.worker.conversation import NO_SETTINGS, Message, ModelSettings, ModelTurn, ToolCall, ToolInfo
from runbrake.worker.deltas import StreamedText
from runbrake.worker.models import ModelProvider
from runbrake.worker.registry import cut_off_after
from runbrake.worker.steer import STEERED, answer_unanswered, steered_step
from runbrake.worker.structured import INTERRUPTED_CHECK, AnswerCheck, Checked, hand_back


class LoopHooks(Protocol):
    """What the runtime offers the loop: persistence and probing, and interruptible call scopes."""

    async def record(self, step: RunStep, sent: Sent | None = None) -> None:
        """Persist a step, then probe the cancel key (raises CancelRequested when set); with ``sent``, the marks
        of the calls that go out right after it, in the same round trip (see :meth:`sending`)."""

    async def checkpoint(self, round_number: int) -> None:
        """Probe the cancel key before the model call of ``round_number`` (raises CancelRequested when set), and
        make sure the call is marked (:meth:`sending`): one round trip, none when the append just before did
        both."""

    async def complete(self, step: RunStep) -> None:
        """Record the final model step and settle the run completed; raises SteerRequested when a steer waits
        (the run goes on with it: docs/cancellation.md, "Steer: the final answer")."""

    async def sending(self, call_id: str | None, round_number: int) -> None:
        """Record, durably, that a call's request is about to go out (a tool call by its id, the model call of
        ``round_number`` with None), so that the worker that takes the run up after this one was lost knows
        what was sent (docs/leases.md, "Lost workers"); no round trip when the append or the probe just before
        wrote the mark. Raises OwnershipLost when the run is not this worker's any more: the call must not go
        out."""

    def in_flight(self, grace_s: float | None = None) -> AbstractContextManager[anyio.CancelScope]:
        """A fresh, unentered scope registered as one of the run's calls in flight while the block runs;
        with ``grace_s``, a cancel lets the call go on that long before it cuts it off."""

    def streamed_text(self, round_number: int, *, max_chars: int) -> StreamedText:
        """Where a model call's streamed text goes: kept for its step, announced as ``delta`` events."""

    @property
    def handing_over(self) -> bool:
        """The worker is shutting down: the run goes back to the queue at its next boundary."""

    @property
    def steering(self) -> bool:
        """A steer reached the run (and no cancel did): its calls are cut off, ``SteerRequested`` comes at the next
        boundary."""

    async def apply_steer(self, answers: Sequence[RunStep], round_number: int) -> str | None:
        """Record ``answers`` (the calls the steer left unanswered), then consume the steer with its ``steer``
        step in one script; the new user message, or None when the steer was no longer there to apply."""


class ToolRunner(Protocol):
    """Executes one tool call on its MCP server; never raises for a tool's failure."""

    @property
    def tools(self) -> Sequence[ToolInfo]: ...

    def problem(self, call: ToolCall) -> str | None:
        """Why the run cannot make ``call`` (no such tool, not allowed), for the model; None when it can."""

    def cancel_grace(self, call: ToolCall) -> float | None:
        """How long a cancel lets ``call`` go on (its tool says ``on_cancel = "finish"``); None: cut off at once."""

    async def execute(self, call: ToolCall, *, interrupt: anyio.CancelScope) -> ToolResult: ...


class LoopEndKind(StrEnum):
    COMPLETED = "completed"
    MAX_ROUNDS = "max_rounds"
    SUSPENDED = "suspended"
    HANDOFF = "handoff"
    """The worker shuts down: the state goes back to the queue for another worker to continue."""


HANDOFF_REASON = TerminationReason.WORKER_SHUTDOWN.value
"""``detail.reason`` of a call cut off by a hand-over (docs/leases.md, "Drain and hand-over")."""
_INTERRUPTED = {
    None: "model call interrupted by a cancel",
    STEERED: "model call interrupted by a steer; its answer was dropped",
    HANDOFF_REASON: "model call interrupted: the worker shut down and handed the run over",
    StepReason.WORKER_LOST.value: "model call interrupted: the worker executing the run was lost",
}
"""A cut-off model step's content by why it was cut off, where no streamed text replaces it."""


def interrupted_model_step(round_number: int, duration_ms: int, why: str | None, partial: str = "") -> RunStep:
    """The step of a model call cut off on purpose: ``interrupted`` (the timeline's ``cancelled``), with
    ``detail.reason`` ``why`` (``steered``, ``worker_shutdown``; none for a cancel, whose reason is the run's);
    the assistant turn it would have made is dropped. ``partial``: what a streamed answer had said by then,
    kept as the content (``detail.partial``), but for a hand-over, whose next worker makes the call again."""
    kept = partial if why not in _MADE_AGAIN else ""
    detail: dict[str, Any] = {"reason": why} if why else {}
    if kept:
        detail["partial"] = True
    return RunStep(kind=StepKind.MODEL, round=round_number, duration_ms=duration_ms, interrupted=True,
                   content=kept or _INTERRUPTED[why], detail=detail)


_MADE_AGAIN = frozenset({HANDOFF_REASON, StepReason.WORKER_LOST.value})
"""Why a cut-off model call is made again by the next worker: its step keeps no partial answer."""


class _HandOverDue(Exception):
    """A model call was cut off by a hand-over: the round is handed over as it stood before the call."""


@dataclass
class LoopState:
    """Where a run's conversation stands; stored as the pending turn while a run waits for approval."""

    messages: list[Message]
    model_calls: int = 0
    """Model calls made so far in the whole run (the next call's ``round_index``)."""
    pending_calls: list[ToolCall] = field(default_factory=list)
    """Tool calls of the current round not yet started: the first waits for approval, or a hand-over came
    before they had a place."""
    approved_call_id: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "messages": [m.to_dict() for m in self.messages],
            "model_calls": self.model_calls,
            "pending_calls": [c.to_dict() for c in self.pending_calls],
            "approved_call_id": self.approved_call_id,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LoopState:
        return cls(
            messages=[Message.from_dict(m) for m in data["messages"]],
            model_calls=int(data["model_calls"]),
            pending_calls=[ToolCall.from_dict(c) for c in data.get("pending_calls", [])],
            approved_call_id=data.get("approved_call_id"),
        )

    @classmethod
    def start(cls, user_input: str) -> LoopState:
        return cls(messages=[Message(role="user", content=user_input)])


@dataclass(frozen=True)
class LoopEnd:
    """How the loop stopped, when it was not by a cancel or an error."""

    kind: LoopEndKind
    content: str | None = None
    state: LoopState | None = None
    final_step: RunStep | None = None
    """COMPLETED: the final model step, recorded with the run's settle in one round trip by the hooks'
    ``complete``; the append's probe still decides (a cancel that won first refuses the settle)."""


class ToolLoop:
    """Runs rounds of one model call plus the tool calls it asks for, those at once."""

    def __init__(
        self,
        provider: ModelProvider,
        runner: ToolRunner,
        hooks: LoopHooks,
        *,
        max_rounds: int,
        approval_required: frozenset[str] = frozenset(),
        max_tool_calls_per_turn: int = 32,
        max_parallel_tool_calls: int = 8,
        max_argument_chars: int = 16_000,
        max_model_content_chars: int = 100_000,
        schema_check_s: float = 5.0,
        settings: ModelSettings = NO_SETTINGS,
        model_name: str = "",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._provider = provider
        self._runner = runner
        self._hooks = hooks
        self._max_rounds = max_rounds
        self._approval_required = approval_required
        self._max_tool_calls_per_turn = max_tool_calls_per_turn
        self._max_parallel_tool_calls = max_parallel_tool_calls
        self._max_argument_chars = max_argument_chars
        self._max_model_content_chars = max_model_content_chars
        self._settings = settings
        self._answer = (None if settings.output_schema is None
                        else AnswerCheck(settings.output_schema, within_s=schema_check_s))
        self._model_name = model_name
        """Which model answers (the catalog name, or an inline provider's tag): each model step's
        ``detail.model``, the label of its tokens in the metrics."""
        self._clock = clock

    async def run(self, state: LoopState) -> LoopEnd:
        """Run until a final answer, ``max_rounds``, or a call that waits for approval; a steer cuts the turn
        off and the run goes on with its message (docs/cancellation.md, "Steer").

        Raises:
            CancelRequested: from the hooks, at the first boundary after a cancel.
            ProviderError: when the model fails (its step is recorded first).
        """
        while True:
            try:
                return await self._rounds(state)
            except SteerRequested:
                await self._steered(state)

    async def _steered(self, state: LoopState) -> None:
        """Apply the steer that stopped the turn: every call it left without a result is answered cancelled,
        the ``steer`` step is recorded, and its message becomes the conversation's next user message."""
        state.pending_calls = []
        state.approved_call_id = None
        answers = answer_unanswered(state.messages, state.model_calls)
        text = await self._hooks.apply_steer(answers, state.model_calls)
        if text is not None:
            state.messages.append(Message(role="user", content=text))

    async def _rounds(self, state: LoopState) -> LoopEnd:
        if state.pending_calls:
            suspended = await self._run_calls(state, state.pending_calls)
            if suspended is not None:
                return suspended
        while True:
            if state.model_calls >= self._max_rounds:
                return LoopEnd(LoopEndKind.MAX_ROUNDS)
            await self._hooks.checkpoint(state.model_calls + 1)
            if self._hooks.handing_over:
                return LoopEnd(LoopEndKind.HANDOFF, state=state)
            try:
                turn, step = await self._model_call(state)
            except _HandOverDue:
                return LoopEnd(LoopEndKind.HANDOFF, state=state)
            state.model_calls += 1
            state.messages.append(Message(role="assistant", content=turn.content, tool_calls=turn.tool_calls))
            if not turn.tool_calls:
                if self._answer is None:
                    await self._hooks.complete(step)
                    return LoopEnd(LoopEndKind.COMPLETED, content=turn.content, final_step=step)
                checked = await self._checked(turn.content)
                if checked.problem is None:
                    step = replace(step, detail={**step.detail, "output_json": checked.value})
                    await self._hooks.complete(step)
                    return LoopEnd(LoopEndKind.COMPLETED, content=turn.content, final_step=step)
                # Handed back like a tool's error (docs/usage.md, "Structured output"); max_rounds bounds it.
                await self._hooks.record(replace(step, detail={**step.detail, "output_error": checked.problem}),
                                         self._next_model(state))
                state.messages.append(Message(role="user", content=hand_back(checked.problem)))
                continue
            await self._hooks.record(step, self._first_calls(state, turn.tool_calls))
            if len(turn.tool_calls) > self._max_tool_calls_per_turn:
                raise RunBoundReached(
                    TerminationReason.TOO_MANY_TOOL_CALLS,
                    f"the model asked for {len(turn.tool_calls)} tool calls in one turn; the limit is "
                    f"{self._max_tool_calls_per_turn} (RUNBRAKE_MAX_TOOL_CALLS_PER_TURN)",
                )
            suspended = await self._run_calls(state, list(turn.tool_calls))
            if suspended is not None:
                return suspended

    def _next_model(self, state: LoopState) -> Sent | None:
        """The mark of the model call that follows the step being recorded (None past the last round)."""
        return Sent(model=state.model_calls + 1) if state.model_calls < self._max_rounds else None

    def _first_calls(self, state: LoopState, calls: Sequence[ToolCall]) -> Sent | None:
        """The marks of the tool calls that start as soon as their model step is recorded: the first ones, up to
        the places free and to the first that waits for approval (the others are marked as they start)."""
        if len(calls) > self._max_tool_calls_per_turn:
            return None
        first = []
        for call in calls[:self._max_parallel_tool_calls]:
            if self._waits_for_approval(call, state):
                break
            if call.problem is None and self._runner.problem(call) is None:
                first.append(call.id)
        return Sent(calls=tuple(first)) if first else None

    async def _checked(self, content: str | None) -> Checked:
        """The final answer checked against the output schema, in flight like a call: a cancel, a steer or a
        hand-over cuts a long check off (its child process killed) and the answer counts as not validated,
        handed back at the step's boundary, where the cancel or steer takes effect (issue 27)."""
        assert self._answer is not None
        checked: Checked | None = None
        with self._hooks.in_flight() as interrupt, interrupt:
            checked = await self._answer.check(content)
        return checked or Checked(problem=INTERRUPTED_CHECK)

    async def _model_call(self, state: LoopState) -> tuple[ModelTurn, RunStep]:
        """The next turn and its step, not yet recorded; an interrupted or failed call is recorded here."""
        round_number = state.model_calls + 1
        started = self._clock()
        turn: ModelTurn | None = None
        error: ProviderError | None = None
        # A streamed answer's text as it arrives: what a cut-off call had said is kept in its step.
        text = self._hooks.streamed_text(round_number, max_chars=self._max_model_content_chars)
        try:
            with self._hooks.in_flight() as interrupt, interrupt:
                await self._sending(None, round_number, interrupt)
                try:
                    turn = await self._provider.complete(state.messages, self._runner.tools,
                                                         round_index=state.model_calls, settings=self._settings,
                                                         text=text)
                except ProviderError as exc:
                    error = exc
        finally:
            text.close()
        duration_ms = _ms(self._clock() - started)
        if turn is None and error is None:
            # The scope swallowed the cancellation: the call was interrupted on purpose. A steer's record
            # raises SteerRequested at its boundary, a cancel's CancelRequested.
            handing_over = not self._hooks.steering and self._hooks.handing_over
            why = STEERED if self._hooks.steering else HANDOFF_REASON if handing_over else None
            await self._hooks.record(interrupted_model_step(round_number, duration_ms, why, text.text))
            if handing_over:  # the probe found no cancel: the next worker makes this call again
                raise _HandOverDue
            # The record's probe raises; reaching here means the cancel (or steer) key could not be read.
            raise ProviderError("model call was interrupted but the run's cancel could not be confirmed")
        if error is not None:
            # A streamed answer that broke off keeps what it had said, as a failed step (never as an answer).
            failed = {**_attempts(error.attempts, error.retried), **({"partial": True} if text.chars else {})}
            await self._hooks.record(
                RunStep(kind=StepKind.MODEL, round=round_number, duration_ms=duration_ms, error=str(error),
                        content=text.text, detail=failed)
            )
            raise error
        assert turn is not None
        detail: dict[str, Any] = _attempts(turn.attempts, turn.retried)
        if self._model_name:
            detail["model"] = self._model_name
        if turn.usage is not None:
            detail["usage"] = turn.usage.to_dict()
        if turn.content is not None and len(turn.content) > self._max_model_content_chars:
            # Bounded like a tool result's content (RUNBRAKE_MAX_MODEL_CONTENT_CHARS), before anything keeps
            # it: the step, the conversation (and so the pending turn), the final answer.
            detail["content_truncated"] = {"chars": len(turn.content), "kept": self._max_model_content_chars}
            turn = replace(turn, content=bound(turn.content, self._max_model_content_chars))
        # The one place a call's arguments are stored (the tool step names the call by its id), bounded.
        detail["tool_calls"] = [_bounded(c.to_dict(), self._max_argument_chars) for c in turn.tool_calls]
        return turn, RunStep(
            kind=StepKind.MODEL,
            round=round_number,
            duration_ms=duration_ms,
            content=turn.content or "",
            detail=detail,
        )

    async def _run_calls(self, state: LoopState, calls: list[ToolCall]) -> LoopEnd | None:
        """Run a turn's calls (or what is left of them) at once, up to the first that waits for approval;
        the results go back to the model in call order (docs/cancellation.md, "Concurrent tool calls").

        Raises:
            CancelRequested: from a step's probe, once every call in flight was cut off and recorded.
        """
        waits = next((i for i, call in enumerate(calls) if self._waits_for_approval(call, state)), len(calls))
        turn = _Turn(round=state.model_calls, calls=calls[:waits],
                     then=self._next_model(state) if waits == len(calls) else None)
        slots = anyio.Semaphore(self._max_parallel_tool_calls)
        async with anyio.create_task_group() as group:
            for index, call in enumerate(turn.calls):
                # Started in call order, as places come free: the calls started are always the first ones.
                await slots.acquire()
                if self._hooks.handing_over or turn.stopped_by is not None:
                    slots.release()
                    break
                turn.started = index + 1
                group.start_soon(self._call, turn, index, call, slots)
        if turn.stopped_by is not None:
            if isinstance(turn.stopped_by, SteerRequested):  # the results so far go with the steer's answers
                state.messages.extend(turn.results[i] for i in sorted(turn.results))
            raise turn.stopped_by
        state.messages.extend(turn.messages())
        if turn.detached or turn.started < len(turn.calls):
            # The hand-over came first: the next worker makes the calls not started, and re-attaches to the
            # MCP tasks and child runs the hand-over left running.
            state.pending_calls = [turn.calls[i] for i in sorted(turn.detached)] + calls[turn.started:]
            if turn.started and state.approved_call_id not in {c.id for c in state.pending_calls}:
                state.approved_call_id = None  # an approved call was among those made
            return LoopEnd(LoopEndKind.HANDOFF, state=state)
        state.approved_call_id = None
        if waits < len(calls):
            state.pending_calls = calls[waits:]
            return LoopEnd(LoopEndKind.SUSPENDED, state=state)
        state.pending_calls = []
        return None

    def _waits_for_approval(self, call: ToolCall, state: LoopState) -> bool:
        return (call.problem is None and call.qualified_name in self._approval_required
                and call.id != state.approved_call_id)

    async def _call(self, turn: _Turn, index: int, call: ToolCall, slots: anyio.Semaphore) -> None:
        """One call of a turn: executed (or handed back, when the run cannot make it), then recorded.

        Never raises but for the task's own cancellation: what stops the turn (the probe's cancel, a bound
        reached, a store that stayed away) is kept in ``turn`` and cuts off the calls still in flight."""
        fails: LostCallFails | None = None
        try:
            started = self._clock()
            problem = call.problem or self._runner.problem(call)
            if problem is not None:
                step = self._invalid_call(turn.round, call, problem)
            else:
                grace_s = self._runner.cancel_grace(call)
                with self._hooks.in_flight(grace_s) as interrupt:
                    turn.scopes[interrupt] = grace_s
                    try:
                        await self._sending(call.id, turn.round, interrupt)
                        result = await self._runner.execute(call, interrupt=interrupt)
                    except LostCallFails as exc:
                        result, fails = exc.result, exc  # recorded, then the run fails
                    finally:
                        turn.release(interrupt)
                step = RunStep.tool(round=turn.round, server=call.server, name=call.tool, result=result,
                                    call_id=call.id, duration_ms=_ms(self._clock() - started))
                if result.outcome is ToolOutcome.CANCELLED and self._hooks.handing_over:
                    # Cut off by the hand-over, not by a cancel (a cancel found by the append's probe still wins).
                    result = ToolResult.cancelled("the call was cut off: the worker executing the run shut down")
                    step = replace(step, content=result.content, detail={**step.detail, "reason": HANDOFF_REASON})
                elif result.outcome is ToolOutcome.CANCELLED and self._hooks.steering:
                    step = steered_step(step)  # cut off by a steer: the run goes on (a cancel still wins)
            if turn.stopped_by is not None and not isinstance(turn.stopped_by, CancelRequested | SteerRequested):
                return  # the run ends otherwise (a bound, the store, the lease): nothing more is written
            turn.results[index] = Message(role="tool", content=step.content, tool_call_id=call.id)
            # The turn's last step marks the model call that follows it.
            last = len(turn.results) == len(turn.calls) and not self._hooks.handing_over
            await self._hooks.record(step, turn.then if last and turn.stopped_by is None and fails is None else None)
            if fails is not None:
                turn.stop(fails)
        except CallHandedOver:
            turn.detached.add(index)  # its task or child run goes on: the next worker re-attaches
        except (CancelRequested, SteerRequested, OwnershipLost, Exception) as exc:  # noqa: BLE001 - raised after the turn
            turn.stop(exc)
        finally:
            slots.release()

    async def _sending(self, call_id: str | None, round_number: int, interrupt: anyio.CancelScope) -> None:
        """Mark the call sent before its request goes out; a run a cancel ended meanwhile cuts the call off here,
        before anything is sent, so that it is recorded cancelled (side effects ``none``) like any call a cancel
        reached on entry."""
        try:
            await self._hooks.sending(call_id, round_number)
        except CancelRequested:
            interrupt.cancel()

    def _invalid_call(self, round_number: int, call: ToolCall, problem: str) -> RunStep:
        """The failed step of a call the run cannot make; its content tells the model what to do instead."""
        names = [tool.model_name for tool in self._runner.tools]
        shown = ", ".join(names[:_MAX_TOOLS_NAMED]) + (f" and {len(names) - _MAX_TOOLS_NAMED} more"
                                                       if len(names) > _MAX_TOOLS_NAMED else "")
        content = (f"invalid tool call: {problem}; it was not executed. "
                   + (f"The tools of this run are: {shown}." if names else "This run has no tools."))
        result = ToolResult.error(bound(content, _MAX_INVALID_CALL_CHARS), failure=Failure.ARGUMENTS)
        step = RunStep.tool(round=round_number, server=call.server, name=call.tool, result=result, call_id=call.id)
        return replace(step, detail={**step.detail, "reason": StepReason.INVALID_CALL.value})


_MAX_TOOLS_NAMED = 50
"""How many of the run's tools an invalid call's message names (the rest are counted)."""
_MAX_INVALID_CALL_CHARS = 4_000
"""The bound on an invalid call's message (a tool name a model made up is bounded before it gets here)."""


@dataclass(eq=False)
class _Turn:
    """The calls of one turn running at once: their results by position, and what stopped the turn."""

    round: int
    calls: list[ToolCall]
    then: Sent | None = None
    """The mark of the model call that follows the turn (None when the turn waits for approval, or was the
    last round): its last step writes it."""
    started: int = 0
    """How many of ``calls`` were started: always the first ones."""
    results: dict[int, Message] = field(default_factory=dict)
    scopes: dict[anyio.CancelScope, float | None] = field(default_factory=dict)
    """The scopes of the calls in flight, to cut them off when the turn stops, with each one's grace (its tool
    says ``on_cancel = "finish"``) or None."""
    timers: dict[anyio.CancelScope, asyncio.TimerHandle] = field(default_factory=dict)
    """The grace timers of ``finish`` calls a cancel reached."""
    stopped_by: BaseException | None = None
    """The first thing that ended the run while the calls ran; raised once every call is back."""
    detached: set[int] = field(default_factory=set)
    """The calls a hand-over left running, unrecorded: the next worker makes them again and re-attaches (to
    the MCP task it polls, worker/mcp_tasks.py, or to the child run, worker/agents.py)."""

    def stop(self, exc: BaseException) -> None:
        """Keep the first reason to stop and cut off the calls still in flight: a cancel found by one call's
        probe interrupts its siblings at once, and each is recorded cancelled (none left unrecorded). A
        ``finish`` call is let go on for its grace by a cancel, cut off at once by anything else."""
        if self.stopped_by is None or (isinstance(self.stopped_by, SteerRequested)
                                       and not isinstance(exc, SteerRequested)):
            self.stopped_by = exc  # anything that ends the run outranks a steer, which only ends the turn
        graceful = isinstance(exc, CancelRequested | SteerRequested)
        for scope, grace_s in self.scopes.items():
            if graceful and grace_s is not None:
                if scope not in self.timers:
                    self.timers[scope] = cut_off_after(scope, grace_s)
            else:
                scope.cancel()

    def release(self, scope: anyio.CancelScope) -> None:
        """A call's scope is done: forget it, and its grace timer."""
        self.scopes.pop(scope, None)
        timer = self.timers.pop(scope, None)
        if timer is not None:
            timer.cancel()

    def messages(self) -> list[Message]:
        """The tool messages of the calls started, in call order (not in the order they completed); a call handed
        over with its task or child run has none yet."""
        return [self.results[i] for i in range(self.started) if i in self.results]


def _attempts(attempts: int, retried: tuple[RetriedAttempt, ...]) -> dict[str, Any]:
    """A model step's ``detail.attempts`` (always) and ``detail.retried`` (the attempts retried, when any)."""
    return {"attempts": attempts, "retried": [r.to_dict() for r in retried]} if retried else {"attempts": attempts}


def _bounded(call: dict[str, Any], max_chars: int) -> dict[str, Any]:
    """A call as stored: arguments longer than ``max_chars`` (as JSON) are kept as a cut excerpt."""
    text = json.dumps(call["arguments"], separators=(",", ":"))
    if len(text) > max_chars:
        call["arguments"] = {"_truncated": text[:max_chars], "_chars": len(text)}
    return call


def _ms(seconds: float) -> int:
    return max(0, round(seconds * 1000))
