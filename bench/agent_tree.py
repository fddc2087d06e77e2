"""Agent trees: how long a cancel at the root of a tree of 1 + 5 + 25 runs takes to reach every call, beside
the cancel of a single run in the same tool call (docs/usage.md, "Agent trees").

Run from the repository root::

    .venv/bin/python -m bench.agent_tree [--trees 50] [--singles 50] [--fanout 5] [--processes 1] [--profile]

What it does, in its own namespace, on loopback only:

1. starts the npm ``@modelcontextprotocol/server-everything`` over streamable HTTP (``everything`` in the
   catalog), ``llm-mock-api`` in a process of its own as the agents' model, and ``--processes`` worker
   processes (1; ``runbrake worker`` starts one per CPU) of ``--concurrency`` 48 each (a tree holds 31 runs);
2. the catalog's agents: ``mid`` (calls ``leaf``) and ``leaf`` (calls ``trigger-long-running-operation`` for
   300 s); the model asks ``mid`` for ``--fanout`` calls of ``leaf`` and ``leaf`` for the long operation;
3. per tree: the root (a scripted model) calls ``mid`` ``--fanout`` times; once every caller marked its agent
   calls sent (``sent:<call id>`` on its hash) and every leaf's long call reported progress (its hash's
   ``progress``: the server runs it), t0 = ``time.time()``,
   ``cancel_run`` on the root; then every run of the tree is awaited terminal, and measured: the latest
   ``recorded_at`` of the cancelled tool steps of the whole tree (every leaf's long call, every agent call of
   the mids and the root) minus t0; every run must be ``cancelled`` and every such step ``cancelled``;
4. per single run: one run calling the long operation directly, cancelled the same way (its one tool step);
5. prints both summaries and the ratio of the p50s, and writes ``bench/results/agent_tree.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time
from typing import Any

from llm_mock_api import MockServer, MockServerOptions
from llm_mock_api.types.reply import ReplyObject
from llm_mock_api.types.reply import ToolCall as MockToolCall

from bench import _profile
from bench._harness import Bench, BenchError, free_port, machine, print_machine, summary_ms, wait_until
from bench._harness import _listening as listening
from runbrake.shared.messaging.cancel import CancelPublisher, cancel_run
from runbrake.shared.messaging.producer import Producer
from runbrake.shared.outcome import ToolOutcome
from runbrake.shared.records import SENT_MODEL, SENT_PREFIX, RunRecord
from runbrake.shared.spec import RunSpec
from runbrake.shared.status import RunStatus
from runbrake.shared.steps import StepKind

SERVER = "everything"
TOOL = "trigger-long-running-operation"
WAIT_S = 60.0
AIM_P99_MS = 50.0


def serve(port: int, fanout: int) -> None:
    """The agents' model, in its own process: ``mid`` asks for ``fanout`` leaves, ``leaf`` for the long call."""
    async def main() -> None:
        server = MockServer(MockServerOptions(host="127.0.0.1", port=port, default_latency=0, default_chunk_size=0))
        server.when("mid").reply(ReplyObject(tools=[
            MockToolCall(name="agent__leaf", args={"input": "leaf"}, id=f"call_leaf_{i}") for i in range(fanout)]))
        server.when("leaf").reply(ReplyObject(tools=[MockToolCall(
            name=f"{SERVER}__{TOOL}", args={"duration": 300, "steps": 300})]))
        await server.start()
        await asyncio.Event().wait()  # until the benchmark terminates the process

    asyncio.run(main())


