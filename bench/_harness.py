"""What both benchmarks share: a namespace of their own, a toolbox MCP server and a worker as
subprocesses, bounded waits on their files, percentiles, and the results file.

A benchmark runs inside :class:`Bench`::

    with Bench("throughput") as bench:
        server = bench.start_toolbox()
        worker = bench.start_worker(concurrency=8, noop=True)
        ...
        bench.write_results({...})

Leaving the block stops every process it started (SIGTERM, then SIGKILL after a grace
period), deletes the namespace's Redis keys and its queues and cancel exchange
(:func:`runbrake.shared.messaging.wire.delete_topology`), and removes the scratch directory (unless
``keep`` is set). Everything is on loopback.
"""

from __future__ import annotations

import json
import math
import os
import platform
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from types import TracebackType
from typing import Any

import pika
import pika.exceptions

from runbrake.shared.catalog import Admission
from runbrake.shared.messaging.cancel import CancelPublisher
from runbrake.shared.messaging.producer import Producer
from runbrake.shared.messaging.rabbitmq import build_broker
from runbrake.shared.messaging.wire import delete_topology
from runbrake.shared.settings import Settings
from runbrake.shared.spec import RunSpec
from runbrake.shared.status import RunStatus
from runbrake.shared.store import RunStore

REPO = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO / "bench" / "results"
TOOLBOX_SERVER = ("-m", "runbrake.broker.toolbox_server")
SERVER_NAME = "toolbox"
STARTUP_TIMEOUT_S = 30.0
STOP_GRACE_S = 20.0


class BenchError(RuntimeError):
    """Raised when a benchmark cannot go on: a process died, a bounded wait ran out."""


# -- files written by other processes ------------------------------------------------------------


class JsonLines:
    """Reads a JSON-lines file another process appends to, incrementally; a partly written
    last line is left for the next read, lines that are not JSON objects are skipped.

    A line holding several objects back to back (two writers of one process that do not share a
    lock: structlog's own output and the standard library's logging) is read as those objects,
    and counted in :attr:`glued_lines`, so a benchmark can say so instead of losing the events."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0
        self._partial = b""
        self.entries: list[dict[str, Any]] = []
        self.glued_lines = 0
        """Lines that held more than one JSON object."""

    def read_new(self) -> list[dict[str, Any]]:
        """The entries appended since the last call (also kept in :attr:`entries`)."""
        try:
            with self.path.open("rb") as handle:
                handle.seek(self._offset)
                chunk = handle.read()
        except FileNotFoundError:
            return []
        self._offset += len(chunk)
        lines = (self._partial + chunk).split(b"\n")
        self._partial = lines.pop()
        new = []
        for line in lines:
            if not line.startswith(b"{"):
                continue
            try:
                entries = [json.loads(line)]
            except ValueError:
                entries = _objects_in(line.decode(errors="replace"))
                if len(entries) > 1:
                    self.glued_lines += 1
            new.extend(entry for entry in entries if isinstance(entry, dict))
        self.entries.extend(new)
        return new


def _objects_in(text: str) -> list[Any]:
    """The JSON values written back to back at the start of ``text``, up to the first that does not parse."""
    decoder = json.JSONDecoder()
    values = []
    index = 0
    while index < len(text):
        try:
            value, index = decoder.raw_decode(text, index)
        except ValueError:
            break
        values.append(value)
        while index < len(text) and text[index].isspace():
            index += 1
    return values


def wait_until(
    condition: Callable[[], Any], *, timeout: float, what: str, interval: float = 0.005,
    alive: Sequence[ManagedProcess] = (),
) -> Any:
    """Poll ``condition`` until it returns something truthy (returned); BenchError after ``timeout`` s
    or as soon as one of the ``alive`` processes has exited."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        for process in alive:
            if process.popen.poll() is not None:
                raise BenchError(f"{process.name} exited ({process.popen.returncode}) while waiting for {what}; "
                                 f"see {process.log_path}")
        if time.monotonic() >= deadline:
            raise BenchError(f"gave up after {timeout:g} s waiting for {what}")
        time.sleep(interval)  # polling another process's output, bounded by the deadline


def log_time(entry: Mapping[str, Any]) -> float:
    """The epoch seconds of a worker log line (structlog's ISO UTC ``timestamp``)."""
    return datetime.fromisoformat(str(entry["timestamp"]).replace("Z", "+00:00")).timestamp()


