"""CLI start-up: the wall clock of one ``runbrake`` command an ops script runs, start to exit (issue 30, item 7).

Run from the repository root::

    .venv/bin/python -m bench.cli_startup [--calls 20]

What it does, in its own namespace (``bench-<hex>``), on the local Redis and RabbitMQ: runs each of
``runbrake --help``, ``runbrake show RUN`` (a run with three steps) and ``runbrake cancel RUN`` (a run of
its own each time: the fence wins and the wake-up is confirmed by RabbitMQ) ``--calls`` times, one after
another, as a script would, and times each process from spawn to exit (wall clock) and the CPU time it
used (user + system). Beside them, ``python -c pass`` (the
interpreter's own start-up, the floor) and ``python -c "import runbrake.broker.cli"`` (the import alone).
For each command also the modules it loaded, counted with ``-X importtime`` once. Every command runs as an
installed package does, with compiled bytecode (in a cache of the benchmark's, written by one warm-up call
that is not counted). Prints the summaries and writes ``bench/results/cli_startup.json``.
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import time
from pathlib import Path

from bench._harness import Bench, background_load, machine, print_machine, summary_ms
from runbrake.shared.steps import RunStep, StepKind

RUNBRAKE = str(Path(sys.executable).parent / "runbrake")


def _timed(command: list[str], env: dict[str, str], cpu: list[float] | None = None) -> float:
    """The wall clock of ``command`` from spawn to exit; its CPU time (user + system) appended to ``cpu``: on a
    machine shared with other work, the wall clock waits for the cores, the CPU time much less so."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, check=False)
    elapsed = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} exited {done.returncode}: {done.stderr.decode()[-500:]}")
    if cpu is not None:
        cpu.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
    return elapsed


def _modules(command: list[str], env: dict[str, str]) -> int:
    """How many modules ``command`` (a ``runbrake`` one) imports, from ``-X importtime``'s lines."""
    done = subprocess.run([sys.executable, "-X", "importtime", RUNBRAKE, *command[1:]], env=env,
                          capture_output=True, text=True, check=False)
    return sum(1 for line in done.stderr.splitlines() if line.startswith("import time:")) - 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20)
    args = parser.parse_args()
    info = {**machine(), "background": background_load()}
    with Bench("cli_startup") as bench:
        # As an installed package runs: with compiled bytecode (pip writes it at install; this environment may
        # say PYTHONDONTWRITEBYTECODE), kept apart from the sources, written by one warm-up call per command.
        env = {key: value for key, value in bench.env.items() if key != "PYTHONDONTWRITEBYTECODE"}
        env["PYTHONPYCACHEPREFIX"] = str(bench.workdir / "pycache")
        shown = bench.store.create({"input": "shown"}).run_id
        bench.store.claim(shown, "bench", lease_s=600)
        for index in range(3):
            bench.store.append_step(shown, RunStep(kind=StepKind.MODEL, round=index + 1, content=f"step {index}"))
        cancelled = [bench.store.create({"input": f"cancelled {i}"}).run_id for i in range(args.calls + 1)]
        commands = {
            "python -c pass": [sys.executable, "-c", "pass"],
            "import runbrake.broker.cli": [sys.executable, "-c", "import runbrake.broker.cli"],
            "runbrake --help": [RUNBRAKE, "--help"],
            "runbrake show RUN": [RUNBRAKE, "show", shown],
        }
        results: dict[str, object] = {}
        for name, command in commands.items():
            _timed(command, env)  # the warm-up: writes the bytecode
            cpu: list[float] = []
            results[name] = {"wall": summary_ms([_timed(command, env, cpu) for _ in range(args.calls)]),
                             "cpu": summary_ms(cpu)}
        _timed([RUNBRAKE, "cancel", cancelled.pop()], env)
        cpu = []
        results["runbrake cancel RUN"] = {
            "wall": summary_ms([_timed([RUNBRAKE, "cancel", run_id], env, cpu) for run_id in cancelled]),
            "cpu": summary_ms(cpu)}
        unknown = [RUNBRAKE, "cancel", "0" * 32]  # refused (exit 1) after the fence: the imports of a cancel
        modules = {name: _modules(command, env) for name, command in
                   [*commands.items(), ("runbrake cancel RUN", unknown)] if command[0] == RUNBRAKE}
        results["modules"] = modules
        print_machine(info)
        for name, summary in results.items():
            print(f"{name:28} {summary}")
        bench.write_results({"machine": info, "calls": args.calls, "results": results})


if __name__ == "__main__":
    main()
