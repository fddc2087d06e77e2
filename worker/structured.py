"""Structured output: the final answer of a run with an ``output_schema`` is JSON that matches it.

The provider is asked for it where it has the notion (worker/models.py, ``response_format``); whatever it
answers is checked here, because a compatible server may ignore the request and a model may still get it
wrong. A mismatch goes back to the model as a message saying what is wrong (docs/usage.md, "Structured
output"), like a tool's error; the loop's ``max_rounds`` bounds how often. The answer is validated in a child
process within ``RUNBRAKE_SCHEMA_CHECK_S`` (shared/schema_check.py), never on the worker's event loop: a
pattern that backtracks or a ``uniqueItems`` over thousands of objects stalls no other run (issue 27). An
answer not validated within the bound is handed back like a mismatch.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from runbrake.shared._schema_child import bounded
from runbrake.shared.schema_check import SCHEMA_CHECKS
from runbrake.shared.threads import hand_back

__all__ = ["INTERRUPTED_CHECK", "AnswerCheck", "Checked", "hand_back"]

INTERRUPTED_CHECK: Final = "the answer was not validated: the run was interrupted (cancelled, steered or handed over)"
"""The problem of an answer whose check a cancel, a steer or a hand-over cut off (worker/loop.py)."""


@dataclass(frozen=True, slots=True)
class Checked:
    """What a final answer came to: the parsed value, or the problem with it (in words for the model)."""

    value: Any = None
    problem: str | None = None


class AnswerCheck:
    """Parses a final answer as JSON and validates it against the run's output schema (Draft 2020-12, as
    the spec's admission checked it: shared/catalog.py), within ``within_s`` of wall clock."""

    def __init__(self, schema: Mapping[str, Any], *, within_s: float) -> None:
        self._schema = dict(schema)
        self._within_s = within_s

    async def check(self, content: str | None) -> Checked:
        text = _unfenced(content or "")
        try:
            value = json.loads(text)  # linear: parsed here, validated in the child
        except (ValueError, RecursionError) as exc:
            return Checked(problem=bounded(f"the answer is not JSON ({exc})"))
        problem = await SCHEMA_CHECKS.answer_problem_async(self._schema, text, within_s=self._within_s)
        return Checked(value=value) if problem is None else Checked(problem=problem)


def _unfenced(text: str) -> str:
    """The answer without a Markdown code fence around it (```json … ```), which models add unasked."""
    stripped = text.strip()
    if stripped.startswith("```") and stripped.endswith("```") and "\n" in stripped:
        return stripped[stripped.index("\n") + 1:-3]
    return stripped
