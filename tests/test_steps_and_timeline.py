"""Run steps that cannot disagree with themselves, old stored rows, the timeline and its labels
(docs/store.md, "Tool outcomes")."""

from __future__ import annotations

import json
from typing import Any

import pytest
from structlog.testing import capture_logs

from runbrake.shared import (
    LABELS,
    RunStep,
    StepError,
    StepKind,
    ToolOutcome,
    ToolResult,
    label,
    outcome_label,
    step_outcome,
)
from runbrake.shared.timeline import outcome_label_key

RESULTS = {
    ToolOutcome.OK: ToolResult.ok("5"),
    ToolOutcome.FAILED: ToolResult.error("boom"),
    ToolOutcome.CANCELLED: ToolResult.cancelled("cut off"),
}


def tool_step(outcome: ToolOutcome) -> RunStep:
    return RunStep.tool(
        round=2, server="calc", name="get-sum", result=RESULTS[outcome], call_id="call-1",
        arguments={"a": 2, "b": 3}, duration_ms=12, recorded_at=1700000000.5,
    )


def stored_tool_step(**fields: Any) -> dict[str, Any]:
    """A tool step as it sits in storage, with the given tool fields."""
    return {"sequence": 3, "kind": "tool", "round": 1, "duration_ms": 4, "recorded_at": 1.0,
            "content": "x", "detail": {}, "tool_server": "calc", "tool_name": "get-sum",
            "tool_call_id": None, **fields}


# -- kinds and the stored form ------------------------------------------------------------------


def test_step_kinds_are_model_tool_and_approval() -> None:
    assert StepKind.MODEL == "model"
    assert StepKind.TOOL == "tool"
    assert StepKind.APPROVAL == "approval"


@pytest.mark.parametrize("outcome", list(ToolOutcome))
def test_a_tool_step_survives_a_round_trip_through_its_stored_form(outcome: ToolOutcome) -> None:
    step = tool_step(outcome).with_sequence(7, 1700000001.25)

    loaded = RunStep.from_dict(json.loads(json.dumps(step.to_dict())))

    assert loaded == step
    assert loaded.tool_outcome is outcome
    assert loaded.sequence == 7
    # A cancelled call says what the server may have done: a call cut off in flight, unknown.
    assert loaded.detail == {"arguments": {"a": 2, "b": 3}} | (
        {"side_effects": "unknown"} if outcome is ToolOutcome.CANCELLED else {})


@pytest.mark.parametrize(
    "step",
    [
        RunStep(kind=StepKind.MODEL, round=1, content="It is 5.", detail={"tool_calls": [{"tool": "x"}]}),
        RunStep(kind=StepKind.MODEL, round=1, interrupted=True),
        RunStep(kind=StepKind.MODEL, round=3, error="rate limited", duration_ms=9),
        RunStep(kind=StepKind.APPROVAL, round=2, content="ok by ops", detail={"decision": "approved"}),
    ],
    ids=["model", "interrupted-model", "failed-model", "approval"],
)
def test_a_non_tool_step_survives_a_round_trip_through_its_stored_form(step: RunStep) -> None:
    stored = json.loads(json.dumps(step.with_sequence(4, 2.5).to_dict()))

    assert RunStep.from_dict(stored) == step.with_sequence(4, 2.5)


def test_the_stored_form_of_a_non_tool_step_has_no_tool_fields() -> None:
    stored = RunStep(kind=StepKind.MODEL, round=1, content="hi").to_dict()

    assert not {k for k in stored if k.startswith("tool_")}


def test_the_stored_form_of_a_tool_step_has_every_tool_field() -> None:
    stored = tool_step(ToolOutcome.CANCELLED).to_dict()

    assert stored["kind"] == "tool"
    assert stored["tool_server"] == "calc"
    assert stored["tool_name"] == "get-sum"
    assert stored["tool_call_id"] == "call-1"
    assert stored["tool_is_error"] is True
    assert stored["tool_outcome"] == "cancelled"


# -- the one builder ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("outcome", "is_error"),
    [(ToolOutcome.OK, False), (ToolOutcome.FAILED, True), (ToolOutcome.CANCELLED, True)],
)
def test_the_tool_builder_derives_tool_is_error_from_the_results_outcome(outcome: ToolOutcome, is_error: bool) -> None:
    step = tool_step(outcome)

    assert step.kind is StepKind.TOOL
    assert step.tool_outcome is outcome
    assert step.tool_is_error is is_error
    assert step.content == RESULTS[outcome].content


