"""Structured output: the final answer of a run with an ``output_schema`` is JSON that matches it.

The provider is asked for it where it has the notion (worker/models.py, ``response_format``); whatever it
answers is checked here, because a compatible server may ignore the request and a model may still get it
wrong. A mismatch goes back to the model as a message saying what is wrong (docs/usage.md, "Structured
output"), like a tool's error; the loop's ``max_rounds`` bounds how often.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from jsonschema import Draft202012Validator
from jsonschema.exceptions import best_match
from referencing.exceptions import Unresolvable

from runbrake.shared.threads import hand_back

__all__ = ["AnswerCheck", "Checked", "hand_back"]

_PROBLEM_CHARS: Final = 500
"""How much of a validation error goes back to the model (and into the step)."""


@dataclass(frozen=True, slots=True)
class Checked:
    """What a final answer came to: the parsed value, or the problem with it (in words for the model)."""

    value: Any = None
    problem: str | None = None


class AnswerCheck:
    """Parses a final answer as JSON and validates it against the run's output schema (Draft 2020-12, as
    the spec checked it: shared/spec.py)."""

    def __init__(self, schema: Mapping[str, Any]) -> None:
        self._validator = Draft202012Validator(dict(schema))

    def check(self, content: str | None) -> Checked:
        text = _unfenced(content or "")
        try:
            value = json.loads(text)
        except (ValueError, RecursionError) as exc:
            return Checked(problem=_bounded(f"the answer is not JSON ({exc})"))
        try:
            error = best_match(self._validator.iter_errors(value))
        except RecursionError:  # a self-referencing schema meeting a deep answer
            return Checked(problem="the answer could not be validated: it nests too deeply for the schema")
        except Unresolvable as exc:  # a local reference to nothing (the spec allows no others: shared/spec.py)
            return Checked(problem=_bounded(f"the output schema has a reference to nothing ({exc})"))
        if error is None:
            return Checked(value=value)
        where = "/" + "/".join(str(part) for part in error.absolute_path)
        return Checked(problem=_bounded(f"at {where}: {error.message}"))


def _unfenced(text: str) -> str:
    """The answer without a Markdown code fence around it (```json … ```), which models add unasked."""
    stripped = text.strip()
    if stripped.startswith("```") and stripped.endswith("```") and "\n" in stripped:
        return stripped[stripped.index("\n") + 1:-3]
    return stripped


def _bounded(text: str) -> str:
    return text if len(text) <= _PROBLEM_CHARS else text[:_PROBLEM_CHARS] + "…"