# -- processes -----------------------------------------------------------------------------------


@dataclass
class ManagedProcess:
    """A subprocess this benchmark started, with the file its output goes to."""

    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def stop(self, signum: int = signal.SIGTERM) -> int:
        """Send ``signum``, wait, SIGKILL after the grace period; the exit code."""
        if self.popen.poll() is None:
            self.popen.send_signal(signum)
            try:
                self.popen.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                self.popen.kill()
        return self.popen.wait()


@dataclass
class ToolboxServer:
    """The example MCP server over streamable HTTP, with its events file."""

    process: ManagedProcess
    url: str
    events: JsonLines

    def server_spec(self) -> dict[str, str]:
        return {"url": self.url}


@dataclass
class Worker:
    """One ``python -m runbrake.worker`` process whose structlog JSON lines go to a file."""

    process: ManagedProcess
    log: JsonLines = field(init=False)

    def __post_init__(self) -> None:
        self.log = JsonLines(self.process.log_path)

    @property
    def pid(self) -> int:
        return self.process.pid

    def peak_rss_kib(self) -> int | None:
        """VmHWM (the peak resident set size) of the worker process, in KiB."""
        return _proc_status_kib(self.pid, "VmHWM")

    def rss_kib(self) -> int | None:
        return _proc_status_kib(self.pid, "VmRSS")

    def log_counts(self) -> dict[str, int]:
        """What the log says so far: error lines, messages Dramatiq retried, and lines holding two log
        entries (two writers without a shared lock; both entries are still read)."""
        self.log.read_new()
        entries = self.log.entries
        return {
            "errors": sum(1 for e in entries if e.get("level") in {"error", "critical"}),
            "messages_retried": sum(1 for e in entries if str(e.get("event", "")).startswith("Retrying message")),
            "glued_lines": self.log.glued_lines,
        }


def cpu_seconds(pid: int) -> float | None:
    """User plus system CPU time a process has used so far, in seconds (its threads included)."""
    return cpu_seconds_of(Path(f"/proc/{pid}/stat"))


def tree_cpu_seconds(pid: int) -> float | None:
    """CPU seconds used so far by a process and every descendant (a prefork pool's children, runbrake's
    worker processes), including the descendants that have exited and been waited for (cutime, cstime)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rpartition(")")[2].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    total, pending, seen = 0.0, [pid], False
    while pending:
        current = pending.pop()
        try:
            fields = Path(f"/proc/{current}/stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        seen = True
        # utime, stime, cutime, cstime: fields 14-17 of proc(5)
        total += sum(int(value) for value in fields[11:15]) / os.sysconf("SC_CLK_TCK")
        pending.extend(children.get(current, ()))
    return total if seen else None


def cpu_seconds_of(stat: Path) -> float | None:
    """utime + stime of a /proc/…/stat file, in seconds."""
    try:
        fields = stat.read_text().rpartition(")")[2].split()
    except OSError:
        return None
    # fields[0] is the state (field 3 of proc(5)); utime and stime are fields 14 and 15.
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def thread_cpu_seconds(pid: int) -> dict[int, float]:
    """CPU seconds used so far by each thread of a process, by thread id."""
    used = {}
    for task in Path(f"/proc/{pid}/task").glob("*"):
        seconds = cpu_seconds_of(task / "stat")
        if seconds is not None:
            used[int(task.name)] = seconds
    return used


def pids_named(command: str) -> list[int]:
    """The pids of running processes whose command name (``/proc/<pid>/comm``) is ``command``; read only."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "comm").read_text().strip() == command:
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


def background_load(seconds: float = 1.0) -> dict[str, float]:
    """How busy the machine is before the benchmark starts: busy share over ``seconds``, load averages."""
    busy_before, total_before = machine_busy_seconds()
    time.sleep(seconds)  # measuring an interval
    busy, total = machine_busy_seconds()
    load1, load5, _ = os.getloadavg()
    return {"busy_pct": round(100 * (busy - busy_before) / max(total - total_before, 1e-9), 1),
            "loadavg_1m": round(load1, 2), "loadavg_5m": round(load5, 2)}


