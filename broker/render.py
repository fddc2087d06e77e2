"""How ``runbrake show`` and ``runbrake runs`` present runs: a table for people, JSON for programs."""

from __future__ import annotations

import json
import time
from collections.abc import Collection, Iterable
from datetime import UTC, datetime
from typing import Any, Final

from runbrake.shared.outcome import ToolOutcome
from runbrake.shared.records import (
    ARGUMENT_ERROR,
    CANCELLED_SIDE_EFFECTS_UNKNOWN,
    WORKER_LOST_NONE,
    WORKER_LOST_UNKNOWN,
)
from runbrake.shared.status import RunStatus
from runbrake.shared.steps import RunStep, StepKind, StepReason
from runbrake.shared.store import RunRecord
from runbrake.shared.timeline import Lang, label, outcome_label, step_outcome
from runbrake.shared.tool_result import SideEffects, TaskStatus

_DETAIL_WIDTH = 60
MAX_ARGUMENTS_CHARS: Final = 4000
"""How much of a pending call's arguments ``show`` and ``pending_call`` carry (as JSON text)."""


def run_json(record: RunRecord) -> dict[str, Any]:
    """The object ``show --json`` prints (docs/usage.md, "Using it"): the run, then steps with their outcome;
    ``pending_call`` (the call a waiting run waits on) and ``progress`` (the call in flight's latest MCP
    progress report) are null when there is none."""
    data = record.to_dict()
    data["steps"] = [step_json(step) for step in record.steps]
    data["pending_call"] = pending_call(record)
    data["progress"] = current_progress(record)
    return data


def run_summary(record: RunRecord) -> dict[str, Any]:
    """A run in a listing (``runbrake runs --json``, ``GET /v1/runs``): ``show --json`` without the steps, the
    input, the instructions and the answer; with ``input_preview`` instead."""
    return record.summary()


def pending_call(record: RunRecord) -> dict[str, Any] | None:
    """The call a run waiting for approval waits on: server, tool, call id and arguments. ``arguments_text``
    is the arguments as JSON, cut at MAX_ARGUMENTS_CHARS (``arguments`` is then null)."""
    if record.status is not RunStatus.WAITING_FOR_APPROVAL or not record.pending:
        return None
    calls = record.pending.get("pending_calls") or []
    call = calls[0] if calls and isinstance(calls[0], dict) else None
    if call is None:
        return None
    arguments = call.get("arguments") or {}
    text = json.dumps(arguments, ensure_ascii=False, sort_keys=True)
    cut = len(text) > MAX_ARGUMENTS_CHARS
    return {
        "tool_server": call.get("server"), "tool_name": call.get("tool"), "tool_call_id": call.get("id"),
        "arguments": None if cut else arguments,
        "arguments_text": text[: MAX_ARGUMENTS_CHARS - 1] + "…" if cut else text,
    }


def current_progress(record: RunRecord) -> dict[str, Any] | None:
    """The latest progress report of the call in flight, or None: only while the run is running, and
    only for a call whose step has not been recorded yet (a stale report is never shown)."""
    progress = record.progress
    if record.status is not RunStatus.RUNNING or not progress:
        return None
    if any(s.tool_call_id == progress.get("tool_call_id") for s in record.steps if s.kind is StepKind.TOOL):
        return None
    return dict(progress)


def step_json(step: RunStep) -> dict[str, Any]:
    data = step.to_dict()
    data["outcome"] = step_outcome(step)
    return data


