"""The child process of shared/schema_check.py: checks a JSON Schema, or an answer against one, per request.

It reads one JSON request a line on stdin (``{"kind": "schema" | "answer", "schema": …, "answer": "<JSON
text>", "within_s": …}``) and writes one JSON answer a line on stdout (``{"problem": "…" | null}``); it says
``"ready"`` once jsonschema is imported. The parent kills it when an answer is late (docs/security.md,
"Bounds"); before each check it also caps its own CPU time, so that a check outlives its bound by a second at
most even when the parent is gone (the kernel's SIGXCPU ends it).
"""

from __future__ import annotations

import json
import math
import resource
import sys
from collections import OrderedDict
from typing import Any, Final

from jsonschema import Draft202012Validator, SchemaError
from jsonschema.exceptions import best_match
from referencing.exceptions import Unresolvable

PROBLEM_CHARS: Final = 500
"""How much of a problem goes back (to the model, into a step, into a 422)."""
_VALIDATORS_KEPT: Final = 8
"""Validators kept for the schemas checked last (a run's answers are checked against one schema)."""

_validators: OrderedDict[str, Draft202012Validator] = OrderedDict()


def bounded(text: str) -> str:
    """``text`` cut to :data:`PROBLEM_CHARS`, with a mark."""
    return text if len(text) <= PROBLEM_CHARS else text[:PROBLEM_CHARS] + "…"


def schema_problem(schema: Any) -> str | None:
    """What makes ``schema`` not a Draft 2020-12 JSON Schema, in words (None: nothing)."""
    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as exc:
        where = "/".join(str(part) for part in exc.absolute_path) or "the schema"
        return f"is not a valid JSON Schema (Draft 2020-12) at {where}: {exc.message[:200]}"
    except RecursionError:
        return "is not a valid JSON Schema (Draft 2020-12): it nests too deeply to be checked"
    return None


def answer_problem(schema_text: str, answer_text: str) -> str | None:
    """What makes the JSON ``answer_text`` not match the schema, in words for the model (None: it matches)."""
    validator = _validators.get(schema_text)
    if validator is None:
        validator = _validators[schema_text] = Draft202012Validator(json.loads(schema_text))
        if len(_validators) > _VALIDATORS_KEPT:
            _validators.popitem(last=False)
    _validators.move_to_end(schema_text)
    try:
        error = best_match(validator.iter_errors(json.loads(answer_text)))
    except RecursionError:  # a self-referencing schema meeting a deep answer
        return "the answer could not be validated: it nests too deeply for the schema"
    except Unresolvable as exc:  # a local reference to nothing (the spec allows no others: shared/spec.py)
        return bounded(f"the output schema has a reference to nothing ({exc})")
    if error is None:
        return None
    where = "/" + "/".join(str(part) for part in error.absolute_path)
    return bounded(f"at {where}: {error.message}")


def _cap_cpu(within_s: float) -> None:
    """Let this process spend at most ``within_s`` (and a second) more CPU seconds before the kernel ends it."""
    used = resource.getrusage(resource.RUSAGE_SELF)
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    soft = math.ceil(used.ru_utime + used.ru_stime + within_s) + 1
    if hard != resource.RLIM_INFINITY:
        soft = min(soft, hard)
    resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))


def _answer(request: dict[str, Any]) -> str | None:
    _cap_cpu(float(request["within_s"]))
    schema_text = request["schema"]
    if request["kind"] == "schema":
        return schema_problem(json.loads(schema_text))
    return answer_problem(schema_text, request["answer"])


def main() -> None:
    """Answer requests until stdin closes (the parent went away or closed its pool)."""
    out = sys.stdout.buffer
    out.write(b'"ready"\n')
    out.flush()
    for line in sys.stdin.buffer:
        try:
            problem = _answer(json.loads(line))
        except Exception as exc:  # noqa: BLE001 - a check that breaks is a problem with its input, said
            problem = bounded(f"could not be checked ({type(exc).__name__}: {exc})")
        out.write(json.dumps({"problem": problem}).encode() + b"\n")
        out.flush()


if __name__ == "__main__":
    main()
