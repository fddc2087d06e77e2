"""The timeline: what each step came to, and the labels it is shown with (README.md, "Using it": the Outcome column).

One string travels end to end (docs/architecture.md, "Tool outcomes: one string end to
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
        "kind.unknown": "unknown",
        "run.status": "Status",
        "run.reason": "Reason",
        "run.cancel": "Cancelled",
        "run.created": "Created",
    },
    "de": {
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
        "kind.unknown": "unbekannt",
        "run.status": "Status",
        "run.reason": "Grund",
        "run.cancel": "Abgebrochen",
        "run.created": "Erstellt",
    },
}


def label(key: str, lang: Lang = "en") -> str:
    """The label for ``key``; a missing key shows as the key itself, so a gap is visible, not blank."""
    return LABELS[lang].get(key, key)


def outcome_label(outcome: str, lang: Lang = "en") -> str:
    """The label shown in the Outcome column; empty for a step that states none."""
    return "" if outcome == NO_OUTCOME else label(outcome_label_key(outcome), lang)