def _when(epoch: float | None) -> str:
    if not epoch:
        return "-"
    return datetime.fromtimestamp(epoch, tz=UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + "Z"


_STEP_REASONS = frozenset(reason.value for reason in StepReason)
_SIDE_EFFECTS = frozenset(effects.value for effects in SideEffects)
_TASK_STATUSES = frozenset(status.value for status in TaskStatus)


def _detail(step: RunStep, lang: Lang = "en") -> str:
    calls_label = label("run.calls", lang)
    if step.kind is StepKind.TOOL:
        name = f"{step.tool_server}.{step.tool_name}" if step.tool_server else str(step.tool_name)
        reason = step.detail.get("reason")
        if reason in _STEP_REASONS:
            name = f"{name} ({label(f'step_reason.{reason}', lang)})"
        task_status = step.detail.get("task_status")
        if task_status in _TASK_STATUSES:
            name = f"{name} ({label(f'task_status.{task_status}', lang)})"
        side_effects = step.detail.get("side_effects")
        if side_effects in _SIDE_EFFECTS:
            name = f"{name} ({label(f'side_effects.{side_effects}', lang)})"
        text = f"{name}: {step.content}"
    elif step.kind is StepKind.MODEL:
        calls = step.detail.get("tool_calls") or []
        names = ", ".join(f"{c['server']}.{c['tool']}" for c in calls)
        text = step.error or step.content or (f"{calls_label} {names}" if names else "")
        if names and step.content:
            text = f"{step.content} ({calls_label} {names})"
    elif step.kind is StepKind.STEER:
        text = str(step.detail.get("input", ""))
        if step.detail.get("requested_by"):
            text += f" ({label('run.by', lang)} {step.detail['requested_by']})"
    else:
        decision = str(step.detail.get("decision", ""))
        text = f"{label(f'decision.{decision}', lang) if decision else ''}: {step.content}"
        if step.detail.get("decided_by"):
            text += f" ({label('run.by', lang)} {step.detail['decided_by']})"
    text = " ".join(text.split())
    return text if len(text) <= _DETAIL_WIDTH else text[: _DETAIL_WIDTH - 1] + "…"


def render_run(record: RunRecord, lang: Lang = "en") -> str:
    """The run's header and its timeline as a text table with an Outcome column."""
    reason = record.termination_reason
    lines = [
        f"{label('run.run', lang)} {record.run_id}",
        f"  {label('run.status', lang)}: {label(f'status.{record.status.value}', lang)}"
        + (f"   {label('run.reason', lang)}: {label(f'reason.{reason.value}', lang)}" if reason else ""),
        f"  {label('run.created', lang)}: {_when(record.created_at)}   {label('run.started', lang)}: "
        f"{_when(record.started_at)}   {label('run.finished', lang)}: {_when(record.finished_at)}",
    ]
    if record.model is not None:
        usage = record.usage
        lines.append(f"  {label('run.model', lang)}: {record.model}   {label('run.tokens', lang)}: "
                     f"{usage.total_tokens} ({usage.input_tokens} {label('run.tokens_in', lang)}, "
                     f"{usage.output_tokens} {label('run.tokens_out', lang)}, "
                     f"{usage.model_calls} {label('run.model_calls', lang)})")
    budget = _budget_line(record, lang)
    if budget:
        lines.append(f"  {label('run.budget', lang)}: {budget}")
    if record.labels:
        lines.append(f"  {label('run.labels', lang)}: "
                     + ", ".join(f"{key}={value}" for key, value in sorted(record.labels.items())))
    if record.status is RunStatus.QUEUED and record.lost_worker is not None:
        lines.append(f"  {label('run.worker_lost', lang)}: {record.lost_worker}")
    if record.parent_run_id is not None:
        lines.append(f"  {label('run.parent', lang)}: {record.parent_run_id}   {label('run.thread', lang)}: "
                     f"{record.thread}")
    if record.caller_run_id is not None:
        lines.append(f"  {label('run.caller', lang)}: {record.caller_run_id}   {label('run.root', lang)}: "
                     f"{record.root} ({label('run.depth', lang)} {record.depth})")
    if record.children:
        lines.append(f"  {label('run.children', lang)}: "
                     + ", ".join(record.children[call] for call in sorted(record.children)))
    if record.waiting_below:
        lines.append(f"  {label('run.waiting_below', lang)}: {', '.join(record.waiting_below)}")
    if record.cancel is not None:
        lines.append(
            f"  {label('run.cancel', lang)}: {record.cancel.reason!r} {label('run.by', lang)} "
            f"{record.cancel.requested_by} {label('run.at', lang)} {_when(record.cancel.requested_at)}"
        )
    if record.error:
        lines.append(f"  {label('run.error', lang)}: {record.error}")
    waiting_on = pending_call(record)
    if waiting_on is not None:
        lines.append(f"  {label('run.pending_call', lang)}: {waiting_on['tool_server']}.{waiting_on['tool_name']}"
                     f" {waiting_on['arguments_text']}")
    headers = [label(k, lang) for k in
               ("column.sequence", "column.round", "column.kind", "column.duration", "column.outcome", "column.detail")]
    rows = [
        [str(s.sequence), str(s.round), label(f"kind.{s.kind.value}", lang), str(s.duration_ms),
         outcome_label(step_outcome(s), lang), _detail(s, lang)]
        for s in record.steps
    ]
    in_flight = current_progress(record)
    if in_flight is not None:
        rows.append(_in_flight_row(record, in_flight, lang))
    lines.append("")
    lines.extend(_table(headers, rows))
    return "\n".join(lines)


def _budget_line(record: RunRecord, lang: Lang) -> str:
    """What the run used of the budget its spec gave, bound by bound: tokens, cost, deadline (and, while the
    run is not over, the time left); "" without a budget (docs/usage.md, "Budgets")."""
    budget, use = record.budget, record.to_dict()["budget_use"]
    if budget is None or use is None:
        return ""
    parts = []
    if "max_total_tokens" in budget:
        parts.append(f"{label('run.budget_tokens', lang)} {use['tokens']}/{budget['max_total_tokens']}")
    if "max_cost_usd" in budget:
        parts.append(f"{label('run.budget_cost', lang)} {use['cost_usd'] or 0:.6f}/{budget['max_cost_usd']:g} USD")
    if use["deadline_at"] is not None:
        text = f"{label('run.budget_deadline', lang)} {_when(use['deadline_at'])}"
        if not record.status.is_terminal:
            text += f" ({max(0.0, use['deadline_at'] - time.time()):.0f} s {label('run.budget_left', lang)})"
        parts.append(text)
    return ", ".join(parts)


def _in_flight_row(record: RunRecord, progress: dict[str, Any], lang: Lang) -> list[str]:
    """The call in flight as a timeline row: no sequence yet, its elapsed time, its latest progress."""
    started = progress.get("started_at")
    elapsed = max(0, round((time.time() - started) * 1000)) if isinstance(started, int | float) else 0
    done, total, message = progress.get("progress"), progress.get("total"), progress.get("message")
    amount = "" if done is None else f"{done:g}" + ("" if total is None else f"/{total:g}")
    text = " ".join(part for part in (amount, message or "") if part)
    detail = " ".join(f"{progress.get('tool_server')}.{progress.get('tool_name')}: {text}".split())
    round_number = record.steps[-1].round if record.steps else 0
    return ["…", str(round_number), label("kind.tool", lang), str(elapsed), label("run.in_flight", lang),
            detail if len(detail) <= _DETAIL_WIDTH else detail[: _DETAIL_WIDTH - 1] + "…"]


def render_runs(records: list[RunRecord]) -> str:
    headers = ["run_id", "status", "reason", "created"]
    rows = [[r.run_id, r.status.value, r.termination_reason.value, _when(r.created_at)] for r in records]
    return "\n".join(_table(headers, rows)) if rows else "(no runs)"


def server_health(counts: dict[str, dict[str, int]]) -> list[dict[str, Any]]:
    """Per server (by its catalog name): the counts by outcome, argument errors apart from failures, and
    ``failure_rate`` = failed / (ok + failed). Cancelled calls and argument errors (the caller's mistakes)
    are counted, shown, and left out of the rate; ``None`` when nothing completed or failed yet."""
    health = []
    for server in sorted(counts):
        by_outcome = {outcome.value: counts[server].get(outcome.value, 0) for outcome in ToolOutcome}
        lost_unknown = counts[server].get(WORKER_LOST_UNKNOWN, 0)
        lost = counts[server].get(WORKER_LOST_NONE, 0) + lost_unknown
        unknown = counts[server].get(CANCELLED_SIDE_EFFECTS_UNKNOWN, 0) + lost_unknown
        by_outcome[ToolOutcome.CANCELLED.value] += counts[server].get(CANCELLED_SIDE_EFFECTS_UNKNOWN, 0) + lost
        decided = by_outcome["ok"] + by_outcome["failed"]
        rate = by_outcome["failed"] / decided if decided else None
        health.append({"server": server, **by_outcome, "argument_errors": counts[server].get(ARGUMENT_ERROR, 0),
                       "side_effects_unknown": unknown, "worker_lost": lost, "failure_rate": rate})
    return health


def tenant_server_health(counts: dict[str, dict[str, int]], usable: Iterable[str],
                         alone: Collection[str]) -> list[dict[str, Any]]:
    """A tenant's :func:`server_health`: the catalog servers ``usable`` by it, each with its counts where the tenant
    ``alone`` may use it; the counts (and rate) of a server other tenants' runs use too are None: they are of
    those runs too (docs/security.md, "Tenants")."""
    health = {h["server"]: h for h in server_health({name: counts.get(name, {}) for name in usable})}
    return [health[name] if name in alone else {**dict.fromkeys(health[name]), "server": name}
            for name in sorted(health)]


def render_servers(health: list[dict[str, Any]]) -> str:
    headers = ["server", "ok", "failed", "argument errors", "cancelled", "side effects unknown", "worker lost",
               "failure rate"]
    rows = [[h["server"], str(h["ok"]), str(h["failed"]), str(h["argument_errors"]), str(h["cancelled"]),
             str(h["side_effects_unknown"]), str(h["worker_lost"]),
             "-" if h["failure_rate"] is None else f"{h['failure_rate']:.1%}"] for h in health]
    return "\n".join(_table(headers, rows)) if rows else "(no tool calls recorded)"


WEBHOOK_FIELDS: Final = ("webhook", "run_id", "event_id", "type", "status", "attempts", "status_code", "error",
                          "occurred_at", "created_at", "last_attempt_at", "next_attempt_at", "delivered_at")
"""What a delivery shows (``runbrake webhooks --json``, ``GET /v1/webhooks``): never its body or signature."""


def webhook_deliveries(stored: list[dict[str, str]]) -> list[dict[str, Any]]:
    """Deliveries as stored, as shown: numbers as numbers, times as epoch seconds (None when not yet)."""
    shown = []
    for delivery in stored:
        item: dict[str, Any] = {}
        for name in WEBHOOK_FIELDS:
            value = delivery.get(name, "")
            if name in ("attempts", "status_code"):
                item[name] = int(float(value or 0))
            elif name.endswith("_at"):
                item[name] = float(value) if value and float(value) > 0 else None
            else:
                item[name] = value
        shown.append(item)
    return shown


def render_webhooks(deliveries: list[dict[str, Any]]) -> str:
    headers = ["webhook", "run", "event", "type", "status", "attempts", "last answer"]
    rows = [[d["webhook"], d["run_id"], d["event_id"], d["type"], d["status"], str(d["attempts"]),
             d["error"] or (str(d["status_code"]) if d["status_code"] else "-")] for d in deliveries]
    return "\n".join(_table(headers, rows)) if rows else "(no webhook deliveries recorded)"


def _table(headers: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    def line(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()
    return [line(headers), line(["-" * w for w in widths]), *(line(r) for r in rows)]
