"""ToolOutcome and ToolResult: three outcomes, fail-closed non-ok results, a bounding transform that
carries every field (docs/store.md, "Tool outcomes")."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest

from runbrake.shared import ToolOutcome, ToolResult
from runbrake.shared.tool_result import Failure, SideEffects

# The content channels the bounding transform may shorten; every other field must pass through as is.
CHANNELS = frozenset({"content", "structured"})

# Every field of ToolResult. When this test fails because a field was added, check that
# ``with_bounded_channels`` carries it (or bounds it, if it is a content channel), then add it here
# and to ``NON_DEFAULT`` below.
EXPECTED_FIELDS = frozenset({"outcome", "content", "structured", "artifacts", "write_target", "failure",
                             "side_effects", "task", "child_run_id"})
FAILED_ONLY = frozenset({"failure", "side_effects"})
"""Fields only a failed (``failure``) or cancelled (``side_effects``) result sets; the carry tests below for
those outcomes cover them."""

# A non-default value for every field the transform must carry unchanged (an ok result, so that
# artifacts and write target are allowed).
NON_DEFAULT: dict[str, object] = {
    "outcome": ToolOutcome.OK,
    "artifacts": ("file:///tmp/report.csv", "s3://bucket/key"),
    "write_target": "postgres://db/table",
    "task": ("task-1", "completed"),
    "child_run_id": "c" * 32,
}


def test_tool_outcome_has_exactly_the_three_members_ok_failed_cancelled() -> None:
    assert {member.value for member in ToolOutcome} == {"ok", "failed", "cancelled"}
    assert ToolOutcome.OK == "ok"
    assert ToolOutcome.FAILED == "failed"
    assert ToolOutcome.CANCELLED == "cancelled"


def test_tool_outcome_reads_back_from_its_string_value() -> None:
    for member in ToolOutcome:
        assert ToolOutcome(member.value) is member


@pytest.mark.parametrize(
    ("outcome", "is_error"),
    [(ToolOutcome.OK, False), (ToolOutcome.FAILED, True), (ToolOutcome.CANCELLED, True)],
)
def test_only_the_ok_outcome_is_not_an_error(outcome: ToolOutcome, is_error: bool) -> None:
    assert outcome.is_error is is_error


def test_an_ok_result_is_not_an_error_and_keeps_what_it_was_given() -> None:
    result = ToolResult.ok("5", structured='{"sum": 5}', artifacts=("file:///a",), write_target="db://t")

    assert result.outcome is ToolOutcome.OK
    assert result.is_error is False
    assert result.content == "5"
    assert result.structured == '{"sum": 5}'
    assert result.artifacts == ("file:///a",)
    assert result.write_target == "db://t"


def test_an_error_result_is_failed_and_an_error() -> None:
    result = ToolResult.error("server died")

    assert result.outcome is ToolOutcome.FAILED
    assert result.is_error is True
    assert result.content == "server died"


def test_a_cancelled_result_is_cancelled_not_failed_and_still_an_error() -> None:
    result = ToolResult.cancelled("run was cancelled")

    assert result.outcome is ToolOutcome.CANCELLED
    assert result.outcome is not ToolOutcome.FAILED
    assert result.is_error is True
    assert result.content == "run was cancelled"


@pytest.mark.parametrize("build", [ToolResult.error, ToolResult.cancelled], ids=["error", "cancelled"])
def test_non_ok_constructors_are_fail_closed_with_no_artifacts_and_no_write_target(
    build: Callable[[str], ToolResult],
) -> None:
    result = build("nope")

    assert result.artifacts == ()
    assert result.write_target is None
    assert result.structured is None


@pytest.mark.parametrize("outcome", [ToolOutcome.FAILED, ToolOutcome.CANCELLED])
def test_constructing_a_non_ok_result_with_artifacts_raises(outcome: ToolOutcome) -> None:
    with pytest.raises(ValueError, match="no artifacts"):
        ToolResult(outcome, "x", artifacts=("file:///a",))


@pytest.mark.parametrize("outcome", [ToolOutcome.FAILED, ToolOutcome.CANCELLED])
def test_constructing_a_non_ok_result_with_a_write_target_raises(outcome: ToolOutcome) -> None:
    with pytest.raises(ValueError, match="no write target"):
        ToolResult(outcome, "x", write_target="db://t")


def test_is_error_is_derived_from_the_outcome_not_stored_beside_it() -> None:
    names = {f.name for f in dataclasses.fields(ToolResult)}

    assert "is_error" not in names
    assert "outcome" in names


def test_a_tool_result_cannot_be_changed_after_it_is_built() -> None:
    result = ToolResult.ok("x")

    with pytest.raises(dataclasses.FrozenInstanceError):
        result.outcome = ToolOutcome.CANCELLED  # type: ignore[misc]


def test_the_fields_of_tool_result_are_exactly_the_ones_the_bounding_transform_was_checked_for() -> None:
    """Adding a field fails here on purpose: check with_bounded_channels carries it, then list it."""
    assert {f.name for f in dataclasses.fields(ToolResult)} == EXPECTED_FIELDS


def test_every_non_channel_field_has_a_non_default_value_in_the_carry_test() -> None:
    """The carry test below must set every field the transform does not bound."""
    assert set(NON_DEFAULT) == EXPECTED_FIELDS - CHANNELS - FAILED_ONLY
    for f in dataclasses.fields(ToolResult):
        if f.name in NON_DEFAULT and f.default is not dataclasses.MISSING:
            assert NON_DEFAULT[f.name] != f.default, f"{f.name} must differ from its default"


def test_bounding_carries_every_non_channel_field_unchanged() -> None:
    original = ToolResult(content="c" * 50, structured="s" * 50, **NON_DEFAULT)  # type: ignore[arg-type]

    bounded = original.with_bounded_channels(10)

    carried = {f.name for f in dataclasses.fields(ToolResult)} - CHANNELS - FAILED_ONLY
    assert carried  # the loop below must check something
    for name in carried:
        assert getattr(bounded, name) == getattr(original, name), f"{name} did not survive the transform"
    assert bounded.content != original.content  # the channels really were bounded


def test_bounding_a_failed_result_carries_whose_failure_it_was() -> None:
    original = ToolResult.error("e" * 50, failure=Failure.ARGUMENTS)

    bounded = original.with_bounded_channels(10)

    assert (bounded.outcome, bounded.failure) == (ToolOutcome.FAILED, Failure.ARGUMENTS)
    assert ToolResult.error("x").failure is Failure.SERVER


@pytest.mark.parametrize("sent", [True, False])
def test_bounding_a_cancelled_result_carries_its_side_effects(sent: bool) -> None:
    bounded = ToolResult.cancelled("c" * 50, sent=sent).with_bounded_channels(10)

    assert (bounded.outcome, bounded.side_effects) == (
        ToolOutcome.CANCELLED, SideEffects.UNKNOWN if sent else SideEffects.NONE)


@pytest.mark.parametrize("outcome", [ToolOutcome.OK, ToolOutcome.FAILED])
def test_only_a_cancelled_result_says_what_side_effects_it_may_have_had(outcome: ToolOutcome) -> None:
    with pytest.raises(ValueError, match="only a cancelled"):
        ToolResult(outcome, "x", failure=Failure.SERVER if outcome is ToolOutcome.FAILED else None,
                   side_effects=SideEffects.NONE)


@pytest.mark.parametrize("outcome", [ToolOutcome.OK, ToolOutcome.CANCELLED])
def test_only_a_failed_result_says_whose_failure_it_was(outcome: ToolOutcome) -> None:
    with pytest.raises(ValueError, match="only a failed one"):
        ToolResult(outcome, "x", failure=Failure.SERVER)


@pytest.mark.parametrize("build", [ToolResult.cancelled, ToolResult.error], ids=["cancelled", "failed"])
def test_bounding_keeps_the_outcome_of_a_non_ok_result(build: Callable[[str], ToolResult]) -> None:
    original = build("x" * 500)

    bounded = original.with_bounded_channels(20)

    assert bounded.outcome is original.outcome
    assert bounded.is_error is True
    assert bounded.artifacts == ()
    assert bounded.write_target is None
    assert len(bounded.content) < len(original.content)


def test_bounding_keeps_a_long_channel_within_max_chars_mark_included_and_says_how_much_was_dropped() -> None:
    result = ToolResult.ok("a" * 60 + "b" * 140, structured="{" + "x" * 399)

    bounded = result.with_bounded_channels(60)

    assert bounded.content.startswith("a" * 20)
    assert "b" not in bounded.content
    assert bounded.structured is not None
    assert bounded.structured.startswith("{" + "x" * 19)
    # A hard bound: the truncation mark counts against the limit, and it says how much went.
    assert len(bounded.content) == len(bounded.structured) == 60
    dropped_content = 200 - bounded.content.index("\n…")
    dropped_structured = 400 - bounded.structured.index("\n…")
    assert f"truncated {dropped_content} chars" in bounded.content
    assert f"truncated {dropped_structured} chars" in bounded.structured


def test_bounding_leaves_channels_at_or_under_the_limit_untouched() -> None:
    result = ToolResult.ok("x" * 10, structured="y" * 9)

    assert result.with_bounded_channels(10) == result


def test_bounding_cuts_a_channel_one_character_over_the_limit() -> None:
    bounded = ToolResult.ok("x" * 41).with_bounded_channels(40)

    assert len(bounded.content) == 40
    assert bounded.content != "x" * 40
    assert "truncated" in bounded.content


def test_bounding_leaves_an_absent_structured_channel_absent() -> None:
    bounded = ToolResult.ok("x" * 100).with_bounded_channels(5)

    assert bounded.structured is None


def test_bounding_returns_a_new_result_and_leaves_the_original_alone() -> None:
    original = ToolResult.ok("x" * 100)

    original.with_bounded_channels(5)

    assert original.content == "x" * 100


@pytest.mark.parametrize("max_chars", [0, -1])
def test_bounding_refuses_a_limit_below_one(max_chars: int) -> None:
    with pytest.raises(ValueError, match="max_chars"):
        ToolResult.ok("x").with_bounded_channels(max_chars)
