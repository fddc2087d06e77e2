"""Redis memory per finished run: what a deployment needs per run kept for RUNBRAKE_RETENTION_S.

Run from the repository root::

    .venv/bin/python -m bench.redis_memory [--runs 500]

In a namespace of its own, writes ``--runs`` runs shaped like the quick runs of the other benchmarks
(the spec of three scripted rounds, then 5 steps: model → tool get-sum → model → tool echo → model
with the final answer) through the real store, settles each ``completed``, and reports per run: the
sum of ``MEMORY USAGE`` over the run's own keys, and the growth of Redis's ``used_memory`` (which
also counts the namespace-wide index, retention and server-count entries). Deletes the namespace.
"""

from __future__ import annotations

import argparse
import secrets
import statistics
import sys
from collections.abc import Sequence

from runbrake.shared import RunSpec, RunStatus, RunStep, RunStore, Settings, StepKind, TerminationReason, ToolResult

SPEC = {
    "input": "What is 2 + 3, and say it back?",
    "model": {"provider": "scripted", "turns": [
        {"tool_calls": [{"server": "toolbox", "tool": "get-sum", "arguments": {"a": 2, "b": 3}}]},
        {"tool_calls": [{"server": "toolbox", "tool": "echo", "arguments": {"text": "five"}}]},
        {"content": "It is 5."},
    ]},
    "mcp_servers": ["toolbox"],
    "idempotency_key": "",
}


def _steps() -> list[RunStep]:
    calls = [{"id": "call_0_0", "server": "toolbox", "tool": "get-sum", "arguments": {"a": 2, "b": 3}}]
    echo = [{"id": "call_1_0", "server": "toolbox", "tool": "echo", "arguments": {"text": "five"}}]
    return [
        RunStep(kind=StepKind.MODEL, round=1, duration_ms=850, detail={"tool_calls": calls}),
        RunStep.tool(round=1, server="toolbox", name="get-sum", result=ToolResult.ok("5"), call_id="call_0_0",
                     duration_ms=12),
        RunStep(kind=StepKind.MODEL, round=2, duration_ms=910, detail={"tool_calls": echo}),
        RunStep.tool(round=2, server="toolbox", name="echo", result=ToolResult.ok("five"), call_id="call_1_0",
                     duration_ms=9),
        RunStep(kind=StepKind.MODEL, round=3, duration_ms=700, content="It is 5.", detail={"tool_calls": []}),
    ]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--runs", type=int, default=500)
    args = parser.parse_args(argv)
    settings = Settings(namespace=f"bench-{secrets.token_hex(6)}")
    store = RunStore.connect(settings)
    try:
        store.ping()
        before = int(store.redis.info("memory")["used_memory"])
        per_run = []
        for i in range(args.runs):
            spec = RunSpec.parse({**SPEC, "idempotency_key": f"order-{i}"})
            run_id = store.create(spec.raw, idempotency_key=spec.idempotency_key).run_id
            store.claim(run_id, "bench-worker", lease_s=60)
            for step in _steps():
                store.append_step(run_id, step)
            settled = store.settle(run_id, RunStatus.COMPLETED, TerminationReason.COMPLETED, owner="bench-worker")
            assert settled.won, settled
            idempotency = store.keys.idempotency(f"order-{i}", store.keys.shard(run_id))
            keys = (store.run_key(run_id), store.steps_key(run_id), idempotency)
            per_run.append(sum(int(store.redis.memory_usage(key, samples=0) or 0) for key in keys))
        after = int(store.redis.info("memory")["used_memory"])
    finally:
        store.delete_namespace()
        store.close()
    print(f"{args.runs} finished runs (5 steps each, with an idempotency key), Redis {_version(settings)}")
    print(f"  MEMORY USAGE of a run's keys: median {statistics.median(per_run):.0f} B, "
          f"max {max(per_run)} B")
    growth = (after - before) / args.runs
    print(f"  used_memory growth per run (index, retention and counters included): {growth:.0f} B")
    return 0


def _version(settings: Settings) -> str:
    store = RunStore.connect(settings)
    try:
        return str(store.redis.info("server")["redis_version"])
    finally:
        store.close()


if __name__ == "__main__":
    sys.exit(main())