def machine_busy_seconds() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot, summed over cores, from /proc/stat."""
    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = values[3] + values[4]  # idle + iowait
    total = sum(values[:8])  # user … steal; guest time is already inside user
    tick = os.sysconf("SC_CLK_TCK")
    return (total - idle) / tick, total / tick


def _proc_status_kib(pid: int, key: str) -> int | None:
    return _read_kib(f"/proc/{pid}/status", key)


def _read_kib(path: str, key: str) -> int | None:
    """A ``Key:   1234 kB`` line of a /proc file, in KiB."""
    try:
        text = Path(path).read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(f"{key}:"):
            return int(line.split()[1])
    return None


def free_port() -> int:
    """A loopback port nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


# -- the benchmark's frame -----------------------------------------------------------------------


class Bench:
    """A benchmark run: its own namespace, its processes, its cleanup."""

    def __init__(self, name: str, *, env: Mapping[str, str] | None = None, keep: bool = False) -> None:
        self.name = name
        self.namespace = f"bench-{secrets.token_hex(6)}"
        self.workdir = Path(tempfile.mkdtemp(prefix=f"runbrake-{name}-"))
        # The benchmarks run as production does: the spec names a server of the operator's catalog.
        self.catalog = self.workdir / "catalog.toml"
        self.catalog.write_text("", encoding="utf-8")
        self.env = {**os.environ, **(env or {}), "RUNBRAKE_NAMESPACE": self.namespace,
                    "RUNBRAKE_CATALOG": str(self.catalog)}
        self.env.pop("RUNBRAKE_ALLOW_INLINE", None)
        self.settings = Settings.from_env(self.env)
        self.store = RunStore.connect(self.settings)
        self.keep = keep
        self._processes: list[ManagedProcess] = []
        self._closers: list[Callable[[], object]] = []
        self._final_closers: list[Callable[[], object]] = []

    def __enter__(self) -> Bench:
        try:
            self.store.ping()
            _check_rabbitmq(self.settings)
        except BaseException:
            self.store.close()
            shutil.rmtree(self.workdir, ignore_errors=True)
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def on_close(self, closer: Callable[[], object], *, after_processes: bool = False) -> None:
        """Run ``closer`` when the benchmark ends: before the processes are stopped, or after them
        (``after_processes``: for deleting what a process still uses, such as a queue it consumes)."""
        (self._final_closers if after_processes else self._closers).append(closer)

    def close(self) -> None:
        """Stop what was started and delete what was written; every step runs even when one fails."""
        try:
            _run_closers(self._closers)
        finally:
            try:
                for process in reversed(self._processes):
                    process.stop()
                self._processes.clear()
            finally:
                try:
                    _run_closers(self._final_closers)
                    self.store.delete_namespace()
                finally:
                    self.store.close()
                    delete_broker_objects(self.settings)
                    if self.keep:
                        print(f"logs kept in {self.workdir}")
                    else:
                        shutil.rmtree(self.workdir, ignore_errors=True)

    # -- processes --

    def _spawn(self, command: list[str], log_path: Path,
               env: Mapping[str, str] | None = None) -> subprocess.Popen[bytes]:
        with log_path.open("ab") as log:
            return subprocess.Popen(
                command, cwd=REPO, env=dict(env or self.env), stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT,
            )

    def _start_server(self, name: str, command: Callable[[int], tuple[list[str], Mapping[str, str] | None]],
                      log_path: Path) -> tuple[ManagedProcess, int]:
        """Start ``command(port)`` (its arguments, and its environment or None for the bench's) on a free loopback
        port, until it listens there; the process and its port."""
        for _ in range(3):  # another process may take the free port between probe and bind
            port = free_port()
            arguments, env = command(port)
            process = ManagedProcess(name, self._spawn(arguments, log_path, env), log_path)
            self._processes.append(process)
            try:
                wait_until(lambda port=port: _listening(port), timeout=STARTUP_TIMEOUT_S,
                           what=f"the {name} on 127.0.0.1:{port}", interval=0.05, alive=[process])
            except BenchError:
                process.stop()
                self._processes.remove(process)
                continue
            return process, port
        raise BenchError(f"the {name} did not start; see {log_path}")

    def start_toolbox(self, *arguments: str) -> ToolboxServer:
        """The example toolbox server over HTTP on a free loopback port, writing an events file; ``arguments``
        are more of its options (``--progress-s 10``)."""
        events = self.workdir / "toolbox-events.jsonl"
        process, port = self._start_server(
            "toolbox server",
            lambda port: ([sys.executable, *TOOLBOX_SERVER, "--transport", "http", "--host", "127.0.0.1",
                           "--port", str(port), "--events", str(events), *arguments], None),
            self.workdir / "toolbox.log")
        url = f"http://127.0.0.1:{port}/mcp"
        self.use_server(url)
        return ToolboxServer(process, url, JsonLines(events))

    def use_server(self, url: str, name: str = SERVER_NAME) -> None:
        """Name the MCP server at ``url`` in the catalog as ``name`` (``toolbox``: what the specs here call)."""
        self.catalog.write_text(f"[mcp_servers.{name}]\nurl = {json.dumps(url)}\n", encoding="utf-8")

    def start_everything(self, name: str) -> ManagedProcess:
        """The npm ``@modelcontextprotocol/server-everything`` (a server nobody here wrote) over streamable HTTP
        on a free loopback port, named ``name`` in the catalog; installed once into ``.venv/node``."""
        entry = npm_package(EVERYTHING) / "dist" / "index.js"
        process, port = self._start_server(
            "everything server", lambda port: (["node", str(entry), "streamableHttp"], {**self.env, "PORT": str(port)}),
            self.workdir / "everything.log")
        self.use_server(f"http://127.0.0.1:{port}/mcp", name)
        return process

    def start_tasks_extension(self, name: str, *, concurrency: int = 10) -> ManagedProcess:
        """tests/tasks_extension_server.py (the 2026-07-28 MCP tasks extension on PyPI ``fastmcp-tasks``, in a venv of
        its own: :func:`python_package`) over streamable HTTP on a free loopback port, named ``name``; it runs at
        most ``concurrency`` tasks at once (its Docket worker's, ``FASTMCP_DOCKET_CONCURRENCY``)."""
        python, script = python_package(TASKS_SERVER), REPO / "tests" / "tasks_extension_server.py"
        env = {**self.env, "FASTMCP_DOCKET_CONCURRENCY": str(concurrency)}
        process, port = self._start_server(
            "tasks extension server", lambda port: ([str(python), str(script), str(port)], env),
            self.workdir / "tasks-extension.log")
        self.use_server(f"http://127.0.0.1:{port}/mcp", name)
        return process

    def admission(self) -> Admission:
        """What a producer checks specs against: this benchmark's catalog and settings."""
        return Admission.from_settings(self.settings)

    def producer_and_publisher(self) -> tuple[Producer, CancelPublisher]:
        """A producer (its broker closed at the end) and a cancel publisher already connected, its exchange
        declared (a wake-up for no run): the first measured cancel or steer pays for neither."""
        broker = build_broker(self.settings)
        self.on_close(broker.close)
        publisher = CancelPublisher(self.settings)
        self.on_close(publisher.close)
        publisher.publish("bench-warm-up")
        return Producer(self.store, broker, self.admission()), publisher

    def start_worker(self, *, concurrency: int, noop: bool = False) -> Worker:
        """``python -m runbrake.worker --concurrency N [--noop]`` here; returns once it logged worker_started."""
        arguments = ["-m", "runbrake.worker", "--concurrency", str(concurrency)]
        if noop:
            arguments.append("--noop")
        return self.start_logging_process("worker", arguments)

    def start_logging_process(self, name: str, arguments: Sequence[str], *,
                              timeout: float = STARTUP_TIMEOUT_S) -> Worker:
        """``python ARGUMENTS`` in this namespace, its output (JSON lines) to a file of its own; returns once
        it logged a ``worker_started`` line (a runbrake worker, or another worker that says the same) within
        ``timeout`` seconds."""
        log_path = self.workdir / f"{name.replace(' ', '-')}-{len(self._processes)}.log"
        popen = self._spawn([sys.executable, *arguments], log_path)
        process = ManagedProcess(name, popen, log_path)
        self._processes.append(process)
        worker = Worker(process)
        wait_until(lambda: any(e.get("event") == "worker_started" for e in worker.log.read_new()),
                   timeout=timeout, what=f"the {name}'s worker_started line", interval=0.05,
                   alive=[process])
        return worker

    # -- results --

    def write_results(self, results: Mapping[str, Any]) -> Path:
        RESULTS_DIR.mkdir(parents=True, exist_ok=True)
        path = RESULTS_DIR / f"{self.name}.json"
        path.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
        return path


