"""The HTTP API fuzzed from its own ``/openapi.json`` with schemathesis, against a running ``runbrake serve``
with tokens: valid and invalid requests for every operation, as an operator (the widest role) and without a
token. No request gets a 5xx, every error is in the documented shape (``{"error": "…"}``, docs/http-api.md,
"Errors"), and nothing is written for a refused request: the runs in the store are exactly those answered 201.

``make test`` runs a bounded, derandomised number of examples (tests/conftest.py, the ``ci`` profile);
``make fuzz`` many more.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx2
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from runbrake.shared import RunStore
from tests.api_helpers import ApiProcess, bearer
from tests.test_fuzz_inputs import examples

STREAMS = frozenset({"/v1/events"})
"""The feed answers a good request with a stream that stays open: tests/test_attack_events.py covers it. A run's
stream is fuzzed: no fuzzed id names a run that exists, so each answer is an error at once."""

_AS = {"operator": bearer("ops-alice"), "nobody": {}}


def _error_shaped(content: bytes) -> str | None:
    """Why an error answer is not in the documented shape, or None when it is."""
    try:
        body = json.loads(content)
    except ValueError:
        return f"not JSON: {content[:200]!r}"
    if not isinstance(body, dict) or not isinstance(body.get("error"), str) or not body["error"]:
        return f"no 'error' string: {body!r:.200}"
    return None


def test_every_operation_answers_fuzzed_requests_without_a_5xx_in_the_documented_shape(
    start_api: Callable[..., ApiProcess], tokens_file: Path, store: RunStore
) -> None:
    api = start_api(tokens=tokens_file)
    schema = schemathesis.openapi.from_url(f"{api.url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    fuzzed = [operation for operation in operations if operation.path not in STREAMS]
    assert {"/v1/runs", "/v1/runs/{run_id}/cancel", "/v1/runs/{run_id}/approve"} <= {o.path for o in fuzzed}

    statuses: Counter[tuple[str, int]] = Counter()
    created: set[str] = set()
    problems: list[str] = []
    for operation in fuzzed:
        _fuzz(operation, api.url, statuses, created, problems)

    assert not problems, "\n".join(problems[:20])
    assert sum(statuses.values()) >= len(fuzzed)
    # Afterwards the API still takes a good run.
    good = httpx2.post(f"{api.url}/v1/runs", headers=bearer("submitter"), timeout=15, json={
        "input": "after the fuzz", "model": {"provider": "scripted", "turns": [{"content": "fine"}]}})
    assert good.status_code == 201, good.text
    created.add(good.json()["run_id"])
    # Nothing written for a refused request: every run in the namespace was answered 201 (or 200, the same
    # idempotency key again).
    assert {record.run_id for record in store.recent(limit=10_000, scan=100_000)} == created


def _fuzz(operation: Any, url: str, statuses: Counter[tuple[str, int]], created: set[str],
          problems: list[str]) -> None:
    """Fuzz one operation; what it answered goes into ``statuses``, ``created`` and ``problems``."""
    cases = (operation.as_strategy(generation_mode=GenerationMode.POSITIVE)
             | operation.as_strategy(generation_mode=GenerationMode.NEGATIVE))
    label = f"{operation.method.upper()} {operation.path}"

    @settings(max_examples=examples(ci=60, fuzz=2_000), suppress_health_check=list(HealthCheck))
    @given(case=cases, who=st.sampled_from(sorted(_AS)))
    def check(case: Any, who: str) -> None:
        response = case.call(base_url=url, headers=_AS[who], timeout=15)
        statuses[(label, response.status_code)] += 1
        if response.status_code >= 500:
            problems.append(f"{label} as {who} → {response.status_code}: {response.content[:300]!r}")
        elif response.status_code >= 400 and (shape := _error_shaped(response.content)) is not None:
            problems.append(f"{label} as {who} → {response.status_code}, {shape}")
        if label == "POST /v1/runs" and response.status_code in (200, 201):
            created.add(json.loads(response.content)["run_id"])

    check()


@pytest.fixture(autouse=True)
def _quiet_schemathesis(monkeypatch: pytest.MonkeyPatch) -> None:
    # Schemathesis reads a schemathesis.toml when one is found; none of ours: the defaults, always.
    monkeypatch.delenv("SCHEMATHESIS_CONFIG", raising=False)
