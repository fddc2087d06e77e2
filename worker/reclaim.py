"""Reclaim: a run whose worker process was lost goes on from its last recorded step (docs/leases.md,
"Lost workers").

A lost worker (kill -9, an OOM kill, a lost host) cannot say where its runs stood, so what it recorded says it:
the steps, and the marks each call leaves in the run's hash before its request goes out (``sent:<call id>``,
``sent:model``: written by the append just before the call, shared/_scripts.py ``APPEND_STEP``, or else by
``MARK_SENT``). :func:`plan` reads them into what the run's record still
lacks and where the conversation stands:

- a call whose MCP task the run recorded (``task:<call id>``) is not cut off: it goes to the pending turn, and
  the next worker polls the same task instead of calling the tool again (worker/mcp_tasks.py);
- each other call of the last model turn with no step gets one: ``cancelled``, ``detail.reason = "worker_lost"``,
  ``detail.side_effects`` ``unknown`` when its mark says the request went out, ``none`` when it never did;
- a model call in flight (its mark names a round no later step answers) gets an ``interrupted`` step with the
  same reason, and is made again by the next worker;
- a ``handoff`` step names the lost worker and marks the gap;
- the conversation is rebuilt from the steps, as the tool loop had built it (results in call order, a steer's
  message, an answer handed back for its schema), and becomes the run's pending turn, as a hand-over's does.

The store's ``RECLAIM`` script appends those steps and puts the run back to ``queued`` in one guarded step:
refused when anything was appended since it was read.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from runbrake.shared.records import SENT_MODEL, SENT_PREFIX, TASK_PREFIX
from runbrake.shared.spec import OnWorkerLost, RunSpec
from runbrake.shared.status import RunStatus
from runbrake.shared.steps import RunStep, StepKind, StepReason
from runbrake.shared.tool_result import ToolResult
from runbrake.worker.conversation import Message, ToolCall
from runbrake.worker.loop import LoopState, interrupted_model_step
from runbrake.worker.runtime import opening
from runbrake.worker.structured import hand_back

WORKER_LOST = StepReason.WORKER_LOST.value

CUT_OFF = "the call was cut off: the worker executing the run was lost"
"""The content of a lost call's step, which the model is shown as the call's result."""


@dataclass(frozen=True, slots=True)
class Plan:
    """What the reclaim of one run writes: the steps it appends, the pending turn, whether the run fails."""

    seq: int
    """The run's last step sequence when it was read: the script refuses when it moved since."""
    running: bool
    steps: list[RunStep] = field(default_factory=list)
    pending: dict[str, Any] = field(default_factory=dict)
    fail: bool = False
    error: str = ""


def plan(fields: Mapping[str, str], steps: Sequence[RunStep], *, worker: str, max_losses: int,
         policy: Callable[[ToolCall], OnWorkerLost] = lambda _call: OnWorkerLost.REPORT) -> Plan:
    """How to take up the run of the lost worker ``worker`` from its hash ``fields`` and its ``steps``; ``policy``
    says what becomes of each cut-off call (the catalog's ``on_worker_lost``)."""
    seq = int(fields.get("seq") or 0)
    status = RunStatus.parse(fields.get("status"), run_id=fields.get("run_id", ""))
    state, turn = _replay(RunSpec.from_json(fields.get("request") or "{}"), steps)
    cut: list[RunStep] = []
    failing: list[str] = []
    if turn is not None:
        for call in turn.calls:
            if call.id in turn.results:
                continue
            if call.problem is None and fields.get(f"{TASK_PREFIX}{call.id}"):
                state.pending_calls.append(call)  # its task runs on: the next worker polls it
                continue
            sent = _mark(fields.get(f"{SENT_PREFIX}{call.id}")) >= turn.sequence
            chosen = OnWorkerLost.REPORT if call.problem is not None else policy(call)
            result = ToolResult.cancelled(CUT_OFF, sent=sent and call.problem is None)
            step = RunStep.tool(round=turn.round, server=call.server, name=call.tool, result=result, call_id=call.id)
            cut.append(replace(step, detail={**step.detail, "reason": WORKER_LOST, "on_worker_lost": chosen.value}))
            if chosen is OnWorkerLost.RETRY:
                state.pending_calls.append(call)  # made again, first thing, by the worker that takes the run up
                continue
            if chosen is OnWorkerLost.FAIL:
                failing.append(call.qualified_name)
            turn.results[call.id] = Message(role="tool", content=result.content, tool_call_id=call.id)
        state.messages.extend(turn.messages())
    # A turn's last step marks the model call after it: with a call of that turn cut off, none was in flight.
    model = None if cut else _model_in_flight(fields.get(SENT_MODEL), steps)
    if model is not None:
        cut.append(interrupted_model_step(model, 0, WORKER_LOST))
    if status is not RunStatus.RUNNING:
        return Plan(seq, running=False, steps=cut)
    losses = int(fields.get("worker_losses") or 0) + 1
    if losses > max_losses:
        error = (f"the run lost {losses} workers (RUNBRAKE_MAX_WORKER_LOSSES = {max_losses}); the last was "
                 f"{worker}")
        return Plan(seq, running=True, steps=cut, fail=True, error=error)
    if failing:
        error = (f"the worker executing the run ({worker}) was lost during {', '.join(failing)}, whose catalog "
                 "entry says on_worker_lost = \"fail\": a person must look at it")
        return Plan(seq, running=True, steps=cut, fail=True, error=error)
    handoff = RunStep(kind=StepKind.HANDOFF, round=state.model_calls,
                      content="the worker executing the run was lost; the run went back to the queue for another "
                              "worker",
                      detail={"reason": WORKER_LOST, "worker": worker, "cut_off_calls": len(cut),
                              "pending_calls": len(state.pending_calls), "worker_losses": losses})
    return Plan(seq, running=True, steps=[*cut, handoff], pending=state.to_dict())


