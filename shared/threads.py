"""Threads: a finished run carried on by a new one (docs/store.md, "Threads").

A continuation is an ordinary run whose spec's ``messages`` hold its parent's whole conversation: the
parent's own ``messages``, its ``input``, every model turn (its text and the tool calls it asked for), every
tool call's result in call order, and its answer. Built from what the store keeps (shared/steps.py): a
model step's ``detail.tool_calls`` and each tool step's ``tool_call_id``. A call the parent never answered
(cut off before it started, waiting for an approval that a cancel or a denial ended) is answered as
cancelled, so every call in the history has its result, as OpenAI and Anthropic require.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Final

from runbrake.shared.errors import SpecError
from runbrake.shared.records import RunRecord
from runbrake.shared.status import RunStatus
from runbrake.shared.steps import RunStep, StepKind

if TYPE_CHECKING:
    from runbrake.shared.spec import RunSpec

NOT_INHERITED: Final = frozenset({"input", "messages", "idempotency_key"})
"""The parent's spec fields a continuation does not take over: its own ``input`` and ``idempotency_key``
come from the request, and its ``messages`` are the parent's conversation."""

MAX_CALL_ID_CHARS: Final = 200
"""What a history's tool call id may hold (shared/spec.py ``HistoryToolCall``)."""


@dataclass(frozen=True, slots=True)
class ThreadLink:
    """Where a new run sits in a thread: the run it continues, and the thread's first run (its root)."""

    parent_run_id: str
    thread: str


def finished(status: RunStatus) -> bool:
    """Whether a run of ``status`` may be continued: completed, failed or cancelled."""
    return status.is_terminal


def hand_back(problem: str) -> str:
    """The message that tells the model its answer does not match the schema (worker/structured.py uses it
    in the run; a continuation's history repeats it, so that the model sees what it saw)."""
    return (f"Your answer does not match the required output schema: {problem}. "
            "Answer again with JSON only, matching the schema.")


def continuation(parent: RunRecord, body: Mapping[str, Any]) -> RunSpec:
    """The spec of a run that carries on ``parent``'s conversation with ``body`` (``input`` and any run-spec
    field but ``messages``): the parent's spec, each field the body gives replacing the parent's, and the
    parent's conversation as ``messages``.

    Raises:
        SpecError: ``body`` gives ``messages``, or the spec it makes is invalid (naming every field).
    """
    if "messages" in body:
        raise SpecError("messages", "a continuation's history is its parent's conversation; give input (and any "
                                    "other spec field) instead")
    raw = {key: value for key, value in parent.request.items() if key not in NOT_INHERITED}
    raw.update(body)
    raw["messages"] = conversation(parent, _servers(raw.get("mcp_servers")))
    # Imported here: the run store imports this module, and the spec's models cost more to import than a
    # command that only reads runs takes in all (docs/benchmarks.md, "CLI start-up (`bench/cli_startup.py`)").
    from runbrake.shared.spec import RunSpec  # noqa: PLC0415

    return RunSpec.parse(raw)


def conversation(parent: RunRecord, servers: frozenset[str]) -> list[dict[str, Any]]:
    """``parent``'s conversation in the spec's ``messages`` form (shared/spec.py ``HistoryMessage``).

    A call to a server the continuation does not declare is not carried (with its result): the history
    may only name the run's servers, and a call the model made up (a tool of no server, ``invalid_call``)
    names none. Arguments the store kept cut (``_truncated``) are carried as ``{"_truncated": true,
    "_chars": N}``: the call is shown, what it asked is not made up.
    """
    request = parent.request
    messages: list[dict[str, Any]] = [dict(m) for m in request.get("messages") or [] if isinstance(m, Mapping)]
    messages.append({"role": "user", "content": parent.input or ""})
    results: dict[str, RunStep] = {}
    for step in parent.steps:
        if step.kind is StepKind.TOOL and step.tool_call_id:
            results.setdefault(step.tool_call_id, step)
    for step in parent.steps:
        if step.kind is StepKind.STEER:  # the new user message a steer gave the run (docs/cancellation.md, "Steer")
            steered = step.detail.get("input")
            if isinstance(steered, str) and steered:
                messages.append({"role": "user", "content": steered})
            continue
        if step.kind is not StepKind.MODEL or step.interrupted or step.error is not None:
            continue  # a call that gave no turn: the next one was made in its place, or the run ended
        calls = [call for call in (_call(c, servers) for c in step.detail.get("tool_calls") or []) if call]
        if calls:
            messages.append({"role": "assistant", "content": step.content or None, "tool_calls": calls})
            messages += [{"role": "tool", "tool_call_id": call["id"], "content": _result(results.get(call["id"]),
                                                                                          parent)}
                         for call in calls]
        elif step.content:  # an empty turn says nothing (and Anthropic refuses an empty text)
            messages.append({"role": "assistant", "content": step.content})
        problem = step.detail.get("output_error")
        if isinstance(problem, str):
            messages.append({"role": "user", "content": hand_back(problem)})
    return messages