def test_a_cancelled_tool_call_is_recorded_as_cancelled_not_failed() -> None:
    step = tool_step(ToolOutcome.CANCELLED)

    assert step.tool_outcome is ToolOutcome.CANCELLED
    assert step_outcome(step) == "cancelled"


# -- a step cannot disagree with itself ---------------------------------------------------------


@pytest.mark.parametrize(
    ("outcome", "is_error"),
    [(ToolOutcome.OK, True), (ToolOutcome.FAILED, False), (ToolOutcome.CANCELLED, False)],
)
def test_constructing_a_tool_step_whose_error_flag_contradicts_its_outcome_raises(
    outcome: ToolOutcome, is_error: bool
) -> None:
    with pytest.raises(ValueError, match="tool_is_error") as raised:
        RunStep(kind=StepKind.TOOL, round=1, tool_is_error=is_error, tool_outcome=outcome)

    assert isinstance(raised.value, StepError)
    assert outcome.value in str(raised.value)


def test_constructing_a_tool_step_with_an_error_flag_but_no_outcome_raises() -> None:
    with pytest.raises(StepError, match="no tool_outcome"):
        RunStep(kind=StepKind.TOOL, round=1, tool_is_error=True)


@pytest.mark.parametrize("kind", [StepKind.MODEL, StepKind.APPROVAL])
@pytest.mark.parametrize("outcome", list(ToolOutcome))
def test_constructing_a_non_tool_step_with_a_tool_outcome_raises(kind: StepKind, outcome: ToolOutcome) -> None:
    with pytest.raises(ValueError, match=f"{kind.value} step states no tool outcome"):
        RunStep(kind=kind, round=1, tool_outcome=outcome, tool_is_error=outcome.is_error)


@pytest.mark.parametrize("kind", [StepKind.MODEL, StepKind.APPROVAL])
@pytest.mark.parametrize("is_error", [True, False])
def test_constructing_a_non_tool_step_with_a_tool_error_flag_raises(kind: StepKind, is_error: bool) -> None:
    with pytest.raises(ValueError, match=f"{kind.value} step states no tool outcome"):
        RunStep(kind=kind, round=1, tool_is_error=is_error)


@pytest.mark.parametrize("kind", [StepKind.TOOL, StepKind.APPROVAL])
def test_only_a_model_step_can_be_interrupted(kind: StepKind) -> None:
    with pytest.raises(StepError, match="interrupted"):
        RunStep(kind=kind, round=1, interrupted=True)


@pytest.mark.parametrize(
    ("outcome", "is_error"), [("ok", True), ("failed", False), ("cancelled", False)],
)
def test_loading_a_stored_tool_step_whose_error_flag_contradicts_its_outcome_raises(
    outcome: str, is_error: bool
) -> None:
    with pytest.raises(ValueError, match="tool_is_error"):
        RunStep.from_dict(stored_tool_step(tool_is_error=is_error, tool_outcome=outcome))


@pytest.mark.parametrize("kind", ["model", "approval"])
@pytest.mark.parametrize("fields", [{"tool_outcome": "cancelled"}, {"tool_is_error": False},
                                    {"tool_outcome": "ok", "tool_is_error": False}])
def test_loading_a_stored_non_tool_step_with_a_tool_outcome_raises(kind: str, fields: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=f"stored {kind} step states a tool outcome"):
        RunStep.from_dict({"kind": kind, "round": 1, **fields})


def test_loading_a_stored_tool_step_with_an_outcome_but_no_error_flag_raises() -> None:
    with pytest.raises(StepError, match="no tool_is_error"):
        RunStep.from_dict(stored_tool_step(tool_outcome="cancelled"))


def test_loading_a_stored_tool_step_with_an_unknown_outcome_raises_naming_the_value() -> None:
    with pytest.raises(StepError, match="'paused'"):
        RunStep.from_dict(stored_tool_step(tool_is_error=True, tool_outcome="paused"))


