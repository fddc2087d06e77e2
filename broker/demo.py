"""``runbrake demo``: the whole story on the local Redis and RabbitMQ, in under a minute.

Part 1 walks one run through its lifecycle on Redis alone: a cancel wins the fence
and a late settle is refused. Part 2 starts the example MCP server and a worker and
enqueues four runs: one completes, one has a failing tool (recorded failed; the run
goes on), one is cancelled while queued (never executed), one is cancelled between
rounds, and one is cancelled in the middle of a 30-second tool call (recorded
cancelled, not failed). Everything runs under a namespace of its own, deleted at the end.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import IO, Any

import click
import pika.exceptions

from runbrake.broker.cancel import CancelPublisher, cancel_run
from runbrake.broker.producer import Producer
from runbrake.broker.rabbitmq import build_broker
from runbrake.broker.render import render_run
from runbrake.broker.wire import delete_topology
from runbrake.shared.catalog import Admission
from runbrake.shared.settings import Settings
from runbrake.shared.spec import RunSpec
from runbrake.shared.status import RunStatus, TerminationReason
from runbrake.shared.steps import RunStep, StepKind
from runbrake.shared.store import RunRecord, RunStore
from runbrake.shared.tool_result import ToolResult

TOOLBOX = "runbrake.broker.toolbox_server"
"""The example MCP server, a module of this package, so the demo runs from a plain install."""
_WAIT_S = 20.0


def run_demo(base: Settings) -> int:
    """Run the demo; returns the exit code."""
    settings = base.with_changes(namespace=f"{base.namespace}-demo-{uuid.uuid4().hex[:6]}")
    store = RunStore.connect(settings)
    store.ping()
    try:
        part_one(store)
        return part_two(settings, store)
    finally:
        store.delete_namespace()
        with contextlib.suppress(pika.exceptions.AMQPError):
            delete_topology(settings)
        store.close()
        click.echo(f"\ncleaned up namespace {settings.namespace}")


def heading(text: str) -> None:
    click.echo(f"\n=== {text} " + "=" * max(0, 70 - len(text)))


def part_one(store: RunStore) -> None:
    heading("Part 1: the run store on Redis")
    created = store.create({"input": "lifecycle walk"})
    run_id = created.run_id
    click.echo(f"created {run_id}: {store.status(run_id).value}")
    store.claim(run_id, "demo-worker", lease_s=60)
    click.echo(f"claimed by demo-worker: {store.status(run_id).value}")
    store.append_step(run_id, RunStep(kind=StepKind.MODEL, round=1, detail={"tool_calls": [
        {"id": "c1", "server": "calc", "tool": "slow", "arguments": {}}]}))
    store.append_step(run_id, RunStep.tool(round=1, server="calc", name="get-sum", result=ToolResult.ok("5")))
    store.append_step(run_id, RunStep.tool(round=1, server="calc", name="fail", result=ToolResult.error("boom")))
    store.append_step(run_id, RunStep.tool(round=1, server="calc", name="slow",
                                           result=ToolResult.cancelled("call to calc.slow was cancelled")))
    cancel = store.cancel(run_id, reason="demo: operator pressed stop", requested_by="demo")
    click.echo(f"cancel: won={cancel.won} (found {cancel.found.value})")
    late = store.settle(run_id, RunStatus.COMPLETED, TerminationReason.COMPLETED, owner="demo-worker")
    click.echo(f"late settle by the worker: won={late.won} (found {late.found.value}) - terminal is terminal")
    again = store.cancel(run_id, reason="twice", requested_by="demo")
    click.echo(f"second cancel: won={again.won} (found {again.found.value})")
    record = store.get(run_id)
    click.echo("")
    click.echo(render_run(record, "en"))
    click.echo("")
    click.echo(render_run(record, "de"))


def _spec(turns: list[dict[str, Any]], text: str) -> RunSpec:
    # The spec names the catalog's server; it cannot say where it is or how to start it (docs/security.md).
    return RunSpec.parse({"input": text, "model": {"provider": "scripted", "turns": turns}, "mcp_servers": ["calc"]})


def _catalog(port: int, where: Path) -> Path:
    """The demo's catalog: its one MCP server, ``calc``, with an allowlist of its tools."""
    where.write_text(f'[mcp_servers.calc]\nurl = "http://127.0.0.1:{port}/mcp"\n'
                     'tools = ["get-sum", "fail", "slow", "echo"]\n', encoding="utf-8")
    return where


def _call(tool: str, **arguments: Any) -> dict[str, Any]:
    return {"server": "calc", "tool": tool, "arguments": arguments}


