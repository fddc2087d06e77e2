"""What the events that end a run carry besides its status: its answer, usage and error (docs/messages.md,
"Run events: the body").

``run.completed``, ``run.failed`` and ``run.cancelled`` (on ``<ns>.events``, to webhooks, as the SSE ``status``
event and on ``GET /v1/events``) carry ``output``, ``output_json``, ``usage`` and ``error`` as
``GET /v1/runs/{id}`` names them, so that a backend driven by events needs no ``GET`` per turn. The answer
is bounded: an ``output`` longer than :data:`EVENT_OUTPUT_CHARS` characters is cut to them, an
``output_json`` whose JSON is longer is left out (``null``), and ``output_truncated`` is then true; the
whole answer stays in ``GET /v1/runs/{id}``.

The store writes these fields in the script that ends the run (shared/_scripts.py, ``announce_end``): the
answer as :func:`answer_members` made it, the usage and the error from the run's hash. Every reader of an
event (the relay, the webhooks, the API's streams) passes them on through :func:`read_run_end`, which checks
their shape: anyone who can write to Redis can write an event.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any, Final

from runbrake.shared.records import RunRecord
from runbrake.shared.redaction import scrub_value
from runbrake.shared.steps import RunStep

__all__ = ["EVENT_OUTPUT_CHARS", "answer_members", "read_run_end", "run_end"]

EVENT_OUTPUT_CHARS: Final = 16_384
"""The most of a run's answer (``output`` in characters, ``output_json`` as compact JSON) an event carries."""

_FIELDS: Final = ("output", "output_json", "output_truncated", "usage", "error")
_COUNTS: Final = ("input_tokens", "output_tokens", "total_tokens", "model_calls")


def _bounded_answer(output: str | None, output_json: Any) -> dict[str, Any]:
    truncated = False
    if output is not None and len(output) > EVENT_OUTPUT_CHARS:
        output, truncated = output[:EVENT_OUTPUT_CHARS], True
    if output_json is not None and len(_compact(output_json)) > EVENT_OUTPUT_CHARS:
        output_json, truncated = None, True
    return {"output": output, "output_json": output_json, "output_truncated": truncated}


def _compact(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def answer_members(final: RunStep | None) -> str:
    """The answer of a run that completes with the model step ``final``, as the JSON members (no braces) the
    settle script splices into the ``run.completed`` event; "" for none (the script writes null)."""
    if final is None:
        return ""
    # Scrubbed as the step is stored (shared/_store_core.py, stored_json), then cut: as GET /v1/runs/{id} has it.
    answer = _bounded_answer(scrub_value(final.content), scrub_value(final.detail.get("output_json")))
    return _compact(answer)[1:-1]


def run_end(record: RunRecord) -> dict[str, Any]:
    """What the event that ended ``record`` carries besides its status, from the record (its final step among
    its steps: :attr:`RunRecord.final_step`): the SSE stream's ``status`` of a run that ended before it was
    opened."""
    return {**_bounded_answer(record.output, record.output_json), "usage": record.usage.to_dict(),
            "error": record.error}


def read_run_end(event: Mapping[str, Any]) -> dict[str, Any]:
    """The fields :func:`run_end` names, as an event read back carries them; {} for an event without them
    (a status that is not terminal, or an event written before they were).

    Raises:
        ValueError: naming the field, when one has a shape the store never writes.
    """
    if not any(name in event for name in _FIELDS):
        return {}
    problem = _problem(event)
    if problem is not None:
        raise ValueError(problem)
    usage = event["usage"]
    read_usage = {name: usage[name] for name in _COUNTS}
    if usage.get("cost_usd") is not None:
        read_usage["cost_usd"] = round(float(usage["cost_usd"]), 9)
    return {"output": event.get("output"), "output_json": event.get("output_json"),
            "output_truncated": event["output_truncated"], "usage": read_usage, "error": event["error"]}


def _problem(event: Mapping[str, Any]) -> str | None:
    """What is wrong with an event's end fields, or None."""
    output, output_json, usage = event.get("output"), event.get("output_json"), event.get("usage")
    if output is not None and (not isinstance(output, str) or len(output) > EVENT_OUTPUT_CHARS):
        return f"output must be null or a string of at most {EVENT_OUTPUT_CHARS} characters"
    if output_json is not None and len(_compact(output_json)) > EVENT_OUTPUT_CHARS:
        return f"output_json must be null or JSON of at most {EVENT_OUTPUT_CHARS} characters"
    if not isinstance(event.get("output_truncated"), bool):
        return "output_truncated must be a boolean"
    if not isinstance(event.get("error"), str):
        return "error must be a string"
    if not isinstance(usage, Mapping):
        return "usage must be an object"
    for name in _COUNTS:
        count = usage.get(name)
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            return f"usage.{name} must be a count"
    cost = usage.get("cost_usd")
    if cost is not None and (not isinstance(cost, int | float) or isinstance(cost, bool) or not math.isfinite(cost)
                             or cost < 0):
        return "usage.cost_usd must be a non-negative number"
    return None
