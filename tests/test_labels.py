"""Every name a user sees has its English and German label, and docs/labels.md lists each one."""

from __future__ import annotations

import re
from enum import StrEnum
from pathlib import Path

import pytest

from runbrake.broker.render import render_run
from runbrake.shared.outcome import DeliveryStatus, ToolOutcome
from runbrake.shared.records import RunRecord
from runbrake.shared.status import RunStatus, TerminationReason
from runbrake.shared.steps import StepKind, StepReason
from runbrake.shared.stream_events import StreamEvent
from runbrake.shared.timeline import LABELS, label
from runbrake.shared.tool_result import SideEffects, TaskStatus

NAMED: tuple[tuple[str, type[StrEnum]], ...] = (
    ("status", RunStatus), ("reason", TerminationReason), ("kind", StepKind), ("outcome", ToolOutcome),
    ("event", StreamEvent), ("step_reason", StepReason), ("side_effects", SideEffects),
    ("task_status", TaskStatus), ("delivery", DeliveryStatus))
"""Label key prefix and the enum whose values follow it. ``TerminationReason.NONE`` is never shown."""

DOC_ROW = re.compile(r"^\| `(?P<value>[a-z_]+)` \| (?P<en>[^|]+) \| (?P<de>[^|]+) \|$")


def shown_keys() -> list[str]:
    return [f"{prefix}.{member.value}" for prefix, enum in NAMED for member in enum if member.value]


@pytest.mark.parametrize("key", shown_keys())
def test_every_member_of_every_shown_enum_has_a_label_in_english_and_german(key: str) -> None:
    for lang in ("en", "de"):
        assert key in LABELS[lang], f"{key} has no {lang} label in shared/timeline.py"
        assert label(key, lang) != key
    assert "_" not in label(key, "en"), f"{key}'s English label reads like a raw key"


def test_docs_labels_lists_every_label_and_only_those() -> None:
    text = Path(__file__).resolve().parents[1].joinpath("docs", "labels.md").read_text(encoding="utf-8")
    sections = re.split(r"^## ", text, flags=re.MULTILINE)[1:]
    documented: dict[str, tuple[str, str]] = {}
    for (prefix, _enum), section in zip(NAMED, sections, strict=True):
        for line in section.splitlines():
            if row := DOC_ROW.match(line):
                documented[f"{prefix}.{row['value']}"] = (row["en"].strip(), row["de"].strip())

    assert documented == {key: (LABELS["en"][key], LABELS["de"][key]) for key in shown_keys()}


@pytest.mark.parametrize("reason", [r for r in TerminationReason if r.value])
def test_show_prints_every_reasons_label_in_both_languages_never_its_key(reason: TerminationReason) -> None:
    record = RunRecord(run_id="0" * 32, status=RunStatus.FAILED, termination_reason=reason, created_at=0.0,
                       started_at=None, finished_at=None, owner="", lease_expires_at=None, request={},
                       pending=None, error="", segments=1, cancel=None)
    for lang in ("en", "de"):
        shown = render_run(record, lang)
        assert label(f"reason.{reason.value}", lang) in shown
        assert "reason." not in shown
        assert "status." not in shown