def part_two(settings: Settings, store: RunStore) -> int:
    heading("Part 2: runs on a worker, tools on a real MCP server")
    port = _free_port()
    with ExitStack() as stack:
        catalog = _catalog(port, Path(stack.enter_context(tempfile.TemporaryDirectory())) / "catalog.toml")
        settings = settings.with_changes(catalog=str(catalog), allow_inline=False)
        env = {**os.environ, "RUNBRAKE_NAMESPACE": settings.namespace, "RUNBRAKE_CATALOG": str(catalog)}
        env.pop("RUNBRAKE_ALLOW_INLINE", None)
        broker = build_broker(settings)
        producer = Producer(store, broker, Admission.from_settings(settings))
        publisher = CancelPublisher(settings)
        stack.callback(broker.close)
        stack.callback(publisher.close)
        server = stack.enter_context(_process("MCP server", [sys.executable, "-m", TOOLBOX, "--transport", "http",
                                                             "--port", str(port)], env))
        _wait(lambda: _port_open(port), "the MCP server to listen", server)

        queued = producer.enqueue(_spec([{"content": "never runs"}], "cancelled while queued")).run_id
        result = cancel_run(store, publisher, queued, reason="demo: not needed any more", requested_by="demo")
        click.echo(f"run C enqueued and cancelled while queued (fence won: {result.won}); no worker runs yet")

        worker = stack.enter_context(
            _process("worker", [sys.executable, "-m", "runbrake.worker", "--threads", "4"], env))
        completes = producer.enqueue(_spec([
            {"tool_calls": [_call("get-sum", a=2, b=3)]}, {"content": "2 + 3 is 5."}], "What is 2 + 3?")).run_id
        fails = producer.enqueue(_spec([
            {"tool_calls": [_call("fail", message="upstream said no"), _call("get-sum", a=1, b=1)]},
            {"content": "One tool failed; 1 + 1 is 2."}], "Try both tools")).run_id
        between = producer.enqueue(_spec([
            {"tool_calls": [_call("get-sum", a=20, b=22)]},
            {"delay_ms": 20_000, "content": "a slow model that never gets to answer"}], "Stop between rounds")).run_id
        mid_tool = producer.enqueue(_spec([
            {"tool_calls": [_call("slow", seconds=30)]}, {"content": "never"}], "Stop a 30 s tool call")).run_id

        records = {
            "A: completes": _until(store, worker, completes, lambda r: r.status.is_terminal),
            "B: a tool fails, the run goes on": _until(store, worker, fails, lambda r: r.status.is_terminal),
        }
        _until(store, worker, between, lambda r: any(s.kind is StepKind.TOOL for s in r.steps))
        cancel_run(store, publisher, between, reason="demo: stop after round 1", requested_by="demo")
        _until(store, worker, mid_tool, lambda r: any(s.kind is StepKind.MODEL for s in r.steps))
        time.sleep(0.5)  # let the tool call get under way on the server: this is a demo, not a test
        started = time.time()
        cancel_run(store, publisher, mid_tool, reason="demo: stop the slow tool", requested_by="demo")
        records["D: cancelled between rounds (the slow model call is cut off)"] = _until(
            store, worker, between, lambda r: len(r.steps) >= 3)
        records["E: cancelled in the middle of a 30 s tool call"] = after = _until(
            store, worker, mid_tool, lambda r: any(s.kind is StepKind.TOOL for s in r.steps))
        interrupted = next(s for s in after.steps if s.kind is StepKind.TOOL)
        records["C: cancelled while queued (never executed)"] = store.get(queued)
        for title, record in sorted(records.items()):
            heading(title)
            click.echo(render_run(store.get(record.run_id), "en"))
        heading("E again, in German")
        click.echo(render_run(store.get(mid_tool), "de"))
        click.echo(f"\nthe 30 s tool call was recorded {interrupted.tool_outcome} "
                   f"{(interrupted.recorded_at - started) * 1000:.0f} ms after the cancel")
    return 0


@dataclasses.dataclass
class _Child:
    """A process the demo started, with its output in a temporary file (read back when it dies)."""

    name: str
    process: subprocess.Popen[bytes]
    output: IO[bytes]

    def died(self) -> str | None:
        """None while it runs; otherwise why it stopped: the exit code and the end of its output."""
        code = self.process.poll()
        if code is None:
            return None
        self.output.seek(0)
        tail = self.output.read().decode(errors="replace").strip().splitlines()[-15:]
        return f"the {self.name} exited with code {code}" + (":\n  " + "\n  ".join(tail) if tail else "")


@contextmanager
def _process(name: str, command: list[str], env: dict[str, str]) -> Iterator[_Child]:
    with tempfile.TemporaryFile() as output:
        process = subprocess.Popen(command, env=env, stdout=output, stderr=subprocess.STDOUT)
        try:
            yield _Child(name, process, output)
        finally:
            _stop(name, process)


def _stop(name: str, process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=15)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    click.echo(f"stopped the {name}")


def _until(store: RunStore, worker: _Child, run_id: str, done: Callable[[RunRecord], bool]) -> RunRecord:
    """The run's record once ``done`` holds; fail at once, saying why, when the worker dies first."""
    deadline = time.monotonic() + _WAIT_S
    while time.monotonic() < deadline:
        record = store.get(run_id)
        if done(record):
            return record
        death = worker.died()
        if death is not None:
            raise click.ClickException(death)
        time.sleep(0.05)
    raise click.ClickException(f"run {run_id} did not get there within {_WAIT_S:.0f} s; is the worker running?")


def _wait(ready: Callable[[], bool], what: str, child: _Child) -> None:
    """Wait for ``ready``; fail at once, saying why, when ``child`` dies first."""
    deadline = time.monotonic() + _WAIT_S
    while not ready():
        death = child.died()
        if death is not None:
            raise click.ClickException(f"{death}\n(waiting for {what})")
        if time.monotonic() > deadline:
            raise click.ClickException(f"timed out after {_WAIT_S:.0f} s waiting for {what}")
        time.sleep(0.05)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _port_open(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0
