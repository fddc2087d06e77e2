"""How ``runbrake show`` and ``runbrake runs`` present runs: a table for people, JSON for programs."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from runbrake.shared._store_core import ARGUMENT_ERROR
from runbrake.shared.outcome import ToolOutcome
from runbrake.shared.steps import RunStep, StepKind
from runbrake.shared.store import RunRecord
from runbrake.shared.timeline import Lang, label, outcome_label, step_outcome

_DETAIL_WIDTH = 60


def run_json(record: RunRecord) -> dict[str, Any]:
    """The object ``show --json`` prints (README.md, "Using it"): the run, then steps with their outcome."""
    data = record.to_dict()
    data["steps"] = [step_json(step) for step in record.steps]
    return data


def step_json(step: RunStep) -> dict[str, Any]:
    data = step.to_dict()
    data["outcome"] = step_outcome(step)
    return data


def _when(epoch: float | None) -> str:
    if not epoch:
        return "-"
    return datetime.fromtimestamp(epoch, tz=UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + "Z"


def _detail(step: RunStep) -> str:
    if step.kind is StepKind.TOOL:
        text = f"{step.tool_server}.{step.tool_name}: {step.content}"
    elif step.kind is StepKind.MODEL:
        calls = step.detail.get("tool_calls") or []
        names = ", ".join(f"{c['server']}.{c['tool']}" for c in calls)
        text = step.error or step.content or (f"calls {names}" if names else "")
        if names and step.content:
            text = f"{step.content} (calls {names})"
    else:
        text = f"{step.detail.get('decision', '')}: {step.content}"
    text = " ".join(text.split())
    return text if len(text) <= _DETAIL_WIDTH else text[: _DETAIL_WIDTH - 1] + "…"


def render_run(record: RunRecord, lang: Lang = "en") -> str:
    """The run's header and its timeline as a text table with an Outcome column."""
    lines = [
        f"run {record.run_id}",
        f"  {label('run.status', lang)}: {record.status.value}"
        + (f"   {label('run.reason', lang)}: {record.termination_reason.value}" if record.termination_reason else ""),
        f"  {label('run.created', lang)}: {_when(record.created_at)}   started: {_when(record.started_at)}"
        f"   finished: {_when(record.finished_at)}",
    ]
    if record.cancel is not None:
        lines.append(
            f"  {label('run.cancel', lang)}: {record.cancel.reason!r} by {record.cancel.requested_by}"
            f" at {_when(record.cancel.requested_at)}"
        )
    if record.error:
        lines.append(f"  error: {record.error}")
    headers = [label(k, lang) for k in
               ("column.sequence", "column.round", "column.kind", "column.duration", "column.outcome", "column.detail")]
    rows = [
        [str(s.sequence), str(s.round), label(f"kind.{s.kind.value}", lang), str(s.duration_ms),
         outcome_label(step_outcome(s), lang), _detail(s)]
        for s in record.steps
    ]
    lines.append("")
    lines.extend(_table(headers, rows))
    return "\n".join(lines)


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
        decided = by_outcome["ok"] + by_outcome["failed"]
        rate = by_outcome["failed"] / decided if decided else None
        health.append({"server": server, **by_outcome, "argument_errors": counts[server].get(ARGUMENT_ERROR, 0),
                       "failure_rate": rate})
    return health


def render_servers(health: list[dict[str, Any]]) -> str:
    headers = ["server", "ok", "failed", "argument errors", "cancelled", "failure rate"]
    rows = [[h["server"], str(h["ok"]), str(h["failed"]), str(h["argument_errors"]), str(h["cancelled"]),
             "-" if h["failure_rate"] is None else f"{h['failure_rate']:.1%}"] for h in health]
    return "\n".join(_table(headers, rows)) if rows else "(no tool calls recorded)"


def _table(headers: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    def line(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()
    return [line(headers), line(["-" * w for w in widths]), *(line(r) for r in rows)]
