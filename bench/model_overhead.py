"""Model call overhead: the CPU runbrake adds to one model call beyond the provider SDK's own.

Run from the repository root::

    .venv/bin/python -m bench.model_overhead [--calls 300] [--rounds 3]

What it does, on loopback only:

1. starts PyPI ``llm-mock-api`` as a subprocess (so its CPU is not this process's), answering every request
   with a short text and usage;
2. for each provider (``openai``: chat completions; ``anthropic``: Messages), alternates rounds of
   ``--calls`` sequential calls of the same conversation (a system prompt, a user message, a turn of two
   tool calls and their results: 6 messages; 8 tools with schemas), two ways:

   - **sdk**: the provider SDK alone, the way a hand-written caller would use it: one long-lived client
     (``max_retries=0``), the request body built once beforehand, the response object taken as it comes;
   - **runbrake**: ``provider_for(spec).complete(...)`` inside ``async with provider``, as a segment of a
     run calls it (worker/runtime.py): the retry wrapper, the segment's one client (with the process's one
     TLS context), runbrake's conversation and tools mapped to the SDK's shapes on every call, the answer
     mapped back (content, tool calls, usage);
   - **first call**: the same, with a new provider per call: what the first model call of a segment pays on
     top (a client and a connection of its own), shown beside the aim, not part of it;

3. per round and way, the CPU time of this process (``time.process_time``, every thread) divided by the
   calls; the overhead is runbrake's minus the sdk's, per call. Wall time per call is printed beside it.
4. prints a table and the median overhead per provider, and writes ``bench/results/model_overhead.json``.

The aim (issue 17, "Performance"): at most 1 ms of CPU per model call.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
from anthropic import AsyncAnthropic
from openai import AsyncOpenAI

from bench._harness import RESULTS_DIR, BenchError, free_port, machine, print_machine
from runbrake.shared.spec import AnthropicModel, OpenAIModel
from runbrake.worker.anthropic_provider import DEFAULT_MAX_TOKENS
from runbrake.worker.anthropic_provider import _conversation as anthropic_conversation
from runbrake.worker.anthropic_provider import _tool_param as anthropic_tool
from runbrake.worker.conversation import Message, ToolCall, ToolInfo
from runbrake.worker.models import _message_param as openai_message
from runbrake.worker.models import _tool_param as openai_tool
from runbrake.worker.models import provider_for

STARTUP_TIMEOUT_S = 30.0
AIM_MS = 1.0

TOOLS = tuple(
    ToolInfo(server="toolbox", name=f"tool-{n}", description=f"Tool number {n}: does one thing well.",
             input_schema={"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "string"}},
                           "required": ["a"]})
    for n in range(8)
)
CALLS = (ToolCall(id="call_1", server="toolbox", tool="tool-0", arguments={"a": 2, "b": "x"}),
         ToolCall(id="call_2", server="toolbox", tool="tool-1", arguments={"a": 3}))
CONVERSATION = (
    Message(role="system", content="You are a careful assistant. Answer briefly."),
    Message(role="user", content="What is 2 + 3, and what is 3 + 4?"),
    Message(role="assistant", content=None, tool_calls=CALLS),
    Message(role="tool", content="5", tool_call_id="call_1"),
    Message(role="tool", content="7", tool_call_id="call_2"),
    Message(role="user", content="And both together?"),
)


def start_mock(port: int) -> subprocess.Popen[bytes]:
    process = subprocess.Popen(
        [sys.executable, "-m", "llm_mock_api.cli", "start", "-p", str(port), "-H", "127.0.0.1",
         "--log-level", "none", "-f", "Twelve."],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise BenchError(f"llm-mock-api exited with {process.returncode}")
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return process
        time.sleep(0.05)  # waiting for a subprocess to listen, bounded
    process.kill()
    raise BenchError("llm-mock-api did not listen in time")


async def measure(call: Callable[[], Awaitable[object]], calls: int) -> tuple[float, float]:
    """(CPU ms, wall ms) per call over ``calls`` sequential calls."""
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(calls):
        await call()
    return ((time.process_time() - cpu) * 1000 / calls, (time.perf_counter() - wall) * 1000 / calls)


async def ways(url: str, stack: contextlib.AsyncExitStack) -> dict[str, dict[str, Callable[[], Awaitable[object]]]]:
    openai_client = AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    anthropic_client = AsyncAnthropic(base_url=url, api_key="unused", max_retries=0)
    openai_body: dict[str, Any] = {"model": "gpt-mock", "messages": [openai_message(m) for m in CONVERSATION],
                                   "tools": [openai_tool(t) for t in TOOLS]}
    system, conversation = anthropic_conversation(CONVERSATION)
    anthropic_body: dict[str, Any] = {"model": "claude-mock", "max_tokens": DEFAULT_MAX_TOKENS, "system": system,
                                      "messages": conversation, "tools": [anthropic_tool(t) for t in TOOLS]}
    openai_spec = OpenAIModel(base_url=f"{url}/v1", model="gpt-mock")
    anthropic_spec = AnthropicModel(model="claude-mock", base_url=url)
    # As in a segment of a run (worker/runtime.py): held, so that the calls share one client.
    openai_provider = await stack.enter_async_context(provider_for(openai_spec))
    anthropic_provider = await stack.enter_async_context(provider_for(anthropic_spec))
    return {
        "openai": {
            "sdk": lambda: openai_client.chat.completions.create(**openai_body),
            "runbrake": lambda: openai_provider.complete(CONVERSATION, TOOLS, round_index=1),
            "first_call": lambda: provider_for(openai_spec).complete(CONVERSATION, TOOLS, round_index=1),
        },
        "anthropic": {
            "sdk": lambda: anthropic_client.messages.create(**anthropic_body),
            "runbrake": lambda: anthropic_provider.complete(CONVERSATION, TOOLS, round_index=1),
            "first_call": lambda: provider_for(anthropic_spec).complete(CONVERSATION, TOOLS, round_index=1),
        },
    }


async def run(url: str, calls: int, rounds: int) -> dict[str, Any]:
    async with contextlib.AsyncExitStack() as stack:
        table = await ways(url, stack)
        for way in table.values():  # warm up: imports, the TLS context, the server's first requests
            for call in way.values():
                await measure(call, 20)
        results: dict[str, Any] = {}
        for provider, way in table.items():
            rows = []
            for number in range(rounds):
                sdk_cpu, sdk_wall = await measure(way["sdk"], calls)
                ours_cpu, ours_wall = await measure(way["runbrake"], calls)
                first_cpu, _ = await measure(way["first_call"], calls)
                rows.append({"round": number + 1, "sdk_cpu_ms": round(sdk_cpu, 3),
                             "runbrake_cpu_ms": round(ours_cpu, 3), "overhead_cpu_ms": round(ours_cpu - sdk_cpu, 3),
                             "first_call_overhead_cpu_ms": round(first_cpu - sdk_cpu, 3),
                             "sdk_wall_ms": round(sdk_wall, 3), "runbrake_wall_ms": round(ours_wall, 3)})
                print(f"{provider:9} round {number + 1}: sdk {sdk_cpu:.3f} ms CPU ({sdk_wall:.2f} wall), runbrake "
                      f"{ours_cpu:.3f} ms CPU ({ours_wall:.2f} wall): +{ours_cpu - sdk_cpu:.3f} ms per call; "
                      f"a segment's first call +{first_cpu - sdk_cpu:.3f} ms")
            overhead = statistics.median(r["overhead_cpu_ms"] for r in rows)
            results[provider] = {"rounds": rows, "median_overhead_cpu_ms": round(overhead, 3),
                                 "median_first_call_overhead_cpu_ms": round(
                                     statistics.median(r["first_call_overhead_cpu_ms"] for r in rows), 3),
                                 "aim_met": overhead <= AIM_MS}
        return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=300, help="sequential calls per round and way")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per provider")
    args = parser.parse_args()
    info = machine()
    print_machine(info)
    port = free_port()
    mock = start_mock(port)
    try:
        results = anyio.run(run, f"http://127.0.0.1:{port}", args.calls, args.rounds)
    finally:
        mock.terminate()
        mock.wait(timeout=20)
    for provider, result in results.items():
        verdict = "met" if result["aim_met"] else "NOT met"
        print(f"{provider}: median overhead {result['median_overhead_cpu_ms']:.3f} ms CPU per model call "
              f"(aim ≤ {AIM_MS} ms: {verdict})")
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / "model_overhead.json"
    path.write_text(json.dumps({"machine": info, "calls": args.calls, "rounds": args.rounds, **results}, indent=2))
    print(f"results: {os.path.relpath(path)}")
    return 0 if all(r["aim_met"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