MAX_RECEIVED_MESSAGES: Final = 200
"""How many messages a model call's view shows: the last ones (``omitted`` counts those left out before)."""
MAX_RECEIVED_CHARS: Final = 20_000
"""How much of one message's text a model call's view shows (``content_truncated`` gives the whole length)."""


def received(record: RunRecord, sequence: int) -> dict[str, Any]:
    """What the model call of step ``sequence`` was sent (docs/http-api.md, "What a model call received"):
    the run's instructions, its history, its input and the conversation rebuilt from the steps before it,
    as :func:`conversation` rebuilds a thread's (every call kept, made-up ones too: the model saw them),
    bounded (:data:`MAX_RECEIVED_MESSAGES`, :data:`MAX_RECEIVED_CHARS`); and the run's model settings.

    Raises:
        LookupError: the run has no step ``sequence``.
        ValueError: that step is not a model step.
    """
    index = next((i for i, step in enumerate(record.steps) if step.sequence == sequence), None)
    if index is None:
        raise LookupError(f"run {record.run_id} has no step {sequence}")
    step = record.steps[index]
    if step.kind is not StepKind.MODEL:
        raise ValueError(f"step {sequence} is a {step.kind.value} step; only a model step was sent messages")
    before = replace(record, steps=record.steps[:index])
    named = {c.get("server") for s in before.steps if s.kind is StepKind.MODEL
             for c in s.detail.get("tool_calls") or [] if isinstance(c, Mapping)}
    messages = conversation(before, frozenset(name for name in named if isinstance(name, str)))
    if record.instructions is not None:
        messages.insert(0, {"role": "system", "content": record.instructions})
    omitted = max(0, len(messages) - MAX_RECEIVED_MESSAGES)
    settings = record.request.get("model_settings")
    return {"run_id": record.run_id, "sequence": sequence, "round": step.round,
            "model": step.detail.get("model", record.model), "settings": dict(settings) if isinstance(
                settings, Mapping) else {}, "output_schema": record.request.get("output_schema") is not None,
            "omitted": omitted, "messages": [_shown(m) for m in messages[omitted:]]}


def _shown(message: dict[str, Any]) -> dict[str, Any]:
    content = message.get("content")
    if isinstance(content, str) and len(content) > MAX_RECEIVED_CHARS:
        return {**message, "content": content[:MAX_RECEIVED_CHARS], "content_truncated": {"chars": len(content)}}
    return message


def _servers(declared: object) -> frozenset[str]:
    if isinstance(declared, Mapping):
        return frozenset(str(name) for name in declared)
    if isinstance(declared, list):
        return frozenset(name for name in declared if isinstance(name, str))
    return frozenset()


def _call(stored: object, servers: frozenset[str]) -> dict[str, Any] | None:
    """A model step's stored call as a history's call, or None when the history cannot name it."""
    if not isinstance(stored, Mapping):
        return None
    call_id, server, tool = stored.get("id"), stored.get("server"), stored.get("tool")
    if not (isinstance(call_id, str) and 0 < len(call_id) <= MAX_CALL_ID_CHARS and isinstance(tool, str) and tool
            and isinstance(server, str) and server in servers):
        return None
    arguments = stored.get("arguments")
    if not isinstance(arguments, Mapping):
        arguments = {}
    elif "_truncated" in arguments:
        arguments = {"_truncated": True, "_chars": arguments.get("_chars")}
    return {"id": call_id, "server": server, "tool": tool, "arguments": dict(arguments)}


def _result(step: RunStep | None, parent: RunRecord) -> str:
    """A call's result as the model is shown it: its step's content, or, for a call the parent never
    made, that it was cancelled and why."""
    if step is not None:
        return step.content
    ended = parent.status.value + (f" ({parent.termination_reason.value})" if parent.termination_reason.value else "")
    return f"cancelled: the call was not made; the run ended {ended} before it"
