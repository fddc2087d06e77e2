"""What a steer does to a run's turn (docs/cancellation.md, "Steer"): the calls it cut off are recorded
``cancelled`` with ``detail.reason = "steered"``, the calls of the turn that never started are answered the
same way (a model refuses a history with a tool call left unanswered), and a ``steer`` step records the new
user message, which the loop appends before it goes on.

The loop (worker/loop.py) and the runtime's hooks (worker/runtime.py) call these; the registry
(worker/registry.py) holds the steer that reached the run until it is applied.
"""

from __future__ import annotations

from dataclasses import replace

from runbrake.shared.records import SteerRequest
from runbrake.shared.steps import RunStep, StepKind, StepReason
from runbrake.shared.tool_result import ToolResult
from runbrake.worker.conversation import Message

STEERED = StepReason.STEERED.value
"""``detail.reason`` of a call a steer cut off or answered, and of a model call it interrupted."""

CUT_OFF = "the call was cut off: the run was steered with a new message"
NOT_STARTED = "the call was not made: the run was steered with a new message first"


def steered_step(step: RunStep) -> RunStep:
    """A tool step a steer cut off, as recorded: ``cancelled`` (the result said so), reason ``steered``, its
    ``detail.side_effects`` kept."""
    return replace(step, content=CUT_OFF, detail={**step.detail, "reason": STEERED})


def answer_unanswered(messages: list[Message], round_number: int) -> list[RunStep]:
    """Answer, in ``messages``, every tool call of the last assistant turn that has no result yet, as cancelled
    (never sent: side effects ``none``), and put that turn's results in call order; the steps to record, in
    call order too."""
    last = next((i for i in range(len(messages) - 1, -1, -1) if messages[i].role == "assistant"), None)
    if last is None or not messages[last].tool_calls:
        return []
    answered = {m.tool_call_id: m for m in messages[last + 1:] if m.role == "tool"}
    steps: list[RunStep] = []
    results: list[Message] = []
    for call in messages[last].tool_calls:
        if call.id in answered:
            results.append(answered[call.id])
            continue
        result = ToolResult.cancelled(NOT_STARTED, sent=False)
        step = RunStep.tool(round=round_number, server=call.server, name=call.tool, result=result, call_id=call.id)
        steps.append(replace(step, detail={**step.detail, "reason": STEERED}))
        results.append(Message(role="tool", content=result.content, tool_call_id=call.id))
    messages[last + 1:] = results
    return steps


def steer_step(steer: SteerRequest, round_number: int) -> RunStep:
    """The ``steer`` step: the new input, who asked, why and when, in ``detail``; its content says why."""
    return RunStep(kind=StepKind.STEER, round=round_number, content=steer.reason or "steered with a new message",
                   detail=steer.detail())