# -- old rows -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("is_error", "outcome"), [(True, ToolOutcome.FAILED), (False, ToolOutcome.OK)])
def test_an_old_tool_step_without_an_outcome_keeps_the_meaning_of_its_error_flag(
    is_error: bool, outcome: ToolOutcome
) -> None:
    step = RunStep.from_dict(stored_tool_step(tool_is_error=is_error))

    assert step.tool_outcome is outcome
    assert step.tool_is_error is is_error
    assert step_outcome(step) == outcome.value
    assert step.to_dict()["tool_outcome"] == outcome.value


def test_an_old_tool_step_with_neither_error_flag_nor_outcome_states_no_outcome() -> None:
    step = RunStep.from_dict(stored_tool_step())

    assert step.tool_outcome is None
    assert step.tool_is_error is None
    assert step_outcome(step) == ""
    assert outcome_label(step_outcome(step)) == ""


def test_a_stored_step_of_an_unknown_kind_loads_as_unknown_and_is_logged() -> None:
    with capture_logs() as logs:
        step = RunStep.from_dict({"kind": "teleport", "round": 1, "sequence": 9})

    assert step.kind is StepKind.UNKNOWN
    assert step_outcome(step) == ""
    assert {"event": "step_kind_unknown", "stored": "teleport", "sequence": 9, "log_level": "warning"} in logs


# -- the timeline -------------------------------------------------------------------------------


@pytest.mark.parametrize("outcome", list(ToolOutcome))
def test_the_timeline_shows_a_tool_steps_stored_outcome(outcome: ToolOutcome) -> None:
    assert step_outcome(tool_step(outcome)) == outcome.value


def test_a_completed_model_step_states_no_outcome() -> None:
    assert step_outcome(RunStep(kind=StepKind.MODEL, round=1, content="It is 5.")) == ""


def test_an_interrupted_model_step_reads_cancelled() -> None:
    assert step_outcome(RunStep(kind=StepKind.MODEL, round=1, interrupted=True)) == "cancelled"


def test_a_model_step_whose_provider_failed_reads_failed() -> None:
    assert step_outcome(RunStep(kind=StepKind.MODEL, round=1, error="500 from provider")) == "failed"


def test_an_approval_step_states_no_outcome() -> None:
    step = RunStep(kind=StepKind.APPROVAL, round=1, detail={"decision": "denied"})

    assert step_outcome(step) == ""


def test_the_outcome_column_is_labelled_outcome_in_english_and_ergebnis_in_german() -> None:
    assert label("column.outcome", "en") == "Outcome"
    assert label("column.outcome", "de") == "Ergebnis"


@pytest.mark.parametrize(
    ("outcome", "en", "de"),
    [("ok", "ok", "ok"), ("failed", "failed", "fehlgeschlagen"), ("cancelled", "cancelled", "abgebrochen")],
)
def test_outcome_labels_in_english_and_german(outcome: str, en: str, de: str) -> None:
    assert outcome_label(outcome, "en") == en
    assert outcome_label(outcome, "de") == de


def test_a_step_without_an_outcome_shows_an_empty_label() -> None:
    assert outcome_label("", "en") == ""
    assert outcome_label("", "de") == ""


def test_a_missing_label_shows_its_key_so_the_gap_is_visible() -> None:
    assert label("no.such.key", "de") == "no.such.key"


@pytest.mark.parametrize("outcome", list(ToolOutcome))
def test_one_string_travels_end_to_end_for_every_outcome(outcome: ToolOutcome) -> None:
    """Enum value, stored field, timeline value and label key suffix are the same string."""
    step = tool_step(outcome)
    stored = json.loads(json.dumps(step.to_dict()))["tool_outcome"]
    timeline = step_outcome(RunStep.from_dict(json.loads(json.dumps(step.to_dict()))))
    key = outcome_label_key(timeline)

    assert outcome.value == stored == timeline == step_outcome(step)
    assert key == "outcome." + outcome.value
    assert key in LABELS["en"]
    assert key in LABELS["de"]


def test_every_outcome_has_a_non_empty_label_in_both_languages() -> None:
    for lang in ("en", "de"):
        outcome_keys = {key for key in LABELS[lang] if key.startswith("outcome.")}
        assert outcome_keys == {f"outcome.{member.value}" for member in ToolOutcome}, lang
        assert all(LABELS[lang][key] for key in outcome_keys), lang


def test_both_languages_label_the_same_keys() -> None:
    assert set(LABELS["en"]) == set(LABELS["de"])