NODE_PREFIX = REPO / ".venv" / "node"
EVERYTHING = "@modelcontextprotocol/server-everything"


def npm_package(name: str) -> Path:
    """The folder of the npm package ``name``, installed once into ``.venv/node``."""
    folder = NODE_PREFIX / "node_modules" / name
    if not folder.is_dir():
        npm = shutil.which("npm")
        if npm is None or shutil.which("node") is None:
            raise BenchError(f"node and npm are needed for {name}: install Debian's nodejs and npm")
        NODE_PREFIX.mkdir(parents=True, exist_ok=True)
        installed = subprocess.run([npm, "install", "--no-audit", "--no-fund", "--silent", "--prefix",
                                    str(NODE_PREFIX), name], capture_output=True, text=True, timeout=600, check=False)
        if installed.returncode != 0:
            raise BenchError(f"npm could not install {name}: {installed.stderr.strip()[-500:]}")
    return folder


TASKS_SERVER = "fastmcp-tasks==4.1.4"
"""A server side of the 2026-07-28 MCP tasks extension nobody here wrote (PyPI ``fastmcp-tasks``, on FastMCP and
the same ``mcp`` SDK): tests/tasks_extension_server.py is served with it."""


def python_package(requirement: str) -> Path:
    """The Python of a venv of its own (``.venv/<name>``) that has ``requirement``, installed once: for a package
    whose pins cannot share the project's venv (``fastmcp-tasks`` excludes the project's ``redis``). Built beside
    and renamed into place, so that two test processes installing at once leave one whole venv."""
    name = requirement.split("==", maxsplit=1)[0]
    home = REPO / ".venv" / name
    if not home.is_dir():
        building = home.with_name(f"{name}.building-{os.getpid()}")
        steps = ([sys.executable, "-m", "venv", str(building)],
                 [str(building / "bin" / "python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                  requirement])
        try:
            for step in steps:
                done = subprocess.run(step, capture_output=True, text=True, timeout=600, check=False)
                if done.returncode != 0:
                    raise BenchError(f"could not install {requirement}: {done.stderr.strip()[-500:]}")
            building.rename(home)
        except OSError:
            if not home.is_dir():
                raise
        finally:
            shutil.rmtree(building, ignore_errors=True)
    return home / "bin" / "python"


def _check_rabbitmq(settings: Settings) -> None:
    try:
        pika.BlockingConnection(pika.URLParameters(settings.rabbitmq_url)).close()
    except pika.exceptions.AMQPError as exc:
        raise BenchError(f"RabbitMQ at {settings.rabbitmq_url} is not reachable: {exc!r}") from exc


def _run_closers(closers: list[Callable[[], object]]) -> None:
    """Call each closer, newest first, reporting (not raising) failures; the list is emptied."""
    for closer in reversed(closers):
        try:
            closer()
        except Exception as exc:
            print(f"cleanup step failed: {type(exc).__name__}: {exc}", file=sys.stderr)
    closers.clear()


def delete_broker_objects(settings: Settings) -> None:
    """Delete the namespace's queues (with Dramatiq's .DQ/.XQ twins) and its cancel exchange."""
    delete_topology(settings)


# -- runs ----------------------------------------------------------------------------------------


def quick_run_arguments(index: int, *, echo_argument: str = "text") -> tuple[dict[str, Any], dict[str, Any]]:
    """The arguments of a quick run's two tool calls: get-sum's, then echo's (whose text parameter is
    ``echo_argument``: ``text`` on the toolbox server, ``message`` on the npm reference server)."""
    return {"a": index, "b": 1}, {echo_argument: f"run {index}"}


def quick_run_spec(server: ToolboxServer | str, index: int, *, echo_argument: str = "text") -> RunSpec:
    """Three rounds with two quick MCP tool calls: get-sum, then echo, then the final answer.

    ``server`` is the toolbox server, or the URL of another MCP server (streamable HTTP) with those tools;
    either way the spec names the catalog's ``toolbox`` (:meth:`Bench.use_server`)."""
    get_sum, echo = quick_run_arguments(index, echo_argument=echo_argument)
    return RunSpec.parse({
        "input": f"quick run {index}",
        "model": {"provider": "scripted", "turns": [
            {"tool_calls": [{"server": SERVER_NAME, "tool": "get-sum", "arguments": get_sum}]},
            {"tool_calls": [{"server": SERVER_NAME, "tool": "echo", "arguments": echo}]},
            {"content": "done"},
        ]},
        "mcp_servers": [SERVER_NAME],
    })


def slow_run_spec(seconds: float, *, server: str = SERVER_NAME, input_text: str = "slow run") -> RunSpec:
    """A run whose first turn calls ``slow(seconds)`` on the catalog's ``server``; the benchmarks cancel it
    (or stop its worker) long before a second turn."""
    return RunSpec.parse({
        "input": input_text,
        "model": {"provider": "scripted", "turns": [
            {"tool_calls": [{"server": server, "tool": "slow", "arguments": {"seconds": seconds}}]},
            {"content": "not reached"},
        ]},
        "mcp_servers": [server],
        "tool_timeout_s": max(120.0, seconds + 60.0),
    })


def in_threads(count: int, total: int, work: Callable[[int], None]) -> None:
    """Call ``work(i)`` for i in range(total), spread over ``count`` threads (each its own broker connection:
    Dramatiq's RabbitMQ broker keeps one per thread). Re-raises the first failure."""
    errors: list[BaseException] = []

    def part(start: int) -> None:
        try:
            for i in range(start, total, count):
                work(i)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=part, args=(k,), name=f"producer-{k}") for k in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


def all_terminal(store: RunStore, run_ids: Sequence[str]) -> Callable[[], bool]:
    """A condition for :func:`wait_until`: true once every one of the runs is in a terminal status.

    Runs finish roughly in the order they were sent: each check reads the oldest pending ones first, a
    chunk at a time (one pipelined round trip per chunk), and stops at the first chunk that still has a
    live run, which keeps the poller cheap."""
    pending = list(run_ids)

    def check() -> bool:
        nonlocal pending
        while pending:
            chunk = pending[:16]
            with store.redis.pipeline(transaction=False) as pipe:
                for run_id in chunk:
                    pipe.hget(store.run_key(run_id), "status")
                statuses = pipe.execute()
            live = [r for r, s in zip(chunk, statuses, strict=True) if not RunStatus.parse(s).is_terminal]
            pending = live + pending[len(chunk):]
            if live:
                return False
        return True

    return check


# -- numbers -------------------------------------------------------------------------------------


def percentile(sorted_values: Sequence[float], p: float) -> float:
    """The nearest-rank percentile of already sorted values."""
    if not sorted_values:
        return math.nan
    rank = max(1, math.ceil(p / 100 * len(sorted_values)))
    return sorted_values[rank - 1]


def summary_ms(values_s: Iterable[float]) -> dict[str, float | int]:
    """n, p50, p95, p99, max and mean of durations given in seconds, in milliseconds."""
    values = sorted(v * 1000 for v in values_s)
    if not values:
        return {"n": 0}
    return {
        "n": len(values),
        "p50": round(percentile(values, 50), 2),
        "p95": round(percentile(values, 95), 2),
        "p99": round(percentile(values, 99), 2),
        "max": round(values[-1], 2),
        "mean": round(sum(values) / len(values), 2),
    }


def machine() -> dict[str, Any]:
    """Where and when the numbers were taken."""
    mem_total = _read_kib("/proc/meminfo", "MemTotal")
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, check=False
    ).stdout.strip()
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True, text=True,
        check=False,
    ).stdout.strip()
    return {
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "nproc": os.cpu_count(),
        "mem_total_gib": round(mem_total / 1024 / 1024, 1) if mem_total else None,
        "machine": platform.machine(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "git_commit": commit + ("-dirty" if dirty else ""),
        "background": background_load(),
    }


def print_machine(info: Mapping[str, Any]) -> None:
    print(f"machine: {info['nproc']} cores, {info['mem_total_gib']} GiB, {info['machine']}, "
          f"Linux {info['kernel']}, Python {info['python']}; commit {info['git_commit']}; {info['date_utc']}")
    load = info.get("background")
    if load:
        print(f"background load before start: {load['busy_pct']} % busy over 1 s, "
              f"load average {load['loadavg_1m']} (1 min)")
