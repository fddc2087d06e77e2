"""The timeline: what each step came to, and the labels it is shown with (docs/usage.md, "Using it": Outcome).

One string travels end to end (docs/store.md, "Tool outcomes: one string end to
end"): ``ToolOutcome.CANCELLED.value`` is the stored ``tool_outcome``, the timeline's
outcome, and the suffix of the label key ``outcome.cancelled``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

from runbrake.shared.outcome import ToolOutcome
from runbrake.shared.steps import RunStep, StepKind

Lang = Literal["en", "de"]
NO_OUTCOME = ""


def step_outcome(step: RunStep) -> str:
    """The outcome a step states: ``ok``, ``failed``, ``cancelled``, or ``""`` for none.

    A tool step states the outcome it stored. A model step states one only when
    its call did not complete: cut off by a cancel (``cancelled``) or failed at
    the provider (``failed``).
    """
    if step.kind is StepKind.TOOL:
        return NO_OUTCOME if step.tool_outcome is None else step.tool_outcome.value
    if step.kind is StepKind.MODEL:
        if step.interrupted:
            return ToolOutcome.CANCELLED.value
        if step.error is not None:
            return ToolOutcome.FAILED.value
    return NO_OUTCOME


def outcome_label_key(outcome: str) -> str:
    """The catalog key for an outcome value."""
    return f"outcome.{outcome}"


LABELS: Mapping[Lang, Mapping[str, str]] = {
    "en": {
        "delivery.pending": "pending",
        "delivery.retrying": "retrying",
        "delivery.delivered": "delivered",
        "delivery.gave_up": "given up",
        "column.outcome": "Outcome",
        "column.sequence": "#",
        "column.kind": "Kind",
        "column.round": "Round",
        "column.duration": "ms",
        "column.detail": "Detail",
        "outcome.ok": "ok",
        "outcome.failed": "failed",
        "outcome.cancelled": "cancelled",
        "kind.model": "model",
        "kind.tool": "tool",
        "kind.approval": "approval",
        "kind.handoff": "hand-over",
        "kind.steer": "steer",
        "kind.unknown": "unknown",
        "run.status": "Status",
        "run.reason": "Reason",
        "run.cancel": "Cancelled",
        "run.created": "Created",
        "run.started": "started",
        "run.finished": "finished",
        "run.error": "error",
        "run.by": "by",
        "run.at": "at",
        "run.calls": "calls",
        "run.pending_call": "Waiting for approval",
        "run.in_flight": "in flight",
        "run.run": "run",
        "run.model": "Model",
        "run.tokens": "Tokens",
        "run.tokens_in": "in",
        "run.tokens_out": "out",
        "run.model_calls": "model calls",
        "run.labels": "Labels",
        "run.budget": "Budget",
        "run.budget_tokens": "tokens",
        "run.budget_cost": "cost",
        "run.budget_deadline": "deadline",
        "run.budget_left": "left",
        "run.parent": "Continues",
        "run.worker_lost": "worker lost, resuming",
        "run.thread": "Thread",
        "run.caller": "Called by",
        "run.root": "Tree",
        "run.depth": "depth",
        "run.children": "Agent runs",
        "run.waiting_below": "Waiting for approval below",
        "decision.approved": "approved",
        "decision.denied": "denied",
        "status.queued": "queued",
        "status.running": "running",
        "status.waiting_for_approval": "waiting for approval",
        "status.completed": "completed",
        "status.failed": "failed",
        "status.cancelled": "cancelled",
        "status.unknown": "unknown",
        "reason.completed": "completed",
        "reason.max_rounds": "round limit reached",
        "reason.provider_failed": "model provider failed",
        "reason.tool_loop_error": "error in the tool loop",
        "reason.approval_denied": "approval denied",
        "reason.cancelled": "cancelled",
        "reason.retries_exhausted": "retries exhausted",
        "reason.lease_lost": "worker lost",
        "reason.time_limit": "time limit reached",
        "reason.worker_shutdown": "worker shut down",
        "reason.enqueue_failed": "enqueue failed",
        "reason.spec_refused": "spec refused",
        "reason.max_steps": "step limit reached",
        "reason.too_many_tool_calls": "too many tool calls in one turn",
        "reason.budget_exceeded": "budget exceeded",
        "reason.deadline_exceeded": "deadline exceeded",
        "reason.unknown": "unknown",
        "event.step": "step",
        "event.progress": "progress",
        "event.delta": "streamed text",
        "event.status": "status",
        "event.end": "end of stream",
        "event.dropped": "dropped (too far behind)",
        "event.resync": "read again",
        "step_reason.invalid_call": "invalid call, handed back to the model",
        "step_reason.steered": "cut off by a steer, the run went on",
        "step_reason.worker_lost": "cut off: its worker was lost",
        "side_effects.none": "not sent, no side effects",
        "side_effects.unknown": "sent, side effects unknown",
        "task_status.working": "MCP task still working",
        "task_status.input_required": "MCP task asked for input",
        "task_status.completed": "MCP task completed",
        "task_status.failed": "MCP task failed",
        "task_status.cancelled": "MCP task cancelled",
        "task_status.lost": "MCP task lost: its server no longer knows it",
    },
    "de": {
        "delivery.pending": "ausstehend",
        "delivery.retrying": "wird wiederholt",
        "delivery.delivered": "zugestellt",
        "delivery.gave_up": "aufgegeben",
        "column.outcome": "Ergebnis",
        "column.sequence": "#",
        "column.kind": "Art",
        "column.round": "Runde",
        "column.duration": "ms",
        "column.detail": "Detail",
        "outcome.ok": "ok",
        "outcome.failed": "fehlgeschlagen",
        "outcome.cancelled": "abgebrochen",
        "kind.model": "Modell",
        "kind.tool": "Werkzeug",
        "kind.approval": "Freigabe",
        "kind.handoff": "Übergabe",
        "kind.steer": "Umlenkung",
        "kind.unknown": "unbekannt",
        "run.status": "Status",
        "run.reason": "Grund",
        "run.cancel": "Abgebrochen",
        "run.created": "Erstellt",
        "run.started": "gestartet",
        "run.finished": "beendet",
        "run.error": "Fehler",
        "run.by": "von",
        "run.at": "am",
        "run.calls": "ruft auf",
        "run.pending_call": "Wartet auf Freigabe",
        "run.in_flight": "läuft",
        "run.run": "Lauf",
        "run.model": "Modell",
        "run.tokens": "Tokens",
        "run.tokens_in": "ein",
        "run.tokens_out": "aus",
        "run.model_calls": "Modellaufrufe",
        "run.labels": "Labels",
        "run.budget": "Budget",
        "run.budget_tokens": "Tokens",
        "run.budget_cost": "Kosten",
        "run.budget_deadline": "Frist",
        "run.budget_left": "übrig",
        "run.parent": "Setzt fort",
        "run.worker_lost": "Worker verloren, wird fortgesetzt",
        "run.thread": "Verlauf",
        "run.caller": "Aufgerufen von",
        "run.root": "Baum",
        "run.depth": "Tiefe",
        "run.children": "Agentenläufe",
        "run.waiting_below": "Darunter wartet auf Freigabe",
        "decision.approved": "freigegeben",
        "decision.denied": "abgelehnt",
        "status.queued": "wartet",
        "status.running": "läuft",
        "status.waiting_for_approval": "wartet auf Freigabe",
        "status.completed": "abgeschlossen",
        "status.failed": "fehlgeschlagen",
        "status.cancelled": "abgebrochen",
        "status.unknown": "unbekannt",
        "reason.completed": "abgeschlossen",
        "reason.max_rounds": "Rundenlimit erreicht",
        "reason.provider_failed": "Modellanbieter fehlgeschlagen",
        "reason.tool_loop_error": "Fehler in der Werkzeugschleife",
        "reason.approval_denied": "Freigabe verweigert",
        "reason.cancelled": "abgebrochen",
        "reason.retries_exhausted": "Wiederholungen erschöpft",
        "reason.lease_lost": "Worker verloren",
        "reason.time_limit": "Zeitlimit erreicht",
        "reason.worker_shutdown": "Worker beendet",
        "reason.enqueue_failed": "Einreihen fehlgeschlagen",
        "reason.spec_refused": "Spezifikation abgelehnt",
        "reason.max_steps": "Schrittlimit erreicht",
        "reason.too_many_tool_calls": "zu viele Werkzeugaufrufe in einem Zug",
        "reason.budget_exceeded": "Budget überschritten",
        "reason.deadline_exceeded": "Frist überschritten",
        "reason.unknown": "unbekannt",
        "event.step": "Schritt",
        "event.progress": "Fortschritt",
        "event.delta": "gestreamter Text",
        "event.status": "Status",
        "event.end": "Ende des Streams",
        "event.dropped": "getrennt (zu weit zurück)",
        "event.resync": "neu lesen",
        "step_reason.invalid_call": "ungültiger Aufruf, an das Modell zurückgegeben",
        "step_reason.steered": "durch Umlenkung abgebrochen, der Lauf ging weiter",
        "step_reason.worker_lost": "abgebrochen: sein Worker ging verloren",
        "side_effects.none": "nicht gesendet, keine Nebenwirkungen",
        "side_effects.unknown": "gesendet, Nebenwirkungen unbekannt",
        "task_status.working": "MCP-Aufgabe läuft noch",
        "task_status.input_required": "MCP-Aufgabe bat um Eingabe",
        "task_status.completed": "MCP-Aufgabe abgeschlossen",
        "task_status.failed": "MCP-Aufgabe fehlgeschlagen",
        "task_status.cancelled": "MCP-Aufgabe abgebrochen",
        "task_status.lost": "MCP-Aufgabe verloren: ihr Server kennt sie nicht mehr",
    },
}


def label(key: str, lang: Lang = "en") -> str:
    """The label for ``key``; a missing key shows as the key itself, so a gap is visible, not blank."""
    return LABELS[lang].get(key, key)


def outcome_label(outcome: str, lang: Lang = "en") -> str:
    """The label shown in the Outcome column; empty for a step that states none."""
    return "" if outcome == NO_OUTCOME else label(outcome_label_key(outcome), lang)