@dataclass
class _Turn:
    """The last model turn that asked for calls, and the results recorded for them."""

    sequence: int
    round: int
    calls: tuple[ToolCall, ...]
    results: dict[str, Message] = field(default_factory=dict)

    def messages(self) -> list[Message]:
        """The results recorded, in call order (the loop's order: worker/loop.py ``_Turn.messages``)."""
        return [self.results[call.id] for call in self.calls if call.id in self.results]


def _replay(spec: RunSpec, steps: Sequence[RunStep]) -> tuple[LoopState, _Turn | None]:
    """The conversation the steps make, and the last turn that asked for calls, whose results are not in the
    conversation yet (None when there is none since the last steer or model answer)."""
    state = LoopState(messages=opening(spec))
    turn: _Turn | None = None
    for step in steps:
        if step.kind is StepKind.TOOL:
            if step.detail.get("on_worker_lost") == OnWorkerLost.RETRY.value:
                continue  # cut off by a lost worker and made again: its next step is its result
            if turn is not None and step.tool_call_id and step.sequence > turn.sequence:
                turn.results[step.tool_call_id] = Message(role="tool", content=step.content,
                                                          tool_call_id=step.tool_call_id)
            continue
        if step.kind is StepKind.STEER:
            _close(state, turn)
            turn = None
            steered = step.detail.get("input")
            if isinstance(steered, str) and steered:
                state.messages.append(Message(role="user", content=steered))
            continue
        if step.kind is not StepKind.MODEL or step.interrupted or step.error is not None:
            continue  # a call that gave no turn is made again; approvals and hand-overs change no message
        _close(state, turn)
        turn = None
        state.model_calls += 1
        calls = tuple(ToolCall.from_dict(c) for c in step.detail.get("tool_calls") or [] if isinstance(c, dict))
        state.messages.append(Message(role="assistant", content=step.content or None if calls else step.content,
                                      tool_calls=calls))
        problem = step.detail.get("output_error")
        if isinstance(problem, str):
            state.messages.append(Message(role="user", content=hand_back(problem)))
        if calls:
            turn = _Turn(step.sequence, step.round, calls)
    return state, turn


def _close(state: LoopState, turn: _Turn | None) -> None:
    """A turn is over (a later model answer or steer): its results go into the conversation."""
    if turn is not None:
        state.messages.extend(turn.messages())


def _mark(value: str | None) -> int:
    """The step sequence a ``sent:<call id>`` mark was written after (-1 without a mark)."""
    try:
        return int(value) if value else -1
    except ValueError:
        return -1


def _model_in_flight(mark: str | None, steps: Sequence[RunStep]) -> int | None:
    """The round of the model call in flight, when the ``sent:model`` mark names one no later step answers."""
    if not mark:
        return None
    round_text, _, after = mark.partition(" ")
    try:
        round_number, sequence = int(round_text), int(after)
    except ValueError:
        return None
    if any(s.kind is StepKind.MODEL and s.round == round_number and s.sequence > sequence for s in steps):
        return None
    return round_number
