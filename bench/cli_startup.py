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

``--before REV`` (a git revision, e.g. ``main``) times the same commands with the package of REV as well (its
``shared``, ``broker`` and ``worker`` extracted into the benchmark's folder, ahead of the installed package on
``PYTHONPATH``), call for call in turn with this tree's, so that both see the same load on a shared machine,
and prints this tree's median over REV's per command.
"""

from __future__ import annotations

import argparse
import io
import resource
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from bench._harness import Bench, background_load, machine, print_machine, summary_ms
from runbrake.shared.steps import RunStep, StepKind

RUNBRAKE = str(Path(sys.executable).parent / "runbrake")
REPO = Path(__file__).resolve().parent.parent


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


def _package_of(revision: str, into: Path) -> Path:
    """The ``runbrake`` package of git ``revision``, laid out as installed (``runbrake/shared``…) under ``into``."""
    archive = subprocess.run(["git", "archive", "--format=tar", revision, "shared", "broker", "worker"], cwd=REPO,
                             capture_output=True, check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(into / "runbrake", filter="data")
    return into


def _timed_in_turn(variants: dict[str, tuple[list[str], dict[str, str]]], calls: int,
                   arguments: dict[str, list[list[str]]] | None = None) -> dict[str, object]:
    """Wall clock and CPU time of each variant's command, ``calls`` times, the variants in turn call for call
    (after one warm-up call each that writes the bytecode); ``arguments`` gives a variant fresh arguments per
    call (the run a ``cancel`` cancels)."""
    walls: dict[str, list[float]] = {name: [] for name in variants}
    cpus: dict[str, list[float]] = {name: [] for name in variants}
    for call in range(calls + 1):
        for name, (command, env) in variants.items():
            extra = arguments[name][call] if arguments else []
            if call == 0:
                _timed([*command, *extra], env)
            else:
                walls[name].append(_timed([*command, *extra], env, cpus[name]))
    return {name: {"wall": summary_ms(walls[name]), "cpu": summary_ms(cpus[name])} for name in variants}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--before", metavar="REV", default=None,
                        help="Also time the package of this git revision, in turn with this tree's.")
    args = parser.parse_args()
    info = {**machine(), "background": background_load()}
    with Bench("cli_startup") as bench:
        # As an installed package runs: with compiled bytecode (pip writes it at install; this environment may
        # say PYTHONDONTWRITEBYTECODE), kept apart from the sources, written by one warm-up call per command.
        env = {key: value for key, value in bench.env.items() if key != "PYTHONDONTWRITEBYTECODE"}
        env["PYTHONPYCACHEPREFIX"] = str(bench.workdir / "pycache")
        envs = {"": env}
        if args.before:
            before = _package_of(args.before, bench.workdir / "before")
            envs[f" ({args.before})"] = {**env, "PYTHONPATH": str(before)}
        shown = bench.store.create({"input": "shown"}).run_id
        bench.store.claim(shown, "bench", lease_s=600)
        for index in range(3):
            bench.store.append_step(shown, RunStep(kind=StepKind.MODEL, round=index + 1, content=f"step {index}"))
        commands = {
            "python -c pass": [sys.executable, "-c", "pass"],
            "import runbrake.broker.cli": [sys.executable, "-c", "import runbrake.broker.cli"],
            "runbrake --help": [RUNBRAKE, "--help"],
            "runbrake show RUN": [RUNBRAKE, "show", shown],
        }
        results: dict[str, object] = {}
        for name, command in commands.items():
            flavours = envs if name != "python -c pass" else {"": env}  # the floor has no package to compare
            results.update(_timed_in_turn({name + suffix: (command, variant) for suffix, variant in flavours.items()},
                                          args.calls))
        cancels = {f"runbrake cancel RUN{suffix}": ([RUNBRAKE, "cancel"], variant) for suffix, variant in envs.items()}
        runs = {name: [[bench.store.create({"input": f"cancelled {i}"}).run_id] for i in range(args.calls + 1)]
                for name in cancels}
        results.update(_timed_in_turn(cancels, args.calls, runs))
        unknown = [RUNBRAKE, "cancel", "0" * 32]  # refused (exit 1) after the fence: the imports of a cancel
        results["modules"] = {
            name + suffix: _modules(command, variant) for suffix, variant in envs.items()
            for name, command in [*commands.items(), ("runbrake cancel RUN", unknown)] if command[0] == RUNBRAKE}
        if args.before:
            results["after / before (wall p50)"] = {
                name: round(_p50(results, name) / _p50(results, f"{name} ({args.before})"), 2)
                for name in [*commands, "runbrake cancel RUN"] if f"{name} ({args.before})" in results}
        print_machine(info)
        for name, summary in results.items():
            print(f"{name:40} {summary}")
        bench.write_results({"machine": info, "calls": args.calls, "before": args.before, "results": results})


def _p50(results: dict[str, object], name: str) -> float:
    summary = results[name]
    assert isinstance(summary, dict)
    return float(summary["wall"]["p50"])


if __name__ == "__main__":
    main()