class TreeBench:
    def __init__(self, bench: Bench, fanout: int) -> None:
        self.bench = bench
        self.fanout = fanout
        self.by_depth: dict[int, list[float]] = {}
        """Seconds from the cancel to each run's last cancelled step, by the run's depth."""
        port = free_port()
        model = subprocess.Popen([sys.executable, "-m", "bench.agent_tree", "--serve", str(port), str(fanout)],
                                 env=bench.env, stdout=subprocess.DEVNULL,
                                 stderr=(bench.workdir / "model.log").open("wb"))
        bench.on_close(lambda: (model.terminate(), model.wait(timeout=10)))
        wait_until(lambda: listening(port), timeout=30, what="llm-mock-api to listen")
        bench.start_everything(SERVER)
        with bench.catalog.open("a", encoding="utf-8") as catalog:
            catalog.write(f'[models.mock]\nprovider = "openai"\nbase_url = "http://127.0.0.1:{port}/v1"\n'
                          'model = "m"\nstream = false\n'
                          '[agents.mid]\ndescription = "delegates"\nmodel = "mock"\nagents = ["leaf"]\n'
                          f'[agents.leaf]\ndescription = "works long"\nmodel = "mock"\nmcp_servers = ["{SERVER}"]\n')
        self.producer: Producer
        self.publisher: CancelPublisher
        self.producer, self.publisher = bench.producer_and_publisher()

    def _runs(self, root: str) -> list[str]:
        return [root, *self.bench.store.descendants(root)]

    def _in_calls(self, run_ids: list[str]) -> bool:
        """Every run in its call: a caller's agent calls marked sent (their child runs exist), a leaf's long call
        reported progress by the server. A leaf's mark alone is not enough: it is written with the model step
        that asks for the call, and a cancel that comes before the call starts leaves it unmade, unrecorded."""
        redis, store = self.bench.store.redis, self.bench.store
        for index, run_id in enumerate(run_ids):
            fields = redis.hkeys(store.run_key(run_id))
            leaf = not self.fanout or index > self.fanout
            if leaf and "progress" not in fields:
                return False
            if not leaf and not any(f.startswith(SENT_PREFIX) and f != SENT_MODEL for f in fields):
                return False
        return True

    def _cancelled(self, root: str) -> float:
        """Cancel ``root`` once every run of its tree has its call sent; seconds from the cancel to the last
        cancelled tool step of the tree."""
        size = 1 + self.fanout + self.fanout * self.fanout if self.fanout else 1
        wait_until(lambda: len(self._runs(root)) >= size, timeout=WAIT_S, what=f"the {size} runs of tree {root}")
        ids = self._runs(root)
        wait_until(lambda: self._in_calls(ids), timeout=WAIT_S, what=f"every call of tree {root}")
        t0 = time.time()
        if not cancel_run(self.bench.store, self.publisher, root, reason="bench", requested_by="bench").won:
            raise BenchError(f"the cancel of {root} did not win")
        # The fence makes a run cancelled at once; its calls' steps follow: each run has one step per call (a
        # leaf its long call, a caller one per agent it called).
        records = wait_until(lambda: self._recorded(ids), timeout=WAIT_S, what=f"tree {root}'s steps",
                             interval=0.02)
        latest = 0.0
        for record in records:
            tools = [s for s in record.steps if s.kind is StepKind.TOOL]
            if record.status is not RunStatus.CANCELLED or any(s.tool_outcome is not ToolOutcome.CANCELLED
                                                               for s in tools):
                raise BenchError(f"run {record.run_id}: {record.status.value}, {[s.tool_outcome for s in tools]}")
            latest = max([latest, *(s.recorded_at for s in tools)])
            self.by_depth.setdefault(record.depth, []).append(max(s.recorded_at for s in tools) - t0)
        return latest - t0

    def _recorded(self, run_ids: list[str]) -> list[RunRecord] | None:
        records = [self.bench.store.get(run_id) for run_id in run_ids]
        done = all(len([s for s in r.steps if s.kind is StepKind.TOOL]) >= max(1, len(r.children)) for r in records)
        return records if done else None

    def tree(self) -> float:
        root = self.producer.enqueue(RunSpec.parse({
            "input": "root", "agents": ["mid"], "model": {"provider": "scripted", "turns": [
                {"tool_calls": [{"server": "agent", "tool": "mid", "arguments": {"input": "mid"}}] * self.fanout},
                {"content": "never"}]}})).run_id
        return self._cancelled(root)

    def single(self) -> float:
        run = self.producer.enqueue(RunSpec.parse({
            "input": "single", "mcp_servers": [SERVER], "model": {"provider": "scripted", "turns": [
                {"tool_calls": [{"server": SERVER, "tool": TOOL, "arguments": {"duration": 300, "steps": 300}}]},
                {"content": "never"}]}})).run_id
        saved, self.fanout = self.fanout, 0
        try:
            return self._cancelled(run)
        finally:
            self.fanout = saved


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trees", type=int, default=50)
    parser.add_argument("--singles", type=int, default=50)
    parser.add_argument("--fanout", type=int, default=5)
    parser.add_argument("--concurrency", type=int, default=48)
    parser.add_argument("--processes", type=int, default=1, help="worker processes (the tree's runs spread over them)")
    parser.add_argument("--keep", action="store_true", help="keep the scratch folder (the worker's log)")
    parser.add_argument("--profile", action="store_true",
                        help="sample the (first) worker with py-spy during the trees and say where its CPU went; the "
                             "raw samples are kept in the scratch folder (with --keep)")
    parser.add_argument("--serve", nargs=2, metavar=("PORT", "FANOUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.profile and _profile.py_spy() is None:
        parser.error("--profile: py-spy is not installed (pip install -e '.[bench]')")
    if args.serve:
        serve(int(args.serve[0]), int(args.serve[1]))
        return 0
    info = machine()
    print_machine(info)
    name = "agent_tree" if args.processes == 1 else f"agent_tree-{args.processes}-processes"
    with Bench(name, keep=args.keep) as bench:
        trees = TreeBench(bench, args.fanout)
        workers = [bench.start_worker(concurrency=args.concurrency) for _ in range(args.processes)]
        singles = [trees.single() for _ in range(args.singles)]
        trees.by_depth.clear()
        recording = _profile.Recording(workers[0].pid, bench.workdir / "profile.txt") if args.profile else None
        tree_times = [trees.tree() for _ in range(args.trees)]
        shares = _profile.shares(recording.stop()) if recording is not None else None
        results: dict[str, Any] = {
            "machine": info, "fanout": args.fanout, "runs_per_tree": 1 + args.fanout + args.fanout ** 2,
            "processes": args.processes,
            "single_ms": summary_ms(singles), "tree_ms": summary_ms(tree_times), "aim_p99_ms": AIM_P99_MS,
            "tree_ms_by_depth": {depth: summary_ms(values) for depth, values in sorted(trees.by_depth.items())}}
        results["ratio_p50"] = round(results["tree_ms"]["p50"] / results["single_ms"]["p50"], 2)
        if shares is not None:
            results["worker_cpu_shares"] = {part: round(share, 3) for part, share in shares.items()}
        bench.write_results(results)
    print(f"single run: {results['single_ms']}")
    print(f"tree of {results['runs_per_tree']}: {results['tree_ms']} (aim p99 <= {AIM_P99_MS} ms)")
    print(f"ratio of the p50s: {results['ratio_p50']}")
    for depth, summary in results["tree_ms_by_depth"].items():
        print(f"  runs at depth {depth}: {summary}")
    for part, share in (results.get("worker_cpu_shares") or {}).items():
        print(f"  worker CPU, {part}: {share:.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
